//! Direct access to a KV tensor's memory on the CPU backend (Flex).
//!
//! Flex's `slice_assign`, `scatter` and `select_add` copy the whole destination tensor
//! on every call (`Arc::make_mut` runs while a second handle is alive). For a KV cache
//! that is the whole layer cache per layer and step: hundreds of megabytes per token for
//! a long context. Both caches write through [`write_in_place`] and the paged pool reads
//! through [`read_in_place`]; other backends take portable tensor operations.

use burn::tensor::{Tensor, backend::Backend};

/// The rows of a 2-D f32 tensor on the host: row `i` is
/// `data[offset + i * stride..][..width]`. A projection's output, or a slice of its
/// columns, read in place.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a> {
    data: &'a [f32],
    offset: usize,
    stride: usize,
    width: usize,
    len: usize,
}

impl<'a> Rows<'a> {
    /// Rows of `width` values, one after another.
    fn contiguous(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            offset: 0,
            stride: width,
            width,
            len: data.len() / width.max(1),
        }
    }

    /// Number of rows.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Row `i` (`i < len()`).
    pub(crate) fn row(&self, i: usize) -> &'a [f32] {
        let at = self.offset + i * self.stride;
        &self.data[at..at + self.width]
    }
}

/// Runs `read` on the rows of a 2-D f32 tensor: in place when it is a Flex tensor whose
/// rows are each contiguous (a projection's output or a slice of its columns), else from
/// a host copy.
pub(crate) fn with_rows<B: Backend, R>(
    tensor: &Tensor<B, 2>,
    read: impl FnOnce(Rows<'_>) -> R,
) -> Option<R> {
    let [rows, width] = tensor.dims();
    #[cfg(feature = "flex")]
    {
        if let Some(flex) = flex_f32(tensor) {
            let layout = flex.layout();
            let strides = layout.strides();
            let data = flex.storage::<f32>();
            let offset = layout.start_offset();
            if let [row_stride, 1] = *strides
                && let Ok(stride) = usize::try_from(row_stride)
                && stride >= width
                && (rows == 0 || offset + (rows - 1) * stride + width <= data.len())
            {
                return Some(read(Rows {
                    data,
                    offset,
                    stride,
                    width,
                    len: rows,
                }));
            }
        }
    }
    let values = tensor.clone().into_data().to_vec::<f32>().ok()?;
    Some(read(Rows::contiguous(&values, width)))
}

/// Runs `write(memory, rows)` on the f32 memory of `tensor` (row-major, its full shape)
/// with the rows of `source` ([`with_rows`]) when `tensor` is a uniquely held, contiguous
/// f32 Flex tensor, and returns it. Otherwise gives `tensor` back untouched as `Err`,
/// without reading `source` (on a GPU backend nothing is downloaded).
pub(crate) fn write_in_place<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    source: &Tensor<B, 2>,
    write: impl FnOnce(&mut [f32], Rows<'_>),
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    #[cfg(feature = "flex")]
    {
        use std::any::Any;

        use burn::backend::flex::FlexTensor;
        use burn::tensor::{DType, TensorPrimitive};

        let mut primitive = tensor.into_primitive().tensor();
        let back = |p| Tensor::from_primitive(TensorPrimitive::Float(p));
        let Some(flex) = (&mut primitive as &mut dyn Any).downcast_mut::<FlexTensor>() else {
            return Err(back(primitive));
        };
        let usable = flex.dtype() == DType::F32
            && flex.layout().is_contiguous()
            && flex.layout().start_offset() == 0
            && flex.is_unique();
        if !usable {
            return Err(back(primitive));
        }
        let Some(memory) = flex.try_storage_mut::<f32>() else {
            return Err(back(primitive));
        };
        match with_rows(source, |rows| write(memory, rows)) {
            Some(()) => Ok(back(primitive)),
            None => Err(back(primitive)),
        }
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (source, write);
        Err(tensor)
    }
}

/// Runs `read` on the f32 memory of `tensor` (row-major, its full shape) when it is a
/// contiguous f32 Flex tensor; `None` otherwise.
pub(crate) fn read_in_place<B: Backend, const D: usize, R>(
    tensor: &Tensor<B, D>,
    read: impl FnOnce(&[f32]) -> R,
) -> Option<R> {
    #[cfg(feature = "flex")]
    {
        let flex = flex_f32(tensor)?;
        let usable = flex.layout().is_contiguous() && flex.layout().start_offset() == 0;
        usable.then(|| read(flex.storage::<f32>()))
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (tensor, read);
        None
    }
}

/// A handle to `tensor`'s Flex primitive, if it is an f32 Flex tensor: the one downcast
/// the readers share.
#[cfg(feature = "flex")]
fn flex_f32<B: Backend, const D: usize>(
    tensor: &Tensor<B, D>,
) -> Option<burn::backend::flex::FlexTensor> {
    let primitive: Box<dyn std::any::Any> = Box::new(tensor.clone().into_primitive().tensor());
    let flex = primitive
        .downcast::<burn::backend::flex::FlexTensor>()
        .ok()?;
    (flex.dtype() == burn::tensor::DType::F32).then_some(*flex)
}
