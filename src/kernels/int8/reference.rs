//! The `fast` precision's product written plainly, from the dequantization-free
//! definition in the module documentation: the reference every kernel is tested against.

use super::QK;
use super::activations::QuantizedRows;
use crate::quant::QuantFormat;
use crate::quant::int_form::Sub;

/// One output of the `fast` precision written plainly, from the dequantization-free
/// definition in the module documentation (for tests).
pub fn int8_reference(format: QuantFormat, row_blocks: &[u8], x: &[f32]) -> f32 {
    let n_in = x.len();
    let f = format.int_form();
    let acts = QuantizedRows::new(x, 1, n_in, f.run);
    let (bv, bb) = (format.block_values(), format.block_bytes());
    let mut acc = 0f32;
    let mut iacc = 0i32;
    let mut subs = [Sub::default(); 8];
    for (blk, bytes) in row_blocks.chunks_exact(bb).enumerate().take(n_in / bv) {
        (format.spec().int_decode)(bytes, &mut subs);
        for (i, sub) in subs.iter().take(bv / QK).enumerate() {
            let s = blk * (bv / QK) + i;
            for h in 0..2 {
                let mut dot = 0i32;
                for k in 16 * h..16 * h + 16 {
                    dot += i32::from(sub.u[k]) * i32::from(acts.q[s * QK + k]);
                }
                iacc += sub.sc[h] * (dot - f.offset * acts.sum16[2 * s + h]);
            }
            if (s + 1).is_multiple_of(f.run) {
                acc = (iacc as f32).mul_add(sub.d * acts.d[s], acc);
                iacc = 0;
            }
            if f.mins {
                acc = sub.m.mul_add(acts.sx[s], acc);
            }
        }
    }
    acc
}
