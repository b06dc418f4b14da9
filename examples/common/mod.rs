//! Helpers shared by the examples: loading a model from `--model` or the demo model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use llama_burn::Loader;
use llama_burn::backend::{DefaultBackend, LlamaBackend, default_device, set_float_type};
use llama_burn::kernels::QuantFormat;
use llama_burn::llama::Llama;
use llama_burn::{FloatType, Precision, Result};

/// The backend chosen by cargo features.
pub type B = DefaultBackend;

/// How the examples load a model: `--precision` and `--quantize`.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelOptions {
    /// How the CPU kernels multiply quantized weights: `fast` (8-bit activations,
    /// integer dot products) or `exact` (f32 activations, exactly dequantized weights).
    /// Default: `exact` for models under one billion parameters (the demo model), else
    /// `fast` where the CPU has integer kernels (x86-64 with AVX-512 VNNI or AVX2).
    #[arg(long)]
    pub precision: Option<Precision>,
    /// Quantize a Hugging Face checkpoint's f32/f16/bf16 matrices in memory at load
    /// (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K or Q6_K; a matrix whose rows are
    /// not whole K-quant blocks of 256 stays dense).
    #[arg(long)]
    pub quantize: Option<QuantFormat>,
    /// The float type of activations, dense weights and the KV cache: `f32`, or `f16` /
    /// `bf16` on the GPU backends (CubeCL kernels accumulate in f32; logits are read back
    /// as f32). The CPU backend takes them too, converting to f32 around its kernels.
    #[arg(long, default_value_t = FloatType::F32)]
    pub dtype: FloatType,
    /// Skip the loader's warm-up on the GPU backends (one forward pass of each kind at
    /// load, so the first request does not compile kernels): a faster start where the
    /// first request's wait does not matter, as in CI's short runs on a software driver.
    #[arg(long)]
    pub no_warm_up: bool,
}

/// Loads `--model PATH` (a `.gguf` file or a Hugging Face directory), or the demo model,
/// as `options` say.
pub fn load_model(
    model: Option<&Path>,
    max_seq_len: usize,
    options: &ModelOptions,
) -> Result<Llama<B>> {
    load_model_as::<B>(model, max_seq_len, options, &default_device())
}

/// [`load_model`] on backend `C` and `device`, whose float type `--dtype` sets first.
pub fn load_model_as<C: LlamaBackend>(
    model: Option<&Path>,
    max_seq_len: usize,
    options: &ModelOptions,
    device: &C::Device,
) -> Result<Llama<C>> {
    let path: PathBuf = match model {
        Some(p) => p.to_path_buf(),
        None => llama_burn::demo::demo_model_path()?,
    };
    set_float_type::<C>(device, options.dtype)?;
    let mut loader = Loader::path(&path)
        .max_seq_len(max_seq_len)
        .warm_up(!options.no_warm_up);
    if let Some(format) = options.quantize {
        loader = loader.quantize(format);
    }
    if let Some(precision) = options.precision {
        loader = loader.precision(precision);
    }
    loader.load::<C>(device)
}

/// Loads the model, runs `job` on it, and exits with the error if either fails.
pub fn run_on_model(
    model: Option<&Path>,
    max_seq_len: usize,
    options: &ModelOptions,
    job: impl FnOnce(Llama<B>) -> Result<()>,
) {
    exit_on_error(load_model(model, max_seq_len, options).and_then(job));
}

/// Prints the error and exits with status 1 if `result` is one.
pub fn exit_on_error(result: Result<()>) {
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// Name of the model for reports.
pub fn model_name(model: Option<&Path>) -> String {
    match model {
        Some(p) => p.display().to_string(),
        None => "SmolLM2-135M-Instruct (demo, Q4_1 GGUF)".to_string(),
    }
}

/// The trained context length of `--model PATH` (or of the demo model).
pub fn context_length(model: Option<&Path>) -> Result<usize> {
    let path: PathBuf = match model {
        Some(p) => p.to_path_buf(),
        None => llama_burn::demo::demo_model_path()?,
    };
    let config = Loader::path(&path).config()?;
    Ok(config.context_length)
}

/// Peak resident memory of this process since the last [`reset_peak_rss`], in bytes
/// (Linux; `None` elsewhere).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the peak resident memory counter (Linux: writes 5 to `/proc/self/clear_refs`).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
