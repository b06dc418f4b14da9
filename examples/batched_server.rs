//! The batched strategy: a basic batch, throughput against sequential, variable-length
//! prompts, a large-batch stress run, and streaming batched output.
//!
//! ```sh
//! cargo run --release --example batched_server
//! ```

mod common;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use common::{B, run_on_model};
use llama_burn::inference::generate_batch;
use llama_burn::llama::Llama;
use llama_burn::sampling::Sampler;

#[derive(Parser, Debug)]
#[command(about = "Batched generation")]
struct Args {
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Rows in the stress run.
    #[arg(long, default_value_t = 32)]
    stress: usize,
    #[command(flatten)]
    options: common::ModelOptions,
}

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Explain quantum computing in one sentence.",
    "What are the three laws of robotics?",
    "Write a haiku about autumn.",
];

/// What the example does with the loaded model.
fn run(args: &Args, mut llama: Llama<B>) -> llama_burn::Result<()> {
    let n = args.max_tokens;
    println!("== 1. basic batch ({} prompts, greedy)", PROMPTS.len());
    let t = Instant::now();
    let results = generate_batch(&mut llama, PROMPTS, n, 0.0, 1.0, 42)?;
    for (p, pieces) in PROMPTS.iter().zip(&results) {
        println!("   {p} ->{}", pieces.concat().replace('\n', " "));
    }
    println!("   ({:.2} s)\n", t.elapsed().as_secs_f64());

    println!(
        "== 2. throughput: sequential vs batched, {} prompts x {n} tokens",
        PROMPTS.len() * 2
    );
    let prompts: Vec<&str> = PROMPTS.iter().chain(PROMPTS).copied().collect();
    let t = Instant::now();
    let mut seq_tokens = 0;
    for p in &prompts {
        seq_tokens += llama
            .generate(p, n, 0.0, &mut Sampler::Argmax)?
            .tokens
            .len();
    }
    let seq = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut state = llama.create_batched_generation_state(&prompts, n)?;
    llama.run_batch_to_end(&mut state, 0.0, &mut vec![Sampler::Argmax; prompts.len()])?;
    let bat = t.elapsed().as_secs_f64();
    let bat_tokens: usize = state.rows().iter().map(|r| r.tokens().len()).sum();
    println!(
        "   sequential {seq:.2} s ({:.1} tokens/s), batched {bat:.2} s ({:.1} tokens/s): {:.1}x\n",
        seq_tokens as f64 / seq,
        bat_tokens as f64 / bat,
        seq / bat
    );

    println!("== 3. variable-length prompts (left padding + mask: each row as if alone)");
    let long = "Tell me everything about the history of the printing press, its inventors, \
                and how it changed the spread of knowledge in Europe and beyond.";
    let varied = ["Hi", "Name a colour.", long];
    let results = generate_batch(&mut llama, &varied, 16, 0.0, 1.0, 0)?;
    for (p, pieces) in varied.iter().zip(&results) {
        let alone = llama.generate(p, 16, 0.0, &mut Sampler::Argmax)?.text;
        let same = if alone == pieces.concat() {
            "same as alone"
        } else {
            "DIFFERS from alone"
        };
        println!(
            "   [{same}] {:.40}... ->{}",
            p,
            pieces.concat().replace('\n', " ")
        );
    }
    println!();

    println!(
        "== 4. stress: {} rows x {n} tokens in one batch",
        args.stress
    );
    let many: Vec<String> = (0..args.stress)
        .map(|i| format!("Fact {i}: the ocean"))
        .collect();
    let t = Instant::now();
    let results = generate_batch(&mut llama, &many, n, 0.7, 0.9, 7)?;
    let secs = t.elapsed().as_secs_f64();
    let pieces: usize = results.iter().map(Vec::len).sum();
    println!(
        "   {pieces} text pieces in {secs:.2} s ({:.1} pieces/s)\n",
        pieces as f64 / secs
    );

    println!("== 5. streaming batched output (tokens as each step produces them)");
    let mut state = llama.create_batched_generation_state(&PROMPTS[..2], 12)?;
    let mut samplers = vec![Sampler::Argmax; 2];
    while !state.is_done() {
        let steps = llama.generate_batched_single_token(&mut state, 0.0, &mut samplers)?;
        let shown: Vec<String> = steps
            .iter()
            .map(|s| {
                s.as_ref()
                    .map_or("-".to_string(), |(_, piece, _)| format!("{piece:?}"))
            })
            .collect();
        println!("   step: {}", shown.join(" | "));
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    run_on_model(args.model.as_deref(), 2048, &args.options, |llama| {
        run(&args, llama)
    });
}
