//! Runs N requests x M tokens through each serving strategy and reports wall time,
//! output tokens/s, time to first token and time per output token (p50, p95).
//!
//! ```sh
//! cargo run --release --example benchmark_concurrency -- --requests 10 --max-tokens 50 \
//!     --strategies sequential,concurrent,batched --json
//! ```
//!
//! Requests arrive at t = 0, or with `--rate R` as a seeded Poisson process of R requests
//! per second. TTFT counts from each request's arrival, so it includes queueing.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use common::{B, WithModel, model_name, with_model};
use llama_burn::inference::{
    ContinuousConfig, GenerateRequest, InferenceBuilder, concurrent_streaming_handler,
    request_sampler,
};
use llama_burn::llama::Llama;
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::Tokenizer;
use serde_json::json;

#[derive(Parser, Debug, Clone)]
#[command(about = "Compare serving strategies")]
struct Args {
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Number of requests.
    #[arg(long, default_value_t = 10)]
    requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 50)]
    max_tokens: usize,
    /// Comma-separated strategies: sequential, concurrent, batched, continuous.
    #[arg(long, default_value = "sequential,concurrent,batched,continuous")]
    strategies: String,
    /// Poisson arrivals at this many requests per second (seeded); without it, every
    /// request arrives at t = 0.
    #[arg(long)]
    rate: Option<f64>,
    /// Seed of the arrival schedule.
    #[arg(long, default_value_t = 7)]
    arrival_seed: u64,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Largest batch for the batched strategy.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Stop requests at the model's stop tokens (by default every request generates
    /// exactly --max-tokens tokens, as llama.cpp's batched-bench does).
    #[arg(long)]
    stop_at_eos: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The fixed, varied prompt set (the same in every run); requests cycle through it.
const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a rainbow forms, step by step, for a curious ten-year-old.",
    "List three uses of the Rust programming language.",
    "Once upon a time",
    "Summarise the plot of a heist movie in which a team of retired engineers plans to \
     steal a famous painting from a museum during a power cut, and everything goes wrong.",
    "Translate to French: Good morning, how are you?",
    "def quicksort(xs):",
    "Give me a recipe for pancakes.",
    "Why is the sky blue? Answer in two sentences.",
    "What are the main differences between TCP and UDP, and when would you pick each?",
    "Hello!",
];

fn request(i: usize, args: &Args) -> GenerateRequest {
    GenerateRequest::new(PROMPTS[i % PROMPTS.len()])
        .with_max_tokens(args.max_tokens)
        .with_temperature(args.temperature)
        .with_top_p(0.9)
        .with_seed(1000 + i as u64)
        .with_ignore_eos(!args.stop_at_eos)
}

/// Token arrival times of one request, relative to the start of the run.
#[derive(Default, Clone)]
struct Trace {
    arrival: Duration,
    ids: Vec<u32>,
    at: Vec<Duration>,
}

/// When each request arrives, relative to the start of the run.
fn arrivals(args: &Args) -> Vec<Duration> {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let Some(rate) = args.rate.filter(|r| *r > 0.0) else {
        return vec![Duration::ZERO; args.requests];
    };
    let mut rng = StdRng::seed_from_u64(args.arrival_seed);
    let mut t = 0.0;
    (0..args.requests)
        .map(|i| {
            if i > 0 {
                let u: f64 = rng.random::<f64>();
                t += -(1.0 - u).ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

fn sleep_until(t0: Instant, at: Duration) {
    let now = t0.elapsed();
    if at > now {
        std::thread::sleep(at - now);
    }
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = (p / 100.0 * (values.len() - 1) as f64).round() as usize;
    values[rank.min(values.len() - 1)]
}

fn summarise(strategy: &str, wall: Duration, traces: &[Trace]) -> serde_json::Value {
    let output_tokens: usize = traces.iter().map(|t| t.ids.len()).sum();
    let mut ttft: Vec<f64> = traces
        .iter()
        .filter_map(|t| t.at.first().map(|first| first.saturating_sub(t.arrival)))
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let mut tpot: Vec<f64> = traces
        .iter()
        .filter(|t| t.at.len() > 1)
        .map(|t| (t.at[t.at.len() - 1] - t.at[0]).as_secs_f64() * 1e3 / (t.at.len() - 1) as f64)
        .collect();
    let wall_s = wall.as_secs_f64();
    json!({
        "strategy": strategy,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens as f64 / wall_s,
        "ttft_ms_p50": percentile(&mut ttft, 50.0),
        "ttft_ms_p95": percentile(&mut ttft, 95.0),
        "tpot_ms_p50": percentile(&mut tpot, 50.0),
        "tpot_ms_p95": percentile(&mut tpot, 95.0),
        "outputs": traces.iter().map(|t| t.ids.clone()).collect::<Vec<_>>(),
    })
}

fn sequential<T: Tokenizer>(
    llama: &mut Llama<B, T>,
    reqs: &[GenerateRequest],
    arrive: &[Duration],
) -> llama_burn::Result<(Duration, Vec<Trace>)> {
    let t0 = Instant::now();
    let mut traces = Vec::new();
    for (r, &arrival) in reqs.iter().zip(arrive) {
        sleep_until(t0, arrival);
        let mut state = llama.create_generation_state(&r.prompt, r.max_tokens)?;
        if r.ignore_eos {
            state = state.ignore_stop_tokens();
        }
        let mut s = request_sampler(r);
        let mut trace = Trace {
            arrival,
            ..Trace::default()
        };
        while !state.is_done() {
            let (id, _, _) = llama.generate_single_token(&mut state, r.temperature, &mut s)?;
            trace.ids.push(id);
            trace.at.push(t0.elapsed());
        }
        traces.push(trace);
    }
    Ok((t0.elapsed(), traces))
}

/// Static batching: each batch takes every request that has arrived (up to
/// `max_batch`) and runs until its last row ends; later arrivals wait for the next batch.
fn batched<T: Tokenizer>(
    llama: &mut Llama<B, T>,
    reqs: &[GenerateRequest],
    arrive: &[Duration],
    max_batch: usize,
) -> llama_burn::Result<(Duration, Vec<Trace>)> {
    let t0 = Instant::now();
    let mut traces: Vec<Trace> = arrive
        .iter()
        .map(|&arrival| Trace {
            arrival,
            ..Trace::default()
        })
        .collect();
    let mut next = 0;
    while next < reqs.len() {
        sleep_until(t0, arrive[next]);
        let now = t0.elapsed();
        let end = (next..reqs.len())
            .take(max_batch.max(1))
            .take_while(|&i| arrive[i] <= now)
            .last()
            .map_or(next + 1, |i| i + 1);
        let chunk = &reqs[next..end];
        let ids = chunk
            .iter()
            .map(|r| llama.encode_prompt(&r.prompt))
            .collect::<llama_burn::Result<Vec<_>>>()?;
        let limits = chunk.iter().map(|r| r.max_tokens).collect();
        let mut state = llama.create_batched_generation_state_from_ids(ids, limits)?;
        if chunk.iter().all(|r| r.ignore_eos) {
            state = state.ignore_stop_tokens();
        }
        let mut samplers: Vec<Sampler> = chunk.iter().map(request_sampler).collect();
        let temperature = chunk[0].temperature;
        while !state.is_done() {
            let steps =
                llama.generate_batched_single_token(&mut state, temperature, &mut samplers)?;
            let now = t0.elapsed();
            for (row, step) in steps.into_iter().enumerate() {
                if let Some((id, _, _)) = step {
                    traces[next + row].ids.push(id);
                    traces[next + row].at.push(now);
                }
            }
        }
        next = end;
    }
    Ok((t0.elapsed(), traces))
}

/// Runs requests through a job service, spawning each at its arrival time; one consumer
/// thread per request records token times.
fn through_service<M: llama_burn::inference::ModelDevice + Send + 'static>(
    service: &llama_burn::inference::Inference<
        M,
        GenerateRequest,
        llama_burn::inference::TokenOutput,
    >,
    reqs: &[GenerateRequest],
    arrive: &[Duration],
) -> llama_burn::Result<(Duration, Vec<Trace>)> {
    let t0 = Instant::now();
    let traces = Arc::new(Mutex::new(vec![Trace::default(); reqs.len()]));
    let mut consumers = Vec::new();
    for (i, (r, &arrival)) in reqs.iter().zip(arrive).enumerate() {
        sleep_until(t0, arrival);
        let job = service.infer(r.clone()).spawn();
        let traces = traces.clone();
        consumers.push(std::thread::spawn(move || {
            let mut trace = Trace {
                arrival,
                ..Trace::default()
            };
            for token in job.stream.iter() {
                trace.ids.push(token.token_id);
                trace.at.push(t0.elapsed());
            }
            let result = job.join();
            if let Ok(mut all) = traces.lock() {
                all[i] = trace;
            }
            result
        }));
    }
    for c in consumers {
        c.join()
            .map_err(|_| llama_burn::LlamaError::Runtime("consumer panicked".into()))??;
    }
    let wall = t0.elapsed();
    let traces = traces.lock().map(|t| t.clone()).unwrap_or_default();
    Ok((wall, traces))
}

impl WithModel for &Args {
    type Output = ();
    fn run<T: Tokenizer>(self, mut llama: Llama<B, T>) -> llama_burn::Result<()> {
        let reqs: Vec<GenerateRequest> = (0..self.requests).map(|i| request(i, self)).collect();
        let wanted: Vec<&str> = self.strategies.split(',').map(str::trim).collect();
        for s in &wanted {
            if !["sequential", "concurrent", "batched", "continuous"].contains(s) {
                return Err(llama_burn::LlamaError::invalid(
                    "strategies",
                    s,
                    "unknown strategy",
                ));
            }
        }
        let arrive = arrivals(self);
        // Warm up (first-touch allocations, thread pools) outside the measurements.
        llama.generate("Warm up", 4, 0.0, &mut Sampler::Argmax)?;
        let mut results = Vec::new();
        let mut report = |name: &str, (wall, traces): (Duration, Vec<Trace>)| {
            let summary = summarise(name, wall, &traces);
            if !self.json {
                println!(
                    "{name:>11}: {:6.2} s wall, {:4} tokens, {:7.1} tokens/s, TTFT p50 {:7.0} ms p95 {:7.0} ms, TPOT p50 {:6.1} ms p95 {:6.1} ms",
                    summary["wall_s"].as_f64().unwrap_or(0.0),
                    summary["output_tokens"],
                    summary["tokens_per_s"].as_f64().unwrap_or(0.0),
                    summary["ttft_ms_p50"].as_f64().unwrap_or(0.0),
                    summary["ttft_ms_p95"].as_f64().unwrap_or(0.0),
                    summary["tpot_ms_p50"].as_f64().unwrap_or(0.0),
                    summary["tpot_ms_p95"].as_f64().unwrap_or(0.0),
                );
            }
            results.push(summary);
        };
        if !self.json {
            let arrival = match self.rate {
                Some(r) => format!("Poisson arrivals at {r} requests/s"),
                None => "all arriving at t = 0".to_string(),
            };
            println!(
                "{} requests x {} tokens on {} ({}), {arrival}",
                self.requests,
                self.max_tokens,
                model_name(self.model.as_deref()),
                llama_burn::backend::BACKEND_NAME
            );
        }
        if wanted.contains(&"sequential") {
            report("sequential", sequential(&mut llama, &reqs, &arrive)?);
        }
        if wanted.contains(&"batched") {
            report(
                "batched",
                batched(&mut llama, &reqs, &arrive, self.max_batch)?,
            );
        }
        if wanted.contains(&"continuous") {
            let config = ContinuousConfig {
                max_running: self.max_batch,
                max_waiting: self.requests.max(1),
                ..ContinuousConfig::default()
            };
            let service = InferenceBuilder::new()
                .with_model(llama)
                .build_continuous(config)?;
            report("continuous", through_service(&service, &reqs, &arrive)?);
            let engine = service.into_model()?;
            llama = engine.shutdown()?;
        }
        if wanted.contains(&"concurrent") {
            let service = InferenceBuilder::new()
                .with_model(llama)
                .build(concurrent_streaming_handler);
            report("concurrent", through_service(&service, &reqs, &arrive)?);
        }
        // Same outputs across strategies is the batch-invariance claim; say so.
        let outputs: Vec<&serde_json::Value> = results.iter().map(|r| &r["outputs"]).collect();
        let identical = outputs.windows(2).all(|w| w[0] == w[1]);
        if self.json {
            let mut order = wanted.clone();
            order.retain(|s| results.iter().any(|r| r["strategy"] == *s));
            results.sort_by_key(|r| order.iter().position(|s| r["strategy"] == *s));
            println!(
                "{}",
                json!({
                    "model": model_name(self.model.as_deref()),
                    "backend": llama_burn::backend::BACKEND_NAME,
                    "requests": self.requests,
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                    "rate": self.rate,
                    "identical_outputs": identical,
                    "results": results,
                })
            );
        } else {
            println!("outputs identical across strategies: {identical}");
        }
        Ok(())
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = with_model(args.model.as_deref(), 2048, &args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
