//! The x86-64 integer kernels of the `fast` precision: one instruction layer ([`Isa`])
//! for AVX-512 with VNNI, for AVX2 with AVX-VNNI and for AVX2, the in-register decoders of every block format's
//! grouped layout, and the tile kernels that multiply them.

use super::activations::QuantizedRows;
use super::{GROUP_TILE, LANES, Panel, QK, ROW_TILE};
use crate::kernels::matrix::{GROUP_ROWS, QuantMatrix};
use crate::kernels::tiling::Columns;
use crate::kernels::x86::{Avx2, AvxVnni, Isa, Vnni, VnniGfni, transpose8};
use crate::quant::{IntForm, IntScales, QuantFormat, with_format};

/// The first format (by id) with the integer form of format `id`: the kernels that
/// read a format only through its integer form are compiled once per form (Q5_1 runs
/// Q4_1's, Q5_K Q4_K's), not once per format.
const fn same_form(id: u8) -> u8 {
    let f = format_at(id).int_form();
    let mut i = 0;
    while i < id {
        let g = format_at(i).int_form();
        if g.offset == f.offset
            && g.scales as u8 == f.scales as u8
            && g.mins == f.mins
            && g.run == f.run
            && g.max == f.max
        {
            return i;
        }
        i += 1;
    }
    id
}

/// The format whose id is `id` (its place in [`QuantFormat::ALL`], which is its
/// declaration order): the in-register kernels take their format as a const parameter
/// (through `with_format!`), so every branch on it is decided at compile time.
const fn format_at(id: u8) -> QuantFormat {
    QuantFormat::ALL[id as usize]
}

/// Runs `$body` once for each listed value, with `$i` a constant equal to it: written
/// out, not looped, so that what depends on `$i` (which vector, which shift) is decided
/// at compile time. LLVM kept the decoders' loops over a super-block's sub-blocks as
/// loops, with a branch per choice and the scales in memory.
macro_rules! unrolled {
    ($i:ident in [$($n:literal)*] => $body:block) => {
        $({
            #[allow(non_upper_case_globals)]
            const $i: usize = $n;
            $body
        })*
    };
}

/// Runs `$body` with `$i` = 0, 1, ... for each `$i < $t` (a constant, at most 8), written
/// out rather than looped: with constant indices the accumulators stay in registers
/// (LLVM keeps a loop of more than four such rows, and their accumulators on the stack).
macro_rules! each_row {
    ($t:expr, $i:ident => $body:block) => {
        each_row!(@ $t, $i, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $t:expr, $i:ident, $body:block, $($n:literal)*) => {
        $(
            // A constant condition: the rows past `$t` are not even compiled.
            if const { $n < $t } {
                let $i: usize = $n;
                $body
            }
        )*
    };
}

/// Evaluates `$call` with the constant `$t` equal to `$tile` (1 to 8, or to the last of
/// the listed counts `; 1 2 ...; last` where a kernel has fewer): the tile kernels take
/// their number of rows as a const parameter, so their accumulators are registers (with
/// a runtime count they lived on the stack, and every fused multiply-add went through a
/// store and a load: 35% of the 16-row kernel's time).
macro_rules! with_tile {
    ($tile:expr, $t:ident => $call:expr) => {
        with_tile!($tile, $t => $call; 1 2 3 4 5 6 7; 8)
    };
    ($tile:expr, $t:ident => $call:expr; $($n:literal)*; $last:literal) => {{
        debug_assert!((1..=$last).contains(&$tile));
        match $tile {
            $(
                $n => {
                    const $t: usize = $n;
                    $call
                }
            )*
            _ => {
                const $t: usize = $last;
                $call
            }
        }
    }};
}

/// Results of activation rows `r0 .. r0 + tile` against the eight rows of a full group,
/// decoded in registers from the grouped layout (no panel): a block's eight rows of
/// quantized values are transposed into vectors of four values per row (lanes = rows),
/// then multiplied as [`vnni_tile_rows`] does, with the same integer sums and float steps, so
/// the same bits. Compiled for AVX-512 VNNI ([`group_tile_vnni`]) and AVX2
/// ([`group_tile_avx2`]).
///
/// # Safety
///
/// The CPU has `I`'s features; `group` holds 8 rows of `acts.n_in` values; `r0 + T`
/// rows exist, `T <= GROUP_TILE`.
#[inline(always)]
unsafe fn group_tile<I: Isa, const T: usize, const F: u8>(
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    use std::arch::x86_64::*;
    // SAFETY: forwarded from this function's contract; `o` holds 8 floats.
    unsafe {
        let mut sink = Multiply::<I, T, F> {
            acts,
            r0,
            acc: [_mm256_setzero_ps(); T],
            iacc: [_mm256_setzero_si256(); T],
            isa: std::marker::PhantomData,
        };
        decode_group::<I, F>(group, acts.blocks(), &mut sink);
        for (o, a) in out.iter_mut().zip(sink.acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), a);
        }
    }
}

/// [`group_tile`] on AVX-512 with VNNI.
///
/// # Safety
///
/// As [`group_tile`], the CPU having AVX-512 F/BW/VL, VNNI, FMA, F16C and AVX2.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_tile_vnni(
    format: QuantFormat,
    gfni: bool,
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded; `gfni` says the CPU has GFNI.
    unsafe {
        if gfni && takes_gfni(format) {
            with_tile!(tile, T => group_tile_gfni_of::<T>(group, acts, r0, out))
        } else {
            with_format!(format, F => with_tile!(tile, T => group_tile_vnni_of::<T, F>(group, acts, r0, out)))
        }
    }
}

/// [`group_tile_vnni`] for `T` rows of Q6_K on a CPU with GFNI ([`VnniGfni`]).
///
/// # Safety
///
/// As [`group_tile_vnni`], the CPU also having GFNI, with `T` for `tile`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2,gfni")]
#[inline(never)]
unsafe fn group_tile_gfni_of<const T: usize>(
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe { group_tile::<VnniGfni, T, { QuantFormat::Q6_K as u8 }>(group, acts, r0, out) }
}

/// [`group_tile_vnni`] for `T` rows of format `F`: one function per tile and format,
/// never inlined into the dispatcher. Inlined, the 72 variants made one function whose
/// loops LLVM's loop passes took minutes over (most of the crate's compile time, measured
/// with `-Zllvm-time-trace`); a call per group tile costs nothing measurable.
///
/// # Safety
///
/// As [`group_tile_vnni`], with `T` for `tile` and `F` for `format`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
#[inline(never)]
unsafe fn group_tile_vnni_of<const T: usize, const F: u8>(
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe { group_tile::<Vnni, T, F>(group, acts, r0, out) }
}

/// [`group_tile`] on AVX2.
///
/// # Safety
///
/// As [`group_tile`], the CPU having AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_tile_avx2(
    format: QuantFormat,
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => with_tile!(tile, T => group_tile_avx2_of::<T, F>(group, acts, r0, out)))
    }
}

/// [`group_tile_avx2`] for `T` rows of format `F`: one function per tile and format,
/// never inlined into the dispatcher. Inlined, the 72 variants made one function whose
/// loops LLVM's loop passes took minutes over (most of the crate's compile time, measured
/// with `-Zllvm-time-trace`); a call per group tile costs nothing measurable.
///
/// # Safety
///
/// As [`group_tile_avx2`], with `T` for `tile` and `F` for `format`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
unsafe fn group_tile_avx2_of<const T: usize, const F: u8>(
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe { group_tile::<Avx2, T, F>(group, acts, r0, out) }
}

/// [`group_tile`] on AVX2 with AVX-VNNI.
///
/// # Safety
///
/// As [`group_tile`], the CPU having AVX2, AVX-VNNI, FMA and F16C.
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_tile_avx_vnni(
    format: QuantFormat,
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => with_tile!(tile, T => group_tile_avx_vnni_of::<T, F>(group, acts, r0, out)))
    }
}

/// [`group_tile_avx_vnni`] for `T` rows of format `F`, never inlined (as
/// [`group_tile_avx2_of`]).
///
/// # Safety
///
/// As [`group_tile_avx_vnni`], with `T` for `tile` and `F` for `format`.
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
#[inline(never)]
unsafe fn group_tile_avx_vnni_of<const T: usize, const F: u8>(
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe { group_tile::<AvxVnni, T, F>(group, acts, r0, out) }
}

/// Decodes the `subs` sub-blocks of each row of a full group in registers, calling
/// `sub(w, scales, s)` for each in order.
///
/// # Safety
///
/// The CPU has `I`'s features; `group` holds 8 rows of `subs * 32` values.
#[inline(always)]
unsafe fn decode_group<I: Isa, const F: u8>(group: &[u8], subs: usize, sink: &mut impl SubSink) {
    let format = format_at(F);
    let bb = format.block_bytes();
    let per_block = format.block_values() / QK;
    debug_assert!(group.len() >= subs / per_block * GROUP_ROWS * bb);
    let prefetch = crate::kernels::tiling::GroupPrefetch::new(GROUP_ROWS * bb);
    for blk in 0..subs / per_block {
        // SAFETY: block `blk` of the group is `8 * bb` bytes at `blk * 8 * bb`.
        let step = unsafe { group.as_ptr().add(blk * GROUP_ROWS * bb) };
        prefetch.ask(step);
        // SAFETY (each arm): `step` holds the format's eight blocks in the grouped layout.
        // Each condition is a constant (`const` blocks, evaluated per `F`), so only the
        // format's own decoder is compiled for it: a `match` on `format` compiled every
        // decoder for every format, tile and instruction set (145 copies of the K-quant
        // decoders, a quarter of the crate's code before optimization).
        unsafe {
            if const { matches!(decoder_of(format_at(F)), Decoder::Block32) } {
                let (w, sc) = decode_step_32::<I>(format, step);
                sink.take(&w, &sc, blk);
            } else if const { matches!(decoder_of(format_at(F)), Decoder::Q5) } {
                let (w, sc) = decode_step_q5::<I>(format, step);
                sink.take(&w, &sc, blk);
            } else if const { matches!(decoder_of(format_at(F)), Decoder::K4) } {
                decode_step_k4::<I>(format, step, blk * 8, sink)
            } else if const { matches!(decoder_of(format_at(F)), Decoder::Q3K) } {
                decode_step_q3k::<I>(step, blk * 8, sink)
            } else {
                decode_step_q6k::<I>(step, blk * 8, sink)
            }
        }
    }
}

/// Which in-register decoder a format's grouped steps take.
enum Decoder {
    /// Q8_0, Q4_0, Q4_1: one 32-value block a step.
    Block32,
    /// Q5_0, Q5_1: 32-value blocks with a fifth bit.
    Q5,
    /// Q4_K, Q5_K: super-blocks with packed 6-bit scales and minimums.
    K4,
    /// Q3_K.
    Q3K,
    /// Q6_K.
    Q6K,
}

/// Whether `format` is decoded with GFNI where the CPU has it ([`VnniGfni`]): Q6_K,
/// whose two high bits per value one `vgf2p8affineqb` places. The one place that says so,
/// for the group tiles and the panels alike.
const fn takes_gfni(format: QuantFormat) -> bool {
    matches!(format, QuantFormat::Q6_K)
}

/// The decoder of `format`'s grouped steps.
const fn decoder_of(format: QuantFormat) -> Decoder {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 => Decoder::Block32,
        QuantFormat::Q5_0 | QuantFormat::Q5_1 => Decoder::Q5,
        QuantFormat::Q4_K | QuantFormat::Q5_K => Decoder::K4,
        QuantFormat::Q3_K => Decoder::Q3K,
        _ => Decoder::Q6K,
    }
}

impl Panel {
    /// [`fill`](Self::fill) for sixteen rows, decoded in registers with AVX-512 by the
    /// format's decoder ([`decoder_of`]) and stored (lanes 0-7 from the first group, 8-15
    /// from the second): the same values. With `gfni`, a format that [`takes_gfni`] is
    /// decoded with [`VnniGfni`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F/BW/VL, F16C and AVX2, and GFNI where `gfni`; `first` starts
    /// two full groups of `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2")]
    pub(super) unsafe fn fill_in_registers(&mut self, w: &QuantMatrix, first: usize, gfni: bool) {
        // SAFETY: forwarded; `gfni` says the CPU has GFNI.
        unsafe {
            match decoder_of(w.format()) {
                Decoder::K4 => self.fill_k4_wide(w, first),
                Decoder::Q6K if gfni && takes_gfni(w.format()) => self.fill_q6k_wide_gfni(w, first),
                Decoder::Q6K => self.fill_q6k_wide(w, first),
                _ => self.fill_with::<Vnni>(w, first),
            }
        }
    }

    /// [`fill_in_registers`](Self::fill_in_registers) for Q4_K and Q5_K, by
    /// [`decode_k4_wide`].
    ///
    /// # Safety
    ///
    /// As [`fill_in_registers`](Self::fill_in_registers); `w` is Q4_K or Q5_K.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2")]
    unsafe fn fill_k4_wide(&mut self, w: &QuantMatrix, first: usize) {
        let mut sink = self.wide_sink(w);
        // SAFETY: forwarded.
        unsafe { decode_k4_wide(w, first, &mut sink) }
    }

    /// The panel sized for `w`'s rows, as a [`WideSink`] that stores into it.
    fn wide_sink(&mut self, w: &QuantMatrix) -> PanelWide {
        let subs = w.cols() / QK;
        self.u.sized(subs * 8 * LANES * 4);
        self.sc.resize(subs * 2 * LANES, 0);
        self.d.resize(subs * LANES, 0.0);
        self.m.resize(subs * LANES, 0.0);
        PanelWide {
            u: self.u.words_mut().as_mut_ptr(),
            sc: self.sc.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            m: self.m.as_mut_ptr(),
        }
    }

    /// [`fill_in_registers`](Self::fill_in_registers) for Q6_K: both groups at once in
    /// 512-bit vectors, as [`fill_k4_wide`](Self::fill_k4_wide) does, each step of
    /// [`decode_step_q6k`] on sixteen lanes.
    ///
    /// # Safety
    ///
    /// As [`fill_in_registers`](Self::fill_in_registers); `w` is Q6_K.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2")]
    unsafe fn fill_q6k_wide(&mut self, w: &QuantMatrix, first: usize) {
        // SAFETY: forwarded.
        unsafe { self.fill_q6k_wide_with::<false>(w, first) }
    }

    /// [`fill_q6k_wide`](Self::fill_q6k_wide) on a CPU with GFNI: the high bits placed by
    /// one bit-matrix product per byte, as [`VnniGfni`] places them.
    ///
    /// # Safety
    ///
    /// As [`fill_q6k_wide`](Self::fill_q6k_wide), the CPU also having GFNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2,gfni")]
    unsafe fn fill_q6k_wide_gfni(&mut self, w: &QuantMatrix, first: usize) {
        // SAFETY: forwarded.
        unsafe { self.fill_q6k_wide_with::<true>(w, first) }
    }

    /// The body of [`fill_q6k_wide`](Self::fill_q6k_wide), with GFNI where `GFNI`.
    ///
    /// # Safety
    ///
    /// As [`fill_q6k_wide`](Self::fill_q6k_wide), and GFNI where `GFNI`.
    #[inline(always)]
    unsafe fn fill_q6k_wide_with<const GFNI: bool>(&mut self, w: &QuantMatrix, first: usize) {
        let mut sink = self.wide_sink(w);
        // SAFETY: forwarded.
        unsafe { decode_q6k_wide::<GFNI>(w, first, &mut sink) }
    }

    /// [`fill_in_registers`](Self::fill_in_registers) with AVX2's instructions.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C; `first` starts two full groups of `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill_in_registers_avx2(&mut self, w: &QuantMatrix, first: usize) {
        // SAFETY: forwarded.
        unsafe { self.fill_with::<Avx2>(w, first) }
    }

    /// The panel of rows `first .. first + 16`, decoded with `I`'s instructions.
    ///
    /// # Safety
    ///
    /// The CPU has `I`'s features; `first` starts two full groups of `w`.
    #[inline(always)]
    unsafe fn fill_with<I: Isa>(&mut self, w: &QuantMatrix, first: usize) {
        // SAFETY: forwarded; `F` is `w`'s format.
        unsafe { with_format!(w.format(), F => self.fill_as::<I, F>(w, first)) }
    }

    /// [`fill_with`](Self::fill_with) for `w` of the format whose id is `F`.
    ///
    /// # Safety
    ///
    /// As [`fill_with`](Self::fill_with); `F` is `w`'s format.
    #[inline(always)]
    unsafe fn fill_as<I: Isa, const F: u8>(&mut self, w: &QuantMatrix, first: usize) {
        let subs = w.cols() / QK;
        self.u.sized(subs * 8 * LANES * 4);
        self.sc.resize(subs * 2 * LANES, 0);
        self.d.resize(subs * LANES, 0.0);
        self.m.resize(subs * LANES, 0.0);
        for half in 0..2 {
            let (group, _) = w.group(first + half * GROUP_ROWS);
            let lane = half * GROUP_ROWS;
            let mut sink = Store {
                u: self.u.words_mut().as_mut_ptr(),
                sc: self.sc.as_mut_ptr(),
                d: self.d.as_mut_ptr(),
                m: self.m.as_mut_ptr(),
                lane,
            };
            // SAFETY: the caller's contract; every store is inside the vectors sized
            // above (sub-block `s < subs`, lanes `lane .. lane + 8 <= 16`).
            unsafe { decode_group::<I, F>(group, subs, &mut sink) };
        }
    }
}

/// Decodes rows `first .. first + 16` of `w` (Q4_K or Q5_K) into `sink`: both groups at
/// once in 512-bit vectors (lanes 0-7 the first group's rows, 8-15 the second's, the
/// panel's own layout), each step of [`decode_step_k4`] on sixteen lanes: half the
/// instructions and stores of two groups in turn, the same values. The panel decode was
/// 5-6% of a 1B Q4_K_M or Q5_K_M prompt's samples.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL and F16C; `first` starts two full groups of `w`, which is
/// Q4_K or Q5_K.
#[inline(always)]
unsafe fn decode_k4_wide(w: &QuantMatrix, first: usize, sink: &mut impl WideSink) {
    use std::arch::x86_64::*;
    let format = w.format();
    debug_assert!(matches!(decoder_of(format), Decoder::K4));
    let five = format == QuantFormat::Q5_K;
    // The first word of the values (`qs`): bytes 48 (Q5_K) or 16 (Q4_K).
    let qs = if five { 12 } else { 4 };
    let subs = w.cols() / QK;
    let step_bytes = GROUP_ROWS * format.block_bytes();
    let groups = [w.group(first).0, w.group(first + GROUP_ROWS).0];
    debug_assert!(groups.iter().all(|g| g.len() >= subs / 8 * step_bytes));
    let prefetch = crate::kernels::tiling::GroupPrefetch::new(step_bytes);
    // SAFETY: the caller's contract (AVX-512 F/BW/VL, F16C; both groups full, so
    // each holds `subs / 8` steps of 36 or 44 words); the sink takes every
    // sub-block `< subs`.
    unsafe {
        for blk in 0..subs / 8 {
            let steps = groups.map(|g| g.as_ptr().add(blk * step_bytes));
            prefetch.ask(steps[0]);
            prefetch.ask(steps[1]);
            let head0 = word16(steps, 0);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head0));
            let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head0)));
            // ggml's packing of the scales and minimums, as in `decode_step_k4`.
            let (a, b, c) = (word16(steps, 1), word16(steps, 2), word16(steps, 3));
            let (six, four, two) = (
                _mm512_set1_epi32(63),
                _mm512_set1_epi32(15),
                _mm512_set1_epi32(3),
            );
            let mut sc = [_mm512_setzero_si512(); 8];
            let mut mn = [_mm512_setzero_ps(); 8];
            unrolled!(j in [0 1 2 3] => {
                let k = _mm_cvtsi32_si128(8 * j as i32);
                let (k4, k6) = (
                    _mm_cvtsi32_si128(8 * j as i32 + 4),
                    _mm_cvtsi32_si128(8 * j as i32 + 6),
                );
                sc[j] = _mm512_and_si512(_mm512_srl_epi32(a, k), six);
                let m = _mm512_and_si512(_mm512_srl_epi32(b, k), six);
                sc[j + 4] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srl_epi32(c, k), four),
                    _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srl_epi32(a, k6), two)),
                );
                let m4 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srl_epi32(c, k4), four),
                    _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srl_epi32(b, k6), two)),
                );
                mn[j] = negated_product(dmin, m);
                mn[j + 4] = negated_product(dmin, m4);
            });
            let mut high = [_mm512_setzero_si512(); 8];
            if five {
                for (k, h) in high.iter_mut().enumerate() {
                    *h = word16(steps, 4 + k);
                }
            }
            let (nibble, fifth) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
            unrolled!(chunk in [0 1 2 3] => {
                let mut t = [_mm512_setzero_si512(); 8];
                for (k, t) in t.iter_mut().enumerate() {
                    *t = word16(steps, qs + 8 * chunk + k);
                }
                unrolled!(half in [0 1] => {
                    let s = 2 * chunk + half;
                    let sub = blk * 8 + s;
                    sink.scales(sub, sc[s], sc[s], d, mn[s]);
                    for (k, &t) in t.iter().enumerate() {
                        let q = if half == 0 { t } else { _mm512_srli_epi16::<4>(t) };
                        let v = if five {
                            // Bit `s` of each `qh` byte moved to bit 4.
                            let moved = if s <= 4 {
                                _mm512_sll_epi16(high[k], _mm_cvtsi32_si128(4 - s as i32))
                            } else {
                                _mm512_srl_epi16(high[k], _mm_cvtsi32_si128(s as i32 - 4))
                            };
                            // 0xEA: (q & nibble) | (moved & fifth).
                            _mm512_ternarylogic_epi32::<0xEA>(
                                q,
                                nibble,
                                _mm512_and_si512(moved, fifth),
                            )
                        } else {
                            _mm512_and_si512(q, nibble)
                        };
                        sink.word(sub, k, v);
                    }
                });
            });
        }
    }
}

/// Decodes rows `first .. first + 16` of `w` (Q6_K) into `sink`: both groups at once in
/// 512-bit vectors, as [`decode_k4_wide`] does, each step of [`decode_step_q6k`] on
/// sixteen lanes, with GFNI where `GFNI` (the high bits placed by one bit-matrix product
/// per byte, as [`VnniGfni`] places them).
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL and F16C, and GFNI where `GFNI`; `first` starts two full
/// groups of `w`, which is Q6_K.
#[inline(always)]
unsafe fn decode_q6k_wide<const GFNI: bool>(
    w: &QuantMatrix,
    first: usize,
    sink: &mut impl WideSink,
) {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.format(), QuantFormat::Q6_K);
    let subs = w.cols() / QK;
    let step_bytes = GROUP_ROWS * w.format().block_bytes();
    let groups = [w.group(first).0, w.group(first + GROUP_ROWS).0];
    debug_assert!(groups.iter().all(|g| g.len() >= subs / 8 * step_bytes));
    let prefetch = crate::kernels::tiling::GroupPrefetch::new(step_bytes);
    // SAFETY: the caller's contract (AVX-512 F/BW/VL, F16C, GFNI where `GFNI`; both
    // groups full, each step 52 words and the eight `d`); every store is inside the
    // vectors sized above (sub-block `< subs`, sixteen lanes from lane 0).
    unsafe {
        for blk in 0..subs / 8 {
            let steps = groups.map(|g| g.as_ptr().add(blk * step_bytes));
            prefetch.ask(steps[0]);
            prefetch.ask(steps[1]);
            let d = _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128(steps[1].add(32 * 52).cast()),
                _mm_loadu_si128(steps[0].add(32 * 52).cast()),
            ));
            let packed = [
                word16(steps, 48),
                word16(steps, 49),
                word16(steps, 50),
                word16(steps, 51),
            ];
            let mut scale = [_mm512_setzero_si512(); 16];
            for (k, v) in scale.iter_mut().enumerate() {
                let count = _mm_cvtsi32_si128(24 - 8 * (k % 4) as i32);
                *v = _mm512_srai_epi32::<24>(_mm512_sll_epi32(packed[k / 4], count));
            }
            let nibble = _mm512_set1_epi8(0x0F);
            unrolled!(half in [0 1] => {
                let mut a = [_mm512_setzero_si512(); 8];
                let mut b = [_mm512_setzero_si512(); 8];
                let mut h = [_mm512_setzero_si512(); 8];
                for k in 0..8 {
                    a[k] = word16(steps, 16 * half + k);
                    b[k] = word16(steps, 16 * half + 8 + k);
                    h[k] = word16(steps, 32 + 8 * half + k);
                }
                unrolled!(j in [0 1 2 3] => {
                    let sub = blk * 8 + 4 * half + j;
                    let s = 4 * half + j;
                    sink.scales(sub, scale[2 * s], scale[2 * s + 1], d, _mm512_setzero_ps());
                    let src = if j.is_multiple_of(2) { &a } else { &b };
                    for k in 0..8 {
                        let low = if j < 2 {
                            src[k]
                        } else {
                            _mm512_srli_epi16::<4>(src[k])
                        };
                        // 0xEA: (low & nibble) | high bits 2j, 2j + 1 at 4, 5.
                        let v = _mm512_ternarylogic_epi32::<0xEA>(
                            low,
                            nibble,
                            pair_to_bits45_wide::<GFNI, j>(h[k]),
                        );
                        sink.word(sub, k, v);
                    }
                });
            });
        }
    }
}

/// What takes a panel of sixteen rows decoded in 512-bit vectors ([`decode_k4_wide`],
/// [`decode_q6k_wide`]): the plain panel ([`PanelWide`]) or the AMX kernel's words
/// (`amx::AmxWide`). Lane `l` of every vector is the panel's row `l`.
trait WideSink {
    /// Sub-block `sub`'s scales, before its words: the integer scales of its two halves
    /// of sixteen values (the same one twice for a scale per sub-block), the block scale
    /// `d` and the negated minimum `m` (zero where the format has none).
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F/BW/VL; `sub` is a sub-block of the panel the sink holds.
    unsafe fn scales(
        &mut self,
        sub: usize,
        sc0: std::arch::x86_64::__m512i,
        sc1: std::arch::x86_64::__m512i,
        d: std::arch::x86_64::__m512,
        m: std::arch::x86_64::__m512,
    );

    /// Word `k` of sub-block `sub`: values `4k .. 4k + 4` of each row, unsigned bytes.
    ///
    /// # Safety
    ///
    /// As [`WideSink::scales`], and `k < 8`.
    unsafe fn word(&mut self, sub: usize, k: usize, v: std::arch::x86_64::__m512i);
}

/// Stores a panel decoded in 512-bit vectors into its plain words, integer scales (one
/// per half), `d` and `m` ([`Panel::wide_sink`]).
struct PanelWide {
    u: *mut u32,
    sc: *mut i32,
    d: *mut f32,
    m: *mut f32,
}

impl WideSink for PanelWide {
    #[inline(always)]
    unsafe fn scales(
        &mut self,
        sub: usize,
        sc0: std::arch::x86_64::__m512i,
        sc1: std::arch::x86_64::__m512i,
        d: std::arch::x86_64::__m512,
        m: std::arch::x86_64::__m512,
    ) {
        use std::arch::x86_64::*;
        // SAFETY: the panel was sized for every sub-block ([`Panel::wide_sink`]).
        unsafe {
            _mm512_storeu_si512(self.sc.add(sub * 2 * LANES).cast(), sc0);
            _mm512_storeu_si512(self.sc.add((sub * 2 + 1) * LANES).cast(), sc1);
            _mm512_storeu_ps(self.d.add(sub * LANES), d);
            _mm512_storeu_ps(self.m.add(sub * LANES), m);
        }
    }

    #[inline(always)]
    unsafe fn word(&mut self, sub: usize, k: usize, v: std::arch::x86_64::__m512i) {
        // SAFETY: as in `scales`.
        unsafe {
            std::arch::x86_64::_mm512_storeu_si512(self.u.add((sub * 8 + k) * LANES).cast(), v)
        };
    }
}

/// What takes each decoded sub-block of a group in turn: a trait with an always-inlined
/// method rather than a closure, because closures are compiled without the target
/// features of the function that calls them, and each intrinsic inside one would become
/// a call.
trait SubSink {
    /// Takes sub-block `s`: `w[t]` holds values `4t .. 4t + 4` of each of eight rows.
    ///
    /// # Safety
    ///
    /// The CPU has the features of the kernel that decodes; `s` is a sub-block of the
    /// rows.
    unsafe fn take(&mut self, w: &[std::arch::x86_64::__m256i; 8], sc: &SubScales, s: usize);
}

/// Multiplies each sub-block with activation rows `r0 .. r0 + T` ([`multiply_sub`]).
struct Multiply<'a, I, const T: usize, const F: u8> {
    acts: &'a QuantizedRows,
    r0: usize,
    acc: [std::arch::x86_64::__m256; T],
    /// The current run's integer sums (see [`IntForm::run`]).
    iacc: [std::arch::x86_64::__m256i; T],
    isa: std::marker::PhantomData<I>,
}

impl<I: Isa, const T: usize, const F: u8> SubSink for Multiply<'_, I, T, F> {
    #[inline(always)]
    unsafe fn take(&mut self, w: &[std::arch::x86_64::__m256i; 8], sc: &SubScales, s: usize) {
        let f = format_at(F).int_form();
        // SAFETY: forwarded; the tile's rows exist (`group_tile`'s contract).
        unsafe {
            multiply_sub::<I, T>(
                w,
                sc,
                f,
                self.acts,
                s,
                self.r0,
                &mut self.acc,
                &mut self.iacc,
            )
        }
    }
}

/// Stores each sub-block into lanes `lane .. lane + 8` of a panel sized for the rows.
struct Store {
    u: *mut u32,
    sc: *mut i32,
    d: *mut f32,
    m: *mut f32,
    lane: usize,
}

impl SubSink for Store {
    #[inline(always)]
    unsafe fn take(&mut self, wv: &[std::arch::x86_64::__m256i; 8], scales: &SubScales, s: usize) {
        use std::arch::x86_64::*;
        let lane = self.lane;
        // SAFETY: the panel holds sub-block `s` for sixteen lanes (`fill_in_registers`).
        unsafe {
            for (t, v) in wv.iter().enumerate() {
                _mm256_storeu_si256(self.u.add((s * 8 + t) * LANES + lane).cast(), *v);
            }
            _mm256_storeu_si256(self.sc.add(s * 2 * LANES + lane).cast(), scales.sc0);
            _mm256_storeu_si256(self.sc.add((s * 2 + 1) * LANES + lane).cast(), scales.sc1);
            _mm256_storeu_ps(self.d.add(s * LANES + lane), scales.d);
            _mm256_storeu_ps(self.m.add(s * LANES + lane), scales.m);
        }
    }
}

/// A sub-block's scales for eight rows (lanes = rows), as [`Panel`] holds them.
struct SubScales {
    sc0: std::arch::x86_64::__m256i,
    sc1: std::arch::x86_64::__m256i,
    d: std::arch::x86_64::__m256,
    m: std::arch::x86_64::__m256,
}

/// `acc[i] += ` sub-block `s` of eight rows (`w[t]`: values `4t .. 4t + 4` of each row)
/// times activation row `r0 + i`, for `i < T`: the integer sum and float steps of the
/// module documentation.
///
/// # Safety
///
/// As [`group_tile`]; `s` is a sub-block of the rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn multiply_sub<I: Isa, const T: usize>(
    w: &[std::arch::x86_64::__m256i; 8],
    sc: &SubScales,
    f: IntForm,
    acts: &QuantizedRows,
    s: usize,
    r0: usize,
    acc: &mut [std::arch::x86_64::__m256; T],
    iacc: &mut [std::arch::x86_64::__m256i; T],
) {
    use std::arch::x86_64::*;
    let subs = acts.blocks();
    // SAFETY: `I`'s features (the caller's contract); row `r0 + i` exists and has
    // `subs * 32` bytes, of which word `t < 8` of block `s` is read.
    unsafe {
        // Q8_0 where `dot4` takes small bytes: signed values, no offset to take back.
        let signed = I::SMALL_BYTES && f.offset == 128;
        // `|q|` as the unsigned operand, `sign(x, q)` as the signed one.
        let mut wv = *w;
        let mut q = *w;
        if signed {
            let flip = _mm256_set1_epi8(-128);
            for (v, q) in wv.iter_mut().zip(q.iter_mut()) {
                *q = _mm256_xor_si256(*v, flip);
                *v = _mm256_abs_epi8(*q);
            }
        }
        let offset = if signed { 0 } else { f.offset };
        each_row!(T, i => {
            let acc = &mut acc[i];
            let iacc = &mut iacc[i];
            let b = (r0 + i) * subs + s;
            let xp = acts.q.as_ptr().add(b * QK).cast::<i32>();
            let mut x = [_mm256_setzero_si256(); 8];
            for (t, v) in x.iter_mut().enumerate() {
                *v = _mm256_set1_epi32(xp.add(t).read_unaligned());
            }
            if signed {
                for (x, q) in x.iter_mut().zip(&q) {
                    *x = _mm256_sign_epi8(*x, *q);
                }
            }
            // Block `b` of the quantized rows exists (the caller's contract).
            let (lo, hi) = (
                *acts.sum16.get_unchecked(2 * b),
                *acts.sum16.get_unchecked(2 * b + 1),
            );
            let isum = if f.scales == IntScales::PerHalf {
                let mut a = _mm256_set1_epi32(-offset * lo);
                let mut c = _mm256_set1_epi32(-offset * hi);
                for t in 0..4 {
                    a = I::dot4(a, wv[t], x[t]);
                    c = I::dot4(c, wv[t + 4], x[t + 4]);
                }
                _mm256_add_epi32(_mm256_mullo_epi32(a, sc.sc0), _mm256_mullo_epi32(c, sc.sc1))
            } else {
                let mut a = _mm256_set1_epi32(-offset * (lo + hi));
                let mut c = _mm256_setzero_si256();
                for t in 0..4 {
                    a = I::dot4(a, wv[t], x[t]);
                    c = I::dot4(c, wv[t + 4], x[t + 4]);
                }
                let a = _mm256_add_epi32(a, c);
                if f.scales == IntScales::PerBlock {
                    _mm256_mullo_epi32(a, sc.sc0)
                } else {
                    a
                }
            };
            *iacc = if f.run == 1 { isum } else { _mm256_add_epi32(*iacc, isum) };
            if (s + 1).is_multiple_of(f.run) {
                let scale = _mm256_mul_ps(sc.d, _mm256_set1_ps(*acts.d.get_unchecked(b)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*iacc), scale, *acc);
                *iacc = _mm256_setzero_si256();
            }
            if f.mins {
                *acc = _mm256_fmadd_ps(sc.m, _mm256_set1_ps(*acts.sx.get_unchecked(b)), *acc);
            }
        });
    }
}

/// Words `w .. w + 8` of the eight rows of a word-interleaved step (see
/// `QuantMatrix`'s layout), one vector each (lanes = rows): what [`transpose8`] makes of
/// the rows' bytes `4 w .. 4 w + 32`, loaded as stored.
///
/// # Safety
///
/// The CPU has AVX; the step holds at least `w + 8` interleaved words.
#[inline(always)]
unsafe fn words8(step: *const u8, w: usize) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut v = [_mm256_setzero_si256(); 8];
        for (j, v) in v.iter_mut().enumerate() {
            *v = _mm256_loadu_si256(step.add(32 * (w + j)).cast());
        }
        v
    }
}

/// [`Isa::pair_to_bits45`] on sixteen lanes: one `vgf2p8affineqb` where `GFNI`, else a
/// shift in 16-bit lanes and a mask. The same bits either way.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW, and GFNI where `GFNI`.
#[inline(always)]
unsafe fn pair_to_bits45_wide<const GFNI: bool, const J: usize>(
    h: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        if GFNI {
            // As `VnniGfni::pair_to_bits45`: bit 4 takes input bit `2 J` (matrix byte 3),
            // bit 5 input bit `2 J + 1` (matrix byte 2).
            let matrix = ((1i64 << (2 * J)) << 24) | ((1i64 << (2 * J + 1)) << 16);
            _mm512_gf2p8affine_epi64_epi8::<0>(h, _mm512_set1_epi64(matrix))
        } else {
            let moved = match J {
                0 => _mm512_slli_epi16::<4>(h),
                1 => _mm512_slli_epi16::<2>(h),
                2 => h,
                _ => _mm512_srli_epi16::<2>(h),
            };
            _mm512_and_si512(moved, _mm512_set1_epi8(0x30))
        }
    }
}

/// Word `w` of two groups' word-interleaved steps, sixteen lanes: the first's rows in
/// the low half.
///
/// # Safety
///
/// The CPU has AVX-512 F; 32 bytes are readable at word `w` of each step.
#[inline(always)]
unsafe fn word16(steps: [*const u8; 2], w: usize) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(word8(steps[0], w)),
            word8(steps[1], w),
        )
    }
}

/// `-(a * m)` for integer `m`, the sign bit flipped as [`negate`] flips it, sixteen lanes.
///
/// # Safety
///
/// The CPU has AVX-512 F.
#[inline(always)]
unsafe fn negated_product(
    a: std::arch::x86_64::__m512,
    m: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let p = _mm512_mul_ps(a, _mm512_cvtepi32_ps(m));
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(p),
            _mm512_set1_epi32(i32::MIN),
        ))
    }
}

/// Word `w` of the eight rows of a word-interleaved step (lanes = rows).
///
/// # Safety
///
/// The CPU has AVX; the step holds at least `w + 1` interleaved words.
#[inline(always)]
unsafe fn word8(step: *const u8, w: usize) -> std::arch::x86_64::__m256i {
    // SAFETY: the caller's contract.
    unsafe { std::arch::x86_64::_mm256_loadu_si256(step.add(32 * w).cast()) }
}

/// The eight rows' f16 scales kept after a word-interleaved step's words (Q3_K's and
/// Q6_K's last two bytes, at word `words`), as f32 lanes.
///
/// # Safety
///
/// The CPU has AVX and F16C; 16 bytes are readable at word `words` of the step.
#[inline(always)]
unsafe fn tail_f16(step: *const u8, words: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(step.add(32 * words).cast())) }
}

/// The f16 pair in each of eight rows' words (`heads`, lanes = rows: the low half, then
/// the high half) as f32 lanes.
///
/// # Safety
///
/// The CPU has `I`'s features.
#[inline(always)]
unsafe fn f16_pair<I: Isa>(heads: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256; 2] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        [
            I::f16_low(heads),
            I::f16_low(_mm256_srli_epi32::<16>(heads)),
        ]
    }
}

/// `-x`, every bit of it (the scalar decoder's negation, not `0 - x`).
///
/// # Safety
///
/// The CPU has AVX.
#[inline(always)]
unsafe fn negate(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe { _mm256_xor_ps(x, _mm256_set1_ps(-0.0)) }
}

/// One step of a Q8_0, Q4_0 or Q4_1 group (eight rows' block `b`): the values and scales.
///
/// # Safety
///
/// The CPU has `I`'s features; `step` holds the step in the grouped layout (eight heads,
/// then eight payloads).
#[inline(always)]
unsafe fn decode_step_32<I: Isa>(
    format: QuantFormat,
    step: *const u8,
) -> ([std::arch::x86_64::__m256i; 8], SubScales) {
    use std::arch::x86_64::*;
    let hb = format.head_bytes();
    // SAFETY (loads): the step's heads are `8 * hb` bytes, its payloads follow.
    unsafe {
        let (d, m) = if hb == 4 {
            let [d, m] = f16_pair::<I>(_mm256_loadu_si256(step.cast()));
            (d, m)
        } else {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(step.cast())),
                _mm256_setzero_ps(),
            )
        };
        let one = _mm256_set1_epi32(1);
        let scales = SubScales {
            sc0: one,
            sc1: one,
            d,
            m,
        };
        let payload = step.add(GROUP_ROWS * hb);
        let mut w = [_mm256_setzero_si256(); 8];
        if format == QuantFormat::Q8_0 {
            let flip = _mm256_set1_epi8(-128);
            let t = transpose8::<I>(|i| payload.add(32 * i));
            for (v, t) in w.iter_mut().zip(t) {
                *v = _mm256_xor_si256(t, flip);
            }
        } else {
            let nibble = _mm256_set1_epi8(0x0F);
            let mut rows = [_mm256_setzero_si256(); 4];
            for (p, v) in rows.iter_mut().enumerate() {
                // Eight payloads of 16 bytes, two per load.
                *v = _mm256_loadu_si256(payload.add(32 * p).cast());
            }
            for (j, v) in I::transpose4(rows).into_iter().enumerate() {
                w[j] = _mm256_and_si256(v, nibble);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
            }
        }
        (w, scales)
    }
}

/// The 32-bit word at byte `at` of each of eight rows `stride` bytes apart from `step`
/// (lanes = rows): one gather, for fields too few or too scattered to transpose.
///
/// # Safety
///
/// The CPU has AVX2; four bytes are readable at `step + i * stride + at` for `i < 8`.
#[inline(always)]
unsafe fn row_words(step: *const u8, stride: usize, at: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let s = stride as i32;
    // SAFETY: the caller's contract.
    unsafe {
        let rows = _mm256_setr_epi32(0, s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s);
        _mm256_i32gather_epi32::<1>(step.wrapping_add(at).cast(), rows)
    }
}

/// One step of a Q5_0 or Q5_1 group (eight rows' block `b`, kept whole): the values and
/// scales. Each row's 32 fifth bits (`qh`) are one gathered word; four of them are spread
/// to bit 4 of four bytes by one multiplication (`x * 0x0020_4081` puts bit `i` of a
/// 4-bit `x` at bit `8i`, the partial products never overlapping).
///
/// # Safety
///
/// The CPU has `I`'s features; `step` holds eight whole blocks of the format.
#[inline(always)]
unsafe fn decode_step_q5<I: Isa>(
    format: QuantFormat,
    step: *const u8,
) -> ([std::arch::x86_64::__m256i; 8], SubScales) {
    use std::arch::x86_64::*;
    let bb = format.block_bytes();
    let head = if format == QuantFormat::Q5_1 { 4 } else { 2 };
    let row = |i: usize| step.wrapping_add(i * bb);
    // SAFETY (every read): row `i < 8`'s block is `bb` bytes at `row(i)`: `d` (and `m`)
    // at 0, `qh` at `head`, 16 bytes of `qs` at `head + 4`.
    unsafe {
        let heads = row_words(step, bb, 0);
        let qh = row_words(step, bb, head);
        let [d, m] = f16_pair::<I>(heads);
        let m = if format == QuantFormat::Q5_1 {
            m
        } else {
            _mm256_setzero_ps()
        };
        let one = _mm256_set1_epi32(1);
        let scales = SubScales {
            sc0: one,
            sc1: one,
            d,
            m,
        };
        let mut pairs = [_mm256_setzero_si256(); 4];
        for (p, v) in pairs.iter_mut().enumerate() {
            *v = _mm256_loadu2_m128i(
                row(2 * p + 1).add(head + 4).cast(),
                row(2 * p).add(head + 4).cast(),
            );
        }
        let (nibble, low4, spread, bits) = (
            _mm256_set1_epi8(0x0F),
            _mm256_set1_epi32(0x0F),
            _mm256_set1_epi32(0x0020_4081),
            _mm256_set1_epi32(0x0101_0101),
        );
        let mut w = [_mm256_setzero_si256(); 8];
        for (j, v) in I::transpose4(pairs).into_iter().enumerate() {
            let halves = [
                _mm256_and_si256(v, nibble),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble),
            ];
            for (h, low) in halves.into_iter().enumerate() {
                let t = j + 4 * h;
                let four =
                    _mm256_and_si256(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(4 * t as i32)), low4);
                let fifth = _mm256_and_si256(_mm256_mullo_epi32(four, spread), bits);
                w[t] = _mm256_or_si256(low, _mm256_slli_epi32::<4>(fifth));
            }
        }
        (w, scales)
    }
}

/// One step of a Q4_K or Q5_K group (eight rows' super-block, word-interleaved): calls
/// `sub(w, scales, i)` for its eight sub-blocks in order. The scales and minimums are
/// unpacked for the eight rows at once: word 0 holds `d | dmin << 16` of every row and
/// words 1-3 the packed bytes, from which each 6-bit scale and minimum is shifts and
/// masks.
///
/// # Safety
///
/// The CPU has `I`'s features; `step` holds eight blocks of the format, interleaved.
#[inline(always)]
unsafe fn decode_step_k4<I: Isa>(
    format: QuantFormat,
    step: *const u8,
    first: usize,
    sink: &mut impl SubSink,
) {
    use std::arch::x86_64::*;
    let five = format == QuantFormat::Q5_K;
    // The first word of the values (`qs`): bytes 48 (Q5_K) or 16 (Q4_K).
    let qs = if five { 12 } else { 4 };
    // SAFETY (every read): the step holds the blocks' 36 (Q4_K) or 44 (Q5_K) words.
    unsafe {
        let head = [
            word8(step, 0),
            word8(step, 1),
            word8(step, 2),
            word8(step, 3),
        ];
        let [d, dmin] = f16_pair::<I>(head[0]);
        // ggml's packing of the eight 6-bit scales and minimums in 12 bytes `q`: for
        // j < 4, scale j = q[j] & 63 and minimum j = q[j + 4] & 63; for j >= 4, the low
        // four bits come from q[j + 4] (scale: low nibble, minimum: high nibble) and the
        // top two from the top bits of q[j - 4] (scale) and q[j] (minimum).
        let (a, b, c) = (head[1], head[2], head[3]);
        let (six, four, two) = (
            _mm256_set1_epi32(63),
            _mm256_set1_epi32(15),
            _mm256_set1_epi32(3),
        );
        let mut sc = [_mm256_setzero_si256(); 8];
        let mut mn = [_mm256_setzero_ps(); 8];
        unrolled!(j in [0 1 2 3] => {
            let k = _mm_cvtsi32_si128(8 * j as i32);
            let (k4, k6) = (
                _mm_cvtsi32_si128(8 * j as i32 + 4),
                _mm_cvtsi32_si128(8 * j as i32 + 6),
            );
            sc[j] = _mm256_and_si256(_mm256_srl_epi32(a, k), six);
            let m = _mm256_and_si256(_mm256_srl_epi32(b, k), six);
            sc[j + 4] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(c, k), four),
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(a, k6), two)),
            );
            let m4 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(c, k4), four),
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(b, k6), two)),
            );
            mn[j] = negate(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)));
            mn[j + 4] = negate(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m4)));
        });
        let high = if five {
            words8(step, 4)
        } else {
            [_mm256_setzero_si256(); 8]
        };
        let (nibble, fifth) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        let mut w = [_mm256_setzero_si256(); 8];
        unrolled!(chunk in [0 1 2 3] => {
            let t = words8(step, qs + 8 * chunk);
            unrolled!(half in [0 1] => {
                let s = 2 * chunk + half;
                for (k, v) in w.iter_mut().enumerate() {
                    let q = if half == 0 {
                        t[k]
                    } else {
                        _mm256_srli_epi16::<4>(t[k])
                    };
                    *v = if five {
                        // Bit `s` of each `qh` byte moved to bit 4 (shifts in 16-bit
                        // lanes: the mask drops what crosses a byte).
                        let moved = if s <= 4 {
                            _mm256_sll_epi16(high[k], _mm_cvtsi32_si128(4 - s as i32))
                        } else {
                            _mm256_srl_epi16(high[k], _mm_cvtsi32_si128(s as i32 - 4))
                        };
                        I::and_or(q, nibble, _mm256_and_si256(moved, fifth))
                    } else {
                        _mm256_and_si256(q, nibble)
                    };
                }
                let scales = SubScales {
                    sc0: sc[s],
                    sc1: sc[s],
                    d,
                    m: mn[s],
                };
                sink.take(&w, &scales, first + s);
            });
        });
    }
}

/// One step of a Q3_K group (eight rows' super-block, word-interleaved): calls `sink` for
/// its eight sub-blocks in order. Values: two bits from `qs` plus a third from `hmask`
/// (set: 4 added); the sixteen 6-bit scales (less 32) of the eight rows are unpacked
/// from three words per row, `d` from the step's tail.
///
/// # Safety
///
/// The CPU has `I`'s features; `step` holds eight Q3_K blocks, interleaved.
#[inline(always)]
unsafe fn decode_step_q3k<I: Isa>(step: *const u8, first: usize, sink: &mut impl SubSink) {
    use std::arch::x86_64::*;
    // SAFETY (every read): the step holds the blocks' 27 words, `hmask` at words 0-7,
    // `qs` at 8-23 and the packed scales at 24-26, then the eight `d`.
    unsafe {
        let packed = [word8(step, 24), word8(step, 25), word8(step, 26)];
        let d = tail_f16(step, 27);
        // ggml's packing of sixteen 6-bit scales in 12 bytes `q`: the low four bits of
        // scale i are q[i]'s low nibble (i < 8) or q[i - 8]'s high nibble; the top two are
        // bits 2(i / 4) of q[8 + i % 4].
        let (four, two, bias) = (
            _mm256_set1_epi32(15),
            _mm256_set1_epi32(3),
            _mm256_set1_epi32(32),
        );
        let mut scale = [_mm256_setzero_si256(); 16];
        for (i, v) in scale.iter_mut().enumerate() {
            let j = i % 8;
            let low_at = 8 * (j % 4) + if i < 8 { 0 } else { 4 };
            let low = _mm256_and_si256(
                _mm256_srl_epi32(packed[j / 4], _mm_cvtsi32_si128(low_at as i32)),
                four,
            );
            let high_at = 8 * (i % 4) + 2 * (i / 4);
            let high = _mm256_and_si256(
                _mm256_srl_epi32(packed[2], _mm_cvtsi32_si128(high_at as i32)),
                two,
            );
            *v = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32::<4>(high)), bias);
        }
        let hmask = words8(step, 0);
        let (pair, third) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
        let mut w = [_mm256_setzero_si256(); 8];
        unrolled!(half in [0 1] => {
            let qs = words8(step, 8 + 8 * half);
            unrolled!(pass in [0 1 2 3] => {
                let s = 4 * half + pass;
                let low_shift = _mm_cvtsi32_si128(2 * pass as i32);
                for (k, v) in w.iter_mut().enumerate() {
                    // Bit `s` of each `hmask` byte moved to bit 2 (shifts in 16-bit
                    // lanes: the mask drops what crosses a byte).
                    let moved = if s <= 2 {
                        _mm256_sll_epi16(hmask[k], _mm_cvtsi32_si128(2 - s as i32))
                    } else {
                        _mm256_srl_epi16(hmask[k], _mm_cvtsi32_si128(s as i32 - 2))
                    };
                    *v = I::and_or(
                        _mm256_srl_epi16(qs[k], low_shift),
                        pair,
                        _mm256_and_si256(moved, third),
                    );
                }
                let scales = SubScales {
                    sc0: scale[2 * s],
                    sc1: scale[2 * s + 1],
                    d,
                    m: _mm256_setzero_ps(),
                };
                sink.take(&w, &scales, first + s);
            });
        });
    }
}

/// One step of a Q6_K group (eight rows' super-block, word-interleaved): calls
/// `sub(w, scales, i)` for its eight sub-blocks in order. The sixteen signed 8-bit scales
/// of the eight rows are words 48-51, each sign-extended with two shifts.
///
/// # Safety
///
/// The CPU has `I`'s features; `step` holds eight Q6_K blocks, interleaved.
#[inline(always)]
unsafe fn decode_step_q6k<I: Isa>(step: *const u8, first: usize, sink: &mut impl SubSink) {
    use std::arch::x86_64::*;
    // SAFETY (every read): the step holds the blocks' 52 words (`ql` at 0-31, `qh` at
    // 32-47, the scales at 48-51), then the eight `d`.
    unsafe {
        let d = tail_f16(step, 52);
        let packed = [
            word8(step, 48),
            word8(step, 49),
            word8(step, 50),
            word8(step, 51),
        ];
        let mut scale = [_mm256_setzero_si256(); 16];
        for (k, v) in scale.iter_mut().enumerate() {
            let up = _mm256_sll_epi32(packed[k / 4], _mm_cvtsi32_si128(24 - 8 * (k % 4) as i32));
            *v = _mm256_srai_epi32::<24>(up);
        }
        let nibble = _mm256_set1_epi8(0x0F);
        let mut w = [_mm256_setzero_si256(); 8];
        unrolled!(half in [0 1] => {
            let a = words8(step, 16 * half);
            let b = words8(step, 16 * half + 8);
            let h = words8(step, 32 + 8 * half);
            unrolled!(j in [0 1 2 3] => {
                let s = 4 * half + j;
                let src = if j.is_multiple_of(2) { &a } else { &b };
                for (k, v) in w.iter_mut().enumerate() {
                    let low = if j < 2 {
                        src[k]
                    } else {
                        _mm256_srli_epi16::<4>(src[k])
                    };
                    // Bits 2j, 2j + 1 of each `qh` byte moved to bits 4, 5.
                    *v = I::and_or(low, nibble, I::pair_to_bits45::<j>(h[k]));
                }
                let scales = SubScales {
                    sc0: scale[2 * s],
                    sc1: scale[2 * s + 1],
                    d,
                    m: _mm256_setzero_ps(),
                };
                sink.take(&w, &scales, first + s);
            });
        });
    }
}

/// Calls `tile(r, n)` for rows `r .. r + n` in turn, tiles of `size` rows covering
/// `rows` (the last one shorter), first asking for a share of each of `next` (the next
/// panels' weights) into the second-level cache: the row loop of every panel kernel.
#[inline(always)]
fn row_tiles(rows: usize, size: usize, next: &[Option<&[u8]>], mut tile: impl FnMut(usize, usize)) {
    let tiles = rows.div_ceil(size);
    let mut r = 0;
    while r < rows {
        for next in next.iter().flatten() {
            crate::kernels::tiling::prefetch_share(next, r / size, tiles);
        }
        let n = size.min(rows - r);
        tile(r, n);
        r += n;
    }
}

/// The kernel with `vpdpbusd` for every activation row against the panel's sixteen
/// rows: tiles of [`ROW_TILE`] rows ([`vnni_tile_rows`]), each tile's results stored
/// straight into columns `first .. first + n` of `target` (no results array copied
/// after each tile: that copy and the per-tile dispatch were 6-7% of a 128-row
/// product's samples). `next`, the next panel's weights, is asked for a share per tile.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, VNNI and FMA; the panel and rows come from one matrix;
/// `acts` holds `rows` rows; `target` holds `rows` rows of at least `first + n`
/// columns, of which `first .. first + n` (`n <= 16`) are this caller's alone.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
pub(super) unsafe fn vnni_panel(
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    n: usize,
    next: Option<&[u8]>,
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => vnni_panel_of::<{ same_form(F) }>(panel, acts, rows, target, first, n, next))
    }
}

/// [`vnni_panel`] for the format whose id is `F`: whole tiles, then the rest.
///
/// # Safety
///
/// As [`vnni_panel`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_panel_of<const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    n: usize,
    next: Option<&[u8]>,
) {
    let mask: u16 = if n >= LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    };
    row_tiles(rows, ROW_TILE, &[next], |r, tile| {
        // SAFETY: the caller's contract; rows `r .. r + tile` exist, and their columns
        // `first .. first + n` are the caller's.
        unsafe {
            let out = target.at(r, first);
            with_tile!(tile, T => vnni_tile_rows::<T, F>(panel, acts, r, out, target.n_out, mask))
        }
    });
}

/// [`vnni_panel`]'s tile of `T` rows of the format whose id is `F` ([`format_at`]):
/// [`panel_tile`] on 512-bit vectors. Row `i`'s results go to lanes `mask` of `out + i *
/// stride`. Never inlined: one function per tile and format, as [`group_tile_vnni_of`].
///
/// # Safety
///
/// As [`vnni_panel`]; rows `r0 .. r0 + T` exist; `out + i * stride` holds the lanes in
/// `mask` for `i < T`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_tile_rows<const T: usize, const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    stride: usize,
    mask: u16,
) {
    // SAFETY: the caller's contract (AVX-512 with VNNI; the rows, the panel's sixteen
    // lanes, and the lanes in `mask` of each output row).
    unsafe {
        let acc = panel_tile::<Zmm, T, 1, F>([panel], acts, r0, [0]);
        for (i, [a]) in acc.into_iter().enumerate() {
            std::arch::x86_64::_mm512_mask_storeu_ps(out.add(i * stride), mask, a);
        }
    }
}

/// Activation rows per tile of [`vnni_panel_pair`]: each row keeps an integer and a float
/// sum and the sub-block's sums for each of the two panels. On Zen 5 (`kernels` bench,
/// 1B `ffn_up` at 128 rows, alternated) 4 rows ran 4-17% faster than the one-panel kernel
/// on every format, 5 and 6 rows (with more registers than AVX-512's 32) slower than 4.
pub(super) const PAIR_TILE: usize = 4;

/// [`vnni_panel`] for two full panels at once (32 outputs, from column `first` of
/// `target`): each activation word broadcast once for both ([`panel_tile`]), in tiles of
/// [`PAIR_TILE`] rows. `next` are the next two panels' bytes, asked for into the
/// second-level cache a share per tile. The same bits as [`vnni_panel`] on each panel.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, VNNI and FMA; both panels were decoded (16 rows each)
/// from one matrix of `format`, the rows from its activations; `acts` holds `rows` rows;
/// `target` holds `rows` rows of at least `first + 32` columns, of which `first .. first
/// + 32` are this caller's alone.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
pub(super) unsafe fn vnni_panel_pair(
    panels: [&Panel; 2],
    format: QuantFormat,
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    next: [Option<&[u8]>; 2],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => vnni_panel_pair_of::<{ same_form(F) }>(panels, acts, rows, target, first, next))
    }
}

/// [`vnni_panel_pair`] for the format whose id is `F`: whole tiles, then the rest.
///
/// # Safety
///
/// As [`vnni_panel_pair`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_panel_pair_of<const F: u8>(
    panels: [&Panel; 2],
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    next: [Option<&[u8]>; 2],
) {
    row_tiles(rows, PAIR_TILE, &next, |r, tile| {
        // SAFETY: the caller's contract; rows `r .. r + tile` exist, and their columns
        // `first .. first + 32` are the caller's.
        unsafe {
            let out = target.at(r, first);
            with_tile!(tile, T => vnni_pair_rows::<T, F>(panels, acts, r, out, target.n_out); 1 2 3; 4)
        }
    });
}

/// [`vnni_panel_pair`]'s tile of `T` rows of the format whose id is `F`: [`panel_tile`]
/// on 512-bit vectors for two panels. Row `i`'s 32 results go to `out + i * stride`.
///
/// # Safety
///
/// As [`vnni_panel_pair`]; rows `r0 .. r0 + T` exist; `out + i * stride` holds 32
/// values for `i < T`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_pair_rows<const T: usize, const F: u8>(
    panels: [&Panel; 2],
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    stride: usize,
) {
    use std::arch::x86_64::_mm512_storeu_ps;
    // SAFETY: the caller's contract (AVX-512 with VNNI; the rows, both panels' sixteen
    // lanes, and 32 values of each output row).
    unsafe {
        let acc = panel_tile::<Zmm, T, 2, F>(panels, acts, r0, [0, 0]);
        for (i, [a, b]) in acc.into_iter().enumerate() {
            _mm512_storeu_ps(out.add(i * stride), a);
            _mm512_storeu_ps(out.add(i * stride + LANES), b);
        }
    }
}

/// The vector width a panel tile runs at: its lanes are outputs (panel lanes), and
/// these are the few instructions [`panel_tile`] takes, on 512-bit vectors ([`Zmm`],
/// AVX-512 with VNNI) or 256-bit ones ([`Ymm`], AVX2 with AVX-VNNI).
trait PanelVector {
    /// Sixteen or eight 32-bit integers.
    type I: Copy;
    /// Sixteen or eight floats.
    type F: Copy;

    /// # Safety
    ///
    /// (Every method.) The CPU has the width's features; a load reads `Self`'s lanes.
    unsafe fn load_i(p: *const i32) -> Self::I;
    unsafe fn load_f(p: *const f32) -> Self::F;
    unsafe fn splat_i(v: i32) -> Self::I;
    unsafe fn splat_f(v: f32) -> Self::F;
    unsafe fn zero_f() -> Self::F;
    /// `acc + ` each lane's four products of unsigned bytes of `w` with signed bytes of `x`.
    unsafe fn dpbusd(acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    unsafe fn add(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mullo(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c`, one rounding.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn to_f(a: Self::I) -> Self::F;
}

/// 512-bit vectors, AVX-512 F with VNNI and FMA.
struct Zmm;

/// 256-bit vectors, AVX2 with AVX-VNNI and FMA.
struct Ymm;

/// Writes out a [`PanelVector`] impl from each method's intrinsic.
macro_rules! panel_vector {
    ($v:ty, $i:ty, $f:ty, $load_i:ident, $load_f:ident, $splat_i:ident, $splat_f:ident,
     $zero_f:ident, $dpbusd:ident, $add:ident, $mullo:ident, $mul:ident, $fmadd:ident,
     $to_f:ident) => {
        impl PanelVector for $v {
            type I = $i;
            type F = $f;
            #[inline(always)]
            unsafe fn load_i(p: *const i32) -> $i {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$load_i(p.cast()) }
            }
            #[inline(always)]
            unsafe fn load_f(p: *const f32) -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$load_f(p) }
            }
            #[inline(always)]
            unsafe fn splat_i(v: i32) -> $i {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$splat_i(v) }
            }
            #[inline(always)]
            unsafe fn splat_f(v: f32) -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$splat_f(v) }
            }
            #[inline(always)]
            unsafe fn zero_f() -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$zero_f() }
            }
            #[inline(always)]
            unsafe fn dpbusd(acc: $i, w: $i, x: $i) -> $i {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$dpbusd(acc, w, x) }
            }
            #[inline(always)]
            unsafe fn add(a: $i, b: $i) -> $i {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$add(a, b) }
            }
            #[inline(always)]
            unsafe fn mullo(a: $i, b: $i) -> $i {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$mullo(a, b) }
            }
            #[inline(always)]
            unsafe fn mul(a: $f, b: $f) -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$mul(a, b) }
            }
            #[inline(always)]
            unsafe fn fmadd(a: $f, b: $f, c: $f) -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$fmadd(a, b, c) }
            }
            #[inline(always)]
            unsafe fn to_f(a: $i) -> $f {
                // SAFETY: the caller's contract.
                unsafe { std::arch::x86_64::$to_f(a) }
            }
        }
    };
}

panel_vector!(
    Zmm,
    std::arch::x86_64::__m512i,
    std::arch::x86_64::__m512,
    _mm512_loadu_si512,
    _mm512_loadu_ps,
    _mm512_set1_epi32,
    _mm512_set1_ps,
    _mm512_setzero_ps,
    _mm512_dpbusd_epi32,
    _mm512_add_epi32,
    _mm512_mullo_epi32,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_cvtepi32_ps
);

panel_vector!(
    Ymm,
    std::arch::x86_64::__m256i,
    std::arch::x86_64::__m256,
    _mm256_loadu_si256,
    _mm256_loadu_ps,
    _mm256_set1_epi32,
    _mm256_set1_ps,
    _mm256_setzero_ps,
    _mm256_dpbusd_avx_epi32,
    _mm256_add_epi32,
    _mm256_mullo_epi32,
    _mm256_mul_ps,
    _mm256_fmadd_ps,
    _mm256_cvtepi32_ps
);

/// Activation rows `r0 .. r0 + T` against lanes `lanes[k] ..` (as many as `V` holds) of
/// each panel `k` of `P`, for the format whose id is `F`: the integer sums of the module
/// documentation, then its float steps in sub-block order, each `if const` keeping only
/// the format's own steps. Returns each row's results, a vector per panel. Written once
/// for both widths and for one or two panels, inlined into each kernel's own target
/// features ([`vnni_tile_rows`], [`vnni_pair_rows`], [`avx_vnni_tile_rows`]).
///
/// Each step of four values loads one weight word per panel and broadcasts each row's
/// activation word once for all `P` panels: with one panel every `vpdpbusd` took a load
/// of its own beside its weights' share, and a bare loop of that shape (no scales) ran
/// at 75% of `vpdpbusd`'s rate on Zen 5, against 95-100% with two or three panels.
/// Every lane's integer sums are exact whatever their grouping, and its float steps are
/// the same steps in the same order as with one panel: the same bits.
///
/// # Safety
///
/// The CPU has `V`'s features; the panels were decoded from a matrix of `F`'s integer
/// form with `acts.n_in` columns; rows `r0 .. r0 + T` exist; each of `lanes` plus `V`'s
/// lanes is at most 16.
#[inline(always)]
unsafe fn panel_tile<V: PanelVector, const T: usize, const P: usize, const F: u8>(
    panels: [&Panel; P],
    acts: &QuantizedRows,
    r0: usize,
    lanes: [usize; P],
) -> [[V::F; P]; T] {
    let f = const { format_at(F).int_form() };
    let per_half = const { matches!(format_at(F).int_form().scales, IntScales::PerHalf) };
    let subs = acts.blocks();
    debug_assert!(acts.q.len() >= (r0 + T) * acts.n_in && acts.d.len() >= (r0 + T) * subs);
    // SAFETY (every pointer and load): each panel holds `subs * 8 * 16` words, `subs * 2
    // * 16` scales and `subs * 16` of `d` and `m`, of which lanes `lanes[k] ..` are read;
    // each activation row has `subs * 32` bytes, `subs` scales and sums `x * d`, and `2 *
    // subs` half sums; rows `r0 .. r0 + T` exist; `V`'s features (the caller's contract).
    unsafe {
        let mut acc = [[V::zero_f(); P]; T];
        let mut iacc = [[V::splat_i(0); P]; T];
        let up: [_; P] =
            std::array::from_fn(|k| panels[k].u.words().as_ptr().add(lanes[k]).cast::<i32>());
        let scp: [_; P] = std::array::from_fn(|k| panels[k].sc.as_ptr().add(lanes[k]));
        let dp: [_; P] = std::array::from_fn(|k| panels[k].d.as_ptr().add(lanes[k]));
        let mp: [_; P] = std::array::from_fn(|k| panels[k].m.as_ptr().add(lanes[k]));
        let (ad, asx, asum) = (acts.d.as_ptr(), acts.sx.as_ptr(), acts.sum16.as_ptr());
        for s in 0..subs {
            // Each row's sums of the sub-block (of its first half where the scales are
            // per half), started at minus the offset times the activations' sum.
            let mut sums = [[V::splat_i(0); P]; T];
            each_row!(T, i => {
                let b = (r0 + i) * subs + s;
                let (lo, hi) = (*asum.add(2 * b), *asum.add(2 * b + 1));
                sums[i] = [V::splat_i(-f.offset * if per_half { lo } else { lo + hi }); P];
            });
            for t in 0..4 {
                dot_step::<V, T, P>(&mut sums, up, acts, r0, s, t);
            }
            if per_half {
                for (p, sc) in scp.iter().enumerate() {
                    let sc0 = V::load_i(sc.add(s * 2 * LANES));
                    each_row!(T, i => {
                        iacc[i][p] = V::add(iacc[i][p], V::mullo(sums[i][p], sc0));
                    });
                }
                each_row!(T, i => {
                    let hi = *asum.add(2 * ((r0 + i) * subs + s) + 1);
                    sums[i] = [V::splat_i(-f.offset * hi); P];
                });
            }
            for t in 4..8 {
                dot_step::<V, T, P>(&mut sums, up, acts, r0, s, t);
            }
            for (p, sc) in scp.iter().enumerate() {
                let sc = V::load_i(sc.add((s * 2 + usize::from(per_half)) * LANES));
                each_row!(T, i => {
                    let isum = match f.scales {
                        IntScales::One => sums[i][p],
                        IntScales::PerBlock | IntScales::PerHalf => V::mullo(sums[i][p], sc),
                    };
                    iacc[i][p] = V::add(iacc[i][p], isum);
                });
            }
            if (s + 1).is_multiple_of(f.run) {
                for (p, d) in dp.iter().enumerate() {
                    let dw = V::load_f(d.add(s * LANES));
                    each_row!(T, i => {
                        let scale = V::mul(dw, V::splat_f(*ad.add((r0 + i) * subs + s)));
                        acc[i][p] = V::fmadd(V::to_f(iacc[i][p]), scale, acc[i][p]);
                        iacc[i][p] = V::splat_i(0);
                    });
                }
            }
            if const { format_at(F).int_form().mins } {
                for (p, m) in mp.iter().enumerate() {
                    let m = V::load_f(m.add(s * LANES));
                    each_row!(T, i => {
                        let sx = V::splat_f(*asx.add((r0 + i) * subs + s));
                        acc[i][p] = V::fmadd(m, sx, acc[i][p]);
                    });
                }
            }
        }
        acc
    }
}

/// One step of [`panel_tile`]: values `4t .. 4t + 4` of sub-block `s`, each row's word
/// broadcast once and multiplied with the word of each panel.
///
/// # Safety
///
/// As [`panel_tile`]; `up` points at each panel's words (at its lane), `t < 8`.
#[inline(always)]
unsafe fn dot_step<V: PanelVector, const T: usize, const P: usize>(
    sums: &mut [[V::I; P]; T],
    up: [*const i32; P],
    acts: &QuantizedRows,
    r0: usize,
    s: usize,
    t: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let w = up.map(|u| V::load_i(u.add((s * 8 + t) * LANES)));
        let xq = acts.q.as_ptr();
        each_row!(T, i => {
            let xp = xq.add((r0 + i) * acts.n_in + s * QK).cast::<i32>();
            let x = V::splat_i(xp.add(t).read_unaligned());
            for (sum, w) in sums[i].iter_mut().zip(w) {
                *sum = V::dpbusd(*sum, w, x);
            }
        });
    }
}

/// Activation rows per tile of the AVX-VNNI panel kernel ([`avx_vnni_panel`]): each
/// row keeps a float and an integer sum for eight lanes in registers beside the eight
/// weight words of a sub-block, of sixteen registers in all.
const AVX_VNNI_TILE: usize = 4;

/// `x @ W^T` for `rows` activation rows against a decoded panel (`n` of its sixteen
/// outputs, from column `first` of `target`) on AVX2 with AVX-VNNI: [`vnni_panel`]'s
/// integer sums and float steps, in its order (so its bits), on 256-bit vectors. A full
/// panel takes both halves (eight outputs each) at once, each activation word broadcast
/// once for both; a partial one each half in turn, masked. `next` is the next panel's
/// bytes, asked for into the second-level cache a share per row tile.
///
/// # Safety
///
/// The CPU has AVX2, AVX-VNNI, FMA and F16C; the panel was decoded from a matrix of
/// `format` with `acts.n_in` columns; `target` holds `rows` rows and columns `first ..
/// first + n`, which no other thread writes; `n <= 16`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
pub(super) unsafe fn avx_vnni_panel(
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    n: usize,
    next: Option<&[u8]>,
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => avx_vnni_panel_of::<{ same_form(F) }>(panel, acts, rows, target, first, n, next))
    }
}

/// [`avx_vnni_panel`] for the format whose id is `F`.
///
/// # Safety
///
/// As [`avx_vnni_panel`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
unsafe fn avx_vnni_panel_of<const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    rows: usize,
    target: &Columns,
    first: usize,
    n: usize,
    next: Option<&[u8]>,
) {
    if n == LANES {
        // Both halves at once: each activation word broadcast once for sixteen outputs.
        row_tiles(rows, AVX_VNNI_BOTH_TILE, &[next], |r, tile| {
            // SAFETY: the caller's contract; rows `r .. r + tile` exist, and their columns
            // `first .. first + 16` are the caller's.
            unsafe {
                let out = target.at(r, first);
                with_tile!(tile, T => avx_vnni_both_rows::<T, F>(panel, acts, r, out, target.n_out); 1 2; 3)
            }
        });
        return;
    }
    for half in 0..2 {
        let lanes = n.saturating_sub(half * 8).min(8);
        if lanes == 0 {
            break;
        }
        let next = if half == 0 { next } else { None };
        row_tiles(rows, AVX_VNNI_TILE, &[next], |r, tile| {
            // SAFETY: the caller's contract; rows `r .. r + tile` exist, and their columns
            // `first + 8 half .. first + 8 half + lanes` are the caller's.
            unsafe {
                let out = target.at(r, first + 8 * half);
                with_tile!(tile, T => avx_vnni_tile_rows::<T, F>(panel, acts, r, half, out, target.n_out, lanes); 1 2 3; 4)
            }
        });
    }
}

/// [`avx_vnni_panel`]'s tile of `T` rows against half `half` of the panel (lanes `8 half
/// .. 8 half + 8`), of the format whose id is `F`: [`panel_tile`] on 256-bit vectors.
/// Row `i`'s results go to its first `lanes` values at `out + i * stride`.
///
/// # Safety
///
/// As [`avx_vnni_panel`]; rows `r0 .. r0 + T` exist; `out + i * stride` holds `lanes`
/// values for `i < T`; `half < 2`, `lanes <= 8`.
#[inline(never)]
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
unsafe fn avx_vnni_tile_rows<const T: usize, const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    r0: usize,
    half: usize,
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    use std::arch::x86_64::{_mm256_cmpgt_epi32, _mm256_set1_epi32, _mm256_setr_epi32};
    debug_assert!(half < 2 && lanes <= 8);
    // SAFETY: the caller's contract (AVX2 with AVX-VNNI; the rows, the panel's lanes
    // `8 half .. 8 half + 8`, and the first `lanes` values of each output row).
    unsafe {
        // Lanes `0..lanes`: all ones where written.
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(lanes as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let acc = panel_tile::<Ymm, T, 1, F>([panel], acts, r0, [8 * half]);
        for (i, [a]) in acc.into_iter().enumerate() {
            std::arch::x86_64::_mm256_maskstore_ps(out.add(i * stride), mask, a);
        }
    }
}

/// Activation rows per tile of [`avx_vnni_panel`] on a full panel, both halves at once:
/// on Zen 5 with `LLAMA_BURN_SIMD=avx2` (1B `ffn_up`, alternated) 3 rows ran 13-31%
/// faster than each half in turn at 16 and 128 rows, 2 rows less so, 4 even with 3.
const AVX_VNNI_BOTH_TILE: usize = 3;

/// [`avx_vnni_panel`]'s tile of `T` rows against both halves of a full panel at once
/// ([`panel_tile`] with the panel's two halves as two panels of eight lanes), of the
/// format whose id is `F`. Row `i`'s sixteen results go to `out + i * stride`.
///
/// # Safety
///
/// As [`avx_vnni_panel`]; the panel is full; rows `r0 .. r0 + T` exist; `out + i *
/// stride` holds sixteen values for `i < T`.
#[inline(never)]
#[target_feature(enable = "avx2,avxvnni,fma,f16c")]
unsafe fn avx_vnni_both_rows<const T: usize, const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    stride: usize,
) {
    use std::arch::x86_64::_mm256_storeu_ps;
    // SAFETY: the caller's contract (AVX2 with AVX-VNNI; the rows, the panel's sixteen
    // lanes, and sixteen values of each output row).
    unsafe {
        let acc = panel_tile::<Ymm, T, 2, F>([panel, panel], acts, r0, [0, 8]);
        for (i, [a, b]) in acc.into_iter().enumerate() {
            _mm256_storeu_ps(out.add(i * stride), a);
            _mm256_storeu_ps(out.add(i * stride + 8), b);
        }
    }
}

/// Words (four values) of a sub-block whose `vpmaddubsw` results AVX2 can add in 16
/// bits without overflow: each word adds at most `2 * max * 127` to a 16-bit lane
/// (the activations are at most 127 in magnitude), so eight words for the 4-bit
/// formats, four for the 5-bit ones, two for Q6_K, and one for Q8_0, whose signed form
/// (`|q| <= 128`) is multiplied.
const fn words_per_i16(f: IntForm) -> usize {
    let max = if f.offset == 128 { 128 } else { f.max };
    let n = 32767 / (2 * max * 127);
    if n < 1 {
        1
    } else if n > 8 {
        8
    } else {
        n as usize
    }
}

/// Each 32-bit lane's low 16 bits of `lo` and of `hi`, as the lane's low and high 16-bit
/// halves (for `vpmaddwd`; the values fit in 16 bits).
///
/// # Safety
///
/// The CPU has AVX2.
#[inline(always)]
unsafe fn pair16(
    lo: std::arch::x86_64::__m256i,
    hi: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract. Blend 0xAA takes each lane's high 16-bit word from
    // the second operand.
    unsafe { _mm256_blend_epi16::<0xAA>(lo, _mm256_slli_epi32::<16>(hi)) }
}

/// The AVX2 kernel of a decoded panel: activation rows `r0 .. r0 + sums.len()` (at most
/// [`AVX2_TILE`](super::AVX2_TILE)) against the panel's sixteen rows over sub-blocks
/// `subs`, carrying each row's sums from and into `sums` (so that a pass over a range of
/// sub-blocks keeps its part of the panel in the first-level cache).
///
/// Per word of four values and pair of 8-lane halves, one load of the panel serves
/// every row of the tile; `vpmaddubsw`'s 16-bit pair sums are added in 16 bits for as
/// many words as [`words_per_i16`] allows, then widened by one `vpmaddwd` that also
/// applies the integer scale; the offset's correction, `offset * (sc0 * lo + sc1 *
/// hi)`, is one more `vpmaddwd` per row and half with the panel's scales. Every step is
/// exact in its width: the integer sums, and then the float steps in sub-block order,
/// are the module's, so the bits are the other paths'.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C; the panel and rows come from one matrix; rows `r0 ..
/// r0 + sums.len()` exist and `subs` lies within the row's sub-blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn avx2_panel_tile(
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    r0: usize,
    subs: std::ops::Range<usize>,
    sums: &mut [super::RowSums],
) {
    // SAFETY: forwarded.
    unsafe {
        const { assert!(super::AVX2_TILE == 3) };
        with_format!(format, F => with_tile!(sums.len(), T => avx2_panel_rows::<T, { same_form(F) }>(panel, acts, r0, subs, sums); 1 2; 3))
    }
}

/// [`avx2_panel_tile`] for `T` rows of the format whose id is `F`.
///
/// # Safety
///
/// As [`avx2_panel_tile`], with `sums.len() == T`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
// The lane halves `l` index several arrays in step (sums, scales, weights).
#[allow(clippy::needless_range_loop)]
unsafe fn avx2_panel_rows<const T: usize, const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    r0: usize,
    subs: std::ops::Range<usize>,
    sums: &mut [super::RowSums],
) {
    use std::arch::x86_64::*;
    let f = const { format_at(F).int_form() };
    // Q8_0: multiplied signed (`|q| * sign(x, q)`), no offset to take back.
    let signed = const { format_at(F).int_form().offset == 128 };
    let n = const { words_per_i16(format_at(F).int_form()) };
    let per_half = const { matches!(format_at(F).int_form().scales, IntScales::PerHalf) };
    let offset = if signed { 0 } else { f.offset };
    let total = acts.blocks();
    debug_assert!(sums.len() == T && subs.end <= total);
    debug_assert!(acts.q.len() >= (r0 + T) * acts.n_in && acts.d.len() >= (r0 + T) * total);
    let (up, scp) = (panel.u.words().as_ptr(), panel.sc.as_ptr());
    let (dp, mp) = (panel.d.as_ptr(), panel.m.as_ptr());
    let xq = acts.q.as_ptr();
    let (ad, asx, asum) = (acts.d.as_ptr(), acts.sx.as_ptr(), acts.sum16.as_ptr());
    // SAFETY (every access): `sums` holds `T` rows of 16 lanes; the panel holds every
    // sub-block of `subs` for 16 lanes (`u`: 8 words, `sc`: 2 scales, `d`, `m`); rows
    // `r0 .. r0 + T` of the activations hold every block of `subs`; AVX2, FMA and F16C
    // (this function's features).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let mut iacc = [[_mm256_setzero_si256(); 2]; T];
        for (i, row) in sums.iter().enumerate().take(T) {
            for l in 0..2 {
                acc[i][l] = _mm256_loadu_ps(row.acc.as_ptr().add(8 * l));
                iacc[i][l] = _mm256_loadu_si256(row.iacc.as_ptr().add(8 * l).cast());
            }
        }
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        for s in subs {
            // Per half of the lanes: the integer scales as 16-bit pairs for the words of
            // the first and the second half of the sub-block, and the offset's
            // correction pair `(offset * sc0, offset * sc1)` (at most 32 * 128).
            let mut first = [ones; 2];
            let mut second = [ones; 2];
            let mut corr = [_mm256_setzero_si256(); 2];
            for l in 0..2 {
                let sc0 = _mm256_loadu_si256(scp.add(s * 2 * LANES + 8 * l).cast());
                let sc1 = _mm256_loadu_si256(scp.add((s * 2 + 1) * LANES + 8 * l).cast());
                match f.scales {
                    IntScales::PerHalf => {
                        first[l] = pair16(sc0, sc0);
                        second[l] = pair16(sc1, sc1);
                        corr[l] = pair16(sc0, sc1);
                    }
                    IntScales::PerBlock => {
                        first[l] = pair16(sc0, sc0);
                        second[l] = first[l];
                        corr[l] = first[l];
                    }
                    IntScales::One => corr[l] = ones,
                }
                if offset != 0 {
                    corr[l] = _mm256_mullo_epi16(corr[l], _mm256_set1_epi16(offset as i16));
                }
            }
            // The activation rows' words of this sub-block.
            let xp: [*const i32; T] =
                std::array::from_fn(|i| xq.add((r0 + i) * acts.n_in + s * QK).cast::<i32>());
            // Words `from .. from + n` (within one half when the halves' scales differ),
            // summed in 16 bits, widened and scaled into `iacc`.
            let mut from = 0;
            while from < 8 {
                let end = if per_half && from < 4 {
                    (from + n).min(4)
                } else {
                    (from + n).min(8)
                };
                let scale = if from < 4 { first } else { second };
                let mut part = [[_mm256_setzero_si256(); 2]; T];
                for t in from..end {
                    let mut w = [
                        _mm256_loadu_si256(up.add((s * 8 + t) * LANES).cast()),
                        _mm256_loadu_si256(up.add((s * 8 + t) * LANES + 8).cast()),
                    ];
                    let mut q = w;
                    if signed {
                        for (w, q) in w.iter_mut().zip(q.iter_mut()) {
                            *q = _mm256_xor_si256(*w, flip);
                            *w = _mm256_abs_epi8(*q);
                        }
                    }
                    each_row!(T, i => {
                        let x = _mm256_set1_epi32(xp[i].add(t).read_unaligned());
                        for l in 0..2 {
                            let x = if signed { _mm256_sign_epi8(x, q[l]) } else { x };
                            let p = _mm256_maddubs_epi16(w[l], x);
                            part[i][l] = if t == from { p } else { _mm256_add_epi16(part[i][l], p) };
                        }
                    });
                }
                each_row!(T, i => {
                    for l in 0..2 {
                        iacc[i][l] = _mm256_add_epi32(iacc[i][l], _mm256_madd_epi16(part[i][l], scale[l]));
                    }
                });
                from = end;
            }
            each_row!(T, i => {
                let b = (r0 + i) * total + s;
                if offset != 0 {
                    // `(lo, hi)` as a 16-bit pair (each at most 16 * 127 in magnitude).
                    let (lo, hi) = (*asum.add(2 * b), *asum.add(2 * b + 1));
                    let sums16 = _mm256_set1_epi32((lo & 0xFFFF) | (hi << 16));
                    for l in 0..2 {
                        iacc[i][l] = _mm256_sub_epi32(iacc[i][l], _mm256_madd_epi16(corr[l], sums16));
                    }
                }
                if (s + 1).is_multiple_of(f.run) {
                    let dx = _mm256_set1_ps(*ad.add(b));
                    for l in 0..2 {
                        let scale = _mm256_mul_ps(_mm256_loadu_ps(dp.add(s * LANES + 8 * l)), dx);
                        acc[i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i][l]), scale, acc[i][l]);
                        iacc[i][l] = _mm256_setzero_si256();
                    }
                }
                if f.mins {
                    let sx = _mm256_set1_ps(*asx.add(b));
                    for l in 0..2 {
                        let m = _mm256_loadu_ps(mp.add(s * LANES + 8 * l));
                        acc[i][l] = _mm256_fmadd_ps(m, sx, acc[i][l]);
                    }
                }
            });
        }
        for (i, row) in sums.iter_mut().enumerate().take(T) {
            for l in 0..2 {
                _mm256_storeu_ps(row.acc.as_mut_ptr().add(8 * l), acc[i][l]);
                _mm256_storeu_si256(row.iacc.as_mut_ptr().add(8 * l).cast(), iacc[i][l]);
            }
        }
    }
}

// Declared after the macros above, which it uses.
mod amx;
pub(super) use amx::{AMX_ROWS, Dest, Tiled, Tiles, amx_panel, fill_amx, tiled_rows};
