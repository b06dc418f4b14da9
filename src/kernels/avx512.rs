//! The AVX-512 path of the CPU kernels (x86-64 with AVX-512 F/BW/VL, FMA and F16C).
//!
//! **Weights dequantized in registers.** Every block is decoded straight into 16-lane
//! registers with the same f32 operations, in the same order, as `quant::dequant` (a
//! multiply, then an add or subtract), so each weight is bitwise the loader's. The 4-bit
//! formats build their block's 16 possible values once (`T[q] = q * d + m` for Q4_1) and
//! look each nibble up with one `vpermps`, which reads only an index's low 4 bits: the
//! low nibbles need no mask and the high ones one shift. A projection of up to
//! [`FUSED_ROWS`] rows multiplies the decoded registers directly (nothing stored); more
//! rows decode each weight row once into a scratch row and reuse it for every row tile.
//!
//! **This path's reduction order.** A 16-lane accumulator takes a dot product's 16-value
//! chunks in order (`acc = fma(w[16k..16k+16], x[16k..16k+16], acc)`), then
//! `t[l] = acc[l] + acc[l + 8]` and `t` is finished as the AVX2 path finishes its 8-lane
//! accumulator (see the `cpu` module). The order is the same for every row count, tile and
//! thread, so results are batch-invariant to the bit; it differs from the AVX2 path's
//! 8-lane order, so the two paths agree to about 1e-6 relative, not to the bit.

use std::arch::x86_64::*;

use super::matrix::{GROUP_ROWS, QuantMatrix};
use super::tiling::MAX_TILE_ROWS;
use super::x86::{Vnni, transpose8};
use crate::quant::QuantFormat;
use crate::quant::dequant::k_scales_mins;

/// Most activation rows of a fused tile.
pub(crate) const FUSED_ROWS: usize = 4;

/// Most activation rows multiplied straight from registers, in fused tiles of up to
/// [`FUSED_ROWS`] (each tile decodes the weights again); more go through scratch rows.
/// Two fused passes beat scratch rows at 8 rows (see docs/src/cpu-kernels.md).
pub(crate) const FUSED_UP_TO: usize = 8;

/// Columns of a scratch tile: 6 x 4 accumulators, 4 weight registers and one activation
/// register (29 of 32), 10 loads per 24 multiply-adds.
const TILE_COLS: usize = 4;

/// Rows of a scratch tile.
const TILE_ROWS: usize = 6;

/// Values of each row that a scratch tile takes over [`SUM_COLS`] columns before the next
/// part: its rows' part stays in L1 (6 rows of 512 values, 12 KiB).
const PART: usize = 512;

/// Columns whose sums a scratch tile carries from one part of the values to the next
/// (32 columns of 6 rows of 16-lane sums: 12 KiB).
const SUM_COLS: usize = 32;

/// `0.0, 1.0, ..., 15.0`: the 4-bit values as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn iota() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// The f16 at `p` (little-endian) as f32, exactly.
///
/// # Safety
///
/// Two readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two bytes.
    let bits = i32::from(u16::from_le_bytes(unsafe { [*p, *p.add(1)] }));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// 16 bytes at `p` widened to 16 unsigned 32-bit lanes.
///
/// # Safety
///
/// 16 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn widen_u8(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 bytes.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Decodes one block of `F` and hands its values to `f` as 16-value chunks, in order:
/// `f(i, w)` gets values `16 i .. 16 i + 16`. For Q8_0, Q4_0 and Q4_1, `scales` holds
/// the block's scales as f32 (`d`, then `m` for Q4_1) and `q` its quantized values; the
/// K-quants read the whole block at `q` (`scales` unused).
///
/// # Safety
///
/// `q` points at the block's quantized values (16 or 32 bytes) or whole K-quant block,
/// `scales` at its scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn decode_block<const F: u8>(
    scales: *const f32,
    q: *const u8,
    mut f: impl FnMut(usize, __m512),
) {
    // SAFETY (every arm): offsets stay inside the block's values (32 bytes for Q8_0, 16
    // for Q4_0 and Q4_1, 144 and 210 for the K-quants) and its scales.
    unsafe {
        match F {
            Q8_0 => {
                // x = q * d
                let d = _mm512_set1_ps(*scales);
                for i in 0..2 {
                    let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(16 * i).cast()));
                    f(i, _mm512_mul_ps(_mm512_cvtepi32_ps(v), d));
                }
            }
            Q4_0 => {
                // x = (q - 8) * d: the 16 possible values, then a lookup per nibble.
                let d = _mm512_set1_ps(*scales);
                let t = _mm512_mul_ps(_mm512_sub_ps(iota(), _mm512_set1_ps(8.0)), d);
                let v = widen_u8(q);
                f(0, _mm512_permutexvar_ps(v, t));
                f(1, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), t));
            }
            Q4_1 => {
                // x = q * d + m
                let d = _mm512_set1_ps(*scales);
                let m = _mm512_set1_ps(*scales.add(1));
                let t = _mm512_add_ps(_mm512_mul_ps(iota(), d), m);
                let v = widen_u8(q);
                f(0, _mm512_permutexvar_ps(v, t));
                f(1, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), t));
            }
            Q4_K => {
                // Eight 32-value groups: x = (d * sc) * q - dmin * mn; group 2c takes the
                // low nibbles of bytes 16 + 32c .. 48 + 32c, group 2c + 1 the high ones.
                let b = q;
                let d = f16_at(b);
                let dmin = f16_at(b.add(2));
                let (sc, mn) = k_scales_mins(std::slice::from_raw_parts(b.add(4), 12));
                for g in 0..8 {
                    let scale = _mm512_set1_ps(d * f32::from(sc[g]));
                    let min = _mm512_set1_ps(dmin * f32::from(mn[g]));
                    let t = _mm512_sub_ps(_mm512_mul_ps(scale, iota()), min);
                    for h in 0..2 {
                        let v = widen_u8(b.add(16 + 32 * (g / 2) + 16 * h));
                        let v = if g % 2 == 0 {
                            v
                        } else {
                            _mm512_srli_epi32::<4>(v)
                        };
                        f(2 * g + h, _mm512_permutexvar_ps(v, t));
                    }
                }
            }
            Q6_K => {
                // 6-bit values offset by -32, x = (d * sc) * q with a scale per 16 values.
                // Chunk j: half j / 8, quarter k = (j % 8) / 2, sixteen l = j % 2; its low
                // 4 bits are nibbles of ql, its high 2 bits a bit pair of qh.
                let b = q;
                let d = f16_at(b.add(208));
                let low4 = _mm_set1_epi8(0x0F);
                let low2 = _mm_set1_epi8(0x03);
                let bias = _mm512_set1_epi32(32);
                for j in 0..16 {
                    let (half, k, l) = (j / 8, (j % 8) / 2, j % 2);
                    let ql = _mm_loadu_si128(b.add(64 * half + 32 * (k % 2) + 16 * l).cast());
                    let nib = if k < 2 {
                        _mm_and_si128(ql, low4)
                    } else {
                        _mm_and_si128(_mm_srli_epi16::<4>(ql), low4)
                    };
                    let qh = _mm_loadu_si128(b.add(128 + 32 * half + 16 * l).cast());
                    let hb = match k {
                        0 => _mm_and_si128(qh, low2),
                        1 => _mm_and_si128(_mm_srli_epi16::<2>(qh), low2),
                        2 => _mm_and_si128(_mm_srli_epi16::<4>(qh), low2),
                        _ => _mm_and_si128(_mm_srli_epi16::<6>(qh), low2),
                    };
                    let v = _mm_or_si128(nib, _mm_slli_epi16::<4>(hb));
                    let v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(v), bias);
                    let sc = f32::from(*b.add(192 + 8 * half + 2 * k + l) as i8);
                    f(
                        j,
                        _mm512_mul_ps(_mm512_set1_ps(d * sc), _mm512_cvtepi32_ps(v)),
                    );
                }
            }
            _ => unreachable_format(),
        }
    }
}

/// The scales of one step of a group (block `b` of each of its `n` rows) as f32, into
/// `out` (`n` values for Q8_0 and Q4_0, `2 n` for Q4_1; nothing for the K-quants).
///
/// # Safety
///
/// `heads` points at the step's `n * head_bytes` bytes of scales; `n <= 8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn step_scales<const F: u8>(heads: *const u8, n: usize, out: &mut [f32; 16]) {
    let count = match F {
        Q8_0 | Q4_0 => n,
        Q4_1 => 2 * n,
        _ => 0,
    };
    // SAFETY: `count` f16 values at `heads` (the caller's contract); `out` holds 16.
    unsafe {
        match count {
            16 => _mm512_storeu_ps(
                out.as_mut_ptr(),
                _mm512_cvtph_ps(_mm256_loadu_si256(heads.cast())),
            ),
            8 => _mm256_storeu_ps(
                out.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(heads.cast())),
            ),
            _ => {
                for (i, o) in out.iter_mut().take(count).enumerate() {
                    *o = f16_at(heads.add(2 * i));
                }
            }
        }
    }
}

/// The eight whole blocks (`bb` bytes each, one after another) of a word-interleaved
/// K-quant step (`QuantMatrix`'s layout) into `out`: the step's words transposed back,
/// eight (then four) words of the eight rows at a time, in registers.
///
/// # Safety
///
/// `step` holds a word-interleaved step of eight `bb`-byte blocks; `out` has room for
/// `8 bb` bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn ungroup_step(step: *const u8, bb: usize, out: *mut u8) {
    let words = bb / 4;
    let word = |w: usize| step.wrapping_add(32 * w);
    let mut w = 0;
    // SAFETY (every access): words `w .. w + 8` (or `+ 4`) of the step exist and land in
    // bytes `4 w ..` of each of the eight blocks of `out`; the tail follows the words.
    unsafe {
        while w + 8 <= words {
            // Words `w .. w + 8` of the eight rows, one vector per row: the shared
            // 8 x 8 transpose of 32-bit words.
            for (i, r) in transpose8::<Vnni>(|j| word(w + j)).into_iter().enumerate() {
                _mm256_storeu_si256(out.add(i * bb + 4 * w).cast(), r);
            }
            w += 8;
        }
        if w + 4 <= words {
            // Four words: per 128-bit half (rows i, i + 4), interleave, then pair up.
            let mut v = [_mm256_setzero_si256(); 4];
            for (j, v) in v.iter_mut().enumerate() {
                *v = _mm256_loadu_si256(word(w + j).cast());
            }
            let lo01 = _mm256_unpacklo_epi32(v[0], v[1]);
            let hi01 = _mm256_unpackhi_epi32(v[0], v[1]);
            let lo23 = _mm256_unpacklo_epi32(v[2], v[3]);
            let hi23 = _mm256_unpackhi_epi32(v[2], v[3]);
            let rows = [
                _mm256_unpacklo_epi64(lo01, lo23),
                _mm256_unpackhi_epi64(lo01, lo23),
                _mm256_unpacklo_epi64(hi01, hi23),
                _mm256_unpackhi_epi64(hi01, hi23),
            ];
            for (i, r) in rows.into_iter().enumerate() {
                _mm_storeu_si128(out.add(i * bb + 4 * w).cast(), _mm256_castsi256_si128(r));
                _mm_storeu_si128(
                    out.add((i + 4) * bb + 4 * w).cast(),
                    _mm256_extracti128_si256::<1>(r),
                );
            }
            w += 4;
        }
        for w in w..words {
            for i in 0..GROUP_ROWS {
                std::ptr::copy_nonoverlapping(word(w).add(4 * i), out.add(i * bb + 4 * w), 4);
            }
        }
        let tail = bb - 4 * words;
        for i in 0..GROUP_ROWS {
            std::ptr::copy_nonoverlapping(
                word(words).add(i * tail),
                out.add(i * bb + 4 * words),
                tail,
            );
        }
    }
}

#[cold]
fn unreachable_format() {
    debug_assert!(false, "format ids are only those of `format_of`");
}

const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q4_K: u8 = 3;
const Q6_K: u8 = 4;

/// The const id of a format in this file's kernels.
fn format_of(format: QuantFormat) -> u8 {
    match format {
        QuantFormat::Q8_0 => Q8_0,
        QuantFormat::Q4_0 => Q4_0,
        QuantFormat::Q4_1 => Q4_1,
        QuantFormat::Q4_K => Q4_K,
        // The callers send only the formats decoded in registers (`simd_decoded`).
        _ => Q6_K,
    }
}

/// Dequantizes rows `first .. first + count` of the group at `first` into `out`, row `c`
/// at `c * stride`, bitwise as the loader does, reading the group's blocks in memory
/// order.
///
/// # Safety
///
/// This path's CPU features; `first` starts a group of `w`, `count` is at most its rows,
/// `stride` at least `w.cols()`, and `out` holds `count` rows of `stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize_group(
    w: &QuantMatrix,
    first: usize,
    count: usize,
    stride: usize,
    out: &mut [f32],
) {
    debug_assert!(stride >= w.cols() && out.len() >= count * stride);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match format_of(w.format()) {
            Q8_0 => dequantize_group_as::<Q8_0>(w, first, count, stride, out),
            Q4_0 => dequantize_group_as::<Q4_0>(w, first, count, stride, out),
            Q4_1 => dequantize_group_as::<Q4_1>(w, first, count, stride, out),
            Q4_K => dequantize_group_as::<Q4_K>(w, first, count, stride, out),
            _ => dequantize_group_as::<Q6_K>(w, first, count, stride, out),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dequantize_group_as<const F: u8>(
    w: &QuantMatrix,
    first: usize,
    count: usize,
    stride: usize,
    out: &mut [f32],
) {
    let format = w.format();
    let (bv, bb, hb) = (
        format.block_values(),
        format.block_bytes(),
        format.head_bytes(),
    );
    let (group, n) = w.group(first);
    debug_assert!(count <= n);
    let per_scale = (hb / 2).max(1);
    let mut scales = [0f32; 16];
    // The K-quants' full groups are word-interleaved (`QuantFormat::interleaves_words`).
    let interleaved = (F == Q4_K || F == Q6_K) && n == GROUP_ROWS;
    let mut whole = [0u8; GROUP_ROWS * 210];
    let prefetch = super::tiling::GroupPrefetch::new(n * bb);
    for blk in 0..w.blocks_per_row() {
        // SAFETY: step `blk` of the group holds `n` blocks: their scales, then their
        // values (put back together into `whole` if interleaved); each row `c` writes
        // its block's `bv` values at `c * stride + blk * bv`.
        unsafe {
            let mut step = group.as_ptr().add(blk * n * bb);
            if interleaved {
                // A whole step (1 to 2 KiB) is read at once: ask for all of the next.
                prefetch.ask(step);
                ungroup_step(step, bb, whole.as_mut_ptr());
                step = whole.as_ptr();
            } else {
                super::tiling::prefetch_step(step);
            }
            step_scales::<F>(step, n, &mut scales);
            for c in 0..count {
                let dst = out.as_mut_ptr().add(c * stride + blk * bv);
                decode_block::<F>(
                    scales.as_ptr().add(c * per_scale),
                    step.add(n * hb + c * (bb - hb)),
                    |i, v| _mm512_storeu_ps(dst.add(16 * i), v),
                );
            }
        }
    }
}

/// This path's final sum of a 16-lane accumulator: `t[l] = acc[l] + acc[l + 8]`, then
/// `u[l] = t[l] + t[l + 4]` and `(u[0] + u[2]) + (u[1] + u[3])`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce(s: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
    let t = _mm256_add_ps(_mm512_castps512_ps256(s), hi);
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps::<1>(v, v)))
}

/// [`reduce`] of four accumulators at once, the same bits: the three halving steps run
/// on all four side by side (fewer shuffles per result).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // t = acc[0..8] + acc[8..16], two accumulators per register.
    let ab = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
    );
    let cd = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d),
    );
    // u = t[0..4] + t[4..8]: lanes 4k..4k+4 hold accumulator k's.
    let u = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
    );
    // (u[0] + u[2]) + (u[1] + u[3]) in every 4-lane group.
    let v = _mm512_add_ps(u, _mm512_permute_ps::<0b01_00_11_10>(u));
    let w = _mm512_add_ps(v, _mm512_permute_ps::<0b10_11_00_01>(v));
    // Lanes 0, 4, 8 and 12: the four results.
    let pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, w))
}

/// `out[r][c] = x[r] . W[c0 + c]` for `R` activation rows and `C` rows of the group at
/// `group` (`n` rows), each weight decoded once into registers and multiplied with every
/// activation row. The group is read in memory order, one step (block `b` of each of its
/// rows) after another.
///
/// # Safety
///
/// This path's CPU features; `group` holds `blocks` steps of `n` blocks of `F`,
/// `c0 + C <= n`, and every `x[r]` holds `blocks * block_values` values.
#[inline]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fused<const F: u8, const R: usize, const C: usize>(
    group: *const u8,
    n: usize,
    c0: usize,
    x: [*const f32; R],
    blocks: usize,
    format: QuantFormat,
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    let (bv, bb, hb) = (
        format.block_values(),
        format.block_bytes(),
        format.head_bytes(),
    );
    let per_scale = (hb / 2).max(1);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut scales = [0f32; 16];
    // The K-quants' full groups are word-interleaved (`QuantFormat::interleaves_words`).
    let interleaved = (F == Q4_K || F == Q6_K) && n == GROUP_ROWS;
    let mut whole = [0u8; GROUP_ROWS * 210];
    let prefetch = super::tiling::GroupPrefetch::new(n * bb);
    for blk in 0..blocks {
        // SAFETY: step `blk` of the group and its values in every activation row exist
        // (the caller's contract; an interleaved step is put back together into
        // `whole`); the prefetch address is only a hint.
        unsafe {
            let mut step = group.add(blk * n * bb);
            if interleaved {
                // A whole step (1 to 2 KiB) is read at once: ask for all of the next.
                prefetch.ask(step);
                ungroup_step(step, bb, whole.as_mut_ptr());
                step = whole.as_ptr();
            } else {
                super::tiling::prefetch_step(step);
            }
            step_scales::<F>(step, n, &mut scales);
            let xb: [*const f32; R] = std::array::from_fn(|r| x[r].add(blk * bv));
            for c in 0..C {
                let col = c0 + c;
                decode_block::<F>(
                    scales.as_ptr().add(col * per_scale),
                    step.add(n * hb + col * (bb - hb)),
                    |i, wv| {
                        for r in 0..R {
                            let xv = _mm512_loadu_ps(xb[r].add(16 * i));
                            acc[r][c] = _mm512_fmadd_ps(wv, xv, acc[r][c]);
                        }
                    },
                );
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            out[r][c] = reduce(acc[r][c]);
        }
    }
}

/// A fused tile: `out[r][c] = acts[r] . W[first + c0 + c]` for up to [`FUSED_ROWS`]
/// activation rows and `cols` weight rows of the group at `first`.
///
/// # Safety
///
/// This path's CPU features; `first` starts a group of `w`, `c0 + cols` rows of it
/// exist, and every activation row holds `w.cols()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn fused_tile(
    w: &QuantMatrix,
    first: usize,
    c0: usize,
    cols: usize,
    acts: &[&[f32]],
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match format_of(w.format()) {
            Q8_0 => fused_tile_as::<Q8_0>(w, first, c0, cols, acts, out),
            Q4_0 => fused_tile_as::<Q4_0>(w, first, c0, cols, acts, out),
            Q4_1 => fused_tile_as::<Q4_1>(w, first, c0, cols, acts, out),
            Q4_K => fused_tile_as::<Q4_K>(w, first, c0, cols, acts, out),
            _ => fused_tile_as::<Q6_K>(w, first, c0, cols, acts, out),
        }
    }
}

#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fused_tile_as<const F: u8>(
    w: &QuantMatrix,
    first: usize,
    c0: usize,
    cols: usize,
    acts: &[&[f32]],
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    let (group, n) = w.group(first);
    let g = group.as_ptr();
    let blocks = w.blocks_per_row();
    let f = w.format();
    debug_assert!(c0 + cols <= n && acts.iter().all(|a| a.len() == w.cols()));
    let x = |r: usize| acts[r].as_ptr();
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match (acts.len(), cols) {
            (1, 8) => fused::<F, 1, 8>(g, n, c0, [x(0)], blocks, f, out),
            (2, 8) => fused::<F, 2, 8>(g, n, c0, [x(0), x(1)], blocks, f, out),
            (3, 8) => fused::<F, 3, 8>(g, n, c0, [x(0), x(1), x(2)], blocks, f, out),
            (4, 4) => fused::<F, 4, 4>(g, n, c0, std::array::from_fn(x), blocks, f, out),
            (3, 4) => fused::<F, 3, 4>(g, n, c0, [x(0), x(1), x(2)], blocks, f, out),
            (2, 4) => fused::<F, 2, 4>(g, n, c0, [x(0), x(1)], blocks, f, out),
            (1, 4) => fused::<F, 1, 4>(g, n, c0, [x(0)], blocks, f, out),
            (r, c) => {
                // Remainders: one column at a time.
                for ci in 0..c {
                    let mut one = [[0f32; 8]; MAX_TILE_ROWS];
                    let c1 = c0 + ci;
                    match r {
                        1 => fused::<F, 1, 1>(g, n, c1, [x(0)], blocks, f, &mut one),
                        2 => fused::<F, 2, 1>(g, n, c1, [x(0), x(1)], blocks, f, &mut one),
                        3 => fused::<F, 3, 1>(g, n, c1, [x(0), x(1), x(2)], blocks, f, &mut one),
                        _ => {
                            fused::<F, 4, 1>(g, n, c1, std::array::from_fn(x), blocks, f, &mut one)
                        }
                    }
                    for ri in 0..r {
                        out[ri][ci] = one[ri][0];
                    }
                }
            }
        }
    }
}

/// The sums of `R` activation rows against `C` weight rows over values `k0..k1`, added
/// to `sums[c][r]` (their 16-lane accumulators, carried from the part before): the
/// multiply-adds of each accumulator are the whole row's, in order, whatever the parts.
///
/// # Safety
///
/// This path's CPU features; every row holds at least `k1` values, `k1 - k0` is a
/// multiple of 16, and `sums` points to `C` arrays of `R` accumulators.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_part<const R: usize, const C: usize>(
    w: [*const f32; C],
    x: [*const f32; R],
    k0: usize,
    k1: usize,
    sums: *mut [__m512; R],
) {
    // SAFETY: `sums` holds `C` arrays of `R` accumulators (the caller's contract).
    let mut acc: [[__m512; C]; R] =
        std::array::from_fn(|r| std::array::from_fn(|c| unsafe { (*sums.add(c))[r] }));
    let mut k = k0;
    while k < k1 {
        // SAFETY: `k + 16 <= k1` values in every row (the caller's contract). The C weight
        // chunks stay loaded and each row's chunk is read once.
        unsafe {
            let wv: [__m512; C] = std::array::from_fn(|c| _mm512_loadu_ps(w[c].add(k)));
            for r in 0..R {
                let xv = _mm512_loadu_ps(x[r].add(k));
                for c in 0..C {
                    acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
                }
            }
        }
        k += 16;
    }
    for c in 0..C {
        for r in 0..R {
            // SAFETY: as above.
            unsafe { (*sums.add(c))[r] = acc[r][c] };
        }
    }
}

/// Every column tile of `R` activation rows: `out[r * stride + c] = x[r] . w[c]` for the
/// `cols` weight rows at `w` (`n` values each, row `c` at `c * ws`). The columns are taken
/// [`SUM_COLS`] at a time, and their values [`PART`] at a time over all of those columns
/// (the rows' part then stays in L1 while the columns' parts come from L2), the sums
/// carried between parts.
///
/// # Safety
///
/// As [`panel`], for these `R` rows.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn panel_rows<const R: usize>(
    w: *const f32,
    ws: usize,
    cols: usize,
    x: [*const f32; R],
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut c0 = 0;
    while c0 < cols {
        let count = SUM_COLS.min(cols - c0);
        let mut sums = [[_mm512_setzero_ps(); R]; SUM_COLS];
        let sp = sums.as_mut_ptr();
        let mut k0 = 0;
        while k0 < n {
            let k1 = (k0 + PART).min(n);
            let mut c = 0;
            // SAFETY: weight rows `c0 + c ..` (+ 4, or 1) exist and hold `n` values; their
            // sums are `sums[c ..]`, within `count <= SUM_COLS` (the caller's contract).
            unsafe {
                while c + TILE_COLS <= count {
                    let wc = std::array::from_fn(|i| w.add((c0 + c + i) * ws));
                    tile_part::<R, TILE_COLS>(wc, x, k0, k1, sp.add(c));
                    c += TILE_COLS;
                }
                while c < count {
                    tile_part::<R, 1>([w.add((c0 + c) * ws)], x, k0, k1, sp.add(c));
                    c += 1;
                }
            }
            k0 = k1;
        }
        for r in 0..R {
            // SAFETY: row `r` of the output has room for columns `c0 .. c0 + count` (the
            // caller's contract).
            unsafe {
                let dst = out.add(r * stride + c0);
                let mut c = 0;
                while c + 4 <= count {
                    let s = reduce4(sums[c][r], sums[c + 1][r], sums[c + 2][r], sums[c + 3][r]);
                    _mm_storeu_ps(dst.add(c), s);
                    c += 4;
                }
                while c < count {
                    *dst.add(c) = reduce(sums[c][r]);
                    c += 1;
                }
            }
        }
        c0 += count;
    }
}

/// A panel of f32 weight rows (scratch rows, row `c` at `c * ws`) times every activation
/// row: `out[r * stride + c] = x[r] . w[c]` for the `rows` rows of `x` and the `cols` rows
/// of `w`, all of `n` values (a multiple of 16). Each row tile (up to [`TILE_ROWS`] rows,
/// balanced so that none is much smaller than the others: 32 rows are 6, 6, 5, 5, 5, 5)
/// runs over the panel's columns [`SUM_COLS`] at a time and [`PART`] values at a time, so
/// its rows' part stays in L1 while the panel's rows come from L2.
///
/// # Safety
///
/// This path's CPU features; `w` holds `cols` rows of `ws >= n` values, `x` holds `rows *
/// n`, and `out` has room for `rows` rows of `stride` values from `cols` columns on, which
/// no other thread writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn panel(
    w: &[f32],
    ws: usize,
    cols: usize,
    x: &[f32],
    rows: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(n.is_multiple_of(16) && ws >= n && w.len() >= cols * ws && x.len() >= rows * n);
    let (w, x) = (w.as_ptr(), x.as_ptr());
    for (r0, r1) in super::tiling::balanced_row_tiles(rows, TILE_ROWS) {
        // SAFETY: rows `r0..r1` of `x` and of `out` exist (the caller's contract).
        unsafe {
            let xr = |i: usize| x.add((r0 + i) * n);
            let o = out.add(r0 * stride);
            match r1 - r0 {
                6 => panel_rows::<6>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                5 => panel_rows::<5>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                4 => panel_rows::<4>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                3 => panel_rows::<3>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                2 => panel_rows::<2>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                _ => panel_rows::<1>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
            }
        }
    }
}

/// [`super::avx2::dot_tile`] for four queries on 512-bit vectors: two keys in each
/// accumulator (their eight lanes each, the query's eight values broadcast to both
/// halves), so each fused multiply-add takes two of the 8-lane chains: every lane's
/// operations are the 8-lane order's, the same bits as four [`super::avx2::dot4`]
/// calls, in half the instructions.
///
/// # Safety
///
/// AVX-512 F/VL, AVX2, FMA and F16C; every slice holds `q[0].len()` values, a multiple of 8.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn dot_tile4(q: [&[f32]; 4], k: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let n = q[0].len();
    debug_assert!(n.is_multiple_of(8) && q.iter().chain(&k).all(|v| v.len() == n));
    // `acc[g][p]`: query `g` with keys `2p` (low half) and `2p + 1` (high half).
    let mut acc = [[_mm512_setzero_ps(); 2]; 4];
    let mut i = 0;
    while i < n {
        // SAFETY: `i + 8 <= n` values in every slice (the caller's contract).
        unsafe {
            let kv: [__m512; 2] = std::array::from_fn(|p| {
                // (The 64-bit forms of the 256-bit insert and broadcast need only
                // AVX-512 F; the bits are moved as they are.)
                let low = _mm512_castpd256_pd512(_mm256_loadu_pd(k[2 * p].as_ptr().add(i).cast()));
                let high = _mm256_loadu_pd(k[2 * p + 1].as_ptr().add(i).cast());
                _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, high))
            });
            for g in 0..4 {
                let qv = _mm256_loadu_pd(q[g].as_ptr().add(i).cast());
                let qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(qv));
                for p in 0..2 {
                    acc[g][p] = _mm512_fmadd_ps(qv, kv[p], acc[g][p]);
                }
            }
        }
        i += 8;
    }
    let halves = |a: [__m512; 2]| {
        [
            _mm512_castps512_ps256(a[0]),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a[0]))),
            _mm512_castps512_ps256(a[1]),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a[1]))),
        ]
    };
    let mut out = [[0f32; 4]; 4];
    for g in (0..4).step_by(2) {
        let [a, b] = [halves(acc[g]), halves(acc[g + 1])];
        let sums = super::avx2::reduce8([a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]);
        let mut both = [0f32; 8];
        // SAFETY: `both` holds eight values.
        unsafe { _mm256_storeu_ps(both.as_mut_ptr(), sums) };
        out[g] = [both[0], both[1], both[2], both[3]];
        out[g + 1] = [both[4], both[5], both[6], both[7]];
    }
    out
}
