//! Our own quantizers: f32 weights into ggml block formats, for in-memory quantization
//! at load ([`QuantizingSource`]: a safetensors checkpoint run as Q8_0 or Q4_0 without a
//! conversion step, as mistral.rs's in-situ quantization does).
//!
//! The 32-value formats follow ggml's reference quantization (`quantize_row_*_ref`)
//! operation for operation, so their bytes are ggml's and gguf-py's to the bit
//! (`tests/integration/quantize.rs` checks them against blocks gguf-py wrote). The K-quants
//! (`Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`, in `kquant.rs`) follow ggml's reference K-quant
//! quantizers the same way (gguf-py has none; the test's blocks come from ggml itself).

use half::f16;

use super::{TensorSource, kquant};
use crate::error::{LlamaError, Result};
use crate::kernels::{QuantFormat, QuantMatrix};

/// The formats [`quantize`] writes: every [`QuantFormat`].
pub const QUANTIZERS: [QuantFormat; 9] = [
    QuantFormat::Q8_0,
    QuantFormat::Q4_0,
    QuantFormat::Q4_1,
    QuantFormat::Q5_0,
    QuantFormat::Q5_1,
    QuantFormat::Q3_K,
    QuantFormat::Q4_K,
    QuantFormat::Q5_K,
    QuantFormat::Q6_K,
];

/// Quantizes `values` (whole blocks: 32 values, or 256 for the K-quants) into
/// `format`'s blocks, as ggml's reference quantization does.
///
/// # Errors
///
/// [`LlamaError::InvalidParameter`] if `values` is not a whole number of `format`'s
/// blocks.
pub fn quantize(format: QuantFormat, values: &[f32]) -> Result<Vec<u8>> {
    let block = format.block_values();
    if !values.len().is_multiple_of(block) {
        return Err(LlamaError::invalid(
            "quantize",
            values.len(),
            "not a whole number of the format's blocks (32 values; 256 for the K-quants)",
        ));
    }
    let encode: fn(&[f32], &mut Vec<u8>) = match format {
        QuantFormat::Q8_0 => q8_0,
        QuantFormat::Q4_0 => q4_0,
        QuantFormat::Q4_1 => q4_1,
        QuantFormat::Q5_0 => q5_0,
        QuantFormat::Q5_1 => q5_1,
        QuantFormat::Q3_K => kquant::q3_k,
        QuantFormat::Q4_K => kquant::q4_k,
        QuantFormat::Q5_K => kquant::q5_k,
        QuantFormat::Q6_K => kquant::q6_k,
    };
    let mut out = Vec::with_capacity(values.len() / block * format.block_bytes());
    for x in values.chunks_exact(block) {
        encode(x, &mut out);
    }
    Ok(out)
}

/// The value of largest magnitude (the first of equal ones) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// The smallest and largest values.
fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| {
        (if v < lo { v } else { lo }, if v > hi { v } else { hi })
    })
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `Q8_0`: `d = max|x| / 127`, `q = round(x / d)`.
fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let (_, amax) = signed_max(x);
    let d = amax / 127.0;
    let id = inverse(d);
    push_f16(out, d);
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// `Q4_0`: `d = max / -8` (the value of largest magnitude), nibbles `min(15, x / d + 8.5)`
/// truncated.
fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -8.0;
    let id = inverse(d);
    push_f16(out, d);
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

/// `Q4_1`: `d = (max - min) / 15`, `m = min`, nibbles `min(15, (x - min) / d + 0.5)`.
fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    push_f16(out, d);
    push_f16(out, min);
    let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

/// The fifth bits of 32 five-bit values, bit `j` for value `j`.
fn fifth_bits(q: &[u8; 32]) -> [u8; 4] {
    let bits = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (j, &v)| h | (u32::from(v >> 4) & 1) << j);
    bits.to_le_bytes()
}

/// `Q5_0`: `d = max / -16`, values `min(31, x / d + 16.5)` truncated.
fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -16.0;
    let id = inverse(d);
    push_f16(out, d);
    let q: [u8; 32] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
    out.extend(fifth_bits(&q));
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

/// `Q5_1`: `d = (max - min) / 31`, `m = min`, values `(x - min) / d + 0.5` truncated.
fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    push_f16(out, d);
    push_f16(out, min);
    let q: [u8; 32] = std::array::from_fn(|j| ((x[j] - min) * id + 0.5) as u8);
    out.extend(fifth_bits(&q));
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

impl QuantMatrix {
    /// Quantizes a row-major `[rows, cols]` f32 matrix into `format` (see [`quantize`]).
    ///
    /// # Errors
    ///
    /// As [`quantize`], and [`LlamaError::InvalidFormat`] if `values` is not `rows`
    /// rows of `cols`.
    pub fn quantize(format: QuantFormat, rows: usize, cols: usize, values: &[f32]) -> Result<Self> {
        let block = format.block_values();
        if Some(values.len()) != rows.checked_mul(cols) || !cols.is_multiple_of(block) {
            return Err(LlamaError::InvalidFormat(format!(
                "{} values are not {rows} rows of {cols} (a multiple of {block})",
                values.len()
            )));
        }
        QuantMatrix::new(format, rows, cols, quantize(format, values)?)
    }
}

/// A [`TensorSource`] whose 2-D tensors that are not already in a kept block format
/// (f32, f16 or bf16 checkpoints) are quantized into `format` as they are read: the
/// projections, the embedding and the output head; norms stay f32. A matrix whose rows
/// are not a whole number of `format`'s blocks (a K-quant's 256 values) stays dense.
pub struct QuantizingSource<'a> {
    inner: &'a mut dyn TensorSource,
    format: QuantFormat,
}

impl<'a> QuantizingSource<'a> {
    /// Quantizes `inner`'s matrices into `format`.
    ///
    /// # Errors
    ///
    /// None today (every [`QuantFormat`] has a quantizer, [`QUANTIZERS`]); kept so a
    /// format without one can be refused.
    pub fn new(inner: &'a mut dyn TensorSource, format: QuantFormat) -> Result<Self> {
        quantize(format, &[])?;
        Ok(Self { inner, format })
    }
}

impl TensorSource for QuantizingSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.inner.read(name)
    }

    fn read_quantized(&mut self, name: &str) -> Result<Option<QuantMatrix>> {
        if let Some(m) = self.inner.read_quantized(name)? {
            return Ok(Some(m));
        }
        let (shape, values) = self.inner.read(name)?;
        match shape.as_slice() {
            [rows, cols] if cols.is_multiple_of(self.format.block_values()) => {
                QuantMatrix::quantize(self.format, *rows, *cols, &values).map(Some)
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_dequantize_close_to_their_values() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for format in QUANTIZERS {
            let m = QuantMatrix::quantize(format, 1, 256, &x).unwrap();
            let back = m.dequantize().unwrap();
            let step = match format {
                QuantFormat::Q8_0 => 3.0 / 127.0,
                QuantFormat::Q6_K => 6.0 / 63.0,
                QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::Q5_K => 6.0 / 31.0,
                QuantFormat::Q3_K => 6.0 / 7.0,
                _ => 6.0 / 15.0,
            };
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= step, "{format:?}: {a} -> {b}");
            }
        }
    }

    #[test]
    fn partial_blocks_are_errors() {
        assert!(quantize(QuantFormat::Q4_K, &[0.0; 128]).is_err());
        assert!(QuantMatrix::quantize(QuantFormat::Q6_K, 2, 128, &[0.0; 256]).is_err());
        assert!(quantize(QuantFormat::Q8_0, &[0.0; 33]).is_err());
        assert!(QuantMatrix::quantize(QuantFormat::Q8_0, 2, 32, &[0.0; 32]).is_err());
        // An all-zero block has scale 0 and zero values.
        assert_eq!(
            quantize(QuantFormat::Q8_0, &[0.0; 32]).unwrap(),
            vec![0; 34]
        );
    }
}
