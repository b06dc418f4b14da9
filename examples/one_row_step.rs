//! Times the projections of one decode step at one row (every block's seven projections
//! in the model's call order, then the output head) on a GGUF file's own weights, with
//! nothing else of the model: what the kernels and their thread split cost per token.
//!
//! `cargo run --release --example one_row_step -- FILE [PASSES] [exact|fast] [ROWS]`
//! (ROWS activation rows per product, 1 by default; 128 times a prompt's projections)
//! prints the median wall time per step and the weights' bytes read per second, beside a
//! plain read of the same weights' memory (the same threads) timed in turn with it: the
//! step's fraction of the read roof at that moment (the machine's bandwidth moves).
//! Then the same for each weight format alone (a Q4_K_M file is Q4_K and Q6_K).

use llama_burn::Precision;
use llama_burn::kernels::{QuantMatrix, matmul_transposed_in};
use llama_burn::loader::gguf::GgufFile;

/// Nanoseconds every thread of this process has run (Linux's `schedstat`).
fn process_cpu_ns() -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: one_row_step FILE [PASSES] [exact|fast] [ROWS]")?;
    let passes: usize = args.next().map_or(Ok(20), |s| s.parse())?;
    let precision = match args.next().as_deref() {
        Some("exact") => Precision::Exact,
        _ => Precision::Fast,
    };
    // Activation rows per product: 1 is a decode step; 128 times a prompt's projections.
    let rows: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let gguf = GgufFile::open(&path)?;
    let get = |name: &str| -> Result<QuantMatrix, Box<dyn std::error::Error>> {
        Ok(QuantMatrix::from_gguf(&gguf, name)?.ok_or("not a kernel format")?)
    };
    let mut steps: Vec<QuantMatrix> = Vec::new();
    for layer in 0.. {
        let name = |s: &str| format!("blk.{layer}.{s}.weight");
        if gguf.tensor_info(&name("attn_q")).is_none() {
            break;
        }
        let (q, k) = (get(&name("attn_q"))?, get(&name("attn_k"))?);
        if q.format() == k.format() {
            steps.push(QuantMatrix::stack(&[q, k])?);
        } else {
            steps.extend([q, k]);
        }
        for s in ["attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"] {
            steps.push(get(&name(s))?);
        }
    }
    let head = if gguf.tensor_info("output.weight").is_some() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    steps.push(get(head)?);
    let bytes: usize = steps.iter().map(QuantMatrix::bytes).sum();
    let inputs: Vec<Vec<f32>> = steps
        .iter()
        .map(|w| {
            (0..w.cols() * rows)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                .collect()
        })
        .collect();
    let mut times = Vec::with_capacity(passes);
    let mut reads = Vec::with_capacity(passes);
    let mut cpu = Vec::with_capacity(passes);
    let mut sink = 0f32;
    let mut read_sink = 0u64;
    for _ in 0..passes + 2 {
        let (start, start_cpu) = (std::time::Instant::now(), process_cpu_ns());
        for (w, x) in steps.iter().zip(&inputs) {
            sink += matmul_transposed_in(precision, x, rows, w)?[0];
        }
        times.push(start.elapsed().as_secs_f64());
        cpu.push((process_cpu_ns() - start_cpu) as f64 * 1e-9);
        let start = std::time::Instant::now();
        for w in &steps {
            read_sink = read_sink.wrapping_add(read_all(w.held_bytes()));
        }
        reads.push(start.elapsed().as_secs_f64());
    }
    let mut reads = reads.split_off(2);
    reads.sort_by(f64::total_cmp);
    let read_median = reads[reads.len() / 2];
    let (mut times, mut cpu) = (times.split_off(2), cpu.split_off(2));
    times.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "plain read of the same weights ({} threads): median {:.2} ms, {:.1} GB/s; \
         the step reads at {:.0}% of it ({read_sink})",
        rayon::current_num_threads(),
        read_median * 1e3,
        bytes as f64 / read_median / 1e9,
        100.0 * read_median / median,
    );
    println!(
        "{} matrices, {:.0} MB: wall median {:.2} ms/step (min {:.2}), {:.1} GB/s; \
         CPU time (all threads) median {:.2} ms (min {:.2}) ({sink:.0})",
        steps.len(),
        bytes as f64 / 1e6,
        median * 1e3,
        times[0] * 1e3,
        bytes as f64 / median / 1e9,
        cpu[cpu.len() / 2] * 1e3,
        cpu[0] * 1e3,
    );
    // The same, format by format: which format's kernel is below the read.
    let mut formats: Vec<_> = steps.iter().map(QuantMatrix::format).collect();
    formats.dedup();
    formats.sort_by_key(|f| format!("{f:?}"));
    formats.dedup();
    for format in formats {
        let picked: Vec<usize> = (0..steps.len())
            .filter(|&i| steps[i].format() == format)
            .collect();
        let bytes: usize = picked.iter().map(|&i| steps[i].bytes()).sum();
        let (mut times, mut reads) = (Vec::new(), Vec::new());
        for _ in 0..passes + 2 {
            let start = std::time::Instant::now();
            for &i in &picked {
                sink += matmul_transposed_in(precision, &inputs[i], rows, &steps[i])?[0];
            }
            times.push(start.elapsed().as_secs_f64());
            let start = std::time::Instant::now();
            for &i in &picked {
                read_sink = read_sink.wrapping_add(read_all(steps[i].held_bytes()));
            }
            reads.push(start.elapsed().as_secs_f64());
        }
        let (mut times, mut reads) = (times.split_off(2), reads.split_off(2));
        times.sort_by(f64::total_cmp);
        reads.sort_by(f64::total_cmp);
        let (t, r) = (times[times.len() / 2], reads[reads.len() / 2]);
        println!(
            "{format:?}: {} matrices, {:.0} MB: {:.2} ms, {:.1} GB/s; read {:.2} ms: {:.0}% \
             ({sink:.0} {read_sink})",
            picked.len(),
            bytes as f64 / 1e6,
            t * 1e3,
            bytes as f64 / t / 1e9,
            r * 1e3,
            100.0 * r / t,
        );
    }
    Ok(())
}

/// Every byte of `bytes` read once, split between the threads.
fn read_all(bytes: &[u8]) -> u64 {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    bytes
        .par_chunks(bytes.len().div_ceil(threads).max(1))
        .map(|c| {
            let mut acc = [0u64; 8];
            for line in c.chunks_exact(64) {
                for (a, v) in acc.iter_mut().zip(line.chunks_exact(8)) {
                    let word = u64::from_le_bytes(v.try_into().unwrap_or_default());
                    *a = a.wrapping_add(word);
                }
            }
            acc.iter().fold(0u64, |s, v| s.wrapping_add(*v))
        })
        .sum()
}
