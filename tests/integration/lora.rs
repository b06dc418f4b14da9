//! LoRA adapters on the demo model: the shipped fixture (`tests/fixtures/lora/`, made by
//! its `make_lora_fixture.py` with PEFT on transformers) read from PEFT and GGUF files,
//! applied at run time against PEFT's own logits and against the adapter merged into f32
//! weights, and rows of different adapters in one step each giving exactly their tokens
//! alone.

use std::path::PathBuf;

use crate::common::{B, demo, ids};
use llama_burn::LlamaError;
use llama_burn::backend::default_device;
use llama_burn::config::LlamaConfig;
use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
use llama_burn::lora::merge::{MergedType, merge_gguf};
use llama_burn::lora::{LoraAdapter, LoraFactors, LoraTarget, LoraWeights};
use llama_burn::model::Logits;
use llama_burn::tokenizer::DynTokenizer;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/lora")).join(path)
}

fn demo_config() -> LlamaConfig {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    llama_burn::Loader::gguf(path).config().expect("config")
}

fn lora_reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("reference.json")).expect("lora reference");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn peft_and_gguf_files_give_the_same_factors_and_scales() {
    let config = demo_config();
    let peft = LoraAdapter::open(fixture("peft"), &config).expect("peft adapter");
    let gguf = LoraAdapter::open(fixture("adapter.gguf"), &config).expect("gguf adapter");
    assert_eq!(peft.rank(), 4);
    assert_eq!(
        peft.modules(),
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    assert_eq!(
        peft.base_model(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    let down = LoraTarget::from_module("down_proj").expect("down");
    let mut compared = 0;
    for (layer, target, f) in peft.tensors() {
        // rsLoRA: alpha / sqrt(rank); the alpha_pattern gives down_proj alpha 4.
        let want = if target == down { 2.0 } else { 4.0 };
        assert_eq!(f.scale, want, "layer {layer} {}", target.module());
        if target == down {
            // One alpha per GGUF file: the fixture's GGUF adapter leaves it out.
            assert!(gguf.factors(layer, target).is_none());
            continue;
        }
        // The GGUF file holds query and key B factors in llama.cpp's row order; read
        // back, they are PEFT's.
        let g = gguf.factors(layer, target).expect("gguf factors");
        assert!(
            g == f,
            "layer {layer} {}: the factors differ",
            target.module()
        );
        compared += 1;
    }
    assert_eq!(compared, 6 * config.n_layers);
    assert_ne!(peft.fingerprint(), gguf.fingerprint());
}

#[test]
fn adapters_that_do_not_fit_are_refused_before_they_are_read() {
    let config = demo_config();
    // Another base model: wider projections.
    let wider = LlamaConfig {
        d_model: config.d_model * 2,
        ..config.clone()
    };
    for path in ["peft", "adapter.gguf"] {
        match LoraAdapter::open(fixture(path), &wider) {
            Err(LlamaError::InvalidAdapter { reason, .. }) => {
                assert!(reason.contains("another base model"), "{path}: {reason}")
            }
            other => panic!("{path}: {other:?}"),
        }
    }
    // A model file is not an adapter.
    let model = llama_burn::demo::demo_model_path().expect("demo model");
    assert!(matches!(
        LoraAdapter::open(&model, &config),
        Err(LlamaError::InvalidAdapter { .. })
    ));
    // What we do not run is refused by name: DoRA, LoRA on the output head.
    let dir = std::env::temp_dir().join(format!("llama-burn-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(
        fixture("peft/adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .expect("copy");
    let base = std::fs::read_to_string(fixture("peft/adapter_config.json")).expect("config");
    for (edit, word) in [
        (("\"use_dora\": false", "\"use_dora\": true"), "DoRA"),
        (("\"q_proj\"", "\"lm_head\""), "lm_head"),
        (
            ("\"lora_alpha\": 8.0", "\"lora_alpha\": \"8\""),
            "adapter_config.json",
        ),
    ] {
        assert!(base.contains(edit.0), "{}", edit.0);
        std::fs::write(
            dir.join("adapter_config.json"),
            base.replace(edit.0, edit.1),
        )
        .expect("write");
        match LoraAdapter::open(&dir, &config) {
            Err(LlamaError::InvalidAdapter { reason, .. }) => {
                assert!(reason.contains(word), "{word}: {reason}")
            }
            other => panic!("{word}: {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Greedy tokens and the logits of each step, through the contiguous forward pass with
/// `adapter` (or none).
fn greedy_with(
    llama: &llama_burn::Llama<B, DynTokenizer>,
    prompt: &[u32],
    n: usize,
    adapter: Option<&LoraWeights<B>>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let model = &llama.model;
    let mut cache = model.new_cache(vec![0], prompt.len() + n);
    let mut input = prompt.to_vec();
    let (mut tokens, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let logits = model
            .forward_adapted(&input, &mut cache, Logits::Last, adapter)
            .expect("forward")
            .into_data()
            .into_vec::<f32>()
            .expect("f32");
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .expect("token");
        tokens.push(next);
        steps.push(logits);
        input = vec![next];
    }
    (tokens, steps)
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn the_adapter_at_run_time_gives_pefts_tokens_and_the_merged_models_logits() {
    let llama = demo(512);
    let config = llama.config().clone();
    let adapter = LoraAdapter::open(fixture("peft"), &config).expect("adapter");
    let weights = LoraWeights::<B>::new(&adapter, &config, &default_device()).expect("weights");

    // The same adapter merged into f32 weights, offline.
    let merged_path =
        std::env::temp_dir().join(format!("llama-burn-merged-{}.gguf", std::process::id()));
    let base = llama_burn::demo::demo_model_path().expect("demo model");
    let report =
        merge_gguf(&base, &adapter, &merged_path, MergedType::F32, |_, _| {}).expect("merge");
    assert_eq!(report.merged, 7 * config.n_layers);
    let merged = llama_burn::Loader::gguf(&merged_path)
        .max_seq_len(512)
        .load::<B>(&default_device())
        .expect("merged model")
        .with_precision(llama_burn::Precision::Exact);
    let _ = std::fs::remove_file(&merged_path);

    let reference = lora_reference();
    let mut worst_merged = 0f32;
    let mut worst_peft = 0f32;
    for p in reference["prompts"].as_array().expect("prompts") {
        let name = p["name"].as_str().expect("name");
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["greedy_ids"]);
        let (tokens, logits) = greedy_with(&llama, &prompt, want.len(), Some(&weights));
        assert_eq!(tokens, want, "{name}: PEFT's greedy tokens");
        let (base_tokens, _) = greedy_with(&llama, &prompt, want.len(), None);
        assert_eq!(
            base_tokens,
            ids(&p["base_greedy_ids"]),
            "{name}: the base model"
        );

        // Merged weights: the same tokens, logits within f32 rounding of the sums'
        // orders (the base product, the adapter's change: apart at run time, summed
        // into one weight when merged).
        let (merged_tokens, merged_logits) = greedy_with(&merged, &prompt, want.len(), None);
        assert_eq!(merged_tokens, want, "{name}: merged");
        for (a, b) in logits.iter().zip(&merged_logits) {
            for (x, y) in a.iter().zip(b) {
                worst_merged = worst_merged.max((x - y).abs());
            }
        }
        // PEFT's top-5 logits after the prompt and at steps 1 and 8.
        for (step, top) in p["topk"].as_object().expect("topk") {
            let step: usize = step.parse().expect("step");
            let ids = ids(&top["ids"]);
            let values: Vec<f32> = top["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("f64") as f32)
                .collect();
            for (id, v) in ids.iter().zip(values) {
                worst_peft = worst_peft.max((logits[step][*id as usize] - v).abs());
            }
        }
    }
    eprintln!("largest logit difference: merged {worst_merged:.2e}, PEFT {worst_peft:.2e}");
    assert!(worst_merged < 1e-3, "run time vs merged: {worst_merged}");
    // The bar of the base model's reference test (transformers' own cached-vs-recomputed
    // difference is about 5e-5).
    assert!(worst_peft < 1e-3, "run time vs PEFT: {worst_peft}");
}

/// `adapter` with every factor scaled by `k` in `B` (another fine-tune, for the test).
fn variant(config: &LlamaConfig, adapter: &LoraAdapter, k: f32, modules: &[&str]) -> LoraAdapter {
    let factors = adapter
        .tensors()
        .filter(|(_, t, _)| modules.contains(&t.module()))
        .map(|(layer, t, f)| {
            (
                layer,
                t,
                LoraFactors {
                    b: f.b.iter().map(|v| v * k).collect(),
                    ..f.clone()
                },
            )
        })
        .collect::<Vec<_>>();
    LoraAdapter::from_factors(format!("x{k}"), config, factors).expect("variant")
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn rows_of_four_adapters_and_none_share_steps_and_each_gets_its_tokens_alone() {
    let llama = demo(512);
    let config = llama.config().clone();
    let peft = LoraAdapter::open(fixture("peft"), &config).expect("peft");
    let all = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    let engine = ContinuousEngine::start(llama, ContinuousConfig::default()).expect("engine");
    let adapters = engine.adapters();
    adapters.register("peft", fixture("peft")).expect("peft");
    adapters
        .register("gguf", fixture("adapter.gguf"))
        .expect("gguf");
    adapters
        .insert("negated", &variant(&config, &peft, -1.0, &all))
        .expect("negated");
    adapters
        .insert("attention", &variant(&config, &peft, 2.0, &all[..4]))
        .expect("attention");
    let names = [
        None,
        Some("peft"),
        Some("gguf"),
        Some("negated"),
        Some("attention"),
    ];
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
    ];
    // The default request: sampling at temperature 1, with log-probabilities.
    let request = |i: usize| {
        let r = GenerateRequest::new(prompts[i % prompts.len()])
            .with_max_tokens(8)
            .with_temperature(1.0)
            .with_seed(100 + i as u64)
            .with_logprobs(2);
        match names[i % names.len()] {
            Some(name) => r.with_adapter(name),
            None => r,
        }
    };
    let run = |r: GenerateRequest| {
        let (tokens, _) = engine.submit(r).expect("submit").collect().expect("tokens");
        tokens
            .iter()
            .map(|t| {
                let lp = t.logprobs.as_ref().expect("logprobs");
                (t.token_id, lp.chosen.logprob.to_bits())
            })
            .collect::<Vec<_>>()
    };
    let rows = 20;
    let alone: Vec<_> = (0..rows).map(|i| run(request(i))).collect();
    let jobs: Vec<_> = (0..rows)
        .map(|i| engine.submit(request(i)).expect("submit"))
        .collect();
    for (i, job) in jobs.into_iter().enumerate() {
        let (tokens, _) = job.collect().expect("tokens");
        let together: Vec<_> = tokens
            .iter()
            .map(|t| {
                let lp = t.logprobs.as_ref().expect("logprobs");
                (t.token_id, lp.chosen.logprob.to_bits())
            })
            .collect();
        assert_eq!(together, alone[i], "row {i} ({:?})", names[i % names.len()]);
    }
    // The adapters change the answers: each row's tokens differ from the base row of its
    // prompt somewhere among them.
    for (i, adapter) in names.iter().enumerate().skip(1) {
        let j = (0..rows)
            .find(|&j| j % names.len() == i && j % prompts.len() == 0)
            .unwrap_or(i);
        let base = run(GenerateRequest {
            adapter: None,
            ..request(j)
        });
        assert_ne!(base, alone[j], "{adapter:?} changed nothing");
    }
    // An unknown adapter is refused by name, and another tenant's prefix cache is not
    // shared across adapters (the prefix hash includes the adapter).
    let err = engine
        .submit(request(1).with_adapter("nope"))
        .expect("submit")
        .collect()
        .expect_err("unknown adapter");
    assert!(
        matches!(err, LlamaError::UnknownAdapter(ref n) if n == "nope"),
        "{err}"
    );
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_cached_prefix_is_reused_only_by_requests_of_the_same_adapter() {
    let llama = demo(512);
    let engine = ContinuousEngine::start(llama, ContinuousConfig::default()).expect("engine");
    engine
        .adapters()
        .register("peft", fixture("peft"))
        .expect("peft");
    let prompt = "The history of computing is a story of steady abstraction. ".repeat(6);
    let run = |adapter: Option<&str>| {
        let mut r = GenerateRequest::new(prompt.clone()).with_max_tokens(2);
        if let Some(a) = adapter {
            r = r.with_adapter(a);
        }
        let (_, metrics) = engine.submit(r).expect("submit").collect().expect("run");
        metrics.prefix_hit_tokens
    };
    assert_eq!(run(None), 0, "a cold cache");
    assert_eq!(
        run(Some("peft")),
        0,
        "the base model's blocks are not the adapter's"
    );
    assert!(run(Some("peft")) > 0, "the adapter's own blocks are reused");
    assert!(run(None) > 0, "and the base model's");
}
