//! The limits a request body must pass before it is parsed into a tree, expanded into
//! choices, or given any work: JSON nesting, the number of prompts, choices (prompts x
//! `n`), stop strings (count and bytes) and messages.
//!
//! Both checks read the body in place and allocate nothing proportional to it: the depth
//! is one pass over the bytes, and the counts come from a serde pass that visits only the
//! four fields concerned, counting their elements (and the bytes of stop strings) without
//! keeping any of them. Only then is the body parsed for real.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::ServerConfig;
use super::error::ApiError;
use super::openai::Endpoint;

/// How many times its size limit a field's JSON text may be as sent (spaces, line breaks
/// and escapes included) before it is parsed into a tree; the limit itself is checked on
/// the parsed value, whose compact form is what it bounds.
const AS_SENT_SLACK: usize = 4;

/// A field read as its JSON text (`raw`, borrowed from the body), parsed into a tree only
/// when that text is at most [`AS_SENT_SLACK`] times `max` bytes (plus 4 KiB): a tree
/// takes 10 to 40 times the bytes of the JSON it holds, so a field far over its limit
/// costs no more than its bytes, which the body holds already. `None` for a missing or
/// `null` field.
///
/// # Errors
///
/// A 400 naming `name` and `flag` for a field over that bound, or malformed.
pub(crate) fn bounded_value(
    raw: Option<&serde_json::value::RawValue>,
    name: &str,
    max: usize,
    flag: &str,
) -> Result<Option<serde_json::Value>, ApiError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let text = raw.get();
    let bound = max.saturating_mul(AS_SENT_SLACK).saturating_add(4096);
    if text.len() > bound {
        return Err(ApiError::invalid(
            format!(
                "`{name}` is {} bytes as sent, more than {bound} ({AS_SENT_SLACK} times \
                 {max}, the limit of its content, and 4 KiB; limit: {flag})",
                text.len()
            ),
            Some(name),
        ));
    }
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Null) => Ok(None),
        Ok(value) => Ok(Some(value)),
        Err(e) => Err(ApiError::invalid(
            format!("`{name}` is not valid JSON: {e}"),
            Some(name),
        )),
    }
}

/// Refuses a body nested deeper than `max` objects and arrays, in one pass over its
/// bytes (brackets inside strings do not count). Malformed JSON is left to the parser.
pub(crate) fn check_depth(body: &[u8], max: usize) -> Result<(), ApiError> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > max {
                    return Err(ApiError::invalid(
                        format!(
                            "the body is nested more than {max} levels deep \
                             (limit: --max-json-depth)"
                        ),
                        None,
                    ));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Refuses a body that gives one key twice in an object, at any depth: parsers disagree
/// on which copy counts (the limits below would read one and the request parser serve
/// the other, or a constraint, tool list or salt be silently dropped), so such a body
/// gets a 400 naming the key and where it is. One streaming pass over a body that passed
/// [`check_depth`]; it keeps only the keys of the objects open at the moment (at most
/// the body's bytes). Malformed JSON is left to the parser.
pub(crate) fn check_unique_keys(body: &[u8]) -> Result<(), ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut walk = Walk::default();
    let result = de::DeserializeSeed::deserialize(UniqueKeys { walk: &mut walk }, &mut de);
    match (result, walk.repeated) {
        (Err(_), true) => {
            let mut path = walk.path;
            let key = path.pop().unwrap_or_default();
            let (at, param) = match path.join(".") {
                parent if parent.is_empty() => ("the body".to_string(), key.clone()),
                parent => (format!("`{parent}`"), format!("{parent}.{key}")),
            };
            Err(ApiError::invalid(
                format!("{at} gives the key `{key}` more than once"),
                Some(&param),
            ))
        }
        _ => Ok(()),
    }
}

/// Where [`UniqueKeys`] is, and whether it found a repeat.
#[derive(Default)]
struct Walk {
    /// Keys and array indices down to the value being read.
    path: Vec<String>,
    /// A key was repeated: `path` ends with it.
    repeated: bool,
}

/// Walks a value checking that no object repeats a key; on a repeat it fails with the
/// walk marked `repeated` and its path ending with the key.
struct UniqueKeys<'a> {
    walk: &'a mut Walk,
}

impl<'de> de::DeserializeSeed<'de> for UniqueKeys<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueKeys<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut index = 0usize;
        loop {
            self.walk.path.push(index.to_string());
            if seq
                .next_element_seed(UniqueKeys { walk: self.walk })?
                .is_none()
            {
                self.walk.path.pop();
                return Ok(());
            }
            self.walk.path.pop();
            index += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let repeated = !seen.insert(key.clone());
            self.walk.path.push(key.into_owned());
            if repeated {
                self.walk.repeated = true;
                return Err(de::Error::custom("a repeated key"));
            }
            map.next_value_seed(UniqueKeys { walk: self.walk })?;
            self.walk.path.pop();
        }
        Ok(())
    }
}

/// What a value looks like, without keeping it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Probe {
    /// An unsigned integer.
    Unsigned(u64),
    /// Another number.
    Number,
    /// A string of this many bytes.
    Str(usize),
    /// An array: its length, how many of its elements are numbers, and the bytes of
    /// its string elements.
    Array {
        len: usize,
        numbers: usize,
        string_bytes: usize,
    },
    /// Anything else (an object, a boolean, null).
    #[default]
    Other,
}

/// Visits a value, keeping only its [`Probe`]; `nested` probes the elements of arrays
/// one level down (and skips anything deeper).
struct ProbeVisitor {
    nested: bool,
}

impl<'de> Visitor<'de> for ProbeVisitor {
    type Value = Probe;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Probe, E> {
        Ok(Probe::Other)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Probe, E> {
        Ok(Probe::Unsigned(v))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Probe, E> {
        Ok(Probe::Number)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Probe, E> {
        Ok(Probe::Number)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Probe, E> {
        Ok(Probe::Str(v.len()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Probe, E> {
        Ok(Probe::Other)
    }

    fn visit_none<E: de::Error>(self) -> Result<Probe, E> {
        Ok(Probe::Other)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Probe, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Probe, A::Error> {
        let (mut len, mut numbers, mut string_bytes) = (0usize, 0usize, 0usize);
        if self.nested {
            while let Some(element) = seq.next_element::<Element>()? {
                len += 1;
                match element.0 {
                    Probe::Unsigned(_) | Probe::Number => numbers += 1,
                    Probe::Str(bytes) => string_bytes = string_bytes.saturating_add(bytes),
                    _ => {}
                }
            }
        } else {
            while seq.next_element::<IgnoredAny>()?.is_some() {
                len += 1;
            }
        }
        Ok(Probe::Array {
            len,
            numbers,
            string_bytes,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Probe::Other)
    }
}

/// A field's probe, its arrays' elements probed one level down.
#[derive(Debug, Default)]
struct Field(Probe);

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ProbeVisitor { nested: true }).map(Field)
    }
}

/// An array element's probe (its own arrays only counted).
struct Element(Probe);

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ProbeVisitor { nested: false })
            .map(Element)
    }
}

/// The fields whose size the limits bound; every other field is skipped unread.
#[derive(Debug, Default, Deserialize)]
struct Shape {
    #[serde(default)]
    prompt: Field,
    #[serde(default)]
    messages: Field,
    #[serde(default)]
    stop: Field,
    #[serde(default)]
    n: Field,
}

/// The one field of an embedding body whose size the limits bound.
#[derive(Debug, Default, Deserialize)]
struct InputShape {
    #[serde(default)]
    input: Field,
}

/// Checks the number of inputs of an embedding body that passed [`check_depth`]: at
/// most [`ServerConfig::max_prompts`], counted before the inputs are read.
pub(crate) fn check_input_count(body: &[u8], config: &ServerConfig) -> Result<(), ApiError> {
    let Ok(shape) = serde_json::from_slice::<InputShape>(body) else {
        return Ok(());
    };
    let inputs = match shape.input.0 {
        // A list of numbers is one input of token ids.
        Probe::Array { len, numbers, .. } if len > 0 && numbers == len => 1,
        Probe::Array { len, .. } => len,
        _ => 1,
    };
    if inputs > config.max_prompts {
        return Err(ApiError::invalid(
            format!(
                "`input` has {inputs} inputs; at most {} are allowed (limit: --max-prompts)",
                config.max_prompts
            ),
            Some("input"),
        ));
    }
    Ok(())
}

/// Checks the counts of a body that passed [`check_depth`]: prompts, choices (prompts x
/// `n`), stop strings and their bytes, messages. A body that does not even have this
/// shape (not an object, a field of another type) is left to the real parser, which
/// names what is wrong.
pub(crate) fn check_counts(
    body: &[u8],
    endpoint: Endpoint,
    config: &ServerConfig,
) -> Result<(), ApiError> {
    let Ok(shape) = serde_json::from_slice::<Shape>(body) else {
        return Ok(());
    };
    let prompts = match (endpoint, shape.prompt.0) {
        (Endpoint::Chat, _) => 1,
        // A list of numbers is one prompt of token ids.
        (_, Probe::Array { len, numbers, .. }) if len > 0 && numbers == len => 1,
        (_, Probe::Array { len, .. }) => len,
        _ => 1,
    };
    if prompts > config.max_prompts {
        return Err(ApiError::invalid(
            format!(
                "`prompt` has {prompts} prompts; at most {} are allowed (limit: --max-prompts)",
                config.max_prompts
            ),
            Some("prompt"),
        ));
    }
    if let Probe::Array { len, .. } = shape.messages.0
        && len > config.max_messages
    {
        return Err(ApiError::invalid(
            format!(
                "`messages` has {len} messages; at most {} are allowed (limit: --max-messages)",
                config.max_messages
            ),
            Some("messages"),
        ));
    }
    let (stops, stop_bytes) = match shape.stop.0 {
        Probe::Str(bytes) => (1, bytes),
        Probe::Array {
            len, string_bytes, ..
        } => (len, string_bytes),
        _ => (0, 0),
    };
    if stops > config.max_stop_strings {
        return Err(ApiError::invalid(
            format!(
                "`stop` has {stops} strings; at most {} are allowed (limit: --max-stop-strings)",
                config.max_stop_strings
            ),
            Some("stop"),
        ));
    }
    if stop_bytes > config.max_stop_bytes {
        return Err(ApiError::invalid(
            format!(
                "`stop` strings have {stop_bytes} bytes together; at most {} are allowed \
                 (limit: --max-stop-bytes)",
                config.max_stop_bytes
            ),
            Some("stop"),
        ));
    }
    // `n` itself is checked against --max-n with the other sampling fields; here only
    // what it multiplies.
    let n = match shape.n.0 {
        Probe::Unsigned(n) => usize::try_from(n).unwrap_or(usize::MAX),
        _ => 1,
    };
    let choices = prompts.saturating_mul(n.max(1));
    if n <= config.max_n && choices > config.max_choices {
        return Err(ApiError::invalid(
            format!(
                "{prompts} prompts x `n` = {n} make {choices} choices; at most {} are allowed \
                 per request (limit: --max-choices)",
                config.max_choices
            ),
            Some("n"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    fn config() -> ServerConfig {
        ServerConfig::new("m")
    }

    fn param(e: ApiError) -> Option<String> {
        e.param
    }

    #[test]
    fn depth_counts_brackets_outside_strings() {
        assert!(check_depth(br#"{"a":[[1]]}"#, 3).is_ok());
        assert_err!(
            check_depth(br#"{"a":[[[1]]]}"#, 3),
            ApiError { message, param: None, .. } if message.contains("more than 3 levels deep")
        );
        assert!(check_depth(br#"{"a":"[[[[[[\"[[[["}"#, 2).is_ok());
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = check_depth(deep.as_bytes(), 32).unwrap_err();
        assert!(e.message.contains("--max-json-depth"), "{}", e.message);
    }

    #[test]
    fn a_repeated_key_is_refused_wherever_it_is() {
        for (body, param) in [
            (r#"{"prompt":"a","prompt":"b"}"#, "prompt"),
            (r#"{"n":1,"stop":"x","n":64}"#, "n"),
            (
                r#"{"messages":[{"role":"user","content":"x","role":"system"}]}"#,
                "messages.0.role",
            ),
            (
                r#"{"response_format":{"type":"json_schema","json_schema":{"schema":{},"schema":{}}}}"#,
                "response_format.json_schema.schema",
            ),
            (
                r#"{"tools":[],"user":"a","cache_salt":"s","cache_salt":"t"}"#,
                "cache_salt",
            ),
            // Escapes spell the same key.
            (r#"{"prompt":"a","pr\u006fmpt":"b"}"#, "prompt"),
        ] {
            let e = check_unique_keys(body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains("more than once"), "{}", e.message);
        }
        // The same key in two objects, or as a string value, is no repeat; malformed
        // JSON is the parser's to name.
        for body in [
            r#"{"messages":[{"role":"user"},{"role":"user"}],"role":"role"}"#,
            r#"{"a":{"b":1},"b":{"a":1}}"#,
            r#"{"prompt":"a","#,
            r#"{"a":[{"b":1},{"c":"#,
            "[1,2]",
        ] {
            assert!(check_unique_keys(body.as_bytes()).is_ok(), "{body}");
        }
    }

    #[test]
    fn counts_prompts_choices_stops_and_messages() {
        let c = config();
        let ok = |body: &str, e| check_counts(body.as_bytes(), e, &c).is_ok();
        let err = |body: &str, e| param(check_counts(body.as_bytes(), e, &c).unwrap_err());
        assert!(ok(r#"{"prompt":[1,2,3],"n":16}"#, Endpoint::Completions));
        assert!(ok(
            r#"{"prompt":["a","b","c","d"],"n":16}"#,
            Endpoint::Completions
        ));
        assert_eq!(
            err(
                r#"{"prompt":["a","b","c","d","e"],"n":16}"#,
                Endpoint::Completions
            )
            .as_deref(),
            Some("n")
        );
        let many = format!(r#"{{"prompt":[{}]}}"#, vec!["[1]"; 65].join(","));
        assert_eq!(err(&many, Endpoint::Completions).as_deref(), Some("prompt"));
        let stop = format!(r#"{{"prompt":"a","stop":"{}"}}"#, "x".repeat(1025));
        assert_eq!(err(&stop, Endpoint::Completions).as_deref(), Some("stop"));
        assert_eq!(
            err(
                r#"{"prompt":"a","stop":["a","b","c","d","e"]}"#,
                Endpoint::Completions
            )
            .as_deref(),
            Some("stop")
        );
        let messages = format!(
            r#"{{"messages":[{}]}}"#,
            vec![r#"{"role":"user","content":"x"}"#; 513].join(",")
        );
        assert_eq!(err(&messages, Endpoint::Chat).as_deref(), Some("messages"));
        // Wrong shapes are the parser's to name.
        assert!(ok(
            r#"{"prompt":5,"n":"x","stop":{}}"#,
            Endpoint::Completions
        ));
        assert!(ok("[1]", Endpoint::Completions));
    }
}
