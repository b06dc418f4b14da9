//! The draft-model proposer.

use super::Proposer;
use crate::backend::LlamaBackend;
use crate::cache::KvCache;
use crate::error::Result;
use crate::llama::logits_to_vec;
use crate::model::Transformer;
use crate::sampling::argmax;

/// Proposes a draft model's greedy continuation. The draft shares the target's
/// tokenizer (checked by [`Llama::set_draft_model`](crate::Llama::set_draft_model)),
/// keeps its own KV cache of the request's history, and on each proposal rolls it back
/// to what the history still shares with it (rejected proposals go) and reads the rest.
#[derive(Debug)]
pub struct DraftModel<B: LlamaBackend> {
    model: Transformer<B>,
    cache: Option<KvCache<B>>,
    /// The tokens whose keys and values are in `cache`.
    cached: Vec<u32>,
}

impl<B: LlamaBackend> DraftModel<B> {
    /// A proposer running `model` (a clone of a loaded model shares its weights).
    pub fn new(model: Transformer<B>) -> Self {
        Self {
            model,
            cache: None,
            cached: Vec::new(),
        }
    }

    /// The logits of the next token after feeding `tokens` (appended to the cache).
    fn feed(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        let model = &self.model;
        let cache = self
            .cache
            .get_or_insert_with(|| model.new_cache(vec![0], capacity));
        let logits = model.forward_prompt(tokens, cache)?;
        self.cached.extend_from_slice(tokens);
        logits_to_vec(logits)
    }
}

impl<B: LlamaBackend> Proposer for DraftModel<B> {
    fn propose(&mut self, history: &[u32], k: usize, out: &mut Vec<u32>) -> Result<()> {
        let max = self.model.config().max_seq_len;
        // The draft's cache holds the history and `k - 1` proposals.
        let k = k.min((max + 1).saturating_sub(history.len()));
        if k == 0 || history.is_empty() {
            return Ok(());
        }
        // Keep what the history still shares with the cache, less at least the last
        // token (fed again for its logits).
        let common = self
            .cached
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        self.cached.truncate(common);
        if let Some(cache) = self.cache.as_mut() {
            cache.truncate(common);
        }
        let mut logits = self.feed(&history[common..], history.len() + k)?;
        for j in 0..k {
            let token = argmax(&logits);
            out.push(token);
            if j + 1 < k {
                logits = self.feed(&[token], history.len() + k)?;
            }
        }
        Ok(())
    }
}
