//! Our quantizers against ggml's reference: the 32-value formats through blocks that
//! gguf-py's quantizer wrote (`tests/fixtures/quantize_ggml.json`: random, zero,
//! constant, tie-prone and f16-subnormal blocks), the K-quants through blocks ggml's
//! own reference quantizers wrote (`tests/fixtures/quantize_kquant_ggml.json`).

use llama_burn::kernels::{QuantFormat, QuantMatrix};
use llama_burn::loader::quantize::{QUANTIZERS, quantize};

#[test]
fn the_32_value_quantizers_write_gguf_py_s_bytes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quantize_ggml.json"
    ))
    .expect("fixture");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("json");
    let values: Vec<f32> = fixture["values"]
        .as_array()
        .expect("values")
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect();
    for format in QUANTIZERS.into_iter().filter(|f| f.block_values() == 32) {
        let hex = fixture["quantized"][format!("{format:?}")]
            .as_str()
            .expect("the fixture has every quantizer's bytes");
        let want: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect();
        let got = quantize(format, &values).expect("quantize");
        assert_eq!(got.len(), want.len(), "{format:?}");
        for (b, (g, w)) in got
            .chunks(format.block_bytes())
            .zip(want.chunks(format.block_bytes()))
            .enumerate()
        {
            assert_eq!(g, w, "{format:?} block {b}");
        }
        let rows = fixture["rows"].as_u64().expect("rows") as usize;
        let m = QuantMatrix::quantize(format, rows, 32, &values).expect("matrix");
        assert_eq!(m.to_ggml_bytes(), want, "{format:?} matrix");
    }
}

/// The K-quant fixture: ggml's own blocks (`make_kquant_fixture.py`).
fn kquant_fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quantize_kquant_ggml.json"
    ))
    .expect("fixture");
    serde_json::from_str(&text).expect("json")
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

fn rmse(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    (sum / a.len() as f64).sqrt()
}

const K_QUANTS: [QuantFormat; 4] = [
    QuantFormat::Q3_K,
    QuantFormat::Q4_K,
    QuantFormat::Q5_K,
    QuantFormat::Q6_K,
];

/// Our K-quant blocks are ggml's reference blocks, byte for byte, on rows chosen to
/// reach every branch (zero, constant, tiny, one-signed, outlier, tie-prone groups);
/// and so their error against the f32 values is ggml's: the root-mean-square error of
/// our dequantized blocks is at most that of ggml's (the bound the issue sets for a
/// K-quant that is not byte-exact, checked here independently of the bytes).
#[test]
fn the_k_quant_quantizers_write_ggml_s_blocks() {
    let fixture = kquant_fixture();
    let values: Vec<f32> = fixture["values"]
        .as_array()
        .expect("values")
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect();
    let rows = fixture["rows"].as_u64().expect("rows") as usize;
    let cols = fixture["cols"].as_u64().expect("cols") as usize;
    assert_eq!(values.len(), rows * cols);
    for format in K_QUANTS {
        let want = hex_bytes(
            fixture["quantized"][format!("{format:?}")]
                .as_str()
                .expect("the fixture has every K-quant's blocks"),
        );
        let got = quantize(format, &values).expect("quantize");
        assert_eq!(got.len(), want.len(), "{format:?}");
        let ours = QuantMatrix::new(format, rows, cols, got.clone())
            .expect("our blocks")
            .dequantize()
            .expect("dequantize ours");
        let ggml = QuantMatrix::new(format, rows, cols, want.clone())
            .expect("ggml's blocks")
            .dequantize()
            .expect("dequantize ggml's");
        let (r_ours, r_ggml) = (rmse(&values, &ours), rmse(&values, &ggml));
        assert!(
            r_ours <= r_ggml,
            "{format:?}: our RMSE {r_ours:e} exceeds ggml's {r_ggml:e}"
        );
        for (b, (g, w)) in got
            .chunks(format.block_bytes())
            .zip(want.chunks(format.block_bytes()))
            .enumerate()
        {
            assert_eq!(g, w, "{format:?} block {b}");
        }
    }
}

/// The K-quants' error on Gaussian weights is what their bits allow: each within a
/// fraction of the weights' spread, and ordered by bits (more bits, less error).
#[test]
fn k_quant_errors_shrink_with_bits() {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f64 / (1u64 << 24) as f64
    };
    // Box-Muller: 64 rows of 256 N(0, 1) values.
    let values: Vec<f32> = (0..64 * 256)
        .map(|_| {
            let (u, v) = (uniform().max(1e-12), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect();
    let mut last = f64::INFINITY;
    for (format, bound) in [
        (QuantFormat::Q3_K, 0.25),
        (QuantFormat::Q4_K, 0.12),
        (QuantFormat::Q5_K, 0.06),
        (QuantFormat::Q6_K, 0.03),
    ] {
        let back = QuantMatrix::quantize(format, 64, 256, &values)
            .expect("quantize")
            .dequantize()
            .expect("dequantize");
        let r = rmse(&values, &back);
        assert!(r < bound && r < last, "{format:?}: RMSE {r}");
        last = r;
    }
}

/// A Q8_0 load of a safetensors checkpoint, quantized in memory by our quantizer, is the
/// Q8_0 GGUF that llama.cpp's `llama-quantize` wrote from the same checkpoint
/// (`tests/fixtures/tiny_q8_0`, made by `make_q8_0_fixture.py`: a tiny random Llama,
/// its F32 GGUF in llama.cpp's layout, query/key rows permuted, then `llama-quantize
/// ... 7`): every matrix's blocks are the same bytes, and the two models' logits at
/// every position are bitwise equal, in both precisions.
#[test]
fn a_q8_0_load_of_a_checkpoint_is_llama_quantize_s_q8_0_file() {
    use llama_burn::backend::default_device;
    use llama_burn::config::LlamaConfig;
    use llama_burn::loader::gguf::GgufFile;
    use llama_burn::loader::quantize::QuantizingSource;
    use llama_burn::loader::safetensors::SafetensorsSource;
    use llama_burn::loader::{GgufSource, TensorSource, build_transformer};
    use llama_burn::model::Logits;

    type B = llama_burn::backend::DefaultBackend;
    let dir = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_q8_0"
    ));
    let json = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let mut config = LlamaConfig::from_hf_json(&json).expect("config");
    let gguf = GgufFile::open(dir.join("model.Q8_0.gguf")).expect("gguf");
    let from_gguf = LlamaConfig::from_gguf(&gguf).expect("gguf config");
    assert_eq!(
        (from_gguf.n_layers, from_gguf.d_model, from_gguf.vocab_size),
        (config.n_layers, config.d_model, config.vocab_size)
    );
    // The GGUF holds epsilon as f32; the models use the same value.
    config.norm_eps = from_gguf.norm_eps;

    let mut safetensors = SafetensorsSource::open_dir(dir).expect("safetensors");
    let mut ours = QuantizingSource::new(&mut safetensors, QuantFormat::Q8_0).expect("source");
    let mut theirs = GgufSource::new(&gguf, &config);
    let mut names = vec!["model.embed_tokens.weight".to_string()];
    for layer in 0..config.n_layers {
        for m in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            names.push(format!("model.layers.{layer}.{m}.weight"));
        }
    }
    for name in &names {
        let a = ours.read_quantized(name).expect("ours").expect("quantized");
        let b = theirs
            .read_quantized(name)
            .expect("theirs")
            .expect("Q8_0 in the file");
        assert_eq!(b.format(), QuantFormat::Q8_0, "{name}");
        assert!(
            a.to_ggml_bytes() == b.to_ggml_bytes(),
            "{name}: blocks differ"
        );
    }

    let ids: Vec<u32> = vec![1, 200, 17, 45, 255, 3, 99, 128, 7, 64, 31];
    let device = default_device();
    for precision in [llama_burn::Precision::Exact, llama_burn::Precision::Fast] {
        let c = config.clone().with_precision(precision);
        let mut safetensors = SafetensorsSource::open_dir(dir).expect("safetensors");
        let mut ours = QuantizingSource::new(&mut safetensors, QuantFormat::Q8_0).expect("src");
        let mut theirs = GgufSource::new(&gguf, &c);
        let logits = |source: &mut dyn TensorSource| -> Vec<f32> {
            let model = build_transformer::<B>(&c, source, &device, &mut |_, _| {}).expect("model");
            let mut cache = model.new_cache(vec![0], ids.len());
            model
                .forward(&ids, &mut cache, Logits::All)
                .expect("forward")
                .into_data()
                .to_vec::<f32>()
                .expect("logits")
        };
        let (a, b) = (logits(&mut ours), logits(&mut theirs));
        assert_eq!(a.len(), ids.len() * config.vocab_size);
        assert!(a.iter().any(|&v| v != 0.0));
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{precision:?}: the logits differ");
    }
}
