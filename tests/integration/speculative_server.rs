//! Speculative decoding through the real `llama-burn-server` binary: with
//! `--speculative draft --draft-model` (the demo model drafting for itself) and with
//! `--speculative ngram`, a chat completion is exactly the plain server's, and the
//! metrics count the verified proposals; `--speculative draft` without a draft model is
//! refused at start.
#![cfg(feature = "server")]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::process::ServerProcess;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_llama-burn-server");

async fn start(http: &reqwest::Client, extra: &[&str]) -> ServerProcess {
    let mut args = vec!["--max-seq-len", "512", "--kv-budget-tokens", "4096"];
    args.extend_from_slice(&["--served-model-name", "demo"]);
    args.extend_from_slice(extra);
    let server = ServerProcess::start(BIN, args);
    assert!(
        server.ready(http, Duration::from_secs(180)).await,
        "{extra:?}: not ready"
    );
    server
}

/// A greedy chat completion that copies much of its prompt (so prompt lookup has
/// something to find): its text and completion tokens.
async fn complete(http: &reqwest::Client, base: &str) -> (String, u64) {
    let body = json!({
        "model": "demo",
        "messages": [{"role": "user", "content":
            "Repeat this list exactly: apples, pears, plums, cherries, grapes, apples, \
             pears, plums, cherries, grapes, apples, pears, plums."}],
        "max_tokens": 48,
        "temperature": 0,
    });
    let response = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("request sent");
    assert_eq!(response.status(), 200);
    let v: Value = response.json().await.expect("JSON body");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    (
        text,
        v["usage"]["completion_tokens"].as_u64().expect("usage"),
    )
}

/// A counter of the server's `/metrics`.
async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
async fn speculating_servers_answer_exactly_as_the_plain_one() {
    let http = reqwest::Client::new();
    let plain = {
        let server = start(&http, &[]).await;
        complete(&http, &server.base).await
    };
    assert!(plain.1 > 8, "{plain:?}");
    let demo = llama_burn::demo::demo_model_path().expect("demo model");
    let demo = demo.to_str().expect("a UTF-8 path");
    for extra in [
        &[
            "--speculative",
            "draft",
            "--draft-model",
            demo,
            "--draft-tokens",
            "4",
        ][..],
        &["--speculative", "ngram", "--step-overhead", "4294967295"][..],
    ] {
        let server = start(&http, extra).await;
        let answer = complete(&http, &server.base).await;
        assert_eq!(answer, plain, "{extra:?}");
        let proposed = metric(
            &http,
            &server.base,
            "llama_burn:spec_decode_num_draft_tokens",
        )
        .await;
        let accepted = metric(
            &http,
            &server.base,
            "llama_burn:spec_decode_num_accepted_tokens",
        )
        .await;
        assert!(proposed > 0.0, "{extra:?}: nothing proposed");
        assert!(
            accepted > 0.0 && accepted <= proposed,
            "{extra:?}: {accepted} of {proposed}"
        );
        if extra[1] == "draft" {
            // The demo model drafting for itself is always right.
            assert_eq!(accepted, proposed);
        }
    }
}

#[test]
fn a_draft_speculation_without_a_draft_model_is_refused_at_start() {
    let mut child = Command::new(BIN)
        .args(["--port", "0", "--speculative", "draft"])
        .env("RUST_LOG", "info")
        // The log goes to stdout.
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the server binary starts");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the server started without a draft model");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut err)
        .expect("stdout");
    assert!(err.contains("draft-model"), "{err}");
}
