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
    let capacity = vocab.limits().compiled_cache_entries;
    if capacity == 0 {
        return compile_fresh(vocab, constraint);
    }
    // The cache's key is the constraint's kind and text; a constraint that fails to
    // compile is not kept (it fails again, in bounded time).
    let key = cache_key(constraint);
    {
        let mut cache = vocab.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
            let entry = cache.remove(i);
            let state = entry.1.fork();
            cache.push(entry);
            return Ok(state);
        }
    }
    let state = compile_fresh(vocab, constraint)?;
    let mut cache = vocab.compiled.lock().unwrap_or_else(|e| e.into_inner());
    if !cache.iter().any(|(k, _)| *k == key) {
        if cache.len() >= capacity {
            cache.remove(0);
        }
        cache.push((key, state.fork()));
    }
    Ok(state)
}

/// The text a compiled constraint is cached under: its kind and its content.
fn cache_key(constraint: &Constraint) -> String {
    let text = match constraint {
        Constraint::JsonSchema(schema) => schema.to_string(),
        Constraint::Regex(regex) => regex.clone(),
        Constraint::Grammar(lark) => lark.clone(),
        Constraint::Choice(choices) => serde_json::Value::from(choices.clone()).to_string(),
    };
    format!("{}\n{text}", constraint.kind())
}

/// Compiles `constraint` (already validated) without the cache.
fn compile_fresh(vocab: &Arc<ConstraintVocab>, constraint: &Constraint) -> Result<ConstraintState> {
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
