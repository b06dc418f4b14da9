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
}

fn request(client: &reqwest::Client, args: &Args) -> reqwest::RequestBuilder {
    let r = client.post(format!("{}/v1/chat/completions", args.url));
    match &args.api_key {
        Some(key) => r.bearer_auth(key),
        None => r,
    }
}

async fn one(client: reqwest::Client, args: Args, model: String, i: usize) -> Sample {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[i % QUESTIONS.len()]}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut sample = Sample::default();
    let response = match request(&client, &args).json(&body).send().await {
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
            let has_text = value["choices"].as_array().is_some_and(|c| {
                c.iter().any(|c| {
                    c["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
                })
            });
            if has_text {
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

    let start = Instant::now();
    let tasks: Vec<_> = offsets
        .into_iter()
        .enumerate()
        .map(|(i, offset)| {
            let (client, args, model) = (client.clone(), args.clone(), model.clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(tokio::time::Instant::from_std(start + offset)).await;
                one(client, args, model, i).await
            })
        })
        .collect();
    let mut samples = Vec::with_capacity(tasks.len());
    for task in tasks {
        samples.push(task.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();

    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let failed = samples.len() - ok.len();
    let output_tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let ttft = stats(ok.iter().filter_map(|s| s.ttft.as_ref()).map(ms).collect());
    let itl = stats(ok.iter().flat_map(|s| s.itl.iter()).map(ms).collect());
    let e2e = stats(ok.iter().map(|s| ms(&s.e2e)).collect());
    let report = json!({
        "model": model,
        "requests": args.requests,
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
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let rate = args
        .rate
        .map_or("all at once".to_string(), |r| format!("Poisson {r} req/s"));
    println!(
        "{} requests to {} ({rate}), {} tokens max",
        args.requests, args.url, args.max_tokens
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
    if let Some(errors) = report["errors"].as_array().filter(|e| !e.is_empty()) {
        println!("first errors: {errors:?}");
    }
    Ok(())
}
