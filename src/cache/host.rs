//! Direct access to a KV tensor's memory on the CPU backend (Flex).
//!
//! Flex's `slice_assign`, `scatter` and `select_add` copy the whole destination tensor
//! on every call (`Arc::make_mut` runs while a second handle is alive). For a KV cache
//! that is the whole layer cache per layer and step: hundreds of megabytes per token for
//! a long context. Both caches write through [`write_in_place`] instead, and fall back to
//! portable tensor operations on other backends.

use burn::tensor::{Tensor, backend::Backend};

/// Runs `write` on the f32 memory of `tensor` (row-major, its full shape) when it is a
/// uniquely held, contiguous f32 Flex tensor, and returns the tensor; otherwise gives the
/// tensor back untouched as `Err`.
pub(crate) fn write_in_place<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    write: impl FnOnce(&mut [f32]),
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
        match usable.then(|| flex.try_storage_mut::<f32>()).flatten() {
            Some(memory) => {
                write(memory);
                Ok(back(primitive))
            }
            None => Err(back(primitive)),
        }
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = write;
        Err(tensor)
    }
}
