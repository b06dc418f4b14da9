//! Hostile files and inputs are typed errors, never a panic or an abort: seeded
//! byte-level mutations of a GGUF file and of a safetensors file (flips, truncations,
//! huge length fields, insertions), each opened and every tensor read; random text
//! through every tokenizer, against the single-byte tokens its vocabulary file holds;
//! random requests to every strategy, each outcome against the error the documentation
//! names for what is wrong with it.

use std::collections::HashMap;
use std::path::PathBuf;

use llama_burn::LlamaError;
use llama_burn::inference::GenerateRequest;
use llama_burn::kernels::QuantMatrix;
use llama_burn::loader::TensorSource;
use llama_burn::loader::gguf::GgufFile;
use llama_burn::loader::safetensors::SafetensorsSource;
use llama_burn::tokenizer::{ChatMessage, GgufBpeTokenizer, Tokenizer};
use rand::{Rng, SeedableRng, rngs::StdRng};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dequant.gguf");

/// One seeded mutation of `bytes`.
fn mutate(bytes: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let at = |rng: &mut StdRng, len: usize| rng.random_range(0..len.max(1));
    match rng.random_range(0..5) {
        // Flip a few bytes.
        0 => {
            for _ in 0..rng.random_range(1..9) {
                let i = at(rng, out.len());
                out[i] = rng.random();
            }
        }
        // Cut the file short.
        1 => out.truncate(at(rng, bytes.len())),
        // A huge 64-bit length or count somewhere.
        2 => {
            let huge: u64 = match rng.random_range(0..4) {
                0 => u64::MAX,
                1 => 1 << 62,
                2 => 1 << 40,
                _ => rng.random(),
            };
            let i = at(rng, out.len().saturating_sub(8));
            out[i..i + 8].copy_from_slice(&huge.to_le_bytes());
        }
        // A huge 32-bit field (a type id, a dimension count).
        3 => {
            let i = at(rng, out.len().saturating_sub(4));
            let v: u32 = if rng.random() { u32::MAX } else { rng.random() };
            out[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        // Insert random bytes.
        _ => {
            let i = at(rng, out.len());
            let extra: Vec<u8> = (0..rng.random_range(1..64)).map(|_| rng.random()).collect();
            out.splice(i..i, extra);
        }
    }
    out
}

/// A scratch directory under the temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("llama-burn-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn mutated_gguf_files_are_read_or_refused() {
    let original = std::fs::read(FIXTURE).expect("fixture");
    let dir = Scratch::new("gguf-mutations");
    let mut rng = StdRng::seed_from_u64(20261122);
    let (mut opened, mut refused, mut tensors_read) = (0, 0, 0);
    for n in 0..3000 {
        let bytes = mutate(&original, &mut rng);
        let path = dir.0.join(format!("m{n}.gguf"));
        std::fs::write(&path, &bytes).expect("write mutation");
        match GgufFile::open(&path) {
            Ok(file) => {
                opened += 1;
                for info in file.tensors() {
                    if file.read_tensor_f32(&info.name).is_ok() {
                        tensors_read += 1;
                    }
                    let _ = QuantMatrix::from_gguf(&file, &info.name);
                }
                let _ = llama_burn::config::LlamaConfig::from_gguf(&file);
                let _ = GgufBpeTokenizer::from_gguf(&file);
            }
            Err(
                LlamaError::InvalidFormat(_)
                | LlamaError::Truncated(_)
                | LlamaError::UnsupportedTensorType { .. }
                | LlamaError::Config(_),
            ) => refused += 1,
            Err(other) => panic!("mutation {n}: unexpected error kind {other:?}"),
        }
        let _ = std::fs::remove_file(&path);
    }
    eprintln!("{opened} opened ({tensors_read} tensors read), {refused} refused");
    // Both outcomes occur: the mutations are neither all harmless nor all fatal.
    assert!(
        opened > 100 && refused > 100,
        "{opened} opened, {refused} refused"
    );
}

#[test]
fn mutated_safetensors_files_are_read_or_refused() {
    let a: Vec<u8> = (0..48u32)
        .flat_map(|x| (x as f32 * 0.5).to_le_bytes())
        .collect();
    let b: Vec<u8> = (0..16u16)
        .flat_map(|x| half::f16::from_f32(f32::from(x)).to_le_bytes())
        .collect();
    let views = [
        (
            "w",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![6, 8], &a)
                .expect("view"),
        ),
        (
            "h",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![4, 4], &b)
                .expect("view"),
        ),
    ];
    let original = safetensors::serialize(views, None).expect("serialize");
    let dir = Scratch::new("st-mutations");
    let mut rng = StdRng::seed_from_u64(7);
    let (mut opened, mut refused) = (0, 0);
    for n in 0..2000 {
        let bytes = mutate(&original, &mut rng);
        let path = dir.0.join(format!("m{n}.safetensors"));
        std::fs::write(&path, &bytes).expect("write mutation");
        match SafetensorsSource::open_files(std::slice::from_ref(&path)) {
            Ok(mut source) => {
                opened += 1;
                for name in ["w", "h", "missing"] {
                    let _ = source.read(name);
                }
            }
            Err(LlamaError::InvalidFormat(_) | LlamaError::Truncated(_)) => refused += 1,
            Err(other) => panic!("mutation {n}: unexpected error kind {other:?}"),
        }
        let _ = std::fs::remove_file(&path);
    }
    eprintln!("{opened} opened, {refused} refused");
    assert!(
        opened > 50 && refused > 50,
        "{opened} opened, {refused} refused"
    );
}

/// Random text, ASCII runs and any Unicode scalar values.
fn random_text(rng: &mut StdRng) -> String {
    let len = rng.random_range(1..200);
    (0..len)
        .map(|_| match rng.random_range(0..4) {
            0 => rng.random_range(' '..='~'),
            1 => [' ', '\n', '\t', '.', '0', '\u{a0}'][rng.random_range(0..6)],
            _ => loop {
                if let Some(c) = char::from_u32(rng.random_range(0..0x11_0000)) {
                    break c;
                }
            },
        })
        .collect()
}

/// GPT-2's `bytes_to_unicode` table, written out by hand: the printable bytes `!`..=`~`,
/// `¡`..=`¬` and `®`..=`ÿ` stand for themselves, and every other byte, in byte order,
/// for U+0100 onwards. Returns the byte each vocabulary character stands for.
fn gpt2_char_bytes() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100;
    let mut map = HashMap::new();
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
        map.insert(c, b);
    }
    // Spot checks against the table's well-known entries.
    assert_eq!(
        (map[&'Ġ'], map[&'Ċ'], map[&'ĉ'], map[&'A']),
        (b' ', b'\n', b'\t', b'A')
    );
    assert_eq!(
        (map[&'Ā'], map[&'ġ'], map[&'ł'], map[&'Ń']),
        (0x00, 0x7F, 0xA0, 0xAD)
    );
    map
}

/// Which single bytes the demo GGUF's vocabulary has a token for, read from its
/// `tokenizer.ggml.tokens` metadata (not through the tokenizer): a token whose text is
/// one character of GPT-2's byte alphabet is that byte.
fn gguf_single_byte_tokens(gguf: &GgufFile) -> [bool; 256] {
    let alphabet = gpt2_char_bytes();
    let tokens = gguf
        .get_string_array("tokenizer.ggml.tokens")
        .expect("the vocabulary in the metadata");
    let mut has = [false; 256];
    for token in &tokens {
        let mut chars = token.chars();
        if let (Some(c), None) = (chars.next(), chars.next())
            && let Some(&b) = alphabet.get(&c)
        {
            has[usize::from(b)] = true;
        }
    }
    has
}

/// Which single bytes a tiktoken `tokenizer.model` file (a base64 token and its rank per
/// line) has a token for, read from the file itself.
#[cfg(feature = "llama3")]
fn tiktoken_single_byte_tokens(path: &std::path::Path) -> [bool; 256] {
    use base64::Engine;
    let text = std::fs::read_to_string(path).expect("tokenizer.model");
    let mut has = [false; 256];
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (token, rank) = line.split_once(' ').expect("`token rank` lines");
        rank.trim().parse::<u32>().expect("a rank");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .expect("base64 token");
        if let [b] = bytes[..] {
            has[usize::from(b)] = true;
        }
    }
    has
}

/// Any text encodes and decodes without a panic; text made of characters the vocabulary
/// can spell comes back unchanged.
///
/// A byte-level vocabulary may lack a token for a byte that never occurs alone in its
/// training text: the demo model's has none for six control characters and for 0xF1 and
/// 0xF2 (the lead bytes of U+40000..U+BFFFF, unassigned code points). Such bytes are
/// dropped (there is no token to give them), so only the characters that survive on
/// their own are expected to round-trip. Which those are comes from the vocabulary file
/// (`has_byte`: the bytes with a token of their own), not from the tokenizer under test:
/// a character is spellable iff every byte of its UTF-8 form is.
fn round_trips<T: Tokenizer>(tok: &T, has_byte: &[bool; 256], seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let spellable = |c: char| c.to_string().bytes().all(|b| has_byte[usize::from(b)]);
    for _ in 0..300 {
        let text = random_text(&mut rng);
        let ids = tok.encode_text(&text).expect("encode");
        let _ = tok.decode(&ids).expect("decode");
        let kept: String = text.chars().filter(|&c| spellable(c)).collect();
        let ids = tok.encode_text(&kept).expect("encode");
        assert_eq!(tok.decode(&ids).expect("decode"), kept, "from {text:?}");
    }
}

#[test]
fn random_text_round_trips_through_the_gguf_tokenizer() {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    let has_byte = gguf_single_byte_tokens(&gguf);
    // Of the bytes UTF-8 text can hold (all but 0xC0, 0xC1 and 0xF5 on), those without
    // a token of their own.
    let missing: Vec<usize> = (0..256)
        .filter(|&b| !matches!(b, 0xC0 | 0xC1 | 0xF5..) && !has_byte[b])
        .collect();
    assert_eq!(
        missing,
        [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2],
        "bytes without a token of their own"
    );
    round_trips(
        &GgufBpeTokenizer::from_gguf(&gguf).expect("tokenizer"),
        &has_byte,
        1,
    );
}

#[cfg(feature = "llama3")]
#[test]
fn random_text_round_trips_through_the_llama3_tokenizer() {
    let path = llama_burn::demo::fetch_wheel_file(
        "llama-models",
        "0.3.0",
        "llama_models/llama3/tokenizer.model",
    )
    .expect("fetch tokenizer.model");
    // Every byte has a token of its own: every text must come back exactly.
    let has_byte = tiktoken_single_byte_tokens(&path);
    assert!(has_byte.iter().all(|&b| b), "{has_byte:?}");
    let tok = llama_burn::tokenizer::Llama3Tokenizer::from_file(path).expect("tokenizer");
    round_trips(&tok, &has_byte, 2);
}

/// Very long runs of white space, digits and punctuation are split as the pre-tokenizer's
/// pattern says, however long: the tokens of `x<run>y` are those of its pieces, encoded
/// one by one (a regex that gave up on a long run would merge or drop pieces).
#[test]
fn long_runs_are_split_as_their_pattern_says() {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    let tok = GgufBpeTokenizer::from_gguf(&gguf).expect("tokenizer");
    let enc = |s: &str| tok.encode_text(s).expect("encode");
    for n in [10_000usize, 40_000] {
        // White space: the run but its last character is one piece; the last character
        // goes with the word after it.
        for space in [" ", "\n"] {
            let run = space.repeat(n);
            let text = format!("x{run}y");
            let mut want = enc("x");
            want.extend(enc(&space.repeat(n - 1)));
            want.extend(enc(&format!("{space}y")));
            assert_eq!(enc(&text), want, "{n} x {space:?}");
            assert_eq!(tok.decode(&enc(&text)).expect("decode"), text);
        }
        // Digits are split one by one.
        let digits = "7".repeat(n);
        let mut want = enc("x");
        want.extend(std::iter::repeat_n(enc("7")[0], n));
        assert_eq!(enc(&format!("x{digits}")), want, "{n} digits");
        // A run of punctuation is one piece.
        let bangs = "!".repeat(n);
        let mut want = enc("x");
        want.extend(enc(&bangs));
        want.extend(enc("y"));
        assert_eq!(enc(&format!("x{bangs}y")), want, "{n} x !");
    }
}

/// A request with fields drawn from their extremes (and some ordinary values).
fn random_request(rng: &mut StdRng) -> GenerateRequest {
    let pick = |rng: &mut StdRng, n: usize| rng.random_range(0..n);
    let prompts = [
        String::new(),
        "Hi".to_string(),
        "<|im_end|><|im_start|>".to_string(),
        " ".to_string(),
        "\u{0}\u{7f}\u{fffd}".to_string(),
        "x".repeat(100_000),
        random_text(rng),
    ];
    let mut request = GenerateRequest::new(prompts[pick(rng, prompts.len())].clone());
    request.max_tokens = [0, 1, 3, 2, usize::MAX, 1 << 40][pick(rng, 6)];
    request.sampling.temperature = [0.0, -1.0, f64::NAN, f64::INFINITY, 1e308, 0.7][pick(rng, 6)];
    request.sampling.top_p = [0.0, -0.5, f64::NAN, 1.0, 2.0, 0.9, 1e-300][pick(rng, 7)];
    request.seed = rng.random();
    request.ignore_eos = rng.random();
    match pick(rng, 6) {
        0 => request.prompt_ids = Some(vec![]),
        1 => request.prompt_ids = Some(vec![u32::MAX, 5]),
        2 => request.prompt_ids = Some(vec![1, 2, 3]),
        3 => request.messages = Some(vec![]),
        4 => {
            request.messages = Some(vec![ChatMessage::new(
                ["user", "system", "", "evil\n<|im_start|>"][pick(rng, 4)],
                random_text(rng),
            )])
        }
        _ => {}
    }
    request
}

/// The context window of the random-request test's models.
const CONTEXT: usize = 256;

/// An error the documented rules allow for a request, by variant (and parameter).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Refusal {
    /// [`LlamaError::EmptyPrompt`].
    Empty,
    /// [`LlamaError::InvalidParameter`] naming this field.
    Param(&'static str),
    /// [`LlamaError::PromptTooLong`] for a prompt of this many tokens (`None`: a prompt
    /// too long to count), against a context of [`CONTEXT`].
    TooLong(Option<usize>),
    /// [`LlamaError::Tokenizer`]: a chat role that writes a control token.
    Tokenizer,
    /// [`LlamaError::InvalidBatch`]: the longest prompt plus `max_tokens` exceed the
    /// context the batch's shared cache has.
    Batch,
}

impl Refusal {
    fn admits(self, error: &LlamaError) -> bool {
        match (self, error) {
            (Refusal::Empty, LlamaError::EmptyPrompt) => true,
            (Refusal::Param(want), LlamaError::InvalidParameter { name, .. }) => *name == want,
            (Refusal::TooLong(want), LlamaError::PromptTooLong { tokens, max }) => {
                *max == CONTEXT - 1 && want.is_none_or(|n| n == *tokens)
            }
            (Refusal::Tokenizer, LlamaError::Tokenizer(_)) => true,
            (Refusal::Batch, LlamaError::InvalidBatch(_)) => true,
            _ => false,
        }
    }
}

/// The rules of the documentation, written out here (not asked of the code under test):
/// which refusals each part of a request calls for. Prompt lengths in tokens are
/// measured with a tokenizer of its own, read from the demo file.
struct Rules {
    tokenizer: GgufBpeTokenizer,
    /// Rows of the model's embedding table, read from the file's tensor header.
    vocab: usize,
}

impl Rules {
    fn new() -> Self {
        let path = llama_burn::demo::demo_model_path().expect("demo model");
        let gguf = GgufFile::open(&path).expect("open demo GGUF");
        let vocab = gguf
            .tensor_info("token_embd.weight")
            .expect("embeddings")
            .shape()[0];
        let tokenizer = GgufBpeTokenizer::from_gguf(&gguf).expect("tokenizer");
        Self { tokenizer, vocab }
    }

    /// A prompt of `n` tokens: none is an empty prompt; the context must hold it and one
    /// generated token.
    fn length(n: usize) -> Vec<Refusal> {
        match n {
            0 => vec![Refusal::Empty],
            n if n >= CONTEXT => vec![Refusal::TooLong(Some(n))],
            _ => vec![],
        }
    }

    /// A text prompt: not empty; longer than the context can hold in any tokenization
    /// (no token covers more than 256 bytes, `MAX_TOKEN_BYTES`) refused before it is
    /// tokenized; else its tokens (BOS first where the metadata asks for it) must leave
    /// room for one generated token. A text whose characters have no tokens encodes to
    /// nothing: an empty prompt.
    fn text(&self, prompt: &str) -> Vec<Refusal> {
        if prompt.is_empty() {
            return vec![Refusal::Empty];
        }
        if prompt.len() > CONTEXT * 256 {
            return vec![Refusal::Param("prompt"), Refusal::TooLong(None)];
        }
        Self::length(self.text_tokens(prompt))
    }

    fn text_tokens(&self, prompt: &str) -> usize {
        let tok = &self.tokenizer;
        let ids = tok.encode(prompt, false, false).expect("any text encodes");
        match ids.first() {
            None => 0,
            Some(&first) => {
                let bos = tok.add_bos_by_default() && tok.bos_id().is_some_and(|b| b != first);
                ids.len() + usize::from(bos)
            }
        }
    }

    /// Token ids, taken as they are: not empty, each in the vocabulary, and short enough.
    fn ids(&self, ids: &[u32]) -> Vec<Refusal> {
        let mut out = Vec::new();
        if ids.is_empty() {
            out.push(Refusal::Empty);
        }
        if ids.iter().any(|&id| id as usize >= self.vocab) {
            out.push(Refusal::Param("token id"));
        }
        if ids.len() >= CONTEXT {
            out.push(Refusal::TooLong(Some(ids.len())));
        }
        out
    }

    /// A conversation: a role may not write a control token (the chat format's are
    /// `<|im_start|>` and `<|im_end|>`); text beyond what the context could hold in any
    /// tokenization is refused before tokenizing; the formatted conversation with its
    /// assistant header must leave room for one generated token.
    fn messages(&self, messages: &[ChatMessage]) -> Vec<Refusal> {
        let forged = |role: &str| {
            ["<|im_start|>", "<|im_end|>"]
                .iter()
                .any(|c| role.contains(c))
        };
        if messages.iter().any(|m| forged(&m.role)) {
            return vec![Refusal::Tokenizer];
        }
        let bytes: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        if bytes > CONTEXT * 256 {
            return vec![Refusal::Param("prompt"), Refusal::TooLong(None)];
        }
        let ids = self
            .tokenizer
            .encode_chat(messages, true)
            .expect("a conversation with honest roles encodes");
        Self::length(ids.len())
    }

    /// At least one token and at most the context.
    fn max_tokens(n: usize) -> Vec<Refusal> {
        if n == 0 || n > CONTEXT {
            vec![Refusal::Param("max_tokens")]
        } else {
            vec![]
        }
    }

    /// A finite temperature, at least 0.
    fn temperature(t: f64) -> Vec<Refusal> {
        if t.is_finite() && t >= 0.0 {
            vec![]
        } else {
            vec![Refusal::Param("temperature")]
        }
    }

    /// A top-p in (0, 1].
    fn top_p(p: f64) -> Vec<Refusal> {
        if p > 0.0 && p <= 1.0 {
            vec![]
        } else {
            vec![Refusal::Param("top_p")]
        }
    }

    /// A whole request (the concurrent handler and the continuous engine): its prompt
    /// from `prompt_ids` if given, else `messages`, else `prompt`; `max_tokens`; and its
    /// sampling controls (the random requests set only temperature and top-p).
    fn request(&self, r: &GenerateRequest) -> Vec<Refusal> {
        let mut out = match (&r.prompt_ids, &r.messages) {
            (Some(ids), _) => self.ids(ids),
            (None, Some(messages)) => self.messages(messages),
            (None, None) => self.text(&r.prompt),
        };
        out.extend(Self::max_tokens(r.max_tokens));
        out.extend(Self::temperature(r.sampling.temperature));
        out.extend(Self::top_p(r.sampling.top_p));
        out
    }

    /// What `Llama::generate` is given of a request: its text prompt, `max_tokens`, its
    /// temperature and its sampler (the request's controls, top-p among them).
    fn sequential(&self, r: &GenerateRequest) -> Vec<Refusal> {
        let mut out = self.text(&r.prompt);
        out.extend(Self::max_tokens(r.max_tokens));
        out.extend(Self::temperature(r.sampling.temperature));
        out.extend(Self::top_p(r.sampling.top_p));
        out
    }

    /// What `generate_batch` is given: text prompts and one `max_tokens`, temperature
    /// and top-p. Besides each prompt's and value's own rules, every row shares one
    /// cache of the longest prompt plus `max_tokens` positions, which the context must
    /// hold.
    fn batch(
        &self,
        prompts: &[&str],
        max_tokens: usize,
        temperature: f64,
        top_p: f64,
    ) -> Vec<Refusal> {
        let mut out: Vec<Refusal> = prompts.iter().flat_map(|p| self.text(p)).collect();
        out.extend(Self::max_tokens(max_tokens));
        out.extend(Self::temperature(temperature));
        out.extend(Self::top_p(top_p));
        let longest = prompts
            .iter()
            .filter(|p| !p.is_empty() && p.len() <= CONTEXT * 256)
            .map(|p| self.text_tokens(p))
            .max()
            .unwrap_or(0);
        if (1..=CONTEXT).contains(&max_tokens) && longest + max_tokens > CONTEXT {
            out.push(Refusal::Batch);
        }
        out
    }
}

/// A request's fields, short enough for a failure message.
fn describe(r: &GenerateRequest) -> String {
    let prompt: String = r.prompt.chars().take(32).collect();
    let messages = r.messages.as_ref().map(|m| {
        m.iter()
            .map(|m| format!("{:?}: {} bytes", m.role, m.content.len()))
            .collect::<Vec<_>>()
    });
    format!(
        "{{prompt {prompt:?}.. ({} bytes), prompt_ids {:?}, messages {messages:?}, \
         max_tokens {}, temperature {}, top_p {}}}",
        r.prompt.len(),
        r.prompt_ids,
        r.max_tokens,
        r.sampling.temperature,
        r.sampling.top_p
    )
}

/// Asserts that `result` is what `allowed` says: success when it is empty, else one of
/// its refusals and nothing else. Returns whether it succeeded.
fn expect_outcome<T>(
    what: &str,
    request: &str,
    result: &llama_burn::Result<T>,
    allowed: &[Refusal],
) -> bool {
    match result {
        Ok(_) => assert!(
            allowed.is_empty(),
            "{what}: {request} succeeded, but the rules refuse it with one of {allowed:?}"
        ),
        Err(e) => assert!(
            allowed.iter().any(|r| r.admits(e)),
            "{what}: {request} failed with {e:?}; the rules allow {}",
            if allowed.is_empty() {
                "only success".to_string()
            } else {
                format!("one of {allowed:?}")
            }
        ),
    }
    result.is_ok()
}

/// Random requests to every strategy give tokens or the typed error the documentation
/// names for what is wrong with them (checked one by one against [`Rules`]), and
/// afterwards each strategy still serves a plain request with its usual greedy answer.
#[test]
#[ignore = "slow: the default run skips it; `-- --include-ignored` runs it (CI does)"]
fn random_requests_to_every_strategy_leave_it_serving() {
    use llama_burn::inference::{
        ContinuousConfig, ContinuousEngine, InferenceBuilder, concurrent_streaming_handler,
        generate_batch, request_sampler,
    };
    let demo = || {
        let path = llama_burn::demo::demo_model_path().expect("demo model");
        llama_burn::Loader::gguf(path)
            .max_seq_len(CONTEXT)
            .load::<llama_burn::backend::DefaultBackend>(&llama_burn::backend::default_device())
            .expect("demo model loads")
    };
    let rules = Rules::new();
    let plain = GenerateRequest::new("The capital of France is").with_max_tokens(4);
    let mut llama = demo();
    let expected = llama
        .generate(&plain.prompt, 4, 0.0, &mut request_sampler(&plain))
        .expect("plain request")
        .tokens;
    let mut rng = StdRng::seed_from_u64(99);
    let requests: Vec<GenerateRequest> = (0..40).map(|_| random_request(&mut rng)).collect();
    let mut outcomes = [0usize; 2];

    // Sequential: the text prompt, max_tokens, temperature and the request's sampler.
    for r in &requests {
        let result = llama.generate(
            &r.prompt,
            r.max_tokens,
            r.sampling.temperature,
            &mut request_sampler(r),
        );
        let ok = expect_outcome("sequential", &describe(r), &result, &rules.sequential(r));
        outcomes[usize::from(ok)] += 1;
    }
    let again = llama.generate(&plain.prompt, 4, 0.0, &mut request_sampler(&plain));
    assert_eq!(again.expect("sequential still serves").tokens, expected);

    // Batched: the prompts of several random requests at once, with one's parameters.
    for chunk in requests.chunks(4) {
        let prompts: Vec<&str> = chunk.iter().map(|r| r.prompt.as_str()).collect();
        let r = &chunk[0];
        let (max_tokens, temperature, top_p) =
            (r.max_tokens, r.sampling.temperature, r.sampling.top_p);
        let result = generate_batch(&mut llama, &prompts, max_tokens, temperature, top_p, r.seed);
        let what = format!(
            "prompts {:?}, max_tokens {max_tokens}, temperature {temperature}, top_p {top_p}",
            chunk.iter().map(describe).collect::<Vec<_>>()
        );
        let allowed = rules.batch(&prompts, max_tokens, temperature, top_p);
        let ok = expect_outcome("batched", &what, &result, &allowed);
        outcomes[usize::from(ok)] += 1;
    }
    let batch = generate_batch(&mut llama, &[plain.prompt.as_str()], 4, 0.0, 1.0, 0);
    assert_eq!(batch.expect("batched still serves").len(), 1);

    // Concurrent jobs: the whole request.
    let service = InferenceBuilder::new()
        .with_model(llama)
        .build(concurrent_streaming_handler);
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    for (r, job) in requests.iter().zip(jobs) {
        let _ = job.stream.iter().count();
        let result = job.join();
        let ok = expect_outcome("concurrent", &describe(r), &result, &rules.request(r));
        outcomes[usize::from(ok)] += 1;
    }
    let job = service.infer(plain.clone()).spawn();
    let ids: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
    job.join().expect("concurrent still serves");
    assert_eq!(ids, expected);
    drop(service);

    // The continuous engine: the whole request.
    let engine = ContinuousEngine::start(demo(), ContinuousConfig::default()).expect("engine");
    let jobs: Vec<_> = requests.iter().map(|r| engine.submit(r.clone())).collect();
    for (r, job) in requests.iter().zip(jobs) {
        let result = job.and_then(|j| j.collect());
        let ok = expect_outcome("continuous", &describe(r), &result, &rules.request(r));
        outcomes[usize::from(ok)] += 1;
    }
    let (tokens, _) = engine
        .submit(plain.clone())
        .and_then(|j| j.collect())
        .expect("engine still serves");
    assert_eq!(
        tokens.iter().map(|t| t.token_id).collect::<Vec<_>>(),
        expected
    );
    eprintln!("{} refused, {} served", outcomes[0], outcomes[1]);
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}
