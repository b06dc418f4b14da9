//! The constraint of tool calls: a Lark grammar (llguidance's dialect) of the model's
//! call envelope around each function's parameter schema.
//!
//! For [`ToolFormat::Hermes`] a call is a block
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` (several, separated by a
//! newline, with parallel calls); for [`ToolFormat::Llama3Json`] it is one object
//! `{"name": "f", "parameters": {...}}`. Each call is a `%json` schema whose `name` is
//! the function's name (`const`) and whose arguments are its `parameters` schema, so the
//! arguments always validate.
//!
//! - A forced call (`tool_choice` `required` or a named function): the output is the
//!   call(s) and nothing else.
//! - `auto` with a tool marked `strict`: the output is free text, or a call. Hermes: text
//!   until the model writes `<tool_call>` (a lazy lexeme ends at the first opener), then
//!   the call's grammar, then more calls when `parallel`, or the end. Llama 3.1+: text
//!   that does not start with `{`, or (after optional whitespace, and `<|python_tag|>`,
//!   which every Llama 3.1+ vocabulary has) one call object. Any tool may be called; the
//!   arguments of the strict ones follow their schema, those of the others are any JSON
//!   object.
//!
//! ```
//! use llama_burn::tools::{Tool, ToolChoice, ToolFormat, grammar::tool_constraint};
//!
//! let mut tool = Tool::new("f", serde_json::json!({"type": "object"}));
//! let c = tool_constraint(&[tool.clone()], &ToolChoice::Required, true, ToolFormat::Hermes);
//! assert!(c.is_some());
//! // `auto` is constrained only when a tool is strict.
//! assert!(tool_constraint(&[tool.clone()], &ToolChoice::Auto, true, ToolFormat::Hermes).is_none());
//! tool.strict = true;
//! assert!(tool_constraint(&[tool], &ToolChoice::Auto, true, ToolFormat::Hermes).is_some());
//! ```

use serde_json::{Value, json};

use super::{Tool, ToolChoice, ToolFormat};
use crate::constraints::Constraint;

/// The constraint for `choice` over `tools` (see the [module](self) documentation):
/// `None` for [`ToolChoice::None`], and for [`ToolChoice::Auto`] when no tool is strict
/// (the output is then read for calls afterwards, and a call whose arguments do not
/// parse stays text); [`ToolChoice::Required`]: a call of any tool, several when
/// `parallel`; [`ToolChoice::Function`]: one call of that function; [`ToolChoice::Auto`]
/// with a strict tool: text, or calls (several when `parallel`, Hermes only) whose
/// strict arguments validate.
pub fn tool_constraint(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    format: ToolFormat,
) -> Option<Constraint> {
    let (chosen, many): (Vec<&Tool>, bool) = match choice {
        ToolChoice::None => return None,
        ToolChoice::Auto => {
            return tools
                .iter()
                .any(|t| t.strict)
                .then(|| auto_grammar(tools, parallel, format));
        }
        ToolChoice::Required => (tools.iter().collect(), parallel),
        ToolChoice::Function(name) => (tools.iter().filter(|t| &t.name == name).collect(), false),
    };
    if chosen.is_empty() {
        return None;
    }
    let mut lark = String::new();
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
    push_bodies(&mut lark, &chosen, format, true);
    Some(Constraint::Grammar(lark))
}

/// `auto` with a strict tool: free text or calls.
fn auto_grammar(tools: &[Tool], parallel: bool, format: ToolFormat) -> Constraint {
    let mut lark = String::new();
    match format {
        ToolFormat::Hermes => {
            // `head` is lazy: it ends at the first `<tool_call>`, so text can never hold
            // an opener that escapes the call's grammar.
            lark.push_str("start: TEXT | head \"\\n\" body \"\\n</tool_call>\"");
            if parallel {
                lark.push_str(" (\"\\n<tool_call>\\n\" body \"\\n</tool_call>\")*");
            }
            lark.push_str("\nhead[lazy]: /(?s:.*)<tool_call>/\nTEXT: /(?s:.*)/\n");
        }
        ToolFormat::Llama3Json => lark.push_str(
            "start: TEXT? | SPACE call\ncall: body | <|python_tag|> body\n\
             SPACE: /[ \\t\\r\\n]*/\nTEXT: /[ \\t\\r\\n]*[^{ \\t\\r\\n](?s:.*)/\n",
        ),
    }
    let all: Vec<&Tool> = tools.iter().collect();
    push_bodies(&mut lark, &all, format, false);
    Constraint::Grammar(lark)
}

/// `body`, one call of any of `tools`, and each tool's `fn_i` rule: its call schema,
/// with its parameter schema when `all_strict` or the tool is strict (else any object).
fn push_bodies(lark: &mut String, tools: &[&Tool], format: ToolFormat, all_strict: bool) {
    let bodies: Vec<String> = (0..tools.len()).map(|i| format!("fn_{i}")).collect();
    lark.push_str(&format!("body: {}\n", bodies.join(" | ")));
    for (tool, body) in tools.iter().zip(&bodies) {
        let schema = call_schema(tool, format, all_strict || tool.strict);
        lark.push_str(&format!("{body}: %json {schema}\n"));
    }
}

/// The schema of one call object: `name` first (the function's), then the arguments
/// (valid against the tool's parameters when `strict`, else any object).
fn call_schema(tool: &Tool, format: ToolFormat, strict: bool) -> Value {
    let parameters = match &tool.parameters {
        Value::Object(o) if strict && !o.is_empty() => Value::Object(o.clone()),
        _ => json!({"type": "object"}),
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

    /// A byte-level vocabulary (ids 0-255), `<|endoftext|>` (256, the stop token) and
    /// `<|python_tag|>` (257, a control token).
    fn byte_vocab() -> std::sync::Arc<crate::constraints::ConstraintVocab> {
        let tokenizer = crate::tokenizer::GgufBpeTokenizer::bytes_and_specials(&[
            "<|endoftext|>",
            "<|python_tag|>",
        ])
        .unwrap();
        std::sync::Arc::new(
            crate::constraints::ConstraintVocab::new(&tokenizer, 258, Default::default()).unwrap(),
        )
    }

    /// How many tokens of `tokens` (byte ids, and 257 for `<|python_tag|>`) the
    /// constraint takes, and whether the output may end there.
    fn feed(
        vocab: &std::sync::Arc<crate::constraints::ConstraintVocab>,
        constraint: &Constraint,
        tokens: &[u32],
    ) -> (usize, bool) {
        let mut state = crate::constraints::compile::compile(vocab, constraint).unwrap();
        let mut taken = 0;
        for &t in tokens {
            if !state.try_accept(t).unwrap() {
                break;
            }
            taken += 1;
        }
        (taken, state.try_accept(256).unwrap())
    }

    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    #[test]
    fn auto_with_a_strict_tool_is_text_or_valid_calls() {
        let vocab = byte_vocab();
        let mut city = Tool::new(
            "city",
            json!({"type": "object", "properties": {"n": {"type": "integer"}},
                "required": ["n"], "additionalProperties": false}),
        );
        city.strict = true;
        let loose = Tool::new(
            "loose",
            json!({"type": "object", "properties": {"s": {"type": "string"}}}),
        );
        let tools = [city, loose];
        let hermes = |parallel| {
            tool_constraint(&tools, &ToolChoice::Auto, parallel, ToolFormat::Hermes).unwrap()
        };
        let call = |name: &str, args: &str| {
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
        };
        // Text alone, any text (a `{`, an unfinished opener).
        for text in ["", "Hello {there} <tool_", "a\n<tool_callx"] {
            let t = bytes(text);
            assert_eq!(feed(&vocab, &hermes(true), &t), (t.len(), true), "{text:?}");
        }
        // Text then a call: the strict tool's arguments follow its schema.
        let good = bytes(&format!("Let me see. {}", call("city", "{\"n\": 7}")));
        assert_eq!(feed(&vocab, &hermes(false), &good), (good.len(), true));
        let bad = format!("Let me see. {}", call("city", "{\"n\": \"x\"}"));
        let refused_at = bad.find("\"x").unwrap();
        assert_eq!(
            feed(&vocab, &hermes(false), &bytes(&bad)),
            (refused_at, false)
        );
        // An unknown function is refused; the loose tool takes any object.
        let unknown = call("nope", "{}");
        let at = unknown.find("nope").unwrap();
        assert_eq!(feed(&vocab, &hermes(true), &bytes(&unknown)), (at, false));
        let other = bytes(&call("loose", "{\"z\": [1]}"));
        assert_eq!(feed(&vocab, &hermes(true), &other), (other.len(), true));
        // Parallel: more calls after a newline; without it, the end.
        let two = bytes(&format!(
            "{}\n{}",
            call("city", "{\"n\": 1}"),
            call("loose", "{}")
        ));
        assert_eq!(feed(&vocab, &hermes(true), &two), (two.len(), true));
        let first = call("city", "{\"n\": 1}").len();
        assert_eq!(feed(&vocab, &hermes(false), &two), (first, true));

        // Llama 3.1+: text not starting with `{`, or one call object (after whitespace and
        // `<|python_tag|>`).
        let llama =
            tool_constraint(&tools, &ToolChoice::Auto, true, ToolFormat::Llama3Json).unwrap();
        let text = bytes(" The answer is {42}.");
        assert_eq!(feed(&vocab, &llama, &text), (text.len(), true));
        let good = "{\"name\": \"city\", \"parameters\": {\"n\": 3}}";
        let mut tagged = bytes("\n");
        tagged.push(257);
        tagged.extend(bytes(good));
        assert_eq!(feed(&vocab, &llama, &tagged), (tagged.len(), true));
        let bad = "{\"name\": \"city\", \"parameters\": {\"m\"";
        let at = bad.find("\"m").unwrap() + 1;
        assert_eq!(feed(&vocab, &llama, &bytes(bad)), (at, false));
        // Not strict: `auto` stays unconstrained.
        assert!(
            tool_constraint(&tools[1..], &ToolChoice::Auto, true, ToolFormat::Hermes).is_none()
        );
    }
}
