//! Continuous batching on the demo model: requests that join and leave a running batch
//! at any step each produce exactly their solo greedy tokens.

use crate::common::{B, Demo, demo, prompts, rest};
use llama_burn::LlamaError;
use llama_burn::inference::{
    ContinuousConfig, ContinuousEngine, EngineEvent, EngineJob, GenerateRequest, InferenceBuilder,
    Outcome,
};
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::DynTokenizer;
use rand::{Rng, SeedableRng, rngs::StdRng};

type Engine = ContinuousEngine<B, DynTokenizer>;

fn solo(llama: &mut Demo, prompt: &str, max_tokens: usize) -> Vec<u32> {
    llama
        .generate(prompt, max_tokens, 0.0, &mut Sampler::Argmax)
        .unwrap()
        .tokens
}

/// Reads `n` tokens of a job (panics if it ends first).
fn take(job: &EngineJob, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| match job.events().recv().expect("event") {
            EngineEvent::Token(t) => t.token_id,
            EngineEvent::Done(r) => panic!("job ended early: {r:?}"),
            EngineEvent::Accepted { .. } => panic!("not submitted with submit_announced"),
        })
        .collect()
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn staggered_arrivals_and_chunked_prompts_match_solo_runs() {
    let mut llama = demo(1024);
    let prompts = prompts();
    let n = 12;
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| solo(&mut llama, p, n)).collect();
    // A small step budget forces the 200+ token prompt through several prefill chunks
    // while other rows keep decoding.
    let config = ContinuousConfig {
        step_tokens: 40,
        min_prefill_chunk: 16,
        ..ContinuousConfig::default()
    };
    let engine: Engine = ContinuousEngine::start(llama, config).unwrap();
    let submit = |i: usize| {
        engine
            .submit(GenerateRequest::new(prompts[i].clone()).with_max_tokens(n))
            .unwrap()
    };
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut jobs: Vec<(usize, EngineJob)> = Vec::new();
    for i in 0..3 {
        jobs.push((i, submit(i)));
    }
    // Later arrivals join while the first ones are mid-generation.
    got[0] = take(&jobs[0].1, 3);
    for i in 3..6 {
        jobs.push((i, submit(i)));
    }
    got[1] = take(&jobs[1].1, 2);
    for i in 6..prompts.len() {
        jobs.push((i, submit(i)));
    }
    for (i, job) in jobs {
        let (tail, result) = rest(job);
        result.unwrap();
        got[i].extend(tail);
    }
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "prompt {i} ({} chars)", prompts[i].len());
    }
    let m = engine.metrics();
    assert_eq!(m.completed, prompts.len() as u64);
    assert_eq!(
        (m.kv_blocks_used, m.running, m.prefilling, m.kv_bytes_used),
        (0, 0, 0, 0)
    );
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_newcomer_gets_its_first_token_while_eight_others_run() {
    let llama = demo(1024);
    let engine: Engine = ContinuousEngine::start(llama, ContinuousConfig::default()).unwrap();
    let long: Vec<EngineJob> = prompts()
        .into_iter()
        .map(|p| {
            engine
                .submit(
                    GenerateRequest::new(p)
                        .with_max_tokens(40)
                        .with_ignore_eos(true),
                )
                .unwrap()
        })
        .collect();
    for job in &long {
        take(job, 1);
    }
    let newcomer = engine
        .submit(GenerateRequest::new("The capital of France is").with_max_tokens(3))
        .unwrap();
    take(&newcomer, 1);
    let m = engine.metrics();
    assert_eq!(m.completed, 0, "none of the eight had finished");
    assert!(m.running >= 8, "{m:?}");
    for job in long {
        let (tail, result) = rest(job);
        result.unwrap();
        assert_eq!(tail.len(), 39);
    }
    rest(newcomer).1.unwrap();
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn cancelling_frees_the_cache_at_once_and_a_full_queue_overloads() {
    let mut llama = demo(1024);
    let keep_prompt = "Once upon a time";
    let expected = {
        let mut state = llama
            .create_generation_state(keep_prompt, 30)
            .unwrap()
            .ignore_stop_tokens();
        llama
            .run_to_end(&mut state, 0.0, &mut Sampler::Argmax)
            .unwrap()
            .tokens
    };
    let config = ContinuousConfig {
        max_running: 2,
        max_waiting: 2,
        ..ContinuousConfig::default()
    };
    let engine: Engine = ContinuousEngine::start(llama, config).unwrap();
    let request = |p: &str, n| {
        GenerateRequest::new(p)
            .with_max_tokens(n)
            .with_ignore_eos(true)
    };
    let victim = engine
        .submit(request("Count to one hundred:", 200))
        .unwrap();
    let keeper = engine.submit(request(keep_prompt, 30)).unwrap();
    let mut kept = take(&keeper, 2);
    take(&victim, 2);
    let before = engine.metrics();
    assert_eq!(before.running, 2);

    // Both slots are busy: two requests wait, the third is refused.
    let waiting: Vec<EngineJob> = (0..2)
        .map(|_| engine.submit(request("Hi", 2)).unwrap())
        .collect();
    match engine.submit(request("Hi", 2)) {
        Err(LlamaError::Overloaded { limit: 2, .. }) => {}
        other => panic!("expected Overloaded, got {other:?}"),
    }

    victim.cancel();
    let (_, result) = rest(victim);
    assert!(matches!(result, Err(LlamaError::Cancelled)), "{result:?}");
    let after = engine.metrics();
    assert!(
        after.kv_blocks_used < before.kv_blocks_used,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.cancelled, 1);

    let (tail, result) = rest(keeper);
    result.unwrap();
    kept.extend(tail);
    assert_eq!(kept, expected, "the other request is unaffected");
    for job in waiting {
        rest(job).1.unwrap();
    }
    // The queue drained: work is accepted again.
    let again = engine.submit(request("Hi", 2)).unwrap();
    rest(again).1.unwrap();
    assert_eq!(engine.metrics().kv_blocks_used, 0);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn many_requests_with_random_lengths_and_cancellations() {
    let mut llama = demo(1024);
    let prompts = prompts();
    let n = 6;
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut s = llama
                .create_generation_state(p, n)
                .unwrap()
                .ignore_stop_tokens();
            llama
                .run_to_end(&mut s, 0.0, &mut Sampler::Argmax)
                .unwrap()
                .tokens
        })
        .collect();
    let engine: Engine = ContinuousEngine::start(llama, ContinuousConfig::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(2024);
    let mut jobs = Vec::new();
    for i in 0..128 {
        let p = i % prompts.len();
        let max_tokens = rng.random_range(1..=n);
        let job = engine
            .submit(
                GenerateRequest::new(prompts[p].clone())
                    .with_max_tokens(max_tokens)
                    .with_ignore_eos(true),
            )
            .unwrap();
        let cancel = rng.random_bool(0.25);
        if cancel {
            job.cancel();
        }
        jobs.push((p, max_tokens, cancel, job));
    }
    let (mut completed, mut cancelled) = (0, 0);
    for (p, max_tokens, cancel, job) in jobs {
        let (ids, result) = rest(job);
        match result {
            Ok(()) => {
                completed += 1;
                assert_eq!(
                    ids,
                    expected[p][..max_tokens],
                    "prompt {p}, {max_tokens} tokens"
                );
            }
            Err(LlamaError::Cancelled) => {
                assert!(cancel, "only cancelled jobs may end as cancelled");
                cancelled += 1;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert!(
        cancelled > 0 && completed > 64,
        "{completed} completed, {cancelled} cancelled"
    );
    let m = engine.metrics();
    assert_eq!(m.completed + m.cancelled, 128);
    assert_eq!(
        (
            m.kv_blocks_used,
            m.running,
            m.prefilling,
            m.waiting,
            m.kv_bytes_used
        ),
        (0, 0, 0, 0, 0)
    );
    assert!(m.recent.iter().all(|r| r.outcome != Outcome::Failed));
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn the_job_api_switches_to_continuous_batching_in_one_line() {
    let mut llama = demo(1024);
    let expected = solo(&mut llama, "The capital of France is", 8);
    let inference = InferenceBuilder::new()
        .with_model(llama)
        .build_continuous(ContinuousConfig::default())
        .unwrap();
    let a = inference
        .infer(GenerateRequest::new("The capital of France is").with_max_tokens(8))
        .spawn();
    let b = inference
        .infer(GenerateRequest::new("Once upon a time").with_max_tokens(50))
        .spawn();
    let ids: Vec<u32> = a.stream.iter().map(|t| t.token_id).collect();
    a.join().unwrap();
    assert_eq!(ids, expected);
    b.stream.recv().expect("first token");
    b.cancel();
    assert!(matches!(b.join(), Err(LlamaError::Cancelled)));
    let bad = inference.infer(GenerateRequest::new("")).spawn();
    assert!(matches!(bad.join(), Err(LlamaError::EmptyPrompt)));
    let m = inference
        .with_model_blocking(|engine| engine.metrics())
        .unwrap();
    assert_eq!(m.completed, 1);
}

/// The submitting side tokenizes, the engine thread takes token ids: a prompt encoded
/// once and submitted as ids gives the text prompt's tokens, a request refused before it
/// is queued (invalid, cancelled already) ends through its own events and counters, and
/// `shutdown` gives the model back whole (its tokenizer no longer shared).
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn submitters_tokenize_and_shutdown_returns_the_model() {
    let mut llama = demo(256);
    let prompt = "The capital of France is";
    let expected = solo(&mut llama, prompt, 6);
    let prompt_ids = llama.encode_prompt(prompt).unwrap();
    let engine: Engine = ContinuousEngine::start(llama, ContinuousConfig::default()).unwrap();

    let request = GenerateRequest::new(prompt).with_max_tokens(6);
    let ids = engine.encode(&request).unwrap();
    assert_eq!(ids, prompt_ids);
    let from_text = rest(engine.submit(request).unwrap());
    let from_ids = (0..2)
        .map(|_| engine.submit(GenerateRequest::from_ids(ids.clone()).with_max_tokens(6)))
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(from_text.0, expected);
    assert!(from_text.1.is_ok(), "{:?}", from_text.1);
    for job in from_ids {
        let (tokens, result) = rest(job);
        assert_eq!(tokens, expected);
        assert!(result.is_ok(), "{result:?}");
    }

    // Refused before the queue: the errors come as the jobs' Done events.
    let long = GenerateRequest::new("word ".repeat(300)).with_max_tokens(4);
    assert!(matches!(
        engine.encode(&long),
        Err(LlamaError::PromptTooLong { .. })
    ));
    let (tokens, result) = rest(engine.submit(long).unwrap());
    assert!(tokens.is_empty());
    assert!(
        matches!(result, Err(LlamaError::PromptTooLong { .. })),
        "{result:?}"
    );
    let bad_id = GenerateRequest::from_ids(vec![u32::MAX]).with_max_tokens(4);
    assert!(matches!(
        rest(engine.submit(bad_id).unwrap()).1,
        Err(LlamaError::InvalidParameter { .. })
    ));
    let cancel = llama_burn::inference::CancelToken::new();
    cancel.cancel();
    let cancelled = engine
        .submit_with_cancel(GenerateRequest::new(prompt).with_max_tokens(4), cancel)
        .unwrap();
    assert!(matches!(rest(cancelled).1, Err(LlamaError::Cancelled)));
    let m = engine.metrics();
    assert_eq!((m.failed, m.cancelled, m.completed), (2, 1, 3));
    assert_eq!((m.waiting, m.running, m.kv_blocks_used), (0, 0, 0));

    let mut llama = engine.shutdown().unwrap();
    assert_eq!(solo(&mut llama, prompt, 6), expected);
}

/// A prompt's log-probabilities are scored a chunk of positions per engine step, between
/// the steps of the running requests: a request streaming already gets tokens while a
/// long prompt is scored for another (that pass used to stop every stream for its whole
/// length), and the scored request gets the numbers of `Llama::prompt_logprobs`.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn prompt_scoring_runs_between_the_steps_of_running_requests() {
    use std::sync::{Arc, Mutex};
    let llama = demo(1024);
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let ids = llama.encode_prompt(&long).unwrap();
    let chunks = ids.len().div_ceil(64);
    assert!(chunks >= 5, "{} tokens", ids.len());
    let want = llama.prompt_logprobs(&ids, 2).unwrap();
    let engine: Engine = ContinuousEngine::start(llama, ContinuousConfig::default()).unwrap();

    // One log, in the engine's order: the streaming request's tokens, and when the
    // scored request was submitted and admitted.
    let log = Arc::new(Mutex::new(Vec::<&str>::new()));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let streaming = {
        let (log, done) = (log.clone(), done_tx.clone());
        move |event| {
            match event {
                EngineEvent::Token(_) => log.lock().unwrap().push("token"),
                EngineEvent::Done(r) => done.send(("streaming", r.is_ok(), None)).unwrap(),
                EngineEvent::Accepted { .. } => {}
            }
            true
        }
    };
    let request = GenerateRequest::new("Once upon a time")
        .with_max_tokens(200)
        .with_ignore_eos(true);
    let cancel = llama_burn::inference::CancelToken::new();
    engine.submit_to(request, cancel, streaming).unwrap();
    while !log.lock().unwrap().contains(&"token") {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }

    let scored = {
        let (log, done) = (log.clone(), done_tx);
        let logprobs = Mutex::new(None);
        move |event| {
            match event {
                EngineEvent::Accepted { .. } => log.lock().unwrap().push("admitted"),
                EngineEvent::Token(t) => {
                    if t.prompt_logprobs.is_some() {
                        *logprobs.lock().unwrap() = t.prompt_logprobs;
                    }
                }
                EngineEvent::Done(r) => {
                    let lp = logprobs.lock().unwrap().take();
                    done.send(("scored", r.is_ok(), lp)).unwrap()
                }
            }
            true
        }
    };
    log.lock().unwrap().push("submitted");
    let request = GenerateRequest::from_ids(ids)
        .with_max_tokens(1)
        .with_prompt_logprobs(2);
    let cancel = llama_burn::inference::CancelToken::new();
    engine.submit_to(request, cancel, scored).unwrap();
    let mut got = None;
    for _ in 0..2 {
        let (who, ok, lp) = done_rx.recv().unwrap();
        assert!(ok, "{who} failed");
        if who == "scored" {
            got = lp;
        }
    }
    assert_eq!(
        got.as_ref(),
        Some(&want),
        "the scored prompt's log-probabilities"
    );

    let log = log.lock().unwrap();
    let at = |what| log.iter().position(|e| *e == what).unwrap();
    let between = log[at("submitted")..at("admitted")]
        .iter()
        .filter(|e| **e == "token")
        .count();
    // One chunk per step: the streaming request decodes at least once per chunk after
    // the first (the whole pass in one step gave it at most the step under way).
    assert!(
        between >= chunks - 1,
        "{between} tokens streamed while {chunks} chunks were scored"
    );
}
