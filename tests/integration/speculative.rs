//! Speculative decoding: verifying `1 + k` tokens in one forward pass gives, for every
//! position, the bits a one-token decode step gives, so speculation never changes a
//! request's tokens (greedy or sampled), whatever the proposer.

use crate::common::{Demo, demo, prompts};
use llama_burn::Precision;
use llama_burn::model::Logits;

const PRECISIONS: [Precision; 2] = [Precision::Exact, Precision::Fast];

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The logits of `tokens` after `prompt`: one forward pass over all of them
/// (`Logits::All`, as verification runs), and one decode step per token.
fn chunk_and_steps(llama: &Demo, prompt: &[u32], tokens: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let vocab = llama.config().vocab_size;
    let rows = |t: burn::tensor::Tensor<_, 3>| -> Vec<Vec<f32>> {
        let v: Vec<f32> = t.into_data().to_vec().unwrap();
        v.chunks(vocab).map(<[f32]>::to_vec).collect()
    };
    let capacity = prompt.len() + tokens.len();
    let mut cache = llama.model.new_cache(vec![0], capacity);
    llama.model.forward_prompt(prompt, &mut cache).unwrap();
    let chunk = rows(
        llama
            .model
            .forward(tokens, &mut cache, Logits::All)
            .unwrap(),
    );

    let mut cache = llama.model.new_cache(vec![0], capacity);
    llama.model.forward_prompt(prompt, &mut cache).unwrap();
    let steps = tokens
        .iter()
        .map(|&t| rows(llama.model.forward(&[t], &mut cache, Logits::Last).unwrap()).remove(0))
        .collect();
    (chunk, steps)
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_verification_chunk_gives_each_position_the_bits_of_a_decode_step() {
    let mut llama = demo(1024);
    for precision in PRECISIONS {
        llama.set_precision(precision);
        for (p, text) in prompts().iter().enumerate().take(5) {
            let prompt = llama.encode_prompt(text).unwrap();
            for k in [1usize, 3, 7] {
                let tokens: Vec<u32> = (0..=k as u32).map(|i| 300 + 17 * i).collect();
                let (chunk, steps) = chunk_and_steps(&llama, &prompt, &tokens);
                assert_eq!(chunk.len(), k + 1);
                for (i, (c, s)) in chunk.iter().zip(&steps).enumerate() {
                    assert_eq!(
                        bits(c),
                        bits(s),
                        "{precision}: prompt {p}, k {k}, position {i}"
                    );
                }
            }
        }
    }
}

/// A paragraph to copy with a few edits: most of the output is in the prompt.
pub const PARAGRAPH: &str = "The lighthouse stood at the end of the rocky point, its white tower \
    streaked with salt and rust. Every evening the keeper climbed the one hundred and twelve \
    steps to light the lamp, and every morning he climbed them again to put it out. Ships \
    passing in the night saw the beam sweep across the water once every nine seconds, and \
    the fishermen of the village set their watches by it. In winter the storms came in from \
    the west, and the waves broke so high against the rocks that the spray reached the \
    gallery windows.";

fn copy_prompt(llama: &Demo) -> Vec<u32> {
    use llama_burn::tokenizer::ChatMessage;
    let request = llama_burn::inference::GenerateRequest::chat(vec![ChatMessage::user(format!(
        "Rewrite the following paragraph exactly, word for word, but change \"lighthouse\" \
         to \"beacon\" and \"nine\" to \"ten\":\n\n{PARAGRAPH}"
    ))]);
    llama.encode_request(&request).unwrap()
}

/// Runs `ids` for `n` tokens (stop tokens ignored), with `spec` if given; greedy at
/// temperature 0, else nucleus sampling with `seed`.
fn run(
    llama: &mut Demo,
    ids: &[u32],
    n: usize,
    spec: Option<SpeculationConfig>,
    temperature: f64,
    seed: u64,
) -> llama_burn::GenerationOutput {
    let state = llama
        .create_generation_state_from_ids(ids.to_vec(), n)
        .unwrap()
        .ignore_stop_tokens();
    let mut state = match spec {
        Some(config) => llama.with_speculation(state, &config).unwrap(),
        None => state,
    };
    let mut sampler = if temperature == 0.0 {
        Sampler::Argmax
    } else {
        Sampler::TopP(TopP::new(0.9, seed))
    };
    llama
        .run_to_end(&mut state, temperature, &mut sampler)
        .unwrap()
}

use llama_burn::sampling::{Sampler, TopP};
use llama_burn::speculative::SpeculationConfig;

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn greedy_tokens_with_prompt_lookup_equal_tokens_without() {
    let mut llama = demo(1024);
    let copy = copy_prompt(&llama);
    for precision in PRECISIONS {
        llama.set_precision(precision);
        for (p, text) in prompts().iter().enumerate().take(5) {
            let ids = llama.encode_prompt(text).unwrap();
            let plain = run(&mut llama, &ids, 24, None, 0.0, 0);
            // Every n-gram length down to 1, so proposals are frequent and often wrong.
            let config = SpeculationConfig::ngram(6).with_ngram_range(1, 3);
            let spec = run(&mut llama, &ids, 24, Some(config), 0.0, 0);
            assert_eq!(spec.tokens, plain.tokens, "{precision}: prompt {p}");
            assert!(plain.speculation.is_none() && spec.speculation.is_some());
        }
        let plain = run(&mut llama, &copy, 160, None, 0.0, 0);
        let spec = run(
            &mut llama,
            &copy,
            160,
            Some(SpeculationConfig::ngram(8)),
            0.0,
            0,
        );
        assert_eq!(spec.tokens, plain.tokens, "{precision}: copy task");
        assert_eq!(spec.text, plain.text);
        let stats = spec.speculation.unwrap();
        // The copy is mostly proposed from the prompt.
        assert!(
            stats.accepted_draft_tokens >= 60,
            "{precision}: {stats:?}: {}",
            spec.text
        );
    }
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn sampled_tokens_with_speculation_equal_tokens_without_for_every_seed() {
    let mut llama = demo(1024);
    let copy = copy_prompt(&llama);
    let mut accepted = 0;
    for seed in 0..4 {
        let plain = run(&mut llama, &copy, 48, None, 0.7, seed);
        let config = SpeculationConfig::ngram(8).with_ngram_range(1, 3);
        let spec = run(&mut llama, &copy, 48, Some(config), 0.7, seed);
        assert_eq!(spec.tokens, plain.tokens, "seed {seed}");
        accepted += spec.speculation.unwrap().accepted_draft_tokens;
    }
    assert!(accepted > 0);
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn the_demo_model_drafting_for_itself_gives_the_plain_tokens_and_is_always_right() {
    let mut llama = demo(1024);
    llama.set_draft_model(demo(1024)).unwrap();
    let ids = llama.encode_prompt(&prompts()[6]).unwrap();
    let plain = run(&mut llama, &ids, 40, None, 0.0, 0);
    let spec = run(
        &mut llama,
        &ids,
        40,
        Some(SpeculationConfig::draft_model(4)),
        0.0,
        0,
    );
    assert_eq!(spec.tokens, plain.tokens);
    let stats = spec.speculation.unwrap();
    // The same model in the same precision: every greedy proposal is the target's token.
    assert!(stats.draft_tokens > 20, "{stats:?}");
    assert_eq!(stats.accepted_draft_tokens, stats.draft_tokens);
    // Sampled: still the plain tokens (proposals are the draft's greedy tokens).
    let plain = run(&mut llama, &ids, 32, None, 0.8, 7);
    let spec = run(
        &mut llama,
        &ids,
        32,
        Some(SpeculationConfig::draft_model(4)),
        0.8,
        7,
    );
    assert_eq!(spec.tokens, plain.tokens);
}

/// The continuous engine with 8 speculating rows (prompt lookup; greedy and sampled)
/// beside 8 plain ones in the same steps, on a small pool of small blocks (so
/// proposals take blocks and rejected ones give them back): every row's tokens equal
/// its solo run without speculation, and every block comes back.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn engine_rows_that_speculate_beside_rows_that_do_not_equal_their_solo_runs() {
    use crate::common::rest;
    use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
    let mut solo = demo(1024);
    let copy = copy_prompt(&solo);
    let texts = prompts();
    let mut cases: Vec<(Vec<u32>, bool, f64, u64)> = Vec::new();
    for i in 0..16u64 {
        let speculate = i % 2 == 0;
        let ids = if i % 4 < 2 {
            copy.clone()
        } else {
            solo.encode_prompt(&texts[(i as usize / 4) % texts.len()])
                .unwrap()
        };
        let temperature = if i % 8 >= 6 { 0.7 } else { 0.0 };
        cases.push((ids, speculate, temperature, 100 + i));
    }
    let n = 40;
    let expected: Vec<Vec<u32>> = cases
        .iter()
        .map(|(ids, _, t, seed)| run(&mut solo, ids, n, None, *t, *seed).tokens)
        .collect();
    let mut config = ContinuousConfig::default().with_kv_budget_tokens(16 * 260);
    config.block_size = 4;
    let engine = ContinuousEngine::start(demo(1024), config).unwrap();
    let jobs: Vec<_> = cases
        .iter()
        .map(|(ids, speculate, t, seed)| {
            let mut r = GenerateRequest::from_ids(ids.clone())
                .with_max_tokens(n)
                .with_ignore_eos(true)
                .with_temperature(*t)
                .with_top_p(0.9)
                .with_seed(*seed);
            if *speculate {
                // Every proposal verified (16 rows fill this CPU's step, so the
                // default cost model would verify few): proposals take blocks.
                r = r.with_speculation(SpeculationConfig {
                    step_overhead: u32::MAX,
                    ..SpeculationConfig::ngram(6).with_ngram_range(1, 3)
                });
            }
            engine.submit(r).unwrap()
        })
        .collect();
    for (i, job) in jobs.into_iter().enumerate() {
        let (tokens, result) = rest(job);
        result.unwrap();
        assert_eq!(tokens, expected[i], "row {i} (speculating: {})", cases[i].1);
    }
    let m = engine.metrics();
    assert_eq!(m.kv_blocks_used, 0);
    assert!(m.spec_decode_num_draft_tokens > 0);
    assert!(
        m.spec_decode_num_accepted_tokens > 40,
        "{} of {} accepted",
        m.spec_decode_num_accepted_tokens,
        m.spec_decode_num_draft_tokens
    );
}
