//! The block formats, one home: each kept format's layout, dequantization, quantizer and
//! integer form, which the loader, the CPU kernels and the GPU kernels all read.
//!
//! - [`QuantFormat`] and its table (below, in this file): one row per format names its
//!   grouped-layout head, its integer form, its GPU kernel code and its three routines;
//!   the block layout (values and bytes per block) comes from the ggml type table;
//! - [`GgmlType`] (`ggml.rs`): every ggml tensor type's id, name and block layout;
//! - [`dequant`]: ggml blocks to `f32`, bit-identical to ggml's reference;
//! - [`quantize`](mod@quantize) (and `kquant.rs` for the K-quants): `f32` into ggml blocks, as ggml's
//!   reference quantizers write them;
//! - `int_form.rs`: each format's integer form for the `fast` precision's kernels.
//!
//! This module sits below both the loader and the kernels and imports neither.
//!
//! # Adding a block format
//!
//! 1. Its type in the ggml table (`ggml.rs`), if it is not there yet.
//! 2. Its row in the table below: the variant's name is the ggml type's.
//! 3. The three routines the row names: a dequantizer in [`dequant`], a quantizer in
//!    [`quantize`](mod@quantize) (or `kquant.rs`), an integer decoder in `int_form.rs`.
//!
//! That is the whole of the format for the loader (reading, quantizing at load, random
//! files), the plain-Rust kernels of both precisions and the tests that loop over
//! [`QuantFormat::ALL`]. Then its kernels: the GPU products' decoders
//! (`gpu/kernels.rs`, under the row's `gpu` code: the `exact` product's `small_block` or
//! `k_block`, and the `fast` product's `int_value`, `int_scale`, `int_d` and `int_m`,
//! which read the integer form of `int_form.rs` from the GGUF blocks; the kernels' block
//! size, run, offset and minimum come from the row), the x86 integer kernels' decode step
//! (`kernels/int8/x86.rs`), and, if the row says `exact_simd: true`, the `exact`
//! precision's in-register decoders (`kernels/avx2.rs`, `kernels/avx512.rs`).

pub mod dequant;
mod ggml;
pub(crate) mod int_form;
mod kquant;
pub mod quantize;

pub use dequant::{dequantize, dequantize_into};
pub use ggml::GgmlType;
pub use quantize::{QUANTIZERS, quantize};

use crate::error::{LlamaError, Result};
use int_form::{IntDecoder, QK};
pub(crate) use int_form::{IntForm, IntScales};

/// Values in a K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// What the crate knows of one kept block format beyond its ggml layout: one row of the
/// table below.
#[derive(Clone, Copy)]
pub(crate) struct Spec {
    /// Bytes at the start of a block that the CPU kernels' grouped layout stores apart
    /// from the values (see [`QuantFormat::head_bytes`]).
    pub(crate) head_bytes: usize,
    /// Whether the `exact` precision's SIMD kernels decode the format in registers.
    pub(crate) exact_simd: bool,
    /// The format's integer form (the `fast` precision), without its run: offset,
    /// scales, minimum, largest unsigned value.
    pub(crate) int: (i32, IntScales, bool, i32),
    /// The GPU product kernel's code for the format (`gpu/kernels.rs`).
    #[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
    pub(crate) gpu_code: u32,
    /// Whole blocks to `f32`, bit-identical to ggml's `dequantize_row_*`.
    pub(crate) dequantize: dequant::Decoder,
    /// One block's values (32, or 256 for the K-quants) appended as the format's bytes.
    pub(crate) quantize: fn(&[f32], &mut Vec<u8>),
    /// One block to its 32-value sub-blocks' integer form.
    pub(crate) int_decode: IntDecoder,
}

/// Defines [`QuantFormat`] from one table of rows, and `with_format!`, which evaluates an
/// expression with a constant equal to a format's id (its place in [`QuantFormat::ALL`]).
macro_rules! quant_formats {
    ($d:tt $(
        $(#[$doc:meta])*
        $variant:ident {
            head: $head:expr,
            exact_simd: $simd:expr,
            int: ($offset:expr, $scales:ident, $mins:expr, $max:expr),
            gpu: $gpu:expr,
            dequantize: $deq:path,
            quantize: $quant:path,
            int_decode: $int:path $(,)?
        }
    )*) => {
        /// The block formats the crate keeps as they are stored (its CPU and GPU kernels
        /// multiply them without dequantizing the matrix): those of the demo model (Q4_1
        /// projections, a Q8_0 embedding) and of the common Q4_K_M, Q5_K_M, Q8_0 and
        /// Q3_K downloads. Other types are dequantized to f32 when loaded.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        pub enum QuantFormat {
            $($(#[$doc])* $variant,)*
        }

        impl QuantFormat {
            /// Every format, in declaration order (a format's id is its place here).
            pub const ALL: [QuantFormat; [$(stringify!($variant)),*].len()] =
                [$(QuantFormat::$variant),*];

            /// The format of a ggml type, if the crate keeps it.
            pub const fn from_ggml(ty: GgmlType) -> Option<Self> {
                match ty {
                    $(GgmlType::$variant => Some(Self::$variant),)*
                    _ => None,
                }
            }

            /// The ggml type this format is.
            pub const fn ggml(self) -> GgmlType {
                match self {
                    $(Self::$variant => GgmlType::$variant,)*
                }
            }

            /// The format's row of the table.
            pub(crate) const fn spec(self) -> Spec {
                match self {
                    $(Self::$variant => Spec {
                        head_bytes: $head,
                        exact_simd: $simd,
                        int: ($offset, IntScales::$scales, $mins, $max),
                        gpu_code: $gpu,
                        dequantize: $deq,
                        quantize: $quant,
                        int_decode: $int,
                    },)*
                }
            }
        }

        /// Evaluates `$call` with the constant `$f` (a `u8`) equal to `$format`'s id:
        /// kernels that take their format as a const parameter decide every branch on
        /// it at compile time.
        #[allow(unused_macros)]
        macro_rules! with_format {
            ($d format:expr, $d f:ident => $d call:expr) => {{
                match $d format {
                    $(crate::quant::QuantFormat::$variant => {
                        const $d f: u8 = crate::quant::QuantFormat::$variant as u8;
                        $d call
                    })*
                }
            }};
        }
        #[allow(unused_imports)]
        pub(crate) use with_format;
    };
}

quant_formats! { $
    /// 32 values: an f16 scale and 32 signed bytes.
    Q8_0 {
        head: 2, exact_simd: true, int: (128, One, false, 255), gpu: 0,
        dequantize: dequant::q8_0, quantize: quantize::q8_0, int_decode: int_form::q8_0,
    }
    /// 32 values: an f16 scale and 32 nibbles offset by 8.
    Q4_0 {
        head: 2, exact_simd: true, int: (8, One, false, 15), gpu: 1,
        dequantize: dequant::q4_0, quantize: quantize::q4_0, int_decode: int_form::q4_0,
    }
    /// 32 values: an f16 scale, an f16 minimum and 32 nibbles.
    Q4_1 {
        head: 4, exact_simd: true, int: (0, One, true, 15), gpu: 2,
        dequantize: dequant::q4_1, quantize: quantize::q4_1, int_decode: int_form::q4_1,
    }
    /// 256 values: f16 scale and minimum, eight 6-bit sub-scales and minimums, nibbles.
    Q4_K {
        head: 0, exact_simd: true, int: (0, PerBlock, true, 15), gpu: 3,
        dequantize: dequant::q4_k, quantize: kquant::q4_k, int_decode: int_form::q4_k,
    }
    /// 256 values: 6-bit values, sixteen 8-bit sub-scales and an f16 scale.
    Q6_K {
        head: 0, exact_simd: true, int: (32, PerHalf, false, 63), gpu: 4,
        dequantize: dequant::q6_k, quantize: kquant::q6_k, int_decode: int_form::q6_k,
    }
    /// 32 values: an f16 scale, 32 fifth bits and 32 nibbles offset by 16.
    Q5_0 {
        head: 0, exact_simd: false, int: (16, One, false, 31), gpu: 6,
        dequantize: dequant::q5_0, quantize: quantize::q5_0, int_decode: int_form::q5_0,
    }
    /// 32 values: an f16 scale, an f16 minimum, 32 fifth bits and 32 nibbles.
    Q5_1 {
        head: 0, exact_simd: false, int: (0, One, true, 31), gpu: 7,
        dequantize: dequant::q5_1, quantize: quantize::q5_1, int_decode: int_form::q5_1,
    }
    /// 256 values: 2-bit values with a high-bit mask, sixteen 6-bit sub-scales, f16 scale.
    Q3_K {
        head: 0, exact_simd: false, int: (4, PerHalf, false, 7), gpu: 8,
        dequantize: dequant::q3_k, quantize: kquant::q3_k, int_decode: int_form::q3_k,
    }
    /// 256 values: as [`Q4_K`](Self::Q4_K) with a fifth bit per value.
    Q5_K {
        head: 0, exact_simd: false, int: (0, PerBlock, true, 31), gpu: 5,
        dequantize: dequant::q5_k, quantize: kquant::q5_k, int_decode: int_form::q5_k,
    }
}

impl QuantFormat {
    /// Values per block (from the ggml type table).
    pub const fn block_values(self) -> usize {
        match self.ggml().layout() {
            Some((values, _)) => values,
            None => 0,
        }
    }

    /// Bytes per block (from the ggml type table).
    pub const fn block_bytes(self) -> usize {
        match self.ggml().layout() {
            Some((_, bytes)) => bytes,
            None => 0,
        }
    }

    /// Bytes at the start of a block that hold its scales (`d`, and `m` for Q4_1), which
    /// the CPU kernels' grouped layout stores apart from the quantized values; 0 for the
    /// formats whose blocks stay whole (the K-quants, and the formats the `exact` SIMD
    /// kernels do not decode).
    pub const fn head_bytes(self) -> usize {
        self.spec().head_bytes
    }

    /// Whether a full group's steps hold their eight blocks word-interleaved (see
    /// `QuantMatrix`'s layout): the K-quants, whose `fast` kernels multiply eight rows'
    /// 32-bit words side by side.
    pub(crate) const fn interleaves_words(self) -> bool {
        self.block_values() == QK_K
    }

    /// Whether the `exact` precision's SIMD kernels decode this format in registers;
    /// the others are dequantized into scratch rows by [`dequant`]'s routine, then
    /// multiplied as the rest.
    pub(crate) const fn simd_decoded(self) -> bool {
        self.spec().exact_simd
    }

    /// The format's integer form for the `fast` precision's kernels.
    pub(crate) const fn int_form(self) -> IntForm {
        let (offset, scales, mins, max) = self.spec().int;
        IntForm {
            offset,
            scales,
            mins,
            max,
            run: self.block_values() / QK,
        }
    }

    /// The GPU product kernel's code for this format.
    #[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
    pub(crate) const fn gpu_code(self) -> u32 {
        self.spec().gpu_code
    }
}

impl std::str::FromStr for QuantFormat {
    type Err = LlamaError;

    /// The ggml name, in either case (`Q8_0`, `q4_k`, ...).
    fn from_str(s: &str) -> Result<Self> {
        QuantFormat::ALL
            .into_iter()
            .find(|f| f.ggml().name().eq_ignore_ascii_case(s))
            .ok_or_else(|| LlamaError::invalid("quantization type", s, "not a kept ggml type"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_agrees_with_the_ggml_layouts_and_itself() {
        let mut codes = Vec::new();
        for (id, f) in QuantFormat::ALL.into_iter().enumerate() {
            assert_eq!(f as usize, id);
            assert_eq!(QuantFormat::from_ggml(f.ggml()), Some(f));
            assert_eq!(Some(f.block_values()), f.ggml().block_size());
            assert_eq!(Some(f.block_bytes()), f.ggml().type_size());
            assert!(f.block_values().is_multiple_of(QK));
            assert!(f.head_bytes() < f.block_bytes());
            assert_eq!(format!("{f:?}"), f.ggml().name());
            assert_eq!(f.ggml().name().parse::<QuantFormat>().ok(), Some(f));
            codes.push(f.gpu_code());
        }
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(
            codes.len(),
            QuantFormat::ALL.len(),
            "GPU codes are distinct"
        );
        assert_eq!(QuantFormat::Q4_K.block_bytes(), 144);
        assert_eq!(QuantFormat::Q4_1.int_form().run, 1);
        assert_eq!(QuantFormat::Q6_K.int_form().run, 8);
        assert!(QuantFormat::from_ggml(GgmlType::F16).is_none());
        assert!(matches!(
            "q2_k".parse::<QuantFormat>(),
            Err(LlamaError::InvalidParameter { .. })
        ));
    }
}
