//! The batched strategy on the demo model: every row gives exactly the tokens it gives
//! alone, whatever else is in the batch.

use crate::common::{Demo, demo, prompts};
use llama_burn::LlamaError;
use llama_burn::inference::generate_batch;
use llama_burn::model::Logits;
use llama_burn::sampling::{Sampler, TopP};

fn solo_greedy(llama: &mut Demo, prompt: &str, max_tokens: usize) -> Vec<u32> {
    llama
        .generate(prompt, max_tokens, 0.0, &mut Sampler::Argmax)
        .unwrap()
        .tokens
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn batch_of_mixed_lengths_matches_each_prompt_alone() {
    let mut llama = demo(1024);
    let prompts = prompts();
    let lens: Vec<usize> = prompts
        .iter()
        .map(|p| llama.encode_prompt(p).unwrap().len())
        .collect();
    assert!(
        lens.contains(&1) && lens.iter().any(|&l| l >= 200),
        "lengths {lens:?}"
    );
    let max_tokens = 24;
    let mut state = llama
        .create_batched_generation_state(&prompts, max_tokens)
        .unwrap();
    let mut samplers = vec![Sampler::Argmax; prompts.len()];
    llama
        .run_batch_to_end(&mut state, 0.0, &mut samplers)
        .unwrap();
    for (prompt, row) in prompts.iter().zip(state.rows()) {
        assert_eq!(
            row.tokens(),
            solo_greedy(&mut llama, prompt, max_tokens),
            "prompt {prompt:?}"
        );
    }
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn batched_logits_match_single_row_logits() {
    let llama = demo(1024);
    let prompts = prompts();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    let width = ids.iter().map(Vec::len).max().unwrap();
    let starts: Vec<usize> = ids.iter().map(|r| width - r.len()).collect();
    let mut tokens = Vec::new();
    for (row, &start) in ids.iter().zip(&starts) {
        tokens.extend(std::iter::repeat_n(0, start));
        tokens.extend(row);
    }
    let mut cache = llama.model.new_cache(starts, width + 1);
    let batched: Vec<f32> = llama
        .model
        .forward(&tokens, &mut cache, Logits::Last)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let vocab = llama.config().vocab_size;
    let mut worst = 0f32;
    for (i, row) in ids.iter().enumerate() {
        let alone = llama.logits(row).unwrap();
        let alone = alone.last().unwrap();
        let batch_row = &batched[i * vocab..(i + 1) * vocab];
        for (a, b) in alone.iter().zip(batch_row) {
            worst = worst.max((a - b).abs());
        }
    }
    eprintln!("largest batched vs single-row logit difference: {worst:e}");
    assert!(worst <= 1e-4, "largest difference {worst}");
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn batch_of_one_equals_sequential_and_rows_stop_independently() {
    let mut llama = demo(512);
    let prompt = "The capital of France is";
    let mut state = llama
        .create_batched_generation_state(&[prompt], 16)
        .unwrap();
    llama
        .run_batch_to_end(&mut state, 0.0, &mut [Sampler::Argmax])
        .unwrap();
    assert_eq!(
        state.rows()[0].tokens(),
        solo_greedy(&mut llama, prompt, 16)
    );

    // Rows with their own budgets and a chat row that ends at its stop token.
    let format = llama.tokenizer.chat_format().unwrap();
    use llama_burn::tokenizer::{ChatMessage, Tokenizer};
    let chat = format.format(&[ChatMessage::user("What is the capital of France?")], true);
    let texts = [chat.as_str(), "Once upon a time", "1, 2, 3, 4,"];
    let budgets = [64, 3, 40];
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| llama.encode_prompt(t).unwrap())
        .collect();
    let mut state = llama
        .create_batched_generation_state_from_ids(ids, budgets.to_vec())
        .unwrap();
    let mut samplers = vec![Sampler::Argmax; 3];
    let mut cache_rows = Vec::new();
    while !state.is_done() {
        llama
            .generate_batched_single_token(&mut state, 0.0, &mut samplers)
            .unwrap();
        cache_rows.push(state.cache_rows());
    }
    assert_eq!(
        state.rows()[0].stop_reason(),
        Some(llama_burn::StopReason::StopToken)
    );
    assert_eq!(state.rows()[1].tokens().len(), 3);
    assert!(
        cache_rows.windows(2).all(|w| w[1] <= w[0]) && cache_rows.contains(&2),
        "{cache_rows:?}"
    );
    for ((text, budget), row) in texts.iter().zip(budgets).zip(state.rows()) {
        assert_eq!(
            row.tokens(),
            solo_greedy(&mut llama, text, budget),
            "prompt {text:?}"
        );
    }
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn seeded_top_p_batches_reproduce_and_split_batches_agree() {
    let mut llama = demo(1024);
    let prompts: Vec<String> = prompts().into_iter().take(5).collect();
    let a = generate_batch(&mut llama, &prompts, 12, 0.8, 0.9, 42).unwrap();
    let b = generate_batch(&mut llama, &prompts, 12, 0.8, 0.9, 42).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), prompts.len());
    // The same rows sampled alone with the seed of their index give the same text.
    for (i, prompt) in prompts.iter().enumerate() {
        let alone = llama
            .generate(
                prompt,
                12,
                0.8,
                &mut Sampler::TopP(TopP::new(0.9, 42 + i as u64)),
            )
            .unwrap();
        assert_eq!(a[i].concat(), alone.text, "row {i}");
    }
}

#[test]
fn malformed_batches_are_errors() {
    let mut llama = demo(256);
    let none: [&str; 0] = [];
    assert!(matches!(
        llama.create_batched_generation_state(&none, 4),
        Err(LlamaError::InvalidBatch(_))
    ));
    assert!(matches!(
        llama.create_batched_generation_state(&["fine", ""], 4),
        Err(LlamaError::EmptyPrompt)
    ));
    let long = "word ".repeat(300);
    assert!(matches!(
        llama.create_batched_generation_state(&["fine", long.as_str()], 4),
        Err(LlamaError::PromptTooLong { .. })
    ));
    let mut state = llama
        .create_batched_generation_state(&["a", "b"], 4)
        .unwrap();
    assert!(matches!(
        llama.generate_batched_single_token(&mut state, 0.0, &mut [Sampler::Argmax]),
        Err(LlamaError::InvalidBatch(_))
    ));
    let top_p = generate_batch(&mut llama, &["x"], 4, 0.5, 1.5, 0);
    assert!(
        matches!(
            top_p,
            Err(LlamaError::InvalidParameter { name: "top_p", .. })
        ),
        "{:?}",
        top_p.err()
    );
}
