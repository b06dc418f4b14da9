//! Structured outputs: constraining decoding to a JSON Schema, a regular expression, a
//! Lark grammar or a choice among strings, on [`llguidance`].
//!
//! - [`vocab`]: the token environment llguidance reads (every token's bytes, special
//!   tokens marked so text can never match them), built once per model from its
//!   [`Tokenizer`](crate::tokenizer::Tokenizer), with the engine's [`ConstraintLimits`];
//! - [`compile`]: a [`Constraint`] to a fresh [`ConstraintState`], in bounded time (the
//!   limits refuse a hostile schema or grammar with [`LlamaError::InvalidConstraint`]);
//! - [`state`]: a request's constraint state, which lives in its sampler
//!   ([`Pipeline::with_constraint`](crate::sampling::Pipeline::with_constraint)) and
//!   advances with each accepted token.
//!
//! The mask is one step of the sampling pipeline, after bias, penalties and bans and
//! before temperature and truncation. The sampled token is checked first and the full
//! mask is computed only when the grammar refuses it (exact for greedy decoding and for
//! plain temperature sampling; with top-k, top-p or min-p on, the mask comes first so the
//! truncation sees only allowed tokens). The model's stop tokens are allowed only where
//! the grammar may end.
//!
//! ```no_run
//! use llama_burn::constraints::Constraint;
//! use llama_burn::inference::GenerateRequest;
//!
//! let schema = serde_json::json!({
//!     "type": "object",
//!     "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
//!     "required": ["name", "age"]
//! });
//! let request = GenerateRequest::new("A person as JSON:")
//!     .with_constraint(Constraint::JsonSchema(schema))
//!     .with_max_tokens(64);
//! assert!(request.validate(2048).is_ok());
//! ```

pub mod compile;
pub(crate) mod model;
pub mod state;
pub mod vocab;

pub use state::ConstraintState;
pub use vocab::{ConstraintLimits, ConstraintVocab};

use crate::error::{LlamaError, Result};

/// Most strings a [`Constraint::Choice`] may list.
pub const MAX_CHOICES: usize = 4096;

/// What a constrained request's output must be.
///
/// ```
/// use llama_burn::LlamaError;
/// use llama_burn::constraints::Constraint;
///
/// let c = Constraint::Choice(vec!["yes".into(), "no".into()]);
/// assert!(c.validate().is_ok());
/// assert!(matches!(
///     Constraint::Choice(vec![]).validate(),
///     Err(LlamaError::InvalidConstraint(m)) if m.contains("at least one string")
/// ));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value valid against this JSON Schema (llguidance's supported subset:
    /// objects, arrays, enums, `anyOf`/`oneOf`, bounded numbers and strings, patterns,
    /// local `$ref`s). `{"type": "object"}` is OpenAI's `json_object` mode. The output is
    /// laid out as `{"a": 1, "b": [2, 3]}` (no other whitespace) unless the schema sets
    /// llguidance's own `x-guidance` options.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression as a whole (Rust `regex` syntax).
    Regex(String),
    /// Text of this Lark grammar (llguidance's Lark dialect; `start` is the start rule).
    Grammar(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Constraint {
    /// A short name of its kind (`json_schema`, `regex`, `grammar`, `choice`).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Grammar(_) => "grammar",
            Constraint::Choice(_) => "choice",
        }
    }

    /// Checks what can be checked without compiling: a choice lists 1 to
    /// [`MAX_CHOICES`] strings, a regex or grammar is not empty.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidConstraint`] naming the problem.
    pub fn validate(&self) -> Result<()> {
        match self {
            Constraint::Choice(choices) if choices.is_empty() => Err(
                LlamaError::InvalidConstraint("a choice needs at least one string".into()),
            ),
            Constraint::Choice(choices) if choices.len() > MAX_CHOICES => {
                Err(LlamaError::InvalidConstraint(format!(
                    "a choice lists {} strings, at most {MAX_CHOICES}",
                    choices.len()
                )))
            }
            Constraint::Regex(text) | Constraint::Grammar(text) if text.trim().is_empty() => Err(
                LlamaError::InvalidConstraint(format!("the {} is empty", self.kind())),
            ),
            _ => Ok(()),
        }
    }

    /// Bytes of text the constraint holds (its schema serialized, its pattern, grammar or
    /// strings): what a server limits before compiling.
    pub fn text_len(&self) -> usize {
        match self {
            Constraint::JsonSchema(schema) => schema.to_string().len(),
            Constraint::Regex(text) | Constraint::Grammar(text) => text.len(),
            Constraint::Choice(choices) => choices.iter().map(String::len).sum(),
        }
    }
}
