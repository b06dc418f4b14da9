//! Choosing the next token from logits, and the log-probabilities of tokens.
//!
//! [`Pipeline`] applies every control a request can give ([`SamplingParams`]: logit bias,
//! penalties, temperature, top-k, top-p, min-p) in one documented order (see
//! [`pipeline`]), fast: no full-vocabulary sort anywhere, nothing at all for a control
//! that is off. The spec's [`Sampler`] with [`TopP`] and [`TopK`] are front doors to the
//! same code. [`logprobs`] computes the model's raw log-probabilities. [`device`] says
//! which rows a backend may draw where their logits are.
//!
//! Every sampler owns its random generator, seeded per request, so results reproduce and
//! never depend on other requests.

pub mod device;
pub mod logprobs;
pub mod pipeline;

use rand::{SeedableRng, rngs::StdRng};

pub use device::{DeviceDraw, DeviceToken, MAX_DEVICE_TOP_LOGPROBS};
pub use logprobs::{MAX_TOP_LOGPROBS, TokenLogprob, TokenLogprobs, token_logprobs};
pub use pipeline::{History, Pipeline, SamplingParams, reference_distribution};

use crate::error::{LlamaError, Result};
use pipeline::Scratch;

/// Nucleus sampling: sample among the smallest set of tokens whose probability mass
/// reaches `p`.
#[derive(Debug, Clone)]
pub struct TopP {
    p: f64,
    rng: StdRng,
    scratch: Scratch,
}

impl TopP {
    /// A nucleus sampler with mass `p` (in `(0, 1]`) and a seed. The value of `p` is
    /// checked when sampling starts ([`Sampler::validate`]).
    pub fn new(p: f64, seed: u64) -> Self {
        Self {
            p,
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
        }
    }

    /// The probability mass kept.
    pub fn p(&self) -> f64 {
        self.p
    }
}

/// Top-k sampling: sample among the `k` most likely tokens.
#[derive(Debug, Clone)]
pub struct TopK {
    k: usize,
    rng: StdRng,
    scratch: Scratch,
}

impl TopK {
    /// A top-k sampler with a seed. `k` must be at least 1.
    pub fn new(k: usize, seed: u64) -> Self {
        Self {
            k,
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
        }
    }
}

/// How the next token is chosen.
///
/// A temperature of 0 always means greedy decoding, whatever the sampler. `TopP` and
/// `TopK` run the [`Pipeline`] with that one control; `Pipeline` runs every control of its
/// [`SamplingParams`], its own temperature included (the `temperature` argument of
/// [`Sampler::sample`] must then be valid but is not read).
#[derive(Debug, Clone)]
pub enum Sampler {
    /// Always the most likely token (ties go to the lowest id).
    Argmax,
    /// Nucleus sampling.
    TopP(TopP),
    /// Top-k sampling.
    TopK(TopK),
    /// Every control of a request.
    Pipeline(Pipeline),
}

impl Sampler {
    /// Checks the sampler's parameters: top-p in `(0, 1]`, top-k at least 1, a
    /// pipeline's as [`SamplingParams::validate`] says.
    pub fn validate(&self) -> Result<()> {
        match self {
            Sampler::Argmax => Ok(()),
            Sampler::TopP(t) => validate_top_p(t.p),
            Sampler::TopK(t) if t.k == 0 => {
                Err(LlamaError::invalid("top_k", t.k, "must be at least 1"))
            }
            Sampler::TopK(_) => Ok(()),
            Sampler::Pipeline(p) => p.params().validate(),
        }
    }

    /// Whether [`sample_with`](Self::sample_with) at `temperature` with
    /// `repetition_penalty` and nothing banned is exactly [`argmax`] of the logits (once
    /// they pass [`check_logits`]): valid parameters, greedy, no bias, penalty or
    /// constraint. Such a draw can run on the device
    /// ([`LlamaBackend::greedy_tokens`](crate::backend::LlamaBackend::greedy_tokens)).
    pub(crate) fn is_plain_greedy(&self, temperature: f64, repetition_penalty: f32) -> bool {
        if validate_temperature(temperature).is_err() || self.validate().is_err() {
            return false;
        }
        match self {
            Sampler::Argmax => repetition_penalty == 1.0,
            Sampler::TopP(_) | Sampler::TopK(_) => temperature == 0.0 && repetition_penalty == 1.0,
            Sampler::Pipeline(p) => p.is_plain_greedy(),
        }
    }

    /// Picks a token from `logits` at `temperature` (0 = greedy).
    pub fn sample(&mut self, logits: &[f32], temperature: f64) -> Result<u32> {
        self.sample_with(logits, temperature, History::default(), 1.0)
    }

    /// Picks a token from `logits` at `temperature`, with the penalties that read
    /// `history`; `repetition_penalty` (1 is off) applies to the `TopP` and `TopK`
    /// samplers (a pipeline has its own).
    pub fn sample_with(
        &mut self,
        logits: &[f32],
        temperature: f64,
        history: History<'_>,
        repetition_penalty: f32,
    ) -> Result<u32> {
        validate_temperature(temperature)?;
        self.validate()?;
        let legacy = |top_k: usize, top_p: f64| SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            ..SamplingParams::default()
        };
        match self {
            Sampler::Pipeline(p) => p.sample(logits, history),
            Sampler::Argmax => {
                let params = SamplingParams {
                    repetition_penalty,
                    ..SamplingParams::greedy()
                };
                let mut rng = StdRng::seed_from_u64(0);
                pipeline::sample(&params, logits, history, &mut rng, &mut Scratch::default())
            }
            Sampler::TopP(t) => {
                pipeline::sample(&legacy(0, t.p), logits, history, &mut t.rng, &mut t.scratch)
            }
            Sampler::TopK(t) => pipeline::sample(
                &legacy(t.k, 1.0),
                logits,
                history,
                &mut t.rng,
                &mut t.scratch,
            ),
        }
    }
}

/// Runs `f` on every item (a row of a step: its state, sampler and logits), in parallel
/// on the CPU kernels' pool, and returns the results in the items' order. Each call sees
/// only its own item, so the results are those of a serial loop.
///
/// ```
/// use llama_burn::sampling::{History, Pipeline, SamplingParams, for_each_row};
///
/// let logits = vec![0.0f32; 4 * 100];
/// let mut rows: Vec<(Pipeline, &[f32])> = logits
///     .chunks(100)
///     .enumerate()
///     .map(|(i, l)| (Pipeline::new(SamplingParams::default(), i as u64).unwrap(), l))
///     .collect();
/// let tokens = for_each_row(&mut rows, |(p, l)| p.sample(l, History::default()));
/// assert_eq!(tokens.len(), 4);
/// ```
pub fn for_each_row<T: Send, R: Send>(items: &mut [T], f: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter_mut().map(f).collect();
    }
    let slots: Vec<std::sync::Mutex<(&mut T, Option<R>)>> = items
        .iter_mut()
        .map(|item| std::sync::Mutex::new((item, None)))
        .collect();
    crate::kernels::pool::for_each_chunk(slots.len(), &|i| {
        if let Ok(mut slot) = slots[i].lock() {
            let (item, out) = &mut *slot;
            *out = Some(f(item));
        }
    });
    slots
        .into_iter()
        .filter_map(|slot| slot.into_inner().ok().and_then(|(_, out)| out))
        .collect()
}

/// Checks that a token can be chosen from `logits`: no NaN, and at least one value
/// above `-inf`.
///
/// # Errors
///
/// [`LlamaError::InvalidLogits`] otherwise.
pub fn check_logits(logits: &[f32]) -> Result<()> {
    // One pass in 16 independent lanes (the compiler vectorizes it); where the NaN is is
    // only looked for when there is one.
    let (mut nan, mut above) = ([false; 16], [false; 16]);
    let chunks = logits.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for l in 0..16 {
            nan[l] |= chunk[l].is_nan();
            above[l] |= chunk[l] != f32::NEG_INFINITY;
        }
    }
    for (l, &v) in rest.iter().enumerate() {
        nan[l] |= v.is_nan();
        above[l] |= v != f32::NEG_INFINITY;
    }
    if nan.contains(&true) {
        let i = logits.iter().position(|l| l.is_nan()).unwrap_or_default();
        return Err(LlamaError::InvalidLogits(format!(
            "the logit of token {i} is NaN"
        )));
    }
    if !above.contains(&true) {
        return Err(LlamaError::InvalidLogits(
            "every logit is -inf: no token can be chosen".into(),
        ));
    }
    Ok(())
}

/// Index of the largest logit (the first one on ties; NaN is never chosen over a number).
pub fn argmax(logits: &[f32]) -> u32 {
    // The largest number (in 16 lanes), then the first index holding it: two passes the
    // compiler vectorizes, where one pass with a running index does not (a 32-row greedy
    // step samples 1.6 million logits).
    let max = crate::kernels::cpu::largest(logits);
    match logits.iter().position(|&l| l == max) {
        Some(i) => i as u32,
        // Every logit is NaN: the last one, as the plain scan gives.
        None => logits.len().saturating_sub(1) as u32,
    }
}

/// Checks a temperature: finite and non-negative.
pub fn validate_temperature(temperature: f64) -> Result<()> {
    if temperature.is_finite() && temperature >= 0.0 {
        Ok(())
    } else {
        Err(LlamaError::invalid(
            "temperature",
            temperature,
            "must be a finite number >= 0 (0 means greedy)",
        ))
    }
}

/// Checks a top-p value: in `(0, 1]`.
pub fn validate_top_p(p: f64) -> Result<()> {
    if p > 0.0 && p <= 1.0 {
        Ok(())
    } else {
        Err(LlamaError::invalid("top_p", p, "must be in (0, 1]"))
    }
}

/// Divides positive logits (multiplies negative ones) of tokens seen in `history` by
/// `penalty` (> 1 discourages repetition), as in the CTRL paper.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = std::collections::HashSet::new();
    for &t in history {
        if seen.insert(t)
            && let Some(l) = logits.get_mut(t as usize)
        {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain scan `argmax` must agree with: first index on ties, NaN never chosen
    /// over a number (all NaN: the last index).
    fn argmax_scan(logits: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] || logits[best].is_nan() {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_and_never_nan() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(5);
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 1.0, -0.0, 0.0];
        for len in [0usize, 1, 2, 15, 16, 17, 33, 100, 49152] {
            for _ in 0..20 {
                let logits: Vec<f32> = (0..len)
                    .map(|_| match rng.random_range(0..10) {
                        0 => specials[rng.random_range(0..specials.len())],
                        // Few distinct values, so ties are common.
                        _ => f32::from(rng.random_range(-8i8..8)) * 0.5,
                    })
                    .collect();
                assert_eq!(argmax(&logits), argmax_scan(&logits), "{logits:?}");
            }
        }
        for logits in [
            vec![f32::NAN; 20],
            vec![f32::NEG_INFINITY; 20],
            vec![f32::NAN, f32::NEG_INFINITY, f32::NAN],
            vec![f32::NEG_INFINITY, f32::NAN],
        ] {
            assert_eq!(argmax(&logits), argmax_scan(&logits), "{logits:?}");
        }
        let mut logits = vec![0.0f32; 40];
        logits[37] = f32::NAN;
        assert!(
            check_logits(&logits)
                .unwrap_err()
                .to_string()
                .contains("token 37")
        );
        logits[37] = f32::NEG_INFINITY;
        assert!(check_logits(&logits).is_ok());
        assert!(check_logits(&[f32::NEG_INFINITY; 35]).is_err());
    }

    #[test]
    fn greedy_and_zero_temperature_pick_the_max() {
        let logits = [0.1, 3.0, 2.0, 3.0];
        assert_eq!(Sampler::Argmax.sample(&logits, 0.7).unwrap(), 1);
        assert_eq!(
            Sampler::TopP(TopP::new(0.9, 1))
                .sample(&logits, 0.0)
                .unwrap(),
            1
        );
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_restricts_support() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let run = |seed| {
            let mut s = Sampler::TopP(TopP::new(0.5, seed));
            (0..64)
                .map(|_| s.sample(&logits, 1.0).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let mut s = Sampler::TopK(TopK::new(2, 3));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for _ in 0..100 {
            let t = s.sample(&logits, 5.0).unwrap() as usize;
            assert!(t == order[0] || t == order[1]);
        }
    }

    #[test]
    fn bad_parameters_are_errors() {
        let logits = [1.0, 2.0];
        for t in [f64::NAN, -0.5, f64::INFINITY] {
            assert!(matches!(
                Sampler::Argmax.sample(&logits, t),
                Err(LlamaError::InvalidParameter {
                    name: "temperature",
                    ..
                })
            ));
        }
        for p in [0.0, -0.1, 1.5, f64::NAN] {
            assert!(matches!(
                Sampler::TopP(TopP::new(p, 0)).sample(&logits, 1.0),
                Err(LlamaError::InvalidParameter { name: "top_p", .. })
            ));
        }
        assert!(Sampler::TopK(TopK::new(0, 0)).validate().is_err());
    }

    #[test]
    fn infinite_logits_are_chosen_and_nan_is_an_error() {
        let mut logits = vec![0.5f32; 100];
        logits[37] = f32::INFINITY;
        logits[3] = f32::NEG_INFINITY;
        let samplers = || {
            [
                Sampler::Argmax,
                Sampler::TopP(TopP::new(0.9, 1)),
                Sampler::TopP(TopP::new(1.0, 2)),
                Sampler::TopK(TopK::new(5, 3)),
            ]
        };
        for mut s in samplers() {
            for t in [0.0, 0.7, 2.0] {
                assert_eq!(s.sample(&logits, t).unwrap(), 37, "{s:?} at {t}");
            }
        }
        // Two `+inf` tokens share the mass: both are drawn, nothing else.
        logits[80] = f32::INFINITY;
        let mut s = Sampler::TopP(TopP::new(1.0, 4));
        let drawn: std::collections::BTreeSet<u32> =
            (0..200).map(|_| s.sample(&logits, 1.0).unwrap()).collect();
        assert_eq!(drawn.into_iter().collect::<Vec<_>>(), vec![37, 80]);
        logits[50] = f32::NAN;
        for mut s in samplers() {
            assert!(matches!(
                s.sample(&logits, 1.0),
                Err(LlamaError::InvalidLogits(_))
            ));
        }
        let none = [f32::NEG_INFINITY; 4];
        assert!(matches!(
            Sampler::Argmax.sample(&none, 0.0),
            Err(LlamaError::InvalidLogits(_))
        ));
        // -inf logits are never drawn.
        let mut some = [f32::NEG_INFINITY; 6];
        some[4] = 1.0;
        some[1] = 0.0;
        let mut s = Sampler::TopK(TopK::new(6, 9));
        for _ in 0..100 {
            assert!([1, 4].contains(&s.sample(&some, 1.0).unwrap()));
        }
    }

    #[test]
    fn repetition_penalty_lowers_seen_tokens() {
        let mut logits = [2.0, -1.0, 2.0];
        apply_repetition_penalty(&mut logits, &[0, 1, 0], 2.0);
        assert_eq!(logits, [1.0, -2.0, 2.0]);
    }
}
