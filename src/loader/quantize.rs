//! In-memory quantization at load ([`QuantizingSource`]: a safetensors checkpoint run
//! as Q8_0 or Q4_0 without a conversion step, as mistral.rs's in-situ quantization
//! does), and [`QuantMatrix::quantize`]. The quantizers themselves are the block
//! formats' own, in [`crate::quant`]; [`quantize`] and [`QUANTIZERS`] are re-exported
//! here for the paths that named them before.

use super::TensorSource;
use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;
pub use crate::quant::QuantFormat;
pub use crate::quant::quantize::{QUANTIZERS, quantize};

impl QuantMatrix {
    /// Quantizes a row-major `[rows, cols]` f32 matrix into `format` (see [`quantize`]).
    ///
    /// # Errors
    ///
    /// As [`quantize`], and [`LlamaError::InvalidFormat`] if `values` is not `rows`
    /// rows of `cols`.
    pub fn quantize(format: QuantFormat, rows: usize, cols: usize, values: &[f32]) -> Result<Self> {
        let block = format.block_values();
        if Some(values.len()) != rows.checked_mul(cols) || !cols.is_multiple_of(block) {
            return Err(LlamaError::InvalidFormat(format!(
                "{} values are not {rows} rows of {cols} (a multiple of {block})",
                values.len()
            )));
        }
        QuantMatrix::new(format, rows, cols, quantize(format, values)?)
    }
}

/// A [`TensorSource`] whose 2-D tensors that are not already in a kept block format
/// (f32, f16 or bf16 checkpoints) are quantized into `format` as they are read: the
/// projections, the embedding and the output head; norms stay f32. A matrix whose rows
/// are not a whole number of `format`'s blocks (a K-quant's 256 values) stays dense.
pub struct QuantizingSource<'a> {
    inner: &'a mut dyn TensorSource,
    format: QuantFormat,
}

impl<'a> QuantizingSource<'a> {
    /// Quantizes `inner`'s matrices into `format`.
    ///
    /// # Errors
    ///
    /// None today (every [`QuantFormat`] has a quantizer, [`QUANTIZERS`]); kept so a
    /// format without one can be refused.
    pub fn new(inner: &'a mut dyn TensorSource, format: QuantFormat) -> Result<Self> {
        quantize(format, &[])?;
        Ok(Self { inner, format })
    }
}

impl TensorSource for QuantizingSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.inner.read(name)
    }

    fn read_quantized(&mut self, name: &str) -> Result<Option<QuantMatrix>> {
        if let Some(m) = self.inner.read_quantized(name)? {
            return Ok(Some(m));
        }
        let (shape, values) = self.inner.read(name)?;
        match shape.as_slice() {
            [rows, cols] if cols.is_multiple_of(self.format.block_values()) => {
                QuantMatrix::quantize(self.format, *rows, *cols, &values).map(Some)
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn blocks_dequantize_close_to_their_values() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for format in QUANTIZERS {
            let m = QuantMatrix::quantize(format, 1, 256, &x).unwrap();
            let back = m.dequantize().unwrap();
            let step = match format {
                QuantFormat::Q8_0 => 3.0 / 127.0,
                QuantFormat::Q6_K => 6.0 / 63.0,
                QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::Q5_K => 6.0 / 31.0,
                QuantFormat::Q3_K => 6.0 / 7.0,
                _ => 6.0 / 15.0,
            };
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= step, "{format:?}: {a} -> {b}");
            }
        }
    }

    #[test]
    fn partial_blocks_are_errors() {
        assert_err!(
            quantize(QuantFormat::Q4_K, &[0.0; 128]),
            LlamaError::InvalidParameter { name: "quantize", value, .. } if value == "128"
        );
        assert_err!(
            QuantMatrix::quantize(QuantFormat::Q6_K, 2, 128, &[0.0; 256]),
            LlamaError::InvalidFormat(m) if m.contains("256 values are not 2 rows of 128")
        );
        assert_err!(
            quantize(QuantFormat::Q8_0, &[0.0; 33]),
            LlamaError::InvalidParameter { name: "quantize", value, .. } if value == "33"
        );
        assert_err!(
            QuantMatrix::quantize(QuantFormat::Q8_0, 2, 32, &[0.0; 32]),
            LlamaError::InvalidFormat(m) if m.contains("32 values are not 2 rows of 32")
        );
        // An all-zero block has scale 0 and zero values.
        assert_eq!(
            quantize(QuantFormat::Q8_0, &[0.0; 32]).unwrap(),
            vec![0; 34]
        );
    }
}
