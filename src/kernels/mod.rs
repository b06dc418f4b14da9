//! Our own CPU kernels: projections over weights kept in their quantized block format.
//!
//! - [`QuantMatrix`]: a weight matrix in a ggml block format ([`QuantFormat`]).
//! - [`cpu::matmul_transposed`]: `x @ W^T` with f32 activations and exact f32
//!   arithmetic, one reduction order for every batch shape, SIMD chosen at run time
//!   ([`SimdPath`]).
//! - [`attention::attention`]: attention that skips masked keys and reduces in key
//!   order, so a row's result does not depend on its batch or its chunking.
//!
//! Backends reach them through [`LlamaBackend`](crate::backend::LlamaBackend): the CPU
//! backend runs these kernels, the others dequantize once at load and keep Burn's matmul.

pub mod activation;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod cpu;
pub mod int8;
pub mod lora;
mod matrix;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod pages;
pub(crate) mod pool;
mod tiling;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use cpu::{SimdPath, matmul_transposed, matmul_transposed_on};
pub use int8::matmul_transposed_int8_on;

use crate::config::Precision;
use crate::error::Result;

/// `x @ W^T` for `x` row-major `[rows, w.cols()]` in `precision`, on the
/// [active](SimdPath::active) path: [`matmul_transposed`] (`Exact`) or the integer
/// kernels of [`int8`] (`Fast`).
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`](crate::LlamaError::ShapeMismatch) if `x` is not `rows`
/// rows of `w.cols()` values.
pub fn matmul_transposed_in(
    precision: Precision,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
) -> Result<Vec<f32>> {
    match precision {
        Precision::Exact => matmul_transposed(x, rows, w),
        Precision::Fast => matmul_transposed_int8_on(SimdPath::active(), x, rows, w),
    }
}

/// [`matmul_transposed_in`] into `out`, whose old values are dropped and whose
/// allocation is reused where it is large enough: a caller's scratch buffer, kept from
/// one product to the next instead of fresh pages for each.
///
/// # Errors
///
/// As [`matmul_transposed_in`]; `out` is then empty.
pub fn matmul_transposed_into(
    precision: Precision,
    x: &[f32],
    rows: usize,
    w: &QuantMatrix,
    out: &mut Vec<f32>,
) -> Result<()> {
    let path = SimdPath::active();
    match precision {
        Precision::Exact => cpu::matmul_transposed_into_on(path, x, rows, w, out),
        Precision::Fast => int8::matmul_transposed_int8_into(path, x, rows, w, out),
    }
}
pub use crate::quant::QuantFormat;
pub use matrix::{GROUP_ROWS, QuantMatrix};

#[cfg(test)]
pub(crate) mod tests {
    use super::cpu::dot_reference_on;
    use super::*;
    use crate::error::{LlamaError, assert_err};
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// Random but valid blocks: finite f16 scales of moderate size, any quant bits.
    pub(crate) fn random_matrix(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        seed: u64,
    ) -> QuantMatrix {
        let mut rng = StdRng::seed_from_u64(seed);
        matrix_of(
            format,
            rows,
            cols,
            &mut rng,
            |data, rng| rng.fill(data),
            |rng| half::f16::from_f32(rng.random_range(-0.05f32..0.05)).to_le_bytes(),
        )
    }

    /// Every byte `byte` but the f16 scales (and minimums), which are 0.01: with 0xFF
    /// every value is its format's largest (0x80 for Q8_0's most negative), the products'
    /// worst case for sums kept in narrow integers.
    pub(crate) fn saturated_matrix(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        byte: u8,
    ) -> QuantMatrix {
        matrix_of(
            format,
            rows,
            cols,
            &mut StdRng::seed_from_u64(0),
            |data, _| data.fill(byte),
            |_| half::f16::from_f32(0.01).to_le_bytes(),
        )
    }

    /// Blocks of `fill`'s bytes with each f16 scale (and minimum) from `scale`.
    fn matrix_of(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        rng: &mut StdRng,
        fill: impl FnOnce(&mut [u8], &mut StdRng),
        scale: impl Fn(&mut StdRng) -> [u8; 2],
    ) -> QuantMatrix {
        let blocks = rows * cols / format.block_values();
        let mut data = vec![0u8; blocks * format.block_bytes()];
        fill(&mut data[..], rng);
        for block in data.chunks_exact_mut(format.block_bytes()) {
            // Where each format keeps its f16 scales (and minimum).
            let at: &[usize] = match format {
                QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => &[0],
                QuantFormat::Q4_1 | QuantFormat::Q4_K | QuantFormat::Q5_1 | QuantFormat::Q5_K => {
                    &[0, 2]
                }
                QuantFormat::Q6_K => &[208],
                QuantFormat::Q3_K => &[108],
            };
            for &i in at {
                block[i..i + 2].copy_from_slice(&scale(rng));
            }
        }
        QuantMatrix::new(format, rows, cols, data).unwrap()
    }

    const FORMATS: [QuantFormat; QuantFormat::ALL.len()] = QuantFormat::ALL;

    fn paths() -> Vec<SimdPath> {
        SimdPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }

    #[test]
    fn every_path_matches_its_reference_to_the_bit() {
        for format in FORMATS {
            // Odd output counts exercise the column-tile remainders (and more than the
            // 32 columns whose sums the AVX-512 scratch tile carries); 1,280 values are
            // two and a half of its parts of 512.
            let (n_out, n_in) = (37, 1280);
            let w = random_matrix(format, n_out, n_in, 7);
            let dense = w.dequantize().unwrap();
            let mut rng = StdRng::seed_from_u64(1);
            for rows in [1, 2, 3, 4, 5, 8, 33] {
                let x: Vec<f32> = (0..rows * n_in)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                for path in paths() {
                    let got = matmul_transposed_on(path, &x, rows, &w).unwrap();
                    for r in 0..rows {
                        for j in 0..n_out {
                            let (wr, xr) = (
                                &dense[j * n_in..(j + 1) * n_in],
                                &x[r * n_in..(r + 1) * n_in],
                            );
                            let want = dot_reference_on(path, wr, xr);
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
        for format in FORMATS {
            let w = random_matrix(format, 70, 256, 3);
            let mut rng = StdRng::seed_from_u64(9);
            let x: Vec<f32> = (0..7 * 256)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            for path in paths() {
                let batch = matmul_transposed_on(path, &x, 7, &w).unwrap();
                for r in 0..7 {
                    let alone =
                        matmul_transposed_on(path, &x[r * 256..(r + 1) * 256], 1, &w).unwrap();
                    assert_eq!(alone, batch[r * 70..(r + 1) * 70], "{format:?} {path:?}");
                }
            }
        }
    }

    #[test]
    fn the_paths_agree_closely_with_a_plain_f64_product() {
        for format in FORMATS {
            let (n_out, n_in) = (9, 1024);
            let w = random_matrix(format, n_out, n_in, 11);
            let dense = w.dequantize().unwrap();
            let mut rng = StdRng::seed_from_u64(2);
            let x: Vec<f32> = (0..2 * n_in)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            for path in paths() {
                let got = matmul_transposed_on(path, &x, 2, &w).unwrap();
                for r in 0..2 {
                    for j in 0..n_out {
                        let (mut exact, mut scale) = (0f64, 0f64);
                        for i in 0..n_in {
                            let p = f64::from(dense[j * n_in + i]) * f64::from(x[r * n_in + i]);
                            exact += p;
                            scale += p.abs();
                        }
                        let err = (f64::from(got[r * n_out + j]) - exact).abs();
                        assert!(err <= 1e-5 * scale.max(1e-30), "{format:?} {path:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_cpu_s_own_simd_path_is_detected() {
        // The tests above compare every supported path: make sure the SIMD one is among
        // them on the architectures that have one (NEON is part of every aarch64 CPU).
        #[cfg(target_arch = "aarch64")]
        assert!(SimdPath::Neon.is_supported());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            assert!(SimdPath::Avx2.is_supported());
        }
        eprintln!("kernel paths run here: {:?}", paths());
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = random_matrix(QuantFormat::Q4_1, 4, 64, 1);
        for n in [63, 128] {
            assert_err!(
                matmul_transposed(&vec![0.0; n], 1, &w),
                LlamaError::ShapeMismatch { name, actual, .. }
                    if name == "quantized matmul input" && actual == [n]
            );
        }
        assert_eq!(matmul_transposed(&[], 0, &w).unwrap(), Vec::<f32>::new());
    }
}
