//! Element-wise kernels between projections on the CPU.

use super::attention::exp;
use super::cpu::SimdPath;

/// `out = silu(gate) * up = gate / (1 + e^-gate) * up`, element by element, with the
/// softmax's [`exp`]: one pass instead of Burn's three (sigmoid, multiply, multiply),
/// and no call into the C library per value. Only element-wise operations, so the bits
/// do not depend on the vector width or on how the values are batched.
///
/// `out`, `gate` and `up` must have the same length (extra values are ignored).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    match SimdPath::active() {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn wide(gate: &[f32], up: &[f32], out: &mut [f32]) {
                swiglu_plain(gate, up, out);
            }
            // SAFETY: the active path is supported by this CPU.
            unsafe { wide(gate, up, out) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn wide(gate: &[f32], up: &[f32], out: &mut [f32]) {
                swiglu_plain(gate, up, out);
            }
            // SAFETY: as above.
            unsafe { wide(gate, up, out) }
        }
        _ => swiglu_plain(gate, up, out),
    }
}

#[inline(always)]
fn swiglu_plain(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_silu_times_up() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let up: Vec<f32> = (0..1000).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let mut out = vec![0f32; 1000];
        swiglu(&gate, &up, &mut out);
        for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let g64 = f64::from(g);
            let want = g64 / (1.0 + (-g64).exp()) * f64::from(u);
            assert!(
                (f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1e-6),
                "{g}"
            );
        }
        // A value alone gives the same bits as in a long slice.
        let mut one = [0f32];
        swiglu(&gate[123..124], &up[123..124], &mut one);
        assert_eq!(one[0].to_bits(), out[123].to_bits());
    }
}
