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
//! `dw` (one per run) and, for the formats with a minimum, a float `m` (the format's integer
//! form, one row per format in `crate::quant`'s table). Output `(r, c)` is then, over the row's sub-blocks `s`
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

//!
//! **Where.** The formats' integer forms are theirs, in [`crate::quant`] (`int_form.rs`);
//! here: the driver, the panel and the portable tile (this file), the activations'
//! quantizer (`activations.rs`), the x86-64 kernels (`x86.rs`) and the plain reference
//! (`reference.rs`). Which path runs is `cpu.rs`'s to say.

mod activations;
mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use super::cpu::has_integer_kernels;
pub use reference::int8_reference;

use super::cpu::{SimdPath, on_simd_path};
use super::matrix::{GROUP_ROWS, QuantMatrix};
use super::tiling::Columns;
use crate::error::{LlamaError, Result};
use crate::quant::{IntForm, QuantFormat};
use activations::QuantizedRows;

/// Values per activation block and per weight sub-block.
pub(crate) use crate::quant::int_form::QK;

/// Weight rows (outputs) per panel: one 16-lane vector of results.
pub(crate) const LANES: usize = 16;

/// Activation rows per register tile.
const ROW_TILE: usize = 8;

/// Activation rows per tile of the in-register group kernels (`x86.rs`).
const GROUP_TILE: usize = 8;

/// Activation rows per tile of the AVX2 panel kernel (`x86.rs`): each holds 16-bit and
/// 32-bit sums for sixteen lanes in registers, of which AVX2 has sixteen. Two and three
/// measured best on a Zen 3 machine (one and four slower).
#[cfg(target_arch = "x86_64")]
const AVX2_TILE: usize = 3;

/// Sub-blocks per pass of the AVX2 panel kernel over a panel: about 12 KiB of it, which
/// stays in the first-level cache while every row's tile reads it.
#[cfg(target_arch = "x86_64")]
const AVX2_PASS: usize = 16;

/// One activation row's partial results against a panel's sixteen rows, carried between
/// the AVX2 panel kernel's passes: the float sums and the current run's integer sums.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Default)]
pub(crate) struct RowSums {
    acc: [f32; LANES],
    iacc: [i32; LANES],
}

/// Sixteen weight rows in their integer form, sub-block by sub-block: `u[(s * 8 + t) *
/// 16 + lane]` holds values `4t .. 4t + 4` of sub-block `s` of row `lane` as one little-
/// endian word; `sc`, `d` and `m` hold each lane's scales (`sc` per half).
#[derive(Default)]
pub(crate) struct Panel {
    u: Lines,
    sc: Vec<i32>,
    d: Vec<f32>,
    m: Vec<f32>,
    /// The AMX kernel's words, decoded by `x86::fill_amx` (instead of `u`): the signed words
    /// `u - offset` (in the first), or for the formats with integer scales the words
    /// times each digit of their scale (two or three).
    #[cfg(target_arch = "x86_64")]
    amx: [Lines; 3],
}

/// A 64-byte line of the caches.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(in crate::kernels::int8) struct Line([u8; 64]);

/// Bytes on whole 64-byte lines, for what vectors and tiles load: a load must not straddle
/// two lines (AMX tile loads of 64-byte rows 16 bytes off a line's start, as a plain
/// vector's allocation is, took 3.3 times as long, measured in C on that kernel's loads;
/// the VNNI kernel's 16-lane loads of a panel's words gained 1-10% on lines). Read as
/// bytes (the AMX words) or as `u32` words (the panel's `u`).
#[derive(Default)]
pub(in crate::kernels::int8) struct Lines(Vec<Line>);

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Lines {
    /// `bytes` bytes (rounded up to whole lines), every one zero.
    fn zeroed(&mut self, bytes: usize) {
        self.0.clear();
        self.sized(bytes);
    }

    /// `bytes` bytes (rounded up to whole lines), left as they were where they were
    /// already there (zeros where new): for a caller that writes every one.
    fn sized(&mut self, bytes: usize) {
        self.0.resize(bytes.div_ceil(64), Line([0; 64]));
    }

    /// `lines` lines, every byte written by `write` (given them all, not yet written).
    fn written(lines: usize, write: impl FnOnce(&mut [std::mem::MaybeUninit<u8>])) -> Self {
        let fill = |v: &mut [std::mem::MaybeUninit<Line>]| {
            // SAFETY: the lines, 64 bytes each with no padding, seen as bytes not yet
            // written (`MaybeUninit<u8>` has `u8`'s size and alignment).
            write(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 64) });
        };
        // SAFETY: `write` writes every byte of the lines (its contract), and any bytes are
        // a valid `Line`.
        Self(unsafe { crate::kernels::cpu::written(lines, fill) })
    }

    /// The bytes.
    fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 bytes with no padding; the lines are contiguous.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 64) }
    }

    /// The bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; any byte value is a valid `u8`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * 64) }
    }

    /// The bytes as `u32` words (sixteen to a line).
    fn words(&self) -> &[u32] {
        // SAFETY: `Line` is 64 bytes with no padding, aligned to 64, so the lines are
        // `len * 16` `u32` in a row; any bits are a valid `u32`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 16) }
    }

    /// The words, to write.
    fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `words`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * 16) }
    }
}

impl Panel {
    /// Decodes rows `first .. first + n` of `w` (`n <= 16`, `first` a multiple of 8);
    /// lanes past `n` hold zeros.
    fn fill(&mut self, w: &QuantMatrix, first: usize, n: usize) {
        let subs = w.cols() / QK;
        self.u.zeroed(subs * 8 * LANES * 4);
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
        let mut decoded = [crate::quant::int_form::Sub::default(); 8];
        for g in (0..n).step_by(GROUP_ROWS) {
            w.for_group_blocks(first + g, n - g, |c, b, head, values| {
                block[..hb].copy_from_slice(head);
                block[hb..bb].copy_from_slice(values);
                (format.spec().int_decode)(&block[..bb], &mut decoded);
                let lane = g + c;
                for (i, sub) in decoded.iter().take(per_block).enumerate() {
                    let s = b * per_block + i;
                    for (t, word) in sub.u.chunks_exact(4).enumerate() {
                        self.u.words_mut()[(s * 8 + t) * LANES + lane] =
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
    let mut out = Vec::new();
    matmul_transposed_int8_into(path, x, rows, w, &mut out)?;
    Ok(out)
}

/// [`matmul_transposed_int8_on`] into `out`, whose old values are dropped and whose
/// allocation is reused where it is large enough (a caller's scratch buffer).
///
/// # Errors
///
/// As [`matmul_transposed_int8_on`]; `out` is then empty.
pub fn matmul_transposed_int8_into(
    path: SimdPath,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    out: &mut Vec<f32>,
) -> Result<()> {
    let uses = Extensions::of(path, rows, w.format());
    matmul_int8_into(path, uses, x, rows, w, out)
}

/// The instruction-set extensions a product may take beyond its path's base (each also
/// checked against the CPU where it is used; the results are the same bits with or
/// without each).
#[derive(Debug, Clone, Copy, Default)]
struct Extensions {
    /// The AMX tile kernel for each sixteen rows (see [`amx_from_rows`]).
    amx: bool,
    /// GFNI's bit matrices in the VNNI kernels' Q6_K decoding.
    gfni: bool,
    /// AVX-VNNI's 256-bit `vpdpbusd` in the AVX2 kernels.
    avx_vnni: bool,
}

impl Extensions {
    /// What a product of `rows` rows of `format`'s weights takes on `path`: each extension
    /// the path has, AMX from [`amx_from_rows`].
    fn of(path: SimdPath, rows: usize, format: QuantFormat) -> Self {
        Self {
            amx: path.has_amx() && rows >= amx_from_rows(format),
            gfni: path.has_gfni(),
            avx_vnni: path.has_avx_vnni(),
        }
    }
}

/// Activation rows from which a product of `format` takes the AMX kernel where the CPU
/// has it: its per-panel work (decoding into the words times the scales' digits, a tile
/// configuration per thread's share) pays back over more rows where a panel has more
/// digits. On a 2-core Intel Xeon with AMX (`cargo bench --bench kernels --
/// real_sizes/1b`, the 1B shape's `ffn_up`, the same binary with `LLAMA_BURN_AMX=off` and
/// on, two rounds, 2026-12-06), AMX against the VNNI kernel: at 16 rows (one group) Q4_0
/// 1.26-1.29x, Q4_1 1.31x, Q5_0 1.39x, Q5_1 1.36x, Q8_0 1.33x, Q4_K 1.21-1.27x, Q5_K
/// 1.26-1.29x, Q3_K 1.08x, but Q6_K (three digits) 0.92-0.96x; at 20 rows (two groups, the
/// second padded) every format but Q6_K 1.06-1.19x, Q6_K 0.94x; at 24 rows Q6_K
/// 1.04-1.05x, at 28 1.12-1.14x, at 32 1.17-1.19x.
const fn amx_from_rows(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q6_K => 24,
        _ => 16,
    }
}

/// [`matmul_int8_into`] returning its output, for the tests.
#[cfg(test)]
fn matmul_int8(
    path: SimdPath,
    uses: Extensions,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    matmul_int8_into(path, uses, x, rows, w, &mut out)?;
    Ok(out)
}

/// [`matmul_transposed_int8_into`] with each of [`Extensions`] on or off (`amx` only
/// where the path [has](SimdPath::has_amx) it, or where `amx_granted` says the CPU runs
/// it: the tests run both, from sixteen rows, whatever `LLAMA_BURN_AMX` says; the same
/// for GFNI and AVX-VNNI).
fn matmul_int8_into(
    path: SimdPath,
    uses: Extensions,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    out: &mut Vec<f32>,
) -> Result<()> {
    out.clear();
    let acts = FastRows::quantize(path, x, rows, w.cols(), w.format().int_form().run)?;
    acts.product_with(uses, w, out)
}

/// Activation rows quantized once for the `fast` products that read them (a layer's
/// queries, keys and values; its gate and up), in runs of one length: each product of a
/// matrix whose formats quantize in runs of that length reads them as they are, and the
/// AMX kernel's layout of them is made once, by the first product that takes it.
pub(crate) struct FastRows {
    /// The path every product runs on.
    path: SimdPath,
    /// Activation rows.
    rows: usize,
    /// 32-value blocks per run of one scale.
    run: usize,
    /// The quantized rows.
    acts: QuantizedRows,
    /// The rows laid out for the AMX kernel, once a product has taken it.
    #[cfg(target_arch = "x86_64")]
    tiled: std::cell::OnceCell<x86::Tiled>,
}

impl FastRows {
    /// `rows` rows of `x` (`n_in` values each) quantized for products on `path` whose
    /// matrices quantize their activations in runs of `run` blocks
    /// ([`IntForm::run`](crate::quant::IntForm)).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `x` is not `rows` rows of `n_in` values or
    /// `n_in` not whole runs, and [`LlamaError::InvalidParameter`] if this CPU cannot run
    /// `path`.
    pub(crate) fn quantize(
        path: SimdPath,
        x: &[f32],
        rows: usize,
        n_in: usize,
        run: usize,
    ) -> Result<Self> {
        Self::check(path, x.len(), rows, n_in, run)?;
        Ok(Self::made(
            path,
            rows,
            run,
            QuantizedRows::new_on(path, x, rows, n_in, run),
        ))
    }

    /// [`quantize`](Self::quantize) of `rms_norm(x, weight, eps)` (the bits of
    /// [`activation::rms_norm`](crate::kernels::activation::rms_norm)), without the
    /// normalized rows in memory: each row normalized where it is quantized.
    ///
    /// # Errors
    ///
    /// As [`quantize`](Self::quantize), with `n_in` the width of `weight`.
    pub(crate) fn normed(
        path: SimdPath,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        rows: usize,
        run: usize,
    ) -> Result<Self> {
        Self::check(path, x.len(), rows, weight.len(), run)?;
        let acts = QuantizedRows::normed_on(path, x, weight, eps, rows, run);
        Ok(Self::made(path, rows, run, acts))
    }

    /// The checks of [`quantize`](Self::quantize) for `len` values.
    fn check(path: SimdPath, len: usize, rows: usize, n_in: usize, run: usize) -> Result<()> {
        if Some(len) != rows.checked_mul(n_in) || !n_in.is_multiple_of(QK * run.max(1)) {
            return Err(LlamaError::ShapeMismatch {
                name: "quantized matmul input".into(),
                expected: vec![rows, n_in],
                actual: vec![len],
            });
        }
        if !path.is_supported() {
            return Err(LlamaError::invalid(
                "simd path",
                path.name(),
                "not supported by this CPU",
            ));
        }
        Ok(())
    }

    /// The rows `acts`, quantized in runs of `run` blocks, for products on `path`.
    fn made(path: SimdPath, rows: usize, run: usize, acts: QuantizedRows) -> Self {
        Self {
            path,
            rows,
            run: run.max(1),
            acts,
            #[cfg(target_arch = "x86_64")]
            tiled: std::cell::OnceCell::new(),
        }
    }

    /// Whether `w`'s products read these rows: its inputs are their values and its
    /// format quantizes activations in runs of their length.
    pub(crate) fn takes(&self, w: &QuantMatrix) -> bool {
        w.cols() == self.acts.n_in && w.format().int_form().run.max(1) == self.run
    }

    /// `rows @ w^T` (`[rows, w.rows()]`) into `out`, whose old values are dropped and
    /// whose allocation is reused where it is large enough.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] unless [`takes`](Self::takes) `w`.
    pub(crate) fn product_into(&self, w: &QuantMatrix, out: &mut Vec<f32>) -> Result<()> {
        self.product_with(Extensions::of(self.path, self.rows, w.format()), w, out)
    }

    /// `rows @ [a | b]^T`: each row's outputs of `a` then of `b` (`[rows, a.rows() +
    /// b.rows()]`), each the bits of [`product_into`](Self::product_into).
    ///
    /// # Errors
    ///
    /// As [`product_into`](Self::product_into), for either matrix.
    pub(crate) fn products_beside(&self, a: &QuantMatrix, b: &QuantMatrix) -> Result<Vec<f32>> {
        self.check_takes(a)?;
        self.check_takes(b)?;
        let width = a.rows() + b.rows();
        let mut out = Vec::with_capacity(self.rows * width);
        #[cfg(test)]
        out.spare_capacity_mut()
            .fill(std::mem::MaybeUninit::new(f32::NAN));
        let uses = |w: &QuantMatrix| Extensions::of(self.path, self.rows, w.format());
        let left = Columns::spare(&mut out, width);
        let right = Columns {
            // SAFETY: `a.rows() <= width`: inside the reserved capacity.
            out: unsafe { left.out.add(a.rows()) },
            n_out: width,
        };
        // SAFETY: `out` holds `rows * width` values; the products write columns `0 ..
        // a.rows()` and `a.rows() .. width` of every row.
        unsafe {
            self.product_columns(uses(a), a, &left);
            self.product_columns(uses(b), b, &right);
            out.set_len(self.rows * width);
        }
        Ok(out)
    }

    /// [`LlamaError::ShapeMismatch`] unless [`takes`](Self::takes) `w`.
    fn check_takes(&self, w: &QuantMatrix) -> Result<()> {
        if self.takes(w) {
            return Ok(());
        }
        Err(LlamaError::ShapeMismatch {
            name: "quantized matmul input".into(),
            expected: vec![w.cols(), w.format().int_form().run.max(1)],
            actual: vec![self.acts.n_in, self.run],
        })
    }

    /// [`product_into`](Self::product_into) with `uses`.
    fn product_with(&self, uses: Extensions, w: &QuantMatrix, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        self.check_takes(w)?;
        let (rows, n_out) = (self.rows, w.rows());
        out.reserve(rows * n_out);
        // In the unit tests the spare capacity starts as NaN: a value no kernel wrote shows
        // (a freed buffer of an earlier path's call, reused, would hold the right bits).
        #[cfg(test)]
        out.spare_capacity_mut()
            .fill(std::mem::MaybeUninit::new(f32::NAN));
        let target = Columns::spare(out, n_out);
        // SAFETY: the capacity holds `rows * n_out` values, all written by the product.
        unsafe {
            self.product_columns(uses, w, &target);
            out.set_len(rows * n_out);
        }
        Ok(())
    }

    /// The product with `w` (which [`takes`](Self::takes) these rows) written into
    /// `target`'s columns `0 .. w.rows()` of rows `0 .. rows`.
    ///
    /// # Safety
    ///
    /// `target` holds those columns of every row, and nothing else reads or writes them
    /// during the call.
    unsafe fn product_columns(&self, uses: Extensions, w: &QuantMatrix, target: &Columns) {
        let (path, rows, acts) = (self.path, self.rows, &self.acts);
        let n_out = w.rows();
        if rows == 0 || n_out == 0 {
            return;
        }
        let threads = rayon::current_num_threads().max(1);
        // Chunks of whole panels (16 outputs), guided: large first, small last.
        let bounds = super::tiling::guided_chunks(n_out.div_ceil(LANES), threads, 2);
        let Extensions {
            amx,
            gfni,
            avx_vnni,
        } = uses;
        let vnni = path.has_vnni();
        let gfni = gfni && vnni && path.has_gfni();
        let in_registers = vnni;
        let avx2_registers = !vnni && path.has_avx2_integer();
        // `avx_vnni_supported` implies `avx2_registers` (the AVX2 integer path, no VNNI).
        let avx_vnni = avx_vnni && super::cpu::avx_vnni_supported(path);
        // More rows than a group tile: decoded once into the panel, reused for every row
        // (by the AVX-VNNI panel kernel where the CPU has it, else AVX2's).
        let avx2_family_panel = avx2_registers && rows > GROUP_TILE;
        let avx_vnni_panel = avx2_family_panel && avx_vnni;
        let avx2_panel = avx2_family_panel && !avx_vnni;
        // Sixteen rows or more, where the CPU has AMX: the tile kernel takes every row, in
        // groups of sixteen, the last one padded with rows of zeros (whose results are
        // dropped). A remainder on the VNNI kernel would need the panel decoded for it too;
        // 150 rows ran faster padded (one group more of the tile unit) than as nine groups
        // and six rows of VNNI.
        #[cfg(target_arch = "x86_64")]
        let amx = amx && vnni && rows >= x86::AMX_ROWS;
        #[cfg(not(target_arch = "x86_64"))]
        let _ = amx;
        // The AMX layout of the rows, made by the first product that takes it: every
        // matrix these rows take has their run length, and so the first one's tile width
        // (runs of one block are the formats without an integer scale, whose tiles are
        // one sub-block wide; runs of eight those with, two sub-blocks: the AMX kernels
        // assert both).
        #[cfg(target_arch = "x86_64")]
        let tiled = if amx {
            self.tiled.get_or_init(|| x86::tiled_rows(acts, w.format()))
        } else {
            &x86::Tiled::default()
        };
        super::pool::for_each_chunk(bounds.len() - 1, &|chunk| {
            let (start, end) = (
                bounds[chunk] * LANES,
                (bounds[chunk + 1] * LANES).min(n_out),
            );
            // SAFETY: `amx` says this CPU has AMX and the kernel granted the tile data
            // (`SimdPath::has_amx`, or the tests' `amx_granted`); the tiles are released
            // when this chunk's work ends.
            #[cfg(target_arch = "x86_64")]
            let _tiles = amx.then(|| unsafe { x86::Tiles::start(w.format()) });
            // One tile's results (of a panel, of a group), made once per chunk: each kernel
            // writes rows `0..tile` of it, and only those are read. Zeroed per tile (a
            // 512-byte `memset` call for every eight rows of every panel) it took 4% of a
            // 128-row product's samples.
            let mut res = [[0f32; LANES]; ROW_TILE];
            #[cfg(target_arch = "x86_64")]
            let mut group_res = [[0f32; GROUP_ROWS]; GROUP_TILE];
            PANEL.with_borrow_mut(|panel| {
                // The second panel of a pair, taken with the first.
                #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
                let mut paired = usize::MAX;
                for first in (start..end).step_by(LANES) {
                    if first == paired {
                        continue;
                    }
                    let n = LANES.min(end - first);
                    #[cfg(target_arch = "x86_64")]
                    if n == LANES && (in_registers || avx2_registers) && rows <= GROUP_TILE {
                        // Each group decoded in registers and multiplied at once, for few
                        // rows.
                        for g in [first, first + GROUP_ROWS] {
                            let group = w.group(g).0;
                            for r in (0..rows).step_by(GROUP_TILE) {
                                let tile = GROUP_TILE.min(rows - r);
                                // SAFETY: `in_registers` (`avx2_registers`) says this CPU
                                // has AVX-512 with VNNI (AVX2, FMA and F16C) and the format
                                // is one `group_tile` reads; the group is full (8 rows of
                                // `w.cols()` values) and `r + tile <= rows`.
                                unsafe {
                                    if in_registers {
                                        x86::group_tile_vnni(
                                            w.format(),
                                            gfni,
                                            group,
                                            acts,
                                            r,
                                            tile,
                                            &mut group_res,
                                        )
                                    } else if avx_vnni {
                                        x86::group_tile_avx_vnni(
                                            w.format(),
                                            group,
                                            acts,
                                            r,
                                            tile,
                                            &mut group_res,
                                        )
                                    } else {
                                        x86::group_tile_avx2(
                                            w.format(),
                                            group,
                                            acts,
                                            r,
                                            tile,
                                            &mut group_res,
                                        )
                                    }
                                };
                                for (i, row) in group_res.iter().take(tile).enumerate() {
                                    // SAFETY: row `r + i < rows`; columns `g .. g + 8` lie in
                                    // this chunk's `start..end`, which no other chunk writes.
                                    unsafe { target.write(r + i, g, row) };
                                }
                            }
                        }
                        continue;
                    }
                    // The AMX kernel, on a full panel: decoded straight into its words, and
                    // every row multiplied.
                    #[cfg(target_arch = "x86_64")]
                    if amx && n == LANES {
                        // SAFETY: `amx` says this CPU has AVX-512 with VNNI (and AMX),
                        // `gfni` that it has GFNI; `first` starts two full groups.
                        unsafe { x86::fill_amx(panel, w, first, gfni) };
                        let out = x86::Dest {
                            target,
                            rows,
                            first,
                        };
                        // The next panel's weights, a share per run of the tile unit.
                        let next = (first + LANES < end).then(|| w.panel_bytes(first + LANES));
                        // SAFETY: as above (AMX, AVX-512 with VNNI); this thread's tiles are
                        // configured for the format; the panel's AMX words are made; `tiled`
                        // was built from `acts`; `target` holds `rows` rows, and columns
                        // `first .. first + 16` lie in this chunk's `start..end`, which no
                        // other chunk writes.
                        unsafe { x86::amx_panel(panel, w.format(), tiled, &out, next) };
                        continue;
                    }
                    // Two full panels at once on AVX-512 with VNNI (each activation word
                    // broadcast once for both); the second is then passed over.
                    #[cfg(target_arch = "x86_64")]
                    if in_registers && !amx && rows > GROUP_TILE && first + 2 * LANES <= end {
                        PAIR.with_borrow_mut(|second| {
                            let next = [2, 3].map(|k| {
                                (first + k * LANES < end).then(|| w.panel_bytes(first + k * LANES))
                            });
                            // SAFETY: `in_registers` says this CPU has AVX-512 with VNNI, and
                            // `gfni` GFNI; `first` and `first + 16` start two full groups
                            // each (`first + 32 <= end`); the rows were built for `w`;
                            // `target` holds `rows` rows of `n_out` columns, and `first ..
                            // first + 32` lie in this chunk's `start..end`, which no other
                            // chunk writes.
                            unsafe {
                                panel.fill_in_registers(w, first, gfni);
                                second.fill_in_registers(w, first + LANES, gfni);
                                x86::vnni_panel_pair(
                                    [panel, second],
                                    w.format(),
                                    acts,
                                    rows,
                                    target,
                                    first,
                                    next,
                                )
                            }
                        });
                        paired = first + LANES;
                        continue;
                    }
                    // More rows: decoded once into the panel, reused for every row.
                    #[cfg(target_arch = "x86_64")]
                    if avx2_family_panel && n == LANES {
                        // SAFETY: `avx2_family_panel` says this CPU has AVX2, FMA and F16C;
                        // `first` starts two full groups.
                        unsafe { panel.fill_in_registers_avx2(w, first) };
                    } else if in_registers && n == LANES {
                        // SAFETY: as above (AVX-512 with VNNI), and `gfni` says the CPU has
                        // GFNI.
                        unsafe { panel.fill_in_registers(w, first, gfni) };
                    } else {
                        panel.fill(w, first, n);
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    panel.fill(w, first, n);
                    #[cfg(target_arch = "x86_64")]
                    if avx2_panel {
                        SUMS.with_borrow_mut(|sums| {
                            sums.clear();
                            sums.resize(rows, RowSums::default());
                            let subs = w.cols() / QK;
                            for s0 in (0..subs).step_by(AVX2_PASS) {
                                let pass = s0..(s0 + AVX2_PASS).min(subs);
                                for (t, tile) in sums.chunks_mut(AVX2_TILE).enumerate() {
                                    // SAFETY: as above; the panel and the rows come from `w`,
                                    // rows `t * AVX2_TILE ..` + `tile.len()` exist and the
                                    // pass lies within their sub-blocks.
                                    unsafe {
                                        x86::avx2_panel_tile(
                                            panel,
                                            w.format(),
                                            acts,
                                            t * AVX2_TILE,
                                            pass.clone(),
                                            tile,
                                        )
                                    };
                                }
                            }
                            for (r, row) in sums.iter().enumerate() {
                                // SAFETY: row `r < rows`; columns `first .. first + n` lie in
                                // this chunk's `start..end`, which no other chunk writes.
                                unsafe { target.write(r, first, &row.acc[..n]) };
                            }
                        });
                        continue;
                    }
                    // The next panel's weights, a share per row tile.
                    let next = (first + LANES < end).then(|| w.panel_bytes(first + LANES));
                    #[cfg(target_arch = "x86_64")]
                    if avx_vnni_panel {
                        // SAFETY: `avx_vnni_panel` says this CPU has AVX2, AVX-VNNI, FMA and
                        // F16C; the panel and the rows were built for `w`; `target` holds
                        // `rows` rows of `n_out` columns, and `first .. first + n` lie in this
                        // chunk's `start..end`, which no other chunk writes.
                        unsafe {
                            x86::avx_vnni_panel(
                                panel,
                                w.format(),
                                acts,
                                rows,
                                target,
                                first,
                                n,
                                next,
                            )
                        };
                        continue;
                    }
                    #[cfg(target_arch = "x86_64")]
                    if vnni {
                        // SAFETY: `vnni` says this CPU has AVX-512 with VNNI; the panel and
                        // the rows were built for `w`; `target` holds `rows` rows of `n_out`
                        // columns, and `first .. first + n` lie in this chunk's `start..end`,
                        // which no other chunk writes.
                        unsafe {
                            x86::vnni_panel(panel, w.format(), acts, rows, target, first, n, next)
                        };
                        continue;
                    }
                    let tiles = rows.div_ceil(ROW_TILE);
                    let mut r = 0;
                    while r < rows {
                        let tile = ROW_TILE.min(rows - r);
                        if let Some(next) = next {
                            super::tiling::prefetch_share(next, r / ROW_TILE, tiles);
                        }
                        run_tile(path, panel, w.format(), acts, r, tile, &mut res);
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
        // The chunks cover the panels `0..n_out.div_ceil(16)` (`guided_chunks`), and each
        // branch above wrote its panel's columns of every row `0..rows`: all `rows * n_out`
        // values of the target's columns are written.
    }
}

thread_local! {
    /// Each worker thread's panel, kept between calls.
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
    /// Each worker thread's second panel of a pair (`x86::vnni_panel_pair`).
    #[cfg(target_arch = "x86_64")]
    static PAIR: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
    /// Each worker thread's partial results of the AVX2 panel kernel, kept between calls.
    #[cfg(target_arch = "x86_64")]
    static SUMS: std::cell::RefCell<Vec<RowSums>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Results of activation rows `r0 .. r0 + tile` against the panel's sixteen rows, on
/// the paths without VNNI (which takes whole panels, `x86::vnni_panel`).
fn run_tile(
    path: SimdPath,
    panel: &Panel,
    format: QuantFormat,
    acts: &QuantizedRows,
    r0: usize,
    tile: usize,
    out: &mut [[f32; LANES]; ROW_TILE],
) {
    let f = format.int_form();
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
                let words = &panel.u.words()[(s * 8 + t) * LANES..][..LANES];
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::{random_matrix, saturated_matrix};
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn paths() -> Vec<SimdPath> {
        SimdPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }

    /// Every kernel this CPU runs: each path with every extension off, the AVX-512 path
    /// with GFNI where the CPU has it, the AVX2 path (and an AVX-512 path without VNNI)
    /// with AVX-VNNI where the CPU has it, and with AMX on where the CPU has it (whatever
    /// `LLAMA_BURN_AMX` and `LLAMA_BURN_AVX_VNNI` say).
    fn kernels() -> Vec<(SimdPath, Extensions)> {
        let none = Extensions::default();
        let mut all: Vec<_> = paths().into_iter().map(|p| (p, none)).collect();
        if SimdPath::Avx512.has_gfni() {
            all.push((SimdPath::Avx512, Extensions { gfni: true, ..none }));
        } else {
            eprintln!("GFNI decoding not tested: this CPU lacks GFNI or AVX-512 VNNI");
        }
        let avx_vnni: Vec<_> = paths()
            .into_iter()
            .filter(|&p| crate::kernels::cpu::avx_vnni_supported(p))
            .collect();
        if avx_vnni.is_empty() {
            eprintln!("AVX-VNNI kernels not tested: this CPU lacks AVX-VNNI");
        }
        for path in avx_vnni {
            all.push((
                path,
                Extensions {
                    avx_vnni: true,
                    ..none
                },
            ));
        }
        if amx_here() {
            all.push((SimdPath::Avx512, Extensions { amx: true, ..none }));
        }
        all
    }

    /// Whether this CPU runs the AMX kernel; where it does not, says so.
    fn amx_here() -> bool {
        let here = SimdPath::Avx512.has_vnni() && crate::kernels::cpu::amx_granted();
        if !here {
            eprintln!(
                "AMX kernel not tested: this CPU lacks AMX-INT8 or AVX-512 VNNI, or the \
                 kernel did not grant the tile data"
            );
        }
        here
    }

    #[test]
    fn the_integer_form_gives_the_dequantized_values() {
        // sc * d * (u - offset) + m is the loader's value, to f32 rounding.
        for format in QuantFormat::ALL {
            let w = random_matrix(format, 3, 512, 5);
            let dense = w.dequantize().unwrap();
            let f = format.int_form();
            let mut subs = [crate::quant::int_form::Sub::default(); 8];
            for r in 0..3 {
                let bytes = w.row_ggml_bytes(r).unwrap();
                let bv = format.block_values();
                for (blk, b) in bytes.chunks_exact(format.block_bytes()).enumerate() {
                    (format.spec().int_decode)(b, &mut subs);
                    for (i, sub) in subs.iter().take(bv / QK).enumerate() {
                        // The table's bound, which AVX2's 16-bit sums rely on; and
                        // `dot4` takes values below 64 (its pairs of byte products
                        // saturate at 32767): Q8_0 is multiplied signed there.
                        let top = sub.u.iter().max().copied().unwrap_or(0);
                        assert!(i32::from(top) <= f.max, "{format:?}: u = {top}");
                        assert!(
                            format == QuantFormat::Q8_0 || top < 64,
                            "{format:?}: u = {top}"
                        );
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
            // 37 outputs: two full panels and a partial one. Rows of 96 values too for
            // the 32-value formats: three sub-blocks, an odd count of the AMX kernel's
            // products.
            let n_out = 37;
            let widths: &[usize] = if format.int_form().run == 1 {
                &[512, 96]
            } else {
                &[512]
            };
            for &n_in in widths {
                let w = random_matrix(format, n_out, n_in, 17);
                let mut rng = StdRng::seed_from_u64(4);
                // 16, 17 and 35: the AMX kernel's groups of sixteen rows, and its last
                // group padded.
                for rows in [1, 3, 4, 5, 9, 10, 11, 16, 17, 35] {
                    let x: Vec<f32> = (0..rows * n_in)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect();
                    for (path, uses) in kernels() {
                        let got = matmul_int8(path, uses, &x, rows, &w).unwrap();
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
                                    "{format:?} {path:?} {uses:?} n_in {n_in} rows {rows} ({r}, {j})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_largest_values_sum_exactly_on_every_path() {
        // Every weight at its format's largest value (0xFF bytes; Q8_0 also at -128)
        // against activations at +-127 throughout: the sums that AVX2 keeps in 16 bits
        // at their worst case, which would wrap or saturate if a bound were wrong.
        for format in QuantFormat::ALL {
            let bytes: &[u8] = if format == QuantFormat::Q8_0 {
                &[0xFF, 0x80, 0x7F]
            } else {
                &[0xFF]
            };
            for &byte in bytes {
                let (n_out, n_in) = (32, 512);
                let w = saturated_matrix(format, n_out, n_in, byte);
                let mut x = vec![1.0f32; n_in];
                x.extend(vec![-1.0f32; n_in]);
                // Blocks of either sign (two positive to one negative: a nonzero result).
                x.extend((0..n_in).map(|i| if i % 96 < 64 { 1.0 } else { -1.0 }));
                // Three rows, and the three six times over: a batch of more rows than
                // a group tile takes the panel kernels (and, of sixteen or more, the
                // AMX kernel where the CPU has it).
                let many = x.repeat(6);
                for (path, uses) in kernels() {
                    let got = matmul_int8(path, uses, &x, 3, &w).unwrap();
                    let batch = matmul_int8(path, uses, &many, 18, &w).unwrap();
                    for r in 0..3 {
                        // One row alone takes other tiles than three together.
                        let alone =
                            matmul_transposed_int8_on(path, &x[r * n_in..][..n_in], 1, &w).unwrap();
                        assert_eq!(alone, got[r * n_out..][..n_out], "{format:?} {path:?}");
                        for k in 0..6 {
                            let row = &batch[(3 * k + r) * n_out..][..n_out];
                            assert_eq!(
                                alone,
                                row,
                                "{format:?} {path:?} {uses:?} row {}",
                                3 * k + r
                            );
                        }
                        let want = int8_reference(
                            format,
                            &w.row_ggml_bytes(0).unwrap(),
                            &x[r * n_in..(r + 1) * n_in],
                        );
                        assert!(want.is_finite() && want != 0.0, "{format:?} {want}");
                        for j in 0..n_out {
                            assert_eq!(
                                got[r * n_out + j].to_bits(),
                                want.to_bits(),
                                "{format:?} byte {byte:#x} {path:?} {uses:?} ({r}, {j})"
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
            // 7 rows, and 19: sixteen in an AMX tile where the CPU has it, three after.
            let x: Vec<f32> = (0..19 * 256)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            for (path, uses) in kernels() {
                for rows in [7, 19] {
                    let batch = matmul_int8(path, uses, &x[..rows * 256], rows, &w).unwrap();
                    for r in 0..rows {
                        let alone =
                            matmul_transposed_int8_on(path, &x[r * 256..(r + 1) * 256], 1, &w)
                                .unwrap();
                        assert_eq!(
                            alone,
                            batch[r * 50..(r + 1) * 50],
                            "{format:?} {path:?} {uses:?} rows {rows}"
                        );
                    }
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
