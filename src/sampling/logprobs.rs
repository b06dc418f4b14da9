//! Log-probabilities: the model's raw log-softmax, before bias, penalties, temperature or
//! any cut (what OpenAI and vLLM report), computed from a row's logits alone so they are
//! bitwise the same in every strategy and batch.

use crate::error::{LlamaError, Result};
use crate::kernels::attention::exp;
use crate::kernels::cpu::largest;

/// Most alternatives per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One token and its log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id.
    pub token_id: u32,
    /// Its log-probability under the model's raw log-softmax (`<= 0`).
    pub logprob: f32,
    /// The token's bytes in the tokenizer's vocabulary (empty until the generation
    /// fills them in: [`token_logprobs`] has no tokenizer).
    pub bytes: Vec<u8>,
}

/// A chosen token's log-probability and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token and its log-probability.
    pub chosen: TokenLogprob,
    /// The `n` most likely tokens at this position, most likely first (ties by id).
    pub top: Vec<TokenLogprob>,
}

/// `ln(sum(e^l))` of a row's logits: subtract it from a logit to get its
/// log-probability. The exponentials in 16 lanes, the sum in f64 per block.
///
/// # Errors
///
/// [`LlamaError::InvalidLogits`] for an empty row or one holding NaN.
pub fn log_normalizer(logits: &[f32]) -> Result<f64> {
    super::check_logits(logits)?;
    let max = largest(logits);
    if !max.is_finite() {
        return Ok(f64::INFINITY);
    }
    #[cfg(target_arch = "x86_64")]
    match crate::kernels::SimdPath::active() {
        crate::kernels::SimdPath::Avx512 => {
            // SAFETY: `active` picks a path only on CPUs that have its features.
            return Ok(f64::from(max) + unsafe { exp_sum_avx512(logits, max) }.ln());
        }
        crate::kernels::SimdPath::Avx2 => {
            // SAFETY: `active` picks a path only on CPUs that have its features.
            return Ok(f64::from(max) + unsafe { exp_sum_avx2(logits, max) }.ln());
        }
        _ => {}
    }
    Ok(f64::from(max) + exp_sum(logits, max).ln())
}

/// [`exp_sum`] compiled for AVX2 (no FMA: the same bits as every path).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_sum_avx2(logits: &[f32], max: f32) -> f64 {
    exp_sum(logits, max)
}

/// [`exp_sum`] compiled for AVX-512 (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_sum_avx512(logits: &[f32], max: f32) -> f64 {
    exp_sum(logits, max)
}

/// `sum(e^(l - max))`: 16 lanes per block of 512, the blocks summed in f64.
#[inline(always)]
fn exp_sum(logits: &[f32], max: f32) -> f64 {
    let mut total = 0f64;
    for block in logits.chunks(512) {
        let mut lanes = [0f32; 16];
        let chunks = block.chunks_exact(16);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (s, &l) in lanes.iter_mut().zip(chunk) {
                *s += if l > f32::NEG_INFINITY {
                    exp(l - max)
                } else {
                    0.0
                };
            }
        }
        for (s, &l) in lanes.iter_mut().zip(rest) {
            *s += if l > f32::NEG_INFINITY {
                exp(l - max)
            } else {
                0.0
            };
        }
        total += lanes.iter().map(|&s| f64::from(s)).sum::<f64>();
    }
    total
}

/// The log-probability of a logit given the row's [`log_normalizer`] (`+inf` when the
/// row holds `infinite` `+inf` logits, which share all the mass).
fn logprob(logit: f32, normalizer: f64, infinite: usize) -> f32 {
    if normalizer == f64::INFINITY {
        return match logit {
            f32::INFINITY => -(infinite as f32).ln(),
            _ => f32::NEG_INFINITY,
        };
    }
    (f64::from(logit) - normalizer).min(0.0) as f32
}

/// The `n` largest logits of `logits` as `(id, logit)`, largest first, ties by id: one
/// pass keeping a small sorted list.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (i, &l) in logits.iter().enumerate() {
        // Only a value above the n-th kept one enters (an equal one has a larger id).
        if l.is_nan() || (best.len() == n && l <= best[n - 1].1) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (i as u32, l));
        best.truncate(n);
    }
    best
}

/// The log-probability of `token` in `logits` and the `n` most likely tokens'
/// (`n <= 20`).
///
/// # Errors
///
/// [`LlamaError::InvalidLogits`] for NaN logits; [`LlamaError::InvalidParameter`] for a
/// token outside the row or `n` above [`MAX_TOP_LOGPROBS`].
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> Result<TokenLogprobs> {
    if n > MAX_TOP_LOGPROBS {
        return Err(LlamaError::invalid("top_logprobs", n, "must be in [0, 20]"));
    }
    let logit = *logits
        .get(token as usize)
        .ok_or_else(|| LlamaError::invalid("token", token, "outside the vocabulary"))?;
    let normalizer = log_normalizer(logits)?;
    let infinite = match normalizer {
        f64::INFINITY => logits.iter().filter(|&&l| l == f32::INFINITY).count(),
        _ => 0,
    };
    Ok(TokenLogprobs {
        chosen: TokenLogprob {
            token_id: token,
            logprob: logprob(logit, normalizer, infinite),
            bytes: Vec::new(),
        },
        top: top_n(logits, n)
            .into_iter()
            .map(|(token_id, l)| TokenLogprob {
                token_id,
                logprob: logprob(l, normalizer, infinite),
                bytes: Vec::new(),
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn matches_a_plain_log_softmax() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32) * 0.13 - 4.0)
            .collect();
        let max = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        let out = token_logprobs(&logits, 17, 5).unwrap();
        assert!((f64::from(out.chosen.logprob) - (logits[17] as f64 - z)).abs() < 1e-5);
        assert_eq!(out.top.len(), 5);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        for (t, &i) in out.top.iter().zip(&order) {
            assert_eq!(t.token_id as usize, i);
            assert!((f64::from(t.logprob) - (logits[i] as f64 - z)).abs() < 1e-5);
            assert!(t.logprob <= 0.0);
        }
        let mass: f64 = logits.iter().map(|&l| (l as f64 - z).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-9);
        assert_err!(
            token_logprobs(&logits, 17, 21),
            LlamaError::InvalidParameter {
                name: "top_logprobs",
                ..
            }
        );
        assert_err!(
            token_logprobs(&logits, 1000, 1),
            LlamaError::InvalidParameter { name: "token", .. }
        );
    }

    #[test]
    fn top_n_breaks_ties_by_id() {
        assert_eq!(
            top_n(&[1.0, 3.0, 3.0, 2.0, 3.0], 2),
            vec![(1, 3.0), (2, 3.0)]
        );
        assert_eq!(top_n(&[1.0], 3), vec![(0, 1.0)]);
        assert!(top_n(&[1.0], 0).is_empty());
    }

    #[test]
    fn infinite_and_masked_logits() {
        let out = token_logprobs(&[f32::NEG_INFINITY, 0.0, 0.0], 1, 3).unwrap();
        assert!((out.chosen.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6);
        assert_eq!(out.top[2].logprob, f32::NEG_INFINITY);
        let out = token_logprobs(&[f32::INFINITY, 0.0, f32::INFINITY], 2, 3).unwrap();
        assert!((out.chosen.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6);
        assert_eq!(out.top[2].logprob, f32::NEG_INFINITY);
    }
}
