//! KV memory budgets.
//!
//! - [`KvBudget`] sizes a KV store in tokens or bytes; the continuous-batching engine
//!   allocates its whole pool from one.
//! - [`KvLimits`] bound the per-request caches of the sequential, concurrent and batched
//!   strategies: how many requests may hold a cache at once and how many bytes their
//!   caches may take together. Every [`GenerationState`](crate::GenerationState) and
//!   [`BatchedGenerationState`](crate::BatchedGenerationState) made by a
//!   [`Llama`](crate::Llama) reserves the most its cache can ever grow to when it is
//!   created, and gives it back when it ends or is dropped. A request that does not fit
//!   now is refused with [`LlamaError::Overloaded`] instead of being allocated.
//!
//! A reservation is the cache's final size, not a guess: a request's cache is allocated
//! once for `prompt + max_tokens` positions and never grows past that, so the bytes
//! reserved are the bytes that can be allocated.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{LlamaError, Result};

/// The size of a KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBudget {
    /// Room for this many tokens. For the demo model (30 layers, 3 KV heads of 64) a
    /// token takes 46,080 bytes in f32, 23,040 in a half type (see
    /// [`LlamaConfig::kv_bytes_per_token_in`](crate::LlamaConfig::kv_bytes_per_token_in)).
    Tokens(usize),
    /// At most this many bytes of keys and values, counted in the model device's float
    /// type (4 bytes a value in f32, 2 in f16/bf16), by the continuous engine's pool and
    /// the per-request caches of the other strategies alike.
    Bytes(usize),
}

impl KvBudget {
    /// The budget in bytes, for a model whose token takes `bytes_per_token` bytes.
    pub fn bytes(&self, bytes_per_token: usize) -> usize {
        match *self {
            KvBudget::Tokens(tokens) => tokens.saturating_mul(bytes_per_token),
            KvBudget::Bytes(bytes) => bytes,
        }
    }
}

/// Limits on the per-request KV caches of the sequential, concurrent and batched
/// strategies, together (set with [`Llama::set_kv_limits`](crate::Llama::set_kv_limits)).
///
/// The defaults admit 256 requests and as many bytes as [`KvLimits::DEFAULT_TOKENS`]
/// tokens or one full context window, whichever is larger (so a single request may
/// always use the whole context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLimits {
    /// Most requests holding a KV cache at once (a batch counts one per row).
    pub max_requests: usize,
    /// Most KV memory those caches may take together.
    pub budget: KvBudget,
}

impl KvLimits {
    /// Tokens of the default budget: the same as the continuous engine's default pool.
    pub const DEFAULT_TOKENS: usize = 32 * 1024;
    /// Requests in flight allowed by default.
    pub const DEFAULT_MAX_REQUESTS: usize = 256;

    /// The default limits for a model whose context window is `max_seq_len` tokens.
    pub fn default_for(max_seq_len: usize) -> Self {
        Self {
            max_requests: Self::DEFAULT_MAX_REQUESTS,
            budget: KvBudget::Tokens(Self::DEFAULT_TOKENS.max(max_seq_len)),
        }
    }

    /// Limits with no bound (for callers that bound memory some other way).
    pub fn unlimited() -> Self {
        Self {
            max_requests: usize::MAX,
            budget: KvBudget::Bytes(usize::MAX),
        }
    }
}

/// What the per-request caches hold now, against their limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvUsage {
    /// Requests holding a reservation now.
    pub requests: usize,
    /// Bytes reserved now.
    pub bytes: usize,
    /// Most bytes reserved at once since the model was loaded (or
    /// [`Llama::reset_kv_peak`](crate::Llama::reset_kv_peak)).
    pub peak_bytes: usize,
    /// Requests refused because a limit was reached.
    pub refused: usize,
    /// The request limit.
    pub max_requests: usize,
    /// The byte limit.
    pub budget_bytes: usize,
}

/// The shared account of reservations (one per [`Llama`](crate::Llama)).
#[derive(Debug)]
pub(crate) struct KvLedger {
    usage: Mutex<KvUsage>,
}

impl KvLedger {
    pub(crate) fn new(max_requests: usize, budget_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            usage: Mutex::new(KvUsage {
                max_requests,
                budget_bytes,
                ..KvUsage::default()
            }),
        })
    }

    /// The counters are plain numbers, valid whatever a panicking holder was doing.
    fn lock(&self) -> MutexGuard<'_, KvUsage> {
        self.usage.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn usage(&self) -> KvUsage {
        *self.lock()
    }

    /// New limits; reservations already made are kept (new ones wait until the total is
    /// under the new limits).
    pub(crate) fn set_limits(&self, max_requests: usize, budget_bytes: usize) {
        let mut usage = self.lock();
        usage.max_requests = max_requests;
        usage.budget_bytes = budget_bytes;
    }

    pub(crate) fn reset_peak(&self) {
        let mut usage = self.lock();
        usage.peak_bytes = usage.bytes;
    }

    /// Reserves `bytes` for `requests` requests, or refuses with
    /// [`LlamaError::Overloaded`] when either limit would be passed.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        requests: usize,
        bytes: usize,
    ) -> Result<KvReservation> {
        let mut usage = self.lock();
        let refusal = if usage.requests.saturating_add(requests) > usage.max_requests {
            Some(LlamaError::Overloaded {
                resource: "requests holding a KV cache",
                in_use: usage.requests,
                requested: requests,
                limit: usage.max_requests,
            })
        } else if usage.bytes.saturating_add(bytes) > usage.budget_bytes {
            Some(LlamaError::Overloaded {
                resource: "KV cache bytes",
                in_use: usage.bytes,
                requested: bytes,
                limit: usage.budget_bytes,
            })
        } else {
            None
        };
        if let Some(refusal) = refusal {
            usage.refused += 1;
            return Err(refusal);
        }
        usage.requests += requests;
        usage.bytes += bytes;
        usage.peak_bytes = usage.peak_bytes.max(usage.bytes);
        Ok(KvReservation {
            ledger: Arc::clone(self),
            requests,
            bytes,
        })
    }

    fn release(&self, requests: usize, bytes: usize) {
        let mut usage = self.lock();
        usage.requests = usage.requests.saturating_sub(requests);
        usage.bytes = usage.bytes.saturating_sub(bytes);
    }
}

/// A claim on part of a [`KvLimits`] budget, given back when dropped.
#[derive(Debug)]
pub struct KvReservation {
    ledger: Arc<KvLedger>,
    requests: usize,
    bytes: usize,
}

impl KvReservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Requests counted.
    pub fn requests(&self) -> usize {
        self.requests
    }

    /// Gives back part of the claim (a batch whose finished rows left its cache).
    pub(crate) fn shrink_to(&mut self, requests: usize, bytes: usize) {
        let (requests, bytes) = (requests.min(self.requests), bytes.min(self.bytes));
        self.ledger
            .release(self.requests - requests, self.bytes - bytes);
        self.requests = requests;
        self.bytes = bytes;
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        self.ledger.release(self.requests, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_against_both_limits_and_are_returned_on_drop() {
        let ledger = KvLedger::new(2, 1000);
        let a = ledger.reserve(1, 600).expect("fits");
        assert!(matches!(
            ledger.reserve(1, 500),
            Err(LlamaError::Overloaded {
                in_use: 600,
                requested: 500,
                limit: 1000,
                ..
            })
        ));
        let b = ledger.reserve(1, 400).expect("fits exactly");
        assert!(matches!(
            ledger.reserve(1, 0),
            Err(LlamaError::Overloaded { limit: 2, .. })
        ));
        let usage = ledger.usage();
        assert_eq!((usage.requests, usage.bytes, usage.refused), (2, 1000, 2));
        drop(a);
        assert_eq!(ledger.usage().bytes, 400);
        drop(b);
        let usage = ledger.usage();
        assert_eq!(
            (usage.requests, usage.bytes, usage.peak_bytes),
            (0, 0, 1000)
        );
    }

    #[test]
    fn the_peak_is_the_most_granted_at_once() {
        let ledger = KvLedger::new(4, 1000);
        let a = ledger.reserve(1, 300).expect("fits");
        let b = ledger.reserve(1, 500).expect("fits");
        // Refused, whichever limit: counted as refused, never as reserved, not even in
        // the peak.
        crate::error::assert_err!(
            ledger.reserve(1, 201),
            LlamaError::Overloaded {
                resource: "KV cache bytes",
                requested: 201,
                ..
            }
        );
        ledger.set_limits(2, 1000);
        crate::error::assert_err!(
            ledger.reserve(1, 1),
            LlamaError::Overloaded {
                resource: "requests holding a KV cache",
                ..
            }
        );
        let usage = ledger.usage();
        assert_eq!(
            (usage.bytes, usage.peak_bytes, usage.refused),
            (800, 800, 2)
        );
        // The peak outlives what is given back, and is the most at once, not a sum.
        drop(b);
        ledger.set_limits(4, 1000);
        let c = ledger.reserve(1, 400).expect("fits");
        assert_eq!(
            (ledger.usage().bytes, ledger.usage().peak_bytes),
            (700, 800)
        );
        let d = ledger.reserve(1, 300).expect("fits exactly");
        assert_eq!(ledger.usage().peak_bytes, 1000);
        drop((a, c, d));
        // A reset starts from what is held now.
        let e = ledger.reserve(1, 100).expect("fits");
        ledger.reset_peak();
        assert_eq!(ledger.usage().peak_bytes, 100);
        drop(e);
        assert_eq!((ledger.usage().bytes, ledger.usage().peak_bytes), (0, 100));
    }

    #[test]
    fn shrinking_returns_the_difference() {
        let ledger = KvLedger::new(8, 1000);
        let mut batch = ledger.reserve(4, 800).expect("fits");
        batch.shrink_to(1, 200);
        assert_eq!((ledger.usage().requests, ledger.usage().bytes), (1, 200));
        // Shrinking never grows a claim.
        batch.shrink_to(3, 900);
        assert_eq!((batch.requests(), batch.bytes()), (1, 200));
        drop(batch);
        assert_eq!(ledger.usage().bytes, 0);
    }

    #[test]
    fn budgets_convert_to_bytes() {
        assert_eq!(KvBudget::Tokens(10).bytes(46_080), 460_800);
        assert_eq!(KvBudget::Bytes(77).bytes(46_080), 77);
        assert_eq!(KvBudget::Tokens(usize::MAX).bytes(2), usize::MAX);
        assert_eq!(
            KvLimits::default_for(131_072).budget,
            KvBudget::Tokens(131_072)
        );
    }
}
