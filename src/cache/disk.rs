//! The prefix cache on disk: full KV blocks written to a directory as they are
//! registered, and read back into the pool when an engine starts, so a restart keeps
//! the prefixes it had computed.
//!
//! One file per block, named by a hash of the writer's identity and the block's chain
//! hash (`{identity:016x}-{hash:032x}.kvb`, so caches of different models or types
//! share a directory without overwriting each other):
//!
//! | field | bytes | meaning |
//! | --- | --- | --- |
//! | magic | 8 | `LBKVBLK1` |
//! | model | 16 | the model's fingerprint ([`PrefixCacheDisk::model`]) |
//! | identity | 4 + n | what computed the block: crate version, backend, precision, SIMD path, the pool's layout and cache types |
//! | depth | 4 | the block's place in its sequence |
//! | parent | 16 | the chain hash of the prefix before it (the tenant's salt for a first block) |
//! | hash | 16 | the chain hash of the prefix it ends |
//! | tokens | 4 + 4 n | its tokens |
//! | payload | 8 + n | the block's keys and values ([`PagedKvCache::read_block`]) |
//! | checksum | 8 | XXH3-64 of everything before it |
//!
//! A file whose model, identity or payload size differ from the engine's, whose hash
//! does not follow from its parent and tokens, or whose checksum fails is refused with a
//! log line and never used; the engine starts either way. Files are written by a thread
//! of their own through a bounded queue (a full queue drops the block: a step never
//! waits for the disk), to a temporary name and renamed, so a crash leaves no half file
//! under a block's name. The directory's blocks for this identity stay within
//! [`PrefixCacheDisk::max_bytes`]: the oldest files go first.

use std::collections::{HashSet, VecDeque};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::SystemTime;

use crossbeam_channel::{Sender, TrySendError};

/// The chain hashes of the blocks on disk or queued for it.
type Known = Arc<std::sync::Mutex<HashSet<PrefixHash>>>;

fn lock(known: &Known) -> std::sync::MutexGuard<'_, HashSet<PrefixHash>> {
    known
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

use super::blocks::{BlockManager, PrefixHash, RegisteredBlock, chain_hash};
use super::paged::PagedKvCache;
use crate::error::{LlamaError, Result};

const MAGIC: &[u8; 8] = b"LBKVBLK1";
const EXTENSION: &str = "kvb";
/// Longest identity string and most tokens a header may claim: a damaged length field
/// cannot make the reader allocate more.
const MAX_IDENTITY: usize = 4096;
const MAX_TOKENS: usize = 65_536;
/// Bytes of blocks waiting for the writer thread, at most.
const QUEUE_BYTES: usize = 64 << 20;

/// Where and how much of the prefix cache is kept on disk
/// ([`ContinuousConfig::prefix_cache_disk`](crate::inference::ContinuousConfig::prefix_cache_disk)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCacheDisk {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// Most bytes of block files kept there for this model and cache layout.
    pub max_bytes: u64,
    /// The model's fingerprint: blocks written for another are refused. See
    /// [`fingerprint_files`].
    pub model: u128,
}

impl PrefixCacheDisk {
    /// A cache in `dir` of at most `max_bytes`, for the model whose fingerprint is
    /// `model`.
    pub fn new(dir: impl Into<PathBuf>, max_bytes: u64, model: u128) -> Self {
        Self {
            dir: dir.into(),
            max_bytes,
            model,
        }
    }
}

/// The fingerprint of a model: XXH3-128 of the contents of `paths` (a GGUF file, or
/// every file of a Hugging Face directory, in name order) and of `variant` (how the
/// loader changes the weights, such as a quantization asked for at load).
///
/// # Errors
///
/// [`LlamaError::Io`] if a file cannot be read.
pub fn fingerprint_files(paths: &[PathBuf], variant: &str) -> Result<u128> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut inner: Vec<PathBuf> = fs::read_dir(path)
                .map_err(|e| LlamaError::io(path, e))?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            inner.sort();
            files.extend(inner);
        } else {
            files.push(path.clone());
        }
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(variant.as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut file = fs::File::open(&path).map_err(|e| LlamaError::io(&path, e))?;
        loop {
            let n = file.read(&mut buf).map_err(|e| LlamaError::io(&path, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.digest128())
}

/// Why a block file was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Written for another model.
    OtherModel,
    /// Written by another version, backend, precision or cache layout (the identity it
    /// records).
    OtherLayout(String),
    /// Cut short, a bad length, a hash that does not follow from its contents, or a
    /// failed checksum.
    Damaged(&'static str),
    /// It could not be read.
    Unreadable(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::OtherModel => write!(f, "written for another model"),
            Refusal::OtherLayout(id) => write!(f, "written by another configuration ({id})"),
            Refusal::Damaged(why) => write!(f, "damaged ({why})"),
            Refusal::Unreadable(e) => write!(f, "unreadable ({e})"),
        }
    }
}

/// One block as a file holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockFile {
    depth: u32,
    parent: PrefixHash,
    hash: PrefixHash,
    tokens: Vec<u32>,
    payload: Vec<u8>,
}

/// What identifies the writer of a block: the model and everything else that changes
/// its bits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    model: u128,
    layout: String,
    payload_bytes: usize,
}

fn encode(id: &Identity, block: &BlockFile) -> Vec<u8> {
    let mut out = Vec::with_capacity(block.payload.len() + id.layout.len() + 128);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&id.model.to_le_bytes());
    out.extend_from_slice(&(id.layout.len() as u32).to_le_bytes());
    out.extend_from_slice(id.layout.as_bytes());
    out.extend_from_slice(&block.depth.to_le_bytes());
    out.extend_from_slice(&block.parent.to_le_bytes());
    out.extend_from_slice(&block.hash.to_le_bytes());
    out.extend_from_slice(&(block.tokens.len() as u32).to_le_bytes());
    for t in &block.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(block.payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&block.payload);
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// A little-endian reader over a file's bytes that reports a short file.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], Refusal> {
        if self.0.len() < n {
            return Err(Refusal::Damaged("cut short"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], Refusal> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> std::result::Result<u32, Refusal> {
        self.array().map(u32::from_le_bytes)
    }

    fn u128(&mut self) -> std::result::Result<u128, Refusal> {
        self.array().map(u128::from_le_bytes)
    }
}

/// Reads the header fields up to the tokens, checking the identity; returns the depth
/// and what follows.
fn decode(bytes: &[u8], id: &Identity) -> std::result::Result<BlockFile, Refusal> {
    let mut c = Cursor(bytes);
    if c.take(MAGIC.len())? != MAGIC {
        return Err(Refusal::Damaged("not a block file"));
    }
    if c.u128()? != id.model {
        return Err(Refusal::OtherModel);
    }
    let layout_len = c.u32()? as usize;
    if layout_len > MAX_IDENTITY {
        return Err(Refusal::Damaged("identity too long"));
    }
    let layout = c.take(layout_len)?;
    if layout != id.layout.as_bytes() {
        return Err(Refusal::OtherLayout(
            String::from_utf8_lossy(layout).into_owned(),
        ));
    }
    let depth = c.u32()?;
    let parent = c.u128()?;
    let hash = c.u128()?;
    let n = c.u32()? as usize;
    if n > MAX_TOKENS {
        return Err(Refusal::Damaged("too many tokens"));
    }
    let tokens = c
        .take(n * 4)?
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect::<Vec<_>>();
    let len = u64::from_le_bytes(c.array()?);
    if len != id.payload_bytes as u64 {
        return Err(Refusal::Damaged("payload of another size"));
    }
    let payload = c.take(id.payload_bytes)?.to_vec();
    let body = bytes.len() - c.0.len();
    let sum = u64::from_le_bytes(c.array()?);
    if !c.0.is_empty() {
        return Err(Refusal::Damaged("trailing bytes"));
    }
    if xxhash_rust::xxh3::xxh3_64(&bytes[..body]) != sum {
        return Err(Refusal::Damaged("checksum"));
    }
    if chain_hash(parent, &tokens) != hash {
        return Err(Refusal::Damaged("hash does not follow from the tokens"));
    }
    Ok(BlockFile {
        depth,
        parent,
        hash,
        tokens,
        payload,
    })
}

impl Identity {
    /// The file name of block `hash` written by this identity: the identity's own hash
    /// first, so that caches of different models or types share a directory without
    /// overwriting each other's blocks of the same tokens.
    fn file_name(&self, hash: PrefixHash) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&self.model.to_le_bytes());
        h.update(self.layout.as_bytes());
        format!("{:016x}-{hash:032x}.{EXTENSION}", h.digest())
    }
}

/// Reads `path` if it is no longer than a block file of `id` can be (a longer one is
/// read only as far as its identity, to say whose it is).
fn read_file(path: &Path, id: &Identity) -> std::result::Result<BlockFile, Refusal> {
    let most = (id.payload_bytes + MAX_IDENTITY + MAX_TOKENS * 4 + 128) as u64;
    let unreadable = |e: std::io::Error| Refusal::Unreadable(e.to_string());
    let len = fs::metadata(path).map_err(unreadable)?.len();
    if len > most {
        let mut head = vec![0u8; MAGIC.len() + 16 + 4 + MAX_IDENTITY];
        let mut file = fs::File::open(path).map_err(unreadable)?;
        file.read_exact(&mut head).map_err(unreadable)?;
        return match decode(&head, id) {
            Err(whose @ (Refusal::OtherModel | Refusal::OtherLayout(_))) => Err(whose),
            _ => Err(Refusal::Damaged("too long")),
        };
    }
    let bytes = fs::read(path).map_err(unreadable)?;
    let block = decode(&bytes, id)?;
    if path.file_name().and_then(|n| n.to_str()) != Some(id.file_name(block.hash).as_str()) {
        return Err(Refusal::Damaged("named for another block"));
    }
    Ok(block)
}

/// Counters of the disk cache, shared with its writer thread.
#[derive(Debug, Default)]
pub(crate) struct DiskStats {
    /// Blocks read into the pool at start.
    pub(crate) loaded: AtomicU64,
    /// Files refused at start.
    pub(crate) refused: AtomicU64,
    /// Blocks written.
    pub(crate) written: AtomicU64,
    /// Blocks not written: the queue was full, or the write failed.
    pub(crate) dropped: AtomicU64,
}

/// The engine's side of the disk cache: loads at start, queues registered blocks for
/// the writer thread, and waits for it when dropped (so a shutdown finishes its files).
pub(crate) struct PrefixDisk {
    queue: Option<Sender<BlockFile>>,
    writer: Option<JoinHandle<()>>,
    /// Blocks on disk or queued, so a block is copied once (the writer forgets those it
    /// removes: the set is as bounded as the directory).
    known: Known,
    /// The counters, shared with the writer.
    pub(crate) stats: Arc<DiskStats>,
}

impl std::fmt::Debug for PrefixDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixDisk")
            .field("known", &lock(&self.known).len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl PrefixDisk {
    /// Opens `config.dir` for a pool `cache` computed by `identity` (everything but the
    /// model and the pool's layout that changes a block's bits), reads the valid blocks
    /// of this model and layout into free blocks of the pool (registered in `blocks`,
    /// first blocks first), reports each refused file on stderr, and starts the writer.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Io`] if the directory cannot be created or listed.
    pub(crate) fn open<B: crate::backend::LlamaBackend>(
        config: &PrefixCacheDisk,
        identity: &str,
        blocks: &mut BlockManager,
        cache: &mut PagedKvCache<B>,
    ) -> Result<Self> {
        let dir = config.dir.clone();
        fs::create_dir_all(&dir).map_err(|e| LlamaError::io(&dir, e))?;
        let id = Identity {
            model: config.model,
            layout: format!("{identity}; {}", cache.layout_tag()),
            payload_bytes: cache.block_bytes(),
        };
        let stats = Arc::new(DiskStats::default());
        // Every block file with its size, oldest first.
        let mut files: Vec<(SystemTime, PathBuf, u64)> = fs::read_dir(&dir)
            .map_err(|e| LlamaError::io(&dir, e))?
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name.starts_with('.') && name.ends_with(".kvb.tmp") {
                    // A write cut short by a crash: never renamed, never read.
                    let _ = fs::remove_file(p);
                }
                p.extension().and_then(|e| e.to_str()) == Some(EXTENSION)
            })
            .map(|p| {
                let meta = fs::metadata(&p).ok();
                let at = meta.as_ref().and_then(|m| m.modified().ok());
                let size = meta.map_or(0, |m| m.len());
                (at.unwrap_or(SystemTime::UNIX_EPOCH), p, size)
            })
            .collect();
        files.sort();
        // Every file is checked (and a refused one reported) before any is loaded;
        // then the newest valid blocks that fit in the pool are read again, one file in
        // memory at a time, deepest first, so that the least recently used end of the
        // cache holds continuations rather than the prefixes they need.
        let mut valid: Vec<(u32, usize, PathBuf)> = Vec::new();
        let mut index = VecDeque::new();
        let mut known = HashSet::new();
        for (age, (_, path, size)) in files.into_iter().enumerate() {
            match read_file(&path, &id) {
                Ok(block) => {
                    index.push_back((block.hash, size));
                    known.insert(block.hash);
                    valid.push((block.depth, age, path));
                }
                Err(why) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "llama-burn: prefix cache file {} refused: {why}; not used",
                        path.display()
                    );
                }
            }
        }
        let room = blocks.available();
        let mut chosen = valid.split_off(valid.len().saturating_sub(room));
        chosen.sort_by_key(|&(depth, age, _)| (std::cmp::Reverse(depth), age));
        for (_, _, path) in chosen {
            let Ok(block) = read_file(&path, &id) else {
                continue;
            };
            if let Some(at) = blocks.insert_cached(block.parent, &block.tokens) {
                cache.write_block(at, &block.payload)?;
                stats.loaded.fetch_add(1, Ordering::Relaxed);
            }
        }
        let capacity = (QUEUE_BYTES / id.payload_bytes.max(1)).clamp(1, 1024);
        let (queue, jobs) = crossbeam_channel::bounded::<BlockFile>(capacity);
        let known: Known = Arc::new(std::sync::Mutex::new(known));
        let writer = Writer {
            dir,
            id,
            max_bytes: config.max_bytes,
            index,
            known: known.clone(),
            stats: stats.clone(),
        };
        let writer = std::thread::Builder::new()
            .name("llama-burn-prefix-disk".into())
            .spawn(move || writer.run(jobs))
            .map_err(|e| LlamaError::Runtime(format!("the prefix cache writer: {e}")))?;
        Ok(Self {
            queue: Some(queue),
            writer: Some(writer),
            known,
            stats,
        })
    }

    /// Queues the blocks `registered` (their contents read from `cache` now) for the
    /// writer, skipping those on disk already. Never waits: a full queue drops a block.
    pub(crate) fn offer<B: crate::backend::LlamaBackend>(
        &mut self,
        registered: Vec<RegisteredBlock>,
        cache: &PagedKvCache<B>,
    ) {
        let Some(queue) = &self.queue else {
            return;
        };
        for block in registered {
            if queue.is_full() {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if !lock(&self.known).insert(block.hash) {
                continue;
            }
            let Ok(payload) = cache.read_block(block.id) else {
                lock(&self.known).remove(&block.hash);
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let file = BlockFile {
                depth: u32::try_from(block.depth).unwrap_or(u32::MAX),
                parent: block.parent,
                hash: block.hash,
                tokens: block.tokens,
                payload,
            };
            if let Err(TrySendError::Full(file) | TrySendError::Disconnected(file)) =
                queue.try_send(file)
            {
                lock(&self.known).remove(&file.hash);
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for PrefixDisk {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it has written what was queued.
        self.queue = None;
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// The writer thread's state: this identity's files on disk, oldest first.
struct Writer {
    dir: PathBuf,
    id: Identity,
    max_bytes: u64,
    index: VecDeque<(PrefixHash, u64)>,
    known: Known,
    stats: Arc<DiskStats>,
}

impl Writer {
    fn run(mut self, jobs: crossbeam_channel::Receiver<BlockFile>) {
        self.trim(0);
        for block in jobs {
            match self.write(&block) {
                Ok(true) => {
                    self.stats.written.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {
                    lock(&self.known).remove(&block.hash);
                }
                Err(e) => {
                    lock(&self.known).remove(&block.hash);
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    eprintln!("llama-burn: a prefix cache block was not written: {e}");
                }
            }
        }
    }

    /// Writes one block under its name, making room first; `false` if it can never fit.
    fn write(&mut self, block: &BlockFile) -> std::io::Result<bool> {
        let bytes = encode(&self.id, block);
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return Ok(false);
        }
        self.trim(size);
        let name = self.id.file_name(block.hash);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        {
            let mut file = fs::File::create(&tmp)?;
            file.write_all(&bytes)?;
        }
        fs::rename(&tmp, self.dir.join(&name))?;
        self.index.push_back((block.hash, size));
        Ok(true)
    }

    /// Removes the oldest files until `incoming` more bytes fit in the budget.
    fn trim(&mut self, incoming: u64) {
        let mut total: u64 = self.index.iter().map(|&(_, s)| s).sum();
        while total + incoming > self.max_bytes {
            let Some((hash, size)) = self.index.pop_front() else {
                break;
            };
            let _ = fs::remove_file(self.dir.join(self.id.file_name(hash)));
            lock(&self.known).remove(&hash);
            total -= size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            model: 7,
            layout: "test layout".into(),
            payload_bytes: 16,
        }
    }

    fn block(parent: PrefixHash, tokens: Vec<u32>) -> BlockFile {
        BlockFile {
            depth: 1,
            parent,
            hash: chain_hash(parent, &tokens),
            tokens,
            payload: (0..16).collect(),
        }
    }

    #[test]
    fn a_block_file_reads_back_and_every_kind_of_damage_is_refused() {
        let id = identity();
        let b = block(3, vec![1, 2, 3, 4]);
        let bytes = encode(&id, &b);
        assert_eq!(decode(&bytes, &id), Ok(b.clone()));
        let other_model = Identity {
            model: 8,
            ..identity()
        };
        assert_eq!(decode(&bytes, &other_model), Err(Refusal::OtherModel));
        let other_layout = Identity {
            layout: "keys q8_0".into(),
            ..identity()
        };
        assert_eq!(
            decode(&bytes, &other_layout),
            Err(Refusal::OtherLayout("test layout".into()))
        );
        let mut flipped = bytes.clone();
        let at = flipped.len() - 12; // inside the payload
        flipped[at] ^= 1;
        assert_eq!(decode(&flipped, &id), Err(Refusal::Damaged("checksum")));
        assert_eq!(
            decode(&bytes[..bytes.len() - 1], &id),
            Err(Refusal::Damaged("cut short"))
        );
        // A file whose hash is not its parent's and tokens' (written by mistake or made
        // up) is refused even with a good checksum.
        let mut forged = b.clone();
        forged.tokens[0] = 9;
        assert_eq!(
            decode(&encode(&id, &forged), &id),
            Err(Refusal::Damaged("hash does not follow from the tokens"))
        );
    }

    #[test]
    fn the_writer_keeps_its_files_within_the_budget_oldest_out_first() {
        let dir = std::env::temp_dir().join(format!("llama-burn-disk-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let id = identity();
        let one = encode(&id, &block(0, vec![1])).len() as u64;
        let mut w = Writer {
            dir: dir.clone(),
            id: id.clone(),
            max_bytes: 2 * one,
            index: VecDeque::new(),
            known: Arc::default(),
            stats: Arc::default(),
        };
        let blocks: Vec<BlockFile> = (0..3).map(|i| block(0, vec![i])).collect();
        for b in &blocks {
            assert!(w.write(b).unwrap());
        }
        let path = |b: &BlockFile| dir.join(id.file_name(b.hash));
        assert!(!path(&blocks[0]).exists(), "the oldest file made room");
        assert!(path(&blocks[1]).exists() && path(&blocks[2]).exists());
        assert_eq!(read_file(&path(&blocks[2]), &id), Ok(blocks[2].clone()));
        // Another identity names the same block differently.
        let other = Identity {
            layout: "other".into(),
            ..identity()
        };
        assert_ne!(
            other.file_name(blocks[2].hash),
            id.file_name(blocks[2].hash)
        );
        // A file renamed to another block's name is refused.
        fs::rename(path(&blocks[1]), path(&blocks[0])).unwrap();
        assert_eq!(
            read_file(&path(&blocks[0]), &id),
            Err(Refusal::Damaged("named for another block"))
        );
        // A file longer than a block file is refused without being read whole, and
        // another identity's still says whose it is.
        let mut long = encode(&id, &blocks[2]);
        long.resize(1 << 20, 0);
        fs::write(path(&blocks[2]), &long).unwrap();
        assert_eq!(
            read_file(&path(&blocks[2]), &id),
            Err(Refusal::Damaged("too long"))
        );
        let mine = Identity {
            model: 9,
            ..identity()
        };
        assert_eq!(
            read_file(&path(&blocks[2]), &mine),
            Err(Refusal::OtherModel)
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
