//! Scaled dot-product attention on the CPU in one fixed reduction order.
//!
//! Burn's fused attention reduces over every key column, masked ones included, so a row
//! padded in a batch sums over a different number of terms than the same row alone. Here
//! masked keys are skipped: a query's result depends only on the keys it sees, taken in
//! column order. Scores are dot products in the kernels' canonical order (see
//! [`super::cpu`]); the softmax takes the maximum, the exponentials, and their sum in an
//! order fixed by each term's place among the visible keys (16 interleaved partial sums);
//! the output accumulates `p_j * v_j` in two interleaved sums, even and odd places, each
//! in key order. Nothing depends on the other rows, the padding or the chunking, so a
//! row's attention is bitwise the same alone, left-padded in a batch, or with its prompt
//! read in chunks.

use super::cpu::{SimdPath, dot, finish, largest, on_simd_path};
use crate::cache::{BlockId, KvCacheType};
use crate::error::{LlamaError, Result};

/// Shapes of one attention call: queries `[batch, heads, queries, dim]`, keys and values
/// `[batch, heads, keys, dim]`, an optional mask `[batch, mask_heads, queries, keys]`
/// (`mask_heads` 1 or `heads`; `true` hides a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Rows.
    pub batch: usize,
    /// Heads (key/value heads; grouped query heads are folded into `queries`).
    pub heads: usize,
    /// Queries per row and head.
    pub queries: usize,
    /// Keys per row and head.
    pub keys: usize,
    /// Values per head vector.
    pub dim: usize,
    /// Heads of the mask (1: shared by all heads).
    pub mask_heads: usize,
}

/// How queries (and the output, which has their layout) are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryLayout {
    /// `[batch, heads, queries, dim]`, contiguous.
    HeadMajor,
    /// `[batch, seq, heads * groups, dim]`: a projection's output, one token per row,
    /// where `queries = groups * seq` folds the `groups` query heads that share a
    /// key/value head (query `g * seq + s` is token `s` of query head `h * groups + g`).
    TokenMajor {
        /// Tokens per row.
        seq: usize,
        /// Query heads per key/value head.
        groups: usize,
    },
}

impl QueryLayout {
    /// Row `b`, key/value head `h` and folded query index of the `index`-th query in
    /// memory order.
    #[inline(always)]
    fn locate(self, index: usize, heads: usize, queries: usize) -> (usize, usize, usize) {
        match self {
            QueryLayout::HeadMajor => {
                let bh = index / queries;
                (bh / heads, bh % heads, index % queries)
            }
            QueryLayout::TokenMajor { seq, groups } => {
                let per_token = heads * groups;
                let (b, rest) = (index / (seq * per_token), index % (seq * per_token));
                let (s, head) = (rest / per_token, rest % per_token);
                (b, head / groups, (head % groups) * seq + s)
            }
        }
    }
}

/// Keys or values `[batch, heads, keys, dim]` read in place: element `(b, h, j, d)` is
/// `data[offset + b * strides[0] + h * strides[1] + j * strides[2] + d]`. A cache's
/// filled columns are such a view of its memory, so attention reads them without a copy.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The memory.
    pub data: &'a [f32],
    /// Where element `(0, 0, 0, 0)` is.
    pub offset: usize,
    /// Steps between rows, heads and keys (values along `dim` are adjacent).
    pub strides: [usize; 3],
}

impl<'a> Strided<'a> {
    /// A contiguous `[batch, heads, keys, dim]` tensor.
    pub fn contiguous(data: &'a [f32], shape: AttentionShape) -> Self {
        let dim = shape.dim;
        Self {
            data,
            offset: 0,
            strides: [shape.heads * shape.keys * dim, shape.keys * dim, dim],
        }
    }

    /// Whether every element of `shape` lies inside `data`.
    fn covers(&self, shape: AttentionShape) -> bool {
        if shape.batch == 0 || shape.heads == 0 || shape.keys == 0 || shape.dim == 0 {
            return true;
        }
        let last = self.offset
            + (shape.batch - 1) * self.strides[0]
            + (shape.heads - 1) * self.strides[1]
            + (shape.keys - 1) * self.strides[2]
            + shape.dim;
        last <= self.data.len()
    }

    /// Key (or value) `j` of row `b`, head `h`: `dim` values (inside `data` when the view
    /// [`covers`](Self::covers) the shape).
    #[inline(always)]
    fn vector(&self, b: usize, h: usize, j: usize, dim: usize) -> &'a [f32] {
        let at = self.offset + b * self.strides[0] + h * self.strides[1] + j * self.strides[2];
        &self.data[at..at + dim]
    }
}

/// Where key (or value) `j` of row `b`, head `h` lies: a [`Strided`] view of a
/// contiguous cache, a [`PagedPool`]'s blocks read through a row's block table, or an
/// [`EncodedPagedPool`]'s rows, decoded.
trait KvView<'a>: Sync {
    /// Whether vectors are decoded into a buffer ([`stage`](Self::stage)) rather than
    /// read in place ([`vector`](Self::vector)). A constant, so each kernel is compiled
    /// for one or the other.
    const STAGED: bool = false;

    /// The `dim` values of vector `j` of row `b`, head `h` (checked to exist by the
    /// caller of the kernel). Only called where [`STAGED`](Self::STAGED) is `false`.
    fn vector(&self, b: usize, h: usize, j: usize, dim: usize) -> &'a [f32];

    /// Writes the values of vector `j` of row `b`, head `h` into `out`.
    #[inline(always)]
    fn stage(&self, b: usize, h: usize, j: usize, out: &mut [f32]) {
        out.copy_from_slice(self.vector(b, h, j, out.len()));
    }

    /// Vectors `j .. j + out.len()` of row `b`, head `h`, each as [`vector`](Self::vector)
    /// gives it, into `out`: one lookup per run of adjacent vectors where the view has
    /// them (a paged view's block).
    #[inline(always)]
    fn vectors<'s>(&self, b: usize, h: usize, j: usize, dim: usize, out: &mut [&'s [f32]])
    where
        'a: 's,
    {
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.vector(b, h, j + i, dim);
        }
    }
}

impl<'a> KvView<'a> for Strided<'a> {
    #[inline(always)]
    fn vector(&self, b: usize, h: usize, j: usize, dim: usize) -> &'a [f32] {
        Strided::vector(self, b, h, j, dim)
    }
}

/// One layer of a paged KV pool, `[blocks, heads, block_size, dim]` for keys and the same
/// for values, read through block tables.
#[derive(Debug, Clone, Copy)]
pub struct PagedPool<'a> {
    /// Keys of every block.
    pub keys: &'a [f32],
    /// Values of every block.
    pub values: &'a [f32],
    /// Key/value heads.
    pub heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Values per head vector.
    pub dim: usize,
}

impl PagedPool<'_> {
    /// Blocks in the pool.
    fn blocks(&self) -> usize {
        self.keys.len() / (self.heads * self.block_size * self.dim).max(1)
    }
}

/// One sequence of a paged attention call: its new tokens (the queries, token-major in
/// the call's `q`, after the previous sequences' tokens) see the `start` tokens already
/// in its blocks and themselves, causally.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// New tokens (queries) of the sequence.
    pub tokens: usize,
    /// Tokens already in the sequence's blocks before these; token `s` sits at position
    /// `start + s` and sees keys `0..=start + s`.
    pub start: usize,
    /// The block table: block `i` holds positions `i * block_size ..`.
    pub blocks: &'a [BlockId],
}

/// A pool's keys or values seen through every sequence's block table.
struct PagedView<'a> {
    data: &'a [f32],
    seqs: &'a [PagedSeq<'a>],
    heads: usize,
    block_size: usize,
}

impl<'a> KvView<'a> for PagedView<'a> {
    #[inline(always)]
    fn vector(&self, b: usize, h: usize, j: usize, dim: usize) -> &'a [f32] {
        let block = self.seqs[b].blocks[j / self.block_size] as usize;
        let at = ((block * self.heads + h) * self.block_size + j % self.block_size) * dim;
        &self.data[at..at + dim]
    }

    #[inline(always)]
    fn vectors<'s>(&self, b: usize, h: usize, j: usize, dim: usize, out: &mut [&'s [f32]])
    where
        'a: 's,
    {
        // A block's slots of one head are adjacent: one table lookup per block (a
        // division and a lookup for every key took a fifth of a prompt's attention).
        let mut i = 0;
        while i < out.len() {
            let (index, slot) = ((j + i) / self.block_size, (j + i) % self.block_size);
            let count = (self.block_size - slot).min(out.len() - i);
            let block = self.seqs[b].blocks[index] as usize;
            let at = ((block * self.heads + h) * self.block_size + slot) * dim;
            let run = &self.data[at..at + count * dim];
            for (o, v) in out[i..i + count]
                .iter_mut()
                .zip(run.chunks_exact(dim.max(1)))
            {
                *o = v;
            }
            i += count;
        }
    }
}

/// One layer of a paged KV pool whose rows are encoded ([`KvCacheType`]): keys and
/// values each one row per `(block, head, slot)`, in that order.
#[derive(Debug, Clone, Copy)]
pub struct EncodedPagedPool<'a> {
    /// Key rows of every block and their type.
    pub keys: (&'a [u8], KvCacheType),
    /// Value rows of every block and their type.
    pub values: (&'a [u8], KvCacheType),
    /// Key/value heads.
    pub heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Values per head vector.
    pub dim: usize,
}

/// An encoded pool's keys or values seen through every sequence's block table.
struct EncodedView<'a> {
    data: &'a [u8],
    ty: KvCacheType,
    /// Whether rows are decoded with the AVX2 + F16C decoders (the same bits as
    /// [`KvCacheType::decode`]; chosen once per call, from [`SimdPath::active`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    simd: bool,
    row_bytes: usize,
    seqs: &'a [PagedSeq<'a>],
    heads: usize,
    block_size: usize,
}

impl<'a> KvView<'a> for EncodedView<'a> {
    const STAGED: bool = true;

    fn vector(&self, _: usize, _: usize, _: usize, _: usize) -> &'a [f32] {
        debug_assert!(false, "an encoded view is staged, not read in place");
        &[]
    }

    #[inline(always)]
    fn stage(&self, b: usize, h: usize, j: usize, out: &mut [f32]) {
        let block = self.seqs[b].blocks[j / self.block_size] as usize;
        let at =
            ((block * self.heads + h) * self.block_size + j % self.block_size) * self.row_bytes;
        let row = &self.data[at..at + self.row_bytes];
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: `simd` is set only where this CPU runs the AVX2 path; the row holds
            // `out.len()` encoded values (the pool's row size for the head size).
            return unsafe { super::avx2::decode_kv_row(self.ty, row, out) };
        }
        self.ty.decode(row, out);
    }
}

/// [`paged_attention`] over a pool of encoded rows: each key and value is decoded where
/// it is read (64 at a time, into a buffer that stays in L1), never into a copy of the
/// cache. Decoding is exact arithmetic on the stored bits, so a token's result depends
/// only on its own keys and values as stored, in the same reduction order as
/// [`paged_attention`]: bitwise batch-invariant, and for `f32` rows bitwise the same as
/// [`paged_attention`] over the same values.
///
/// # Errors
///
/// As [`paged_attention`]; [`LlamaError::InvalidParameter`] if a type does not fit the
/// head size.
pub fn paged_attention_encoded(
    q: &[f32],
    n_heads: usize,
    pool: EncodedPagedPool<'_>,
    seqs: &[PagedSeq<'_>],
) -> Result<Vec<f32>> {
    let EncodedPagedPool {
        heads,
        block_size,
        dim,
        ..
    } = pool;
    check_paged_shape(q.len(), n_heads, heads, block_size, dim, seqs)?;
    let (key_row, value_row) = (pool.keys.1.row_bytes(dim)?, pool.values.1.row_bytes(dim)?);
    let rows = heads * block_size;
    let blocks = pool.keys.0.len() / (rows * key_row);
    if pool.keys.0.len() != blocks * rows * key_row
        || pool.values.0.len() != blocks * rows * value_row
    {
        return Err(LlamaError::ShapeMismatch {
            name: "paged attention pool".into(),
            expected: vec![blocks, heads, block_size, dim],
            actual: vec![pool.keys.0.len(), pool.values.0.len()],
        });
    }
    check_tables(seqs, block_size, blocks)?;
    let k = EncodedView {
        data: pool.keys.0,
        ty: pool.keys.1,
        simd: matches!(SimdPath::active(), SimdPath::Avx2 | SimdPath::Avx512),
        row_bytes: key_row,
        seqs,
        heads,
        block_size,
    };
    let v = EncodedView {
        data: pool.values.0,
        ty: pool.values.1,
        row_bytes: value_row,
        ..k
    };
    Ok(attend_paged(q, n_heads, heads, dim, seqs, &k, &v))
}

/// Checks a paged call's shapes: heads, block size and head size that fit, and queries
/// `[tokens, n_heads * dim]` for the sequences' tokens.
fn check_paged_shape(
    q_len: usize,
    n_heads: usize,
    heads: usize,
    block_size: usize,
    dim: usize,
    seqs: &[PagedSeq<'_>],
) -> Result<()> {
    let tokens: usize = seqs.iter().map(|s| s.tokens).sum();
    if heads == 0 || block_size == 0 || dim == 0 || !n_heads.is_multiple_of(heads) {
        return Err(LlamaError::InvalidBatch(format!(
            "{n_heads} query heads over {heads} key/value heads of {dim} values in blocks of \
             {block_size} do not fit"
        )));
    }
    if q_len != tokens * n_heads * dim {
        return Err(LlamaError::ShapeMismatch {
            name: "paged attention queries".into(),
            expected: vec![tokens, n_heads * dim],
            actual: vec![q_len],
        });
    }
    Ok(())
}

/// Checks that every block table holds its sequence's tokens, in a pool of `blocks`.
fn check_tables(seqs: &[PagedSeq<'_>], block_size: usize, blocks: usize) -> Result<()> {
    for seq in seqs {
        let end = seq.start + seq.tokens;
        if seq.blocks.len().saturating_mul(block_size) < end
            || seq.blocks[..end.div_ceil(block_size)]
                .iter()
                .any(|&b| b as usize >= blocks)
        {
            return Err(LlamaError::InvalidBatch(format!(
                "a block table of {} blocks in a pool of {blocks} cannot hold {end} tokens",
                seq.blocks.len()
            )));
        }
    }
    Ok(())
}

/// Every sequence's new tokens attended over its keys `k` and values `v` (checked).
fn attend_paged<'a, V: KvView<'a>>(
    q: &[f32],
    n_heads: usize,
    heads: usize,
    dim: usize,
    seqs: &[PagedSeq<'_>],
    k: &V,
    v: &V,
) -> Vec<f32> {
    // The sequence and position of every token.
    let tokens: usize = seqs.iter().map(|s| s.tokens).sum();
    let mut owner = Vec::with_capacity(tokens);
    for (b, seq) in seqs.iter().enumerate() {
        owner.extend((0..seq.tokens).map(|s| (b, seq.start + s)));
    }
    let groups = n_heads / heads;
    attend_queries(q, dim, k, v, 0, groups, |index| {
        let (b, position) = owner[index / n_heads];
        let h = (index % n_heads) / groups;
        (b, h, None, position + 1)
    })
}

/// Attention of every sequence's new tokens over its blocks of a paged pool, in the
/// reduction order of [`attention`]: a token's result is bitwise the same as the
/// contiguous kernel's over the same keys, whatever the other sequences, the block size
/// or where its blocks lie. `q` is `[tokens, n_heads * dim]` (the sequences' tokens one
/// after another, RoPE applied); returns the same shape. No keys are copied and no mask
/// is built: a token sees its sequence's keys up to its own position.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if `q` or the pool does not match, and
/// [`LlamaError::InvalidBatch`] if a block table is too short for its tokens or names a
/// block outside the pool.
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    pool: PagedPool<'_>,
    seqs: &[PagedSeq<'_>],
) -> Result<Vec<f32>> {
    let PagedPool {
        heads,
        block_size,
        dim,
        ..
    } = pool;
    check_paged_shape(q.len(), n_heads, heads, block_size, dim, seqs)?;
    let block_len = heads * block_size * dim;
    if !pool.keys.len().is_multiple_of(block_len) || pool.values.len() != pool.keys.len() {
        return Err(LlamaError::ShapeMismatch {
            name: "paged attention pool".into(),
            expected: vec![pool.keys.len() / block_len, heads, block_size, dim],
            actual: vec![pool.keys.len(), pool.values.len()],
        });
    }
    check_tables(seqs, block_size, pool.blocks())?;
    let view = |data| PagedView {
        data,
        seqs,
        heads,
        block_size,
    };
    let (k, v) = (view(pool.keys), view(pool.values));
    Ok(attend_paged(q, n_heads, heads, dim, seqs, &k, &v))
}

/// `softmax(q k^T / sqrt(dim), masked) v` over contiguous slices: returns
/// `[batch, heads, queries, dim]`.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if a slice does not match `shape`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[bool]>,
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    attention_strided(
        q,
        Strided::contiguous(k, shape),
        Strided::contiguous(v, shape),
        mask,
        shape,
    )
}

/// [`attention`] with keys and values read in place through [`Strided`] views.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if a slice or view does not match `shape`.
pub fn attention_strided(
    q: &[f32],
    k: Strided<'_>,
    v: Strided<'_>,
    mask: Option<&[bool]>,
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    attention_laid_out(q, QueryLayout::HeadMajor, k, v, mask, shape)
}

/// [`attention_strided`] with queries, and the output, in `layout`.
///
/// # Errors
///
/// As [`attention_strided`], and [`LlamaError::ShapeMismatch`] if a token-major layout
/// does not fold into `shape.queries`.
pub fn attention_laid_out(
    q: &[f32],
    layout: QueryLayout,
    k: Strided<'_>,
    v: Strided<'_>,
    mask: Option<&[bool]>,
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    if let QueryLayout::TokenMajor { seq, groups } = layout
        && seq.checked_mul(groups) != Some(shape.queries)
    {
        return Err(LlamaError::ShapeMismatch {
            name: "attention query layout".into(),
            expected: vec![shape.queries],
            actual: vec![seq, groups],
        });
    }
    let AttentionShape {
        batch,
        heads,
        queries,
        keys,
        dim,
        mask_heads,
    } = shape;
    let check = |name: &str, len: usize, want: usize| {
        if len == want {
            Ok(())
        } else {
            Err(LlamaError::ShapeMismatch {
                name: format!("attention {name}"),
                expected: vec![want],
                actual: vec![len],
            })
        }
    };
    check("queries", q.len(), batch * heads * queries * dim)?;
    for (name, view) in [("keys", &k), ("values", &v)] {
        if !view.covers(shape) {
            return Err(LlamaError::ShapeMismatch {
                name: format!("attention {name}"),
                expected: vec![batch, heads, keys, dim],
                actual: vec![view.data.len()],
            });
        }
    }
    if let Some(m) = mask {
        if mask_heads != 1 && mask_heads != heads {
            return Err(LlamaError::invalid(
                "mask heads",
                mask_heads,
                "must be 1 or heads",
            ));
        }
        check("mask", m.len(), batch * mask_heads * queries * keys)?;
    }
    // A token's query heads over one key/value head are adjacent in a token-major
    // layout (and see the same keys when their mask rows agree).
    let group_hint = match layout {
        QueryLayout::TokenMajor { groups, .. } => groups,
        QueryLayout::HeadMajor => 1,
    };
    Ok(attend_queries(q, dim, &k, &v, keys, group_hint, |index| {
        let (b, h, i) = layout.locate(index, heads, queries);
        let mask_base = (b * mask_heads + if mask_heads == 1 { 0 } else { h }) * queries;
        let hidden = mask.map(|m| &m[(mask_base + i) * keys..(mask_base + i + 1) * keys]);
        (b, h, hidden, keys)
    }))
}

/// Attention of every `dim`-value query vector of `q` (the output has their layout):
/// `locate(index)` says which row and key/value head query `index` belongs to, which
/// keys it may not see, and how many keys it has. Every query is independent: the work
/// is split by queries, not only by (row, head) (a prompt's 3 key/value heads on 2 cores
/// left one core idle a third of the time).
fn attend_queries<'a, 'm, V: KvView<'a>>(
    q: &[f32],
    dim: usize,
    k: &V,
    v: &V,
    keys_hint: usize,
    group_hint: usize,
    locate: impl Fn(usize) -> (usize, usize, Option<&'m [bool]>, usize) + Sync,
) -> Vec<f32> {
    let path = SimdPath::active();
    let scale = 1.0 / (dim as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    let n = q.len().checked_div(dim).unwrap_or(0);
    // About eight runs of queries per thread, in whole groups of the queries that may
    // share their keys, handed out in turn from the last: a prompt's later tokens see
    // more keys, and taking the largest runs first leaves the small ones to even out the
    // threads' ends (from the first, a 512-token prompt's last run started alone and left
    // the other core idle for 8% of the time).
    let group_hint = group_hint.clamp(1, MAX_GROUP);
    let per_chunk = n
        .div_ceil(8 * rayon::current_num_threads().max(1))
        .next_multiple_of(group_hint);
    let runs = n.div_ceil(per_chunk.max(1));
    let query = |index: usize| {
        let (b, h, hidden, keys) = locate(index);
        Query {
            q: &q[index * dim..(index + 1) * dim],
            hidden,
            k,
            v,
            b,
            h,
            keys,
            scale,
        }
    };
    let target = super::pool::Disjoint::new(&mut out);
    super::pool::for_each_chunk(runs, &|c| {
        let (start, end) = ((runs - 1 - c) * per_chunk, ((runs - c) * per_chunk).min(n));
        let mut scores = Scores::with_capacity(keys_hint);
        // The run's groups: consecutive queries that see the same keys (a token's query
        // heads over one key/value head), attended together.
        let mut groups = Vec::new();
        let mut index = start;
        while index < end {
            let first = query(index);
            let mut len = 1;
            while len < MAX_GROUP && index + len < end && first.sees_what(&query(index + len)) {
                len += 1;
            }
            groups.push((first.b, first.h, index, len));
            index += len;
        }
        // Taken key/value head by head (each head's tokens in order): the keys and values
        // of one head stay in the second-level cache from one token to the next, where
        // token by token (every head in turn) a 512-token prompt's eight heads, 2 MiB,
        // came from the third.
        groups.sort_by_key(|&(b, h, ..)| (b, h));
        let mut group = Vec::with_capacity(MAX_GROUP);
        for (k, &(b, h, index, len)) in groups.iter().enumerate() {
            group.clear();
            group.extend((index..index + len).map(query));
            // Whether another group of the run has this row and head (a prompt's other
            // tokens): then a staged view's keys are decoded once for them all.
            let shares = |other: Option<&(usize, usize, usize, usize)>| {
                other.is_some_and(|&(ob, oh, ..)| (ob, oh) == (b, h))
            };
            let keep =
                shares(k.checked_sub(1).and_then(|p| groups.get(p))) || shares(groups.get(k + 1));
            // SAFETY: queries `index .. index + len <= n` own values `index * dim ..` of
            // `out` (`n * dim` values), and only this run writes them.
            let o = unsafe { target.part(index * dim, len * dim) };
            attend_on(path, &group, &mut scores, keep, o);
        }
    });
    out
}

/// Most queries attended together (those of one key/value head: 3 in the demo model, 4
/// in Llama 3 8B, 8 at most here).
const MAX_GROUP: usize = 8;

/// Keys per block of a group's score and value loops: a block's keys (then values),
/// 16 KiB for 64-value heads, stay in L1 while each query of the group reads them, so a
/// key/value head is read from memory once for all its query heads, not once for each.
const KEY_BLOCK: usize = 64;

/// The visible keys of one query and their scores (then probabilities), in key order.
struct Scores {
    keys: Vec<usize>,
    values: Vec<f32>,
    /// Decoded keys or values of one block of [`KEY_BLOCK`] (staged views only).
    stage: Vec<f32>,
    /// A staged view's keys and values of one row and head, decoded once for the run's
    /// groups that share them.
    kept: Kept,
}

impl Scores {
    fn with_capacity(n: usize) -> Self {
        Self {
            keys: Vec::with_capacity(n),
            values: Vec::with_capacity(n),
            stage: Vec::new(),
            kept: Kept::default(),
        }
    }
}

/// Most keys of one head [`Kept`] decoded (8 MiB of keys and values for 128-value heads):
/// longer prompts decode block by block for each token.
const KEEP_KEYS: usize = 8192;

/// The first `count` keys and values of row `b`, head `h` of a staged view, decoded: a
/// prompt's tokens over one key/value head see the same first keys (each one more), and
/// decoding them once for all its tokens, not once per token, took a 512-token prompt's
/// attention over a q8_0 cache from 12.2-12.6 ms a 1B layer to about the f32 cache's.
#[derive(Default)]
struct Kept {
    /// The row and head, and the head size, of what is kept.
    of: Option<(usize, usize, usize)>,
    count: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl Kept {
    /// Keys and values `0..n` of `query`'s row and head decoded (what was kept for them
    /// extended, else dropped and decoded anew).
    fn cover<'a, V: KvView<'a>>(&mut self, query: &Query<'_, V>, n: usize, dim: usize) {
        let of = Some((query.b, query.h, dim));
        if self.of != of {
            self.of = of;
            self.count = 0;
        }
        if n <= self.count {
            return;
        }
        self.keys.resize(n * dim, 0.0);
        self.values.resize(n * dim, 0.0);
        for j in self.count..n {
            let at = j * dim..(j + 1) * dim;
            query
                .k
                .stage(query.b, query.h, j, &mut self.keys[at.clone()]);
            query.v.stage(query.b, query.h, j, &mut self.values[at]);
        }
        self.count = n;
    }
}

/// One query's attention inputs: it sees keys `0..keys` that `hidden` does not hide.
struct Query<'a, V> {
    q: &'a [f32],
    hidden: Option<&'a [bool]>,
    k: &'a V,
    v: &'a V,
    b: usize,
    h: usize,
    keys: usize,
    scale: f32,
}

impl<V> Query<'_, V> {
    /// Whether `other` sees the same keys and values as this query.
    fn sees_what(&self, other: &Self) -> bool {
        let hidden = match (self.hidden, other.hidden) {
            (None, None) => true,
            (Some(a), Some(b)) => std::ptr::eq(a, b) || a.get(..self.keys) == b.get(..self.keys),
            _ => false,
        };
        self.b == other.b && self.h == other.h && self.keys == other.keys && hidden
    }
}

/// [`attend`] compiled for the widest vectors of `path`. Only element-wise operations
/// (separate multiplies and adds, no fused ones) are vectorized by the compiler, so the
/// result is the same bits at every width; the dot products follow `path`'s own order.
fn attend_on<'a, V: KvView<'a>>(
    path: SimdPath,
    group: &[Query<'_, V>],
    scores: &mut Scores,
    keep: bool,
    out: &mut [f32],
) {
    on_simd_path!(
        path,
        attend['a, V: KvView<'a>](
            path: SimdPath,
            group: &[Query<'_, V>],
            scores: &mut Scores,
            keep: bool,
            out: &mut [f32],
        )
    );
}

/// A group of queries that see the same keys (one query alone, or a token's query heads
/// over one key/value head), each written to its `dim` values of `out` in turn. For
/// each query: scores of the visible keys in key order, their maximum, the
/// exponentials ([`exp`]) and their sum ([`sum_of`]), and `sum_j p_j v_j`
/// ([`weighted_sum`]), divided by the sum. The loops run over blocks of [`KEY_BLOCK`]
/// keys, each query of the group in turn, so a block is read from memory once; every
/// query's operations and their order are the same as alone.
#[inline(always)]
fn attend<'a, V: KvView<'a>>(
    path: SimdPath,
    group: &[Query<'_, V>],
    scores: &mut Scores,
    keep: bool,
    out: &mut [f32],
) {
    let Some(first) = group.first() else {
        return;
    };
    let dim = out.len() / group.len();
    let Scores {
        keys,
        values,
        stage,
        kept,
    } = scores;
    if V::STAGED {
        stage.resize(KEY_BLOCK * dim, 0.0);
    }
    // The visible keys: a run `first..end` (no mask, or a causal and padding mask, whose
    // visible keys are one run) without listing them, or else listed one by one.
    let run = match first.hidden {
        None => Some(0..first.keys),
        Some(hidden) => visible_run(&hidden[..first.keys]),
    };
    let list: &[usize] = match &run {
        Some(_) => &[],
        None => {
            keys.clear();
            let hidden = first.hidden.unwrap_or_default();
            keys.extend((0..first.keys).filter(|&j| !hidden[j]));
            keys
        }
    };
    let n = run.as_ref().map_or(list.len(), |r| r.len());
    let at = |i: usize| match &run {
        Some(r) => r.start + i,
        None => list[i],
    };
    // A staged view's first `n` keys and values decoded once for the groups that share
    // them (`keep`: the caller's run has more than one group of this row and head).
    let kept = (V::STAGED && keep && n <= KEEP_KEYS && run.as_ref().is_some_and(|r| r.start == 0))
        .then(|| {
            kept.cover(first, n, dim);
            &*kept
        });
    // Scores: query `g`'s are `values[g * n..(g + 1) * n]`.
    values.clear();
    values.resize(group.len() * n, 0.0);
    // This row and head's keys or values (`view`), kept decoded where `decoded` is.
    let source = |view, decoded| BlockSource {
        view,
        b: first.b,
        h: first.h,
        at: &at,
        run: run.as_ref().map(|r| r.start),
        decoded,
    };
    let keys_of = source(first.k, kept.map(|kept| &kept.keys[..n * dim]));
    for block in (0..n).step_by(KEY_BLOCK) {
        let end = (block + KEY_BLOCK).min(n);
        // The block's keys, looked up once for every query of the group.
        let mut keys: [&[f32]; KEY_BLOCK] = [&[]; KEY_BLOCK];
        let keys = &mut keys[..end - block];
        keys_of.block(block, dim, stage, keys);
        block_scores(path, group, keys, block, n, values);
    }
    let mut sums = [0f32; MAX_GROUP];
    for (s, sum) in values.chunks_exact_mut(n.max(1)).zip(&mut sums) {
        let max = largest(s);
        for p in s.iter_mut() {
            *p = exp(*p - max);
        }
        *sum = sum_of(s);
    }
    let values_of = source(first.v, kept.map(|kept| &kept.values[..n * dim]));
    // The usual head sizes accumulate in registers (local arrays the compiler keeps in
    // vector registers); others in `out`. Same operations, same order either way.
    match dim {
        // Two queries at once where AVX-512's 32 registers hold both one's sums (16) and
        // the other's.
        64 => {
            let pairs = path == SimdPath::Avx512;
            weighted_sums::<64, V>(group.len(), n, values, &values_of, stage, out, pairs)
        }
        128 => weighted_sums::<128, V>(group.len(), n, values, &values_of, stage, out, false),
        _ => {
            let mut one = vec![0f32; dim];
            for (o, p) in out.chunks_exact_mut(dim).zip(values.chunks_exact(n.max(1))) {
                // The same two interleaved sums as `weighted_sum`, in `o` and a second
                // buffer.
                o.fill(0.0);
                let mut odd = vec![0f32; dim];
                for (i, &p) in p.iter().enumerate().take(n) {
                    let acc = if i % 2 == 0 { &mut *o } else { &mut odd[..] };
                    let value = values_of.read(i, &mut one);
                    for (o, &x) in acc.iter_mut().zip(value) {
                        *o += p * x;
                    }
                }
                for (o, &x) in o.iter_mut().zip(&odd) {
                    *o += x;
                }
            }
        }
    }
    for (o, &sum) in out.chunks_exact_mut(dim).zip(&sums) {
        if sum > 0.0 {
            for o in o.iter_mut() {
                *o /= sum;
            }
        }
    }
}

/// The scores of a group's queries (query `g`'s are `values[g * n..]`) for one block of
/// keys, the visible keys `block .. block + keys.len()`: each `dot(q, k) * scale` as
/// [`dot`] computes it. On the AVX paths several queries at once over four keys at a
/// time ([`super::avx2::dot_tile`]: each key word loaded once for them all, and the sums
/// finished together); the same bits as one query at a time.
#[inline(always)]
fn block_scores<V>(
    path: SimdPath,
    group: &[Query<'_, V>],
    keys: &[&[f32]],
    block: usize,
    n: usize,
    values: &mut [f32],
) {
    let dim = group.first().map_or(0, |g| g.q.len());
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if dim.is_multiple_of(8) {
        // Four queries where AVX-512's 32 registers hold their 16 sums, then two (a
        // group of 3 or 6 heads); two on AVX2.
        if path == SimdPath::Avx512 {
            done = score_tiles::<4, V>(group, 0, keys, block, n, values);
        }
        if matches!(path, SimdPath::Avx512 | SimdPath::Avx2) {
            done = score_tiles::<2, V>(group, done, keys, block, n, values);
        }
    }
    for (query, s) in group.iter().zip(values.chunks_exact_mut(n)).skip(done) {
        // Four keys at a time from the first visible key on (blocks start at multiples
        // of 4); the last few one by one.
        let mut i = 0;
        while i + 4 <= keys.len() {
            let k = [keys[i], keys[i + 1], keys[i + 2], keys[i + 3]];
            let four = dot4(path, query.q, k).map(|d| d * query.scale);
            s[block + i..block + i + 4].copy_from_slice(&four);
            i += 4;
        }
        for (s, k) in s[block..].iter_mut().zip(keys).skip(i) {
            *s = dot(path, query.q, k) * query.scale;
        }
    }
}

/// [`block_scores`] for the group's queries from `from` on in tiles of `Q` (on AVX2, FMA
/// and F16C, `dim` a multiple of 8): returns where the queries it left start (after its
/// whole tiles).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn score_tiles<const Q: usize, V>(
    group: &[Query<'_, V>],
    from: usize,
    keys: &[&[f32]],
    block: usize,
    n: usize,
    values: &mut [f32],
) -> usize {
    let mut g = from;
    while g + Q <= group.len() {
        let q: [&[f32]; Q] = std::array::from_fn(|t| group[g + t].q);
        let mut i = 0;
        while i + 4 <= keys.len() {
            let k = [keys[i], keys[i + 1], keys[i + 2], keys[i + 3]];
            // SAFETY: the path holds AVX2, FMA and F16C, and AVX-512 F/VL where `Q` is 4
            // (the caller's match on `SimdPath::active`); every query and key holds `dim`
            // values, a multiple of 8.
            let four = unsafe {
                if let Ok(q4) = <[&[f32]; 4]>::try_from(&q[..]) {
                    let four = super::avx512::dot_tile4(q4, k);
                    std::array::from_fn(|t| four[t])
                } else {
                    super::avx2::dot_tile::<Q>(q, k)
                }
            };
            for (t, four) in four.into_iter().enumerate() {
                let at = (g + t) * n + block + i;
                let scale = group[g + t].scale;
                values[at..at + 4].copy_from_slice(&four.map(|d| d * scale));
            }
            i += 4;
        }
        for (i, &k) in keys.iter().enumerate().skip(i) {
            for t in 0..Q {
                let query = &group[g + t];
                values[(g + t) * n + block + i] = dot(SimdPath::Avx2, query.q, k) * query.scale;
            }
        }
        g += Q;
    }
    g
}

/// The keys or values a group of queries sees: vector `i` of the visible keys is the
/// view's vector `at(i)` of row `b`, head `h`.
struct BlockSource<'v, V, A> {
    view: &'v V,
    b: usize,
    h: usize,
    at: &'v A,
    /// Where the visible keys start when they are one run (`at(i)` is then `start + i`).
    run: Option<usize>,
    /// A staged view's vectors already decoded ([`Kept`]), every visible one.
    decoded: Option<&'v [f32]>,
}

impl<'a, 'v, V: KvView<'a>, A: Fn(usize) -> usize> BlockSource<'v, V, A> {
    /// Value `i`: in place, or decoded into `buffer` (`dim` values) for a staged view.
    #[inline(always)]
    fn read<'s>(&self, i: usize, buffer: &'s mut [f32]) -> &'s [f32]
    where
        'a: 's,
    {
        if V::STAGED {
            self.view.stage(self.b, self.h, (self.at)(i), buffer);
            buffer
        } else {
            self.view.vector(self.b, self.h, (self.at)(i), buffer.len())
        }
    }

    /// Vectors `block .. block + table.len()` of the visible keys into `table`: from the
    /// decoded ones, else decoded into `stage` (at least `table.len() * dim` values) for a
    /// staged view, else read in place (one lookup per paged block where the visible
    /// keys are one run).
    #[inline(always)]
    fn block<'s>(&self, block: usize, dim: usize, stage: &'s mut [f32], table: &mut [&'s [f32]])
    where
        'a: 's,
        'v: 's,
    {
        if let Some(decoded) = self.decoded {
            for (vector, decoded) in table
                .iter_mut()
                .zip(decoded[block * dim..].chunks_exact(dim))
            {
                *vector = decoded;
            }
        } else if V::STAGED {
            for (i, out) in stage.chunks_exact_mut(dim).take(table.len()).enumerate() {
                self.view.stage(self.b, self.h, (self.at)(block + i), out);
            }
            let staged: &'s [f32] = stage;
            for (vector, staged) in table.iter_mut().zip(staged.chunks_exact(dim)) {
                *vector = staged;
            }
        } else if let Some(start) = self.run {
            self.view.vectors(self.b, self.h, start + block, dim, table);
        } else {
            for (i, vector) in table.iter_mut().enumerate() {
                *vector = self.view.vector(self.b, self.h, (self.at)(block + i), dim);
            }
        }
    }
}

/// [`weighted_sum`] for each of a group's `queries` (probabilities `probs[g * n..]`),
/// block by block of [`KEY_BLOCK`] keys (decoded into `stage` first for a staged view),
/// into `out` (`D` values per query).
#[inline(always)]
fn weighted_sums<'a, const D: usize, V: KvView<'a>>(
    queries: usize,
    n: usize,
    probs: &[f32],
    values: &BlockSource<'_, V, impl Fn(usize) -> usize>,
    stage: &mut [f32],
    out: &mut [f32],
    pairs: bool,
) {
    let mut acc = [[[0f32; D]; 2]; MAX_GROUP];
    for block in (0..n).step_by(KEY_BLOCK) {
        let end = (block + KEY_BLOCK).min(n);
        // The block's values, looked up once for every query of the group.
        let mut vectors: [&[f32]; KEY_BLOCK] = [&[]; KEY_BLOCK];
        let vectors = &mut vectors[..end - block];
        values.block(block, D, stage, vectors);
        let probs_of = |g: usize| &probs[g * n + block..g * n + end];
        let mut g = 0;
        if pairs {
            while g + 2 <= queries {
                let (a, b) = acc.split_at_mut(g + 1);
                weighted_sum::<D, 2>(
                    [&mut a[g], &mut b[0]],
                    vectors,
                    [probs_of(g), probs_of(g + 1)],
                );
                g += 2;
            }
        }
        for (g, acc) in acc.iter_mut().enumerate().take(queries).skip(g) {
            weighted_sum::<D, 1>([acc], vectors, [probs_of(g)]);
        }
    }
    for (o, [even, odd]) in out.chunks_exact_mut(D).zip(&acc) {
        for d in 0..D {
            o[d] = even[d] + odd[d];
        }
    }
}

/// `sum_j p_j v_j` of each of `Q` queries over one block of the visible keys
/// (`values[i]` with query `q`'s probability `probs[q][i]`, the block starting at an even
/// place among the visible keys), continued in `acc[q]`: the terms go alternately into
/// two sums (even and odd places in key order), each taken in key order; the result is
/// their sum. Two independent chains of additions instead of one (an addition waits for
/// the previous one's result). Each value is read once for all `Q` queries; each query's
/// operations and their order are the same whatever `Q`.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn weighted_sum<const D: usize, const Q: usize>(
    acc: [&mut [[f32; D]; 2]; Q],
    values: &[&[f32]],
    probs: [&[f32]; Q],
) {
    let mut sums: [[[f32; D]; 2]; Q] = std::array::from_fn(|q| *acc[q]);
    let vector = |i: usize| -> &[f32; D] { values[i].try_into().unwrap_or(&[0.0; D]) };
    let mut i = 0;
    while i + 1 < values.len() {
        let (v0, v1) = (vector(i), vector(i + 1));
        for q in 0..Q {
            let (p0, p1) = (probs[q][i], probs[q][i + 1]);
            let [even, odd] = &mut sums[q];
            for d in 0..D {
                even[d] += p0 * v0[d];
                odd[d] += p1 * v1[d];
            }
        }
        i += 2;
    }
    if i < values.len() {
        let v0 = vector(i);
        for q in 0..Q {
            let p0 = probs[q][i];
            for d in 0..D {
                sums[q][0][d] += p0 * v0[d];
            }
        }
    }
    for (acc, sums) in acc.into_iter().zip(sums) {
        *acc = sums;
    }
}

/// The visible keys of a mask row (`true` hides a key) as one run `first..end`, if they
/// are one (`0..0` if none is visible).
fn visible_run(hidden: &[bool]) -> Option<std::ops::Range<usize>> {
    let Some(first) = hidden.iter().position(|&h| !h) else {
        return Some(0..0);
    };
    let end = hidden
        .iter()
        .rposition(|&h| !h)
        .map_or(first, |last| last + 1);
    (!hidden[first..end].contains(&true)).then_some(first..end)
}

/// The sum of the probabilities in one fixed order: 16 partial sums (term `i` goes to
/// sum `i % 16`, each in key order), then `t[l] = s[l] + s[l + 8]` finished as the
/// kernels' 8-lane order (see [`super::cpu`]). Element-wise adds only, so the bits are
/// the same at every vector width.
#[inline(always)]
fn sum_of(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = values.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (s, &v) in lanes.iter_mut().zip(chunk) {
            *s += v;
        }
    }
    for (s, &v) in lanes.iter_mut().zip(rest) {
        *s += v;
    }
    finish(&std::array::from_fn(|l| lanes[l] + lanes[l + 8]))
}

/// Four dot products of `q` on `path`, each as [`dot`] computes it.
#[inline(always)]
fn dot4(path: SimdPath, q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if matches!(path, SimdPath::Avx2 | SimdPath::Avx512) && q.len().is_multiple_of(8) {
        // SAFETY: the path is supported by this CPU (`SimdPath::active`); the keys hold
        // `q.len()` values, a multiple of 8.
        return unsafe { super::avx2::dot4(q, k) };
    }
    k.map(|k| dot(path, q, k))
}

/// `e^x` for the softmax (`x <= 0`), to about 2 ulp: a power of two times a degree-7
/// polynomial of the remainder (Cephes' `expf` coefficients). Plain multiplies and adds,
/// so it gives the same bits on every CPU and at every vector width. Inputs are clamped
/// to [-87, 88].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    // `n` as an integer, from `t`'s bits: `t` is `ROUND + n` with `|n| <= 127`, so `n`
    // is the difference of the two floats' bits (their exponents are the same). This is
    // `n as i32` for every number; unlike that saturating cast, which compiles to a
    // scalar conversion and compare per value, it vectorizes. (A NaN `x` gives a NaN
    // either way.)
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    e * f32::from_bits((ni.wrapping_add(127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// A pool's keys and values, `n` random values each.
    fn random_pool(n: usize, rng: &mut StdRng) -> (Vec<f32>, Vec<f32>) {
        (random(n, rng), random(n, rng))
    }

    /// The f32 pool of `keys` and `values`.
    fn paged_pool<'a>(
        keys: &'a [f32],
        values: &'a [f32],
        heads: usize,
        block_size: usize,
        dim: usize,
    ) -> PagedPool<'a> {
        PagedPool {
            keys,
            values,
            heads,
            block_size,
            dim,
        }
    }

    #[test]
    fn visible_keys_are_a_run_only_when_they_are_one() {
        let (t, f) = (true, false);
        assert_eq!(visible_run(&[t, t, f, f, f, t]), Some(2..5));
        assert_eq!(visible_run(&[f, f, f]), Some(0..3));
        assert_eq!(visible_run(&[t, t]), Some(0..0));
        assert_eq!(visible_run(&[]), Some(0..0));
        assert_eq!(visible_run(&[t, f, t, f]), None);
        assert_eq!(visible_run(&[f, t, t, f]), None);
    }

    #[test]
    fn matches_a_plain_softmax_and_ignores_hidden_keys() {
        let mut rng = StdRng::seed_from_u64(5);
        let (keys, dim) = (7, 64);
        let shape = AttentionShape {
            batch: 1,
            heads: 1,
            queries: 1,
            keys,
            dim,
            mask_heads: 1,
        };
        let (q, k, v) = (
            random(dim, &mut rng),
            random(keys * dim, &mut rng),
            random(keys * dim, &mut rng),
        );
        let out = attention(&q, &k, &v, None, shape).unwrap();
        let s: Vec<f64> = k
            .chunks(dim)
            .map(|kj| {
                kj.iter()
                    .zip(&q)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>()
                    / 8.0
            })
            .collect();
        let max = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = e.iter().sum();
        for d in 0..dim {
            let want: f64 = (0..keys)
                .map(|j| e[j] * f64::from(v[j * dim + d]))
                .sum::<f64>()
                / total;
            assert!((f64::from(out[d]) - want).abs() < 1e-5);
        }
        // Hiding the first two keys equals dropping them, to the bit.
        let mut mask = vec![false; keys];
        mask[..2].fill(true);
        let hidden = attention(&q, &k, &v, Some(&mask), shape).unwrap();
        let dropped = attention(
            &q,
            &k[2 * dim..],
            &v[2 * dim..],
            None,
            AttentionShape {
                keys: keys - 2,
                ..shape
            },
        )
        .unwrap();
        assert_eq!(hidden, dropped);
        // Keys hidden in the middle (not one run) too: keys 1 and 4 of 7.
        let mut holes = vec![false; keys];
        holes[1] = true;
        holes[4] = true;
        let kept = |x: &[f32]| -> Vec<f32> {
            x.chunks(dim)
                .enumerate()
                .filter(|(j, _)| !holes[*j])
                .flat_map(|(_, c)| c.to_vec())
                .collect()
        };
        let with_holes = attention(&q, &k, &v, Some(&holes), shape).unwrap();
        let without = attention(
            &q,
            &kept(&k),
            &kept(&v),
            None,
            AttentionShape {
                keys: keys - 2,
                ..shape
            },
        )
        .unwrap();
        assert_eq!(with_holes, without);
        // The softmax's exponential is within 2e-7 relative of f64's on [-87, 0].
        for i in 0..1990 {
            let x = -(i as f32) * 0.0437;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            assert!((got - want).abs() <= 2e-7 * want, "{x}: {got} vs {want}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));

        assert_err!(
            attention(&q, &k[1..], &v, None, shape),
            LlamaError::ShapeMismatch { name, .. } if name == "attention keys"
        );

        // Keys and values read in place from a larger cache (3 spare columns, and an
        // offset) give the same bits as contiguous copies.
        let cap = keys + 3;
        let pad = |src: &[f32]| {
            let mut buf = vec![f32::NAN; 5 + cap * dim];
            buf[5..5 + keys * dim].copy_from_slice(src);
            buf
        };
        let (kb, vb) = (pad(&k), pad(&v));
        let view = |data| Strided {
            data,
            offset: 5,
            strides: [cap * dim, cap * dim, dim],
        };
        let strided = attention_strided(&q, view(&kb), view(&vb), None, shape).unwrap();
        assert_eq!(strided, out);
        let short = Strided {
            data: &kb[..5 + (keys - 1) * dim],
            ..view(&kb)
        };
        assert_err!(
            attention_strided(&q, short, view(&vb), None, shape),
            LlamaError::ShapeMismatch { name, .. } if name == "attention keys"
        );
    }

    #[test]
    fn exp_takes_the_power_of_two_from_the_rounding_bits_exactly() {
        // `exp` as first written: the power of two from a saturating cast of `n`.
        fn with_cast(x: f32) -> f32 {
            let x = x.clamp(-87.0, 88.0);
            let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let r = (x - n * 0.693_359_4) - n * -2.121_944_4e-4;
            let mut p = 1.987_569_1e-4_f32;
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                p = p * r + c;
            }
            (p * (r * r) + r + 1.0) * f32::from_bits(((n as i32 + 127) as u32) << 23)
        }
        let mut rng = StdRng::seed_from_u64(11);
        let xs = (0..20_000)
            .map(|_| rng.random_range(-100.0f32..100.0))
            .chain((-200..=200).map(|i| i as f32 * 0.5))
            .chain([
                -87.0,
                88.0,
                -0.0,
                f32::MIN,
                f32::MAX,
                f32::INFINITY,
                f32::NEG_INFINITY,
            ]);
        for x in xs {
            assert_eq!(exp(x).to_bits(), with_cast(x).to_bits(), "{x}");
        }
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn token_major_queries_give_the_head_major_bits() {
        let mut rng = StdRng::seed_from_u64(8);
        let (batch, heads, groups, seq, keys, dim) = (2, 3, 2, 5, 9, 64);
        let shape = AttentionShape {
            batch,
            heads,
            queries: groups * seq,
            keys,
            dim,
            mask_heads: 1,
        };
        let (k, v) = (
            random(batch * heads * keys * dim, &mut rng),
            random(batch * heads * keys * dim, &mut rng),
        );
        let mask: Vec<bool> = (0..batch * groups * seq * keys)
            .map(|i| i % 7 == 3)
            .collect();
        // Token-major queries [batch, seq, heads * groups, dim] and the same values
        // rearranged head-major [batch, heads, groups * seq, dim].
        let tokens = random(batch * seq * heads * groups * dim, &mut rng);
        let at = |b: usize, s: usize, h: usize, g: usize| {
            (((b * seq + s) * heads + h) * groups + g) * dim
        };
        let mut head_major = Vec::new();
        for b in 0..batch {
            for h in 0..heads {
                for g in 0..groups {
                    for s in 0..seq {
                        head_major.extend_from_slice(&tokens[at(b, s, h, g)..at(b, s, h, g) + dim]);
                    }
                }
            }
        }
        let want = attention(&head_major, &k, &v, Some(&mask), shape).unwrap();
        let layout = QueryLayout::TokenMajor { seq, groups };
        let contiguous = |data| Strided::contiguous(data, shape);
        let got = attention_laid_out(
            &tokens,
            layout,
            contiguous(&k),
            contiguous(&v),
            Some(&mask),
            shape,
        )
        .unwrap();
        let mut i = 0;
        for b in 0..batch {
            for h in 0..heads {
                for g in 0..groups {
                    for s in 0..seq {
                        assert_eq!(got[at(b, s, h, g)..at(b, s, h, g) + dim], want[i..i + dim]);
                        i += dim;
                    }
                }
            }
        }
        let bad = QueryLayout::TokenMajor { seq: 4, groups };
        assert_err!(
            attention_laid_out(&tokens, bad, contiguous(&k), contiguous(&v), None, shape),
            LlamaError::ShapeMismatch { name, .. } if name == "attention query layout"
        );
    }

    #[test]
    fn grouped_query_heads_give_each_head_alone_bits() {
        // A token's 3 query heads over one key/value head see the same keys (a causal
        // mask, or none), so they are attended together in blocks of KEY_BLOCK keys; each
        // must give the bits it gives alone. Key counts cross block boundaries and are
        // odd; 32-value heads take the generic path.
        let mut rng = StdRng::seed_from_u64(21);
        for (keys, dim, masked) in [(150, 64, true), (131, 64, false), (70, 32, true)] {
            let (heads, groups, seq) = (2, 3, 4);
            let shape = AttentionShape {
                batch: 1,
                heads,
                queries: groups * seq,
                keys,
                dim,
                mask_heads: 1,
            };
            let k = random(heads * keys * dim, &mut rng);
            let v = random(heads * keys * dim, &mut rng);
            // Token s sees keys 0..keys - seq + s + 1, the same for each of its groups.
            let mask: Vec<bool> = (0..groups * seq * keys)
                .map(|i| {
                    let (row, j) = (i / keys, i % keys);
                    j > keys - seq + row % seq
                })
                .collect();
            let mask = masked.then_some(&mask[..]);
            let tokens = random(seq * heads * groups * dim, &mut rng);
            let layout = QueryLayout::TokenMajor { seq, groups };
            let contiguous = |data| Strided::contiguous(data, shape);
            let got =
                attention_laid_out(&tokens, layout, contiguous(&k), contiguous(&v), mask, shape)
                    .unwrap();
            for s in 0..seq {
                for h in 0..heads {
                    for g in 0..groups {
                        let at = ((s * heads + h) * groups + g) * dim;
                        let one = AttentionShape {
                            heads: 1,
                            queries: 1,
                            ..shape
                        };
                        let row = g * seq + s;
                        let alone = attention(
                            &tokens[at..at + dim],
                            &k[h * keys * dim..(h + 1) * keys * dim],
                            &v[h * keys * dim..(h + 1) * keys * dim],
                            mask.map(|m| &m[row * keys..(row + 1) * keys]),
                            one,
                        )
                        .unwrap();
                        assert_eq!(got[at..at + dim], alone[..], "{keys} keys, token {s}");
                    }
                }
            }
        }
    }

    /// The AVX2 + F16C row decoders give [`KvCacheType::decode`]'s bits for every type,
    /// at head sizes with and without a tail of fewer than 8 values (f16).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_row_decoders_give_the_portable_bits() {
        if !matches!(SimdPath::active(), SimdPath::Avx2 | SimdPath::Avx512) {
            eprintln!("skipped: this CPU (or LLAMA_BURN_SIMD) has no AVX2 path");
            return;
        }
        let mut rng = StdRng::seed_from_u64(7);
        for ty in KvCacheType::ALL {
            for dim in [32, 64, 128, 36] {
                let Ok(row_bytes) = ty.row_bytes(dim) else {
                    continue;
                };
                let x: Vec<f32> = (0..dim).map(|_| rng.random_range(-4.0..4.0)).collect();
                let mut bytes = vec![0u8; row_bytes];
                ty.encode(&x, &mut bytes);
                let (mut want, mut got) = (vec![0f32; dim], vec![f32::NAN; dim]);
                ty.decode(&bytes, &mut want);
                // SAFETY: the AVX2 path is active, so this CPU has AVX2, FMA and F16C.
                unsafe { super::super::avx2::decode_kv_row(ty, &bytes, &mut got) };
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty} at head size {dim}");
            }
        }
    }

    /// Every type's encoded pool gives, to the bit, what the f32 kernel gives over the
    /// same rows decoded: for sequences longer than a block of staged keys, at both the
    /// unrolled head size (64) and another (32), with keys and values of different
    /// types; and a sequence alone gives its bits in the batch.
    #[test]
    fn encoded_pools_give_the_bits_of_their_decoded_values() {
        let mut rng = StdRng::seed_from_u64(5);
        let types = [
            (KvCacheType::Q8_0, KvCacheType::Q4_0),
            (KvCacheType::Q4_0, KvCacheType::F32),
            (KvCacheType::F16, KvCacheType::Bf16),
            (KvCacheType::Bf16, KvCacheType::F16),
            (KvCacheType::F32, KvCacheType::Q8_0),
        ];
        for dim in [64, 32] {
            let (heads, groups, bs, pool_blocks) = (2, 3, 16, 24);
            let n_heads = heads * groups;
            let rows = pool_blocks * heads * bs;
            let keys = random(rows * dim, &mut rng);
            let values = random(rows * dim, &mut rng);
            // A prompt chunk of 5 after 150 keys (three staged blocks of 64), a decode step
            // after 70, a fresh prompt of 40 (runs of several of its tokens per head: their
            // keys decoded once, `Kept`).
            let tables: [Vec<BlockId>; 3] = [
                (0..10).map(|i| 23 - 2 * i).collect(),
                vec![0, 6, 12, 18, 2],
                vec![1, 3, 4],
            ];
            let seqs: Vec<PagedSeq<'_>> = [(5, 150), (1, 70), (40, 0)]
                .iter()
                .zip(&tables)
                .map(|(&(tokens, start), blocks)| PagedSeq {
                    tokens,
                    start,
                    blocks,
                })
                .collect();
            let tokens: usize = seqs.iter().map(|s| s.tokens).sum();
            let q = random(tokens * n_heads * dim, &mut rng);
            let encode = |ty: KvCacheType, data: &[f32]| {
                let row = ty.row_bytes(dim).unwrap();
                let mut bytes = vec![0u8; rows * row];
                let mut decoded = vec![0f32; rows * dim];
                for ((x, b), d) in data
                    .chunks_exact(dim)
                    .zip(bytes.chunks_exact_mut(row))
                    .zip(decoded.chunks_exact_mut(dim))
                {
                    ty.encode(x, b);
                    ty.decode(b, d);
                }
                (bytes, decoded)
            };
            for (kt, vt) in types {
                let (kb, kd) = encode(kt, &keys);
                let (vb, vd) = encode(vt, &values);
                let pool = EncodedPagedPool {
                    keys: (&kb, kt),
                    values: (&vb, vt),
                    heads,
                    block_size: bs,
                    dim,
                };
                let got = paged_attention_encoded(&q, n_heads, pool, &seqs).unwrap();
                let decoded = PagedPool {
                    keys: &kd,
                    values: &vd,
                    heads,
                    block_size: bs,
                    dim,
                };
                let want = paged_attention(&q, n_heads, decoded, &seqs).unwrap();
                assert_eq!(bits(&got), bits(&want), "k={kt} v={vt} dim {dim}");
                // The first sequence alone.
                let span = seqs[0].tokens * n_heads * dim;
                let alone = paged_attention_encoded(&q[..span], n_heads, pool, &seqs[..1]).unwrap();
                assert_eq!(bits(&alone), bits(&got[..span]), "k={kt} v={vt} alone");
                // Neither side is exact f32 in every pair: the encoding rounds something.
                let exact = PagedPool {
                    keys: &keys,
                    values: &values,
                    heads,
                    block_size: bs,
                    dim,
                };
                let f32_out = paged_attention(&q, n_heads, exact, &seqs).unwrap();
                assert_ne!(bits(&got), bits(&f32_out), "k={kt} v={vt} rounds something");
            }
            // A pool whose bytes are not whole blocks of rows: a typed error.
            let (kb, _) = encode(KvCacheType::Q8_0, &keys);
            let pool = EncodedPagedPool {
                keys: (&kb[1..], KvCacheType::Q8_0),
                values: (&kb[1..], KvCacheType::Q8_0),
                heads,
                block_size: bs,
                dim,
            };
            assert_err!(
                paged_attention_encoded(&q, n_heads, pool, &seqs),
                LlamaError::ShapeMismatch { name, .. } if name == "paged attention pool"
            );
        }
    }

    /// One query's attention written plainly in the module's order: each score `dot(q,
    /// k_j) * scale` on `path`, the maximum, `exp(s_j - max)`, their sum in 16 partial
    /// sums (term `j` to sum `j % 16`) finished as the 8-lane order, `p_j * v_j` into two
    /// sums (even and odd places) in key order, their sum, over the sum.
    fn reference_attention(path: SimdPath, q: &[f32], kv: &[(&[f32], &[f32])]) -> Vec<f32> {
        let dim = q.len();
        let scale = 1.0 / (dim as f32).sqrt();
        let s: Vec<f32> = kv.iter().map(|(k, _)| dot(path, q, k) * scale).collect();
        let max = s
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let p: Vec<f32> = s.iter().map(|&x| exp(x - max)).collect();
        let mut lanes = [0f32; 16];
        for (j, &x) in p.iter().enumerate() {
            lanes[j % 16] += x;
        }
        let sum = finish(&std::array::from_fn(|l| lanes[l] + lanes[l + 8]));
        let (mut even, mut odd) = (vec![0f32; dim], vec![0f32; dim]);
        for (j, (&pj, (_, v))) in p.iter().zip(kv).enumerate() {
            let acc = if j % 2 == 0 { &mut even } else { &mut odd };
            for (a, &x) in acc.iter_mut().zip(v.iter()) {
                *a += pj * x;
            }
        }
        even.iter()
            .zip(&odd)
            .map(|(e, o)| if sum > 0.0 { (e + o) / sum } else { e + o })
            .collect()
    }

    #[test]
    fn prompts_give_the_plain_order_bits_in_every_tile() {
        // Prompts through a paged pool: groups of 1, 3, 4 and 8 query heads (tiles of four
        // and two queries, and the rest one by one), keys past two blocks of 64 and not a
        // multiple of four, head sizes with and without the registers' sums (64, 128,
        // 40) and one not a multiple of 8 (12), each query against the plain reference.
        let mut rng = StdRng::seed_from_u64(17);
        let path = SimdPath::active();
        for (groups, dim, tokens, start) in [
            (4usize, 64usize, 2usize, 0usize),
            (4, 64, 70, 61),
            (8, 64, 9, 130),
            (3, 64, 5, 66),
            (1, 64, 6, 3),
            (4, 128, 7, 67),
            (2, 40, 5, 62),
            (4, 12, 3, 7),
        ] {
            let (heads, bs): (usize, usize) = (2, 16);
            let n_heads = heads * groups;
            let len = start + tokens;
            let blocks = len.div_ceil(bs);
            // The sequence's blocks in reverse order through the pool.
            let table: Vec<BlockId> = (0..blocks as BlockId).rev().collect();
            let block_len = heads * bs * dim;
            let (keys, values) = random_pool(blocks * block_len, &mut rng);
            let pool = paged_pool(&keys, &values, heads, bs, dim);
            let seqs = [PagedSeq {
                tokens,
                start,
                blocks: &table,
            }];
            let q = random(tokens * n_heads * dim, &mut rng);
            let got = paged_attention(&q, n_heads, pool, &seqs).unwrap();
            let at =
                |j: usize, h: usize| ((table[j / bs] as usize * heads + h) * bs + j % bs) * dim;
            for t in 0..tokens {
                for head in 0..n_heads {
                    let h = head / groups;
                    let kv: Vec<(&[f32], &[f32])> = (0..=start + t)
                        .map(|j| (&keys[at(j, h)..][..dim], &values[at(j, h)..][..dim]))
                        .collect();
                    let index = t * n_heads + head;
                    let want = reference_attention(path, &q[index * dim..][..dim], &kv);
                    assert_eq!(
                        bits(&got[index * dim..][..dim]),
                        bits(&want),
                        "{path:?} groups {groups} dim {dim} token {t} of {tokens} after {start}, head {head}"
                    );
                }
            }
        }
    }

    #[test]
    fn paged_attention_gives_the_contiguous_bits_through_block_tables() {
        let mut rng = StdRng::seed_from_u64(11);
        let (heads, groups, dim, bs, pool_blocks) = (3, 2, 64, 4, 12);
        let n_heads = heads * groups;
        let block_len = heads * bs * dim;
        let (keys, values) = random_pool(pool_blocks * block_len, &mut rng);
        let pool = paged_pool(&keys, &values, heads, bs, dim);
        // Three sequences: a prompt of 6 new tokens, a decode step after 9 tokens and a
        // chunk of 3 after 2, their blocks scattered through the pool.
        let tables: [&[BlockId]; 3] = [&[7, 2], &[0, 11, 5], &[9, 3]];
        let seqs: Vec<PagedSeq<'_>> = [(6, 0), (1, 9), (3, 2)]
            .iter()
            .zip(tables)
            .map(|(&(tokens, start), blocks)| PagedSeq {
                tokens,
                start,
                blocks,
            })
            .collect();
        let tokens: usize = seqs.iter().map(|s| s.tokens).sum();
        let q = random(tokens * n_heads * dim, &mut rng);
        let got = paged_attention(&q, n_heads, pool, &seqs).unwrap();

        // Each sequence alone, its keys copied out of its blocks into a contiguous
        // `[1, heads, len, dim]` cache, through the contiguous kernel with a causal mask.
        let mut first = 0;
        for seq in &seqs {
            let len = seq.start + seq.tokens;
            let copy = |data: &[f32]| {
                let mut out = Vec::with_capacity(heads * len * dim);
                for h in 0..heads {
                    for j in 0..len {
                        let block = seq.blocks[j / bs] as usize;
                        let at = ((block * heads + h) * bs + j % bs) * dim;
                        out.extend_from_slice(&data[at..at + dim]);
                    }
                }
                out
            };
            let (k, v) = (copy(&keys), copy(&values));
            let shape = AttentionShape {
                batch: 1,
                heads,
                queries: groups * seq.tokens,
                keys: len,
                dim,
                mask_heads: 1,
            };
            let mut mask = Vec::new();
            for _ in 0..groups {
                for s in 0..seq.tokens {
                    mask.extend((0..len).map(|j| j > seq.start + s));
                }
            }
            let span = seq.tokens * n_heads * dim;
            let want = attention_laid_out(
                &q[first..first + span],
                QueryLayout::TokenMajor {
                    seq: seq.tokens,
                    groups,
                },
                Strided::contiguous(&k, shape),
                Strided::contiguous(&v, shape),
                Some(&mask),
                shape,
            )
            .unwrap();
            assert_eq!(got[first..first + span], want[..]);
            first += span;
        }

        // A table too short for its tokens, a block outside the pool, queries of the
        // wrong size: typed errors.
        let short = [PagedSeq {
            tokens: 2,
            start: 7,
            blocks: &[1, 2],
        }];
        assert_err!(
            paged_attention(&q[..2 * n_heads * dim], n_heads, pool, &short),
            LlamaError::InvalidBatch(m) if m.contains("2 blocks in a pool of 12 cannot hold 9 tokens")
        );
        let outside = [PagedSeq {
            tokens: 1,
            start: 0,
            blocks: &[12],
        }];
        assert_err!(
            paged_attention(&q[..n_heads * dim], n_heads, pool, &outside),
            LlamaError::InvalidBatch(m) if m.contains("1 blocks in a pool of 12 cannot hold 1 tokens")
        );
        assert_err!(
            paged_attention(&q[1..], n_heads, pool, &seqs),
            LlamaError::ShapeMismatch { name, .. } if name == "paged attention queries"
        );
        assert_err!(
            paged_attention(&q, 4, pool, &seqs),
            LlamaError::InvalidBatch(m) if m.contains("4 query heads over 3")
        );
    }
}
