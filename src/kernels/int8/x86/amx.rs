//! The `fast` products on Intel's AMX tile unit, for prompts and batches: the integer
//! sums of sixteen activation rows against a panel's sixteen weight rows in the tile
//! unit (`tdpbssd`, `tdpbsud`), then the float steps in the vector units.
//!
//! **Same sums, same bits.** Every float step is the other kernels', in their order, on
//! the same integers:
//! - The formats without an integer scale (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the tile unit
//!   multiplies signed bytes, so the panel's unsigned values `u = q + offset` are taken
//!   back to `u - offset` (a byte for every format: Q8_0's own `-128..=127`), and one
//!   product per sub-block gives `sum (u - offset) * q`, the integer the other kernels
//!   compute as `sum u * q - offset * sum q`.
//! - The formats with a 6-bit scale per sub-block (Q4_K, Q5_K; values below 32, offset
//!   0): each scale is cut into two 3-bit digits, `sc = (hi << 3) + lo`, and the words
//!   times each digit (products below 256, one unsigned byte) are two panels; a run's
//!   eight sub-blocks are then four products of 64 values per digit, summed in the tile
//!   unit, and `(hi_sum << 3) + lo_sum` is the run's `sum sc * u * q`, exactly.
//! - Q6_K (a signed 8-bit scale per 16 values, values `u - 32`): each scale is cut into
//!   three balanced digits in base 7 (`-3..=3`), and the signed words times each digit
//!   are three panels; `sum_i sum_k * 7^i` is the run's `sum sc * (u - 32) * q`.
//! - Q3_K (a signed 6-bit scale per 16 values, values `u - 4`): two digits in base 8,
//!   the high one signed, and the signed words times each digit are two panels.
//!
//! **How.** The activation rows are copied once per product into tiles of sixteen rows
//! ([`tiled_rows`]; the last group padded with rows of zeros, so every row is the tile
//! unit's), each panel of sixteen weight rows is decoded straight into the words the tile
//! unit multiplies ([`fill_amx`]), in their own layout (a tile row is four values of
//! each of the sixteen lanes), and every tile load reads whole 64-byte lines
//! ([`Lines`]). A group of sixteen rows runs through the whole row with its float sums
//! in registers while the tile unit computes the next chunk (or run) of products; for
//! the formats with integer scales, two groups at once ([`amx_run_pairs`]), each weight
//! tile loaded once for both (Q6_K's three digits in a snake's order: six sums and one
//! tile each for the activations and the weights).
//!
//! **Where it runs.** Linux gives a process the tile unit's state only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `cpu.rs` asks once and says whether it was
//! granted. A thread configures its tiles with [`Tiles::start`] and releases them when
//! the guard drops, so no tile state outlives one product's share of work.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::activations::QuantizedRows;
use super::super::{LANES, Lines, Panel, QK};
use super::{
    SubScales, SubSink, Vnni, WideSink, decode_group, decode_k4_wide, decode_q6k_wide, format_at,
    same_form,
};
use crate::kernels::matrix::{GROUP_ROWS, QuantMatrix};
use crate::kernels::tiling::{Columns, prefetch_share};
use crate::quant::{IntForm, IntScales, QuantFormat, with_format};

/// Activation rows per tile: the tile unit's sixteen rows.
pub(in crate::kernels::int8) const AMX_ROWS: usize = 16;

/// Sub-blocks whose sums the formats without an integer scale compute before they are
/// scaled (each sub-block is its own run there).
const CHUNK: usize = 8;

/// The 64-byte tile configuration that `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of tiles 0-15.
    colsb: [u16; 16],
    /// Rows of tiles 0-15.
    rows: [u8; 16],
}

/// Bytes of one product's values: a 32-value sub-block, or two for the formats with an
/// integer scale, whose scales are folded into the weights (see [`fill_amx`]).
const fn unit_bytes(scales: IntScales) -> usize {
    match scales {
        IntScales::PerBlock | IntScales::PerHalf => 2 * QK,
        IntScales::One => QK,
    }
}

/// How a format's integer scales are cut into digits, each digit times a value one
/// byte: `(base, digits)`, `sc = sum of digit_i * base^i`.
/// - A scale per sub-block (Q4_K, Q5_K: 6-bit scales, values below 32): two digits in
///   base 8, `0..8`, so a digit times a value is below 256, one unsigned byte.
/// - Q6_K (a signed 8-bit scale per 16 values, values `u - 32` in `-32..=31`): three
///   balanced digits in base 7, `-3..=3` (they reach `-171..=171`), so `|digit * (u -
///   32)| <= 96`, one signed byte (and `u * |digit| <= 189` below 256, which
///   [`fill_amx`] relies on). Four 2-bit digits, the first version, made the tile unit
///   multiply a third more.
/// - Q3_K (a signed 6-bit scale per 16 values, values `u - 4` in `-4..=3`): two digits
///   in base 8, the low one in `0..8`, the high one signed, `-4..=3` (an arithmetic
///   shift), so `|digit * (u - 4)| <= 28`, one signed byte.
const fn digits(f: IntForm) -> (i32, usize) {
    match f.scales {
        IntScales::PerBlock => (8, 2),
        IntScales::PerHalf if f.max == 63 => (7, 3),
        IntScales::PerHalf => (8, 2),
        IntScales::One => (0, 0),
    }
}

/// Decodes rows `first .. first + 16` of `w` straight into the panel's words for the
/// AMX kernel, and its float scales `d` and `m` (the panel's plain words and integer
/// scales, which only the other kernels read, are not made): for the formats with
/// integer scales ([`digits`]), the words times each digit of their scale, one panel per
/// digit (`amx[i]`): unsigned bytes `u * digit` for a scale per sub-block (offset 0),
/// signed bytes `(u - offset) * digit` for a scale per half; for the others, the signed
/// words `u - offset` in each byte (`amx[0]`; every format's signed values fit a byte:
/// `-128..=127` for Q8_0, whose offset is 128). The same words as decoding the panel and
/// then deriving them, in one pass.
///
/// Q4_K, Q5_K and Q6_K are decoded both groups at once in 512-bit vectors
/// ([`decode_k4_wide`], [`decode_q6k_wide`], with GFNI where `gfni`) and their digits'
/// words made sixteen lanes at a time ([`AmxWide`]); the others a group at a time in
/// 256-bit vectors ([`AmxStore`]). On a 150-token prefill of a 1B Q6_K file, the
/// 256-bit decode was a fifth of the samples.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, FMA, F16C and AVX2, and GFNI where `gfni`; `first`
/// starts two full groups of `w`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2")]
pub(in crate::kernels::int8) unsafe fn fill_amx(
    panel: &mut Panel,
    w: &QuantMatrix,
    first: usize,
    gfni: bool,
) {
    let subs = w.cols() / QK;
    let words = subs * 8 * LANES;
    let (_, count) = digits(w.format().int_form());
    // Every byte of the panels, and every scale, is written below.
    for v in panel.amx.iter_mut().take(count.max(1)) {
        v.sized(4 * words);
    }
    panel.d.resize(subs * LANES, 0.0);
    panel.m.resize(subs * LANES, 0.0);
    let mut out = [std::ptr::null_mut::<u8>(); 3];
    for (o, v) in out.iter_mut().zip(panel.amx.iter_mut()) {
        *o = v.bytes_mut().as_mut_ptr();
    }
    let (d, m) = (panel.d.as_mut_ptr(), panel.m.as_mut_ptr());
    const Q4_K: u8 = QuantFormat::Q4_K as u8;
    const Q5_K: u8 = QuantFormat::Q5_K as u8;
    const Q6_K: u8 = QuantFormat::Q6_K as u8;
    // SAFETY (each arm): the caller's contract; every store is inside the panels sized
    // above (sub-block `s < subs`, lanes `0 .. 16`, digit `i < count`).
    unsafe {
        match w.format() {
            QuantFormat::Q4_K => decode_k4_wide(w, first, &mut AmxWide::<Q4_K>::new(out, d, m)),
            QuantFormat::Q5_K => decode_k4_wide(w, first, &mut AmxWide::<Q5_K>::new(out, d, m)),
            QuantFormat::Q6_K if gfni => {
                fill_q6k_gfni(w, first, &mut AmxWide::<Q6_K>::new(out, d, m))
            }
            QuantFormat::Q6_K => {
                decode_q6k_wide::<false>(w, first, &mut AmxWide::<Q6_K>::new(out, d, m))
            }
            _ => {
                for half in 0..2 {
                    let (group, _) = w.group(first + half * GROUP_ROWS);
                    let lane = half * GROUP_ROWS;
                    with_format!(w.format(), F => decode_group::<Vnni, F>(
                        group,
                        subs,
                        &mut AmxStore::<F> { out, d, m, lane }
                    ))
                }
            }
        }
    }
}

/// [`decode_q6k_wide`] with GFNI, into the AMX kernel's words.
///
/// # Safety
///
/// As [`fill_amx`], the CPU having GFNI; `w` is Q6_K.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2,gfni")]
unsafe fn fill_q6k_gfni(
    w: &QuantMatrix,
    first: usize,
    sink: &mut AmxWide<{ QuantFormat::Q6_K as u8 }>,
) {
    // SAFETY: forwarded.
    unsafe { decode_q6k_wide::<true>(w, first, sink) }
}

/// How a panel's words are multiplied by one digit of their scale ([`digits`]), lane by
/// lane (a lane: four values of one row).
#[derive(Clone, Copy)]
struct Factor {
    /// `|digit|` in both 16-bit halves of the lane: `vpmullw` then multiplies the
    /// lane's four bytes in pairs, and as each byte's product is below 256 no carry
    /// reaches its neighbour.
    both: __m512i,
    /// `offset * |digit|` in each byte of the lane (below 128).
    off: __m512i,
    /// The bytes of the lanes whose digit is negative.
    negative: __mmask64,
}

impl Factor {
    /// The factor of a digit of zero, where a format has fewer digits than three.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F.
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the caller's contract (AVX-512 F).
        unsafe {
            Self {
                both: _mm512_setzero_si512(),
                off: _mm512_setzero_si512(),
                negative: 0,
            }
        }
    }
}

/// The [`Factor`]s of the digits of the scales `sc` (one per lane) of the format whose id
/// is `F`, which has integer scales.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW.
#[inline(always)]
unsafe fn factors<const F: u8>(sc: __m512i) -> [Factor; 3] {
    // SAFETY: the caller's contract (the CPU's features).
    unsafe {
        let f = const { format_at(F).int_form() };
        let (base, count) = const { digits(format_at(F).int_form()) };
        let ds = if base == 7 {
            // Balanced digits in base 7: `q = round(sc / 7)` and `sc - 7 q`, twice (exact in
            // floats: `sc / 7` is never a half, and far from one).
            let seventh = _mm512_set1_ps(1.0 / 7.0);
            let q1 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(_mm512_cvtepi32_ps(sc), seventh),
            );
            let q2 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(_mm512_cvtepi32_ps(q1), seventh),
            );
            let seven = |q: __m512i| _mm512_sub_epi32(_mm512_slli_epi32::<3>(q), q);
            [
                _mm512_sub_epi32(sc, seven(q1)),
                _mm512_sub_epi32(q1, seven(q2)),
                q2,
            ]
        } else {
            // Two digits in base 8: the low one unsigned, the high one by an arithmetic
            // shift (signed where the scale is: Q3_K's).
            let low = _mm512_and_si512(sc, _mm512_set1_epi32(base - 1));
            [low, _mm512_srai_epi32::<3>(sc), _mm512_setzero_si512()]
        };
        let ones = _mm512_set1_epi32(0x0101_0101);
        let mut out = [Factor::zero(); 3];
        for (o, &d) in out.iter_mut().zip(&ds).take(count) {
            let size = _mm512_abs_epi32(d);
            *o = Factor {
                both: _mm512_or_si512(size, _mm512_slli_epi32::<16>(size)),
                off: _mm512_mullo_epi32(
                    _mm512_mullo_epi32(size, _mm512_set1_epi32(f.offset)),
                    ones,
                ),
                negative: _mm512_movepi8_mask(_mm512_srai_epi32::<31>(d)),
            };
        }
        out
    }
}

/// The words `v` (unsigned bytes `u`) times one digit of their scale: `u * digit` for
/// a scale per sub-block (offset 0, digits from 0), `(u - offset) * digit` for a scale
/// per half, signed bytes.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW.
#[inline(always)]
unsafe fn times_digit<const F: u8>(v: __m512i, f: &Factor) -> __m512i {
    // SAFETY: the caller's contract (the CPU's features).
    unsafe {
        let p = _mm512_mullo_epi16(v, f.both);
        if const { matches!(format_at(F).int_form().scales, IntScales::PerBlock) } {
            return p;
        }
        let p = _mm512_sub_epi8(p, f.off);
        _mm512_mask_sub_epi8(p, f.negative, _mm512_setzero_si512(), p)
    }
}

/// Takes a panel decoded in 512-bit vectors ([`WideSink`]) into the AMX words of the
/// format whose id is `F` ([`fill_amx`]).
struct AmxWide<const F: u8> {
    out: [*mut u8; 3],
    d: *mut f32,
    m: *mut f32,
    /// The current sub-block's digits, for each half.
    factors: [[Factor; 3]; 2],
}

impl<const F: u8> AmxWide<F> {
    /// A sink into the panels at `out` and the float scales at `d` and `m`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F.
    #[inline(always)]
    unsafe fn new(out: [*mut u8; 3], d: *mut f32, m: *mut f32) -> Self {
        // SAFETY: the caller's contract (AVX-512 F).
        let zero = unsafe { Factor::zero() };
        Self {
            out,
            d,
            m,
            factors: [[zero; 3]; 2],
        }
    }
}

impl<const F: u8> WideSink for AmxWide<F> {
    #[inline(always)]
    unsafe fn scales(&mut self, sub: usize, sc0: __m512i, sc1: __m512i, d: __m512, m: __m512) {
        // SAFETY: the caller's contract; the scales hold sub-block `sub` for sixteen
        // lanes ([`fill_amx`]).
        unsafe {
            _mm512_storeu_ps(self.d.add(sub * LANES), d);
            _mm512_storeu_ps(self.m.add(sub * LANES), m);
            self.factors[0] = factors::<F>(sc0);
            self.factors[1] = if const { matches!(format_at(F).int_form().scales, IntScales::PerHalf) }
            {
                factors::<F>(sc1)
            } else {
                self.factors[0]
            };
        }
    }

    #[inline(always)]
    unsafe fn word(&mut self, sub: usize, k: usize, v: __m512i) {
        let (_, count) = const { digits(format_at(F).int_form()) };
        for (&o, f) in self.out.iter().zip(&self.factors[k / 4]).take(count) {
            // SAFETY: the caller's contract; the panels hold sub-block `sub` for sixteen
            // lanes ([`fill_amx`]).
            unsafe {
                _mm512_storeu_si512(
                    o.add(4 * (sub * 8 + k) * LANES).cast(),
                    times_digit::<F>(v, f),
                )
            };
        }
    }
}

/// Takes each decoded sub-block of eight rows into lanes `lane .. lane + 8` of the AMX
/// words ([`fill_amx`]) of the format whose id is `F`.
struct AmxStore<const F: u8> {
    out: [*mut u8; 3],
    d: *mut f32,
    m: *mut f32,
    lane: usize,
}

impl<const F: u8> SubSink for AmxStore<F> {
    #[inline(always)]
    unsafe fn take(&mut self, wv: &[__m256i; 8], scales: &SubScales, s: usize) {
        let f = const { format_at(F).int_form() };
        let (_, count) = const { digits(format_at(F).int_form()) };
        let signed = const { matches!(format_at(F).int_form().scales, IntScales::PerHalf) };
        let lane = self.lane;
        let at = |t: usize| 4 * ((s * 8 + t) * LANES + lane);
        // SAFETY: the panels hold sub-block `s` for sixteen lanes ([`fill_amx`]).
        unsafe {
            _mm256_storeu_ps(self.d.add(s * LANES + lane), scales.d);
            _mm256_storeu_ps(self.m.add(s * LANES + lane), scales.m);
            if count == 0 {
                let off = _mm256_set1_epi8(f.offset as u8 as i8);
                for (t, v) in wv.iter().enumerate() {
                    _mm256_storeu_si256(self.out[0].add(at(t)).cast(), _mm256_sub_epi8(*v, off));
                }
                return;
            }
            debug_assert!(match f.scales {
                IntScales::PerBlock => f.offset == 0 && f.max < 32,
                _ => (f.offset, f.max) == (32, 63) || (f.offset, f.max) == (4, 7),
            });
            for h in 0..2 {
                // A scale per sub-block is in `sc0` (for both halves); a scale per half
                // in `sc0` and `sc1`. The eight lanes in the low half of 512-bit
                // vectors, the digits' steps shared with [`AmxWide`].
                let sc = if signed && h == 1 {
                    scales.sc1
                } else {
                    scales.sc0
                };
                let fs = factors::<F>(_mm512_zextsi256_si512(sc));
                for (&o, f) in self.out.iter().zip(&fs).take(count) {
                    for (t, &v) in wv.iter().enumerate().skip(h * 4).take(4) {
                        let p = times_digit::<F>(_mm512_zextsi256_si512(v), f);
                        _mm256_storeu_si256(o.add(at(t)).cast(), _mm512_castsi512_si256(p));
                    }
                }
            }
        }
    }
}

/// A thread's tiles, configured for one format's products; released when dropped.
pub(in crate::kernels::int8) struct Tiles(());

impl Tiles {
    /// Configures this thread's tiles for `format`'s products: tiles 0 to 3 hold 16 x
    /// 16 sums, 4 and 5 sixteen rows of one product's activation bytes, 6 and 7 the
    /// panel's words of the same values.
    ///
    /// # Safety
    ///
    /// The CPU has AMX-TILE and AMX-INT8 and the kernel has granted this process the
    /// tile data (`cpu.rs`'s `amx_granted`).
    pub(in crate::kernels::int8) unsafe fn start(format: QuantFormat) -> Tiles {
        let k = unit_bytes(format.int_form().scales);
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..4 {
            config.colsb[t] = (LANES * 4) as u16;
            config.rows[t] = AMX_ROWS as u8;
        }
        for t in 4..6 {
            config.colsb[t] = k as u16;
            config.rows[t] = AMX_ROWS as u8;
        }
        for t in 6..8 {
            config.colsb[t] = (LANES * 4) as u16;
            config.rows[t] = (k / 4) as u8;
        }
        // SAFETY: the caller's contract; the configuration is valid for palette 1
        // (at most 16 rows of at most 64 bytes).
        unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
        Tiles(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only after `start`, on a CPU with AMX-TILE.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Sums of one chunk: `[sub-block][row][lane]`.
#[repr(C, align(64))]
struct Sums([[[i32; LANES]; AMX_ROWS]; CHUNK]);

/// Bytes of one sub-block of sixteen rows in [`tiled_rows`]' layout of 32-byte tiles.
const TILE_BYTES: usize = AMX_ROWS * QK;

/// Bytes of a run (256 values) of sixteen rows in the tiles of the formats with integer
/// scales: four tiles of 64 bytes a row, 1 KiB each (the activations', and each digit's
/// words').
const RUN_BYTES: usize = 4 * AMX_ROWS * 64;

/// From this many bytes of tiled rows, [`tiled_rows`] lays them out on the pool's
/// threads (a batch of a few groups stays on the calling thread).
const SPLIT_TILED_BYTES: usize = 256 * 1024;

/// The activation rows of one product laid out for the AMX kernel ([`tiled_rows`]).
#[derive(Default)]
pub(in crate::kernels::int8) struct Tiled {
    /// The quantized values, in tiles (see [`tiled_rows`]).
    values: Lines,
    /// Each group's scales, sub-block by sub-block ([`GroupScales`]), zeros for the
    /// padding rows.
    scales: Vec<f32>,
    /// Values per row.
    n_in: usize,
    /// Sub-blocks (of 32 values) per row.
    subs: usize,
}

impl Tiled {
    /// The values of group `g` (rows `16 g ..` + 16) from sub-block `s` on: a tile of
    /// [`TILE_BYTES`] per sub-block, the group's sub-blocks in order.
    ///
    /// # Safety
    ///
    /// Group `g` is one of the rows' groups and `s` at most its sub-blocks.
    #[inline(always)]
    unsafe fn values_at(&self, g: usize, s: usize) -> *const u8 {
        // SAFETY: the caller's contract; each group holds `subs` tiles.
        unsafe {
            self.values
                .bytes()
                .as_ptr()
                .add((g * self.subs + s) * TILE_BYTES)
        }
    }

    /// The scales of group `g` (rows `16 g ..` + 16).
    ///
    /// # Safety
    ///
    /// Group `g` is one of the rows' groups.
    #[inline(always)]
    unsafe fn group(&self, g: usize) -> GroupScales {
        // SAFETY: the caller's contract; each group holds `subs * 2 * 16` scales.
        GroupScales(unsafe { self.scales.as_ptr().add(g * self.subs * 2 * AMX_ROWS) })
    }
}

/// The scales of one group of sixteen rows, sub-block by sub-block: the sixteen rows'
/// block scales `d`, then their sums `sx`. One pointer reaches the group's sixteen rows
/// at fixed offsets; read from the rows' own layout (`(g * 16 + i) * subs + s`), the
/// kernel kept a pointer per row, sixteen more than the registers it had, and reloaded
/// one from the stack for every fused multiply-add.
#[derive(Clone, Copy)]
struct GroupScales(*const f32);

impl GroupScales {
    /// Where row `i`'s `d` of sub-block `s` is, from the group's first scale (its `sx`
    /// is [`AMX_ROWS`] further).
    const fn at(s: usize, i: usize) -> usize {
        s * 2 * AMX_ROWS + i
    }

    /// Row `i`'s block scale `d` of sub-block `s`.
    ///
    /// # Safety
    ///
    /// `s` is one of the row's sub-blocks and `i < 16`.
    #[inline(always)]
    unsafe fn d(self, s: usize, i: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *self.0.add(Self::at(s, i)) }
    }

    /// Row `i`'s sum of quantized values `sx` of sub-block `s`.
    ///
    /// # Safety
    ///
    /// As [`GroupScales::d`].
    #[inline(always)]
    unsafe fn sx(self, s: usize, i: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *self.0.add(Self::at(s, i) + AMX_ROWS) }
    }
}

/// The quantized values of the activation rows, laid out for the tile loads of
/// `format`'s products, in groups of sixteen rows (the last one padded with rows of
/// zeros), in tiles of `w` = [`unit_bytes`] bytes (one or two sub-blocks) of sixteen
/// rows: group `g`, tile `t`, row `i`, value `v` at `((g * tiles + t) * 16 + i) * w + v`.
/// A tile's sixteen rows are then contiguous (their rows `w` bytes apart), not sixteen
/// lines a row's length apart, which for rows of 2 KiB or more fall in the same few sets
/// of the first-level cache. With them, the rows' scales group by group
/// ([`Tiled::scales`]). Built once per product, read by every panel.
pub(in crate::kernels::int8) fn tiled_rows(acts: &QuantizedRows, format: QuantFormat) -> Tiled {
    let w = unit_bytes(format.int_form().scales);
    let (n_in, rows) = (acts.n_in, acts.q.len() / acts.n_in.max(1));
    let subs = acts.blocks();
    let groups = rows.div_ceil(AMX_ROWS);
    // A group is 16 rows of whole 32-value blocks: whole lines.
    let group_bytes = AMX_ROWS * n_in;
    debug_assert!(group_bytes.is_multiple_of(64));
    // Group `g`'s tiles, the padding rows' zeros too: every byte of `group`.
    let lay_out = |g: usize, group: &mut [std::mem::MaybeUninit<u8>]| {
        for (t, tile) in group.chunks_exact_mut(AMX_ROWS * w).enumerate() {
            for (i, row) in tile.chunks_exact_mut(w).enumerate() {
                let r = g * AMX_ROWS + i;
                if r < rows {
                    for (b, &q) in row.iter_mut().zip(&acts.q[r * n_in + t * w..][..w]) {
                        b.write(q as u8);
                    }
                } else {
                    for b in row {
                        b.write(0);
                    }
                }
            }
        }
    };
    // Written once, by the pool's threads for a prompt's groups: cleared first and
    // laid out on one thread, this was 2% of a 450-token prefill's samples while the
    // other core waited.
    let values = Lines::written(groups * group_bytes / 64, |bytes| {
        if groups * group_bytes < SPLIT_TILED_BYTES {
            for (g, group) in bytes.chunks_exact_mut(group_bytes).enumerate() {
                lay_out(g, group);
            }
            return;
        }
        let target = crate::kernels::pool::Disjoint::new(bytes);
        crate::kernels::pool::for_each_chunk(groups, &|g| {
            // SAFETY: group `g < groups` owns bytes `g * group_bytes ..` + `group_bytes`
            // of the buffer, and only this chunk writes them.
            lay_out(g, unsafe { target.part(g * group_bytes, group_bytes) });
        });
    });
    let mut scales = vec![0f32; rows.div_ceil(AMX_ROWS) * subs * 2 * AMX_ROWS];
    for (r, (d, sx)) in acts
        .d
        .chunks_exact(subs)
        .zip(acts.sx.chunks_exact(subs))
        .take(rows)
        .enumerate()
    {
        let (g, i) = (r / AMX_ROWS, r % AMX_ROWS);
        let group = &mut scales[g * subs * 2 * AMX_ROWS..][..subs * 2 * AMX_ROWS];
        for s in 0..subs {
            group[GroupScales::at(s, i)] = d[s];
            group[GroupScales::at(s, i) + AMX_ROWS] = sx[s];
        }
    }
    Tiled {
        values,
        scales,
        n_in,
        subs,
    }
}

/// Where a panel's results go: rows `0 .. rows` of `target`, columns `first .. first +
/// 16`. The kernel stores each group's sixteen rows from its registers as the group
/// ends, so the stores' cache misses (a line per row: the rows are a product's output,
/// megabytes) wait in the store buffer while the tile unit goes on; copied there from a
/// buffer of the panel's results after it, all rows' stores came at once, filled the
/// store buffer and stalled (the copy was 7.5% of a 450-token prefill's samples).
pub(in crate::kernels::int8) struct Dest<'a> {
    /// The product's output.
    pub target: &'a Columns,
    /// Activation rows (the padding rows of the last group are not stored).
    pub rows: usize,
    /// The panel's first column.
    pub first: usize,
}

impl Dest<'_> {
    /// Stores group `g`'s sixteen rows of results `acc`, those below [`Dest::rows`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F; columns `first ..` + 16 of the target's rows are this
    /// thread's to write.
    #[inline(always)]
    unsafe fn store_group(&self, g: usize, acc: &[__m512; AMX_ROWS]) {
        for (i, a) in acc.iter().enumerate() {
            let r = g * AMX_ROWS + i;
            if r < self.rows {
                // SAFETY: the caller's contract; row `r` is one of the target's.
                unsafe { _mm512_storeu_ps(self.target.at(r, self.first), *a) };
            }
        }
    }
}

/// The results of activation rows `0 .. dest.rows` against the panel's sixteen rows,
/// whose AMX words ([`fill_amx`]) are in place, stored at `dest`; `tiled` is the rows'
/// [`tiled_rows`]. `next`, the next panel's weights, is asked for into the second-level
/// cache a share per run (or chunk) of products, so it comes from memory while the tile
/// unit computes rather than when [`fill_amx`] decodes it.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, FMA, AMX-TILE and AMX-INT8; this thread's [`Tiles`] are
/// configured for `format`; the panel and the rows come from one matrix of `format`;
/// `tiled` holds at least `dest.rows` rows; `dest.target` holds `dest.rows` rows, and columns
/// `dest.first ..` + 16 of them are this thread's to write.
pub(in crate::kernels::int8) unsafe fn amx_panel(
    panel: &Panel,
    format: QuantFormat,
    tiled: &Tiled,
    out: &Dest,
    next: Option<&[u8]>,
) {
    debug_assert!(
        tiled.values.bytes().len() >= out.rows.next_multiple_of(AMX_ROWS) * tiled.n_in
            && tiled.scales.len() >= out.rows.next_multiple_of(AMX_ROWS) * tiled.subs * 2
    );
    // SAFETY: forwarded.
    unsafe {
        if !matches!(format.int_form().scales, IntScales::One) {
            with_format!(format, F => amx_runs_of::<{ same_form(F) }>(panel, tiled, out, next))
        } else {
            with_format!(format, F => amx_panel_of::<{ same_form(F) }>(panel, tiled, out, next))
        }
    }
}

/// [`amx_panel`] for the format whose id is `F`, one without an integer scale (Q8_0,
/// Q4_0, Q4_1, Q5_0, Q5_1): one product per sub-block, whose sums the vector units
/// scale as [`vnni_tile_rows`](super::vnni_tile_rows) does. A group of sixteen rows runs through
/// the whole row with its float sums in registers, a chunk of products ahead.
///
/// # Safety
///
/// As [`amx_panel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline(never)]
unsafe fn amx_panel_of<const F: u8>(panel: &Panel, tiled: &Tiled, out: &Dest, next: Option<&[u8]>) {
    let f = const { format_at(F).int_form() };
    // Compiled for every format (`with_format!`), run for those without an integer
    // scale: the others' copies are this return.
    if !matches!(f.scales, IntScales::One) {
        return;
    }
    const {
        let f = format_at(F).int_form();
        assert!(!matches!(f.scales, IntScales::One) || f.run == 1);
    };
    let subs = tiled.subs;
    let groups = out.rows.div_ceil(AMX_ROWS);
    debug_assert!(panel.amx[0].bytes().len() >= subs * 8 * LANES * 4);
    // The sums of a chunk of sub-blocks, for two chunks: the tile unit computes the
    // next chunk's while the vector units scale this one's.
    #[repr(C, align(64))]
    struct ChunkSums([Sums; 2]);
    let mut sums = std::mem::MaybeUninit::<ChunkSums>::uninit();
    let sp = sums.as_mut_ptr().cast::<Sums>();
    let (dp, mp) = (panel.d.as_ptr(), panel.m.as_ptr());
    let chunks = subs.div_ceil(CHUNK);
    for g in 0..groups {
        // The products of chunk `c` of this group into `sums[c % 2]`.
        let chunk_products = |c: usize| {
            let s0 = c * CHUNK;
            // SAFETY: group `g` holds `subs` tiles of 512 bytes and the panel `subs * 8`
            // rows of 64 bytes; product `j` of the chunk reads tile `s0 + j` and the
            // panel's rows `(s0 + j) * 8 ..` + 8; the chunk has at most `CHUNK`
            // products, within both and within `sums[c % 2]`.
            unsafe {
                products(
                    tiled.values_at(g, s0).cast(),
                    panel.amx[0].bytes().as_ptr().add(s0 * TILE_BYTES),
                    CHUNK.min(subs - s0),
                    sp.add(c % 2),
                )
            };
        };
        chunk_products(0);
        // SAFETY (every access): `out` takes the group's rows below `out.rows`;
        // `sums[c % 2]` was written by `chunk_products(c)`; the panel holds `subs * 16`
        // of `d` and `m`; the group's scales hold `subs` sub-blocks of sixteen `d` and
        // `sx`.
        unsafe {
            // The sixteen rows' float sums, in registers through the whole row.
            let mut acc = [_mm512_setzero_ps(); AMX_ROWS];
            let sc = tiled.group(g);
            for c in 0..chunks {
                if c + 1 < chunks {
                    chunk_products(c + 1);
                }
                if let Some(next) = next {
                    prefetch_share(next, g * chunks + c, groups * chunks);
                }
                let s0 = c * CHUNK;
                let chunk = &(*sp.add(c % 2)).0;
                for s in s0..s0 + CHUNK.min(subs - s0) {
                    let dw = _mm512_loadu_ps(dp.add(s * LANES));
                    let m = _mm512_loadu_ps(mp.add(s * LANES));
                    each_row!(@ AMX_ROWS, i, {
                        let dot = _mm512_loadu_si512(chunk[s - s0][i].as_ptr().cast());
                        let scale = _mm512_mul_ps(dw, _mm512_set1_ps(sc.d(s, i)));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
                        if f.mins {
                            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sc.sx(s, i)), acc[i]);
                        }
                    }, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
                }
            }
            out.store_group(g, &acc);
        }
    }
}

/// [`amx_panel`] for the format whose id is `F`, one with integer scales (Q3_K, Q4_K, Q5_K,
/// Q6_K): its scales are in the panel's words as digits ([`fill_amx`], [`digits`]),
/// so a run's eight sub-blocks are four products of 64 values per digit, summed in the
/// tile unit; per run and row, the vector units add the digits' sums (`(hi << 3) + lo`
/// for two 3-bit digits, the integer `sum sc * u * q` of the other kernels) and take the
/// float steps in the other kernels' order: each sub-block's minimum, with the run's
/// scale before the last.
/// A group of sixteen rows runs through the whole row with its float sums in registers,
/// and the tile unit computes a run ahead: with the sums in memory (a load and a store
/// per row and run) and no run ahead, each run waited for the last one's stores, and the
/// kernel was no faster than the VNNI one. The groups are taken two at a time
/// ([`amx_run_pairs`]) and a last odd one alone.
///
/// # Safety
///
/// As [`amx_panel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline(never)]
unsafe fn amx_runs_of<const F: u8>(panel: &Panel, tiled: &Tiled, out: &Dest, next: Option<&[u8]>) {
    let f = const { format_at(F).int_form() };
    // Compiled for every format (`with_format!`), run for those with integer scales:
    // the others' copies are this return.
    if matches!(f.scales, IntScales::One) {
        return;
    }
    const {
        let f = format_at(F).int_form();
        assert!(matches!(f.scales, IntScales::One) || f.run == 8);
        assert!(unit_bytes(IntScales::PerBlock) == 64 && unit_bytes(IntScales::PerHalf) == 64);
    };
    let (_, count) = const { digits(format_at(F).int_form()) };
    let subs = tiled.subs;
    let groups = out.rows.div_ceil(AMX_ROWS);
    debug_assert!(panel.amx[count - 1].bytes().len() >= subs * 8 * LANES * 4);
    // Each digit's sums of a run, `[digit][row][lane]`, for two runs: the tile unit
    // computes the next run's while the vector units scale this one's.
    #[repr(C, align(64))]
    struct RunSums([[[[i32; LANES]; AMX_ROWS]; 3]; 2]);
    let mut sums = std::mem::MaybeUninit::<RunSums>::uninit();
    let sp = sums.as_mut_ptr();
    let (dp, mp) = (panel.d.as_ptr(), panel.m.as_ptr());
    let runs = subs / 8;
    // Two groups at once: each digit's weight tile loaded once for both (two digits:
    // four loads for four products instead of six; three: seven for six instead of
    // eight), the two groups' float sums kept in memory between their runs.
    let mut g = 0;
    while g + 1 < groups {
        // SAFETY: the caller's contract (`amx_panel`); groups `g` and `g + 1` are both the
        // rows'.
        unsafe { amx_run_pairs::<F>(panel, tiled, out, next, g) };
        g += 2;
    }
    for g in g..groups {
        // Both digits' products of run `r` of this group into `sums[r % 2]`.
        let products = |r: usize| {
            // SAFETY: run `r` of group `g` is 4 KiB of `tiled` (four tiles of 16 rows of
            // 64 bytes); the digits' words of the run are 4 KiB each (its 64 rows of 64
            // bytes); `sums[r % 2]` holds two 1 KiB results. The tiles are configured
            // for 64-byte products.
            unsafe {
                let a = tiled.values_at(g, r * 8);
                let d = |i: usize| panel.amx[i].bytes().as_ptr().add(r * RUN_BYTES);
                let c = sp.cast::<[[[i32; LANES]; AMX_ROWS]; 3]>().add(r % 2);
                if count == 2 {
                    // One step of 64 values of both digits, at byte `$off` of the run's
                    // tiles, the activations in tile `$ta`.
                    #[rustfmt::skip]
                    macro_rules! step {
                        ($dp:literal, $ta:literal, $off:literal) => {
                            concat!(
                                "tileloadd ", $ta, ", [{a} + {row}", $off, "]\n",
                                "tileloadd tmm6, [{d0} + {row}", $off, "]\n",
                                $dp, " tmm0, ", $ta, ", tmm6\n",
                                "tileloadd tmm7, [{d1} + {row}", $off, "]\n",
                                $dp, " tmm1, ", $ta, ", tmm7",
                            )
                        };
                    }
                    macro_rules! two_digits {
                        ($dp:literal) => {
                            asm!(
                                "tilezero tmm0",
                                "tilezero tmm1",
                                step!($dp, "tmm4", ""),
                                step!($dp, "tmm5", " + 1024"),
                                step!($dp, "tmm4", " + 2048"),
                                step!($dp, "tmm5", " + 3072"),
                                "tilestored [{c} + {row}], tmm0",
                                "tilestored [{c} + {row} + 1024], tmm1",
                                a = in(reg) a,
                                d0 = in(reg) d(0),
                                d1 = in(reg) d(1),
                                row = in(reg) 64usize,
                                c = in(reg) c,
                                options(nostack),
                            )
                        };
                    }
                    // Two digits' words: unsigned (offset 0: Q4_K, Q5_K) by `tdpbsud`,
                    // signed (Q3_K) by `tdpbssd`.
                    if f.offset == 0 {
                        two_digits!("tdpbsud");
                    } else {
                        two_digits!("tdpbssd");
                    }
                } else {
                    // Three signed digits' words: `tdpbssd`, the activations' tile read
                    // once per step for the three. One step of 64 values, at byte `$off`
                    // of the run's tiles: the activations in tile `$ta`, the digits' words
                    // in `$tx`, `$ty`, `$tx` (the next step loads its first digit into
                    // `$ty` while the last product of this one reads `$tx`).
                    #[rustfmt::skip]
                    macro_rules! step {
                        ($ta:literal, $tx:literal, $ty:literal, $off:literal) => {
                            concat!(
                                "tileloadd ", $ta, ", [{a} + {row}", $off, "]\n",
                                "tileloadd ", $tx, ", [{d0} + {row}", $off, "]\n",
                                "tdpbssd tmm0, ", $ta, ", ", $tx, "\n",
                                "tileloadd ", $ty, ", [{d1} + {row}", $off, "]\n",
                                "tdpbssd tmm1, ", $ta, ", ", $ty, "\n",
                                "tileloadd ", $tx, ", [{d2} + {row}", $off, "]\n",
                                "tdpbssd tmm2, ", $ta, ", ", $tx,
                            )
                        };
                    }
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        step!("tmm4", "tmm6", "tmm7", ""),
                        step!("tmm5", "tmm7", "tmm6", " + 1024"),
                        step!("tmm4", "tmm6", "tmm7", " + 2048"),
                        step!("tmm5", "tmm7", "tmm6", " + 3072"),
                        "tilestored [{c} + {row}], tmm0",
                        "tilestored [{c} + {row} + 1024], tmm1",
                        "tilestored [{c} + {row} + 2048], tmm2",
                        a = in(reg) a,
                        d0 = in(reg) d(0),
                        d1 = in(reg) d(1),
                        d2 = in(reg) d(2),
                        row = in(reg) 64usize,
                        c = in(reg) c,
                        options(nostack),
                    );
                }
            }
        };
        products(0);
        // SAFETY (every access): `out` takes the group's rows below `out.rows`;
        // `sums[r % 2]` was written by `products(r)`; the panel holds `subs * 16` of `d`
        // and `m`; the group's scales hold `subs` sub-blocks of sixteen `d` and `sx`.
        unsafe {
            // The sixteen rows' float sums, in registers through the whole row.
            let mut acc = [_mm512_setzero_ps(); AMX_ROWS];
            let sc = tiled.group(g);
            for r in 0..runs {
                if r + 1 < runs {
                    products(r + 1);
                }
                if let Some(next) = next {
                    prefetch_share(next, g * runs + r, groups * runs);
                }
                run_steps::<F>(&mut acc, &(*sp).0[r % 2], sc, dp, mp, r * 8);
            }
            out.store_group(g, &acc);
        }
    }
}

/// [`amx_runs_of`] for groups `g` and `g + 1` at once: in each step the weight tile of
/// each digit is loaded once and multiplied with both groups' activation tiles, and the
/// tile unit computes the next run of both while the vector units take this one's float
/// steps, group after group. With two digits, four tile loads for four products where a
/// group alone takes three for two; with three (Q6_K), six sums leave one tile for the
/// activations and one for the weights, and a snake's order (the first group's digits
/// up, the second's down, the last digit's weights kept between them) loads seven tiles
/// for six products where a group alone loads four for three (kernel bench, 1B Q6_K,
/// `fast`, two rounds alternated: 128 rows 512-537 -> 559-580 G multiply-adds/s, 32 rows
/// 288 -> 305-316; 150-token prefill of the 1B Q6_K file 385 -> 427 tokens/s). The same
/// integer sums and the same float steps in the same order as a group alone
/// ([`run_steps`]), so the same bits.
///
/// # Safety
///
/// As [`amx_panel`], the format `F` having integer scales ([`digits`]); groups `g` and
/// `g + 1` are both the rows'.
#[inline(always)]
unsafe fn amx_run_pairs<const F: u8>(
    panel: &Panel,
    tiled: &Tiled,
    out: &Dest,
    next: Option<&[u8]>,
    g: usize,
) {
    let f = const { format_at(F).int_form() };
    let (_, count) = const { digits(format_at(F).int_form()) };
    let groups = out.rows.div_ceil(AMX_ROWS);
    let runs = tiled.subs / 8;
    // Each group's digits' sums of a run, `[group][digit][row][lane]` (the third digit
    // unused where there are two), for two runs.
    #[repr(C, align(64))]
    struct PairSums([[[[[i32; LANES]; AMX_ROWS]; 3]; 2]; 2]);
    const GROUP_SUMS: usize = 3 * AMX_ROWS * LANES * 4;
    let mut sums = std::mem::MaybeUninit::<PairSums>::uninit();
    let sp = sums.as_mut_ptr();
    let (dp, mp) = (panel.d.as_ptr(), panel.m.as_ptr());
    let products = |r: usize| {
        // SAFETY: run `r` of groups `g` and `g + 1` is 4 KiB of `tiled` each; the digits'
        // words of the run are 4 KiB each; `sums[r % 2]` holds both groups' two 1 KiB
        // results, the second group's `GROUP_SUMS` bytes after the first's. The tiles
        // are configured for 64-byte products.
        unsafe {
            let (a0, a1) = (tiled.values_at(g, r * 8), tiled.values_at(g + 1, r * 8));
            let d = |i: usize| panel.amx[i].bytes().as_ptr().add(r * RUN_BYTES);
            let c = sp
                .cast::<[[[[i32; LANES]; AMX_ROWS]; 3]; 2]>()
                .add(r % 2)
                .cast::<u8>();
            // One step of 64 values for both groups, at byte `$off` of the run's tiles:
            // each digit's weight tile loaded once, multiplied with both groups'
            // activations (tiles 4 and 5).
            #[rustfmt::skip]
            macro_rules! pair_step {
                ($dp:literal, $off:literal) => {
                    concat!(
                        "tileloadd tmm4, [{a0} + {row}", $off, "]\n",
                        "tileloadd tmm6, [{d0} + {row}", $off, "]\n",
                        $dp, " tmm0, tmm4, tmm6\n",
                        "tileloadd tmm5, [{a1} + {row}", $off, "]\n",
                        $dp, " tmm2, tmm5, tmm6\n",
                        "tileloadd tmm7, [{d1} + {row}", $off, "]\n",
                        $dp, " tmm1, tmm4, tmm7\n",
                        $dp, " tmm3, tmm5, tmm7",
                    )
                };
            }
            macro_rules! pair {
                ($dp:literal) => {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        pair_step!($dp, ""),
                        pair_step!($dp, " + 1024"),
                        pair_step!($dp, " + 2048"),
                        pair_step!($dp, " + 3072"),
                        "tilestored [{c0} + {row}], tmm0",
                        "tilestored [{c0} + {row} + 1024], tmm1",
                        "tilestored [{c1} + {row}], tmm2",
                        "tilestored [{c1} + {row} + 1024], tmm3",
                        a0 = in(reg) a0,
                        a1 = in(reg) a1,
                        d0 = in(reg) d(0),
                        d1 = in(reg) d(1),
                        row = in(reg) 64usize,
                        c0 = in(reg) c,
                        c1 = in(reg) c.add(GROUP_SUMS),
                        options(nostack),
                    )
                };
            }
            if count == 3 {
                // Three signed digits' words (Q6_K): six sums in tiles 0 to 5, one tile
                // for the activations and one for the weights, in a snake's order (the
                // first group's digits up, the second's down, the last digit's weight
                // tile kept between them), so each step loads seven tiles for six
                // products where a group alone loads four for three. One step of 64
                // values, at byte `$off` of the run's tiles:
                #[rustfmt::skip]
                macro_rules! snake_step {
                    ($off:literal) => {
                        concat!(
                            "tileloadd tmm6, [{a0} + {row}", $off, "]\n",
                            "tileloadd tmm7, [{d0} + {row}", $off, "]\n",
                            "tdpbssd tmm0, tmm6, tmm7\n",
                            "tileloadd tmm7, [{d1} + {row}", $off, "]\n",
                            "tdpbssd tmm1, tmm6, tmm7\n",
                            "tileloadd tmm7, [{d2} + {row}", $off, "]\n",
                            "tdpbssd tmm2, tmm6, tmm7\n",
                            "tileloadd tmm6, [{a1} + {row}", $off, "]\n",
                            "tdpbssd tmm5, tmm6, tmm7\n",
                            "tileloadd tmm7, [{d1} + {row}", $off, "]\n",
                            "tdpbssd tmm4, tmm6, tmm7\n",
                            "tileloadd tmm7, [{d0} + {row}", $off, "]\n",
                            "tdpbssd tmm3, tmm6, tmm7",
                        )
                    };
                }
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "tilezero tmm4",
                    "tilezero tmm5",
                    snake_step!(""),
                    snake_step!(" + 1024"),
                    snake_step!(" + 2048"),
                    snake_step!(" + 3072"),
                    "tilestored [{c0} + {row}], tmm0",
                    "tilestored [{c0} + {row} + 1024], tmm1",
                    "tilestored [{c0} + {row} + 2048], tmm2",
                    "tilestored [{c1} + {row}], tmm3",
                    "tilestored [{c1} + {row} + 1024], tmm4",
                    "tilestored [{c1} + {row} + 2048], tmm5",
                    a0 = in(reg) a0,
                    a1 = in(reg) a1,
                    d0 = in(reg) d(0),
                    d1 = in(reg) d(1),
                    d2 = in(reg) d(2),
                    row = in(reg) 64usize,
                    c0 = in(reg) c,
                    c1 = in(reg) c.add(GROUP_SUMS),
                    options(nostack),
                );
            } else if f.offset == 0 {
                // Unsigned words (offset 0: Q4_K, Q5_K) by `tdpbsud`, signed (Q3_K) by
                // `tdpbssd`.
                pair!("tdpbsud");
            } else {
                pair!("tdpbssd");
            }
        }
    };
    products(0);
    // SAFETY (every access): `out` takes the groups' rows below `out.rows`;
    // `sums[r % 2]` was written by `products(r)`; the panel holds `subs * 16` of `d` and
    // `m`; each group's scales hold `subs` sub-blocks of sixteen `d` and `sx`.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); AMX_ROWS]; 2];
        let sc = [tiled.group(g), tiled.group(g + 1)];
        for r in 0..runs {
            if r + 1 < runs {
                products(r + 1);
            }
            if let Some(next) = next {
                prefetch_share(next, g * runs + r, groups * runs);
                prefetch_share(next, (g + 1) * runs + r, groups * runs);
            }
            for (h, (acc, &sc)) in acc.iter_mut().zip(&sc).enumerate() {
                run_steps::<F>(acc, &(*sp).0[r % 2][h], sc, dp, mp, r * 8);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            out.store_group(g + h, acc);
        }
    }
}

/// The float steps of run `s0 / 8` for a group of sixteen rows, in the other kernels'
/// order, on the digits' sums of the run (`run[digit][row]`): each sub-block's minimum,
/// with the run's scale before the last, into the rows' float sums `acc`.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW; the panel's `d` and `m` at `dp` and `mp`, and the group's
/// scales `sc`, hold the run's sub-blocks; `F` has integer scales.
#[inline(always)]
unsafe fn run_steps<const F: u8>(
    acc: &mut [__m512; AMX_ROWS],
    run: &[[[i32; LANES]; AMX_ROWS]; 3],
    sc: GroupScales,
    dp: *const f32,
    mp: *const f32,
    s0: usize,
) {
    let f = const { format_at(F).int_form() };
    let (base, count) = const { digits(format_at(F).int_form()) };
    // SAFETY: the caller's contract.
    unsafe {
        for s in s0..s0 + 7 {
            if f.mins {
                let m = _mm512_loadu_ps(mp.add(s * LANES));
                each_row!(@ AMX_ROWS, i, {
                    acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sc.sx(s, i)), acc[i]);
                }, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
            }
        }
        let s = s0 + 7;
        let (m, dw) = (
            _mm512_loadu_ps(mp.add(s * LANES)),
            _mm512_loadu_ps(dp.add(s * LANES)),
        );
        each_row!(@ AMX_ROWS, i, {
            // The digits' sums, highest first: `isum = isum * base + sum_i`
            // (base 8: a shift; base 7: `(isum << 3) - isum`).
            let mut isum = _mm512_loadu_si512(run[count - 1][i].as_ptr().cast());
            for k in (0..count - 1).rev() {
                let low = _mm512_loadu_si512(run[k][i].as_ptr().cast());
                let eight = _mm512_slli_epi32::<3>(isum);
                let times = if base == 8 {
                    eight
                } else {
                    _mm512_sub_epi32(eight, isum)
                };
                isum = _mm512_add_epi32(times, low);
            }
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(sc.d(s, i)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i]);
            if f.mins {
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sc.sx(s, i)), acc[i]);
            }
        }, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
}

/// Products `0 .. count` of a chunk: product `j` multiplies the 32-byte rows of tile
/// `j` from `a` (sixteen activation rows of one sub-block, 512 bytes) with the panel's
/// eight 64-byte rows from `b + j * 512` into product `j` of `sums`; two at a time, in
/// tiles 0, 4, 6 and 1, 5, 7.
///
/// # Safety
///
/// The tiles are configured for 32-byte products ([`Tiles::start`]); the rows and the
/// panel hold what the products read; `count <= CHUNK`.
#[inline(always)]
unsafe fn products(a: *const i8, b: *const u8, count: usize, sums: *mut Sums) {
    let out = sums.cast::<u8>();
    const ROW: usize = LANES * 4;
    const RESULT: usize = AMX_ROWS * LANES * 4;
    let mut j = 0;
    while j < count {
        // SAFETY: the caller's contract; product `j` (and `j + 1`) lies within it.
        unsafe {
            let (a, b, c) = (
                a.add(j * TILE_BYTES),
                b.add(j * TILE_BYTES),
                out.add(j * RESULT),
            );
            if j + 1 < count {
                asm!(
                    "tileloadd tmm4, [{a} + {sa}]",
                    "tileloadd tmm6, [{b} + {row}]",
                    "tilezero tmm0",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a} + {sa} + 512]",
                    "tileloadd tmm7, [{b} + {row} + 512]",
                    "tilezero tmm1",
                    "tdpbssd tmm1, tmm5, tmm7",
                    "tilestored [{c} + {row}], tmm0",
                    "tilestored [{c} + {row} + 1024], tmm1",
                    a = in(reg) a,
                    sa = in(reg) QK,
                    b = in(reg) b,
                    row = in(reg) ROW,
                    c = in(reg) c,
                    options(nostack),
                );
                j += 2;
            } else {
                asm!(
                    "tileloadd tmm4, [{a} + {sa}]",
                    "tileloadd tmm6, [{b} + {row}]",
                    "tilezero tmm0",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tilestored [{c} + {row}], tmm0",
                    a = in(reg) a,
                    sa = in(reg) QK,
                    b = in(reg) b,
                    row = in(reg) ROW,
                    c = in(reg) c,
                    options(nostack),
                );
                j += 1;
            }
        }
    }
}
