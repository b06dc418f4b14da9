//! Reference fidelity: the demo model reproduces Hugging Face transformers (float32, the
//! same dequantized weights) token for token, and its logits within 1e-3.

mod common;

use common::{demo, ids, reference};
use llama_burn::sampling::Sampler;

#[test]
fn prompt_ids_greedy_tokens_and_top5_logits_match_transformers() {
    let mut llama = demo(512);
    let reference = reference();
    let prompts = reference["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 4, "fixture has its four prompts");
    let mut worst_logit_diff = 0f32;
    for case in prompts {
        let name = case["name"].as_str().unwrap_or("?");
        let prompt_ids = ids(&case["prompt_ids"]);
        let encoded = llama
            .encode_prompt(case["prompt_text"].as_str().expect("text"))
            .expect("encode");
        assert_eq!(encoded, prompt_ids, "prompt ids of `{name}`");

        let expected = ids(&case["greedy_ids"]);
        let mut state = llama
            .create_generation_state_from_ids(prompt_ids.clone(), expected.len())
            .expect("state")
            .ignore_stop_tokens();
        let out = llama
            .run_to_end(&mut state, 0.0, &mut Sampler::Argmax)
            .expect("generate");
        assert_eq!(out.tokens, expected, "greedy continuation of `{name}`");

        // Top-5 logits of the rows that chose generated tokens s+1.
        let mut full = prompt_ids.clone();
        full.extend_from_slice(&expected);
        let logits = llama.logits(&full).expect("logits");
        for (step, top) in case["topk"].as_object().expect("topk map") {
            let s: usize = step.parse().expect("step index");
            let row = &logits[prompt_ids.len() - 1 + s];
            let want_ids = ids(&top["ids"]);
            let want_vals: Vec<f32> = top["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("value") as f32)
                .collect();
            for (id, want) in want_ids.iter().zip(&want_vals) {
                let diff = (row[*id as usize] - want).abs();
                worst_logit_diff = worst_logit_diff.max(diff);
                assert!(
                    diff <= 1e-3,
                    "`{name}` step {s} token {id}: {} vs {want}",
                    row[*id as usize]
                );
            }
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            assert_eq!(
                order[0] as u32, want_ids[0],
                "`{name}` step {s}: top-1 token"
            );
        }
    }
    eprintln!("largest top-5 logit difference from transformers: {worst_logit_diff:e}");
}
