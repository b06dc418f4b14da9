//! The value types of the paged KV cache ([`KvCacheType`]), keys and values chosen
//! separately ([`KvCacheTypes`]): one row per type in [`KvCacheType::layout`],
//! [`encode`](KvCacheType::encode) and [`decode`](KvCacheType::decode).
//!
//! A head vector of `head_dim` values is stored as one *row*: `head_dim` little-endian
//! floats, or `head_dim / 32` ggml blocks (`q8_0`: an f16 scale and 32 signed bytes;
//! `q4_0`: an f16 scale and 32 nibbles). Each token's row is encoded on its own when it
//! is written, from that token's values only, so what a token's keys become does not
//! depend on the batch, the chunking or the other tokens: attention over an encoded
//! cache stays bitwise batch-invariant.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::{LlamaError, Result};

/// How the paged KV cache stores keys or values.
///
/// `F32` (the default) keeps the activations' float type: f32 on the CPU, or the
/// device's half type where it is set (see [`set_float_type`](crate::backend::set_float_type)).
/// The other types are encoded on the host by the CPU backend (Flex), whose attention
/// reads them in place (see [`crate::kernels::attention::paged_attention_encoded`]).
///
/// | type | bytes per value | tokens in the budget of one f16 token |
/// | --- | --- | --- |
/// | `f32` | 4 | 0.5 |
/// | `f16`, `bf16` | 2 | 1 |
/// | `q8_0` | 34 / 32 | 1.88 |
/// | `q4_0` | 18 / 32 | 3.56 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCacheType {
    /// The activations' float type (f32 on the CPU backend).
    #[default]
    F32,
    /// IEEE half precision, rounded to nearest.
    F16,
    /// bfloat16, rounded to nearest (f32's range, 8 bits of mantissa).
    Bf16,
    /// ggml's `q8_0`: per 32 values an f16 scale `max|x| / 127` and 32 signed bytes.
    Q8_0,
    /// ggml's `q4_0`: per 32 values an f16 scale and 32 four-bit values.
    Q4_0,
}

impl KvCacheType {
    /// Every type, in the order of the table above.
    pub const ALL: [Self; 5] = [Self::F32, Self::F16, Self::Bf16, Self::Q8_0, Self::Q4_0];

    /// The name the flags take: `f32`, `f16`, `bf16`, `q8_0`, `q4_0`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
        }
    }

    /// `(values per block, bytes per block)`: a row of `head_dim` values is
    /// `head_dim / values` blocks.
    const fn layout(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q8_0 => (32, 34),
            Self::Q4_0 => (32, 18),
        }
    }

    /// The type's code in our CubeCL kernels (`crate::gpu`): 0 f32, 1 f16, 2 bf16,
    /// 3 `q8_0`, 4 `q4_0`.
    pub fn kernel_code(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Bf16 => 2,
            Self::Q8_0 => 3,
            Self::Q4_0 => 4,
        }
    }

    /// Bytes of one stored head vector of `head_dim` values.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] if `head_dim` is not a whole number of the
    /// type's blocks (32 values for `q8_0` and `q4_0`).
    pub fn row_bytes(self, head_dim: usize) -> Result<usize> {
        let (values, bytes) = self.layout();
        if head_dim == 0 || !head_dim.is_multiple_of(values) {
            return Err(LlamaError::invalid(
                "kv_cache_type",
                self,
                "the model's head size is not a multiple of this type's 32-value blocks",
            ));
        }
        Ok(head_dim / values * bytes)
    }

    /// Encodes one head vector `x` into its row `out` (`row_bytes(x.len())` bytes).
    pub fn encode(self, x: &[f32], out: &mut [u8]) {
        match self {
            Self::F32 => {
                for (o, v) in out.as_chunks_mut::<4>().0.iter_mut().zip(x) {
                    *o = v.to_le_bytes();
                }
            }
            Self::F16 => {
                for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(x) {
                    *o = f16::from_f32(*v).to_le_bytes();
                }
            }
            Self::Bf16 => {
                for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(x) {
                    *o = bf16::from_f32(*v).to_le_bytes();
                }
            }
            Self::Q8_0 => {
                for (o, x) in out.chunks_exact_mut(34).zip(x.chunks_exact(32)) {
                    crate::quant::quantize::q8_0_into(x, o);
                }
            }
            Self::Q4_0 => {
                for (o, x) in out.chunks_exact_mut(18).zip(x.chunks_exact(32)) {
                    crate::quant::quantize::q4_0_into(x, o);
                }
            }
        }
    }

    /// Decodes one row `bytes` into its head vector `out`.
    #[inline(always)]
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        use crate::quant::dequant;
        match self {
            Self::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                    *o = f32::from_le_bytes(*b);
                }
            }
            Self::F16 => dequant::f16_le(bytes, out),
            Self::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
                }
            }
            Self::Q8_0 => dequant::q8_0(bytes, out),
            Self::Q4_0 => dequant::q4_0(bytes, out),
        }
    }
}

impl fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvCacheType {
    type Err = LlamaError;

    /// Parses a type's [`name`](Self::name), in any case.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                LlamaError::invalid("kv_cache_type", s, "expected f32, f16, bf16, q8_0 or q4_0")
            })
    }
}

/// The types of the keys and of the values of a paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KvCacheTypes {
    /// How keys are stored.
    pub keys: KvCacheType,
    /// How values are stored.
    pub values: KvCacheType,
}

impl KvCacheTypes {
    /// Keys in `keys`, values in `values`.
    pub fn new(keys: KvCacheType, values: KvCacheType) -> Self {
        Self { keys, values }
    }

    /// Keys and values both in `ty`.
    pub fn both(ty: KvCacheType) -> Self {
        Self::new(ty, ty)
    }

    /// Whether both are [`KvCacheType::F32`]: the pool is the backend's own tensors.
    pub fn is_float(self) -> bool {
        self == Self::default()
    }

    /// Bytes one token takes across `n_layers` layers of `kv_heads` heads of
    /// `head_dim` values, keys and values together.
    ///
    /// # Errors
    ///
    /// As [`KvCacheType::row_bytes`].
    pub fn bytes_per_token(
        self,
        n_layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<usize> {
        let row = self.keys.row_bytes(head_dim)? + self.values.row_bytes(head_dim)?;
        Ok(n_layers.saturating_mul(kv_heads).saturating_mul(row))
    }
}

impl fmt::Display for KvCacheTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "k={} v={}", self.keys, self.values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn names_parse_back_and_unknown_names_are_refused() {
        for ty in KvCacheType::ALL {
            assert_eq!(ty.name().parse::<KvCacheType>().unwrap(), ty);
            assert_eq!(ty.name().to_uppercase().parse::<KvCacheType>().unwrap(), ty);
        }
        assert_err!(
            "q5_k".parse::<KvCacheType>(),
            LlamaError::InvalidParameter {
                name: "kv_cache_type",
                ..
            }
        );
    }

    #[test]
    fn rows_round_trip_within_each_types_error() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Largest error per type, relative to the row's largest magnitude.
        for (ty, bytes, tolerance) in [
            (KvCacheType::F32, 256, 0.0),
            (KvCacheType::F16, 128, 1e-3),
            (KvCacheType::Bf16, 128, 8e-3),
            (KvCacheType::Q8_0, 68, 1.0 / 127.0),
            (KvCacheType::Q4_0, 36, 1.0 / 8.0),
        ] {
            assert_eq!(ty.row_bytes(64).unwrap(), bytes, "{ty}");
            let mut row = vec![0u8; bytes];
            ty.encode(&x, &mut row);
            let mut back = vec![f32::NAN; 64];
            ty.decode(&row, &mut back);
            let worst = x
                .iter()
                .zip(&back)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= tolerance * amax, "{ty}: {worst}");
            if ty == KvCacheType::F32 {
                assert_eq!(back, x);
            } else {
                assert!(worst > 0.0, "{ty} loses something on these values");
            }
        }
    }

    #[test]
    fn quantized_types_need_whole_blocks() {
        assert_eq!(KvCacheType::F16.row_bytes(40).unwrap(), 80);
        assert_err!(
            KvCacheType::Q8_0.row_bytes(40),
            LlamaError::InvalidParameter {
                name: "kv_cache_type",
                ..
            }
        );
        let types = KvCacheTypes::new(KvCacheType::Q8_0, KvCacheType::F16);
        // Demo model: 30 layers, 3 heads of 64: (68 + 128) bytes per head.
        assert_eq!(
            types.bytes_per_token(30, 3, 64).unwrap(),
            30 * 3 * (68 + 128)
        );
        assert_eq!(types.to_string(), "k=q8_0 v=f16");
    }
}
