//! Criterion benchmarks on the demo model (CPU backend): one decode step at several batch
//! sizes, and prompt processing. Run with `cargo bench`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::model::Logits;

fn benches(c: &mut Criterion) {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let llama = llama_burn::Loader::gguf(path)
        .max_seq_len(1024)
        .load::<DefaultBackend>(&default_device())
        .expect("load");
    let prompt = llama
        .encode_prompt("The capital of France is")
        .expect("encode");

    let mut group = c.benchmark_group("decode_step");
    group.sample_size(10);
    for rows in [1usize, 4, 16, 32] {
        group.throughput(Throughput::Elements(rows as u64));
        group.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            let tokens: Vec<u32> = prompt
                .iter()
                .copied()
                .cycle()
                .take(prompt.len() * rows)
                .collect();
            b.iter_batched(
                || {
                    let mut cache = llama.model.new_cache(vec![0; rows], prompt.len() + 2);
                    llama
                        .model
                        .forward(&tokens, &mut cache, Logits::Last)
                        .expect("prefill");
                    cache
                },
                |mut cache| {
                    llama
                        .model
                        .forward(&vec![28; rows], &mut cache, Logits::Last)
                        .expect("step")
                },
                criterion::BatchSize::LargeInput,
            );
        });
    }
    group.finish();

    let mut group = c.benchmark_group("prefill");
    group.sample_size(10);
    let long: Vec<u32> = prompt.iter().copied().cycle().take(128).collect();
    group.throughput(Throughput::Elements(long.len() as u64));
    group.bench_function("128_tokens", |b| {
        b.iter(|| {
            let mut cache = llama.model.new_cache(vec![0], long.len());
            llama
                .model
                .forward(&long, &mut cache, Logits::Last)
                .expect("prefill")
        })
    });
    group.finish();
}

criterion_group!(decode, benches);
criterion_main!(decode);
