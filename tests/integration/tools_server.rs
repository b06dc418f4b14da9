//! Tool calling through the OpenAI-compatible server over real HTTP: `tool_choice`
//! `required` and a named function give `tool_calls` whose arguments validate, streamed
//! (id and name first, then argument fragments) and not; the tool's result goes back as
//! a `tool` message and the next answer is text; bad tools are 400s naming the field;
//! `auto` with a `strict` tool gives text or calls whose arguments validate.
#![cfg(feature = "server")]

use crate::common::server::start_constrained_server;
use futures_util::StreamExt;
use serde_json::{Value, json};

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"], "additionalProperties": false}
    }})
}

/// The arguments of a `get_weather` call, checked against its schema.
fn check_weather(arguments: &str) -> Value {
    let v: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments:?}"));
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 2, "{arguments}");
    assert!(o["city"].as_str().expect("city").chars().count() <= 20);
    assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().expect("unit")));
    v
}

async fn post(client: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let response = client.post(url).json(&body).send().await.expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.expect("json body"))
}

/// The `data:` chunks of a streamed answer.
async fn chunks(client: &reqwest::Client, url: &str, body: Value) -> Vec<Value> {
    let response = client.post(url).json(&body).send().await.expect("sent");
    assert_eq!(response.status().as_u16(), 200);
    let mut stream = response.bytes_stream();
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        text.extend_from_slice(&chunk.expect("chunk"));
    }
    String::from_utf8(text)
        .expect("utf-8")
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk json"))
        .collect()
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn tool_calls_over_http() {
    let (base, rt, _server) = start_constrained_server();
    let chat = format!("{base}/v1/chat/completions");
    let question = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    rt.block_on(async {
        let client = reqwest::Client::new();
        // A named function: one call, valid arguments, no content.
        let (status, body) = post(&client, &chat, json!({
            "messages": question, "max_tokens": 48, "temperature": 0,
            "tools": [weather_tool(), time_tool()],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        })).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
        assert!(choice["message"]["content"].is_null(), "{body}");
        let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 1, "{body}");
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let id = calls[0]["id"].as_str().expect("id").to_string();
        assert!(id.starts_with("call_"));
        let arguments = calls[0]["function"]["arguments"].as_str().expect("arguments");
        let args = check_weather(arguments);
        println!("named call: {arguments}");

        // `required`, streamed: the first delta of a call has its index, id, type and
        // name; the argument fragments join into valid arguments.
        let streamed = chunks(&client, &chat, json!({
            "messages": question, "max_tokens": 48, "temperature": 0, "stream": true,
            "tools": [weather_tool()], "tool_choice": "required",
            "parallel_tool_calls": false,
        })).await;
        let mut name = None;
        let mut joined = String::new();
        let mut finish = None;
        let mut fragments = 0;
        for chunk in &streamed {
            let choice = &chunk["choices"][0];
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
            assert!(choice["delta"]["content"].as_str().unwrap_or("").is_empty(), "{chunk}");
            let Some(calls) = choice["delta"]["tool_calls"].as_array() else {
                continue;
            };
            assert_eq!(calls[0]["index"], 0);
            if let Some(n) = calls[0]["function"]["name"].as_str() {
                assert!(name.is_none(), "one start");
                assert!(calls[0]["id"].as_str().expect("id").starts_with("call_"));
                assert_eq!(calls[0]["type"], "function");
                name = Some(n.to_string());
            } else {
                assert!(name.is_some(), "arguments after the name");
            }
            let fragment = calls[0]["function"]["arguments"].as_str().expect("fragment");
            fragments += usize::from(!fragment.is_empty());
            joined.push_str(fragment);
        }
        assert_eq!(name.as_deref(), Some("get_weather"));
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        assert!(fragments > 1, "arguments arrive in pieces");
        // Greedy: the same call as the whole answer's.
        assert_eq!(check_weather(&joined), args);

        // The round trip: the call and its result in the history; the answer is text.
        let history = json!([
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 21, \"sky\": \"sunny\"}"},
        ]);
        let (status, body) = post(&client, &chat, json!({
            "messages": history, "max_tokens": 24, "temperature": 0,
            "tools": [weather_tool()], "tool_choice": "none",
        })).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        let text = choice["message"]["content"].as_str().expect("text");
        assert!(!text.trim().is_empty());
        assert!(choice["message"].get("tool_calls").is_none(), "{body}");
        println!("answer after the tool: {text:?}");

        // Bad tools: a 400 naming the field; the server keeps serving.
        let bad_schema = json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}});
        for (fields, param) in [
            (json!({"tools": [weather_tool()], "tool_choice":
                {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
            (json!({"tools": [bad_schema], "tool_choice": "required"}), "tools"),
            (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name"),
            (json!({"tools": [{"type": "function", "function": {"name": "f",
                "description": "x".repeat(5000)}}]}), "tools"),
            (json!({"tools": [weather_tool()], "tool_choice": "required",
                "response_format": {"type": "json_object"}}), "tool_choice"),
            (json!({"tool_choice": "required"}), "tool_choice"),
        ] {
            let mut request = json!({"messages": question, "max_tokens": 8});
            for (k, v) in fields.as_object().unwrap() {
                request[k] = v.clone();
            }
            let (status, body) = post(&client, &chat, request).await;
            assert_eq!(status, 400, "{body}");
            assert_eq!(body["error"]["param"], param, "{body}");
        }
        let (status, _) = post(&client, &chat, json!({"messages": question, "max_tokens": 2})).await;
        assert_eq!(status, 200);
    });
}

/// `auto` with a `strict` tool: the model chooses between text and calls; once it opens a
/// `<tool_call>` decoding is constrained, so the call names a tool and its arguments
/// validate. Text-only answers are untouched.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn auto_with_a_strict_tool() {
    let (base, rt, _server) = start_constrained_server();
    let chat = format!("{base}/v1/chat/completions");
    let mut strict = weather_tool();
    strict["function"]["strict"] = json!(true);
    let ask = |q: &str, stream: bool| {
        json!({
            "messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0,
            "tools": [strict.clone(), time_tool()], "tool_choice": "auto",
            "parallel_tool_calls": false, "stream": stream,
        })
    };
    rt.block_on(async {
        let client = reqwest::Client::new();
        // The model calls: one valid call, and then the end.
        let q = "Call get_weather for Paris in celsius.";
        let (status, body) = post(&client, &chat, ask(q, false)).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
        let calls = choice["message"]["tool_calls"]
            .as_array()
            .expect("tool_calls");
        assert_eq!(calls.len(), 1, "{body}");
        assert_eq!(calls[0]["function"]["name"], "get_weather", "{body}");
        let arguments = calls[0]["function"]["arguments"]
            .as_str()
            .expect("arguments");
        let args = check_weather(arguments);
        println!("auto call: {}", choice["message"]);

        // Streamed: the same call, reassembled from its deltas.
        let streamed = chunks(&client, &chat, ask(q, true)).await;
        let mut joined = String::new();
        let mut names = Vec::new();
        let mut finish = None;
        for chunk in &streamed {
            let choice = &chunk["choices"][0];
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
            for call in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(call["index"], 0, "{chunk}");
                if let Some(name) = call["function"]["name"].as_str() {
                    names.push(name.to_string());
                }
                joined.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        assert_eq!(names, ["get_weather"]);
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        assert_eq!(check_weather(&joined), args);

        // The model answers in text: no call, the text as it is unconstrained.
        let (status, body) = post(&client, &chat, ask("Say hello.", false)).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{body}");
        assert!(choice["message"].get("tool_calls").is_none(), "{body}");
        let text = choice["message"]["content"].as_str().expect("text");
        let mut loose = ask("Say hello.", false);
        loose["tools"][0] = weather_tool();
        let (_, unconstrained) = post(&client, &chat, loose).await;
        assert_eq!(
            text, unconstrained["choices"][0]["message"]["content"],
            "{body}"
        );
        assert!(!text.trim().is_empty());
        println!("auto text: {text:?}");
    });
}
