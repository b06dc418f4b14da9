//! Prometheus metrics under the names vLLM's dashboards use, prefixed `llama_burn:`.
//!
//! Each [`ServerMetrics`] has its own recorder (no process-wide state), so several
//! servers can run in one process. Gauges and the engine's own counters are read from
//! [`EngineMetrics`] when `/metrics` is scraped; per-request counters and histograms are
//! recorded as requests finish.

use std::time::Duration;

use metrics::Recorder;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::error::{LlamaError, Result};
use crate::inference::EngineMetrics;

/// Requests decoding or having their prompt processed.
pub const NUM_REQUESTS_RUNNING: &str = "llama_burn:num_requests_running";
/// Requests waiting for admission.
pub const NUM_REQUESTS_WAITING: &str = "llama_burn:num_requests_waiting";
/// Fraction of the KV pool's blocks held by requests (0 to 1).
pub const KV_CACHE_USAGE_PERC: &str = "llama_burn:kv_cache_usage_perc";
/// Prompt tokens of accepted requests.
pub const PROMPT_TOKENS_TOTAL: &str = "llama_burn:prompt_tokens_total";
/// Generated tokens.
pub const GENERATION_TOKENS_TOTAL: &str = "llama_burn:generation_tokens_total";
/// Finished requests, by `finished_reason` (`stop`, `length`, `abort`, `error`).
pub const REQUEST_SUCCESS_TOTAL: &str = "llama_burn:request_success_total";
/// Submission to first token.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "llama_burn:time_to_first_token_seconds";
/// Between consecutive tokens of a request.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "llama_burn:inter_token_latency_seconds";
/// Submission to the end of a request.
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "llama_burn:e2e_request_latency_seconds";
/// Submission to admission.
pub const REQUEST_QUEUE_TIME_SECONDS: &str = "llama_burn:request_queue_time_seconds";
/// Preemptions (a request gave its KV blocks back, to be recomputed later).
pub const NUM_PREEMPTIONS_TOTAL: &str = "llama_burn:num_preemptions_total";
/// Proposed tokens verified by speculative decoding (vLLM's name).
pub const SPEC_DECODE_NUM_DRAFT_TOKENS: &str = "llama_burn:spec_decode_num_draft_tokens";
/// Proposed tokens accepted by speculative decoding (vLLM's name).
pub const SPEC_DECODE_NUM_ACCEPTED_TOKENS: &str = "llama_burn:spec_decode_num_accepted_tokens";
/// Prompt tokens looked up in the prefix cache.
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "llama_burn:prefix_cache_queries_total";
/// Prompt tokens served from the prefix cache.
pub const PREFIX_CACHE_HITS_TOTAL: &str = "llama_burn:prefix_cache_hits_total";
/// Prompt tokens served from prefix blocks read from disk at start.
pub const PREFIX_CACHE_DISK_HITS_TOTAL: &str = "llama_burn:prefix_cache_disk_hits_total";
/// Prefix blocks read from disk into the KV pool at start.
pub const PREFIX_CACHE_DISK_LOADED_BLOCKS: &str = "llama_burn:prefix_cache_disk_loaded_blocks";
/// Prefix cache files refused at start (another model or configuration, or damaged).
pub const PREFIX_CACHE_DISK_REFUSED_FILES: &str = "llama_burn:prefix_cache_disk_refused_files";
/// Prefix blocks written to disk.
pub const PREFIX_CACHE_DISK_WRITTEN_BLOCKS: &str = "llama_burn:prefix_cache_disk_written_blocks";
/// Prefix blocks not written to disk (the writer's queue was full, or a write failed).
pub const PREFIX_CACHE_DISK_DROPPED_BLOCKS: &str = "llama_burn:prefix_cache_disk_dropped_blocks";
/// API requests by tenant (API-key tenants only; other requests count as `other`).
pub const TENANT_REQUESTS_TOTAL: &str = "llama_burn:tenant_requests_total";
/// Requests refused because the engine's queue was full.
pub const REQUESTS_REJECTED_TOTAL: &str = "llama_burn:requests_rejected_total";
/// Prompts tokenized (on the tokenizer pool: each prompt of a request once, whatever
/// `n`; none of a request whose client went away first).
pub const PROMPTS_TOKENIZED_TOTAL: &str = "llama_burn:prompts_tokenized_total";
/// Bytes held by stored responses (`/v1/responses` with `store`), at most
/// `--response-store-bytes`.
pub const RESPONSE_STORE_BYTES: &str = "llama_burn:response_store_bytes";
/// Stored responses held.
pub const RESPONSE_STORE_ENTRIES: &str = "llama_burn:response_store_entries";

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The server's metrics and their Prometheus rendering.
pub struct ServerMetrics {
    recorder: PrometheusRecorder,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").finish_non_exhaustive()
    }
}

impl ServerMetrics {
    /// Metrics labelled with `model_name`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if the exporter refuses the histogram buckets.
    pub fn new(model_name: &str) -> Result<Self> {
        let mut builder = PrometheusBuilder::new().add_global_label("model_name", model_name);
        for (name, buckets) in [
            (TIME_TO_FIRST_TOKEN_SECONDS, LATENCY_BUCKETS),
            (INTER_TOKEN_LATENCY_SECONDS, LATENCY_BUCKETS),
            (E2E_REQUEST_LATENCY_SECONDS, REQUEST_BUCKETS),
            (REQUEST_QUEUE_TIME_SECONDS, REQUEST_BUCKETS),
        ] {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)
                .map_err(|e| LlamaError::Runtime(format!("metrics: {e}")))?;
        }
        let metrics = Self {
            recorder: builder.build_recorder(),
        };
        metrics.describe();
        Ok(metrics)
    }

    fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder as &dyn Recorder, f)
    }

    fn describe(&self) {
        self.with(|| {
            metrics::describe_gauge!(NUM_REQUESTS_RUNNING, "Requests decoding or prefilling.");
            metrics::describe_gauge!(NUM_REQUESTS_WAITING, "Requests waiting for admission.");
            metrics::describe_gauge!(
                RESPONSE_STORE_BYTES,
                metrics::Unit::Bytes,
                "Bytes held by stored responses."
            );
            metrics::describe_gauge!(RESPONSE_STORE_ENTRIES, "Stored responses held.");
            metrics::describe_gauge!(
                KV_CACHE_USAGE_PERC,
                "Fraction of KV cache blocks in use (1 = full)."
            );
            metrics::describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens processed.");
            metrics::describe_counter!(GENERATION_TOKENS_TOTAL, "Tokens generated.");
            metrics::describe_counter!(
                REQUEST_SUCCESS_TOTAL,
                "Finished requests by finished_reason."
            );
            metrics::describe_histogram!(
                TIME_TO_FIRST_TOKEN_SECONDS,
                metrics::Unit::Seconds,
                "Time to first token."
            );
            metrics::describe_histogram!(
                INTER_TOKEN_LATENCY_SECONDS,
                metrics::Unit::Seconds,
                "Time between consecutive tokens."
            );
            metrics::describe_histogram!(
                E2E_REQUEST_LATENCY_SECONDS,
                metrics::Unit::Seconds,
                "Request latency from submission to its end."
            );
            metrics::describe_histogram!(
                REQUEST_QUEUE_TIME_SECONDS,
                metrics::Unit::Seconds,
                "Time from submission to admission."
            );
            metrics::describe_counter!(NUM_PREEMPTIONS_TOTAL, "Preemptions.");
            metrics::describe_counter!(
                SPEC_DECODE_NUM_DRAFT_TOKENS,
                "Proposed tokens verified by speculative decoding."
            );
            metrics::describe_counter!(
                SPEC_DECODE_NUM_ACCEPTED_TOKENS,
                "Proposed tokens accepted by speculative decoding."
            );
            metrics::describe_counter!(
                PREFIX_CACHE_QUERIES_TOTAL,
                "Prompt tokens looked up in the prefix cache."
            );
            metrics::describe_counter!(
                PREFIX_CACHE_HITS_TOTAL,
                "Prompt tokens served from the prefix cache."
            );
            for (name, help) in [
                (
                    PREFIX_CACHE_DISK_HITS_TOTAL,
                    "Prompt tokens served from prefix blocks read from disk at start.",
                ),
                (
                    PREFIX_CACHE_DISK_LOADED_BLOCKS,
                    "Prefix blocks read from disk into the KV pool at start.",
                ),
                (
                    PREFIX_CACHE_DISK_REFUSED_FILES,
                    "Prefix cache files refused at start (another model or configuration, or damaged).",
                ),
                (
                    PREFIX_CACHE_DISK_WRITTEN_BLOCKS,
                    "Prefix blocks written to disk.",
                ),
                (
                    PREFIX_CACHE_DISK_DROPPED_BLOCKS,
                    "Prefix blocks not written to disk (queue full or write failed).",
                ),
            ] {
                metrics::describe_counter!(name, help);
            }
            metrics::describe_counter!(
                REQUESTS_REJECTED_TOTAL,
                "Requests refused because the queue was full."
            );
            metrics::describe_counter!(
                PROMPTS_TOKENIZED_TOTAL,
                "Prompts tokenized (each prompt of a request once, whatever n)."
            );
        });
    }

    /// Counts an API request of `tenant`; `keyed` says whether it is an API-key tenant
    /// (a bounded set, so a label); other names count as `other`.
    pub fn tenant_request(&self, tenant: &str, keyed: bool) {
        let label = if keyed {
            tenant.to_string()
        } else {
            "other".into()
        };
        self.with(|| {
            metrics::counter!(TENANT_REQUESTS_TOTAL, "tenant" => label).increment(1);
        });
    }

    /// A request was accepted with a prompt of `tokens` tokens.
    pub fn prompt(&self, tokens: usize) {
        self.with(|| {
            metrics::counter!(PROMPT_TOKENS_TOTAL).increment(tokens as u64);
            metrics::counter!(PREFIX_CACHE_QUERIES_TOTAL).increment(tokens as u64);
        });
    }

    /// A token arrived `since_previous` after the request's previous one (`None` for
    /// the first).
    pub fn token(&self, since_previous: Option<Duration>) {
        self.with(|| {
            metrics::counter!(GENERATION_TOKENS_TOTAL).increment(1);
            if let Some(gap) = since_previous {
                metrics::histogram!(INTER_TOKEN_LATENCY_SECONDS).record(gap.as_secs_f64());
            }
        });
    }

    /// A request ended.
    pub fn finished(
        &self,
        reason: &'static str,
        time_to_first_token: Option<Duration>,
        e2e: Duration,
        queue_time: Option<Duration>,
    ) {
        self.with(|| {
            metrics::counter!(REQUEST_SUCCESS_TOTAL, "finished_reason" => reason).increment(1);
            if let Some(ttft) = time_to_first_token {
                metrics::histogram!(TIME_TO_FIRST_TOKEN_SECONDS).record(ttft.as_secs_f64());
            }
            metrics::histogram!(E2E_REQUEST_LATENCY_SECONDS).record(e2e.as_secs_f64());
            if let Some(queue) = queue_time {
                metrics::histogram!(REQUEST_QUEUE_TIME_SECONDS).record(queue.as_secs_f64());
            }
        });
    }

    /// The response store holds `entries` responses in `bytes` bytes.
    pub fn response_store(&self, bytes: usize, entries: usize) {
        self.with(|| {
            metrics::gauge!(RESPONSE_STORE_BYTES).set(bytes as f64);
            metrics::gauge!(RESPONSE_STORE_ENTRIES).set(entries as f64);
        });
    }

    /// `prompts` prompts have been tokenized since the server started.
    pub fn prompts_tokenized(&self, prompts: u64) {
        self.with(|| metrics::counter!(PROMPTS_TOKENIZED_TOTAL).absolute(prompts));
    }

    /// The Prometheus text exposition, with gauges and engine counters from `engine`
    /// (none while the model loads); the per-tenant counters only with `tenants` (the
    /// server shows them only behind its metrics key).
    pub fn render(&self, engine: Option<&EngineMetrics>, tenants: bool) -> String {
        if let Some(m) = engine {
            self.with(|| {
                metrics::gauge!(NUM_REQUESTS_RUNNING).set((m.running + m.prefilling) as f64);
                metrics::gauge!(NUM_REQUESTS_WAITING).set(m.waiting as f64);
                let usage = if m.kv_blocks_total == 0 {
                    0.0
                } else {
                    m.kv_blocks_used as f64 / m.kv_blocks_total as f64
                };
                metrics::gauge!(KV_CACHE_USAGE_PERC).set(usage);
                metrics::counter!(NUM_PREEMPTIONS_TOTAL).absolute(m.preemptions);
                metrics::counter!(PREFIX_CACHE_HITS_TOTAL).absolute(m.prefix_hit_tokens);
                metrics::counter!(REQUESTS_REJECTED_TOTAL).absolute(m.rejected);
                for (name, value) in [
                    (PREFIX_CACHE_DISK_HITS_TOTAL, m.prefix_disk_hit_tokens),
                    (PREFIX_CACHE_DISK_LOADED_BLOCKS, m.prefix_disk_loaded_blocks),
                    (PREFIX_CACHE_DISK_REFUSED_FILES, m.prefix_disk_refused_files),
                    (
                        PREFIX_CACHE_DISK_WRITTEN_BLOCKS,
                        m.prefix_disk_written_blocks,
                    ),
                    (
                        PREFIX_CACHE_DISK_DROPPED_BLOCKS,
                        m.prefix_disk_dropped_blocks,
                    ),
                ] {
                    metrics::counter!(name).absolute(value);
                }
                metrics::counter!(SPEC_DECODE_NUM_DRAFT_TOKENS)
                    .absolute(m.spec_decode_num_draft_tokens);
                metrics::counter!(SPEC_DECODE_NUM_ACCEPTED_TOKENS)
                    .absolute(m.spec_decode_num_accepted_tokens);
            });
        }
        let handle = self.recorder.handle();
        handle.run_upkeep();
        let text = handle.render();
        if tenants {
            return text;
        }
        // The per-tenant family, its HELP and TYPE lines included, left out.
        text.lines()
            .filter(|line| !line.contains(TENANT_REQUESTS_TOTAL))
            .fold(String::with_capacity(text.len()), |mut out, line| {
                out.push_str(line);
                out.push('\n');
                out
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_prefix() {
        let m = ServerMetrics::new("smol").unwrap();
        m.prompt(12);
        m.token(None);
        m.token(Some(Duration::from_millis(20)));
        m.finished(
            "stop",
            Some(Duration::from_millis(50)),
            Duration::from_millis(90),
            Some(Duration::from_millis(1)),
        );
        let engine = EngineMetrics {
            running: 2,
            prefilling: 1,
            waiting: 4,
            kv_blocks_used: 5,
            kv_blocks_total: 10,
            preemptions: 3,
            ..Default::default()
        };
        m.tenant_request("acme", true);
        let named = m.render(Some(&engine), true);
        assert!(named.contains("tenant=\"acme\""), "{named}");
        let text = m.render(Some(&engine), false);
        assert!(!text.contains("tenant"), "{text}");
        for expected in [
            "llama_burn:num_requests_running{model_name=\"smol\"} 3",
            "llama_burn:num_requests_waiting{model_name=\"smol\"} 4",
            "llama_burn:kv_cache_usage_perc{model_name=\"smol\"} 0.5",
            "llama_burn:prompt_tokens_total{model_name=\"smol\"} 12",
            "llama_burn:generation_tokens_total{model_name=\"smol\"} 2",
            "llama_burn:num_preemptions_total{model_name=\"smol\"} 3",
            "llama_burn:time_to_first_token_seconds_bucket",
            "llama_burn:inter_token_latency_seconds_count{model_name=\"smol\"} 1",
            "llama_burn:e2e_request_latency_seconds_sum",
            "llama_burn:request_queue_time_seconds_count",
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
        assert!(text.contains("llama_burn:request_success_total{"));
        assert!(text.contains("finished_reason=\"stop\""));
    }
}
