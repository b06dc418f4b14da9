//! A POST body through every check the chat, completions and embeddings endpoints run
//! before any work.
//! The body is `llama_burn::fuzzing::server_body` (which documents the input and the checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_burn::fuzzing::server_body(data));
