//! Reference fidelity: the demo model reproduces Hugging Face transformers (float32, the
//! same dequantized weights) token for token, and its logits within 1e-3.

use crate::common::{demo, ids, reference};
use llama_burn::Precision;
use llama_burn::sampling::Sampler;

#[test]
fn prompt_ids_greedy_tokens_and_top5_logits_match_transformers() {
    // The `exact` precision is the one held to the fp32 reference.
    let mut llama = demo(512).with_precision(Precision::Exact);
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

/// The `fast` precision (8-bit activations) against the same reference: its greedy
/// tokens' agreement with transformers' is reported, and its logits of the reference's
/// top 5 tokens stay within 5% of the logits' range (seen: 1.2% on the avx512 path, 2.6%
/// on the portable path, whose attention and norms round differently before the 8-bit
/// quantization of the activations).
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn fast_precision_mostly_agrees_with_the_reference() {
    let mut llama = demo(512).with_precision(Precision::Fast);
    let reference = reference();
    let (mut agree, mut total, mut worst) = (0, 0, 0f32);
    // Teacher-forced: the next-token choice at every position of the reference's greedy
    // continuation, the context being the reference's own tokens (no divergence
    // compounds): 187 of 192 measured (97%; on a wider set, 564 of 576, where
    // llama.cpp's Q4_1 gets 561). A bug in an integer kernel, which changes most choices,
    // falls far below the floor. The greedy runs' agreement up to their first
    // difference (27 of 192) is printed only: one early difference ends a run's count.
    let (mut forced_agree, mut forced_total) = (0usize, 0usize);
    for case in reference["prompts"].as_array().expect("prompts") {
        let prompt_ids = ids(&case["prompt_ids"]);
        let expected = ids(&case["greedy_ids"]);
        let mut state = llama
            .create_generation_state_from_ids(prompt_ids.clone(), expected.len())
            .expect("state")
            .ignore_stop_tokens();
        let out = llama
            .run_to_end(&mut state, 0.0, &mut Sampler::Argmax)
            .expect("generate");
        // Agreement until the first difference (after it the contexts differ).
        let same = out
            .tokens
            .iter()
            .zip(&expected)
            .take_while(|(a, b)| a == b)
            .count();
        agree += same;
        total += expected.len();
        let mut forced: Vec<u32> = prompt_ids.clone();
        forced.extend_from_slice(&expected[..expected.len() - 1]);
        let rows = llama.logits(&forced).expect("forced logits");
        for (k, want) in expected.iter().enumerate() {
            let row = &rows[prompt_ids.len() - 1 + k];
            let best = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) },
                )
                .0;
            forced_agree += usize::from(best as u32 == *want);
            forced_total += 1;
        }
        let logits = llama.logits(&prompt_ids).expect("logits");
        let row = &logits[prompt_ids.len() - 1];
        let top = &case["topk"]["0"];
        let range = row.iter().fold(f32::MIN, |m, &v| m.max(v))
            - row.iter().fold(f32::MAX, |m, &v| m.min(v));
        for (id, want) in ids(&top["ids"])
            .iter()
            .zip(top["values"].as_array().expect("values"))
        {
            worst =
                worst.max((row[*id as usize] - want.as_f64().expect("value") as f32).abs() / range);
        }
    }
    eprintln!(
        "fast precision: greedy tokens equal to the reference's (up to each prompt's first difference): {agree} of {total}; next-token choices with the reference's context: {forced_agree} of {forced_total}; largest top-5 logit difference {worst:.4} of the logits' range"
    );
    assert!(
        forced_agree * 100 >= forced_total * 95,
        "fast precision's next-token choices agree with the fp32 reference's at \
         {forced_agree} of {forced_total} positions (floor: 95%)"
    );
    assert!(
        worst <= 0.05,
        "top-5 logits within 5% of the range: {worst}"
    );
}
