//! Sampling with every control, and log-probabilities, on the demo model: a seeded
//! request's tokens and log-probabilities are bitwise the same alone (sequential), in the
//! concurrent strategy, in a padded batch beside other prompts, and in the continuous
//! engine with chunked prompts beside other requests.

use crate::common::{Demo, demo, prompts};
use llama_burn::inference::{
    ContinuousConfig, ContinuousEngine, EngineEvent, GenerateRequest, InferenceBuilder,
    concurrent_streaming_handler, request_sampler,
};
use llama_burn::sampling::{Sampler, TokenLogprobs};
use llama_burn::tokenizer::Tokenizer;

/// What a request produced: each token's id and its log-probabilities.
type Run = Vec<(u32, Option<TokenLogprobs>)>;

/// Requests that use every control, each differently, all seeded and asking for logprobs.
fn requests() -> Vec<GenerateRequest> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = GenerateRequest::new(p)
                .with_max_tokens(10)
                .with_seed(100 + i as u64)
                .with_temperature([0.0, 0.7, 1.0, 1.3][i % 4])
                .with_top_p([1.0, 0.9, 0.95][i % 3])
                .with_top_k([0, 40, 5][i % 3])
                .with_min_p([0.0, 0.05][i % 2])
                .with_min_tokens(i % 3)
                .with_logprobs(i % 6)
                .with_prompt_logprobs(i % 3);
            r.sampling.repetition_penalty = [1.0, 1.1][i % 2];
            r.sampling.frequency_penalty = [0.0, 0.5, -0.3][i % 3];
            r.sampling.presence_penalty = [0.2, 0.0][i % 2];
            r.sampling.logit_bias = vec![(13, 2.0), (100 + i as u32, -5.0)];
            r
        })
        .collect()
}

/// The sequential strategy: one request at a time, token by token.
fn alone(llama: &mut Demo, request: &GenerateRequest) -> Run {
    let ids = llama.encode_request(request).unwrap();
    let mut state = llama
        .create_generation_state_from_ids(ids, request.max_tokens)
        .unwrap()
        .with_request(request);
    let mut sampler = request_sampler(request);
    let mut run = Vec::new();
    loop {
        let (id, _, done) = llama
            .generate_single_token(&mut state, request.sampling.temperature, &mut sampler)
            .unwrap();
        run.push((id, state.take_logprobs()));
        if done {
            return run;
        }
    }
}

fn check(what: &str, got: &[Run], expected: &[Run]) {
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert_eq!(g, e, "{what}: request {i}");
    }
    assert_eq!(got.len(), expected.len());
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn tokens_and_logprobs_are_the_same_in_every_strategy() {
    let mut llama = demo(1024);
    let requests = requests();
    let expected: Vec<Run> = requests.iter().map(|r| alone(&mut llama, r)).collect();
    // The log-probabilities are there, raw, and sensible.
    for (r, run) in requests.iter().zip(&expected) {
        for (id, lp) in run {
            let lp = lp.as_ref().expect("logprobs asked for");
            assert_eq!(lp.chosen.token_id, *id);
            assert!(lp.chosen.logprob <= 0.0);
            assert_eq!(lp.top.len(), r.logprobs.unwrap());
            assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        }
    }
    // Sampled requests draw differently with another seed (the seed is used).
    let reseeded = alone(&mut llama, &requests[2].clone().with_seed(7));
    assert_ne!(reseeded, expected[2]);
    // Every strategy delivers the prompt's log-probabilities with the first token: those
    // of `Llama::prompt_logprobs`.
    let prompt_expected: Vec<_> = requests
        .iter()
        .map(|r| {
            let ids = llama.encode_request(r).unwrap();
            Some(
                llama
                    .prompt_logprobs(&ids, r.prompt_logprobs.unwrap())
                    .unwrap(),
            )
        })
        .collect();
    assert!(
        prompt_expected
            .iter()
            .all(|p| p.as_ref().unwrap()[0].is_none())
    );

    // Batched: every prompt in one left-padded batch.
    let ids: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| llama.encode_request(r).unwrap())
        .collect();
    let mut state = llama
        .create_batched_generation_state_from_ids(ids, vec![10; requests.len()])
        .unwrap()
        .with_requests(&requests)
        .unwrap();
    let mut samplers: Vec<Sampler> = requests.iter().map(request_sampler).collect();
    let mut batched: Vec<Run> = vec![Vec::new(); requests.len()];
    while !state.is_done() {
        let steps = llama
            .generate_batched_single_token(&mut state, 1.0, &mut samplers)
            .unwrap();
        for (row, step) in steps.into_iter().enumerate() {
            if let Some((id, _, _)) = step {
                batched[row].push((id, state.take_logprobs(row)));
            }
        }
    }
    check("batched", &batched, &expected);

    // Concurrent: every request interleaved token by token.
    let service = InferenceBuilder::new()
        .with_model(llama)
        .build(concurrent_streaming_handler);
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    let mut prompt_got = Vec::new();
    let concurrent: Vec<Run> = jobs
        .into_iter()
        .map(|job| {
            let mut run = Vec::new();
            for t in job.stream.iter() {
                if t.index == 0 {
                    prompt_got.push(t.prompt_logprobs.clone());
                }
                run.push((t.token_id, t.logprobs));
            }
            job.join().unwrap();
            run
        })
        .collect();
    check("concurrent", &concurrent, &expected);
    assert_eq!(prompt_got, prompt_expected, "concurrent prompt logprobs");
    drop(service);

    // Continuous: chunked prompts, joined by greedy requests without logprobs.
    let config = ContinuousConfig {
        step_tokens: 24,
        min_prefill_chunk: 8,
        ..ContinuousConfig::default()
    };
    let engine = ContinuousEngine::start(demo(1024), config).unwrap();
    let others: Vec<_> = (0..3)
        .map(|i| {
            engine
                .submit(GenerateRequest::new(format!("Other request {i}:")).with_max_tokens(15))
                .unwrap()
        })
        .collect();
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let mut prompt_got = Vec::new();
    let continuous: Vec<Run> = jobs
        .into_iter()
        .map(|job| {
            let mut run = Vec::new();
            for event in job.events().iter() {
                match event {
                    EngineEvent::Token(t) => {
                        if t.index == 0 {
                            prompt_got.push(t.prompt_logprobs.clone());
                        }
                        run.push((t.token_id, t.logprobs));
                    }
                    EngineEvent::Done(result) => {
                        result.unwrap();
                        break;
                    }
                    EngineEvent::Accepted { .. } => {}
                }
            }
            run
        })
        .collect();
    check("continuous", &continuous, &expected);
    assert_eq!(prompt_got, prompt_expected, "continuous prompt logprobs");
    for job in others {
        job.collect().unwrap();
    }
}

#[test]
fn min_tokens_stop_token_ids_and_bans_hold_on_the_model() {
    let mut llama = demo(256);
    let eos = llama.tokenizer.stop_ids().to_vec();
    // A +100 bias on a stop token would end at once, but min_tokens bans it for 3 tokens.
    let mut r = GenerateRequest::new("Hi")
        .with_max_tokens(8)
        .with_temperature(1.0)
        .with_seed(5)
        .with_min_tokens(3);
    r.sampling.logit_bias = vec![(eos[0], 100.0)];
    let run = alone(&mut llama, &r);
    assert_eq!(run.len(), 4, "{run:?}");
    assert!(run[..3].iter().all(|(id, _)| !eos.contains(id)));
    assert_eq!(run[3].0, eos[0]);
    // An extra stop id ends the request (greedy: the id it draws first).
    let greedy = GenerateRequest::new("The capital of France is")
        .with_max_tokens(8)
        .with_ignore_eos(true);
    let first = alone(&mut llama, &greedy);
    let stop = first[2].0;
    let at = first.iter().position(|(id, _)| *id == stop).unwrap_or(2);
    let stopped = alone(&mut llama, &greedy.clone().with_stop_token_ids(vec![stop]));
    assert_eq!(stopped[..], first[..=at]);
}

#[test]
fn score_and_prompt_logprobs_agree_with_generation() {
    let llama = demo(256);
    let context = llama.encode_prompt("The capital of France is").unwrap();
    // The greedy continuation scores as greedy, with the generation's own logprobs.
    let mut generating = demo(256);
    let request = GenerateRequest::from_ids(context.clone())
        .with_max_tokens(4)
        .with_ignore_eos(true)
        .with_logprobs(0);
    let run = alone(&mut generating, &request);
    let continuation: Vec<u32> = run.iter().map(|(id, _)| *id).collect();
    let score = llama.score_ids(&context, &continuation).unwrap();
    assert!(score.is_greedy);
    let generated: Vec<f32> = run
        .iter()
        .map(|(_, lp)| lp.as_ref().unwrap().chosen.logprob)
        .collect();
    // The prompt pass and the decode steps compute the same logits to within rounding.
    for (s, g) in score.token_logprobs.iter().zip(&generated) {
        assert!((s - g).abs() < 1e-3, "{s} vs {g}");
    }
    assert!(score.logprob < 0.0);
    // Another continuation is not greedy, and its first token (where only it differs
    // from the greedy one) is less likely than the greedy first token.
    let mut other = continuation.clone();
    other[0] = (other[0] + 1) % 1000;
    let worse = llama.score_ids(&context, &other).unwrap();
    assert!(!worse.is_greedy);
    assert!(
        worse.token_logprobs[0] < score.token_logprobs[0],
        "{} vs the greedy {}",
        worse.token_logprobs[0],
        score.token_logprobs[0]
    );
    // The prompt's log-probabilities: none for the first token; the sum over the
    // continuation's positions is the score.
    let all: Vec<u32> = context.iter().chain(&continuation).copied().collect();
    let prompt = llama.prompt_logprobs(&all, 2).unwrap();
    assert!(prompt[0].is_none());
    let sum: f64 = prompt[context.len()..]
        .iter()
        .map(|lp| f64::from(lp.as_ref().unwrap().chosen.logprob))
        .sum();
    assert!(
        (sum - score.logprob).abs() < 1e-4,
        "{sum} vs {}",
        score.logprob
    );
    assert!(
        prompt[1..]
            .iter()
            .all(|lp| lp.as_ref().unwrap().top.len() == 2)
    );
    // Text in, same answer: the context as a prompt, the continuation as plain text,
    // score exactly as their ids do.
    let text = llama.score("The capital of France is", " Paris").unwrap();
    let paris = llama.tokenizer.encode(" Paris", false, false).unwrap();
    let by_ids = llama.score_ids(&context, &paris).unwrap();
    assert!(!text.tokens.is_empty());
    assert_eq!(text.tokens, by_ids.tokens);
    assert_eq!(text.logprob.to_bits(), by_ids.logprob.to_bits());
    assert_eq!(text.is_greedy, by_ids.is_greedy);
    assert!(text.logprob < 0.0);
    assert!(matches!(
        llama.score("", " Paris"),
        Err(llama_burn::LlamaError::EmptyPrompt)
    ));
    assert!(matches!(
        llama.prompt_logprobs(&all, 21),
        Err(llama_burn::LlamaError::InvalidParameter { .. })
    ));
}
