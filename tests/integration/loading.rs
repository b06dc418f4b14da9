//! Loading checkpoints, on the real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF):
//! - a Hugging Face directory (sharded F32 safetensors + `config.json`) written from the
//!   demo GGUF loads to a model with exactly the GGUF model's logits;
//! - F16 and BF16 safetensors tensors are converted to f32 exactly;
//! - bad checkpoints (truncated, foreign, non-llama, missing or mis-shaped tensors, a
//!   tokenizer larger than the model, an impossible context length) give typed errors,
//!   never panics.

use std::borrow::Cow;
use std::cell::RefCell;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::{Dtype, View};

use crate::common::B;
use llama_burn::backend::default_device;
use llama_burn::loader::gguf::GgufFile;
use llama_burn::loader::safetensors::SafetensorsSource;
use llama_burn::loader::{GgufSource, TensorSource};
use llama_burn::model::Transformer;
use llama_burn::tokenizer::{DynTokenizer, GgufBpeTokenizer, Tokenizer};
use llama_burn::{Llama, LlamaConfig, LlamaError, Loader};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// A uniquely named directory under the system temp dir, removed (with its contents) on
/// drop, so a failing test leaves nothing behind.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "llama-burn-loading-{}-{tag}-{n}-{nanos}",
            std::process::id()
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn demo_path() -> PathBuf {
    llama_burn::demo::demo_model_path().expect("demo model available")
}

fn demo_tokenizer(gguf: &GgufFile) -> GgufBpeTokenizer {
    GgufBpeTokenizer::from_gguf(gguf).expect("demo tokenizer")
}

/// Loads a GGUF file without a progress display.
fn load_gguf(path: &Path, max_seq_len: usize) -> Result<Llama<B, DynTokenizer>, LlamaError> {
    Loader::gguf(path)
        .max_seq_len(max_seq_len)
        .quiet()
        .load::<B>(&default_device())
}

/// Loads a Hugging Face directory with the given tokenizer, without a progress display.
fn load_hf<T: Tokenizer>(
    dir: &Path,
    tokenizer: T,
    max_seq_len: usize,
) -> Result<Llama<B, T>, LlamaError> {
    Loader::hf_dir(dir)
        .tokenizer(tokenizer)
        .max_seq_len(max_seq_len)
        .quiet()
        .load::<B>(&default_device())
}

/// A tensor name with its shape.
type NamedShape = (String, Vec<usize>);

/// The Hugging Face names and (PyTorch-order) shapes of every tensor of a model with
/// tied embeddings, in the order `build_transformer` reads them.
fn hf_tensor_shapes(c: &LlamaConfig) -> Vec<NamedShape> {
    let (d, hd, ff) = (c.d_model, c.head_dim, c.ffn_hidden);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, d],
    )];
    for i in 0..c.n_layers {
        let layer = |suffix: &str, shape: Vec<usize>| (format!("model.layers.{i}.{suffix}"), shape);
        out.extend([
            layer("input_layernorm.weight", vec![d]),
            layer("self_attn.q_proj.weight", vec![c.n_heads * hd, d]),
            layer("self_attn.k_proj.weight", vec![c.n_kv_heads * hd, d]),
            layer("self_attn.v_proj.weight", vec![c.n_kv_heads * hd, d]),
            layer("self_attn.o_proj.weight", vec![d, c.n_heads * hd]),
            layer("post_attention_layernorm.weight", vec![d]),
            layer("mlp.gate_proj.weight", vec![ff, d]),
            layer("mlp.up_proj.weight", vec![ff, d]),
            layer("mlp.down_proj.weight", vec![d, ff]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![d]));
    out
}

/// A safetensors [`View`] whose F32 data is read from the GGUF only when the writer asks
/// for it, so a shard is written tensor by tensor without holding the model in memory.
struct GgufTensor<'s, 'g> {
    source: &'s RefCell<GgufSource<'g>>,
    name: String,
    shape: Vec<usize>,
}

impl View for GgufTensor<'_, '_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let (shape, values) = self
            .source
            .borrow_mut()
            .read(&self.name)
            .unwrap_or_else(|e| panic!("reading {} from the GGUF: {e}", self.name));
        assert_eq!(shape, self.shape, "shape of {}", self.name);
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Writes the given tensors of the GGUF as one F32 safetensors file.
fn write_shard(path: &Path, source: &RefCell<GgufSource<'_>>, tensors: &[NamedShape]) {
    let views = tensors.iter().map(|(name, shape)| {
        (
            name.clone(),
            GgufTensor {
                source,
                name: name.clone(),
                shape: shape.clone(),
            },
        )
    });
    safetensors::serialize_to_file(views, None, path).expect("write safetensors shard");
}

/// Writes `model.safetensors.index.json` mapping every tensor of `shards` to its file.
fn write_index(dir: &Path, shards: &[(&str, &[NamedShape])]) {
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0usize;
    for (file, tensors) in shards {
        for (name, shape) in *tensors {
            weight_map.insert(name.clone(), serde_json::Value::from(*file));
            total_size += shape.iter().product::<usize>() * 4;
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total_size },
        "weight_map": weight_map,
    });
    write_json(&dir.join("model.safetensors.index.json"), &index);
}

fn write_json(path: &Path, value: &serde_json::Value) {
    let text = serde_json::to_string_pretty(value).expect("serialize json");
    std::fs::write(path, text).expect("write json");
}

/// The demo model's `config.json`, as Hugging Face publishes it (the relevant keys).
fn demo_config_json(hidden_size: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": hidden_size,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": true,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    })
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "rows");
    a.iter()
        .zip(b)
        .flat_map(|(ra, rb)| {
            assert_eq!(ra.len(), rb.len(), "row width");
            ra.iter().zip(rb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// Copies the first `len` bytes of `src` to a new file `dst`.
fn copy_prefix(src: &Path, dst: &Path, len: u64) {
    let mut input = std::fs::File::open(src).expect("open source").take(len);
    let mut output = std::fs::File::create(dst).expect("create copy");
    let copied = std::io::copy(&mut input, &mut output).expect("copy prefix");
    assert_eq!(copied, len, "source is long enough");
}

/// A safetensors [`View`] over bytes already in memory.
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn raw16(shape: Vec<usize>, dtype: Dtype, bits: &[u16]) -> Raw {
    Raw {
        dtype,
        shape,
        bytes: bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
    }
}

// ---------------------------------------------------------------------------------------
// Hugging Face directory vs GGUF
// ---------------------------------------------------------------------------------------

/// The one test that writes the demo model in F32 (~540 MB): it builds a sharded Hugging
/// Face directory from the GGUF, checks the logits against the GGUF model, and then
/// damages the directory to check the errors that need a real checkpoint.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn hf_directory_gives_the_gguf_logits_and_typed_errors() {
    let device = default_device();
    let path = demo_path();
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    let gguf_config = LlamaConfig::from_gguf(&gguf).expect("demo config");

    // Shard 1 holds layers 0-3 (small, so it can be rewritten cheaply below); shard 2 the
    // embedding table, the other layers and the final norm.
    let tensors = hf_tensor_shapes(&gguf_config);
    let (first, second): (Vec<_>, Vec<_>) = tensors.into_iter().partition(|(name, _)| {
        [
            "model.layers.0.",
            "model.layers.1.",
            "model.layers.2.",
            "model.layers.3.",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
    });
    assert_eq!(first.len(), 4 * 9);
    let shard1 = "model-00001-of-00002.safetensors";
    let shard2 = "model-00002-of-00002.safetensors";

    let dir = TempDir::new("hf");
    let source = RefCell::new(GgufSource::new(&gguf, &gguf_config));
    write_shard(&dir.join(shard1), &source, &first);
    write_shard(&dir.join(shard2), &source, &second);
    write_index(dir.path(), &[(shard1, &first), (shard2, &second)]);
    write_json(&dir.join("config.json"), &demo_config_json(576));
    assert!(!dir.join("model.safetensors").exists());

    // config.json describes the same model (rms_norm_eps 1e-5 is the GGUF's f32 value).
    let json = std::fs::read_to_string(dir.join("config.json")).expect("read config.json");
    let mut hf_config = LlamaConfig::from_hf_json(&json).expect("parse config.json");
    assert_eq!(hf_config.norm_eps as f32, gguf_config.norm_eps as f32);
    hf_config.norm_eps = gguf_config.norm_eps;
    assert_eq!(hf_config, gguf_config);

    // The loader tells a directory from a file, and reads its configuration alone.
    let mut auto = Loader::path(dir.path())
        .config()
        .expect("directory's config");
    assert_eq!(auto.norm_eps, 1e-5);
    auto.norm_eps = hf_config.norm_eps;
    assert_eq!(auto, hf_config.clone().with_max_seq_len(2048));

    // An impossible context length is refused before any tensor is read.
    for bad in [0, 8193] {
        let err = load_hf(dir.path(), demo_tokenizer(&gguf), bad).expect_err("bad max_seq_len");
        assert!(
            matches!(
                err,
                LlamaError::InvalidParameter {
                    name: "max_seq_len",
                    ..
                }
            ),
            "max_seq_len {bad}: {err:?}"
        );
    }

    // Same weights, same logits.
    // Exact: the f32 arithmetic that the directory's dense matmul does too.
    let from_gguf = Loader::gguf(&path)
        .max_seq_len(256)
        .quiet()
        .load::<B>(&device)
        .expect("load GGUF")
        .with_precision(llama_burn::Precision::Exact);
    let mut calls = 0usize;
    let mut last = (0, 0);
    let from_hf = Loader::hf_dir(dir.path())
        .tokenizer(demo_tokenizer(&gguf))
        .max_seq_len(256)
        .progress(|done, total| {
            calls += 1;
            last = (done, total);
        })
        .load::<B>(&device)
        .expect("load HF directory");
    let from_hf = from_hf.with_precision(llama_burn::Precision::Exact);
    assert_eq!(last, (2 + 9 * 30, 2 + 9 * 30), "progress reaches the end");
    assert_eq!(calls, 2 + 9 * 30, "one progress call per tensor");
    // The two differ only in how rms_norm_eps was stored (f64 1e-5 vs f32 1e-5), which
    // the f32 model cannot tell apart.
    let mut loaded = from_hf.config().clone();
    loaded.norm_eps = from_gguf.config().norm_eps;
    assert_eq!(&loaded, from_gguf.config());

    let prompt = "The capital of France is Paris, and the capital of Italy is";
    let ids = from_gguf.encode_prompt(prompt).expect("encode");
    assert_eq!(from_hf.encode_prompt(prompt).expect("encode"), ids);
    let a = from_gguf.logits(&ids).expect("GGUF logits");
    let b = from_hf.logits(&ids).expect("HF logits");
    assert_eq!(a.len(), ids.len());
    assert!(a.iter().flatten().all(|v| v.is_finite()));
    let diff = max_abs_diff(&a, &b);
    eprintln!(
        "HF directory vs GGUF: max |logit diff| = {diff:e} over {} tokens",
        ids.len()
    );
    // The GGUF model keeps its Q4_1/Q8_0 blocks and multiplies them with our kernels;
    // the directory holds the same weights dequantized, multiplied by Burn's matmul. Same
    // weights, a different summation order: a loading mistake (a transposed or permuted
    // tensor) moves logits by whole units, the order by about 1e-5.
    assert!(diff <= 2e-4, "logits differ by {diff}");
    drop((from_gguf, from_hf));

    // config.json with a different hidden size: the first tensor has the wrong shape.
    write_json(&dir.join("config.json"), &demo_config_json(720));
    let err = load_hf(dir.path(), demo_tokenizer(&gguf), 256).expect_err("wrong hidden size");
    match err {
        LlamaError::ShapeMismatch {
            name,
            expected,
            actual,
        } => {
            assert_eq!(name, "model.embed_tokens.weight");
            assert_eq!(expected, vec![49152, 720]);
            assert_eq!(actual, vec![49152, 576]);
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    // Absurd or wrong layer counts: a typed error before anything is allocated for them.
    for layers in [4_000_000_000u64, 31] {
        let mut json = demo_config_json(576);
        json["num_hidden_layers"] = layers.into();
        write_json(&dir.join("config.json"), &json);
        let err = load_hf(dir.path(), demo_tokenizer(&gguf), 256).expect_err("layer count");
        assert!(matches!(err, LlamaError::Config(_)), "{layers}: {err:?}");
    }
    write_json(&dir.join("config.json"), &demo_config_json(576));

    // One tensor missing (from its shard and from the index).
    let dropped = "model.layers.3.mlp.up_proj.weight";
    let without: Vec<_> = first
        .iter()
        .filter(|(n, _)| n != dropped)
        .cloned()
        .collect();
    assert_eq!(without.len(), first.len() - 1);
    std::fs::remove_file(dir.join(shard1)).expect("remove shard 1");
    write_shard(&dir.join(shard1), &source, &without);
    write_index(dir.path(), &[(shard1, &without), (shard2, &second)]);
    let err = load_hf(dir.path(), demo_tokenizer(&gguf), 256).expect_err("missing tensor");
    assert!(
        matches!(&err, LlamaError::MissingTensor(name) if name == dropped),
        "{err:?}"
    );
}

/// F16 and BF16 tensors are widened to f32 exactly; other types are refused.
#[test]
fn safetensors_source_converts_f16_and_bf16() {
    let dir = TempDir::new("dtypes");
    let path = dir.join("mixed.safetensors");
    // Bit patterns and their exact values.
    let bf16 = [
        (0x3F80, 1.0),
        (0xC020, -2.5),
        (0x3E20, 0.156_25),
        (0x4049, 3.140_625),
        (0x4780, 65536.0),
        (0x8000, -0.0),
    ];
    let f16 = [
        (0x3C00, 1.0),
        (0xC000, -2.0),
        (0x7BFF, 65504.0),
        (0x0400, 6.103_515_6e-5), // smallest normal, 2^-14
        (0x0001, 5.960_464_5e-8), // smallest subnormal, 2^-24
        (0x3555, 0.333_251_95),
    ];
    let f32_values = [0.1f32, -7.25, f32::MIN_POSITIVE];
    let bits = |t: &[(u16, f32)]| t.iter().map(|&(b, _)| b).collect::<Vec<_>>();
    let values = |t: &[(u16, f32)]| t.iter().map(|&(_, v)| v).collect::<Vec<_>>();
    let tensors = vec![
        (
            "b".to_string(),
            raw16(vec![2, 3], Dtype::BF16, &bits(&bf16)),
        ),
        ("h".to_string(), raw16(vec![3, 2], Dtype::F16, &bits(&f16))),
        (
            "f".to_string(),
            Raw {
                dtype: Dtype::F32,
                shape: vec![3],
                bytes: f32_values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            },
        ),
        (
            "i".to_string(),
            Raw {
                dtype: Dtype::I32,
                shape: vec![2],
                bytes: [7i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect(),
            },
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &path).expect("write safetensors");

    let mut source = SafetensorsSource::open_files(std::slice::from_ref(&path)).expect("open");
    assert!(source.contains("b") && source.contains("h") && !source.contains("x"));

    let (shape, data) = source.read("b").expect("read bf16");
    assert_eq!(shape, vec![2, 3]);
    assert_eq!(data, values(&bf16));
    assert!(data[5].is_sign_negative(), "-0.0 keeps its sign");

    let (shape, data) = source.read("h").expect("read f16");
    assert_eq!(shape, vec![3, 2]);
    assert_eq!(data, values(&f16));

    let (shape, data) = source.read("f").expect("read f32");
    assert_eq!((shape, data), (vec![3], f32_values.to_vec()));

    let err = source.read("i").expect_err("i32 is not a weight type");
    assert!(
        matches!(&err, LlamaError::UnsupportedTensorType { name, .. } if name == "i"),
        "{err:?}"
    );
    let err = source.read("x").expect_err("absent tensor");
    assert!(matches!(err, LlamaError::MissingTensor(_)), "{err:?}");
}

// ---------------------------------------------------------------------------------------
// Bad files
// ---------------------------------------------------------------------------------------

#[test]
fn the_loader_s_options_and_defaults() {
    use llama_burn::Precision;
    use llama_burn::kernels::QuantFormat;
    let path = demo_path();
    // Defaults: 2048 tokens of context, and `exact` for a model under 1B parameters.
    let config = Loader::path(&path).config().expect("config");
    assert_eq!(config.max_seq_len, 2048);
    assert_eq!(config.context_length, 8192);
    assert_eq!(config.precision, Precision::Exact);
    let config = Loader::gguf(&path)
        .max_seq_len(100)
        .precision(Precision::Fast)
        .config()
        .expect("config");
    assert_eq!(
        (config.max_seq_len, config.precision),
        (100, Precision::Fast)
    );

    // What the options set reaches the model, and the progress callback runs to the end.
    let mut last = (0, 0);
    let llama = Loader::path(&path)
        .max_seq_len(64)
        .precision(Precision::Fast)
        .progress(|done, total| last = (done, total))
        .load::<B>(&default_device())
        .expect("load");
    assert_eq!(llama.config().max_seq_len, 64);
    assert_eq!(llama.config().precision, Precision::Fast);
    assert_eq!(last, (2 + 9 * 30, 2 + 9 * 30));

    // A GGUF keeps its own types: quantizing one is refused before a weight is read.
    let err = Loader::gguf(&path)
        .quantize(QuantFormat::Q8_0)
        .load::<B>(&default_device())
        .expect_err("quantized GGUF");
    assert!(
        matches!(
            err,
            LlamaError::InvalidParameter {
                name: "quantize",
                ..
            }
        ),
        "{err:?}"
    );
    // A directory without config.json is an I/O error naming the file.
    let dir = TempDir::new("empty");
    let err = Loader::path(dir.path())
        .config()
        .expect_err("no config.json");
    assert!(
        matches!(&err, LlamaError::Io { path, .. } if path.ends_with("config.json")),
        "{err:?}"
    );
}

#[test]
fn truncated_gguf_is_reported_as_truncated() {
    let path = demo_path();
    let len = std::fs::metadata(&path).expect("stat demo").len();
    let dir = TempDir::new("truncated");
    // Cut inside the tensor data, inside the metadata, and one byte short.
    for cut in [50 << 20, 1000, 16, len - 1] {
        let copy = dir.join(&format!("cut-{cut}.gguf"));
        copy_prefix(&path, &copy, cut);
        let err = load_gguf(&copy, 256).expect_err("truncated file loads");
        assert!(
            matches!(err, LlamaError::Truncated(_)),
            "cut at {cut} bytes: {err:?}"
        );
        std::fs::remove_file(&copy).expect("remove copy");
    }
}

#[test]
fn foreign_files_are_invalid_format() {
    let dir = TempDir::new("foreign");

    // Text where a GGUF should be.
    let text = dir.join("notes.gguf");
    std::fs::write(
        &text,
        "This is not a model, just some text long enough to parse.\n".repeat(10),
    )
    .expect("write text");
    let err = load_gguf(&text, 256).expect_err("text file");
    assert!(matches!(err, LlamaError::InvalidFormat(_)), "{err:?}");

    // A safetensors file renamed to .gguf.
    let st = dir.join("weights.gguf");
    let tensor = Raw {
        dtype: Dtype::F32,
        shape: vec![4, 4],
        bytes: vec![0; 64],
    };
    safetensors::serialize_to_file([("w", tensor)], None, &st).expect("write safetensors");
    let err = load_gguf(&st, 256).expect_err("safetensors as GGUF");
    assert!(matches!(err, LlamaError::InvalidFormat(_)), "{err:?}");

    // An HF directory whose model.safetensors is text, or a GGUF file.
    let gguf = GgufFile::open(demo_path()).expect("open demo GGUF");
    let hf = TempDir::new("foreign-hf");
    write_json(&hf.join("config.json"), &demo_config_json(576));
    std::fs::copy(&text, hf.join("model.safetensors")).expect("copy text");
    let err = load_hf(hf.path(), demo_tokenizer(&gguf), 256).expect_err("text safetensors");
    assert!(matches!(err, LlamaError::InvalidFormat(_)), "{err:?}");
    std::fs::remove_file(hf.join("model.safetensors")).expect("remove");
    copy_prefix(&demo_path(), &hf.join("model.safetensors"), 1 << 20);
    let err = load_hf(hf.path(), demo_tokenizer(&gguf), 256).expect_err("GGUF as safetensors");
    assert!(matches!(err, LlamaError::InvalidFormat(_)), "{err:?}");
}

/// A GGUF whose `general.architecture` is not `llama` is refused with a configuration
/// error naming the architecture.
#[test]
fn non_llama_gguf_is_refused() {
    let path = demo_path();
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    let (header_len, file_len) = (gguf.data_offset(), gguf.file_len());
    let mut header = Vec::new();
    std::fs::File::open(&path)
        .expect("open demo")
        .take(header_len)
        .read_to_end(&mut header)
        .expect("read header");
    // key (u64 length + text), value type 8 (string), value (u64 length + text)
    let mut needle = 20u64.to_le_bytes().to_vec();
    needle.extend_from_slice(b"general.architecture");
    needle.extend_from_slice(&8u32.to_le_bytes());
    needle.extend_from_slice(&5u64.to_le_bytes());
    needle.extend_from_slice(b"llama");
    let at = header
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("architecture key in the header");
    let value = at + needle.len() - 5;
    header[value..value + 5].copy_from_slice(b"qwen2");

    // Same header, tensor data left as a hole of the right length (a sparse file).
    let dir = TempDir::new("arch");
    let copy = dir.join("qwen2.gguf");
    let mut file = std::fs::File::create(&copy).expect("create");
    file.write_all(&header).expect("write header");
    file.set_len(file_len).expect("extend");
    drop(file);
    let err = load_gguf(&copy, 256).expect_err("qwen2 GGUF");
    assert!(
        matches!(&err, LlamaError::Config(msg) if msg.contains("qwen2")),
        "{err:?}"
    );
}

#[test]
fn tokenizer_larger_than_the_model_is_a_mismatch() {
    let gguf = GgufFile::open(demo_path()).expect("open demo GGUF");
    let tokenizer = demo_tokenizer(&gguf);
    assert_eq!(tokenizer.vocab_size(), 49152);
    let config = LlamaConfig {
        vocab_size: 1000,
        d_model: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        ffn_hidden: 128,
        context_length: 512,
        max_seq_len: 512,
        ..LlamaConfig::smollm2_135m()
    };
    let model = Transformer::<B>::random(config, 7, &default_device()).expect("random model");
    let err = Llama::new(model, tokenizer).expect_err("tokenizer does not fit");
    assert!(
        matches!(
            err,
            LlamaError::TokenizerMismatch {
                tokenizer_vocab: 49152,
                model_vocab: 1000
            }
        ),
        "{err:?}"
    );
}

#[test]
fn max_seq_len_out_of_range_is_invalid_parameter() {
    let path = demo_path();
    for bad in [0, 1, 8193, usize::MAX] {
        let err = load_gguf(&path, bad).expect_err("bad max_seq_len");
        assert!(
            matches!(
                err,
                LlamaError::InvalidParameter {
                    name: "max_seq_len",
                    ..
                }
            ),
            "max_seq_len {bad}: {err:?}"
        );
    }
}

/// In-memory quantization at load: the demo model written as an f32 safetensors
/// checkpoint and loaded as Q8_0 keeps every projection and the embedding in Q8_0; the
/// embedding's blocks are the demo GGUF's own Q8_0 blocks again (they were dequantized
/// into the checkpoint, and quantizing them back gives ggml's bytes), and its logits
/// stay within Q8_0's error of the f32 load's.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn a_safetensors_checkpoint_quantized_at_load_keeps_ggml_s_blocks() {
    use llama_burn::kernels::QuantFormat;
    use llama_burn::model::VocabMatrix;
    let path = demo_path();
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    let config = LlamaConfig::from_gguf(&gguf).expect("demo config");
    let dir = TempDir::new("quantize");
    let source = RefCell::new(GgufSource::new(&gguf, &config));
    let tensors = hf_tensor_shapes(&config);
    write_shard(&dir.join("model.safetensors"), &source, &tensors);
    write_json(&dir.join("config.json"), &demo_config_json(576));

    let quantized = Loader::hf_dir(dir.path())
        .tokenizer(demo_tokenizer(&gguf))
        .max_seq_len(256)
        .quantize(QuantFormat::Q8_0)
        .quiet()
        .load::<B>(&default_device())
        .expect("load as Q8_0")
        .with_precision(llama_burn::Precision::Exact);
    let VocabMatrix::Quantized(embed) = &quantized.model.embed else {
        panic!("the embedding is kept quantized");
    };
    assert_eq!(embed.format(), QuantFormat::Q8_0);
    let original = llama_burn::kernels::QuantMatrix::from_gguf(&gguf, "token_embd.weight")
        .expect("read")
        .expect("the demo's embedding is Q8_0");
    assert_eq!(embed.to_ggml_bytes(), original.to_ggml_bytes());
    assert!(quantized.model.blocks.iter().all(|b| b.w_up.is_quantized()));

    let dense = load_hf(dir.path(), demo_tokenizer(&gguf), 256)
        .expect("load f32")
        .with_precision(llama_burn::Precision::Exact);
    let ids = dense
        .encode_prompt("The capital of France is")
        .expect("encode");
    let (a, b) = (
        dense.logits(&ids).expect("logits"),
        quantized.logits(&ids).expect("logits"),
    );
    let diff = max_abs_diff(&a, &b);
    eprintln!("Q8_0 in memory against the f32 checkpoint: largest logit difference {diff}");
    assert!(diff > 0.0 && diff < 1.0, "{diff}");
}
