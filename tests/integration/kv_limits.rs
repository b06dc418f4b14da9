//! The KV limits of the sequential, concurrent and batched strategies on the demo model:
//! every state reserves the most its cache can hold, a request that does not fit is
//! refused with `Overloaded` (nothing allocated), and ending or dropping a request gives
//! its memory back.

use crate::common::{Demo, demo};
use llama_burn::LlamaError;
use llama_burn::cache::{KvBudget, KvLimits};
use llama_burn::inference::{
    GenerateRequest, InferenceBuilder, concurrent_streaming_handler, request_sampler,
};
use llama_burn::sampling::Sampler;

const PROMPT: &str = "The capital of France is";

fn limited(max_requests: usize, tokens: usize) -> Demo {
    demo(1024)
        .with_kv_limits(KvLimits {
            max_requests,
            budget: KvBudget::Tokens(tokens),
        })
        .expect("valid limits")
}

#[test]
fn states_reserve_their_cache_and_give_it_back() {
    let mut llama = limited(8, 200);
    let per_token = llama.kv_bytes_per_token();
    let prompt_len = llama.encode_prompt(PROMPT).unwrap().len();

    let mut a = llama.create_generation_state(PROMPT, 60).unwrap();
    assert_eq!(a.reserved_bytes(), (prompt_len + 60) * per_token);
    let b = llama.create_generation_state(PROMPT, 60).unwrap();
    assert_eq!(llama.kv_usage().requests, 2);
    assert_eq!(llama.kv_usage().bytes, 2 * (prompt_len + 60) * per_token);

    // A third does not fit beside them: refused, nothing reserved.
    let before = llama.kv_usage();
    match llama.create_generation_state(PROMPT, 100) {
        Err(LlamaError::Overloaded {
            resource,
            in_use,
            requested,
            limit,
        }) => {
            assert_eq!(resource, "KV cache bytes");
            assert_eq!(in_use, before.bytes);
            assert_eq!(requested, (prompt_len + 100) * per_token);
            assert_eq!(limit, 200 * per_token);
        }
        other => panic!("expected Overloaded, got {other:?}"),
    }
    assert_eq!(llama.kv_usage().bytes, before.bytes);
    assert_eq!(llama.kv_usage().refused, 1);

    // The cache a state allocates never exceeds what it reserved.
    let mut sampler = Sampler::Argmax;
    while !a.is_done() {
        llama
            .generate_single_token(&mut a, 0.0, &mut sampler)
            .unwrap();
        assert!(a.cache_bytes() <= a.reserved_bytes() || a.is_done());
    }
    // Ending frees the cache and the reservation; dropping does too.
    assert_eq!((a.cache_bytes(), a.reserved_bytes()), (0, 0));
    assert_eq!(llama.kv_usage().requests, 1);
    drop(b);
    assert_eq!((llama.kv_usage().requests, llama.kv_usage().bytes), (0, 0));
    assert_eq!(llama.kv_usage().peak_bytes, before.bytes);

    // Now the refused request fits.
    let c = llama.create_generation_state(PROMPT, 100).unwrap();
    assert_eq!(c.reserved_bytes(), (prompt_len + 100) * per_token);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn the_request_limit_and_the_whole_budget_are_enforced() {
    let llama = limited(2, 1000);
    let _a = llama.create_generation_state(PROMPT, 10).unwrap();
    let _b = llama.create_generation_state(PROMPT, 10).unwrap();
    assert!(matches!(
        llama.create_generation_state(PROMPT, 10),
        Err(LlamaError::Overloaded {
            resource: "requests holding a KV cache",
            in_use: 2,
            limit: 2,
            ..
        })
    ));
    // More than the whole budget can never be served: an invalid request, not a retry.
    let llama = limited(2, 100);
    assert!(matches!(
        llama.create_generation_state(PROMPT, 500),
        Err(LlamaError::InvalidParameter { .. })
    ));
    // The sequential strategy goes through the same account.
    let mut llama = limited(1, 1000);
    let held = llama.create_generation_state(PROMPT, 10).unwrap();
    assert!(matches!(
        llama.generate(PROMPT, 10, 0.0, &mut Sampler::Argmax),
        Err(LlamaError::Overloaded { .. })
    ));
    drop(held);
    let out = llama
        .generate(PROMPT, 10, 0.0, &mut Sampler::Argmax)
        .unwrap();
    assert_eq!(out.tokens.len(), 10);
    assert_eq!(llama.kv_usage().bytes, 0);
    assert!(matches!(
        llama.set_kv_limits(KvLimits {
            max_requests: 0,
            budget: KvBudget::Tokens(10)
        }),
        Err(LlamaError::InvalidParameter { .. })
    ));
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_batch_reserves_its_rectangle_and_shrinks_as_rows_end() {
    let mut llama = limited(8, 400);
    let per_token = llama.kv_bytes_per_token();
    let prompts = [PROMPT, "Hi"];
    let longest = prompts
        .iter()
        .map(|p| llama.encode_prompt(p).unwrap().len())
        .max()
        .unwrap();
    let prompt_ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    let mut batch = llama
        .create_batched_generation_state_from_ids(prompt_ids.clone(), vec![4, 40])
        .unwrap()
        .ignore_stop_tokens();
    // Every row pays for the longest prompt plus the largest budget.
    let columns = longest + 40;
    assert_eq!(batch.reserved_bytes(), 2 * columns * per_token);
    assert_eq!(llama.kv_usage().requests, 2);
    // A second batch as large does not fit.
    assert!(matches!(
        llama.create_batched_generation_state_from_ids(prompt_ids.clone(), vec![4, 170]),
        Err(LlamaError::Overloaded { .. })
    ));

    let mut samplers = vec![Sampler::Argmax, Sampler::Argmax];
    let mut shrank = false;
    while !batch.is_done() {
        llama
            .generate_batched_single_token(&mut batch, 0.0, &mut samplers)
            .unwrap();
        assert!(batch.cache_bytes() <= batch.reserved_bytes() || batch.is_done());
        if batch.active_rows().len() == 1 {
            assert_eq!(batch.reserved_bytes(), columns * per_token);
            assert_eq!(llama.kv_usage().requests, 1);
            shrank = true;
        }
    }
    assert!(shrank, "the short row ended first and its share came back");
    assert_eq!(batch.reserved_bytes(), 0);
    assert_eq!((llama.kv_usage().requests, llama.kv_usage().bytes), (0, 0));

    // More rows than requests allowed is a malformed batch, not a retry.
    let llama = limited(1, 400);
    assert!(matches!(
        llama.create_batched_generation_state_from_ids(prompt_ids, vec![4, 4]),
        Err(LlamaError::InvalidBatch(_))
    ));
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn concurrent_jobs_over_the_budget_are_refused_and_the_rest_are_unchanged() {
    let mut solo_model = demo(1024);
    let request = GenerateRequest::new(PROMPT).with_max_tokens(12);
    let expected = solo_model
        .generate(PROMPT, 12, 0.0, &mut request_sampler(&request))
        .unwrap()
        .tokens;
    drop(solo_model);

    let service = InferenceBuilder::new()
        .with_model(limited(4, 100))
        .build(concurrent_streaming_handler);
    let (per_token, prompt_len) = service
        .with_model_blocking(|llama| {
            (
                llama.kv_bytes_per_token(),
                llama.encode_prompt(PROMPT).unwrap().len(),
            )
        })
        .unwrap();
    // Something else holds most of the budget.
    let held = service
        .with_model_blocking(|llama| llama.create_generation_state(PROMPT, 80))
        .unwrap()
        .unwrap();
    let job = service.infer(request.clone()).spawn();
    assert_eq!(job.stream.iter().count(), 0);
    assert!(matches!(
        job.join(),
        Err(LlamaError::Overloaded {
            resource: "KV cache bytes",
            ..
        })
    ));
    // The refused job took nothing, not even for a moment: the peak is the held state.
    let usage = service
        .with_model_blocking(|llama| llama.kv_usage())
        .unwrap();
    assert_eq!(
        (usage.bytes, usage.peak_bytes, usage.refused),
        (
            (prompt_len + 80) * per_token,
            (prompt_len + 80) * per_token,
            1
        )
    );
    drop(held);
    service
        .with_model_blocking(|llama| llama.reset_kv_peak())
        .unwrap();

    // With the budget back, four jobs at once complete exactly as alone.
    let jobs: Vec<_> = (0..4)
        .map(|_| service.infer(request.clone()).spawn())
        .collect();
    for job in jobs {
        let ids: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
        job.join().unwrap();
        assert_eq!(ids, expected);
    }
    let usage = service
        .with_model_blocking(|llama| llama.kv_usage())
        .unwrap();
    assert_eq!((usage.requests, usage.bytes), (0, 0));
    // Since the reset, the most held at once is one to four jobs' caches (how many ran
    // at once depends on the interleaving), each its prompt and 12 tokens: whole
    // reservations, each counted once and given back.
    let one = (prompt_len + 12) * per_token;
    assert!(
        usage.peak_bytes.is_multiple_of(one) && (1..=4).contains(&(usage.peak_bytes / one)),
        "peak {} bytes, jobs of {one}",
        usage.peak_bytes
    );
    assert_eq!(usage.refused, 1);
}
