//! Our own CubeCL kernels for Burn's CubeCL backends (`cuda`, `wgpu`, `vulkan`): written
//! once, compiled by CubeCL for CUDA, Vulkan/WGPU and Metal, and run behind
//! [`LlamaBackend`] as the CPU backend's kernels are.
//!
//! [`CubeKernels`] is the kernels at the level of Burn's tensor primitives, implemented
//! for every [`CubeBackend`] and, through a custom operation in Burn's fusion stream, for
//! [`Fusion`] over one (what `burn::backend::{Cuda, Wgpu, Vulkan}` are with Burn's default
//! features). [`LlamaBackend`] is implemented for both with the kernels in place of the
//! portable defaults where there is one:
//!
//! - [`paged_attention`](LlamaBackend::paged_attention): reads every sequence's block
//!   table on the device, decode and prompt chunks, grouped-query heads, causal; no
//!   gathered copy of the pool, no padding, no mask.
//! - [`paged_store_encoded`](LlamaBackend::paged_store_encoded) and
//!   [`paged_attention_encoded`](LlamaBackend::paged_attention_encoded): the KV cache in
//!   f16, bf16, `q8_0` or `q4_0` on the device, the host pool's bytes four to a word,
//!   each token encoded from its own values by the host's rounding rules, each key and
//!   value decoded where the attention reads it.
//! - [`quantized_matmul`](LlamaBackend::quantized_matmul): weights stay in their GGUF
//!   blocks on the device ([`keeps_quantized_weights`](LlamaBackend::keeps_quantized_weights)),
//!   uploaded once on first use; every kept format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K,
//!   Q4_K, Q5_K, Q6_K) is multiplied by a fused dequantize-and-multiply kernel. Decode takes one row per unit; prompts and batches of
//!   4 rows or more take tiles of 4 or 8 rows per unit, each weight decoded once per tile
//!   (`quant_tile`), with a row's arithmetic the same at every tile size.
//!   In the `fast` precision the product is the CPU `fast` product's bits instead
//!   (`kernels::int_matmul_kernel`): the activations quantized in the kernel's prologue
//!   by the CPU's rule, exact integer block sums, the float steps in the CPU's order, with
//!   a fused multiply-add emulated exactly where the device's may round twice
//!   (`native_fma`).
//!   Two matrices of unlike formats (a Q4_K_M layer's Q+K beside its Q6_K values) go in
//!   one launch ([`quantized_matmul_two`](LlamaBackend::quantized_matmul_two)), and so do
//!   gate, up and SwiGLU ([`quantized_swiglu`](LlamaBackend::quantized_swiglu)).
//! - [`rope_paged_store`](LlamaBackend::rope_paged_store): RoPE on a step's queries and
//!   keys and the paged write of its keys and values in one kernel, the angles read from
//!   the RoPE table at each token's position; with Q, K and V in one product and each
//!   residual add inside the next norm, a decode step launches 8 kernels a layer.
//! - [`fused_quantized_matmul`](LlamaBackend::fused_quantized_matmul): in the `fast`
//!   precision a layer's RMSNorm runs in the prologue of the product after it (Q, K and
//!   V; gate and up) and each residual add in the epilogue of the product before it (the
//!   output projection; down), the bits of the separate kernels: 6 launches a layer.
//! - [`rms_norm`](LlamaBackend::rms_norm), [`add_rms_norm`](LlamaBackend::add_rms_norm),
//!   [`rope`](LlamaBackend::rope), [`swiglu`](LlamaBackend::swiglu) and the attention
//!   kernels take the CPU kernels' steps in their order with their roundings (each product
//!   kept from contraction into a fused multiply-add, division and square root corrected
//!   to nearest, the CPU's `exp`), so with the `fast` product the whole model's f32 logits
//!   are the CPU backend's bit for bit.
//! - [`dense_matmul`](LlamaBackend::dense_matmul): projections and the output head held
//!   in the float type (F32/F16/BF16 checkpoints) through our own kernel, each output its
//!   own sum in one order, so that they are batch-invariant too: Burn's matmul is not
//!   (on wgpu every row of a 2- to 128-row product differed in some bits from the row
//!   alone).
//! - [`greedy_tokens`](LlamaBackend::greedy_tokens): each row's argmax on the device, so a
//!   step whose rows all decode greedily reads back token ids, not logits.
//! - [`sample_tokens`](LlamaBackend::sample_tokens): a row drawn with temperature,
//!   top-k, top-p and min-p (the rule of [`crate::sampling::device`]) on the device, with
//!   the uniform its own generator gives on the host: one workgroup per row, every sum in
//!   an order fixed by the row alone, top-k and top-p cuts found by a search over the
//!   bits of the threshold (no sort), the draw a walk of the kept weights in id order, as
//!   the host pipeline's; the token and its raw log-probability come back.

mod kernels;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive, backend::Backend};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};

use crate::backend::{Around, Beside, LlamaBackend, check_quantized_input};
use crate::cache::paged::DeviceKvPool;
use crate::config::Precision;
use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;
use crate::model::paged_batch::PagedBatch;
use crate::sampling::{DeviceDraw, DeviceToken};

/// The shape of a paged attention call (see [`CubeKernels::paged_attention_primitive`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    /// Query tokens (rows of `q`).
    pub tokens: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads of the pool (dividing `n_heads`).
    pub kv_heads: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Values per head.
    pub dim: usize,
}

/// The shape of a quantized product (see [`CubeKernels::quantized_matmul_primitive`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantShape {
    /// Rows of `x`.
    pub rows: usize,
    /// Outputs (rows of the weight).
    pub n_out: usize,
    /// Inputs (columns of `x` and of the weight, a whole number of blocks).
    pub cols: usize,
    /// The block format: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_K, 6 Q5_0, 7 Q5_1,
    /// 8 Q3_K.
    pub format: u32,
    /// Blocks per row of the weight (`cols` over the format's values per block).
    pub blocks: usize,
    /// The `fast` precision's integer product: the activations quantized on the device
    /// as the CPU quantizes them, integer block sums, the float steps in the CPU's order,
    /// so the outputs are the CPU `fast` product's bits (else the f32 product of the
    /// dequantized weights, `exact`).
    pub integer: bool,
    /// A second matrix in the same launch (its format code and outputs), its words in
    /// the product's `up` tensor: the outputs are the first matrix's `n_out` then the
    /// second's, in rows of `n_out + n_second`. It takes the same `cols` and units per
    /// output as the first.
    pub second: Option<(u32, usize)>,
    /// With `integer`: whether the product may take the tile kernel (see [`TensorCores`]).
    pub tensor_cores: TensorCores,
}

/// Which kernel a `fast` product takes on a CubeCL device: the integer sums on tensor
/// cores, or in plain multiply-adds. The bits are the same either way (the CPU `fast`
/// product's).
///
/// The default is [`TensorCores::Off`] until the tensor-core form has run on an NVIDIA
/// GPU (its portable form is tested on every CI run, on lavapipe); opt in with
/// `LLAMA_BURN_TENSOR_CORES=auto` or [`set_tensor_cores`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TensorCores {
    /// Fragment products of 16 x 16 x 16 `i8` values into `i32` on tensor cores
    /// (`kernels::int_tiles_kernel`) for products of [`TENSOR_CORE_ROWS`] rows or more
    /// on a device that offers them (CUDA from sm_72; Vulkan's cooperative matrices),
    /// else the scalar kernel (`kernels::int_matmul_kernel`).
    Auto,
    /// Always the scalar kernel.
    #[default]
    Off,
    /// The tile kernel at every row count on every device, its fragment products in plain
    /// integer multiply-adds: the same tiles, sums and float steps as with tensor cores,
    /// for testing that kernel where there are none (lavapipe). Slow.
    Portable,
}

/// The most units a cube of the attention kernels takes (a query head's units are its
/// values), where the device allows that many: 1,024, CUDA's limit, so the Llama 3
/// shapes share every group (the 3B's three heads of 128, the 8B's four); a WebGPU
/// device with its default limit of 256 takes fewer.
const ATTENTION_UNITS: usize = 1024;

/// Floats of keys (or values) the attention kernels stage in shared memory a tile: 16 KiB,
/// so a cube fits the 32 KiB of lavapipe and of Apple's GPUs.
const ATTENTION_STAGED: usize = 4096;

/// How the attention kernels cut the work: query heads per cube (the most of a group
/// sharing one key/value head whose units fit [`ATTENTION_UNITS`] and the device's cube),
/// so the cube reads (and decodes) each key and value once for all of them, and keys per
/// tile (`dim`, or fewer where a tile of `dim` keys would not fit [`ATTENTION_STAGED`]).
/// Neither changes a result's bits: each head's sums keep their order whatever the tile.
fn attention_layout<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    shape: PagedShape,
) -> (usize, usize) {
    let hardware = &client.properties().hardware;
    let units = ATTENTION_UNITS.min(hardware.max_units_per_cube as usize);
    let groups = (shape.n_heads / shape.kv_heads.max(1)).max(1);
    let dim = shape.dim.max(1);
    let heads = (1..=groups)
        .rev()
        .find(|&h| {
            groups.is_multiple_of(h) && h * dim <= units && h <= hardware.max_cube_dim.1 as usize
        })
        .unwrap_or(1);
    let key_tile = dim.min(ATTENTION_STAGED / dim).max(1);
    (heads, key_tile)
}

/// The fewest rows a `fast` product takes tensor cores for under [`TensorCores::Auto`]
/// (a fragment is 16 rows; `LLAMA_BURN_TENSOR_CORE_ROWS` overrides it for a process).
pub const TENSOR_CORE_ROWS: usize = 16;

std::thread_local! {
    static TENSOR_CORES_HERE: core::cell::Cell<Option<TensorCores>> =
        const { core::cell::Cell::new(None) };
}

/// Sets which kernel the `fast` products submitted from this thread take (`None`: the
/// process's default, `LLAMA_BURN_TENSOR_CORES=auto|off|portable`, else
/// [`TensorCores::default`]). The choice is made where a product is submitted, so it holds
/// for the thread's products even where Burn's fusion stream launches them later; a
/// model run on another thread (the continuous engine's worker) takes that thread's, so
/// set the environment variable to change a whole process.
pub fn set_tensor_cores(mode: Option<TensorCores>) {
    TENSOR_CORES_HERE.with(|c| c.set(mode));
}

/// Which kernel the `fast` products submitted from this thread take (see
/// [`set_tensor_cores`]).
pub fn tensor_cores_mode() -> TensorCores {
    static DEFAULT: std::sync::OnceLock<TensorCores> = std::sync::OnceLock::new();
    TENSOR_CORES_HERE
        .with(core::cell::Cell::get)
        .unwrap_or_else(|| {
            *DEFAULT.get_or_init(|| {
                match std::env::var("LLAMA_BURN_TENSOR_CORES")
                    .ok()
                    .as_deref()
                    .map(str::trim)
                {
                    Some("auto") => TensorCores::Auto,
                    Some("portable") => TensorCores::Portable,
                    _ => TensorCores::default(),
                }
            })
        })
}

/// [`TENSOR_CORE_ROWS`], or `LLAMA_BURN_TENSOR_CORE_ROWS` where it is set to a number.
/// Read once per process.
fn tensor_core_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("LLAMA_BURN_TENSOR_CORE_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(TENSOR_CORE_ROWS)
    })
}

/// Bytes of shared memory a cube of [`kernels::int_tiles_kernel`] takes: the units'
/// largest magnitudes, the tile rows' scales and sums of `q`, the staged activations and
/// weights (`i8` on tensor cores, else `i32`), the planes' accumulators.
fn tile_shared_bytes(format: u32, pair: bool, tensor_cores: bool) -> usize {
    let planes = kernels::TILE_PLANES;
    let units = kernels::PLANE * planes;
    let subs = kernels::run_of(format);
    let value = if tensor_cores { 1 } else { 4 };
    let matrices = if pair { 2 } else { 1 };
    4 * units
        + 4 * 2 * kernels::TILE_ROWS
        + 4 * kernels::TILE_ROWS * subs
        + 512 * value
        + matrices * (planes * 512 * value + planes * 256 * 4)
}

/// Whether the device multiplies 16 x 16 x 16 fragments of `i8` into `i32` in planes
/// of 32 units (a CUDA warp; the tile kernel's layout).
fn int8_fragments<R: CubeRuntime>(client: &cubecl::client::ComputeClient<R>) -> bool {
    use cubecl::ir::features::MmaConfig;
    use cubecl::ir::{ElemType, IntKind};
    let i8 = ElemType::Int(IntKind::I8).into();
    let hardware = &client.properties().hardware;
    let planes_of_32 = hardware.plane_size_min == 32 && hardware.plane_size_max == 32;
    planes_of_32
        && client.features().matmul.cmma.contains(&MmaConfig {
            a_type: i8,
            b_type: i8,
            cd_type: ElemType::Int(IntKind::I32).into(),
            m: 16,
            n: 16,
            k: 16,
        })
}

/// What a quantized product does on either side of its multiply (see
/// [`CubeKernels::quantized_matmul_primitive`]): the work of the launches before and
/// after it in a layer, fused into its prologue or epilogue.
#[derive(Debug, Clone)]
pub enum ProductIo<T> {
    /// `x @ W^T`.
    Plain,
    /// `rms_norm(x) @ W^T`: each row of `x` normalized by `weight` (`[cols]`) with `eps`,
    /// the values [`CubeKernels::rms_norm_primitive`] gives.
    Norm {
        /// The norm's weight, `[cols]`.
        weight: T,
        /// The norm's epsilon.
        eps: f32,
    },
    /// `residual + x @ W^T`, the add rounded to the float type as a tensor add rounds
    /// it; `residual` has the output's shape.
    Residual(T),
}

impl<T> ProductIo<T> {
    /// The tensor it holds, if any, and what it is with `()` in the tensor's place.
    fn take(self) -> (Option<T>, ProductIo<()>) {
        match self {
            ProductIo::Plain => (None, ProductIo::Plain),
            ProductIo::Norm { weight, eps } => (Some(weight), ProductIo::Norm { weight: (), eps }),
            ProductIo::Residual(residual) => (Some(residual), ProductIo::Residual(())),
        }
    }
}

impl ProductIo<()> {
    /// The same with `t` in the tensor's place ([`Plain`](ProductIo::Plain) holds none).
    fn put<T>(&self, t: T) -> ProductIo<T> {
        match *self {
            ProductIo::Plain => ProductIo::Plain,
            ProductIo::Norm { eps, .. } => ProductIo::Norm { weight: t, eps },
            ProductIo::Residual(()) => ProductIo::Residual(t),
        }
    }
}

/// The shape of a dense product (see [`CubeKernels::dense_matmul_primitive`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseShape {
    /// Rows of `x`.
    pub rows: usize,
    /// Outputs.
    pub n_out: usize,
    /// Inputs (columns of `x`).
    pub cols: usize,
    /// `W` is `[n_out, cols]` (else `[cols, n_out]`).
    pub transposed: bool,
}

/// The largest head the paged attention kernel takes (one unit per value of a head).
pub const MAX_HEAD_DIM: usize = 256;

/// llama-burn's CubeCL kernels on a backend's tensor primitives.
pub trait CubeKernels: Backend {
    /// Whether `device` multiplies 16 x 16 x 16 fragments of `i8` into `i32` (tensor
    /// cores: CUDA from sm_72, Vulkan's cooperative matrices) in planes of 32 units, so
    /// that the `fast` products of [`TENSOR_CORE_ROWS`] rows or more take them (see
    /// [`TensorCores`]).
    fn int8_tensor_cores(device: &Self::Device) -> bool;

    /// Paged attention: `q` `[tokens, n_heads * dim]` over the pool `keys`/`values`
    /// `[blocks, kv_heads, block_size, dim]` through `table` (the layout of
    /// [`PagedBatch::device_table`]); returns `[tokens, n_heads * dim]`. The caller has
    /// checked the shapes and that every block named lies in the pool.
    fn paged_attention_primitive(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: IntTensor<Self>,
        shape: PagedShape,
    ) -> FloatTensor<Self>;

    /// `x @ W^T` for `x` `[rows, cols]` and `W` `[n_out, cols]` in ggml's blocks of
    /// `shape.format`, row by row, its bytes packed little-endian four to an integer
    /// (`words`); returns `[rows, n_out]`. The caller has checked the shapes.
    ///
    /// With `up` (the words of a second matrix of the same format and shape), each
    /// output is `silu(x @ W^T) * (x @ Up^T)` instead, in f32 (the feed-forward's gate,
    /// up and SwiGLU in one launch). With `shape.second` instead, `up` is a second matrix
    /// (of that format and outputs, the same `cols`) multiplied in the same launch, its
    /// outputs after the first's: `[rows, n_out + n_second]`.
    ///
    /// `io` says what is done on either side of the product ([`ProductIo`]): in the
    /// `fast` precision (`shape.integer`) inside the product's launch, else as launches
    /// of their own before or after it; the bits are those of the separate kernels.
    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        up: Option<IntTensor<Self>>,
        io: ProductIo<FloatTensor<Self>>,
        shape: QuantShape,
    ) -> FloatTensor<Self>;

    /// `x @ W` for `x` `[rows, cols]` and a dense `W` `[cols, n_out]`, or `x @ W^T` for
    /// `W` `[n_out, cols]` when `shape.transposed`; returns `[rows, n_out]`, each output
    /// its own sum in one order whatever the batch. The caller has checked the shapes.
    fn dense_matmul_primitive(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        shape: DenseShape,
    ) -> FloatTensor<Self>;

    /// The greedy token of each row of `logits` `[rows, vocab]` (the first index of the
    /// largest value), `vocab` for a row holding a NaN or nothing above minus infinity:
    /// `[rows]` integers. The caller has checked the shape.
    fn argmax_primitive(logits: FloatTensor<Self>, rows: usize, vocab: usize) -> IntTensor<Self>;

    /// Each row of `logits` `[rows, vocab]` drawn as `draws` `[rows * DeviceDraw::WORDS]`
    /// ([`DeviceDraw::words`] per row) says: `[rows * 3]` integers, per row the token
    /// (`vocab` where the row cannot be drawn) and its log-probability's `f32` bits, high
    /// then low 16 bits. The caller has checked the shapes.
    fn sample_primitive(
        logits: FloatTensor<Self>,
        draws: IntTensor<Self>,
        rows: usize,
        vocab: usize,
    ) -> IntTensor<Self>;

    /// RMSNorm of each row of `x` `[rows, d]` scaled by `weight` `[d]`, one cube per row
    /// (every sum in an order fixed by `d`); returns `[rows, d]`. The caller has checked
    /// the shapes.
    fn rms_norm_primitive(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self>;

    /// `x + delta` and the RMSNorm of that sum in one pass (the residual add of one
    /// sub-layer and the norm of the next): `(sum, normed)`, both `[rows, d]`. The caller
    /// has checked the shapes.
    fn add_rms_norm_primitive(
        x: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// SwiGLU of `gate` and `up` (the same shape), element by element, as the CPU computes
    /// it (see [`LlamaBackend::swiglu`]). The caller has checked the shapes.
    fn swiglu_primitive(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// RoPE in the rotate-half layout on `x` `[rows, width]` with `cos`/`sin` of its shape
    /// (see [`LlamaBackend::rope`]), heads of `head_dim` values. The caller has checked the
    /// shapes.
    fn rope_primitive(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        head_dim: usize,
    ) -> FloatTensor<Self>;

    /// Writes `k` and `v` (`[tokens, kv_heads * head_dim]`, rows may be a column slice of a
    /// wider tensor) into the pools `keys`/`values` at the slots `table` (the layout of
    /// [`PagedBatch::device_table`]) names; returns the pools, written in place where no
    /// other tensor shares them. The caller has checked the shapes.
    fn paged_store_primitive(
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// RoPE on `qk` (`[tokens, (n_heads + kv_heads) * dim]`, queries then keys; rows may
    /// be a column slice of a wider tensor) with `angles` (the tables of cosines and sines,
    /// `[positions, dim]`, read at each token's position in `table`), then the rotated keys and `v` written into the pools as
    /// [`paged_store_primitive`](Self::paged_store_primitive) writes them, in one launch:
    /// returns the rotated queries `[tokens, n_heads * dim]` and the pools. The caller has
    /// checked the shapes.
    fn rope_paged_store_primitive(
        qk: FloatTensor<Self>,
        v: FloatTensor<Self>,
        angles: [FloatTensor<Self>; 2],
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> [FloatTensor<Self>; 3];

    /// Writes `x` (`[tokens, kv_heads * dim]`, rows may be a column slice of a wider
    /// tensor) encoded in `kv.ty` into the word pool `pool` at the slots `table` names
    /// (see `kernels::paged_store_encoded_kernel`); returns the pool, written in place
    /// where no other tensor shares it. The caller has checked the shapes.
    fn paged_store_encoded_primitive(
        x: FloatTensor<Self>,
        table: IntTensor<Self>,
        pool: IntTensor<Self>,
        kv: EncodedRows,
        shape: PagedShape,
    ) -> IntTensor<Self>;

    /// [`paged_attention_primitive`](Self::paged_attention_primitive) over the word pools
    /// `keys` (encoded as `k` says) and `values` (as `v` says). The caller has checked the
    /// shapes.
    fn paged_attention_encoded_primitive(
        q: FloatTensor<Self>,
        keys: IntTensor<Self>,
        values: IntTensor<Self>,
        table: IntTensor<Self>,
        kv: [EncodedRows; 2],
        shape: PagedShape,
    ) -> FloatTensor<Self>;
}

/// How the rows of an encoded device pool are stored (see
/// [`crate::cache::paged::DeviceKvPool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodedRows {
    /// The type's [`kernel_code`](crate::cache::KvCacheType::kernel_code).
    pub ty: u32,
    /// Words per row.
    pub row_words: usize,
}

impl<R, F, I, BT> CubeKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn int8_tensor_cores(device: &Self::Device) -> bool {
        int8_fragments(&R::client(device))
    }

    fn paged_attention_primitive(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: IntTensor<Self>,
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};

        let q = unit_stride_rows(q);
        let keys = into_contiguous(keys);
        let values = into_contiguous(values);
        let table = into_contiguous(table);
        let out_shape = burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]);
        let out = empty_on(&q, out_shape, q.dtype);
        let (f_dtype, i_dtype) = (q.dtype, table.dtype);
        let client = q.client.clone();
        let (heads, key_tile) = attention_layout(&client, shape);
        kernels::paged_attention_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, (shape.n_heads / heads) as u32, 1),
            CubeDim::new_2d(shape.dim as u32, heads as u32),
            q.into_tensor_arg(),
            keys.into_tensor_arg(),
            values.into_tensor_arg(),
            table.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape.n_heads as u32,
            (shape.n_heads / shape.kv_heads) as u32,
            shape.kv_heads as u32,
            shape.block_size as u32,
            1.0 / (shape.dim as f32).sqrt(),
            0,
            shape.dim,
            heads,
            key_tile,
            native_fma::<R>(&client),
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }

    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        up: Option<IntTensor<Self>>,
        io: ProductIo<FloatTensor<Self>>,
        shape: QuantShape,
    ) -> FloatTensor<Self> {
        use burn::tensor::ops::FloatTensorOps;
        if shape.integer {
            return quant_launch(x, words, up, io, shape);
        }
        // The f32 product has no prologue or epilogue: the norm and the add are launches
        // of their own.
        let plain = ProductIo::Plain;
        match io {
            ProductIo::Plain => quant_launch(x, words, up, plain, shape),
            ProductIo::Norm { weight, eps } => {
                let x = Self::rms_norm_primitive(x, weight, eps);
                quant_launch(x, words, up, plain, shape)
            }
            ProductIo::Residual(residual) => {
                Self::float_add(residual, quant_launch(x, words, up, plain, shape))
            }
        }
    }

    fn dense_matmul_primitive(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        shape: DenseShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};

        let x = into_contiguous(x);
        let w = into_contiguous(w);
        let out = empty_on(
            &x,
            burn::tensor::Shape::new([shape.rows, shape.n_out]),
            x.dtype,
        );
        let f_dtype = x.dtype;
        let client = x.client.clone();
        let width = 64u32;
        let tile = quant_tile(shape.rows);
        kernels::dense_matmul_kernel::launch::<R>(
            &client,
            CubeCount::Static(
                (shape.n_out as u32).div_ceil(width),
                shape.rows.div_ceil(tile) as u32,
                1,
            ),
            CubeDim::new_1d(width),
            x.into_tensor_arg(),
            w.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape.rows as u32,
            shape.n_out as u32,
            shape.cols as u32,
            shape.transposed,
            tile,
            f_dtype.into(),
        );
        out
    }

    fn argmax_primitive(logits: FloatTensor<Self>, rows: usize, vocab: usize) -> IntTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};

        let logits = into_contiguous(logits);
        let i_dtype = I::dtype();
        let out = empty_on(&logits, burn::tensor::Shape::new([rows]), i_dtype);
        let f_dtype = logits.dtype;
        let client = logits.client.clone();
        kernels::argmax_kernel::launch::<R>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(kernels::ARGMAX_WIDTH as u32),
            logits.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            vocab as u32,
            kernels::ARGMAX_WIDTH,
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }

    fn sample_primitive(
        logits: FloatTensor<Self>,
        draws: IntTensor<Self>,
        rows: usize,
        vocab: usize,
    ) -> IntTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};

        let logits = into_contiguous(logits);
        let draws = into_contiguous(draws);
        let i_dtype = draws.dtype;
        let n = rows * kernels::SAMPLE_OUT;
        let out = empty_on(&logits, burn::tensor::Shape::new([n]), i_dtype);
        let f_dtype = logits.dtype;
        let client = logits.client.clone();
        kernels::sample_kernel::launch::<R>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(kernels::SAMPLE_WIDTH as u32),
            logits.into_tensor_arg(),
            draws.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            vocab as u32,
            kernels::SAMPLE_WIDTH,
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }

    fn rms_norm_primitive(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        use cubecl::{CubeCount, CubeDim};
        let x = burn_cubecl::kernel::into_contiguous(x);
        let weight = burn_cubecl::kernel::into_contiguous(weight);
        let [rows, d] = dims2(&x);
        let out = empty_on(&x, burn::tensor::Shape::new([rows, d]), x.dtype);
        let client = x.client.clone();
        let dtype = x.dtype;
        kernels::rms_norm_kernel::launch::<R>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(kernels::NORM_WIDTH as u32),
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            d as u32,
            eps,
            0,
            native_fma::<R>(&client),
            dtype.into(),
        );
        out
    }

    fn add_rms_norm_primitive(
        x: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use cubecl::{CubeCount, CubeDim};
        let x = burn_cubecl::kernel::into_contiguous(x);
        let delta = burn_cubecl::kernel::into_contiguous(delta);
        let weight = burn_cubecl::kernel::into_contiguous(weight);
        let [rows, d] = dims2(&x);
        let sum = empty_on(&x, burn::tensor::Shape::new([rows, d]), x.dtype);
        let out = empty_on(&x, burn::tensor::Shape::new([rows, d]), x.dtype);
        let client = x.client.clone();
        let dtype = x.dtype;
        kernels::add_rms_norm_kernel::launch::<R>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(kernels::NORM_WIDTH as u32),
            x.into_tensor_arg(),
            delta.into_tensor_arg(),
            weight.into_tensor_arg(),
            sum.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            d as u32,
            eps,
            0,
            native_fma::<R>(&client),
            dtype.into(),
        );
        (sum, out)
    }

    fn swiglu_primitive(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        let gate = into_contiguous(gate);
        let up = into_contiguous(up);
        let [rows, width] = dims2(&gate);
        let out = empty_on(&gate, burn::tensor::Shape::new([rows, width]), gate.dtype);
        let client = gate.client.clone();
        let dtype = gate.dtype;
        let (count, dim) = elementwise_grid(rows * width);
        kernels::swiglu_kernel::launch::<R>(
            &client,
            count,
            dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            0,
            native_fma::<R>(&client),
            dtype.into(),
        );
        out
    }

    fn rope_primitive(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        head_dim: usize,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        let x = into_contiguous(x);
        let cos = into_contiguous(cos);
        let sin = into_contiguous(sin);
        let [rows, width] = dims2(&x);
        let out = empty_on(&x, burn::tensor::Shape::new([rows, width]), x.dtype);
        let client = x.client.clone();
        let dtype = x.dtype;
        let (count, dim) = elementwise_grid(rows * width);
        kernels::rope_kernel::launch::<R>(
            &client,
            count,
            dim,
            x.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            head_dim as u32,
            0,
            dtype.into(),
        );
        out
    }

    fn paged_store_primitive(
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};
        let (keys, values) = (owned_pool(keys), owned_pool(values));
        let table = into_contiguous(table);
        let client = keys.client.clone();
        let (f_dtype, i_dtype) = (keys.dtype, table.dtype);
        kernels::paged_store_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, 1, 1),
            CubeDim::new_1d(128),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            table.into_tensor_arg(),
            keys.clone().into_tensor_arg(),
            values.clone().into_tensor_arg(),
            shape.kv_heads as u32,
            shape.block_size as u32,
            shape.dim as u32,
            [f_dtype.into(), i_dtype.into()],
        );
        (keys, values)
    }

    fn rope_paged_store_primitive(
        qk: FloatTensor<Self>,
        v: FloatTensor<Self>,
        angles: [FloatTensor<Self>; 2],
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> [FloatTensor<Self>; 3] {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};
        let (keys, values) = (owned_pool(keys), owned_pool(values));
        let [cos, sin] = angles.map(into_contiguous);
        let table = into_contiguous(table);
        let q_width = shape.n_heads * shape.dim;
        let q = empty_on(
            &qk,
            burn::tensor::Shape::new([shape.tokens, q_width]),
            qk.dtype,
        );
        let client = keys.client.clone();
        let (f_dtype, i_dtype) = (keys.dtype, table.dtype);
        kernels::rope_paged_store_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, 1, 1),
            CubeDim::new_1d(128),
            qk.into_tensor_arg(),
            v.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            table.into_tensor_arg(),
            q.clone().into_tensor_arg(),
            keys.clone().into_tensor_arg(),
            values.clone().into_tensor_arg(),
            q_width as u32,
            shape.kv_heads as u32,
            shape.block_size as u32,
            shape.dim as u32,
            0,
            [f_dtype.into(), i_dtype.into()],
        );
        [q, keys, values]
    }

    fn paged_store_encoded_primitive(
        x: FloatTensor<Self>,
        table: IntTensor<Self>,
        pool: IntTensor<Self>,
        kv: EncodedRows,
        shape: PagedShape,
    ) -> IntTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};
        let pool = owned_pool(pool);
        let table = into_contiguous(table);
        let client = pool.client.clone();
        let (f_dtype, i_dtype) = (x.dtype, table.dtype);
        kernels::paged_store_encoded_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, 1, 1),
            CubeDim::new_1d(128),
            x.into_tensor_arg(),
            table.into_tensor_arg(),
            pool.clone().into_tensor_arg(),
            kv.ty,
            shape.kv_heads as u32,
            shape.block_size as u32,
            shape.dim as u32,
            kv.row_words as u32,
            [f_dtype.into(), i_dtype.into()],
        );
        pool
    }

    fn paged_attention_encoded_primitive(
        q: FloatTensor<Self>,
        keys: IntTensor<Self>,
        values: IntTensor<Self>,
        table: IntTensor<Self>,
        kv: [EncodedRows; 2],
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use cubecl::{CubeCount, CubeDim};

        let q = unit_stride_rows(q);
        let keys = into_contiguous(keys);
        let values = into_contiguous(values);
        let table = into_contiguous(table);
        let out_shape = burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]);
        let out = empty_on(&q, out_shape, q.dtype);
        let (f_dtype, i_dtype) = (q.dtype, table.dtype);
        let client = q.client.clone();
        let (heads, key_tile) = attention_layout(&client, shape);
        kernels::paged_attention_encoded_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, (shape.n_heads / heads) as u32, 1),
            CubeDim::new_2d(shape.dim as u32, heads as u32),
            q.into_tensor_arg(),
            keys.into_tensor_arg(),
            values.into_tensor_arg(),
            table.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape.n_heads as u32,
            (shape.n_heads / shape.kv_heads) as u32,
            shape.kv_heads as u32,
            shape.block_size as u32,
            1.0 / (shape.dim as f32).sqrt(),
            kv[0].ty,
            kv[0].row_words as u32,
            kv[1].ty,
            kv[1].row_words as u32,
            0,
            shape.dim,
            heads,
            key_tile,
            native_fma::<R>(&client),
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }
}

impl<B: FusionBackend + CubeKernels> CubeKernels for Fusion<B> {
    fn int8_tensor_cores(device: &Self::Device) -> bool {
        B::int8_tensor_cores(device)
    }

    fn paged_attention_primitive(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: IntTensor<Self>,
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        let out = (
            burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]),
            q.dtype,
        );
        let [attended] = stream_kernel::<B, 3, 1, 1>(
            "llama_burn_paged_attention",
            [q, keys, values],
            [table],
            [out],
            move |[q, keys, values], [table]| {
                [B::paged_attention_primitive(q, keys, values, table, shape)]
            },
        );
        attended
    }

    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        up: Option<IntTensor<Self>>,
        io: ProductIo<FloatTensor<Self>>,
        shape: QuantShape,
    ) -> FloatTensor<Self> {
        let n_second = shape.second.map_or(0, |(_, n)| n);
        let out = (
            burn::tensor::Shape::new([shape.rows, shape.n_out + n_second]),
            x.dtype,
        );
        // The norm's weight or the residual is the operation's second float input.
        let (extra, kind) = io.take();
        let name = match (&extra, &up) {
            (None, None) => "llama_burn_quantized_matmul",
            (None, Some(_)) => "llama_burn_quantized_swiglu",
            (Some(_), None) => "llama_burn_quantized_matmul_io",
            (Some(_), Some(_)) => "llama_burn_quantized_swiglu_io",
        };
        let [product] = match (extra, up) {
            (None, None) => {
                stream_kernel::<B, 1, 1, 1>(name, [x], [words], [out], move |[x], [w]| {
                    [B::quantized_matmul_primitive(
                        x,
                        w,
                        None,
                        ProductIo::Plain,
                        shape,
                    )]
                })
            }
            (None, Some(up)) => {
                stream_kernel::<B, 1, 2, 1>(name, [x], [words, up], [out], move |[x], [w, up]| {
                    [B::quantized_matmul_primitive(
                        x,
                        w,
                        Some(up),
                        ProductIo::Plain,
                        shape,
                    )]
                })
            }
            (Some(extra), None) => {
                stream_kernel::<B, 2, 1, 1>(name, [x, extra], [words], [out], move |[x, e], [w]| {
                    [B::quantized_matmul_primitive(
                        x,
                        w,
                        None,
                        kind.put(e),
                        shape,
                    )]
                })
            }
            (Some(extra), Some(up)) => stream_kernel::<B, 2, 2, 1>(
                name,
                [x, extra],
                [words, up],
                [out],
                move |[x, e], [w, up]| {
                    [B::quantized_matmul_primitive(
                        x,
                        w,
                        Some(up),
                        kind.put(e),
                        shape,
                    )]
                },
            ),
        };
        product
    }

    fn dense_matmul_primitive(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        shape: DenseShape,
    ) -> FloatTensor<Self> {
        let out = (burn::tensor::Shape::new([shape.rows, shape.n_out]), x.dtype);
        let [product] = stream_kernel::<B, 2, 0, 1>(
            "llama_burn_dense_matmul",
            [x, w],
            [],
            [out],
            move |[x, w], []| [B::dense_matmul_primitive(x, w, shape)],
        );
        product
    }

    fn argmax_primitive(logits: FloatTensor<Self>, rows: usize, vocab: usize) -> IntTensor<Self> {
        use burn::tensor::Element;
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream.
        #[derive(Debug)]
        struct ArgmaxOp<B> {
            desc: CustomOpIr,
            rows: usize,
            vocab: usize,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for ArgmaxOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([logits], [out]) = self.desc.as_fixed();
                let result = B::argmax_primitive(
                    handles.get_float_tensor::<B>(logits),
                    self.rows,
                    self.vocab,
                );
                handles.register_int_tensor::<B>(&out.id, result);
            }
        }

        let client = logits.client.clone();
        let streams = OperationStreams::with_inputs([&logits]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            burn::tensor::Shape::new([rows]),
            <B::IntElem as Element>::dtype(),
        );
        let desc = CustomOpIr::new("llama_burn_argmax", &[logits.into_ir()], &[out]);
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                ArgmaxOp::<B> {
                    desc,
                    rows,
                    vocab,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
    }

    fn sample_primitive(
        logits: FloatTensor<Self>,
        draws: IntTensor<Self>,
        rows: usize,
        vocab: usize,
    ) -> IntTensor<Self> {
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream.
        #[derive(Debug)]
        struct SampleOp<B> {
            desc: CustomOpIr,
            rows: usize,
            vocab: usize,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for SampleOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([logits, draws], [out]) = self.desc.as_fixed();
                let result = B::sample_primitive(
                    handles.get_float_tensor::<B>(logits),
                    handles.get_int_tensor::<B>(draws),
                    self.rows,
                    self.vocab,
                );
                handles.register_int_tensor::<B>(&out.id, result);
            }
        }

        let client = logits.client.clone();
        let streams = OperationStreams::with_inputs([&logits, &draws]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            burn::tensor::Shape::new([rows * kernels::SAMPLE_OUT]),
            draws.dtype,
        );
        let desc = CustomOpIr::new(
            "llama_burn_sample",
            &[logits.into_ir(), draws.into_ir()],
            &[out],
        );
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                SampleOp::<B> {
                    desc,
                    rows,
                    vocab,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
    }

    fn rms_norm_primitive(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        let out = (x.shape.clone(), x.dtype);
        let [normed] = stream_kernel::<B, 2, 0, 1>(
            "llama_burn_rms_norm",
            [x, weight],
            [],
            [out],
            move |[x, weight], []| [B::rms_norm_primitive(x, weight, eps)],
        );
        normed
    }

    fn add_rms_norm_primitive(
        x: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let out = (x.shape.clone(), x.dtype);
        let [sum, normed] = stream_kernel::<B, 3, 0, 2>(
            "llama_burn_add_rms_norm",
            [x, delta, weight],
            [],
            [out.clone(), out],
            move |[x, delta, weight], []| {
                let (sum, normed) = B::add_rms_norm_primitive(x, delta, weight, eps);
                [sum, normed]
            },
        );
        (sum, normed)
    }

    fn swiglu_primitive(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = (gate.shape.clone(), gate.dtype);
        let [gated] = stream_kernel::<B, 2, 0, 1>(
            "llama_burn_swiglu",
            [gate, up],
            [],
            [out],
            move |[gate, up], []| [B::swiglu_primitive(gate, up)],
        );
        gated
    }

    fn rope_primitive(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        head_dim: usize,
    ) -> FloatTensor<Self> {
        let out = (x.shape.clone(), x.dtype);
        let [rotated] = stream_kernel::<B, 3, 0, 1>(
            "llama_burn_rope",
            [x, cos, sin],
            [],
            [out],
            move |[x, cos, sin], []| [B::rope_primitive(x, cos, sin, head_dim)],
        );
        rotated
    }

    fn paged_store_primitive(
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let outs = [
            (keys.shape.clone(), keys.dtype),
            (values.shape.clone(), values.dtype),
        ];
        let [keys, values] = stream_kernel::<B, 4, 1, 2>(
            "llama_burn_paged_store",
            [k, v, keys, values],
            [table],
            outs,
            move |[k, v, keys, values], [table]| {
                let (keys, values) = B::paged_store_primitive(k, v, table, keys, values, shape);
                [keys, values]
            },
        );
        (keys, values)
    }

    fn rope_paged_store_primitive(
        qk: FloatTensor<Self>,
        v: FloatTensor<Self>,
        angles: [FloatTensor<Self>; 2],
        table: IntTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        shape: PagedShape,
    ) -> [FloatTensor<Self>; 3] {
        let outs = [
            (
                burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]),
                qk.dtype,
            ),
            (keys.shape.clone(), keys.dtype),
            (values.shape.clone(), values.dtype),
        ];
        let [cos, sin] = angles;
        stream_kernel::<B, 6, 1, 3>(
            "llama_burn_rope_paged_store",
            [qk, v, cos, sin, keys, values],
            [table],
            outs,
            move |[qk, v, cos, sin, keys, values], [table]| {
                B::rope_paged_store_primitive(qk, v, [cos, sin], table, keys, values, shape)
            },
        )
    }

    fn paged_store_encoded_primitive(
        x: FloatTensor<Self>,
        table: IntTensor<Self>,
        pool: IntTensor<Self>,
        kv: EncodedRows,
        shape: PagedShape,
    ) -> IntTensor<Self> {
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream.
        #[derive(Debug)]
        struct StoreOp<B> {
            desc: CustomOpIr,
            kv: EncodedRows,
            shape: PagedShape,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for StoreOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([x, table, pool], [out]) = self.desc.as_fixed();
                let result = B::paged_store_encoded_primitive(
                    handles.get_float_tensor::<B>(x),
                    handles.get_int_tensor::<B>(table),
                    handles.get_int_tensor::<B>(pool),
                    self.kv,
                    self.shape,
                );
                handles.register_int_tensor::<B>(&out.id, result);
            }
        }

        let client = x.client.clone();
        let streams = OperationStreams::with_inputs([&x, &table, &pool]);
        let out = TensorIr::uninit(client.create_empty_handle(), pool.shape.clone(), pool.dtype);
        let desc = CustomOpIr::new(
            "llama_burn_paged_store_encoded",
            &[x.into_ir(), table.into_ir(), pool.into_ir()],
            &[out],
        );
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                StoreOp::<B> {
                    desc,
                    kv,
                    shape,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
    }

    fn paged_attention_encoded_primitive(
        q: FloatTensor<Self>,
        keys: IntTensor<Self>,
        values: IntTensor<Self>,
        table: IntTensor<Self>,
        kv: [EncodedRows; 2],
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        let out = (
            burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]),
            q.dtype,
        );
        let [attended] = stream_kernel::<B, 1, 3, 1>(
            "llama_burn_paged_attention_encoded",
            [q],
            [keys, values, table],
            [out],
            move |[q], [keys, values, table]| {
                [B::paged_attention_encoded_primitive(
                    q, keys, values, table, kv, shape,
                )]
            },
        );
        attended
    }
}

/// A matrix whose rows our kernels read at `stride(0)` apart: copied only where its
/// values within a row are not adjacent (a column slice of a wider matrix is read in
/// place).
fn unit_stride_rows<R: CubeRuntime>(
    t: burn_cubecl::tensor::CubeTensor<R>,
) -> burn_cubecl::tensor::CubeTensor<R> {
    if t.meta.strides().last().is_some_and(|&s| s == 1) {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// The grid of an element-wise kernel over `values` values: one unit per value, 256
/// units a cube (the kernels check their index against the length).
fn elementwise_grid(values: usize) -> (cubecl::CubeCount, cubecl::CubeDim) {
    const UNITS: u32 = 256;
    (
        cubecl::CubeCount::Static((values as u32).div_ceil(UNITS), 1, 1),
        cubecl::CubeDim::new_1d(UNITS),
    )
}

/// The two dimensions of a matrix (a vector counts as one row).
fn dims2<R: CubeRuntime>(t: &burn_cubecl::tensor::CubeTensor<R>) -> [usize; 2] {
    let shape = t.meta.shape();
    match shape.num_dims() {
        1 => [1, shape[0]],
        _ => [
            shape.num_elements() / shape[shape.num_dims() - 1],
            shape[shape.num_dims() - 1],
        ],
    }
}

/// A pool to write in place, contiguous: the tensor itself when nothing else holds it
/// (the cache owns it), else a copy, so that no other tensor sees the write.
fn owned_pool<R: CubeRuntime>(
    pool: burn_cubecl::tensor::CubeTensor<R>,
) -> burn_cubecl::tensor::CubeTensor<R> {
    let pool = burn_cubecl::kernel::into_contiguous(pool);
    if pool.can_mut() { pool } else { pool.copy() }
}

/// One quantized product launch ([`CubeKernels::quantized_matmul_primitive`]): the
/// `fast` kernel (`shape.integer`), whose prologue and epilogue take `io`, or the f32
/// one (`io` then [`ProductIo::Plain`]).
fn quant_launch<R: CubeRuntime>(
    x: burn_cubecl::tensor::CubeTensor<R>,
    words: burn_cubecl::tensor::CubeTensor<R>,
    up: Option<burn_cubecl::tensor::CubeTensor<R>>,
    io: ProductIo<burn_cubecl::tensor::CubeTensor<R>>,
    shape: QuantShape,
) -> burn_cubecl::tensor::CubeTensor<R> {
    use burn_cubecl::kernel::into_contiguous;
    use cubecl::{CubeCount, CubeDim};

    let x = into_contiguous(x);
    let words = into_contiguous(words);
    let pair = up.is_some();
    // Without a pair the kernel never reads `up`: the weight's words stand in.
    let up = up.map_or_else(|| words.clone(), into_contiguous);
    let (second, n_second) = shape.second.unwrap_or((kernels::NO_SECOND, 0));
    let pair = pair && shape.second.is_none();
    let out = empty_on(
        &x,
        burn::tensor::Shape::new([shape.rows, shape.n_out + n_second]),
        x.dtype,
    );
    let (f_dtype, i_dtype) = (x.dtype, words.dtype);
    let client = x.client.clone();
    let tile = quant_tile(shape.rows);
    let lanes = quant_lanes(shape.blocks);
    let outputs = kernels::QUANT_OUTPUTS as u32;
    let cubes = (shape.n_out as u32).div_ceil(outputs) + (n_second as u32).div_ceil(outputs);
    let count = CubeCount::Static(cubes, shape.rows.div_ceil(tile) as u32, 1);
    let dim = CubeDim::new_2d(outputs, lanes as u32);
    let tiles = match (shape.integer, &io, shape.tensor_cores) {
        (false, _, _) | (_, ProductIo::Norm { .. }, _) | (_, _, TensorCores::Off) => None,
        (true, _, TensorCores::Portable) => Some(false),
        (true, _, TensorCores::Auto) => {
            (shape.rows >= tensor_core_rows() && int8_fragments(&client)).then_some(true)
        }
    }
    .filter(|&tensor_cores| {
        // The tile kernel where its shared memory fits (else the scalar kernel, which
        // gives the same bits).
        let formats = [Some(shape.format), shape.second.map(|(f, _)| f)];
        let bytes = formats
            .into_iter()
            .flatten()
            .map(|f| tile_shared_bytes(f, pair, tensor_cores))
            .max()
            .unwrap_or(0);
        bytes <= client.properties().hardware.max_shared_memory_size
    });
    if shape.integer {
        // Without a norm or a residual the kernels never read `extra`: `x` stands in.
        let (extra, eps, io) = match io {
            ProductIo::Plain => (x.clone(), 0.0, kernels::IO_PLAIN),
            ProductIo::Norm { weight, eps } => (into_contiguous(weight), eps, kernels::IO_NORM),
            ProductIo::Residual(residual) => (into_contiguous(residual), 0.0, kernels::IO_RESIDUAL),
        };
        if let Some(tensor_cores) = tiles {
            let planes = kernels::TILE_PLANES;
            let per_cube = (kernels::TILE_OUTPUTS * planes) as u32;
            let cubes =
                (shape.n_out as u32).div_ceil(per_cube) + (n_second as u32).div_ceil(per_cube);
            let count = CubeCount::Static(cubes, shape.rows.div_ceil(kernels::TILE_ROWS) as u32, 1);
            let dim = CubeDim::new_2d(kernels::PLANE as u32, planes as u32);
            // `i8` fragments on tensor cores; `i32` values for the plain multiply-adds (WGSL
            // has no 8-bit type).
            let e_dtype = if tensor_cores {
                burn::tensor::DType::I8
            } else {
                burn::tensor::DType::I32
            };
            kernels::int_tiles_kernel::launch::<R>(
                &client,
                count,
                dim,
                x.into_tensor_arg(),
                words.into_tensor_arg(),
                up.into_tensor_arg(),
                extra.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                shape.rows as u32,
                shape.n_out as u32,
                n_second as u32,
                shape.cols as u32,
                0,
                shape.format,
                second,
                planes,
                pair,
                io,
                native_fma::<R>(&client),
                tensor_cores,
                [f_dtype.into(), i_dtype.into(), e_dtype.into()],
            );
            return out;
        }
        // The activations are quantized in the kernel's prologue.
        kernels::int_matmul_kernel::launch::<R>(
            &client,
            count,
            dim,
            x.into_tensor_arg(),
            words.into_tensor_arg(),
            up.into_tensor_arg(),
            extra.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape.rows as u32,
            shape.n_out as u32,
            n_second as u32,
            shape.cols as u32,
            eps,
            0,
            shape.format,
            second,
            tile,
            lanes,
            pair,
            io,
            native_fma::<R>(&client),
            [f_dtype.into(), i_dtype.into()],
        );
        return out;
    }
    kernels::quantized_matmul_kernel::launch::<R>(
        &client,
        count,
        dim,
        x.into_tensor_arg(),
        words.into_tensor_arg(),
        up.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        shape.rows as u32,
        shape.n_out as u32,
        n_second as u32,
        shape.cols as u32,
        0,
        shape.format,
        second,
        tile,
        lanes,
        pair,
        native_fma::<R>(&client),
        [f_dtype.into(), i_dtype.into()],
    );
    out
}

/// A new contiguous tensor of `shape` and `dtype` on `t`'s device and client (a kernel's
/// output).
fn empty_on<R: CubeRuntime>(
    t: &burn_cubecl::tensor::CubeTensor<R>,
    shape: burn::tensor::Shape,
    dtype: burn::tensor::DType,
) -> burn_cubecl::tensor::CubeTensor<R> {
    let bytes = shape.num_elements() * dtype.size();
    burn_cubecl::tensor::CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        shape,
        t.client.empty(bytes),
        dtype,
    )
}

/// One of our kernels as an operation of Burn's fusion stream: `run` gets the inner
/// backend's tensors (`F` floats, then `I` integers) when the stream reaches it and
/// returns the `O` float outputs. (The argmax and the sampler, whose outputs are
/// integers, keep operations of their own.)
struct StreamKernel<B: FusionBackend, const F: usize, const I: usize, const O: usize> {
    desc: burn_ir::CustomOpIr,
    #[allow(clippy::type_complexity)]
    run: Box<dyn Fn([FloatTensor<B>; F], [IntTensor<B>; I]) -> [FloatTensor<B>; O] + Send + Sync>,
}

impl<B: FusionBackend, const F: usize, const I: usize, const O: usize> core::fmt::Debug
    for StreamKernel<B, F, I, O>
{
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StreamKernel")
            .field("desc", &self.desc)
            .finish()
    }
}

impl<B: FusionBackend, const F: usize, const I: usize, const O: usize>
    burn_fusion::stream::Operation<B::FusionRuntime> for StreamKernel<B, F, I, O>
{
    fn execute(
        &self,
        handles: &mut burn_ir::HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs = &self.desc.inputs;
        let floats: [FloatTensor<B>; F] =
            core::array::from_fn(|i| handles.get_float_tensor::<B>(&inputs[i]));
        let ints: [IntTensor<B>; I] =
            core::array::from_fn(|i| handles.get_int_tensor::<B>(&inputs[F + i]));
        for (out, tensor) in self.desc.outputs.iter().zip((self.run)(floats, ints)) {
            handles.register_float_tensor::<B>(&out.id, tensor);
        }
    }
}

/// Registers `run` (a kernel on the inner backend) in the fusion stream of its inputs
/// and returns its outputs, of the shapes and types `outputs` says.
fn stream_kernel<B: FusionBackend, const F: usize, const I: usize, const O: usize>(
    name: &'static str,
    floats: [FloatTensor<Fusion<B>>; F],
    ints: [IntTensor<Fusion<B>>; I],
    outputs: [(burn::tensor::Shape, burn::tensor::DType); O],
    run: impl Fn([FloatTensor<B>; F], [IntTensor<B>; I]) -> [FloatTensor<B>; O] + Send + Sync + 'static,
) -> [FloatTensor<Fusion<B>>; O] {
    use burn_fusion::stream::OperationStreams;
    use burn_ir::{CustomOpIr, OperationIr, TensorIr};
    let client = floats[0].client.clone();
    let streams = OperationStreams::with_inputs(floats.iter().chain(ints.iter()));
    let outs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = floats
        .into_iter()
        .map(|t| t.into_ir())
        .chain(ints.into_iter().map(|t| t.into_ir()))
        .collect();
    let desc = CustomOpIr::new(name, &inputs, &outs);
    let results = client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        StreamKernel::<B, F, I, O> {
            desc,
            run: Box::new(run),
        },
    );
    let mut results = results.into_iter();
    core::array::from_fn(|_| results.next().expect("one tensor per declared output"))
}

/// The CubeCL backend under a [`Fusion`] one: `Unfused<burn::backend::Cuda>` is Burn's
/// CUDA backend without its fusion stream, every operation launched as it comes (our
/// kernels are the same on both). For comparing the two (`gpu_bench --no-fusion`).
pub type Unfused<B> = <B as FusedBackend>::Inner;

/// A [`Fusion`] backend's inner backend (see [`Unfused`]).
pub trait FusedBackend {
    /// The backend the fusion stream runs on.
    type Inner;
}

impl<B: FusionBackend> FusedBackend for Fusion<B> {
    type Inner = B;
}

/// Logs every kernel launch of Burn's CubeCL backends to `path`, one line `Executing
/// NAME` per launch (CubeCL's execution-only profiling level: no timing, no
/// synchronization), for counting the launches of a decode step (`gpu_bench
/// --count-launches`). CubeCL writes the lines from a background task, a moment after
/// the launch.
///
/// # Errors
///
/// [`LlamaError::Runtime`] if CubeCL's configuration was already read or set: call this
/// before the first tensor of any CubeCL device.
pub fn log_kernel_launches(path: &std::path::Path) -> Result<()> {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, profiling::ProfilingLogLevel};
    let mut config = CubeClRuntimeConfig::default();
    config.profiling.logger.level = ProfilingLogLevel::Minimal;
    config.profiling.logger.file = Some(path.to_path_buf());
    config.profiling.logger.append = true;
    std::panic::catch_unwind(move || CubeClRuntimeConfig::set(config)).map_err(|_| {
        LlamaError::Runtime(
            "CubeCL's configuration is already in use: log kernel launches before the first \
             tensor"
                .into(),
        )
    })
}

/// [`LlamaBackend::greedy_tokens`] through [`CubeKernels::argmax_primitive`]: only the
/// `rows` token ids are read back.
fn greedy_tokens<B: LlamaBackend + CubeKernels>(
    logits: &Tensor<B, 2>,
) -> Result<Option<Vec<Option<u32>>>> {
    let [rows, vocab] = logits.dims();
    if rows == 0 || vocab == 0 || u32::try_from(vocab).is_err() {
        return Ok(None);
    }
    let ids = B::argmax_primitive(logits.clone().into_primitive().tensor(), rows, vocab);
    let ids = Tensor::<B, 1, Int>::from_primitive(ids)
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .map_err(|e| LlamaError::Runtime(format!("reading greedy tokens: {e:?}")))?;
    Ok(Some(
        ids.into_iter()
            .map(|id| u32::try_from(id).ok().filter(|&id| (id as usize) < vocab))
            .collect(),
    ))
}

/// [`LlamaBackend::sample_tokens`] through [`CubeKernels::sample_primitive`]: the draws
/// go up as words, three integers per row come back.
fn sample_tokens<B: LlamaBackend + CubeKernels>(
    logits: &Tensor<B, 2>,
    draws: &[DeviceDraw],
) -> Result<Option<Vec<Option<DeviceToken>>>> {
    let [rows, vocab] = logits.dims();
    if draws.len() != rows {
        return Err(LlamaError::ShapeMismatch {
            name: "device draws".into(),
            expected: vec![rows],
            actual: vec![draws.len()],
        });
    }
    if rows == 0 || vocab == 0 || u32::try_from(vocab).is_err() {
        return Ok(None);
    }
    let words: Vec<i32> = draws.iter().flat_map(|d| d.words(vocab)).collect();
    let n = words.len();
    let device = logits.device();
    let words = Tensor::<B, 1, Int>::from_data(TensorData::new(words, [n]), &device);
    let out = B::sample_primitive(
        logits.clone().into_primitive().tensor(),
        words.into_primitive(),
        rows,
        vocab,
    );
    let out = Tensor::<B, 1, Int>::from_primitive(out)
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .map_err(|e| LlamaError::Runtime(format!("reading sampled tokens: {e:?}")))?;
    Ok(Some(
        out.chunks_exact(kernels::SAMPLE_OUT)
            .map(|w| {
                let token = u32::try_from(w[0]).ok().filter(|&t| (t as usize) < vocab)?;
                let half = |v: i64| u32::try_from(v).ok().filter(|&h| h <= 0xffff);
                let bits = (half(w[1])? << 16) | half(w[2])?;
                Some(DeviceToken {
                    token,
                    logprob: f32::from_bits(bits),
                })
            })
            .collect(),
    ))
}

/// [`LlamaBackend::paged_attention`] through [`CubeKernels::paged_attention_primitive`],
/// or the portable path where the kernel does not take the shape (a head over
/// [`MAX_HEAD_DIM`] values).
fn paged_attention<B: LlamaBackend + CubeKernels>(
    q: Tensor<B, 2>,
    keys: &Tensor<B, 4>,
    values: &Tensor<B, 4>,
    batch: &PagedBatch<'_, B>,
) -> Result<Tensor<B, 2>> {
    let [blocks, kv_heads, block_size, dim] = keys.dims();
    let n_heads = batch.n_heads();
    let tokens: usize = batch.seqs().iter().map(|s| s.tokens).sum();
    if dim == 0 || dim > MAX_HEAD_DIM {
        return batch.attention_by_gathering(q, keys, values, B::masked_attention);
    }
    if kv_heads == 0 || !n_heads.is_multiple_of(kv_heads) || block_size != batch.block_size() {
        return Err(LlamaError::InvalidBatch(format!(
            "{n_heads} query heads over {kv_heads} key/value heads in blocks of {block_size} \
             do not fit"
        )));
    }
    if q.dims() != [tokens, n_heads * dim] || values.dims() != keys.dims() {
        return Err(LlamaError::ShapeMismatch {
            name: "paged attention queries".into(),
            expected: vec![tokens, n_heads * dim],
            actual: q.dims().to_vec(),
        });
    }
    let (table, max_block) = batch.device_table();
    if max_block >= blocks {
        return Err(LlamaError::InvalidBatch(format!(
            "block {max_block} lies outside a pool of {blocks} blocks"
        )));
    }
    let shape = PagedShape {
        tokens,
        n_heads,
        kv_heads,
        block_size,
        dim,
    };
    let out = B::paged_attention_primitive(
        q.into_primitive().tensor(),
        keys.clone().into_primitive().tensor(),
        values.clone().into_primitive().tensor(),
        table.clone().into_primitive(),
        shape,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// The shape of a step over encoded device pools, checked: `x_width` is the width of
/// the rows (queries for attention: `n_heads * dim`; keys or values for a store:
/// `kv_heads * dim`).
fn encoded_shape<B: LlamaBackend>(
    pool: &DeviceKvPool<B>,
    rows: [usize; 2],
    x_width: usize,
    batch: &PagedBatch<'_, B>,
) -> Result<PagedShape> {
    let (kv_heads, block_size, dim) = (pool.kv_heads(), pool.block_size(), pool.head_dim());
    let n_heads = batch.n_heads();
    let tokens: usize = batch.seqs().iter().map(|s| s.tokens).sum();
    if dim == 0 || dim > MAX_HEAD_DIM || kv_heads * dim / 32 > kernels::ENCODED_SCALES {
        return Err(LlamaError::invalid(
            "kv_cache_type",
            pool.ty(),
            "the device cache takes heads of up to 256 values and up to 32,768 values a token",
        ));
    }
    if kv_heads == 0 || !n_heads.is_multiple_of(kv_heads) || block_size != batch.block_size() {
        return Err(LlamaError::InvalidBatch(format!(
            "{n_heads} query heads over {kv_heads} key/value heads in blocks of {block_size} \
             do not fit"
        )));
    }
    if rows != [tokens, x_width] {
        return Err(LlamaError::ShapeMismatch {
            name: "encoded paged rows".into(),
            expected: vec![tokens, x_width],
            actual: rows.to_vec(),
        });
    }
    let (_, max_block) = batch.device_table();
    if tokens > 0 && max_block >= pool.num_blocks() {
        return Err(LlamaError::InvalidBatch(format!(
            "block {max_block} lies outside a pool of {} blocks",
            pool.num_blocks()
        )));
    }
    Ok(PagedShape {
        tokens,
        n_heads,
        kv_heads,
        block_size,
        dim,
    })
}

fn encoded_rows<B: Backend>(pool: &DeviceKvPool<B>) -> EncodedRows {
    EncodedRows {
        ty: pool.ty().kernel_code(),
        row_words: pool.row_words(),
    }
}

/// [`LlamaBackend::paged_store_encoded`] through
/// [`CubeKernels::paged_store_encoded_primitive`]: every token in one launch, in place.
fn paged_store_encoded<B: LlamaBackend + CubeKernels>(
    pool: &mut DeviceKvPool<B>,
    x: Tensor<B, 2>,
    batch: &PagedBatch<'_, B>,
) -> Result<()> {
    let width = pool.kv_heads() * pool.head_dim();
    let shape = encoded_shape(pool, x.dims(), width, batch)?;
    if shape.tokens == 0 {
        return Ok(());
    }
    let kv = encoded_rows(pool);
    let (table, _) = batch.device_table();
    let table = table.clone().into_primitive();
    pool.words_mut().inplace(|words| {
        Tensor::from_primitive(B::paged_store_encoded_primitive(
            x.into_primitive().tensor(),
            table,
            words.into_primitive(),
            kv,
            shape,
        ))
    });
    Ok(())
}

/// [`LlamaBackend::paged_attention_encoded`] through
/// [`CubeKernels::paged_attention_encoded_primitive`].
fn paged_attention_encoded<B: LlamaBackend + CubeKernels>(
    q: Tensor<B, 2>,
    keys: &DeviceKvPool<B>,
    values: &DeviceKvPool<B>,
    batch: &PagedBatch<'_, B>,
) -> Result<Tensor<B, 2>> {
    let shape = encoded_shape(keys, q.dims(), batch.n_heads() * keys.head_dim(), batch)?;
    let dims =
        |p: &DeviceKvPool<B>| vec![p.num_blocks(), p.kv_heads(), p.block_size(), p.head_dim()];
    if dims(values) != dims(keys) {
        return Err(LlamaError::ShapeMismatch {
            name: "encoded value pool".into(),
            expected: dims(keys),
            actual: dims(values),
        });
    }
    if shape.tokens == 0 {
        return Ok(q);
    }
    let (table, _) = batch.device_table();
    let out = B::paged_attention_encoded_primitive(
        q.into_primitive().tensor(),
        keys.words().clone().into_primitive(),
        values.words().clone().into_primitive(),
        table.clone().into_primitive(),
        [encoded_rows(keys), encoded_rows(values)],
        shape,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// A quantized matrix on a device: its ggml blocks as little-endian words, and the
/// kernel's code for their format.
#[derive(Debug, Clone)]
struct DeviceWeight<B: Backend> {
    words: Tensor<B, 1, Int>,
    format: u32,
}

/// Rows of `x` per unit of the quantized product for a product of `rows` rows: one for
/// decode (each unit reads its weight row once per row, which few rows can afford), 4 or 8
/// for prompts and large batches, where each weight is decoded once per tile. The
/// kernel's per-row arithmetic is the same at every tile size, so a row's outputs do not
/// depend on it (tested on wgpu).
///
/// Tiles of 16 for 64 rows or more were measured slower on an H200 (128 rows of the
/// 1B Q4_K_M model in bf16: 1,561 against 1,681 tokens/s; prefill 1,692 against 1,854).
pub(crate) fn quant_tile(rows: usize) -> usize {
    match rows {
        0..4 => 1,
        4..16 => 4,
        _ => 8,
    }
}

/// Whether the device's `fma` rounds once by definition (CUDA's and HIP's), so the
/// `fast` product's float steps use it; elsewhere (Vulkan, WGPU, Metal) they are computed
/// from singly rounded operations, exactly as a fused multiply-add (see
/// `kernels::fused_mul_add`).
fn native_fma<R: CubeRuntime>(client: &cubecl::client::ComputeClient<R>) -> bool {
    matches!(R::name(client), "cuda" | "hip")
}

/// Units of [`kernels::quantized_matmul_kernel`] that share one output: the largest power
/// of two up to 8 (a cube of 32 outputs is then at most 256 units, wgpu's limit) and up
/// to the row's `blocks`. It depends on the weight's shape only, so a row's sums are
/// added in the same order in every batch.
pub(crate) fn quant_lanes(blocks: usize) -> usize {
    let mut lanes = 1;
    while lanes < 8 && lanes * 2 <= blocks {
        lanes *= 2;
    }
    lanes
}

/// A quantized matrix's copy on `device` (made on first use and kept with the matrix).
fn device_weight<B: LlamaBackend + CubeKernels>(
    w: &QuantMatrix,
    device: &B::Device,
) -> Result<DeviceWeight<B>> {
    w.device_copy::<DeviceWeight<B>>(
        |copy| copy.words.device() == *device,
        |w| {
            // Four bytes to a word, little-endian; the integer tensor holds the words'
            // bits (an `i32` of any value).
            let words: Vec<i32> = w
                .to_ggml_bytes()
                .chunks(4)
                .map(|c| {
                    let mut word = [0u8; 4];
                    word[..c.len()].copy_from_slice(c);
                    i32::from_le_bytes(word)
                })
                .collect();
            let n = words.len();
            Ok(DeviceWeight {
                words: Tensor::from_data(TensorData::new(words, [n]), device),
                format: w.format().gpu_code(),
            })
        },
    )
}

/// One quantized product launch on the device (the matrices' copies there): `w` and what
/// goes `beside` it, in `precision`, with `io` on either side (checked by the caller).
fn product_launch<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    w: &QuantMatrix,
    beside: Beside<'_>,
    io: ProductIo<FloatTensor<B>>,
    precision: Precision,
) -> Result<Tensor<B, 2>> {
    let [rows, n_in] = x.dims();
    check_quantized_input(n_in, w)?;
    let other = match beside {
        Beside::Nothing => None,
        Beside::SwiGluUp(m) | Beside::Second(m) => Some(m),
    };
    if let Some(m) = other {
        check_quantized_input(n_in, m)?;
    }
    let device = x.device();
    let first = device_weight::<B>(w, &device)?;
    let other = other
        .map(|m| Ok::<_, LlamaError>((m, device_weight::<B>(m, &device)?)))
        .transpose()?;
    let second = match (beside, &other) {
        (Beside::Second(_), Some((m, copy))) => Some((copy.format, m.rows())),
        _ => None,
    };
    let shape = QuantShape {
        rows,
        n_out: w.rows(),
        cols: n_in,
        format: first.format,
        blocks: n_in / w.format().block_values(),
        integer: precision == Precision::Fast,
        second,
        tensor_cores: tensor_cores_mode(),
    };
    let out = B::quantized_matmul_primitive(
        x.into_primitive().tensor(),
        first.words.into_primitive(),
        other.map(|(_, copy)| copy.words.into_primitive()),
        io,
        shape,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`LlamaBackend::quantized_matmul`] on the device: the matrix's copy there, through the
/// fused kernel.
fn quantized_matmul<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    w: &QuantMatrix,
    precision: Precision,
) -> Result<Tensor<B, 2>> {
    product_launch(x, w, Beside::Nothing, ProductIo::Plain, precision)
}

/// [`LlamaBackend::quantized_matmul_two`] on the device: both products in one launch where
/// the two matrices take the same inputs and the same units per output (a Q4_K query and
/// key matrix beside a Q6_K value matrix, say), else `None`.
fn quantized_matmul_two<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    a: &QuantMatrix,
    b: &QuantMatrix,
    precision: Precision,
) -> Result<Option<Tensor<B, 2>>> {
    // Checked before the lanes are compared, so that inputs of the wrong width are an
    // error here rather than a `None` (`product_launch` checks them again).
    let n_in = x.dims()[1];
    check_quantized_input(n_in, a)?;
    if !fits_one_launch(a, Beside::Second(b), n_in)? {
        return Ok(None);
    }
    product_launch(x, a, Beside::Second(b), ProductIo::Plain, precision).map(Some)
}

/// [`LlamaBackend::quantized_swiglu`] on the device: both products and SwiGLU in one
/// launch where the two matrices share a format and a shape, else `None`.
fn quantized_swiglu<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    precision: Precision,
) -> Result<Option<Tensor<B, 2>>> {
    if !fits_one_launch(gate, Beside::SwiGluUp(up), x.dims()[1])? {
        return Ok(None);
    }
    product_launch(x, gate, Beside::SwiGluUp(up), ProductIo::Plain, precision).map(Some)
}

/// Whether `w` and what is `beside` it fit one launch of the product kernels: `up` of
/// `w`'s format and shape, or a second matrix taking its inputs in the same units per
/// output ([`quant_lanes`]) as `w`.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] where a second matrix does not take inputs of `n_in`
/// values.
fn fits_one_launch(w: &QuantMatrix, beside: Beside<'_>, n_in: usize) -> Result<bool> {
    Ok(match beside {
        Beside::Nothing => true,
        Beside::SwiGluUp(up) => {
            up.format() == w.format() && up.rows() == w.rows() && up.cols() == w.cols()
        }
        Beside::Second(b) => {
            check_quantized_input(n_in, b)?;
            let blocks = |m: &QuantMatrix| n_in / m.format().block_values();
            quant_lanes(blocks(w)) == quant_lanes(blocks(b))
        }
    })
}

/// The most rows whose RMSNorm a product takes in its prologue
/// ([`LlamaBackend::fused_quantized_matmul`]). Each of its units normalizes every value
/// it reads (two products more beside the quantization's steps), which a decode step of a few rows,
/// bound by the host's cost per launch, does not feel; a prompt chunk or a wide batch
/// keeps the norm a launch of its own rather than pay that on every value of a
/// compute-bound product. Not yet measured on a GPU: `gpu_suite.sh` times 1, 8, 32 and
/// 128 rows, and `LLAMA_BURN_NORM_IN_PROLOGUE_ROWS=N` sets another bound for a process
/// (0: every norm apart), so a GPU run compares both in one session
/// (`SUITE_BENCH_VARIANTS="bf16 bf16:normapart"`).
pub const NORM_IN_PROLOGUE_ROWS: usize = 8;

/// [`NORM_IN_PROLOGUE_ROWS`], or `LLAMA_BURN_NORM_IN_PROLOGUE_ROWS` where it is set to a
/// number. Read once per process.
fn norm_in_prologue_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("LLAMA_BURN_NORM_IN_PROLOGUE_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(NORM_IN_PROLOGUE_ROWS)
    })
}

/// [`LlamaBackend::fused_quantized_matmul`] on the device: in the `fast` precision the
/// norm in the integer product's prologue (up to [`norm_in_prologue_rows`] rows) or the
/// residual add in its epilogue ([`ProductIo`]), else (or where the types differ)
/// `None`.
fn fused_quantized_matmul<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    w: &QuantMatrix,
    beside: Beside<'_>,
    around: Around<'_, B>,
    precision: Precision,
) -> Result<Option<Tensor<B, 2>>> {
    let [rows, n_in] = x.dims();
    crate::backend::check_fused_product(&x, w, beside, &around)?;
    let io = match around {
        Around::Norm(weight, eps) => {
            if weight.dtype() != x.dtype() {
                return Ok(None);
            }
            ProductIo::Norm {
                weight: weight.clone().into_primitive().tensor(),
                eps: eps as f32,
            }
        }
        Around::Residual(residual) => {
            if residual.dtype() != x.dtype() {
                return Ok(None);
            }
            ProductIo::Residual(residual.into_primitive().tensor())
        }
    };
    let norm_too_wide = matches!(io, ProductIo::Norm { .. }) && rows > norm_in_prologue_rows();
    if precision != Precision::Fast || rows == 0 || norm_too_wide {
        return Ok(None);
    }
    if !fits_one_launch(w, beside, n_in)? {
        return Ok(None);
    }
    product_launch(x, w, beside, io, precision).map(Some)
}

/// [`LlamaBackend::dense_matmul`] on the device, through [`CubeKernels::dense_matmul_primitive`].
fn dense_matmul<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    w: &Tensor<B, 2>,
    transposed: bool,
) -> Result<Tensor<B, 2>> {
    let [rows, cols] = x.dims();
    let [a, b] = w.dims();
    let (w_cols, n_out) = if transposed { (b, a) } else { (a, b) };
    if w_cols != cols {
        return Err(LlamaError::ShapeMismatch {
            name: "dense matmul input".into(),
            expected: vec![w_cols],
            actual: vec![cols],
        });
    }
    let shape = DenseShape {
        rows,
        n_out,
        cols,
        transposed,
    };
    let out = B::dense_matmul_primitive(
        x.into_primitive().tensor(),
        w.clone().into_primitive().tensor(),
        shape,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`LlamaBackend::rms_norm`] through [`CubeKernels::rms_norm_primitive`] (one launch,
/// sums in an order fixed by the row's length), or [`rms_norm_in_order`] where `x` and
/// `weight` differ in type.
fn rms_norm<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Result<Tensor<B, 2>> {
    crate::backend::check_norm(&x, weight)?;
    if x.dtype() != weight.dtype() || x.dims()[0] == 0 {
        return rms_norm_in_order(x, weight, eps);
    }
    let out = B::rms_norm_primitive(
        x.into_primitive().tensor(),
        weight.clone().into_primitive().tensor(),
        eps as f32,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`LlamaBackend::add_rms_norm`] through [`CubeKernels::add_rms_norm_primitive`].
fn add_rms_norm<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    delta: Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Result<(Tensor<B, 2>, Tensor<B, 2>)> {
    crate::backend::check_same_shape("residual", &x, &delta)?;
    crate::backend::check_norm(&x, weight)?;
    if x.dtype() != weight.dtype() || x.dtype() != delta.dtype() || x.dims()[0] == 0 {
        let sum = x + delta;
        let normed = rms_norm_in_order(sum.clone(), weight, eps)?;
        return Ok((sum, normed));
    }
    let (sum, normed) = B::add_rms_norm_primitive(
        x.into_primitive().tensor(),
        delta.into_primitive().tensor(),
        weight.clone().into_primitive().tensor(),
        eps as f32,
    );
    Ok((
        Tensor::from_primitive(TensorPrimitive::Float(sum)),
        Tensor::from_primitive(TensorPrimitive::Float(normed)),
    ))
}

/// [`LlamaBackend::swiglu`] through [`CubeKernels::swiglu_primitive`]: one launch, the
/// CPU's arithmetic (Burn's `silu` and multiply were three element-wise operations with
/// the device's own `exp`).
fn swiglu<B: LlamaBackend + CubeKernels>(
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
) -> Result<Tensor<B, 2>> {
    crate::backend::check_same_shape("swiglu up", &gate, &up)?;
    if gate.dims().contains(&0) || gate.dtype() != up.dtype() {
        return Ok(burn::tensor::activation::silu(gate) * up);
    }
    let out = B::swiglu_primitive(gate.into_primitive().tensor(), up.into_primitive().tensor());
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`LlamaBackend::rope`] through [`CubeKernels::rope_primitive`] (one launch).
fn rope<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    swap: &Tensor<B, 2>,
) -> Result<Tensor<B, 2>> {
    let [rows, width] = crate::backend::check_rope(&x, cos, sin, swap)?;
    let head_dim = swap.dims()[0];
    if rows == 0 || width == 0 || cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        return crate::backend::rope_by_slicing(x, cos, sin, head_dim);
    }
    let out = B::rope_primitive(
        x.into_primitive().tensor(),
        cos.clone().into_primitive().tensor(),
        sin.clone().into_primitive().tensor(),
        head_dim,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`LlamaBackend::paged_store`] through [`CubeKernels::paged_store_primitive`]: both
/// pools, every token, one launch, reading the slots from the step's device table (the
/// attention's upload). The portable write where the batch does not match the pools.
fn paged_store<B: LlamaBackend + CubeKernels>(
    pools: (Tensor<B, 4>, Tensor<B, 4>),
    k: Tensor<B, 2>,
    v: Tensor<B, 2>,
    slots: &[crate::cache::paged::Slot],
    batch: &PagedBatch<'_, B>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    use crate::cache::paged::write_slots;
    let (keys, values) = pools;
    let [blocks, kv_heads, block_size, dim] = keys.dims();
    let [tokens, width] = k.dims();
    let (table, max_block) = batch.device_table();
    let fits = tokens > 0
        && tokens == slots.len()
        && width == kv_heads * dim
        && v.dims() == [tokens, width]
        && values.dims() == keys.dims()
        && block_size == batch.block_size()
        && max_block < blocks
        && k.dtype() == keys.dtype()
        && v.dtype() == values.dtype();
    if !fits {
        return (write_slots(keys, k, slots), write_slots(values, v, slots));
    }
    let shape = PagedShape {
        tokens,
        n_heads: batch.n_heads(),
        kv_heads,
        block_size,
        dim,
    };
    let (keys, values) = B::paged_store_primitive(
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        table.clone().into_primitive(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        shape,
    );
    (
        Tensor::from_primitive(TensorPrimitive::Float(keys)),
        Tensor::from_primitive(TensorPrimitive::Float(values)),
    )
}

/// [`LlamaBackend::rope_paged_store`] through [`CubeKernels::rope_paged_store_primitive`]:
/// RoPE on the queries and keys and the write of the keys and values in one launch, with
/// [`rope`]'s and [`paged_store`]'s bits. The portable path where the step does not match
/// the pools or the angles.
fn rope_paged_store<B: LlamaBackend + CubeKernels>(
    pools: (Tensor<B, 4>, Tensor<B, 4>),
    qk: Tensor<B, 2>,
    v: Tensor<B, 2>,
    rotation: crate::backend::Rotation<'_, B>,
    q_width: usize,
    slots: &[crate::cache::paged::Slot],
    batch: &PagedBatch<'_, B>,
) -> (Result<Tensor<B, 2>>, crate::backend::LayerPools<B>) {
    let (keys, values) = &pools;
    let [blocks, kv_heads, block_size, dim] = keys.dims();
    let [tokens, width] = qk.dims();
    let (table, max_block) = batch.device_table();
    let n_heads = batch.n_heads();
    let dtype = keys.dtype();
    let (cos, sin) = rotation.angles.tables();
    let fits = tokens > 0
        && tokens == slots.len()
        && dim > 0
        && q_width == n_heads * dim
        && width == q_width + kv_heads * dim
        && v.dims() == [tokens, kv_heads * dim]
        && cos.dims()[1] == dim
        // The kernel reads each token's angles at the position the store's table gives
        // it: the angles' positions must be those.
        && batch.rotates_its_tokens(rotation.angles)
        && rotation.swap.dims() == [dim, dim]
        && values.dims() == keys.dims()
        && block_size == batch.block_size()
        && max_block < blocks
        && [
            qk.dtype(),
            v.dtype(),
            values.dtype(),
            cos.dtype(),
            sin.dtype(),
        ]
        .into_iter()
        .all(|d| d == dtype);
    if !fits {
        return crate::backend::rope_then_store(pools, qk, v, rotation, q_width, slots, batch);
    }
    let (keys, values) = pools;
    let shape = PagedShape {
        tokens,
        n_heads,
        kv_heads,
        block_size,
        dim,
    };
    let [q, keys, values] = B::rope_paged_store_primitive(
        qk.into_primitive().tensor(),
        v.into_primitive().tensor(),
        [
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        ],
        table.clone().into_primitive(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        shape,
    );
    let pool = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    (
        Ok(Tensor::from_primitive(TensorPrimitive::Float(q))),
        (pool(keys), pool(values)),
    )
}

/// Burn's CubeCL backends without fusion: our kernels where we have them, the portable
/// defaults elsewhere.
/// RMSNorm whose sums of squares are added in one fixed order per row (our dense kernel
/// against a column of ones), so a row's result never depends on the batch. Burn's
/// `mean_dim` reduces through a strategy autotuned by the tensor's shape, whose order of
/// addition (and so whose bits) can change with the number of rows: on CUDA a 32-row
/// decode step then drifted from the same rows run alone. Half inputs are normalized in
/// f32, as the default does.
fn rms_norm_in_order<B: LlamaBackend>(
    x: Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Result<Tensor<B, 2>> {
    use burn::tensor::{DType, FloatDType};
    crate::backend::check_norm(&x, weight)?;
    let [_, d] = x.dims();
    let dtype = x.dtype();
    let half = matches!(dtype, DType::F16 | DType::BF16);
    let (x, weight) = if half {
        (
            x.cast(FloatDType::F32),
            weight.clone().cast(FloatDType::F32),
        )
    } else {
        (x, weight.clone())
    };
    let ones = Tensor::<B, 2>::ones([d, 1], &x.device()).cast(FloatDType::F32);
    let sums = B::dense_matmul(x.clone() * x.clone(), &ones, false)?;
    let inv_rms = sums.div_scalar(d as f64).add_scalar(eps).sqrt().recip();
    let out = x * inv_rms * weight.unsqueeze::<2>();
    Ok(if half { out.cast(dtype) } else { out })
}

/// The one [`LlamaBackend`] body of both CubeCL backend types (plain [`CubeBackend`]
/// and [`Fusion`] over it): our kernels where we have them, the portable defaults
/// elsewhere. A macro because the two are distinct types that a blanket impl cannot
/// cover beside the other backends' impls.
macro_rules! cube_llama_backend {
    () => {
        fn rms_norm(
            x: Tensor<Self, 2>,
            weight: &Tensor<Self, 1>,
            eps: f64,
        ) -> Result<Tensor<Self, 2>> {
            rms_norm(x, weight, eps)
        }

        fn add_rms_norm(
            x: Tensor<Self, 2>,
            delta: Tensor<Self, 2>,
            weight: &Tensor<Self, 1>,
            eps: f64,
        ) -> Result<(Tensor<Self, 2>, Tensor<Self, 2>)> {
            add_rms_norm(x, delta, weight, eps)
        }

        fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Result<Tensor<Self, 2>> {
            swiglu(gate, up)
        }

        fn rope(
            x: Tensor<Self, 2>,
            cos: &Tensor<Self, 2>,
            sin: &Tensor<Self, 2>,
            swap: &Tensor<Self, 2>,
        ) -> Result<Tensor<Self, 2>> {
            rope(x, cos, sin, swap)
        }

        fn paged_store(
            pools: (Tensor<Self, 4>, Tensor<Self, 4>),
            k: Tensor<Self, 2>,
            v: Tensor<Self, 2>,
            slots: &[crate::cache::paged::Slot],
            batch: &PagedBatch<'_, Self>,
        ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
            paged_store(pools, k, v, slots, batch)
        }

        fn rope_paged_store(
            pools: (Tensor<Self, 4>, Tensor<Self, 4>),
            qk: Tensor<Self, 2>,
            v: Tensor<Self, 2>,
            rotation: crate::backend::Rotation<'_, Self>,
            q_width: usize,
            slots: &[crate::cache::paged::Slot],
            batch: &PagedBatch<'_, Self>,
        ) -> (Result<Tensor<Self, 2>>, crate::backend::LayerPools<Self>) {
            rope_paged_store(pools, qk, v, rotation, q_width, slots, batch)
        }

        fn paged_attention(
            q: Tensor<Self, 2>,
            keys: &Tensor<Self, 4>,
            values: &Tensor<Self, 4>,
            batch: &PagedBatch<'_, Self>,
        ) -> Result<Tensor<Self, 2>> {
            paged_attention(q, keys, values, batch)
        }

        fn encodes_kv_cache_on_device() -> bool {
            true
        }

        fn paged_store_encoded(
            pool: &mut DeviceKvPool<Self>,
            x: Tensor<Self, 2>,
            batch: &PagedBatch<'_, Self>,
        ) -> Result<()> {
            paged_store_encoded(pool, x, batch)
        }

        fn paged_attention_encoded(
            q: Tensor<Self, 2>,
            keys: &DeviceKvPool<Self>,
            values: &DeviceKvPool<Self>,
            batch: &PagedBatch<'_, Self>,
        ) -> Result<Tensor<Self, 2>> {
            paged_attention_encoded(q, keys, values, batch)
        }

        fn keeps_quantized_weights() -> bool {
            true
        }

        fn compiles_kernels() -> bool {
            true
        }

        fn int8_tensor_cores(device: &Self::Device) -> bool {
            <Self as CubeKernels>::int8_tensor_cores(device)
        }

        fn quantized_matmul(
            x: Tensor<Self, 2>,
            w: &QuantMatrix,
            precision: Precision,
        ) -> Result<Tensor<Self, 2>> {
            quantized_matmul(x, w, precision)
        }

        fn quantized_swiglu(
            x: Tensor<Self, 2>,
            gate: &QuantMatrix,
            up: &QuantMatrix,
            precision: Precision,
        ) -> Result<Option<Tensor<Self, 2>>> {
            quantized_swiglu(x, gate, up, precision)
        }

        fn quantized_matmul_two(
            x: Tensor<Self, 2>,
            a: &QuantMatrix,
            b: &QuantMatrix,
            precision: Precision,
        ) -> Result<Option<Tensor<Self, 2>>> {
            quantized_matmul_two(x, a, b, precision)
        }

        fn fused_quantized_matmul(
            x: Tensor<Self, 2>,
            w: &QuantMatrix,
            beside: Beside<'_>,
            around: Around<'_, Self>,
            precision: Precision,
        ) -> Result<Option<Tensor<Self, 2>>> {
            fused_quantized_matmul(x, w, beside, around, precision)
        }

        fn dense_matmul(
            x: Tensor<Self, 2>,
            w: &Tensor<Self, 2>,
            transposed: bool,
        ) -> Result<Tensor<Self, 2>> {
            dense_matmul(x, w, transposed)
        }

        fn greedy_tokens(logits: &Tensor<Self, 2>) -> Result<Option<Vec<Option<u32>>>> {
            greedy_tokens(logits)
        }

        fn samples_on_device() -> bool {
            true
        }

        fn sample_tokens(
            logits: &Tensor<Self, 2>,
            draws: &[DeviceDraw],
        ) -> Result<Option<Vec<Option<DeviceToken>>>> {
            sample_tokens(logits, draws)
        }
    };
}

impl<R, F, I, BT> LlamaBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    cube_llama_backend!();
}

/// Burn's CubeCL backends with fusion (`burn::backend::{Cuda, Wgpu, Vulkan}`): our
/// kernels where we have them, the portable defaults elsewhere.
impl<B: FusionBackend + CubeKernels> LlamaBackend for Fusion<B> {
    cube_llama_backend!();
}
