//! The token environment llguidance reads, built once per model from its tokenizer.

use std::sync::Arc;

use llguidance::ParserFactory;
use llguidance::api::ParserLimits;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::{LlamaError, Result};
use crate::tokenizer::Tokenizer;

/// The constraint engine's limits: a schema or grammar needing more is refused (when it
/// is compiled, or when a step needs more, with the request ending in
/// [`LlamaError::ConstraintFailed`]). Each bounds time or memory; the defaults refuse a
/// hostile schema in well under a second and keep a request's lexer under about 64 MB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConstraintLimits {
    /// Largest grammar, in symbols of its productions (a large JSON Schema is a few tens
    /// of thousands).
    pub max_grammar_size: usize,
    /// Work allowed to build the lexer's initial regular expressions (about 50 per µs).
    pub initial_lexer_fuel: u64,
    /// Lexer work allowed for one token's mask (about 14 per µs).
    pub step_lexer_fuel: u64,
    /// Parser items allowed for one token's mask (about 20 per µs).
    pub step_max_items: usize,
    /// Parser items allowed in one row of the parse (the grammar's branching).
    pub max_items_in_row: usize,
    /// Lexer states kept per request (1 to 2 kB each).
    pub max_lexer_states: usize,
    /// Compiled constraints kept for reuse (least recently used dropped first; 0 keeps
    /// none): a request repeating a schema, a regex or a grammar, or the `n` choices
    /// of one request, compile it once.
    pub compiled_cache_entries: usize,
}

impl Default for ConstraintLimits {
    fn default() -> Self {
        Self {
            max_grammar_size: 200_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            step_max_items: 50_000,
            max_items_in_row: 2_000,
            max_lexer_states: 32_768,
            compiled_cache_entries: 64,
        }
    }
}

impl ConstraintLimits {
    fn parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_items_in_row: self.max_items_in_row,
            initial_lexer_fuel: self.initial_lexer_fuel,
            step_lexer_fuel: self.step_lexer_fuel,
            step_max_items: self.step_max_items,
            max_lexer_states: self.max_lexer_states,
            max_grammar_size: self.max_grammar_size,
            precompute_large_lexemes: true,
            // Errors name the problem, not the whole grammar and parser state.
            verbose_errors: false,
        }
    }
}

/// A model's vocabulary as llguidance sees it: each token's bytes (special tokens
/// marked, so no text constraint can produce them), the model's stop tokens, and the
/// parser factory with its [`ConstraintLimits`]. Built once per model
/// ([`Llama::constraint_vocab`](crate::llama::Llama::constraint_vocab) caches it) and
/// shared by every constrained request.
pub struct ConstraintVocab {
    pub(crate) factory: ParserFactory,
    pub(crate) stop_ids: Vec<u32>,
    pub(crate) eos: u32,
    vocab_size: usize,
    limits: ConstraintLimits,
    /// Compiled constraints by their text, most recently used last (at most
    /// `limits.compiled_cache_entries`).
    pub(crate) compiled: std::sync::Mutex<Vec<(String, super::ConstraintState)>>,
}

impl std::fmt::Debug for ConstraintVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintVocab")
            .field("vocab_size", &self.vocab_size)
            .field("stop_ids", &self.stop_ids)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl ConstraintVocab {
    /// Builds the environment for `tokenizer` under a model whose logits have
    /// `vocab_size` entries (ids the tokenizer lacks are never allowed).
    ///
    /// A token is special (a control token no text can produce) when encoding its text
    /// with special-token matching gives it back but encoding it as plain text does not.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidConstraint`] when the tokenizer has no stop token (a
    /// constrained output could never end) or llguidance refuses the vocabulary.
    pub fn new<T: Tokenizer + ?Sized>(
        tokenizer: &T,
        vocab_size: usize,
        limits: ConstraintLimits,
    ) -> Result<Self> {
        let stop_ids = tokenizer.stop_ids().to_vec();
        let eos = tokenizer
            .eos_id()
            .or_else(|| stop_ids.first().copied())
            .ok_or_else(|| {
                LlamaError::InvalidConstraint(
                    "the tokenizer has no stop token, so a constrained output could not end".into(),
                )
            })?;
        let n = u32::try_from(vocab_size)
            .map_err(|_| LlamaError::InvalidConstraint("vocabulary too large".into()))?;
        let words: Vec<Vec<u8>> = (0..n)
            .map(|id| token_word(tokenizer, id))
            .collect::<Result<_>>()?;
        let mut info = TokRxInfo::new(n, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| LlamaError::InvalidConstraint(format!("token environment: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits.parser_limits();
        Ok(Self {
            factory,
            stop_ids,
            eos,
            vocab_size,
            limits,
            compiled: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Entries of the logits it masks.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Its limits.
    pub fn limits(&self) -> &ConstraintLimits {
        &self.limits
    }

    /// How many compiled constraints the cache holds now (at most
    /// [`ConstraintLimits::compiled_cache_entries`]).
    pub fn cached_constraints(&self) -> usize {
        self.compiled
            .lock()
            .map_or_else(|e| e.into_inner().len(), |c| c.len())
    }

    /// Whether `id` is one of the model's stop tokens.
    pub(crate) fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }
}

/// The bytes llguidance sees for token `id`: its text, or for a special token its text
/// behind toktrie's marker byte; empty for an id the tokenizer lacks.
fn token_word<T: Tokenizer + ?Sized>(tokenizer: &T, id: u32) -> Result<Vec<u8>> {
    let Some(bytes) = tokenizer.token_bytes(id) else {
        return Ok(Vec::new());
    };
    let special = tokenizer.stop_ids().contains(&id)
        || tokenizer.bos_id() == Some(id)
        || match std::str::from_utf8(&bytes) {
            Ok(text) if !text.is_empty() => {
                tokenizer.encode_text(text).ok().as_deref() != Some(&[id][..])
                    && tokenizer.encode(text, false, false).ok().as_deref() == Some(&[id][..])
            }
            _ => false,
        };
    if special {
        let mut marked = Vec::with_capacity(bytes.len() + 1);
        marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
        marked.extend_from_slice(&bytes);
        Ok(marked)
    } else {
        Ok(bytes)
    }
}
