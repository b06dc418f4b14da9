//! Generates a continuation of one prompt (the sequential strategy).
//!
//! ```sh
//! cargo run --release --example generate -- --prompt "The capital of France is" --max-tokens 32
//! cargo run --release --example generate -- --chat --prompt "What is Rust?" --json
//! # speculative decoding (the same tokens, fewer forward passes): prompt lookup, or a draft
//! # model sharing the tokenizer (here the demo model drafting for itself)
//! cargo run --release --example generate -- --chat --prompt-file paragraph.txt --speculative ngram --draft-tokens 8 --json
//! cargo run --release --example generate -- --speculative draft --draft-model demo --json
//! ```

mod common;

use std::path::PathBuf;

use clap::Parser;
use common::{B, load_model, model_name, run_on_model};
use llama_burn::llama::Llama;
use llama_burn::sampling::{Sampler, TopP};
use llama_burn::speculative::{SpeculationConfig, SpeculationMethod};
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
    /// Read the prompt from this file instead of --prompt.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
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
    /// Speculative decoding: `ngram` (prompt lookup) or `draft` (needs --draft-model).
    #[arg(long)]
    speculative: Option<SpeculationMethod>,
    /// The draft model of `--speculative draft`: a .gguf file or Hugging Face directory
    /// sharing the model's tokenizer, or `demo` for the demo model.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Most tokens proposed per step (the step's count adapts below it).
    #[arg(long, default_value_t = 8)]
    draft_tokens: usize,
    /// A forward step's fixed cost in units of one more position: proposals are
    /// verified only while they are expected to raise tokens per unit of cost (2 fits a
    /// small model on a CPU; a GPU's decode step is larger, 16-64).
    #[arg(long, default_value_t = llama_burn::speculative::DEFAULT_STEP_OVERHEAD)]
    step_overhead: u32,
    /// Keep generating past stop tokens, up to --max-tokens.
    #[arg(long)]
    ignore_eos: bool,
}

/// What the example does with the loaded model.
fn run(args: &Args, mut llama: Llama<B>) -> llama_burn::Result<()> {
    let text = match &args.prompt_file {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| llama_burn::LlamaError::io(path, e))?
        }
        None => args.prompt.clone(),
    };
    if let Some(path) = &args.draft_model {
        let path = (path.as_os_str() != "demo").then_some(path.as_path());
        llama.set_draft_model(load_model(path, args.max_seq_len, &args.options)?)?;
    }
    let prompt = if args.chat {
        let format = llama.tokenizer.chat_format().ok_or_else(|| {
            llama_burn::LlamaError::Tokenizer("this model has no known chat format".into())
        })?;
        format.format(&[ChatMessage::user(&text)], true)
    } else {
        text
    };
    let mut sampler = Sampler::TopP(TopP::new(args.top_p, args.seed));
    let mut state = llama.create_generation_state(&prompt, args.max_tokens)?;
    if args.ignore_eos {
        state = state.ignore_stop_tokens();
    }
    if let Some(method) = args.speculative {
        let config = SpeculationConfig {
            method,
            step_overhead: args.step_overhead,
            ..SpeculationConfig::ngram(args.draft_tokens)
        };
        state = llama.with_speculation(state, &config)?;
    }
    let out = llama.run_to_end(&mut state, args.temperature, &mut sampler)?;
    let spec = out.speculation.unwrap_or_default();
    if args.json {
        let json = serde_json::json!({
            "model": model_name(args.model.as_deref()),
            "backend": llama_burn::backend::BACKEND_NAME,
            "precision": llama.config().precision.name(),
            "dtype": llama_burn::backend::float_type::<B>(llama.device())
                .map_or("other", llama_burn::FloatType::name),
            "prompt": prompt,
            "prompt_tokens": out.prompt_tokens,
            "tokens": out.tokens,
            "text": out.text,
            "stop_reason": format!("{:?}", out.stop_reason),
            "prompt_ms": out.prompt_time.as_secs_f64() * 1e3,
            "decode_ms": out.decode_time.as_secs_f64() * 1e3,
            "decode_tokens_per_s": out.decode_tokens_per_s(),
            "speculative": args.speculative.map(|m| m.to_string()),
            "draft_tokens": spec.draft_tokens,
            "accepted_draft_tokens": spec.accepted_draft_tokens,
        });
        println!("{json}");
    } else {
        println!("{prompt}{}", out.text);
        eprintln!(
            "\n[{} prompt tokens in {:.0} ms; {} tokens at {:.1} tokens/s; stopped: {:?}]",
            out.prompt_tokens.len(),
            out.prompt_time.as_secs_f64() * 1e3,
            out.tokens.len(),
            out.decode_tokens_per_s(),
            out.stop_reason
        );
        if args.speculative.is_some() {
            eprintln!(
                "[speculation: {} of {} proposed tokens accepted ({:.0}%)]",
                spec.accepted_draft_tokens,
                spec.draft_tokens,
                100.0 * spec.acceptance_rate()
            );
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
