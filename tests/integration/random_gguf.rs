//! A random-weight GGUF written by `loader::random` (through the GGUF writer) reads
//! back with the crate's own GGUF loader: the configuration, every tensor's type and
//! bytes (blocks equal to the random rows quantized again), and a model that generates.

use crate::common::B;
use llama_burn::backend::default_device;
use llama_burn::config::LlamaConfig;
use llama_burn::loader::gguf::{GgmlType, GgufFile};
use llama_burn::loader::random::{
    WeightTypes, metadata, plan, random_config, tensor_rows, tokenizer_metadata, write_random_llama,
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

#[test]
fn random_gguf_files_round_trip_and_generate() {
    let demo = GgufFile::open(llama_burn::demo::demo_model_path().expect("demo model"))
        .expect("demo gguf");
    let (tokenizer, vocab) = tokenizer_metadata(&demo).expect("tokenizer");
    let config = tiny(vocab);
    let dir = std::env::temp_dir().join(format!("random-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (name, seed) in [("Q4_K_M", 7), ("Q8_0", 8), ("F16", 9)] {
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
        let plans = plan(&config, &types);
        assert_eq!(file.tensors().len(), plans.len());
        let mut types_seen = std::collections::BTreeSet::new();
        for p in &plans {
            let info = file.tensor_info(&p.name).expect("tensor present");
            assert_eq!(
                (info.shape(), info.ty),
                (p.shape.clone(), p.ty),
                "{}",
                p.name
            );
            let rows = if p.shape.len() == 1 { 1 } else { p.shape[0] };
            let want = tensor_rows(seed, p, 0..rows).expect("rows");
            assert!(
                file.read_tensor_bytes(info).expect("bytes") == want,
                "{name}: {} differs",
                p.name
            );
            types_seen.insert(info.ty.to_string());
        }
        if name == "Q4_K_M" {
            // The preset mixes: Q4_K, and Q6_K for the embeddings and the last layer's
            // attn_v / ffn_down.
            let q6 = file.tensor_info("blk.1.ffn_down.weight").expect("down").ty;
            let q4 = file.tensor_info("blk.0.ffn_down.weight").expect("down").ty;
            assert_eq!((q6, q4), (GgmlType::Q6_K, GgmlType::Q4_K));
        }
        assert!(types_seen.contains("F32"), "{types_seen:?}");

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
