//! Helpers shared by the examples: loading a model from `--model` or the demo model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use llama_burn::Result;
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::llama::{Llama, LlamaConfig};
use llama_burn::tokenizer::Tokenizer;

/// The backend chosen by cargo features.
pub type B = DefaultBackend;

/// Something to do with a loaded model, whatever its tokenizer type.
pub trait WithModel {
    /// The result.
    type Output;
    /// Runs on the loaded model.
    fn run<T: Tokenizer>(self, llama: Llama<B, T>) -> Result<Self::Output>;
}

/// Loads `--model PATH` (a `.gguf` file or a Hugging Face directory), or the demo model,
/// and hands it to `job`.
pub fn with_model<J: WithModel>(
    model: Option<&Path>,
    max_seq_len: usize,
    job: J,
) -> Result<J::Output> {
    let path: PathBuf = match model {
        Some(p) => p.to_path_buf(),
        None => llama_burn::demo::demo_model_path()?,
    };
    let device = default_device();
    if path.is_dir() {
        job.run(LlamaConfig::load_hf_dir::<B>(&path, max_seq_len, &device)?)
    } else {
        job.run(LlamaConfig::load_gguf::<B>(&path, max_seq_len, &device)?)
    }
}

/// Name of the model for reports.
pub fn model_name(model: Option<&Path>) -> String {
    match model {
        Some(p) => p.display().to_string(),
        None => "SmolLM2-135M-Instruct (demo, Q4_1 GGUF dequantized to f32)".to_string(),
    }
}
