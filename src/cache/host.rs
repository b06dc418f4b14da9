//! Direct access to a KV tensor's memory on the CPU backend (Flex).
//!
//! Flex's `slice_assign`, `scatter` and `select_add` copy the whole destination tensor
//! on every call (`Arc::make_mut` runs while a second handle is alive). For a KV cache
//! that is the whole layer cache per layer and step: hundreds of megabytes per token for
//! a long context. Both caches write through [`write_in_place`] and the paged pool reads
//! through [`read_in_place`]; other backends take portable tensor operations.

use burn::tensor::{Tensor, backend::Backend};

/// Copies `source` to the host and runs `write(memory, source)` on the f32 memory of
/// `tensor` (row-major, its full shape) when `tensor` is a uniquely held, contiguous f32
/// Flex tensor, and returns it. Otherwise gives `tensor` back untouched as `Err`, without
/// reading `source` (on a GPU backend nothing is downloaded).
pub(crate) fn write_in_place<B: Backend, const D: usize, const S: usize>(
    tensor: Tensor<B, D>,
    source: &Tensor<B, S>,
    write: impl FnOnce(&mut [f32], &[f32]),
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
        let Ok(values) = source.clone().into_data().to_vec::<f32>() else {
            return Err(back(primitive));
        };
        match flex.try_storage_mut::<f32>() {
            Some(memory) => {
                write(memory, &values);
                Ok(back(primitive))
            }
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
        use std::any::Any;

        use burn::backend::flex::FlexTensor;
        use burn::tensor::DType;

        let primitive = tensor.clone().into_primitive().tensor();
        let flex = (&primitive as &dyn Any).downcast_ref::<FlexTensor>()?;
        let usable = flex.dtype() == DType::F32
            && flex.layout().is_contiguous()
            && flex.layout().start_offset() == 0;
        usable.then(|| read(flex.storage::<f32>()))
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (tensor, read);
        None
    }
}
