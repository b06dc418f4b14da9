//! `x @ W^T` on the CPU for a [`QuantMatrix`] `W`, in exact f32 arithmetic.
//!
//! Each weight row (one output) is dequantized into an f32 scratch row, exactly as the
//! loader's dequantization gives it, and multiplied with the f32 activations: no 8-bit
//! activations, so every output is the f32 dot product of the dequantized weights.
//!
//! **One reduction order.** Every output element is reduced the same way whatever the
//! number of rows, the tile it falls in or the thread that computes it: an 8-lane
//! accumulator takes the row's 8-value chunks in order (`acc += w[8k..8k+8] *
//! x[8k..8k+8]`), then `t[l] = acc[l] + acc[l + 4]` and the result is
//! `(t[0] + t[2]) + (t[1] + t[3])`. A request's logits are therefore
//! bitwise the same alone, in any batch, and after any chunking of its prompt. The AVX2
//! path fuses each multiply-add (one rounding); the portable path rounds the product and
//! the sum separately, so the two paths agree to about 1e-6 relative, not to the bit.
//!
//! Work is split across threads by output columns; a weight row is dequantized once per
//! call and reused for every activation row.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::quant::QuantMatrix;
use crate::error::{LlamaError, Result};

/// An instruction-set path of the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdPath {
    /// Plain Rust, on every CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
}

impl SimdPath {
    /// The best path this CPU runs, unless `LLAMA_BURN_SIMD=portable` (or `avx2`) asks
    /// for a lower one. Read once per process.
    pub fn active() -> SimdPath {
        static ACTIVE: OnceLock<SimdPath> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = SimdPath::best_supported();
            match std::env::var("LLAMA_BURN_SIMD").ok().as_deref() {
                Some("portable") => SimdPath::Portable,
                _ => best,
            }
        })
    }

    /// The best path this CPU supports.
    pub fn best_supported() -> SimdPath {
        if SimdPath::Avx2.is_supported() {
            SimdPath::Avx2
        } else {
            SimdPath::Portable
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            SimdPath::Portable => true,
            SimdPath::Avx2 => avx2_supported(),
        }
    }

    /// The path's name.
    pub fn name(self) -> &'static str {
        match self {
            SimdPath::Portable => "portable",
            SimdPath::Avx2 => "avx2+fma",
        }
    }
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

/// Rows of activations per tile when several rows are multiplied.
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
        return Ok(Vec::new());
    }
    // Column tiles: 8 weight rows share the activations when one row is decoded (eight
    // independent accumulators), 3 when several rows share each weight row (a 4 x 3
    // tile: 12 accumulators, 7 loads per 12 multiply-adds).
    let col_tile = if rows == 1 { 8 } else { 3 };
    let threads = rayon::current_num_threads().max(1);
    let per_chunk = n_out
        .div_ceil(threads)
        .next_multiple_of(col_tile)
        .max(col_tile);
    let chunks: Vec<(usize, usize)> = (0..n_out)
        .step_by(per_chunk)
        .map(|start| (start, (start + per_chunk).min(n_out)))
        .collect();
    let parts: Vec<Result<Vec<f32>>> = chunks
        .par_iter()
        .map(|&(start, end)| columns(path, x, rows, w, start, end, col_tile))
        .collect();
    let mut out = vec![0f32; rows * n_out];
    for (&(start, end), part) in chunks.iter().zip(parts) {
        let part = part?;
        let width = end - start;
        for (r, src) in part.chunks_exact(width).enumerate() {
            out[r * n_out + start..r * n_out + end].copy_from_slice(src);
        }
    }
    Ok(out)
}

/// Outputs `start..end` of every row, row-major `[rows, end - start]`.
fn columns(
    path: SimdPath,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    start: usize,
    end: usize,
    col_tile: usize,
) -> Result<Vec<f32>> {
    let n_in = w.cols();
    let width = end - start;
    let mut out = vec![0f32; rows * width];
    let mut scratch = vec![0f32; col_tile * n_in];
    let mut tile_out = [[0f32; 8]; ROW_TILE];
    for j in (start..end).step_by(col_tile) {
        let cols = col_tile.min(end - j);
        for (c, dst) in scratch.chunks_exact_mut(n_in).take(cols).enumerate() {
            dequantize_row(path, w, j + c, dst)?;
        }
        let mut weights: [&[f32]; 8] = [&[]; 8];
        for (slot, w) in weights
            .iter_mut()
            .zip(scratch.chunks_exact(n_in).take(cols))
        {
            *slot = w;
        }
        let weights = &weights[..cols];
        let mut r = 0;
        while r < rows {
            let tile_rows = if rows == 1 { 1 } else { ROW_TILE.min(rows - r) };
            let mut acts: [&[f32]; ROW_TILE] = [&[]; ROW_TILE];
            for (slot, a) in acts
                .iter_mut()
                .zip(x[r * n_in..(r + tile_rows) * n_in].chunks_exact(n_in))
            {
                *slot = a;
            }
            dot_tile(path, weights, &acts[..tile_rows], &mut tile_out);
            for (i, row_out) in tile_out.iter().take(tile_rows).enumerate() {
                let base = (r + i) * width + (j - start);
                out[base..base + cols].copy_from_slice(&row_out[..cols]);
            }
            r += tile_rows;
        }
    }
    Ok(out)
}

fn dequantize_row(path: SimdPath, w: &QuantMatrix, row: usize, out: &mut [f32]) -> Result<()> {
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            // SAFETY: the path was checked to be supported by this CPU.
            unsafe { super::avx2::dequantize_row(w.format(), w.row(row), out) }
            Ok(())
        }
        _ => w.dequantize_row(row, out),
    }
}

/// `out[r][c] = acts[r] . weights[c]` in the canonical reduction order, for up to
/// [`ROW_TILE`] rows and 8 columns.
fn dot_tile(path: SimdPath, weights: &[&[f32]], acts: &[&[f32]], out: &mut [[f32; 8]; ROW_TILE]) {
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            // SAFETY: the path was checked to be supported by this CPU; every slice holds
            // the same number of values, a multiple of 32 (whole blocks).
            unsafe { super::avx2::dot_tile(weights, acts, out) }
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
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            let mut out = [[0f32; 8]; ROW_TILE];
            // SAFETY: the caller holds a supported path (`SimdPath::active` or a checked
            // one); both slices hold the same multiple of 8 values.
            unsafe { super::avx2::dot_tile(&[a], &[b], &mut out) };
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

/// One dot product in the canonical order, each product and sum rounded separately:
/// what the portable path computes (for tests).
pub fn dot_reference(w: &[f32], x: &[f32]) -> f32 {
    dot_portable(w, x)
}
