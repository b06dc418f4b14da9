//! [`Loader`], the front door for loading a model: one builder over GGUF files and
//! Hugging Face directories, with every option a load takes.
//!
//! ```no_run
//! # fn main() -> llama_burn::Result<()> {
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::loader::Loader;
//!
//! let path = llama_burn::demo::demo_model_path()?;
//! let llama = Loader::gguf(path).max_seq_len(4096).load::<DefaultBackend>(&default_device())?;
//! println!("{} layers", llama.config().n_layers);
//! # Ok(())
//! # }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::gguf::GgufFile;
use super::quantize::QuantizingSource;
use super::safetensors::SafetensorsSource;
use super::{GgufSource, build_transformer, terminal_progress};
use crate::backend::LlamaBackend;
use crate::config::{LlamaConfig, Precision};
use crate::error::{LlamaError, Result};
use crate::llama::Llama;
use crate::quant::QuantFormat;
use crate::tokenizer::{DynTokenizer, GgufBpeTokenizer, HfTokenizer, Tokenizer};

/// The context window a [`Loader`] allocates for when [`Loader::max_seq_len`] is not
/// called (or the model's trained context, if that is shorter).
pub const DEFAULT_MAX_SEQ_LEN: usize = 2048;

/// What a checkpoint path holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// A directory is a Hugging Face checkpoint, a file a GGUF.
    Auto,
    Gguf,
    HfDir,
}

/// How a load reports progress.
enum Progress<'a> {
    /// A percentage on stderr when it is a terminal (the default).
    Terminal,
    /// Nothing.
    Quiet,
    /// The caller's callback, `(tensors done, tensors total)`.
    Callback(Box<dyn FnMut(usize, usize) + 'a>),
}

/// Loads a model: which checkpoint, then options, then [`load`](Loader::load) on a
/// backend and device.
///
/// - [`Loader::gguf`]: a GGUF file, with its embedded tokenizer;
/// - [`Loader::hf_dir`]: a Hugging Face directory (`config.json`, `model.safetensors` or
///   shards with `model.safetensors.index.json`, `tokenizer.json`);
/// - [`Loader::path`]: either, a directory being a Hugging Face checkpoint.
///
/// Options: [`max_seq_len`](Loader::max_seq_len) (default [`DEFAULT_MAX_SEQ_LEN`]),
/// [`quantize`](Loader::quantize) (a Hugging Face checkpoint's matrices into a block
/// format, in memory), [`precision`](Loader::precision) (default
/// [`Precision::for_model`]), [`progress`](Loader::progress) or
/// [`quiet`](Loader::quiet) (default: a percentage on a terminal), and
/// [`tokenizer`](Loader::tokenizer) (default: the checkpoint's own).
///
/// ```no_run
/// # fn main() -> llama_burn::Result<()> {
/// use llama_burn::backend::{DefaultBackend, default_device};
/// use llama_burn::quant::QuantFormat;
/// use llama_burn::loader::Loader;
///
/// let llama = Loader::hf_dir("SmolLM2-135M-Instruct")
///     .max_seq_len(8192)
///     .quantize(QuantFormat::Q4_K)
///     .progress(|done, total| eprintln!("{done}/{total} tensors"))
///     .load::<DefaultBackend>(&default_device())?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a Loader does nothing until `load` is called"]
pub struct Loader<'a, T = Embedded> {
    path: PathBuf,
    format: Format,
    max_seq_len: Option<usize>,
    quantize: Option<QuantFormat>,
    precision: Option<Precision>,
    progress: Progress<'a>,
    tokenizer: T,
    warm_up: bool,
}

impl std::fmt::Debug for Loader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("max_seq_len", &self.max_seq_len)
            .field("quantize", &self.quantize)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

/// The tokenizer choice of a [`Loader`] that uses the checkpoint's own tokenizer (the
/// GGUF's embedded one, or a Hugging Face directory's `tokenizer.json`), as a
/// [`DynTokenizer`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Embedded;

/// The tokenizer choice of a [`Loader`] given one with [`Loader::tokenizer`].
#[derive(Debug, Clone)]
pub struct Given<T>(T);

/// Which tokenizer a [`Loader`] pairs the weights with: [`Embedded`] or [`Given`].
pub trait TokenizerChoice: sealed::Sealed {
    /// The tokenizer type of the loaded [`Llama`].
    type Tokenizer: Tokenizer;
    /// The tokenizer, from the opened checkpoint (`gguf` for a GGUF file, `dir` for a
    /// Hugging Face directory).
    #[doc(hidden)]
    fn resolve(self, gguf: Option<&GgufFile>, dir: Option<&Path>) -> Result<Self::Tokenizer>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Embedded {}
    impl<T> Sealed for super::Given<T> {}
}

impl TokenizerChoice for Embedded {
    type Tokenizer = DynTokenizer;

    fn resolve(self, gguf: Option<&GgufFile>, dir: Option<&Path>) -> Result<DynTokenizer> {
        match (gguf, dir) {
            (Some(gguf), _) => Ok(Arc::new(GgufBpeTokenizer::from_gguf(gguf)?)),
            (None, Some(dir)) => Ok(Arc::new(HfTokenizer::from_dir(dir)?)),
            (None, None) => Err(LlamaError::Config(
                "no checkpoint to read a tokenizer from".into(),
            )),
        }
    }
}

impl<T: Tokenizer> TokenizerChoice for Given<T> {
    type Tokenizer = T;

    fn resolve(self, _: Option<&GgufFile>, _: Option<&Path>) -> Result<T> {
        Ok(self.0)
    }
}

impl Loader<'static> {
    /// Loads a GGUF file, with its embedded tokenizer. On the CPU backend the block
    /// formats our kernels take stay quantized; everything else is dequantized.
    pub fn gguf(path: impl AsRef<Path>) -> Self {
        Self::new(path.as_ref(), Format::Gguf)
    }

    /// Loads a Hugging Face model directory (`config.json`, `model.safetensors` or
    /// shards with `model.safetensors.index.json`, and `tokenizer.json` unless
    /// [`tokenizer`](Self::tokenizer) gives one).
    pub fn hf_dir(dir: impl AsRef<Path>) -> Self {
        Self::new(dir.as_ref(), Format::HfDir)
    }

    /// Loads `path` as [`hf_dir`](Self::hf_dir) if it is a directory, else as
    /// [`gguf`](Self::gguf).
    pub fn path(path: impl AsRef<Path>) -> Self {
        Self::new(path.as_ref(), Format::Auto)
    }

    fn new(path: &Path, format: Format) -> Self {
        Self {
            path: path.to_path_buf(),
            format,
            max_seq_len: None,
            quantize: None,
            precision: None,
            progress: Progress::Terminal,
            tokenizer: Embedded,
            warm_up: true,
        }
    }
}

impl<'a, C: TokenizerChoice> Loader<'a, C> {
    /// Allocates for `max_seq_len` tokens of context (prompt plus generated tokens),
    /// between 2 and the model's trained context length
    /// ([`LlamaError::InvalidParameter`] otherwise, before any weight is read).
    pub fn max_seq_len(mut self, max_seq_len: usize) -> Self {
        self.max_seq_len = Some(max_seq_len);
        self
    }

    /// Quantizes a Hugging Face checkpoint's f32, f16 or bf16 matrices into `format` in
    /// memory as they are read (see [`QuantizingSource`]); on the CPU backend they then
    /// stay in it, elsewhere they are dequantized as GGUF blocks are. A GGUF file keeps
    /// its own types: loading one with this set is [`LlamaError::InvalidParameter`].
    pub fn quantize(mut self, format: QuantFormat) -> Self {
        self.quantize = Some(format);
        self
    }

    /// Sets how the CPU kernels multiply quantized weights (default:
    /// [`Precision::for_model`], `exact` below one billion parameters).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = Some(precision);
        self
    }

    /// Reports progress to `callback` as `(tensors done, tensors total)` instead of the
    /// default terminal percentage.
    pub fn progress(mut self, callback: impl FnMut(usize, usize) + 'a) -> Self {
        self.progress = Progress::Callback(Box::new(callback));
        self
    }

    /// Reports no progress.
    pub fn quiet(mut self) -> Self {
        self.progress = Progress::Quiet;
        self
    }

    /// Whether to run each kind of forward pass once at load (default: yes) on a backend
    /// that compiles its kernels on first use (the CubeCL backends: `cuda`, `wgpu`,
    /// `vulkan`), so that the first request does not wait for them
    /// ([`Transformer::warm_up`](crate::model::Transformer::warm_up)). Other backends
    /// skip it either way.
    pub fn warm_up(mut self, warm_up: bool) -> Self {
        self.warm_up = warm_up;
        self
    }

    /// Pairs the weights with `tokenizer` (a Llama 3 `tokenizer.model`, say) instead
    /// of the checkpoint's own.
    pub fn tokenizer<U: Tokenizer>(self, tokenizer: U) -> Loader<'a, Given<U>> {
        Loader {
            path: self.path,
            format: self.format,
            max_seq_len: self.max_seq_len,
            quantize: self.quantize,
            warm_up: self.warm_up,
            precision: self.precision,
            progress: self.progress,
            tokenizer: Given(tokenizer),
        }
    }

    /// Reads only the checkpoint's configuration (GGUF metadata or `config.json`), with
    /// this loader's context window and precision applied: what [`load`](Self::load)
    /// would build, without reading a weight.
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load), for the configuration.
    pub fn config(&self) -> Result<LlamaConfig> {
        let config = if self.is_hf_dir() {
            read_hf_config(&self.path)?
        } else {
            LlamaConfig::from_gguf(&GgufFile::open(&self.path)?)?
        };
        self.configure(config)
    }

    fn is_hf_dir(&self) -> bool {
        match self.format {
            Format::Auto => self.path.is_dir(),
            Format::Gguf => false,
            Format::HfDir => true,
        }
    }

    /// `config` with this loader's context window and precision.
    fn configure(&self, config: LlamaConfig) -> Result<LlamaConfig> {
        let n = self
            .max_seq_len
            .unwrap_or(DEFAULT_MAX_SEQ_LEN.min(config.context_length));
        let config = config.checked_max_seq_len(n)?;
        Ok(match self.precision {
            Some(p) => config.with_precision(p),
            None => config,
        })
    }

    /// Reads the checkpoint and builds the model on `device`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Io`] for a missing file, the format's errors for a damaged or
    /// foreign checkpoint ([`LlamaError::InvalidFormat`], [`LlamaError::Config`],
    /// [`LlamaError::MissingTensor`], ...), [`LlamaError::InvalidParameter`] for a
    /// `max_seq_len` outside the model's context or [`quantize`](Self::quantize) on a
    /// GGUF file; each before the weights are read.
    pub fn load<B: LlamaBackend>(self, device: &B::Device) -> Result<Llama<B, C::Tokenizer>> {
        let hf = self.is_hf_dir();
        // A GGUF file is opened once, for its configuration, tokenizer and weights.
        let gguf = if hf {
            None
        } else {
            if self.quantize.is_some() {
                return Err(LlamaError::invalid(
                    "quantize",
                    self.path.display(),
                    "applies to Hugging Face checkpoint directories (a GGUF keeps its own types)",
                ));
            }
            Some(GgufFile::open(&self.path)?)
        };
        let config = match &gguf {
            None => self.configure(read_hf_config(&self.path)?)?,
            Some(gguf) => self.configure(LlamaConfig::from_gguf(gguf)?)?,
        };
        let Loader {
            path,
            quantize,
            progress,
            tokenizer,
            warm_up,
            ..
        } = self;
        let label = match quantize {
            Some(format) => format!("loading {} as {format:?}", path.display()),
            None => format!("loading {}", path.display()),
        };
        let mut terminal = terminal_progress(&label);
        let mut quiet = |_: usize, _: usize| {};
        let mut callback;
        let progress: &mut dyn FnMut(usize, usize) = match progress {
            Progress::Terminal => &mut terminal,
            Progress::Quiet => &mut quiet,
            Progress::Callback(f) => {
                callback = f;
                &mut callback
            }
        };
        let (model, tokenizer) = if let Some(gguf) = gguf {
            let tokenizer = tokenizer.resolve(Some(&gguf), None)?;
            let mut source = GgufSource::new(&gguf, &config);
            let model = build_transformer(&config, &mut source, device, progress)?;
            (model, tokenizer)
        } else {
            let tokenizer = tokenizer.resolve(None, Some(&path))?;
            let mut safetensors = SafetensorsSource::open_dir(&path)?;
            let model = match quantize {
                Some(format) => {
                    let mut source = QuantizingSource::new(&mut safetensors, format)?;
                    build_transformer(&config, &mut source, device, progress)?
                }
                None => build_transformer(&config, &mut safetensors, device, progress)?,
            };
            (model, tokenizer)
        };
        if warm_up && B::compiles_kernels() {
            model.warm_up()?;
        }
        Llama::new(model, tokenizer)
    }
}

/// The configuration of a Hugging Face directory (its `config.json`).
fn read_hf_config(dir: &Path) -> Result<LlamaConfig> {
    let path = dir.join("config.json");
    let json = std::fs::read_to_string(&path).map_err(|e| LlamaError::io(&path, e))?;
    LlamaConfig::from_hf_json(&json)
}
