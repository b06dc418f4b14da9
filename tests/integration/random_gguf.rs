//! A random-weight GGUF written by `loader::random` (through the GGUF writer) reads
//! back with the crate's own GGUF loader: the metadata, every tensor's name, dims and
//! type against a table written here from llama.cpp's conventions, every tensor's values
//! (dequantized by the crate's dequantizer, which `gguf_format` checks against ggml's
//! own fixtures) against the documented random values within the type's rounding error
//! and against N(0, 0.02²), and a model that generates.

use std::collections::BTreeMap;

use crate::common::B;
use llama_burn::backend::default_device;
use llama_burn::config::LlamaConfig;
use llama_burn::loader::gguf::{GgufFile, GgufValue};
use llama_burn::loader::random::{
    WeightTypes, metadata, random_config, random_row, tokenizer_metadata, write_random_llama,
};
use llama_burn::sampling::Sampler;

/// A small body (2 layers, d 256, 4/2 heads of 64, ffn 512): every matrix is whole
/// 256-value blocks, so every type applies.
fn tiny(vocab: usize) -> LlamaConfig {
    let body = LlamaConfig {
        d_model: 256,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        ffn_hidden: 512,
        ..LlamaConfig::smollm2_135m()
    };
    random_config(body, vocab)
}

/// ggml type ids (ggml.h's `enum ggml_type`).
const F32: u32 = 0;
const F16: u32 = 1;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;

/// The tensors of the tiny body in `preset`, by hand: name → (ggml dims, `ne0` first, as
/// llama.cpp prints them; ggml type id).
///
/// Names are llama.cpp's `llama` architecture's; embeddings are tied, so there is no
/// `output.weight`. Norms are F32. `F16` and `Q8_0` store every matrix in their type.
/// `Q4_K_M` (`llama-quantize`'s `llama_tensor_get_type`) stores matrices in Q4_K except:
/// the tied embeddings, which are the output head, in Q6_K; and `attn_v` and `ffn_down`
/// in Q6_K in the layers where `use_more_bits(i, n)` = `i < n/8 || i >= 7*n/8 ||
/// (i - n/8) % 3 == 2` holds: of 2 layers (n/8 = 0, 7n/8 = 1), layer 1 only.
fn expected_tensors(preset: &str, vocab: usize) -> BTreeMap<String, (Vec<u64>, u32)> {
    let (matrix, embed, more_bits) = match preset {
        "Q4_K_M" => (Q4_K, Q6_K, Q6_K),
        "Q8_0" => (Q8_0, Q8_0, Q8_0),
        "F16" => (F16, F16, F16),
        other => panic!("no table for {other}"),
    };
    let mut t = BTreeMap::new();
    t.insert("token_embd.weight".into(), (vec![256, vocab as u64], embed));
    t.insert("output_norm.weight".into(), (vec![256], F32));
    for layer in 0..2 {
        let v_down = if layer == 1 { more_bits } else { matrix };
        for (name, dims, ty) in [
            ("attn_norm", vec![256], F32),
            ("attn_q", vec![256, 256], matrix),
            ("attn_k", vec![256, 128], matrix),
            ("attn_v", vec![256, 128], v_down),
            ("attn_output", vec![256, 256], matrix),
            ("ffn_norm", vec![256], F32),
            ("ffn_gate", vec![256, 512], matrix),
            ("ffn_up", vec![256, 512], matrix),
            ("ffn_down", vec![512, 256], v_down),
        ] {
            t.insert(format!("blk.{layer}.{name}.weight"), (dims, ty));
        }
    }
    t
}

/// Largest root-mean-square error of a dequantized row, relative to the row's own
/// root mean square, for Gaussian values stored in type `ty`: about 1.5 to 2 times the
/// worst row measured in these files (3,700 to 53,000 rows a type; F16, 11 bits of
/// mantissa: 2.6e-4; Q8_0, a 127th of a 32-value block's largest: 0.0071; Q6_K, 6 bits
/// per 16 values: 0.022; Q4_K, 4 bits per 32 values above a minimum: 0.083). A row from
/// another tensor or another row is off by ~1.4, a wrong scale by ~1, and a Q6_K
/// tensor that went through Q4_K on the way by ~0.08.
fn rounding_bound(ty: u32) -> f64 {
    match ty {
        F32 => 0.0,
        F16 => 5e-4,
        Q8_0 => 0.012,
        Q6_K => 0.035,
        Q4_K => 0.12,
        other => panic!("no bound for type {other}"),
    }
}

#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn random_gguf_files_round_trip_and_generate() {
    let demo = GgufFile::open(llama_burn::demo::demo_model_path().expect("demo model"))
        .expect("demo gguf");
    let (tokenizer, vocab) = tokenizer_metadata(&demo).expect("tokenizer");
    let demo_tokens = demo
        .get_string_array("tokenizer.ggml.tokens")
        .expect("demo vocabulary");
    assert_eq!(vocab, demo_tokens.len());
    let config = tiny(vocab);
    let dir = std::env::temp_dir().join(format!("random-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // Preset, seed, llama.cpp's `llama_ftype` (MOSTLY_Q4_K_M, MOSTLY_Q8_0, MOSTLY_F16).
    for (name, seed, file_type) in [("Q4_K_M", 7, 15), ("Q8_0", 8, 7), ("F16", 9, 1)] {
        let types = WeightTypes::parse(name, false).expect("type");
        let path = dir.join(format!("tiny.{name}.gguf"));
        let meta = metadata(&config, "random-tiny", &types, &tokenizer);
        let mut last = (0, 0);
        let summary = write_random_llama(&path, &config, &types, &meta, seed, &mut |d, t| {
            last = (d, t)
        })
        .expect("write");
        assert_eq!(last, (summary.data_bytes, summary.data_bytes), "{name}");

        let file = GgufFile::open(&path).expect("open");
        // The metadata, as the module documents it and llama.cpp names it.
        let u = |key: &str| file.get_u64(key).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        for (key, want) in [
            ("llama.context_length", 8192),
            ("llama.embedding_length", 256),
            ("llama.block_count", 2),
            ("llama.feed_forward_length", 512),
            ("llama.attention.head_count", 4),
            ("llama.attention.head_count_kv", 2),
            ("llama.rope.dimension_count", 64),
            ("general.file_type", file_type),
        ] {
            assert_eq!(u(key), want, "{name}: {key}");
        }
        if name != "F16" {
            assert_eq!(u("general.quantization_version"), 2, "{name}");
        }
        assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 500_000.0);
        assert_eq!(
            file.get_f32("llama.attention.layer_norm_rms_epsilon")
                .unwrap(),
            1e-5
        );
        assert_eq!(
            file.get_string_array("tokenizer.ggml.tokens").unwrap(),
            demo_tokens,
            "{name}: the tokenizer is the demo's"
        );
        assert!(
            matches!(file.get("tokenizer.ggml.model"), Some(GgufValue::String(m)) if m == "gpt2")
        );
        let read = LlamaConfig::from_gguf(&file).expect("config");
        // The file holds epsilon as f32.
        assert_eq!(read.norm_eps, f64::from(1e-5f32));
        assert_eq!(
            LlamaConfig {
                norm_eps: config.norm_eps,
                ..read
            },
            config,
            "{name}"
        );

        // Names, dims and types against the table.
        let want = expected_tensors(name, vocab);
        let got: BTreeMap<String, (Vec<u64>, u32)> = file
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), (t.dims.clone(), t.ty.id())))
            .collect();
        assert_eq!(file.tensors().len(), want.len(), "{name}: a tensor twice");
        let differences: Vec<String> = want
            .iter()
            .filter(|&(tensor, w)| got.get(tensor) != Some(w))
            .map(|(tensor, w)| format!("{tensor}: want {w:?}, got {:?}", got.get(tensor)))
            .chain(
                got.keys()
                    .filter(|tensor| !want.contains_key(*tensor))
                    .map(|tensor| format!("{tensor}: not in the table")),
            )
            .collect();
        assert!(differences.is_empty(), "{name}: {differences:#?}");

        // Values: norms are ones; each matrix row is the documented random row
        // (`random_row`: seed, tensor name, row) within its type's rounding, and each
        // matrix as a whole is N(0, 0.02²).
        for (tensor, (dims, ty)) in &want {
            let (shape, values) = file
                .read_tensor_f32(tensor)
                .unwrap_or_else(|e| panic!("{name}: {tensor}: {e}"));
            if dims.len() == 1 {
                assert!(
                    values.len() == 256 && values.iter().all(|&v| v == 1.0),
                    "{name}: {tensor} is not ones"
                );
                continue;
            }
            let (rows, cols) = (shape[0], shape[1]);
            assert_eq!((cols as u64, rows as u64), (dims[0], dims[1]));
            let mut expected = vec![0f32; cols];
            let mut worst: f64 = 0.0;
            for (r, row) in values.chunks_exact(cols).enumerate() {
                random_row(seed, tensor, r, &mut expected);
                let err: f64 = row
                    .iter()
                    .zip(&expected)
                    .map(|(&a, &b)| f64::from(a - b).powi(2))
                    .sum();
                let norm: f64 = expected.iter().map(|&b| f64::from(b).powi(2)).sum();
                worst = worst.max((err / norm).sqrt());
            }
            eprintln!("{name}: {tensor} rows off by {worst:.2e} of their size");
            assert!(
                worst <= rounding_bound(*ty),
                "{name}: {tensor} (type {ty}) rows are off by {worst} of their size"
            );
            let n = values.len() as f64;
            let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let std = (values
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            assert!(
                mean.abs() < 0.001 && (std - 0.02).abs() < 0.001,
                "{name}: {tensor} has mean {mean}, std {std}; N(0, 0.02²) documented"
            );
        }

        let mut llama = llama_burn::Loader::gguf(&path)
            .max_seq_len(64)
            .load::<B>(&default_device())
            .expect("load");
        let out = llama
            .generate("The capital of France is", 8, 0.0, &mut Sampler::Argmax)
            .expect("generate");
        assert!(!out.tokens.is_empty() && out.tokens.len() <= 8, "{name}");
        assert!(out.tokens.iter().all(|&t| (t as usize) < vocab));
        // Greedy decoding of the same file reproduces.
        let again = llama
            .generate("The capital of France is", 8, 0.0, &mut Sampler::Argmax)
            .expect("generate");
        assert_eq!(again.tokens, out.tokens, "{name}");
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}
