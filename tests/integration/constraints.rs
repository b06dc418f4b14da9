//! Structured outputs on the demo model: constrained requests produce what their
//! constraint says in every strategy, give the same tokens alone and in a batch with
//! unconstrained requests, and bad constraints get typed errors.

use crate::common::{B, Demo, demo, rest};
use llama_burn::LlamaError;
use llama_burn::constraints::{Constraint, ConstraintLimits, ConstraintVocab};
use llama_burn::inference::{
    ContinuousConfig, ContinuousEngine, GenerateRequest, InferenceBuilder, KvBudget,
    concurrent_streaming_handler, constrained_sampler,
};
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::{DynTokenizer, Tokenizer};
use serde_json::{Value, json};

fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// A person: nested objects in an array, an enum, bounded numbers and strings, an
/// optional field, a string pattern.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "pets": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
                    "required": ["kind", "legs"],
                    "additionalProperties": false
                }
            },
            "nickname": {"type": "string", "maxLength": 8}
        },
        "required": ["name", "age", "role", "code", "pets"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`person_schema`] (every keyword it uses).
fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    for key in o.keys() {
        assert!(
            ["name", "age", "role", "code", "pets", "nickname"].contains(&key.as_str()),
            "extra key {key}: {text}"
        );
    }
    let name = o["name"].as_str().expect("name is a string");
    assert!(name.chars().count() <= 12, "{text}");
    let age = o["age"].as_i64().expect("age is an integer");
    assert!((0..=120).contains(&age), "{text}");
    assert!(["admin", "user", "guest"].contains(&o["role"].as_str().expect("role")));
    let code: Vec<char> = o["code"].as_str().expect("code").chars().collect();
    assert!(
        code.len() == 4
            && code[..2].iter().all(char::is_ascii_uppercase)
            && code[2..].iter().all(char::is_ascii_digit),
        "{text}"
    );
    let pets = o["pets"].as_array().expect("pets is an array");
    assert!(pets.len() <= 2, "{text}");
    for pet in pets {
        let pet = pet.as_object().expect("pet is an object");
        assert_eq!(pet.len(), 2, "{text}");
        assert!(["cat", "dog"].contains(&pet["kind"].as_str().expect("kind")));
        assert!((0..=8).contains(&pet["legs"].as_i64().expect("legs")));
    }
    if let Some(nick) = o.get("nickname") {
        assert!(nick.as_str().expect("nickname").chars().count() <= 8);
    }
}

/// The generated text without its final stop token.
fn text(llama: &Demo, ids: &[u32]) -> String {
    let tokenizer = &llama.tokenizer;
    let ids: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| !tokenizer.is_stop(id))
        .collect();
    tokenizer.decode(&ids).expect("decodes")
}

fn solo(llama: &mut Demo, r: &GenerateRequest) -> Vec<u32> {
    let mut sampler = constrained_sampler(llama, r).expect("compiles");
    llama
        .generate(
            &r.prompt,
            r.max_tokens,
            r.sampling.temperature,
            &mut sampler,
        )
        .expect("generates")
        .tokens
}

/// Constrained requests (temperature 1 with seeds, and greedy) and unconstrained ones.
fn requests() -> Vec<GenerateRequest> {
    let person = |seed: u64, t: f64| {
        GenerateRequest::new(chat("Describe a person as JSON."))
            .with_constraint(Constraint::JsonSchema(person_schema()))
            .with_temperature(t)
            .with_seed(seed)
            .with_max_tokens(90)
    };
    vec![
        person(1, 1.0),
        GenerateRequest::new("The capital of France is").with_max_tokens(12),
        person(2, 1.0),
        GenerateRequest::new(chat("Say hi."))
            .with_temperature(1.0)
            .with_seed(5)
            .with_max_tokens(12),
        person(0, 0.0),
    ]
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn json_schema_output_is_valid_and_the_same_in_every_strategy() {
    let mut llama = demo(1024);
    let requests = requests();
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&mut llama, r)).collect();
    for (r, ids) in requests.iter().zip(&expected) {
        if r.constraint.is_some() {
            // It ended by itself with a stop token, within its budget.
            assert!(
                llama.tokenizer.is_stop(*ids.last().expect("tokens")),
                "{ids:?}"
            );
            check_person(&text(&llama, ids));
        }
    }

    // Batched: one forward pass for all rows, each with its own sampler.
    let ids: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| llama.encode_request(r).expect("encodes"))
        .collect();
    let limits = requests.iter().map(|r| r.max_tokens).collect();
    let mut state = llama
        .create_batched_generation_state_from_ids(ids, limits)
        .expect("batch")
        .with_requests(&requests)
        .expect("requests");
    let mut samplers: Vec<Sampler> = requests
        .iter()
        .map(|r| constrained_sampler(&llama, r).expect("compiles"))
        .collect();
    llama
        .run_batch_to_end(&mut state, 1.0, &mut samplers)
        .expect("batch runs");
    for (i, row) in state.rows().iter().enumerate() {
        assert_eq!(row.tokens(), &expected[i][..], "batched row {i}");
    }

    // Concurrent: interleaved token by token through the job runtime.
    let service = InferenceBuilder::new()
        .with_model(demo(1024))
        .build(concurrent_streaming_handler);
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    for (i, job) in jobs.into_iter().enumerate() {
        let ids: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
        job.join().expect("job succeeds");
        assert_eq!(ids, expected[i], "concurrent request {i}");
    }
    drop(service);

    // Continuous, with a pool small enough that requests are preempted and recomputed.
    let config = ContinuousConfig {
        kv_budget: KvBudget::Tokens(160),
        block_size: 16,
        ..ContinuousConfig::default()
    };
    let engine: ContinuousEngine<B, DynTokenizer> =
        ContinuousEngine::start(llama, config).expect("engine");
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submitted"))
        .collect();
    for (i, job) in jobs.into_iter().enumerate() {
        let (ids, result) = rest(job);
        result.expect("request succeeds");
        assert_eq!(ids, expected[i], "continuous request {i}");
    }
    assert_eq!(engine.metrics().completed, requests.len() as u64);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn regex_and_choice_are_honoured() {
    let mut llama = demo(512);
    let phone = GenerateRequest::new(chat("Give me a phone number."))
        .with_constraint(Constraint::Regex("[0-9]{3}-[0-9]{4}".into()))
        .with_temperature(1.0)
        .with_seed(11)
        .with_max_tokens(20);
    let ids = solo(&mut llama, &phone);
    let out = text(&llama, &ids);
    let c: Vec<char> = out.chars().collect();
    assert!(
        c.len() == 8
            && c[3] == '-'
            && c.iter()
                .enumerate()
                .all(|(i, ch)| i == 3 || ch.is_ascii_digit()),
        "{out:?}"
    );
    let colours = vec!["red".to_string(), "green".into(), "dark blue".into()];
    for seed in 0..3 {
        let pick = GenerateRequest::new(chat("Pick a colour."))
            .with_constraint(Constraint::Choice(colours.clone()))
            .with_temperature(1.0)
            .with_seed(seed)
            .with_max_tokens(10);
        let ids = solo(&mut llama, &pick);
        let out = text(&llama, &ids);
        assert!(colours.contains(&out), "{out:?}");
    }
    // A Lark grammar: a yes/no answer and a number.
    let lark = GenerateRequest::new(chat("Is 7 prime? Answer and give a number."))
        .with_constraint(Constraint::Grammar(
            "start: (\"yes\" | \"no\") \", \" /[1-9][0-9]?/".into(),
        ))
        .with_max_tokens(10);
    let ids = solo(&mut llama, &lark);
    let out = text(&llama, &ids);
    let (answer, number) = out.split_once(", ").unwrap_or_else(|| panic!("{out:?}"));
    assert!(["yes", "no"].contains(&answer), "{out:?}");
    assert!(
        number.parse::<u32>().is_ok_and(|n| (1..100).contains(&n)),
        "{out:?}"
    );
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn bad_and_hostile_constraints_get_typed_errors() {
    let llama = demo(256);
    let refused = |c: Constraint| match llama.compile_constraint(&c) {
        Err(LlamaError::InvalidConstraint(message)) => message,
        other => panic!("{c:?} compiled: {other:?}"),
    };
    let m = refused(Constraint::JsonSchema(json!({"type": "frobnicate"})));
    assert!(m.contains("json_schema"), "{m}");
    refused(Constraint::JsonSchema(json!({"$ref": "#/$defs/missing"})));
    refused(Constraint::Regex("[0-9".into()));
    refused(Constraint::Grammar("start: foo\n".into()));
    refused(Constraint::Grammar("start: (((\n".into()));
    refused(Constraint::Choice(vec![]));
    // Deeply nested arrays of arrays (100 levels, at least two items each) are within
    // the grammar's limits (measured: the schema compiles), and the constraint holds at
    // that depth: the answer's first tokens can only open arrays.
    let mut deep = json!({"type": "integer"});
    for _ in 0..100 {
        deep = json!({"type": "array", "items": deep, "minItems": 2});
    }
    let request = GenerateRequest::new(chat("Give me a list."))
        .with_constraint(Constraint::JsonSchema(deep))
        .with_max_tokens(8);
    let mut nested = demo(256);
    let ids = solo(&mut nested, &request);
    let answer = text(&nested, &ids);
    assert!(
        !answer.is_empty() && answer.chars().all(|c| c == '[' || c.is_whitespace()),
        "{answer:?}"
    );

    // A 10,000-value enum is a legitimate schema: it compiles under the default limits
    // and is refused, with a typed error naming the limit, under a small lexer budget.
    let values: Vec<Value> = (0..10_000).map(|i| json!(format!("value-{i}"))).collect();
    let big_enum = Constraint::JsonSchema(json!({"enum": values}));
    llama
        .compile_constraint(&big_enum)
        .expect("compiles under the defaults");
    let small = ConstraintLimits {
        initial_lexer_fuel: 20_000,
        ..ConstraintLimits::default()
    };
    let vocab = std::sync::Arc::new(
        ConstraintVocab::new(&llama.tokenizer, llama.config().vocab_size, small).expect("vocab"),
    );
    match llama_burn::constraints::compile::compile(&vocab, &big_enum) {
        Err(LlamaError::InvalidConstraint(m)) => assert!(m.contains("too big"), "{m}"),
        other => panic!("a 10,000-value enum passed a 20,000-fuel limit: {other:?}"),
    }
    // A refused constraint is not cached; compiled ones are, once each, within the
    // configured number of entries (least recently used dropped).
    assert_eq!(vocab.cached_constraints(), 0);
    let two = std::sync::Arc::new(
        ConstraintVocab::new(
            &llama.tokenizer,
            llama.config().vocab_size,
            ConstraintLimits {
                compiled_cache_entries: 2,
                ..ConstraintLimits::default()
            },
        )
        .expect("vocab"),
    );
    let compile = |c: &Constraint| llama_burn::constraints::compile::compile(&two, c).unwrap();
    let digits = Constraint::Regex("[0-9]{1,3}".into());
    compile(&digits);
    compile(&digits);
    assert_eq!(two.cached_constraints(), 1, "one schema, one entry");
    compile(&Constraint::Choice(vec!["a".into(), "b".into()]));
    compile(&Constraint::JsonSchema(json!({"type": "integer"})));
    assert_eq!(
        two.cached_constraints(),
        2,
        "bounded by compiled_cache_entries"
    );
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn the_engine_refuses_a_bad_constraint_and_keeps_serving() {
    let llama = demo(512);
    let engine: ContinuousEngine<B, DynTokenizer> =
        ContinuousEngine::start(llama, ContinuousConfig::default()).expect("engine");
    let bad = GenerateRequest::new("Hi")
        .with_constraint(Constraint::Regex("(unclosed".into()))
        .with_max_tokens(4);
    let (ids, result) = rest(engine.submit(bad).expect("submitted"));
    assert!(ids.is_empty());
    assert!(
        matches!(result, Err(LlamaError::InvalidConstraint(_))),
        "{result:?}"
    );
    let good = GenerateRequest::new(chat("Yes or no?"))
        .with_constraint(Constraint::Choice(vec!["yes".into(), "no".into()]))
        .with_max_tokens(4);
    let (ids, result) = rest(engine.submit(good).expect("submitted"));
    result.expect("the next request is served");
    assert!(!ids.is_empty());
}
