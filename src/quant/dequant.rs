//! Dequantization of ggml tensor data to `f32`.
//!
//! Every routine here follows ggml's reference (`dequantize_row_*`) semantics exactly:
//! block layouts, the packing of K-quant scales and minimums, the order of nibbles and
//! high bits, and the order of the floating-point operations, so the results are
//! bit-identical to ggml's and gguf-py's.
//!
//! Supported: `F32`, `F16`, `BF16`, `F64`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q2_K`,
//! `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`, `Q8_K`, `IQ4_NL` and `IQ4_XS`: the list is the
//! `decoder` table below, which [`GgmlType::can_dequantize`] reads too. Block layouts come
//! from the ggml type table ([`GgmlType`]).

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::QuantFormat;
use super::ggml::GgmlType;
use crate::error::{LlamaError, Result};

/// Number of values in a K-quant super-block.
const QK_K: usize = 256;

/// The 16 non-linear levels of `IQ4_NL` and `IQ4_XS`.
const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Dequantizes `n_elements` values of type `ty` stored in `bytes` into a new vector.
///
/// `bytes` must hold exactly the data of `n_elements` values (whole blocks for the
/// block-quantized types); anything else is an [`LlamaError::InvalidFormat`]. Types this
/// module cannot decode give [`LlamaError::UnsupportedTensorType`].
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    check(ty, bytes.len(), n_elements)?;
    let mut out = vec![0.0f32; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantizes the values of type `ty` stored in `bytes` into `out`, which must have room
/// for exactly as many values as `bytes` holds.
///
/// Errors as [`dequantize`] does; on error `out` may be partially written.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check(ty, bytes.len(), out.len())?;
    let decode = decoder(ty).ok_or_else(|| unsupported(ty))?;
    decode(bytes, out);
    Ok(())
}

/// Dequantizes whole blocks without [`dequantize_into`]'s checks, for callers that hold
/// checked blocks (the CPU kernels' formats): the values are the same. Types this module
/// cannot decode leave `out` untouched.
pub(crate) fn dequantize_block(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    if let Some(decode) = decoder(ty) {
        decode(bytes, out);
    }
}

/// Decodes whole blocks of one type from `bytes` into `out`.
pub(crate) type Decoder = fn(&[u8], &mut [f32]);

/// The types this module decodes, with the routine for each: the kept block formats'
/// from their rows in the format table ([`QuantFormat`]), and the others here.
fn decoder(ty: GgmlType) -> Option<Decoder> {
    if let Some(format) = QuantFormat::from_ggml(ty) {
        return Some(format.spec().dequantize);
    }
    Some(match ty {
        GgmlType::F32 => f32_le,
        GgmlType::F16 => f16_le,
        GgmlType::BF16 => bf16_le,
        GgmlType::F64 => f64_le,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q8_K => q8_k,
        GgmlType::IQ4_NL => iq4_nl,
        GgmlType::IQ4_XS => iq4_xs,
        _ => return None,
    })
}

impl GgmlType {
    /// Whether [`dequantize`] can turn this type into `f32` (answered by the
    /// dequantizer's own list, so the two cannot drift apart).
    pub fn can_dequantize(self) -> bool {
        decoder(self).is_some()
    }
}

fn unsupported(ty: GgmlType) -> LlamaError {
    LlamaError::UnsupportedTensorType {
        name: "(unnamed buffer)".to_string(),
        ty: ty.to_string(),
    }
}

/// Checks that `n_bytes` is exactly the storage of `n_elements` values of type `ty`.
fn check(ty: GgmlType, n_bytes: usize, n_elements: usize) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(unsupported(ty));
    }
    let (Some(block), Some(size)) = (ty.block_size(), ty.type_size()) else {
        return Err(unsupported(ty));
    };
    if !n_elements.is_multiple_of(block) {
        return Err(LlamaError::InvalidFormat(format!(
            "{n_elements} values of type {ty} are not a whole number of {block}-value blocks"
        )));
    }
    let expected = (n_elements / block).checked_mul(size);
    if expected != Some(n_bytes) {
        return Err(LlamaError::InvalidFormat(format!(
            "{n_elements} values of type {ty} take {} bytes, but {n_bytes} bytes were given",
            expected.map_or_else(|| "more than usize::MAX".to_string(), |e| e.to_string())
        )));
    }
    Ok(())
}

#[inline(always)]
pub(crate) fn f16_at(lo: u8, hi: u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

fn f32_le(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.as_chunks::<4>().0.iter().zip(out.iter_mut()) {
        *o = f32::from_le_bytes(*b);
    }
}

pub(crate) fn f16_le(bytes: &[u8], out: &mut [f32]) {
    // Gather into an aligned buffer so `half` can convert whole slices (with F16C where
    // the CPU has it) instead of one value at a time.
    const CHUNK: usize = 256;
    let mut buf = [f16::ZERO; CHUNK];
    for (src, dst) in bytes.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let buf = &mut buf[..dst.len()];
        for (h, b) in buf.iter_mut().zip(src.as_chunks::<2>().0) {
            *h = f16::from_le_bytes(*b);
        }
        buf.convert_to_f32_slice(dst);
    }
}

fn bf16_le(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.as_chunks::<2>().0.iter().zip(out.iter_mut()) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
    }
}

fn f64_le(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.as_chunks::<8>().0.iter().zip(out.iter_mut()) {
        *o = f64::from_le_bytes(*b) as f32;
    }
}

/// `Q4_0`: `d: f16, qs: [u8; 16]`; value `j` is the low nibble of `qs[j]`, value `j + 16`
/// its high nibble, both offset by -8.
pub(crate) fn q4_0(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<18>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let qs = &b[2..18];
        let (lo, hi) = o.split_at_mut(16);
        for ((q, l), h) in qs.iter().zip(lo.iter_mut()).zip(hi.iter_mut()) {
            *l = f32::from(i16::from(q & 0x0F) - 8) * d;
            *h = f32::from(i16::from(q >> 4) - 8) * d;
        }
    }
}

/// `Q4_1`: `d: f16, m: f16, qs: [u8; 16]`; `x = d * q + m` with the nibble order of `Q4_0`.
pub(super) fn q4_1(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<20>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let m = f16_at(b[2], b[3]);
        let qs = &b[4..20];
        let (lo, hi) = o.split_at_mut(16);
        for ((q, l), h) in qs.iter().zip(lo.iter_mut()).zip(hi.iter_mut()) {
            *l = f32::from(q & 0x0F) * d + m;
            *h = f32::from(q >> 4) * d + m;
        }
    }
}

/// `Q5_0`: `d: f16, qh: u32, qs: [u8; 16]`; bit `j` of `qh` is the fifth bit of value `j`.
pub(super) fn q5_0(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<22>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        let (lo, hi) = o.split_at_mut(16);
        for (j, ((q, l), h)) in qs.iter().zip(lo.iter_mut()).zip(hi.iter_mut()).enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            let x0 = (u32::from(q & 0x0F) | h0) as i32 - 16;
            let x1 = (u32::from(q >> 4) | h1) as i32 - 16;
            *l = x0 as f32 * d;
            *h = x1 as f32 * d;
        }
    }
}

/// `Q5_1`: `d: f16, m: f16, qh: u32, qs: [u8; 16]`; `x = d * q + m`.
pub(super) fn q5_1(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<24>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let m = f16_at(b[2], b[3]);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        let (lo, hi) = o.split_at_mut(16);
        for (j, ((q, l), h)) in qs.iter().zip(lo.iter_mut()).zip(hi.iter_mut()).enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            *l = (u32::from(q & 0x0F) | h0) as f32 * d + m;
            *h = (u32::from(q >> 4) | h1) as f32 * d + m;
        }
    }
}

/// `Q8_0`: `d: f16, qs: [i8; 32]`.
pub(crate) fn q8_0(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<34>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        for (q, x) in b[2..34].iter().zip(o.iter_mut()) {
            *x = f32::from(*q as i8) * d;
        }
    }
}

/// `Q2_K`: `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`. Each 16-value group has a
/// 4-bit scale (low nibble) and 4-bit minimum (high nibble); values are 2-bit fields.
fn q2_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<84>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let scales = &b[0..16];
        let d = f16_at(b[80], b[81]);
        let dmin = f16_at(b[82], b[83]);
        // Two halves of 128 values, each reading 32 bytes of `qs` four times (shifts
        // 0, 2, 4, 6); each pass covers two 16-value groups.
        for half in 0..2 {
            let qs = &b[16 + 32 * half..16 + 32 * (half + 1)];
            for pass in 0..4 {
                let shift = 2 * pass;
                for g in 0..2 {
                    let group = 8 * half + 2 * pass + g;
                    let sc = scales[group];
                    let dl = d * f32::from(sc & 0x0F);
                    let ml = dmin * f32::from(sc >> 4);
                    let dst = &mut o[16 * group..16 * group + 16];
                    for (x, q) in dst.iter_mut().zip(&qs[16 * g..16 * g + 16]) {
                        *x = dl * f32::from((q >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

/// `Q3_K`: `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`. Sixteen 6-bit signed
/// scales (offset 32); values are 2 low bits from `qs` plus a high bit from `hmask`
/// (a clear bit subtracts 4).
pub(super) fn q3_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<110>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let hmask = &b[0..32];
        let packed = &b[96..108];
        let d = f16_at(b[108], b[109]);
        let mut scales = [0i8; 16];
        for (i, s) in scales.iter_mut().enumerate() {
            let low = if i < 8 {
                packed[i] & 0x0F
            } else {
                packed[i - 8] >> 4
            };
            let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
            *s = ((low | (high << 4)) as i8).wrapping_sub(32);
        }
        for half in 0..2 {
            let qs = &b[32 + 32 * half..32 + 32 * (half + 1)];
            for pass in 0..4 {
                let shift = 2 * pass;
                let mask_bit = 1u8 << (4 * half + pass);
                for g in 0..2 {
                    let group = 8 * half + 2 * pass + g;
                    let dl = d * f32::from(scales[group]);
                    let dst = &mut o[16 * group..16 * group + 16];
                    let q_src = &qs[16 * g..16 * g + 16];
                    let h_src = &hmask[16 * g..16 * g + 16];
                    for ((x, q), h) in dst.iter_mut().zip(q_src).zip(h_src) {
                        let low = ((q >> shift) & 3) as i8;
                        let v = if h & mask_bit != 0 { low } else { low - 4 };
                        *x = dl * f32::from(v);
                    }
                }
            }
        }
    }
}

/// Unpacks the eight 6-bit scales and eight 6-bit minimums of a `Q4_K`/`Q5_K` block.
#[inline(always)]
pub(crate) fn k_scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            sc[j] = packed[j] & 63;
            mn[j] = packed[j + 4] & 63;
        } else {
            sc[j] = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
            mn[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// `Q4_K`: `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`. Eight 32-value groups;
/// each 32-byte chunk of `qs` holds two groups (low nibbles, then high nibbles).
pub(super) fn q4_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<144>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let dmin = f16_at(b[2], b[3]);
        let (sc, mn) = k_scales_mins(&b[4..16]);
        let qs = &b[16..144];
        for (chunk, (q, dst)) in qs.chunks_exact(32).zip(o.chunks_exact_mut(64)).enumerate() {
            let d1 = d * f32::from(sc[2 * chunk]);
            let m1 = dmin * f32::from(mn[2 * chunk]);
            let d2 = d * f32::from(sc[2 * chunk + 1]);
            let m2 = dmin * f32::from(mn[2 * chunk + 1]);
            let (lo, hi) = dst.split_at_mut(32);
            for ((q, l), h) in q.iter().zip(lo.iter_mut()).zip(hi.iter_mut()) {
                *l = d1 * f32::from(q & 0x0F) - m1;
                *h = d2 * f32::from(q >> 4) - m2;
            }
        }
    }
}

/// `Q5_K`: `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`; like `Q4_K`
/// with a fifth bit per value taken from `qh` (bit `g` of `qh[l]` for group `g`).
pub(super) fn q5_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<176>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let dmin = f16_at(b[2], b[3]);
        let (sc, mn) = k_scales_mins(&b[4..16]);
        let qh = &b[16..48];
        let qs = &b[48..176];
        for (chunk, (q, dst)) in qs.chunks_exact(32).zip(o.chunks_exact_mut(64)).enumerate() {
            let d1 = d * f32::from(sc[2 * chunk]);
            let m1 = dmin * f32::from(mn[2 * chunk]);
            let d2 = d * f32::from(sc[2 * chunk + 1]);
            let m2 = dmin * f32::from(mn[2 * chunk + 1]);
            let u1 = 1u8 << (2 * chunk);
            let u2 = 2u8 << (2 * chunk);
            let (lo, hi) = dst.split_at_mut(32);
            for (((q, h), l), hv) in q.iter().zip(qh).zip(lo.iter_mut()).zip(hi.iter_mut()) {
                let b1 = if h & u1 != 0 { 16 } else { 0 };
                let b2 = if h & u2 != 0 { 16 } else { 0 };
                *l = d1 * f32::from((q & 0x0F) + b1) - m1;
                *hv = d2 * f32::from((q >> 4) + b2) - m2;
            }
        }
    }
}

/// `Q6_K`: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`. Values are 4 low bits
/// from `ql` and 2 high bits from `qh`, offset by -32; one signed 8-bit scale per 16 values.
pub(super) fn q6_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<210>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[208], b[209]);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            let dst = &mut o[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let h = qh[l];
                let q1 = ((ql[l] & 0x0F) | ((h & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
                dst[l] = d * f32::from(sc[is] as i8) * f32::from(q1);
                dst[l + 32] = d * f32::from(sc[is + 2] as i8) * f32::from(q2);
                dst[l + 64] = d * f32::from(sc[is + 4] as i8) * f32::from(q3);
                dst[l + 96] = d * f32::from(sc[is + 6] as i8) * f32::from(q4);
            }
        }
    }
}

/// `Q8_K`: `d: f32, qs: [i8; 256], bsums: [i16; 16]` (the sums are not needed here).
fn q8_k(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<292>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (q, x) in b[4..260].iter().zip(o.iter_mut()) {
            *x = d * f32::from(*q as i8);
        }
    }
}

/// `IQ4_NL`: `d: f16, qs: [u8; 16]`; nibbles index a fixed table of 16 levels, in the
/// nibble order of `Q4_0`.
fn iq4_nl(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<18>().0;
    let outs = out.as_chunks_mut::<32>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let (lo, hi) = o.split_at_mut(16);
        for ((q, l), h) in b[2..18].iter().zip(lo.iter_mut()).zip(hi.iter_mut()) {
            *l = d * f32::from(IQ4_LEVELS[usize::from(q & 0x0F)]);
            *h = d * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
        }
    }
}

/// `IQ4_XS`: `d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]`; eight 32-value
/// groups with 6-bit scales (offset 32) and `IQ4_NL` levels.
fn iq4_xs(bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.as_chunks::<136>().0;
    let outs = out.as_chunks_mut::<QK_K>().0;
    for (b, o) in blocks.iter().zip(outs.iter_mut()) {
        let d = f16_at(b[0], b[1]);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let scales_l = &b[4..8];
        let qs = &b[8..136];
        for (ib, (q, dst)) in qs.chunks_exact(16).zip(o.chunks_exact_mut(32)).enumerate() {
            let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
            let high = ((scales_h >> (2 * ib)) & 3) as u8;
            let ls = i16::from(low | (high << 4)) - 32;
            let dl = d * f32::from(ls);
            let (lo, hi) = dst.split_at_mut(16);
            for ((q, l), h) in q.iter().zip(lo.iter_mut()).zip(hi.iter_mut()) {
                *l = dl * f32::from(IQ4_LEVELS[usize::from(q & 0x0F)]);
                *h = dl * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn length_mismatches_are_errors() {
        // One Q4_0 block is 18 bytes for 32 values.
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 18], 32).is_ok());
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 17], 32),
            Err(LlamaError::InvalidFormat(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 18], 31),
            Err(LlamaError::InvalidFormat(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::F32, &[0u8; 7], 2),
            Err(LlamaError::InvalidFormat(_))
        ));
        let mut out = [0.0f32; 3];
        assert_err!(
            dequantize_into(GgmlType::F16, &[0u8; 4], &mut out),
            LlamaError::InvalidFormat(m) if m.contains("take 6 bytes, but 4 bytes were given")
        );
        assert!(dequantize(GgmlType::F32, &[], 0).is_ok_and(|v| v.is_empty()));
    }

    #[test]
    fn unsupported_types_are_errors() {
        for ty in [
            GgmlType::Q8_1,
            GgmlType::IQ2_XXS,
            GgmlType::I32,
            GgmlType::Unknown(99),
        ] {
            assert!(matches!(
                dequantize(ty, &[0u8; 64], 16),
                Err(LlamaError::UnsupportedTensorType { .. })
            ));
        }
    }

    #[test]
    fn q4_0_nibble_order() {
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for j in 0..16 {
            block[2 + j] = (j as u8) | (((15 - j) as u8) << 4);
        }
        let out = dequantize(GgmlType::Q4_0, &block, 32).unwrap_or_default();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q8_k_scales_signed_values() {
        let mut block = vec![0u8; 292];
        block[..4].copy_from_slice(&0.25f32.to_le_bytes());
        for j in 0..256 {
            block[4 + j] = (j as u8).wrapping_sub(128);
        }
        let out = dequantize(GgmlType::Q8_K, &block, 256).unwrap_or_default();
        for (j, x) in out.iter().enumerate() {
            assert_eq!(*x, 0.25 * (j as f32 - 128.0));
        }
    }

    #[test]
    fn bf16_and_f64() {
        let bytes = [0x80, 0x3f, 0x00, 0xc0]; // 1.0, -2.0
        assert_eq!(
            dequantize(GgmlType::BF16, &bytes, 2).unwrap_or_default(),
            vec![1.0, -2.0]
        );
        let bytes: Vec<u8> = [1.5f64, -0.25]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::F64, &bytes, 2).unwrap_or_default(),
            vec![1.5, -0.25]
        );
    }
}
