//! The block manager of the paged KV cache: which block of the pool holds what.
//!
//! It deals only in block ids, never in tensors (the tensors live in
//! [`PagedKvCache`](super::paged::PagedKvCache)), so it is tested without a model.
//!
//! - **Allocation.** Blocks are handed out from a free list; a request owns the blocks of
//!   its block table and gives them back with [`BlockManager::free`].
//! - **Prefix caching.** A block whose every slot is computed can be *registered* under
//!   the hash of its tokens and of everything before them (a hash chain, so equal blocks
//!   after different prefixes never match). A new request then reuses the registered
//!   blocks of its longest cached prefix ([`BlockManager::match_prefix`]) instead of
//!   recomputing them. A block is shared by reference count; when the last user frees it
//!   it stays cached (with its contents) until the pool needs room, and the least
//!   recently used cached block is evicted first.
//! - **Accounting.** Every block is exactly one of: in use (referenced), cached (registered,
//!   unreferenced, evictable) or free; [`BlockManager::check_invariants`] proves it.
//!
//! - **Persistence.** With [`BlockManager::record_registrations`] on, every newly
//!   registered block is also listed for [`BlockManager::take_registered`] (the engine
//!   copies those to disk), and [`BlockManager::insert_cached`] registers a block whose
//!   contents came from disk; hits on such blocks are counted apart
//!   ([`BlockManager::disk_hit_tokens`]).
//!
//! A key is the 128-bit chain hash of the prefix before the block *and* the block's
//! tokens themselves, compared exactly: a lookup can only be wrong if two different
//! prefixes collide on 128 bits. The chain hash is XXH3-128, a specified function, so a
//! chain written to disk by one build reads the same in the next.

use std::collections::{BTreeMap, HashMap};

/// Index of a block in the pool.
pub type BlockId = u32;

/// The 128-bit hash of a prefix: every token up to the end of a block.
pub type PrefixHash = u128;

/// Identity of a full block: the prefix before it and its own tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: PrefixHash,
    tokens: Vec<u32>,
}

impl BlockKey {
    /// The chain hash of the prefix that ends with this block.
    fn chain_hash(&self) -> PrefixHash {
        chain_hash(self.parent, &self.tokens)
    }
}

/// The chain hash of the prefix that ends with a block of `tokens` after the prefix
/// `parent`: XXH3-128 of `parent` and the tokens, little-endian.
pub fn chain_hash(parent: PrefixHash, tokens: &[u32]) -> PrefixHash {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&parent.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest128()
}

/// A block registered in the prefix cache, as [`BlockManager::take_registered`] lists
/// it: where it is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredBlock {
    /// The block.
    pub id: BlockId,
    /// The chain hash of the prefix before it (the partition's salt for a first block).
    pub parent: PrefixHash,
    /// Its tokens (`block_size` of them).
    pub tokens: Vec<u32>,
    /// The chain hash of the prefix it ends.
    pub hash: PrefixHash,
    /// Its place in its sequence (0 for the first block).
    pub depth: usize,
}

/// The full blocks of `tokens`, which follow the prefix whose hash is `parent`: each
/// block's key and the chain hash of the prefix it ends. The one walk of the hash chain.
fn block_keys(
    tokens: &[u32],
    block_size: usize,
    mut parent: PrefixHash,
) -> impl Iterator<Item = (BlockKey, PrefixHash)> + '_ {
    tokens.chunks_exact(block_size.max(1)).map(move |chunk| {
        let key = BlockKey {
            parent,
            tokens: chunk.to_vec(),
        };
        parent = key.chain_hash();
        (key, parent)
    })
}

/// The hash chain of a token sequence: one [`PrefixHash`] per full block.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<PrefixHash> {
    block_keys(tokens, block_size, 0)
        .map(|(_, hash)| hash)
        .collect()
}

#[derive(Debug, Clone, Default)]
struct BlockInfo {
    refs: u32,
    /// Set while the block is registered in the prefix cache.
    key: Option<BlockKey>,
    /// When it was last released (for least-recently-used eviction).
    released_at: u64,
    /// Its contents were read from disk ([`BlockManager::insert_cached`]).
    from_disk: bool,
}

/// Allocation, sharing and prefix caching of the pool's blocks.
#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<BlockInfo>,
    /// Unregistered, unreferenced blocks (a stack: the most recently freed is reused first).
    free: Vec<BlockId>,
    /// Registered, unreferenced blocks by release time (oldest first).
    evictable: BTreeMap<u64, BlockId>,
    /// Registered blocks by key.
    cached: HashMap<BlockKey, BlockId>,
    clock: u64,
    hit_tokens: u64,
    disk_hit_tokens: u64,
    evictions: u64,
    /// Newly registered blocks, kept while recording is on.
    registered: Option<Vec<RegisteredBlock>>,
}

/// A request's reuse of cached blocks found by [`BlockManager::match_prefix`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The reused blocks, in order; the request now holds a reference to each.
    pub blocks: Vec<BlockId>,
    /// Tokens covered (`blocks.len() * block_size`).
    pub tokens: usize,
    /// Of those, tokens in blocks read from disk.
    pub disk_tokens: usize,
}

impl BlockManager {
    /// A manager for `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        let count = u32::try_from(num_blocks).unwrap_or(u32::MAX);
        Self {
            block_size: block_size.max(1),
            prefix_caching,
            blocks: vec![BlockInfo::default(); count as usize],
            // Reversed so that block 0 is handed out first.
            free: (0..count).rev().collect(),
            evictable: BTreeMap::new(),
            cached: HashMap::new(),
            clock: 0,
            hit_tokens: 0,
            disk_hit_tokens: 0,
            evictions: 0,
            registered: None,
        }
    }

    /// Lists every block registered from now on for [`take_registered`](Self::take_registered)
    /// (the engine's copy to disk). Off by default.
    pub fn record_registrations(&mut self, on: bool) {
        self.registered = on.then(Vec::new);
    }

    /// The blocks registered since the last call (none when recording is off). Their
    /// contents are complete; a block may have been freed since, never reused (a
    /// registered block is reused only after it is evicted, which takes a step).
    pub fn take_registered(&mut self) -> Vec<RegisteredBlock> {
        self.registered
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Registers a free block as holding `tokens` (a full block) after the prefix
    /// `parent`, unreferenced and evictable, for contents the caller writes into it
    /// (read from disk). Returns it, or `None` when prefix caching is off, `tokens` is
    /// not one block, no block is free (cached ones are not evicted for this), or the
    /// prefix is cached already.
    pub fn insert_cached(&mut self, parent: PrefixHash, tokens: &[u32]) -> Option<BlockId> {
        if !self.prefix_caching || tokens.len() != self.block_size {
            return None;
        }
        let key = BlockKey {
            parent,
            tokens: tokens.to_vec(),
        };
        if self.cached.contains_key(&key) {
            return None;
        }
        let id = self.free.pop()?;
        self.clock += 1;
        let info = &mut self.blocks[id as usize];
        info.key = Some(key.clone());
        info.released_at = self.clock;
        info.from_disk = true;
        self.evictable.insert(self.clock, id);
        self.cached.insert(key, id);
        Some(id)
    }

    /// Prompt tokens served from blocks read from disk so far (part of
    /// [`hit_tokens`](Self::hit_tokens)).
    pub fn disk_hit_tokens(&self) -> u64 {
        self.disk_hit_tokens
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now: free ones plus cached ones nobody uses.
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one request.
    pub fn in_use(&self) -> usize {
        self.blocks.len() - self.available()
    }

    /// Registered blocks nobody uses (kept for prefix hits, evicted when room is needed).
    pub fn cached_unused(&self) -> usize {
        self.evictable.len()
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Prompt tokens served from the prefix cache so far.
    pub fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// Cached blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Finds the longest cached prefix of `tokens` made of full blocks, leaving at least
    /// one token uncached (its logits are needed), and takes a reference to each of its
    /// blocks. Returns no blocks when prefix caching is off.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixMatch {
        self.match_prefix_salted(tokens, 0)
    }

    /// [`match_prefix`](Self::match_prefix) in the cache partition `salt`: the hash
    /// chain starts from `salt` instead of 0, so blocks registered under another salt
    /// (by [`register_full_blocks`](Self::register_full_blocks) with that salt as the
    /// first parent) never match. Tenants that must not learn each other's prompts get
    /// different salts.
    pub fn match_prefix_salted(&mut self, tokens: &[u32], salt: PrefixHash) -> PrefixMatch {
        if !self.prefix_caching || tokens.len() < 2 {
            return PrefixMatch::default();
        }
        let usable = (tokens.len() - 1) / self.block_size;
        let mut blocks = Vec::new();
        for (key, _) in block_keys(tokens, self.block_size, salt).take(usable) {
            let Some(&id) = self.cached.get(&key) else {
                break;
            };
            blocks.push(id);
        }
        let mut from_disk = 0;
        for &id in &blocks {
            self.take_ref(id);
            from_disk += usize::from(self.blocks[id as usize].from_disk);
        }
        let tokens = blocks.len() * self.block_size;
        self.hit_tokens += tokens as u64;
        self.disk_hit_tokens += (from_disk * self.block_size) as u64;
        PrefixMatch {
            blocks,
            tokens,
            disk_tokens: from_disk * self.block_size,
        }
    }

    /// Undoes a [`match_prefix`](Self::match_prefix) whose request could not be admitted
    /// after all: releases the references and uncounts the hit.
    pub fn unmatch(&mut self, hit: &PrefixMatch) {
        self.free(&hit.blocks);
        self.hit_tokens = self.hit_tokens.saturating_sub(hit.tokens as u64);
        self.disk_hit_tokens = self.disk_hit_tokens.saturating_sub(hit.disk_tokens as u64);
    }

    /// Hands out `n` blocks (evicting least recently used cached blocks if the free list
    /// runs short), or none at all if fewer than `n` are available.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = match self.free.pop() {
                Some(id) => id,
                None => self.evict_one()?,
            };
            self.blocks[id as usize].refs = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Gives back a request's references to `blocks` (in table order). Unreferenced
    /// registered blocks stay cached; the others return to the free list. Blocks later in
    /// the table are released as older, so a prefix outlives its continuations.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let Some(info) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if info.refs == 0 {
                continue;
            }
            info.refs -= 1;
            if info.refs > 0 {
                continue;
            }
            if info.key.is_some() {
                self.clock += 1;
                info.released_at = self.clock;
                self.evictable.insert(self.clock, id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Registers full blocks of a request for prefix caching: `table[i]` holds tokens
    /// `i * block_size..(i + 1) * block_size` of `tokens`, and every slot of the first
    /// `computed` tokens holds its keys and values. Blocks already registered (or whose
    /// content another block already provides) are skipped. Cheap to call every step:
    /// it starts at block `from` and returns where to start next time.
    pub fn register_full_blocks(
        &mut self,
        tokens: &[u32],
        table: &[BlockId],
        computed: usize,
        from: usize,
        parent_of_from: PrefixHash,
    ) -> (usize, PrefixHash) {
        if !self.prefix_caching {
            return (from, parent_of_from);
        }
        let full = (computed.min(tokens.len()) / self.block_size).min(table.len());
        if full <= from {
            return (from, parent_of_from);
        }
        let fresh = &tokens[from * self.block_size..full * self.block_size];
        let mut parent = parent_of_from;
        for (i, (key, hash)) in (from..).zip(block_keys(fresh, self.block_size, parent_of_from)) {
            parent = hash;
            let id = table[i];
            let info = &self.blocks[id as usize];
            if info.key.is_none() && !self.cached.contains_key(&key) {
                if let Some(list) = &mut self.registered {
                    list.push(RegisteredBlock {
                        id,
                        parent: key.parent,
                        tokens: key.tokens.clone(),
                        hash,
                        depth: i,
                    });
                }
                self.cached.insert(key.clone(), id);
                self.blocks[id as usize].key = Some(key);
            }
        }
        (full, parent)
    }

    fn take_ref(&mut self, id: BlockId) {
        let info = &mut self.blocks[id as usize];
        if info.refs == 0 {
            self.evictable.remove(&info.released_at);
        }
        info.refs += 1;
    }

    fn evict_one(&mut self) -> Option<BlockId> {
        let (_, id) = self.evictable.pop_first()?;
        let info = &mut self.blocks[id as usize];
        info.from_disk = false;
        if let Some(key) = info.key.take() {
            self.cached.remove(&key);
        }
        self.evictions += 1;
        Some(id)
    }

    /// Checks the accounting: every block is exactly one of in use, cached-unused or
    /// free, and the prefix map points at registered blocks. For tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = vec![0u8; self.blocks.len()];
        for &id in &self.free {
            let info = &self.blocks[id as usize];
            if info.refs != 0 || info.key.is_some() {
                return Err(format!("free block {id} is referenced or registered"));
            }
            seen[id as usize] += 1;
        }
        for &id in self.evictable.values() {
            let info = &self.blocks[id as usize];
            if info.refs != 0 || info.key.is_none() {
                return Err(format!(
                    "evictable block {id} is referenced or unregistered"
                ));
            }
            seen[id as usize] += 1;
        }
        for (id, info) in self.blocks.iter().enumerate() {
            let expected = u8::from(info.refs == 0);
            if seen[id] != expected {
                return Err(format!("block {id} is counted {} times", seen[id]));
            }
        }
        for (key, &id) in &self.cached {
            if self.blocks[id as usize].key.as_ref() != Some(key) {
                return Err(format!("prefix map points at block {id} with another key"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    #[test]
    fn allocate_and_free_account_for_every_block() {
        let mut m = BlockManager::new(8, 4, false);
        let a = m.allocate(3).unwrap();
        let b = m.allocate(5).unwrap();
        assert_eq!((m.in_use(), m.available()), (8, 0));
        assert!(m.allocate(1).is_none(), "the pool is exhausted");
        m.free(&a);
        assert_eq!((m.in_use(), m.available()), (5, 3));
        assert!(m.allocate(4).is_none(), "all-or-nothing");
        assert_eq!(m.allocate(3).unwrap().len(), 3);
        m.free(&b);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_registered_prefix_is_found_and_shared() {
        let mut m = BlockManager::new(16, 4, true);
        let prompt = seq(10, 100); // two full blocks and a partial one
        let table = m.allocate(3).unwrap();
        let (next, _) = m.register_full_blocks(&prompt, &table, 10, 0, 0);
        assert_eq!(next, 2, "only full blocks are registered");
        // Another request with the same first 9 tokens and a different tail.
        let mut other = prompt[..9].to_vec();
        other.extend([7, 7, 7]);
        let hit = m.match_prefix(&other);
        assert_eq!(hit.blocks, table[..2].to_vec());
        assert_eq!(hit.tokens, 8);
        assert_eq!(m.hit_tokens(), 8);
        // Shared, not copied: freeing the first owner keeps them in use.
        m.free(&table);
        assert_eq!(m.in_use(), 2);
        m.free(&hit.blocks);
        assert_eq!((m.in_use(), m.cached_unused()), (0, 2));
        m.check_invariants().unwrap();
    }

    #[test]
    fn the_last_token_is_never_served_from_cache() {
        let mut m = BlockManager::new(8, 4, true);
        let prompt = seq(8, 1);
        let table = m.allocate(2).unwrap();
        m.register_full_blocks(&prompt, &table, 8, 0, 0);
        // The same 8 tokens: only the first block may be reused, so one token is computed.
        let hit = m.match_prefix(&prompt);
        assert_eq!(hit.tokens, 4);
        m.free(&hit.blocks);
        m.free(&table);
        m.check_invariants().unwrap();
    }

    #[test]
    fn equal_blocks_after_different_prefixes_do_not_match() {
        let mut m = BlockManager::new(8, 2, true);
        let a = vec![1, 2, 3, 4, 9];
        let table = m.allocate(3).unwrap();
        m.register_full_blocks(&a, &table, 5, 0, 0);
        // Second block [3, 4] is the same, the first differs.
        let b = vec![5, 6, 3, 4, 9];
        assert_eq!(m.match_prefix(&b), PrefixMatch::default());
        m.free(&table);
        m.check_invariants().unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_used_first() {
        let mut m = BlockManager::new(4, 2, true);
        let old = m.allocate(2).unwrap();
        m.register_full_blocks(&[1, 2, 3, 4], &old, 4, 0, 0);
        m.free(&old);
        let young = m.allocate(2).unwrap();
        m.register_full_blocks(&[5, 6, 7, 8], &young, 4, 0, 0);
        m.free(&young);
        assert_eq!((m.available(), m.cached_unused()), (4, 4));
        // Two blocks are needed: both blocks of the older prefix are evicted.
        let fresh = m.allocate(2).unwrap();
        assert_eq!(m.evictions(), 2);
        assert!(
            fresh.iter().all(|b| old.contains(b)),
            "{fresh:?} vs {old:?}"
        );
        assert_eq!(m.match_prefix(&[1, 2, 3, 4, 0]).tokens, 0);
        let hit = m.match_prefix(&[5, 6, 7, 8, 0]);
        assert_eq!(hit.tokens, 4, "the recently used prefix survived");
        m.free(&hit.blocks);
        m.free(&fresh);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_takes_a_cached_block_out_of_the_evictable_set() {
        let mut m = BlockManager::new(3, 2, true);
        let t = m.allocate(1).unwrap();
        m.register_full_blocks(&[1, 2], &t, 2, 0, 0);
        m.free(&t);
        let hit = m.match_prefix(&[1, 2, 3]);
        assert_eq!(hit.blocks, t);
        // Two blocks left to allocate; the shared one may not be evicted under us.
        assert!(m.allocate(3).is_none());
        let rest = m.allocate(2).unwrap();
        assert!(!rest.contains(&t[0]));
        m.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_content_registers_once() {
        let mut m = BlockManager::new(4, 2, true);
        let a = m.allocate(1).unwrap();
        let b = m.allocate(1).unwrap();
        m.register_full_blocks(&[1, 2], &a, 2, 0, 0);
        m.register_full_blocks(&[1, 2], &b, 2, 0, 0);
        m.free(&a);
        m.free(&b);
        // One is cached, the duplicate went straight back to the free list.
        assert_eq!(m.cached_unused(), 1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_caching_off_never_matches() {
        let mut m = BlockManager::new(4, 2, false);
        let t = m.allocate(2).unwrap();
        m.register_full_blocks(&[1, 2, 3, 4], &t, 4, 0, 0);
        m.free(&t);
        assert_eq!(m.match_prefix(&[1, 2, 3, 4, 5]).tokens, 0);
        assert_eq!(m.cached_unused(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn registrations_are_recorded_and_blocks_from_disk_are_found_and_counted() {
        let mut m = BlockManager::new(8, 2, true);
        m.record_registrations(true);
        let prompt = [1, 2, 3, 4, 5];
        let t = m.allocate(3).unwrap();
        m.register_full_blocks(&prompt, &t, 5, 0, 0);
        let listed = m.take_registered();
        let hashes = prefix_hashes(&prompt, 2);
        assert_eq!(listed.len(), 2);
        assert_eq!(
            (listed[1].id, listed[1].parent, listed[1].depth),
            (t[1], hashes[0], 1)
        );
        assert_eq!(
            (listed[1].tokens.clone(), listed[1].hash),
            (vec![3, 4], hashes[1])
        );
        assert!(m.take_registered().is_empty(), "taken once");

        // A second manager (a restart) given those blocks from disk.
        let mut n = BlockManager::new(4, 2, true);
        for b in &listed {
            assert!(n.insert_cached(b.parent, &b.tokens).is_some());
        }
        assert_eq!(
            n.insert_cached(listed[0].parent, &listed[0].tokens),
            None,
            "once"
        );
        assert_eq!(n.insert_cached(0, &[1]), None, "not a whole block");
        assert_eq!(n.cached_unused(), 2);
        let hit = n.match_prefix(&[1, 2, 3, 4, 9]);
        assert_eq!(
            (hit.tokens, hit.disk_tokens, n.disk_hit_tokens()),
            (4, 4, 4)
        );
        n.free(&hit.blocks);
        // The two free blocks are all insert_cached takes: cached ones are not evicted.
        assert!(n.insert_cached(0, &[7, 7]).is_some());
        assert!(n.insert_cached(0, &[8, 8]).is_some());
        assert_eq!(n.insert_cached(0, &[9, 9]), None);
        // Evicted and reused, a block no longer counts as from disk.
        let all = n.allocate(4).unwrap();
        n.free(&all);
        assert_eq!(n.match_prefix(&[1, 2, 3, 4, 9]).disk_tokens, 0);
        n.check_invariants().unwrap();
    }

    #[test]
    fn chain_hashes_depend_on_the_whole_prefix() {
        let a = prefix_hashes(&[1, 2, 3, 4], 2);
        let b = prefix_hashes(&[9, 2, 3, 4], 2);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
        assert_eq!(a, prefix_hashes(&[1, 2, 3, 4, 5], 2));
    }
}
