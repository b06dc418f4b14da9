//! Key/value storage.
//!
//! - [`KvCache`]: one contiguous cache per request or per batch (rows share a column
//!   axis, left-padded), used by the sequential, concurrent and batched strategies.
//! - [`PagedKvCache`] and [`BlockManager`]: the paged pool of the continuous-batching
//!   engine. The pool holds the tensors (fixed-size blocks, allocated once from the
//!   budget); the block manager decides which block holds what (allocation, sharing,
//!   prefix caching, eviction) and deals only in block ids.
//! - [`KvCacheType`]: how the pool stores keys and values (the activations' float type,
//!   f16, bf16, `q8_0`, `q4_0`).
//! - [`PrefixCacheDisk`]: the prefix cache's copy on disk, read back when an engine
//!   starts ([`disk`]).
//! - [`KvBudget`], [`KvLimits`]: how much KV memory a store or a set of per-request
//!   caches may take.

pub mod blocks;
mod budget;
mod contiguous;
pub mod disk;
pub(crate) mod host;
mod kv_type;
pub mod paged;

pub use blocks::{BlockId, BlockManager, PrefixMatch};
pub(crate) use budget::KvLedger;
pub use budget::{KvBudget, KvLimits, KvReservation, KvUsage};
pub use contiguous::KvCache;
pub use disk::{PrefixCacheDisk, fingerprint_files};
pub use kv_type::{KvCacheType, KvCacheTypes};
pub use paged::PagedKvCache;
