//! Key/value storage.
//!
//! - [`KvCache`]: one contiguous cache per request or per batch (rows share a column
//!   axis, left-padded), used by the sequential, concurrent and batched strategies.
//! - [`PagedKvCache`] and [`BlockManager`]: the paged pool of the continuous-batching
//!   engine. The pool holds the tensors (fixed-size blocks, allocated once from the
//!   budget); the block manager decides which block holds what (allocation, sharing,
//!   prefix caching, eviction) and deals only in block ids.

pub mod blocks;
mod contiguous;
pub mod paged;

pub use blocks::{BlockId, BlockManager, PrefixMatch};
pub use contiguous::KvCache;
pub use paged::PagedKvCache;
