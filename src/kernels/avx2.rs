//! The AVX2 + FMA + F16C path of the CPU kernels (x86-64).
//!
//! Dequantization computes every weight with the same f32 operations, in the same order,
//! as `quant::dequant` (a multiply, then an add or subtract), so the scratch row is
//! bitwise the loader's. The dot products follow the canonical order described in
//! the `cpu` module. One row of the 32-value formats is multiplied straight from the
//! registers its blocks are decoded into ([`fused_row`]), with the same operations and
//! order, so the bits are the scratch path's.

use std::arch::x86_64::*;

use super::matrix::QuantMatrix;
use crate::quant::QuantFormat;
use crate::quant::dequant::k_scales_mins;

/// An f16 (little-endian bytes) to f32, exactly.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16(lo: u8, hi: u8) -> f32 {
    let bits = i32::from(u16::from_le_bytes([lo, hi]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// Dequantizes rows `first .. first + count` of `w` (the group at `first`) into `out`,
/// row `c` at `c * stride`, bitwise as the loader does.
///
/// # Safety
///
/// The CPU must support AVX2, FMA and F16C; `first` starts a group of `w`, `count` is at
/// most its rows, `stride` at least `w.cols()`, and `out` holds `count` rows of `stride`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequantize_group(
    w: &QuantMatrix,
    first: usize,
    count: usize,
    stride: usize,
    out: &mut [f32],
) {
    let bv = w.format().block_values();
    debug_assert!(stride >= w.cols() && out.len() >= count * stride);
    let base = out.as_mut_ptr();
    let dst = |c: usize, blk: usize| base.wrapping_add(c * stride + blk * bv);
    // One loop per format, so each block's code is inlined into it.
    // SAFETY (every arm): each call gets one block's scales and values and its `bv`
    // values of `out` (row `c < count`, block `blk` of a row at `c * stride`); the CPU
    // features are this function's own.
    unsafe {
        match w.format() {
            QuantFormat::Q8_0 => {
                w.for_group_blocks(first, count, |c, blk, h, q| q8_0(h, q, dst(c, blk)))
            }
            QuantFormat::Q4_0 => {
                w.for_group_blocks(first, count, |c, blk, h, q| q4_0(h, q, dst(c, blk)))
            }
            QuantFormat::Q4_1 => {
                w.for_group_blocks(first, count, |c, blk, h, q| q4_1(h, q, dst(c, blk)))
            }
            QuantFormat::Q4_K => {
                w.for_group_blocks(first, count, |c, blk, _, b| q4_k(b, dst(c, blk)))
            }
            QuantFormat::Q6_K => {
                w.for_group_blocks(first, count, |c, blk, _, b| q6_k(b, dst(c, blk)))
            }
            // The callers send only the formats decoded in registers (`simd_decoded`).
            _ => {}
        }
    }
}

/// Widens 8 bytes at `src` (unsigned) to 8 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_u8(src: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(src))
}

/// 16 bytes of nibbles to (low nibbles, high nibbles) as 16 bytes each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(q: __m128i) -> (__m128i, __m128i) {
    let mask = _mm_set1_epi8(0x0F);
    (
        _mm_and_si128(q, mask),
        _mm_and_si128(_mm_srli_epi16(q, 4), mask),
    )
}

/// Writes 16 bytes of small unsigned values as `scale * q + add` (a multiply, then an
/// add) to `dst[0..16]`.
///
/// # Safety
///
/// `dst` points at 16 writable f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store16(q: __m128i, scale: __m256, add: __m256, dst: *mut f32) {
    let a = _mm256_add_ps(_mm256_mul_ps(widen_u8(q), scale), add);
    let b = _mm256_add_ps(_mm256_mul_ps(widen_u8(_mm_srli_si128(q, 8)), scale), add);
    // SAFETY: the caller guarantees 16 values at `dst`.
    unsafe {
        _mm256_storeu_ps(dst, a);
        _mm256_storeu_ps(dst.add(8), b);
    }
}

/// `Q8_0`: `x = q * d` (`h`: the scale, `q`: 32 values, `o`: room for 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(h: &[u8], q: &[u8], o: *mut f32) {
    let d = _mm256_set1_ps(f16(h[0], h[1]));
    for i in 0..4 {
        // SAFETY: 32 bytes of values and room for 32 values (the caller's contract).
        unsafe {
            let v = _mm_loadl_epi64(q.as_ptr().add(8 * i).cast());
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
            _mm256_storeu_ps(o.add(8 * i), _mm256_mul_ps(v, d));
        }
    }
}

/// `Q4_0`: `x = (q - 8) * d` (`h`: the scale, `q`: 16 bytes, `o`: room for 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0(h: &[u8], q: &[u8], o: *mut f32) {
    let d = _mm256_set1_ps(f16(h[0], h[1]));
    // SAFETY: 16 bytes of values and room for 32 values (the caller's contract).
    unsafe {
        let (lo, hi) = nibbles(_mm_loadu_si128(q.as_ptr().cast()));
        let eight = _mm256_set1_epi32(8);
        for (i, q) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
            .into_iter()
            .enumerate()
        {
            let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), eight));
            _mm256_storeu_ps(o.add(8 * i), _mm256_mul_ps(v, d));
        }
    }
}

/// Decodes one encoded KV cache row of `ty` (`bytes`) into `out`, bitwise as
/// [`KvCacheType::decode`](crate::cache::KvCacheType::decode) does: F16C's conversion
/// is exact, and the 32-value blocks are the loader's decoders above.
///
/// # Safety
///
/// The CPU must support AVX2, FMA and F16C; `bytes` holds the encoded row of `out.len()`
/// values (whole 32-value blocks for the ggml types).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn decode_kv_row(ty: crate::cache::KvCacheType, bytes: &[u8], out: &mut [f32]) {
    use crate::cache::KvCacheType as T;
    let o = out.as_mut_ptr();
    match ty {
        T::F16 => {
            let whole = out.len() / 8 * 8;
            for i in (0..whole).step_by(8) {
                // SAFETY: 16 bytes (8 values) at `2 * i` and room for 8 at `i`.
                unsafe {
                    let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i).cast());
                    _mm256_storeu_ps(o.add(i), _mm256_cvtph_ps(h));
                }
            }
            for (i, out) in out.iter_mut().enumerate().skip(whole) {
                *out = f16(bytes[2 * i], bytes[2 * i + 1]);
            }
        }
        // SAFETY (both arms): each ggml block's bytes and room for its 32 values.
        T::Q8_0 => {
            let block = QuantFormat::Q8_0.block_bytes();
            for (blk, b) in bytes.chunks_exact(block).take(out.len() / 32).enumerate() {
                unsafe { q8_0(&b[..2], &b[2..], o.add(32 * blk)) }
            }
        }
        T::Q4_0 => {
            let block = QuantFormat::Q4_0.block_bytes();
            for (blk, b) in bytes.chunks_exact(block).take(out.len() / 32).enumerate() {
                unsafe { q4_0(&b[..2], &b[2..], o.add(32 * blk)) }
            }
        }
        T::F32 | T::Bf16 => ty.decode(bytes, out),
    }
}

/// `Q4_1`: `x = q * d + m` (`h`: the scale and minimum, `q`: 16 bytes, `o`: room for 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1(h: &[u8], q: &[u8], o: *mut f32) {
    let d = _mm256_set1_ps(f16(h[0], h[1]));
    let m = _mm256_set1_ps(f16(h[2], h[3]));
    // SAFETY: 16 bytes of values and room for 32 values (the caller's contract).
    unsafe {
        let (lo, hi) = nibbles(_mm_loadu_si128(q.as_ptr().cast()));
        store16(lo, d, m, o);
        store16(hi, d, m, o.add(16));
    }
}

/// `Q4_K`: eight 32-value groups, `x = (d * sc) * q - dmin * mn`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k(b: &[u8], o: *mut f32) {
    let d = f16(b[0], b[1]);
    let dmin = f16(b[2], b[3]);
    let (sc, mn) = k_scales_mins(&b[4..16]);
    for chunk in 0..4 {
        // SAFETY: bytes 16..144 and values 0..256 exist (block of 144 bytes, 256 values).
        unsafe {
            let src = b.as_ptr().add(16 + 32 * chunk);
            let dst = o.add(64 * chunk);
            for (group, offset) in [(2 * chunk, 0), (2 * chunk + 1, 32)] {
                let scale = _mm256_set1_ps(d * f32::from(sc[group]));
                let min = _mm256_set1_ps(dmin * f32::from(mn[group]));
                for half in 0..2 {
                    let q = _mm_loadu_si128(src.add(16 * half).cast());
                    let (lo, hi) = nibbles(q);
                    let q = if offset == 0 { lo } else { hi };
                    for i in 0..2 {
                        let v = widen_u8(if i == 0 { q } else { _mm_srli_si128(q, 8) });
                        let x = _mm256_sub_ps(_mm256_mul_ps(scale, v), min);
                        _mm256_storeu_ps(dst.add(offset + 16 * half + 8 * i), x);
                    }
                }
            }
        }
    }
}

/// `Q6_K`: 6-bit values offset by -32, `x = (d * sc) * q` with a scale per 16 values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(b: &[u8], o: *mut f32) {
    let d = f16(b[208], b[209]);
    let mut q = [0i8; 256];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let dst = &mut q[128 * half..128 * half + 128];
        for l in 0..32 {
            let h = qh[l];
            dst[l] = ((ql[l] & 0x0F) | ((h & 3) << 4)) as i8 - 32;
            dst[l + 32] = ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32;
            dst[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            dst[l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    for group in 0..16 {
        let scale = _mm256_set1_ps(d * f32::from(b[192 + group] as i8));
        for i in 0..2 {
            let at = 16 * group + 8 * i;
            // SAFETY: `at + 8 <= 256` values of `q` and of `o`.
            unsafe {
                let v = _mm_loadl_epi64(q.as_ptr().add(at).cast());
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                _mm256_storeu_ps(o.add(at), _mm256_mul_ps(scale, v));
            }
        }
    }
}

/// `q . k[i]` for four vectors `k[i]` in the canonical order (one 8-lane fused
/// accumulator each, then [`reduce`]): the same bits as four [`dot`] calls, with
/// the four chains interleaved. Attention's scores.
///
/// # Safety
///
/// AVX2 and FMA; every slice holds `q.len()` values, a multiple of 8.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len();
    debug_assert!(n.is_multiple_of(8) && k.iter().all(|k| k.len() == n));
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        // SAFETY: `i + 8 <= n` values in every slice (the caller's contract).
        unsafe {
            let qv = _mm256_loadu_ps(q.as_ptr().add(i));
            for j in 0..4 {
                acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j].as_ptr().add(i)), acc[j]);
            }
        }
        i += 8;
    }
    [
        reduce(acc[0]),
        reduce(acc[1]),
        reduce(acc[2]),
        reduce(acc[3]),
    ]
}

/// `q[g] . k[i]` for `Q` queries (an even number) and four keys, each in the canonical
/// order as [`dot4`] computes it, the `4 Q` chains interleaved (each key word loaded
/// once for every query) and finished eight at a time ([`reduce8`]): the same bits as
/// `Q` calls of [`dot4`]. Attention's scores for several queries over the same keys.
///
/// # Safety
///
/// AVX2 and FMA; every slice holds `q[0].len()` values, a multiple of 8.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_tile<const Q: usize>(q: [&[f32]; Q], k: [&[f32]; 4]) -> [[f32; 4]; Q] {
    let n = q[0].len();
    debug_assert!(Q.is_multiple_of(2) && n.is_multiple_of(8));
    debug_assert!(q.iter().chain(&k).all(|v| v.len() == n));
    let mut acc = [[_mm256_setzero_ps(); 4]; Q];
    let mut i = 0;
    while i < n {
        // SAFETY: `i + 8 <= n` values in every slice (the caller's contract).
        unsafe {
            let kv: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(k[j].as_ptr().add(i)));
            for g in 0..Q {
                let qv = _mm256_loadu_ps(q[g].as_ptr().add(i));
                for j in 0..4 {
                    acc[g][j] = _mm256_fmadd_ps(qv, kv[j], acc[g][j]);
                }
            }
        }
        i += 8;
    }
    let mut out = [[0f32; 4]; Q];
    for g in (0..Q).step_by(2) {
        let [a, b] = [acc[g], acc[g + 1]];
        let sums = reduce8([a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]);
        let mut both = [0f32; 8];
        // SAFETY: `both` holds eight values.
        unsafe { _mm256_storeu_ps(both.as_mut_ptr(), sums) };
        out[g] = [both[0], both[1], both[2], both[3]];
        out[g + 1] = [both[4], both[5], both[6], both[7]];
    }
    out
}

/// [`reduce`] of eight accumulators at once: lane `k` of the result is `reduce(a[k])`,
/// with the same additions of the same values (`t[l] = a[l] + a[l + 4]`, then `(t[0] +
/// t[2]) + (t[1] + t[3])`), taken for eight accumulators in four vector additions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn reduce8(a: [__m256; 8]) -> __m256 {
    // `[t(a[k]) | t(a[k + 4])]`: each accumulator's low half plus its high half.
    let t: [__m256; 4] = std::array::from_fn(|k| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a[k], a[k + 4]),
            _mm256_permute2f128_ps::<0x31>(a[k], a[k + 4]),
        )
    });
    // Per half: `[t0[0] + t0[2], t1[0] + t1[2], t0[1] + t0[3], t1[1] + t1[3]]`, the
    // same for accumulators 2 and 3 (4-7 in the high half).
    let s01 = _mm256_add_ps(
        _mm256_unpacklo_ps(t[0], t[1]),
        _mm256_unpackhi_ps(t[0], t[1]),
    );
    let s23 = _mm256_add_ps(
        _mm256_unpacklo_ps(t[2], t[3]),
        _mm256_unpackhi_ps(t[2], t[3]),
    );
    // `(t[0] + t[2]) + (t[1] + t[3])` of each.
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b01_00_01_00>(s01, s23),
        _mm256_shuffle_ps::<0b11_10_11_10>(s01, s23),
    )
}

/// The canonical final sum of an accumulator.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce(s: __m256) -> f32 {
    let t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)))
}

/// `out[r * stride + c] = x[r] . w[c]` for `R` activation rows and `C` weight rows of
/// `n` values, stored straight into the output.
///
/// Index loops keep every accumulator in a register (const-size arrays, unrolled).
///
/// # Safety
///
/// AVX2 and FMA; every row holds `n` values, `n` a multiple of 8, and `out` has room for
/// `R` rows of `stride` values from `C` columns on.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const C: usize>(
    w: [*const f32; C],
    x: [*const f32; R],
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut k = 0;
    while k < n {
        // SAFETY: `k + 8 <= n` values in every row (the caller's contract).
        // Registers: with one row, the row's chunk stays loaded and each weight chunk is
        // read once (C + 2 registers); with several, the C weight chunks stay loaded and
        // each row's chunk is read once (R * C + C + 1 <= 16 for a 4 x 3 tile).
        unsafe {
            if R == 1 {
                let xv = _mm256_loadu_ps(x[0].add(k));
                for c in 0..C {
                    acc[0][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c].add(k)), xv, acc[0][c]);
                }
            } else {
                let wv: [__m256; C] = std::array::from_fn(|c| _mm256_loadu_ps(w[c].add(k)));
                for r in 0..R {
                    let xv = _mm256_loadu_ps(x[r].add(k));
                    for c in 0..C {
                        acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
                    }
                }
            }
        }
        k += 8;
    }
    for r in 0..R {
        for c in 0..C {
            // SAFETY: room for `C` values in row `r` (the caller's contract).
            unsafe { *out.add(r * stride + c) = reduce(acc[r][c]) };
        }
    }
}

/// Every column tile of `R` activation rows over the `cols` weight rows at `w` (`n`
/// values each, row `c` at `c * ws`): 1 x 8 tiles for one row, R x 3 for several.
///
/// # Safety
///
/// As [`panel`], for these `R` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_rows<const R: usize>(
    w: *const f32,
    ws: usize,
    cols: usize,
    x: [*const f32; R],
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut c = 0;
    // SAFETY: weight rows `c ..` exist and their outputs are columns of `out` (the
    // caller's contract).
    unsafe {
        let rows_at = |c: usize| move |i: usize| w.add((c + i) * ws);
        if R == 1 {
            while c + 8 <= cols {
                tile::<R, 8>(std::array::from_fn(rows_at(c)), x, n, out.add(c), stride);
                c += 8;
            }
        } else {
            while c + 3 <= cols {
                tile::<R, 3>(std::array::from_fn(rows_at(c)), x, n, out.add(c), stride);
                c += 3;
            }
        }
        while c < cols {
            tile::<R, 1>([w.add(c * ws)], x, n, out.add(c), stride);
            c += 1;
        }
    }
}

/// A panel of f32 weight rows (scratch rows, row `c` at `c * ws`) times every activation
/// row: `out[r * stride + c] = x[r] . w[c]` for the `rows` rows of `x` and the `cols` rows
/// of `w`, all of `n` values (a multiple of 8), in balanced row tiles of up to 4 rows, each
/// over all of the panel's column tiles, every result stored straight into `out`.
///
/// # Safety
///
/// AVX2, FMA and F16C; `w` holds `cols` rows of `ws >= n` values, `x` holds `rows * n`,
/// and `out` has room for `rows` rows of `stride` values from `cols` columns on, which no
/// other thread writes.
#[target_feature(enable = "avx2,fma,f16c")]
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
    debug_assert!(n.is_multiple_of(8) && ws >= n && w.len() >= cols * ws && x.len() >= rows * n);
    let (w, x) = (w.as_ptr(), x.as_ptr());
    for (r0, r1) in super::tiling::balanced_row_tiles(rows, 4) {
        // SAFETY: rows `r0..r1` of `x` and of `out` exist (the caller's contract).
        unsafe {
            let xr = |i: usize| x.add((r0 + i) * n);
            let o = out.add(r0 * stride);
            match r1 - r0 {
                4 => panel_rows::<4>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                3 => panel_rows::<3>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                2 => panel_rows::<2>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
                _ => panel_rows::<1>(w, ws, cols, std::array::from_fn(xr), n, o, stride),
            }
        }
    }
}

/// One dot product in this path's 8-lane order (a 1 x 1 tile).
///
/// # Safety
///
/// AVX2, FMA and F16C; both slices hold the same number of values, a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert!(a.len().is_multiple_of(8) && a.len() == b.len());
    let mut out = 0f32;
    // SAFETY: forwarded from this function's contract; `out` holds the one result.
    unsafe { tile::<1, 1>([a.as_ptr()], [b.as_ptr()], a.len(), &mut out, 1) };
    out
}

/// Whether [`fused_row`] takes weights of `format` (the 32-value formats; the K-quants
/// go through scratch rows).
pub(crate) fn fuses(format: QuantFormat) -> bool {
    matches!(
        format,
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1
    )
}

/// One activation row times `cols` rows of the group at `first` (from its row `c0` on),
/// each block decoded in registers, with the operations of [`dequantize_group`], and
/// multiplied at once: `out[c] = x . W[first + c0 + c]` in the 8-lane order, the bits
/// of the scratch path. Nothing is stored but the results, and the group is read once,
/// in memory order.
///
/// # Safety
///
/// AVX2, FMA and F16C; `w`'s format [`fuses`]; `first` starts a group holding
/// `c0 + cols` rows, and `x` holds `w.cols()` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fused_row(
    w: &QuantMatrix,
    first: usize,
    c0: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32; 8],
) {
    let (group, n) = w.group(first);
    debug_assert!(fuses(w.format()) && c0 + cols <= n && x.len() == w.cols());
    let (g, xp, f) = (group.as_ptr(), x.as_ptr(), w.format());
    let blocks = w.blocks_per_row();
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match (f, cols) {
            (QuantFormat::Q8_0, 8) => row_as::<FUSED_Q8_0, 8>(g, n, c0, xp, blocks, f, out),
            (QuantFormat::Q4_0, 8) => row_as::<FUSED_Q4_0, 8>(g, n, c0, xp, blocks, f, out),
            (QuantFormat::Q4_1, 8) => row_as::<FUSED_Q4_1, 8>(g, n, c0, xp, blocks, f, out),
            _ => {
                // A group's last rows: one at a time.
                for (c, slot) in out.iter_mut().enumerate().take(cols) {
                    let mut one = [0f32; 8];
                    let c = c0 + c;
                    match f {
                        QuantFormat::Q8_0 => {
                            row_as::<FUSED_Q8_0, 1>(g, n, c, xp, blocks, f, &mut one)
                        }
                        QuantFormat::Q4_0 => {
                            row_as::<FUSED_Q4_0, 1>(g, n, c, xp, blocks, f, &mut one)
                        }
                        _ => row_as::<FUSED_Q4_1, 1>(g, n, c, xp, blocks, f, &mut one),
                    }
                    *slot = one[0];
                }
            }
        }
    }
}

const FUSED_Q8_0: u8 = 0;
const FUSED_Q4_0: u8 = 1;
const FUSED_Q4_1: u8 = 2;

/// [`fused_row`] for format `F` (`format`, whose id `F` is) and `C` rows.
///
/// # Safety
///
/// As [`fused_row`]: `group` holds `blocks` steps of `n` blocks of `F`, `c0 + C <= n`.
#[inline]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_as<const F: u8, const C: usize>(
    group: *const u8,
    n: usize,
    c0: usize,
    x: *const f32,
    blocks: usize,
    format: QuantFormat,
    out: &mut [f32; 8],
) {
    let (bb, hb) = (format.block_bytes(), format.head_bytes());
    let per_scale = hb / 2;
    let mut acc = [_mm256_setzero_ps(); C];
    let mut scales = [0f32; 16];
    for blk in 0..blocks {
        // SAFETY: step `blk` of the group (its `n` blocks' scales, then their values)
        // and values `32 blk .. 32 blk + 32` of `x` exist (the caller's contract); a
        // prefetch is only a hint.
        unsafe {
            let step = group.add(blk * n * bb);
            super::tiling::prefetch_step(step);
            // The step's scales as f32: `d` (and `m`) of each row, side by side.
            let count = n * per_scale;
            if count == 8 || count == 16 {
                for half in 0..count / 8 {
                    let h = _mm_loadu_si128(step.add(16 * half).cast());
                    _mm256_storeu_ps(scales.as_mut_ptr().add(8 * half), _mm256_cvtph_ps(h));
                }
            } else {
                for (i, s) in scales.iter_mut().take(count).enumerate() {
                    *s = f16(*step.add(2 * i), *step.add(2 * i + 1));
                }
            }
            let xb = x.add(32 * blk);
            let xv: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.add(8 * i)));
            for c in 0..C {
                let col = c0 + c;
                let q = step.add(n * hb + col * (bb - hb));
                let d = _mm256_set1_ps(scales[col * per_scale]);
                // The block's four 8-value chunks, in order, as `dequantize_group`
                // computes them.
                let chunks: [__m256; 4] = match F {
                    FUSED_Q8_0 => std::array::from_fn(|i| {
                        let v = _mm_loadl_epi64(q.add(8 * i).cast());
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d)
                    }),
                    FUSED_Q4_0 => {
                        let (lo, hi) = nibbles(_mm_loadu_si128(q.cast()));
                        let eight = _mm256_set1_epi32(8);
                        [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)].map(|q| {
                            let v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), eight);
                            _mm256_mul_ps(_mm256_cvtepi32_ps(v), d)
                        })
                    }
                    _ => {
                        let m = _mm256_set1_ps(scales[col * per_scale + 1]);
                        let (lo, hi) = nibbles(_mm_loadu_si128(q.cast()));
                        [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
                            .map(|q| _mm256_add_ps(_mm256_mul_ps(widen_u8(q), d), m))
                    }
                };
                for i in 0..4 {
                    acc[c] = _mm256_fmadd_ps(chunks[i], xv[i], acc[c]);
                }
            }
        }
    }
    for c in 0..C {
        out[c] = reduce(acc[c]);
    }
}
