//! Writes a random-weight Llama GGUF of a real model's shape in a chosen type, with the
//! demo model's tokenizer, to measure speed at real sizes with no download (the text it
//! generates is noise). Streams the file: memory stays at a few megabytes.
//!
//! ```sh
//! cargo run --release --example random_gguf -- --shape 1b --type Q4_K_M --out 1b.Q4_K_M.gguf
//! cargo run --release --example random_gguf -- --shape 8b --type Q8_0 --out 8b.Q8_0.gguf --json
//! ```
//!
//! Types: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, and the
//! presets Q4_K_M and Q5_K_M (as llama-quantize mixes them: Q6_K for the embeddings and
//! for attn_v/ffn_down in some layers). As llama-quantize does, a quantized type other
//! than Q8_0 stores the tied embeddings (the output head) in Q6_K; `--pure` keeps every
//! matrix in the one type. Shapes: 1b (Llama 3.2 1B: 16 layers, d 2048, 32/8 heads, ffn
//! 8192), 3b (28 layers, d 3072, 24/8 heads, ffn 8192), 8b (Llama 3.1 8B: 32 layers, d
//! 4096, 32/8 heads, ffn 14336), all with the demo tokenizer's 49152-token vocabulary
//! and tied embeddings, as `../shared/bench/make_random_llama.py` writes them.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use llama_burn::loader::gguf::GgufFile;
use llama_burn::loader::random::{
    WeightTypes, metadata, shape, tokenizer_metadata, write_random_llama,
};

#[derive(Parser)]
#[command(about = "Write a random-weight Llama GGUF of a named shape")]
struct Args {
    /// Model shape: 1b, 3b or 8b.
    #[arg(long, default_value = "1b")]
    shape: String,
    /// Storage type of the matrices (see the example's documentation).
    #[arg(long = "type", default_value = "Q4_K_M")]
    ty: String,
    /// Every matrix in the one type (no Q6_K embeddings).
    #[arg(long)]
    pure: bool,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// GGUF file whose tokenizer is copied in (default: the demo model).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Seed of the random values.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
}

fn run(args: &Args) -> llama_burn::Result<()> {
    let source = match &args.tokenizer {
        Some(p) => p.clone(),
        None => llama_burn::demo::demo_model_path()?,
    };
    let (tokenizer, vocab) = tokenizer_metadata(&GgufFile::open(&source)?)?;
    let config = shape(&args.shape, vocab)?;
    let types = WeightTypes::parse(&args.ty, args.pure)?;
    let name = format!("random-llama-{}", args.shape);
    let meta = metadata(&config, &name, &types, &tokenizer);
    let start = Instant::now();
    let mut last_pct = u64::MAX;
    let mut progress = |done: u64, total: u64| {
        let pct = done * 100 / total.max(1);
        if pct != last_pct {
            last_pct = pct;
            let secs = start.elapsed().as_secs_f64();
            eprint!(
                "\rwriting {}: {pct:3}% ({:.0} of {:.0} MB, {:.0} MB/s)",
                args.out.display(),
                done as f64 / 1e6,
                total as f64 / 1e6,
                done as f64 / 1e6 / secs.max(1e-9)
            );
            if done == total {
                eprintln!();
            }
        }
    };
    let summary = write_random_llama(&args.out, &config, &types, &meta, args.seed, &mut progress)?;
    let seconds = start.elapsed().as_secs_f64();
    let file_bytes = std::fs::metadata(&args.out)
        .map_err(|e| llama_burn::LlamaError::io(&args.out, e))?
        .len();
    if args.json {
        let json = serde_json::json!({
            "path": args.out.display().to_string(),
            "shape": args.shape,
            "type": args.ty.to_ascii_uppercase(),
            "pure": args.pure,
            "seed": args.seed,
            "layers": config.n_layers,
            "d_model": config.d_model,
            "heads": config.n_heads,
            "kv_heads": config.n_kv_heads,
            "ffn": config.ffn_hidden,
            "vocab": config.vocab_size,
            "tensors": summary.tensors,
            "parameters": summary.parameters,
            "file_bytes": file_bytes,
            "seconds": seconds,
        });
        println!("{json}");
    } else {
        println!(
            "wrote {} ({} tensors, {:.2} B parameters, {:.2} GB) in {seconds:.1} s",
            args.out.display(),
            summary.tensors,
            summary.parameters as f64 / 1e9,
            file_bytes as f64 / 1e9
        );
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
