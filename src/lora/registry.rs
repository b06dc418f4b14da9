//! The adapters an engine serves, by name, with a bound on how many are held on the
//! device at once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{LoraAdapter, LoraWeights};
use crate::backend::LlamaBackend;
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};

/// What an adapter is, as [`AdapterRegistry::list`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// The name requests select it by.
    pub name: String,
    /// Where it is read from (its path, or the name it was inserted under).
    pub source: String,
    /// The base model its files name, if they do.
    pub base_model: Option<String>,
    /// Its largest rank.
    pub rank: usize,
    /// The modules it changes (`q_proj`, ...).
    pub modules: Vec<&'static str>,
    /// Its fingerprint ([`LoraAdapter::fingerprint`]).
    pub fingerprint: u128,
    /// Whether its factors are on the device now (an adapter with a path may be evicted
    /// and is read again when a request needs it).
    pub loaded: bool,
    /// Bytes its factors take on the device (as f32).
    pub bytes: usize,
}

struct Entry<B: LlamaBackend> {
    /// Where to read it again after an eviction; `None` for an adapter given as values,
    /// which is never evicted.
    path: Option<PathBuf>,
    weights: Option<Arc<LoraWeights<B>>>,
    info: AdapterInfo,
    last_used: u64,
}

struct Inner<B: LlamaBackend> {
    entries: BTreeMap<String, Entry<B>>,
    clock: u64,
}

/// The LoRA adapters of one model, by name: registered from a path (read, checked and
/// uploaded at once) or inserted as values. At most `max_loaded` are held on the device;
/// loading another evicts the least recently used one that no running request holds
/// and that can be read again from its path. Cheap to share (`Arc`); every method takes
/// `&self`.
pub struct AdapterRegistry<B: LlamaBackend> {
    inner: Mutex<Inner<B>>,
    config: LlamaConfig,
    device: B::Device,
    max_loaded: usize,
}

impl<B: LlamaBackend> std::fmt::Debug for AdapterRegistry<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterRegistry")
            .field("adapters", &self.list())
            .field("max_loaded", &self.max_loaded)
            .finish()
    }
}

/// Longest adapter name accepted (it is a request's `model`).
pub const MAX_NAME_BYTES: usize = 256;

impl<B: LlamaBackend> AdapterRegistry<B> {
    /// An empty registry for a model of `config` on `device`, holding at most
    /// `max_loaded` adapters on the device at once.
    pub fn new(config: &LlamaConfig, device: &B::Device, max_loaded: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                entries: BTreeMap::new(),
                clock: 0,
            }),
            config: config.clone(),
            device: device.clone(),
            max_loaded,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<B>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn check_name(name: &str) -> Result<()> {
        if name.is_empty()
            || name.len() > MAX_NAME_BYTES
            || name.chars().any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(LlamaError::invalid(
                "adapter",
                name.chars().take(64).collect::<String>(),
                "an adapter name is 1 to 256 bytes without spaces or control characters",
            ));
        }
        Ok(())
    }

    /// Reads the adapter at `path` ([`LoraAdapter::open`]), checks it against the model
    /// and holds it on the device under `name`, replacing an adapter of that name.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] (`adapter`) for an empty or odd name,
    /// [`LlamaError::InvalidAdapter`] for an adapter that does not fit,
    /// [`LlamaError::Overloaded`] if `max_loaded` adapters are held and all are in use,
    /// and what reading the files reports.
    pub fn register(&self, name: &str, path: impl AsRef<Path>) -> Result<AdapterInfo> {
        Self::check_name(name)?;
        let path = path.as_ref();
        let adapter = LoraAdapter::open(path, &self.config)?;
        self.put(name, Some(path.to_path_buf()), &adapter)
    }

    /// Holds `adapter` on the device under `name` (never evicted: it has no file to be
    /// read again from), replacing an adapter of that name.
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register).
    pub fn insert(&self, name: &str, adapter: &LoraAdapter) -> Result<AdapterInfo> {
        Self::check_name(name)?;
        self.put(name, None, adapter)
    }

    fn put(&self, name: &str, path: Option<PathBuf>, adapter: &LoraAdapter) -> Result<AdapterInfo> {
        let mut inner = self.lock();
        let replacing = inner.entries.get(name).is_some_and(|e| e.weights.is_some());
        if !replacing {
            self.make_room(&mut inner, name)?;
        }
        let weights = Arc::new(LoraWeights::new(adapter, &self.config, &self.device)?);
        let info = AdapterInfo {
            name: name.to_string(),
            source: adapter.source().to_string(),
            base_model: adapter.base_model().map(str::to_owned),
            rank: adapter.rank(),
            modules: adapter.modules(),
            fingerprint: adapter.fingerprint(),
            loaded: true,
            bytes: weights.bytes(),
        };
        inner.clock += 1;
        let last_used = inner.clock;
        inner.entries.insert(
            name.to_string(),
            Entry {
                path,
                weights: Some(weights),
                info: info.clone(),
                last_used,
            },
        );
        Ok(info)
    }

    /// Evicts least recently used adapters until one more fits (not `keep`).
    fn make_room(&self, inner: &mut Inner<B>, keep: &str) -> Result<()> {
        loop {
            let loaded = inner
                .entries
                .values()
                .filter(|e| e.weights.is_some())
                .count();
            if loaded < self.max_loaded {
                return Ok(());
            }
            // Evictable: loaded, readable again, and held by no running request.
            let victim = inner
                .entries
                .iter()
                .filter(|(n, e)| {
                    n.as_str() != keep
                        && e.path.is_some()
                        && e.weights
                            .as_ref()
                            .is_some_and(|w| Arc::strong_count(w) == 1)
                })
                .min_by_key(|(_, e)| e.last_used)
                .map(|(n, _)| n.clone());
            let Some(victim) = victim else {
                return Err(LlamaError::Overloaded {
                    resource: "loaded LoRA adapters",
                    in_use: loaded,
                    requested: 1,
                    limit: self.max_loaded,
                });
            };
            if let Some(e) = inner.entries.get_mut(&victim) {
                e.weights = None;
                e.info.loaded = false;
            }
        }
    }

    /// Forgets the adapter `name`. Requests running with it finish with it.
    ///
    /// # Errors
    ///
    /// [`LlamaError::UnknownAdapter`] if there is none of that name.
    pub fn remove(&self, name: &str) -> Result<()> {
        match self.lock().entries.remove(name) {
            Some(_) => Ok(()),
            None => Err(LlamaError::UnknownAdapter(name.to_string())),
        }
    }

    /// The adapter `name` on the device, read again from its path if it was evicted,
    /// and marked as used now.
    ///
    /// # Errors
    ///
    /// [`LlamaError::UnknownAdapter`] if there is none of that name;
    /// [`LlamaError::Overloaded`] if it must be read again and every held adapter is in
    /// use; what reading it again reports.
    pub fn get(&self, name: &str) -> Result<Arc<LoraWeights<B>>> {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let entry = inner
            .entries
            .get_mut(name)
            .ok_or_else(|| LlamaError::UnknownAdapter(name.to_string()))?;
        entry.last_used = now;
        if let Some(w) = &entry.weights {
            return Ok(w.clone());
        }
        let Some(path) = entry.path.clone() else {
            return Err(LlamaError::UnknownAdapter(name.to_string()));
        };
        self.make_room(&mut inner, name)?;
        let adapter = LoraAdapter::open(&path, &self.config)?;
        let weights = Arc::new(LoraWeights::new(&adapter, &self.config, &self.device)?);
        let entry = inner
            .entries
            .get_mut(name)
            .ok_or_else(|| LlamaError::UnknownAdapter(name.to_string()))?;
        entry.weights = Some(weights.clone());
        entry.info.loaded = true;
        entry.info.fingerprint = weights.fingerprint();
        Ok(weights)
    }

    /// Every adapter, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        self.lock()
            .entries
            .values()
            .map(|e| e.info.clone())
            .collect()
    }

    /// Whether an adapter of that name is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().entries.contains_key(name)
    }

    /// The most adapters held on the device at once.
    pub fn max_loaded(&self) -> usize {
        self.max_loaded
    }
}
