//! Structured outputs on the wire: OpenAI's `response_format` and vLLM's
//! `structured_outputs`, read into a [`Constraint`] and checked against the size limit
//! before anything is compiled.
//!
//! - `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}` (any
//!   JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
//! - `structured_outputs` (vLLM): exactly one of `json` (a schema, or its JSON text),
//!   `regex`, `grammar` (llguidance's Lark), `choice` (a list of strings) or
//!   `json_object: true`.
//!
//! A request may use one of the two. A malformed field is a 400 naming it; a schema or
//! grammar that does not compile is a 400 from the engine
//! ([`LlamaError::InvalidConstraint`](crate::LlamaError::InvalidConstraint)).

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::limits::bounded_value;

use super::error::ApiError;
use crate::constraints::Constraint;

/// The two fields, read from the body on their own (shown in `/openapi.json` as
/// `StructuredOutputFields`).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[schema(as = StructuredOutputFields)]
pub(crate) struct Fields {
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name", "schema", "strict"}}`.
    #[schema(value_type = Option<Object>)]
    response_format: Option<Box<RawValue>>,
    /// vLLM's: exactly one of `json` (a schema, or its JSON text), `regex`, `grammar`
    /// (Lark), `choice` (a list of strings) or `json_object: true`.
    #[schema(value_type = Option<Object>)]
    structured_outputs: Option<Box<RawValue>>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message.into(), Some(param))
}

/// The constraint a request body asks for, if any; `max_bytes` bounds its text (the
/// schema serialized, the pattern, the grammar, the choices together).
///
/// # Errors
///
/// A 400 naming the field that is malformed, too large, or given with the other one.
pub(crate) fn constraint(body: &[u8], max_bytes: usize) -> Result<Option<Constraint>, ApiError> {
    let fields: Fields = serde_json::from_slice(body).unwrap_or_default();
    let flag = "--max-constraint-bytes";
    let format = bounded_value(
        fields.response_format.as_deref(),
        "response_format",
        max_bytes,
        flag,
    )?;
    let outputs = bounded_value(
        fields.structured_outputs.as_deref(),
        "structured_outputs",
        max_bytes,
        flag,
    )?;
    let from_format = match &format {
        None => None,
        Some(format) => response_format(format)?,
    };
    let from_vllm = match &outputs {
        None => None,
        Some(outputs) => Some(structured_outputs(outputs)?),
    };
    let (constraint, param) = match (from_format, from_vllm) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "structured_outputs",
                "give `response_format` or `structured_outputs`, not both",
            ));
        }
        (Some(c), None) => (c, "response_format"),
        (None, Some(c)) => (c, "structured_outputs"),
        (None, None) => return Ok(None),
    };
    let size = constraint.text_len();
    if size > max_bytes {
        return Err(invalid(
            param,
            format!(
                "the {} is {size} bytes, at most {max_bytes}",
                constraint.kind()
            ),
        ));
    }
    constraint
        .validate()
        .map_err(|e| invalid(param, e.to_string()))?;
    Ok(Some(constraint))
}

fn response_format(format: &Value) -> Result<Option<Constraint>, ApiError> {
    let param = "response_format";
    let kind = format
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(param, "`response_format.type` must be a string"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonSchema(json!({"type": "object"})))),
        "json_schema" => {
            let spec = format
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    invalid(
                        "response_format.json_schema",
                        "`response_format.json_schema` must be an object with `name` and `schema`",
                    )
                })?;
            if !spec.get("name").is_some_and(Value::is_string) {
                return Err(invalid(
                    "response_format.json_schema.name",
                    "`response_format.json_schema.name` must be a string",
                ));
            }
            if spec
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(invalid(
                    "response_format.json_schema.strict",
                    "`response_format.json_schema.strict` must be a boolean",
                ));
            }
            // Decoding always follows the schema: `strict` asks for nothing more.
            let schema = match spec.get("schema") {
                None | Some(Value::Null) => json!({}),
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => schema.clone(),
                Some(_) => {
                    return Err(invalid(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema.schema` must be a JSON Schema object",
                    ));
                }
            };
            Ok(Some(Constraint::JsonSchema(schema)))
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "`response_format.type` = `{other}` is not supported (text, json_object or \
                 json_schema)"
            ),
        )),
    }
}

fn structured_outputs(outputs: &Value) -> Result<Constraint, ApiError> {
    let param = "structured_outputs";
    let object = outputs
        .as_object()
        .ok_or_else(|| invalid(param, "`structured_outputs` must be an object"))?;
    let mut found = Vec::new();
    for (key, value) in object {
        if value.is_null() || (key == "json_object" && value == &Value::Bool(false)) {
            continue;
        }
        let field = format!("structured_outputs.{key}");
        let constraint = match key.as_str() {
            "json" => match value {
                Value::String(text) => {
                    let schema: Value = serde_json::from_str(text).map_err(|e| {
                        invalid(&field, format!("`{field}` is not valid JSON: {e}"))
                    })?;
                    Constraint::JsonSchema(schema)
                }
                Value::Object(_) | Value::Bool(_) => Constraint::JsonSchema(value.clone()),
                _ => return Err(invalid(&field, format!("`{field}` must be a JSON Schema"))),
            },
            "json_object" if value == &Value::Bool(true) => {
                Constraint::JsonSchema(json!({"type": "object"}))
            }
            "regex" | "grammar" => {
                let text = value
                    .as_str()
                    .ok_or_else(|| invalid(&field, format!("`{field}` must be a string")))?
                    .to_string();
                if key == "regex" {
                    Constraint::Regex(text)
                } else {
                    Constraint::Grammar(text)
                }
            }
            "choice" => {
                let choices = value
                    .as_array()
                    .and_then(|items| {
                        items
                            .iter()
                            .map(|v| v.as_str().map(str::to_string))
                            .collect::<Option<Vec<String>>>()
                    })
                    .ok_or_else(|| {
                        invalid(&field, format!("`{field}` must be a list of strings"))
                    })?;
                Constraint::Choice(choices)
            }
            // Options vLLM accepts alongside (whitespace, backends): nothing to honour.
            "disable_any_whitespace" | "disable_fallback" | "whitespace_pattern" => continue,
            _ => {
                return Err(invalid(
                    &field,
                    format!(
                        "`{field}` is not supported (json, regex, grammar, choice or \
                         json_object)"
                    ),
                ));
            }
        };
        found.push(constraint);
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(invalid(
            param,
            "`structured_outputs` needs one of json, regex, grammar, choice or json_object",
        )),
        _ => Err(invalid(
            param,
            "`structured_outputs` takes one of json, regex, grammar, choice or json_object",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value) -> Result<Option<Constraint>, ApiError> {
        constraint(body.to_string().as_bytes(), 1024)
    }

    fn param(body: Value) -> String {
        parse(body).unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn response_formats() {
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(
            parse(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_object"}})).unwrap(),
            Some(Constraint::JsonSchema(json!({"type": "object"})))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let body = json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(parse(body).unwrap(), Some(Constraint::JsonSchema(schema)));
        assert_eq!(
            param(json!({"response_format": {"type": "yaml"}})),
            "response_format.type"
        );
        assert_eq!(
            param(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})
            ),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": 3}}})),
            "response_format.json_schema.schema"
        );
    }

    #[test]
    fn vllm_structured_outputs() {
        assert_eq!(
            parse(json!({"structured_outputs": {"regex": "[0-9]+"}})).unwrap(),
            Some(Constraint::Regex("[0-9]+".into()))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"choice": ["a", "b"]}})).unwrap(),
            Some(Constraint::Choice(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"json": "{\"type\": \"string\"}"}})).unwrap(),
            Some(Constraint::JsonSchema(json!({"type": "string"})))
        );
        assert_eq!(
            param(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})),
            "structured_outputs"
        );
        assert_eq!(
            param(json!({"structured_outputs": {"choice": []}})),
            "structured_outputs"
        );
        assert_eq!(
            param(json!({"structured_outputs": {"choice": [1]}})),
            "structured_outputs.choice"
        );
        assert_eq!(
            param(json!({"structured_outputs": {"ebnf": "x"}})),
            "structured_outputs.ebnf"
        );
        assert_eq!(
            param(json!({"structured_outputs": {"regex": "a"},
                "response_format": {"type": "json_object"}})),
            "structured_outputs"
        );
    }

    #[test]
    fn size_is_limited_before_compiling() {
        let long = "a".repeat(2000);
        let e = parse(json!({"structured_outputs": {"regex": long}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("structured_outputs"));
        assert!(e.message.contains("2000 bytes"), "{}", e.message);
    }

    #[test]
    fn a_field_far_over_its_limit_is_refused_as_sent() {
        // 4 times the limit and 4 KiB, as sent: refused before any tree is built, even
        // for a `text` format that would ignore the payload.
        let payload = vec![0; 5000];
        for field in ["response_format", "structured_outputs"] {
            let e = parse(json!({field: {"type": "text", "junk": payload}})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(
                e.message.contains("bytes as sent") && e.message.contains("--max-constraint-bytes"),
                "{}",
                e.message
            );
        }
        // Spaces count as sent, up to the slack: a pretty-printed schema within its limit
        // is read.
        let body = format!(
            r#"{{"response_format": {{"type": "json_object"{}}}}}"#,
            " ".repeat(4000)
        );
        assert!(constraint(body.as_bytes(), 1024).unwrap().is_some());
    }
}
