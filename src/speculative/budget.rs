//! Which proposals are worth verifying: a cost model of a forward step and each row's
//! acceptance rate decide how many of its proposed tokens a step runs.
//!
//! A step of `n` positions costs about `c + n` units, where one unit is the cost of one
//! more position and `c` ([`SpeculationConfig::step_overhead`]) is the part of a step
//! that does not grow with its positions (reading the weights once, the fixed work of a
//! layer). A step that emits `e` tokens on average (one per decoding row, plus every
//! accepted proposal) yields `e / (c + n)` tokens per unit. One more proposal whose
//! chance of being accepted (and reached) is `p` raises that yield exactly when
//! `p * (c + n) > e`. Taking proposals in decreasing `p` while that holds gives the best
//! yield under this model: at one row almost any likely proposal pays, while in a batch
//! that already fills the step's compute only near-certain ones do.
//!
//! A row's `p` for its `j`-th proposal is `a^j`, with `a` its acceptance rate
//! ([`Acceptance`]: accepted tokens over accepted tokens plus misses, with a prior of
//! one of each and old verifications fading), the chance that a proposal is accepted
//! given the ones before it were.
//!
//! The model only decides speed: verification keeps the target's tokens whatever is
//! verified.
//!
//! [`SpeculationConfig::step_overhead`]: super::SpeculationConfig::step_overhead

/// The default [`SpeculationConfig::step_overhead`](super::SpeculationConfig::step_overhead):
/// on the demo model on two CPU cores a verifying pass of `1 + k` positions costs
/// `0.65 + 0.35 (k + 1)` one-token steps, a fixed part of about two positions.
pub const DEFAULT_STEP_OVERHEAD: u32 = 2;

/// Weight kept by earlier verifications at each new one (the acceptance rate follows
/// the request's current stretch: copying, then free text).
const FADE: f64 = 0.9;

/// A request's running acceptance rate of proposals.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Acceptance {
    accepted: f64,
    missed: f64,
}

impl Acceptance {
    /// Records a verification of `proposed` tokens of which `accepted` were accepted.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.accepted = self.accepted * FADE + accepted as f64;
        self.missed = self.missed * FADE + f64::from(u8::from(accepted < proposed));
    }

    /// The chance that a proposal is accepted given the proposals before it were: `0.5`
    /// before any verification.
    pub fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.accepted + self.missed + 2.0)
    }
}

/// One row's proposals, as [`allocate`] weighs them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Proposed tokens on offer.
    pub proposed: usize,
    /// The row's [`Acceptance::rate`].
    pub rate: f64,
    /// The row's [`SpeculationConfig::step_overhead`](super::SpeculationConfig::step_overhead).
    pub overhead: f64,
}

/// How many of each candidate row's proposals a step should verify, at most `budget`
/// in all, for a step that already runs `base` one-token rows (the candidates
/// included). Proposals are taken in decreasing chance of acceptance (older rows first
/// on ties) while each raises the step's expected tokens per unit of cost.
pub fn allocate(candidates: &[Candidate], base: usize, mut budget: usize) -> Vec<usize> {
    let mut counts = vec![0usize; candidates.len()];
    let mut open: Vec<bool> = candidates.iter().map(|c| c.proposed > 0).collect();
    let mut next: Vec<f64> = candidates.iter().map(|c| c.rate).collect();
    let (mut positions, mut emitted) = (base as f64, base as f64);
    while budget > 0 {
        let mut best: Option<usize> = None;
        for i in (0..candidates.len()).filter(|&i| open[i]) {
            if best.is_none_or(|b| next[i] > next[b]) {
                best = Some(i);
            }
        }
        let Some(i) = best else {
            break;
        };
        let p = next[i];
        if p * (candidates[i].overhead + positions) <= emitted {
            // The threshold only rises and this row's next chances only fall.
            open[i] = false;
            continue;
        }
        counts[i] += 1;
        budget -= 1;
        positions += 1.0;
        emitted += p;
        next[i] *= candidates[i].rate;
        open[i] = counts[i] < candidates[i].proposed;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(proposed: usize, rate: f64) -> Candidate {
        Candidate {
            proposed,
            rate,
            overhead: f64::from(DEFAULT_STEP_OVERHEAD),
        }
    }

    #[test]
    fn one_row_verifies_likely_proposals_and_a_full_batch_only_near_certain_ones() {
        // One row copying (rate 0.9): several proposals pay; a coin flip: one.
        assert_eq!(allocate(&[row(8, 0.9)], 1, 64), vec![5]);
        assert_eq!(allocate(&[row(8, 0.5)], 1, 64), vec![1]);
        assert_eq!(allocate(&[row(8, 0.2)], 1, 64), vec![0]);
        // Sixteen rows: a 0.5 row gets nothing, a near-certain one still gets some.
        assert_eq!(allocate(&[row(8, 0.5)], 16, 64), vec![0]);
        let mixed = allocate(&[row(8, 0.5), row(8, 0.97)], 16, 64);
        assert_eq!(mixed[0], 0);
        assert!(mixed[1] >= 1, "{mixed:?}");
        // Within the budget and the proposals on offer, older rows first on ties.
        assert_eq!(allocate(&[row(2, 0.99), row(2, 0.99)], 2, 3), vec![2, 1]);
        assert_eq!(allocate(&[row(0, 0.99)], 1, 8), vec![0]);
        // An overhead this large verifies every proposal.
        let always = Candidate {
            overhead: f64::from(u32::MAX),
            ..row(8, 0.1)
        };
        assert_eq!(allocate(&[always], 32, 64), vec![8]);
    }

    #[test]
    fn the_rate_follows_recent_verifications() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        for _ in 0..20 {
            a.observe(4, 4);
        }
        assert!(a.rate() > 0.95, "{}", a.rate());
        for _ in 0..40 {
            a.observe(4, 0);
        }
        assert!(a.rate() < 0.2, "{}", a.rate());
        a.observe(0, 0);
        assert!(a.rate() < 0.2);
    }
}
