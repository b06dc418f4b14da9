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
