//! Folds a LoRA adapter into a GGUF model, offline: for serving one fine-tune only, the
//! merged file runs at the base model's speed with no adapter at run time. Every tensor
//! the adapter changes becomes `W + scale * B A` (computed in f32 from the dequantized
//! weight), in f32 or, with `--type same`, quantized again into the base tensor's own
//! format; the other tensors are copied as they are.
//!
//! ```sh
//! cargo run --release --example merge_lora -- --model base.gguf \
//!     --lora tests/fixtures/lora/peft --out merged.gguf
//! cargo run --release --example merge_lora -- --model base.gguf \
//!     --lora adapter.gguf --out merged.gguf --type same --json
//! ```

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use llama_burn::config::LlamaConfig;
use llama_burn::loader::gguf::GgufFile;
use llama_burn::lora::LoraAdapter;
use llama_burn::lora::merge::{MergedType, merge_gguf};

#[derive(Parser)]
#[command(about = "Fold a LoRA adapter into a GGUF model")]
struct Args {
    /// The base model (a GGUF file).
    #[arg(long)]
    model: PathBuf,
    /// The adapter: a PEFT directory or a GGUF LoRA file.
    #[arg(long)]
    lora: PathBuf,
    /// The merged model to write.
    #[arg(long)]
    out: PathBuf,
    /// The changed tensors' type: `f32` or `same` (the base tensor's format).
    #[arg(long = "type", default_value = "f32")]
    ty: String,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
}

fn run(args: &Args) -> llama_burn::Result<()> {
    let ty = match args.ty.as_str() {
        "f32" => MergedType::F32,
        "same" => MergedType::Same,
        other => {
            return Err(llama_burn::LlamaError::invalid(
                "type",
                other,
                "f32 or same",
            ));
        }
    };
    let start = Instant::now();
    let config = LlamaConfig::from_gguf(&GgufFile::open(&args.model)?)?;
    let adapter = LoraAdapter::open(&args.lora, &config)?;
    eprintln!(
        "adapter {}: rank {}, {} ({:.1} MB)",
        adapter.source(),
        adapter.rank(),
        adapter.modules().join(", "),
        adapter.bytes() as f64 / 1e6
    );
    let mut last = 0;
    let report = merge_gguf(&args.model, &adapter, &args.out, ty, |done, total| {
        let percent = done * 100 / total.max(1);
        if percent >= last + 10 {
            last = percent;
            eprintln!("merging: {percent}%");
        }
    })?;
    let seconds = start.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": args.model,
                "lora": args.lora,
                "out": args.out,
                "type": args.ty,
                "merged_tensors": report.merged,
                "copied_tensors": report.copied,
                "bytes": report.bytes,
                "seconds": seconds,
            })
        );
    } else {
        println!(
            "wrote {} ({:.1} MB): {} tensors merged, {} copied, in {seconds:.1} s",
            args.out.display(),
            report.bytes as f64 / 1e6,
            report.merged,
            report.copied
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
