//! Weight matrices kept in a ggml block format, as the CPU kernels read them.

use super::pages::WeightBytes;
use crate::error::{LlamaError, Result};
use crate::quant::QuantFormat;
use crate::quant::dequant::dequantize_block;

/// Rows of a [`QuantMatrix`] whose blocks are stored interleaved (see its layout).
pub const GROUP_ROWS: usize = 8;

/// Stores `block` (`bb` bytes, ggml's) as row `i` of a word-interleaved step of eight
/// blocks: its 32-bit word `w` at word `8 w + i` of the step, and its last `bb % 4`
/// bytes, if any, after every row's words, row by row.
fn put_interleaved(step: &mut [u8], i: usize, block: &[u8]) {
    let words = block.len() / 4;
    for (w, word) in block.chunks_exact(4).enumerate() {
        step[4 * (GROUP_ROWS * w + i)..][..4].copy_from_slice(word);
    }
    let tail = &block[4 * words..];
    step[4 * GROUP_ROWS * words + i * tail.len()..][..tail.len()].copy_from_slice(tail);
}

/// Row `i`'s block of a word-interleaved step ([`put_interleaved`]) into `out` (`bb`
/// bytes).
pub(crate) fn get_interleaved(step: &[u8], i: usize, out: &mut [u8]) {
    let words = out.len() / 4;
    let (whole, tail) = out.split_at_mut(4 * words);
    for (w, word) in whole.chunks_exact_mut(4).enumerate() {
        word.copy_from_slice(&step[4 * (GROUP_ROWS * w + i)..][..4]);
    }
    tail.copy_from_slice(&step[4 * GROUP_ROWS * words + i * tail.len()..][..tail.len()]);
}

/// A `[rows, cols]` matrix in a block format, blocks running along each row. For a
/// projection, a row is one output's weights (ggml's `[out, in]` layout).
///
/// **Layout.** Rows are stored in groups of [`GROUP_ROWS`] (the last group may be
/// smaller), and a group's blocks are interleaved: block 0 of each of its rows, then
/// block 1 of each, and so on. Within one such step the rows' scales come first, side by
/// side, then their quantized values ([`QuantFormat::head_bytes`]). A kernel that
/// multiplies a group's eight outputs at once then reads one sequential stream, which
/// the hardware prefetcher follows, and converts eight rows' scales with one
/// instruction: 1-row decode went from 69 to 171 tokens/s with it (measured here, see
/// docs/src/cpu-kernels.md).
///
/// The K-quants (`QuantFormat::interleaves_words`) keep their blocks whole in a
/// group of fewer than eight rows; in a full group each step interleaves its eight
/// blocks by 32-bit words (word `w` of row `i` at word `8 w + i`, then the blocks' last
/// `bb % 4` bytes row by row), so 32 bytes at word `8 w` are word `w` of the eight rows:
/// the `fast` kernels load them as they multiply them, where they transposed each
/// block's bytes before. The bytes held are exactly the ggml blocks', rearranged.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: WeightBytes,
    /// What GPU backends made of it on their devices, made on first use.
    device: DeviceCopies,
}

/// Copies of a matrix that a GPU backend keeps on its devices (its blocks, or a dense
/// form where the backend has no kernel for the format), type-erased and shared by the
/// matrix's clones. They are derived from the matrix, so they never make two matrices
/// differ.
#[derive(Clone, Default)]
struct DeviceCopies(std::sync::Arc<std::sync::Mutex<Vec<DeviceCopy>>>);

type DeviceCopy = std::sync::Arc<dyn std::any::Any + Send + Sync>;

impl std::fmt::Debug for DeviceCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |copies| copies.len());
        write!(f, "DeviceCopies({n})")
    }
}

impl PartialEq for DeviceCopies {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl QuantMatrix {
    /// The copy of type `T` for which `fits` holds (a tensor on the right device), made
    /// by `make` and kept on first use.
    ///
    /// # Errors
    ///
    /// What `make` reports, and [`LlamaError::Runtime`] if another thread panicked while
    /// holding the copies.
    #[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
    pub(crate) fn device_copy<T: Clone + Send + Sync + 'static>(
        &self,
        fits: impl Fn(&T) -> bool,
        make: impl FnOnce(&Self) -> Result<T>,
    ) -> Result<T> {
        let mut copies =
            self.device.0.lock().map_err(|_| {
                LlamaError::Runtime("a matrix's device copies were poisoned".into())
            })?;
        if let Some(copy) = copies
            .iter()
            .filter_map(|c| c.downcast_ref::<T>())
            .find(|c| fits(c))
        {
            return Ok(copy.clone());
        }
        let copy = make(self)?;
        copies.push(std::sync::Arc::new(copy.clone()));
        Ok(copy)
    }
}

impl QuantMatrix {
    /// Takes `data` in ggml's layout (row by row, each row its blocks in order), checking
    /// that it holds exactly `rows` rows of `cols` values, and stores it grouped.
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
        let mut m = Self {
            format,
            rows,
            cols,
            data: WeightBytes::zeroed(0),
            device: DeviceCopies::default(),
        };
        let (bb, hb) = (format.block_bytes(), format.head_bytes());
        let row_bytes = m.row_bytes();
        let mut grouped = WeightBytes::zeroed(data.len());
        for r in 0..rows {
            for b in 0..m.blocks_per_row() {
                let src = &data[r * row_bytes + b * bb..r * row_bytes + (b + 1) * bb];
                if m.interleaved(r) {
                    let step = m.step_offset(r, b);
                    put_interleaved(&mut grouped[step..], r % GROUP_ROWS, src);
                    continue;
                }
                let (head, payload) = m.block_offsets(r, b);
                grouped[head..head + hb].copy_from_slice(&src[..hb]);
                grouped[payload..payload + bb - hb].copy_from_slice(&src[hb..]);
            }
        }
        m.data = grouped;
        Ok(m)
    }

    /// The matrix in ggml's layout (row by row), as [`new`](Self::new) takes it.
    pub fn to_ggml_bytes(&self) -> Vec<u8> {
        let bb = self.format.block_bytes();
        let mut out = vec![0u8; self.data.len()];
        for (i, dst) in out.chunks_exact_mut(bb).enumerate() {
            let (r, b) = (i / self.blocks_per_row(), i % self.blocks_per_row());
            self.block_into(r, b, dst);
        }
        out
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
        let data = parts.iter().flat_map(|p| p.to_ggml_bytes()).collect();
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

    /// The bytes held, in the kernels' grouped layout (not ggml's: see
    /// [`to_ggml_bytes`](Self::to_ggml_bytes)), where they live: for timing a plain read
    /// of the very memory a product streams.
    pub fn held_bytes(&self) -> &[u8] {
        &self.data
    }

    /// Bytes of one row's blocks.
    pub fn row_bytes(&self) -> usize {
        self.blocks_per_row() * self.format.block_bytes()
    }

    /// Blocks in each row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.format.block_values()
    }

    /// Rows in the group of row `row`.
    fn group_len(&self, row: usize) -> usize {
        GROUP_ROWS.min(self.rows - row / GROUP_ROWS * GROUP_ROWS)
    }

    /// Whether row `r`'s group is word-interleaved (a full group of a K-quant).
    fn interleaved(&self, r: usize) -> bool {
        self.format.interleaves_words() && self.group_len(r) == GROUP_ROWS
    }

    /// Where the step holding block `b` of row `r`'s group starts.
    fn step_offset(&self, r: usize, b: usize) -> usize {
        let n = self.group_len(r);
        r / GROUP_ROWS * GROUP_ROWS * self.row_bytes() + b * n * self.format.block_bytes()
    }

    /// Where block `b` of row `r` keeps its scales and its quantized values (a group
    /// that is not word-interleaved).
    fn block_offsets(&self, r: usize, b: usize) -> (usize, usize) {
        let (bb, hb) = (self.format.block_bytes(), self.format.head_bytes());
        let n = self.group_len(r);
        let step = self.step_offset(r, b);
        let i = r % GROUP_ROWS;
        (step + i * hb, step + n * hb + i * (bb - hb))
    }

    /// The bytes of the group of rows starting at `first` (a multiple of
    /// [`GROUP_ROWS`]) and the number of rows in it (see the type's layout).
    pub(crate) fn group(&self, first: usize) -> (&[u8], usize) {
        let n = self.group_len(first);
        let start = first * self.row_bytes();
        (&self.data[start..start + n * self.row_bytes()], n)
    }

    /// The bytes of rows `first .. first + 16` (or to the last row): a panel's weights,
    /// two groups stored one after the other.
    pub(crate) fn panel_bytes(&self, first: usize) -> &[u8] {
        let end = (first + 2 * GROUP_ROWS).min(self.rows);
        &self.data[first * self.row_bytes()..end * self.row_bytes()]
    }

    /// Copies block `b` of row `r`, in ggml's layout, into `out` (`block_bytes` long).
    pub(crate) fn block_into(&self, r: usize, b: usize, out: &mut [u8]) {
        let (bb, hb) = (self.format.block_bytes(), self.format.head_bytes());
        if self.interleaved(r) {
            let step = self.step_offset(r, b);
            get_interleaved(&self.data[step..], r % GROUP_ROWS, &mut out[..bb]);
            return;
        }
        let (head, payload) = self.block_offsets(r, b);
        out[..hb].copy_from_slice(&self.data[head..head + hb]);
        out[hb..bb].copy_from_slice(&self.data[payload..payload + bb - hb]);
    }

    /// Row `row` in ggml's layout (its blocks in order).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] if `row` is out of range.
    pub fn row_ggml_bytes(&self, row: usize) -> Result<Vec<u8>> {
        if row >= self.rows {
            return Err(LlamaError::invalid("row", row, "outside the matrix"));
        }
        let bb = self.format.block_bytes();
        let mut out = vec![0u8; self.row_bytes()];
        for (b, dst) in out.chunks_exact_mut(bb).enumerate() {
            self.block_into(row, b, dst);
        }
        Ok(out)
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
        let mut block = [0u8; 256];
        let (bb, bv) = (self.format.block_bytes(), self.format.block_values());
        let ty = self.format.ggml();
        for (b, dst) in out.chunks_exact_mut(bv).enumerate() {
            self.block_into(row, b, &mut block[..bb]);
            dequantize_block(ty, &block[..bb], dst);
        }
        Ok(())
    }

    /// Visits rows `first .. first + count` of the group at `first` (a multiple of
    /// [`GROUP_ROWS`]) block by block, in memory order: `f(c, b, head, values)` for
    /// block `b` of row `first + c`, its scales ([`QuantFormat::head_bytes`], empty for
    /// the K-quants) and the rest of the block (a word-interleaved block put back
    /// together).
    pub(crate) fn for_group_blocks(
        &self,
        first: usize,
        count: usize,
        mut f: impl FnMut(usize, usize, &[u8], &[u8]),
    ) {
        let (bb, hb) = (self.format.block_bytes(), self.format.head_bytes());
        let (group, n) = self.group(first);
        let interleaved = self.interleaved(first);
        let mut block = [0u8; 256];
        for (b, step) in group.chunks_exact(n * bb).enumerate() {
            if interleaved {
                for c in 0..count.min(n) {
                    get_interleaved(step, c, &mut block[..bb]);
                    f(c, b, &[], &block[..bb]);
                }
                continue;
            }
            let (heads, values) = step.split_at(n * hb);
            for c in 0..count.min(n) {
                f(
                    c,
                    b,
                    &heads[c * hb..(c + 1) * hb],
                    &values[c * (bb - hb)..(c + 1) * (bb - hb)],
                );
            }
        }
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
    use crate::error::assert_err;

    #[test]
    fn the_grouped_layout_gives_back_the_ggml_bytes() {
        for format in QuantFormat::ALL {
            // 19 rows: two full groups and a partial one.
            let rows = 19;
            let cols = 2 * format.block_values();
            let data: Vec<u8> = (0..rows * 2 * format.block_bytes())
                .map(|i| (i * 31 % 251) as u8)
                .collect();
            let m = QuantMatrix::new(format, rows, cols, data.clone()).unwrap();
            assert_eq!(m.to_ggml_bytes(), data);
            assert_ne!(&m.data[..], &data[..], "{format:?} is stored grouped");
            let rb = m.row_bytes();
            assert_eq!(m.row_ggml_bytes(17).unwrap(), data[17 * rb..18 * rb]);
        }
    }

    #[test]
    fn shapes_are_checked() {
        assert!(QuantMatrix::new(QuantFormat::Q4_1, 2, 32, vec![0; 40]).is_ok());
        assert_err!(
            QuantMatrix::new(QuantFormat::Q4_1, 2, 32, vec![0; 39]),
            LlamaError::InvalidFormat(m) if m.contains("39 given")
        );
        assert_err!(
            QuantMatrix::new(QuantFormat::Q4_1, 2, 48, vec![0; 60]),
            LlamaError::InvalidFormat(m) if m.contains("not a whole number of 32-value blocks")
        );
        assert!(QuantMatrix::new(QuantFormat::Q6_K, 1, 256, vec![0; 210]).is_ok());
        let a = QuantMatrix::new(QuantFormat::Q8_0, 1, 32, vec![1; 34]).unwrap();
        let b = QuantMatrix::new(QuantFormat::Q8_0, 2, 32, vec![2; 68]).unwrap();
        let s = QuantMatrix::stack(&[a.clone(), b]).unwrap();
        assert_eq!(s.rows(), 3);
        assert_eq!(s.row_ggml_bytes(0).unwrap(), a.row_ggml_bytes(0).unwrap());
        assert_eq!(s.row_ggml_bytes(2).unwrap(), vec![2; 34]);
        let c = QuantMatrix::new(QuantFormat::Q4_0, 1, 32, vec![0; 18]).unwrap();
        assert_err!(
            QuantMatrix::stack(&[a, c]),
            LlamaError::InvalidFormat(m) if m.contains("differ in format")
        );
    }
}
