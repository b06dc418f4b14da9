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
//! - [`quantized_matmul`](LlamaBackend::quantized_matmul): weights stay in their GGUF
//!   blocks on the device ([`keeps_quantized_weights`](LlamaBackend::keeps_quantized_weights)),
//!   uploaded once on first use; every kept format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K,
//!   Q4_K, Q5_K, Q6_K) is multiplied by a fused dequantize-and-multiply kernel. Decode takes one row per unit; prompts and batches of
//!   4 rows or more take tiles of 4 or 8 rows per unit, each weight decoded once per tile
//!   ([`quant_tile`]), with a row's arithmetic the same at every tile size.
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

use crate::backend::LlamaBackend;
use crate::config::Precision;
use crate::error::{LlamaError, Result};
use crate::kernels::{QuantFormat, QuantMatrix};
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
    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
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

    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        shape: QuantShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::{CubeCount, CubeDim};

        let x = into_contiguous(x);
        let words = into_contiguous(words);
        let out_shape = burn::tensor::Shape::new([shape.rows, shape.n_out]);
        let bytes = out_shape.num_elements() * x.dtype.size();
        let out = CubeTensor::new_contiguous(
            x.client.clone(),
            x.device.clone(),
            out_shape,
            x.client.empty(bytes),
            x.dtype,
        );
        let (f_dtype, i_dtype) = (x.dtype, words.dtype);
        let client = x.client.clone();
        let tile = quant_tile(shape.rows);
        let lanes = quant_lanes(shape.blocks);
        let outputs = kernels::QUANT_OUTPUTS as u32;
        kernels::quantized_matmul_kernel::launch::<R>(
            &client,
            CubeCount::Static(
                (shape.n_out as u32).div_ceil(outputs),
                shape.rows.div_ceil(tile) as u32,
                1,
            ),
            CubeDim::new_2d(outputs, lanes as u32),
            x.into_tensor_arg(),
            words.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape.rows as u32,
            shape.n_out as u32,
            shape.cols as u32,
            shape.format,
            tile,
            lanes,
            [f_dtype.into(), i_dtype.into()],
        );
        out
    }

    fn dense_matmul_primitive(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        shape: DenseShape,
    ) -> FloatTensor<Self> {
        use burn_cubecl::kernel::into_contiguous;
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::{CubeCount, CubeDim};

        let x = into_contiguous(x);
        let w = into_contiguous(w);
        let out_shape = burn::tensor::Shape::new([shape.rows, shape.n_out]);
        let bytes = out_shape.num_elements() * x.dtype.size();
        let out = CubeTensor::new_contiguous(
            x.client.clone(),
            x.device.clone(),
            out_shape,
            x.client.empty(bytes),
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
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::{CubeCount, CubeDim};

        let logits = into_contiguous(logits);
        let i_dtype = I::dtype();
        let out = CubeTensor::new_contiguous(
            logits.client.clone(),
            logits.device.clone(),
            burn::tensor::Shape::new([rows]),
            logits.client.empty(rows * i_dtype.size()),
            i_dtype,
        );
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
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::{CubeCount, CubeDim};

        let logits = into_contiguous(logits);
        let draws = into_contiguous(draws);
        let i_dtype = draws.dtype;
        let n = rows * kernels::SAMPLE_OUT;
        let out = CubeTensor::new_contiguous(
            logits.client.clone(),
            logits.device.clone(),
            burn::tensor::Shape::new([n]),
            logits.client.empty(n * i_dtype.size()),
            i_dtype,
        );
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
            &[
                q.into_ir(),
                keys.into_ir(),
                values.into_ir(),
                table.into_ir(),
            ],
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

    fn quantized_matmul_primitive(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        shape: QuantShape,
    ) -> FloatTensor<Self> {
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream.
        #[derive(Debug)]
        struct QuantizedMatmulOp<B> {
            desc: CustomOpIr,
            shape: QuantShape,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for QuantizedMatmulOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([x, words], [out]) = self.desc.as_fixed();
                let result = B::quantized_matmul_primitive(
                    handles.get_float_tensor::<B>(x),
                    handles.get_int_tensor::<B>(words),
                    self.shape,
                );
                handles.register_float_tensor::<B>(&out.id, result);
            }
        }

        let client = x.client.clone();
        let streams = OperationStreams::with_inputs([&x, &words]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            burn::tensor::Shape::new([shape.rows, shape.n_out]),
            x.dtype,
        );
        let desc = CustomOpIr::new(
            "llama_burn_quantized_matmul",
            &[x.into_ir(), words.into_ir()],
            &[out],
        );
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                QuantizedMatmulOp::<B> {
                    desc,
                    shape,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
    }

    fn dense_matmul_primitive(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        shape: DenseShape,
    ) -> FloatTensor<Self> {
        use burn_fusion::stream::{Operation, OperationStreams};
        use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

        /// The kernel as an operation of the fusion stream.
        #[derive(Debug)]
        struct DenseMatmulOp<B> {
            desc: CustomOpIr,
            shape: DenseShape,
            _backend: core::marker::PhantomData<B>,
        }

        impl<B: FusionBackend + CubeKernels> Operation<B::FusionRuntime> for DenseMatmulOp<B> {
            fn execute(
                &self,
                handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
            ) {
                let ([x, w], [out]) = self.desc.as_fixed();
                let result = B::dense_matmul_primitive(
                    handles.get_float_tensor::<B>(x),
                    handles.get_float_tensor::<B>(w),
                    self.shape,
                );
                handles.register_float_tensor::<B>(&out.id, result);
            }
        }

        let client = x.client.clone();
        let streams = OperationStreams::with_inputs([&x, &w]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            burn::tensor::Shape::new([shape.rows, shape.n_out]),
            x.dtype,
        );
        let desc = CustomOpIr::new(
            "llama_burn_dense_matmul",
            &[x.into_ir(), w.into_ir()],
            &[out],
        );
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                DenseMatmulOp::<B> {
                    desc,
                    shape,
                    _backend: core::marker::PhantomData,
                },
            )
            .output()
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
pub(crate) fn quant_tile(rows: usize) -> usize {
    match rows {
        0..4 => 1,
        4..16 => 4,
        _ => 8,
    }
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

/// The kernel's code for a block format.
fn kernel_format(format: QuantFormat) -> u32 {
    match format {
        QuantFormat::Q8_0 => 0,
        QuantFormat::Q4_0 => 1,
        QuantFormat::Q4_1 => 2,
        QuantFormat::Q4_K => 3,
        QuantFormat::Q6_K => 4,
        QuantFormat::Q5_K => 5,
        QuantFormat::Q5_0 => 6,
        QuantFormat::Q5_1 => 7,
        QuantFormat::Q3_K => 8,
    }
}

/// [`LlamaBackend::quantized_matmul`] on the device: the matrix's copy there (made on
/// first use and kept with the matrix), through the fused kernel.
fn quantized_matmul<B: LlamaBackend + CubeKernels>(
    x: Tensor<B, 2>,
    w: &QuantMatrix,
) -> Result<Tensor<B, 2>> {
    let [rows, n_in] = x.dims();
    if n_in != w.cols() {
        return Err(LlamaError::ShapeMismatch {
            name: "quantized matmul input".into(),
            expected: vec![w.cols()],
            actual: vec![n_in],
        });
    }
    let device = x.device();
    let weight = w.device_copy::<DeviceWeight<B>>(
        |copy| copy.words.device() == device,
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
                words: Tensor::from_data(TensorData::new(words, [n]), &device),
                format: kernel_format(w.format()),
            })
        },
    )?;
    let shape = QuantShape {
        rows,
        n_out: w.rows(),
        cols: n_in,
        format: weight.format,
        blocks: n_in / w.format().block_values(),
    };
    let out = B::quantized_matmul_primitive(
        x.into_primitive().tensor(),
        weight.words.into_primitive(),
        shape,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
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
            rms_norm_in_order(x, weight, eps)
        }

        fn paged_attention(
            q: Tensor<Self, 2>,
            keys: &Tensor<Self, 4>,
            values: &Tensor<Self, 4>,
            batch: &PagedBatch<'_, Self>,
        ) -> Result<Tensor<Self, 2>> {
            paged_attention(q, keys, values, batch)
        }

        fn keeps_quantized_weights() -> bool {
            true
        }

        fn quantized_matmul(
            x: Tensor<Self, 2>,
            w: &QuantMatrix,
            _precision: Precision,
        ) -> Result<Tensor<Self, 2>> {
            quantized_matmul(x, w)
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
