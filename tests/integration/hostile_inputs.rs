//! Hostile files and inputs are typed errors, never a panic or an abort: seeded
//! byte-level mutations of a GGUF file and of a safetensors file (flips, truncations,
//! huge length fields, insertions), each opened and every tensor read; random text
//! through every tokenizer.

use std::path::PathBuf;

use llama_burn::LlamaError;
use llama_burn::kernels::QuantMatrix;
use llama_burn::loader::TensorSource;
use llama_burn::loader::gguf::GgufFile;
use llama_burn::loader::safetensors::SafetensorsSource;
use llama_burn::tokenizer::{GgufBpeTokenizer, Tokenizer};
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

/// Any text encodes and decodes without a panic; text made of characters the vocabulary
/// can spell comes back unchanged.
///
/// A byte-level vocabulary may lack a token for a byte that never occurs alone in its
/// training text: the demo model's has none for 0xF1 and 0xF2 (the lead bytes of
/// U+40000..U+BFFFF, unassigned code points). Such bytes are dropped (there is no token
/// to give them), so only the characters that survive on their own are expected to
/// round-trip.
fn round_trips<T: Tokenizer>(tok: &T, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let spellable = |c: char| {
        let s = c.to_string();
        tok.encode_text(&s)
            .and_then(|ids| tok.decode(&ids))
            .is_ok_and(|back| back == s)
    };
    for _ in 0..300 {
        let text = random_text(&mut rng);
        let ids = tok.encode_text(&text).expect("encode");
        let _ = tok.decode(&ids).expect("decode");
        let kept: String = text.chars().filter(|&c| spellable(c)).collect();
        let ids = tok.encode_text(&kept).expect("encode");
        assert_eq!(tok.decode(&ids).expect("decode"), kept);
    }
}

#[test]
fn random_text_round_trips_through_the_gguf_tokenizer() {
    let path = llama_burn::demo::demo_model_path().expect("demo model");
    let gguf = GgufFile::open(&path).expect("open demo GGUF");
    round_trips(&GgufBpeTokenizer::from_gguf(&gguf).expect("tokenizer"), 1);
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
    let tok = llama_burn::tokenizer::Llama3Tokenizer::from_file(path).expect("tokenizer");
    round_trips(&tok, 2);
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
fn random_request(rng: &mut StdRng) -> llama_burn::inference::GenerateRequest {
    use llama_burn::inference::GenerateRequest;
    use llama_burn::tokenizer::ChatMessage;
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

/// Random requests to every strategy give tokens or a typed error, and afterwards each
/// strategy still serves a plain request with its usual greedy answer.
#[test]
fn random_requests_to_every_strategy_leave_it_serving() {
    use llama_burn::inference::{
        ContinuousConfig, ContinuousEngine, GenerateRequest, InferenceBuilder,
        concurrent_streaming_handler, generate_batch, request_sampler,
    };
    let demo = || {
        let path = llama_burn::demo::demo_model_path().expect("demo model");
        llama_burn::Loader::gguf(path)
            .max_seq_len(256)
            .load::<llama_burn::backend::DefaultBackend>(&llama_burn::backend::default_device())
            .expect("demo model loads")
    };
    let plain = GenerateRequest::new("The capital of France is").with_max_tokens(4);
    let mut llama = demo();
    let expected = llama
        .generate(&plain.prompt, 4, 0.0, &mut request_sampler(&plain))
        .expect("plain request")
        .tokens;
    let mut rng = StdRng::seed_from_u64(99);
    let requests: Vec<GenerateRequest> = (0..40).map(|_| random_request(&mut rng)).collect();
    let mut outcomes = [0usize; 2];

    // Sequential.
    for r in &requests {
        let result = llama.generate(
            &r.prompt,
            r.max_tokens,
            r.sampling.temperature,
            &mut request_sampler(r),
        );
        outcomes[usize::from(result.is_ok())] += 1;
    }
    let again = llama.generate(&plain.prompt, 4, 0.0, &mut request_sampler(&plain));
    assert_eq!(again.expect("sequential still serves").tokens, expected);

    // Batched: the prompts of several random requests at once, with one's parameters.
    for chunk in requests.chunks(4) {
        let prompts: Vec<&str> = chunk.iter().map(|r| r.prompt.as_str()).collect();
        let r = &chunk[0];
        let result = generate_batch(
            &mut llama,
            &prompts,
            r.max_tokens,
            r.sampling.temperature,
            r.sampling.top_p,
            r.seed,
        );
        outcomes[usize::from(result.is_ok())] += 1;
    }
    let batch = generate_batch(&mut llama, &[plain.prompt.as_str()], 4, 0.0, 1.0, 0);
    assert_eq!(batch.expect("batched still serves").len(), 1);

    // Concurrent jobs.
    let service = InferenceBuilder::new()
        .with_model(llama)
        .build(concurrent_streaming_handler);
    let jobs: Vec<_> = requests
        .iter()
        .map(|r| service.infer(r.clone()).spawn())
        .collect();
    for job in jobs {
        let _ = job.stream.iter().count();
        outcomes[usize::from(job.join().is_ok())] += 1;
    }
    let job = service.infer(plain.clone()).spawn();
    let ids: Vec<u32> = job.stream.iter().map(|t| t.token_id).collect();
    job.join().expect("concurrent still serves");
    assert_eq!(ids, expected);
    drop(service);

    // The continuous engine.
    let engine = ContinuousEngine::start(demo(), ContinuousConfig::default()).expect("engine");
    let jobs: Vec<_> = requests.iter().map(|r| engine.submit(r.clone())).collect();
    for job in jobs {
        let ok = job.and_then(|j| j.collect()).is_ok();
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
