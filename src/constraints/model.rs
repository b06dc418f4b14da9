//! A model's constraint vocabulary, cached, and compiling constraints against it.

use std::sync::{Arc, OnceLock};

use super::{Constraint, ConstraintLimits, ConstraintState, ConstraintVocab, compile};
use crate::backend::LlamaBackend;
use crate::error::Result;
use crate::llama::Llama;
use crate::tokenizer::Tokenizer;

/// Where a model keeps its constraint vocabulary once built: shared (an `Arc`) between
/// the model and whoever compiles constraints for it on other threads.
pub(crate) type VocabCell = Arc<OnceLock<Arc<ConstraintVocab>>>;

/// The vocabulary in `cell`, built from `tokenizer` with the default limits if it is not
/// there yet.
pub(crate) fn vocab_in<T: Tokenizer + ?Sized>(
    cell: &VocabCell,
    tokenizer: &T,
    vocab_size: usize,
) -> Result<Arc<ConstraintVocab>> {
    if let Some(vocab) = cell.get() {
        return Ok(vocab.clone());
    }
    let vocab = Arc::new(ConstraintVocab::new(
        tokenizer,
        vocab_size,
        ConstraintLimits::default(),
    )?);
    Ok(cell.get_or_init(|| vocab).clone())
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// The constraint engine's view of this model's vocabulary, built on first use with
    /// the default [`ConstraintLimits`] (or those of
    /// [`set_constraint_limits`](Self::set_constraint_limits)) and cached.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidConstraint`](crate::LlamaError::InvalidConstraint) when the
    /// tokenizer has no stop token.
    pub fn constraint_vocab(&self) -> Result<Arc<ConstraintVocab>> {
        vocab_in(
            &self.constraint_vocab,
            &self.tokenizer,
            self.config().vocab_size,
        )
    }

    /// Sets the constraint engine's limits (builds its vocabulary now; once set, they
    /// hold for the model's life).
    ///
    /// # Errors
    ///
    /// As [`constraint_vocab`](Self::constraint_vocab); and
    /// [`LlamaError::InvalidParameter`](crate::LlamaError::InvalidParameter) if the
    /// vocabulary was already built with other limits.
    pub fn set_constraint_limits(&mut self, limits: ConstraintLimits) -> Result<()> {
        if let Some(vocab) = self.constraint_vocab.get() {
            if *vocab.limits() == limits {
                return Ok(());
            }
            return Err(crate::LlamaError::invalid(
                "constraint_limits",
                "changed",
                "set before the first constrained request",
            ));
        }
        let vocab = ConstraintVocab::new(&self.tokenizer, self.config().vocab_size, limits)?;
        let _ = self.constraint_vocab.set(Arc::new(vocab));
        Ok(())
    }

    /// Compiles `constraint` for this model: the state to give a sampler
    /// ([`Pipeline::with_constraint`](crate::sampling::Pipeline::with_constraint)).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidConstraint`](crate::LlamaError::InvalidConstraint) naming the
    /// problem, in time bounded by the [`ConstraintLimits`].
    pub fn compile_constraint(&self, constraint: &Constraint) -> Result<ConstraintState> {
        compile::compile(&self.constraint_vocab()?, constraint)
    }
}
