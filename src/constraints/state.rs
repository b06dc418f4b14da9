//! A request's constraint state: where it is in its grammar, advanced token by token.

use std::sync::Arc;

use llguidance::Matcher;

use super::ConstraintVocab;
use crate::error::{LlamaError, Result};

/// Where a constrained request is in its grammar. It lives in the request's sampler
/// ([`Pipeline::with_constraint`](crate::sampling::Pipeline::with_constraint)), next to
/// its random generator, so it travels wherever the request's sampling state does (a
/// concurrent job between tokens, a batched row, a continuous-engine request through
/// preemption and recompute, which keep a request's generated tokens and so its state).
///
/// Made by [`compile`](super::compile::compile) (or
/// [`Llama::compile_constraint`](crate::llama::Llama::compile_constraint)).
#[derive(Clone)]
pub struct ConstraintState {
    matcher: Matcher,
    vocab: Arc<ConstraintVocab>,
    accepted: usize,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState")
            .field("accepted", &self.accepted)
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl ConstraintState {
    pub(crate) fn new(matcher: Matcher, vocab: Arc<ConstraintVocab>) -> Self {
        Self {
            matcher,
            vocab,
            accepted: 0,
        }
    }

    /// An independent copy of a fresh state (the compiled-constraint cache's entries):
    /// the parser and its lexer caches cloned, nothing shared that either one changes.
    pub(crate) fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab.clone(),
            accepted: self.accepted,
        }
    }

    /// Tokens accepted so far (stop tokens are not counted: they end the output).
    pub fn accepted(&self) -> usize {
        self.accepted
    }

    /// Whether the output may end here (a stop token is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar is complete: only a stop token may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Takes back the last `n` accepted tokens (for an engine that discards generated
    /// tokens).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ConstraintFailed`] if `n` exceeds the tokens accepted.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > self.accepted {
            return Err(LlamaError::ConstraintFailed(format!(
                "cannot roll back {n} tokens, {} accepted",
                self.accepted
            )));
        }
        self.matcher.rollback(n).map_err(failed)?;
        self.accepted -= n;
        Ok(())
    }

    /// Computes the first mask, so limits are checked before the request runs.
    pub(crate) fn check_start(&mut self) -> Result<()> {
        let mask = self.matcher.compute_mask_or_eos().map_err(failed)?;
        if mask.is_zero() && !self.is_accepting() {
            return Err(LlamaError::ConstraintFailed(
                "the constraint allows no output with this vocabulary".into(),
            ));
        }
        Ok(())
    }

    /// Accepts `token` if the grammar allows it here (a stop token: if the output may
    /// end); returns whether it did.
    pub(crate) fn try_accept(&mut self, token: u32) -> Result<bool> {
        if self.vocab.is_stop(token) {
            return Ok(self.is_accepting());
        }
        if self.matcher.is_stopped() {
            return Ok(false);
        }
        let taken = self.matcher.try_consume_tokens(&[token]).map_err(failed)?;
        self.accepted += taken;
        Ok(taken == 1)
    }

    /// Writes `logits` into `out` with every token the grammar refuses here set to
    /// `-inf` (stop tokens allowed only where the output may end).
    pub(crate) fn mask(&mut self, logits: &[f32], out: &mut Vec<f32>) -> Result<()> {
        let mask = self.matcher.compute_mask_or_eos().map_err(failed)?;
        out.clear();
        out.resize(logits.len(), f32::NEG_INFINITY);
        let mut any = false;
        mask.iter_set_entries(|i| {
            if let (Some(o), Some(&l)) = (out.get_mut(i), logits.get(i)) {
                *o = l;
                any = true;
            }
        });
        let eos = self.vocab.eos as usize;
        if eos < mask.len() && mask.is_allowed(self.vocab.eos) || self.matcher.is_stopped() {
            for &id in &self.vocab.stop_ids {
                if let (Some(o), Some(&l)) = (out.get_mut(id as usize), logits.get(id as usize)) {
                    *o = l;
                    any = true;
                }
            }
        }
        if !any {
            return Err(LlamaError::ConstraintFailed(
                "the constraint allows no token here".into(),
            ));
        }
        Ok(())
    }

    /// Advances past `token`, which the mask allowed (a stop token is not consumed).
    pub(crate) fn accept(&mut self, token: u32) -> Result<()> {
        if self.vocab.is_stop(token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(failed)?;
        self.accepted += 1;
        Ok(())
    }
}

fn failed(e: impl std::fmt::Display) -> LlamaError {
    LlamaError::ConstraintFailed(e.to_string())
}
