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

mod kernels;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};

use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::model::attention::PagedBatch;

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

/// The largest head the paged attention kernel takes (one unit per value of a head).
pub const MAX_HEAD_DIM: usize = 256;

/// llama-burn's CubeCL kernels on a backend's tensor primitives.
pub trait CubeKernels: Backend {
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
}

impl<R, F, I, BT> CubeKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn paged_attention_primitive(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: IntTensor<Self>,
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::{CubeCount, CubeDim};

        let q = into_contiguous(q);
        let keys = into_contiguous(keys);
        let values = into_contiguous(values);
        let table = into_contiguous(table);
        let out_shape = burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]);
        let bytes = out_shape.num_elements() * q.dtype.size();
        let out = CubeTensor::new_contiguous(
            q.client.clone(),
            q.device.clone(),
            out_shape,
            q.client.empty(bytes),
            q.dtype,
        );
        let (f_dtype, i_dtype) = (q.dtype, table.dtype);
        let client = q.client.clone();
        kernels::paged_attention_kernel::launch::<R>(
            &client,
            CubeCount::Static(shape.tokens as u32, shape.n_heads as u32, 1),
            CubeDim::new_1d(shape.dim as u32),
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
            shape.dim,
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }
}

impl<B: FusionBackend + CubeKernels> CubeKernels for Fusion<B> {
    fn paged_attention_primitive(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: IntTensor<Self>,
        shape: PagedShape,
    ) -> FloatTensor<Self> {
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream: run on the inner backend's
        /// tensors when the stream reaches it.
        #[derive(Debug)]
        struct PagedAttentionOp<B> {
            desc: CustomOpIr,
            shape: PagedShape,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for PagedAttentionOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([q, keys, values, table], [out]) = self.desc.as_fixed();
                let result = B::paged_attention_primitive(
                    handles.get_float_tensor::<B>(q),
                    handles.get_float_tensor::<B>(keys),
                    handles.get_float_tensor::<B>(values),
                    handles.get_int_tensor::<B>(table),
                    self.shape,
                );
                handles.register_float_tensor::<B>(&out.id, result);
            }
        }

        let client = q.client.clone();
        let streams = OperationStreams::with_inputs([&q, &keys, &values, &table]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            burn::tensor::Shape::new([shape.tokens, shape.n_heads * shape.dim]),
            q.dtype,
        );
        let desc = CustomOpIr::new(
            "llama_burn_paged_attention",
            &[q.into_ir(), keys.into_ir(), values.into_ir(), table.into_ir()],
            &[out],
        );
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                PagedAttentionOp::<B> {
                    desc,
                    shape,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
    }
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
        return batch.attention_by_gathering(q, keys, values);
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

/// Burn's CubeCL backends without fusion: our kernels where we have them, the portable
/// defaults elsewhere.
impl<R, F, I, BT> LlamaBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn paged_attention(
        q: Tensor<Self, 2>,
        keys: &Tensor<Self, 4>,
        values: &Tensor<Self, 4>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<Tensor<Self, 2>> {
        paged_attention(q, keys, values, batch)
    }
}

/// Burn's CubeCL backends with fusion (`burn::backend::{Cuda, Wgpu, Vulkan}`): our
/// kernels where we have them, the portable defaults elsewhere.
impl<B: FusionBackend + CubeKernels> LlamaBackend for Fusion<B> {
    fn paged_attention(
        q: Tensor<Self, 2>,
        keys: &Tensor<Self, 4>,
        values: &Tensor<Self, 4>,
        batch: &PagedBatch<'_, Self>,
    ) -> Result<Tensor<Self, 2>> {
        paged_attention(q, keys, values, batch)
    }
}
