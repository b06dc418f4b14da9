//! The `fast` precision's products: activations quantized to 8 bits in runs of 32-value
//! blocks, multiplied with the weights' own integers, the sums exact in 32-bit integers.
//!
//! **What is computed.** Each activation row is cut into blocks of 32 values, in runs
//! that share one scale: a run is one block for the 32-value weight formats (as ggml's
//! `Q8_0` activations) and eight blocks, 256 values, for the K-quants (as ggml's `Q8_K`,
//! which llama.cpp pairs with them). A run is quantized as ggml's `Q8_0` reference
//! quantizes a block (`d = max|x| / 127` over the run, `q = round(x / d)`, with `d` kept
//! in f32). Each weight format is read as 32-value sub-blocks of small integers
//! `u = q + offset` (0..=255) with an integer scale for each 16-value half, a float scale
//! `dw` (one per run) and, for the formats with a minimum, a float `m` ([`IntForm`], one
//! row per format in [`decode`]). Output `(r, c)` is then, over the row's sub-blocks `s`
//! in order:
//!
//! ```text
//! isum += sum over halves h of sc[h] * (sum of u * q over the half - offset * sum of q)
//! at the end of each run (every sub-block, or every eighth for the K-quants):
//! acc   = fma(isum as f32, dw * dx, acc); isum = 0   // dx: the run's activation scale
//! acc   = fma(m, dx * sum of q, acc)             // formats with a minimum only
//! ```
//!
//! For the 32-value formats (runs of one block) that is the same arithmetic, bit for bit,
//! as before runs existed. The largest run sum, Q6_K's (8 sub-blocks, 2 halves of 16
//! values of at most 32 * 127, scales of at most 128), is 1.3e8 < 2^31.
//!
//! A K-quant super-block's eight sub-blocks thus cost one conversion, one multiply and
//! one fused multiply-add per output instead of eight each (the 16-lane kernel at 128
//! rows of the 1B Q5_K_M file: 577-607 -> 500-528 ms for a step's projections).
//!
//! The integer sums are exact, so every kernel (portable, AVX-512 VNNI, AVX2) that
//! computes them in any order and then takes the float steps in sub-block order gives
//! the same bits: the `fast` precision's results are the same on every SIMD path, and a
//! row's outputs depend only on its own values, whatever the batch, the chunking of a
//! prompt or the number of threads.
//!
//! **How.** Sixteen weight rows at a time are decoded into a panel in which one 64-byte
//! vector holds four consecutive values of each of the sixteen rows: `vpdpbusd` then
//! multiplies them with four activation bytes broadcast to every lane, and a sub-block of
//! sixteen outputs costs eight such instructions, one conversion and one or two fused
//! multiply-adds, reused for every activation row of the product.

use super::cpu::{SimdPath, on_simd_path};
use super::quant::{GROUP_ROWS, QuantFormat, QuantMatrix};
use super::tiling::Columns;
use crate::error::{LlamaError, Result};
use crate::loader::dequant::{f16_at, k_scales_mins};

/// Values per activation block and per weight sub-block.
pub(crate) const QK: usize = 32;

/// Weight rows (outputs) per panel: one 16-lane vector of results.
pub(crate) const LANES: usize = 16;

/// Activation rows per register tile.
const ROW_TILE: usize = 8;

/// How a format's sub-blocks scale their integer sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntScales {
    /// No integer scale (it is 1).
    One,
    /// One integer scale per 32-value sub-block.
    PerBlock,
    /// One integer scale per 16-value half.
    PerHalf,
}

/// A weight format's integer form.
#[derive(Debug, Clone, Copy)]
struct IntForm {
    /// Added to the format's signed values to make them unsigned bytes.
    offset: i32,
    /// How the integer sums are scaled.
    scales: IntScales,
    /// Whether the format has a minimum (`m`).
    mins: bool,
    /// Sub-blocks in a run that shares one activation scale and whose scaled integer
    /// sums are added exactly before one float step: 8 (a super-block of 256 values)
    /// for the K-quants, whose activations are quantized per 256 values as ggml's
    /// `Q8_K` is; 1 for the 32-value formats (activations per 32 values, as `Q8_0`).
    run: usize,
}

/// The integer form of each format.
const fn form(format: QuantFormat) -> IntForm {
    use IntScales::{One, PerBlock, PerHalf};
    let (offset, scales, mins) = match format {
        QuantFormat::Q8_0 => (128, One, false),
        QuantFormat::Q4_0 => (8, One, false),
        QuantFormat::Q4_1 => (0, One, true),
        QuantFormat::Q5_0 => (16, One, false),
        QuantFormat::Q5_1 => (0, One, true),
        QuantFormat::Q3_K => (4, PerHalf, false),
        QuantFormat::Q4_K => (0, PerBlock, true),
        QuantFormat::Q5_K => (0, PerBlock, true),
        QuantFormat::Q6_K => (32, PerHalf, false),
    };
    IntForm {
        offset,
        scales,
        mins,
        run: format.block_values() / QK,
    }
}

/// The format whose id is `id` (its place in [`QuantFormat::ALL`], which is its
/// declaration order): the in-register kernels take their format as a const parameter,
/// so every branch on it is decided at compile time.
#[cfg(target_arch = "x86_64")]
const fn format_at(id: u8) -> QuantFormat {
    QuantFormat::ALL[id as usize]
}

/// Evaluates `$call` with the constant `$f` equal to `$format`'s id ([`format_at`]).
/// With the format a run-time value, the kernels branched on it (and on its
/// [`IntForm`]) inside every sub-block.
#[cfg(target_arch = "x86_64")]
macro_rules! with_format {
    ($format:expr, $f:ident => $call:expr) => {{
        match $format {
            QuantFormat::Q8_0 => {
                const $f: u8 = QuantFormat::Q8_0 as u8;
                $call
            }
            QuantFormat::Q4_0 => {
                const $f: u8 = QuantFormat::Q4_0 as u8;
                $call
            }
            QuantFormat::Q4_1 => {
                const $f: u8 = QuantFormat::Q4_1 as u8;
                $call
            }
            QuantFormat::Q4_K => {
                const $f: u8 = QuantFormat::Q4_K as u8;
                $call
            }
            QuantFormat::Q6_K => {
                const $f: u8 = QuantFormat::Q6_K as u8;
                $call
            }
            QuantFormat::Q5_0 => {
                const $f: u8 = QuantFormat::Q5_0 as u8;
                $call
            }
            QuantFormat::Q5_1 => {
                const $f: u8 = QuantFormat::Q5_1 as u8;
                $call
            }
            QuantFormat::Q3_K => {
                const $f: u8 = QuantFormat::Q3_K as u8;
                $call
            }
            QuantFormat::Q5_K => {
                const $f: u8 = QuantFormat::Q5_K as u8;
                $call
            }
        }
    }};
}

/// One 32-value sub-block of weights in its integer form.
#[derive(Debug, Clone, Copy, Default)]
struct Sub {
    /// The values plus the format's offset.
    u: [u8; QK],
    /// The integer scales of the two 16-value halves.
    sc: [i32; 2],
    /// The float scale of the integer sum.
    d: f32,
    /// The coefficient of the activations' sum (0 without a minimum).
    m: f32,
}

/// Decodes one ggml block of `format` into its sub-blocks (1 or 8 of `out`): the one
/// place that reads each format's bit layout for the integer kernels, mirroring the
/// loader's dequantization (`loader::dequant`).
fn decode(format: QuantFormat, b: &[u8], out: &mut [Sub; 8]) {
    let nibbles = |qs: &[u8], u: &mut [u8; QK]| {
        for (j, q) in qs.iter().enumerate().take(16) {
            u[j] = q & 0x0F;
            u[j + 16] = q >> 4;
        }
    };
    let fifth = |qh: u32, u: &mut [u8; QK]| {
        for (j, v) in u.iter_mut().enumerate() {
            *v |= (((qh >> j) & 1) as u8) << 4;
        }
    };
    let o = &mut out[0];
    match format {
        QuantFormat::Q8_0 => {
            *o = Sub {
                d: f16_at(b[0], b[1]),
                sc: [1, 1],
                ..Sub::default()
            };
            for (u, &q) in o.u.iter_mut().zip(&b[2..34]) {
                *u = q ^ 0x80; // (q as i8) + 128
            }
        }
        QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
            let head = if format == QuantFormat::Q4_0 { 2 } else { 4 };
            *o = Sub {
                d: f16_at(b[0], b[1]),
                m: if head == 4 { f16_at(b[2], b[3]) } else { 0.0 },
                sc: [1, 1],
                ..Sub::default()
            };
            nibbles(&b[head..head + 16], &mut o.u);
        }
        QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
            let head = if format == QuantFormat::Q5_0 { 2 } else { 4 };
            *o = Sub {
                d: f16_at(b[0], b[1]),
                m: if head == 4 { f16_at(b[2], b[3]) } else { 0.0 },
                sc: [1, 1],
                ..Sub::default()
            };
            let qh = u32::from_le_bytes([b[head], b[head + 1], b[head + 2], b[head + 3]]);
            nibbles(&b[head + 4..head + 20], &mut o.u);
            fifth(qh, &mut o.u);
        }
        QuantFormat::Q4_K | QuantFormat::Q5_K => {
            let (d, dmin) = (f16_at(b[0], b[1]), f16_at(b[2], b[3]));
            let (sc, mn) = k_scales_mins(&b[4..16]);
            let five = format == QuantFormat::Q5_K;
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
        QuantFormat::Q6_K => {
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
        QuantFormat::Q3_K => {
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
    }
}

/// Activation rows quantized in runs of 32-value blocks that share one scale (a run of
/// one block for the 32-value weight formats, as ggml's `Q8_0`; of eight for the
/// K-quants, as `Q8_K`), each block's scale and sums kept per block.
pub(crate) struct QuantizedRows {
    /// Values per row.
    n_in: usize,
    /// The quantized values, row-major.
    q: Vec<i8>,
    /// Each block's scale.
    d: Vec<f32>,
    /// Each block's scale times the sum of its values.
    sx: Vec<f32>,
    /// The sums of each block's two 16-value halves.
    sum16: Vec<i32>,
}

impl QuantizedRows {
    /// Quantizes `rows` rows of `n_in` values (a multiple of `32 * run`) as ggml's
    /// `Q8_0` reference does, with the scale kept in f32, each run of `run` 32-value
    /// blocks sharing the scale of its largest magnitude.
    pub(crate) fn new(x: &[f32], rows: usize, n_in: usize, run: usize) -> Self {
        let blocks = rows * n_in / QK;
        let mut out = Self {
            n_in,
            q: vec![0; rows * n_in],
            d: Vec::with_capacity(blocks),
            sx: Vec::with_capacity(blocks),
            sum16: Vec::with_capacity(2 * blocks),
        };
        for (xr, qr) in x
            .chunks_exact(QK * run)
            .zip(out.q.chunks_exact_mut(QK * run))
        {
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (xb, qb) in xr.chunks_exact(QK).zip(qr.chunks_exact_mut(QK)) {
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = (v * id).round() as i8;
                }
                let half = |h: &[i8]| h.iter().map(|&q| i32::from(q)).sum::<i32>();
                let (lo, hi) = (half(&qb[..16]), half(&qb[16..]));
                out.d.push(d);
                out.sx.push(d * (lo + hi) as f32);
                out.sum16.extend([lo, hi]);
            }
        }
        out
    }

    /// [`new`](Self::new) on `path`: the same bits, in the path's vectors (`round` is a
    /// library call per value in plain Rust; here it is a truncation and a comparison of
    /// the remainder, which gives its bits and vectorizes).
    pub(crate) fn new_on(path: SimdPath, x: &[f32], rows: usize, n_in: usize, run: usize) -> Self {
        let blocks = rows * n_in / QK;
        let mut out = Self {
            n_in,
            q: vec![0; rows * n_in],
            d: vec![0.0; blocks],
            sx: vec![0.0; blocks],
            sum16: vec![0; 2 * blocks],
        };
        // A prompt's rows are split between the pool's threads in runs of whole blocks
        // (each run of blocks is quantized alone, so the split changes no bit); a decode
        // step's few rows are not worth a split. The split's runs are whole runs of
        // blocks (`PARALLEL_QUANTIZE_BLOCKS / 2` is a multiple of 8).
        let per = if blocks >= PARALLEL_QUANTIZE_BLOCKS {
            PARALLEL_QUANTIZE_BLOCKS / 2
        } else {
            blocks
        };
        let (q, d, sx, sum16) = (
            super::pool::Disjoint::new(&mut out.q),
            super::pool::Disjoint::new(&mut out.d),
            super::pool::Disjoint::new(&mut out.sx),
            super::pool::Disjoint::new(&mut out.sum16),
        );
        super::pool::for_each_run(blocks, per, &|first, end| {
            let n = end - first;
            let x = &x[first * QK..end * QK];
            // SAFETY: this run alone writes blocks `first..end` of each buffer, all inside
            // them (`end <= blocks`), and the buffers outlive the split.
            let (q, d, sx, sum16) = unsafe {
                (
                    q.part(first * QK, n * QK),
                    d.part(first, n),
                    sx.part(first, n),
                    sum16.part(2 * first, 2 * n),
                )
            };
            on_simd_path!(path, quantize_blocks(
                x: &[f32],
                q: &mut [i8],
                d: &mut [f32],
                sx: &mut [f32],
                sum16: &mut [i32],
                run: usize,
            ));
        });
        out
    }

    /// Sub-blocks per row.
    fn blocks(&self) -> usize {
        self.n_in / QK
    }
}

/// From this many 32-value blocks (64 Ki values: 32 rows of 2,048), the activations of a
/// product are quantized by the pool's threads, in runs of half as many blocks; below it
/// (a decode step) on the calling thread. A prompt of 150 tokens spent 7% of its
/// projections' time quantizing on one thread while the other waited.
const PARALLEL_QUANTIZE_BLOCKS: usize = 2048;

/// [`QuantizedRows::new`]'s quantization of the 32-value blocks of `x` into `q`, each
/// block's scale into `d`, scale times sum into `sx` and half sums into `sum16`, written
/// so that the compiler vectorizes it: the maximum in 16 lanes (exact in any order), and
/// `round` (half away from zero) as `t = trunc(y)`, plus `sign(y)` where `|y - t| >=
/// 0.5` (`y - t` is exact).
#[inline(always)]
fn quantize_blocks(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sx: &mut [f32],
    sum16: &mut [i32],
    run: usize,
) {
    let runs = x
        .chunks_exact(QK * run)
        .zip(q.chunks_exact_mut(QK * run))
        .zip(d.chunks_exact_mut(run).zip(sx.chunks_exact_mut(run)))
        .zip(sum16.chunks_exact_mut(2 * run));
    for (((xr, qr), (dr, sxr)), sums) in runs {
        let mut lanes = [0f32; 16];
        for part in xr.chunks_exact(16) {
            for (m, v) in lanes.iter_mut().zip(part) {
                *m = m.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let blocks = xr
            .chunks_exact(QK)
            .zip(qr.chunks_exact_mut(QK))
            .zip(dr.iter_mut().zip(sxr.iter_mut()))
            .zip(sums.chunks_exact_mut(2));
        for (((xb, qb), (d, sx)), sums) in blocks {
            let mut ints = [0i32; QK];
            for ((q, int), &v) in qb.iter_mut().zip(ints.iter_mut()).zip(xb) {
                let y = v * id;
                let t = y.trunc();
                let r = if (y - t).abs() >= 0.5 {
                    t + 1f32.copysign(y)
                } else {
                    t
                };
                // |r| <= 127 (or NaN, which both casts make 0).
                *int = r as i32;
                *q = *int as i8;
            }
            let (lo, hi) = (
                ints[..16].iter().sum::<i32>(),
                ints[16..].iter().sum::<i32>(),
            );
            *d = scale;
            *sx = scale * (lo + hi) as f32;
            sums.copy_from_slice(&[lo, hi]);
        }
    }
}

/// Sixteen weight rows in their integer form, sub-block by sub-block: `u[(s * 8 + t) *
/// 16 + lane]` holds values `4t .. 4t + 4` of sub-block `s` of row `lane` as one little-
/// endian word; `sc`, `d` and `m` hold each lane's scales (`sc` per half).
#[derive(Default)]
pub(crate) struct Panel {
    u: Vec<u32>,
    sc: Vec<i32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Panel {
    /// Decodes rows `first .. first + n` of `w` (`n <= 16`, `first` a multiple of 8);
    /// lanes past `n` hold zeros.
    fn fill(&mut self, w: &QuantMatrix, first: usize, n: usize) {
        let subs = w.cols() / QK;
        self.u.clear();
        self.u.resize(subs * 8 * LANES, 0);
        self.sc.clear();
        self.sc.resize(subs * 2 * LANES, 0);
        self.d.clear();
        self.d.resize(subs * LANES, 0.0);
        self.m.clear();
        self.m.resize(subs * LANES, 0.0);
        let format = w.format();
        let per_block = format.block_values() / QK;
        let (bb, hb) = (format.block_bytes(), format.head_bytes());
        let mut block = [0u8; 256];
        let mut decoded = [Sub::default(); 8];
        for g in (0..n).step_by(super::quant::GROUP_ROWS) {
            w.for_group_blocks(first + g, n - g, |c, b, head, values| {
                block[..hb].copy_from_slice(head);
                block[hb..bb].copy_from_slice(values);
                decode(format, &block[..bb], &mut decoded);
                let lane = g + c;
                for (i, sub) in decoded.iter().take(per_block).enumerate() {
                    let s = b * per_block + i;
                    for (t, word) in sub.u.chunks_exact(4).enumerate() {
                        self.u[(s * 8 + t) * LANES + lane] =
                            u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
                    }
                    self.sc[(s * 2) * LANES + lane] = sub.sc[0];
                    self.sc[(s * 2 + 1) * LANES + lane] = sub.sc[1];
                    self.d[s * LANES + lane] = sub.d;
                    self.m[s * LANES + lane] = sub.m;
                }
            });
        }
    }
}

/// `x @ W^T` in the `fast` precision for `x` row-major `[rows, w.cols()]`: `[rows,
/// w.rows()]`, on `path`. The same bits on every path (see the module documentation).
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if `x` is not `rows` rows of `w.cols()` values, and
/// [`LlamaError::InvalidParameter`] if this CPU cannot run `path`.
pub fn matmul_transposed_int8_on(
    path: SimdPath,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
) -> Result<Vec<f32>> {
    let (n_in, n_out) = (w.cols(), w.rows());
    // Activations are quantized in runs of `run` blocks (see `IntForm::run`).
    let run = form(w.format()).run;
    if Some(x.len()) != rows.checked_mul(n_in) || !n_in.is_multiple_of(QK * run) {
        return Err(LlamaError::ShapeMismatch {
            name: "quantized matmul input".into(),
            expected: vec![rows, n_in],
            actual: vec![x.len()],
        });
    }
    if !path.is_supported() {
        return Err(LlamaError::invalid(
            "simd path",
            path.name(),
            "not supported by this CPU",
        ));
    }
    if rows == 0 || n_out == 0 {
        return Ok(Vec::new());
    }
    let acts = QuantizedRows::new_on(path, x, rows, n_in, run);
    let threads = rayon::current_num_threads().max(1);
    // Chunks of whole panels (16 outputs), guided: large first, small last.
    let bounds = super::tiling::guided_chunks(n_out.div_ceil(LANES), threads, 2);
    let mut out = vec![0f32; rows * n_out];
    let target = Columns::new(&mut out, n_out);
    let vnni = vnni_supported(path);
    let in_registers = vnni && registers_decode(w.format());
    let avx2_registers = !vnni && avx2_supported(path) && registers_decode(w.format());
    super::pool::for_each_chunk(bounds.len() - 1, &|chunk| {
        let (start, end) = (
            bounds[chunk] * LANES,
            (bounds[chunk + 1] * LANES).min(n_out),
        );
        PANEL.with_borrow_mut(|panel| {
            for first in (start..end).step_by(LANES) {
                let n = LANES.min(end - first);
                #[cfg(target_arch = "x86_64")]
                if n == LANES && ((in_registers && rows <= GROUP_TILE) || avx2_registers) {
                    // Each group decoded in registers and multiplied at once: with VNNI
                    // for few rows, on AVX2 (no 16-lane panel kernel) for every tile.
                    for g in [first, first + GROUP_ROWS] {
                        let group = w.group(g).0;
                        for r in (0..rows).step_by(GROUP_TILE) {
                            let tile = GROUP_TILE.min(rows - r);
                            let mut res = [[0f32; GROUP_ROWS]; GROUP_TILE];
                            // SAFETY: `in_registers` (`avx2_registers`) says this CPU
                            // has AVX-512 with VNNI (AVX2, FMA and F16C) and the format
                            // is one `group_tile` reads; the group is full (8 rows of
                            // `w.cols()` values) and `r + tile <= rows`.
                            unsafe {
                                if in_registers {
                                    group_tile_vnni(w.format(), group, &acts, r, tile, &mut res)
                                } else {
                                    group_tile_avx2(w.format(), group, &acts, r, tile, &mut res)
                                }
                            };
                            for (i, row) in res.iter().take(tile).enumerate() {
                                // SAFETY: row `r + i < rows`; columns `g .. g + 8` lie in
                                // this chunk's `start..end`, which no other chunk writes.
                                unsafe { target.write(r + i, g, row) };
                            }
                        }
                    }
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if in_registers && n == LANES {
                    // More rows: decoded once into the panel, reused for every row.
                    // SAFETY: as above; `first` starts two full groups.
                    unsafe { panel.fill_in_registers(w, first) };
                } else {
                    panel.fill(w, first, n);
                }
                #[cfg(not(target_arch = "x86_64"))]
                panel.fill(w, first, n);
                let mut r = 0;
                while r < rows {
                    let tile = ROW_TILE.min(rows - r);
                    let mut res = [[0f32; LANES]; ROW_TILE];
                    run_tile(path, vnni, panel, w.format(), &acts, r, tile, &mut res);
                    for (i, row) in res.iter().take(tile).enumerate() {
                        // SAFETY: row `r + i < rows`; columns `first .. first + n` lie in
                        // this chunk's `start..end`, which no other chunk writes.
                        unsafe { target.write(r + i, first, &row[..n]) };
                    }
                    r += tile;
                }
            }
        });
    });
    Ok(out)
}

thread_local! {
    /// Each worker thread's panel, kept between calls.
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
}

/// Whether the [active](SimdPath::active) path runs the `fast` precision with its own
/// integer kernels (AVX-512 with VNNI, or AVX2 with FMA and F16C), rather than the
/// plain-Rust reference.
pub fn has_integer_kernels() -> bool {
    let path = SimdPath::active();
    vnni_supported(path) || avx2_supported(path)
}

/// Whether `path` can run the AVX2 in-register kernel ([`group_tile_avx2`]) on this
/// CPU (the AVX-512 path takes it where the CPU lacks VNNI).
fn avx2_supported(path: SimdPath) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(path, SimdPath::Avx2 | SimdPath::Avx512)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = path;
        false
    }
}

/// Whether `path` runs the `vpdpbusd` kernel on this CPU.
fn vnni_supported(path: SimdPath) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        path == SimdPath::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = path;
        false
    }
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

/// Activation rows per tile of [`group_tile`].
const GROUP_TILE: usize = 8;

/// Runs `$body` with `$i` = 0, 1, ... for each `$i < $t` (a constant, at most 8), written
/// out rather than looped: with constant indices the accumulators stay in registers
/// (LLVM keeps a loop of more than four such rows, and their accumulators on the stack).
macro_rules! each_row {
    ($t:expr, $i:ident => $body:block) => {
        each_row!(@ $t, $i, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $t:expr, $i:ident, $body:block, $($n:literal)*) => {
        $(
            if $n < $t {
                let $i: usize = $n;
                $body
            }
        )*
    };
}

/// Evaluates `$call` with the constant `$t` equal to `$tile` (1 to 8): the tile kernels
/// take their number of rows as a const parameter, so their accumulators are registers
/// (with a runtime count they lived on the stack, and every fused multiply-add went
/// through a store and a load: 35% of the 16-row kernel's time).
macro_rules! with_tile {
    ($tile:expr, $t:ident => $call:expr) => {{
        debug_assert!((1..=8).contains(&$tile));
        match $tile {
            1 => {
                const $t: usize = 1;
                $call
            }
            2 => {
                const $t: usize = 2;
                $call
            }
            3 => {
                const $t: usize = 3;
                $call
            }
            4 => {
                const $t: usize = 4;
                $call
            }
            5 => {
                const $t: usize = 5;
                $call
            }
            6 => {
                const $t: usize = 6;
                $call
            }
            7 => {
                const $t: usize = 7;
                $call
            }
            _ => {
                const $t: usize = 8;
                $call
            }
        }
    }};
}

/// The few instructions in which the in-register kernels differ between AVX-512 (with
/// VNNI) and AVX2: everything else ([`decode_group`], [`multiply_sub`]) is written once
/// over 8-lane vectors, generic over this, and compiled into one entry point per
/// instruction set ([`group_tile_vnni`], [`group_tile_avx2`]) with its target features.
/// Both give the same integer sums, so the same bits.
#[cfg(target_arch = "x86_64")]
trait Isa {
    /// Four vectors of two rows' four u32 words each (rows `2p`, `2p + 1`) to four
    /// vectors of one word of eight rows each.
    ///
    /// # Safety
    ///
    /// The CPU has the instruction set's features.
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4];

    /// The f16 values in the low halves of the eight 32-bit lanes, as f32.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256;

    /// `acc + ` each lane's four products of unsigned bytes of `w` (at most 63 on AVX2,
    /// where `vpmaddubsw` saturates pairs at 32767) with signed bytes of `x`.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;

    /// `(a & mask) | b`, bit by bit: a field of `a` merged with bits already in place.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;

    /// Whether [`dot4`](Self::dot4) takes only bytes below 64, so Q8_0's values are
    /// multiplied signed (`|q| * sign(x, q)`) rather than offset by 128.
    const SMALL_BYTES: bool;
}

/// AVX-512 F/BW/VL with VNNI: `vpdpbusd` and two-source permutes.
#[cfg(target_arch = "x86_64")]
struct Vnni;

/// AVX2 with FMA and F16C: `vpmaddubsw` then `vpmaddwd`, and unpacks.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Isa for Vnni {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 F/VL).
        unsafe {
            let pick_lo = _mm256_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13);
            let pick_hi = _mm256_setr_epi32(2, 6, 10, 14, 3, 7, 11, 15);
            let low_halves = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
            let high_halves = _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15);
            let p01 = _mm256_permutex2var_epi32(a[0], pick_lo, a[1]);
            let p23 = _mm256_permutex2var_epi32(a[0], pick_hi, a[1]);
            let q01 = _mm256_permutex2var_epi32(a[2], pick_lo, a[3]);
            let q23 = _mm256_permutex2var_epi32(a[2], pick_hi, a[3]);
            [
                _mm256_permutex2var_epi32(p01, low_halves, q01),
                _mm256_permutex2var_epi32(p01, high_halves, q01),
                _mm256_permutex2var_epi32(p23, low_halves, q23),
                _mm256_permutex2var_epi32(p23, high_halves, q23),
            ]
        }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 VL, F16C).
        unsafe { _mm256_cvtph_ps(_mm256_cvtepi32_epi16(v)) }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 VL, VNNI).
        unsafe { std::arch::x86_64::_mm256_dpbusd_epi32(acc, w, x) }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 F/VL). 0xEA: (a & mask) | b.
        unsafe { std::arch::x86_64::_mm256_ternarylogic_epi32::<0xEA>(a, mask, b) }
    }

    const SMALL_BYTES: bool = false;
}

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            // Per 128-bit half (rows 2p | 2p + 1): words 0-1, then 2-3, of rows 0 and 2
            // (4 and 6) interleaved.
            let lo02 = _mm256_unpacklo_epi32(a[0], a[1]);
            let hi02 = _mm256_unpackhi_epi32(a[0], a[1]);
            let lo46 = _mm256_unpacklo_epi32(a[2], a[3]);
            let hi46 = _mm256_unpackhi_epi32(a[2], a[3]);
            // Word j of rows 0, 2, 4, 6 | 1, 3, 5, 7: put the rows in order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            [
                _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(lo02, lo46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(lo02, lo46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(hi02, hi46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(hi02, hi46), order),
            ]
        }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2, F16C).
        unsafe {
            let pick = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13,
                -1, -1, -1, -1, -1, -1, -1, -1,
            );
            let halves = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(v, pick));
            _mm256_cvtph_ps(_mm256_castsi256_si128(halves))
        }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2). Pairs of products stay within i16: at
        // most 2 * 63 * 127 (or 2 * 128 * 127 for Q8_0's signed form).
        unsafe {
            let pairs = _mm256_maddubs_epi16(w, x);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2).
        unsafe { _mm256_or_si256(_mm256_and_si256(a, mask), b) }
    }

    const SMALL_BYTES: bool = true;
}

/// Results of activation rows `r0 .. r0 + tile` against the eight rows of a full group,
/// decoded in registers from the grouped layout (no panel): a block's eight rows of
/// quantized values are transposed into vectors of four values per row (lanes = rows),
/// then multiplied as [`vnni_tile`] does, with the same integer sums and float steps, so
/// the same bits. Compiled for AVX-512 VNNI ([`group_tile_vnni`]) and AVX2
/// ([`group_tile_avx2`]).
///
/// # Safety
///
/// The CPU has `I`'s features; [`registers_decode`] holds for `format`; `group` holds 8
/// rows of `acts.n_in` values; `r0 + T` rows exist, `T <= GROUP_TILE`.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_tile_vnni(
    format: QuantFormat,
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => with_tile!(tile, T => group_tile::<Vnni, T, F>(group, acts, r0, out)))
    }
}

/// [`group_tile`] on AVX2.
///
/// # Safety
///
/// As [`group_tile`], the CPU having AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_tile_avx2(
    format: QuantFormat,
    group: &[u8],
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; GROUP_ROWS]; GROUP_TILE],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => with_tile!(tile, T => group_tile::<Avx2, T, F>(group, acts, r0, out)))
    }
}

/// Decodes the `subs` sub-blocks of each row of a full group in registers, calling
/// `sub(w, scales, s)` for each in order.
///
/// # Safety
///
/// The CPU has `I`'s features; [`registers_decode`] holds for `format`; `group` holds 8
/// rows of `subs * 32` values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn decode_group<I: Isa, const F: u8>(group: &[u8], subs: usize, sink: &mut impl SubSink) {
    let format = format_at(F);
    let bb = format.block_bytes();
    let per_block = format.block_values() / QK;
    debug_assert!(group.len() >= subs / per_block * GROUP_ROWS * bb);
    for blk in 0..subs / per_block {
        // SAFETY: block `blk` of the group is `8 * bb` bytes at `blk * 8 * bb`.
        let step = unsafe { group.as_ptr().add(blk * GROUP_ROWS * bb) };
        super::tiling::prefetch_group_step(step, GROUP_ROWS * bb);
        // SAFETY (each arm): `step` holds the format's eight blocks in the grouped layout.
        unsafe {
            match format {
                QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                    let (w, sc) = decode_step_32::<I>(format, step);
                    sink.take(&w, &sc, blk);
                }
                QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                    let (w, sc) = decode_step_q5::<I>(format, step);
                    sink.take(&w, &sc, blk);
                }
                QuantFormat::Q4_K | QuantFormat::Q5_K => {
                    decode_step_k4::<I>(format, step, blk * 8, sink)
                }
                QuantFormat::Q3_K => decode_step_q3k::<I>(step, blk * 8, sink),
                _ => decode_step_q6k::<I>(step, blk * 8, sink),
            }
        }
    }
}

impl Panel {
    /// [`fill`](Self::fill) for sixteen rows of a format [`registers_decode`] takes,
    /// decoded in registers and stored (lanes 0-7 from the first group, 8-15 from the
    /// second): the same values.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512 F/BW/VL, F16C and AVX2; `first` starts two full groups of
    /// `w`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c,avx2")]
    unsafe fn fill_in_registers(&mut self, w: &QuantMatrix, first: usize) {
        let subs = w.cols() / QK;
        self.u.resize(subs * 8 * LANES, 0);
        self.sc.resize(subs * 2 * LANES, 0);
        self.d.resize(subs * LANES, 0.0);
        self.m.resize(subs * LANES, 0.0);
        for half in 0..2 {
            let (group, _) = w.group(first + half * GROUP_ROWS);
            let lane = half * GROUP_ROWS;
            let mut sink = Store {
                u: self.u.as_mut_ptr(),
                sc: self.sc.as_mut_ptr(),
                d: self.d.as_mut_ptr(),
                m: self.m.as_mut_ptr(),
                lane,
            };
            // SAFETY: the caller's contract; every store is inside the vectors sized
            // above (sub-block `s < subs`, lanes `lane .. lane + 8 <= 16`).
            unsafe {
                with_format!(w.format(), F => decode_group::<Vnni, F>(group, subs, &mut sink))
            };
        }
    }
}

/// Whether [`group_tile`] decodes `format` straight from a matrix's grouped layout.
fn registers_decode(format: QuantFormat) -> bool {
    matches!(
        format,
        QuantFormat::Q8_0
            | QuantFormat::Q4_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_0
            | QuantFormat::Q5_1
            | QuantFormat::Q4_K
            | QuantFormat::Q3_K
            | QuantFormat::Q5_K
            | QuantFormat::Q6_K
    )
}

/// What takes each decoded sub-block of a group in turn: a trait with an always-inlined
/// method rather than a closure, because closures are compiled without the target
/// features of the function that calls them, and each intrinsic inside one would become
/// a call.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
struct Multiply<'a, I, const T: usize, const F: u8> {
    acts: &'a QuantizedRows,
    r0: usize,
    acc: [std::arch::x86_64::__m256; T],
    /// The current run's integer sums (see [`IntForm::run`]).
    iacc: [std::arch::x86_64::__m256i; T],
    isa: std::marker::PhantomData<I>,
}

#[cfg(target_arch = "x86_64")]
impl<I: Isa, const T: usize, const F: u8> SubSink for Multiply<'_, I, T, F> {
    #[inline(always)]
    unsafe fn take(&mut self, w: &[std::arch::x86_64::__m256i; 8], sc: &SubScales, s: usize) {
        let f = form(format_at(F));
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
#[cfg(target_arch = "x86_64")]
struct Store {
    u: *mut u32,
    sc: *mut i32,
    d: *mut f32,
    m: *mut f32,
    lane: usize,
}

#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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

/// The 32 bytes at `at(i)` for rows `i < 8` to eight vectors of one u32 word of the
/// eight rows each.
///
/// # Safety
///
/// The CPU has `I`'s features; 32 bytes are readable at each `at(i)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8<I: Isa>(at: impl Fn(usize) -> *const u8) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut rows = [_mm256_setzero_si256(); 8];
        for (i, v) in rows.iter_mut().enumerate() {
            *v = _mm256_loadu_si256(at(i).cast());
        }
        let mut first = [_mm256_setzero_si256(); 4];
        let mut last = [_mm256_setzero_si256(); 4];
        for p in 0..4 {
            first[p] = _mm256_permute2x128_si256::<0x20>(rows[2 * p], rows[2 * p + 1]);
            last[p] = _mm256_permute2x128_si256::<0x31>(rows[2 * p], rows[2 * p + 1]);
        }
        let (a, b) = (I::transpose4(first), I::transpose4(last));
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    }
}

/// Words `w .. w + 8` of the eight rows of a word-interleaved step (see
/// `QuantMatrix`'s layout), one vector each (lanes = rows): what [`transpose8`] makes of
/// the rows' bytes `4 w .. 4 w + 32`, loaded as stored.
///
/// # Safety
///
/// The CPU has AVX; the step holds at least `w + 8` interleaved words.
#[cfg(target_arch = "x86_64")]
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

/// Word `w` of the eight rows of a word-interleaved step (lanes = rows).
///
/// # Safety
///
/// The CPU has AVX; the step holds at least `w + 1` interleaved words.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
        let (nibble, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
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
                    // Bits 2j, 2j + 1 of each `qh` byte moved to bits 4, 5 (shifts in
                    // 16-bit lanes: the mask drops what crosses a byte).
                    let moved = match j {
                        0 => _mm256_slli_epi16::<4>(h[k]),
                        1 => _mm256_slli_epi16::<2>(h[k]),
                        2 => h[k],
                        _ => _mm256_srli_epi16::<2>(h[k]),
                    };
                    *v = I::and_or(low, nibble, _mm256_and_si256(moved, top));
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

/// Results of activation rows `r0 .. r0 + tile` against the panel's sixteen rows.
#[allow(clippy::too_many_arguments)]
fn run_tile(
    path: SimdPath,
    vnni: bool,
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; LANES]; ROW_TILE],
) {
    let f = form(format);
    #[cfg(target_arch = "x86_64")]
    if vnni {
        // SAFETY: `vnni` says this CPU has AVX-512 with VNNI; the panel and the rows
        // were built for the same matrix and `r0 + tile <= rows`.
        unsafe { vnni_tile(panel, format, acts, r0, tile, out) };
        return;
    }
    let _ = vnni;
    on_simd_path!(path, plain_tile(
        panel: &Panel,
        f: IntForm,
        acts: &QuantizedRows,
        r0: usize,
        tile: usize,
        out: &mut [[f32; LANES]; ROW_TILE],
    ));
}

/// The kernel in plain Rust, lanes innermost (the reference; other paths compile it for
/// their vector width).
#[inline(always)]
fn plain_tile(
    panel: &Panel,
    f: IntForm,
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; LANES]; ROW_TILE],
) {
    let subs = acts.blocks();
    for (i, acc) in out.iter_mut().enumerate().take(tile) {
        let r = r0 + i;
        *acc = [0f32; LANES];
        let mut iacc = [0i32; LANES];
        for s in 0..subs {
            let xq = &acts.q[r * acts.n_in + s * QK..][..QK];
            let mut half = [[0i32; LANES]; 2];
            for t in 0..8 {
                let x4 = &xq[4 * t..4 * t + 4];
                let words = &panel.u[(s * 8 + t) * LANES..][..LANES];
                for (h, &w) in half[t / 4].iter_mut().zip(words) {
                    let w = w.to_le_bytes();
                    *h += (0..4)
                        .map(|k| i32::from(w[k]) * i32::from(x4[k]))
                        .sum::<i32>();
                }
            }
            let b = r * subs + s;
            let dx = acts.d[b];
            let corr = [
                f.offset * acts.sum16[2 * b],
                f.offset * acts.sum16[2 * b + 1],
            ];
            let end_of_run = (s + 1).is_multiple_of(f.run);
            for l in 0..LANES {
                iacc[l] += panel.sc[s * 2 * LANES + l] * (half[0][l] - corr[0])
                    + panel.sc[(s * 2 + 1) * LANES + l] * (half[1][l] - corr[1]);
                if end_of_run {
                    acc[l] = (iacc[l] as f32).mul_add(panel.d[s * LANES + l] * dx, acc[l]);
                    iacc[l] = 0;
                }
                if f.mins {
                    acc[l] = panel.m[s * LANES + l].mul_add(acts.sx[b], acc[l]);
                }
            }
        }
    }
}

/// The kernel with `vpdpbusd`: per sub-block, eight dot products of four bytes for all
/// sixteen lanes of each activation row of the tile.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW/VL, VNNI and FMA; the panel and rows come from one matrix
/// and `r0 + tile` rows exist.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_tile(
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; LANES]; ROW_TILE],
) {
    // SAFETY: forwarded.
    unsafe {
        with_format!(format, F => with_tile!(tile, T => vnni_tile_rows::<T, F>(panel, acts, r0, out)))
    }
}

/// [`vnni_tile`] for `T` rows of the format whose id is `F` ([`format_at`]): its integer
/// form is a constant, so the kernel has no branch on it; the integer sums and float
/// steps are the module's, in its order.
///
/// # Safety
///
/// As [`vnni_tile`], with `T` for `tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn vnni_tile_rows<const T: usize, const F: u8>(
    panel: &Panel,
    acts: &QuantizedRows,
    r0: usize,
    out: &mut [[f32; LANES]; ROW_TILE],
) {
    use std::arch::x86_64::*;
    let f = form(format_at(F));
    let subs = acts.blocks();
    debug_assert!(acts.q.len() >= (r0 + T) * acts.n_in && acts.d.len() >= (r0 + T) * subs);
    let mut acc = [_mm512_setzero_ps(); T];
    let mut iacc = [_mm512_setzero_si512(); T];
    let (up, scp) = (panel.u.as_ptr(), panel.sc.as_ptr());
    let (dp, mp) = (panel.d.as_ptr(), panel.m.as_ptr());
    // The activations' values and per-block data (block `b = r * subs + s` of row `r`).
    let xq = acts.q.as_ptr();
    let (ad, asx, asum) = (acts.d.as_ptr(), acts.sx.as_ptr(), acts.sum16.as_ptr());
    for s in 0..subs {
        // SAFETY (every load): the panel holds `subs * 8 * 16` words, `subs * 2 * 16`
        // scales and `subs * 16` of `d` and `m`; each activation row has `subs * 32`
        // bytes, `subs` scales and sums `x * d`, and `2 * subs` half sums; rows
        // `r0 .. r0 + T` exist.
        unsafe {
            let mut w = [_mm512_setzero_si512(); 8];
            for (t, v) in w.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(up.add((s * 8 + t) * LANES).cast());
            }
            let sc0 = _mm512_loadu_si512(scp.add(s * 2 * LANES).cast());
            let sc1 = _mm512_loadu_si512(scp.add((s * 2 + 1) * LANES).cast());
            let dw = _mm512_loadu_ps(dp.add(s * LANES));
            each_row!(T, i => {
                let r = r0 + i;
                let b = r * subs + s;
                let xp = xq.add(r * acts.n_in + s * QK).cast::<i32>();
                let x = |t: usize| _mm512_set1_epi32(xp.add(t).read_unaligned());
                let (lo, hi) = (*asum.add(2 * b), *asum.add(2 * b + 1));
                let isum = if f.scales == IntScales::PerHalf {
                    let mut a = _mm512_set1_epi32(-f.offset * lo);
                    let mut c = _mm512_set1_epi32(-f.offset * hi);
                    for t in 0..4 {
                        a = _mm512_dpbusd_epi32(a, w[t], x(t));
                        c = _mm512_dpbusd_epi32(c, w[t + 4], x(t + 4));
                    }
                    _mm512_add_epi32(_mm512_mullo_epi32(a, sc0), _mm512_mullo_epi32(c, sc1))
                } else {
                    let mut a = _mm512_set1_epi32(-f.offset * (lo + hi));
                    let mut c = _mm512_setzero_si512();
                    for t in 0..4 {
                        a = _mm512_dpbusd_epi32(a, w[t], x(t));
                        c = _mm512_dpbusd_epi32(c, w[t + 4], x(t + 4));
                    }
                    let a = _mm512_add_epi32(a, c);
                    if f.scales == IntScales::PerBlock {
                        _mm512_mullo_epi32(a, sc0)
                    } else {
                        a
                    }
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
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds 16 floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
}

/// One output of the `fast` precision written plainly, from the dequantization-free
/// definition in the module documentation (for tests).
pub fn int8_reference(format: QuantFormat, row_blocks: &[u8], x: &[f32]) -> f32 {
    let n_in = x.len();
    let f = form(format);
    let acts = QuantizedRows::new(x, 1, n_in, f.run);
    let (bv, bb) = (format.block_values(), format.block_bytes());
    let mut acc = 0f32;
    let mut iacc = 0i32;
    let mut subs = [Sub::default(); 8];
    for (blk, bytes) in row_blocks.chunks_exact(bb).enumerate().take(n_in / bv) {
        decode(format, bytes, &mut subs);
        for (i, sub) in subs.iter().take(bv / QK).enumerate() {
            let s = blk * (bv / QK) + i;
            for h in 0..2 {
                let mut dot = 0i32;
                for k in 16 * h..16 * h + 16 {
                    dot += i32::from(sub.u[k]) * i32::from(acts.q[s * QK + k]);
                }
                iacc += sub.sc[h] * (dot - f.offset * acts.sum16[2 * s + h]);
            }
            if (s + 1).is_multiple_of(f.run) {
                acc = (iacc as f32).mul_add(sub.d * acts.d[s], acc);
                iacc = 0;
            }
            if f.mins {
                acc = sub.m.mul_add(acts.sx[s], acc);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::random_matrix;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn paths() -> Vec<SimdPath> {
        SimdPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }

    #[test]
    fn the_integer_form_gives_the_dequantized_values() {
        // sc * d * (u - offset) + m is the loader's value, to f32 rounding.
        for format in QuantFormat::ALL {
            let w = random_matrix(format, 3, 512, 5);
            let dense = w.dequantize().unwrap();
            let f = form(format);
            let mut subs = [Sub::default(); 8];
            for r in 0..3 {
                let bytes = w.row_ggml_bytes(r).unwrap();
                let bv = format.block_values();
                for (blk, b) in bytes.chunks_exact(format.block_bytes()).enumerate() {
                    decode(format, b, &mut subs);
                    for (i, sub) in subs.iter().take(bv / QK).enumerate() {
                        for k in 0..QK {
                            let v = sub.d
                                * (sub.sc[k / 16] * (i32::from(sub.u[k]) - f.offset)) as f32
                                + sub.m;
                            let want = dense[r * 512 + blk * bv + i * QK + k];
                            let terms = (sub.d
                                * (sub.sc[k / 16] * (i32::from(sub.u[k]) - f.offset)) as f32)
                                .abs()
                                + sub.m.abs();
                            assert!(
                                (v - want).abs() <= 1e-6 * terms + 1e-12,
                                "{format:?} row {r} block {blk} sub {i} value {k}: {v} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_quantizes_activations_as_the_plain_rule() {
        // Ties (x / d = k + 0.5 exactly: the block's maximum is 127, so d = 1), values
        // next to them, zeros, signed zeros, a NaN and an infinity.
        let mut x = vec![127.0f32, -0.5, 0.5, 2.5, -2.5, 126.5, -126.5, 0.0, -0.0];
        x.extend([
            1.4999999, -1.4999999, 1.5000001, 63.5, -63.5, 0.49999997, 3.0,
        ]);
        x.extend((0..16).map(|i| i as f32 * 7.25 - 50.0));
        x.extend([1e-30, -3e-31, f32::NAN, 2.0]);
        x.extend((0..28).map(|i| (i as f32 * 0.37).sin()));
        x.extend([f32::INFINITY, 1.0, -1.0, 0.25]);
        x.extend((0..28).map(|i| (i as f32 * 1.37).cos() * 1e3));
        let mut rng = StdRng::seed_from_u64(8);
        x.extend((0..64 * 32).map(|_| rng.random_range(-3.0f32..3.0)));
        let rows = x.len() / 256;
        x.truncate(rows * 256);
        // Runs of one block (the 32-value formats) and of eight (the K-quants).
        for run in [1, 8] {
            let want = QuantizedRows::new(&x, rows, 256, run);
            for path in paths() {
                let got = QuantizedRows::new_on(path, &x, rows, 256, run);
                assert_eq!(got.q, want.q, "{path:?} {run}");
                assert_eq!(got.sum16, want.sum16, "{path:?} {run}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.d), bits(&want.d), "{path:?} {run}");
                assert_eq!(bits(&got.sx), bits(&want.sx), "{path:?} {run}");
            }
            // A run's blocks share its scale.
            assert!(
                want.d
                    .chunks(run)
                    .all(|r| r.iter().all(|d| d.to_bits() == r[0].to_bits()))
            );
        }
    }

    #[test]
    fn every_path_gives_the_reference_bits() {
        for format in QuantFormat::ALL {
            // 37 outputs: two full panels and a partial one.
            let (n_out, n_in) = (37, 512);
            let w = random_matrix(format, n_out, n_in, 17);
            let mut rng = StdRng::seed_from_u64(4);
            for rows in [1, 3, 4, 5, 9] {
                let x: Vec<f32> = (0..rows * n_in)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                for path in paths() {
                    let got = matmul_transposed_int8_on(path, &x, rows, &w).unwrap();
                    for r in 0..rows {
                        for j in 0..n_out {
                            let want = int8_reference(
                                format,
                                &w.row_ggml_bytes(j).unwrap(),
                                &x[r * n_in..(r + 1) * n_in],
                            );
                            assert_eq!(
                                got[r * n_out + j].to_bits(),
                                want.to_bits(),
                                "{format:?} {path:?} rows {rows} ({r}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_is_bitwise_the_same_alone_and_in_any_batch() {
        for format in QuantFormat::ALL {
            let w = random_matrix(format, 50, 256, 3);
            let mut rng = StdRng::seed_from_u64(9);
            let x: Vec<f32> = (0..7 * 256)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            for path in paths() {
                let batch = matmul_transposed_int8_on(path, &x, 7, &w).unwrap();
                for r in 0..7 {
                    let alone =
                        matmul_transposed_int8_on(path, &x[r * 256..(r + 1) * 256], 1, &w).unwrap();
                    assert_eq!(alone, batch[r * 50..(r + 1) * 50], "{format:?} {path:?}");
                }
            }
        }
    }

    #[test]
    fn fast_is_close_to_exact() {
        // 8-bit activations: about 1% of the products' scale at worst.
        for format in QuantFormat::ALL {
            let (n_out, n_in) = (9, 1024);
            let w = random_matrix(format, n_out, n_in, 11);
            let dense = w.dequantize().unwrap();
            let mut rng = StdRng::seed_from_u64(2);
            let x: Vec<f32> = (0..n_in).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let got = matmul_transposed_int8_on(SimdPath::Portable, &x, 1, &w).unwrap();
            for j in 0..n_out {
                let (mut exact, mut scale) = (0f64, 0f64);
                for i in 0..n_in {
                    let p = f64::from(dense[j * n_in + i]) * f64::from(x[i]);
                    exact += p;
                    scale += p.abs();
                }
                let err = (f64::from(got[j]) - exact).abs();
                assert!(err <= 1e-2 * scale, "{format:?} {j}: {err} of {scale}");
            }
        }
    }
}
