//! The paged KV cache: per layer one pool of fixed-size blocks, allocated once.
//!
//! Keys and values of layer `l` live in two tensors shaped
//! `[num_blocks, n_kv_heads, block_size, head_dim]` in the activations' float type, or,
//! for the other [`KvCacheType`]s, in two buffers of encoded rows in the same order (one
//! row per token and head, encoded when written; see the `kv_type` module): on the host for
//! the CPU backend, on the device ([`DeviceKvPool`]) for the CubeCL backends. A request's tokens sit in the blocks
//! of its block table (token `i` in block `table[i / block_size]`, slot
//! `i % block_size`); which block belongs to whom is the
//! [`BlockManager`](super::blocks::BlockManager)'s business, not this type's. The memory
//! held is the pool, always: writing a step's keys and values touches only their slots,
//! and nothing is copied when requests join or leave a batch.
//!
//! Attention reads a step's rows through their block tables: on the CPU backend our
//! kernel reads the pool in place (an encoded pool too, decoding 64 keys at a time into
//! a buffer that stays in L1: [`paged_attention_encoded`](crate::kernels::attention::paged_attention_encoded)) ([`paged_attention`](crate::kernels::attention::paged_attention));
//! elsewhere `gather_blocks` copies the blocks of a group of rows into one
//! `[rows, n_kv_heads, blocks * block_size, head_dim]` tensor for the backend's fused
//! attention, and that copy is dropped when the layer's attention returns.
//!
//! On the CPU backend (Flex) writes and gathers go straight to the pool's memory
//! (Flex's `slice_assign` copies the whole destination tensor on every call, which for a
//! pool means hundreds of megabytes per layer and step); on every other backend they
//! are portable Burn operations (`slice_assign`, `select`).

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use rayon::prelude::*;

use super::blocks::BlockId;
use super::kv_type::{KvCacheType, KvCacheTypes};
use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::kernels::pages::WeightBytes;
use crate::model::paged_batch::PagedBatch;

/// Where one token's keys and values go: `(block, slot within the block)`.
pub type Slot = (BlockId, usize);

/// Keys and values of one layer, `[num_blocks, n_kv_heads, block_size, head_dim]` each.
#[derive(Debug, Clone)]
enum LayerPool<B: Backend> {
    /// In the activations' float type ([`KvCacheType::F32`] keys and values).
    Float { k: Tensor<B, 4>, v: Tensor<B, 4> },
    /// Encoded on the host (any other types, on the CPU backend).
    Encoded { k: EncodedPool, v: EncodedPool },
    /// Encoded on the device (any other types, on the CubeCL backends).
    Device {
        k: DeviceKvPool<B>,
        v: DeviceKvPool<B>,
    },
}

/// Keys or values of one layer encoded in a [`KvCacheType`] on a backend's device: the
/// host encoded pool's bytes (one row of [`KvCacheType::row_bytes`] per
/// `(block, head, slot)`, in that order) four to a little-endian word of an integer
/// tensor, so that a block read from either is the same bytes. A row must be a whole
/// number of words (a head size that is a multiple of 64 for `q8_0`/`q4_0`, even for a
/// half type: every Llama model's). Written by [`LlamaBackend::paged_store_encoded`],
/// read by [`LlamaBackend::paged_attention_encoded`].
#[derive(Debug, Clone)]
pub struct DeviceKvPool<B: Backend> {
    words: Tensor<B, 1, Int>,
    ty: KvCacheType,
    num_blocks: usize,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
}

impl<B: Backend> DeviceKvPool<B> {
    /// A pool of `num_blocks` blocks of `block_size` tokens, `kv_heads` heads of
    /// `head_dim` values, every byte zero, on `device`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] (`kv_cache_type`) for a head size that is not a
    /// whole number of the type's blocks or whose row is not a whole number of 4-byte
    /// words; (`kv_budget`) for a pool of more than `2^31` words.
    pub fn zeros(
        ty: KvCacheType,
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
        device: &B::Device,
    ) -> Result<Self> {
        let row_bytes = ty.row_bytes(head_dim)?;
        if !row_bytes.is_multiple_of(4) {
            return Err(LlamaError::invalid(
                "kv_cache_type",
                ty,
                "the device cache needs rows of whole 4-byte words: a head size that is a \
                 multiple of 64 for q8_0 and q4_0",
            ));
        }
        let words = num_blocks
            .checked_mul(kv_heads)
            .and_then(|n| n.checked_mul(block_size))
            .and_then(|n| n.checked_mul(row_bytes / 4))
            .filter(|&n| n > 0 && i32::try_from(n).is_ok())
            .ok_or_else(|| {
                LlamaError::invalid(
                    "kv_budget",
                    num_blocks,
                    "a device KV pool holds between 1 and 2^31 - 1 words",
                )
            })?;
        Ok(Self {
            words: Tensor::zeros([words], device),
            ty,
            num_blocks,
            kv_heads,
            block_size,
            head_dim,
        })
    }

    /// The words: `[blocks * kv_heads * block_size * row_words]`.
    pub fn words(&self) -> &Tensor<B, 1, Int> {
        &self.words
    }

    /// The words, for a backend's store to write (see
    /// [`LlamaBackend::paged_store_encoded`]).
    pub fn words_mut(&mut self) -> &mut Tensor<B, 1, Int> {
        &mut self.words
    }

    /// How the rows are encoded.
    pub fn ty(&self) -> KvCacheType {
        self.ty
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Words per row (one token's head).
    pub fn row_words(&self) -> usize {
        self.ty.row_bytes(self.head_dim).unwrap_or(0) / 4
    }

    /// Words per block (every head and slot of one block).
    fn block_words(&self) -> usize {
        self.kv_heads * self.block_size * self.row_words()
    }
}

/// Keys or values of one layer encoded in a [`KvCacheType`], on the host: one row of
/// `row_bytes` per `(block, head, slot)`, in that order.
#[derive(Debug, Clone)]
pub(crate) struct EncodedPool {
    pub(crate) ty: KvCacheType,
    pub(crate) row_bytes: usize,
    pub(crate) bytes: WeightBytes,
}

impl EncodedPool {
    fn new(ty: KvCacheType, rows: usize, head_dim: usize) -> Result<Self> {
        let row_bytes = ty.row_bytes(head_dim)?;
        let len = rows.checked_mul(row_bytes).ok_or_else(|| {
            LlamaError::invalid("kv_budget", rows, "the KV pool does not fit in memory")
        })?;
        Ok(Self {
            ty,
            row_bytes,
            bytes: WeightBytes::zeroed(len),
        })
    }

    /// Encodes the rows of `values` (`[tokens, kv_heads * head_dim]`) into `slots`.
    fn write<B: Backend>(
        &mut self,
        values: &Tensor<B, 2>,
        slots: &[Slot],
        kv_heads: usize,
        block_size: usize,
    ) -> Result<()> {
        let head_dim = values.dims()[1] / kv_heads.max(1);
        let Self {
            ty,
            row_bytes,
            bytes,
        } = self;
        super::host::with_rows(values, |rows| {
            for (i, &(block, slot)) in slots.iter().enumerate().take(rows.len()) {
                let row = rows.row(i);
                for (h, x) in row.chunks_exact(head_dim).enumerate() {
                    let at = ((block as usize * kv_heads + h) * block_size + slot) * *row_bytes;
                    ty.encode(x, &mut bytes[at..at + *row_bytes]);
                }
            }
        })
        .ok_or_else(|| LlamaError::Runtime("the KV rows could not be read on the host".into()))
    }
}

/// Runs `store` on a layer's float pools taken out of the cache and puts back the pools
/// it returns, so that a backend writes them in place when the cache alone holds them
/// (Burn's `inplace`); returns what `store` gives beside them.
fn store_in_place<B: Backend, T>(
    keys: &mut Tensor<B, 4>,
    values: &mut Tensor<B, 4>,
    store: impl FnOnce((Tensor<B, 4>, Tensor<B, 4>)) -> (T, (Tensor<B, 4>, Tensor<B, 4>)),
) -> T {
    let mut out = None;
    keys.inplace(|keys| {
        let mut written = None;
        values.inplace(|values| {
            let (result, (keys, values)) = store((keys, values));
            out = Some(result);
            written = Some(keys);
            values
        });
        // `inplace` ran the closure: `written` holds the keys.
        written.unwrap_or_else(|| unreachable!("Tensor::inplace runs its closure"))
    });
    out.unwrap_or_else(|| unreachable!("Tensor::inplace runs its closure"))
}

/// The block pool of every layer.
#[derive(Debug, Clone)]
pub struct PagedKvCache<B: Backend> {
    layers: Vec<LayerPool<B>>,
    types: KvCacheTypes,
    num_blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Bytes one block of `block_size` tokens takes across all layers (keys and values of
/// `value_bytes` each: 4 for f32, 2 for a half type).
pub fn block_bytes(
    n_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    value_bytes: usize,
) -> usize {
    n_layers
        .saturating_mul(2)
        .saturating_mul(kv_heads)
        .saturating_mul(head_dim)
        .saturating_mul(block_size)
        .saturating_mul(value_bytes)
}

impl<B: Backend> PagedKvCache<B> {
    /// Allocates the pool in the activations' float type: `num_blocks` blocks of
    /// `block_size` tokens for each of `n_layers` layers.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for no blocks, or more than `2^32 - 1`.
    pub fn new(
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        device: &B::Device,
    ) -> Result<Self> {
        Self::check_blocks(num_blocks, block_size)?;
        let shape = [num_blocks, kv_heads, block_size, head_dim];
        let layers = (0..n_layers)
            .map(|_| LayerPool::Float {
                k: Tensor::zeros(shape, device),
                v: Tensor::zeros(shape, device),
            })
            .collect();
        Ok(Self {
            layers,
            types: KvCacheTypes::default(),
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
        })
    }

    /// Allocates the pool as [`new`](Self::new) does, keys and values stored in
    /// `types`: the backend's tensors for [`KvCacheType::F32`] keys and values, else
    /// encoded host buffers (the CPU backend only).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); [`LlamaError::InvalidParameter`] (`kv_cache_type`) for an
    /// encoded type on a backend that keeps its cache in its own tensors, or a head size
    /// that is not a whole number of the type's blocks.
    pub fn with_types(
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        types: KvCacheTypes,
        device: &B::Device,
    ) -> Result<Self>
    where
        B: LlamaBackend,
    {
        if types.is_float() {
            return Self::new(n_layers, num_blocks, block_size, kv_heads, head_dim, device);
        }
        Self::check_blocks(num_blocks, block_size)?;
        if B::encodes_kv_cache_on_device() && !B::encodes_kv_cache() {
            let pool =
                |ty| DeviceKvPool::zeros(ty, num_blocks, kv_heads, block_size, head_dim, device);
            let layers = (0..n_layers)
                .map(|_| {
                    Ok(LayerPool::Device {
                        k: pool(types.keys)?,
                        v: pool(types.values)?,
                    })
                })
                .collect::<Result<_>>()?;
            return Ok(Self {
                layers,
                types,
                num_blocks,
                block_size,
                kv_heads,
                head_dim,
            });
        }
        if !B::encodes_kv_cache() {
            return Err(LlamaError::invalid(
                "kv_cache_type",
                types,
                "this backend keeps its KV cache in its float type (f32); the other types \
                 run on the CPU and CubeCL backends",
            ));
        }
        let rows = num_blocks
            .checked_mul(kv_heads)
            .and_then(|n| n.checked_mul(block_size))
            .ok_or_else(|| {
                LlamaError::invalid(
                    "kv_budget",
                    num_blocks,
                    "the KV pool does not fit in memory",
                )
            })?;
        let layers = (0..n_layers)
            .map(|_| {
                Ok(LayerPool::Encoded {
                    k: EncodedPool::new(types.keys, rows, head_dim)?,
                    v: EncodedPool::new(types.values, rows, head_dim)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            types,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
        })
    }

    fn check_blocks(num_blocks: usize, block_size: usize) -> Result<()> {
        if num_blocks == 0 || block_size == 0 || u32::try_from(num_blocks).is_err() {
            return Err(LlamaError::invalid(
                "kv_budget",
                num_blocks,
                "the KV pool needs between 1 and 2^32 - 1 blocks",
            ));
        }
        Ok(())
    }

    /// How keys and values are stored.
    pub fn types(&self) -> KvCacheTypes {
        self.types
    }

    /// Blocks per layer pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes one block holds across every layer (in the pool's types).
    pub fn block_bytes(&self) -> usize {
        let rows = self.kv_heads.saturating_mul(self.block_size);
        let per_layer = match self.layers.first() {
            None => 0,
            Some(LayerPool::Float { k, .. }) => block_bytes(
                1,
                self.kv_heads,
                self.head_dim,
                self.block_size,
                k.dtype().size(),
            ),
            Some(LayerPool::Encoded { k, v }) => rows.saturating_mul(k.row_bytes + v.row_bytes),
            Some(LayerPool::Device { k, v }) => {
                rows.saturating_mul(4 * (k.row_words() + v.row_words()))
            }
        };
        per_layer.saturating_mul(self.layers.len())
    }

    /// Bytes held by the pool: everything this cache ever allocates.
    pub fn allocated_bytes(&self) -> usize {
        self.block_bytes() * self.num_blocks
    }

    /// Writes this step's keys and values of `layer` (`[tokens, kv_heads * head_dim]`
    /// each, one row per token) into their slots, through the backend's
    /// [`paged_store`](LlamaBackend::paged_store) (or encoded on the host).
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if an encoded pool's rows cannot be read on the host.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k: Tensor<B, 2>,
        v: Tensor<B, 2>,
        slots: &[Slot],
        batch: &PagedBatch<'_, B>,
    ) -> Result<()>
    where
        B: LlamaBackend,
    {
        let (kv_heads, block_size) = (self.kv_heads, self.block_size);
        let (keys, values) = match &mut self.layers[layer] {
            LayerPool::Float { k, v } => (k, v),
            LayerPool::Encoded { k: kp, v: vp } => {
                kp.write(&k, slots, kv_heads, block_size)?;
                return vp.write(&v, slots, kv_heads, block_size);
            }
            LayerPool::Device { k: kp, v: vp } => {
                B::paged_store_encoded(kp, k, batch)?;
                return B::paged_store_encoded(vp, v, batch);
            }
        };
        store_in_place(keys, values, |pools| {
            ((), B::paged_store(pools, k, v, slots, batch))
        });
        Ok(())
    }

    /// Rotates a step's queries and keys of `layer` and writes the keys and values into
    /// their slots, as [`write`](Self::write) does; returns the rotated queries. A float
    /// pool takes the backend's [`rope_paged_store`](LlamaBackend::rope_paged_store) (one
    /// kernel on the CubeCL backends); an encoded one the backend's RoPE, then its write.
    ///
    /// # Errors
    ///
    /// What RoPE reports (shapes); as [`write`](Self::write).
    pub(crate) fn write_rotated(
        &mut self,
        layer: usize,
        step: crate::model::attention::QkvStep<'_, B>,
        slots: &[Slot],
        batch: &PagedBatch<'_, B>,
    ) -> Result<Tensor<B, 2>>
    where
        B: LlamaBackend,
    {
        let LayerPool::Float { k: keys, v: values } = &mut self.layers[layer] else {
            let (q, k, v) = step.rotated()?;
            self.write(layer, k, v, slots, batch)?;
            return Ok(q);
        };
        let rotation = step.rope.rotation(step.angles);
        let (qk, v, q_dim) = (step.qk, step.v, step.q_dim);
        store_in_place(keys, values, |pools| {
            B::rope_paged_store(pools, qk, v, rotation, q_dim, slots, batch)
        })
    }

    /// A description of how a block's bytes are laid out ([`read_block`](Self::read_block)):
    /// the types, the float pool's dtype, layers, heads, head size and block size. Two
    /// caches with the same tag read each other's blocks.
    pub fn layout_tag(&self) -> String {
        let float = match self.layers.first() {
            Some(LayerPool::Float { k, .. }) => format!("{:?}", k.dtype()),
            _ => "encoded".into(),
        };
        format!(
            "keys {} values {} ({float}); layers {}; kv heads {}; head dim {}; block {}",
            self.types.keys,
            self.types.values,
            self.layers.len(),
            self.kv_heads,
            self.head_dim,
            self.block_size
        )
    }

    /// The contents of block `block` in every layer, as bytes: per layer its keys then
    /// its values, `[kv_heads, block_size, head_dim]` values (or encoded rows) each.
    /// [`block_bytes`](Self::block_bytes) long.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for a block outside the pool;
    /// [`LlamaError::Runtime`] if the backend cannot read a tensor back.
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>> {
        let b = self.check_block(block)?;
        let mut out = Vec::with_capacity(self.block_bytes());
        for layer in &self.layers {
            match layer {
                LayerPool::Float { k, v } => {
                    for pool in [k, v] {
                        let data = pool.clone().narrow(0, b, 1).into_data();
                        out.extend_from_slice(data.as_bytes());
                    }
                }
                LayerPool::Encoded { k, v } => {
                    for pool in [k, v] {
                        let span = self.kv_heads * self.block_size * pool.row_bytes;
                        out.extend_from_slice(&pool.bytes[b * span..(b + 1) * span]);
                    }
                }
                LayerPool::Device { k, v } => {
                    for pool in [k, v] {
                        let span = pool.block_words();
                        let words = pool
                            .words
                            .clone()
                            .narrow(0, b * span, span)
                            .into_data()
                            .convert::<i64>()
                            .into_vec::<i64>()
                            .map_err(|e| {
                                LlamaError::Runtime(format!("reading a KV block: {e:?}"))
                            })?;
                        // The integers hold the words' bits: an `i32` of any value.
                        out.extend(words.iter().flat_map(|&w| (w as u32).to_le_bytes()));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Writes `bytes` (laid out as [`read_block`](Self::read_block) gives them) into
    /// block `block` of every layer.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for a block outside the pool or bytes of another
    /// length than [`block_bytes`](Self::block_bytes).
    pub fn write_block(&mut self, block: BlockId, bytes: &[u8]) -> Result<()> {
        let b = self.check_block(block)?;
        if bytes.len() != self.block_bytes() {
            return Err(LlamaError::invalid(
                "kv_block",
                bytes.len(),
                "not the length of one block in this pool",
            ));
        }
        let (kv_heads, block_size, head_dim) = (self.kv_heads, self.block_size, self.head_dim);
        let mut rest = bytes;
        for layer in &mut self.layers {
            match layer {
                LayerPool::Float { k, v } => {
                    for pool in [k, v] {
                        let dtype = pool.dtype();
                        let span = kv_heads * block_size * head_dim * dtype.size();
                        let (mine, tail) = rest.split_at(span);
                        rest = tail;
                        let data = TensorData::from_bytes_vec(
                            mine.to_vec(),
                            [1, kv_heads, block_size, head_dim],
                            dtype,
                        );
                        write_block_into(pool, b, data);
                    }
                }
                LayerPool::Encoded { k, v } => {
                    for pool in [k, v] {
                        let span = kv_heads * block_size * pool.row_bytes;
                        let (mine, tail) = rest.split_at(span);
                        rest = tail;
                        pool.bytes[b * span..(b + 1) * span].copy_from_slice(mine);
                    }
                }
                LayerPool::Device { k, v } => {
                    for pool in [k, v] {
                        let span = pool.block_words();
                        let (mine, tail) = rest.split_at(4 * span);
                        rest = tail;
                        let words: Vec<i32> = mine
                            .as_chunks::<4>()
                            .0
                            .iter()
                            .map(|w| i32::from_le_bytes(*w))
                            .collect();
                        let device = pool.words.device();
                        let block =
                            Tensor::<B, 1, Int>::from_data(TensorData::new(words, [span]), &device);
                        let start = b * span;
                        // One range: Burn's slice of a 1-D tensor, not a vector.
                        #[allow(clippy::single_range_in_vec_init)]
                        let range = [start..start + span];
                        // The words are moved into the assignment: with no other
                        // reference, the backend writes the block in place instead of
                        // copying the whole pool.
                        pool.words.inplace(|words| words.slice_assign(range, block));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_block(&self, block: BlockId) -> Result<usize> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(LlamaError::invalid("kv_block", block, "outside the pool"));
        }
        Ok(b)
    }

    /// Layer `layer`'s pool in the float type: keys and values,
    /// `[blocks, kv_heads, block_size, head_dim]` each (`None` for an encoded pool).
    #[cfg(test)]
    pub(crate) fn layer(&self, layer: usize) -> Option<(&Tensor<B, 4>, &Tensor<B, 4>)> {
        match &self.layers[layer] {
            LayerPool::Float { k, v } => Some((k, v)),
            LayerPool::Encoded { .. } | LayerPool::Device { .. } => None,
        }
    }

    /// Attention of a step's queries `q` (`[tokens, n_heads * head_dim]`) over layer
    /// `layer`'s pool: the backend's [`paged_attention`](LlamaBackend::paged_attention)
    /// on a float pool, our CPU kernel on an encoded one.
    ///
    /// # Errors
    ///
    /// What the kernel reports (see [`LlamaBackend::paged_attention`]).
    pub(crate) fn attention(
        &self,
        layer: usize,
        q: Tensor<B, 2>,
        batch: &PagedBatch<'_, B>,
    ) -> Result<Tensor<B, 2>>
    where
        B: LlamaBackend,
    {
        use crate::kernels::attention::{EncodedPagedPool, paged_attention_encoded};
        let (k, v) = match &self.layers[layer] {
            LayerPool::Float { k, v } => return B::paged_attention(q, k, v, batch),
            LayerPool::Device { k, v } => return B::paged_attention_encoded(q, k, v, batch),
            LayerPool::Encoded { k, v } => (k, v),
        };
        let dims = q.dims();
        let device = q.device();
        let q = q
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| LlamaError::Runtime(format!("attention queries: {e:?}")))?;
        let pool = EncodedPagedPool {
            keys: (&k.bytes, k.ty),
            values: (&v.bytes, v.ty),
            heads: self.kv_heads,
            block_size: self.block_size,
            dim: self.head_dim,
        };
        let out = paged_attention_encoded(&q, batch.n_heads(), pool, batch.seqs())?;
        Ok(Tensor::from_data(TensorData::new(out, dims), &device))
    }
}

/// Writes one block's `data` (`[1, kv_heads, block_size, head_dim]` in the pool's dtype)
/// into block `b` of `pool`: in place on the CPU backend's f32 pools (a slice assignment
/// there copies the whole pool), else a slice assignment.
fn write_block_into<B: Backend>(pool: &mut Tensor<B, 4>, b: usize, data: TensorData) {
    let [_, kv_heads, block_size, head_dim] = pool.dims();
    let device = pool.device();
    let block = Tensor::<B, 4>::from_data(data, &device);
    let rows = block.clone().reshape([kv_heads * block_size, head_dim]);
    pool.inplace(|pool| {
        let span = kv_heads * block_size * head_dim;
        match super::host::write_in_place(pool, &rows, |memory, rows| {
            for i in 0..rows.len() {
                let at = b * span + i * head_dim;
                memory[at..at + head_dim].copy_from_slice(rows.row(i));
            }
        }) {
            Ok(pool) => pool,
            Err(pool) => {
                pool.slice_assign([b..b + 1, 0..kv_heads, 0..block_size, 0..head_dim], block)
            }
        }
    });
}

/// Writes `values` (`[tokens, kv_heads * head_dim]`) into `pool` (`[blocks, kv_heads,
/// block_size, head_dim]`) at `slots`: on the host where the pool lives there, else one
/// slice assignment per run of consecutive slots in one block (the portable
/// [`LlamaBackend::paged_store`]).
pub(crate) fn write_slots<B: Backend>(
    pool: Tensor<B, 4>,
    values: Tensor<B, 2>,
    slots: &[Slot],
) -> Tensor<B, 4> {
    let [_, kv_heads, block_size, head_dim] = pool.dims();
    let written = super::host::write_in_place(pool, &values, |memory, rows| {
        for (i, &(block, slot)) in slots.iter().enumerate().take(rows.len()) {
            let row = rows.row(i);
            for h in 0..kv_heads {
                let dst = ((block as usize * kv_heads + h) * block_size + slot) * head_dim;
                memory[dst..dst + head_dim].copy_from_slice(&row[h * head_dim..(h + 1) * head_dim]);
            }
        }
    });
    // Portable: one slice assignment per run of consecutive slots in one block.
    let mut pool = match written {
        Ok(done) => return done,
        Err(pool) => pool,
    };
    let mut t = 0;
    while t < slots.len() {
        let (block, start) = slots[t];
        let mut n = 1;
        while t + n < slots.len() && slots[t + n] == (block, start + n) {
            n += 1;
        }
        let b = block as usize;
        let run = values
            .clone()
            .slice([t..t + n, 0..kv_heads * head_dim])
            .reshape([1, n, kv_heads, head_dim])
            .swap_dims(1, 2);
        pool = pool.slice_assign([b..b + 1, 0..kv_heads, start..start + n, 0..head_dim], run);
        t += n;
    }
    pool
}

/// Copies the blocks of a layer's `pool` (`[blocks, kv_heads, block_size, head_dim]`)
/// listed in `tables` (`rows` tables of the same length, padded with any valid id; the
/// caller masks what lies past a row's length) into one
/// `[rows, kv_heads, blocks * block_size, head_dim]` tensor.
pub(crate) fn gather_blocks<B: Backend>(
    pool: &Tensor<B, 4>,
    tables: &[BlockId],
    rows: usize,
) -> Tensor<B, 4> {
    let [_, kv_heads, block_size, head_dim] = pool.dims();
    let blocks = tables.len() / rows.max(1);
    let shape = [rows, kv_heads, blocks * block_size, head_dim];
    let gathered = super::host::read_in_place(pool, |memory| {
        let span = block_size * head_dim;
        let per_row = kv_heads * blocks * span;
        let mut out = vec![0f32; rows * per_row];
        out.par_chunks_mut(per_row.max(1))
            .zip(tables.par_chunks(blocks.max(1)))
            .for_each(|(dst, table)| {
                for h in 0..kv_heads {
                    for (j, &block) in table.iter().enumerate() {
                        let src = (block as usize * kv_heads + h) * span;
                        let at = (h * blocks + j) * span;
                        dst[at..at + span].copy_from_slice(&memory[src..src + span]);
                    }
                }
            });
        out
    });
    if let Some(out) = gathered {
        return Tensor::from_data(TensorData::new(out, shape), &pool.device());
    }
    let device = pool.device();
    let ids: Vec<i64> = tables.iter().map(|&b| i64::from(b)).collect();
    let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tables.len()]), &device);
    pool.clone()
        .select(0, ids)
        .reshape([rows, blocks, kv_heads, block_size * head_dim])
        .swap_dims(1, 2)
        .reshape([rows, kv_heads, blocks * block_size, head_dim])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend as B, default_device};
    use crate::error::assert_err;

    fn values(tokens: usize, width: usize, base: f32) -> Tensor<B, 2> {
        let data: Vec<f32> = (0..tokens * width).map(|i| base + i as f32).collect();
        Tensor::from_data(TensorData::new(data, [tokens, width]), &default_device())
    }

    #[test]
    fn written_slots_are_read_back_through_block_tables() {
        let (heads, dim, bs) = (2, 3, 4);
        let mut cache = PagedKvCache::<B>::new(1, 5, bs, heads, dim, &default_device()).unwrap();
        // Row A: 6 tokens in blocks [3, 1]; row B: 2 tokens in block [0].
        let a_slots: Vec<Slot> = (0..6).map(|i| ([3, 1][i / bs], i % bs)).collect();
        let b_slots: Vec<Slot> = (0..2).map(|i| (0, i)).collect();
        let slots: Vec<Slot> = a_slots.iter().chain(&b_slots).copied().collect();
        let k = values(8, heads * dim, 0.0);
        let v = values(8, heads * dim, 1000.0);
        let seqs = vec![
            crate::model::attention::PagedSeq {
                tokens: 6,
                start: 0,
                blocks: &[3, 1],
            },
            crate::model::attention::PagedSeq {
                tokens: 2,
                start: 0,
                blocks: &[0],
            },
        ];
        let batch = PagedBatch::new(seqs, heads, bs, 5, &default_device()).unwrap();
        cache
            .write(0, k.clone(), v.clone(), &slots, &batch)
            .unwrap();
        let (pk, pv) = cache.layer(0).unwrap();
        let tables = [3, 1, 0, 0];
        let (gk, gv) = (gather_blocks(pk, &tables, 2), gather_blocks(pv, &tables, 2));
        assert_eq!(gk.dims(), [2, heads, 2 * bs, dim]);
        let gk = gk.into_data().to_vec::<f32>().unwrap();
        let gv = gv.into_data().to_vec::<f32>().unwrap();
        let k = k.into_data().to_vec::<f32>().unwrap();
        let v = v.into_data().to_vec::<f32>().unwrap();
        let at = |row: usize, h: usize, pos: usize, d: usize| {
            ((row * heads + h) * 2 * bs + pos) * dim + d
        };
        for (row, first, len) in [(0, 0, 6), (1, 6, 2)] {
            for pos in 0..len {
                for h in 0..heads {
                    for d in 0..dim {
                        let src = (first + pos) * heads * dim + h * dim + d;
                        assert_eq!(gk[at(row, h, pos, d)], k[src]);
                        assert_eq!(gv[at(row, h, pos, d)], v[src]);
                    }
                }
            }
        }
        assert_eq!(cache.allocated_bytes(), 5 * 2 * heads * bs * dim * 4);
    }

    #[test]
    fn a_block_read_out_writes_back_into_another_block_of_a_pool_of_its_layout() {
        use crate::cache::KvCacheType as T;
        let (heads, dim, bs, layers) = (2, 32, 4, 2);
        let device = default_device();
        for types in [
            KvCacheTypes::both(T::F32),
            KvCacheTypes::new(T::Q8_0, T::F16),
        ] {
            let new = || {
                PagedKvCache::<B>::with_types(layers, 3, bs, heads, dim, types, &device).unwrap()
            };
            let mut cache = new();
            let seqs = vec![crate::model::attention::PagedSeq {
                tokens: bs,
                start: 0,
                blocks: &[1],
            }];
            let batch = PagedBatch::new(seqs, heads, bs, 3, &device).unwrap();
            let slots: Vec<Slot> = (0..bs).map(|i| (1, i)).collect();
            for layer in 0..layers {
                let base = 10.0 * layer as f32;
                let (k, v) = (
                    values(bs, heads * dim, base),
                    values(bs, heads * dim, -base),
                );
                cache.write(layer, k, v, &slots, &batch).unwrap();
            }
            let bytes = cache.read_block(1).unwrap();
            assert_eq!(bytes.len(), cache.block_bytes(), "{types}");
            assert!(bytes.iter().any(|&b| b != 0));
            // Into block 2 of a fresh pool: the same bytes come back out.
            let mut other = new();
            assert_eq!(other.layout_tag(), cache.layout_tag());
            other.write_block(2, &bytes).unwrap();
            assert_eq!(other.read_block(2).unwrap(), bytes, "{types}");
            assert!(other.read_block(1).unwrap().iter().all(|&b| b == 0));
            assert_err!(
                other.write_block(3, &bytes),
                LlamaError::InvalidParameter {
                    name: "kv_block",
                    ..
                }
            );
            assert_err!(
                other.write_block(0, &bytes[1..]),
                LlamaError::InvalidParameter {
                    name: "kv_block",
                    ..
                }
            );
        }
    }

    #[test]
    fn a_zero_block_pool_is_an_error() {
        assert_err!(
            PagedKvCache::<B>::new(1, 0, 16, 1, 1, &default_device()),
            LlamaError::InvalidParameter {
                name: "kv_budget",
                ..
            }
        );
    }
}
