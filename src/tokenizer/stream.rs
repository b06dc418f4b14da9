//! Incremental decoding of generated tokens.

use super::Tokenizer;

/// Turns a stream of token ids into text pieces, never splitting a UTF-8 character.
///
/// Byte-level tokenizers often spread one character (an emoji, a CJK ideograph) over
/// several tokens, none of which is valid UTF-8 alone. The decoder keeps the bytes of an
/// incomplete character until the tokens that complete it arrive, so every piece returned
/// is whole text. Bytes that can never become valid UTF-8 are rendered as U+FFFD exactly
/// as [`String::from_utf8_lossy`] renders them, so for byte-level BPE tokenizers the
/// concatenation of all pieces (including [`StreamDecoder::finish`]) equals
/// [`Tokenizer::decode`] of all the ids.
///
/// ```
/// # use llama_burn::tokenizer::{StreamDecoder, Tokenizer};
/// # fn demo(tokenizer: &dyn Tokenizer, ids: &[u32]) {
/// let mut decoder = StreamDecoder::new();
/// let mut text = String::new();
/// for &id in ids {
///     text.push_str(&decoder.push(tokenizer, id));
/// }
/// text.push_str(&decoder.finish());
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the bytes of token `id` and returns the text they complete (possibly empty).
    ///
    /// An id the tokenizer does not know adds nothing.
    pub fn push<T: Tokenizer + ?Sized>(&mut self, tok: &T, id: u32) -> String {
        match tok.token_bytes(id) {
            Some(bytes) => self.push_bytes(&bytes),
            None => String::new(),
        }
    }

    /// Adds raw bytes and returns the text they complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.drain(false)
    }

    /// Returns what is left, rendering an incomplete trailing character as U+FFFD, and
    /// leaves the decoder empty (ready for a new stream).
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Number of bytes held back because they may start a character not yet complete.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Drops any held-back bytes.
    pub fn reset(&mut self) {
        self.pending.clear();
    }

    /// Emits every complete character of the pending bytes. Without `at_end`, a trailing
    /// sequence that may still become a character is kept; with it, it becomes U+FFFD.
    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(text) => {
                    out.push_str(text);
                    start = self.pending.len();
                }
                Err(err) => {
                    let valid_end = start + err.valid_up_to();
                    if let Ok(text) = std::str::from_utf8(&self.pending[start..valid_end]) {
                        out.push_str(text);
                    }
                    match err.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid_end + bad;
                        }
                        None if at_end => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = self.pending.len();
                        }
                        None => {
                            start = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use crate::tokenizer::SpecialTokens;

    /// A tokenizer whose id `n < 256` is the byte `n` and whose id 256 is "<eos>".
    struct Bytes;

    impl Tokenizer for Bytes {
        fn encode(&self, text: &str, _bos: bool, _eos: bool) -> Result<Vec<u32>> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
            self.encode(text, false, false)
        }
        fn decode(&self, ids: &[u32]) -> Result<String> {
            let bytes: Vec<u8> = ids
                .iter()
                .filter_map(|&i| self.token_bytes(i))
                .flatten()
                .collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
            match id {
                0..=255 => Some(vec![id as u8]),
                256 => Some(b"<eos>".to_vec()),
                _ => None,
            }
        }
        fn vocab_size(&self) -> usize {
            257
        }
        fn special_tokens(&self) -> &SpecialTokens {
            static SPECIAL: std::sync::LazyLock<SpecialTokens> =
                std::sync::LazyLock::new(|| SpecialTokens {
                    eos: Some(256),
                    stop_ids: vec![256],
                    ..SpecialTokens::default()
                });
            &SPECIAL
        }
    }

    fn stream(ids: &[u32]) -> Vec<String> {
        let mut decoder = StreamDecoder::new();
        let mut pieces: Vec<String> = ids.iter().map(|&id| decoder.push(&Bytes, id)).collect();
        pieces.push(decoder.finish());
        assert_eq!(decoder.pending_len(), 0);
        pieces
    }

    #[test]
    fn emoji_split_over_byte_tokens_comes_out_whole() {
        let text = "a👍🏽b🇫🇷 日本語 👩‍👩‍👧";
        let ids = Bytes.encode(text, false, false).unwrap();
        let pieces = stream(&ids);
        for piece in &pieces {
            // Each non-empty piece is whole text: it starts at a char boundary of `text`.
            assert!(!piece.contains(char::REPLACEMENT_CHARACTER));
        }
        assert_eq!(pieces.concat(), text);
        // The thumbs-up (4 bytes) only appears once its last byte is pushed.
        assert_eq!(pieces[1..4].concat(), "");
        assert_eq!(pieces[4], "👍");
    }

    #[test]
    fn invalid_bytes_match_lossy_decoding() {
        let cases: [&[u32]; 6] = [
            &[0xF0, 0x9F, 0x41],
            &[0xFF, 0x41, 0xC3],
            &[0xE6, 0x97, 0xA5, 0xE6, 0x97],
            &[0x80, 0x80, 0xE2, 0x82, 0xAC],
            &[0xED, 0xA0, 0x80, 0x41],
            &[0x41, 256, 0xF0, 0x9F, 0x98, 0x80, 0x98],
        ];
        for ids in cases {
            let pieces = stream(ids);
            assert_eq!(pieces.concat(), Bytes.decode(ids).unwrap(), "ids {ids:?}");
        }
    }

    #[test]
    fn unknown_ids_add_nothing_and_reset_clears() {
        let mut decoder = StreamDecoder::new();
        assert_eq!(decoder.push(&Bytes, 9999), "");
        assert_eq!(decoder.push(&Bytes, 0xE2), "");
        assert_eq!(decoder.pending_len(), 1);
        decoder.reset();
        assert_eq!(decoder.finish(), "");
        assert_eq!(decoder.push_bytes("é".as_bytes()), "é");
    }
}
