//! A [`Constraint`] to a fresh [`ConstraintState`], in bounded time.

use std::sync::Arc;

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;

use super::{Constraint, ConstraintState, ConstraintVocab};
use crate::error::{LlamaError, Result};

/// Compiles `constraint` against `vocab` and computes its first mask, so a schema or
/// grammar the limits refuse is refused here, before the request runs.
///
/// # Errors
///
/// [`LlamaError::InvalidConstraint`] naming the problem (malformed, unsupported, or past
/// a limit of [`ConstraintLimits`](super::ConstraintLimits)).
pub fn compile(vocab: &Arc<ConstraintVocab>, constraint: &Constraint) -> Result<ConstraintState> {
    constraint.validate()?;
    let grammar = match constraint {
        Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
        Constraint::Regex(regex) => TopLevelGrammar::from_regex(regex),
        Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        Constraint::Choice(choices) => TopLevelGrammar::from_lark(choice_grammar(choices)),
    };
    let invalid = |e: String| LlamaError::InvalidConstraint(format!("{}: {e}", constraint.kind()));
    // llguidance reports its own panics as errors; a panic elsewhere in compiling is
    // contained here too, and refuses this constraint only.
    let matcher = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        vocab
            .factory
            .create_parser(grammar)
            .map(|parser| Matcher::new(Ok(parser)))
    }))
    .map_err(|_| invalid("the compiler failed".into()))?
    .map_err(|e| invalid(e.to_string()))?;
    let mut state = ConstraintState::new(matcher, vocab.clone());
    state.check_start().map_err(|e| match e {
        LlamaError::ConstraintFailed(message) => invalid(message),
        other => other,
    })?;
    Ok(state)
}

/// `schema` with the JSON layout we generate: no free whitespace (a small model could
/// otherwise spend its tokens on blank lines), `", "` and `": "` as separators. A schema
/// giving its own `x-guidance` options keeps them.
fn with_layout(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// The Lark grammar of a choice: one string literal per choice (JSON escapes are Lark's).
fn choice_grammar(choices: &[String]) -> String {
    let literals: Vec<String> = choices
        .iter()
        .map(|c| serde_json::Value::String(c.clone()).to_string())
        .collect();
    format!("start: {}", literals.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_escaped_literals() {
        let g = choice_grammar(&["a\"b".into(), "c\\d".into(), "x\ny".into()]);
        assert_eq!(g, r#"start: "a\"b" | "c\\d" | "x\ny""#);
    }
}
