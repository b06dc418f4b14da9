//! GGUF reader and dequantization against a fixture made by gguf-py
//! (`tests/fixtures/make_gguf_fixture.py`; the expected values are gguf-py's own
//! dequantization of the stored bytes).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use llama_burn::LlamaError;
use llama_burn::loader::gguf::{GgmlType, GgufFile, GgufValue};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dequant.gguf");
const EXPECTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/dequant_expected.json"
);

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(FIXTURE).expect("read fixture")
}

/// A uniquely named file under the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    /// Writes `bytes` to a new file. (Always a new file: rewriting an existing one is
    /// slow on some file systems, which flush on truncate.)
    fn new(tag: &str, bytes: &[u8]) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("llama-burn-gguf-test-{}-{tag}-{n}.gguf", std::process::id());
        let path = std::env::temp_dir().join(name);
        std::fs::write(&path, bytes).expect("write temp file");
        TempFile(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Opens `bytes` as a GGUF file (through a temporary file).
fn open_bytes(tag: &str, bytes: &[u8]) -> Result<GgufFile, LlamaError> {
    let tmp = TempFile::new(tag, bytes);
    // The open file stays valid after the path is removed (on Unix; on Windows the
    // removal fails silently and the file is left in the temp dir).
    GgufFile::open(tmp.path())
}

/// Byte offset of the `type` field of the tensor info for `name` (assumes `name` occurs
/// once in the header, preceded by its u64 length).
fn tensor_type_field(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .expect("tensor name in header");
    let dims_at = at + needle.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().unwrap()) as usize;
    dims_at + 4 + 8 * n_dims
}

/// Byte offset of the value of metadata key `key` (after its type field).
fn metadata_value_field(bytes: &[u8], key: &str) -> usize {
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .expect("key in header");
    at + needle.len() + 4
}

#[test]
fn every_type_dequantizes_like_gguf_py() {
    let file = GgufFile::open(FIXTURE).expect("open fixture");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(EXPECTED).unwrap()).unwrap();
    let expected = expected.as_object().unwrap();
    assert_eq!(expected.len(), file.tensors().len());

    let mut seen = Vec::new();
    for (name, want) in expected {
        let info = file.tensor_info(name).expect("tensor in file");
        assert_eq!(info.ty.name(), want["type"].as_str().unwrap(), "{name}");
        let want_shape: Vec<usize> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let want_data: Vec<f32> = want["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();

        let (shape, data) = file.read_tensor_f32(name).expect("read tensor");
        assert_eq!(shape, want_shape, "{name}");
        assert_eq!(info.shape(), want_shape, "{name}");
        assert_eq!(info.n_elements(), want_data.len(), "{name}");
        assert_eq!(data.len(), want_data.len(), "{name}");
        let max_diff = data
            .iter()
            .zip(&want_data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max_diff <= 1e-6, "{name}: max abs diff {max_diff}");
        seen.push(info.ty);
    }
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q5_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ] {
        assert!(seen.contains(&ty), "fixture lacks a {ty} tensor");
    }
}

#[test]
fn tensor_infos_and_layout() {
    let file = GgufFile::open(FIXTURE).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    assert_eq!(file.tensors().len(), 16);

    let q6 = file.tensor_info("t.q6_k").unwrap();
    assert_eq!(q6.dims, vec![256, 1, 2]);
    assert_eq!(q6.shape(), vec![2, 1, 256]);
    assert_eq!(q6.n_elements(), 512);
    assert_eq!(q6.ty, GgmlType::Q6_K);
    assert_eq!(q6.n_bytes(), Some(2 * 210));
    assert!(q6.offset >= file.data_offset());
    assert_eq!(q6.offset % 64, 0);

    let raw = file.read_tensor_bytes(q6).unwrap();
    assert_eq!(raw.len(), 420);

    let total: u64 = file.tensors().iter().map(|t| t.n_bytes().unwrap()).sum();
    assert_eq!(file.tensor_data_bytes(), total);
    assert!(file.data_offset() + total <= file.file_len());
}

#[test]
fn metadata_reads_back() {
    let file = GgufFile::open(FIXTURE).unwrap();
    let m = file.metadata();
    assert_eq!(m["test.u8"], GgufValue::U8(200));
    assert_eq!(m["test.i8"], GgufValue::I8(-100));
    assert_eq!(m["test.u16"], GgufValue::U16(60000));
    assert_eq!(m["test.i16"], GgufValue::I16(-30000));
    assert_eq!(m["test.u32"], GgufValue::U32(4_000_000_000));
    assert_eq!(m["test.i32"], GgufValue::I32(-2_000_000_000));
    assert_eq!(m["test.u64"], GgufValue::U64((1 << 40) + 3));
    assert_eq!(m["test.i64"], GgufValue::I64(-(1 << 40)));
    assert_eq!(m["test.f32"], GgufValue::F32(1.5));
    assert_eq!(m["test.f64"], GgufValue::F64(0.1));
    assert_eq!(m["test.bool_true"], GgufValue::Bool(true));
    assert_eq!(m["test.bool_false"], GgufValue::Bool(false));
    assert_eq!(
        m["test.string"],
        GgufValue::String("h\u{e9}llo \u{2713} w\u{f6}rld".into())
    );
    assert_eq!(m["test.empty_string"], GgufValue::String(String::new()));
    assert_eq!(
        m["test.arr_nested"],
        GgufValue::Array(vec![
            GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(2)]),
            GgufValue::Array(vec![GgufValue::I32(3)]),
        ])
    );
    assert_eq!(
        m["test.arr_bool"],
        GgufValue::Array(vec![
            GgufValue::Bool(true),
            GgufValue::Bool(false),
            GgufValue::Bool(true)
        ])
    );

    // Typed getters.
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.get_str("general.name").unwrap(), "dequant fixture");
    assert_eq!(file.get_u64("test.u8").unwrap(), 200);
    assert_eq!(file.get_u64("test.u32").unwrap(), 4_000_000_000);
    assert_eq!(file.get_u64("test.u64").unwrap(), (1 << 40) + 3);
    assert_eq!(file.get_usize("llama.block_count").unwrap(), 2);
    assert_eq!(file.get_f32("test.f32").unwrap(), 1.5);
    assert_eq!(file.get_f32("test.f64").unwrap(), 0.1f64 as f32);
    assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert!(file.get_bool("test.bool_true").unwrap());
    assert!(!file.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(
        file.get_string_array("test.arr_str").unwrap(),
        vec!["a", "bb", "", "\u{fc}ml\u{e4}ut"]
    );
    assert_eq!(
        file.get_string_array("tokenizer.ggml.tokens").unwrap(),
        vec!["<unk>", "<s>", "</s>", "hello"]
    );
    assert_eq!(file.get_i32_array("test.arr_i32").unwrap(), vec![1, -2, 3]);
    assert_eq!(file.get_i32_array("test.arr_u8").unwrap(), vec![0, 7, 255]);
    assert_eq!(
        file.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        vec![2, 3, 3, 1]
    );
    assert_eq!(
        file.get_f32_array("tokenizer.ggml.scores").unwrap(),
        vec![0.0, -1.0, -2.0, -3.5]
    );
    assert_eq!(
        file.get_f32_array("test.arr_f32").unwrap(),
        vec![0.5, -1.25]
    );

    // Optional getters: absent is None, present is Some.
    assert_eq!(file.get_opt_u64("nope").unwrap(), None);
    assert_eq!(file.get_opt_f32("nope").unwrap(), None);
    assert_eq!(file.get_opt_str("nope").unwrap(), None);
    assert_eq!(file.get_opt_bool("nope").unwrap(), None);
    assert_eq!(file.get_opt_string_array("nope").unwrap(), None);
    assert_eq!(file.get_opt_i32_array("nope").unwrap(), None);
    assert_eq!(file.get_opt_u64("test.u16").unwrap(), Some(60000));
    assert_eq!(file.get_opt_bool("test.bool_false").unwrap(), Some(false));
    assert!(file.get("nope").is_none());
    assert_eq!(file.get("test.u8"), Some(&GgufValue::U8(200)));

    // Wrong types and missing keys are configuration errors.
    let config_err = |r: Result<(), LlamaError>| match r {
        Err(LlamaError::Config(msg)) => msg,
        other => panic!("expected a Config error, got {other:?}"),
    };
    let msg = config_err(file.get_u64("nope").map(drop));
    assert!(msg.contains("nope"), "{msg}");
    config_err(file.get_u64("test.i8").map(drop)); // negative
    config_err(file.get_u64("test.string").map(drop));
    config_err(file.get_opt_u64("test.f32").map(drop));
    config_err(file.get_str("test.u8").map(drop));
    config_err(file.get_bool("test.u8").map(drop));
    config_err(file.get_f32("test.string").map(drop));
    config_err(file.get_string_array("test.arr_i32").map(drop));
    config_err(file.get_string_array("test.string").map(drop));
    let msg = config_err(file.get_i32_array("test.arr_u32").map(drop)); // 4e9 > i32::MAX
    assert!(msg.contains("#1"), "{msg}");
    config_err(file.get_opt_i32_array("test.arr_str").map(drop));
}

#[test]
fn missing_tensor() {
    let file = GgufFile::open(FIXTURE).unwrap();
    assert!(file.tensor_info("nope").is_none());
    match file.read_tensor_f32("nope") {
        Err(LlamaError::MissingTensor(name)) => assert_eq!(name, "nope"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn truncated_copies_are_reported() {
    let bytes = fixture_bytes();
    let file = GgufFile::open(FIXTURE).unwrap();
    let data_offset = file.data_offset() as usize;
    // The file may end with padding after the last tensor; cutting that is harmless.
    let data_end = file
        .tensors()
        .iter()
        .map(|t| t.offset + t.n_bytes().unwrap())
        .max()
        .unwrap() as usize;
    let infos_start = {
        let mut needle = 5u64.to_le_bytes().to_vec();
        needle.extend_from_slice(b"t.f32");
        bytes
            .windows(needle.len())
            .position(|w| w == needle.as_slice())
            .unwrap()
    };
    assert!(24 < infos_start && infos_start < data_offset);

    // Every cut in the header, metadata and tensor infos, and a few in the tensor data.
    let mut cuts: Vec<usize> = (0..data_offset).collect();
    cuts.extend([
        data_offset,
        data_offset + 1,
        (data_offset + data_end) / 2,
        data_end - 1,
    ]);
    const TAG: &str = "truncated";
    for cut in cuts {
        let section = if cut < 24 {
            "header"
        } else if cut < infos_start {
            "metadata"
        } else if cut < data_offset {
            "tensor infos"
        } else {
            "tensor data"
        };
        match open_bytes(TAG, &bytes[..cut]) {
            Err(LlamaError::Truncated(msg)) => assert!(!msg.is_empty()),
            other => panic!("cut at {cut} ({section}): expected Truncated, got {other:?}"),
        }
    }
}

#[test]
fn wrong_magic_and_versions() {
    const TAG: &str = "magic";

    let mut bytes = fixture_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    match open_bytes(TAG, &bytes) {
        Err(LlamaError::InvalidFormat(msg)) => assert!(msg.contains("not a GGUF file"), "{msg}"),
        other => panic!("expected InvalidFormat, got {other:?}"),
    }

    let not_gguf = br#"{"model": "this is a JSON file, not a checkpoint"}"#;
    assert!(matches!(
        open_bytes(TAG, not_gguf),
        Err(LlamaError::InvalidFormat(_))
    ));
    assert!(matches!(
        open_bytes(TAG, b"PK"),
        Err(LlamaError::InvalidFormat(_))
    ));

    let mut bytes = fixture_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        open_bytes(TAG, &bytes),
        Err(LlamaError::InvalidFormat(_))
    ));
    bytes[4..8].copy_from_slice(&99u32.to_le_bytes());
    assert!(matches!(
        open_bytes(TAG, &bytes),
        Err(LlamaError::InvalidFormat(_))
    ));

    // Version 2 has the same layout as version 3.
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let file = open_bytes(TAG, &bytes).unwrap();
    assert_eq!(file.version(), 2);
    assert!(file.read_tensor_f32("t.q4_k").is_ok());

    match GgufFile::open(std::env::temp_dir().join("llama-burn-gguf-test-does-not-exist.gguf")) {
        Err(LlamaError::Io { .. }) => {}
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn unknown_tensor_type_opens_but_does_not_read() {
    let mut bytes = fixture_bytes();
    let at = tensor_type_field(&bytes, "t.patch_me");
    assert_eq!(&bytes[at..at + 4], &0u32.to_le_bytes()); // F32 in the fixture
    bytes[at..at + 4].copy_from_slice(&200u32.to_le_bytes());
    const TAG: &str = "unknown";
    let file = open_bytes(TAG, &bytes).expect("unknown types must not fail open");

    assert_eq!(file.architecture().unwrap(), "llama");
    let info = file.tensor_info("t.patch_me").unwrap();
    assert_eq!(info.ty, GgmlType::Unknown(200));
    assert_eq!(info.n_bytes(), None);
    match file.read_tensor_f32("t.patch_me") {
        Err(LlamaError::UnsupportedTensorType { name, ty }) => {
            assert_eq!(name, "t.patch_me");
            assert!(ty.contains("200"), "{ty}");
        }
        other => panic!("expected UnsupportedTensorType, got {other:?}"),
    }
    assert!(matches!(
        file.read_tensor_bytes(info),
        Err(LlamaError::UnsupportedTensorType { .. })
    ));
    // The other tensors are unaffected.
    assert!(file.read_tensor_f32("t.q6_k").is_ok());

    // A known type this crate does not dequantize: raw bytes yes, f32 no.
    bytes[at..at + 4].copy_from_slice(&GgmlType::I32.id().to_le_bytes());
    let file = open_bytes(TAG, &bytes).unwrap();
    let info = file.tensor_info("t.patch_me").unwrap();
    assert_eq!(file.read_tensor_bytes(info).unwrap().len(), 16);
    match file.read_tensor_f32("t.patch_me") {
        Err(LlamaError::UnsupportedTensorType { ty, .. }) => assert_eq!(ty, "I32"),
        other => panic!("expected UnsupportedTensorType, got {other:?}"),
    }
}

#[test]
fn block_type_with_bad_row_length_is_invalid() {
    // t.f32 is 3x5 (rows of 5): as Q8_0 its rows would not be whole blocks.
    let mut bytes = fixture_bytes();
    let at = tensor_type_field(&bytes, "t.f32");
    bytes[at..at + 4].copy_from_slice(&GgmlType::Q8_0.id().to_le_bytes());
    const TAG: &str = "rows";
    assert!(matches!(
        open_bytes(TAG, &bytes),
        Err(LlamaError::InvalidFormat(_))
    ));
}

#[test]
fn absurd_lengths_are_errors_not_allocations() {
    const TAG: &str = "absurd";
    let original = fixture_bytes();
    let huge = 1u64 << 60;

    // A string length of 2^60 (the value of general.architecture).
    let mut bytes = original.clone();
    let at = metadata_value_field(&bytes, "general.architecture");
    bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
    let err = open_bytes(TAG, &bytes).unwrap_err();
    assert!(
        matches!(err, LlamaError::Truncated(_) | LlamaError::InvalidFormat(_)),
        "{err:?}"
    );

    // An array of 2^60 strings.
    let mut bytes = original.clone();
    let at = metadata_value_field(&bytes, "tokenizer.ggml.tokens") + 4;
    bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
    let err = open_bytes(TAG, &bytes).unwrap_err();
    assert!(
        matches!(err, LlamaError::Truncated(_) | LlamaError::InvalidFormat(_)),
        "{err:?}"
    );

    // 2^60 tensors and 2^60 metadata entries.
    let mut bytes = original.clone();
    bytes[8..16].copy_from_slice(&huge.to_le_bytes());
    assert!(matches!(
        open_bytes(TAG, &bytes),
        Err(LlamaError::InvalidFormat(_))
    ));
    let mut bytes = original.clone();
    bytes[16..24].copy_from_slice(&huge.to_le_bytes());
    assert!(matches!(
        open_bytes(TAG, &bytes),
        Err(LlamaError::InvalidFormat(_))
    ));

    // A tensor dimension of 2^60.
    let mut bytes = original;
    let at = tensor_type_field(&bytes, "t.q4_k") - 16;
    bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
    let err = open_bytes(TAG, &bytes).unwrap_err();
    assert!(
        matches!(err, LlamaError::Truncated(_) | LlamaError::InvalidFormat(_)),
        "{err:?}"
    );
}

#[test]
fn corrupted_headers_never_panic() {
    let original = fixture_bytes();
    let data_offset = GgufFile::open(FIXTURE).unwrap().data_offset() as usize;
    const TAG: &str = "corrupt";
    for i in 0..data_offset {
        for v in [0xFFu8, 0x41] {
            let mut bytes = original.clone();
            bytes[i] ^= v;
            // Any result but a panic is fine; whatever opens must also read without panics.
            if let Ok(file) = open_bytes(TAG, &bytes) {
                for t in file.tensors() {
                    let _ = file.read_tensor_f32(&t.name);
                }
            }
        }
    }
}
