//! One API request on the engine: its choices as engine requests, their events as an
//! async sequence of [`Update`]s with stop strings applied, and cancellation of whatever
//! still runs when the [`Generation`] is dropped (the client went away, a stop string
//! ended a choice, the server shuts down).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::error::ApiError;
use super::openai::{CachedTokens, Endpoint, Usage};
use super::stop::StopMatcher;
use super::{Shared, TenantSlot};
use crate::error::LlamaError;
use crate::inference::{CancelToken, EngineEvent, GenerateRequest, Scope};
use crate::llama::StopReason;
use crate::sampling::{TokenLogprob, TokenLogprobs};

/// One choice to generate.
#[derive(Debug, Clone)]
pub(crate) struct ChoiceSpec {
    /// The engine request.
    pub request: GenerateRequest,
    /// Which prompt of the API request it continues (for usage).
    pub prompt: usize,
    /// Its stop strings.
    pub stop: Vec<String>,
    /// The prompt text to send back first (completions' `echo`).
    pub echo: Option<String>,
    /// Leave the generated token out (`echo` with `max_tokens: 0`).
    pub prompt_only: bool,
}

/// What happened next in a generation.
#[derive(Debug)]
pub(crate) enum Update {
    /// New text for choice `index`.
    Text {
        /// The choice.
        index: usize,
        /// The text.
        text: String,
        /// The log-probabilities of the tokens generated since the last update, with
        /// each token's character offset in the choice's text (when asked for).
        logprobs: Vec<(TokenLogprobs, usize)>,
    },
    /// Choice `index` ended, with its last text.
    Finished {
        /// The choice.
        index: usize,
        /// The text held back until now (may be empty).
        text: String,
        /// `stop` or `length`.
        reason: &'static str,
        /// As for `Text`.
        logprobs: Vec<(TokenLogprobs, usize)>,
    },
    /// A choice failed; the request ends with this error.
    Failed(ApiError),
}

struct Choice {
    prompt: usize,
    matcher: StopMatcher,
    cancel: CancelToken,
    prompt_tokens: Option<usize>,
    /// Prompt tokens read from the prefix cache (told with the first token).
    cached_tokens: usize,
    completion_tokens: usize,
    finish: Option<&'static str>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Log-probabilities not sent yet, with each token's character offset.
    logprobs: Vec<(TokenLogprobs, usize)>,
    /// Characters of token text received so far.
    chars: usize,
    /// The prompt to send back before the first token's text.
    echo: Option<String>,
    /// Leave generated tokens out of the answer.
    prompt_only: bool,
}

/// A request's choices running on the engine.
pub(crate) struct Generation {
    shared: Arc<Shared>,
    id: u64,
    /// The client's `X-Request-Id`, or the response id: logged with the request.
    request_id: String,
    endpoint: Endpoint,
    started: Instant,
    events: mpsc::Receiver<(usize, EngineEvent)>,
    pending: VecDeque<(usize, EngineEvent)>,
    choices: Vec<Choice>,
    /// The tenant's share this request holds, given back when it ends.
    _slot: TenantSlot,
}

impl Generation {
    /// Submits every choice (in `scope`: prefix-cache partition and tenant) and waits
    /// until the
    /// engine has accepted them all, so that an invalid request is an error status, not
    /// a broken stream.
    ///
    /// The events wait in a channel of [`ServerConfig::max_unsent_events`] per choice:
    /// when a client stops reading, its stream stops taking events, the channel fills,
    /// and the engine drops the request (freeing its KV blocks) instead of buffering its
    /// whole answer.
    ///
    /// [`ServerConfig::max_unsent_events`]: super::ServerConfig::max_unsent_events
    pub(crate) async fn start(
        shared: Arc<Shared>,
        endpoint: Endpoint,
        specs: Vec<ChoiceSpec>,
        request_id: String,
        scope: Scope,
        slot: TenantSlot,
    ) -> Result<Self, ApiError> {
        let engine = shared.engine()?;
        let capacity = specs
            .len()
            .max(1)
            .saturating_mul(shared.config.max_unsent_events)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let (tx, events) = mpsc::channel(capacity);
        let id = shared.register();
        let mut generation = Self {
            shared: shared.clone(),
            id,
            request_id,
            endpoint,
            started: Instant::now(),
            events,
            pending: VecDeque::new(),
            choices: Vec::with_capacity(specs.len()),
            _slot: slot,
        };
        for (index, spec) in specs.into_iter().enumerate() {
            let cancel = CancelToken::new();
            shared.track(id, cancel.clone());
            // The engine thread sends the choice's events straight into this request's
            // channel; once the request is gone, sending fails and the engine drops the
            // choice.
            let tx = tx.clone();
            // `try_send`: the engine thread never waits; a full channel (the client stopped
            // reading) ends the choice.
            let on_event = Box::new(move |event| tx.try_send((index, event)).is_ok());
            engine
                .submit(spec.request, cancel.clone(), scope, on_event)
                .map_err(|e| ApiError::from_llama(&e, endpoint.prompt_param()))?;
            generation.choices.push(Choice {
                prompt: spec.prompt,
                matcher: StopMatcher::new(spec.stop),
                cancel,
                prompt_tokens: None,
                cached_tokens: 0,
                completion_tokens: 0,
                finish: None,
                first_token: None,
                last_token: None,
                logprobs: Vec::new(),
                chars: 0,
                echo: spec.echo,
                prompt_only: spec.prompt_only,
            });
        }
        drop(tx);
        generation.wait_accepted().await?;
        Ok(generation)
    }

    async fn wait_accepted(&mut self) -> Result<(), ApiError> {
        while self.choices.iter().any(|c| c.prompt_tokens.is_none()) {
            let Some((index, event)) = self.events.recv().await else {
                return Err(ApiError::unavailable("the engine stopped"));
            };
            match event {
                EngineEvent::Accepted { prompt_tokens } => {
                    if let Some(choice) = self.choices.get_mut(index) {
                        choice.prompt_tokens = Some(prompt_tokens);
                        self.shared.metrics.prompt(prompt_tokens);
                    }
                }
                EngineEvent::Done(Err(e)) => {
                    if let Some(choice) = self.choices.get_mut(index) {
                        choice.finish = Some("error");
                    }
                    return Err(ApiError::from_llama(&e, self.endpoint.prompt_param()));
                }
                other => self.pending.push_back((index, other)),
            }
        }
        Ok(())
    }

    /// Number of choices.
    pub(crate) fn len(&self) -> usize {
        self.choices.len()
    }

    /// The next update, or `None` once every choice has finished.
    pub(crate) async fn next(&mut self) -> Option<Update> {
        loop {
            if self.choices.iter().all(|c| c.finish.is_some()) {
                return None;
            }
            let (index, event) = match self.pending.pop_front() {
                Some(item) => item,
                None => match self.events.recv().await {
                    Some(item) => item,
                    None => {
                        self.abort_all("error");
                        return Some(Update::Failed(ApiError::unavailable("the engine stopped")));
                    }
                },
            };
            if let Some(update) = self.apply(index, event) {
                return Some(update);
            }
        }
    }

    fn apply(&mut self, index: usize, event: EngineEvent) -> Option<Update> {
        let choice = self.choices.get_mut(index)?;
        if choice.finish.is_some() {
            return None;
        }
        match event {
            EngineEvent::Accepted { .. } => None,
            EngineEvent::Token(mut token) => {
                if let Some(cached) = token.cached_prompt_tokens {
                    choice.cached_tokens = cached;
                }
                let prefix = match choice.echo.take() {
                    Some(prompt) => {
                        echo_logprobs(choice, &prompt, token.prompt_logprobs.take());
                        prompt
                    }
                    None => String::new(),
                };
                if choice.prompt_only {
                    return (!prefix.is_empty()).then(|| Update::Text {
                        index,
                        text: prefix,
                        logprobs: std::mem::take(&mut choice.logprobs),
                    });
                }
                let now = Instant::now();
                self.shared
                    .metrics
                    .token(choice.last_token.map(|last| now - last));
                choice.first_token.get_or_insert(now);
                choice.last_token = Some(now);
                choice.completion_tokens += 1;
                if let Some(lp) = token.logprobs {
                    choice.logprobs.push((lp, choice.chars));
                }
                choice.chars += token.token.chars().count();
                let mut out = choice.matcher.push(&token.token);
                out.text.insert_str(0, &prefix);
                if out.stopped {
                    // Nothing after a stop string is wanted: free the engine at once.
                    choice.cancel.cancel();
                    let logprobs = std::mem::take(&mut choice.logprobs);
                    self.finish(index, "stop", None);
                    Some(Update::Finished {
                        index,
                        text: out.text,
                        reason: "stop",
                        logprobs,
                    })
                } else if out.text.is_empty() {
                    None
                } else {
                    Some(Update::Text {
                        index,
                        text: out.text,
                        logprobs: std::mem::take(&mut choice.logprobs),
                    })
                }
            }
            EngineEvent::Done(Ok(metrics)) => {
                let text = match choice.prompt_only {
                    true => String::new(),
                    false => choice.matcher.finish(),
                };
                let logprobs = std::mem::take(&mut choice.logprobs);
                let reason = match metrics.stop_reason {
                    _ if choice.prompt_only => "length",
                    Some(StopReason::MaxTokens | StopReason::ContextFull) => "length",
                    _ => "stop",
                };
                self.finish(index, reason, Some(metrics.queue_time));
                Some(Update::Finished {
                    index,
                    text,
                    reason,
                    logprobs,
                })
            }
            EngineEvent::Done(Err(e)) => {
                let reason = if matches!(e, LlamaError::Cancelled) {
                    "abort"
                } else {
                    "error"
                };
                self.finish(index, reason, None);
                self.abort_all(reason);
                Some(Update::Failed(ApiError::from_llama(
                    &e,
                    self.endpoint.prompt_param(),
                )))
            }
        }
    }

    fn finish(&mut self, index: usize, reason: &'static str, queue_time: Option<Duration>) {
        let Some(choice) = self.choices.get_mut(index) else {
            return;
        };
        choice.finish = Some(reason);
        // Requests the engine refused are errors of the API request, not finished ones.
        if choice.prompt_tokens.is_some() {
            let ttft = choice.first_token.map(|t| t - self.started);
            self.shared
                .metrics
                .finished(reason, ttft, self.started.elapsed(), queue_time);
        }
    }

    /// Cancels every choice still running and counts it as ended for `reason`.
    fn abort_all(&mut self, reason: &'static str) {
        for index in 0..self.choices.len() {
            if self.choices[index].finish.is_none() {
                self.choices[index].cancel.cancel();
                self.finish(index, reason, None);
            }
        }
    }

    /// Token counts so far: each prompt once, every choice's generated tokens.
    pub(crate) fn usage(&self) -> Usage {
        // (prompt, its tokens, the fewest of them any of its choices read from cache)
        let mut prompts: Vec<(usize, usize, usize)> = Vec::new();
        for c in &self.choices {
            match prompts.iter_mut().find(|(p, _, _)| *p == c.prompt) {
                Some(entry) => entry.2 = entry.2.min(c.cached_tokens),
                None => prompts.push((c.prompt, c.prompt_tokens.unwrap_or(0), c.cached_tokens)),
            }
        }
        let prompt_tokens = prompts.iter().map(|&(_, n, _)| n).sum();
        let cached_tokens = prompts.iter().map(|&(_, _, c)| c).sum();
        let completion_tokens = self.choices.iter().map(|c| c.completion_tokens).sum();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: CachedTokens { cached_tokens },
        }
    }
}

/// Queues the echoed prompt's log-probabilities (when there are some) before the
/// generated tokens', and counts the prompt's characters for the text offsets. The first
/// prompt token has no log-probability (written null): its text is what the others'
/// bytes leave of the prompt.
fn echo_logprobs(choice: &mut Choice, prompt: &str, logprobs: Option<Vec<Option<TokenLogprobs>>>) {
    if let Some(entries) = logprobs {
        let rest: Vec<u8> = entries
            .iter()
            .flatten()
            .flat_map(|lp| lp.chosen.bytes.iter().copied())
            .collect();
        let first = prompt
            .as_bytes()
            .strip_suffix(rest.as_slice())
            .unwrap_or_default();
        let first = TokenLogprobs {
            chosen: TokenLogprob {
                token_id: 0,
                logprob: f32::NAN,
                bytes: first.to_vec(),
            },
            top: Vec::new(),
        };
        let mut offset = 0;
        for lp in std::iter::once(first).chain(entries.into_iter().flatten()) {
            let chars = String::from_utf8_lossy(&lp.chosen.bytes).chars().count();
            choice.logprobs.push((lp, offset));
            offset += chars;
        }
    }
    choice.chars = prompt.chars().count();
}

impl Drop for Generation {
    fn drop(&mut self) {
        let disconnected = self.choices.iter().any(|c| c.finish.is_none());
        // Whatever still runs is abandoned (client gone): free its KV blocks now.
        self.abort_all("abort");
        self.shared.unregister(self.id);
        if self.choices.is_empty() || self.choices.iter().all(|c| c.prompt_tokens.is_some()) {
            let usage = self.usage();
            let reasons: Vec<&str> = self.choices.iter().filter_map(|c| c.finish).collect();
            tracing::info!(
                request = self.id,
                request_id = self.request_id.as_str(),
                endpoint = self.endpoint.object(),
                choices = self.choices.len(),
                prompt_tokens = usage.prompt_tokens,
                completion_tokens = usage.completion_tokens,
                finish = reasons.join(",").as_str(),
                client_gone = disconnected,
                ms = self.started.elapsed().as_millis() as u64,
                "request done"
            );
        }
    }
}
