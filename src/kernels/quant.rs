//! Weight matrices kept in a ggml block format, as the CPU kernels read them.

use crate::error::{LlamaError, Result};
use crate::loader::dequant::dequantize_into;
use crate::loader::gguf::GgmlType;

/// The block formats the CPU kernels multiply without dequantizing the matrix: those of
/// the demo model (Q4_1 projections, a Q8_0 embedding) and of the common Q4_K_M and Q8_0
/// downloads. Other types are dequantized to f32 when loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    /// 32 values: an f16 scale and 32 signed bytes.
    Q8_0,
    /// 32 values: an f16 scale and 32 nibbles offset by 8.
    Q4_0,
    /// 32 values: an f16 scale, an f16 minimum and 32 nibbles.
    Q4_1,
    /// 256 values: f16 scale and minimum, eight 6-bit sub-scales and minimums, nibbles.
    Q4_K,
    /// 256 values: 6-bit values, sixteen 8-bit sub-scales and an f16 scale.
    Q6_K,
}

impl QuantFormat {
    /// The format of a ggml type, if the kernels handle it.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        Some(match ty {
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q4_K => Self::Q4_K,
            GgmlType::Q6_K => Self::Q6_K,
            _ => return None,
        })
    }

    /// The ggml type this format is.
    pub fn ggml(self) -> GgmlType {
        match self {
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q4_K => GgmlType::Q4_K,
            Self::Q6_K => GgmlType::Q6_K,
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => 32,
            Self::Q4_K | Self::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
        }
    }
}

/// A `[rows, cols]` matrix stored row by row in a block format, blocks running along
/// each row. For a projection, a row is one output's weights (ggml's `[out, in]` layout),
/// so `x @ W^T` reads each row once.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl QuantMatrix {
    /// Wraps `data`, checking that it holds exactly `rows` rows of `cols` values.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] if `cols` is not a whole number of blocks or the
    /// byte count is not `rows` rows' worth.
    pub fn new(format: QuantFormat, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        let block = format.block_values();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(LlamaError::InvalidFormat(format!(
                "a {format:?} row of {cols} values is not a whole number of {block}-value blocks"
            )));
        }
        let expected = rows
            .checked_mul(cols / block)
            .and_then(|b| b.checked_mul(format.block_bytes()));
        if expected != Some(data.len()) {
            return Err(LlamaError::InvalidFormat(format!(
                "{rows} x {cols} {format:?} values need {expected:?} bytes, {} given",
                data.len()
            )));
        }
        Ok(Self {
            format,
            rows,
            cols,
            data,
        })
    }

    /// Stacks matrices with the same format and row length (for fused projections).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] if the parts differ in format or row length, or
    /// there are none.
    pub fn stack(parts: &[QuantMatrix]) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| LlamaError::InvalidFormat("nothing to stack".into()))?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols)
        {
            return Err(LlamaError::InvalidFormat(
                "stacked matrices differ in format or row length".into(),
            ));
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        let rows = parts.iter().map(|p| p.rows).sum();
        Self::new(first.format, rows, first.cols, data)
    }

    /// The block format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Rows (outputs of a projection).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row (inputs of a projection).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.format.block_values() * self.format.block_bytes()
    }

    /// The blocks of row `row` (`row < rows`).
    pub fn row(&self, row: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[row * n..(row + 1) * n]
    }

    /// Row `row` as f32, exactly as the loader's dequantization gives it.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] if `row` is out of range or `out` is not one row.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<()> {
        if row >= self.rows || out.len() != self.cols {
            return Err(LlamaError::invalid(
                "row",
                row,
                "outside the matrix or the wrong output length",
            ));
        }
        dequantize_into(self.format.ggml(), self.row(row), out)
    }

    /// Rows `ids` as f32, row-major `[ids.len(), cols]` (an embedding lookup).
    ///
    /// # Errors
    ///
    /// As [`dequantize_row`](Self::dequantize_row).
    pub fn dequantize_rows(&self, ids: &[usize]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.cols];
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            self.dequantize_row(id, dst)?;
        }
        Ok(out)
    }

    /// The whole matrix as f32, row-major `[rows, cols]`.
    ///
    /// # Errors
    ///
    /// Never in practice (the matrix was checked when built); typed for safety.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let ids: Vec<usize> = (0..self.rows).collect();
        self.dequantize_rows(&ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked() {
        assert!(QuantMatrix::new(QuantFormat::Q4_1, 2, 32, vec![0; 40]).is_ok());
        assert!(QuantMatrix::new(QuantFormat::Q4_1, 2, 32, vec![0; 39]).is_err());
        assert!(QuantMatrix::new(QuantFormat::Q4_1, 2, 48, vec![0; 60]).is_err());
        assert!(QuantMatrix::new(QuantFormat::Q6_K, 1, 256, vec![0; 210]).is_ok());
        let a = QuantMatrix::new(QuantFormat::Q8_0, 1, 32, vec![1; 34]).unwrap();
        let b = QuantMatrix::new(QuantFormat::Q8_0, 2, 32, vec![2; 68]).unwrap();
        let s = QuantMatrix::stack(&[a.clone(), b]).unwrap();
        assert_eq!((s.rows(), s.row(0)), (3, a.row(0)));
        let c = QuantMatrix::new(QuantFormat::Q4_0, 1, 32, vec![0; 18]).unwrap();
        assert!(QuantMatrix::stack(&[a, c]).is_err());
    }
}
