//! Batch invariance to the bit on the CPU backend: a request's logits are exactly the
//! same alone, left-padded in a batch of 7, and with its prompt read in chunks, because
//! every projection and attention reduces in one fixed order whatever the batch shape.

mod common;

use common::{Demo, demo, prompts};
use llama_burn::model::Logits;

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Last-position logits of every row of a left-padded batch, and after one more decode
/// step with `next[r]` appended to each row.
fn batch_logits(llama: &Demo, rows: &[Vec<u32>], next: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let width = rows.iter().map(Vec::len).max().unwrap();
    let starts: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
    let mut tokens = Vec::new();
    for (row, &start) in rows.iter().zip(&starts) {
        tokens.extend(std::iter::repeat_n(0, start));
        tokens.extend(row);
    }
    let vocab = llama.config().vocab_size;
    let mut cache = llama.model.new_cache(starts, width + 1);
    let split = |t: burn::tensor::Tensor<_, 3>| -> Vec<Vec<f32>> {
        let v: Vec<f32> = t.into_data().to_vec().unwrap();
        v.chunks(vocab).map(<[f32]>::to_vec).collect()
    };
    let prompt = split(
        llama
            .model
            .forward(&tokens, &mut cache, Logits::Last)
            .unwrap(),
    );
    let step = split(llama.model.forward(next, &mut cache, Logits::Last).unwrap());
    (prompt, step)
}

#[test]
fn logits_are_bitwise_equal_alone_in_a_batch_of_seven_and_chunked() {
    let llama = demo(1024);
    let ids: Vec<Vec<u32>> = prompts()
        .iter()
        .take(7)
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    assert!(ids.iter().map(Vec::len).max() > ids.iter().map(Vec::len).min());
    let next: Vec<u32> = (0..ids.len() as u32).map(|i| 100 + i).collect();
    let (batch_prompt, batch_step) = batch_logits(&llama, &ids, &next);
    for (r, row) in ids.iter().enumerate() {
        let (alone_prompt, alone_step) =
            batch_logits(&llama, std::slice::from_ref(row), &next[r..=r]);
        assert_eq!(
            bits(&alone_prompt[0]),
            bits(&batch_prompt[r]),
            "row {r}: prompt"
        );
        assert_eq!(
            bits(&alone_step[0]),
            bits(&batch_step[r]),
            "row {r}: decode step"
        );

        // The same prompt read in chunks of 3 columns.
        let mut cache = llama.model.new_cache(vec![0], row.len() + 1);
        let mut last = None;
        for chunk in row.chunks(3) {
            last = Some(
                llama
                    .model
                    .forward(chunk, &mut cache, Logits::Last)
                    .unwrap(),
            );
        }
        let chunked: Vec<f32> = last.unwrap().into_data().to_vec().unwrap();
        assert_eq!(
            bits(&chunked),
            bits(&alone_prompt[0]),
            "row {r}: chunked prefill"
        );
    }
}
