//! Tool calling on the wire: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
//! read and checked before anything is rendered or compiled.
//!
//! - `tools`: at most [`MAX_TOOLS`] entries `{"type": "function", "function": {"name",
//!   "description", "parameters", "strict"}}`, names `[A-Za-z0-9_-]{1,64}` and distinct,
//!   `parameters` a JSON Schema object; all of them together at most
//!   `--max-constraint-bytes` (they become a grammar);
//! - `tool_choice`: `none`, `auto` (the default with tools), `required`, or
//!   `{"type": "function", "function": {"name"}}` naming one of the tools;
//! - `parallel_tool_calls`: whether `required` (and `auto` with a `strict` tool) may give
//!   several calls (default true).
//!
//! Each problem is a 400 naming its field.

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use crate::tools::{Tool, ToolChoice};

/// Most tools one request may give.
pub const MAX_TOOLS: usize = 128;

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolRequest {
    /// The functions.
    pub tools: Vec<Tool>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls`.
    pub parallel: bool,
}

/// The tool fields of a chat request, read from the body on their own (and shown in
/// `/openapi.json` as `ChatToolFields`).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[schema(as = ChatToolFields)]
pub(crate) struct Fields {
    /// Functions the model may call: `{"type": "function", "function": {"name",
    /// "description", "parameters" (a JSON Schema), "strict"}}`, at most 128.
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Box<serde_json::value::RawValue>>,
    /// `none`, `auto` (the default with tools), `required`, or
    /// `{"type": "function", "function": {"name"}}` to force one.
    #[schema(value_type = Option<Object>)]
    tool_choice: Option<Value>,
    /// Whether an answer may hold several calls (default true).
    #[schema(value_type = Option<bool>)]
    parallel_tool_calls: Option<Value>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message.into(), Some(param))
}

/// The tools a chat request body gives, if any; `max_bytes` bounds their JSON together.
///
/// # Errors
///
/// A 400 naming the field that is malformed, too large, or names an unknown function.
pub(crate) fn read(body: &[u8], max_bytes: usize) -> Result<Option<ToolRequest>, ApiError> {
    let fields: Fields = serde_json::from_slice(body).unwrap_or_default();
    let parallel = match &fields.parallel_tool_calls {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ));
        }
    };
    let tools = super::limits::bounded_value(
        fields.tools.as_deref(),
        "tools",
        max_bytes,
        "--max-constraint-bytes",
    )?;
    let entries = match &tools {
        None => &[][..],
        Some(Value::Array(items)) => &items[..],
        Some(_) => return Err(invalid("tools", "`tools` must be a list")),
    };
    if entries.len() > MAX_TOOLS {
        return Err(invalid(
            "tools",
            format!(
                "`tools` has {} entries; at most {MAX_TOOLS} are allowed",
                entries.len()
            ),
        ));
    }
    let size: usize = entries.iter().map(|t| t.to_string().len()).sum();
    if size > max_bytes {
        return Err(invalid(
            "tools",
            format!(
                "the tools are {size} bytes, at most {max_bytes} (limit: --max-constraint-bytes)"
            ),
        ));
    }
    let mut tools = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        let tool = tool(i, entry)?;
        if tools.iter().any(|t: &Tool| t.name == tool.name) {
            return Err(invalid(
                &format!("tools[{i}].function.name"),
                format!("two tools are named `{}`", tool.name),
            ));
        }
        tools.push(tool);
    }
    let choice = match &fields.tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` = `{other}` is not supported (none, auto, required or \
                         a function)"
                    ),
                ));
            }
        },
        Some(object @ Value::Object(_)) => {
            let name = object
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| object.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid(
                        "tool_choice",
                        "`tool_choice` must be none, auto, required or \
                         {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not one of `tools`"),
                ));
            }
            ToolChoice::Function(name.to_string())
        }
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "`tool_choice` must be a string or an object",
            ));
        }
    };
    if tools.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(invalid("tool_choice", "`tool_choice` needs `tools`")),
        };
    }
    Ok(Some(ToolRequest {
        tools,
        choice,
        parallel,
    }))
}

/// Tool `i` of `tools`, checked.
fn tool(i: usize, entry: &Value) -> Result<Tool, ApiError> {
    let param = |field: &str| format!("tools[{i}]{field}");
    if entry.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid(
            &param(".type"),
            format!("`tools[{i}].type` must be `function`"),
        ));
    }
    let function = entry
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            invalid(
                &param(".function"),
                format!("`tools[{i}].function` must be an object"),
            )
        })?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| {
            (1..=64).contains(&n.len())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
        .ok_or_else(|| {
            invalid(
                &param(".function.name"),
                format!("`tools[{i}].function.name` must be 1 to 64 of a-z, A-Z, 0-9, _ and -"),
            )
        })?;
    let description = match function.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(invalid(
                &param(".function.description"),
                format!("`tools[{i}].function.description` must be a string"),
            ));
        }
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => {
            return Err(invalid(
                &param(".function.parameters"),
                format!("`tools[{i}].function.parameters` must be a JSON Schema object"),
            ));
        }
    };
    let strict = match function.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(invalid(
                &param(".function.strict"),
                format!("`tools[{i}].function.strict` must be a boolean"),
            ));
        }
    };
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
        strict,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<Option<ToolRequest>, ApiError> {
        read(body.to_string().as_bytes(), 4096)
    }

    fn param(body: Value) -> String {
        parse(body).unwrap_err().param.unwrap_or_default()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn tools_and_choices() {
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(parse(json!({"tools": []})).unwrap(), None);
        let r = parse(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!((r.choice, r.parallel), (ToolChoice::Auto, true));
        assert_eq!(r.tools[0].name, "get_weather");
        let r = parse(json!({"tools": [weather()], "tool_choice": "required",
            "parallel_tool_calls": false}))
        .unwrap()
        .unwrap();
        assert_eq!((r.choice, r.parallel), (ToolChoice::Required, false));
        let r = parse(json!({"tools": [weather()], "tool_choice":
            {"type": "function", "function": {"name": "get_weather"}}}))
        .unwrap()
        .unwrap();
        assert_eq!(r.choice, ToolChoice::Function("get_weather".into()));
    }

    #[test]
    fn errors_name_their_field() {
        let named = |name: &str| json!({"type": "function", "function": {"name": name}});
        assert_eq!(param(json!({"tools": {}})), "tools");
        assert_eq!(param(json!({"tools": [{"type": "x"}]})), "tools[0].type");
        assert_eq!(
            param(json!({"tools": [named("a b")]})),
            "tools[0].function.name"
        );
        assert_eq!(
            param(json!({"tools": [named("a"), named("a")]})),
            "tools[1].function.name"
        );
        assert_eq!(
            param(
                json!({"tools": [{"type": "function", "function": {"name": "a",
                "parameters": "x"}}]})
            ),
            "tools[0].function.parameters"
        );
        assert_eq!(
            param(json!({"tools": [weather()], "tool_choice":
                {"type": "function", "function": {"name": "nope"}}})),
            "tool_choice"
        );
        assert_eq!(
            param(json!({"tools": [weather()], "tool_choice": "always"})),
            "tool_choice"
        );
        assert_eq!(param(json!({"tool_choice": "required"})), "tool_choice");
        assert_eq!(
            param(json!({"tools": [weather()], "parallel_tool_calls": "yes"})),
            "parallel_tool_calls"
        );
        let many: Vec<Value> = (0..MAX_TOOLS + 1)
            .map(|i| named(&format!("f{i}")))
            .collect();
        assert_eq!(param(json!({"tools": many})), "tools");
        let big = json!({"type": "function", "function": {"name": "f",
            "description": "x".repeat(5000)}});
        let e = parse(json!({"tools": [big]})).unwrap_err();
        assert!(
            e.message.contains("--max-constraint-bytes"),
            "{}",
            e.message
        );
    }
}
