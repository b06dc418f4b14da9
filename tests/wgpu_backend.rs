//! The GPU-style code path, run: Burn's wgpu backend (the CubeCL kernels the GPU
//! backends share) on the demo model, against the CPU backend. On a machine without a
//! GPU it runs on Mesa's software Vulkan driver (Debian `mesa-vulkan-drivers`), slowly,
//! so the checks are few and short. Only with the `wgpu` feature.
#![cfg(feature = "wgpu")]

use burn::backend::{Flex, Wgpu};
use llama_burn::LlamaError;
use llama_burn::backend::LlamaBackend;
use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
use llama_burn::llama::{Llama, LlamaConfig};
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::{DynTokenizer, Tokenizer};

const PROMPTS: [&str; 3] = ["The capital of France is", "Hi", "def fibonacci(n):"];
const TOKENS: usize = 6;

fn demo<B: LlamaBackend>(device: &B::Device) -> Llama<B, DynTokenizer> {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    // Exact: the CPU backend's f32 arithmetic, which the wgpu backend's f32 matmul matches.
    LlamaConfig::load_gguf::<B>(path, 128, device)
        .expect("demo model loads")
        .with_precision(llama_burn::Precision::Exact)
}

fn greedy<B: LlamaBackend>(llama: &mut Llama<B, DynTokenizer>, prompt: &str) -> Vec<u32> {
    llama
        .generate(prompt, TOKENS, 0.0, &mut Sampler::Argmax)
        .expect("generate")
        .tokens
}

#[test]
fn wgpu_gives_the_cpu_backend_tokens_and_logits() {
    let mut cpu = demo::<Flex>(&Default::default());
    let mut gpu = demo::<Wgpu>(&Default::default());

    // Greedy tokens, prompt by prompt.
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|p| greedy(&mut cpu, p)).collect();
    for (prompt, want) in PROMPTS.iter().zip(&want) {
        assert_eq!(&greedy(&mut gpu, prompt), want, "{prompt:?}");
    }

    // Logits of a prompt within 1e-3.
    let ids = cpu.encode_prompt(PROMPTS[0]).expect("encode");
    let (a, b) = (
        cpu.logits(&ids).expect("cpu"),
        gpu.logits(&ids).expect("gpu"),
    );
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("wgpu vs cpu: max |logit diff| {diff:e}");
    assert!(diff <= 1e-3, "{diff}");

    // A left-padded batch of rows of different lengths equals the rows alone.
    let batch = llama_burn::inference::generate_batch(&mut gpu, &PROMPTS, TOKENS, 0.0, 1.0, 0)
        .expect("batch");
    for (row, want) in batch.iter().zip(&want) {
        let text: String = row.concat();
        assert_eq!(text, gpu.tokenizer.decode(want).expect("decode"));
    }

    // The continuous engine: two requests and a cancellation.
    let engine = ContinuousEngine::start(gpu, ContinuousConfig::default()).expect("engine");
    let cancelled = engine
        .submit(GenerateRequest::new(PROMPTS[2]).with_max_tokens(100))
        .expect("submit");
    cancelled.cancel();
    let jobs: Vec<_> = PROMPTS[..2]
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest::new(*p).with_max_tokens(TOKENS))
                .expect("submit")
        })
        .collect();
    for (job, want) in jobs.into_iter().zip(&want) {
        let (tokens, _) = job.collect().expect("engine request");
        let ids: Vec<u32> = tokens.iter().map(|t| t.token_id).collect();
        assert_eq!(&ids, want);
    }
    assert!(matches!(cancelled.collect(), Err(LlamaError::Cancelled)));
    let m = engine.metrics();
    assert_eq!((m.cancelled, m.completed, m.kv_blocks_used), (1, 2, 0));
}
