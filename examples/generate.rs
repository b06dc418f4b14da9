//! Generates a continuation of one prompt (the sequential strategy).
//!
//! ```sh
//! cargo run --release --example generate -- --prompt "The capital of France is" --max-tokens 32
//! cargo run --release --example generate -- --chat --prompt "What is Rust?" --json
//! ```

mod common;

use std::path::PathBuf;

use clap::Parser;
use common::{B, model_name, run_on_model};
use llama_burn::llama::Llama;
use llama_burn::sampling::{Sampler, TopP};
use llama_burn::tokenizer::{ChatMessage, Tokenizer};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Llama-architecture model")]
struct Args {
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt; without --chat it is fed as it is (special tokens in it are honoured).
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    /// Largest number of tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    top_p: f64,
    /// Sampling seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Context window to allocate.
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    #[command(flatten)]
    options: common::ModelOptions,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// What the example does with the loaded model.
fn run(args: &Args, mut llama: Llama<B>) -> llama_burn::Result<()> {
    let prompt = if args.chat {
        let format = llama.tokenizer.chat_format().ok_or_else(|| {
            llama_burn::LlamaError::Tokenizer("this model has no known chat format".into())
        })?;
        format.format(&[ChatMessage::user(&args.prompt)], true)
    } else {
        args.prompt.clone()
    };
    let mut sampler = Sampler::TopP(TopP::new(args.top_p, args.seed));
    let out = llama.generate(&prompt, args.max_tokens, args.temperature, &mut sampler)?;
    if args.json {
        let json = serde_json::json!({
            "model": model_name(args.model.as_deref()),
            "backend": llama_burn::backend::BACKEND_NAME,
            "precision": llama.config().precision.name(),
            "prompt": prompt,
            "prompt_tokens": out.prompt_tokens,
            "tokens": out.tokens,
            "text": out.text,
            "stop_reason": format!("{:?}", out.stop_reason),
            "prompt_ms": out.prompt_time.as_secs_f64() * 1e3,
            "decode_ms": out.decode_time.as_secs_f64() * 1e3,
            "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        println!("{json}");
    } else {
        println!("{}{}", args.prompt, out.text);
        eprintln!(
            "\n[{} prompt tokens in {:.0} ms; {} tokens at {:.1} tokens/s; stopped: {:?}]",
            out.prompt_tokens.len(),
            out.prompt_time.as_secs_f64() * 1e3,
            out.tokens.len(),
            out.decode_tokens_per_s(),
            out.stop_reason
        );
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    run_on_model(
        args.model.as_deref(),
        args.max_seq_len,
        &args.options,
        |llama| run(&args, llama),
    );
}
