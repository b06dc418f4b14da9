//! Our own quantizers of the 32-value formats (`Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`),
//! and [`quantize`], which runs any format's quantizer (the K-quants' are in
//! `kquant.rs`; each format's row in the table of [`super`] names its own).
//!
//! The 32-value formats follow ggml's reference quantization (`quantize_row_*_ref`)
//! operation for operation, so their bytes are ggml's and gguf-py's to the bit
//! (`tests/integration/quantize.rs` checks them against blocks gguf-py wrote).

use half::f16;

use super::QuantFormat;
use crate::error::{LlamaError, Result};

/// The formats [`quantize`] writes: every [`QuantFormat`].
pub const QUANTIZERS: [QuantFormat; QuantFormat::ALL.len()] = QuantFormat::ALL;

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
    let encode = format.spec().quantize;
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
pub(super) fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + 34, 0);
    q8_0_into(x, &mut out[at..]);
}

/// [`q8_0`] of one 32-value block into its 34 bytes.
pub(crate) fn q8_0_into(x: &[f32], out: &mut [u8]) {
    let (_, amax) = signed_max(x);
    let d = amax / 127.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// `Q4_0`: `d = max / -8` (the value of largest magnitude), nibbles `min(15, x / d + 8.5)`
/// truncated.
pub(super) fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + 18, 0);
    q4_0_into(x, &mut out[at..]);
}

/// [`q4_0`] of one 32-value block into its 18 bytes.
pub(crate) fn q4_0_into(x: &[f32], out: &mut [u8]) {
    let (max, _) = signed_max(x);
    let d = max / -8.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for (j, o) in out[2..18].iter_mut().enumerate() {
        *o = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// `Q4_1`: `d = (max - min) / 15`, `m = min`, nibbles `min(15, (x - min) / d + 0.5)`.
pub(super) fn q4_1(x: &[f32], out: &mut Vec<u8>) {
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
pub(super) fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -16.0;
    let id = inverse(d);
    push_f16(out, d);
    let q: [u8; 32] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
    out.extend(fifth_bits(&q));
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

/// `Q5_1`: `d = (max - min) / 31`, `m = min`, values `(x - min) / d + 0.5` truncated.
pub(super) fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    push_f16(out, d);
    push_f16(out, min);
    let q: [u8; 32] = std::array::from_fn(|j| ((x[j] - min) * id + 0.5) as u8);
    out.extend(fifth_bits(&q));
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}
