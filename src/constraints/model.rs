//! A model's constraint vocabulary, cached, and compiling constraints against it.

use std::sync::Arc;

use super::{Constraint, ConstraintLimits, ConstraintState, ConstraintVocab, compile};
use crate::backend::LlamaBackend;
use crate::error::Result;
use crate::llama::Llama;
use crate::tokenizer::Tokenizer;

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
        if let Some(vocab) = self.constraint_vocab.get() {
            return Ok(vocab.clone());
        }
        let vocab = Arc::new(ConstraintVocab::new(
            &self.tokenizer,
            self.config().vocab_size,
            ConstraintLimits::default(),
        )?);
        Ok(self.constraint_vocab.get_or_init(|| vocab).clone())
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
