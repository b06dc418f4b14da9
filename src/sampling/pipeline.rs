//! The sampling pipeline: every control a request can give, applied in one order.
//!
//! The order is vLLM's: **logit bias**, **penalties** (repetition over prompt and output,
//! frequency and presence over the output), the **ban** of stop tokens before
//! `min_tokens`, then **temperature** (0 = greedy: the largest modified logit), **top-k**,
//! **top-p**, **min-p**, and the **draw**.
//!
//! Nothing costs more than it must:
//!
//! - no control modifies the logits: they are read in place, never copied;
//! - temperature alone (top-k, top-p and min-p off, the OpenAI default) is two passes in
//!   16 lanes (the largest logit, then `e^((l - max) / t)` and block sums with the
//!   vectorizable exponential of [`crate::kernels::attention::exp`]) and a walk of one
//!   block of 512 weights;
//! - top-k is one selection (`select_nth_unstable`), top-p one pass that sums the mass per
//!   power of two of the weight and sorts only the one bucket where the mass reaches `p`,
//!   min-p a threshold: no full sort of the vocabulary anywhere.
//!
//! The draw walks the kept tokens in id order (not probability order): a tiny change in
//! the logits then moves interval boundaries only a little. Tokens tied with the last one
//! top-k or top-p keeps are kept too, so the kept set never depends on an id order.
//! A row's token depends only on its logits, its history and its own random generator:
//! the same whatever the batch, the strategy or the thread count.

use rand::{Rng, SeedableRng, rngs::StdRng};

use super::{argmax, check_logits, validate_temperature, validate_top_p};
use crate::constraints::ConstraintState;
use crate::error::{LlamaError, Result};
use crate::kernels::attention::exp;
use crate::kernels::cpu::largest;

/// Most `logit_bias` entries a request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Largest absolute `logit_bias` value (OpenAI's range, `[-100, 100]`).
pub const MAX_BIAS: f32 = 100.0;
/// Largest absolute frequency or presence penalty (OpenAI's range, `[-2, 2]`).
pub const MAX_PENALTY: f32 = 2.0;

/// Weights per block of the draw's block sums.
const BLOCK: usize = 512;
/// Buckets of the top-p pass: one per power of two of the weight, the last for the rest.
const BUCKETS: usize = 64;

/// Every sampling control of a request. The defaults (`SamplingParams::default()`) are
/// temperature 1 and every other control off.
///
/// ```
/// use llama_burn::LlamaError;
/// use llama_burn::sampling::SamplingParams;
///
/// let params = SamplingParams { temperature: 0.8, top_k: 40, min_p: 0.05, ..Default::default() };
/// assert!(params.validate().is_ok());
/// assert!(matches!(
///     SamplingParams { top_p: 0.0, ..Default::default() }.validate(),
///     Err(LlamaError::InvalidParameter { name: "top_p", .. })
/// ));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Temperature, finite and `>= 0`; 0 (and anything below
    /// [`MIN_SAMPLED_TEMPERATURE`](super::MIN_SAMPLED_TEMPERATURE)) is greedy (the largest
    /// logit after bias, penalties and bans).
    pub temperature: f64,
    /// Keep the `top_k` largest logits (ties with the last one kept too); 0 is off.
    pub top_k: usize,
    /// Keep the most likely tokens until their mass reaches `top_p`, in `(0, 1]`; 1 is
    /// off.
    pub top_p: f64,
    /// Keep tokens at least `min_p` times as likely as the most likely one, in `[0, 1]`;
    /// 0 is off.
    pub min_p: f64,
    /// CTRL's repetition penalty over prompt and output tokens: positive logits divided,
    /// negative ones multiplied; finite and `> 0`, 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted from a logit once per time its token was generated, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Subtracted from a logit once if its token was generated, in `[-2, 2]`.
    pub presence_penalty: f32,
    /// `(token id, bias)` added to logits first; at most [`MAX_LOGIT_BIAS`] entries,
    /// values in `[-100, 100]`.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What [`Sampler::Argmax`](super::Sampler::Argmax) draws with: greedy, nothing else.
pub(crate) static GREEDY: SamplingParams = SamplingParams::GREEDY;

impl SamplingParams {
    /// The defaults: temperature 1 and every other control off (its neutral value). A
    /// new control's default goes here.
    const DEFAULT: Self = Self {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        logit_bias: Vec::new(),
    };

    /// Greedy decoding and nothing else, as a constant.
    const GREEDY: Self = {
        let mut greedy = Self::DEFAULT;
        greedy.temperature = 0.0;
        greedy
    };

    /// Greedy decoding, nothing else.
    pub fn greedy() -> Self {
        Self::GREEDY
    }

    /// Checks every value against its range.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] naming the first field out of range.
    pub fn validate(&self) -> Result<()> {
        validate_temperature(self.temperature)?;
        validate_top_p(self.top_p)?;
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(LlamaError::invalid(
                "min_p",
                self.min_p,
                "must be in [0, 1]",
            ));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(LlamaError::invalid(
                "repetition_penalty",
                self.repetition_penalty,
                "must be a finite number > 0 (1 is off)",
            ));
        }
        for (name, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return Err(LlamaError::invalid(name, value, "must be in [-2, 2]"));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(LlamaError::invalid(
                "logit_bias",
                format!("{} entries", self.logit_bias.len()),
                "at most 1024 entries",
            ));
        }
        let mut ids: Vec<u32> = self.logit_bias.iter().map(|&(id, _)| id).collect();
        ids.sort_unstable();
        if let Some(pair) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(LlamaError::invalid(
                "logit_bias",
                format!("token {} twice", pair[0]),
                "one bias per token id",
            ));
        }
        if let Some(&(_, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_BIAS..=MAX_BIAS).contains(b))
        {
            return Err(LlamaError::invalid(
                "logit_bias",
                bias,
                "values must be in [-100, 100]",
            ));
        }
        Ok(())
    }

    /// Checks the token ids of `logit_bias` against a vocabulary of `vocab` tokens.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for an id outside the vocabulary.
    pub fn validate_ids(&self, vocab: usize) -> Result<()> {
        match self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            Some((id, _)) => Err(LlamaError::invalid(
                "logit_bias",
                id,
                "token id outside the model's vocabulary",
            )),
            None => Ok(()),
        }
    }

    /// Whether the logits are modified before temperature (bias or penalties).
    pub(crate) fn modifies(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Whether a cut keeps only some tokens (top-k, top-p or min-p on): a constrained
    /// draw then masks the logits first.
    pub(crate) fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }

    /// Whether a device draw ([`DeviceDraw`](super::DeviceDraw)) applies every control
    /// that is on: only temperature, top-k, top-p and min-p may differ from their
    /// defaults. A new control is thus drawn on the host until the device draw learns it.
    pub(crate) fn is_device_drawable(&self) -> bool {
        let Self {
            temperature,
            top_k,
            top_p,
            min_p,
            ..
        } = *self;
        *self
            == Self {
                temperature,
                top_k,
                top_p,
                min_p,
                ..Self::DEFAULT
            }
    }
}

/// What the penalties and bans read: the request's tokens so far and the tokens it may
/// not draw now.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    /// The prompt's ids (read by the repetition penalty).
    pub prompt: &'a [u32],
    /// The generated ids (read by every penalty).
    pub output: &'a [u32],
    /// Ids that may not be drawn at this step (stop tokens before `min_tokens`).
    pub banned: &'a [u32],
}

/// Buffers reused from token to token (their size is the vocabulary's).
#[derive(Debug, Clone, Default)]
pub(crate) struct Scratch {
    logits: Vec<f32>,
    weights: Vec<f32>,
    blocks: Vec<f64>,
}

/// A request's sampler: its [`SamplingParams`], its seed and its own random generator.
///
/// ```
/// use llama_burn::sampling::{History, Pipeline, SamplingParams};
///
/// let params = SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() };
/// let mut a = Pipeline::new(params.clone(), 7)?;
/// let mut b = Pipeline::new(params, 7)?;
/// let logits = [0.5, 2.0, 1.0, -1.0];
/// let draw = |p: &mut Pipeline| p.sample(&logits, History::default());
/// assert_eq!(draw(&mut a)?, draw(&mut b)?);
/// assert_eq!(a.seed(), 7);
/// # Ok::<(), llama_burn::LlamaError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Pipeline {
    params: SamplingParams,
    seed: u64,
    rng: StdRng,
    scratch: Scratch,
    constraint: Option<Box<Constrained>>,
}

/// A pipeline's constraint: its state and the buffer of masked logits.
#[derive(Debug, Clone)]
struct Constrained {
    state: ConstraintState,
    masked: Vec<f32>,
}

impl Pipeline {
    /// A sampler with `params` (checked) and `seed`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] as [`SamplingParams::validate`] says.
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            seed,
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
            constraint: None,
        })
    }

    /// A sampler whose `params` were checked at the front door already (by
    /// [`GenerateRequest::validate`](crate::inference::GenerateRequest::validate), or by a
    /// method that takes the sampler and checks it once).
    pub(crate) fn unchecked(params: SamplingParams, seed: u64) -> Self {
        Self {
            params,
            seed,
            rng: StdRng::seed_from_u64(seed),
            scratch: Scratch::default(),
            constraint: None,
        }
    }

    /// Constrains what it draws to `state`'s grammar: the mask step of the pipeline
    /// (after bias, penalties and bans, before temperature), and the state advances with
    /// each token drawn. The token drawn without the mask is kept when the grammar allows
    /// it (exactly the masked distribution for greedy decoding and plain temperature
    /// sampling); with top-k, top-p or min-p on, the mask is applied first.
    #[must_use]
    pub fn with_constraint(mut self, state: ConstraintState) -> Self {
        self.constraint = Some(Box::new(Constrained {
            state,
            masked: Vec::new(),
        }));
        self
    }

    /// Its constraint's state, if it has one.
    pub fn constraint(&self) -> Option<&ConstraintState> {
        self.constraint.as_ref().map(|c| &c.state)
    }

    /// Its constraint's state, mutably (to roll it back).
    pub fn constraint_mut(&mut self) -> Option<&mut ConstraintState> {
        self.constraint.as_mut().map(|c| &mut c.state)
    }

    /// The seed it was made with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Its controls.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Its random generator (read by [`super::device`] for a draw on the device).
    pub(crate) fn rng(&self) -> &StdRng {
        &self.rng
    }

    /// Its random generator, mutably (moved on by [`super::device::commit`]).
    pub(crate) fn rng_mut(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    /// Picks the next token from `logits`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidLogits`] when the logits hold a NaN or no token can be drawn.
    /// With a constraint, [`LlamaError::ConstraintFailed`] when its step fails.
    pub fn sample(&mut self, logits: &[f32], history: History<'_>) -> Result<u32> {
        let Some(constrained) = self.constraint.as_mut() else {
            return sample(
                &self.params,
                logits,
                history,
                &mut self.rng,
                &mut self.scratch,
            );
        };
        let params = &self.params;
        if !params.truncates() {
            // The sampled token first: kept when the grammar allows it.
            let token = sample(params, logits, history, &mut self.rng, &mut self.scratch)?;
            if constrained.state.try_accept(token)? {
                return Ok(token);
            }
        }
        constrained.state.mask(logits, &mut constrained.masked)?;
        let token = sample(
            params,
            &constrained.masked,
            history,
            &mut self.rng,
            &mut self.scratch,
        )?;
        constrained.state.accept(token)?;
        Ok(token)
    }
}

/// The pipeline on one row: `params` over `logits`, drawing from `rng`.
pub(crate) fn sample(
    params: &SamplingParams,
    logits: &[f32],
    history: History<'_>,
    rng: &mut StdRng,
    scratch: &mut Scratch,
) -> Result<u32> {
    if logits.is_empty() {
        return Err(LlamaError::invalid("logits", "[]", "must not be empty"));
    }
    let modified = params.modifies() || !history.banned.is_empty();
    // The sampled path without modifications checks for NaN in its weight pass instead of
    // a pass of its own.
    if modified || super::greedy_at(params.temperature) {
        check_logits(logits)?;
    }
    let work: &[f32] = if modified {
        modify(params, logits, history, &mut scratch.logits);
        check_logits(&scratch.logits)?;
        &scratch.logits
    } else {
        logits
    };
    if super::greedy_at(params.temperature) {
        return Ok(argmax(work));
    }
    let u: f64 = rng.random();
    let max = largest(work);
    if max.is_infinite() {
        check_logits(work)?;
    }
    if max == f32::INFINITY {
        // The softmax's limit: the `+inf` tokens share all the mass evenly.
        let n = work.iter().filter(|&&l| l == f32::INFINITY).count();
        let k = ((u * n as f64) as usize).min(n - 1);
        return work
            .iter()
            .enumerate()
            .filter(|&(_, &l)| l == f32::INFINITY)
            .nth(k)
            .map(|(i, _)| i as u32)
            .ok_or_else(|| LlamaError::InvalidLogits("no +inf logit after all".into()));
    }
    let threshold = match params.top_k {
        k if k > 0 && k < work.len() => kth_largest(work, k, &mut scratch.weights),
        _ => f32::NEG_INFINITY,
    };
    let inv_t = (1.0 / params.temperature) as f32;
    let nan = weights(
        work,
        max,
        inv_t,
        threshold,
        &mut scratch.weights,
        &mut scratch.blocks,
    );
    if nan {
        // The check names the NaN.
        check_logits(work)?;
    }
    let weights = &mut scratch.weights;
    let mut cut = 0.0f32;
    if params.top_p < 1.0 {
        cut = nucleus_cut(weights, params.top_p);
    }
    if params.min_p > 0.0 {
        // The largest weight is exactly 1 (`exp(0)`), so min-p is a weight threshold.
        cut = cut.max(params.min_p as f32);
    }
    if cut > 0.0 {
        apply_cut(weights, cut, &mut scratch.blocks);
    }
    draw(weights, &scratch.blocks, u)
}

/// Copies `logits` into `out` with the bias, the penalties and the bans applied.
fn modify(params: &SamplingParams, logits: &[f32], history: History<'_>, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(logits);
    for &(id, bias) in &params.logit_bias {
        if let Some(l) = out.get_mut(id as usize) {
            *l += bias;
        }
    }
    if params.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = history
            .prompt
            .iter()
            .chain(history.output)
            .copied()
            .collect();
        seen.sort_unstable();
        seen.dedup();
        let p = params.repetition_penalty;
        for id in seen {
            if let Some(l) = out.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut generated = history.output.to_vec();
        generated.sort_unstable();
        for run in generated.chunk_by(|a, b| a == b) {
            if let Some(l) = out.get_mut(run[0] as usize) {
                *l -= params.frequency_penalty * run.len() as f32 + params.presence_penalty;
            }
        }
    }
    for &id in history.banned {
        if let Some(l) = out.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// The `k`-th largest value of `values` (`0 < k < len`), using `buffer` as room.
fn kth_largest(values: &[f32], k: usize, buffer: &mut Vec<f32>) -> f32 {
    buffer.clear();
    buffer.extend_from_slice(values);
    let (_, kth, _) = buffer.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    *kth
}

/// `out[i] = e^((l_i - max) * inv_t)` for logits at or above `threshold`, else 0
/// (`-inf` logits always 0), and the sums of `out` per block of [`BLOCK`] in `blocks`.
/// Returns whether a logit is NaN.
fn weights(
    logits: &[f32],
    max: f32,
    inv_t: f32,
    threshold: f32,
    out: &mut Vec<f32>,
    blocks: &mut Vec<f64>,
) -> bool {
    out.clear();
    out.resize(logits.len(), 0.0);
    blocks.clear();
    blocks.resize(logits.len().div_ceil(BLOCK), 0.0);
    #[cfg(target_arch = "x86_64")]
    match crate::kernels::SimdPath::active() {
        crate::kernels::SimdPath::Avx512 => {
            // SAFETY: `active` picks a path only on CPUs that have its features.
            return unsafe { weights_avx512(logits, max, inv_t, threshold, out, blocks) };
        }
        crate::kernels::SimdPath::Avx2 => {
            // SAFETY: `active` picks a path only on CPUs that have its features.
            return unsafe { weights_avx2(logits, max, inv_t, threshold, out, blocks) };
        }
        _ => {}
    }
    weights_body(logits, max, inv_t, threshold, out, blocks)
}

/// [`weights_body`] compiled for AVX2 (8 lanes; plain multiplies and adds, no FMA, so
/// the same bits as every other path).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn weights_avx2(
    logits: &[f32],
    max: f32,
    inv_t: f32,
    threshold: f32,
    out: &mut [f32],
    blocks: &mut [f64],
) -> bool {
    weights_body(logits, max, inv_t, threshold, out, blocks)
}

/// [`weights_body`] compiled for AVX-512 (16 lanes; the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn weights_avx512(
    logits: &[f32],
    max: f32,
    inv_t: f32,
    threshold: f32,
    out: &mut [f32],
    blocks: &mut [f64],
) -> bool {
    weights_body(logits, max, inv_t, threshold, out, blocks)
}

/// The weights and block sums, in 16 lanes the compiler vectorizes.
#[inline(always)]
fn weights_body(
    logits: &[f32],
    max: f32,
    inv_t: f32,
    threshold: f32,
    out: &mut [f32],
    blocks: &mut [f64],
) -> bool {
    let mut nan = [false; 16];
    let weight = |l: f32| {
        let e = exp((l - max) * inv_t);
        if l >= threshold && l > f32::NEG_INFINITY {
            e
        } else {
            0.0
        }
    };
    for ((src, dst), sum) in logits.chunks(BLOCK).zip(out.chunks_mut(BLOCK)).zip(blocks) {
        let mut lanes = [0f32; 16];
        let mut whole = src.chunks_exact(16).zip(dst.chunks_exact_mut(16));
        for (l, w) in &mut whole {
            for i in 0..16 {
                w[i] = weight(l[i]);
                lanes[i] += w[i];
                nan[i] |= l[i].is_nan();
            }
        }
        let done = src.len() / 16 * 16;
        for (i, (&l, w)) in src[done..].iter().zip(&mut dst[done..]).enumerate() {
            *w = weight(l);
            lanes[i] += *w;
            nan[i] |= l.is_nan();
        }
        *sum = lanes.iter().map(|&s| f64::from(s)).sum();
    }
    nan.contains(&true)
}

/// Zeroes the weights below `cut` and sums each block again.
fn apply_cut(weights: &mut [f32], cut: f32, blocks: &mut [f64]) {
    for (block, sum) in weights.chunks_mut(BLOCK).zip(blocks) {
        let mut lanes = [0f32; 16];
        for chunk in block.chunks_mut(16) {
            for (i, w) in chunk.iter_mut().enumerate() {
                *w = if *w >= cut { *w } else { 0.0 };
                lanes[i] += *w;
            }
        }
        *sum = lanes.iter().map(|&s| f64::from(s)).sum();
    }
}

/// The smallest weight the nucleus keeps: the largest weights, in decreasing order,
/// until their sum reaches `top_p` of the total. Sums the mass per power of two of the
/// weight (one pass), then sorts only the bucket where the mass reaches `top_p`.
fn nucleus_cut(weights: &[f32], top_p: f64) -> f32 {
    let mut mass = [0f64; BUCKETS];
    let bucket = |w: f32| -> usize {
        // Weights are in (0, 1]: 1 is bucket 0, [1/2, 1) bucket 1, [1/4, 1/2) bucket 2, ...
        let exponent = ((w.to_bits() >> 23) & 0xff) as i32 - 127;
        (-exponent).clamp(0, BUCKETS as i32 - 1) as usize
    };
    for &w in weights {
        if w > 0.0 {
            mass[bucket(w)] += f64::from(w);
        }
    }
    let total: f64 = mass.iter().sum();
    let target = top_p * total;
    let mut before = 0.0;
    let Some(b) = mass.iter().position(|&m| {
        before += m;
        before >= target
    }) else {
        return 0.0;
    };
    let mut cumulative = before - mass[b];
    let mut members: Vec<f32> = weights
        .iter()
        .copied()
        .filter(|&w| w > 0.0 && bucket(w) == b)
        .collect();
    members.sort_unstable_by(|a, b| b.total_cmp(a));
    for &w in &members {
        cumulative += f64::from(w);
        if cumulative >= target {
            return w;
        }
    }
    members.last().copied().unwrap_or(0.0)
}

/// The token whose interval (weights in id order) holds `u` of the total: finds the
/// block from the block sums, then walks it.
fn draw(weights: &[f32], blocks: &[f64], u: f64) -> Result<u32> {
    let total: f64 = blocks.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return Err(LlamaError::InvalidLogits(
            "no token has a probability above 0".into(),
        ));
    }
    let mut r = u * total;
    let mut start = blocks.len();
    for (b, &s) in blocks.iter().enumerate() {
        if r < s {
            start = b;
            break;
        }
        r -= s;
    }
    // Rounding can leave `r` just past a block's own walk: go on to the next ones.
    let mut last = None;
    for (i, &w) in weights
        .iter()
        .enumerate()
        .skip(start.min(blocks.len()) * BLOCK)
    {
        if w > 0.0 {
            last = Some(i);
            let w = f64::from(w);
            if r < w {
                return Ok(i as u32);
            }
            r -= w;
        }
    }
    last.or_else(|| weights.iter().rposition(|&w| w > 0.0))
        .map(|i| i as u32)
        .ok_or_else(|| LlamaError::InvalidLogits("no token has a probability above 0".into()))
}

/// The exact distribution a [`Pipeline`] with `params` samples from (no bias, penalties
/// or constraints), in f64, by its definition: a full sort, softmax at temperature, top-k
/// (ties at the cut kept), top-p over the renormalized top-k, min-p. A reference for
/// tests of this pipeline and of other samplers (the GPU kernel's); `params.temperature`
/// must be above 0. No logits give an empty distribution.
pub fn reference_distribution(params: &SamplingParams, logits: &[f32]) -> Vec<f64> {
    if logits.is_empty() {
        return Vec::new();
    }
    let t = params.temperature;
    let z: Vec<f64> = logits.iter().map(|&l| f64::from(l) / t).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let mut keep = vec![true; z.len()];
    if params.top_k > 0 && params.top_k < z.len() {
        let kth = z[order[params.top_k - 1]];
        keep.iter_mut().zip(&z).for_each(|(k, &v)| *k &= v >= kth);
    }
    let max = z[order[0]];
    let softmax = |keep: &[bool]| -> Vec<f64> {
        let w: Vec<f64> = z
            .iter()
            .zip(keep)
            .map(|(&v, &k)| if k { (v - max).exp() } else { 0.0 })
            .collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|w| w / total).collect()
    };
    if params.top_p < 1.0 {
        let p = softmax(&keep);
        let mut mass = 0.0;
        let mut cut = 0.0;
        for &i in order.iter().filter(|&&i| keep[i]) {
            mass += p[i];
            cut = p[i];
            if mass >= params.top_p {
                break;
            }
        }
        keep.iter_mut().zip(&p).for_each(|(k, &v)| *k &= v >= cut);
    }
    if params.min_p > 0.0 {
        let p = softmax(&keep);
        let top = p.iter().copied().fold(0.0, f64::max);
        keep.iter_mut()
            .zip(&p)
            .for_each(|(k, &v)| *k &= v >= params.min_p * top);
    }
    softmax(&keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws `n` tokens and checks their counts against `expected` with a chi-square test
    /// at the 0.1% level (a seeded test: it fails only if the distribution is wrong); a
    /// token of probability 0 must never be drawn.
    fn chi_square(params: SamplingParams, logits: &[f32], n: usize) {
        let expected = reference_distribution(&params, logits);
        let mut pipeline = Pipeline::new(params.clone(), 12345).unwrap();
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[pipeline.sample(logits, History::default()).unwrap() as usize] += 1;
        }
        let mut statistic = 0.0;
        let mut df = 0usize;
        for (i, (&c, &p)) in counts.iter().zip(&expected).enumerate() {
            if p == 0.0 {
                assert_eq!(c, 0, "token {i} drawn {c} times but excluded ({params:?})");
                continue;
            }
            let e = p * n as f64;
            statistic += (c as f64 - e).powi(2) / e;
            df += 1;
        }
        let df = (df - 1).max(1) as f64;
        // Wilson-Hilferty: the chi-square quantile at 0.999 (z = 3.09).
        let a = 2.0 / (9.0 * df);
        let critical = df * (1.0 - a + 3.09 * a.sqrt()).powi(3);
        assert!(
            statistic < critical,
            "chi-square {statistic:.1} >= {critical:.1} (df {df}) for {params:?}: {counts:?}"
        );
    }

    fn logits() -> Vec<f32> {
        // Distinct values, no ties, boundaries far from every cut used below.
        vec![
            2.0, -1.0, 0.5, 3.1, -2.0, 1.2, 0.0, 2.6, -0.5, 1.7, -3.0, 0.9, 1.4, -1.5, 2.2, 0.3,
        ]
    }

    #[test]
    fn draws_follow_the_exact_distribution() {
        let base = SamplingParams::default;
        let cases = [
            SamplingParams {
                temperature: 1.0,
                ..base()
            },
            SamplingParams {
                temperature: 0.6,
                ..base()
            },
            SamplingParams {
                temperature: 1.7,
                ..base()
            },
            SamplingParams { top_k: 4, ..base() },
            SamplingParams {
                top_p: 0.8,
                ..base()
            },
            SamplingParams {
                min_p: 0.2,
                ..base()
            },
            SamplingParams {
                temperature: 1.3,
                top_k: 9,
                top_p: 0.9,
                min_p: 0.05,
                ..base()
            },
            SamplingParams {
                temperature: 0.8,
                top_k: 6,
                min_p: 0.1,
                ..base()
            },
        ];
        for params in cases {
            chi_square(params, &logits(), 40_000);
        }
    }

    #[test]
    fn a_large_vocabulary_draws_right_too() {
        // Several blocks of the draw's block sums, and many buckets of the nucleus pass.
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.004)
            .collect();
        let mut coarse = logits.clone();
        // 50 groups of 100 tokens, tested on group counts.
        for (i, l) in coarse.iter_mut().enumerate() {
            *l = (i / 100) as f32 * 0.05;
        }
        chi_square(SamplingParams::default(), &coarse, 20_000);
        chi_square(
            SamplingParams {
                top_p: 0.5,
                ..Default::default()
            },
            &coarse,
            20_000,
        );
        // The nucleus of the varied row is exactly the reference's.
        let params = SamplingParams {
            top_p: 0.3,
            ..Default::default()
        };
        let expected = reference_distribution(&params, &logits);
        let mut pipeline = Pipeline::new(params, 3).unwrap();
        for _ in 0..2000 {
            let t = pipeline.sample(&logits, History::default()).unwrap();
            assert!(expected[t as usize] > 0.0);
        }
    }

    #[test]
    fn penalties_and_bias_follow_their_definitions() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            logit_bias: vec![(0, 1.0), (5, -100.0)],
            ..Default::default()
        };
        let logits = [1.0, 2.0, -1.0, 4.0, 0.5, 3.0];
        let history = History {
            prompt: &[1, 2],
            output: &[3, 3, 2, 9],
            banned: &[4],
        };
        let mut out = Vec::new();
        modify(&params, &logits, history, &mut out);
        // 0: bias only. 1: prompt -> /2. 2: prompt and output once: *2, then -0.5 - 0.25.
        // 3: output twice: /2, then -1.0 - 0.25. 4: banned. 5: bias -100.
        assert_eq!(out, [2.0, 1.0, -2.75, 0.75, f32::NEG_INFINITY, -97.0]);
        // Greedy reads the modified logits: a +100 bias forces a token, a ban excludes it.
        let mut greedy = Pipeline::new(
            SamplingParams {
                logit_bias: vec![(2, 100.0)],
                ..SamplingParams::greedy()
            },
            0,
        )
        .unwrap();
        assert_eq!(greedy.sample(&logits, History::default()).unwrap(), 2);
        let banned = History {
            banned: &[2, 3],
            ..History::default()
        };
        assert_eq!(greedy.sample(&logits, banned).unwrap(), 5);
        // A -100 bias is never drawn at temperature 1.
        let mut sampled = Pipeline::new(
            SamplingParams {
                logit_bias: vec![(3, -100.0)],
                ..Default::default()
            },
            1,
        )
        .unwrap();
        for _ in 0..2000 {
            assert_ne!(sampled.sample(&logits, History::default()).unwrap(), 3);
        }
        // A NaN logit is an error at every temperature, with or without modifications.
        let mut nan = logits;
        nan[4] = f32::NAN;
        let mut plain = Pipeline::new(SamplingParams::default(), 2).unwrap();
        assert!(matches!(
            plain.sample(&nan, History::default()),
            Err(LlamaError::InvalidLogits(_))
        ));
        assert!(matches!(
            sampled.sample(&nan, History::default()),
            Err(LlamaError::InvalidLogits(_))
        ));
        // Everything banned is an error, not a panic.
        let all = History {
            banned: &[0, 1, 2, 3, 4, 5],
            ..History::default()
        };
        assert!(matches!(
            greedy.sample(&logits, all),
            Err(LlamaError::InvalidLogits(_))
        ));
    }

    #[test]
    fn one_bias_per_token() {
        // Two entries for one token would add up past the +-100 limit.
        let twice = SamplingParams {
            logit_bias: vec![(1, 100.0), (4, 1.0), (1, 100.0)],
            ..Default::default()
        };
        assert!(matches!(
            twice.validate(),
            Err(LlamaError::InvalidParameter { name: "logit_bias", value, .. })
                if value == "token 1 twice"
        ));
        let once = SamplingParams {
            logit_bias: vec![(1, 100.0), (4, 1.0)],
            ..Default::default()
        };
        once.validate().unwrap();
    }

    #[test]
    fn temperatures_too_small_to_invert_draw_the_greedy_token() {
        // 1e-300's inverse overflows f32: every weight was NaN and the draw an error
        // (a 500 from the server). Below MIN_SAMPLED_TEMPERATURE the draw is greedy.
        let logits = logits();
        let greedy = argmax(&logits);
        for t in [1e-300, f64::MIN_POSITIVE, 1e-39, 1e-6, 0.0] {
            let params = SamplingParams {
                temperature: t,
                ..Default::default()
            };
            params.validate().unwrap();
            let mut pipeline = Pipeline::new(params, 7).unwrap();
            for _ in 0..50 {
                assert_eq!(
                    pipeline.sample(&logits, History::default()).unwrap(),
                    greedy,
                    "temperature {t}"
                );
            }
        }
        // At the threshold the draw samples (and reads the generator).
        assert!(!super::super::greedy_at(
            super::super::MIN_SAMPLED_TEMPERATURE
        ));
    }

    #[test]
    fn the_defaults_are_temperature_1_and_every_other_control_off() {
        let off = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
        };
        assert_eq!(SamplingParams::default(), off);
        assert!(!off.modifies());
        assert_eq!(
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.0,
                ..off
            }
        );
    }

    #[test]
    fn only_the_device_draws_controls_may_be_on_for_a_device_draw() {
        let base = SamplingParams::default;
        let drawable = [
            base(),
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                ..base()
            },
        ];
        assert!(drawable.iter().all(SamplingParams::is_device_drawable));
        let host_only = [
            SamplingParams {
                repetition_penalty: 1.1,
                ..base()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..base()
            },
            SamplingParams {
                presence_penalty: -0.5,
                ..base()
            },
            SamplingParams {
                logit_bias: vec![(1, 0.0)],
                ..base()
            },
        ];
        for params in host_only {
            assert!(
                params.modifies() && !params.is_device_drawable(),
                "{params:?}"
            );
        }
    }

    #[test]
    fn the_spec_samplers_are_the_pipeline() {
        let logits = logits();
        let mut top_p = super::super::Sampler::TopP(super::super::TopP::new(0.8, 9));
        let mut pipeline = Pipeline::new(
            SamplingParams {
                temperature: 0.7,
                top_p: 0.8,
                ..Default::default()
            },
            9,
        )
        .unwrap();
        for _ in 0..200 {
            assert_eq!(
                top_p.sample(&logits, 0.7).unwrap(),
                pipeline.sample(&logits, History::default()).unwrap()
            );
        }
    }
}
