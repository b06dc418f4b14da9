//! The bytes of a weight matrix, backed by transparent huge pages where Linux has them.
//!
//! Decoding one row streams every weight from memory once per token. With 4 KiB pages
//! the hardware prefetchers stop at each page boundary and every 4 KiB costs a TLB
//! miss; a plain read of 667 MB by one core of the development machine ran at 19.5 GB/s
//! on 4 KiB pages and 26-27 GB/s on 2 MiB ones. Linux gives anonymous memory huge pages
//! only where asked (`madvise`, the usual `transparent_hugepage` setting) and only for
//! 2 MiB-aligned ranges, so a matrix of at least 2 MiB gets its own mapping, aligned,
//! marked `MADV_HUGEPAGE` before its pages are first touched. Elsewhere (and if the
//! mapping fails) the bytes are an ordinary vector. The bytes held are the same either
//! way; only their pages differ. The unaligned lead of a mapping is never touched, so it
//! costs address space, not memory.

use std::ops::{Deref, DerefMut};

/// The size (and alignment) of a transparent huge page on x86-64 and most aarch64
/// kernels.
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// Zero-initialised bytes, on huge pages where the OS has them (see the module).
pub(crate) struct WeightBytes(Storage);

enum Storage {
    Heap(Vec<u8>),
    #[cfg(target_os = "linux")]
    Mapped {
        map: memmap2::MmapMut,
        start: usize,
        len: usize,
    },
}

impl WeightBytes {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE
            && let Some(mapped) = Self::mapped(len)
        {
            return mapped;
        }
        Self(Storage::Heap(vec![0; len]))
    }

    /// A fresh anonymous mapping (zeroed by the OS) with a 2 MiB-aligned run of `len`
    /// bytes, marked for huge pages before anything touches it; `None` if the OS refuses.
    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> Option<Self> {
        let map = memmap2::MmapMut::map_anon(len.checked_add(HUGE_PAGE)?).ok()?;
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        // Only a hint: a kernel without transparent huge pages refuses it, and the bytes
        // are as good on small pages.
        let _ = map.advise_range(memmap2::Advice::HugePage, start, len);
        Some(Self(Storage::Mapped { map, start, len }))
    }

    /// Whether the bytes sit in their own huge-page mapping (for tests).
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        !matches!(self.0, Storage::Heap(_))
    }
}

impl Deref for WeightBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Storage::Heap(v) => v,
            #[cfg(target_os = "linux")]
            Storage::Mapped { map, start, len } => &map[*start..*start + *len],
        }
    }
}

impl DerefMut for WeightBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Storage::Heap(v) => v,
            #[cfg(target_os = "linux")]
            Storage::Mapped { map, start, len } => &mut map[*start..*start + *len],
        }
    }
}

impl Clone for WeightBytes {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len());
        copy.copy_from_slice(self);
        copy
    }
}

impl PartialEq for WeightBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_zeroed_writable_and_cloned_on_any_storage() {
        for len in [0, 1, 4096, (2 << 20) + 12345] {
            let mut b = WeightBytes::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 0));
            for (i, v) in b.iter_mut().enumerate() {
                *v = (i % 251) as u8;
            }
            let c = b.clone();
            assert_eq!(c, b);
            assert!(c.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
            #[cfg(target_os = "linux")]
            if len >= HUGE_PAGE {
                assert!(b.is_mapped());
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "aligned");
            }
        }
    }
}
