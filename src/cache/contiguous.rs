//! The contiguous key/value cache of the sequential, concurrent and batched strategies.
//!
//! One [`KvCache`] holds, for every layer, keys and values shaped
//! `[batch, kv_heads, capacity, head_dim]`. All rows share the column axis: column `c`
//! of every row is written in the same forward pass. Rows are *left*-padded: row `r`'s
//! real tokens occupy columns `start[r]..len`, and its token in column `c` sits at
//! position `c - start[r]`. Since RoPE scores depend only on relative positions and the
//! padded columns are masked out, a padded row computes exactly what it would alone.
//!
//! A per-request cache is the batch-1 case (`start = [0]`). Capacity grows on demand
//! (doubling, up to the model's context window) so short requests hold little memory.

use burn::tensor::{Bool, Tensor, TensorData, backend::Backend};

use crate::error::{LlamaError, Result};

/// Keys and values of one layer.
#[derive(Debug, Clone)]
struct LayerKv<B: Backend> {
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
}

/// Per-layer key/value tensors for a batch of rows sharing one column axis.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<LayerKv<B>>,
    starts: Vec<usize>,
    len: usize,
    capacity: usize,
    max_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl<B: Backend> KvCache<B> {
    /// A cache for `starts.len()` rows whose real tokens begin at the given columns
    /// (left padding), with room for `capacity` columns now and up to `max_capacity`
    /// after growing.
    pub fn new(
        n_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        starts: Vec<usize>,
        capacity: usize,
        max_capacity: usize,
        device: &B::Device,
    ) -> Self {
        let batch = starts.len();
        let capacity = capacity.clamp(1, max_capacity.max(1));
        let zeros = || Tensor::<B, 4>::zeros([batch, kv_heads, capacity, head_dim], device);
        Self {
            layers: (0..n_layers)
                .map(|_| LayerKv {
                    k: zeros(),
                    v: zeros(),
                })
                .collect(),
            starts,
            len: 0,
            capacity,
            max_capacity: max_capacity.max(1),
            kv_heads,
            head_dim,
        }
    }

    /// Layers of the cache.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Key/value heads per layer.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Values per head vector.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rows in the cache.
    pub fn batch(&self) -> usize {
        self.starts.len()
    }

    /// Columns written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Columns allocated now.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest number of columns this cache may grow to.
    pub fn max_capacity(&self) -> usize {
        self.max_capacity
    }

    /// First real column of each row (the row's left padding).
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// Tokens of each row held in the cache (excluding padding).
    pub fn row_lengths(&self) -> Vec<usize> {
        self.starts
            .iter()
            .map(|&s| self.len.saturating_sub(s))
            .collect()
    }

    /// Bytes held by the cache's tensors (f32 elements).
    pub fn allocated_bytes(&self) -> usize {
        self.layers.len() * 2 * self.batch() * self.kv_heads * self.capacity * self.head_dim * 4
    }

    /// Makes room for `additional` more columns, growing the tensors if needed.
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let needed = self.len + additional;
        if needed > self.max_capacity {
            return Err(LlamaError::PromptTooLong {
                tokens: needed,
                max: self.max_capacity,
            });
        }
        if needed <= self.capacity {
            return Ok(());
        }
        let new_capacity = needed.max(self.capacity * 2).min(self.max_capacity);
        let extra = new_capacity - self.capacity;
        let batch = self.batch();
        for layer in &mut self.layers {
            let device = layer.k.device();
            let pad = Tensor::<B, 4>::zeros([batch, self.kv_heads, extra, self.head_dim], &device);
            layer.k = Tensor::cat(vec![layer.k.clone(), pad.clone()], 2);
            layer.v = Tensor::cat(vec![layer.v.clone(), pad], 2);
        }
        self.capacity = new_capacity;
        Ok(())
    }

    /// Writes `k`, `v` of `layer` (a projection's output `[batch * seq, kv_heads *
    /// head_dim]`, one token per row) at columns `len..len + seq` and returns all keys
    /// and values up to the new end, `[batch, kv_heads, len + seq, head_dim]`. The caller
    /// must have called [`reserve`](Self::reserve) for `seq` columns, and must call
    /// [`advance`](Self::advance) once after writing every layer.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k: Tensor<B, 2>,
        v: Tensor<B, 2>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (batch, heads, dim) = (self.batch(), self.kv_heads, self.head_dim);
        let seq = k.dims()[0] / batch.max(1);
        let (start, end) = (self.len, self.len + seq);
        let capacity = self.capacity;
        let entry = &mut self.layers[layer];
        let region = [0..batch, 0..heads, start..end, 0..dim];
        for (target, new) in [(&mut entry.k, k), (&mut entry.v, v)] {
            target.inplace(|t| write_columns(t, new, region.clone(), capacity));
        }
        let filled = [0..batch, 0..heads, 0..end, 0..dim];
        (
            entry.k.clone().slice(filled.clone()),
            entry.v.clone().slice(filled),
        )
    }

    /// Layer `layer`'s whole keys and values, `[batch, kv_heads, capacity, head_dim]`
    /// (columns from `len` on not yet written).
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor<B, 4>, &Tensor<B, 4>) {
        let entry = &self.layers[layer];
        (&entry.k, &entry.v)
    }

    /// The next `seq` columns of every row as a paged step over this cache seen as a
    /// pool of one block of `capacity` positions per row (row `r`'s block is `rows[r]`,
    /// which the caller fills with `0..batch`), its slots its columns and its left
    /// padding the slots before its start
    /// ([`with_left_padding`](crate::model::attention::PagedBatch)). Call after
    /// [`reserve`](Self::reserve).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] if the capacity does not hold the chunk or `rows`
    /// does not name one block per row.
    pub(crate) fn as_paged_batch<'a>(
        &self,
        rows: &'a [super::BlockId],
        seq: usize,
        n_heads: usize,
        device: &B::Device,
    ) -> Result<crate::model::paged_batch::PagedBatch<'a, B>> {
        if rows.len() != self.batch() {
            return Err(LlamaError::InvalidBatch(format!(
                "{} block ids for {} rows",
                rows.len(),
                self.batch()
            )));
        }
        let seqs = rows
            .chunks(1)
            .map(|blocks| crate::kernels::attention::PagedSeq {
                tokens: seq,
                start: self.len,
                blocks,
            })
            .collect();
        crate::model::paged_batch::PagedBatch::new(
            seqs,
            n_heads,
            self.capacity,
            self.batch(),
            device,
        )?
        .with_left_padding(self.starts.clone())
    }

    /// Forgets the columns from `len` on (speculative decoding's rejected positions):
    /// they are written again by the next forward pass. A cache shorter than `len` is
    /// left as it is.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Marks `seq` more columns as written.
    pub(crate) fn advance(&mut self, seq: usize) {
        self.len += seq;
    }

    /// RoPE position of each new token of a `seq`-column chunk, row-major `[batch, seq]`.
    /// Padding columns get position 0 (they are masked).
    pub(crate) fn chunk_positions(&self, seq: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.batch() * seq);
        for &start in &self.starts {
            out.extend((self.len..self.len + seq).map(|c| c.saturating_sub(start)));
        }
        out
    }

    /// Attention mask for a `seq`-column chunk, `[batch, 1, groups * seq, len + seq]`,
    /// `true` where a key must be ignored; the query axis repeats the chunk `groups` times
    /// (query heads sharing a key/value head are folded into it). A real query sees the
    /// real keys at or before its column; a padding query sees only itself, so no row is
    /// fully masked. Returns `None` when nothing needs masking.
    pub(crate) fn chunk_mask(
        &self,
        seq: usize,
        groups: usize,
        device: &B::Device,
    ) -> Option<Tensor<B, 4, Bool>> {
        let keys = self.len + seq;
        let no_padding = self.starts.iter().all(|&s| s == 0);
        if seq == 1 && no_padding {
            return None;
        }
        let batch = self.batch();
        let mut data = Vec::with_capacity(batch * groups * seq * keys);
        for &start in &self.starts {
            let mut row_block = Vec::with_capacity(seq * keys);
            for i in 0..seq {
                let col = self.len + i;
                if col < start {
                    row_block.extend((0..keys).map(|k| k != col));
                } else {
                    row_block.extend((0..keys).map(|k| k < start || k > col));
                }
            }
            for _ in 0..groups {
                data.extend_from_slice(&row_block);
            }
        }
        let mask = TensorData::new(data, [batch, 1, groups * seq, keys]);
        Some(Tensor::<B, 4, Bool>::from_data(mask, device))
    }

    /// Appends the rows of `other` after this cache's rows. Both caches are aligned on
    /// their last written column: the shorter one is left-padded, which shifts columns
    /// but not positions (each row keeps its own start), so every row's attention is
    /// unchanged. Used when a request that finished its prefill joins a running batch.
    pub fn merge(&mut self, other: KvCache<B>) -> Result<()> {
        if other.layers.len() != self.layers.len()
            || other.kv_heads != self.kv_heads
            || other.head_dim != self.head_dim
        {
            return Err(LlamaError::InvalidBatch(
                "caches of different models cannot merge".into(),
            ));
        }
        let len = self.len.max(other.len);
        // Room after the aligned end: whatever either side had reserved.
        let room = (self.capacity - self.len).max(other.capacity - other.len);
        let capacity = (len + room).min(self.max_capacity.max(other.max_capacity));
        let pad = |t: Tensor<B, 4>, left: usize, right: usize| {
            if left == 0 && right == 0 {
                return t;
            }
            let [b, h, c, d] = t.dims();
            let device = t.device();
            let mut parts = Vec::with_capacity(3);
            if left > 0 {
                parts.push(Tensor::<B, 4>::zeros([b, h, left, d], &device));
            }
            parts.push(t);
            if right > 0 {
                parts.push(Tensor::<B, 4>::zeros([b, h, right, d], &device));
            }
            let t = Tensor::cat(parts, 2);
            debug_assert_eq!(t.dims()[2], left + c + right);
            t
        };
        let (shift_a, shift_b) = (len - self.len, len - other.len);
        let right_a = capacity - (shift_a + self.capacity).min(capacity);
        let right_b = capacity - (shift_b + other.capacity).min(capacity);
        let cut = |t: Tensor<B, 4>, shift: usize| {
            // Drop reserved columns that no longer fit after shifting.
            let [b, h, c, d] = t.dims();
            let keep = c.min(capacity - shift);
            if keep < c {
                t.slice([0..b, 0..h, 0..keep, 0..d])
            } else {
                t
            }
        };
        for (mine, theirs) in self.layers.iter_mut().zip(other.layers) {
            let k = pad(cut(mine.k.clone(), shift_a), shift_a, right_a);
            let v = pad(cut(mine.v.clone(), shift_a), shift_a, right_a);
            let ok = pad(cut(theirs.k, shift_b), shift_b, right_b);
            let ov = pad(cut(theirs.v, shift_b), shift_b, right_b);
            mine.k = Tensor::cat(vec![k, ok], 0);
            mine.v = Tensor::cat(vec![v, ov], 0);
        }
        let mut starts: Vec<usize> = self.starts.iter().map(|s| s + shift_a).collect();
        starts.extend(other.starts.iter().map(|s| s + shift_b));
        self.starts = starts;
        self.len = len;
        self.capacity = capacity;
        self.max_capacity = self.max_capacity.max(other.max_capacity);
        Ok(())
    }

    /// Keeps only the listed rows (in that order), then drops leading columns that are
    /// padding for every remaining row. Used to stop spending compute on finished rows.
    pub fn retain_rows(&mut self, rows: &[usize]) -> Result<()> {
        if rows.iter().any(|&r| r >= self.batch()) {
            return Err(LlamaError::InvalidBatch(format!(
                "row index out of range (batch {})",
                self.batch()
            )));
        }
        if rows.is_empty() {
            return Err(LlamaError::InvalidBatch("cannot retain zero rows".into()));
        }
        let starts: Vec<usize> = rows.iter().map(|&r| self.starts[r]).collect();
        let trim = starts.iter().copied().min().unwrap_or(0).min(self.len);
        let keep_all_rows =
            rows.len() == self.batch() && rows.iter().enumerate().all(|(i, &r)| i == r);
        if keep_all_rows && trim == 0 {
            return Ok(());
        }
        for layer in &mut self.layers {
            let device = layer.k.device();
            let index = Tensor::<B, 1, burn::tensor::Int>::from_data(
                TensorData::new(
                    rows.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                    [rows.len()],
                ),
                &device,
            );
            let cols = trim..self.capacity;
            let select = |t: Tensor<B, 4>| {
                let t = if keep_all_rows {
                    t
                } else {
                    t.select(0, index.clone())
                };
                if trim > 0 {
                    let [b, h, _, d] = t.dims();
                    t.slice([0..b, 0..h, cols.clone(), 0..d])
                } else {
                    t
                }
            };
            layer.k = select(layer.k.clone());
            layer.v = select(layer.v.clone());
        }
        self.starts = starts.iter().map(|s| s - trim).collect();
        self.len -= trim;
        self.capacity -= trim;
        Ok(())
    }
}

/// From this many values, [`write_columns`] copies on the pool's threads (a decode
/// step's few stay on the calling thread).
const SPLIT_WRITE_VALUES: usize = 64 * 1024;

/// Writes `new` (`[batch, heads, seq, dim]`) into `cache` at `region` (columns
/// `start..start + seq` of a `capacity`-column cache): in place on the CPU backend,
/// with `slice_assign` elsewhere.
fn write_columns<B: Backend>(
    cache: Tensor<B, 4>,
    new: Tensor<B, 2>,
    region: [std::ops::Range<usize>; 4],
    capacity: usize,
) -> Tensor<B, 4> {
    let (batch, heads, dim) = (region[0].end, region[1].end, region[3].end);
    let (start, seq) = (region[2].start, region[2].len());
    // Token `s` of row `b` goes to column `start + s` of every head's `[capacity, dim]`
    // plane: the transposition is done by the copy itself.
    // Head by head, each head's columns in order (written one after another), the
    // heads of a prompt split across the pool's threads: token by token on one thread,
    // this copy was 1.7% of a 450-token prefill while the other core waited.
    let written = super::host::write_in_place(cache, &new, |memory, rows| {
        debug_assert_eq!(rows.len(), batch * seq);
        let planes = batch * heads;
        // The region is the cache's own shape (its caller's checks).
        let fits = memory.len() >= planes * capacity * dim && start + seq <= capacity;
        debug_assert!(fits, "a cache write outside the cache");
        if !fits {
            return;
        }
        let target = crate::kernels::pool::Disjoint::new(memory);
        let plane = |p: usize| {
            let (b, h) = (p / heads, p % heads);
            // SAFETY: plane `p < planes` (its `capacity * dim` values, inside `memory`)
            // belongs to this call alone; columns `start..start + seq` lie in it.
            let columns = unsafe { target.part((p * capacity + start) * dim, seq * dim) };
            let tokens = seq.min(rows.len().saturating_sub(b * seq));
            for (s, column) in columns.chunks_exact_mut(dim).take(tokens).enumerate() {
                column.copy_from_slice(&rows.row(b * seq + s)[h * dim..(h + 1) * dim]);
            }
        };
        if batch * seq * heads * dim < SPLIT_WRITE_VALUES {
            (0..planes).for_each(plane);
        } else {
            crate::kernels::pool::for_each_chunk(planes, &plane);
        }
    });
    match written {
        Ok(cache) => cache,
        Err(cache) => {
            let new = new.reshape([batch, seq, heads, dim]).swap_dims(1, 2);
            cache.slice_assign(region, new)
        }
    }
}
