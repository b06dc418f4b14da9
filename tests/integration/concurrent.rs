//! The concurrent strategy on the demo model: requests interleaved token by token through
//! the job runtime produce exactly what they produce alone.

use crate::common::{Demo, demo, prompts};
use llama_burn::LlamaError;
use llama_burn::inference::{
    GenerateRequest, Inference, InferenceBuilder, TokenOutput, concurrent_streaming_handler,
    request_sampler, streaming_handler,
};

type Service = Inference<Demo, GenerateRequest, TokenOutput>;

fn solo(llama: &mut Demo, request: &GenerateRequest) -> Vec<u32> {
    let mut sampler = request_sampler(request);
    llama
        .generate(
            &request.prompt,
            request.max_tokens,
            request.sampling.temperature,
            &mut sampler,
        )
        .unwrap()
        .tokens
}

fn concurrent_service() -> Service {
    InferenceBuilder::new()
        .with_model(demo(1024))
        .build(concurrent_streaming_handler)
}

fn run_all(service: &Service, requests: &[GenerateRequest]) -> Vec<Vec<u32>> {
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    jobs.into_iter()
        .map(|job| {
            let ids: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
            job.join().expect("job succeeds");
            ids
        })
        .collect()
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn eight_interleaved_requests_match_their_solo_runs() {
    let mut llama = demo(1024);
    let greedy: Vec<GenerateRequest> = prompts()
        .into_iter()
        .map(|p| GenerateRequest::new(p).with_max_tokens(16))
        .collect();
    let sampled: Vec<GenerateRequest> = greedy
        .iter()
        .enumerate()
        .map(|(i, r)| {
            r.clone()
                .with_temperature(0.8)
                .with_top_p(0.9)
                .with_seed(100 + i as u64)
        })
        .collect();
    let expected_greedy: Vec<_> = greedy.iter().map(|r| solo(&mut llama, r)).collect();
    let expected_sampled: Vec<_> = sampled.iter().map(|r| solo(&mut llama, r)).collect();
    drop(llama);

    let service = concurrent_service();
    assert_eq!(run_all(&service, &greedy), expected_greedy);
    assert_eq!(run_all(&service, &sampled), expected_sampled);
}

/// Spawns a long job, waits for its first token, then runs a short job to completion and
/// reports whether the long one had finished by then.
fn long_job_finished_before_short_one(service: &Service) -> bool {
    let long = service
        .infer(GenerateRequest::new("Once upon a time").with_max_tokens(40))
        .spawn();
    long.stream.recv().expect("first token of the long job");
    let short = service
        .infer(GenerateRequest::new("The capital of France is").with_max_tokens(2))
        .spawn();
    let short_tokens = short.stream.iter().count();
    short.join().unwrap();
    assert_eq!(short_tokens, 2);
    let finished = long.is_finished();
    let rest = long.stream.iter().count();
    long.join().unwrap();
    assert_eq!(rest, 39);
    finished
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_second_request_streams_before_the_first_finishes() {
    let service = concurrent_service();
    assert!(
        !long_job_finished_before_short_one(&service),
        "concurrent handler interleaves"
    );
    let blocking = InferenceBuilder::new()
        .with_model(demo(1024))
        .build(streaming_handler);
    assert!(
        long_job_finished_before_short_one(&blocking),
        "blocking handler serialises"
    );
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn cancelling_one_job_leaves_the_others_unchanged() {
    let mut llama = demo(1024);
    let requests: Vec<GenerateRequest> = prompts()
        .into_iter()
        .take(3)
        .map(|p| GenerateRequest::new(p).with_max_tokens(20))
        .collect();
    let expected: Vec<_> = requests.iter().map(|r| solo(&mut llama, r)).collect();
    drop(llama);

    let service = concurrent_service();
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    // Cancel the middle job after its third token.
    let victim = &jobs[1];
    for _ in 0..3 {
        victim.stream.recv().expect("token before cancel");
    }
    victim.cancel();
    let after_cancel = victim.stream.iter().count();
    assert!(
        after_cancel <= 1,
        "{after_cancel} tokens arrived after cancel"
    );
    let mut jobs = jobs.into_iter();
    let first = jobs.next().unwrap();
    let victim = jobs.next().unwrap();
    let third = jobs.next().unwrap();
    assert!(matches!(victim.join(), Err(LlamaError::Cancelled)));
    for (job, want) in [(first, &expected[0]), (third, &expected[2])] {
        let got: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
        job.join().unwrap();
        assert_eq!(&got, want);
    }
}

#[test]
fn invalid_requests_fail_their_job_and_the_service_keeps_serving() {
    let service = concurrent_service();
    // Each bad request with the error it must get: its variant, and the parameter (or
    // the context limit) it names.
    let bad = [
        (GenerateRequest::new(""), "EmptyPrompt"),
        (
            GenerateRequest::new("x").with_max_tokens(0),
            "InvalidParameter(max_tokens)",
        ),
        (
            GenerateRequest::new("x").with_max_tokens(1 << 30),
            "InvalidParameter(max_tokens)",
        ),
        (
            GenerateRequest::new("x").with_temperature(f64::NAN),
            "InvalidParameter(temperature)",
        ),
        (
            GenerateRequest::new("x").with_temperature(-1.0),
            "InvalidParameter(temperature)",
        ),
        (
            GenerateRequest::new("x")
                .with_temperature(0.5)
                .with_top_p(0.0),
            "InvalidParameter(top_p)",
        ),
        (
            GenerateRequest::new("x")
                .with_temperature(0.5)
                .with_top_p(1.5),
            "InvalidParameter(top_p)",
        ),
        (
            GenerateRequest::new("word ".repeat(2000)),
            "PromptTooLong(max 1023)",
        ),
    ];
    let named = |e: &LlamaError| match e {
        LlamaError::EmptyPrompt => "EmptyPrompt".to_string(),
        LlamaError::InvalidParameter { name, .. } => format!("InvalidParameter({name})"),
        LlamaError::PromptTooLong { max, .. } => format!("PromptTooLong(max {max})"),
        other => format!("{other:?}"),
    };
    for (request, want) in bad {
        let job = service.infer(request.clone()).spawn();
        assert_eq!(job.stream.iter().count(), 0);
        let err = job.join().unwrap_err();
        assert_eq!(named(&err), want, "{request:?}: {err}");
    }
    let ok = service
        .infer(GenerateRequest::new("Hello").with_max_tokens(3))
        .run()
        .unwrap();
    assert_eq!(ok.len(), 3);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn sixty_four_requests_at_once_all_complete_unmixed() {
    let mut llama = demo(1024);
    let distinct: Vec<GenerateRequest> = prompts()
        .into_iter()
        .map(|p| GenerateRequest::new(p).with_max_tokens(4))
        .collect();
    let expected: Vec<_> = distinct.iter().map(|r| solo(&mut llama, r)).collect();
    drop(llama);
    let requests: Vec<GenerateRequest> = (0..64)
        .map(|i| distinct[i % distinct.len()].clone())
        .collect();
    let service = concurrent_service();
    let outputs = run_all(&service, &requests);
    assert_eq!(outputs.len(), 64);
    for (i, out) in outputs.iter().enumerate() {
        assert_eq!(out, &expected[i % distinct.len()], "request {i}");
    }
}
