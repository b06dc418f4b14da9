//! Stored responses (`store: true` on `/v1/responses`): what `GET /v1/responses/{id}`
//! answers and what `previous_response_id` continues, kept per tenant (a tenant never
//! reads another's), within a byte budget (the oldest go first), and dropped once older
//! than their time to live.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::tokenizer::ChatMessage;

/// One stored response.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    /// The response object as it was sent (JSON text).
    pub(crate) json: String,
    /// The conversation up to and including this response's answer, as chat messages:
    /// what a request naming it as `previous_response_id` continues.
    pub(crate) conversation: Vec<ChatMessage>,
}

impl Stored {
    /// Bytes it is counted as: its text, and the messages' text and calls.
    fn bytes(&self) -> usize {
        let messages: usize = self
            .conversation
            .iter()
            .map(|m| {
                m.role.len()
                    + m.content.len()
                    + m.tool_call_id.as_ref().map_or(0, String::len)
                    + m.tool_calls
                        .iter()
                        .map(|c| c.id.len() + c.name.len() + c.arguments.len())
                        .sum::<usize>()
                    + std::mem::size_of::<ChatMessage>()
            })
            .sum();
        self.json.len() + messages + std::mem::size_of::<Self>()
    }
}

/// The store: responses by (tenant, id), in insertion order for eviction.
pub(crate) struct ResponseStore {
    inner: Mutex<Inner>,
    budget: usize,
    ttl: Duration,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<(String, String), (Stored, Instant, usize)>,
    order: VecDeque<(String, String)>,
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, key: &(String, String)) -> Option<Stored> {
        let (stored, _, bytes) = self.entries.remove(key)?;
        self.bytes -= bytes;
        Some(stored)
    }

    /// Drops the oldest entries while `fits` is false or they have expired.
    fn evict(&mut self, now: Instant, ttl: Duration, mut fits: impl FnMut(usize) -> bool) {
        while let Some(key) = self.order.front().cloned() {
            let expired = self
                .entries
                .get(&key)
                .is_none_or(|(_, at, _)| now.duration_since(*at) >= ttl);
            if !expired && fits(self.bytes) {
                break;
            }
            self.order.pop_front();
            self.remove(&key);
        }
    }
}

impl ResponseStore {
    /// A store of at most `budget` bytes whose entries live `ttl`.
    pub(crate) fn new(budget: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            budget,
            ttl,
        }
    }

    /// Keeps `stored` as `tenant`'s response `id`, evicting the oldest responses (of
    /// any tenant) to make room; one larger than the whole budget is not kept.
    /// Returns whether it was kept.
    pub(crate) fn insert(&self, tenant: &str, id: &str, stored: Stored) -> bool {
        // The key is held twice: in the map and in the eviction order.
        let bytes = stored.bytes()
            + 2 * (tenant.len() + id.len() + std::mem::size_of::<(String, String)>());
        if bytes > self.budget {
            return false;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return false;
        };
        let budget = self.budget;
        inner.evict(Instant::now(), self.ttl, |used| used + bytes <= budget);
        let key = (tenant.to_string(), id.to_string());
        inner.remove(&key);
        inner.bytes += bytes;
        inner.order.push_back(key.clone());
        inner.entries.insert(key, (stored, Instant::now(), bytes));
        true
    }

    /// `tenant`'s response `id`, unless it expired or was evicted.
    pub(crate) fn get(&self, tenant: &str, id: &str) -> Option<Stored> {
        let mut inner = self.inner.lock().ok()?;
        inner.evict(Instant::now(), self.ttl, |_| true);
        inner
            .entries
            .get(&(tenant.to_string(), id.to_string()))
            .map(|(stored, _, _)| stored.clone())
    }

    /// Deletes `tenant`'s response `id`; whether there was one.
    pub(crate) fn delete(&self, tenant: &str, id: &str) -> bool {
        let Ok(mut inner) = self.inner.lock() else {
            return false;
        };
        let key = (tenant.to_string(), id.to_string());
        inner.order.retain(|k| k != &key);
        inner.remove(&key).is_some()
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.usage().0
    }

    /// Bytes and responses held now (expired ones dropped first).
    pub(crate) fn usage(&self) -> (usize, usize) {
        let Ok(mut inner) = self.inner.lock() else {
            return (0, 0);
        };
        inner.evict(Instant::now(), self.ttl, |_| true);
        (inner.bytes, inner.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(text: &str) -> Stored {
        Stored {
            json: text.to_string(),
            conversation: vec![ChatMessage::new("user", text)],
        }
    }

    #[test]
    fn tenants_are_apart_and_the_budget_holds() {
        let one = stored(&"x".repeat(100)).bytes();
        let store = ResponseStore::new(3 * one, Duration::from_secs(60));
        assert!(store.insert("a", "r1", stored(&"x".repeat(100))));
        assert!(store.get("b", "r1").is_none(), "another tenant's");
        assert_eq!(store.get("a", "r1").map(|s| s.json.len()), Some(100));
        for i in 2..=5 {
            assert!(store.insert("a", &format!("r{i}"), stored(&"x".repeat(100))));
            assert!(store.bytes() <= 3 * one);
        }
        // The oldest went first.
        assert!(store.get("a", "r2").is_none());
        assert!(store.get("a", "r5").is_some());
        assert!(store.delete("a", "r5"));
        assert!(!store.delete("a", "r5"));
        assert!(!store.insert("a", "big", stored(&"x".repeat(10 * one))));
    }

    #[test]
    fn expired_responses_are_gone() {
        let store = ResponseStore::new(1 << 20, Duration::ZERO);
        store.insert("a", "r1", stored("hi"));
        assert!(store.get("a", "r1").is_none());
        assert_eq!(store.bytes(), 0);
    }
}
