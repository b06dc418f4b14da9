//! Prompt lookup: the n-gram proposer.

use super::{MAX_NGRAM, Proposer};
use crate::error::{LlamaError, Result};

/// Proposes the tokens that followed the latest earlier occurrence of the history's
/// last `n` tokens, trying `n` from the longest to the shortest configured. Copy-heavy
/// outputs (a rewritten paragraph, an edited function, a quoted document) repeat long
/// runs of their prompt, which this finds at no model cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NGramProposer {
    min_n: usize,
    max_n: usize,
}

impl NGramProposer {
    /// Matches n-grams of `min_n..=max_n` tokens.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] unless `1 <= min_n <= max_n <= 8`.
    pub fn new(min_n: usize, max_n: usize) -> Result<Self> {
        if min_n == 0 || min_n > max_n || max_n > MAX_NGRAM {
            return Err(LlamaError::invalid(
                "ngram",
                format!("{min_n}..={max_n}"),
                "needs 1 <= min <= max <= 8",
            ));
        }
        Ok(Self { min_n, max_n })
    }
}

impl Proposer for NGramProposer {
    fn propose(&mut self, history: &[u32], k: usize, out: &mut Vec<u32>) -> Result<()> {
        let len = history.len();
        for n in (self.min_n..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let pattern = &history[len - n..];
            // Latest earlier occurrence: it starts before `len - n`, so a token follows it.
            let found = (0..len - n).rev().find(|&i| &history[i..i + n] == pattern);
            if let Some(i) = found {
                let from = i + n;
                let to = (from + k).min(len);
                out.extend_from_slice(&history[from..to]);
                return Ok(());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    fn propose(p: &mut NGramProposer, history: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        p.propose(history, k, &mut out).unwrap();
        out
    }

    #[test]
    fn the_longest_latest_match_is_continued() {
        let mut p = NGramProposer::new(1, 3).unwrap();
        // "1 2 3" occurs at 0 and is followed by 4 5 6.
        assert_eq!(
            propose(&mut p, &[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3),
            vec![4, 5, 6]
        );
        // Only "3" matches (at 2, followed by 7), and k bounds the proposal.
        assert_eq!(propose(&mut p, &[1, 2, 3, 7, 8, 9, 4, 3], 1), vec![7]);
        // The latest occurrence wins; a proposal may run to the end of the history.
        assert_eq!(propose(&mut p, &[5, 1, 5, 2, 5], 4), vec![2, 5]);
        assert!(propose(&mut p, &[1, 2, 3], 4).is_empty());
        let mut p = NGramProposer::new(2, 2).unwrap();
        assert!(propose(&mut p, &[1, 2, 3, 9, 3], 4).is_empty());
        for (min, max) in [(0, 2), (2, 9)] {
            assert_err!(
                NGramProposer::new(min, max),
                LlamaError::InvalidParameter { name: "ngram", value, .. } if value == format!("{min}..={max}")
            );
        }
    }
}
