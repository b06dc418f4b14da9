//! Speculative decoding: proposers guess the next tokens of a request, the target model
//! checks them all in one forward pass.
//!
//! A decoding step reads every weight once whatever the number of positions it runs, so
//! a step that scores the last accepted token plus `k` proposed ones costs little more
//! than a one-token step, and yields up to `k + 1` tokens.
//!
//! **Exact results.** The crate's kernels are batch-invariant: the verifying pass
//! computes each position's logits bitwise as a one-token decode step would
//! (`tests/integration/speculative.rs` checks it in every precision). Every proposer here is
//! deterministic (its proposal is a point mass), so verification is the standard
//! rejection rule in its simplest form: at each position the request's own sampler draws
//! a token from the target's logits, with the request's random generator, exactly as it
//! would without speculation; the proposed token is accepted when the draw equals it
//! (probability `p_target(t)`), and otherwise the drawn token is the correction (a draw
//! from `p_target` given that it is not `t`: the residual distribution). Verification
//! stops at the first mismatch, and the token drawn there (or after the last accepted
//! proposal, the bonus token) is emitted. One draw per emitted token, each from the same
//! logits and generator state as without speculation: a request's tokens and
//! log-probabilities are the same with speculation and without it, greedy or sampled,
//! for any seed.
//!
//! - [`Proposer`]: the trait; [`NGramProposer`] (prompt lookup: match the last tokens
//!   in the request's prompt and output, propose what followed) and [`DraftModel`] (a
//!   smaller model of the family, greedy).
//! - [`DraftLength`]: `k` follows the acceptance rate, up to the configured maximum.
//! - [`allocate`]: how many proposals a step verifies, by a cost model of the step and
//!   each row's [`Acceptance`] rate (one row: those likely enough to pay; a full batch:
//!   only near-certain ones).
//! - [`verify`]: the acceptance loop, shared by the sequential path
//!   ([`Llama::generate`](crate::Llama::generate) with
//!   [`Llama::with_speculation`](crate::Llama::with_speculation))
//!   and the continuous engine.

mod budget;
mod draft;
mod ngram;

use std::str::FromStr;

pub use budget::{Acceptance, Candidate, DEFAULT_STEP_OVERHEAD, allocate};
pub use draft::DraftModel;
pub use ngram::NGramProposer;

use crate::error::{LlamaError, Result};

/// Most tokens one verification step may propose.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Longest n-gram [`NGramProposer`] may match.
pub const MAX_NGRAM: usize = 8;

/// Proposes the next tokens of a request.
///
/// A proposer sees the request's whole token history (prompt, then the tokens
/// generated so far; the last one is the token the next step feeds) and returns at most
/// `k` tokens it expects to follow. Proposals only decide the speed: verification keeps
/// the target model's tokens whatever is proposed.
pub trait Proposer: Send {
    /// Appends at most `k` proposed tokens after `history` to `out` (none when it has no
    /// guess).
    ///
    /// # Errors
    ///
    /// A proposer that runs a model fails as its forward pass does.
    fn propose(&mut self, history: &[u32], k: usize, out: &mut Vec<u32>) -> Result<()>;

    /// Learns how many of the `proposed` tokens were accepted (the default ignores it).
    fn observe(&mut self, proposed: usize, accepted: usize) {
        let _ = (proposed, accepted);
    }
}

/// Where proposals come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeculationMethod {
    /// Prompt lookup: the tokens that followed the last n-gram's latest earlier
    /// occurrence in the prompt and output ([`NGramProposer`]).
    NGram,
    /// The draft model the [`Llama`](crate::Llama) or engine holds
    /// ([`Llama::set_draft_model`](crate::Llama::set_draft_model)).
    DraftModel,
}

impl FromStr for SpeculationMethod {
    type Err = LlamaError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ngram" => Ok(Self::NGram),
            "draft" | "draft-model" | "draft_model" => Ok(Self::DraftModel),
            _ => Err(LlamaError::invalid(
                "speculative",
                s,
                "expected \"ngram\" or \"draft\"",
            )),
        }
    }
}

impl std::fmt::Display for SpeculationMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NGram => "ngram",
            Self::DraftModel => "draft",
        })
    }
}

/// A request's speculative decoding settings
/// ([`GenerateRequest::with_speculation`](crate::inference::GenerateRequest::with_speculation)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculationConfig {
    /// Where proposals come from.
    pub method: SpeculationMethod,
    /// Most tokens proposed per step (`1..=16`); the step's `k` adapts below it.
    pub max_draft_tokens: usize,
    /// Longest n-gram matched ([`SpeculationMethod::NGram`]).
    pub ngram_max: usize,
    /// Shortest n-gram matched ([`SpeculationMethod::NGram`]).
    pub ngram_min: usize,
    /// The fixed cost of one forward step, in units of one more position in it (see
    /// [`allocate`]): proposals are verified only while they are expected to raise the
    /// step's tokens per unit of cost. [`DEFAULT_STEP_OVERHEAD`] (2) fits the demo model
    /// on a CPU, where a step's cost grows fast with its positions; where a step is
    /// bound by reading the weights (a GPU, a large model at few rows) it is larger
    /// (16-64); `u32::MAX` verifies every proposal.
    pub step_overhead: u32,
}

impl SpeculationConfig {
    /// Prompt-lookup speculation proposing up to `max_draft_tokens` per step, matching
    /// n-grams of 3 down to 2 tokens.
    pub fn ngram(max_draft_tokens: usize) -> Self {
        Self {
            method: SpeculationMethod::NGram,
            max_draft_tokens,
            ngram_max: 3,
            ngram_min: 2,
            step_overhead: DEFAULT_STEP_OVERHEAD,
        }
    }

    /// Draft-model speculation proposing up to `max_draft_tokens` per step.
    pub fn draft_model(max_draft_tokens: usize) -> Self {
        Self {
            method: SpeculationMethod::DraftModel,
            ..Self::ngram(max_draft_tokens)
        }
    }

    /// The same settings with n-grams of `min..=max` tokens matched.
    pub fn with_ngram_range(mut self, min: usize, max: usize) -> Self {
        self.ngram_min = min;
        self.ngram_max = max;
        self
    }

    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for `max_draft_tokens` outside `1..=16` or an
    /// n-gram range outside `1..=8`.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.max_draft_tokens) {
            return Err(LlamaError::invalid(
                "draft_tokens",
                self.max_draft_tokens,
                "must be in [1, 16]",
            ));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > MAX_NGRAM {
            return Err(LlamaError::invalid(
                "ngram",
                format!("{}..={}", self.ngram_min, self.ngram_max),
                "needs 1 <= min <= max <= 8",
            ));
        }
        Ok(())
    }
}

/// Proposed and accepted tokens of a request (or of an engine, summed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Tokens proposed and verified (vLLM's `spec_decode_num_draft_tokens`).
    pub draft_tokens: u64,
    /// Proposed tokens accepted (vLLM's `spec_decode_num_accepted_tokens`).
    pub accepted_draft_tokens: u64,
    /// Verification steps (steps that proposed at least one token).
    pub drafts: u64,
}

impl SpeculationStats {
    /// Accepted over proposed tokens (0 before any proposal).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_draft_tokens as f64 / self.draft_tokens as f64
        }
    }

    /// Adds one verification of `proposed` tokens of which `accepted` were accepted.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed > 0 {
            self.drafts += 1;
            self.draft_tokens += proposed as u64;
            self.accepted_draft_tokens += accepted as u64;
        }
    }
}

/// How many tokens to propose next: grows while proposals are accepted (doubling, up to
/// the maximum), falls to one past the accepted ones (at most by half) on a partial
/// miss, and after
/// proposals that were wholly rejected, pauses (1, 2, 4 then 8 steps without proposing)
/// before trying one token again, so a request whose proposals miss decodes at nearly
/// its plain speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftLength {
    max: usize,
    k: usize,
    misses: u32,
    wait: u32,
}

/// Longest pause after proposals that missed, in steps.
const MAX_WAIT: u32 = 8;

impl DraftLength {
    /// Starts at `max` (at least 1).
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            k: max,
            misses: 0,
            wait: 0,
        }
    }

    /// Tokens to propose at this step (0: pausing); counts the step.
    pub fn take(&mut self) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            0
        } else {
            self.k
        }
    }

    /// Learns the outcome of a proposal of `proposed` tokens.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if accepted >= proposed {
            self.misses = 0;
            self.k = (self.k * 2).clamp(1, self.max);
        } else if accepted == 0 {
            self.k = 1;
            self.wait = (1u32 << self.misses.min(3)).min(MAX_WAIT);
            self.misses += 1;
        } else {
            // A miss inside a run of accepted tokens (an edit in a copy) rarely ends the
            // run: halve at most.
            self.misses = 0;
            self.k = (accepted + 1).max(self.k / 2).min(self.max);
        }
    }
}

/// A request's speculation: its proposer, its adaptive draft length and its counts.
pub struct Speculator {
    proposer: Box<dyn Proposer>,
    length: DraftLength,
    stats: SpeculationStats,
    /// The history handed to the proposer (prompt and output), reused between steps.
    history: Vec<u32>,
    /// How often proposals are accepted lately.
    acceptance: Acceptance,
    /// [`SpeculationConfig::step_overhead`].
    overhead: f64,
}

impl std::fmt::Debug for Speculator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculator")
            .field("length", &self.length)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Speculator {
    /// Speculation with `proposer`, proposing at most `max_draft_tokens` per step, as
    /// many of them as pay at one row for a step of fixed cost `step_overhead`
    /// ([`SpeculationConfig::step_overhead`]).
    pub fn new(proposer: Box<dyn Proposer>, max_draft_tokens: usize, step_overhead: u32) -> Self {
        Self {
            proposer,
            length: DraftLength::new(max_draft_tokens.min(MAX_DRAFT_TOKENS)),
            stats: SpeculationStats::default(),
            history: Vec::new(),
            acceptance: Acceptance::default(),
            overhead: f64::from(step_overhead),
        }
    }

    /// This request's `proposed` tokens as [`allocate`] weighs them in a batch.
    pub fn candidate(&self, proposed: usize) -> Candidate {
        Candidate {
            proposed,
            rate: self.acceptance.rate(),
            overhead: self.overhead,
        }
    }

    /// The counts so far.
    pub fn stats(&self) -> SpeculationStats {
        self.stats
    }

    /// Proposes at most `limit` tokens after `prompt` then `output`, for a step of
    /// `rows` decoding rows: no more than [`allocate`] could verify there (none while the
    /// draft length pauses, or when the proposer has no guess).
    ///
    /// # Errors
    ///
    /// As the proposer's.
    pub fn propose(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        limit: usize,
        rows: usize,
    ) -> Result<Vec<u32>> {
        let k = self.length.take().min(limit);
        // As many as could pay in a step of `rows` decoding rows (the batch's plan may
        // verify fewer), so a proposer (a draft model) does no work a step would drop.
        let k = allocate(&[self.candidate(k)], rows.max(1), k)[0];
        let mut out = Vec::with_capacity(k);
        if k == 0 {
            return Ok(out);
        }
        self.history.clear();
        self.history.extend_from_slice(prompt);
        self.history.extend_from_slice(output);
        self.proposer.propose(&self.history, k, &mut out)?;
        out.truncate(k);
        Ok(out)
    }

    /// Records a verification of `proposed` tokens of which `accepted` were accepted.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        self.stats.record(proposed, accepted);
        self.acceptance.observe(proposed, accepted);
        self.length.observe(proposed, accepted);
        self.proposer.observe(proposed, accepted);
    }
}

/// Builds the proposer `config` names: `draft` is the draft model held by the caller,
/// needed for [`SpeculationMethod::DraftModel`].
///
/// # Errors
///
/// [`LlamaError::InvalidParameter`] for invalid settings, or draft-model speculation
/// without a draft model.
pub fn speculator(
    config: &SpeculationConfig,
    draft: Option<Box<dyn Proposer>>,
) -> Result<Speculator> {
    config.validate()?;
    let proposer: Box<dyn Proposer> = match config.method {
        SpeculationMethod::NGram => {
            Box::new(NGramProposer::new(config.ngram_min, config.ngram_max)?)
        }
        SpeculationMethod::DraftModel => draft.ok_or_else(|| {
            LlamaError::invalid(
                "speculative",
                "draft",
                "no draft model is loaded (Llama::set_draft_model)",
            )
        })?,
    };
    Ok(Speculator::new(
        proposer,
        config.max_draft_tokens,
        config.step_overhead,
    ))
}

/// Verifies `drafts` against the target's logits `rows` (one per position: the last
/// accepted token's, then each draft's). `step(row)` draws the position's token with the
/// request's sampler, records it, and says whether the request is done. Stops at the
/// first drawn token that differs from its draft, at the end of the request, or after
/// the bonus token. Returns how many drafts were accepted.
///
/// # Errors
///
/// As `step`'s, and [`LlamaError::Runtime`] if fewer rows than `drafts.len() + 1` come.
pub fn verify<'a>(
    drafts: &[u32],
    rows: impl IntoIterator<Item = &'a [f32]>,
    mut step: impl FnMut(&'a [f32]) -> Result<(u32, bool)>,
) -> Result<usize> {
    let mut rows = rows.into_iter();
    for i in 0..=drafts.len() {
        let row = rows
            .next()
            .ok_or_else(|| LlamaError::Runtime("verification is missing logits".into()))?;
        let (token, done) = step(row)?;
        let matched = drafts.get(i) == Some(&token);
        if done || !matched {
            return Ok(i + usize::from(matched));
        }
    }
    Ok(drafts.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;
    use crate::sampling::{History, Pipeline, SamplingParams};

    #[test]
    fn draft_length_grows_falls_and_pauses() {
        let mut d = DraftLength::new(8);
        assert_eq!(d.take(), 8);
        d.observe(8, 3);
        assert_eq!(d.take(), 4);
        d.observe(4, 4);
        assert_eq!(d.take(), 8);
        d.observe(8, 0);
        // One step paused, then one token.
        assert_eq!((d.take(), d.take()), (0, 1));
        d.observe(1, 0);
        assert_eq!((d.take(), d.take(), d.take()), (0, 0, 1));
        d.observe(1, 1);
        assert_eq!(d.take(), 2);
    }

    #[test]
    fn verification_stops_at_the_first_mismatch_or_the_end() {
        let rows: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32]).collect();
        let run = |drafts: &[u32], draws: &[u32], end: usize| {
            let mut out = Vec::new();
            let accepted = verify(drafts, rows.iter().map(Vec::as_slice), |row| {
                let t = draws[row[0] as usize];
                out.push(t);
                Ok((t, out.len() == end))
            })
            .unwrap();
            (accepted, out)
        };
        assert_eq!(run(&[5, 6, 7], &[5, 6, 7, 8], 9), (3, vec![5, 6, 7, 8]));
        assert_eq!(run(&[5, 6, 7], &[5, 9, 7, 8], 9), (1, vec![5, 9]));
        assert_eq!(run(&[5, 6, 7], &[1, 6, 7, 8], 9), (0, vec![1]));
        assert_eq!(run(&[5, 6, 7], &[5, 6, 7, 8], 2), (2, vec![5, 6]));
        assert_eq!(run(&[], &[4], 9), (0, vec![4]));
    }

    /// The rejection rule with a point-mass proposal, as verification runs it (the
    /// target's own draw decides), on a fixed distribution: the proposal is accepted
    /// with probability `p(t)`, and a rejected proposal's replacement follows the
    /// residual `p` without `t`, renormalised. A chi-square bound over many seeds.
    #[test]
    fn the_rejection_rule_keeps_the_target_distribution() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp() / z).collect();
        let proposed = 0u32;
        let n = 40_000usize;
        let mut accepted = 0usize;
        let mut residual = vec![0usize; logits.len()];
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        for seed in 0..n as u64 {
            let mut sampler = Pipeline::new(params.clone(), seed).unwrap();
            let drafts = [proposed];
            let mut drawn = Vec::new();
            let got = verify(&drafts, [&logits[..], &logits[..]], |row| {
                let t = sampler.sample(row, History::default())?;
                drawn.push(t);
                Ok((t, false))
            })
            .unwrap();
            if got == 1 {
                accepted += 1;
            } else {
                residual[drawn[0] as usize] += 1;
            }
        }
        // Acceptance: within 5 standard deviations of p(t).
        let pa = p[proposed as usize];
        let sd = (pa * (1.0 - pa) / n as f64).sqrt();
        let rate = accepted as f64 / n as f64;
        assert!((rate - pa).abs() < 5.0 * sd, "acceptance {rate} vs {pa}");
        // The replacement: chi-square over the residual distribution, 4 degrees of
        // freedom; 30 is far beyond its 99.99th percentile (about 23.5).
        assert_eq!(residual[proposed as usize], 0);
        let rejected = (n - accepted) as f64;
        let chi: f64 = (0..logits.len())
            .filter(|&i| i != proposed as usize)
            .map(|i| {
                let expected = rejected * p[i] / (1.0 - pa);
                (residual[i] as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi < 30.0, "chi-square {chi}");
    }

    #[test]
    fn configs_are_checked() {
        assert!(SpeculationConfig::ngram(4).validate().is_ok());
        for n in [0, 17] {
            assert_err!(
                SpeculationConfig::ngram(n).validate(),
                LlamaError::InvalidParameter { name: "draft_tokens", value, .. } if value == n.to_string()
            );
        }
        let bad = SpeculationConfig::ngram(4).with_ngram_range(3, 2);
        assert_err!(
            bad.validate(),
            LlamaError::InvalidParameter { name: "ngram", value, .. } if value == "3..=2"
        );
        assert_err!(
            speculator(&SpeculationConfig::draft_model(4), None),
            LlamaError::InvalidParameter { name: "speculative", reason, .. }
                if reason.contains("no draft model is loaded")
        );
        assert_eq!(
            "ngram".parse::<SpeculationMethod>().ok(),
            Some(SpeculationMethod::NGram)
        );
        assert_err!(
            "eagle".parse::<SpeculationMethod>(),
            LlamaError::InvalidParameter { name: "speculative", value, .. } if value == "eagle"
        );
    }
}
