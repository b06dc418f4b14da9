//! Stop strings: text (not tokens) that ends an answer.
//!
//! A stop string may span several tokens, so the generated text is matched as it grows.
//! [`StopMatcher::push`] releases only text that can no longer be part of a stop string:
//! whatever ends the text so far and could be the start of one is held back until the
//! next piece shows whether it is. Nothing at or after a stop string is ever released.

/// Finds stop strings in text that arrives piece by piece.
///
/// ```
/// use llama_burn::server::StopMatcher;
///
/// let mut m = StopMatcher::new(vec!["\n\nUser:".to_string()]);
/// assert_eq!(m.push("Paris.").text, "Paris.");
/// assert_eq!(m.push("\n").text, ""); // could be the start of the stop string
/// let out = m.push("\nUser: and");
/// assert!(out.stopped);
/// assert_eq!(out.text, "");
/// ```
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

/// What [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is now safe to send.
    pub text: String,
    /// A stop string was found: `text` ends just before it, and nothing follows.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings among them are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been found.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Adds the next piece of generated text and returns what can be sent now.
    /// After a stop string was found every call returns nothing.
    pub fn push(&mut self, piece: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: piece.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return StopOutput {
                text,
                stopped: true,
            };
        }
        let keep = self.partial_suffix_len();
        let split = self.held.len() - keep;
        let held = self.held.split_off(split);
        let text = std::mem::replace(&mut self.held, held);
        StopOutput {
            text,
            stopped: false,
        }
    }

    /// Ends the text: releases what was held back (nothing after a stop string).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest end of the held text that is the start of a stop
    /// string (always a character boundary).
    fn partial_suffix_len(&self) -> usize {
        let text = self.held.as_str();
        self.stops
            .iter()
            .filter_map(|stop| {
                // Longest proper prefix of `stop` that `text` ends with.
                let longest = stop.len().saturating_sub(1).min(text.len());
                (1..=longest).rev().find(|&n| {
                    stop.is_char_boundary(n)
                        && text.is_char_boundary(text.len() - n)
                        && text.ends_with(&stop[..n])
                })
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns everything released and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let o = m.push(piece);
            out.push_str(&o.text);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn stop_inside_one_piece() {
        assert_eq!(run(&["END"], &["abcENDdef"]), ("abc".into(), true));
        assert_eq!(run(&["END"], &["END"]), ("".into(), true));
    }

    #[test]
    fn stop_across_pieces() {
        assert_eq!(run(&["END"], &["abcE", "N", "Dxyz"]), ("abc".into(), true));
        assert_eq!(
            run(&["\n\n"], &["one", "\n", "\n", "two"]),
            ("one".into(), true)
        );
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcE").text, "abc");
        assert_eq!(m.push("Nx").text, "ENx");
        assert_eq!(m.push("E").text, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn released_text_never_contains_a_stop() {
        // Every split of the text into three pieces gives the same answer.
        let text = "The answer is 42. User: thanks";
        let stops = ["User:", "42.!"];
        for i in 0..=text.len() {
            for j in i..=text.len() {
                let pieces = [&text[..i], &text[i..j], &text[j..]];
                assert_eq!(
                    run(&stops, &pieces),
                    ("The answer is 42. ".into(), true),
                    "{pieces:?}"
                );
            }
        }
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        assert_eq!(run(&["bcd", "c"], &["ab", "cd"]), ("a".into(), true));
    }

    #[test]
    fn multibyte_characters_are_not_split() {
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        let mut m = StopMatcher::new(vec!["日本".into()]);
        assert_eq!(m.push("に日").text, "に");
        assert_eq!(m.push("x").text, "日x");
    }

    #[test]
    fn nothing_after_a_stop() {
        let mut m = StopMatcher::new(vec!["x".into()]);
        assert!(m.push("axb").stopped);
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), StopOutput::default());
        assert_eq!(m.finish(), "");
    }
}
