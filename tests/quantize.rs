//! Our quantizers against ggml's reference, through blocks that gguf-py's quantizer
//! wrote (`tests/fixtures/quantize_ggml.json`: random, zero, constant, tie-prone and
//! f16-subnormal blocks); and a checkpoint quantized in memory at load.

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
    for format in QUANTIZERS {
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

#[test]
fn the_k_quants_have_no_quantizer_yet() {
    for format in [
        QuantFormat::Q3_K,
        QuantFormat::Q4_K,
        QuantFormat::Q5_K,
        QuantFormat::Q6_K,
    ] {
        assert!(quantize(format, &[0.5; 256]).is_err(), "{format:?}");
    }
}
