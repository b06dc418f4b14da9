//! The GPU-style code path, run: Burn's wgpu backend (the CubeCL kernels the GPU
//! backends share) on the demo model, against the CPU backend. On a machine without a
//! GPU it runs on Mesa's software Vulkan driver (Debian `mesa-vulkan-drivers`), slowly,
//! so the checks are few and short. Only with the `wgpu` feature.
#![cfg(feature = "wgpu")]

use burn::backend::{Flex, Wgpu};
use llama_burn::LlamaError;
use llama_burn::backend::LlamaBackend;
use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
use llama_burn::llama::{Llama, LlamaConfig};
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::{DynTokenizer, Tokenizer};

const PROMPTS: [&str; 3] = ["The capital of France is", "Hi", "def fibonacci(n):"];
const TOKENS: usize = 6;

fn demo<B: LlamaBackend>(device: &B::Device) -> Llama<B, DynTokenizer> {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    // Exact: the CPU backend's f32 arithmetic, which the wgpu backend's f32 matmul matches.
    LlamaConfig::load_gguf::<B>(path, 128, device)
        .expect("demo model loads")
        .with_precision(llama_burn::Precision::Exact)
}

fn greedy<B: LlamaBackend>(llama: &mut Llama<B, DynTokenizer>, prompt: &str) -> Vec<u32> {
    llama
        .generate(prompt, TOKENS, 0.0, &mut Sampler::Argmax)
        .expect("generate")
        .tokens
}

#[test]
fn wgpu_gives_the_cpu_backend_tokens_and_logits() {
    let mut cpu = demo::<Flex>(&Default::default());
    let mut gpu = demo::<Wgpu>(&Default::default());

    // Greedy tokens, prompt by prompt.
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|p| greedy(&mut cpu, p)).collect();
    for (prompt, want) in PROMPTS.iter().zip(&want) {
        assert_eq!(&greedy(&mut gpu, prompt), want, "{prompt:?}");
    }

    // Logits of a prompt within 1e-3.
    let ids = cpu.encode_prompt(PROMPTS[0]).expect("encode");
    let (a, b) = (
        cpu.logits(&ids).expect("cpu"),
        gpu.logits(&ids).expect("gpu"),
    );
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("wgpu vs cpu: max |logit diff| {diff:e}");
    assert!(diff <= 1e-3, "{diff}");

    // A left-padded batch of rows of different lengths equals the rows alone.
    let batch = llama_burn::inference::generate_batch(&mut gpu, &PROMPTS, TOKENS, 0.0, 1.0, 0)
        .expect("batch");
    for (row, want) in batch.iter().zip(&want) {
        let text: String = row.concat();
        assert_eq!(text, gpu.tokenizer.decode(want).expect("decode"));
    }

    // The continuous engine: two requests and a cancellation.
    let engine = ContinuousEngine::start(gpu, ContinuousConfig::default()).expect("engine");
    let cancelled = engine
        .submit(GenerateRequest::new(PROMPTS[2]).with_max_tokens(100))
        .expect("submit");
    cancelled.cancel();
    let jobs: Vec<_> = PROMPTS[..2]
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest::new(*p).with_max_tokens(TOKENS))
                .expect("submit")
        })
        .collect();
    for (job, want) in jobs.into_iter().zip(&want) {
        let (tokens, _) = job.collect().expect("engine request");
        let ids: Vec<u32> = tokens.iter().map(|t| t.token_id).collect();
        assert_eq!(&ids, want);
    }
    assert!(matches!(cancelled.collect(), Err(LlamaError::Cancelled)));
    let m = engine.metrics();
    assert_eq!((m.cancelled, m.completed, m.kv_blocks_used), (1, 2, 0));
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

#[test]
fn paged_attention_kernel_gives_the_cpu_reference() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::kernels::attention::{PagedPool, PagedSeq, paged_attention};
    use llama_burn::model::attention::PagedBatch;

    // Odd shapes: blocks of 5 positions, heads of 16 values (tiles of 16 keys), 4 query
    // heads over 2 key/value heads; block tables with holes (blocks no sequence uses) and
    // a prefix block (7) shared by two sequences; lengths not multiples of the block size,
    // decode rows, prompt chunks over cached keys and a fresh prompt.
    let (n_heads, kv_heads, block_size, dim, blocks) = (4, 2, 5, 16, 24);
    let tables: [&[u32]; 5] = [
        &[7, 2, 9],
        &[7, 3],
        &[11],
        &[20, 19, 18, 17, 16, 15, 14, 13, 12, 10],
        &[4],
    ];
    // (tokens, start) per sequence.
    let shapes = [(1, 13), (4, 6), (3, 0), (2, 46), (1, 0)];
    let seqs: Vec<PagedSeq> = shapes
        .iter()
        .zip(tables)
        .map(|(&(tokens, start), blocks)| PagedSeq {
            tokens,
            start,
            blocks,
        })
        .collect();
    let pool_len = blocks * kv_heads * block_size * dim;
    let (keys, vals) = (values(pool_len, 1), values(pool_len, 2));
    let tokens: usize = shapes.iter().map(|s| s.0).sum();
    let q = values(tokens * n_heads * dim, 3);
    let pool = PagedPool {
        keys: &keys,
        values: &vals,
        heads: kv_heads,
        block_size,
        dim,
    };
    let want = paged_attention(&q, n_heads, pool, &seqs).expect("cpu reference");

    let device = Default::default();
    let pool_dims = [blocks, kv_heads, block_size, dim];
    let k = Tensor::<Wgpu, 4>::from_data(TensorData::new(keys.clone(), pool_dims), &device);
    let v = Tensor::<Wgpu, 4>::from_data(TensorData::new(vals.clone(), pool_dims), &device);
    let run = |q: &[f32], seqs: Vec<PagedSeq>| -> Vec<f32> {
        let rows: usize = seqs.iter().map(|s| s.tokens).sum();
        let batch =
            PagedBatch::<Wgpu>::new(seqs, n_heads, block_size, blocks, &device).expect("batch");
        let q = Tensor::<Wgpu, 2>::from_data(
            TensorData::new(q.to_vec(), [rows, n_heads * dim]),
            &device,
        );
        Wgpu::paged_attention(q, &k, &v, &batch)
            .expect("wgpu paged attention")
            .into_data()
            .into_vec::<f32>()
            .expect("f32")
    };
    let got = run(&q, seqs.clone());
    let diff = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("paged attention kernel vs cpu: max |diff| {diff:e}");
    assert_eq!(got.len(), want.len());
    assert!(diff <= 1e-5, "{diff}");

    // Batch invariance: each sequence alone gives its rows of the batch, bitwise.
    let width = n_heads * dim;
    let mut first = 0;
    for seq in &seqs {
        let rows = first..first + seq.tokens;
        let alone = run(&q[rows.start * width..rows.end * width], vec![*seq]);
        assert_eq!(alone, got[rows.start * width..rows.end * width]);
        first = rows.end;
    }

    // A block outside the pool is an error, not a read out of bounds.
    let outside = [PagedSeq {
        tokens: 1,
        start: 0,
        blocks: &[blocks as u32],
    }];
    assert!(
        PagedBatch::<Wgpu>::new(outside.to_vec(), n_heads, block_size, blocks, &device).is_err()
    );
}

#[test]
fn quantized_matmul_kernels_give_the_cpu_reference() {
    use burn::tensor::{Tensor, TensorData};
    use llama_burn::Precision;
    use llama_burn::kernels::{QuantFormat, QuantMatrix};

    let device = Default::default();
    // Every kept format, all through the fused kernel. An odd number of outputs and of
    // blocks per row; one row (a unit per row), 5 rows (tiles of 4, the last one partial)
    // and 19 (tiles of 8, the last one partial).
    let multiply = |x: &[f32], rows: usize, w: &QuantMatrix| -> Vec<f32> {
        let xt =
            Tensor::<Wgpu, 2>::from_data(TensorData::new(x.to_vec(), [rows, w.cols()]), &device);
        Wgpu::quantized_matmul(xt, w, Precision::Exact)
            .expect("wgpu quantized matmul")
            .into_data()
            .into_vec::<f32>()
            .expect("f32")
    };
    for format in QuantFormat::ALL {
        let (n_out, cols) = (37, 3 * format.block_values());
        let w =
            QuantMatrix::quantize(format, n_out, cols, &values(n_out * cols, 4)).expect("quantize");
        let dense = w.dequantize().expect("dequantize");
        for rows in [1, 5, 19] {
            let x = values(rows * cols, 5 + rows as u64);
            let want: Vec<f32> = (0..rows * n_out)
                .map(|i| {
                    let (r, o) = (i / n_out, i % n_out);
                    (0..cols)
                        .map(|c| f64::from(x[r * cols + c]) * f64::from(dense[o * cols + c]))
                        .sum::<f64>() as f32
                })
                .collect();
            let got = multiply(&x, rows, &w);
            let diff = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert_eq!(got.len(), want.len());
            assert!(diff <= 1e-4, "{format:?}, {rows} rows: {diff}");
            // Batch invariance: each row alone gives the same bits as in its tile.
            if rows > 1 {
                for r in [0, rows / 2, rows - 1] {
                    let alone = multiply(&x[r * cols..(r + 1) * cols], 1, &w);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&alone),
                        bits(&got[r * n_out..(r + 1) * n_out]),
                        "{format:?}: row {r} of {rows} differs from the row alone"
                    );
                }
            }
        }
    }
    assert!(<Wgpu as LlamaBackend>::keeps_quantized_weights());
}

#[test]
fn dense_matmul_kernel_is_batch_invariant_and_gives_the_reference() {
    use burn::tensor::{Tensor, TensorData};

    // Dense weights (F32/F16/BF16 checkpoints) go through our kernel on the CubeCL
    // backends: Burn's matmul gives a row different bits in different batches. Both
    // layouts (`[in, out]` projections, the `[vocab, d]` output head), an odd shape, one
    // row (a unit per row), 5 (tiles of 4) and 19 (tiles of 8).
    let device = Default::default();
    let (n_out, cols) = (37, 67);
    let w = values(n_out * cols, 21);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for transposed in [false, true] {
        let dims = if transposed {
            [n_out, cols]
        } else {
            [cols, n_out]
        };
        let wt = Tensor::<Wgpu, 2>::from_data(TensorData::new(w.clone(), dims), &device);
        let weight = |o: usize, c: usize| {
            f64::from(if transposed {
                w[o * cols + c]
            } else {
                w[c * n_out + o]
            })
        };
        let multiply = |x: &[f32], rows: usize| -> Vec<f32> {
            let xt =
                Tensor::<Wgpu, 2>::from_data(TensorData::new(x.to_vec(), [rows, cols]), &device);
            Wgpu::dense_matmul(xt, &wt, transposed)
                .expect("wgpu dense matmul")
                .into_data()
                .into_vec::<f32>()
                .expect("f32")
        };
        for rows in [1, 5, 19] {
            let x = values(rows * cols, 30 + rows as u64);
            let got = multiply(&x, rows);
            assert_eq!(got.len(), rows * n_out);
            for (i, g) in got.iter().enumerate() {
                let (r, o) = (i / n_out, i % n_out);
                let want: f64 = (0..cols)
                    .map(|c| f64::from(x[r * cols + c]) * weight(o, c))
                    .sum();
                assert!(
                    (f64::from(*g) - want).abs() <= 1e-4,
                    "{transposed} {rows}: {g} {want}"
                );
            }
            for r in [0, rows / 2, rows - 1] {
                let alone = multiply(&x[r * cols..(r + 1) * cols], 1);
                assert_eq!(
                    bits(&alone),
                    bits(&got[r * n_out..(r + 1) * n_out]),
                    "transposed {transposed}: row {r} of {rows} differs from the row alone"
                );
            }
        }
        // A weight that does not take `x`'s columns is an error, not a panic.
        let wrong = Tensor::<Wgpu, 2>::from_data(
            TensorData::new(vec![0f32; 3 * cols + 3], [1, 3 * cols + 3]),
            &device,
        );
        assert!(Wgpu::dense_matmul(wrong, &wt, transposed).is_err());
    }
}

#[test]
fn device_argmax_gives_the_host_greedy_token() {
    use burn::tensor::{Tensor, TensorData};

    // An odd vocabulary (not a multiple of the kernel's 256 units), rows with ties (the
    // first index wins), minus and plus infinity, signed zeros, a NaN and a row of minus
    // infinity (no token: the host path's error).
    let vocab = 1037;
    let mut rows: Vec<Vec<f32>> = (0..4).map(|r| values(vocab, 40 + r)).collect();
    rows[1][700] = 5.0;
    rows[1][300] = 5.0;
    rows[1][1036] = 5.0;
    rows[2][10] = f32::NEG_INFINITY;
    rows[2][900] = f32::INFINITY;
    rows[2][901] = f32::INFINITY;
    rows[3].iter_mut().for_each(|v| *v = -v.abs() - 1e-3);
    rows[3][513] = -0.0;
    rows[3][257] = 0.0;
    let mut nan = values(vocab, 50);
    nan[600] = f32::NAN;
    rows.push(nan);
    rows.push(vec![f32::NEG_INFINITY; vocab]);
    rows.push(vec![-1.0; vocab]);
    let want: Vec<Option<u32>> = rows
        .iter()
        .map(|r| {
            llama_burn::sampling::check_logits(r)
                .ok()
                .map(|()| llama_burn::sampling::argmax(r))
        })
        .collect();
    assert_eq!(want[1], Some(300));
    assert_eq!(want[2], Some(900));
    assert_eq!(want[3], Some(257));
    assert_eq!(want[6], Some(0));
    assert_eq!((want[4], want[5]), (None, None));

    let n = rows.len();
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    let logits =
        Tensor::<Wgpu, 2>::from_data(TensorData::new(flat, [n, vocab]), &Default::default());
    let got = Wgpu::greedy_tokens(&logits)
        .expect("wgpu argmax")
        .expect("the CubeCL backends have a device argmax");
    assert_eq!(got, want);
}
