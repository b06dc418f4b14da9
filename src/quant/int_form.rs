//! Each block format's integer form, as the `fast` precision's kernels read it
//! (`kernels::int8`): a block is cut into 32-value sub-blocks of unsigned bytes
//! `u = q + offset` (0..=255) with an integer scale per 16-value half, a float scale
//! `d` and, for the formats with a minimum, a float coefficient `m` of the activations'
//! sum. The decoders here are the one place that reads a format's bit layout for the
//! integer kernels, mirroring its dequantization ([`super::dequant`]); each format's row
//! in [`super`]'s table names its decoder and its [`IntForm`].

use super::dequant::{f16_at, k_scales_mins};

/// Values per activation block and per weight sub-block.
pub(crate) const QK: usize = 32;

/// How a format's sub-blocks scale their integer sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntScales {
    /// No integer scale (it is 1).
    One,
    /// One integer scale per 32-value sub-block.
    PerBlock,
    /// One integer scale per 16-value half.
    PerHalf,
}

/// A weight format's integer form.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IntForm {
    /// Added to the format's signed values to make them unsigned bytes.
    pub(crate) offset: i32,
    /// How the integer sums are scaled.
    pub(crate) scales: IntScales,
    /// Whether the format has a minimum (`m`).
    pub(crate) mins: bool,
    /// The largest value `u` takes (15 for the 4-bit formats, 63 for Q6_K): AVX2's
    /// kernels add byte products in 16 bits while this bound says they cannot overflow.
    pub(crate) max: i32,
    /// Sub-blocks in a run that shares one activation scale and whose scaled integer
    /// sums are added exactly before one float step: 8 (a super-block of 256 values)
    /// for the K-quants, whose activations are quantized per 256 values as ggml's
    /// `Q8_K` is; 1 for the 32-value formats (activations per 32 values, as `Q8_0`).
    pub(crate) run: usize,
}

/// One 32-value sub-block of weights in its integer form.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sub {
    /// The values plus the format's offset.
    pub(crate) u: [u8; QK],
    /// The integer scales of the two 16-value halves.
    pub(crate) sc: [i32; 2],
    /// The float scale of the integer sum.
    pub(crate) d: f32,
    /// The coefficient of the activations' sum (0 without a minimum).
    pub(crate) m: f32,
}

/// Decodes one ggml block into its sub-blocks (1 or 8 of `out`).
pub(crate) type IntDecoder = fn(&[u8], &mut [Sub; 8]);

/// Low nibbles of `qs` to values 0..16, high nibbles to 16..32.
fn nibbles(qs: &[u8], u: &mut [u8; QK]) {
    for (j, q) in qs.iter().enumerate().take(16) {
        u[j] = q & 0x0F;
        u[j + 16] = q >> 4;
    }
}

/// Adds bit `j` of `qh` as the fifth bit of value `j`.
fn fifth(qh: u32, u: &mut [u8; QK]) {
    for (j, v) in u.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
}

/// The head of a 32-value block: its scale and, if `head` is 4 bytes, its minimum.
fn head_sub(b: &[u8], head: usize) -> Sub {
    Sub {
        d: f16_at(b[0], b[1]),
        m: if head == 4 { f16_at(b[2], b[3]) } else { 0.0 },
        sc: [1, 1],
        ..Sub::default()
    }
}

/// `Q8_0`: the signed bytes offset by 128.
pub(super) fn q8_0(b: &[u8], out: &mut [Sub; 8]) {
    let o = &mut out[0];
    *o = head_sub(b, 2);
    for (u, &q) in o.u.iter_mut().zip(&b[2..34]) {
        *u = q ^ 0x80; // (q as i8) + 128
    }
}

/// `Q4_0` and `Q4_1` (`head` 2 or 4 bytes): the nibbles.
fn q4(b: &[u8], head: usize, out: &mut [Sub; 8]) {
    out[0] = head_sub(b, head);
    nibbles(&b[head..head + 16], &mut out[0].u);
}

/// `Q4_0`.
pub(super) fn q4_0(b: &[u8], out: &mut [Sub; 8]) {
    q4(b, 2, out);
}

/// `Q4_1`.
pub(super) fn q4_1(b: &[u8], out: &mut [Sub; 8]) {
    q4(b, 4, out);
}

/// `Q5_0` and `Q5_1` (`head` 2 or 4 bytes): the nibbles and the fifth bits.
fn q5(b: &[u8], head: usize, out: &mut [Sub; 8]) {
    out[0] = head_sub(b, head);
    let qh = u32::from_le_bytes([b[head], b[head + 1], b[head + 2], b[head + 3]]);
    nibbles(&b[head + 4..head + 20], &mut out[0].u);
    fifth(qh, &mut out[0].u);
}

/// `Q5_0`.
pub(super) fn q5_0(b: &[u8], out: &mut [Sub; 8]) {
    q5(b, 2, out);
}

/// `Q5_1`.
pub(super) fn q5_1(b: &[u8], out: &mut [Sub; 8]) {
    q5(b, 4, out);
}

/// `Q4_K` and `Q5_K` (`five`): eight sub-blocks with 6-bit scales and minimums.
fn k4(b: &[u8], five: bool, out: &mut [Sub; 8]) {
    let (d, dmin) = (f16_at(b[0], b[1]), f16_at(b[2], b[3]));
    let (sc, mn) = k_scales_mins(&b[4..16]);
    let (qh, qs) = if five {
        (&b[16..48], &b[48..176])
    } else {
        (&b[0..0], &b[16..144])
    };
    for (s, sub) in out.iter_mut().enumerate() {
        let (chunk, high) = (s / 2, s % 2 == 1);
        *sub = Sub {
            d,
            m: -(dmin * f32::from(mn[s])),
            sc: [i32::from(sc[s]); 2],
            ..Sub::default()
        };
        for (l, u) in sub.u.iter_mut().enumerate() {
            let q = qs[32 * chunk + l];
            *u = if high { q >> 4 } else { q & 0x0F };
            if five && qh[l] & (1 << s) != 0 {
                *u += 16;
            }
        }
    }
}

/// `Q4_K`.
pub(super) fn q4_k(b: &[u8], out: &mut [Sub; 8]) {
    k4(b, false, out);
}

/// `Q5_K`.
pub(super) fn q5_k(b: &[u8], out: &mut [Sub; 8]) {
    k4(b, true, out);
}

/// `Q6_K`: 6-bit values offset by 32, sixteen signed 8-bit scales.
pub(super) fn q6_k(b: &[u8], out: &mut [Sub; 8]) {
    let d = f16_at(b[208], b[209]);
    for (s, sub) in out.iter_mut().enumerate() {
        let (half, j) = (s / 4, s % 4);
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        *sub = Sub {
            d,
            sc: [i32::from(sc[2 * j] as i8), i32::from(sc[2 * j + 1] as i8)],
            ..Sub::default()
        };
        for (l, u) in sub.u.iter_mut().enumerate() {
            let low = if j % 2 == 0 { ql[l] } else { ql[l + 32] };
            let low = if j < 2 { low & 0x0F } else { low >> 4 };
            *u = low | (((qh[l] >> (2 * j)) & 3) << 4);
        }
    }
}

/// `Q3_K`: 2-bit values with a high-bit mask, offset by 4; sixteen 6-bit scales.
pub(super) fn q3_k(b: &[u8], out: &mut [Sub; 8]) {
    let (hmask, packed) = (&b[0..32], &b[96..108]);
    let d = f16_at(b[108], b[109]);
    let scale = |i: usize| {
        let low = if i < 8 {
            packed[i] & 0x0F
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        i32::from((low | (high << 4)) as i8) - 32
    };
    for (s, sub) in out.iter_mut().enumerate() {
        let (half, pass) = (s / 4, s % 4);
        let qs = &b[32 + 32 * half..64 + 32 * half];
        let bit = 1u8 << (4 * half + pass);
        *sub = Sub {
            d,
            sc: [scale(2 * s), scale(2 * s + 1)],
            ..Sub::default()
        };
        for (l, u) in sub.u.iter_mut().enumerate() {
            let low = (qs[l] >> (2 * pass)) & 3;
            *u = if hmask[l] & bit != 0 { low + 4 } else { low };
        }
    }
}
