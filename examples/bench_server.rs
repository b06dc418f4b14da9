//! A load generator for a running OpenAI-compatible server (`llama-burn-server`, or any
//! other): N streaming chat requests, all at once or arriving at a Poisson rate, as
//! vLLM's serving benchmark sends them. Reports throughput and the time to first token
//! (TTFT), inter-token latency (ITL) and end-to-end latency percentiles.
//!
//! ```sh
//! cargo run --release --features server --bin llama-burn-server -- --port 8080 &
//! cargo run --release --example bench_server -- --requests 16                # all at once
//! cargo run --release --example bench_server -- --requests 32 --rate 2 --json # Poisson, 2 req/s
//! ```
//!
//! With `--conversations C --turns T` it runs C multi-turn conversations at once instead:
//! each turn sends the whole conversation so far (the earlier answers included) with an
//! `X-Session-Id` header, as a chat application does. With `--metrics-url` (once per
//! replica) it reads each server's prefix-cache counters before and after, and reports
//! how many prompt tokens were served from the cache: the measure of session stickiness
//! behind a load balancer (see docs/src/deployment.md).

use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};

#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmark a running OpenAI-compatible server with streaming requests")]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Number of requests.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Mean arrival rate in requests per second (Poisson arrivals); all at once if absent.
    #[arg(long)]
    rate: Option<f64>,
    /// Tokens per answer at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Model id (default: the first model of /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// API key, if the server needs one.
    #[arg(long)]
    api_key: Option<String>,
    /// Seed of the arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Multi-turn mode: this many conversations at once (instead of --requests).
    #[arg(long)]
    conversations: Option<usize>,
    /// Turns per conversation in multi-turn mode.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Mean pause between a conversation's turns in milliseconds (exponentially
    /// distributed, seeded): the user reading and typing.
    #[arg(long, default_value_t = 0.0)]
    think_ms: f64,
    /// A server's base URL whose /metrics to read before and after (repeat for each
    /// replica behind a balancer) for the prefix-cache hit tokens.
    #[arg(long)]
    metrics_url: Vec<String>,
}

const QUESTIONS: &[&str] = &[
    "What is the capital of France?",
    "Explain quantum computing in one sentence.",
    "Write a haiku about autumn.",
    "What are the three laws of robotics?",
    "Give me three tips for writing clean code.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
    "How do airplanes fly?",
];

/// What one request measured.
#[derive(Debug, Default)]
struct Sample {
    ok: bool,
    error: Option<String>,
    ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    itl: Vec<Duration>,
    e2e: Duration,
    output_tokens: usize,
    /// The answer's text.
    text: String,
}

/// A multi-turn conversation: each turn asks the next question after the earlier turns
/// and their answers.
async fn conversation(client: reqwest::Client, args: Args, model: String, i: usize) -> Vec<Sample> {
    let session = format!("bench-{}-{i}", args.seed);
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(i as u64));
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    let mut samples = Vec::with_capacity(args.turns);
    for turn in 0..args.turns {
        if turn > 0 && args.think_ms > 0.0 {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            tokio::time::sleep(Duration::from_secs_f64(-u.ln() * args.think_ms / 1e3)).await;
        }
        let question = QUESTIONS[(i + turn) % QUESTIONS.len()];
        messages.push(json!({"role": "user", "content": question}));
        let sample = one(&client, &args, &model, &messages, Some(&session)).await;
        let ok = sample.ok;
        messages.push(json!({"role": "assistant", "content": sample.text}));
        samples.push(sample);
        if !ok {
            break;
        }
    }
    samples
}

/// The system prompt of multi-turn conversations (a shared prefix, as applications have).
const SYSTEM: &str = "You are a helpful assistant. Answer briefly and precisely.";

/// The sum over `urls` of the prefix-cache (queries, hits) counters in tokens.
async fn prefix_cache_counters(client: &reqwest::Client, urls: &[String]) -> (f64, f64) {
    let mut totals = (0.0, 0.0);
    for url in urls {
        let Ok(response) = client.get(format!("{url}/metrics")).send().await else {
            continue;
        };
        let Ok(text) = response.text().await else {
            continue;
        };
        for line in text.lines() {
            let mut parts = line.split_whitespace();
            let (Some(name), Some(value)) = (parts.next(), parts.next()) else {
                continue;
            };
            let value: f64 = value.parse().unwrap_or(0.0);
            if name.starts_with("llama_burn:prefix_cache_queries_total") {
                totals.0 += value;
            } else if name.starts_with("llama_burn:prefix_cache_hits_total") {
                totals.1 += value;
            }
        }
    }
    totals
}

fn request(client: &reqwest::Client, args: &Args) -> reqwest::RequestBuilder {
    let r = client.post(format!("{}/v1/chat/completions", args.url));
    match &args.api_key {
        Some(key) => r.bearer_auth(key),
        None => r,
    }
}

/// One streamed chat request; `session` goes in an `X-Session-Id` header.
async fn one(
    client: &reqwest::Client,
    args: &Args,
    model: &str,
    messages: &[Value],
    session: Option<&str>,
) -> Sample {
    let body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut sample = Sample::default();
    let mut builder = request(client, args).json(&body);
    if let Some(session) = session {
        builder = builder.header("x-session-id", session);
    }
    let response = match builder.send().await {
        Ok(r) => r,
        Err(e) => {
            sample.error = Some(e.to_string());
            return sample;
        }
    };
    if !response.status().is_success() {
        sample.error = Some(format!("HTTP {}", response.status()));
        return sample;
    }
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut last: Option<Instant> = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                sample.error = Some(e.to_string());
                return sample;
            }
        };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                sample.ok = true;
                continue;
            }
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(error) = value.get("error") {
                sample.error = Some(error.to_string());
            }
            if let Some(n) = value["usage"]["completion_tokens"].as_u64() {
                sample.output_tokens = n as usize;
            }
            let text: String = value["choices"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["delta"]["content"].as_str())
                .collect();
            if !text.is_empty() {
                sample.text.push_str(&text);
                let now = Instant::now();
                match last {
                    None => sample.ttft = Some(now - start),
                    Some(prev) => sample.itl.push(now - prev),
                }
                last = Some(now);
            }
        }
    }
    sample.e2e = start.elapsed();
    sample.ok &= sample.error.is_none();
    sample
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn stats(mut values: Vec<f64>) -> Value {
    values.sort_by(f64::total_cmp);
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    json!({
        "mean": mean,
        "p50": percentile(&values, 50.0),
        "p95": percentile(&values, 95.0),
        "p99": percentile(&values, 99.0),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.requests == 0 {
        return Err("--requests must be at least 1".into());
    }
    if let Some(rate) = args.rate
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err("--rate must be a positive number".into());
    }
    if !(args.think_ms.is_finite() && args.think_ms >= 0.0) {
        return Err("--think-ms must be a number of milliseconds".into());
    }
    let client = reqwest::Client::new();
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let mut r = client.get(format!("{}/v1/models", args.url));
            if let Some(key) = &args.api_key {
                r = r.bearer_auth(key);
            }
            let models: Value = r.send().await?.error_for_status()?.json().await?;
            models["data"][0]["id"]
                .as_str()
                .ok_or("the server lists no model")?
                .to_string()
        }
    };

    // Arrival offsets: all at zero, or exponential gaps of mean 1/rate.
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut at = 0.0f64;
    let offsets: Vec<Duration> = (0..args.requests)
        .map(|_| {
            let offset = Duration::from_secs_f64(at);
            if let Some(rate) = args.rate {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += -u.ln() / rate;
            }
            offset
        })
        .collect();

    let cache_before = prefix_cache_counters(&client, &args.metrics_url).await;
    let start = Instant::now();
    let mut samples = Vec::new();
    if let Some(conversations) = args.conversations {
        let tasks: Vec<_> = (0..conversations)
            .map(|i| tokio::spawn(conversation(client.clone(), args.clone(), model.clone(), i)))
            .collect();
        for task in tasks {
            samples.extend(task.await?);
        }
    } else {
        let tasks: Vec<_> = offsets
            .into_iter()
            .enumerate()
            .map(|(i, offset)| {
                let (client, args, model) = (client.clone(), args.clone(), model.clone());
                tokio::spawn(async move {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(start + offset)).await;
                    let question = QUESTIONS[i % QUESTIONS.len()];
                    let messages = [json!({"role": "user", "content": question})];
                    one(&client, &args, &model, &messages, None).await
                })
            })
            .collect();
        for task in tasks {
            samples.push(task.await?);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cache_after = prefix_cache_counters(&client, &args.metrics_url).await;
    let prefix_cache = (!args.metrics_url.is_empty()).then(|| {
        let queries = cache_after.0 - cache_before.0;
        let hits = cache_after.1 - cache_before.1;
        json!({
            "prompt_tokens": queries,
            "hit_tokens": hits,
            "hit_rate": if queries > 0.0 { hits / queries } else { 0.0 },
        })
    });

    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let failed = samples.len() - ok.len();
    let output_tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let ttft = stats(ok.iter().filter_map(|s| s.ttft.as_ref()).map(ms).collect());
    let itl = stats(ok.iter().flat_map(|s| s.itl.iter()).map(ms).collect());
    let e2e = stats(ok.iter().map(|s| ms(&s.e2e)).collect());
    let report = json!({
        "model": model,
        "requests": samples.len(),
        "conversations": args.conversations,
        "turns": args.conversations.map(|_| args.turns),
        "think_ms": args.conversations.map(|_| args.think_ms),
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "completed": ok.len(),
        "failed": failed,
        "duration_s": elapsed,
        "request_throughput": ok.len() as f64 / elapsed,
        "output_token_throughput": output_tokens as f64 / elapsed,
        "output_tokens": output_tokens,
        "ttft_ms": ttft,
        "itl_ms": itl,
        "e2e_ms": e2e,
        "errors": samples.iter().filter_map(|s| s.error.clone()).take(5).collect::<Vec<_>>(),
        "prefix_cache": prefix_cache,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let arrivals = match (args.conversations, args.rate) {
        (Some(c), _) => format!("{c} conversations of {} turns at once", args.turns),
        (None, Some(r)) => format!("Poisson {r} req/s"),
        (None, None) => "all at once".to_string(),
    };
    println!(
        "{} requests to {} ({arrivals}), {} tokens max",
        samples.len(),
        args.url,
        args.max_tokens
    );
    println!("completed {} / failed {failed} in {elapsed:.2} s", ok.len());
    println!(
        "throughput: {:.2} requests/s, {:.1} output tokens/s ({output_tokens} tokens)",
        report["request_throughput"].as_f64().unwrap_or(0.0),
        report["output_token_throughput"].as_f64().unwrap_or(0.0)
    );
    for (name, s) in [("TTFT", &ttft), ("ITL", &itl), ("E2E", &e2e)] {
        println!(
            "{name:>5} ms: mean {:8.1}  p50 {:8.1}  p95 {:8.1}  p99 {:8.1}",
            s["mean"].as_f64().unwrap_or(f64::NAN),
            s["p50"].as_f64().unwrap_or(f64::NAN),
            s["p95"].as_f64().unwrap_or(f64::NAN),
            s["p99"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if let Some(cache) = &report["prefix_cache"].as_object() {
        println!(
            "prefix cache: {} of {} prompt tokens were hits ({:.1}%)",
            cache["hit_tokens"],
            cache["prompt_tokens"],
            cache["hit_rate"].as_f64().unwrap_or(0.0) * 100.0
        );
    }
    if let Some(errors) = report["errors"].as_array().filter(|e| !e.is_empty()) {
        println!("first errors: {errors:?}");
    }
    Ok(())
}
