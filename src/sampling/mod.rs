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
//!
//! # One value from the request to the draw
//!
//! A request's sampling settings are one [`SamplingParams`] all the way: the server parses
//! the body into it, [`GenerateRequest::sampling`] holds it,
//! [`GenerateRequest::validate`] checks it once ([`SamplingParams::validate`]), and the
//! request's sampler ([`constrained_sampler`]) reads it: every strategy draws with
//! [`Sampler::params`], and the device-draw decisions ([`device`]) read the same value.
//! Nothing downstream checks it again or carries a control beside it. The spec's methods
//! that take a `temperature` beside a `TopP` or `TopK` sampler make it that sampler's
//! temperature, once, where they are called.
//!
//! # Adding a control
//!
//! A new sampler control is two files:
//!
//! 1. `pipeline.rs`: one field of [`SamplingParams`] with its default (off) in
//!    `SamplingParams::DEFAULT`; one check in [`SamplingParams::validate`] (its range,
//!    the error named after the field); one step in the pipeline, in the order the
//!    [`pipeline`] docs give: a change of the logits goes in `modify` (and in
//!    `SamplingParams::modifies`, which says whether `modify` runs), a cut in `sample`
//!    (and in `SamplingParams::truncates`, which says whether a constrained draw masks
//!    first, and in [`reference_distribution`], which the tests draw against);
//! 2. `server/openai.rs`: its JSON name, a field of `CommonFields` and the line of
//!    `CommonFields::params` that reads it into the `SamplingParams` (its range is
//!    `validate`'s).
//!
//! Nothing else changes: [`GenerateRequest`](crate::inference::GenerateRequest) holds the
//! value, the strategies and the engine carry it as it is, and a row with a control the
//! device draw does not apply is sampled on the host (`SamplingParams::is_device_drawable`
//! compares every field but temperature, top-k, top-p and min-p with its default). A
//! request sets it with `GenerateRequest::with_sampling` or
//! `request.sampling.my_control = ...`. The `all_controls` case of `benches/sampling.rs`
//! names every field, so it is extended too.
//!
//! [`GenerateRequest::sampling`]: crate::inference::GenerateRequest::sampling
//! [`GenerateRequest::validate`]: crate::inference::GenerateRequest::validate
//! [`constrained_sampler`]: crate::inference::constrained_sampler

pub mod device;
pub mod logprobs;
pub mod pipeline;

use rand::{SeedableRng, rngs::StdRng};

pub use device::{DeviceDraw, DeviceToken, MAX_DEVICE_TOP_LOGPROBS};
pub use logprobs::{MAX_TOP_LOGPROBS, TokenLogprob, TokenLogprobs, token_logprobs};
pub use pipeline::{History, Pipeline, SamplingParams, reference_distribution};

/// Temperatures below this decode greedily, as vLLM's do: their inverse (by which the
/// logits are scaled) overflows `f32` somewhere below it (a temperature of `1e-300` gave
/// every weight `NaN`), and long before that the draw is the greedy token in all but
/// exact ties. [`greedy_at`] is the one place that reads it.
pub const MIN_SAMPLED_TEMPERATURE: f64 = 1e-5;

/// Whether `temperature` decodes greedily (below [`MIN_SAMPLED_TEMPERATURE`], 0 included).
pub fn greedy_at(temperature: f64) -> bool {
    temperature < MIN_SAMPLED_TEMPERATURE
}

use crate::error::{LlamaError, Result};
use pipeline::{GREEDY, Scratch};

/// Nucleus sampling: sample among the smallest set of tokens whose probability mass
/// reaches `p`.
///
/// Its controls are a [`SamplingParams`] with top-p `p`; the temperature is the one the
/// method it is passed to gives ([`Sampler::sample`], [`Llama::generate`], ...).
///
/// [`Llama::generate`]: crate::llama::Llama::generate
#[derive(Debug, Clone)]
pub struct TopP {
    params: SamplingParams,
    rng: StdRng,
    scratch: Scratch,
}

impl TopP {
    /// A nucleus sampler with mass `p` (in `(0, 1]`) and a seed. The value of `p` is
    /// checked when sampling starts ([`Sampler::validate`]).
    pub fn new(p: f64, seed: u64) -> Self {
        Self::at(p, seed, 1.0)
    }

    /// A nucleus sampler at `temperature` already (for the crate's own front doors, which
    /// have checked both values).
    pub(crate) fn at(p: f64, seed: u64, temperature: f64) -> Self {
        Self {
            params: SamplingParams {
                temperature,
                top_p: p,
                ..SamplingParams::default()
            },
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
        }
    }

    /// The probability mass kept.
    pub fn p(&self) -> f64 {
        self.params.top_p
    }
}

/// Top-k sampling: sample among the `k` most likely tokens.
///
/// Its controls are a [`SamplingParams`] with top-k `k`; the temperature is the one the
/// method it is passed to gives, as for [`TopP`].
#[derive(Debug, Clone)]
pub struct TopK {
    params: SamplingParams,
    rng: StdRng,
    scratch: Scratch,
}

impl TopK {
    /// A top-k sampler with a seed. `k` must be at least 1.
    pub fn new(k: usize, seed: u64) -> Self {
        Self {
            params: SamplingParams {
                top_k: k,
                ..SamplingParams::default()
            },
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
        }
    }
}

/// How the next token is chosen.
///
/// Every sampler draws through the [`Pipeline`]'s code with one [`SamplingParams`]
/// ([`params`](Self::params)): a `Pipeline` with its own (its temperature included),
/// `TopP` and `TopK` with their one control at the temperature of the method they are
/// passed to (a method taking a `temperature` argument makes it theirs; for a `Pipeline`
/// the argument must be valid but is not read), `Argmax` greedy. A temperature of 0
/// always means greedy decoding, whatever the sampler.
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
            Sampler::TopK(t) if t.params.top_k == 0 => Err(LlamaError::invalid(
                "top_k",
                t.params.top_k,
                "must be at least 1",
            )),
            Sampler::TopP(TopP { params, .. }) | Sampler::TopK(TopK { params, .. }) => {
                params.validate()
            }
            Sampler::Pipeline(p) => p.params().validate(),
        }
    }

    /// The controls it draws with: a pipeline's own, a `TopP` or `TopK` sampler's one
    /// control at the temperature the last method it was passed to gave, greedy for
    /// `Argmax`.
    pub fn params(&self) -> &SamplingParams {
        match self {
            Sampler::Argmax => &GREEDY,
            Sampler::TopP(TopP { params, .. }) | Sampler::TopK(TopK { params, .. }) => params,
            Sampler::Pipeline(p) => p.params(),
        }
    }

    /// The front door of every method that takes a `temperature` beside a sampler:
    /// checks `temperature` and the sampler, and makes `temperature` the temperature of a
    /// `TopP` or `TopK` sampler (a pipeline keeps its own). What follows draws with
    /// [`params`](Self::params) and checks nothing again.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] naming the value out of range.
    pub(crate) fn bind(&mut self, temperature: f64) -> Result<()> {
        self.bind_with(temperature, 1.0)
    }

    /// [`bind`](Self::bind) with a repetition penalty for `TopP` and `TopK`.
    fn bind_with(&mut self, temperature: f64, repetition_penalty: f32) -> Result<()> {
        validate_temperature(temperature)?;
        if let Sampler::TopP(TopP { params, .. }) | Sampler::TopK(TopK { params, .. }) = self {
            params.temperature = temperature;
            params.repetition_penalty = repetition_penalty;
        }
        self.validate()
    }

    /// Its constraint's state, if it has one.
    pub(crate) fn constraint(&self) -> Option<&crate::constraints::ConstraintState> {
        match self {
            Sampler::Pipeline(p) => p.constraint(),
            _ => None,
        }
    }

    /// Its random generator (`Argmax` has none).
    pub(crate) fn rng(&self) -> Option<&StdRng> {
        match self {
            Sampler::Argmax => None,
            Sampler::TopP(TopP { rng, .. }) | Sampler::TopK(TopK { rng, .. }) => Some(rng),
            Sampler::Pipeline(p) => Some(p.rng()),
        }
    }

    /// Its random generator, mutably.
    pub(crate) fn rng_mut(&mut self) -> Option<&mut StdRng> {
        match self {
            Sampler::Argmax => None,
            Sampler::TopP(TopP { rng, .. }) | Sampler::TopK(TopK { rng, .. }) => Some(rng),
            Sampler::Pipeline(p) => Some(p.rng_mut()),
        }
    }

    /// Whether [`draw`](Self::draw) with nothing banned is exactly [`argmax`] of the
    /// logits (once they pass [`check_logits`]): greedy, no bias, penalty or constraint.
    /// Such a draw can run on the device
    /// ([`LlamaBackend::greedy_tokens`](crate::backend::LlamaBackend::greedy_tokens)).
    pub(crate) fn is_plain_greedy(&self) -> bool {
        let params = self.params();
        greedy_at(params.temperature) && !params.modifies() && self.constraint().is_none()
    }

    /// Picks a token from `logits` at `temperature` (0 = greedy).
    pub fn sample(&mut self, logits: &[f32], temperature: f64) -> Result<u32> {
        self.sample_with(logits, temperature, History::default(), 1.0)
    }

    /// Picks a token from `logits` at `temperature`, with the penalties that read
    /// `history`; `repetition_penalty` (1 is off) applies to the `Argmax`, `TopP` and
    /// `TopK` samplers (a pipeline has its own).
    pub fn sample_with(
        &mut self,
        logits: &[f32],
        temperature: f64,
        history: History<'_>,
        repetition_penalty: f32,
    ) -> Result<u32> {
        self.bind_with(temperature, repetition_penalty)?;
        if let Sampler::Argmax = self
            && repetition_penalty != 1.0
        {
            let params = SamplingParams {
                repetition_penalty,
                ..SamplingParams::greedy()
            };
            let mut rng = StdRng::seed_from_u64(0);
            return pipeline::sample(&params, logits, history, &mut rng, &mut Scratch::default());
        }
        self.draw(logits, history)
    }

    /// Picks a token from `logits` with [`params`](Self::params), checked already by a
    /// front door ([`GenerateRequest::validate`](crate::inference::GenerateRequest::validate)
    /// or [`bind`](Self::bind)): the one draw every strategy makes.
    pub(crate) fn draw(&mut self, logits: &[f32], history: History<'_>) -> Result<u32> {
        match self {
            Sampler::Pipeline(p) => p.sample(logits, history),
            Sampler::Argmax => {
                let mut rng = StdRng::seed_from_u64(0);
                pipeline::sample(&GREEDY, logits, history, &mut rng, &mut Scratch::default())
            }
            Sampler::TopP(TopP {
                params,
                rng,
                scratch,
            })
            | Sampler::TopK(TopK {
                params,
                rng,
                scratch,
            }) => pipeline::sample(params, logits, history, rng, scratch),
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
    use crate::error::assert_err;

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
        assert_err!(
            check_logits(&[f32::NEG_INFINITY; 35]),
            LlamaError::InvalidLogits(m) if m.contains("every logit is -inf")
        );
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
        assert_err!(
            Sampler::TopK(TopK::new(0, 0)).validate(),
            LlamaError::InvalidParameter { name: "top_k", .. }
        );
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
    fn the_front_door_temperature_becomes_the_spec_samplers_own() {
        let mut top_p = Sampler::TopP(TopP::new(0.8, 1));
        top_p.bind(0.6).unwrap();
        assert_eq!(
            *top_p.params(),
            SamplingParams {
                temperature: 0.6,
                top_p: 0.8,
                ..SamplingParams::default()
            }
        );
        let mut top_k = Sampler::TopK(TopK::new(3, 1));
        top_k.bind(0.0).unwrap();
        assert!(top_k.is_plain_greedy());
        // A pipeline keeps its own temperature: the argument is checked, not read.
        let own = SamplingParams {
            temperature: 1.3,
            ..SamplingParams::default()
        };
        let mut pipeline = Sampler::Pipeline(Pipeline::new(own.clone(), 1).unwrap());
        pipeline.bind(0.0).unwrap();
        assert_eq!(*pipeline.params(), own);
        assert!(!pipeline.is_plain_greedy());
        assert!(matches!(
            pipeline.bind(-1.0),
            Err(LlamaError::InvalidParameter {
                name: "temperature",
                ..
            })
        ));
        assert!(matches!(
            Sampler::TopK(TopK::new(0, 1)).bind(1.0),
            Err(LlamaError::InvalidParameter { name: "top_k", .. })
        ));
        assert_eq!(*Sampler::Argmax.params(), SamplingParams::greedy());
        // `sample_with`'s repetition penalty is the spec sampler's, and reset by the next
        // front door.
        let mut s = Sampler::TopP(TopP::new(0.9, 2));
        let history = History {
            prompt: &[1],
            ..History::default()
        };
        s.sample_with(&[0.0, 1.0, 0.5], 0.0, history, 4.0).unwrap();
        assert_eq!(s.params().repetition_penalty, 4.0);
        s.bind(0.0).unwrap();
        assert_eq!(s.params().repetition_penalty, 1.0);
    }

    #[test]
    fn repetition_penalty_lowers_seen_tokens() {
        let mut logits = [2.0, -1.0, 2.0];
        apply_repetition_penalty(&mut logits, &[0, 1, 0], 2.0);
        assert_eq!(logits, [1.0, -2.0, 2.0]);
    }
}
