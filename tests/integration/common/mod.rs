//! Shared helpers for the integration tests: the real demo model on the CPU backend.
#![allow(dead_code)]

#[cfg(feature = "server")]
pub mod process;
#[cfg(feature = "server")]
pub mod server;

use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::llama::Llama;
use llama_burn::tokenizer::DynTokenizer;

/// The backend the tests run on.
pub type B = DefaultBackend;
/// The demo model type.
pub type Demo = Llama<B, DynTokenizer>;

/// Loads the demo model (SmolLM2-135M-Instruct), fetching it on first use, in the
/// `exact` precision: several tests state what the demo model answers (a chat reply
/// that ends at its stop token, "Paris"), which is the fp32 reference's behaviour. The
/// `fast` precision (the library's default) is held to the same invariance claims in
/// `tests/integration/batch_invariance.rs` and reported against the reference in `tests/integration/reference.rs`.
pub fn demo(max_seq_len: usize) -> Demo {
    let path = llama_burn::demo::demo_model_path().expect("demo model available");
    llama_burn::Loader::gguf(path)
        .max_seq_len(max_seq_len)
        .load::<B>(&default_device())
        .expect("demo model loads")
        .with_precision(llama_burn::Precision::Exact)
}

/// The reference data produced by Hugging Face transformers.
pub fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/reference.json"
    ))
    .expect("reference fixture");
    serde_json::from_str(&text).expect("reference json")
}

/// A fixed, varied set of prompts of different lengths.
pub fn prompts() -> Vec<String> {
    let long = "The history of computing is a story of steady abstraction. ".repeat(20);
    vec![
        "Hi".to_string(),
        "The capital of France is".to_string(),
        "Write a haiku about the sea.".to_string(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_string(),
        long,
        "1, 2, 3, 4,".to_string(),
        "Once upon a time, in a land far away, there lived a".to_string(),
        "Emoji test 🦀🔥 and".to_string(),
    ]
}

/// Converts a JSON array of numbers to ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Reads the rest of an engine job: its token ids and how it ended.
pub fn rest(job: llama_burn::inference::EngineJob) -> (Vec<u32>, llama_burn::Result<()>) {
    use llama_burn::inference::EngineEvent;
    let mut ids = Vec::new();
    for event in job.events().iter() {
        match event {
            EngineEvent::Token(t) => ids.push(t.token_id),
            EngineEvent::Accepted { .. } => {}
            EngineEvent::Done(r) => return (ids, r.map(|_| ())),
        }
    }
    (
        ids,
        Err(llama_burn::LlamaError::ModelUnavailable(
            "the engine closed the channel".into(),
        )),
    )
}
