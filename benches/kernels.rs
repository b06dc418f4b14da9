//! Criterion benchmarks of the CPU kernels alone: on the demo model's real tensors, one
//! projection of each shape the model runs, at 1, 32 and 128 rows, on every SIMD path
//! this CPU supports; and at Llama 3.2 1B's and Llama 3.1 8B's feed-forward shapes, every
//! kept format in both precisions (`real_sizes`) on the active path. Run with
//! `cargo bench --bench kernels` (or `-- real_sizes/1b` for one group).
//!
//! With `LLAMA_BURN_BENCH_CPU_TIME=1`, `real_sizes` reports the CPU time all of the
//! process's threads spent (from `/proc/self/task/*/schedstat`) instead of wall time: a
//! kernel's cost that holds while other work shares the cores.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use llama_burn::kernels::{
    QuantFormat, QuantMatrix, SimdPath, matmul_transposed_int8_on, matmul_transposed_on,
};
use llama_burn::loader::gguf::GgufFile;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// A matrix of random but valid blocks (finite f16 scales): speed does not depend on the
/// values.
fn random_matrix(format: QuantFormat, rows: usize, cols: usize) -> QuantMatrix {
    let mut rng = StdRng::seed_from_u64(1);
    let blocks = rows * cols / format.block_values();
    let mut data = vec![0u8; blocks * format.block_bytes()];
    rng.fill(&mut data[..]);
    let scales: &[usize] = match format {
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => &[0],
        QuantFormat::Q6_K => &[208],
        QuantFormat::Q3_K => &[108],
        _ => &[0, 2],
    };
    for block in data.chunks_exact_mut(format.block_bytes()) {
        for &i in scales {
            let v = half::f16::from_f32(rng.random_range(-0.01f32..0.01));
            block[i..i + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    QuantMatrix::new(format, rows, cols, data).expect("valid blocks")
}

/// Nanoseconds every thread of this process has run, or `None` where Linux's
/// `schedstat` is not readable.
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// Times `f`: wall time, or the process's CPU time where `LLAMA_BURN_BENCH_CPU_TIME` is
/// set (and readable).
fn time<R>(b: &mut criterion::Bencher, mut f: impl FnMut() -> R) {
    if std::env::var_os("LLAMA_BURN_BENCH_CPU_TIME").is_some() && process_cpu_ns().is_some() {
        b.iter_custom(|iters| {
            let start = process_cpu_ns().unwrap_or(0);
            for _ in 0..iters {
                std::hint::black_box(f());
            }
            std::time::Duration::from_nanos(process_cpu_ns().unwrap_or(0).saturating_sub(start))
        });
    } else {
        b.iter(f);
    }
}

/// The feed-forward up projection (`[ffn, d]`) of the 1B and 8B shapes, every format,
/// `exact` and `fast`, at 1, 16 and 128 rows.
fn real_sizes(c: &mut Criterion) {
    let simd = SimdPath::active();
    for (shape, d, ffn) in [("1b", 2048, 8192), ("8b", 4096, 14336)] {
        for format in QuantFormat::ALL {
            let w = random_matrix(format, ffn, d);
            let mut group = c.benchmark_group(format!("real_sizes/{shape}_{format:?}"));
            group.sample_size(10);
            for rows in [1usize, 16, 32, 128] {
                let x: Vec<f32> = (0..rows * d)
                    .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                    .collect();
                group.throughput(Throughput::Elements((rows * ffn * d) as u64));
                group.bench_with_input(BenchmarkId::new("exact", rows), &rows, |b, &rows| {
                    time(b, || {
                        matmul_transposed_on(simd, &x, rows, &w).expect("matmul")
                    })
                });
                group.bench_with_input(BenchmarkId::new("fast", rows), &rows, |b, &rows| {
                    time(b, || {
                        matmul_transposed_int8_on(simd, &x, rows, &w).expect("matmul")
                    })
                });
            }
            group.finish();
        }
    }
}

fn matrix(gguf: &GgufFile, name: &str) -> QuantMatrix {
    QuantMatrix::from_gguf(gguf, name)
        .expect("tensor")
        .expect("a kernel format")
}

fn benches(c: &mut Criterion) {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let gguf = GgufFile::open(path).expect("open");
    let tensors = [
        ("ffn_up_q4_1", matrix(&gguf, "blk.0.ffn_up.weight")),
        ("ffn_down_q4_1", matrix(&gguf, "blk.0.ffn_down.weight")),
        ("head_q8_0", matrix(&gguf, "token_embd.weight")),
    ];
    for (name, w) in &tensors {
        let mut group = c.benchmark_group(format!("matmul_{name}"));
        group.sample_size(10);
        for rows in [1usize, 32, 128] {
            if *name == "head_q8_0" && rows == 128 {
                continue;
            }
            let x: Vec<f32> = (0..rows * w.cols())
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                .collect();
            group.throughput(Throughput::Elements((rows * w.rows() * w.cols()) as u64));
            for simd in SimdPath::ALL.into_iter().filter(|p| p.is_supported()) {
                group.bench_with_input(
                    BenchmarkId::new(simd.env_name(), rows),
                    &rows,
                    |b, &rows| b.iter(|| matmul_transposed_on(simd, &x, rows, w).expect("matmul")),
                );
            }
        }
        group.finish();
    }
}

/// Benchmarks `chains(t)` run on every thread `t` of rayon's pool at once, each doing
/// `per_thread` operations (the throughput is their total); the results are kept, so the
/// chains cannot be optimized away.
#[cfg(target_arch = "x86_64")]
fn on_every_thread<R: Send>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    per_thread: usize,
    chains: impl Fn(usize) -> R + Sync,
) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads();
    group.throughput(Throughput::Elements((threads * per_thread) as u64));
    group.bench_function(name, |b| {
        b.iter(|| {
            (0..threads)
                .into_par_iter()
                .for_each(|t| drop(std::hint::black_box(chains(t))))
        })
    });
}

/// The machine's roof, on every core at once (rayon): f32 fused multiply-adds and 8-bit
/// integer dot products (`vpdpbusd`, 4 multiply-adds per lane; on AVX2 `vpmaddubsw`) from
/// registers, in independent chains, and a plain read of 1 GiB. Each kernel's figure is
/// then a fraction of these (docs/src/cpu-kernels.md).
#[cfg(target_arch = "x86_64")]
fn roof(c: &mut Criterion) {
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    const STEPS: usize = 1 << 20;
    let threads = rayon::current_num_threads();
    let mut group = c.benchmark_group("roof");
    group.sample_size(10);
    if SimdPath::active() == SimdPath::Avx512 {
        #[target_feature(enable = "avx512f,fma")]
        fn fma_chains(seed: f32) -> f32 {
            let mut acc = [_mm512_set1_ps(seed); 12];
            let (a, b) = (_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3));
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, a, b);
                }
            }
            acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        // 12 chains x 16 lanes per step.
        on_every_thread(&mut group, "f32_fma_multiply_adds", STEPS * 12 * 16, |t| {
            // SAFETY: the active path is AVX-512, which this CPU has (with FMA).
            unsafe { fma_chains(t as f32) }
        });
        if std::arch::is_x86_feature_detected!("avx512vnni") {
            #[target_feature(enable = "avx512f,avx512vnni")]
            fn dot_chains(seed: i32) -> i32 {
                let mut acc = [_mm512_set1_epi32(seed); 12];
                let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
                for _ in 0..STEPS {
                    for v in acc.iter_mut() {
                        *v = _mm512_dpbusd_epi32(*v, a, b);
                    }
                }
                acc.iter().map(|v| _mm512_reduce_add_epi32(*v)).sum()
            }
            // 12 chains x 16 lanes x 4 byte products per step.
            on_every_thread(&mut group, "int8_dot_multiply_adds", STEPS * 12 * 64, |t| {
                // SAFETY: the CPU has AVX-512 VNNI (checked above).
                unsafe { dot_chains(t as i32) }
            });
        }
    }
    if SimdPath::active() == SimdPath::Avx2 {
        #[target_feature(enable = "avx2,fma")]
        fn fma_chains(seed: f32) -> f32 {
            let mut acc = [_mm256_set1_ps(seed); 12];
            let (a, b) = (_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3));
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, a, b);
                }
            }
            let mut out = [0f32; 8];
            let sum = acc
                .iter()
                .fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v));
            // SAFETY: `out` holds eight floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
            out.iter().sum()
        }
        // 12 chains x 8 lanes per step.
        on_every_thread(&mut group, "f32_fma_multiply_adds", STEPS * 12 * 8, |t| {
            // SAFETY: the active path is AVX2, which this CPU has (with FMA).
            unsafe { fma_chains(t as f32) }
        });
        // AVX2 has no byte dot product into 32 bits: `vpmaddubsw` is its only instruction
        // that multiplies bytes (32 byte products, summed in pairs into 16 bits). Its
        // rate is the int8 roof; a full dot product also spends `vpmaddwd` and `vpaddd`
        // (or, for small enough values, `vpaddw`) on widening and adding the pairs.
        #[target_feature(enable = "avx2")]
        fn maddubs_chains(seed: i32) -> i32 {
            let mut acc = [_mm256_set1_epi32(seed); 12];
            let b = _mm256_set1_epi8(1);
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    // Small values: the pairs never saturate, the chain stays a chain.
                    *v = _mm256_maddubs_epi16(*v, b);
                }
            }
            let sum = acc
                .iter()
                .fold(_mm256_setzero_si256(), |s, v| _mm256_add_epi16(s, *v));
            _mm256_extract_epi32::<0>(sum)
        }
        // 12 chains x 32 byte products per step.
        on_every_thread(&mut group, "int8_dot_multiply_adds", STEPS * 12 * 32, |t| {
            // SAFETY: the active path is AVX2, which this CPU has.
            unsafe { maddubs_chains(t as i32) }
        });
    }
    let data = vec![1u64; (1 << 30) / 8];
    group.throughput(Throughput::Bytes((data.len() * 8) as u64));
    group.bench_function("read_bytes", |b| {
        b.iter(|| {
            data.par_chunks(data.len() / threads)
                .map(|c| c.iter().fold(0u64, |s, &v| s.wrapping_add(v)))
                .sum::<u64>()
        })
    });
    group.finish();
}

#[cfg(not(target_arch = "x86_64"))]
fn roof(_: &mut Criterion) {}

criterion_group!(kernels, benches, real_sizes, roof);
criterion_main!(kernels);
