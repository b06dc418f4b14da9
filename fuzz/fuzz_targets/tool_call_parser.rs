//! The streaming tool-call parser on arbitrary text in arbitrary pieces.
//! The body is `llama_burn::fuzzing::tool_call_parser` (which documents the input and the checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_burn::fuzzing::tool_call_parser(data));
