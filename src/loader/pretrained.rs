//! Pretrained checkpoints from the Hugging Face hub (feature `pretrained`).
//!
//! The `*_pretrained` constructors on [`crate::LlamaConfig`] download a
//! model's files with [`hf_hub`]'s blocking API and load them with the Hugging Face
//! directory loader
//! ([`Loader::hf_dir`](crate::loader::Loader::hf_dir)):
//!
//! | constructor | repository | tokenizer |
//! |---|---|---|
//! | `llama3_2_1b_pretrained` (`llama3`) | `meta-llama/Llama-3.2-1B-Instruct` | `original/tokenizer.model` |
//! | `llama3_2_3b_pretrained` (`llama3`) | `meta-llama/Llama-3.2-3B-Instruct` | `original/tokenizer.model` |
//! | `llama3_1_8b_pretrained` (`llama3`) | `meta-llama/Llama-3.1-8B-Instruct` | `original/tokenizer.model` |
//! | `llama3_8b_pretrained` (`llama3`) | `meta-llama/Meta-Llama-3-8B-Instruct` | `original/tokenizer.model` |
//! | [`tiny_llama_pretrained`](crate::LlamaConfig::tiny_llama_pretrained) | `TinyLlama/TinyLlama-1.1B-Chat-v1.0` | `tokenizer.json` |
//!
//! Files are kept in the hub's usual cache (`$HF_HOME/hub`, by default
//! `~/.cache/huggingface/hub`) and are only downloaded once; a fully cached model loads
//! without network access. Each download is announced with one line on stderr, and a
//! progress bar is drawn when stderr is a terminal.
//!
//! The Meta repositories are gated: accept the license on the model's page, then make an
//! access token of that account available, either in the `HF_TOKEN` environment variable
//! or with `huggingface-cli login`. `HF_ENDPOINT` selects another hub (a mirror).
//!
//! ```no_run
//! # fn main() -> llama_burn::Result<()> {
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::LlamaConfig;
//! use llama_burn::sampling::Sampler;
//!
//! let mut llama = LlamaConfig::tiny_llama_pretrained::<DefaultBackend>(1024, &default_device())?;
//! let out = llama.generate("The capital of France is", 32, 0.0, &mut Sampler::Argmax)?;
//! println!("{}", out.text);
//! # Ok(())
//! # }
//! ```

use std::io::IsTerminal;
use std::path::{Component, Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, CacheRepo, Repo};

#[cfg(feature = "llama3")]
use crate::backend::LlamaBackend;
#[cfg(feature = "llama3")]
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
#[cfg(feature = "llama3")]
use crate::llama::Llama;
#[cfg(feature = "llama3")]
use crate::tokenizer::{DynTokenizer, Llama3Tokenizer};

/// Name of the single weights file of an unsharded checkpoint.
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
/// Name of the index that lists the shards of a sharded checkpoint.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// How a repository stores its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFiles {
    /// One `model.safetensors`.
    Single,
    /// Shards listed in `model.safetensors.index.json`.
    Sharded,
}

/// A checkpoint on the Hugging Face hub: its repository and the files it is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PretrainedModel {
    /// Repository id (`owner/name`).
    pub repo_id: &'static str,
    /// How the weights are stored.
    pub weights: WeightFiles,
    /// The other files to fetch (configuration, tokenizer), paths within the repository.
    pub files: &'static [&'static str],
}

/// Meta's Llama 3.2 1B Instruct.
pub const LLAMA3_2_1B_INSTRUCT: PretrainedModel = PretrainedModel {
    repo_id: "meta-llama/Llama-3.2-1B-Instruct",
    weights: WeightFiles::Single,
    files: &["config.json", "original/tokenizer.model"],
};

/// Meta's Llama 3.2 3B Instruct.
pub const LLAMA3_2_3B_INSTRUCT: PretrainedModel = PretrainedModel {
    repo_id: "meta-llama/Llama-3.2-3B-Instruct",
    weights: WeightFiles::Sharded,
    files: &["config.json", "original/tokenizer.model"],
};

/// Meta's Llama 3.1 8B Instruct.
pub const LLAMA3_1_8B_INSTRUCT: PretrainedModel = PretrainedModel {
    repo_id: "meta-llama/Llama-3.1-8B-Instruct",
    weights: WeightFiles::Sharded,
    files: &["config.json", "original/tokenizer.model"],
};

/// Meta's Llama 3 8B Instruct.
pub const LLAMA3_8B_INSTRUCT: PretrainedModel = PretrainedModel {
    repo_id: "meta-llama/Meta-Llama-3-8B-Instruct",
    weights: WeightFiles::Sharded,
    files: &["config.json", "original/tokenizer.model"],
};

/// TinyLlama 1.1B Chat v1.0.
pub const TINY_LLAMA_1_1B_CHAT: PretrainedModel = PretrainedModel {
    repo_id: "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    weights: WeightFiles::Single,
    files: &["config.json", "tokenizer.json", "tokenizer_config.json"],
};

impl PretrainedModel {
    /// The files to fetch before any has been read: [`files`](Self::files), then
    /// `model.safetensors` or the shard index.
    pub fn initial_files(&self) -> Vec<&'static str> {
        let weights = match self.weights {
            WeightFiles::Single => SINGLE_WEIGHTS_FILE,
            WeightFiles::Sharded => WEIGHTS_INDEX_FILE,
        };
        self.files.iter().copied().chain([weights]).collect()
    }

    /// Every file of the checkpoint: [`initial_files`](Self::initial_files), then, for a
    /// sharded checkpoint, each shard named in `index_json` (the content of
    /// `model.safetensors.index.json`) once, in name order.
    ///
    /// Fails with [`LlamaError::InvalidFormat`] when a sharded checkpoint's index is
    /// missing, is not valid JSON, has no `weight_map`, or names a file outside the
    /// repository.
    pub fn all_files(&self, index_json: Option<&str>) -> Result<Vec<String>> {
        let mut files: Vec<String> = self.initial_files().into_iter().map(String::from).collect();
        if self.weights == WeightFiles::Sharded {
            let index = index_json.ok_or_else(|| {
                LlamaError::InvalidFormat(format!(
                    "{}: the shard index {WEIGHTS_INDEX_FILE} is needed to list the shards",
                    self.repo_id
                ))
            })?;
            files.extend(shard_files(index)?);
        }
        Ok(files)
    }

    /// Fetches the checkpoint into the hub cache (downloading only what is not cached yet)
    /// and returns the local directory holding all its files, ready for
    /// [`Loader::hf_dir`](crate::loader::Loader::hf_dir).
    ///
    /// Fails with [`LlamaError::Download`] when a file cannot be fetched (hub unreachable,
    /// gated repository without an accepted license or token, ...).
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::loader::pretrained::TINY_LLAMA_1_1B_CHAT;
    ///
    /// let dir = TINY_LLAMA_1_1B_CHAT.download()?;
    /// println!("TinyLlama is in {}", dir.display());
    /// # Ok(())
    /// # }
    /// ```
    pub fn download(&self) -> Result<PathBuf> {
        let hub = Hub::new(self.repo_id)?;
        // Files already cached are looked up under the revision the cache last saw, new
        // ones are stored under the hub's current one. If the repository changed since an
        // earlier, partial download, the files end up in different snapshot directories;
        // a second pass then fetches the missing ones into the newest snapshot.
        for _ in 0..2 {
            let mut fetched: Vec<(String, PathBuf)> = Vec::new();
            for name in self.initial_files() {
                fetched.push((name.to_string(), hub.fetch(name)?));
            }
            if self.weights == WeightFiles::Sharded {
                let index_path = fetched
                    .iter()
                    .find(|(name, _)| name == WEIGHTS_INDEX_FILE)
                    .map(|(_, path)| path.clone())
                    .ok_or_else(|| LlamaError::Runtime("shard index not fetched".into()))?;
                let index = std::fs::read_to_string(&index_path)
                    .map_err(|e| LlamaError::io(&index_path, e))?;
                for name in shard_files(&index)? {
                    let path = hub.fetch(&name)?;
                    fetched.push((name, path));
                }
            }
            if let Some(dir) = common_snapshot(&fetched) {
                return Ok(dir);
            }
        }
        Err(LlamaError::Download(format!(
            "the files of {} come from different revisions (the repository changed during \
             the download); run again to fetch the current revision",
            self.repo_id
        )))
    }
}

/// The distinct shard files named in the `weight_map` of a `model.safetensors.index.json`,
/// in name order. Names must be relative paths inside the repository.
fn shard_files(index_json: &str) -> Result<Vec<String>> {
    let bad = |msg: String| LlamaError::InvalidFormat(format!("{WEIGHTS_INDEX_FILE}: {msg}"));
    let json: serde_json::Value =
        serde_json::from_str(index_json).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut files = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("the file of `{tensor}` is not a string")))?;
        let inside = !file.is_empty()
            && Path::new(file)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            return Err(bad(format!(
                "`{file}` (for `{tensor}`) is not a path inside the repository"
            )));
        }
        files.push(file.to_string());
    }
    if files.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// The snapshot directory holding a fetched file: `path` minus the components of the
/// file's name within the repository (`original/tokenizer.model` has two).
fn snapshot_dir(name: &str, path: &Path) -> Option<PathBuf> {
    let depth = Path::new(name).components().count();
    path.ancestors().nth(depth).map(Path::to_path_buf)
}

/// The one snapshot directory all fetched files are in, if there is one.
fn common_snapshot(fetched: &[(String, PathBuf)]) -> Option<PathBuf> {
    let mut dirs = fetched.iter().map(|(name, path)| snapshot_dir(name, path));
    let first = dirs.next()??;
    dirs.all(|dir| dir.as_ref() == Some(&first))
        .then_some(first)
}

/// One repository on the hub, with its local cache.
struct Hub {
    repo_id: &'static str,
    cache_dir: PathBuf,
    cached: CacheRepo,
    remote: ApiRepo,
}

impl Hub {
    fn new(repo_id: &'static str) -> Result<Self> {
        // The same cache and endpoint as the other Hugging Face tools.
        let cache = Cache::from_env();
        let mut builder = ApiBuilder::from_cache(cache.clone())
            .with_progress(std::io::stderr().is_terminal())
            .with_retries(3)
            .with_user_agent("llama-burn", env!("CARGO_PKG_VERSION"));
        if let Some(endpoint) = env_var("HF_ENDPOINT") {
            builder = builder.with_endpoint(endpoint);
        }
        // A token in the environment wins over the one saved by `huggingface-cli login`.
        if let Some(token) = env_var("HF_TOKEN").or_else(|| env_var("HUGGING_FACE_HUB_TOKEN")) {
            builder = builder.with_token(Some(token));
        }
        let api = builder.build().map_err(|e| {
            LlamaError::Download(format!("cannot set up the Hugging Face hub client: {e}"))
        })?;
        let repo = Repo::model(repo_id.to_string());
        Ok(Self {
            repo_id,
            cache_dir: cache.path().clone(),
            cached: cache.repo(repo.clone()),
            remote: api.repo(repo),
        })
    }

    /// The local path of `name`, downloading it first unless it is cached.
    fn fetch(&self, name: &str) -> Result<PathBuf> {
        if let Some(path) = self.cached.get(name) {
            return Ok(path);
        }
        eprintln!(
            "llama-burn: downloading {}/{name} into {}",
            self.repo_id,
            self.cache_dir.display()
        );
        self.remote
            .download(name)
            .map_err(|e| download_error(self.repo_id, name, &self.cache_dir, e))
    }
}

/// A non-empty environment variable.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Turns an hf-hub error into a [`LlamaError::Download`] that says what to do about it.
fn download_error(repo_id: &str, file: &str, cache_dir: &Path, err: ApiError) -> LlamaError {
    let what = format!("{repo_id}/{file}");
    let msg = match err {
        ApiError::TooManyRetries(inner) => return download_error(repo_id, file, cache_dir, *inner),
        ApiError::RequestError(e) => {
            let text = e.to_string();
            match (*e).into_response().map(|response| response.status()) {
                Some(401 | 403) => format!(
                    "{what}: access denied ({text}). {repo_id} may be a gated repository: \
                     accept its license at https://huggingface.co/{repo_id}, then set HF_TOKEN \
                     to an access token of that account (or run `huggingface-cli login`)"
                ),
                Some(404) => format!(
                    "{what}: not found ({text}); check the repository, or, if it is gated, \
                     that HF_TOKEN holds a token with access to it"
                ),
                Some(status) => format!("{what}: the hub answered HTTP {status} ({text})"),
                None => format!(
                    "{what}: could not reach the Hugging Face hub ({text}); check the network \
                     connection, the proxy settings (HTTPS_PROXY) or HF_ENDPOINT"
                ),
            }
        }
        ApiError::IoError(e) => format!(
            "{what}: I/O error while saving into the cache {}: {e}",
            cache_dir.display()
        ),
        ApiError::LockAcquisition(path) => format!(
            "{what}: {} is locked: another process is downloading it; wait for it to finish \
             (or remove the lock file if that process is gone)",
            path.display()
        ),
        other => format!("{what}: {other}"),
    };
    LlamaError::Download(msg)
}

/// Downloads a Llama 3 checkpoint and loads it with Meta's tokenizer.
#[cfg(feature = "llama3")]
pub(super) fn load_llama3<B: LlamaBackend>(
    model: &PretrainedModel,
    preset: LlamaConfig,
    max_seq_len: usize,
    device: &B::Device,
) -> Result<Llama<B, DynTokenizer>> {
    // Refuse an impossible context before downloading gigabytes.
    preset.checked_max_seq_len(max_seq_len)?;
    let dir = model.download()?;
    let tokenizer: DynTokenizer = std::sync::Arc::new(Llama3Tokenizer::from_file(
        dir.join("original").join("tokenizer.model"),
    )?);
    let label = format!("loading {}", model.repo_id);
    super::Loader::hf_dir(&dir)
        .tokenizer(tokenizer)
        .max_seq_len(max_seq_len)
        .progress(super::terminal_progress(&label))
        .load(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn sharded_repo_requests_its_files_then_each_shard_once() {
        let index = r#"{
            "metadata": {"total_size": 6425499648},
            "weight_map": {
                "model.norm.weight": "model-00002-of-00002.safetensors",
                "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
                "model.layers.27.mlp.up_proj.weight": "model-00002-of-00002.safetensors"
            }
        }"#;
        let files = LLAMA3_2_3B_INSTRUCT.all_files(Some(index)).unwrap();
        assert_eq!(
            files,
            [
                "config.json",
                "original/tokenizer.model",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ]
        );
        // The index is required for a sharded checkpoint, ignored for a single file.
        assert_err!(
            LLAMA3_2_3B_INSTRUCT.all_files(None),
            LlamaError::InvalidFormat(m) if m.contains("the shard index")
        );
        assert_eq!(
            TINY_LLAMA_1_1B_CHAT.all_files(Some(index)).unwrap(),
            [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "model.safetensors"
            ]
        );
    }

    #[test]
    fn bad_indexes_are_refused() {
        for index in [
            "{",
            r#"{"metadata": {}}"#,
            r#"{"weight_map": {}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {"a": "../../.ssh/id_rsa"}}"#,
            r#"{"weight_map": {"a": "/etc/passwd"}}"#,
            r#"{"weight_map": {"a": ""}}"#,
        ] {
            assert!(
                matches!(shard_files(index), Err(LlamaError::InvalidFormat(_))),
                "{index}"
            );
        }
    }

    #[test]
    fn files_of_one_revision_share_a_snapshot_directory() {
        let snap = Path::new("/cache/models--a--b/snapshots/0123");
        let same = vec![
            ("config.json".to_string(), snap.join("config.json")),
            (
                "original/tokenizer.model".to_string(),
                snap.join("original/tokenizer.model"),
            ),
        ];
        assert_eq!(common_snapshot(&same).as_deref(), Some(snap));
        let mut mixed = same.clone();
        mixed.push((
            "model.safetensors".to_string(),
            Path::new("/cache/models--a--b/snapshots/4567/model.safetensors").to_path_buf(),
        ));
        assert_eq!(common_snapshot(&mixed), None);
    }
}
