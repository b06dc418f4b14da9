//! Batch invariance to the bit on the CPU backend, in both precisions: a request's logits
//! are exactly the same alone, left-padded in batches of 2 to 32, with its prompt read in
//! chunks, and on one thread or all, because every projection and attention reduces in
//! one fixed order whatever the batch shape.

use crate::common::{Demo, demo, prompts};
use llama_burn::Precision;
use llama_burn::cache::PagedKvCache;
use llama_burn::model::{Logits, PagedRow};

/// Both precisions, or those `LLAMA_BURN_TEST_PRECISIONS` names (`exact,fast`): CI's
/// portable-path step runs `exact` only, because there `fast`'s integer kernels are plain
/// Rust loops that the kernel tests of the same step already check against the scalar
/// reference, and the whole model in them takes minutes.
fn precisions() -> Vec<Precision> {
    match std::env::var("LLAMA_BURN_TEST_PRECISIONS") {
        Ok(names) => names
            .split(',')
            .map(|n| match n.trim() {
                "exact" => Precision::Exact,
                "fast" => Precision::Fast,
                other => panic!("LLAMA_BURN_TEST_PRECISIONS: unknown precision {other:?}"),
            })
            .collect(),
        Err(_) => vec![Precision::Exact, Precision::Fast],
    }
}

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
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn logits_are_bitwise_equal_alone_in_a_batch_of_seven_and_chunked() {
    let mut llama = demo(1024);
    for precision in precisions() {
        llama.set_precision(precision);
        alone_batched_and_chunked(&llama);
    }
}

fn alone_batched_and_chunked(llama: &Demo) {
    let precision = llama.config().precision;
    let ids: Vec<Vec<u32>> = prompts()
        .iter()
        .take(7)
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    assert!(ids.iter().map(Vec::len).max() > ids.iter().map(Vec::len).min());
    let next: Vec<u32> = (0..ids.len() as u32).map(|i| 100 + i).collect();
    let (batch_prompt, batch_step) = batch_logits(llama, &ids, &next);
    for (r, row) in ids.iter().enumerate() {
        let (alone_prompt, alone_step) =
            batch_logits(llama, std::slice::from_ref(row), &next[r..=r]);
        assert_eq!(
            bits(&alone_prompt[0]),
            bits(&batch_prompt[r]),
            "{precision}: row {r}: prompt"
        );
        assert_eq!(
            bits(&alone_step[0]),
            bits(&batch_step[r]),
            "{precision}: row {r}: decode step"
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
            "{precision}: row {r}: chunked prefill"
        );
    }
}

/// One prompt's logits (prompt and one decode step) alone on a one-thread pool, and as
/// row 0 of left-padded batches of 2, 5, 16 and 32 different prompts on every core.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_row_is_the_same_in_batches_of_2_to_32_and_on_one_thread() {
    let mut llama = demo(1024);
    let base = prompts();
    let ids: Vec<Vec<u32>> = (0..32)
        .map(|i| {
            let text = format!("{} ({i})", base[i % base.len()]);
            llama.encode_prompt(&text).unwrap()
        })
        .collect();
    let next: Vec<u32> = (0..32).map(|i| 300 + i).collect();
    for precision in precisions() {
        llama.set_precision(precision);
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let (alone_prompt, alone_step) =
            one_thread.install(|| batch_logits(&llama, &ids[..1], &next[..1]));
        for size in [2, 5, 16, 32] {
            let (prompt, step) = batch_logits(&llama, &ids[..size], &next[..size]);
            assert_eq!(
                bits(&prompt[0]),
                bits(&alone_prompt[0]),
                "{precision}: batch of {size}: prompt"
            );
            assert_eq!(
                bits(&step[0]),
                bits(&alone_step[0]),
                "{precision}: batch of {size}: decode step"
            );
        }
    }
}

/// One paged step: `rows` (start, new tokens) through their block `tables`; the
/// last-position logits of every row.
fn paged_step(
    llama: &Demo,
    cache: &mut llama_burn::cache::PagedKvCache<crate::common::B>,
    rows: &[(usize, Vec<u32>)],
    tables: &[Vec<u32>],
) -> Vec<Vec<f32>> {
    let paged: Vec<PagedRow<'_>> = rows
        .iter()
        .zip(tables)
        .map(|((start, tokens), blocks)| PagedRow {
            tokens,
            start: *start,
            blocks,
            logits: true,
            all_logits: false,
            adapter: None,
        })
        .collect();
    let logits: Vec<f32> = llama
        .model
        .forward_paged(&paged, cache)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    logits
        .chunks(llama.config().vocab_size)
        .map(<[f32]>::to_vec)
        .collect()
}

/// The continuous engine's paged path: rows in one step, each through its own scattered
/// block table, give the contiguous cache's logits to the bit, for a prompt read whole,
/// prompts read in two chunks beside another row's decode step, and decode steps.
#[test]
fn paged_steps_give_the_contiguous_bits() {
    let mut llama = demo(1024);
    for precision in precisions() {
        llama.set_precision(precision);
        paged_like_contiguous(&llama);
    }
}

fn paged_like_contiguous(llama: &Demo) {
    let ids: Vec<Vec<u32>> = prompts()
        .iter()
        .take(4)
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    let next: Vec<u32> = (0..ids.len() as u32).map(|i| 200 + i).collect();
    let c = llama.config();
    let bs = 16;
    let mut cache = PagedKvCache::new(
        c.n_layers,
        64,
        bs,
        c.n_kv_heads,
        c.head_dim,
        &llama_burn::backend::default_device(),
    )
    .unwrap();
    // Row r takes blocks r, r + 4, r + 8, ...: interleaved, never adjacent.
    let tables: Vec<Vec<u32>> = ids
        .iter()
        .enumerate()
        .map(|(r, row)| {
            (0..(row.len() + 1).div_ceil(bs))
                .map(|i| (r + 4 * i) as u32)
                .collect()
        })
        .collect();
    // Step 1: row 0's whole prompt, the first half of the others'.
    let cut = |r: usize| {
        if r == 0 {
            ids[0].len()
        } else {
            ids[r].len() / 2
        }
    };
    let first: Vec<(usize, Vec<u32>)> = (0..ids.len())
        .map(|r| (0, ids[r][..cut(r)].to_vec()))
        .collect();
    paged_step(llama, &mut cache, &first, &tables);
    // Step 2: row 0's decode step beside the others' second halves.
    let second: Vec<(usize, Vec<u32>)> = (0..ids.len())
        .map(|r| match r {
            0 => (cut(0), vec![next[0]]),
            _ => (cut(r), ids[r][cut(r)..].to_vec()),
        })
        .collect();
    let prompt_logits = paged_step(llama, &mut cache, &second, &tables);
    // Step 3: the others' decode steps.
    let third: Vec<(usize, Vec<u32>)> = (1..ids.len())
        .map(|r| (ids[r].len(), vec![next[r]]))
        .collect();
    let decode_logits = paged_step(llama, &mut cache, &third, &tables[1..]);

    for (r, row) in ids.iter().enumerate() {
        let (alone_prompt, alone_step) =
            batch_logits(llama, std::slice::from_ref(row), &next[r..=r]);
        if r == 0 {
            assert_eq!(
                bits(&prompt_logits[0]),
                bits(&alone_step[0]),
                "row 0: decode"
            );
        } else {
            assert_eq!(
                bits(&prompt_logits[r]),
                bits(&alone_prompt[0]),
                "row {r}: prompt"
            );
            assert_eq!(
                bits(&decode_logits[r - 1]),
                bits(&alone_step[0]),
                "row {r}: decode"
            );
        }
    }
}

/// An encoded paged KV cache (every type, for keys or values) keeps a row's logits the
/// same to the bit: a prompt read whole on one thread alone, or in two chunks beside
/// other rows on every core; a decode step alone or beside others.
#[test]
fn encoded_kv_caches_give_a_row_the_same_bits_alone_chunked_and_batched() {
    use llama_burn::cache::{KvCacheType as T, KvCacheTypes};
    let llama = demo(1024);
    let ids: Vec<Vec<u32>> = prompts()
        .iter()
        .take(3)
        .map(|p| llama.encode_prompt(p).unwrap())
        .collect();
    let next: Vec<u32> = (0..ids.len() as u32).map(|i| 300 + i).collect();
    let c = llama.config();
    let bs = 16;
    let new_cache = |types: KvCacheTypes| {
        PagedKvCache::with_types(
            c.n_layers,
            48,
            bs,
            c.n_kv_heads,
            c.head_dim,
            types,
            &llama_burn::backend::default_device(),
        )
        .unwrap()
    };
    let tables: Vec<Vec<u32>> = ids
        .iter()
        .enumerate()
        .map(|(r, row)| {
            (0..(row.len() + 1).div_ceil(bs))
                .map(|i| (r + 3 * i) as u32)
                .collect()
        })
        .collect();
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut outputs = Vec::new();
    for (k, v) in [
        (T::Q8_0, T::Q4_0),
        (T::Q4_0, T::Q8_0),
        (T::F16, T::Bf16),
        (T::Bf16, T::F32),
    ] {
        let types = KvCacheTypes::new(k, v);
        // Batched: every row's first half, then its second half beside row 0's decode
        // step, then the others' decode steps.
        let mut cache = new_cache(types);
        let half = |r: usize| {
            if r == 0 {
                ids[0].len()
            } else {
                ids[r].len() / 2
            }
        };
        let first: Vec<(usize, Vec<u32>)> = (0..ids.len())
            .map(|r| (0, ids[r][..half(r)].to_vec()))
            .collect();
        paged_step(&llama, &mut cache, &first, &tables);
        let second: Vec<(usize, Vec<u32>)> = (0..ids.len())
            .map(|r| match r {
                0 => (half(0), vec![next[0]]),
                _ => (half(r), ids[r][half(r)..].to_vec()),
            })
            .collect();
        let mixed = paged_step(&llama, &mut cache, &second, &tables);
        let third: Vec<(usize, Vec<u32>)> = (1..ids.len())
            .map(|r| (ids[r].len(), vec![next[r]]))
            .collect();
        let decoded = paged_step(&llama, &mut cache, &third, &tables[1..]);
        for r in 0..ids.len() {
            // Alone, on one thread, the prompt whole, in a fresh cache.
            let mut cache = new_cache(types);
            let table = &tables[r..=r];
            let (prompt, step) = one_thread.install(|| {
                let prompt = paged_step(&llama, &mut cache, &[(0, ids[r].clone())], table);
                let step = paged_step(&llama, &mut cache, &[(ids[r].len(), vec![next[r]])], table);
                (prompt, step)
            });
            if r == 0 {
                assert_eq!(bits(&mixed[0]), bits(&step[0]), "{types}: row 0 decode");
            } else {
                assert_eq!(bits(&mixed[r]), bits(&prompt[0]), "{types}: row {r} prompt");
                assert_eq!(
                    bits(&decoded[r - 1]),
                    bits(&step[0]),
                    "{types}: row {r} decode"
                );
            }
        }
        outputs.push(bits(&mixed[1]));
    }
    // The types store different bits, so their logits differ.
    for (i, a) in outputs.iter().enumerate() {
        for b in &outputs[i + 1..] {
            assert_ne!(a, b);
        }
    }
}
