//! The batched API on a randomly initialised small Llama (no download needed): shows
//! `create_batched_generation_state`, `generate_batched_single_token` and
//! `generate_batch`, and measures sequential against batched throughput.
//!
//! ```sh
//! cargo run --release --example simple_batch
//! ```

use std::time::Instant;

use llama_burn::backend::{BACKEND_NAME, DefaultBackend, default_device};
use llama_burn::config::{LlamaConfig, RopeFrequencies};
use llama_burn::inference::generate_batch;
use llama_burn::llama::Llama;
use llama_burn::model::Transformer;
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::GgufBpeTokenizer;

fn main() -> llama_burn::Result<()> {
    // A small Llama: 4 layers, GQA 8 query / 2 key-value heads, byte-level vocabulary.
    let config = LlamaConfig {
        vocab_size: 257,
        d_model: 256,
        n_layers: 4,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 32,
        ffn_hidden: 688,
        norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_frequencies: RopeFrequencies::Plain,
        tie_embeddings: true,
        context_length: 512,
        max_seq_len: 512,
        precision: Default::default(),
    };
    let device = default_device();
    let model = Transformer::<DefaultBackend>::random(config, 7, &device)?;
    let mut llama = Llama::new(model, GgufBpeTokenizer::bytes_only()?)?;
    println!("random 4-layer Llama on {BACKEND_NAME}");

    let prompts = [
        "Hello",
        "The quick brown fox",
        "A",
        "Batching is efficient because",
    ];
    let n = 32;

    // Step by step: one forward pass advances every row.
    let mut state = llama.create_batched_generation_state(&prompts, n)?;
    let mut samplers = vec![Sampler::Argmax; prompts.len()];
    let mut steps = 0;
    while !state.is_done() {
        llama.generate_batched_single_token(&mut state, 0.0, &mut samplers)?;
        steps += 1;
    }
    println!("{} rows finished in {steps} batched steps", state.len());

    // Batch invariance: every row equals its solo run.
    for (prompt, row) in prompts.iter().zip(state.rows()) {
        let alone = llama.generate(prompt, n, 0.0, &mut Sampler::Argmax)?;
        assert_eq!(
            row.tokens(),
            alone.tokens.as_slice(),
            "batched row differs from solo run"
        );
    }
    println!("every row matches its solo run token for token");

    // Throughput: sequential vs one batch.
    let many: Vec<String> = (0..16).map(|i| format!("prompt number {i}")).collect();
    let t = Instant::now();
    for p in &many {
        llama.generate(p, n, 0.0, &mut Sampler::Argmax)?;
    }
    let sequential = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let results = generate_batch(&mut llama, &many, n, 0.0, 1.0, 0)?;
    let batched = t.elapsed().as_secs_f64();
    let tokens = many.len() * n;
    println!(
        "{} prompts x {n} tokens: sequential {:.2} s ({:.0} tokens/s), batched {:.2} s ({:.0} tokens/s), {:.1}x",
        many.len(),
        sequential,
        tokens as f64 / sequential,
        batched,
        tokens as f64 / batched,
        sequential / batched
    );
    println!(
        "first row's text (random weights, so noise): {:?}",
        results[0].concat()
    );
    Ok(())
}
