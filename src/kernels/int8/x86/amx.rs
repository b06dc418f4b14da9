//! The `fast` products on Intel's AMX tile unit, for prompts and batches of at least
//! sixteen rows: the integer sums of sixteen activation rows against a panel's sixteen
//! weight rows, one 32-value sub-block (or 16-value half) at a time, in one `tdpbssd`.
//!
//! **Same sums, same bits.** The tile unit multiplies signed bytes with signed bytes, so
//! the panel's unsigned values `u = q + offset` are taken back to their signed form
//! `u - offset` (which fits a byte for every format: Q8_0's is its own `-128..=127`),
//! and a sub-block's (or half's) product is `sum (u - offset) * q`, the integer that the
//! other kernels compute as `sum u * q - offset * sum q`. The tile's results are stored
//! to a buffer and then scaled, converted and accumulated exactly as
//! [`vnni_tile`](super::vnni_tile) does, in sub-block order: the results are the other
//! paths' bits.
//!
//! **How.** Tiles 4 and 5 hold sixteen activation rows' values of one sub-block (or
//! half) each, read in place from the quantized rows (a tile row is a row's 32 or 16
//! bytes, the row stride the row's length); tiles 6 and 7 the panel's words of the same
//! values (a tile row is four values of each of the sixteen lanes, the panel's own
//! layout); tiles 0 and 1 the 16 x 16 sums. Eight sub-blocks' sums are computed and
//! stored, then scaled eight rows at a time (each row's float and integer accumulators
//! stay in registers), so the tile unit and the vector units work side by side.
//!
//! **Where it runs.** Linux gives a process the tile unit's state only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `cpu.rs` asks once and says whether it was
//! granted. A thread configures its tiles with [`Tiles::start`] and releases them when
//! the guard drops, so no tile state outlives one product's share of work.

use std::arch::asm;

use super::super::activations::QuantizedRows;
use super::super::{LANES, Panel, QK};
use super::{format_at, same_form};
use crate::quant::{IntScales, QuantFormat, with_format};

/// Activation rows per tile: the tile unit's sixteen rows.
pub(in crate::kernels::int8) const AMX_ROWS: usize = 16;

/// Sub-blocks whose sums are computed before they are scaled: a multiple of every
/// format's run (eight sub-blocks for the K-quants), so a run never spans two chunks
/// and the integer accumulators start each chunk at zero.
const CHUNK: usize = 8;
const _: () = assert!(CHUNK.is_multiple_of(8));

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

/// Bytes of one product's values: a whole 32-value sub-block, or a 16-value half for
/// the formats with an integer scale per half.
const fn unit_bytes(scales: IntScales) -> usize {
    match scales {
        IntScales::PerHalf => QK / 2,
        IntScales::One | IntScales::PerBlock => QK,
    }
}

/// A thread's tiles, configured for one format's products; released when dropped.
pub(in crate::kernels::int8) struct Tiles(());

impl Tiles {
    /// Configures this thread's tiles for `format`'s products: tiles 0 and 1 hold 16 x
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
        for t in 0..2 {
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

/// Sums of one chunk: `[product][row][lane]`, two products per sub-block at most.
#[repr(C, align(64))]
struct Sums([[[i32; LANES]; AMX_ROWS]; 2 * CHUNK]);

/// Bytes of one sub-block of sixteen rows in [`tiled_rows`]' layout.
const TILE_BYTES: usize = AMX_ROWS * QK;

/// The quantized values of the first `rows / 16 * 16` activation rows, laid out for the
/// tile loads: group `g` of sixteen rows, sub-block `s`, row `i`, value `v` at `((g *
/// subs + s) * 16 + i) * 32 + v`. A tile's sixteen rows are then 512 contiguous bytes
/// (their rows 32 bytes apart), not sixteen lines a row's length apart, which for rows
/// of 2 KiB or more fall in the same few sets of the first-level cache. Built once per
/// product, read by every panel.
pub(in crate::kernels::int8) fn tiled_rows(acts: &QuantizedRows, rows: usize) -> Vec<i8> {
    let (n_in, groups) = (acts.n_in, rows / AMX_ROWS);
    let mut out = vec![0i8; groups * AMX_ROWS * n_in];
    for (g, group) in out.chunks_exact_mut(AMX_ROWS * n_in).enumerate() {
        for (s, tile) in group.chunks_exact_mut(TILE_BYTES).enumerate() {
            for (i, row) in tile.chunks_exact_mut(QK).enumerate() {
                let r = g * AMX_ROWS + i;
                row.copy_from_slice(&acts.q[r * n_in + s * QK..][..QK]);
            }
        }
    }
    out
}

/// The results of activation rows `0 .. out.len()` (a multiple of 16) against the
/// panel's sixteen rows, whose signed words ([`Panel::fill_signed`]) are in place;
/// `tiled` is the rows' [`tiled_rows`].
///
/// The loop runs over chunks of eight sub-blocks, and within a chunk over the groups of
/// sixteen rows: the chunk's 4 KiB of the panel stay in the first-level cache while
/// every group reads them (a group's whole row, for each group in turn, read the panel
/// from the second-level cache for every group, at 1 KiB a product).
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, FMA, AMX-TILE and AMX-INT8; this thread's [`Tiles`] are
/// configured for `format`; the panel and the rows come from one matrix of `format`;
/// `tiled` holds at least `out.len()` rows.
pub(in crate::kernels::int8) unsafe fn amx_panel(
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    tiled: &[i8],
    out: &mut [[f32; LANES]],
) {
    debug_assert!(out.len().is_multiple_of(AMX_ROWS) && tiled.len() >= out.len() * acts.n_in);
    // SAFETY: forwarded.
    unsafe { with_format!(format, F => amx_panel_of::<{ same_form(F) }>(panel, acts, tiled, out)) }
}

/// [`amx_panel`] for the format whose id is `F`.
///
/// # Safety
///
/// As [`amx_panel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline(never)]
unsafe fn amx_panel_of<const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    tiled: &[i8],
    out: &mut [[f32; LANES]],
) {
    use std::arch::x86_64::*;
    let f = const { format_at(F).int_form() };
    let k = const { unit_bytes(format_at(F).int_form().scales) };
    let per_sub = QK / k;
    let subs = acts.blocks();
    let groups = out.len() / AMX_ROWS;
    debug_assert!(panel.s.len() >= subs * 8 * LANES);
    // Written by `products` before it is read, product by product.
    let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
    let sp = sums.as_mut_ptr();
    let (scp, dp, mp) = (panel.sc.as_ptr(), panel.d.as_ptr(), panel.m.as_ptr());
    let (ad, asx) = (acts.d.as_ptr(), acts.sx.as_ptr());
    out.fill([0.0; LANES]);
    for s0 in (0..subs).step_by(CHUNK) {
        let n = CHUNK.min(subs - s0);
        for g in 0..groups {
            // SAFETY: group `g` holds `subs` tiles of 512 bytes and the panel `subs * 8`
            // words of 16 lanes: product `j` of the chunk reads 16 rows of `k` bytes at
            // byte `j * k % 32` of tile `s0 + j * k / 32`, and the panel's 64-byte rows
            // `(s0 * 32 + j * k) / 4 ..`, `k / 4` of them; the chunk has `n * per_sub`
            // products, within both and within `sums`.
            unsafe {
                products(
                    tiled.as_ptr().add((g * subs + s0) * TILE_BYTES),
                    panel.s.as_ptr().add(s0 * 8 * LANES).cast(),
                    k,
                    n * per_sub,
                    sp,
                )
            };
            for half in [0, 8] {
                let r0 = g * AMX_ROWS + half;
                // SAFETY (every access): `out` has rows `r0 .. r0 + 8`; `sums` holds a
                // product for each of the chunk's sub-blocks (two for `PerHalf`), just
                // written; the panel holds `subs * 2 * 16` scales and `subs * 16` of `d`
                // and `m`; rows `r0 .. r0 + 8` have `subs` block scales and sums `x * d`.
                unsafe {
                    let dots = |j: usize, i: usize| {
                        _mm512_loadu_si512((*sp).0[j][half + i].as_ptr().cast())
                    };
                    let mut acc = [_mm512_setzero_ps(); 8];
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_loadu_ps(out[r0 + i].as_ptr());
                    }
                    let mut iacc = [_mm512_setzero_si512(); 8];
                    for s in s0..s0 + n {
                        let j = (s - s0) * per_sub;
                        let sc0 = _mm512_loadu_si512(scp.add(s * 2 * LANES).cast());
                        let sc1 = _mm512_loadu_si512(scp.add((s * 2 + 1) * LANES).cast());
                        let dw = _mm512_loadu_ps(dp.add(s * LANES));
                        each_row!(8, i => {
                            let b = (r0 + i) * subs + s;
                            let isum = match f.scales {
                                IntScales::PerHalf => _mm512_add_epi32(
                                    _mm512_mullo_epi32(dots(j, i), sc0),
                                    _mm512_mullo_epi32(dots(j + 1, i), sc1),
                                ),
                                IntScales::PerBlock => _mm512_mullo_epi32(dots(j, i), sc0),
                                IntScales::One => dots(j, i),
                            };
                            iacc[i] = if f.run == 1 { isum } else { _mm512_add_epi32(iacc[i], isum) };
                            if (s + 1).is_multiple_of(f.run) {
                                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*ad.add(b)));
                                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), scale, acc[i]);
                                iacc[i] = _mm512_setzero_si512();
                            }
                            if f.mins {
                                let m = _mm512_loadu_ps(mp.add(s * LANES));
                                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(*asx.add(b)), acc[i]);
                            }
                        });
                    }
                    for (i, a) in acc.iter().enumerate() {
                        _mm512_storeu_ps(out[r0 + i].as_mut_ptr(), *a);
                    }
                }
            }
        }
    }
}

/// Products `0 .. count` of a chunk: product `j` multiplies `k` bytes of sixteen
/// activation rows, at byte `j * k % 32` of the 512-byte tile `j * k / 32` from `a`
/// (rows 32 bytes apart), with the panel's 64-byte rows from `b + j * 16 * k` (`k / 4`
/// of them) into product `j` of `sums`; two at a time, in tiles 0, 4, 6 and 1, 5, 7.
///
/// # Safety
///
/// The tiles are configured for products of `k` bytes ([`Tiles::start`]); the rows and
/// the panel hold what the products read; `count <= 2 * CHUNK`.
#[inline(always)]
unsafe fn products(a: *const i8, b: *const u8, k: usize, count: usize, sums: *mut Sums) {
    let out = sums.cast::<u8>();
    const ROW: usize = LANES * 4;
    const RESULT: usize = AMX_ROWS * LANES * 4;
    let at = |j: usize| j * k / QK * TILE_BYTES + j * k % QK;
    let mut j = 0;
    while j < count {
        // SAFETY: the caller's contract; product `j` (and `j + 1`) lies within it.
        unsafe {
            let (b, c) = (b.add(j * 16 * k), out.add(j * RESULT));
            if j + 1 < count {
                asm!(
                    "tileloadd tmm4, [{a} + {sa}]",
                    "tileloadd tmm6, [{b} + {row}]",
                    "tilezero tmm0",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a2} + {sa}]",
                    "tileloadd tmm7, [{b2} + {row}]",
                    "tilezero tmm1",
                    "tdpbssd tmm1, tmm5, tmm7",
                    "tilestored [{c} + {row}], tmm0",
                    "tilestored [{c2} + {row}], tmm1",
                    a = in(reg) a.add(at(j)),
                    a2 = in(reg) a.add(at(j + 1)),
                    sa = in(reg) QK,
                    b = in(reg) b,
                    b2 = in(reg) b.add(16 * k),
                    row = in(reg) ROW,
                    c = in(reg) c,
                    c2 = in(reg) c.add(RESULT),
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
                    a = in(reg) a.add(at(j)),
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
