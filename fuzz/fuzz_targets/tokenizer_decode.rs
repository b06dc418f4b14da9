//! Arbitrary token ids decoded by the demo model's, the Llama 3 and the bytes-only
//! tokenizers (loaded once). The body is `llama_burn::fuzzing::tokenizer_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        llama_burn::fuzzing::tokenizers().expect("the tokenizers");
    },
    |data: &[u8]| {
        let tokenizers = llama_burn::fuzzing::tokenizers().expect("the tokenizers");
        llama_burn::fuzzing::tokenizer_decode(tokenizers, data);
    }
);
