//! Sampling on the device: which rows may be drawn where their logits are, and what such
//! a row sends there.
//!
//! A row may be drawn on the device
//! ([`LlamaBackend::sample_tokens`](crate::backend::LlamaBackend::sample_tokens)) when its
//! draw is the [`pipeline`](super::pipeline)'s temperature, top-k, top-p and min-p steps
//! alone (temperature 0 included: the greedy token): no logit bias, penalty, ban,
//! constraint or speculation (a speculating request is drawn on the host at every step,
//! so that where it is drawn never depends on the batch's plan), and at most
//! [`MAX_DEVICE_TOP_LOGPROBS`] alternatives asked for. Everything else, and any row the device cannot draw (a NaN, a
//! `+inf` or no finite logit), is sampled on the host.
//!
//! The random number stays on the host: [`DeviceDraw::uniform`] is the number the row's
//! own generator would give the host pipeline for this draw, read from a copy of the
//! generator; `commit` moves the generator on once the device's token is taken. A
//! request's random stream is then the same whichever side draws its tokens. The device
//! computes its weights in its own float arithmetic, so its token is the host's except
//! where the uniform lies within rounding of an interval's boundary, and its
//! log-probability is the host's to about `1e-5`.

use rand::{Rng, rngs::StdRng};

use super::Sampler;

/// Most `top_logprobs` alternatives a row drawn on the device may ask for: the chosen
/// token's log-probability only.
pub const MAX_DEVICE_TOP_LOGPROBS: usize = 0;

/// One row's draw on the device: the controls of the host pipeline's cut and draw, and
/// the row's uniform.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceDraw {
    /// The temperature (finite, `>= 0`); 0 draws the greedy token (the first index of the
    /// largest logit) and reads no random number.
    pub temperature: f64,
    /// Keep the `top_k` largest logits (ties with the last one kept too); 0 is off.
    pub top_k: usize,
    /// Keep the most likely tokens until their mass reaches `top_p`; 1 is off.
    pub top_p: f64,
    /// Keep tokens at least `min_p` times as likely as the most likely one; 0 is off.
    pub min_p: f64,
    /// The uniform in `[0, 1)` the draw reads (ignored at temperature 0).
    pub uniform: f64,
}

impl DeviceDraw {
    /// Words per row of [`words`](Self::words).
    pub const WORDS: usize = 6;

    /// The draw as the device kernel reads it: greedy (1) or not (0), the uniform, the
    /// inverse temperature as the host pipeline computes it, top-k (clamped to `vocab`),
    /// top-p and min-p; the floats as their `f32` bits.
    pub fn words(&self, vocab: usize) -> [i32; Self::WORDS] {
        let bits = |v: f32| v.to_bits() as i32;
        // The largest f32 below 1: the uniform must stay below 1 once rounded.
        let uniform = (self.uniform as f32)
            .min(f32::from_bits(0x3f7f_ffff))
            .max(0.0);
        let inv_t = if self.is_sampled() {
            (1.0 / self.temperature) as f32
        } else {
            1.0
        };
        let top_k = if self.top_k > 0 && self.top_k < vocab {
            self.top_k
        } else {
            0
        };
        [
            i32::from(!self.is_sampled()),
            bits(uniform),
            bits(inv_t),
            i32::try_from(top_k).unwrap_or(0),
            bits(if self.top_p < 1.0 {
                self.top_p as f32
            } else {
                1.0
            }),
            bits(self.min_p as f32),
        ]
    }

    /// Whether the draw reads a random number (temperature at or above
    /// [`MIN_SAMPLED_TEMPERATURE`](super::MIN_SAMPLED_TEMPERATURE)).
    pub fn is_sampled(&self) -> bool {
        !super::greedy_at(self.temperature)
    }
}

/// A token drawn on the device and its raw log-probability (the model's log-softmax, as
/// [`token_logprobs`](super::token_logprobs) computes it on the host).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceToken {
    /// The token's id.
    pub token: u32,
    /// Its log-probability (`<= 0`).
    pub logprob: f32,
}

/// The device draw of a row sampled by `sampler` (as [`Sampler::params`] says; checked
/// at the front door), where `banned` says whether tokens are banned at this step and
/// `top_logprobs` is the request's `logprobs`; `None` where the row must be sampled on
/// the host. Reads the row's uniform from a copy of its generator: the sampler is not
/// moved on (see [`commit`]).
pub(crate) fn device_draw(
    sampler: &Sampler,
    banned: bool,
    top_logprobs: Option<usize>,
) -> Option<DeviceDraw> {
    let params = sampler.params();
    if banned
        || top_logprobs.is_some_and(|n| n > MAX_DEVICE_TOP_LOGPROBS)
        || sampler.constraint().is_some()
        || !params.is_device_drawable()
    {
        return None;
    }
    Some(DeviceDraw {
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        uniform: sampler.rng().map_or(0.0, peek),
    })
}

/// Moves `sampler`'s generator on as the host pipeline's draw of `draw` would (one
/// uniform when it is sampled): call it once the device's token is taken.
pub(crate) fn commit(sampler: &mut Sampler, draw: &DeviceDraw) {
    if !draw.is_sampled() {
        return;
    }
    if let Some(rng) = sampler.rng_mut() {
        let _: f64 = rng.random();
    }
}

/// The uniform the host pipeline draws first from `rng` ([`super::pipeline`]'s `sample`),
/// without moving `rng` on.
fn peek(rng: &StdRng) -> f64 {
    rng.clone().random()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{History, Pipeline, SamplingParams};

    #[test]
    fn the_device_draw_reads_the_host_pipelines_uniform() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..Default::default()
        };
        let mut device = Sampler::Pipeline(Pipeline::new(params.clone(), 11).unwrap());
        let mut host = Pipeline::new(params, 11).unwrap();
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut same_rng = StdRng::clone(host.rng());
        for _ in 0..5 {
            let draw = device_draw(&device, false, None).unwrap();
            assert_eq!(draw.uniform, same_rng.random::<f64>());
            assert_eq!(draw, device_draw(&device, false, None).unwrap());
            commit(&mut device, &draw);
            host.sample(&logits, History::default()).unwrap();
            let Sampler::Pipeline(p) = &device else {
                unreachable!()
            };
            assert_eq!(
                p.rng().clone().random::<u64>(),
                host.rng().clone().random::<u64>()
            );
        }
        // What the device does not draw stays on the host.
        assert!(device_draw(&device, true, None).is_none());
        assert!(device_draw(&device, false, Some(1)).is_none());
        assert!(device_draw(&device, false, Some(0)).is_some());
        let biased = SamplingParams {
            logit_bias: vec![(1, 1.0)],
            ..Default::default()
        };
        let biased = Sampler::Pipeline(Pipeline::new(biased, 1).unwrap());
        assert!(device_draw(&biased, false, None).is_none());
        let penalized = SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::greedy()
        };
        let penalized = Sampler::Pipeline(Pipeline::new(penalized, 1).unwrap());
        assert!(device_draw(&penalized, false, None).is_none());
        let greedy = device_draw(&Sampler::Argmax, false, None).unwrap();
        assert!(!greedy.is_sampled());
        // A spec sampler draws at the temperature its front door made its own.
        let mut top_p = Sampler::TopP(crate::sampling::TopP::new(0.9, 3));
        top_p.bind(0.8).unwrap();
        let draw = device_draw(&top_p, false, None).unwrap();
        assert_eq!((draw.temperature, draw.top_p, draw.top_k), (0.8, 0.9, 0));
    }
}
