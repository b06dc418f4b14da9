//! Criterion benchmarks of the CPU kernels alone, on the demo model's real tensors: one
//! projection of each shape the model runs, at 1, 32 and 128 rows, on every SIMD path
//! this CPU supports. Run with `cargo bench --bench kernels`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use llama_burn::kernels::{QuantMatrix, SimdPath, matmul_transposed_on};
use llama_burn::loader::gguf::GgufFile;

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

criterion_group!(kernels, benches);
criterion_main!(kernels);
