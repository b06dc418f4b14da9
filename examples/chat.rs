//! Chat with a model in its chat format, streaming tokens as they come.
//!
//! ```sh
//! cargo run --release --example chat                      # interactive
//! cargo run --release --example chat -- --prompt "Hi!"    # one turn
//! ```

mod common;

use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::Parser;
use common::{B, run_on_model};
use llama_burn::llama::Llama;
use llama_burn::sampling::{Sampler, TopP};
use llama_burn::tokenizer::{ChatMessage, Tokenizer};

#[derive(Parser, Debug)]
#[command(about = "Chat with a Llama-architecture model")]
struct Args {
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Answer this one message and exit (otherwise read messages from stdin).
    #[arg(long)]
    prompt: Option<String>,
    /// Largest number of tokens per answer.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    top_p: f64,
    /// Sampling seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Context window to allocate.
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    #[command(flatten)]
    options: common::ModelOptions,
}

/// What the example does with the loaded model.
fn run(args: &Args, mut llama: Llama<B>) -> llama_burn::Result<()> {
    let format = llama.tokenizer.chat_format().ok_or_else(|| {
        llama_burn::LlamaError::Tokenizer("this model has no known chat format".into())
    })?;
    let mut sampler = Sampler::TopP(TopP::new(args.top_p, args.seed));
    let mut history: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        let user = match &args.prompt {
            Some(p) => p.clone(),
            None => {
                print!("> ");
                std::io::stdout().flush().ok();
                match lines.next() {
                    Some(Ok(line)) if !line.trim().is_empty() => line,
                    Some(Ok(_)) => continue,
                    _ => break,
                }
            }
        };
        history.push(ChatMessage::user(&user));
        let prompt = format.format(&history, true);
        let mut state = llama.create_generation_state(&prompt, args.max_tokens)?;
        let mut answer = String::new();
        loop {
            let (_, piece, done) =
                llama.generate_single_token(&mut state, args.temperature, &mut sampler)?;
            print!("{piece}");
            std::io::stdout().flush().ok();
            answer.push_str(&piece);
            if done {
                break;
            }
        }
        println!();
        history.push(ChatMessage::assistant(&answer));
        if args.prompt.is_some() {
            break;
        }
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
