//! The sequential strategy on the demo model: bad input gives typed errors, seeded
//! sampling reproduces, stop tokens end generation, and the per-request state API gives
//! the same tokens as `generate`.

use crate::common::demo;
use llama_burn::LlamaError;
use llama_burn::sampling::{Sampler, TopP};

#[test]
fn bad_input_is_a_typed_error() {
    let mut llama = demo(64);
    let mut greedy = Sampler::Argmax;
    // A cache built for another model (3 layers, not 30): an error, not an index panic.
    let mut foreign = llama_burn::cache::KvCache::<crate::common::B>::new(
        3,
        3,
        64,
        vec![0],
        8,
        8,
        &llama_burn::backend::default_device(),
    );
    assert!(matches!(
        llama
            .model
            .forward(&[1, 2], &mut foreign, llama_burn::model::Logits::Last),
        Err(LlamaError::InvalidBatch(_))
    ));
    assert!(matches!(
        llama.generate("", 5, 0.0, &mut greedy),
        Err(LlamaError::EmptyPrompt)
    ));
    // Far more bytes than the context can hold: refused before tokenizing.
    let huge = "x".repeat(64 * llama_burn::llama::MAX_TOKEN_BYTES + 1);
    assert!(matches!(
        llama.generate(&huge, 5, 0.0, &mut greedy),
        Err(LlamaError::InvalidParameter { name: "prompt", .. })
    ));
    let long = "word ".repeat(200);
    assert!(matches!(
        llama.generate(&long, 5, 0.0, &mut greedy),
        Err(LlamaError::PromptTooLong { .. })
    ));
    for (max_tokens, what) in [(0, "zero"), (1_000_000, "huge")] {
        let err = llama
            .generate("Hello", max_tokens, 0.0, &mut greedy)
            .unwrap_err();
        assert!(
            matches!(
                err,
                LlamaError::InvalidParameter {
                    name: "max_tokens",
                    ..
                }
            ),
            "{what} max_tokens: {err}"
        );
    }
    for t in [f64::NAN, -1.0, f64::INFINITY] {
        let err = llama.generate("Hello", 5, t, &mut greedy).unwrap_err();
        assert!(
            matches!(
                err,
                LlamaError::InvalidParameter {
                    name: "temperature",
                    ..
                }
            ),
            "{err}"
        );
    }
    for p in [0.0, -0.5, 1.01, f64::NAN] {
        let err = llama
            .generate("Hello", 5, 0.7, &mut Sampler::TopP(TopP::new(p, 1)))
            .unwrap_err();
        assert!(
            matches!(err, LlamaError::InvalidParameter { name: "top_p", .. }),
            "{err}"
        );
    }
    // The model still works after all of that.
    let out = llama
        .generate("The capital of France is", 4, 0.0, &mut greedy)
        .unwrap();
    assert_eq!(out.tokens.len(), 4);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn seeded_sampling_reproduces_and_greedy_matches_state_api() {
    let mut llama = demo(256);
    let prompt = "Once upon a time";
    let run = |llama: &mut crate::common::Demo, seed| {
        llama
            .generate(prompt, 24, 0.9, &mut Sampler::TopP(TopP::new(0.9, seed)))
            .unwrap()
            .tokens
    };
    let a = run(&mut llama, 7);
    assert_eq!(a, run(&mut llama, 7), "same seed, same tokens");
    assert_ne!(a, run(&mut llama, 8), "another seed gives another sample");

    let greedy = llama
        .generate(prompt, 20, 0.0, &mut Sampler::Argmax)
        .unwrap();
    let mut state = llama.create_generation_state(prompt, 20).unwrap();
    let mut tokens = Vec::new();
    let mut text = String::new();
    loop {
        let (id, piece, done) = llama
            .generate_single_token(&mut state, 0.0, &mut Sampler::Argmax)
            .unwrap();
        tokens.push(id);
        text.push_str(&piece);
        if done {
            break;
        }
    }
    assert_eq!(tokens, greedy.tokens);
    assert_eq!(text, greedy.text);
    // A finished generation refuses another step, naming its state.
    let after = llama.generate_single_token(&mut state, 0.0, &mut Sampler::Argmax);
    assert!(
        matches!(
            after,
            Err(llama_burn::LlamaError::InvalidParameter { name: "state", .. })
        ),
        "{:?}",
        after.err()
    );
}

#[test]
fn chat_generation_stops_at_the_end_of_turn_token() {
    let mut llama = demo(512);
    let format = llama
        .tokenizer
        .chat_format()
        .expect("demo model has a chat format");
    use llama_burn::tokenizer::{ChatMessage, Tokenizer};
    let prompt = format.format(&[ChatMessage::user("What is the capital of France?")], true);
    let out = llama
        .generate(&prompt, 64, 0.0, &mut Sampler::Argmax)
        .unwrap();
    assert_eq!(out.stop_reason, llama_burn::StopReason::StopToken);
    assert!(
        llama
            .tokenizer
            .stop_ids()
            .contains(out.tokens.last().unwrap())
    );
    assert!(out.text.contains("Paris"), "{}", out.text);
    assert!(!out.text.contains("<|im_end|>"));
}
