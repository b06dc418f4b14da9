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
    let passes: usize = args.next().map_or(Ok(20), |s| s.parse::<usize>())?.max(1);
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
    let (mut sink, mut read_sink) = (0f32, 0u64);
    let all: Vec<usize> = (0..steps.len()).collect();
    let mut run = |picked: &[usize]| {
        time_steps(
            &steps,
            &inputs,
            picked,
            precision,
            rows,
            passes,
            &mut sink,
            &mut read_sink,
        )
    };
    let step = run(&all)?;
    let (median, read_median) = (median_of(&step.times), median_of(&step.reads));
    println!(
        "plain read of the same weights ({} threads): median {:.2} ms, {:.1} GB/s; \
         the step reads at {:.0}% of it",
        rayon::current_num_threads(),
        read_median * 1e3,
        bytes as f64 / read_median / 1e9,
        100.0 * read_median / median,
    );
    println!(
        "{} matrices, {:.0} MB: wall median {:.2} ms/step (min {:.2}), {:.1} GB/s; \
         CPU time (all threads) median {:.2} ms (min {:.2})",
        steps.len(),
        bytes as f64 / 1e6,
        median * 1e3,
        step.times[0] * 1e3,
        bytes as f64 / median / 1e9,
        median_of(&step.cpu) * 1e3,
        step.cpu[0] * 1e3,
    );
    // The same, format by format: which format's kernel is below the read.
    let mut formats: Vec<_> = steps.iter().map(QuantMatrix::format).collect();
    formats.sort_by_key(|f| format!("{f:?}"));
    formats.dedup();
    for format in formats {
        let picked: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| steps[i].format() == format)
            .collect();
        let bytes: usize = picked.iter().map(|&i| steps[i].bytes()).sum();
        let timed = run(&picked)?;
        let (t, r) = (median_of(&timed.times), median_of(&timed.reads));
        println!(
            "{format:?}: {} matrices, {:.0} MB: {:.2} ms, {:.1} GB/s; read {:.2} ms: {:.0}%",
            picked.len(),
            bytes as f64 / 1e6,
            t * 1e3,
            bytes as f64 / t / 1e9,
            r * 1e3,
            100.0 * r / t,
        );
    }
    // Printed so that no product or read can be optimized away.
    println!("({sink:.0} {read_sink})");
    Ok(())
}

/// Seconds per pass, each sorted, of [`time_steps`]'s passes.
struct Timings {
    /// Wall time of the products.
    times: Vec<f64>,
    /// CPU time of the products, all threads.
    cpu: Vec<f64>,
    /// Wall time of the plain read that followed each pass's products.
    reads: Vec<f64>,
}

/// Times `passes` passes (after two to warm up) of the `picked` matrices' products, each
/// pass followed by a plain read of the same matrices' bytes, in turn.
#[allow(clippy::too_many_arguments)]
fn time_steps(
    steps: &[QuantMatrix],
    inputs: &[Vec<f32>],
    picked: &[usize],
    precision: Precision,
    rows: usize,
    passes: usize,
    sink: &mut f32,
    read_sink: &mut u64,
) -> Result<Timings, Box<dyn std::error::Error>> {
    let (mut times, mut cpu, mut reads) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..passes + 2 {
        let (start, start_cpu) = (std::time::Instant::now(), process_cpu_ns());
        for &i in picked {
            *sink += matmul_transposed_in(precision, &inputs[i], rows, &steps[i])?[0];
        }
        times.push(start.elapsed().as_secs_f64());
        cpu.push((process_cpu_ns() - start_cpu) as f64 * 1e-9);
        let start = std::time::Instant::now();
        for &i in picked {
            *read_sink = read_sink.wrapping_add(read_all(steps[i].held_bytes()));
        }
        reads.push(start.elapsed().as_secs_f64());
    }
    let sorted = |mut v: Vec<f64>| {
        let mut v = v.split_off(2);
        v.sort_by(f64::total_cmp);
        v
    };
    Ok(Timings {
        times: sorted(times),
        cpu: sorted(cpu),
        reads: sorted(reads),
    })
}

/// The middle value of sorted `values`.
fn median_of(values: &[f64]) -> f64 {
    values[values.len() / 2]
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
