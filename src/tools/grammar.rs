//! The constraint of a forced tool call: a Lark grammar (llguidance's dialect) of the
//! model's call envelope around each function's parameter schema.
//!
//! For [`ToolFormat::Hermes`] the output is one or more (with parallel calls) blocks
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` separated by a newline;
//! for [`ToolFormat::Llama3Json`] it is one object `{"name": "f", "parameters": {...}}`.
//! Each call is a `%json` schema whose `name` is the function's name (`const`) and whose
//! arguments are its `parameters` schema, so the arguments always validate.
//!
//! ```
//! use llama_burn::tools::{Tool, ToolChoice, ToolFormat, grammar::tool_constraint};
//!
//! let tools = [Tool::new("f", serde_json::json!({"type": "object"}))];
//! let c = tool_constraint(&tools, &ToolChoice::Required, true, ToolFormat::Hermes);
//! assert!(c.is_some());
//! assert!(tool_constraint(&tools, &ToolChoice::Auto, true, ToolFormat::Hermes).is_none());
//! ```

use serde_json::{Value, json};

use super::{Tool, ToolChoice, ToolFormat};
use crate::constraints::Constraint;

/// The constraint for `choice` over `tools`: `None` unless a call is forced
/// ([`ToolChoice::Required`]: a call of any tool, several when `parallel`;
/// [`ToolChoice::Function`]: one call of that function). `auto` is unconstrained: the
/// output is read for calls afterwards, and a call whose arguments do not parse stays
/// text.
pub fn tool_constraint(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    format: ToolFormat,
) -> Option<Constraint> {
    let (chosen, many): (Vec<&Tool>, bool) = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => (tools.iter().collect(), parallel),
        ToolChoice::Function(name) => (tools.iter().filter(|t| &t.name == name).collect(), false),
    };
    if chosen.is_empty() {
        return None;
    }
    let mut lark = String::new();
    let bodies: Vec<String> = (0..chosen.len()).map(|i| format!("fn_{i}")).collect();
    match format {
        ToolFormat::Hermes => {
            lark.push_str(if many {
                "start: call (\"\\n\" call)*\n"
            } else {
                "start: call\n"
            });
            lark.push_str("call: \"<tool_call>\\n\" body \"\\n</tool_call>\"\n");
        }
        // Llama 3.1 makes one call per answer.
        ToolFormat::Llama3Json => lark.push_str("start: body\n"),
    }
    lark.push_str(&format!("body: {}\n", bodies.join(" | ")));
    for (tool, body) in chosen.iter().zip(&bodies) {
        lark.push_str(&format!("{body}: %json {}\n", call_schema(tool, format)));
    }
    Some(Constraint::Grammar(lark))
}

/// The schema of one call object: `name` first (the function's), then the arguments.
fn call_schema(tool: &Tool, format: ToolFormat) -> Value {
    let parameters = match &tool.parameters {
        Value::Object(o) if o.is_empty() => json!({"type": "object"}),
        other => other.clone(),
    };
    let mut properties = serde_json::Map::new();
    properties.insert("name".into(), json!({"const": tool.name}));
    properties.insert(format.arguments_key().into(), parameters);
    json!({
        "type": "object",
        "properties": properties,
        "required": ["name", format.arguments_key()],
        "additionalProperties": false,
        "x-guidance": {
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars() {
        let tools = [
            Tool::new("a", json!({})),
            Tool::new(
                "b",
                json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
            ),
        ];
        let Some(Constraint::Grammar(g)) = tool_constraint(
            &tools,
            &ToolChoice::Function("b".into()),
            true,
            ToolFormat::Hermes,
        ) else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(g.contains("body: fn_0\n"), "{g}");
        assert!(g.contains(r#""name": {"const": "b"}"#) || g.contains(r#""name":{"const":"b"}"#));
        let Some(Constraint::Grammar(g)) =
            tool_constraint(&tools, &ToolChoice::Required, true, ToolFormat::Llama3Json)
        else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: body\nbody: fn_0 | fn_1\n"), "{g}");
        assert!(g.contains("\"parameters\""), "{g}");
        assert!(
            tool_constraint(
                &tools,
                &ToolChoice::Function("c".into()),
                true,
                ToolFormat::Hermes
            )
            .is_none()
        );
    }
}
