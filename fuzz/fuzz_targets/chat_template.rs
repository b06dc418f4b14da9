//! Chat templates (arbitrary, or the demo model's own) rendered with arbitrary messages
//! and tools. The body is `llama_burn::fuzzing::chat_template`.
#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        llama_burn::fuzzing::tokenizers().expect("the tokenizers");
    },
    |data: &[u8]| {
        let tokenizers = llama_burn::fuzzing::tokenizers().expect("the tokenizers");
        llama_burn::fuzzing::chat_template(&*tokenizers[0], data);
    }
);
