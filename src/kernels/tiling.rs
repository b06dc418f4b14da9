//! Tiling helpers shared by the CPU kernels' drivers (`cpu`, `int8`) and their SIMD
//! files (`avx512`, `avx2`, `neon`), which sit above this module and never import each
//! other's drivers.

/// Most activation rows of any path's tile (the size of a tile's output).
pub(crate) const MAX_TILE_ROWS: usize = 8;

/// The output `[rows, n_out]` that the column chunks write into, each its own columns.
pub(crate) struct Columns {
    pub(crate) out: *mut f32,
    pub(crate) n_out: usize,
}

// SAFETY: every chunk writes only its own columns `start..end` of each row (disjoint
// ranges of the buffer), and the buffer outlives the parallel loop that writes it.
unsafe impl Sync for Columns {}

impl Columns {
    /// The columns of `out`'s spare capacity, `n_out` values a row: for a caller that
    /// writes every value and then sets the length (a product's output of many rows is
    /// megabytes, which zeroing first costs a pass over, 2.5% of a prefill).
    pub(crate) fn spare(out: &mut Vec<f32>, n_out: usize) -> Self {
        Self {
            out: out.spare_capacity_mut().as_mut_ptr().cast(),
            n_out,
        }
    }

    /// Where row `r`'s column `col` is, for a kernel that stores its results itself.
    ///
    /// # Safety
    ///
    /// Inside the buffer; what is written there follows [`Columns::write`]'s contract.
    pub(crate) unsafe fn at(&self, r: usize, col: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.out.add(r * self.n_out + col) }
    }

    /// Writes `values` at row `r`, columns `col..col + values.len()`.
    ///
    /// # Safety
    ///
    /// Inside the buffer, and no other thread writes those columns of that row.
    pub(crate) unsafe fn write(&self, r: usize, col: usize, values: &[f32]) {
        // SAFETY: the caller's contract.
        unsafe {
            let at = self.out.add(r * self.n_out + col);
            #[cfg(target_arch = "x86_64")]
            if values.len() == 16 {
                // A panel's sixteen values (the common case): four vector stores, not a
                // call to `memcpy` per 64 bytes (6% of a prefill's samples, which now
                // fall on the stores' cache misses instead). Written as four stores, not
                // a loop: a 64-byte copy (or a loop the compiler takes for one) is merged
                // with the copy below into a call to `memcpy` of either length.
                use std::arch::x86_64::{_mm_loadu_ps, _mm_storeu_ps};
                let v = values.as_ptr();
                _mm_storeu_ps(at, _mm_loadu_ps(v));
                _mm_storeu_ps(at.add(4), _mm_loadu_ps(v.add(4)));
                _mm_storeu_ps(at.add(8), _mm_loadu_ps(v.add(8)));
                _mm_storeu_ps(at.add(12), _mm_loadu_ps(v.add(12)));
                return;
            }
            std::ptr::copy_nonoverlapping(values.as_ptr(), at, values.len());
        }
    }
}

/// Row tiles `r0..r1` covering `0..rows`, as few as tiles of at most `most` rows allow
/// and balanced so that none is much smaller than the others (32 rows in tiles of up to 6
/// are 6, 6, 5, 5, 5, 5, not five of 6 and one of 2).
pub(crate) fn balanced_row_tiles(rows: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = rows.div_ceil(most.max(1));
    (0..tiles).map(move |t| (rows * t / tiles, rows * (t + 1) / tiles))
}

/// Boundaries `b[0] = 0 < b[1] < ... = units` of the chunks that a product of `units`
/// column units splits into for `threads` threads, guided: each chunk a `1 / (2 *
/// threads)` share of what is left (at least `least` units), so the first chunks are
/// large (few hand-overs, long sequential streams of weights) and the last ones small
/// (a thread that finishes waits for at most a small chunk of the other's).
pub(crate) fn guided_chunks(units: usize, threads: usize, least: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut done = 0;
    while done < units {
        let left = units - done;
        done += left.div_ceil(2 * threads.max(1)).max(least).min(left);
        bounds.push(done);
    }
    bounds
}

/// How far ahead (in bytes) the x86 kernels ask for a weight group's next bytes.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 1024;

/// Asks for the bytes [`PREFETCH_BYTES`] past a group's step at `step`: three lines, as
/// a step of Q4_1 is 160 bytes. A group's bytes come from memory, read once per product.
/// Measured by alternating runs of `benchmark_concurrency --strategies batched`: in the
/// AVX-512 dequantization (32 rows) 494 -> 516 tokens/s with three lines against none; in
/// the AVX-512 fused kernel (4 rows) 283 -> 310 with three lines against two.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_step(step: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    for line in 0..3 {
        let at = step.wrapping_add(PREFETCH_BYTES + 64 * line).cast();
        // SAFETY: SSE is part of every x86-64 CPU, and a prefetch is a hint: any address
        // is allowed.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
    }
}

/// Asks for share `part` of `parts` of `bytes` (whole lines) into the second-level
/// cache: a panel kernel spreads the next panel's weights over its row tiles this way,
/// so they come from memory while the tiles compute rather than when the panel is
/// decoded. A hint only; off x86-64 it does nothing.
#[inline(always)]
pub(crate) fn prefetch_share(bytes: &[u8], part: usize, parts: usize) {
    let lines = bytes.len().div_ceil(64);
    let per = lines.div_ceil(parts.max(1));
    let (from, to) = ((part * per).min(lines), ((part + 1) * per).min(lines));
    #[cfg(target_arch = "x86_64")]
    for line in from..to {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: SSE is part of every x86-64 CPU; the line starts inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(64 * line).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (from, to);
}

/// The fewest whole steps of `len` bytes (at least a line) that make `bytes`, in bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn whole_steps_ahead(len: usize, bytes: usize) -> usize {
    let len = len.max(64);
    len * bytes.div_ceil(len)
}

/// Where and how far ahead the in-register kernels ask for their weights.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupPrefetchSetting {
    /// The least distance, in bytes, past the step being read (0: the step itself).
    pub(crate) bytes: usize,
    /// Into the second-level cache (`prefetcht1`) instead of the first (`prefetcht0`).
    pub(crate) into_l2: bool,
}

/// This machine's [`GroupPrefetchSetting`]: its entry in [`prefetch_for`], with
/// `LLAMA_BURN_PREFETCH_BYTES=N` for the distance and `LLAMA_BURN_PREFETCH_LEVEL=1` or
/// `2` for the cache level where they are set. Read once per process.
#[cfg(target_arch = "x86_64")]
pub(crate) fn group_prefetch() -> GroupPrefetchSetting {
    static SETTING: std::sync::OnceLock<GroupPrefetchSetting> = std::sync::OnceLock::new();
    *SETTING.get_or_init(|| {
        let env = |key: &str| -> Option<usize> { std::env::var(key).ok()?.trim().parse().ok() };
        let machine = prefetch_for(cpu_vendor_family_model());
        GroupPrefetchSetting {
            bytes: env("LLAMA_BURN_PREFETCH_BYTES").unwrap_or(machine.bytes),
            into_l2: env("LLAMA_BURN_PREFETCH_LEVEL").map_or(machine.into_l2, |level| level == 2),
        }
    })
}

/// The prefetch setting for a CPU (vendor, family, model): 16 KiB ahead into the
/// second-level cache on AMD's Zen 4 (family 0x19, models 0x10-0x1F, 0x60-0x7F and
/// 0xA0-0xAF; Zen 3 shares the family and was not measured), 4 KiB into the first on Zen
/// 5 and later (0x1A), 1 KiB into the first elsewhere.
///
/// Measured on a 2-core Zen 5 EPYC (family 0x1A, 2026-12-01) with `one_row_step FILE 20
/// fast 1`, each format's products at one row against a plain read of their bytes, one
/// binary with the distance alternated: Q6_K at 75-80% of the read with one step (1.6
/// KiB) ahead, 86% at 2.6 KiB, 92-96% at two steps (3.3 KiB), 100-102% at three or four;
/// Q4_K 92-94% at one or two steps (1.1-2.3 KiB), 101-104% at three or four (3.4-4.6
/// KiB); Q4_0 97-102% -> 104-112% and Q8_0 98-113% -> 101-107% at 4 KiB.
///
/// On a 2-core Zen 4 EPYC (family 0x19, model 0x11, 2026-12-02) whose plain read ran at
/// 25-35 GB/s, one step ahead into the first level held Q4_K at 70-95% of the read and
/// Q6_K at 55-75%; further into the first level fell off the cliff that
/// [`GroupPrefetch::new`] describes (Q6_K 44-48% at 3 KiB). Into the second level, the
/// same command: 45-54% at 1 KiB, 75-84% at 4-6 KiB, Q6_K 74-105% and Q4_K 79-114% at
/// 12-32 KiB. Whole model, one row, three alternated rounds of `benchmark_concurrency
/// --requests 1 --max-tokens 48 --strategies batched`,
/// the build before against this one (medians, tokens/s): 1B Q4_K_M 29.9 -> 35.6, Q5_K_M
/// 25.4 -> 38.3, Q6_K 23.6 -> 27.8, Q4_0 41.8 -> 47.5, Q8_0 26.4 -> 26.0, 3B Q4_K_M 12.1
/// -> 13.7. Intel machines keep 1 KiB into the first level, as measured before.
#[cfg(target_arch = "x86_64")]
pub(crate) fn prefetch_for(cpu: (CpuVendor, u32, u32)) -> GroupPrefetchSetting {
    let (bytes, into_l2) = match cpu {
        (CpuVendor::Amd, 0x19, 0x10..=0x1F | 0x60..=0x7F | 0xA0..=0xAF) => (16 * 1024, true),
        (CpuVendor::Amd, family, _) if family >= 0x1A => (4096, false),
        _ => (1024, false),
    };
    GroupPrefetchSetting { bytes, into_l2 }
}

/// A CPU's maker, as far as the kernels' tuning tells them apart.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuVendor {
    /// `AuthenticAMD`.
    Amd,
    /// `GenuineIntel`.
    Intel,
    /// Any other.
    Other,
}

/// This CPU's maker, family and model (CPUID leaf 1: the base family, plus the extended
/// family when the base is 0xF; the base model, plus the extended model times 16 when
/// the base family is 0x6 or 0xF).
#[cfg(target_arch = "x86_64")]
pub(crate) fn cpu_vendor_family_model() -> (CpuVendor, u32, u32) {
    use std::arch::x86_64::__cpuid;
    // SAFETY: CPUID is part of every x86-64 CPU; leaves 0 and 1 always exist.
    #[allow(unused_unsafe)]
    let (vendor, sig) = unsafe { (__cpuid(0), __cpuid(1).eax) };
    let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    let vendor = match &name[..] {
        b"AuthenticAMD" => CpuVendor::Amd,
        b"GenuineIntel" => CpuVendor::Intel,
        _ => CpuVendor::Other,
    };
    let base = (sig >> 8) & 0xF;
    let family = if base == 0xF {
        base + ((sig >> 20) & 0xFF)
    } else {
        base
    };
    let model = if base == 0x6 || base == 0xF {
        ((sig >> 4) & 0xF) | (((sig >> 16) & 0xF) << 4)
    } else {
        (sig >> 4) & 0xF
    };
    (vendor, family, model)
}

/// Asks for later group steps of `len` bytes than the one being read, whole, a line at a
/// time, as far past it as [`GroupPrefetch::new`] says. The distance is worked out once,
/// where a group's loop over its steps begins, not at every step.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct GroupPrefetch {
    /// Bytes per step.
    len: usize,
    /// Bytes past a step at which its later step is asked for.
    ahead: usize,
    /// Into the second-level cache instead of the first.
    into_l2: bool,
}

#[cfg(target_arch = "x86_64")]
impl GroupPrefetch {
    /// For steps of `len` bytes, asked for this far ahead: the fewest whole steps that
    /// make at least the machine's [`GroupPrefetchSetting::bytes`] (on most machines 1
    /// KiB: one step of Q4_K, Q5_K or Q6_K; eight of Q4_0). Each group step is
    /// prefetched whole, all of its lines: the weights stream from memory once per
    /// product, and the kernel's work between loads hides the hardware prefetcher's
    /// stride.
    ///
    /// Measured with `one_row_step FILE 6` (each format's products at one row beside a
    /// plain read of their bytes, two threads, alternated, 3 rounds) on Zen 4: a fixed 2
    /// KiB held Q4_K at 78-98% and Q6_K at 77-86% of the read, one step ahead 91-103% and
    /// 95-99% (Q4_0 and Q8_0 at the read either way). More lines in flight than that fall
    /// off a cliff there: Q6_K at 1.5 steps (2.5 KiB) read at 51%. Before, without any
    /// hint, Q4_K_M decoded at 29.4-30.4 tokens/s and with 2 KiB at 37.4-39.6 (`generate
    /// --json`). That cliff is the first-level cache's: into the second level, far ahead,
    /// it is gone ([`prefetch_for`]).
    #[inline(always)]
    pub(crate) fn new(len: usize) -> Self {
        let setting = group_prefetch();
        Self {
            len,
            ahead: whole_steps_ahead(len, setting.bytes),
            into_l2: setting.into_l2,
        }
    }

    /// Asks for the step `ahead` bytes past the one at `step` ([`GroupPrefetch::new`]),
    /// into the machine's cache level (one branch per step, the same way every time).
    #[inline(always)]
    pub(crate) fn ask(self, step: *const u8) {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        let at = step.wrapping_add(self.ahead);
        let mut line = 0;
        while line < self.len {
            // SAFETY: SSE is part of every x86-64 CPU, and a prefetch is a hint: any
            // address is allowed.
            unsafe {
                if self.into_l2 {
                    _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(line).cast());
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast());
                }
            }
            line += 64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_prefetch_distance_is_the_machines() {
        // Zen 4 (family 0x19) asks 16 KiB ahead into the second-level cache; Zen 5 (0x1A)
        // and later 4 KiB into the first; Intel, older AMD and others 1 KiB into the first.
        let table = [
            // Zen 4: family 0x19, models 0x10-0x1F, 0x60-0x7F, 0xA0-0xAF.
            ((CpuVendor::Amd, 0x19, 0x11), 16384, true),
            ((CpuVendor::Amd, 0x19, 0x61), 16384, true),
            ((CpuVendor::Amd, 0x19, 0xA0), 16384, true),
            // Zen 3 shares the family (models 0x00-0x0F, 0x20-0x5F) and keeps 1 KiB.
            ((CpuVendor::Amd, 0x19, 0x01), 1024, false),
            ((CpuVendor::Amd, 0x19, 0x21), 1024, false),
            // Zen 5 and later.
            ((CpuVendor::Amd, 0x1A, 0x02), 4096, false),
            ((CpuVendor::Amd, 0x1B, 0x00), 4096, false),
            // Zen 2, Intel and other makers.
            ((CpuVendor::Amd, 0x17, 0x31), 1024, false),
            ((CpuVendor::Intel, 6, 0x8F), 1024, false),
            ((CpuVendor::Other, 0x1A, 0x11), 1024, false),
        ];
        for (cpu, bytes, into_l2) in table {
            let want = GroupPrefetchSetting { bytes, into_l2 };
            assert_eq!(prefetch_for(cpu), want, "{cpu:?}");
        }
        // Whole group steps (8 rows) of at least that many bytes: Q6_K's 1,680-byte steps
        // three ahead at 4 KiB and one at 1 KiB, Q4_K's 1,152 four and one, Q4_0's 144
        // twenty-nine and eight; a step under a line counts as a line; 0 is the step itself.
        assert_eq!(whole_steps_ahead(1680, 4096), 3 * 1680);
        assert_eq!(whole_steps_ahead(1680, 1024), 1680);
        assert_eq!(whole_steps_ahead(1152, 4096), 4 * 1152);
        assert_eq!(whole_steps_ahead(1152, 1024), 1152);
        assert_eq!(whole_steps_ahead(144, 4096), 29 * 144);
        assert_eq!(whole_steps_ahead(144, 1024), 8 * 144);
        assert_eq!(whole_steps_ahead(10, 1024), 1024);
        assert_eq!(whole_steps_ahead(1680, 0), 0);
        assert_eq!(
            GroupPrefetch::new(1680).ahead,
            whole_steps_ahead(1680, group_prefetch().bytes)
        );
        // This machine is read as what /proc/cpuinfo says (Linux only).
        if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
            let (vendor, family, model) = cpu_vendor_family_model();
            let field = |key: &str| {
                info.lines()
                    .find(|l| l.starts_with(key))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|v| v.trim().to_string())
            };
            if let Some(f) = field("cpu family") {
                assert_eq!(f.parse::<u32>().ok(), Some(family));
            }
            if let Some(m) = field("model\t") {
                assert_eq!(m.parse::<u32>().ok(), Some(model));
            }
            match field("vendor_id").as_deref() {
                Some("AuthenticAMD") => assert_eq!(vendor, CpuVendor::Amd),
                Some("GenuineIntel") => assert_eq!(vendor, CpuVendor::Intel),
                _ => {}
            }
        }
    }

    #[test]
    fn guided_chunks_cover_every_unit_once_shrinking() {
        for units in [0, 1, 2, 5, 16, 128, 3072] {
            for threads in [1, 2, 3, 16] {
                let b = guided_chunks(units, threads, 2);
                assert_eq!((b[0], *b.last().unwrap()), (0, units));
                let sizes: Vec<usize> = b.windows(2).map(|w| w[1] - w[0]).collect();
                assert!(sizes.iter().all(|&s| s > 0));
                assert!(sizes.windows(2).all(|w| w[1] <= w[0]), "{sizes:?}");
            }
        }
        assert_eq!(guided_chunks(128, 2, 2).len() - 1, 13);
    }
}
