//! The backend chosen by the enabled cargo features, for examples and applications that
//! want "whatever the user built with". Priority when several are enabled:
//! `cuda` > `tch-gpu` > `tch-cpu` > `vulkan` > `wgpu` > `flex` (the CPU default).

#[cfg(feature = "cuda")]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::Cuda;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "cuda";
    /// The first CUDA device.
    pub fn default_device() -> burn::backend::cuda::CudaDevice {
        burn::backend::cuda::CudaDevice::default()
    }
}

#[cfg(all(feature = "tch-gpu", not(feature = "cuda")))]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::LibTorch;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "tch-gpu";
    /// The first CUDA device (Metal on macOS).
    pub fn default_device() -> burn::backend::libtorch::LibTorchDevice {
        if cfg!(target_os = "macos") {
            burn::backend::libtorch::LibTorchDevice::Mps
        } else {
            burn::backend::libtorch::LibTorchDevice::Cuda(0)
        }
    }
}

#[cfg(all(feature = "tch-cpu", not(any(feature = "cuda", feature = "tch-gpu"))))]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::LibTorch;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "tch-cpu";
    /// LibTorch on the CPU.
    pub fn default_device() -> burn::backend::libtorch::LibTorchDevice {
        burn::backend::libtorch::LibTorchDevice::Cpu
    }
}

#[cfg(all(
    feature = "vulkan",
    not(any(feature = "cuda", feature = "tch-gpu", feature = "tch-cpu"))
))]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::Vulkan;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "vulkan";
    /// The default GPU.
    pub fn default_device() -> burn::backend::wgpu::WgpuDevice {
        burn::backend::wgpu::WgpuDevice::default()
    }
}

#[cfg(all(
    feature = "wgpu",
    not(any(
        feature = "cuda",
        feature = "tch-gpu",
        feature = "tch-cpu",
        feature = "vulkan"
    ))
))]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::Wgpu;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "wgpu";
    /// The default GPU.
    pub fn default_device() -> burn::backend::wgpu::WgpuDevice {
        burn::backend::wgpu::WgpuDevice::default()
    }
}

#[cfg(not(any(
    feature = "cuda",
    feature = "tch-gpu",
    feature = "tch-cpu",
    feature = "vulkan",
    feature = "wgpu"
)))]
mod chosen {
    /// The selected backend.
    pub type DefaultBackend = burn::backend::Flex;
    /// Human-readable backend name.
    pub const BACKEND_NAME: &str = "flex (CPU)";
    /// The CPU.
    pub fn default_device() -> burn::backend::flex::FlexDevice {
        burn::backend::flex::FlexDevice
    }
}

pub use chosen::{BACKEND_NAME, DefaultBackend, default_device};

use burn::tensor::{
    Bool, DType, FloatDType, Int, Tensor, TensorData, backend::Backend, module::attention,
    ops::AttentionModuleOptions,
};

use crate::cache::paged::DeviceKvPool;
use crate::config::{FloatType, Precision};
use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;
use crate::model::paged_batch::PagedBatch;
use crate::sampling::{DeviceDraw, DeviceToken};

/// What llama-burn asks of a backend beyond Burn's own operations: a backend extension
/// in the manner of Burn's book (a trait on the backend whose default methods are the
/// portable path, overridden where a backend has a kernel of its own).
///
/// Implemented for every backend of this crate's features: the CPU backend (Flex) keeps
/// quantized weights in their blocks and multiplies them with our own kernels
/// ([`crate::kernels::cpu`]); Burn's CubeCL backends (cuda, wgpu, vulkan) run our CubeCL
/// kernels for paged attention and quantized projections (`crate::gpu`, with those
/// features); the others keep the defaults, so loading dequantizes and projections are
/// Burn's matmul.
pub trait LlamaBackend: Backend {
    /// Whether loading keeps weights in a supported block format
    /// ([`QuantFormat`](crate::kernels::QuantFormat)) instead of dequantizing them.
    fn keeps_quantized_weights() -> bool {
        false
    }

    /// Whether the backend compiles (and tunes) its kernels on first use, so that a
    /// model is worth running once at load ([`crate::Loader::warm_up`]). The default is
    /// `false`; the CubeCL backends say `true`.
    fn compiles_kernels() -> bool {
        false
    }

    /// Whether the `fast` products of many rows may take int8 tensor cores on `device`
    /// (the CubeCL backends on a device with `i8` fragments: see
    /// `gpu::TensorCores`). The default is `false`.
    fn int8_tensor_cores(_device: &Self::Device) -> bool {
        false
    }

    /// The largest weight, in bytes, that loading hands to the backend in one piece;
    /// larger matrices go in blocks of rows, concatenated on the device. The default,
    /// `None`, is no limit.
    fn max_upload_bytes() -> Option<usize> {
        None
    }

    /// Whether the paged KV cache may be stored in the encoded
    /// [`KvCacheType`](crate::cache::KvCacheType)s (f16, bf16, `q8_0`, `q4_0`), on the
    /// host, read by our CPU attention kernel. The default is `false`: the cache is the
    /// backend's own tensors in its float type. The CPU backend says `true`.
    fn encodes_kv_cache() -> bool {
        false
    }

    /// Whether the paged KV cache may be stored in the encoded
    /// [`KvCacheType`](crate::cache::KvCacheType)s on the device, in the backend's own
    /// integer tensors ([`DeviceKvPool`]), written by
    /// [`paged_store_encoded`](Self::paged_store_encoded) and read by
    /// [`paged_attention_encoded`](Self::paged_attention_encoded). The default is
    /// `false`; the CubeCL backends say `true`.
    fn encodes_kv_cache_on_device() -> bool {
        false
    }

    /// Writes a step's keys or values `x` (`[tokens, kv_heads * head_dim]`) into the
    /// encoded pool `pool` at the slots `batch`'s tables give its positions, each token's
    /// rows encoded from its own values alone, in place. The default refuses:
    /// only a backend that says [`encodes_kv_cache_on_device`](Self::encodes_kv_cache_on_device)
    /// implements it.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] (`kv_cache_type`) where the backend has no such
    /// kernel; [`LlamaError::ShapeMismatch`]/[`LlamaError::InvalidBatch`] for rows or a
    /// batch that do not fit the pool.
    fn paged_store_encoded(
        pool: &mut DeviceKvPool<Self>,
        x: Tensor<Self, 2>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<()> {
        let _ = (x, batch);
        Err(no_device_kv(pool.ty()))
    }

    /// [`paged_attention`](Self::paged_attention) over encoded pools: `q`
    /// `[tokens, n_heads * head_dim]` over `keys` and `values`, each key and value decoded
    /// where it is read (no decoded copy of the cache). The default refuses, as
    /// [`paged_store_encoded`](Self::paged_store_encoded) does.
    ///
    /// # Errors
    ///
    /// As [`paged_store_encoded`](Self::paged_store_encoded).
    fn paged_attention_encoded(
        q: Tensor<Self, 2>,
        keys: &DeviceKvPool<Self>,
        values: &DeviceKvPool<Self>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<Tensor<Self, 2>> {
        let _ = (q, values, batch);
        Err(no_device_kv(keys.ty()))
    }

    /// `x @ W^T` for activations `x` `[rows, in]` and a quantized `W` `[out, in]`:
    /// `[rows, out]`, in `precision` where the backend has both. The default dequantizes
    /// `W` and uses Burn's matmul (the backend's own float precision, whatever
    /// `precision` says).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `x` has not `W.cols()` columns.
    fn quantized_matmul(
        x: Tensor<Self, 2>,
        w: &QuantMatrix,
        precision: Precision,
    ) -> Result<Tensor<Self, 2>> {
        let _ = precision;
        check_quantized_input(x.dims()[1], w)?;
        let dense = Tensor::<Self, 2>::from_data(
            TensorData::new(w.dequantize()?, [w.rows(), w.cols()]),
            (&x.device(), x.dtype()),
        );
        Ok(x.matmul(dense.transpose()))
    }

    /// `x @ W` for activations `x` `[rows, in]` and dense weights `W` `[in, out]`, or,
    /// with `transposed`, `x @ W^T` for `W` `[out, in]` (the output head's
    /// `[vocab, d_model]` table): `[rows, out]`. The default is Burn's matmul (the
    /// transposed form as `(W x^T)^T`, which was the fastest form of the output head at
    /// 8-32 rows on the CPU backend, and equal at 1); the CubeCL
    /// backends use a kernel whose outputs do not depend on the batch.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] where a backend checks that `W` takes `x`'s columns.
    fn dense_matmul(
        x: Tensor<Self, 2>,
        w: &Tensor<Self, 2>,
        transposed: bool,
    ) -> Result<Tensor<Self, 2>> {
        Ok(if transposed {
            w.clone().matmul(x.transpose()).transpose()
        } else {
            x.matmul(w.clone())
        })
    }

    /// The feed-forward's gate and up projections and SwiGLU at once, `silu(x @ gate^T) *
    /// (x @ up^T)`, for two quantized matrices, where the backend has a kernel that does
    /// all three in one pass; `Ok(None)`, the default, where it has not (the caller then
    /// runs [`quantized_matmul`](Self::quantized_matmul) twice and
    /// [`swiglu`](Self::swiglu)). The CubeCL backends take two matrices of one format
    /// and shape.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `x`'s columns are not the matrices' inputs.
    fn quantized_swiglu(
        _x: Tensor<Self, 2>,
        _gate: &QuantMatrix,
        _up: &QuantMatrix,
        _precision: Precision,
    ) -> Result<Option<Tensor<Self, 2>>> {
        Ok(None)
    }

    /// `x @ [A | B]` for two quantized matrices `[n_a, in]` and `[n_b, in]` of any formats
    /// (a fused projection's parts, such as the queries and keys beside values of another
    /// format): `[rows, n_a + n_b]`, each output as [`quantized_matmul`](Self::quantized_matmul)
    /// computes it, in one launch where the backend can (the CubeCL backends), else
    /// `Ok(None)` (the default): the caller then runs the two products.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `x`'s columns are not the matrices' inputs.
    fn quantized_matmul_two(
        _x: Tensor<Self, 2>,
        _a: &QuantMatrix,
        _b: &QuantMatrix,
        _precision: Precision,
    ) -> Result<Option<Tensor<Self, 2>>> {
        Ok(None)
    }

    /// A quantized product with the work on one side of it in the same launch, where the
    /// backend fuses it ([`Around`]): `rms_norm(x) @ W^T` or `residual + x @ W^T`, with
    /// what goes `beside` `W` as [`quantized_swiglu`](Self::quantized_swiglu) and
    /// [`quantized_matmul_two`](Self::quantized_matmul_two) take it, each output the
    /// bits the separate operations give. `Ok(None)` where the backend has no such
    /// kernel (the default, and the CubeCL backends outside the `fast` precision): the
    /// caller then runs them apart ([`add_rms_norm`](Self::add_rms_norm) and the
    /// product). On the CubeCL backends a decode step's layer is then 6 launches, not 8.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `x`'s columns are not the matrices' inputs, the
    /// norm's weight not `x`'s width or the residual not the output's shape.
    fn fused_quantized_matmul(
        _x: Tensor<Self, 2>,
        _w: &QuantMatrix,
        _beside: Beside<'_>,
        _around: Around<'_, Self>,
        _precision: Precision,
    ) -> Result<Option<Tensor<Self, 2>>> {
        Ok(None)
    }

    /// The feed-forward gate: `silu(gate) * up`, element by element. The default is
    /// Burn's operations.
    ///
    /// # Errors
    ///
    /// Backends with a kernel of their own report what it cannot take.
    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Result<Tensor<Self, 2>> {
        Ok(burn::tensor::activation::silu(gate) * up)
    }

    /// The LoRA changes of a step's adapters to a projection's output rows: for each
    /// group, `y[r] += (x[r] @ a) @ b` for each row `r` of its `rows`, with `x` `[tokens,
    /// in]`, `a` `[in, rank]`, `b` `[rank, out]` (the scale folded in) and `y` `[tokens,
    /// out]`; every other row of `y` is returned as it is. Each row's change depends on
    /// that row alone. The default gathers each group's rows, multiplies with
    /// [`dense_matmul`](Self::dense_matmul) and adds the result back; the CPU backend
    /// has a kernel of its own (one fixed order of addition per row, every group in one
    /// pass over `y`).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] where a backend checks the shapes.
    fn lora_add(
        y: Tensor<Self, 2>,
        x: Tensor<Self, 2>,
        groups: &[LoraRows<'_, Self>],
    ) -> Result<Tensor<Self, 2>> {
        let mut y = y;
        for g in groups {
            let xs = x.clone().select(0, g.index.clone());
            let t = Self::dense_matmul(xs, g.a, false)?;
            let delta = Self::dense_matmul(t, g.b, false)?;
            y = y.select_assign(
                0,
                g.index.clone(),
                delta,
                burn::tensor::IndexingUpdateOp::Add,
            );
        }
        Ok(y)
    }

    /// Grouped-query attention of token-major queries: `q` `[batch * seq, n_heads * dim]`
    /// (a projection's output, RoPE applied), keys and values `[batch, n_kv_heads, keys,
    /// dim]`, `mask` `[batch, 1, groups * seq, keys]` over the folded queries (query
    /// heads sharing a key/value head folded into the query axis, `groups = n_heads /
    /// n_kv_heads`). Returns `[batch * seq, n_heads * dim]`. The default rearranges the
    /// queries for [`masked_attention`](Self::masked_attention) and the output back.
    ///
    /// # Errors
    ///
    /// As [`masked_attention`](Self::masked_attention).
    fn token_major_attention(
        q: Tensor<Self, 2>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Option<Tensor<Self, 4, Bool>>,
        batch: usize,
        n_heads: usize,
    ) -> Result<Tensor<Self, 2>> {
        let [_, n_kv, _, dim] = k.dims();
        let rows = q.dims()[0];
        let (seq, groups) = fold_heads(rows, &k.dims(), batch, n_heads)?;
        let q = q
            .reshape([batch, seq, n_heads, dim])
            .swap_dims(1, 2)
            .reshape([batch, n_kv, groups * seq, dim]);
        Ok(Self::masked_attention(q, k, v, mask)?
            .reshape([batch, n_heads, seq, dim])
            .swap_dims(1, 2)
            .reshape([rows, n_heads * dim]))
    }

    /// RMSNorm over the last axis of `x` (`[rows, d]`), scaled by `weight` (`[d]`):
    /// `x / sqrt(mean(x^2) + eps) * weight`. The default is Burn's operations.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `weight` does not have `d` values.
    /// A half-precision `x` is normalized in f32 (its squares summed, scaled and
    /// multiplied in f32) and the result rounded once to `x`'s type: an f16 square
    /// overflows past 255 and a half sum of thousands of squares loses its low bits.
    fn rms_norm(x: Tensor<Self, 2>, weight: &Tensor<Self, 1>, eps: f64) -> Result<Tensor<Self, 2>> {
        check_norm(&x, weight)?;
        let dtype = x.dtype();
        if let DType::F16 | DType::BF16 = dtype {
            let out = rms_norm_f32(
                x.cast(FloatDType::F32),
                weight.clone().cast(FloatDType::F32),
                eps,
            );
            return Ok(out.cast(dtype));
        }
        Ok(rms_norm_f32(x, weight.clone(), eps))
    }

    /// The residual add of one sub-layer and the RMSNorm of the next: `(x + delta,
    /// rms_norm(x + delta))`. The default is a tensor add and
    /// [`rms_norm`](Self::rms_norm); the CubeCL backends do both in one kernel.
    ///
    /// # Errors
    ///
    /// As [`rms_norm`](Self::rms_norm), and [`LlamaError::ShapeMismatch`] if `delta`'s
    /// shape is not `x`'s.
    fn add_rms_norm(
        x: Tensor<Self, 2>,
        delta: Tensor<Self, 2>,
        weight: &Tensor<Self, 1>,
        eps: f64,
    ) -> Result<(Tensor<Self, 2>, Tensor<Self, 2>)> {
        check_same_shape("residual", &x, &delta)?;
        let sum = x + delta;
        let normed = Self::rms_norm(sum.clone(), weight, eps)?;
        Ok((sum, normed))
    }

    /// Writes a step's keys `k` and values `v` (`[tokens, kv_heads * head_dim]`) into a
    /// layer's pools `keys`/`values` (`[blocks, kv_heads, block_size, head_dim]`) at
    /// `slots` (one per token, the slots `batch`'s tables give its positions); returns
    /// the pools. The default writes on the host where the tensor lives there, else one
    /// slice assignment per run of consecutive slots; the CubeCL backends write every
    /// token of both pools in one kernel.
    fn paged_store(
        pools: (Tensor<Self, 4>, Tensor<Self, 4>),
        k: Tensor<Self, 2>,
        v: Tensor<Self, 2>,
        slots: &[crate::cache::paged::Slot],
        _batch: &PagedBatch<'_, Self>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        let (keys, values) = pools;
        (
            crate::cache::paged::write_slots(keys, k, slots),
            crate::cache::paged::write_slots(values, v, slots),
        )
    }

    /// RoPE on a step's queries and keys and the paged write of its keys and values, the
    /// attention's preparation: `qk` `[tokens, q_width + kv_heads * head_dim]` is the
    /// projection's queries then keys before RoPE (its rows may lie further apart than
    /// their width: a column view of a wider product), `v` `[tokens, kv_heads *
    /// head_dim]` the values, `rotation` the angles for `qk` as [`rope`](Self::rope)
    /// takes them. Returns the rotated queries `[tokens, q_width]` and the pools with the
    /// rotated keys and the values written at `slots` as
    /// [`paged_store`](Self::paged_store) writes them; the pools come back on an error
    /// too (unchanged). The default is [`rope`](Self::rope), then
    /// [`paged_store`](Self::paged_store) of the keys' columns; the CubeCL backends do
    /// both in one kernel, with the same bits.
    fn rope_paged_store(
        pools: (Tensor<Self, 4>, Tensor<Self, 4>),
        qk: Tensor<Self, 2>,
        v: Tensor<Self, 2>,
        rotation: Rotation<'_, Self>,
        q_width: usize,
        slots: &[crate::cache::paged::Slot],
        batch: &PagedBatch<'_, Self>,
    ) -> (Result<Tensor<Self, 2>>, LayerPools<Self>) {
        rope_then_store(pools, qk, v, rotation, q_width, slots, batch)
    }

    /// Rotary position embedding in the rotate-half layout: `x * cos + rotate_half(x) *
    /// sin` for `x`, `cos` and `sin` `[rows, heads * head_dim]` (the first half's sign
    /// folded into `sin`), where `swap` is the `[head_dim, head_dim]` permutation that
    /// swaps a head's halves. The default is Burn's operations, each head's halves
    /// swapped by slicing (exact on every backend; a product with `swap` would run in
    /// TF32 on Burn's CUDA matmul, rounding every query and key to 10 bits of mantissa).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if the shapes do not agree.
    fn rope(
        x: Tensor<Self, 2>,
        cos: &Tensor<Self, 2>,
        sin: &Tensor<Self, 2>,
        swap: &Tensor<Self, 2>,
    ) -> Result<Tensor<Self, 2>> {
        check_rope(&x, cos, sin, swap)?;
        rope_by_slicing(x, cos, sin, swap.dims()[0])
    }

    /// [`rope`](Self::rope) of `x` `[rows, heads * head_dim]` by `rotation`: row `i` at
    /// the angles of position `rotation.angles.positions()[i]`. The default gathers the
    /// angles for every row and head ([`RopeAngles::gathered`](crate::model::rope::RopeAngles::gathered),
    /// once per forward pass) and calls [`rope`](Self::rope); the CPU backend reads the
    /// tables at each row's position instead, with the same bits.
    ///
    /// # Errors
    ///
    /// As [`rope`](Self::rope): [`LlamaError::ShapeMismatch`] if `x` does not have the
    /// angles' shape.
    fn rope_rotation(x: Tensor<Self, 2>, rotation: &Rotation<'_, Self>) -> Result<Tensor<Self, 2>> {
        let (cos, sin) = rotation.angles.gathered();
        Self::rope(x, cos, sin, rotation.swap)
    }

    /// Attention of a paged step: `q` `[tokens, n_heads * head_dim]` (the sequences'
    /// new tokens one after another, RoPE applied) over a layer's pool `keys`/`values`
    /// `[blocks, kv_heads, block_size, head_dim]`, each sequence through its block table
    /// and causally (see [`PagedBatch`]); returns the shape of `q`. The default gathers
    /// blocks into padded batches for [`masked_attention`](Self::masked_attention)
    /// ([`PagedBatch::attention_by_gathering`]). On a backend whose
    /// [`compiles_kernels`](Self::compiles_kernels) is true, the contiguous cache's
    /// left-padded batches come here too ([`PagedBatch::is_left_padded`]): a token then
    /// sees the keys from [`PagedBatch::first_key`] to its own slot.
    ///
    /// # Errors
    ///
    /// As [`masked_attention`](Self::masked_attention).
    fn paged_attention(
        q: Tensor<Self, 2>,
        keys: &Tensor<Self, 4>,
        values: &Tensor<Self, 4>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<Tensor<Self, 2>> {
        batch.attention_by_gathering(q, keys, values, Self::masked_attention)
    }

    /// The greedy token of each row of `logits` `[rows, vocab]`, computed where the
    /// logits are so that only the ids are read back: the first index of the row's
    /// largest value, as [`crate::sampling::argmax`] picks it, or `None` for a row
    /// holding a NaN or nothing above minus infinity (which the host path reports as an
    /// error). `Ok(None)`, the default, where the backend has no such kernel: the caller
    /// reads the logits back and samples on the host.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if the ids cannot be read back.
    fn greedy_tokens(_logits: &Tensor<Self, 2>) -> Result<Option<Vec<Option<u32>>>> {
        Ok(None)
    }

    /// Whether [`sample_tokens`](Self::sample_tokens) draws on the device (else it
    /// always answers `Ok(None)`, and a caller need not prepare draws for it). The
    /// default is `false`.
    fn samples_on_device() -> bool {
        false
    }

    /// Each row of `logits` `[rows, vocab]` drawn where the logits are, as `draws` (one
    /// per row) says: the host pipeline's temperature, top-k, top-p, min-p and draw with
    /// the row's uniform (see [`crate::sampling::device`]), so that only the tokens and
    /// their raw log-probabilities are read back. `None` for a row the device cannot draw
    /// (a NaN, a `+inf` or nothing above minus infinity: the host path handles it).
    /// `Ok(None)`, the default, where the backend has no such kernel: the caller reads
    /// the logits back and samples on the host.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if the results cannot be read back;
    /// [`LlamaError::ShapeMismatch`] if `draws` does not have one draw per row.
    fn sample_tokens(
        _logits: &Tensor<Self, 2>,
        _draws: &[DeviceDraw],
    ) -> Result<Option<Vec<Option<DeviceToken>>>> {
        Ok(None)
    }

    /// `softmax(q k^T / sqrt(dim)) v` with `true` in `mask` hiding a key: `q`
    /// `[batch, heads, queries, dim]`, `k`/`v` `[batch, heads, keys, dim]`, `mask`
    /// `[batch, 1, queries, keys]`. The default is Burn's fused attention.
    ///
    /// # Errors
    ///
    /// Backends with a kernel of their own report what it cannot take.
    fn masked_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Option<Tensor<Self, 4, Bool>>,
    ) -> Result<Tensor<Self, 4>> {
        Ok(fused_attention(q, k, v, mask))
    }
}

/// The refusal of an encoded KV cache type by a backend without the kernels for it.
fn no_device_kv(ty: crate::cache::KvCacheType) -> LlamaError {
    LlamaError::invalid(
        "kv_cache_type",
        ty,
        "this backend keeps its KV cache in its float type (f32); the other types run on \
         the CPU and CubeCL backends",
    )
}

/// `x / sqrt(mean(x^2) + eps) * weight` by Burn's operations, in the tensors' own type.
fn rms_norm_f32<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let inv_rms = (x.clone() * x.clone())
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    x * inv_rms * weight.unsqueeze::<2>()
}

/// The float type that tensors created on `device` take, as Burn's device settings say:
/// `B::FloatElem`'s, unless [`set_float_type`] chose another before the device's first
/// tensor. `None` for a type other than f32, f16 and bf16.
///
/// Burn 0.21 keys these settings by device (its type and index), not by backend type:
/// `Wgpu<f16>` and `Wgpu` (f32) share `WgpuDevice::DefaultDevice`, and whichever creates a
/// tensor on it first fixes its float type for the rest of the process (and Burn's CubeCL
/// backends compute in the tensors' type, whatever their `F`). So `Llama<Cuda<bf16>>`
/// computes in bf16 when it is the first on its device; after an f32 model there, it
/// computes in f32. Check with this function, or choose with [`set_float_type`] first.
pub fn float_type<B: Backend>(device: &B::Device) -> Option<FloatType> {
    FloatType::from_dtype(burn::tensor::backend::get_device_settings::<B>(device).float_dtype)
}

/// Makes `ty` the float type of every tensor created on `device` from now on: a model
/// loaded there keeps its dense weights, activations and KV cache in `ty` (quantized
/// weights stay in their blocks; logits are read back as f32). Burn fixes a device's
/// float type at its first tensor, so call this before anything else runs on `device`
/// (see [`float_type`]). `B` need not have `ty` as its `FloatElem`: `set_float_type::<Cuda>(
/// &device, FloatType::Bf16)` makes the f32-typed `Cuda` compute as `Cuda<bf16>` does.
///
/// # Errors
///
/// [`LlamaError::InvalidParameter`] if the device does not support `ty` (f16 on wgpu
/// needs the adapter's `SHADER_F16`; bf16 is not in WGSL), or if the device's float type
/// is already fixed to another.
pub fn set_float_type<B: Backend>(device: &B::Device, ty: FloatType) -> Result<()> {
    use burn::tensor::backend::{DeviceError, set_default_float_dtype};
    match set_default_float_dtype::<B>(device, ty.dtype()) {
        Ok(()) => Ok(()),
        Err(DeviceError::AlreadyInitialized { .. }) if float_type::<B>(device) == Some(ty) => {
            Ok(())
        }
        Err(DeviceError::AlreadyInitialized { .. }) => Err(LlamaError::invalid(
            "dtype",
            ty,
            "the device's float type is already fixed to another (Burn fixes it at the \
             device's first tensor)",
        )),
        Err(_) => Err(LlamaError::invalid(
            "dtype",
            ty,
            "not supported by this backend's device",
        )),
    }
}

/// Burn's fused attention with the default scale, no soft cap and no causal mask of its
/// own: `true` in `mask` hides a key.
fn fused_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
) -> Tensor<B, 4> {
    attention(
        q,
        k,
        v,
        mask,
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: false,
        },
    )
}

/// Row-major `[rows, cols]` host data as a tensor on `device`, uploaded whole, or in blocks
/// of rows of at most [`LlamaBackend::max_upload_bytes`] concatenated on the device.
pub(crate) fn upload_matrix<B: LlamaBackend>(
    data: Vec<f32>,
    [rows, cols]: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2> {
    let row_bytes = cols.max(1) * std::mem::size_of::<f32>();
    match B::max_upload_bytes() {
        Some(limit) if rows > 1 && rows * row_bytes > limit => {
            let block_rows = (limit / row_bytes).max(1);
            let blocks = data
                .chunks(block_rows * cols.max(1))
                .map(|block| {
                    let n = block.len() / cols.max(1);
                    Tensor::from_data(TensorData::new(block.to_vec(), [n, cols]), device)
                })
                .collect();
            Tensor::cat(blocks, 0)
        }
        _ => Tensor::from_data(TensorData::new(data, [rows, cols]), device),
    }
}

/// What a quantized product multiplies beside its first matrix in the same launch (see
/// [`LlamaBackend::fused_quantized_matmul`]).
#[derive(Debug, Clone, Copy)]
pub enum Beside<'a> {
    /// Nothing: `x @ W^T`.
    Nothing,
    /// The feed-forward's up matrix (the first is the gate): `silu(x @ G^T) * (x @ U^T)`.
    SwiGluUp(&'a QuantMatrix),
    /// A second matrix whose outputs follow the first's: `x @ [A | B]^T`.
    Second(&'a QuantMatrix),
}

/// The work on one side of a quantized product that a backend may fuse into its launch
/// (see [`LlamaBackend::fused_quantized_matmul`]).
#[derive(Debug, Clone)]
pub enum Around<'a, B: Backend> {
    /// The product of `rms_norm(x, weight, eps)` (as [`LlamaBackend::rms_norm`]), not of `x`.
    Norm(&'a Tensor<B, 1>, f64),
    /// The product added to this residual (`[rows, outputs]`), rounded to the float type as
    /// a tensor add rounds it.
    Residual(Tensor<B, 2>),
}

/// [`LlamaError::ShapeMismatch`] (`quantized matmul input`) unless activations of `n_in`
/// values are `w`'s inputs.
pub(crate) fn check_quantized_input(n_in: usize, w: &QuantMatrix) -> Result<()> {
    if n_in != w.cols() {
        return Err(LlamaError::ShapeMismatch {
            name: "quantized matmul input".into(),
            expected: vec![w.cols()],
            actual: vec![n_in],
        });
    }
    Ok(())
}

/// The shapes every backend's [`LlamaBackend::fused_quantized_matmul`] checks: `x` is
/// `w`'s input, and what goes `around` the product fits it (the norm's weight `x`'s
/// width, the residual the product's `[rows, outputs]`, the outputs `w`'s and those of a
/// [`Beside::Second`] matrix). Returns the outputs per row.
pub(crate) fn check_fused_product<B: Backend>(
    x: &Tensor<B, 2>,
    w: &QuantMatrix,
    beside: Beside<'_>,
    around: &Around<'_, B>,
) -> Result<usize> {
    let [rows, n_in] = x.dims();
    check_quantized_input(n_in, w)?;
    let outputs = w.rows()
        + match beside {
            Beside::Second(m) => m.rows(),
            Beside::Nothing | Beside::SwiGluUp(_) => 0,
        };
    match around {
        Around::Norm(weight, _) => check_norm(x, weight)?,
        Around::Residual(residual) if residual.dims() != [rows, outputs] => {
            return Err(LlamaError::ShapeMismatch {
                name: "residual of a quantized product".into(),
                expected: vec![rows, outputs],
                actual: residual.dims().to_vec(),
            });
        }
        Around::Residual(_) => {}
    }
    Ok(outputs)
}

/// [`LlamaError::ShapeMismatch`] (`swiglu up`) unless the feed-forward's `up` matrix has
/// `gate`'s shape.
#[cfg(feature = "flex")]
fn check_swiglu_matrices(gate: &QuantMatrix, up: &QuantMatrix) -> Result<()> {
    if (up.rows(), up.cols()) != (gate.rows(), gate.cols()) {
        return Err(LlamaError::ShapeMismatch {
            name: "swiglu up".into(),
            expected: vec![gate.rows(), gate.cols()],
            actual: vec![up.rows(), up.cols()],
        });
    }
    Ok(())
}

/// [`LlamaError::ShapeMismatch`] unless `b` has `a`'s shape.
pub(crate) fn check_same_shape<B: Backend>(
    name: &str,
    a: &Tensor<B, 2>,
    b: &Tensor<B, 2>,
) -> Result<()> {
    if a.dims() != b.dims() {
        return Err(LlamaError::ShapeMismatch {
            name: name.into(),
            expected: a.dims().to_vec(),
            actual: b.dims().to_vec(),
        });
    }
    Ok(())
}

/// [`LlamaError::ShapeMismatch`] unless `weight` has one value per column of `x`.
pub(crate) fn check_norm<B: Backend>(x: &Tensor<B, 2>, weight: &Tensor<B, 1>) -> Result<()> {
    let [_, d] = x.dims();
    if weight.dims() == [d] {
        Ok(())
    } else {
        Err(LlamaError::ShapeMismatch {
            name: "rms_norm weight".into(),
            expected: vec![d],
            actual: weight.dims().to_vec(),
        })
    }
}

/// A layer's paged pools, keys then values, `[blocks, kv_heads, block_size, head_dim]`
/// each.
pub type LayerPools<B> = (Tensor<B, 4>, Tensor<B, 4>);

/// The rotation of a step's queries and keys: each row's angles
/// ([`RopeAngles`](crate::model::rope::RopeAngles): positions and tables, and the
/// cosines and sines gathered for [`LlamaBackend::rope`]) and `swap`, the `[head_dim,
/// head_dim]` permutation that swaps a head's halves.
#[derive(Debug, Clone, Copy)]
pub struct Rotation<'a, B: Backend> {
    /// The rows' angles.
    pub angles: &'a crate::model::rope::RopeAngles<B>,
    /// The permutation swapping a head's halves (its size is the head's).
    pub swap: &'a Tensor<B, 2>,
}

impl<B: LlamaBackend> Rotation<'_, B> {
    /// Rotates `qk` (`[rows, q_width + keys' width]`: queries then keys) with the
    /// backend's [`rope`](LlamaBackend::rope) and splits it after column `q_width`:
    /// `(queries, keys)`, column views of the one rotated tensor.
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`] if `q_width` is past `qk`'s columns, or as
    /// [`rope`](LlamaBackend::rope).
    pub fn rotate_split(
        &self,
        qk: Tensor<B, 2>,
        q_width: usize,
    ) -> Result<(Tensor<B, 2>, Tensor<B, 2>)> {
        let [rows, width] = qk.dims();
        if q_width > width {
            return Err(LlamaError::ShapeMismatch {
                name: "rope: query width".into(),
                expected: vec![width],
                actual: vec![q_width],
            });
        }
        let qk = B::rope_rotation(qk, self)?;
        let q = qk.clone().slice([0..rows, 0..q_width]);
        Ok((q, qk.slice([0..rows, q_width..width])))
    }
}

/// [`LlamaBackend::rope_paged_store`]'s portable path: the backend's RoPE over `qk`,
/// then its paged write of the keys' columns and the values.
pub(crate) fn rope_then_store<B: LlamaBackend>(
    pools: (Tensor<B, 4>, Tensor<B, 4>),
    qk: Tensor<B, 2>,
    v: Tensor<B, 2>,
    rotation: Rotation<'_, B>,
    q_width: usize,
    slots: &[crate::cache::paged::Slot],
    batch: &PagedBatch<'_, B>,
) -> (Result<Tensor<B, 2>>, LayerPools<B>) {
    match rotation.rotate_split(qk, q_width) {
        Ok((q, k)) => (Ok(q), B::paged_store(pools, k, v, slots, batch)),
        Err(e) => (Err(e), pools),
    }
}

/// RoPE by Burn's operations: each head's halves swapped by slicing, then
/// `x * cos + rotated * sin` (the portable [`LlamaBackend::rope`]).
pub(crate) fn rope_by_slicing<B: Backend>(
    x: Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    head_dim: usize,
) -> Result<Tensor<B, 2>> {
    let [rows, width] = x.dims();
    let half = head_dim / 2;
    let heads = x.clone().reshape([rows * width / head_dim, head_dim]);
    let rotated = Tensor::cat(
        vec![
            heads.clone().narrow(1, half, half),
            heads.narrow(1, 0, half),
        ],
        1,
    )
    .reshape([rows, width]);
    Ok(x * cos.clone() + rotated * sin.clone())
}

/// The shape `[rows, width]` of a RoPE call's `x`, or an error if `cos` and `sin` do
/// not have it or `swap` is not a square of an even size dividing `width`.
pub(crate) fn check_rope<B: Backend>(
    x: &Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    swap: &Tensor<B, 2>,
) -> Result<[usize; 2]> {
    let dims = x.dims();
    let [a, b] = swap.dims();
    for (name, t) in [("rope cos", cos), ("rope sin", sin)] {
        if t.dims() != dims {
            return Err(LlamaError::ShapeMismatch {
                name: name.into(),
                expected: dims.to_vec(),
                actual: t.dims().to_vec(),
            });
        }
    }
    if a != b || a == 0 || !a.is_multiple_of(2) || !dims[1].is_multiple_of(a) {
        return Err(LlamaError::ShapeMismatch {
            name: "rope head permutation".into(),
            expected: vec![a, a],
            actual: vec![a, b],
        });
    }
    Ok(dims)
}

/// Tokens per row and query heads per key/value head of a token-major attention call
/// (`rows` query rows, keys of shape `[batch, n_kv_heads, keys, dim]`), or an error if
/// they do not fit together.
fn fold_heads(
    rows: usize,
    keys: &[usize; 4],
    batch: usize,
    n_heads: usize,
) -> Result<(usize, usize)> {
    let n_kv = keys[1];
    if keys[0] != batch
        || batch == 0
        || n_kv == 0
        || !n_heads.is_multiple_of(n_kv)
        || !rows.is_multiple_of(batch)
    {
        return Err(LlamaError::InvalidBatch(format!(
            "{rows} query rows in {batch} rows, {n_heads} query heads and keys of shape \
             {keys:?} do not fit"
        )));
    }
    Ok((rows / batch, n_heads / n_kv))
}

/// A strided view of an f32 Flex tensor `[batch, heads, keys, dim]` whose `dim` values are
/// adjacent and whose strides are non-negative; `None` otherwise.
#[cfg(feature = "flex")]
fn in_place_view(
    t: &burn::backend::flex::FlexTensor,
    shape: crate::kernels::attention::AttentionShape,
) -> Option<crate::kernels::attention::Strided<'_>> {
    let layout = t.layout();
    let strides = layout.strides();
    if t.dtype() != burn::tensor::DType::F32
        || strides.len() != 4
        || (strides[3] != 1 && shape.dim > 1)
    {
        return None;
    }
    let step = |i: usize| usize::try_from(strides[i]).ok();
    Some(crate::kernels::attention::Strided {
        data: t.storage::<f32>(),
        offset: layout.start_offset(),
        strides: [step(0)?, step(1)?, step(2)?],
    })
}

/// Keys or values for the attention kernel: `t` read in place, or else a contiguous copy
/// of it kept in `copy`.
#[cfg(feature = "flex")]
fn view_or_copy<'a>(
    t: &'a burn::backend::flex::FlexTensor,
    shape: crate::kernels::attention::AttentionShape,
    copy: &'a mut Option<Vec<f32>>,
) -> Result<crate::kernels::attention::Strided<'a>> {
    if let Some(view) = in_place_view(t, shape) {
        return Ok(view);
    }
    let tensor = Tensor::<burn::backend::Flex, 4>::from_primitive(
        burn::tensor::TensorPrimitive::Float(t.clone()),
    );
    let data = copy.insert(host::<f32, 4, _>(tensor)?);
    Ok(crate::kernels::attention::Strided::contiguous(data, shape))
}

/// Runs `f` on an f32 tensor's values: read in place when the tensor is contiguous (no
/// copy), else from a host copy.
#[cfg(feature = "flex")]
fn with_values<const D: usize, R>(
    t: &Tensor<burn::backend::Flex, D>,
    mut f: impl FnMut(&[f32]) -> Result<R>,
) -> Result<R> {
    match crate::cache::host::read_in_place(t, &mut f) {
        Some(out) => out,
        None => f(&host::<f32, D, _>(t.clone())?),
    }
}

/// One adapter's rows of a step and its factors for a projection, as
/// [`LlamaBackend::lora_add`] takes them.
#[derive(Debug)]
pub struct LoraRows<'a, B: Backend> {
    /// The flat token rows that use the adapter.
    pub rows: &'a [u32],
    /// The same rows on the device.
    pub index: &'a Tensor<B, 1, Int>,
    /// `A`, `[in, rank]`.
    pub a: &'a Tensor<B, 2>,
    /// `scale * B`, `[rank, out]`.
    pub b: &'a Tensor<B, 2>,
}

/// A tensor's values on the host.
#[cfg(feature = "flex")]
fn host<T: burn::tensor::Element, const D: usize, K>(
    t: Tensor<burn::backend::Flex, D, K>,
) -> Result<Vec<T>>
where
    K: burn::tensor::TensorKind<burn::backend::Flex> + burn::tensor::BasicOps<burn::backend::Flex>,
{
    t.into_data()
        .convert::<T>()
        .into_vec::<T>()
        .map_err(|e| LlamaError::Runtime(format!("reading a tensor: {e:?}")))
}

/// Calls `run` once with every group's factors as the CPU kernel takes them, each read
/// in place when it is contiguous (as loaded), else from a copy.
#[cfg(feature = "flex")]
fn with_lora_groups(
    groups: &[LoraRows<'_, burn::backend::Flex>],
    done: &[crate::kernels::lora::LoraGroup<'_>],
    run: &mut dyn FnMut(&[crate::kernels::lora::LoraGroup<'_>]),
) -> Result<()> {
    let Some((g, rest)) = groups.split_first() else {
        run(done);
        return Ok(());
    };
    let rank = g.a.dims()[1];
    with_values(g.a, |a| {
        with_values(g.b, |b| {
            let mut next: Vec<crate::kernels::lora::LoraGroup<'_>> = done.to_vec();
            next.push(crate::kernels::lora::LoraGroup {
                rows: g.rows,
                a,
                b,
                rank,
            });
            with_lora_groups(rest, &next, run)
        })
    })
}

/// Adds every group's change to `y` (`[tokens, n_out]`) with the CPU kernel, `x(r)`
/// being row `r` of the projection's input.
#[cfg(feature = "flex")]
fn add_lora_changes<'x>(
    groups: &[LoraRows<'_, burn::backend::Flex>],
    x: &(dyn Fn(usize) -> &'x [f32] + Sync),
    n_in: usize,
    n_out: usize,
    y: &mut [f32],
) -> Result<()> {
    with_lora_groups(groups, &[], &mut |kernel_groups| {
        let path = crate::kernels::SimdPath::active();
        crate::kernels::lora::add_changes(path, x, n_in, n_out, kernel_groups, y);
    })
}

#[cfg(feature = "flex")]
thread_local! {
    /// Each thread's buffer for the up projection of the CPU backend's
    /// [`quantized_swiglu`](LlamaBackend::quantized_swiglu), kept from one layer to the
    /// next. Fresh, a prompt chunk's (512 rows of 8,192 values on a 1B model, 16.8 MB)
    /// made the allocator map a new heap for each layer and the kernel clear its pages.
    static UP_SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The most values [`UP_SCRATCH`] keeps between calls (64 MiB): a larger product's buffer
/// is freed after it.
#[cfg(feature = "flex")]
const UP_SCRATCH_KEEP: usize = 16 << 20;

/// Runs `f` on this thread's [`UP_SCRATCH`], taken out for the call and put back after it
/// unless it grew past [`UP_SCRATCH_KEEP`]. Taken, not borrowed across the call: a
/// product's split may run on rayon's pool, whose waiting worker can take another
/// request's forward pass on this thread, and that pass's gate then finds an empty
/// buffer.
#[cfg(feature = "flex")]
fn with_up_scratch<R>(f: impl FnOnce(&mut Vec<f32>) -> Result<R>) -> Result<R> {
    let mut scratch = UP_SCRATCH.take();
    let out = f(&mut scratch);
    if scratch.capacity() <= UP_SCRATCH_KEEP {
        UP_SCRATCH.set(scratch);
    }
    out
}

/// `silu(x @ gate^T) * (x @ up^T)` of activation rows quantized once for both products,
/// SwiGLU in the gate's own output.
#[cfg(feature = "flex")]
fn gated_on(
    acts: &crate::kernels::int8::FastRows,
    gate: &QuantMatrix,
    up: &QuantMatrix,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    acts.product_into(gate, &mut out)?;
    with_up_scratch(|scratch| {
        acts.product_into(up, scratch)?;
        crate::kernels::activation::swiglu(&mut out, scratch);
        Ok(())
    })?;
    Ok(out)
}

#[cfg(feature = "flex")]
impl LlamaBackend for burn::backend::Flex {
    fn keeps_quantized_weights() -> bool {
        true
    }

    fn encodes_kv_cache() -> bool {
        true
    }

    fn quantized_matmul(
        x: Tensor<Self, 2>,
        w: &QuantMatrix,
        precision: Precision,
    ) -> Result<Tensor<Self, 2>> {
        let [rows, _] = x.dims();
        let device = x.device();
        let out = with_values(&x, |values| {
            crate::kernels::matmul_transposed_in(precision, values, rows, w)
        })?;
        Ok(Tensor::from_data(
            TensorData::new(out, [rows, w.rows()]),
            &device,
        ))
    }

    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Result<Tensor<Self, 2>> {
        let dims = gate.dims();
        if up.dims() != dims {
            return Err(LlamaError::ShapeMismatch {
                name: "swiglu up".into(),
                expected: dims.to_vec(),
                actual: up.dims().to_vec(),
            });
        }
        let device = gate.device();
        let out = with_values(&gate, |gate| {
            with_values(&up, |up| {
                let mut out = gate.to_vec();
                crate::kernels::activation::swiglu(&mut out, up);
                Ok(out)
            })
        })?;
        Ok(Tensor::from_data(TensorData::new(out, dims), &device))
    }

    /// Both products, then SwiGLU in the gate's own output: one buffer of `[rows,
    /// hidden]` fewer than the separate operations (a 450-token prompt's is 14.7 MB a
    /// layer, whose fresh pages the allocator mapped and the kernel cleared each time),
    /// and in `fast` the activations quantized once for both: the same bits.
    fn quantized_swiglu(
        x: Tensor<Self, 2>,
        gate: &QuantMatrix,
        up: &QuantMatrix,
        precision: Precision,
    ) -> Result<Option<Tensor<Self, 2>>> {
        check_swiglu_matrices(gate, up)?;
        let [rows, n_in] = x.dims();
        let device = x.device();
        let run = gate.format().int_form().run;
        let out = with_values(&x, |values| {
            if precision == Precision::Fast && up.format().int_form().run == run {
                let path = crate::kernels::SimdPath::active();
                let acts = crate::kernels::int8::FastRows::quantize(path, values, rows, n_in, run)?;
                return gated_on(&acts, gate, up);
            }
            let mut out = crate::kernels::matmul_transposed_in(precision, values, rows, gate)?;
            with_up_scratch(|scratch| {
                crate::kernels::matmul_transposed_into(precision, values, rows, up, scratch)?;
                crate::kernels::activation::swiglu(&mut out, scratch);
                Ok(())
            })?;
            Ok(out)
        })?;
        Ok(Some(Tensor::from_data(
            TensorData::new(out, [rows, gate.rows()]),
            &device,
        )))
    }

    /// In `fast`, the activations quantized once for the product's matrices (both of
    /// [`Beside::Second`] and [`Beside::SwiGluUp`]), RMSNorm taken row by row where they
    /// are quantized (no normalized rows in memory), and the residual added to the
    /// product's own output: the bits of the separate operations. `Ok(None)` in `exact`,
    /// and where the two matrices quantize their activations in runs of different
    /// lengths.
    fn fused_quantized_matmul(
        x: Tensor<Self, 2>,
        w: &QuantMatrix,
        beside: Beside<'_>,
        around: Around<'_, Self>,
        precision: Precision,
    ) -> Result<Option<Tensor<Self, 2>>> {
        let [rows, n_in] = x.dims();
        let outputs = check_fused_product(&x, w, beside, &around)?;
        let second = match beside {
            Beside::Nothing => None,
            Beside::Second(m) | Beside::SwiGluUp(m) => Some(m),
        };
        if let Some(m) = second {
            check_quantized_input(n_in, m)?;
        }
        if let Beside::SwiGluUp(up) = beside {
            check_swiglu_matrices(w, up)?;
        }
        let run = w.format().int_form().run;
        if precision != Precision::Fast || second.is_some_and(|m| m.format().int_form().run != run)
        {
            return Ok(None);
        }
        let path = crate::kernels::SimdPath::active();
        let device = x.device();
        let acts = with_values(&x, |values| match &around {
            Around::Norm(weight, eps) => with_values(weight, |weight| {
                crate::kernels::int8::FastRows::normed(path, values, weight, *eps as f32, rows, run)
            }),
            Around::Residual(_) => {
                crate::kernels::int8::FastRows::quantize(path, values, rows, n_in, run)
            }
        })?;
        drop(x);
        let mut out = match beside {
            Beside::Nothing => {
                let mut out = Vec::new();
                acts.product_into(w, &mut out)?;
                out
            }
            Beside::Second(b) => acts.products_beside(w, b)?,
            Beside::SwiGluUp(up) => gated_on(&acts, w, up)?,
        };
        drop(acts);
        if let Around::Residual(residual) = &around {
            with_values(residual, |residual| {
                let row = |r: usize| &residual[r * outputs..(r + 1) * outputs];
                crate::kernels::activation::add_rows(&mut out, outputs, &row);
                Ok(())
            })?;
        }
        Ok(Some(Tensor::from_data(
            TensorData::new(out, [rows, outputs]),
            &device,
        )))
    }

    fn lora_add(
        y: Tensor<Self, 2>,
        x: Tensor<Self, 2>,
        groups: &[LoraRows<'_, Self>],
    ) -> Result<Tensor<Self, 2>> {
        let dims = y.dims();
        let [tokens, n_in] = x.dims();
        let n_out = dims[1];
        for g in groups {
            let ([a_in, rank], [b_rank, b_out]) = (g.a.dims(), g.b.dims());
            if a_in != n_in || b_rank != rank || b_out != n_out || dims[0] != tokens {
                return Err(LlamaError::ShapeMismatch {
                    name: "lora factors".into(),
                    expected: vec![n_in, rank, n_out],
                    actual: vec![a_in, b_rank, b_out],
                });
            }
            if let Some(&bad) = g.rows.iter().find(|&&r| r as usize >= tokens) {
                return Err(LlamaError::invalid(
                    "lora row",
                    bad,
                    "outside the step's rows",
                ));
            }
        }
        // `y` written in place when it is uniquely held and contiguous (a projection's
        // fresh output), else through a copy.
        let mut result = Ok(());
        match crate::cache::host::write_in_place(y, &x, |memory, rows| {
            result = add_lora_changes(groups, &|r| rows.row(r), n_in, n_out, memory);
        }) {
            Ok(y) => result.map(|()| y),
            Err(y) => {
                let device = y.device();
                let mut out = host::<f32, 2, _>(y)?;
                with_values(&x, |x| {
                    let row = |r: usize| &x[r * n_in..(r + 1) * n_in];
                    add_lora_changes(groups, &row, n_in, n_out, &mut out)
                })?;
                Ok(Tensor::from_data(TensorData::new(out, dims), &device))
            }
        }
    }

    fn token_major_attention(
        q: Tensor<Self, 2>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Option<Tensor<Self, 4, Bool>>,
        batch: usize,
        n_heads: usize,
    ) -> Result<Tensor<Self, 2>> {
        use crate::kernels::attention::{AttentionShape, QueryLayout, attention_laid_out};
        let [_, n_kv, keys, dim] = k.dims();
        let rows = q.dims()[0];
        let (seq, groups) = fold_heads(rows, &k.dims(), batch, n_heads)?;
        let shape = AttentionShape {
            batch,
            heads: n_kv,
            queries: groups * seq,
            keys,
            dim,
            mask_heads: mask.as_ref().map_or(1, |m| m.dims()[1]),
        };
        let device = q.device();
        let mask = mask.map(host::<bool, 4, Bool>).transpose()?;
        // The queries are read in their projection's layout and the output written in
        // it: no rearranging copies on either side.
        let q = host::<f32, 2, _>(q)?;
        let (k, v) = (k.into_primitive().tensor(), v.into_primitive().tensor());
        let (mut k_copy, mut v_copy) = (None, None);
        let out = attention_laid_out(
            &q,
            QueryLayout::TokenMajor { seq, groups },
            view_or_copy(&k, shape, &mut k_copy)?,
            view_or_copy(&v, shape, &mut v_copy)?,
            mask.as_deref(),
            shape,
        )?;
        Ok(Tensor::from_data(
            TensorData::new(out, [rows, n_heads * dim]),
            &device,
        ))
    }

    fn add_rms_norm(
        x: Tensor<Self, 2>,
        delta: Tensor<Self, 2>,
        weight: &Tensor<Self, 1>,
        eps: f64,
    ) -> Result<(Tensor<Self, 2>, Tensor<Self, 2>)> {
        check_same_shape("residual", &x, &delta)?;
        check_norm(&x, weight)?;
        // `x + delta` in place in `x` where it is a uniquely held, contiguous tensor (the
        // residual stream is), on the pool's threads; else Burn's add. Burn's add on one
        // thread, into a fresh tensor, was 1.1% of a 450-token prefill while the other
        // core waited.
        let width = x.dims()[1];
        let sum = match crate::cache::host::write_in_place(x, &delta, |memory, rows| {
            crate::kernels::activation::add_rows(memory, width, &|r| rows.row(r));
        }) {
            Ok(sum) => sum,
            Err(x) => x + delta,
        };
        let normed = Self::rms_norm(sum.clone(), weight, eps)?;
        Ok((sum, normed))
    }

    fn rms_norm(x: Tensor<Self, 2>, weight: &Tensor<Self, 1>, eps: f64) -> Result<Tensor<Self, 2>> {
        check_norm(&x, weight)?;
        let dims = x.dims();
        let device = x.device();
        // One pass per row instead of seven tensor operations, each with its own output.
        let out = with_values(&x, |x| {
            with_values(weight, |weight| {
                Ok(crate::kernels::activation::rms_norm_new(
                    x, weight, eps as f32,
                ))
            })
        })?;
        Ok(Tensor::from_data(TensorData::new(out, dims), &device))
    }

    fn rope(
        x: Tensor<Self, 2>,
        cos: &Tensor<Self, 2>,
        sin: &Tensor<Self, 2>,
        swap: &Tensor<Self, 2>,
    ) -> Result<Tensor<Self, 2>> {
        let dims = check_rope(&x, cos, sin, swap)?;
        let head_dim = swap.dims()[0];
        let device = x.device();
        // One pass over the projection's output instead of a product and four
        // element-wise operations, each with its own output tensor.
        let out = with_values(&x, |x| {
            with_values(cos, |cos| {
                with_values(sin, |sin| {
                    let mut out = vec![0f32; x.len()];
                    crate::kernels::activation::rope(x, cos, sin, head_dim, &mut out);
                    Ok(out)
                })
            })
        })?;
        Ok(Tensor::from_data(TensorData::new(out, dims), &device))
    }

    fn rope_rotation(x: Tensor<Self, 2>, rotation: &Rotation<'_, Self>) -> Result<Tensor<Self, 2>> {
        let angles = rotation.angles;
        let (cos_table, sin_table) = angles.tables();
        let [rows, width] = x.dims();
        let [head_dim, _] = rotation.swap.dims();
        let positions = angles.positions();
        // The shapes `rope` would check on the gathered angles, `[rows, heads *
        // head_dim]`, checked on the tables (`RopeAngles::new` has checked that both
        // tables have one shape and that every position lies in them).
        if cos_table.dims()[1] != head_dim
            || head_dim < 2
            || !head_dim.is_multiple_of(2)
            || positions.len() != rows
            || width != angles.heads() * head_dim
        {
            return Err(LlamaError::ShapeMismatch {
                name: "rope cos".into(),
                expected: vec![rows, width],
                actual: vec![positions.len(), angles.heads() * cos_table.dims()[1]],
            });
        }
        let device = x.device();
        let out = with_values(cos_table, |cos| {
            with_values(sin_table, |sin| {
                crate::cache::host::with_rows(&x, |x| {
                    crate::kernels::activation::rope_at(
                        &|r| x.row(r),
                        width,
                        cos,
                        sin,
                        positions,
                        head_dim,
                    )
                })
                .ok_or_else(|| LlamaError::Runtime("reading the rows to rotate".into()))
            })
        })?;
        Ok(Tensor::from_data(
            TensorData::new(out, [rows, width]),
            &device,
        ))
    }

    fn paged_attention(
        q: Tensor<Self, 2>,
        keys: &Tensor<Self, 4>,
        values: &Tensor<Self, 4>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<Tensor<Self, 2>> {
        use crate::kernels::attention::{PagedPool, paged_attention};
        if batch.is_left_padded() {
            // The host kernel attends from each table's first slot.
            return batch.attention_by_gathering(q, keys, values, Self::masked_attention);
        }
        let [_, heads, block_size, dim] = keys.dims();
        let dims = q.dims();
        let device = q.device();
        let q = host::<f32, 2, _>(q)?;
        // The pool is read in place, through each sequence's block table: no gathered
        // copy, no padding and no mask.
        let out = with_values(keys, |keys| {
            with_values(values, |values| {
                let pool = PagedPool {
                    keys,
                    values,
                    heads,
                    block_size,
                    dim,
                };
                paged_attention(&q, batch.n_heads(), pool, batch.seqs())
            })
        })?;
        Ok(Tensor::from_data(TensorData::new(out, dims), &device))
    }

    fn masked_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Option<Tensor<Self, 4, Bool>>,
    ) -> Result<Tensor<Self, 4>> {
        use crate::kernels::attention::{AttentionShape, attention_strided};
        let [batch, heads, queries, dim] = q.dims();
        let keys = k.dims()[2];
        let mask_heads = mask.as_ref().map_or(1, |m| m.dims()[1]);
        let device = q.device();
        let shape = AttentionShape {
            batch,
            heads,
            queries,
            keys,
            dim,
            mask_heads,
        };
        let mask = mask.map(host::<bool, 4, Bool>).transpose()?;
        let q = host::<f32, 4, _>(q)?;
        // Keys and values are usually a view of a cache's filled columns: read them in
        // place when their values along `dim` are adjacent, else from a copy.
        let (k, v) = (k.into_primitive().tensor(), v.into_primitive().tensor());
        let (mut k_copy, mut v_copy) = (None, None);
        let out = attention_strided(
            &q,
            view_or_copy(&k, shape, &mut k_copy)?,
            view_or_copy(&v, shape, &mut v_copy)?,
            mask.as_deref(),
            shape,
        )?;
        Ok(Tensor::from_data(
            TensorData::new(out, [batch, heads, queries, dim]),
            &device,
        ))
    }
}

/// LibTorch: the portable path, but for the attention mask. burn-tch 0.21 hands Burn's
/// mask (`true` hides a key) to PyTorch's `scaled_dot_product_attention` as it is, where a
/// boolean `true` means the opposite (the key takes part), so every masked attention came
/// out wrong (the reference test's first greedy token differed). The mask is inverted
/// here, so the fused kernel sees PyTorch's meaning.
#[cfg(any(feature = "tch-gpu", feature = "tch-cpu"))]
impl LlamaBackend for burn::backend::LibTorch {
    fn masked_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Option<Tensor<Self, 4, Bool>>,
    ) -> Result<Tensor<Self, 4>> {
        Ok(fused_attention(q, k, v, mask.map(Tensor::bool_not)))
    }
}

// Burn's CubeCL backends (cuda, wgpu, vulkan): implemented in `crate::gpu`, with our
// CubeCL kernels.

/// Burn's remote backend: every tensor operation goes to the server's device, so the
/// portable defaults (dequantized weights, Burn's operations) are the only path; our CPU
/// kernels run on host memory and never see the server's tensors.
#[cfg(feature = "remote")]
impl LlamaBackend for burn::backend::RemoteBackend {
    /// Burn 0.21's client sends a tensor's data as one WebSocket message and its server
    /// (axum's defaults) closes the connection on a message over 16 MiB, so weights go in
    /// blocks of 8 MiB (the demo model's 113 MB embedding table would not load).
    fn max_upload_bytes() -> Option<usize> {
        Some(8 << 20)
    }
}

/// Burn's router over the CPU backend: the operations the remote backend sends, run in
/// this process without a network (the control of examples/remote_backend.rs, which
/// separates the cost of the portable path from the cost of the wire). Portable defaults.
#[cfg(all(feature = "remote", feature = "flex"))]
impl LlamaBackend for burn::backend::Router<(burn::backend::Flex, burn::backend::Flex)> {}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::kernels::QuantFormat;
    use crate::kernels::tests::random_matrix;
    use burn::backend::Flex;

    fn values(t: Tensor<Flex, 2>) -> Vec<u32> {
        t.into_data()
            .into_vec::<f32>()
            .expect("f32")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The CPU backend's fused feed-forward gate (the up product in a buffer kept
    /// between calls, SwiGLU in the gate's output) gives the bits of the two products
    /// and the element-wise SwiGLU, in both precisions, whatever the calls before it
    /// left in the kept buffer.
    #[test]
    fn fused_gate_gives_the_separate_operations_bits() {
        let device = Default::default();
        for format in [QuantFormat::Q4_K, QuantFormat::Q8_0] {
            let (gate, up) = (
                random_matrix(format, 48, 256, 1),
                random_matrix(format, 48, 256, 2),
            );
            for precision in [Precision::Exact, Precision::Fast] {
                for rows in [19, 1, 5, 40] {
                    let x: Vec<f32> = (0..rows * 256)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                        .collect();
                    let x = Tensor::<Flex, 2>::from_data(TensorData::new(x, [rows, 256]), &device);
                    let fused = Flex::quantized_swiglu(x.clone(), &gate, &up, precision)
                        .expect("fused")
                        .expect("the CPU backend fuses");
                    let apart = Flex::swiglu(
                        Flex::quantized_matmul(x.clone(), &gate, precision).expect("gate"),
                        Flex::quantized_matmul(x, &up, precision).expect("up"),
                    )
                    .expect("swiglu");
                    assert_eq!(fused.dims(), [rows, 48]);
                    let (fused, apart) = (values(fused), values(apart));
                    let first = fused.iter().zip(&apart).position(|(a, b)| a != b);
                    assert_eq!(first, None, "{format:?} {precision:?} {rows} rows");
                }
            }
        }
        let x = Tensor::<Flex, 2>::zeros([2, 256], &device);
        let short = random_matrix(QuantFormat::Q8_0, 32, 256, 3);
        let gate = random_matrix(QuantFormat::Q8_0, 48, 256, 1);
        let got = Flex::quantized_swiglu(x, &gate, &short, Precision::Fast);
        assert!(
            matches!(&got, Err(LlamaError::ShapeMismatch { name, .. }) if name == "swiglu up"),
            "{got:?}"
        );
    }

    /// The CPU backend's fused products in `fast` (the activations quantized once for
    /// both matrices, RMSNorm taken where they are quantized, the residual added to the
    /// output) give the bits of the separate operations, for one matrix, two beside each
    /// other (formats of one run length) and the feed-forward gate, from one row to the
    /// AMX kernel's forty; `exact`, and two matrices whose activations are quantized in
    /// runs of different lengths, are left to the separate operations; the shapes are
    /// checked.
    #[test]
    fn fused_products_give_the_separate_operations_bits() {
        let device = Default::default();
        let n_in = 512;
        let fast = Precision::Fast;
        let norm_weight: Vec<f32> = (0..n_in).map(|i| 0.5 + (i % 13) as f32 * 0.07).collect();
        let norm_weight =
            Tensor::<Flex, 1>::from_data(TensorData::new(norm_weight, [n_in]), &device);
        let eps = 1e-5;
        for (a, b) in [
            (QuantFormat::Q4_K, QuantFormat::Q6_K),
            (QuantFormat::Q8_0, QuantFormat::Q4_0),
        ] {
            let (w, beside, up) = (
                random_matrix(a, 48, n_in, 1),
                random_matrix(b, 32, n_in, 2),
                random_matrix(a, 48, n_in, 3),
            );
            for rows in [19, 1, 5, 40] {
                let x: Vec<f32> = (0..rows * n_in)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 * (1 + i / n_in % 3) as f32)
                    .collect();
                let x = Tensor::<Flex, 2>::from_data(TensorData::new(x, [rows, n_in]), &device);
                let h = Flex::rms_norm(x.clone(), &norm_weight, eps).expect("norm");
                let product = |x: &Tensor<Flex, 2>, m: &QuantMatrix| {
                    Flex::quantized_matmul(x.clone(), m, fast).expect("product")
                };
                let norm = || Around::Norm(&norm_weight, eps);
                let fused = |beside: Beside<'_>, around: Around<'_, Flex>| {
                    Flex::fused_quantized_matmul(x.clone(), &w, beside, around, fast)
                        .expect("fused")
                        .expect("the CPU backend fuses in fast")
                };
                let residual = product(&x, &w).mul_scalar(-0.75);
                let cases = [
                    ("norm", fused(Beside::Nothing, norm()), product(&h, &w)),
                    (
                        "norm, two beside",
                        fused(Beside::Second(&beside), norm()),
                        Tensor::cat(vec![product(&h, &w), product(&h, &beside)], 1),
                    ),
                    (
                        "norm, gate",
                        fused(Beside::SwiGluUp(&up), norm()),
                        Flex::swiglu(product(&h, &w), product(&h, &up)).expect("swiglu"),
                    ),
                    (
                        "residual",
                        fused(Beside::Nothing, Around::Residual(residual.clone())),
                        residual.clone() + product(&x, &w),
                    ),
                ];
                for (case, fused, apart) in cases {
                    assert_eq!(fused.dims(), apart.dims(), "{case}");
                    let (fused, apart) = (values(fused), values(apart));
                    let first = fused.iter().zip(&apart).position(|(a, b)| a != b);
                    assert_eq!(first, None, "{a:?} {case}, {rows} rows");
                }
                let exact = Flex::fused_quantized_matmul(
                    x.clone(),
                    &w,
                    Beside::Nothing,
                    norm(),
                    Precision::Exact,
                );
                assert!(matches!(exact, Ok(None)), "{exact:?}");
            }
        }
        let x = Tensor::<Flex, 2>::ones([3, n_in], &device);
        let (w, q8) = (
            random_matrix(QuantFormat::Q4_K, 48, n_in, 1),
            random_matrix(QuantFormat::Q8_0, 32, n_in, 2),
        );
        let norm = || Around::Norm(&norm_weight, 1e-5);
        let runs_differ =
            Flex::fused_quantized_matmul(x.clone(), &w, Beside::Second(&q8), norm(), fast);
        assert!(matches!(runs_differ, Ok(None)), "{runs_differ:?}");
        let short = Tensor::<Flex, 2>::ones([3, 47], &device);
        let got = Flex::fused_quantized_matmul(
            x.clone(),
            &w,
            Beside::Nothing,
            Around::Residual(short),
            fast,
        );
        assert!(
            matches!(&got, Err(LlamaError::ShapeMismatch { name, .. }) if name == "residual of a quantized product"),
            "{got:?}"
        );
        let narrow = Tensor::<Flex, 1>::ones([n_in - 1], &device);
        let got = Flex::fused_quantized_matmul(
            x.clone(),
            &w,
            Beside::Nothing,
            Around::Norm(&narrow, 1e-5),
            fast,
        );
        assert!(
            matches!(&got, Err(LlamaError::ShapeMismatch { name, .. }) if name == "rms_norm weight"),
            "{got:?}"
        );
        let other = random_matrix(QuantFormat::Q4_K, 48, 2 * n_in, 4);
        let got = Flex::fused_quantized_matmul(x, &w, Beside::SwiGluUp(&other), norm(), fast);
        assert!(
            matches!(&got, Err(LlamaError::ShapeMismatch { name, .. }) if name == "quantized matmul input"),
            "{got:?}"
        );
    }
}
