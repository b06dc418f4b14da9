//! Criterion benchmark of the sampling pipeline: one step of 32 rows of Llama 3's
//! 128,256 logits, greedy against temperature 1 (alone and with top-p, top-k, min-p),
//! penalties with logit bias, and log-probabilities, each serial and in parallel.
//! Run with `cargo bench --bench sampling`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use llama_burn::sampling::{History, Pipeline, SamplingParams, for_each_row, token_logprobs};
use rand::{Rng, SeedableRng, rngs::StdRng};

const ROWS: usize = 32;
const VOCAB: usize = 128_256;

fn benches(c: &mut Criterion) {
    // Logits shaped like a model's: most tokens far below a few likely ones.
    let mut rng = StdRng::seed_from_u64(1);
    let logits: Vec<f32> = (0..ROWS * VOCAB)
        .map(|_| {
            let u: f32 = rng.random::<f32>();
            -8.0 + 10.0 * u.powi(6) + rng.random::<f32>()
        })
        .collect();
    let history: Vec<u32> = (0..300).map(|i| (i * 401) % VOCAB as u32).collect();
    let settings: [(&str, SamplingParams); 7] = [
        ("greedy", SamplingParams::greedy()),
        ("temperature_1", SamplingParams::default()),
        (
            "top_p_0.9",
            SamplingParams {
                top_p: 0.9,
                ..Default::default()
            },
        ),
        (
            "top_k_40",
            SamplingParams {
                top_k: 40,
                ..Default::default()
            },
        ),
        (
            "min_p_0.05",
            SamplingParams {
                min_p: 0.05,
                ..Default::default()
            },
        ),
        (
            "all_controls",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.95,
                min_p: 0.02,
                repetition_penalty: 1.1,
                frequency_penalty: 0.3,
                presence_penalty: 0.2,
                logit_bias: vec![(13, 5.0), (42, -100.0)],
            },
        ),
        ("temperature_1_logprobs_5", SamplingParams::default()),
    ];
    let mut group = c.benchmark_group("sample_32x128256");
    group.sample_size(20);
    group.throughput(Throughput::Elements(ROWS as u64));
    for (name, params) in settings {
        let logprobs = name.ends_with("logprobs_5");
        let mut rows: Vec<(Pipeline, &[f32])> = logits
            .chunks(VOCAB)
            .enumerate()
            .map(|(i, l)| (Pipeline::new(params.clone(), i as u64).expect("params"), l))
            .collect();
        let step = |(pipeline, row): &mut (Pipeline, &[f32])| {
            let history = History {
                prompt: &history,
                output: &history[..50],
                banned: &[],
            };
            let token = pipeline.sample(row, history).expect("sample");
            if logprobs {
                token_logprobs(row, token, 5).expect("logprobs");
            }
            token
        };
        group.bench_function(BenchmarkId::new("serial", name), |b| {
            b.iter(|| rows.iter_mut().map(step).collect::<Vec<u32>>())
        });
        group.bench_function(BenchmarkId::new("parallel", name), |b| {
            b.iter(|| for_each_row(&mut rows, step))
        });
    }
    group.finish();
}

criterion_group!(sampling, benches);
criterion_main!(sampling);
