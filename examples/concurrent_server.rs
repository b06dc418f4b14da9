//! The concurrent strategy through the job runtime: a single-request baseline, three
//! requests interleaving (visibly), cancellation, and a stress run.
//!
//! ```sh
//! cargo run --release --example concurrent_server
//! cargo run --release --example concurrent_server --features llama3,cuda -- --model DIR
//! ```

mod common;

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use clap::Parser;
use common::{B, run_on_model};
use llama_burn::inference::{GenerateRequest, InferenceBuilder, concurrent_streaming_handler};
use llama_burn::llama::Llama;

#[derive(Parser, Debug)]
#[command(about = "Concurrent requests over one model")]
struct Args {
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Requests in the stress run.
    #[arg(long, default_value_t = 12)]
    stress: usize,
    #[command(flatten)]
    options: common::ModelOptions,
}

/// What the example does with the loaded model.
// Devices are `Copy` only on the CPU backend; GPU devices must be cloned.
#[allow(clippy::clone_on_copy)]
fn run(args: &Args, llama: Llama<B>) -> llama_burn::Result<()> {
    let device = llama.device().clone();
    let inference = InferenceBuilder::new()
        .with_model(llama)
        .build(concurrent_streaming_handler);

    println!("== 1. single request (baseline)");
    let t = Instant::now();
    let job = inference
        .infer(GenerateRequest::new("The capital of France is").with_max_tokens(20))
        .with_devices([device.clone()])
        .spawn();
    let mut first = None;
    for token in job.stream.iter() {
        first.get_or_insert_with(|| t.elapsed().as_secs_f64());
        print!("{}", token.token);
    }
    job.join()?;
    println!("\n   ({:.2} s)\n", t.elapsed().as_secs_f64());
    if let Some(first) = first {
        // The model is loaded before `run`: this is the wait of the first request.
        eprintln!("first token: {first:.3} s after the model loaded");
    }

    println!("== 2. three concurrent requests (each token is tagged with its request)");
    let prompts = [
        "Once upon a time",
        "The three primary colours are",
        "def add(a, b):",
    ];
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    let jobs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let job = inference
                .infer(GenerateRequest::new(*p).with_max_tokens(16))
                .spawn();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for token in job.stream.iter() {
                    let _ = tx.send((i, token.token));
                }
                job.join()
            })
        })
        .collect();
    drop(tx);
    let mut texts = vec![String::new(); prompts.len()];
    for (i, piece) in rx {
        print!("[{}]{:?} ", i + 1, piece);
        texts[i].push_str(&piece);
    }
    for j in jobs {
        j.join()
            .map_err(|_| llama_burn::LlamaError::Runtime("consumer panicked".into()))??;
    }
    println!("\n");
    for (p, text) in prompts.iter().zip(&texts) {
        println!("   {p}{text}");
    }
    println!("   ({:.2} s for all three)\n", t.elapsed().as_secs_f64());

    println!("== 3. cancellation");
    let job = inference
        .infer(GenerateRequest::new("Count slowly: one, two,").with_max_tokens(100))
        .spawn();
    let mut received = 0;
    for token in job.stream.iter() {
        print!("{}", token.token);
        received += 1;
        if received == 5 {
            job.cancel();
        }
    }
    println!(
        "\n   cancelled after {received} tokens: {:?}\n",
        job.join().err()
    );

    println!("== 4. stress: {} requests at once", args.stress);
    let t = Instant::now();
    let jobs: Vec<_> = (0..args.stress)
        .map(|i| {
            inference
                .infer(
                    GenerateRequest::new(format!("Fact number {i} about the ocean:"))
                        .with_max_tokens(12),
                )
                .spawn()
        })
        .collect();
    let mut total = 0;
    for job in jobs {
        total += job.stream.iter().count();
        job.join()?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "   {total} tokens in {secs:.2} s ({:.1} tokens/s), every request completed",
        total as f64 / secs
    );
    Ok(())
}

fn main() {
    let args = Args::parse();
    run_on_model(args.model.as_deref(), 2048, &args.options, |llama| {
        run(&args, llama)
    });
}
