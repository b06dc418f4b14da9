//! Criterion benchmarks on the demo model (CPU backend): one decode step at several batch
//! sizes, prompt processing, and embeddings of 128-token inputs (1 and 32 at once, and 32
//! one at a time). Run with `cargo bench --bench decode`.

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

    // Embeddings: inputs of 128 tokens, one call for all of them (left-padded groups)
    // and, for 32, one call per input.
    let mut group = c.benchmark_group("embed_128_tokens");
    group.sample_size(10);
    let options = llama_burn::embed::EmbeddingOptions::default();
    let input = |i: usize| -> Vec<u32> {
        prompt
            .iter()
            .copied()
            .cycle()
            .skip(i % prompt.len())
            .take(128)
            .collect()
    };
    for inputs in [1usize, 32] {
        group.throughput(Throughput::Elements(inputs as u64));
        group.bench_with_input(BenchmarkId::new("batched", inputs), &inputs, |b, &n| {
            b.iter(|| {
                llama
                    .embed_ids((0..n).map(input).collect(), &options)
                    .expect("embed")
            })
        });
    }
    group.throughput(Throughput::Elements(32));
    group.bench_function("one_at_a_time/32", |b| {
        b.iter(|| {
            for i in 0..32 {
                llama.embed_ids(vec![input(i)], &options).expect("embed");
            }
        })
    });
    group.finish();
}

criterion_group!(decode, benches);
criterion_main!(decode);
