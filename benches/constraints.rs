//! Criterion benchmark of the constraint engine on the demo model's 49,152-token
//! vocabulary: building the token environment (once per model), compiling a JSON Schema,
//! and one constrained draw when the sampled token is allowed (the check alone) and when
//! it is refused (the full mask, then the masked draw); and, with the `llama3` feature,
//! the same draws on the Llama 3 tokenizer's 128,256-token vocabulary.
//! Run with `cargo bench --features llama3 --bench constraints`.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::constraints::{Constraint, ConstraintLimits, ConstraintVocab};
use llama_burn::sampling::{History, Pipeline, SamplingParams};
use llama_burn::tokenizer::Tokenizer;

fn benches(c: &mut Criterion) {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let llama = llama_burn::Loader::gguf(path)
        .max_seq_len(256)
        .load::<DefaultBackend>(&default_device())
        .expect("demo model loads");
    let vocab = llama.config().vocab_size;
    let mut group = c.benchmark_group("constraints");
    group.sample_size(10);
    group.bench_function("vocab_build_49k", |b| {
        b.iter(|| ConstraintVocab::new(&llama.tokenizer, vocab, ConstraintLimits::default()))
    });
    let schema = Constraint::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}
        },
        "required": ["name", "tags"]
    }));
    group.bench_function("compile_json_schema", |b| {
        b.iter(|| llama.compile_constraint(&schema).expect("compiles"))
    });
    group.sample_size(50);
    let state = llama.compile_constraint(&schema).expect("compiles");
    let pipeline = Pipeline::new(SamplingParams::greedy(), 0)
        .expect("params")
        .with_constraint(state);
    let brace = llama.tokenizer.encode_text("{").expect("encodes")[0] as usize;
    let word = llama.tokenizer.encode_text("Hello").expect("encodes")[0] as usize;
    for (name, top) in [("allowed_check", brace), ("refused_full_mask", word)] {
        let mut logits = vec![0.0f32; vocab];
        logits[top] = 10.0;
        group.bench_function(format!("draw_{name}_49k"), |b| {
            b.iter_batched(
                || pipeline.clone(),
                |mut p| p.sample(&logits, History::default()).expect("draws"),
                BatchSize::SmallInput,
            )
        });
    }
    #[cfg(feature = "llama3")]
    {
        let path = llama_burn::demo::fetch_wheel_file(
            "llama-models",
            "0.3.0",
            "llama_models/llama3/tokenizer.model",
        )
        .expect("Llama 3 tokenizer");
        let tok = llama_burn::tokenizer::Llama3Tokenizer::from_file(path).expect("loads");
        let vocab_size = tok.vocab_size();
        let vocab = std::sync::Arc::new(
            ConstraintVocab::new(&tok, vocab_size, ConstraintLimits::default()).expect("vocab"),
        );
        let state = llama_burn::constraints::compile::compile(&vocab, &schema).expect("compiles");
        let pipeline = Pipeline::new(SamplingParams::greedy(), 0)
            .expect("params")
            .with_constraint(state);
        let brace = tok.encode_text("{").expect("encodes")[0] as usize;
        let word = tok.encode_text("Hello").expect("encodes")[0] as usize;
        for (name, top) in [("allowed_check", brace), ("refused_full_mask", word)] {
            let mut logits = vec![0.0f32; vocab_size];
            logits[top] = 10.0;
            group.bench_function(format!("draw_{name}_128k"), |b| {
                b.iter_batched(
                    || pipeline.clone(),
                    |mut p| p.sample(&logits, History::default()).expect("draws"),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(constraint_benches, benches);
criterion_main!(constraint_benches);
