//! Paged attention per KV cache type, alternated in one run: the attention of one layer
//! of Llama 3.2 1B (32 query heads over 8 key/value heads of 64) for `rows` decode rows,
//! each over its own `context` keys in scattered blocks of 16, with keys and values
//! stored in each type in turn. Rounds go through every type before the next round, and
//! each type's median is reported with its ratio to `f32`.
//!
//! With `prompt`, one prompt of `tokens` new tokens instead (each token over the keys
//! up to its own, as a prompt's attention in prefill).
//!
//! ```sh
//! cargo bench --bench kv_cache                 # 1 and 32 rows, 2,000 keys
//! cargo bench --bench kv_cache -- 32 4000 15   # rows, context, rounds
//! cargo bench --bench kv_cache -- prompt 512 9 # a prompt's tokens, rounds
//! cargo bench --bench kv_cache -- prompt 512 9 f32  # f32 keys and values only
//! ```

use std::time::Instant;

use llama_burn::cache::KvCacheType;
use llama_burn::kernels::attention::{
    EncodedPagedPool, PagedPool, PagedSeq, paged_attention, paged_attention_encoded,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

const HEADS: usize = 8;
const QUERY_HEADS: usize = 32;
const DIM: usize = 64;
const BLOCK: usize = 16;

fn main() {
    let prompt = std::env::args().any(|a| a == "prompt");
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if prompt {
        let (tokens, rounds) = match args[..] {
            [tokens, rounds, ..] => (tokens, rounds),
            [tokens] => (tokens, 9),
            _ => (512, 9),
        };
        run(1, tokens, 0, rounds);
        return;
    }
    let (rows_list, context, rounds) = match args[..] {
        [rows, context, rounds, ..] => (vec![rows], context, rounds),
        [rows, context] => (vec![rows], context, 9),
        _ => (vec![1, 32], 2000, 9),
    };
    for rows in rows_list {
        run(rows, 1, context, rounds);
    }
}

/// `rows` sequences of `tokens` new tokens each after `context` cached ones.
fn run(rows: usize, tokens: usize, context: usize, rounds: usize) {
    let mut rng = StdRng::seed_from_u64(3);
    let per_row = (context + tokens).div_ceil(BLOCK);
    let blocks = rows * per_row;
    let n = blocks * HEADS * BLOCK;
    let keys: Vec<f32> = (0..n * DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let values: Vec<f32> = (0..n * DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    // Row r's blocks are r, r + rows, r + 2 rows, ...: interleaved through the pool.
    let tables: Vec<Vec<u32>> = (0..rows)
        .map(|r| (0..per_row).map(|i| (r + i * rows) as u32).collect())
        .collect();
    let seqs: Vec<PagedSeq<'_>> = tables
        .iter()
        .map(|blocks| PagedSeq {
            tokens,
            start: context,
            blocks,
        })
        .collect();
    let q: Vec<f32> = (0..rows * tokens * QUERY_HEADS * DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let encoded: Vec<(KvCacheType, Vec<u8>, Vec<u8>)> = KvCacheType::ALL[1..]
        .iter()
        .map(|&ty| {
            let row = ty.row_bytes(DIM).expect("64 is whole blocks");
            let encode = |data: &[f32]| {
                let mut out = vec![0u8; n * row];
                for (x, o) in data.chunks_exact(DIM).zip(out.chunks_exact_mut(row)) {
                    ty.encode(x, o);
                }
                out
            };
            (ty, encode(&keys), encode(&values))
        })
        .collect();
    let f32_pool = PagedPool {
        keys: &keys,
        values: &values,
        heads: HEADS,
        block_size: BLOCK,
        dim: DIM,
    };
    let f32_only = std::env::args().any(|a| a == "f32");
    let mut times = vec![Vec::new(); KvCacheType::ALL.len()];
    for _ in 0..rounds {
        let start = Instant::now();
        std::hint::black_box(paged_attention(&q, QUERY_HEADS, f32_pool, &seqs).expect("shapes"));
        times[0].push(start.elapsed().as_secs_f64());
        for (i, (ty, k, v)) in encoded.iter().enumerate().filter(|_| !f32_only) {
            let pool = EncodedPagedPool {
                keys: (k, *ty),
                values: (v, *ty),
                heads: HEADS,
                block_size: BLOCK,
                dim: DIM,
            };
            let start = Instant::now();
            std::hint::black_box(
                paged_attention_encoded(&q, QUERY_HEADS, pool, &seqs).expect("shapes"),
            );
            times[i + 1].push(start.elapsed().as_secs_f64());
        }
    }
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let base = median(&mut times[0]);
    if tokens == 1 {
        println!(
            "{rows} rows x {context} keys, one 1B layer, {rounds} rounds alternated (median):"
        );
    } else {
        println!(
            "{rows} x a prompt of {tokens} tokens, one 1B layer, {rounds} rounds alternated (median):"
        );
    }
    for (ty, t) in KvCacheType::ALL
        .iter()
        .zip(&mut times)
        .filter(|(_, t)| !t.is_empty())
    {
        let m = median(t);
        // A decode row reads its keys and values once; a prompt's tokens share theirs.
        let bytes = (ty.row_bytes(DIM).unwrap_or(0) * 2 * HEADS * (context + tokens) * rows) as f64;
        let read = if tokens == 1 {
            format!(", {:6.1} GB/s of KV read", bytes / m / 1e9)
        } else {
            String::new()
        };
        println!(
            "  {:>5}: {:8.3} ms  ({:.2}x f32's time{read})",
            ty.name(),
            m * 1e3,
            m / base,
        );
    }
}
