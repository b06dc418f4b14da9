//! Arbitrary bytes as a GGUF file: header, metadata, tensor infos and tensor data.
//! The body is `llama_burn::fuzzing::gguf_header` (which documents the input and the checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_burn::fuzzing::gguf_header(data));
