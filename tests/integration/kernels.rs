//! The CPU kernels on real tensors: the GGUF fixture's (written by gguf-py) and the demo
//! model's, against dequantize-then-f32-matmul, on every SIMD path this CPU runs.

use burn::tensor::{Tensor, TensorData};
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::kernels::cpu::dot_reference_on;
use llama_burn::kernels::{QuantMatrix, SimdPath, matmul_transposed_on};
use llama_burn::loader::gguf::GgufFile;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dequant.gguf");

fn matrix(gguf: &GgufFile, name: &str) -> QuantMatrix {
    QuantMatrix::from_gguf(gguf, name)
        .expect("tensor")
        .expect("a kernel format")
}

/// Deterministic activations in [-1, 1).
fn activations(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn check(m: &QuantMatrix, row_counts: &[usize]) {
    let (n_out, n_in) = (m.rows(), m.cols());
    let dense = m.dequantize().unwrap();
    let device = default_device();
    let w = Tensor::<DefaultBackend, 2>::from_data(
        TensorData::new(dense.clone(), [n_out, n_in]),
        &device,
    );
    for &rows in row_counts {
        let x = activations(rows * n_in, rows as u32);
        let xt = Tensor::<DefaultBackend, 2>::from_data(
            TensorData::new(x.clone(), [rows, n_in]),
            &device,
        );
        let burn: Vec<f32> = xt
            .matmul(w.clone().transpose())
            .into_data()
            .to_vec()
            .unwrap();
        for path in SimdPath::ALL {
            if !path.is_supported() {
                continue;
            }
            let got = matmul_transposed_on(path, &x, rows, m).unwrap();
            for r in 0..rows {
                for j in 0..n_out {
                    let (wr, xr) = (
                        &dense[j * n_in..(j + 1) * n_in],
                        &x[r * n_in..(r + 1) * n_in],
                    );
                    // The same reduction order: equal to the last bit.
                    let same_order = dot_reference_on(path, wr, xr);
                    let g = got[r * n_out + j];
                    assert_eq!(
                        g.to_bits(),
                        same_order.to_bits(),
                        "{:?} {path:?}",
                        m.format()
                    );
                    // Burn's matmul sums in another order: within 1e-5 of the terms' size.
                    let scale: f32 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                    let b = burn[r * n_out + j];
                    assert!(
                        (g - b).abs() <= 1e-5 * scale.max(f32::MIN_POSITIVE),
                        "{:?} {path:?}: {g} vs {b}",
                        m.format()
                    );
                }
            }
        }
    }
}

#[test]
fn fixture_tensors_of_every_kernel_format() {
    let gguf = GgufFile::open(FIXTURE).unwrap();
    for name in ["t.q8_0", "t.q4_0", "t.q4_1", "t.q4_k", "t.q6_k"] {
        check(&matrix(&gguf, name), &[1, 3, 4, 8, 33, 128]);
    }
}

#[test]
fn demo_model_tensors() {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let gguf = GgufFile::open(path).unwrap();
    // A Q4_1 projection and 37 rows of the Q8_0 embedding (real scales and values).
    check(&matrix(&gguf, "blk.0.ffn_down.weight"), &[1, 3, 33]);
    let embed = matrix(&gguf, "token_embd.weight");
    let rows: Vec<usize> = (0..37).map(|i| i * 1009).collect();
    let bytes: Vec<u8> = rows
        .iter()
        .flat_map(|&r| embed.row_ggml_bytes(r).unwrap())
        .collect();
    let part = QuantMatrix::new(embed.format(), rows.len(), embed.cols(), bytes).unwrap();
    check(&part, &[1, 8, 128]);
}

#[test]
fn the_demo_model_keeps_its_blocks_in_memory() {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let llama = llama_burn::Loader::gguf(path)
        .max_seq_len(256)
        .load::<DefaultBackend>(&default_device())
        .expect("load");
    let c = llama.config();
    // The Q8_0 embedding (34 bytes per 32 values), tied to the head and counted once;
    // every projection in Q4_1 (20 bytes per 32); the norms in f32.
    let embed = c.vocab_size * c.d_model / 32 * 34;
    let kv = c.n_kv_heads * c.head_dim;
    let per_layer =
        c.d_model * (c.d_model + 2 * kv) + c.d_model * c.d_model + 3 * c.d_model * c.ffn_hidden;
    let projections = c.n_layers * per_layer / 32 * 20;
    let norms = (2 * c.n_layers + 1) * c.d_model * 4;
    assert!(c.tie_embeddings);
    assert_eq!(llama.model.weight_bytes(), embed + projections + norms);
    assert!(
        llama
            .model
            .blocks
            .iter()
            .all(|b| b.w_down.is_quantized() && b.wqkv.is_quantized())
    );
}
