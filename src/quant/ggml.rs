//! The ggml tensor types: one table of every type's id, name and block layout, which the
//! GGUF reader (`loader::gguf`), the dequantizer ([`super::dequant`]) and the kept block
//! formats ([`super::QuantFormat`]) all read. What the dequantizer can decode is its own
//! list, [`super::dequant`]'s `decoder`.

use std::fmt;

/// Defines [`GgmlType`] from one table: each type's id, its name, and its block layout
/// `(values per block, bytes per block)` (`K` values in a K-quant super-block).
macro_rules! ggml_types {
    ($($(#[$doc:meta])* $variant:ident = $id:literal => $layout:expr,)*) => {
        /// A ggml tensor element type, as stored in a GGUF tensor info (ids from `ggml.h`).
        ///
        /// Types that ggml has since removed, and ids newer than this crate, are kept as
        /// [`GgmlType::Unknown`]: such a file still opens (its metadata stays readable) and
        /// only reading that tensor fails.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $($(#[$doc])* $variant,)*
            /// A type id this crate does not know.
            Unknown(u32),
        }

        impl GgmlType {
            /// Maps a ggml type id to its type ([`GgmlType::Unknown`] if not recognised).
            pub fn from_id(id: u32) -> Self {
                match id {
                    $($id => GgmlType::$variant,)*
                    other => GgmlType::Unknown(other),
                }
            }

            /// The ggml type id.
            pub fn id(self) -> u32 {
                match self {
                    $(GgmlType::$variant => $id,)*
                    GgmlType::Unknown(id) => id,
                }
            }

            /// `(values per block, bytes per block)`, or `None` for an unknown type.
            pub(crate) const fn layout(self) -> Option<(usize, usize)> {
                const K: usize = 256;
                match self {
                    $(GgmlType::$variant => Some($layout),)*
                    GgmlType::Unknown(_) => None,
                }
            }

            /// The type's name as ggml spells it (`"Q4_K"`, `"BF16"`, ...), `"unknown"` for
            /// [`GgmlType::Unknown`] (whose [`Display`](fmt::Display) also shows the id).
            pub fn name(self) -> &'static str {
                match self {
                    $(GgmlType::$variant => stringify!($variant),)*
                    GgmlType::Unknown(_) => "unknown",
                }
            }
        }
    };
}

ggml_types! {
    /// 32-bit IEEE float.
    F32 = 0 => (1, 4),
    /// 16-bit IEEE float.
    F16 = 1 => (1, 2),
    /// 4-bit, 32-value blocks with an `f16` scale.
    Q4_0 = 2 => (32, 2 + 16),
    /// 4-bit, 32-value blocks with an `f16` scale and minimum.
    Q4_1 = 3 => (32, 2 + 2 + 16),
    /// 5-bit, 32-value blocks with an `f16` scale.
    Q5_0 = 6 => (32, 2 + 4 + 16),
    /// 5-bit, 32-value blocks with an `f16` scale and minimum.
    Q5_1 = 7 => (32, 2 + 2 + 4 + 16),
    /// 8-bit, 32-value blocks with an `f16` scale.
    Q8_0 = 8 => (32, 2 + 32),
    /// 8-bit, 32-value blocks with an `f16` scale and sum (an intermediate type).
    Q8_1 = 9 => (32, 2 + 2 + 32),
    /// 2-bit K-quant, 256-value super-blocks.
    Q2_K = 10 => (K, K / 16 + K / 4 + 2 + 2),
    /// 3-bit K-quant.
    Q3_K = 11 => (K, K / 8 + K / 4 + 12 + 2),
    /// 4-bit K-quant.
    Q4_K = 12 => (K, 2 + 2 + 12 + K / 2),
    /// 5-bit K-quant.
    Q5_K = 13 => (K, 2 + 2 + 12 + K / 8 + K / 2),
    /// 6-bit K-quant.
    Q6_K = 14 => (K, K / 2 + K / 4 + K / 16 + 2),
    /// 8-bit K-quant with an `f32` scale (an intermediate type).
    Q8_K = 15 => (K, 4 + K + 2 * (K / 16)),
    /// Importance-matrix 2-bit quant.
    IQ2_XXS = 16 => (K, 2 + K / 4),
    /// Importance-matrix 2-bit quant.
    IQ2_XS = 17 => (K, 2 + K / 4 + K / 32),
    /// Importance-matrix 3-bit quant.
    IQ3_XXS = 18 => (K, 2 + K / 4 + K / 8),
    /// Importance-matrix 1-bit quant.
    IQ1_S = 19 => (K, 2 + K / 8 + K / 16),
    /// Non-linear 4-bit quant, 32-value blocks.
    IQ4_NL = 20 => (32, 2 + 16),
    /// Importance-matrix 3-bit quant.
    IQ3_S = 21 => (K, 2 + K / 4 + K / 8 + K / 32 + 4),
    /// Importance-matrix 2-bit quant.
    IQ2_S = 22 => (K, 2 + K / 4 + K / 16),
    /// Non-linear 4-bit quant, 256-value super-blocks.
    IQ4_XS = 23 => (K, 2 + 2 + K / 2 + K / 64),
    /// 8-bit signed integer.
    I8 = 24 => (1, 1),
    /// 16-bit signed integer.
    I16 = 25 => (1, 2),
    /// 32-bit signed integer.
    I32 = 26 => (1, 4),
    /// 64-bit signed integer.
    I64 = 27 => (1, 8),
    /// 64-bit IEEE float.
    F64 = 28 => (1, 8),
    /// Importance-matrix 1-bit quant.
    IQ1_M = 29 => (K, K / 8 + K / 16 + K / 32),
    /// bfloat16.
    BF16 = 30 => (1, 2),
    /// Ternary quant.
    TQ1_0 = 34 => (K, 2 + 4 * 13),
    /// Ternary quant.
    TQ2_0 = 35 => (K, 2 + 64),
    /// Microscaling 4-bit float.
    MXFP4 = 39 => (32, 1 + 16),
    /// NVIDIA 4-bit float.
    NVFP4 = 40 => (64, 4 + 32),
    /// 1-bit quant, 128-value blocks.
    Q1_0 = 41 => (128, 2 + 16),
}

impl GgmlType {
    /// Number of values in one block (1 for the plain types), `None` if unknown.
    pub fn block_size(self) -> Option<usize> {
        self.layout().map(|(n, _)| n)
    }

    /// Number of bytes one block takes (the element size for the plain types), `None` if
    /// unknown.
    pub fn type_size(self) -> Option<usize> {
        self.layout().map(|(_, b)| b)
    }

    /// Whether the type stores values in multi-value blocks (anything quantized).
    pub fn is_quantized(self) -> bool {
        self.block_size().is_some_and(|n| n > 1)
    }

    /// Bytes taken by `n_elements` values, or `None` if the type is unknown, the count is
    /// not a whole number of blocks, or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (block, size) = self.layout()?;
        let (block, size) = (block as u64, size as u64);
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(size)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgmlType::Unknown(id) => write!(f, "unknown ggml type id {id}"),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_table_is_consistent() {
        for id in 0..64 {
            let ty = GgmlType::from_id(id);
            assert_eq!(ty.id(), id);
            if !matches!(ty, GgmlType::Unknown(_)) {
                assert!(ty.block_size().is_some() && ty.type_size().is_some());
            }
        }
        assert_eq!(GgmlType::Q4_K.type_size(), Some(144));
        assert_eq!(GgmlType::Q6_K.type_size(), Some(210));
        assert_eq!(GgmlType::Q3_K.type_size(), Some(110));
        assert_eq!(GgmlType::Q2_K.type_size(), Some(84));
        assert_eq!(GgmlType::Q5_K.type_size(), Some(176));
        assert_eq!(GgmlType::Q8_K.type_size(), Some(292));
        assert_eq!(GgmlType::IQ4_XS.type_size(), Some(136));
        assert_eq!(GgmlType::Unknown(77).to_string(), "unknown ggml type id 77");
    }
}
