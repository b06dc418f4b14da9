//! Tokenization off the engine thread: a bounded pool of blocking threads that turns an
//! API request's prompts into token ids, each prompt once whatever `n`, before any of
//! its choices is submitted. The engine thread then deals in token ids only, so long
//! prompts cannot stall the streams it is running.
//!
//! At most [`ServerConfig::tokenizer_threads`] requests are tokenized at once (on
//! tokio's blocking threads) and at most [`ServerConfig::tokenizer_queue`] more wait for
//! a turn; beyond that a request gets 429 at once. The work held is bounded with them:
//! each request in the pool holds its parsed prompts, at most
//! [`ServerConfig::max_body_bytes`]. A request whose client has gone (its handler
//! dropped) is not tokenized: cancellation is checked before each prompt.
//!
//! [`ServerConfig::tokenizer_threads`]: super::ServerConfig::tokenizer_threads
//! [`ServerConfig::tokenizer_queue`]: super::ServerConfig::tokenizer_queue
//! [`ServerConfig::max_body_bytes`]: super::ServerConfig::max_body_bytes

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::Semaphore;

use super::Engine;
use crate::error::{LlamaError, Result};
use crate::inference::GenerateRequest;

/// The pool's two bounds: requests in it (tokenizing or waiting) and requests
/// tokenizing.
pub(crate) struct TokenizerPool {
    /// Permits for requests in the pool: threads + queue.
    admitted: Arc<Semaphore>,
    /// Permits for requests being tokenized: threads.
    running: Arc<Semaphore>,
    /// The pool's size as configured (for the 429's numbers).
    limit: usize,
    /// Prompts tokenized since the server started (tests read it to see that a prompt is
    /// tokenized once whatever `n`, and not at all for a client that went away).
    prompts: Arc<AtomicU64>,
}

/// Set when dropped: tells the blocking job that its request is gone.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl TokenizerPool {
    /// A pool of `threads` threads and `queue` waiting requests.
    pub(crate) fn new(threads: usize, queue: usize) -> Self {
        let limit = threads.saturating_add(queue).min(Semaphore::MAX_PERMITS);
        Self {
            admitted: Arc::new(Semaphore::new(limit)),
            running: Arc::new(Semaphore::new(threads.min(Semaphore::MAX_PERMITS))),
            limit,
            prompts: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Prompts tokenized so far.
    pub(crate) fn prompts_tokenized(&self) -> u64 {
        self.prompts.load(Ordering::Acquire)
    }

    /// Validates and tokenizes each of `prompts` (each an engine request whose prompt is
    /// text, messages or ids, with the settings its choices will have) through
    /// `engine`, on a blocking thread, and returns their token ids in order, each with
    /// its text when `decode` says so for that prompt (an echoed prompt of ids).
    ///
    /// # Errors
    ///
    /// [`LlamaError::Overloaded`] when the pool and its queue are full; the first
    /// prompt's error ([`Engine::encode`]); [`LlamaError::Cancelled`] if this future is
    /// dropped meanwhile (nobody sees that one).
    pub(crate) async fn encode(
        &self,
        engine: Arc<dyn Engine>,
        prompts: Vec<GenerateRequest>,
        decode: Vec<bool>,
    ) -> Result<Vec<(Vec<u32>, Option<String>)>> {
        let mut decode = decode.into_iter();
        let items = prompts
            .into_iter()
            .map(|p| (p, decode.next().unwrap_or(false)))
            .collect();
        self.each(engine, items, |engine, (prompt, decode)| {
            let ids = engine.encode(prompt)?;
            let text = match decode {
                true => Some(engine.decode(&ids)?),
                false => None,
            };
            Ok((ids, text))
        })
        .await
    }

    /// Encodes each of `texts` as an input to embed ([`Engine::encode_text`]), on a
    /// blocking thread, and returns their token ids in order.
    ///
    /// # Errors
    ///
    /// As [`encode`](Self::encode), the first text's error
    /// ([`Engine::encode_text`]).
    pub(crate) async fn encode_texts(
        &self,
        engine: Arc<dyn Engine>,
        texts: Vec<String>,
    ) -> Result<Vec<Vec<u32>>> {
        self.each(engine, texts, |engine, text| engine.encode_text(text))
            .await
    }

    /// Runs `f` on each of `items` in order on a blocking thread of the pool, stopping
    /// at the first error or once this future is dropped.
    async fn each<I, O>(
        &self,
        engine: Arc<dyn Engine>,
        items: Vec<I>,
        f: impl Fn(&dyn Engine, &I) -> Result<O> + Send + 'static,
    ) -> Result<Vec<O>>
    where
        I: Send + 'static,
        O: Send + 'static,
    {
        let admitted =
            self.admitted
                .clone()
                .try_acquire_owned()
                .map_err(|_| LlamaError::Overloaded {
                    resource: "requests waiting for tokenization (--tokenizer-queue)",
                    in_use: self.limit,
                    requested: 1,
                    limit: self.limit,
                })?;
        // Dropping this future while it waits here costs nothing more.
        let running = self
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| LlamaError::Runtime("the tokenizer pool is closed".into()))?;
        let gone = Arc::new(AtomicBool::new(false));
        let _cancel = CancelOnDrop(gone.clone());
        let counter = self.prompts.clone();
        let job = tokio::task::spawn_blocking(move || {
            // The permits go with the work: a job whose request was dropped still counts
            // until it has seen that and stopped.
            let _permits = (admitted, running);
            let mut out = Vec::with_capacity(items.len());
            for item in &items {
                if gone.load(Ordering::Acquire) {
                    return Err(LlamaError::Cancelled);
                }
                out.push(f(&*engine, item)?);
                counter.fetch_add(1, Ordering::AcqRel);
            }
            Ok(out)
        });
        job.await
            .map_err(|e| LlamaError::StepFailed(format!("tokenizing the request failed ({e})")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend, default_device};
    use crate::inference::{ContinuousConfig, ContinuousEngine};
    use futures_util::FutureExt;

    fn engine() -> Arc<dyn Engine> {
        let path = crate::demo::demo_model_path().expect("demo model");
        let llama = crate::loader::Loader::gguf(path)
            .max_seq_len(128)
            .load::<DefaultBackend>(&default_device())
            .expect("demo model loads");
        let config = ContinuousConfig::default().with_kv_budget_tokens(1024);
        Arc::new(ContinuousEngine::start(llama, config).expect("engine starts"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bounded_cancelled_first_and_each_prompt_once() {
        let engine = engine();
        let pool = TokenizerPool::new(1, 1);
        let prompt = || GenerateRequest::new("The capital of France is").with_max_tokens(4);

        // The one thread is busy: a request waits for it, a second takes the queue's
        // one place, a third is refused at once.
        let busy = pool
            .running
            .clone()
            .try_acquire_owned()
            .expect("the thread");
        let mut waiting = Box::pin(pool.encode(engine.clone(), vec![prompt()], vec![]));
        assert!(
            waiting.as_mut().now_or_never().is_none(),
            "waits for the thread"
        );
        let mut queued = Box::pin(pool.encode(engine.clone(), vec![prompt()], vec![]));
        assert!(
            queued.as_mut().now_or_never().is_none(),
            "waits in the queue"
        );
        let refused = pool
            .encode(engine.clone(), vec![prompt()], vec![])
            .now_or_never()
            .expect("refused at once");
        match refused {
            Err(LlamaError::Overloaded { resource, .. }) => {
                assert!(resource.contains("--tokenizer-queue"), "{resource}")
            }
            other => panic!("expected Overloaded, got {other:?}"),
        }
        // The clients go away before their turn: their prompts are never tokenized.
        drop(waiting);
        drop(queued);
        drop(busy);
        assert_eq!(pool.prompts_tokenized(), 0);
        assert_eq!(
            pool.admitted.available_permits(),
            2,
            "its place is free again"
        );

        // Two prompts: two token-id lists, each prompt tokenized once; the second, a
        // prompt of ids, decoded too (an echoed one).
        let hi = engine.encode(&GenerateRequest::new("Hi")).expect("encode");
        let encoded = pool
            .encode(
                engine.clone(),
                vec![prompt(), GenerateRequest::from_ids(hi.clone())],
                vec![false, true],
            )
            .await
            .expect("tokenized");
        assert_eq!(encoded.len(), 2);
        assert_eq!(encoded[0].0, engine.encode(&prompt()).expect("encode"));
        assert_eq!(encoded[0].1, None);
        assert_eq!(encoded[1], (hi, Some("Hi".to_string())));
        assert_eq!(pool.prompts_tokenized(), 2);

        // The first invalid prompt's error comes back; the places are all free again.
        let too_long = GenerateRequest::new("word ".repeat(400)).with_max_tokens(4);
        let error = pool
            .encode(engine.clone(), vec![prompt(), too_long], vec![])
            .await
            .expect_err("too long");
        assert!(
            matches!(error, LlamaError::PromptTooLong { .. }),
            "{error:?}"
        );
        assert_eq!(pool.admitted.available_permits(), 2);
        assert_eq!(pool.running.available_permits(), 1);
    }
}
