//! The GPU code path, run: our CubeCL kernels and the whole model on a GPU backend, against
//! the CPU backend. With the `cuda` feature it runs on an NVIDIA GPU (`Cuda`); else, with
//! `wgpu`, on Burn's wgpu backend, which on a machine without a GPU runs on Mesa's software
//! Vulkan driver (Debian `mesa-vulkan-drivers`), slowly, so the checks are few and short.
//!
//! Burn 0.21 fixes a device's float type at its first tensor. On wgpu the half-precision
//! model takes Mesa's driver under its other name, a device of its own, so every test runs
//! in one process. A CUDA machine's GPU is one device, so there the half-precision models
//! are ignored tests, each run in a process of its own:
//! `cargo test --release --features llama3,cuda --test gpu_backend -- --ignored --exact the_demo_model_in_bf16`
//! (and `the_demo_model_in_f16`).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::backend::Flex;
use llama_burn::LlamaError;
use llama_burn::backend::LlamaBackend;
use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
use llama_burn::llama::Llama;
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::{DynTokenizer, Tokenizer};

/// The GPU backend under test, in f32.
#[cfg(feature = "cuda")]
type Gpu = burn::backend::Cuda;
/// The GPU backend under test, in f32.
#[cfg(not(feature = "cuda"))]
type Gpu = burn::backend::Wgpu;

const PROMPTS: [&str; 3] = ["The capital of France is", "Hi", "def fibonacci(n):"];
const TOKENS: usize = 6;

fn demo<B: LlamaBackend>(device: &B::Device) -> Llama<B, DynTokenizer> {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    // Exact: the CPU backend's f32 arithmetic, which the wgpu backend's f32 matmul matches.
    // No warm-up at load: its forward passes (a 280-token prompt chunk among them) are
    // two and a half minutes a model on Mesa's software driver, and every kernel they
    // would compile is compiled by the checks below anyway.
    llama_burn::Loader::gguf(path)
        .max_seq_len(128)
        .warm_up(false)
        .load::<B>(device)
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
fn the_gpu_gives_the_cpu_backend_tokens_and_logits() {
    let mut cpu = demo::<Flex>(&Default::default());
    let mut gpu = demo::<Gpu>(&Default::default());

    // Greedy tokens, prompt by prompt.
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|p| greedy(&mut cpu, p)).collect();
    for (prompt, want) in PROMPTS.iter().zip(&want) {
        assert_eq!(&greedy(&mut gpu, prompt), want, "{prompt:?}");
    }

    // The engine's path (paged cache, our kernels alone): last logits within 1e-3.
    let ids = cpu.encode_prompt(PROMPTS[0]).expect("encode");
    let cpu_logits = cpu.logits(&ids).expect("cpu");
    let (paged, _) = paged_last_logits(&gpu, &ids, &Default::default());
    let diff = max_diff(cpu_logits.last().expect("a row"), &paged);
    eprintln!("gpu vs cpu, engine path: max |logit diff| {diff:e}");
    assert!(diff <= 1e-3, "{diff}");

    // The engine's path over a KV cache encoded on the device (our store and attention
    // kernels for the encoded types) against the CPU backend's over its host-encoded
    // cache. The kernels give the host's bytes and attention exactly (the kernel test
    // below), but the two backends' keys differ in their last bits (the f32 bound
    // above), so a value near a rounding boundary of the type may round the other way:
    // on the demo model the two differ by a fifth to a half of the type's own change
    // from f32 (q8_0: 0.11 of 0.20; f16: 0.004 of 0.012). A store or a read of the wrong
    // rows would differ by far more than the type's own change.
    {
        use llama_burn::cache::{KvCacheType, KvCacheTypes};
        for types in [
            KvCacheTypes::both(KvCacheType::Q8_0),
            KvCacheTypes::new(KvCacheType::Q4_0, KvCacheType::F16),
            KvCacheTypes::new(KvCacheType::Bf16, KvCacheType::Q4_0),
            KvCacheTypes::both(KvCacheType::F16),
            KvCacheTypes::new(KvCacheType::Bf16, KvCacheType::F16),
        ] {
            let (on_gpu, _) = paged_last_logits_in(&gpu, &ids, &Default::default(), types);
            let (on_cpu, _) = paged_last_logits_in(&cpu, &ids, &Default::default(), types);
            let diff = max_diff(&on_cpu, &on_gpu);
            let from_f32 = max_diff(&on_cpu, cpu_logits.last().expect("a row"));
            eprintln!(
                "gpu vs cpu, engine path, KV cache {types}: max |logit diff| {diff:e} \
                 (the type's own change from f32 on the CPU: {from_f32:e})"
            );
            assert!(diff < from_f32, "{types}: {diff} against {from_f32}");
        }
    }

    // The contiguous cache's path, every position: our paged attention kernel over the
    // cache seen as one block per row (it was Burn's attention, TF32 on CUDA), so the
    // engine's bound holds.
    let got = gpu.logits(&ids).expect("gpu");
    let diff = cpu_logits
        .iter()
        .zip(&got)
        .map(|(a, b)| max_diff(a, b))
        .fold(0f32, f32::max);
    eprintln!("gpu vs cpu, contiguous path: max |logit diff| {diff:e}");
    assert!(diff <= 1e-3, "{diff}");
    // The same kernels as the engine's: the prompt's last logits, bit for bit.
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(got.last().expect("a row")),
        bits(&paged),
        "the contiguous path's last logits differ from the engine path's"
    );

    // A left-padded batch (prompts of different lengths) through our attention kernel,
    // its padding skipped: each row's logits, the prompt's last and a decode step's,
    // bit for bit those of the row alone (Burn's masked attention gave other bits).
    {
        use llama_burn::model::Logits;
        let rows: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| gpu.encode_prompt(p).expect("encode"))
            .collect();
        let width = rows.iter().map(Vec::len).max().expect("rows");
        let starts: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
        let padded: Vec<u32> = rows
            .iter()
            .flat_map(|r| std::iter::repeat_n(0, width - r.len()).chain(r.iter().copied()))
            .collect();
        let model = &gpu.model;
        let mut cache = model.new_cache(starts, width + 2);
        let last =
            |t: burn::tensor::Tensor<Gpu, 3>| bits(&t.into_data().into_vec::<f32>().expect("f32"));
        let prompt = last(
            model
                .forward(&padded, &mut cache, Logits::Last)
                .expect("batch"),
        );
        let next: Vec<u32> = (0..rows.len() as u32).map(|r| 7 + r).collect();
        let step = last(
            model
                .forward(&next, &mut cache, Logits::Last)
                .expect("step"),
        );
        let vocab = prompt.len() / rows.len();
        for (r, ids) in rows.iter().enumerate() {
            let mut alone = model.new_cache(vec![0], ids.len() + 2);
            let want = last(model.forward(ids, &mut alone, Logits::Last).expect("alone"));
            assert_eq!(
                prompt[r * vocab..(r + 1) * vocab],
                want,
                "row {r}'s prompt logits"
            );
            let want = last(
                model
                    .forward(&next[r..=r], &mut alone, Logits::Last)
                    .expect("step"),
            );
            assert_eq!(
                step[r * vocab..(r + 1) * vocab],
                want,
                "row {r}'s decode logits"
            );
        }
    }

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

    // Sampling on the device (the OpenAI default, temperature 1; the cuts; a greedy row
    // in the same steps) draws the tokens the CPU backend's engine draws on the host
    // from the same seeds, and log-probabilities within the logits' difference.
    let on_gpu = run_sampled(&engine);
    let cpu_engine = ContinuousEngine::start(cpu, ContinuousConfig::default()).expect("engine");
    let on_cpu = run_sampled(&cpu_engine);
    for (gpu_row, cpu_row) in on_gpu.iter().zip(&on_cpu) {
        let ids = |row: &[(u32, Option<f32>)]| row.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(gpu_row), ids(cpu_row));
        for (g, c) in gpu_row.iter().zip(cpu_row) {
            assert_eq!(g.1.is_some(), c.1.is_some());
            if let (Some(g), Some(c)) = (g.1, c.1) {
                assert!(
                    (g - c).abs() <= 2e-3,
                    "logprob {g} on the GPU, {c} on the CPU"
                );
            }
        }
    }
    eprintln!("device sampling: {on_gpu:?}");
}

/// The whole demo model in the `fast` precision on the device gives the CPU backend's
/// `fast` logits bit for bit, at every position of every prompt, on the contiguous path
/// (`Llama::logits`, what `generate` runs) and on the engine's paged path, over an f32
/// KV cache and over caches encoded on the device; and so the CPU's greedy tokens. The
/// products are the CPU's integer arithmetic (the test above) and every kernel around
/// them (RMSNorm, RoPE, attention, SwiGLU) takes the CPU's steps in the CPU's order with
/// its roundings. The CPU's attention rounds each product of its dot products on the
/// portable path (no AVX2 or NEON), where the bits are not the device's: skipped there.
#[test]
fn the_fast_precision_gives_the_cpu_backends_fast_bits() {
    use llama_burn::cache::{KvCacheType, KvCacheTypes};
    use llama_burn::kernels::SimdPath;
    if SimdPath::active() == SimdPath::Portable {
        eprintln!("skipped: the CPU runs its portable path, whose attention is not fused");
        return;
    }
    let fast = llama_burn::Precision::Fast;
    let mut cpu = demo::<Flex>(&Default::default()).with_precision(fast);
    let mut gpu = demo::<Gpu>(&Default::default()).with_precision(fast);
    let bits = |rows: &[Vec<f32>]| -> Vec<Vec<u32>> {
        rows.iter()
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    for prompt in PROMPTS {
        let want = greedy(&mut cpu, prompt);
        assert_eq!(greedy(&mut gpu, prompt), want, "{prompt:?}: greedy tokens");
        let mut ids = cpu.encode_prompt(prompt).expect("encode");
        ids.extend_from_slice(&want);
        let on_cpu = cpu.logits(&ids).expect("cpu");
        let on_gpu = gpu.logits(&ids).expect("gpu");
        assert_eq!(on_cpu.len(), ids.len());
        for (position, (c, g)) in bits(&on_cpu).iter().zip(&bits(&on_gpu)).enumerate() {
            let first = c.iter().zip(g).position(|(a, b)| a != b);
            assert_eq!(
                first, None,
                "{prompt:?}: position {position}'s logits differ first at token {first:?}"
            );
        }
        for types in [
            KvCacheTypes::default(),
            KvCacheTypes::both(KvCacheType::Q8_0),
            KvCacheTypes::new(KvCacheType::Q4_0, KvCacheType::F16),
            KvCacheTypes::new(KvCacheType::Bf16, KvCacheType::Q4_0),
        ] {
            let (c, _) = paged_last_logits_in(&cpu, &ids, &Default::default(), types);
            let (g, _) = paged_last_logits_in(&gpu, &ids, &Default::default(), types);
            assert_eq!(
                bits(&[g]),
                bits(&[c]),
                "{prompt:?}: the engine path's last logits over a {types} cache"
            );
        }
        eprintln!(
            "{prompt:?}: {} tokens' logits and {} greedy tokens bitwise the CPU's",
            ids.len(),
            want.len()
        );
    }
}

/// The largest absolute difference between two equally long slices.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The last position's logits of `ids` on the engine's path (`forward_paged` over a paged
/// KV cache, our kernels), read back as f32, and their type on the device.
fn paged_last_logits<B: LlamaBackend>(
    llama: &Llama<B, DynTokenizer>,
    ids: &[u32],
    device: &B::Device,
) -> (Vec<f32>, burn::tensor::DType) {
    let types = llama_burn::cache::KvCacheTypes::default();
    paged_last_logits_in(llama, ids, device, types)
}

/// [`paged_last_logits`] with the KV cache stored in `types`.
fn paged_last_logits_in<B: LlamaBackend>(
    llama: &Llama<B, DynTokenizer>,
    ids: &[u32],
    device: &B::Device,
    types: llama_burn::cache::KvCacheTypes,
) -> (Vec<f32>, burn::tensor::DType) {
    use llama_burn::cache::PagedKvCache;
    use llama_burn::model::PagedRow;
    let c = llama.config().clone();
    let mut cache =
        PagedKvCache::<B>::with_types(c.n_layers, 2, 16, c.n_kv_heads, c.head_dim, types, device)
            .expect("pool");
    let row = PagedRow {
        tokens: ids,
        start: 0,
        blocks: &[1, 0],
        logits: true,
        all_logits: false,
        adapter: None,
    };
    let logits = llama
        .model
        .forward_paged(&[row], &mut cache)
        .expect("forward");
    let dtype = logits.dtype();
    let values = logits
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32");
    (values, dtype)
}

/// Sampled requests (the OpenAI default, temperature 1; the cuts; a greedy one in the
/// same steps) through `engine`: per request its tokens and chosen log-probabilities.
fn run_sampled<B: LlamaBackend>(engine: &ContinuousEngine<B>) -> Vec<Vec<(u32, Option<f32>)>> {
    let base = |p: &str, seed| {
        GenerateRequest::new(p)
            .with_max_tokens(TOKENS)
            .with_seed(seed)
    };
    let requests = vec![
        base(PROMPTS[0], 7).with_temperature(1.0).with_logprobs(0),
        base(PROMPTS[1], 8)
            .with_temperature(0.8)
            .with_top_k(20)
            .with_top_p(0.9)
            .with_min_p(0.05),
        base(PROMPTS[2], 9).with_temperature(1.0),
        base(PROMPTS[0], 10).with_logprobs(0),
    ];
    let jobs: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(r).expect("submit"))
        .collect();
    jobs.into_iter()
        .map(|job| {
            let (tokens, _) = job.collect().expect("sampled request");
            tokens
                .iter()
                .map(|t| (t.token_id, t.logprobs.as_ref().map(|l| l.chosen.logprob)))
                .collect()
        })
        .collect()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// Our paged attention kernel against the CPU's over odd shapes: the CPU's bits (it
/// takes the CPU's steps in its order), each sequence alone bitwise its rows of the batch.
/// Heads of 16 values (tiles of 16 keys, one of the 16 partial sums per unit), 24 (tiles
/// that start in the middle of the sums' cycle) and 12 (a dot product not in 8 sums, and
/// fewer units than sums). On the CPU's portable path (no AVX2 or NEON) its dot products
/// round each product, so there the check is 1e-5.
#[test]
fn paged_attention_kernel_gives_the_cpu_reference() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::kernels::SimdPath;
    use llama_burn::kernels::attention::{PagedPool, PagedSeq, paged_attention};
    use llama_burn::model::attention::PagedBatch;

    // Odd shapes: blocks of 5 positions, 4 (or 8) query heads over 2 key/value heads; block
    // tables with holes (blocks no sequence uses) and a prefix block (7) shared by two
    // sequences; lengths not multiples of the block size, decode rows, prompt chunks over
    // cached keys and a fresh prompt.
    let (n_heads, kv_heads, block_size, blocks) = (4, 2, 5, 24);
    let tables: [&[u32]; 5] = [
        &[7, 2, 9],
        &[7, 3],
        &[11],
        &[20, 19, 18, 17, 16, 15, 14, 13, 12, 10],
        &[4],
    ];
    // (tokens, start) per sequence.
    let shapes = [(1, 13), (4, 6), (3, 0), (2, 46), (1, 0)];
    let seqs: Vec<PagedSeq> = shapes
        .iter()
        .zip(tables)
        .map(|(&(tokens, start), blocks)| PagedSeq {
            tokens,
            start,
            blocks,
        })
        .collect();
    let device = Default::default();
    // 128: tiles of fewer keys than `dim` (the kernel stages 4,096 floats a tile). Then
    // groups of four query heads (the 1B shape's), which a workgroup takes together.
    let configs = [(4, 16), (4, 24), (4, 12), (4, 128), (8, 64), (8, 128)];
    for (n_heads, dim) in configs {
        let pool_len = blocks * kv_heads * block_size * dim;
        let (keys, vals) = (values(pool_len, 1), values(pool_len, 2));
        let tokens: usize = shapes.iter().map(|s| s.0).sum();
        let q = values(tokens * n_heads * dim, 3);
        let pool = PagedPool {
            keys: &keys,
            values: &vals,
            heads: kv_heads,
            block_size,
            dim,
        };
        let want = paged_attention(&q, n_heads, pool, &seqs).expect("cpu reference");

        let pool_dims = [blocks, kv_heads, block_size, dim];
        let k = Tensor::<Gpu, 4>::from_data(TensorData::new(keys.clone(), pool_dims), &device);
        let v = Tensor::<Gpu, 4>::from_data(TensorData::new(vals.clone(), pool_dims), &device);
        let run = |q: &[f32], seqs: Vec<PagedSeq>| -> Vec<f32> {
            let rows: usize = seqs.iter().map(|s| s.tokens).sum();
            let batch =
                PagedBatch::<Gpu>::new(seqs, n_heads, block_size, blocks, &device).expect("batch");
            let q = Tensor::<Gpu, 2>::from_data(
                TensorData::new(q.to_vec(), [rows, n_heads * dim]),
                &device,
            );
            Gpu::paged_attention(q, &k, &v, &batch)
                .expect("wgpu paged attention")
                .into_data()
                .into_vec::<f32>()
                .expect("f32")
        };
        let got = run(&q, seqs.clone());
        assert_eq!(got.len(), want.len());
        let diff = max_diff(&want, &got);
        eprintln!("paged attention kernel vs cpu, {n_heads} heads of {dim}: max |diff| {diff:e}");
        if SimdPath::active() == SimdPath::Portable {
            assert!(diff <= 1e-5, "{dim}: {diff}");
        } else {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let first = bits(&want)
                .iter()
                .zip(bits(&got))
                .position(|(a, b)| *a != b);
            assert_eq!(
                first, None,
                "{n_heads} heads of {dim}: the first value unlike the CPU's"
            );
        }

        // Batch invariance: each sequence alone gives its rows of the batch, bitwise.
        let width = n_heads * dim;
        let mut first = 0;
        for seq in &seqs {
            let rows = first..first + seq.tokens;
            let alone = run(&q[rows.start * width..rows.end * width], vec![*seq]);
            assert_eq!(alone, got[rows.start * width..rows.end * width]);
            first = rows.end;
        }
    }

    // A block outside the pool is an error, not a read out of bounds.
    let outside = [PagedSeq {
        tokens: 1,
        start: 0,
        blocks: &[blocks as u32],
    }];
    assert!(matches!(
        PagedBatch::<Gpu>::new(outside.to_vec(), n_heads, block_size, blocks, &device),
        Err(llama_burn::LlamaError::InvalidBatch(m)) if m.contains("cannot hold")
    ));
}

#[test]
fn quantized_matmul_kernels_give_the_cpu_reference() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    // Every kept format, all through the fused kernel. An odd number of outputs and of
    // blocks per row; one row (a unit per row), 5 rows (tiles of 4, the last one partial)
    // and 19 (tiles of 8, the last one partial).
    let multiply = |x: &[f32], rows: usize, w: &QuantMatrix| -> Vec<f32> {
        let xt =
            Tensor::<Gpu, 2>::from_data(TensorData::new(x.to_vec(), [rows, w.cols()]), &device);
        Gpu::quantized_matmul(xt, w, Precision::Exact)
            .expect("wgpu quantized matmul")
            .into_data()
            .into_vec::<f32>()
            .expect("f32")
    };
    // Rows of 3 blocks (2 lanes share an output) and of 37 (8 lanes, some with a block
    // more than others).
    for (format, blocks) in QuantFormat::ALL.into_iter().flat_map(|f| [(f, 3), (f, 37)]) {
        let (n_out, cols) = (37, blocks * format.block_values());
        let w =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4)).expect("quantize");
        let dense = w.dequantize().expect("dequantize");
        for rows in [1, 5, 19] {
            let x = values(rows * cols, 5 + rows as u64);
            let want: Vec<f32> = (0..rows * n_out)
                .map(|i| {
                    let (r, o) = (i / n_out, i % n_out);
                    (0..cols)
                        .map(|c| f64::from(x[r * cols + c]) * f64::from(dense[o * cols + c]))
                        .sum::<f64>() as f32
                })
                .collect();
            let got = multiply(&x, rows, &w);
            let diff = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            assert_eq!(got.len(), want.len());
            assert!(
                diff <= 1e-4 * scale,
                "{format:?}, {rows} rows: {diff} ({scale})"
            );
            // Batch invariance: each row alone gives the same bits as in its tile.
            if rows > 1 {
                for r in [0, rows / 2, rows - 1] {
                    let alone = multiply(&x[r * cols..(r + 1) * cols], 1, &w);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&alone),
                        bits(&got[r * n_out..(r + 1) * n_out]),
                        "{format:?}: row {r} of {rows} differs from the row alone"
                    );
                }
            }
            // Gate, up and SwiGLU in one launch: `silu(x W^T) * (x U^T)` from the same
            // sums as the products alone (the gate's are `got`'s bits), in f32, and
            // each row alone the same bits as in the batch.
            let up = QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 6))
                .expect("quantize");
            let fused = |x: &[f32], rows: usize| -> Vec<f32> {
                let xt =
                    Tensor::<Gpu, 2>::from_data(TensorData::new(x.to_vec(), [rows, cols]), &device);
                Gpu::quantized_swiglu(xt, &w, &up, Precision::Exact)
                    .expect("wgpu quantized swiglu")
                    .expect("one format and shape: fused")
                    .into_data()
                    .into_vec::<f32>()
                    .expect("f32")
            };
            let ups = multiply(&x, rows, &up);
            let gated = fused(&x, rows);
            for ((g, u), f) in got.iter().zip(&ups).zip(&gated) {
                let want = f64::from(*g) / (1.0 + (-f64::from(*g)).exp()) * f64::from(*u);
                assert!(
                    (f64::from(*f) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{format:?}, {rows} rows: swiglu {f} against {want}"
                );
            }
            if rows > 1 {
                let r = rows - 1;
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fused(&x[r * cols..(r + 1) * cols], 1)),
                    bits(&gated[r * n_out..(r + 1) * n_out]),
                    "{format:?}: swiglu row {r} of {rows} differs from the row alone"
                );
            }
        }
    }
    // Gate and up of different formats are not fused: the caller runs them apart.
    let cols = 256;
    let a = QuantMatrix::quantize(QuantFormat::Q4_K, 8, cols, &values(8 * cols, 7)).expect("q");
    let b = QuantMatrix::quantize(QuantFormat::Q6_K, 8, cols, &values(8 * cols, 8)).expect("q");
    let x = Tensor::<Gpu, 2>::from_data(TensorData::new(values(cols, 9), [1, cols]), &device);
    assert!(
        Gpu::quantized_swiglu(x, &a, &b, Precision::Exact)
            .expect("no error")
            .is_none()
    );
    assert!(<Gpu as LlamaBackend>::keeps_quantized_weights());
}

/// The `fast` precision on the device is the CPU's `fast` product, bit for bit: the
/// activations quantized on the device by the CPU's rule, the integer block sums, the
/// float steps in the CPU's order. Every kept format; 1, 5, 19 and 128 rows (a unit per
/// row, tiles of 4 and of 8, the last ones partial); rows of 3 blocks (two lanes share
/// an output) and of 37 (eight lanes, the last chunk partial); a row whose first run is
/// zeros (a zero scale) and one of large values. Each row alone gives its bits in the
/// batch, and gate, up and SwiGLU in one launch give SwiGLU of the two products.
#[test]
fn fast_products_on_the_device_give_the_cpu_fast_bits() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    let on = |x: &[f32], rows: usize, w: &QuantMatrix, gpu: bool| -> Vec<f32> {
        let data = TensorData::new(x.to_vec(), [rows, w.cols()]);
        if gpu {
            let xt = Tensor::<Gpu, 2>::from_data(data, &device);
            Gpu::quantized_matmul(xt, w, Precision::Fast)
                .expect("device fast product")
                .into_data()
                .into_vec::<f32>()
                .expect("f32")
        } else {
            let xt = Tensor::<Flex, 2>::from_data(data, &Default::default());
            Flex::quantized_matmul(xt, w, Precision::Fast)
                .expect("cpu fast product")
                .into_data()
                .into_vec::<f32>()
                .expect("f32")
        }
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let cases = QuantFormat::ALL
        .into_iter()
        .flat_map(|f| [(f, 3, vec![1, 5, 19, 128]), (f, 37, vec![1, 19])]);
    for (format, blocks, all_rows) in cases {
        let (n_out, cols) = (37, blocks * format.block_values());
        let w =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4)).expect("quantize");
        for rows in all_rows {
            let mut x = values(rows * cols, 5 + rows as u64);
            // A zero run (a scale of 0) and a row of large values.
            x[..256.min(cols)].fill(0.0);
            if rows > 1 {
                for v in &mut x[cols..2 * cols] {
                    *v *= 3.0e4;
                }
            }
            let want = on(&x, rows, &w, false);
            let got = on(&x, rows, &w, true);
            assert_eq!(got.len(), want.len());
            if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                panic!(
                    "{format:?}, {rows} rows of {blocks} blocks: output {i} (row {}, column {}) \
                     is {} on the device and {} on the CPU",
                    i / n_out,
                    i % n_out,
                    got[i],
                    want[i]
                );
            }
            if rows > 1 {
                for r in [0, 1, rows - 1] {
                    let alone = on(&x[r * cols..(r + 1) * cols], 1, &w, true);
                    assert_eq!(
                        bits(&alone),
                        bits(&got[r * n_out..(r + 1) * n_out]),
                        "{format:?}: row {r} of {rows} differs from the row alone"
                    );
                }
            }
            if rows == 5 {
                let up = QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 6))
                    .expect("quantize");
                let ups = on(&x, rows, &up, true);
                let fused = |x: &[f32], rows: usize| -> Vec<f32> {
                    let xt = Tensor::<Gpu, 2>::from_data(
                        TensorData::new(x.to_vec(), [rows, cols]),
                        &device,
                    );
                    Gpu::quantized_swiglu(xt, &w, &up, Precision::Fast)
                        .expect("device fast swiglu")
                        .expect("one format and shape: fused")
                        .into_data()
                        .into_vec::<f32>()
                        .expect("f32")
                };
                let gated = fused(&x, rows);
                for ((g, u), f) in got.iter().zip(&ups).zip(&gated) {
                    let want = f64::from(*g) / (1.0 + (-f64::from(*g)).exp()) * f64::from(*u);
                    assert!(
                        (f64::from(*f) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{format:?}: fast swiglu {f} against {want}"
                    );
                }
                // The CPU's SwiGLU of the two products, bit for bit.
                let mut on_cpu = got.clone();
                llama_burn::kernels::activation::swiglu(&mut on_cpu, &ups);
                assert_eq!(bits(&gated), bits(&on_cpu), "{format:?}: fast swiglu");
                // The element-wise kernel (gate and up of unlike formats, dense weights)
                // gives the same bits.
                let matrix = |v: &[f32]| {
                    Tensor::<Gpu, 2>::from_data(TensorData::new(v.to_vec(), [rows, n_out]), &device)
                };
                let apart = Gpu::swiglu(matrix(&got), matrix(&ups))
                    .expect("device swiglu")
                    .into_data()
                    .into_vec::<f32>()
                    .expect("f32");
                assert_eq!(
                    bits(&apart),
                    bits(&on_cpu),
                    "{format:?}: element-wise swiglu"
                );
                assert_eq!(
                    bits(&fused(&x[4 * cols..], 1)),
                    bits(&gated[4 * n_out..]),
                    "{format:?}: fast swiglu's last row differs from the row alone"
                );
            }
        }
    }
}

#[test]
fn a_norm_or_a_residual_add_fused_into_a_product_gives_the_separate_launches_bits() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::backend::{Around, Beside};
    use llama_burn::gpu::NORM_IN_PROLOGUE_ROWS;
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    let fast = Precision::Fast;
    let gpu = |v: &[f32], dims: [usize; 2]| {
        Tensor::<Gpu, 2>::from_data(TensorData::new(v.to_vec(), dims), &device)
    };
    let bits = |t: Tensor<Gpu, 2>| -> Vec<u32> {
        let v = t.into_data().into_vec::<f32>().expect("f32");
        v.iter().map(|f| f.to_bits()).collect()
    };
    let eps = 1e-5;
    // The `fast` product with the work `around` it in its launch, where it must fuse.
    fn fused_product(
        x: Tensor<Gpu, 2>,
        w: &QuantMatrix,
        beside: Beside<'_>,
        around: Around<'_, Gpu>,
    ) -> Tensor<Gpu, 2> {
        Gpu::fused_quantized_matmul(x, w, beside, around, Precision::Fast)
            .expect("fused product")
            .expect("fused")
    }
    // One format of 32-value blocks and two K-quants (the prologue's reads differ by the
    // run length; every format's product is checked against the CPU's above). Each
    // launch shape is a shader to compile on lavapipe: the cases are few.
    for format in [QuantFormat::Q4_0, QuantFormat::Q4_K, QuantFormat::Q6_K] {
        let (n_out, cols) = (37, 3 * format.block_values());
        let w =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4)).expect("quantize");
        let up =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 6)).expect("quantize");
        // Of another format with the same values per block (the same lanes per output).
        let other = match format.block_values() {
            256 if format == QuantFormat::Q6_K => QuantFormat::Q4_K,
            256 => QuantFormat::Q6_K,
            _ if format == QuantFormat::Q8_0 => QuantFormat::Q4_0,
            _ => QuantFormat::Q8_0,
        };
        let second = QuantMatrix::quantize(other, 5, cols, &values(5 * cols, 8)).expect("quantize");
        let weight_values: Vec<f32> = values(cols, 7).iter().map(|v| 1.0 + v).collect();
        let weight = Tensor::<Gpu, 1>::from_data(TensorData::new(weight_values, [cols]), &device);
        for rows in [1, 5, 19] {
            let mut x = values(rows * cols, 9 + rows as u64);
            if rows > 1 {
                for v in &mut x[cols..2 * cols] {
                    *v *= 3.0e4;
                }
            }
            let xt = gpu(&x, [rows, cols]);
            let normed = Gpu::rms_norm(xt.clone(), &weight, eps).expect("norm");
            // A prompt chunk or a wide batch keeps its norm a launch of its own.
            let norm = Around::Norm(&weight, eps);
            let wide = Gpu::fused_quantized_matmul(xt.clone(), &w, Beside::Nothing, norm, fast)
                .expect("fused product");
            assert_eq!(wide.is_none(), rows > NORM_IN_PROLOGUE_ROWS, "{rows} rows");
            for (name, beside) in [
                ("alone", Beside::Nothing),
                ("with up and SwiGLU", Beside::SwiGluUp(&up)),
                ("beside another format's matrix", Beside::Second(&second)),
            ] {
                if rows > NORM_IN_PROLOGUE_ROWS {
                    break;
                }
                let apart = match beside {
                    Beside::Nothing => Gpu::quantized_matmul(normed.clone(), &w, fast),
                    Beside::SwiGluUp(u) => Gpu::quantized_swiglu(normed.clone(), &w, u, fast)
                        .map(|t| t.expect("one format and shape: fused")),
                    Beside::Second(b) => Gpu::quantized_matmul_two(normed.clone(), &w, b, fast)
                        .map(|t| t.expect("one launch")),
                }
                .expect("product");
                let fused = fused_product(xt.clone(), &w, beside, Around::Norm(&weight, eps));
                assert_eq!(
                    bits(fused.clone()),
                    bits(apart),
                    "{format:?}, {rows} rows, {name}: the norm in the prologue"
                );
                if rows > 1 {
                    let width = fused.dims()[1];
                    let alone = fused_product(
                        gpu(&x[cols..2 * cols], [1, cols]),
                        &w,
                        beside,
                        Around::Norm(&weight, eps),
                    );
                    assert_eq!(
                        bits(alone),
                        bits(fused.slice([1..2, 0..width])),
                        "{format:?} {name}: row 1 of {rows} differs from the row alone"
                    );
                }
            }
            // The residual add in the epilogue.
            let residual = gpu(&values(rows * n_out, 11), [rows, n_out]);
            let apart = residual.clone() + Gpu::quantized_matmul(xt.clone(), &w, fast).expect("p");
            let fused = fused_product(
                xt.clone(),
                &w,
                Beside::Nothing,
                Around::Residual(residual.clone()),
            );
            assert_eq!(
                bits(fused),
                bits(apart),
                "{format:?}, {rows} rows: the residual add in the epilogue"
            );
            let wrong = Gpu::fused_quantized_matmul(
                xt.clone(),
                &w,
                Beside::Nothing,
                Around::Residual(gpu(&values(rows * 3, 12), [rows, 3])),
                fast,
            );
            assert!(
                matches!(wrong, Err(LlamaError::ShapeMismatch { .. })),
                "a residual of the wrong shape: {wrong:?}"
            );
        }
    }
    // In f16 (tensors of that type on the same device): the norm stores f16 values and
    // the add rounds to f16, fused or apart.
    {
        use burn::tensor::DType;
        let cols = 512;
        let w = QuantMatrix::quantize(QuantFormat::Q4_K, 37, cols, &values(37 * cols, 4))
            .expect("quantize");
        let half = |v: Vec<f32>, dims: [usize; 2]| {
            Tensor::<Gpu, 2>::from_data(TensorData::new(v, dims), (&device, DType::F16))
        };
        let weight_values: Vec<f32> = values(cols, 7).iter().map(|v| 1.0 + v).collect();
        let weight = Tensor::<Gpu, 1>::from_data(
            TensorData::new(weight_values, [cols]),
            (&device, DType::F16),
        );
        let half_bits = |t: Tensor<Gpu, 2>| -> Vec<u16> {
            assert_eq!(t.dtype(), DType::F16);
            let v = t
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32");
            v.iter()
                .map(|&f| burn::tensor::f16::from_f32(f).to_bits())
                .collect()
        };
        for rows in [1, 5] {
            let xt = half(values(rows * cols, 13), [rows, cols]);
            let normed = Gpu::rms_norm(xt.clone(), &weight, eps).expect("norm");
            let apart = Gpu::quantized_matmul(normed, &w, fast).expect("product");
            let fused = fused_product(xt.clone(), &w, Beside::Nothing, Around::Norm(&weight, eps));
            assert_eq!(
                half_bits(fused),
                half_bits(apart),
                "f16, {rows} rows: the norm"
            );
            let residual = half(values(rows * 37, 14), [rows, 37]);
            let apart = residual.clone() + Gpu::quantized_matmul(xt.clone(), &w, fast).expect("p");
            let fused = fused_product(xt, &w, Beside::Nothing, Around::Residual(residual));
            assert_eq!(
                half_bits(fused),
                half_bits(apart),
                "f16, {rows} rows: the add"
            );
        }
    }
    // Outside `fast` the CubeCL backends run the norm and the add apart.
    let (w, cols) = (
        QuantMatrix::quantize(QuantFormat::Q4_K, 8, 256, &values(8 * 256, 4)).expect("quantize"),
        256,
    );
    let weight = Tensor::<Gpu, 1>::from_data(TensorData::new(vec![1.0f32; cols], [cols]), &device);
    let exact = Gpu::fused_quantized_matmul(
        gpu(&values(cols, 3), [1, cols]),
        &w,
        Beside::Nothing,
        Around::Norm(&weight, eps),
        Precision::Exact,
    )
    .expect("exact");
    assert!(exact.is_none(), "the f32 product has no fused form");
}

#[test]
fn dense_matmul_kernel_is_batch_invariant_and_gives_the_reference() {
    use burn::tensor::{Tensor, TensorData};

    // Dense weights (F32/F16/BF16 checkpoints) go through our kernel on the CubeCL
    // backends: Burn's matmul gives a row different bits in different batches. Both
    // layouts (`[in, out]` projections, the `[vocab, d]` output head), an odd shape, one
    // row (a unit per row), 5 (tiles of 4) and 19 (tiles of 8).
    let device = Default::default();
    let (n_out, cols) = (37, 67);
    let w = values(n_out * cols, 21);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for transposed in [false, true] {
        let dims = if transposed {
            [n_out, cols]
        } else {
            [cols, n_out]
        };
        let wt = Tensor::<Gpu, 2>::from_data(TensorData::new(w.clone(), dims), &device);
        let weight = |o: usize, c: usize| {
            f64::from(if transposed {
                w[o * cols + c]
            } else {
                w[c * n_out + o]
            })
        };
        let multiply = |x: &[f32], rows: usize| -> Vec<f32> {
            let xt =
                Tensor::<Gpu, 2>::from_data(TensorData::new(x.to_vec(), [rows, cols]), &device);
            Gpu::dense_matmul(xt, &wt, transposed)
                .expect("wgpu dense matmul")
                .into_data()
                .into_vec::<f32>()
                .expect("f32")
        };
        for rows in [1, 5, 19] {
            let x = values(rows * cols, 30 + rows as u64);
            let got = multiply(&x, rows);
            assert_eq!(got.len(), rows * n_out);
            for (i, g) in got.iter().enumerate() {
                let (r, o) = (i / n_out, i % n_out);
                let want: f64 = (0..cols)
                    .map(|c| f64::from(x[r * cols + c]) * weight(o, c))
                    .sum();
                assert!(
                    (f64::from(*g) - want).abs() <= 1e-4,
                    "{transposed} {rows}: {g} {want}"
                );
            }
            for r in [0, rows / 2, rows - 1] {
                let alone = multiply(&x[r * cols..(r + 1) * cols], 1);
                assert_eq!(
                    bits(&alone),
                    bits(&got[r * n_out..(r + 1) * n_out]),
                    "transposed {transposed}: row {r} of {rows} differs from the row alone"
                );
            }
        }
        // A weight that does not take `x`'s columns is an error, not a panic.
        let wrong = Tensor::<Gpu, 2>::from_data(
            TensorData::new(vec![0f32; 3 * cols + 3], [1, 3 * cols + 3]),
            &device,
        );
        assert!(matches!(
            Gpu::dense_matmul(wrong, &wt, transposed),
            Err(llama_burn::LlamaError::ShapeMismatch { .. })
        ));
    }
}

#[test]
fn row_kernels_give_the_reference_and_the_store_writes_each_slot() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::model::attention::{PagedBatch, PagedSeq};

    let device = Default::default();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let read = |t: Tensor<Gpu, 2>| t.into_data().into_vec::<f32>().expect("f32");
    let matrix = |v: &[f32], rows: usize, cols: usize| {
        Tensor::<Gpu, 2>::from_data(TensorData::new(v.to_vec(), [rows, cols]), &device)
    };
    let cpu = |v: &[f32], r: usize, c: usize| {
        Tensor::<Flex, 2>::from_data(TensorData::new(v.to_vec(), [r, c]), &Default::default())
    };
    let read_cpu = |t: Tensor<Flex, 2>| t.into_data().into_vec::<f32>().expect("f32");

    // RMSNorm (one cube per row, sums in an order fixed by the row's length; 300 values
    // are more than one pass of the cube) and the residual add fused with it: against an
    // f64 reference and the CPU backend's bits, and each row alone bitwise equal to its
    // row in a batch of 19.
    let (rows, d, eps) = (19, 300, 1e-5);
    let x = values(rows * d, 3);
    let delta = values(rows * d, 4);
    let w = values(d, 5);
    let weight = Tensor::<Gpu, 1>::from_data(TensorData::new(w.clone(), [d]), &device);
    let normed = read(Gpu::rms_norm(matrix(&x, rows, d), &weight, eps).expect("norm"));
    let (sum, fused) =
        Gpu::add_rms_norm(matrix(&x, rows, d), matrix(&delta, rows, d), &weight, eps)
            .expect("add and norm");
    let (sum, fused) = (read(sum), read(fused));
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            let want = f64::from(row[i]) * inv * f64::from(w[i]);
            let got = f64::from(normed[r * d + i]);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{r} {i}: {got} {want}"
            );
            // The residual sum is the plain f32 add.
            assert_eq!(
                sum[r * d + i].to_bits(),
                (x[r * d + i] + delta[r * d + i]).to_bits()
            );
        }
    }
    // The CPU's steps in the CPU's order: its bits.
    let w_cpu = Tensor::<Flex, 1>::from_data(TensorData::new(w.clone(), [d]), &Default::default());
    let on_cpu = read_cpu(Flex::rms_norm(cpu(&x, rows, d), &w_cpu, eps).expect("cpu norm"));
    assert_eq!(
        bits(&normed),
        bits(&on_cpu),
        "RMSNorm differs from the CPU's"
    );
    // The fused kernel normalizes its sum exactly as the norm kernel does.
    let normed_sum = read(Gpu::rms_norm(matrix(&sum, rows, d), &weight, eps).expect("norm"));
    assert_eq!(bits(&fused), bits(&normed_sum));
    for r in [0, 7, rows - 1] {
        let alone =
            read(Gpu::rms_norm(matrix(&x[r * d..(r + 1) * d], 1, d), &weight, eps).unwrap());
        assert_eq!(bits(&alone), bits(&normed[r * d..(r + 1) * d]), "row {r}");
    }
    // A weight of the wrong length is an error, not a panic.
    let short = Tensor::<Gpu, 1>::from_data(TensorData::new(vec![1f32; d - 1], [d - 1]), &device);
    assert!(matches!(
        Gpu::rms_norm(matrix(&x, rows, d), &short, eps),
        Err(LlamaError::ShapeMismatch { .. })
    ));

    // RoPE in one kernel against the CPU backend's (two products and an add, each
    // rounded on its own): its bits.
    let (rows, heads, head_dim) = (5, 3, 8);
    let width = heads * head_dim;
    let (x, cos, sin) = (
        values(rows * width, 6),
        values(rows * width, 7),
        values(rows * width, 8),
    );
    let mut swap = vec![0f32; head_dim * head_dim];
    for i in 0..head_dim {
        swap[i * head_dim + (i + head_dim / 2) % head_dim] = 1.0;
    }
    let on_gpu = read(
        Gpu::rope(
            matrix(&x, rows, width),
            &matrix(&cos, rows, width),
            &matrix(&sin, rows, width),
            &matrix(&swap, head_dim, head_dim),
        )
        .expect("rope"),
    );
    let on_cpu = Flex::rope(
        cpu(&x, rows, width),
        &cpu(&cos, rows, width),
        &cpu(&sin, rows, width),
        &cpu(&swap, head_dim, head_dim),
    )
    .expect("cpu rope")
    .into_data()
    .into_vec::<f32>()
    .expect("f32");
    assert_eq!(bits(&on_gpu), bits(&on_cpu), "RoPE differs from the CPU's");

    // The paged store: two sequences' keys and values (a column slice of a wider tensor,
    // as the model passes them) into their blocks, one launch for both pools; a copy of
    // the pool taken before the write keeps its old values.
    let (blocks, kv_heads, block_size, dim) = (6, 2, 4, 3);
    let width = kv_heads * dim;
    let table_a = [4u32, 1];
    let table_b = [0u32];
    let seqs = vec![
        PagedSeq {
            tokens: 3,
            start: 2,
            blocks: &table_a,
        },
        PagedSeq {
            tokens: 2,
            start: 0,
            blocks: &table_b,
        },
    ];
    let batch = PagedBatch::<Gpu>::new(seqs, 4, block_size, blocks, &device).expect("batch");
    let slots = [(4, 2), (4, 3), (1, 0), (0, 0), (0, 1)];
    let tokens = slots.len();
    let wide = values(tokens * 2 * width, 9);
    let kv = matrix(&wide, tokens, 2 * width);
    let (k, v) = (
        kv.clone().slice([0..tokens, 0..width]),
        kv.slice([0..tokens, width..2 * width]),
    );
    let pool_len = blocks * kv_heads * block_size * dim;
    let pool = |base: f32| {
        let init: Vec<f32> = (0..pool_len).map(|i| base - i as f32).collect();
        Tensor::<Gpu, 4>::from_data(
            TensorData::new(init, [blocks, kv_heads, block_size, dim]),
            &device,
        )
    };
    let (keys, values_pool) = (pool(-1.0), pool(-1000.0));
    let kept = keys.clone();
    let (keys, values_pool) = Gpu::paged_store((keys, values_pool), k, v, &slots, &batch);
    let keys = keys.into_data().into_vec::<f32>().expect("f32");
    let vals = values_pool.into_data().into_vec::<f32>().expect("f32");
    let mut want_k: Vec<f32> = (0..pool_len).map(|i| -1.0 - i as f32).collect();
    let mut want_v: Vec<f32> = (0..pool_len).map(|i| -1000.0 - i as f32).collect();
    for (t, &(block, slot)) in slots.iter().enumerate() {
        for c in 0..width {
            let at = ((block as usize * kv_heads + c / dim) * block_size + slot) * dim + c % dim;
            want_k[at] = wide[t * 2 * width + c];
            want_v[at] = wide[t * 2 * width + width + c];
        }
    }
    assert_eq!(bits(&keys), bits(&want_k));
    assert_eq!(bits(&vals), bits(&want_v));
    let kept = kept.into_data().into_vec::<f32>().expect("f32");
    assert!(kept.iter().enumerate().all(|(i, &v)| v == -1.0 - i as f32));
}

/// Two quantized matrices of unlike formats in one launch (`quantized_matmul_two`: a
/// Q4_K_M file's Q4_K queries and keys beside its Q6_K values, say): every output bitwise
/// the two products' own, in both precisions, at 1, 5 and 19 rows, with a first matrix
/// whose outputs end inside a cube; matrices that take different units per output are
/// left to two launches (`None`).
/// The `fast` product through the tile kernel (`TensorCores::Portable`: the tensor-core
/// kernel's tiles, staging and steps with its fragment products in plain multiply-adds;
/// on a device with int8 tensor cores `Auto` from 16 rows takes the fragments
/// themselves) gives the CPU `fast` product's bits: every kept format, rows that fill a
/// tile, part of one and more than two, outputs across cubes and planes with dead ones;
/// each row alone equal to its row in the batch; gate and up with SwiGLU, a second matrix
/// of another format beside, and the residual add, the CPU's bits too.
#[test]
fn the_tile_kernel_gives_the_cpu_fast_bits() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::backend::{Around, Beside};
    use llama_burn::gpu::{TensorCores, set_tensor_cores};
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    let fast = Precision::Fast;
    // Where the device has them, `Auto` takes the fragment instructions from 16 rows.
    let mut modes = vec![TensorCores::Portable];
    if Gpu::int8_tensor_cores(&device) {
        println!("int8 tensor cores here: the tile kernel runs on them too, from 16 rows");
        modes.push(TensorCores::Auto);
    } else {
        println!("no int8 tensor cores here: the tile kernel runs in its portable form only");
    }
    let gpu = |v: &[f32], dims: [usize; 2]| {
        Tensor::<Gpu, 2>::from_data(TensorData::new(v.to_vec(), dims), &device)
    };
    let read = |t: Tensor<Gpu, 2>| t.into_data().into_vec::<f32>().expect("f32");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for mode in modes.iter().copied() {
        for format in QuantFormat::ALL {
            let (n_out, cols) = (37, 2 * format.block_values());
            let w = QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4))
                .expect("quantize");
            // A tile's part, more than two tiles; with `Auto` from 16 rows.
            let all_rows: &[usize] = if mode == TensorCores::Auto {
                &[16, 40]
            } else {
                &[1, 5, 40]
            };
            for &rows in all_rows {
                let mut x = values(rows * cols, 50 + rows as u64);
                // A zero run (a scale of 0) and a row of large values.
                x[..32].fill(0.0);
                if rows > 1 {
                    for v in &mut x[cols..2 * cols] {
                        *v *= 3.0e4;
                    }
                }
                let cpu = Tensor::<Flex, 2>::from_data(
                    TensorData::new(x.clone(), [rows, cols]),
                    &Default::default(),
                );
                let want = Flex::quantized_matmul(cpu, &w, fast).expect("cpu fast product");
                let want = want.into_data().into_vec::<f32>().expect("f32");
                set_tensor_cores(Some(mode));
                let got = read(Gpu::quantized_matmul(gpu(&x, [rows, cols]), &w, fast).unwrap());
                set_tensor_cores(None);
                if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    panic!(
                        "{mode:?}, {format:?}, {rows} rows: output {i} (row {}, column {}) is \
                         {} on the device and {} on the CPU",
                        i / n_out,
                        i % n_out,
                        got[i],
                        want[i]
                    );
                }
                if rows > 1 && mode == TensorCores::Portable {
                    set_tensor_cores(Some(mode));
                    let alone = read(
                        Gpu::quantized_matmul(gpu(&x[(rows - 1) * cols..], [1, cols]), &w, fast)
                            .unwrap(),
                    );
                    set_tensor_cores(None);
                    assert_eq!(
                        bits(&alone),
                        bits(&want[(rows - 1) * n_out..]),
                        "{format:?}: the last of {rows} rows differs from the row alone"
                    );
                }
            }
        }
    }
    // Gate and up with SwiGLU, a second matrix beside, the residual add, at 150 outputs
    // (three cubes of 64): the CPU's bits. A 32-value format and Q6_K (its halves scaled
    // apart): each launch shape is a shader to compile on lavapipe, so the cases are few.
    let cpu_product = |x: &[f32], rows: usize, w: &QuantMatrix| -> Vec<f32> {
        let xt = Tensor::<Flex, 2>::from_data(
            TensorData::new(x.to_vec(), [rows, w.cols()]),
            &Default::default(),
        );
        let out = Flex::quantized_matmul(xt, w, fast).expect("cpu fast product");
        out.into_data().into_vec::<f32>().expect("f32")
    };
    for format in [QuantFormat::Q4_0, QuantFormat::Q6_K] {
        let (n_out, cols) = (150, 2 * format.block_values());
        let w =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4)).expect("quantize");
        let up =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 6)).expect("quantize");
        let other = if format == QuantFormat::Q6_K {
            QuantFormat::Q4_K
        } else if format.block_values() == 256 {
            QuantFormat::Q6_K
        } else {
            QuantFormat::Q8_0
        };
        let n2 = 21;
        let second =
            QuantMatrix::quantize(other, n2, cols, &values(n2 * cols, 8)).expect("quantize");
        for rows in [5, 19] {
            let x = values(rows * cols, 60 + rows as u64);
            let residual = values(rows * n_out, 61);
            let gate = cpu_product(&x, rows, &w);
            let mut gated = gate.clone();
            llama_burn::kernels::activation::swiglu(&mut gated, &cpu_product(&x, rows, &up));
            let beside = cpu_product(&x, rows, &second);
            let both: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let first = gate[r * n_out..(r + 1) * n_out].iter();
                    first.chain(&beside[r * n2..(r + 1) * n2]).copied()
                })
                .collect();
            let added: Vec<f32> = gate.iter().zip(&residual).map(|(g, r)| r + g).collect();
            for mode in modes.iter().copied() {
                set_tensor_cores(Some(mode));
                let xt = gpu(&x, [rows, cols]);
                let on_gpu = [
                    Gpu::quantized_swiglu(xt.clone(), &w, &up, fast)
                        .expect("swiglu")
                        .expect("one format and shape: fused"),
                    Gpu::quantized_matmul_two(xt.clone(), &w, &second, fast)
                        .expect("two")
                        .expect("one launch"),
                    Gpu::fused_quantized_matmul(
                        xt,
                        &w,
                        Beside::Nothing,
                        Around::Residual(gpu(&residual, [rows, n_out])),
                        fast,
                    )
                    .expect("fused product")
                    .expect("fused"),
                ];
                set_tensor_cores(None);
                for ((name, want), got) in [("swiglu", &gated), ("beside", &both), ("add", &added)]
                    .into_iter()
                    .zip(on_gpu)
                {
                    let got = read(got);
                    let bad = (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits());
                    let bad: Vec<usize> = bad.collect();
                    assert!(
                        bad.is_empty(),
                        "{mode:?}, {format:?}, {rows} rows, {name}: {} of {} outputs differ from \
                         the CPU's, the first {:?}",
                        bad.len(),
                        got.len(),
                        bad.first().map(|&i| (i, got[i], want[i]))
                    );
                }
            }
        }
    }
}

#[test]
fn two_matrices_of_unlike_formats_in_one_launch_give_each_products_bits() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let read = |t: Tensor<Gpu, 2>| t.into_data().into_vec::<f32>().expect("f32");
    let input = |rows: usize, cols: usize| {
        Tensor::<Gpu, 2>::from_data(
            TensorData::new(values(rows * cols, 40 + rows as u64), [rows, cols]),
            &device,
        )
    };
    // (first, second, columns): K-quants of 2 blocks a row (2 units an output each),
    // 32-value formats of 3 blocks (2 units each), and a 32-value beside a K-quant at 2048
    // columns (64 and 8 blocks: 8 units each).
    let cases = [
        (QuantFormat::Q4_K, QuantFormat::Q6_K, 512),
        (QuantFormat::Q8_0, QuantFormat::Q4_1, 96),
        (QuantFormat::Q5_0, QuantFormat::Q3_K, 2048),
    ];
    for (fa, fb, cols) in cases {
        let (na, nb) = (40, 37);
        let a = QuantMatrix::quantize(fa, na, cols, &values(na * cols, 31)).expect("quantize");
        let b = QuantMatrix::quantize(fb, nb, cols, &values(nb * cols, 32)).expect("quantize");
        for precision in [Precision::Exact, Precision::Fast] {
            for rows in [1, 5, 19] {
                let both = Gpu::quantized_matmul_two(input(rows, cols), &a, &b, precision)
                    .expect("one launch")
                    .expect("these two share units per output");
                assert_eq!(both.dims(), [rows, na + nb]);
                let both = read(both);
                let first = read(Gpu::quantized_matmul(input(rows, cols), &a, precision).unwrap());
                let second = read(Gpu::quantized_matmul(input(rows, cols), &b, precision).unwrap());
                for r in 0..rows {
                    let row = &both[r * (na + nb)..(r + 1) * (na + nb)];
                    assert_eq!(
                        bits(&row[..na]),
                        bits(&first[r * na..(r + 1) * na]),
                        "{fa:?} beside {fb:?}, {precision:?}, {rows} rows: row {r}'s first part"
                    );
                    assert_eq!(
                        bits(&row[na..]),
                        bits(&second[r * nb..(r + 1) * nb]),
                        "{fa:?} beside {fb:?}, {precision:?}, {rows} rows: row {r}'s second part"
                    );
                }
            }
        }
    }
    // Q8_0 (16 blocks: 8 units) beside Q6_K (2 blocks: 2 units) at 512 columns: two launches.
    let a = QuantMatrix::quantize(QuantFormat::Q8_0, 8, 512, &values(8 * 512, 33)).unwrap();
    let b = QuantMatrix::quantize(QuantFormat::Q6_K, 8, 512, &values(8 * 512, 34)).unwrap();
    let none = Gpu::quantized_matmul_two(input(1, 512), &a, &b, Precision::Exact).expect("ok");
    assert!(none.is_none());
    // Inputs of the wrong width: the shape error, not a launch.
    assert!(matches!(
        Gpu::quantized_matmul_two(input(1, 256), &a, &b, Precision::Exact),
        Err(LlamaError::ShapeMismatch { .. })
    ));
}

/// RoPE and the paged store in one launch (`rope_paged_store`, what a decode step runs):
/// the queries and the pools bitwise what the RoPE kernel then the store kernel give,
/// from a column view of a fused projection's output as the model passes it, the angles
/// read from the tables at each token's position; angles at other positions than the
/// batch's taken as given (the portable path); the CPU backend's path within RoPE's
/// rounding; tables of the wrong head size an error with the pools given back unchanged.
#[test]
fn rope_and_the_paged_store_in_one_launch_give_the_two_kernels_bits() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::backend::Rotation;
    use llama_burn::model::attention::{PagedBatch, PagedSeq};
    use llama_burn::model::rope::RopeAngles;

    #[derive(Clone, Copy, PartialEq)]
    enum Angles {
        OfTheBatch,
        Shifted,
        WrongHeadSize,
    }

    fn run<B: LlamaBackend>(
        device: &B::Device,
        fused: bool,
        angles: Angles,
    ) -> (Result<Vec<f32>, LlamaError>, Vec<f32>, Vec<f32>) {
        let (n_heads, kv_heads, dim, blocks, block_size) = (4, 2, 8, 6, 4);
        let (q_width, kv_width) = (n_heads * dim, kv_heads * dim);
        let width = q_width + kv_width;
        let table_a = [4u32, 1];
        let table_b = [0u32];
        let seqs = vec![
            PagedSeq {
                tokens: 3,
                start: 2,
                blocks: &table_a,
            },
            PagedSeq {
                tokens: 2,
                start: 0,
                blocks: &table_b,
            },
        ];
        let batch = PagedBatch::<B>::new(seqs, n_heads, block_size, blocks, device).expect("batch");
        let slots = [(4, 2), (4, 3), (1, 0), (0, 0), (0, 1)];
        let tokens = slots.len();
        let matrix = |v: Vec<f32>, rows: usize, cols: usize| {
            Tensor::<B, 2>::from_data(TensorData::new(v, [rows, cols]), device)
        };
        // The fused projection's output: queries, keys, values side by side.
        let qkv = matrix(
            values(tokens * (width + kv_width), 21),
            tokens,
            width + kv_width,
        );
        let qk = qkv.clone().slice([0..tokens, 0..width]);
        let v = qkv.slice([0..tokens, width..width + kv_width]);
        let table_dim = if angles == Angles::WrongHeadSize {
            dim - 2
        } else {
            dim
        };
        let positions = match angles {
            Angles::Shifted => vec![3, 4, 5, 1, 2],
            _ => vec![2, 3, 4, 0, 1],
        };
        let angles = RopeAngles::new(
            matrix(values(8 * table_dim, 22), 8, table_dim),
            matrix(values(8 * table_dim, 23), 8, table_dim),
            positions,
            n_heads + kv_heads,
        )
        .expect("angles");
        let mut swap = vec![0f32; dim * dim];
        for i in 0..dim {
            swap[i * dim + (i + dim / 2) % dim] = 1.0;
        }
        let swap = matrix(swap, dim, dim);
        let pool_len = blocks * kv_heads * block_size * dim;
        let pool = |base: f32| {
            let init: Vec<f32> = (0..pool_len).map(|i| base - i as f32).collect();
            Tensor::<B, 4>::from_data(
                TensorData::new(init, [blocks, kv_heads, block_size, dim]),
                device,
            )
        };
        let pools = (pool(-1.0), pool(-1000.0));
        let (q, (keys, values_pool)) = if fused {
            let rotation = Rotation {
                angles: &angles,
                swap: &swap,
            };
            B::rope_paged_store(pools, qk, v, rotation, q_width, &slots, &batch)
        } else {
            let (cos, sin) = angles.gathered();
            let qk = B::rope(qk, cos, sin, &swap).expect("rope");
            let q = qk.clone().slice([0..tokens, 0..q_width]);
            let k = qk.slice([0..tokens, q_width..width]);
            (Ok(q), B::paged_store(pools, k, v, &slots, &batch))
        };
        let read = |t: Tensor<B, 2>| t.into_data().into_vec::<f32>().expect("f32");
        let flat = |t: Tensor<B, 4>| t.into_data().into_vec::<f32>().expect("f32");
        (q.map(read), flat(keys), flat(values_pool))
    }

    let device = Default::default();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for angles in [Angles::OfTheBatch, Angles::Shifted] {
        let (q, keys, vals) = run::<Gpu>(&device, true, angles);
        let q = q.expect("fused rope and store");
        let (q2, keys2, vals2) = run::<Gpu>(&device, false, angles);
        assert_eq!(bits(&q), bits(&q2.expect("rope")), "rotated queries");
        assert_eq!(bits(&keys), bits(&keys2), "key pool");
        assert_eq!(bits(&vals), bits(&vals2), "value pool");
        // The CPU backend's portable path: RoPE then its store.
        let (q3, keys3, vals3) = run::<Flex>(&Default::default(), true, angles);
        let q3 = q3.expect("cpu rope and store");
        assert!(max_diff(&q, &q3) <= 1e-6, "queries: {}", max_diff(&q, &q3));
        assert!(
            max_diff(&keys, &keys3) <= 1e-6,
            "keys: {}",
            max_diff(&keys, &keys3)
        );
        assert_eq!(bits(&vals), bits(&vals3), "values are copied");
        // Every token's slot was written (the pools start far from the inputs' range).
        let written = keys.iter().filter(|k| k.abs() < 2.0).count();
        assert_eq!(written, 5 * 2 * 8);
    }
    // Tables of the wrong head size: an error naming the angles, the pools unchanged.
    let (q, keys, vals) = run::<Gpu>(&device, true, Angles::WrongHeadSize);
    assert!(
        matches!(&q, Err(LlamaError::ShapeMismatch { name, .. }) if name == "rope cos"),
        "{q:?}"
    );
    assert!(keys.iter().enumerate().all(|(i, &k)| k == -1.0 - i as f32));
    assert!(
        vals.iter()
            .enumerate()
            .all(|(i, &v)| v == -1000.0 - i as f32)
    );
}

#[test]
fn encoded_kv_pools_on_the_device_hold_the_host_bytes_and_give_the_cpu_attention() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::cache::paged::DeviceKvPool;
    use llama_burn::cache::{KvCacheType, KvCacheTypes};
    use llama_burn::kernels::attention::{EncodedPagedPool, paged_attention_encoded};
    use llama_burn::model::attention::{PagedBatch, PagedSeq};

    let device = Default::default();
    let (blocks, kv_heads, block_size, dim, n_heads) = (6, 2, 4, 64, 4);
    let width = kv_heads * dim;
    let (table_a, table_b) = ([4u32, 1], [0u32]);
    let seq_a = PagedSeq {
        tokens: 6,
        start: 0,
        blocks: &table_a,
    };
    let seq_b = || PagedSeq {
        tokens: 3,
        start: 0,
        blocks: &table_b,
    };
    let batch = PagedBatch::<Gpu>::new(vec![seq_a, seq_b()], n_heads, block_size, blocks, &device)
        .expect("batch");
    let slots: Vec<(u32, usize)> = (0..6)
        .map(|i| (table_a[i / block_size], i % block_size))
        .chain((0..3).map(|i| (table_b[0], i)))
        .collect();
    let tokens = slots.len();
    let matrix = |v: &[f32], rows: usize, cols: usize| {
        Tensor::<Gpu, 2>::from_data(TensorData::new(v.to_vec(), [rows, cols]), &device)
    };
    // Keys and values as the model passes them: column slices of one wider tensor. One
    // key row's largest magnitude twice, with both signs, and a value row of zeros (a
    // zero scale) try the encoders' edges.
    let mut wide = values(tokens * 2 * width, 21);
    wide[3 * 2 * width + 5] = 1.0;
    wide[3 * 2 * width + 9] = -1.0;
    for c in 0..dim {
        wide[4 * 2 * width + width + c] = 0.0;
    }
    let kv = matrix(&wide, tokens, 2 * width);
    let q = values(tokens * n_heads * dim, 22);
    let bytes_of = |pool: &DeviceKvPool<Gpu>| -> Vec<u8> {
        pool.words()
            .clone()
            .into_data()
            .convert::<i64>()
            .into_vec::<i64>()
            .expect("words")
            .iter()
            .flat_map(|&w| (w as u32).to_le_bytes())
            .collect()
    };

    for types in [
        KvCacheTypes::both(KvCacheType::Q8_0),
        KvCacheTypes::both(KvCacheType::Q4_0),
        KvCacheTypes::new(KvCacheType::F16, KvCacheType::Bf16),
        KvCacheTypes::new(KvCacheType::F32, KvCacheType::Q8_0),
    ] {
        let pool = |ty| DeviceKvPool::<Gpu>::zeros(ty, blocks, kv_heads, block_size, dim, &device);
        let (mut kp, mut vp) = (
            pool(types.keys).expect("keys"),
            pool(types.values).expect("values"),
        );
        let k = kv.clone().slice([0..tokens, 0..width]);
        let v = kv.clone().slice([0..tokens, width..2 * width]);
        Gpu::paged_store_encoded(&mut kp, k, &batch).expect("store keys");
        Gpu::paged_store_encoded(&mut vp, v, &batch).expect("store values");

        // Every written row holds the bytes the host's encoder gives its values (the
        // CPU backend's cache), every other row stays zero.
        let (k_bytes, v_bytes) = (bytes_of(&kp), bytes_of(&vp));
        for (half, ty, bytes) in [(0, types.keys, &k_bytes), (1, types.values, &v_bytes)] {
            let row_bytes = ty.row_bytes(dim).expect("row");
            let mut want = vec![0u8; bytes.len()];
            for (t, &(block, slot)) in slots.iter().enumerate() {
                for h in 0..kv_heads {
                    let at = t * 2 * width + half * width + h * dim;
                    let row = ((block as usize * kv_heads + h) * block_size + slot) * row_bytes;
                    ty.encode(&wide[at..at + dim], &mut want[row..row + row_bytes]);
                }
            }
            assert!(
                bytes == &want,
                "{types}: the device's {ty} rows are not the host's bytes"
            );
        }

        // Attention over the device's pools: the CPU kernel's result over the same
        // bytes, and sequence B alone bit for bit its rows in the batch.
        let got = Gpu::paged_attention_encoded(matrix(&q, tokens, n_heads * dim), &kp, &vp, &batch)
            .expect("attention")
            .into_data()
            .into_vec::<f32>()
            .expect("f32");
        let host = EncodedPagedPool {
            keys: (&k_bytes, types.keys),
            values: (&v_bytes, types.values),
            heads: kv_heads,
            block_size,
            dim,
        };
        let want = paged_attention_encoded(&q, n_heads, host, batch.seqs()).expect("cpu");
        let diff = max_diff(&got, &want);
        assert!(diff <= 1e-5, "{types}: {diff}");
        // The CPU's order and roundings: its bits (on its fused paths, see
        // `paged_attention_kernel_gives_the_cpu_reference`).
        if llama_burn::kernels::SimdPath::active() != llama_burn::kernels::SimdPath::Portable {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{types}: attention differs from the CPU's"
            );
        }
        let alone = PagedBatch::<Gpu>::new(vec![seq_b()], n_heads, block_size, blocks, &device)
            .expect("batch");
        let row = n_heads * dim;
        let b_alone = Gpu::paged_attention_encoded(matrix(&q[6 * row..], 3, row), &kp, &vp, &alone)
            .expect("attention")
            .into_data()
            .into_vec::<f32>()
            .expect("f32");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&b_alone), bits(&got[6 * row..]), "{types}");
    }

    // A row that is not whole words (q8_0 heads of 32 values: 34 bytes) is refused.
    assert!(matches!(
        DeviceKvPool::<Gpu>::zeros(KvCacheType::Q8_0, blocks, kv_heads, block_size, 32, &device),
        Err(LlamaError::InvalidParameter {
            name: "kv_cache_type",
            ..
        })
    ));
}

/// A block moved through bytes (the prefix cache on disk, host swap) lands in a device
/// pool as the host pool's bytes: written into one block of a GPU cache, read back the
/// same, its neighbours untouched, and the CPU cache given the same bytes reads them back
/// alike, so a block saved by one backend loads into the other.
#[test]
fn a_block_written_into_a_device_pool_reads_back_its_bytes() {
    use llama_burn::cache::paged::PagedKvCache;
    use llama_burn::cache::{KvCacheType, KvCacheTypes};

    let (layers, blocks, block_size, kv_heads, dim) = (2, 5, 4, 2, 64);
    for types in [
        KvCacheTypes::both(KvCacheType::Q8_0),
        KvCacheTypes::new(KvCacheType::Q4_0, KvCacheType::F16),
    ] {
        let mut gpu = PagedKvCache::<Gpu>::with_types(
            layers,
            blocks,
            block_size,
            kv_heads,
            dim,
            types,
            &Default::default(),
        )
        .expect("gpu cache");
        let mut cpu = PagedKvCache::<Flex>::with_types(
            layers,
            blocks,
            block_size,
            kv_heads,
            dim,
            types,
            &Default::default(),
        )
        .expect("cpu cache");
        let size = gpu.block_bytes();
        assert_eq!(size, cpu.block_bytes(), "{types}");
        let block: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
        gpu.write_block(3, &block).expect("write gpu");
        cpu.write_block(3, &block).expect("write cpu");
        assert!(
            gpu.read_block(3).expect("read") == block,
            "{types}: block 3"
        );
        assert!(
            cpu.read_block(3).expect("read") == block,
            "{types}: cpu block 3"
        );
        for other in [2, 4] {
            assert!(
                gpu.read_block(other).expect("read").iter().all(|&b| b == 0),
                "{types}: block {other} changed"
            );
        }
        assert!(matches!(
            gpu.write_block(3, &block[1..]),
            Err(LlamaError::InvalidParameter {
                name: "kv_block",
                ..
            })
        ));
    }
}

/// LoRA adapters on the GPU path: one paged step with rows of two adapters and a row
/// with none (the fused feed-forward kernel's rows recomputed apart for the adapter
/// rows) gives each row exactly its logits alone, and the CPU backend's within the
/// bound of the model test.
#[test]
fn lora_rows_share_a_gpu_step_and_give_the_cpu_logits() {
    use llama_burn::cache::PagedKvCache;
    use llama_burn::lora::{LoraAdapter, LoraFactors, LoraWeights};
    use llama_burn::model::PagedRow;

    let device = Default::default();
    let gpu = demo::<Gpu>(&device);
    let cpu = demo::<Flex>(&Default::default());
    let c = gpu.config().clone();
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/lora/peft");
    let peft = LoraAdapter::open(fixture, &c).expect("adapter");
    let negated = LoraAdapter::from_factors(
        "negated",
        &c,
        peft.tensors().map(|(layer, t, f)| {
            let b = f.b.iter().map(|v| -v).collect();
            (layer, t, LoraFactors { b, ..f.clone() })
        }),
    )
    .expect("negated");
    let ids: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| gpu.tokenizer.encode(p, true, false).expect("ids"))
        .collect();
    // Rows: prompt 0 with the adapter, prompt 1 with none, prompt 2 negated.
    let adapters_of = [Some(0), None, Some(1)];
    let run = |rows: &[usize], gpu_side: bool| -> Vec<Vec<f32>> {
        fn pass<B: LlamaBackend>(
            llama: &Llama<B, DynTokenizer>,
            adapters: &[LoraAdapter],
            ids: &[Vec<u32>],
            rows: &[usize],
            adapters_of: &[Option<usize>],
            device: &B::Device,
        ) -> Vec<Vec<f32>> {
            let c = llama.config();
            let weights: Vec<LoraWeights<B>> = adapters
                .iter()
                .map(|a| LoraWeights::new(a, c, device).expect("weights"))
                .collect();
            let refs: Vec<&LoraWeights<B>> = weights.iter().collect();
            let mut cache = PagedKvCache::<B>::new(
                c.n_layers,
                2 * rows.len(),
                16,
                c.n_kv_heads,
                c.head_dim,
                device,
            )
            .expect("pool");
            let tables: Vec<[u32; 2]> =
                (0..rows.len() as u32).map(|r| [2 * r, 2 * r + 1]).collect();
            let paged: Vec<PagedRow> = rows
                .iter()
                .zip(&tables)
                .map(|(&r, table)| PagedRow {
                    tokens: &ids[r],
                    start: 0,
                    blocks: table,
                    logits: true,
                    all_logits: false,
                    adapter: adapters_of[r],
                })
                .collect();
            let logits = llama
                .model
                .forward_paged_adapted(&paged, &refs, &mut cache)
                .expect("forward")
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32");
            logits.chunks(c.vocab_size).map(<[f32]>::to_vec).collect()
        }
        let adapters = [peft.clone(), negated.clone()];
        if gpu_side {
            pass(&gpu, &adapters, &ids, rows, &adapters_of, &device)
        } else {
            pass(
                &cpu,
                &adapters,
                &ids,
                rows,
                &adapters_of,
                &Default::default(),
            )
        }
    };
    let together = run(&[0, 1, 2], true);
    let on_cpu = run(&[0, 1, 2], false);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for r in 0..3 {
        let alone = run(&[r], true);
        assert_eq!(bits(&alone[0]), bits(&together[r]), "row {r} alone");
        let diff = max_diff(&together[r], &on_cpu[r]);
        eprintln!("lora row {r}: GPU vs CPU {diff:.2e}");
        assert!(diff <= 1e-3, "row {r}: {diff}");
    }
    // The adapters change the logits.
    let base = paged_last_logits(&gpu, &ids[0], &device).0;
    assert!(max_diff(&base, &together[0]) > 0.1);
}

#[test]
fn device_argmax_gives_the_host_greedy_token() {
    use burn::tensor::{Tensor, TensorData};

    // An odd vocabulary (not a multiple of the kernel's 256 units), rows with ties (the
    // first index wins), minus and plus infinity, signed zeros, a NaN and a row of minus
    // infinity (no token: the host path's error).
    let vocab = 1037;
    let mut rows: Vec<Vec<f32>> = (0..4).map(|r| values(vocab, 40 + r)).collect();
    rows[1][700] = 5.0;
    rows[1][300] = 5.0;
    rows[1][1036] = 5.0;
    rows[2][10] = f32::NEG_INFINITY;
    rows[2][900] = f32::INFINITY;
    rows[2][901] = f32::INFINITY;
    rows[3].iter_mut().for_each(|v| *v = -v.abs() - 1e-3);
    rows[3][513] = -0.0;
    rows[3][257] = 0.0;
    let mut nan = values(vocab, 50);
    nan[600] = f32::NAN;
    rows.push(nan);
    rows.push(vec![f32::NEG_INFINITY; vocab]);
    rows.push(vec![-1.0; vocab]);
    let want: Vec<Option<u32>> = rows
        .iter()
        .map(|r| {
            llama_burn::sampling::check_logits(r)
                .ok()
                .map(|()| llama_burn::sampling::argmax(r))
        })
        .collect();
    assert_eq!(want[1], Some(300));
    assert_eq!(want[2], Some(900));
    assert_eq!(want[3], Some(257));
    assert_eq!(want[6], Some(0));
    assert_eq!((want[4], want[5]), (None, None));

    let n = rows.len();
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    let logits =
        Tensor::<Gpu, 2>::from_data(TensorData::new(flat, [n, vocab]), &Default::default());
    let got = Gpu::greedy_tokens(&logits)
        .expect("wgpu argmax")
        .expect("the CubeCL backends have a device argmax");
    assert_eq!(got, want);
}

#[test]
fn device_sampling_draws_the_host_pipelines_tokens() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::sampling::{
        DeviceDraw, History, Pipeline, SamplingParams, reference_distribution, token_logprobs,
    };
    use rand::{Rng, SeedableRng, rngs::StdRng};

    // An odd vocabulary (several of the host's blocks of 512, not a multiple of the
    // kernel's 256 units); spread logits, and coarse ones (ties at the top-k cut).
    let vocab = 1500;
    let base = SamplingParams::default;
    let cases = [
        base(),
        SamplingParams {
            temperature: 0.7,
            ..base()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 40,
            ..base()
        },
        SamplingParams {
            top_p: 0.9,
            ..base()
        },
        SamplingParams {
            min_p: 0.05,
            ..base()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.8,
            min_p: 0.02,
            ..base()
        },
        SamplingParams::greedy(),
        // These keep the largest logit only.
        SamplingParams { top_k: 1, ..base() },
        SamplingParams {
            top_p: 1e-6,
            ..base()
        },
        SamplingParams {
            min_p: 1.0,
            ..base()
        },
    ];
    let mut rows: Vec<(Vec<f32>, SamplingParams, u64)> = Vec::new();
    for (c, params) in cases.iter().enumerate() {
        for r in 0..6u64 {
            let seed = 100 * c as u64 + r;
            let mut logits: Vec<f32> = values(vocab, seed).iter().map(|v| v * 6.0).collect();
            if r % 3 == 2 {
                logits
                    .iter_mut()
                    .for_each(|v| *v = (*v * 2.0).round() / 2.0);
            }
            rows.push((logits, params.clone(), seed));
        }
    }
    let draw = |params: &SamplingParams, seed: u64| DeviceDraw {
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        uniform: StdRng::seed_from_u64(seed).random(),
    };
    let device = Default::default();
    let run = |rows: &[&(Vec<f32>, SamplingParams, u64)]| {
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.0.clone()).collect();
        let logits =
            Tensor::<Gpu, 2>::from_data(TensorData::new(flat, [rows.len(), vocab]), &device);
        let draws: Vec<DeviceDraw> = rows.iter().map(|r| draw(&r.1, r.2)).collect();
        Gpu::sample_tokens(&logits, &draws)
            .expect("wgpu sampling")
            .expect("the CubeCL backends sample on the device")
    };
    let all: Vec<_> = rows.iter().collect();
    let got = run(&all);
    let mut differ = 0;
    for ((logits, params, seed), got) in rows.iter().zip(&got) {
        let got = got.expect("a finite row is drawn on the device");
        let want = Pipeline::new(params.clone(), *seed)
            .expect("params")
            .sample(logits, History::default())
            .expect("host draw");
        // The host's log-probability of the device's token.
        let host = token_logprobs(logits, got.token, 0).expect("logprobs");
        assert!(
            (got.logprob - host.chosen.logprob).abs() <= 1e-4,
            "{} vs {}",
            got.logprob,
            host.chosen.logprob
        );
        // Greedy: the first largest logit. Top-k 1, a tiny top-p, min-p 1: the largest
        // logit (or one tied with it).
        let top = llama_burn::sampling::argmax(logits);
        if params.temperature == 0.0 {
            assert_eq!(got.token, top);
        }
        if params.top_k == 1 || params.top_p < 1e-3 || params.min_p == 1.0 {
            assert_eq!(
                logits[got.token as usize], logits[top as usize],
                "{params:?}"
            );
        }
        if params.temperature == 0.0 {
            assert_eq!(got.token, want);
            continue;
        }
        let p = reference_distribution(params, logits);
        assert!(
            p[got.token as usize] > 0.0,
            "token {} outside the kept set ({params:?})",
            got.token
        );
        if got.token != want {
            // Only a uniform within rounding of a boundary of the host's intervals (its
            // cumulative mass in id order) may fall on another token.
            let u: f64 = StdRng::seed_from_u64(*seed).random();
            let mut mass = 0.0;
            let near = p.iter().any(|&q| {
                mass += q;
                q > 0.0 && (mass - u).abs() < 1e-5
            });
            assert!(
                near,
                "device {} vs host {want} at u = {u} ({params:?})",
                got.token
            );
            differ += 1;
        }
    }
    eprintln!(
        "device sampling: {differ} of {} rows differ from the host (at a boundary)",
        rows.len()
    );
    assert!(differ <= 2);

    // A row's token is the same alone and anywhere in a batch of other rows.
    let reversed: Vec<_> = rows.iter().rev().collect();
    let mut back = run(&reversed);
    back.reverse();
    assert_eq!(back, got);
    for i in (0..rows.len()).step_by(11) {
        assert_eq!(run(&[&rows[i]]), vec![got[i]]);
    }

    // Rows the device cannot draw are left to the host: a NaN, +inf, nothing finite.
    let mut nan = values(vocab, 1);
    nan[77] = f32::NAN;
    let mut inf = values(vocab, 2);
    inf[5] = f32::INFINITY;
    let bad = [
        (nan, base(), 1),
        (inf, base(), 2),
        (vec![f32::NEG_INFINITY; vocab], base(), 3),
    ];
    let bad: Vec<_> = bad.iter().collect();
    assert_eq!(run(&bad), vec![None, None, None]);
}

/// `values` rounded to f16, as f32 (what an f16 tensor of them holds).
fn rounded_to_f16(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| burn::tensor::f16::from_f32(v).to_f32())
        .collect()
}

#[test]
fn kernels_in_f16_accumulate_in_f32() {
    use burn::tensor::{DType, Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::kernels::attention::{PagedPool, PagedSeq, paged_attention};
    use llama_burn::kernels::{QuantFormat, QuantMatrix};
    use llama_burn::model::attention::PagedBatch;

    // f16 tensors on the f32 tests' device (an explicit type, not the device's default):
    // the kernels read half values and accumulate in f32, so each output is the f32
    // reference of the rounded inputs, rounded once to f16 (within an f16 ulp, 2^-11
    // relative; sums kept in f16 would be off by several).
    let device = Default::default();
    let half = |data: Vec<f32>, dims: [usize; 2]| {
        Tensor::<Gpu, 2>::from_data(TensorData::new(data, dims), (&device, DType::F16))
    };
    let read = |t: Tensor<Gpu, 2>| -> Vec<f32> {
        assert_eq!(t.dtype(), DType::F16);
        t.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32")
    };

    // Paged attention: a long sequence (many tiles of keys), a prompt chunk, two heads
    // per key/value head.
    let (n_heads, kv_heads, block_size, dim, blocks) = (4, 2, 7, 32, 40);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let seqs = vec![
        PagedSeq {
            tokens: 1,
            start: 250,
            blocks: &table,
        },
        PagedSeq {
            tokens: 3,
            start: 17,
            blocks: &table[5..],
        },
    ];
    let pool_len = blocks * kv_heads * block_size * dim;
    let (keys, vals) = (
        rounded_to_f16(&values(pool_len, 11)),
        rounded_to_f16(&values(pool_len, 12)),
    );
    let q = rounded_to_f16(&values(4 * n_heads * dim, 13));
    let pool = PagedPool {
        keys: &keys,
        values: &vals,
        heads: kv_heads,
        block_size,
        dim,
    };
    let want = paged_attention(&q, n_heads, pool, &seqs).expect("cpu reference");
    let pool_dims = [blocks, kv_heads, block_size, dim];
    let k = Tensor::<Gpu, 4>::from_data(TensorData::new(keys, pool_dims), (&device, DType::F16));
    let v = Tensor::<Gpu, 4>::from_data(TensorData::new(vals, pool_dims), (&device, DType::F16));
    let batch = PagedBatch::<Gpu>::new(seqs, n_heads, block_size, blocks, &device).expect("batch");
    let got =
        read(Gpu::paged_attention(half(q, [4, n_heads * dim]), &k, &v, &batch).expect("attention"));
    let worst = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-2))
        .fold(0f32, f32::max);
    eprintln!("f16 paged attention vs f32 reference: max relative diff {worst:e}");
    assert_eq!(got.len(), want.len());
    assert!(worst <= 1e-3, "{worst}");

    // The fused quantized products (one row per unit, and a tile of 4 rows).
    for (format, rows) in [
        (QuantFormat::Q8_0, 3),
        (QuantFormat::Q4_K, 3),
        (QuantFormat::Q6_K, 4),
        (QuantFormat::Q5_0, 4),
    ] {
        let (n_out, cols) = (19, 4 * format.block_values());
        let w = QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 14))
            .expect("quantize");
        let dense = w.dequantize().expect("dequantize");
        let x = rounded_to_f16(&values(rows * cols, 15));
        let want: Vec<f64> = (0..rows * n_out)
            .map(|i| {
                let (r, o) = (i / n_out, i % n_out);
                (0..cols)
                    .map(|c| f64::from(x[r * cols + c]) * f64::from(dense[o * cols + c]))
                    .sum()
            })
            .collect();
        let got = read(
            Gpu::quantized_matmul(half(x, [rows, cols]), &w, Precision::Exact).expect("matmul"),
        );
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| ((a - f64::from(*b)).abs() / a.abs().max(1.0)) as f32)
            .fold(0f32, f32::max);
        eprintln!("f16 {format:?} product vs f64 reference: max relative diff {worst:e}");
        assert!(worst <= 1e-3, "{format:?}: {worst}");
    }

    // The dense kernel (F16/BF16 checkpoints' projections), both layouts.
    let (rows, n_in, n_out) = (5, 300, 23);
    let x = rounded_to_f16(&values(rows * n_in, 16));
    let w = rounded_to_f16(&values(n_in * n_out, 17));
    for transposed in [false, true] {
        let at = |i: usize, o: usize| {
            if transposed {
                o * n_in + i
            } else {
                i * n_out + o
            }
        };
        let want: Vec<f64> = (0..rows * n_out)
            .map(|k| {
                let (r, o) = (k / n_out, k % n_out);
                (0..n_in)
                    .map(|i| f64::from(x[r * n_in + i]) * f64::from(w[at(i, o)]))
                    .sum()
            })
            .collect();
        let dims = if transposed {
            [n_out, n_in]
        } else {
            [n_in, n_out]
        };
        let got = read(
            Gpu::dense_matmul(
                half(x.clone(), [rows, n_in]),
                &half(w.clone(), dims),
                transposed,
            )
            .expect("dense"),
        );
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| ((a - f64::from(*b)).abs() / a.abs().max(1.0)) as f32)
            .fold(0f32, f32::max);
        eprintln!(
            "f16 dense product (transposed {transposed}) vs f64: max relative diff {worst:e}"
        );
        assert!(worst <= 1e-3, "{worst}");
    }
}

#[test]
#[cfg(not(feature = "cuda"))]
fn the_demo_model_in_f16_on_wgpu() {
    use burn::backend::wgpu::WgpuDevice;
    // Burn 0.21 fixes a device's float type at its first tensor, per device and not per
    // backend type: the other tests' f32 `Wgpu` on the default device would make this
    // model's tensors f32 were it first there. So the half model takes Mesa's software
    // driver by its other name, a device of its own.
    the_demo_model_in_half::<burn::backend::Wgpu<burn::tensor::f16>>(&WgpuDevice::Cpu);
}

#[test]
#[cfg(feature = "cuda")]
#[ignore = "a device's float type is fixed by its first tensor: run alone, --ignored --exact"]
fn the_demo_model_in_bf16() {
    the_demo_model_in_half::<burn::backend::Cuda<burn::tensor::bf16>>(&Default::default());
}

#[test]
#[cfg(feature = "cuda")]
#[ignore = "a device's float type is fixed by its first tensor: run alone, --ignored --exact"]
fn the_demo_model_in_f16() {
    the_demo_model_in_half::<burn::backend::Cuda<burn::tensor::f16>>(&Default::default());
}

/// The demo model in the half type of `Half` on `device`, against the CPU backend's f32:
/// logits within a half type's error, greedy tokens mostly the same, and batch invariance.
fn the_demo_model_in_half<Half: LlamaBackend>(device: &Half::Device) {
    use burn::tensor::DType;
    let mut cpu = demo::<Flex>(&Default::default());
    let gpu = demo::<Half>(device);
    let want_type = llama_burn::backend::float_type::<Half>(device).expect("a float type");
    let dtype: DType = want_type.dtype().into();
    eprintln!("the demo model in {want_type:?}");
    assert_ne!(dtype, DType::F32);
    assert!(
        <Half as burn::tensor::backend::Backend>::supports_dtype(device, dtype),
        "the device has no {dtype:?}"
    );

    // The last logits of a prompt on the engine's path (paged cache, our kernels), read
    // back as f32, within a half type's error of the CPU backend's f32 logits.
    let ids = cpu.encode_prompt(PROMPTS[0]).expect("encode");
    let want = cpu.logits(&ids).expect("cpu").pop().expect("a row");
    let (got, got_type) = paged_last_logits(&gpu, &ids, device);
    assert_eq!(got_type, dtype);
    let scale = want.iter().map(|x| x.abs()).fold(0f32, f32::max);
    let diff = want
        .iter()
        .zip(&got)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("{want_type:?} vs cpu f32: max |logit diff| {diff:e} (largest |logit| {scale:e})");
    assert_eq!(got.len(), want.len());
    // bf16 keeps 8 bits of mantissa to f16's 11, so its bound is four times as wide, and
    // only each continuation's first token must agree (the agreement is printed).
    let bf16 = dtype == DType::BF16;
    assert!(diff <= if bf16 { 2.0 } else { 0.5 }, "{diff}");

    // Greedy tokens through the continuous engine (the device argmax), each prompt alone,
    // against the CPU backend's f32 tokens: the common prefix of each continuation.
    let config = ContinuousConfig::default().with_kv_budget_tokens(1024);
    let engine = ContinuousEngine::start(gpu, config).expect("engine");
    let run = |prompts: &[&str]| -> Vec<Vec<u32>> {
        let jobs: Vec<_> = prompts
            .iter()
            .map(|p| {
                engine
                    .submit(GenerateRequest::new(*p).with_max_tokens(TOKENS))
                    .expect("submit")
            })
            .collect();
        jobs.into_iter()
            .map(|job| {
                let (tokens, _) = job.collect().expect("engine request");
                tokens.iter().map(|t| t.token_id).collect()
            })
            .collect()
    };
    let alone: Vec<Vec<u32>> = PROMPTS.iter().flat_map(|p| run(&[p])).collect();
    let mut agreed = 0;
    for ((prompt, got), want) in PROMPTS
        .iter()
        .zip(&alone)
        .zip(PROMPTS.map(|p| greedy(&mut cpu, p)))
    {
        let same = want.iter().zip(got).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{want_type:?} vs cpu f32, {prompt:?}: the first {same} of {TOKENS} tokens agree"
        );
        assert!(same >= 1, "{prompt:?}: {got:?} vs {want:?}");
        agreed += same;
    }
    eprintln!(
        "{want_type:?} vs cpu f32: {agreed} of {} greedy tokens agree",
        PROMPTS.len() * TOKENS
    );
    let least = if bf16 {
        PROMPTS.len()
    } else {
        PROMPTS.len() * TOKENS * 2 / 3
    };
    assert!(agreed >= least, "{agreed}");

    // Batch invariance holds in half: the rows submitted together give the tokens of the
    // same rows run one at a time.
    assert_eq!(run(&PROMPTS), alone);
}
