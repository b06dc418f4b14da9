//! `x @ W^T` on the CPU for a [`QuantMatrix`] `W`, in exact f32 arithmetic.
//!
//! Every weight is dequantized exactly as the loader's dequantization gives it (into
//! registers on the AVX-512 path, into f32 scratch rows elsewhere) and multiplied with
//! the f32 activations: no 8-bit activations, so every output is the f32 dot product of
//! the dequantized weights.
//!
//! **One reduction order per path.** Every output element is reduced the same way
//! whatever the number of rows, the tile it falls in or the thread that computes it. On
//! the portable, AVX2 and NEON paths an 8-lane accumulator takes the row's 8-value chunks
//! in order (`acc += w[8k..8k+8] * x[8k..8k+8]`), then `t[l] = acc[l] + acc[l + 4]` and
//! the result is `(t[0] + t[2]) + (t[1] + t[3])`; the AVX-512 path takes 16-value chunks
//! into 16 lanes and first adds `acc[l] + acc[l + 8]`. A request's logits are therefore
//! bitwise the same alone, in any batch, and after any chunking of its prompt. The SIMD
//! paths fuse each multiply-add (one rounding); the portable path rounds the product and
//! the sum separately. AVX2 and NEON give the same bits; the paths otherwise agree to
//! about 1e-6 relative, not to the bit.
//!
//! Work is split across threads by output columns, in whole groups of
//! [`GROUP_ROWS`] weight rows, on the kernels' own pool (`kernels::pool`, helpers that
//! spin between the splits of a step); a group is dequantized once per call and reused
//! for every activation row.

use std::sync::OnceLock;

use super::matrix::{GROUP_ROWS, QuantMatrix};
use super::tiling::{Columns, MAX_TILE_ROWS};
use crate::error::{LlamaError, Result};

/// An instruction-set path of the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdPath {
    /// Plain Rust, on every CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 (F, BW, VL), FMA and F16C: weights decoded in registers,
    /// 16-lane accumulators (its own reduction order, see the module documentation).
    Avx512,
    /// aarch64 with NEON: the AVX2 path's order and bits, in 4-lane registers.
    Neon,
}

impl SimdPath {
    /// Every path, from the plainest to the widest.
    pub const ALL: [SimdPath; 4] = [
        SimdPath::Portable,
        SimdPath::Neon,
        SimdPath::Avx2,
        SimdPath::Avx512,
    ];

    /// The best path this CPU runs, unless `LLAMA_BURN_SIMD` names a lower one
    /// (`portable`, `avx2` or `avx512`; a path this CPU lacks falls back to the best it
    /// has). Read once per process: a CPU with AVX-512 runs the AVX2 path with
    /// `LLAMA_BURN_SIMD=avx2`, as a CPU without it would.
    pub fn active() -> SimdPath {
        static ACTIVE: OnceLock<SimdPath> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = SimdPath::best_supported();
            let asked = std::env::var("LLAMA_BURN_SIMD").ok();
            SimdPath::ALL
                .into_iter()
                .find(|p| Some(p.env_name()) == asked.as_deref())
                .filter(|p| p.is_supported())
                .unwrap_or(best)
        })
    }

    /// The best path this CPU supports.
    pub fn best_supported() -> SimdPath {
        SimdPath::ALL
            .into_iter()
            .rev()
            .find(|p| p.is_supported())
            .unwrap_or(SimdPath::Portable)
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            SimdPath::Portable => true,
            SimdPath::Avx2 => avx2_supported(),
            SimdPath::Avx512 => avx512_supported(),
            SimdPath::Neon => neon_supported(),
        }
    }

    /// The path's name.
    pub fn name(self) -> &'static str {
        match self {
            SimdPath::Portable => "portable",
            SimdPath::Avx2 => "avx2+fma",
            SimdPath::Avx512 => "avx512",
            SimdPath::Neon => "neon",
        }
    }

    /// Whether the path runs the `fast` precision's `vpdpbusd` kernels on this CPU
    /// (the AVX-512 path, where the CPU has VNNI).
    pub(crate) fn has_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == SimdPath::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the path's `vpdpbusd` kernels ([`has_vnni`](Self::has_vnni)) decode Q6_K
    /// with GFNI's bit matrices (the same values, fewer instructions).
    pub(crate) fn has_gfni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.has_vnni() && std::arch::is_x86_feature_detected!("gfni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the path runs the `fast` precision's AMX tile kernel for products of 32
    /// rows or more (prompts, large batches): the AVX-512 path where the CPU has VNNI,
    /// AMX-TILE and AMX-INT8, Linux has granted this process the tile data, and
    /// `LLAMA_BURN_AMX` is not `off` (read once per process; the results are the same
    /// bits either way).
    pub fn has_amx(self) -> bool {
        static ENABLED: OnceLock<bool> = OnceLock::new();
        self.has_vnni()
            && *ENABLED.get_or_init(|| {
                !std::env::var("LLAMA_BURN_AMX").is_ok_and(|v| v == "off") && amx_granted()
            })
    }

    /// Whether the path can run the `fast` precision's AVX2 in-register kernels on
    /// this CPU (the AVX-512 path takes them where the CPU lacks VNNI).
    pub(crate) fn has_avx2_integer(self) -> bool {
        matches!(self, SimdPath::Avx2 | SimdPath::Avx512) && avx2_supported()
    }

    /// Whether the path's AVX2 integer kernels (the `fast` precision's, on the AVX2 path
    /// or on an AVX-512 path without VNNI) multiply with AVX-VNNI's 256-bit `vpdpbusd`
    /// instead of `vpmaddubsw` and `vpmaddwd`: where the CPU has AVX-VNNI (Intel since
    /// Alder Lake, AMD since Zen 5) but the path is not AVX-512 with VNNI, and
    /// `LLAMA_BURN_AVX_VNNI` is not `off` (read once per process; the results are the
    /// same bits either way).
    pub fn has_avx_vnni(self) -> bool {
        static ENABLED: OnceLock<bool> = OnceLock::new();
        avx_vnni_supported(self)
            && *ENABLED
                .get_or_init(|| !std::env::var("LLAMA_BURN_AVX_VNNI").is_ok_and(|v| v == "off"))
    }

    /// The value of `LLAMA_BURN_SIMD` that asks for the path.
    pub fn env_name(self) -> &'static str {
        match self {
            SimdPath::Portable => "portable",
            SimdPath::Avx2 => "avx2",
            SimdPath::Avx512 => "avx512",
            SimdPath::Neon => "neon",
        }
    }
}

/// Whether `path` could multiply with AVX-VNNI on this CPU, whatever `LLAMA_BURN_AVX_VNNI`
/// says ([`SimdPath::has_avx_vnni`] without the setting; the tests run both).
pub(crate) fn avx_vnni_supported(path: SimdPath) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        path.has_avx2_integer()
            && !path.has_vnni()
            && std::arch::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = path;
        false
    }
}

/// Whether the [active](SimdPath::active) path runs the `fast` precision with its own
/// integer kernels (AVX-512 with VNNI, or AVX2 with FMA and F16C), rather than the
/// plain-Rust reference.
pub fn has_integer_kernels() -> bool {
    let path = SimdPath::active();
    path.has_vnni() || path.has_avx2_integer()
}

/// Calls the plain function `$plain($args)` compiled for SIMD path `$path`: a copy with
/// the AVX-512 or AVX2 target features enabled (so the compiler vectorises its loops for
/// that width; `$plain` should be `#[inline(always)]`), or as it is on other paths.
/// `[$generics]` are the copy's generic parameters, when `$plain` has any.
macro_rules! on_simd_path {
    (@copy $features:tt, $plain:ident [$($generics:tt)*] ($($arg:ident: $ty:ty),*)) => {{
        #[target_feature(enable = $features)]
        fn wide<$($generics)*>($($arg: $ty),*) {
            $plain($($arg),*)
        }
        // SAFETY: the path is supported by this CPU (`SimdPath::active`).
        unsafe { wide($($arg),*) }
    }};
    ($path:expr, $plain:ident $([$($generics:tt)*])? ($($arg:ident: $ty:ty),* $(,)?)) => {
        match $path {
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::cpu::SimdPath::Avx512 => $crate::kernels::cpu::on_simd_path!(
                @copy "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
                $plain [$($($generics)*)?] ($($arg: $ty),*)
            ),
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::cpu::SimdPath::Avx2 => $crate::kernels::cpu::on_simd_path!(
                @copy "avx2,fma,f16c",
                $plain [$($($generics)*)?] ($($arg: $ty),*)
            ),
            _ => $plain($($arg),*),
        }
    };
}
pub(crate) use on_simd_path;

/// A place a kernel writes one `T` to: a `T`, or one not yet written. Kernels generic
/// over it write a buffer they fill whole without clearing it first ([`written`]).
pub(crate) trait Slot<T> {
    /// Writes `v`.
    fn set(&mut self, v: T);
}

impl<T> Slot<T> for T {
    #[inline(always)]
    fn set(&mut self, v: T) {
        *self = v;
    }
}

impl<T> Slot<T> for std::mem::MaybeUninit<T> {
    #[inline(always)]
    fn set(&mut self, v: T) {
        self.write(v);
    }
}

/// A vector of `n` values written by `write`, which is given them all, not yet written:
/// no pass that clears them first (a prompt's buffers are megabytes, and clearing them
/// on the calling thread was 5.6% of a 450-token prefill's main thread).
///
/// # Safety
///
/// `write` writes every one of the `n` values.
pub(crate) unsafe fn written<T>(
    n: usize,
    write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    write(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: the caller's contract: the `n` reserved values are written.
    unsafe { v.set_len(n) };
    v
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    avx2_supported()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

/// Whether this CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and
/// Linux grants this process the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`, Linux 5.16 and later; the grant is the process's, every thread's).
/// Asked once per process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) fn amx_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        // SAFETY: CPUID is part of every x86-64 CPU; leaf 7 exists where leaf 0 says so.
        #[allow(unused_unsafe)]
        let edx = unsafe {
            if std::arch::x86_64::__cpuid(0).eax < 7 {
                return false;
            }
            std::arch::x86_64::__cpuid_count(7, 0).edx
        };
        let (tile, int8) = (edx & (1 << 24) != 0, edx & (1 << 25) != 0);
        if !(tile && int8) {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request for a permission; it reads and writes no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    })
}

/// Not on this platform: no AMX.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) fn amx_granted() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn neon_supported() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

#[cfg(not(target_arch = "aarch64"))]
fn neon_supported() -> bool {
    false
}

/// Chunks of output columns per thread in one product.
const CHUNKS_PER_THREAD: usize = 4;

/// Rows of activations per tile on the portable and AVX2 paths.
const ROW_TILE: usize = 4;

/// `x @ W^T` for `x` row-major `[rows, w.cols()]`: returns `[rows, w.rows()]`, on the
/// [active](SimdPath::active) path.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if `x` is not `rows` rows of `w.cols()` values.
pub fn matmul_transposed(x: &[f32], rows: usize, w: &QuantMatrix) -> Result<Vec<f32>> {
    matmul_transposed_on(SimdPath::active(), x, rows, w)
}

/// [`matmul_transposed`] on a given path (tests compare paths with it).
///
/// # Errors
///
/// As [`matmul_transposed`], and [`LlamaError::InvalidParameter`] if this CPU cannot run
/// `path`.
pub fn matmul_transposed_on(
    path: SimdPath,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    matmul_transposed_into_on(path, x, rows, w, &mut out)?;
    Ok(out)
}

/// [`matmul_transposed_on`] into `out`, whose old values are dropped and whose
/// allocation is reused where it is large enough (a caller's scratch buffer).
///
/// # Errors
///
/// As [`matmul_transposed_on`]; `out` is then empty.
pub fn matmul_transposed_into_on(
    path: SimdPath,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    out: &mut Vec<f32>,
) -> Result<()> {
    out.clear();
    let (n_in, n_out) = (w.cols(), w.rows());
    if Some(x.len()) != rows.checked_mul(n_in) {
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
        return Ok(());
    }
    let tiles = Tiles::of(path, rows, w.format());
    let threads = rayon::current_num_threads().max(1);
    // Four chunks of columns per thread, handed out in turn (one atomic add each), so a
    // thread that starts late or is slowed by something else is made up for.
    let per_chunk = n_out
        .div_ceil(threads * CHUNKS_PER_THREAD)
        .next_multiple_of(GROUP_ROWS)
        .max(GROUP_ROWS);
    // Not zeroed first: every element is written once, by the chunk that owns its column.
    out.reserve(rows * n_out);
    let target = Columns {
        out: out.as_mut_ptr(),
        n_out,
    };
    let failure = std::sync::Mutex::new(None);
    super::pool::for_each_run(n_out, per_chunk, &|start, end| {
        if let Err(e) = columns(path, tiles, x, rows, w, start, end, &target) {
            *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    // SAFETY: the chunks cover columns `0..n_out` and each wrote all `rows` rows of its
    // columns (every row tile of every column tile; a failed chunk returned above), so
    // all `rows * n_out` values are initialized.
    unsafe { out.set_len(rows * n_out) };
    Ok(())
}

/// How a path tiles a product of `rows` activation rows.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    /// Weight rows (outputs) per tile, within one group of [`GROUP_ROWS`].
    cols: usize,
    /// Activation rows per tile.
    rows: usize,
    /// Whether weights are multiplied straight from registers (no scratch rows).
    fused: bool,
}

impl Tiles {
    fn of(path: SimdPath, rows: usize, format: crate::quant::QuantFormat) -> Tiles {
        match path {
            // Up to 8 rows: each block decoded in registers and multiplied at once, in
            // tiles of up to 4 rows, a whole group of 8 outputs per tile below 4 rows (4
            // outputs from 4 rows on: 16 accumulators). More rows go through scratch
            // rows, whose tiles `avx512::panel` shapes.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 if rows <= super::avx512::FUSED_UP_TO && format.simd_decoded() => {
                use super::avx512::FUSED_ROWS;
                Tiles {
                    cols: if rows < FUSED_ROWS {
                        GROUP_ROWS
                    } else {
                        GROUP_ROWS / 2
                    },
                    rows: FUSED_ROWS,
                    fused: true,
                }
            }
            // One row of the 32-value formats: each block decoded in registers and
            // multiplied at once, a group of 8 outputs per tile (eight accumulators).
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 if rows == 1 && super::avx2::fuses(format) => Tiles {
                cols: GROUP_ROWS,
                rows: 1,
                fused: true,
            },
            // Scratch rows (the tiles of `row_tiles`; the AVX-512 and AVX2 panel kernels
            // shape their own): 8 weight rows share the activations when one row is
            // decoded (eight independent accumulators), 3 when several rows share each
            // weight row (a 4 x 3 tile: 12 accumulators, 7 loads per 12 multiply-adds).
            _ => Tiles {
                cols: if rows == 1 { GROUP_ROWS } else { 3 },
                rows: ROW_TILE,
                fused: false,
            },
        }
    }
}

/// Bytes of dequantized weight rows a scratch tile pass keeps (a panel of whole groups):
/// a tile's activation rows then stay in L1 across the panel's columns while the
/// panel's weight rows come from L2.
const PANEL_BYTES: usize = 192 * 1024;

/// Values of padding after each scratch row (one 64-byte line), and the scratch rows
/// start on a line. Rows of 2,048 or 8,192 values (a 1B model's) are a multiple of 4 KiB
/// apart without it, so the lines that a tile reads at once from its four weight rows (and
/// six activation rows) all fall in one set of the first-level cache and evict each
/// other; and a vector load from rows not on a line reads two lines. The AVX-512 `exact`
/// product of 128 rows of the 1B `ffn_up` (2-core Intel Xeon with AMX, alternated): 86-93
/// G multiply-adds/s, 106-110 with the padding, 106-111 -> 120-135 with the rows on lines.
const SCRATCH_PAD: usize = 16;

/// Outputs `start..end` of every row, written into `target` (`start` starts a group of
/// the matrix).
#[allow(clippy::too_many_arguments)]
fn columns(
    path: SimdPath,
    tiles: Tiles,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    start: usize,
    end: usize,
    target: &Columns,
) -> Result<()> {
    let n_in = w.cols();
    debug_assert!(end <= target.n_out && x.len() == rows * n_in);
    if tiles.fused {
        for first in (start..end).step_by(GROUP_ROWS) {
            let n = GROUP_ROWS.min(end - first);
            row_tiles(
                tiles,
                x,
                rows,
                n_in,
                first,
                n,
                target,
                |c0, cols, acts, out| {
                    fused_tile(path, w, first, c0, cols, acts, out);
                },
            );
        }
        return Ok(());
    }
    // Scratch rows: a panel of groups is dequantized once, then every row tile runs over
    // all of its columns. Rows are `ws` apart (see `SCRATCH_PAD`).
    let ws = n_in + SCRATCH_PAD;
    let panel_rows = (PANEL_BYTES / (n_in * std::mem::size_of::<f32>())).max(GROUP_ROWS)
        / GROUP_ROWS
        * GROUP_ROWS;
    SCRATCH.with_borrow_mut(|scratch| {
        // A line more than the panel, so that its rows can start on a line.
        let len = panel_rows.min(end - start) * ws + SCRATCH_PAD;
        if scratch.len() < len {
            scratch.resize(len, 0.0);
        }
        let line = scratch.as_ptr().align_offset(64).min(SCRATCH_PAD);
        let scratch = &mut scratch[line..];
        for first in (start..end).step_by(panel_rows) {
            let n = panel_rows.min(end - first);
            for g in (0..n).step_by(GROUP_ROWS) {
                let count = GROUP_ROWS.min(n - g);
                let rows_of_group = &mut scratch[g * ws..(g + count) * ws];
                dequantize_group(path, w, first + g, count, ws, rows_of_group)?;
            }
            scratch_panel(
                path,
                tiles,
                &scratch[..n * ws],
                ws,
                n,
                x,
                rows,
                first,
                target,
            );
        }
        Ok(())
    })
}

/// Outputs `first..first + n` of every row from the `n` dequantized weight rows in
/// `weights` (row `c` at `c * ws`), written into `target`.
#[allow(clippy::too_many_arguments)]
fn scratch_panel(
    path: SimdPath,
    tiles: Tiles,
    weights: &[f32],
    ws: usize,
    n: usize,
    x: &[f32],
    rows: usize,
    first: usize,
    target: &Columns,
) {
    let n_in = x.len() / rows.max(1);
    #[cfg(target_arch = "x86_64")]
    if matches!(path, SimdPath::Avx512 | SimdPath::Avx2) {
        let out = target.out.wrapping_add(first);
        // SAFETY: the path was checked to be supported by this CPU; `weights` holds `n`
        // rows and `x` `rows` rows of `n_in` values, a multiple of 32 (whole blocks);
        // columns `first..first + n` of every row lie in this chunk, which no other chunk
        // writes.
        unsafe {
            if path == SimdPath::Avx512 {
                super::avx512::panel(weights, ws, n, x, rows, n_in, out, target.n_out)
            } else {
                super::avx2::panel(weights, ws, n, x, rows, n_in, out, target.n_out)
            }
        };
        return;
    }
    row_tiles(
        tiles,
        x,
        rows,
        n_in,
        first,
        n,
        target,
        |c0, cols, acts, out| {
            let mut rows_of: [&[f32]; 8] = [&[]; 8];
            for (slot, w) in rows_of
                .iter_mut()
                .zip(weights.chunks(ws).skip(c0).take(cols))
            {
                *slot = &w[..n_in];
            }
            dot_tile(path, &rows_of[..cols], acts, out);
        },
    );
}

thread_local! {
    /// Each worker thread's scratch rows, kept between calls (a panel is at most
    /// [`PANEL_BYTES`], or one group of a very wide matrix).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `tile(c0, cols, acts, out)` over every row tile and column tile of outputs
/// `first..first + n`, and writes each tile's results into `target`. Row tiles outside,
/// column tiles inside: a tile's activation rows are read from L2 once and reused from
/// L1 for the other columns.
#[allow(clippy::too_many_arguments)]
fn row_tiles(
    tiles: Tiles,
    x: &[f32],
    rows: usize,
    n_in: usize,
    first: usize,
    n: usize,
    target: &Columns,
    mut tile: impl FnMut(usize, usize, &[&[f32]], &mut [[f32; 8]; MAX_TILE_ROWS]),
) {
    let mut tile_out = [[0f32; 8]; MAX_TILE_ROWS];
    let mut r = 0;
    while r < rows {
        let tile_rows = tiles.rows.min(rows - r);
        let mut acts: [&[f32]; MAX_TILE_ROWS] = [&[]; MAX_TILE_ROWS];
        for (slot, a) in acts
            .iter_mut()
            .zip(x[r * n_in..(r + tile_rows) * n_in].chunks_exact(n_in))
        {
            *slot = a;
        }
        let acts = &acts[..tile_rows];
        let mut c0 = 0;
        while c0 < n {
            let cols = tiles.cols.min(n - c0);
            tile(c0, cols, acts, &mut tile_out);
            for (i, row_out) in tile_out.iter().take(tile_rows).enumerate() {
                // SAFETY: row `r + i < rows`, columns `first + c0 .. + cols` lie in this
                // chunk's `start..end`, which no other chunk writes.
                unsafe { target.write(r + i, first + c0, &row_out[..cols]) };
            }
            c0 += cols;
        }
        r += tile_rows;
    }
}

/// Dequantizes `count` rows of the group at `first` into `out`, row `c` at `c * stride`,
/// bitwise as the loader does.
fn dequantize_group(
    path: SimdPath,
    w: &QuantMatrix,
    first: usize,
    count: usize,
    stride: usize,
    out: &mut [f32],
) -> Result<()> {
    let n_in = w.cols();
    debug_assert!(stride >= n_in && out.len() >= count * stride);
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 if w.format().simd_decoded() => {
            // SAFETY: the path was checked to be supported by this CPU; `first` starts a
            // group, `count` is at most its rows and `out` holds `count` rows of `stride`.
            unsafe { super::avx2::dequantize_group(w, first, count, stride, out) }
            Ok(())
        }
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 if w.format().simd_decoded() => {
            // SAFETY: as above.
            unsafe { super::avx512::dequantize_group(w, first, count, stride, out) }
            Ok(())
        }
        _ => {
            for (c, dst) in out.chunks_mut(stride).take(count).enumerate() {
                w.dequantize_row(first + c, &mut dst[..n_in])?;
            }
            Ok(())
        }
    }
}

/// `out[r][c] = acts[r] . W[first + c0 + c]` with the weights decoded in registers
/// (paths whose [`Tiles`] are fused).
fn fused_tile(
    path: SimdPath,
    w: &QuantMatrix,
    first: usize,
    c0: usize,
    cols: usize,
    acts: &[&[f32]],
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => {
            // SAFETY: the path was checked to be supported by this CPU; `first` starts a
            // group holding `c0 + cols` rows and every activation row has `w.cols()`
            // values.
            unsafe { super::avx512::fused_tile(w, first, c0, cols, acts, out) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            let mut row = [0f32; 8];
            // SAFETY: the path was checked to be supported by this CPU and its tiles are
            // fused only for one row of a format `fused_row` takes; `first` starts a
            // group holding `c0 + cols` rows and the row has `w.cols()` values.
            unsafe { super::avx2::fused_row(w, first, c0, cols, acts[0], &mut row) };
            out[0] = row;
        }
        _ => {
            let _ = (w, first, c0, cols, acts, out);
            unreachable_fused(path);
        }
    }
}

#[cold]
fn unreachable_fused(path: SimdPath) {
    debug_assert!(false, "{path:?} has no fused tiles");
}

/// `out[r][c] = acts[r] . weights[c]` in the path's reduction order, for up to
/// [`ROW_TILE`] rows and 8 columns.
fn dot_tile(
    path: SimdPath,
    weights: &[&[f32]],
    acts: &[&[f32]],
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    match path {
        #[cfg(target_arch = "aarch64")]
        SimdPath::Neon => {
            // SAFETY: the path was checked to be supported by this CPU; every slice holds
            // the same number of values, a multiple of 32 (whole blocks).
            unsafe { super::neon::dot_tile(weights, acts, out) }
        }
        _ => {
            for (r, a) in acts.iter().enumerate() {
                for (c, w) in weights.iter().enumerate() {
                    out[r][c] = dot_portable(w, a);
                }
            }
        }
    }
}

/// One dot product on `path` in the canonical order (a plain left-to-right sum when the
/// length is not a multiple of 8).
pub(crate) fn dot(path: SimdPath, a: &[f32], b: &[f32]) -> f32 {
    if !a.len().is_multiple_of(8) || a.len() != b.len() {
        return a.iter().zip(b).fold(0.0, |s, (x, y)| s + x * y);
    }
    match path {
        // Attention's dot products are short (a head's dimension): the AVX-512 path
        // computes them as the AVX2 path does.
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 | SimdPath::Avx512 => {
            // SAFETY: the caller holds a supported path (`SimdPath::active` or a checked
            // one); both slices hold the same multiple of 8 values.
            unsafe { super::avx2::dot(a, b) }
        }
        #[cfg(target_arch = "aarch64")]
        SimdPath::Neon => {
            let mut out = [[0f32; 8]; MAX_TILE_ROWS];
            // SAFETY: as above.
            unsafe { super::neon::dot_tile(&[a], &[b], &mut out) };
            out[0][0]
        }
        _ => dot_portable(a, b),
    }
}

/// One dot product in the canonical order, each product and sum rounded separately.
pub(crate) fn dot_portable(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (wc, xc) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += wc[l] * xc[l];
        }
    }
    finish(&acc)
}

/// The largest number in `values` (NaN skipped; `-inf` if there is none), in 16 lanes
/// that the compiler vectorizes (`if v > m` is one vector maximum). A maximum is exact
/// in any order, so this is the plain scan's answer.
#[inline(always)]
pub(crate) fn largest(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = values.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    for (m, &v) in lanes.iter_mut().zip(rest) {
        *m = if v > *m { v } else { *m };
    }
    lanes
        .into_iter()
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// The canonical final sum of the accumulator.
pub(crate) fn finish(acc: &[f32; 8]) -> f32 {
    let t: [f32; 4] = std::array::from_fn(|l| acc[l] + acc[l + 4]);
    (t[0] + t[2]) + (t[1] + t[3])
}

/// One dot product in the canonical order with fused multiply-adds: what the AVX2 path
/// computes, written plainly (for tests).
pub fn dot_fused_reference(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (wc, xc) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = wc[l].mul_add(xc[l], acc[l]);
        }
    }
    finish(&acc)
}

/// One dot product in the AVX-512 path's order: a 16-lane accumulator with fused
/// multiply-adds over 16-value chunks, then `t[l] = acc[l] + acc[l + 8]` finished as the
/// 8-lane order finishes (for tests; the length must be a multiple of 16).
pub fn dot_fused16_reference(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (wc, xc) in w.chunks_exact(16).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = wc[l].mul_add(xc[l], acc[l]);
        }
    }
    finish(&std::array::from_fn(|l| acc[l] + acc[l + 8]))
}

/// The reference dot product of `path`'s reduction order, written plainly (for tests).
pub fn dot_reference_on(path: SimdPath, w: &[f32], x: &[f32]) -> f32 {
    match path {
        SimdPath::Portable => dot_reference(w, x),
        SimdPath::Avx2 | SimdPath::Neon => dot_fused_reference(w, x),
        SimdPath::Avx512 => dot_fused16_reference(w, x),
    }
}

/// One dot product in the canonical order, each product and sum rounded separately:
/// what the portable path computes (for tests).
pub fn dot_reference(w: &[f32], x: &[f32]) -> f32 {
    dot_portable(w, x)
}
