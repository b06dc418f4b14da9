//! A fork-join pool for the CPU kernels whose helper threads spin between jobs.
//!
//! A decode step of the demo model splits about 180 kernel calls across the cores, a few
//! tens of microseconds apart. Rayon's idle workers yield, then sleep on a futex; each
//! split then waits for a sleeping thread to be woken, which on a virtual machine costs
//! as much as the work split (one row decoded on 2 cores ran at 1.5x one core's speed).
//! Here the helpers spin on an atomic counter for a short while after each job
//! ([`SPIN`]), so the next split starts at once, and park when nothing comes.
//!
//! One caller holds the pool at a time. Another thread that asks meanwhile (a second
//! request decoding on its own thread, or a kernel called from inside a job) runs its
//! chunks on rayon's pool instead, so callers never wait for each other.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a helper spins for the next job before it parks (unless
/// `LLAMA_BURN_SPIN_US` says otherwise): longer than the gaps inside a decode step, short
/// enough that an idle process leaves the cores within a millisecond.
const SPIN: Duration = Duration::from_micros(300);

/// One split: `chunks` calls of `f`, handed out by a shared counter.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Runs chunks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.chunks {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// What the caller and the helpers share.
struct Pool {
    /// Held by the caller whose job is running.
    busy: AtomicBool,
    /// The running job (null between jobs); its lifetime is the caller's call.
    job: AtomicPtr<Job<'static>>,
    /// Bumped for every job: the helpers watch it.
    epoch: AtomicU64,
    /// Helpers that may be reading `job`.
    working: AtomicUsize,
    /// Whether each helper is parked (or about to park).
    parked: Vec<AtomicBool>,
    /// The helpers, to unpark them.
    threads: OnceLock<Vec<Thread>>,
    /// How long helpers spin before parking.
    spin: Duration,
}

/// The pool, started on first use with one helper per rayon thread but one (none on a
/// single thread).
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    *POOL.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0 {
            return None;
        }
        let spin = std::env::var("LLAMA_BURN_SPIN_US")
            .ok()
            .and_then(|us| us.parse().ok())
            .map_or(SPIN, Duration::from_micros);
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            busy: AtomicBool::new(false),
            job: AtomicPtr::new(ptr::null_mut()),
            epoch: AtomicU64::new(0),
            working: AtomicUsize::new(0),
            parked: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
            threads: OnceLock::new(),
            spin,
        }));
        let mut threads = Vec::with_capacity(helpers);
        for me in 0..helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("llama-burn-kernel-{me}"))
                .spawn(move || helper(pool, me));
            match spawned {
                Ok(handle) => threads.push(handle.thread().clone()),
                // No thread to be had: run without the pool (rayon's instead).
                Err(_) => return None,
            }
        }
        // Every helper was spawned, so `threads` is set exactly once here.
        let _ = pool.threads.set(threads);
        Some(pool)
    })
}

/// A helper's life: wait for a new epoch (spinning, then parked), help with its job.
fn helper(pool: &'static Pool, me: usize) {
    let mut seen = pool.epoch.load(Ordering::Acquire);
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = pool.epoch.load(Ordering::SeqCst);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && idle_since.elapsed() > pool.spin {
                // Say so before looking once more: a caller that bumps the epoch after
                // this look sees the flag and unparks us.
                pool.parked[me].store(true, Ordering::SeqCst);
                if pool.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park();
                }
                pool.parked[me].store(false, Ordering::SeqCst);
                idle_since = Instant::now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Counted as working before reading the job, so the caller (which clears the job
        // and then waits for no helper to be working) never frees a job being read.
        pool.working.fetch_add(1, Ordering::SeqCst);
        let job = pool.job.load(Ordering::SeqCst);
        if !job.is_null() {
            // SAFETY: the caller keeps the job alive until `working` is back to 0.
            unsafe { &*job }.work();
        }
        pool.working.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Spins until `ready()`, yielding the core now and then (a thread it waits for may
/// need it).
fn wait_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Forward passes running now (see [`ForwardPass`]).
static FORWARDS: AtomicUsize = AtomicUsize::new(0);

/// Marks a forward pass as running while it lives. While more than one runs (requests
/// decoded on their own threads), every split runs on its caller's thread: the cores
/// are busy with the passes already, and splitting them too only adds hand-overs (with
/// the pool's helper spinning beside two passes, 8 concurrent requests ran 12% slower).
pub(crate) struct ForwardPass(());

impl ForwardPass {
    /// Counts a pass in until the value is dropped.
    pub(crate) fn start() -> Self {
        FORWARDS.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for ForwardPass {
    fn drop(&mut self) {
        FORWARDS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Calls `f(0)`, ..., `f(chunks - 1)`, on this thread and the pool's helpers (or on
/// rayon's pool when another caller holds this one; or on this thread alone while
/// several forward passes run), and returns when all are done.
///
/// # Panics
///
/// If a call of `f` panicked.
pub(crate) fn for_each_chunk(chunks: usize, f: &(dyn Fn(usize) + Sync)) {
    let alone = FORWARDS.load(Ordering::Relaxed) <= 1;
    let Some(pool) = pool().filter(|_| chunks > 1 && alone) else {
        (0..chunks).for_each(f);
        return;
    };
    if pool
        .busy
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        (0..chunks).into_par_iter().for_each(f);
        return;
    }
    let job = Job {
        f,
        chunks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    // SAFETY (of the erased lifetime): the job is cleared below, and this call waits for
    // every helper to stop reading it, before `job` goes out of scope.
    let erased = ptr::from_ref(&job).cast_mut().cast::<Job<'static>>();
    pool.job.store(erased, Ordering::SeqCst);
    pool.epoch.fetch_add(1, Ordering::SeqCst);
    if let Some(threads) = pool.threads.get() {
        for (thread, parked) in threads.iter().zip(&pool.parked) {
            if parked.load(Ordering::SeqCst) {
                thread.unpark();
            }
        }
    }
    job.work();
    wait_until(|| job.done.load(Ordering::Acquire) >= chunks);
    pool.job.store(ptr::null_mut(), Ordering::SeqCst);
    wait_until(|| pool.working.load(Ordering::SeqCst) == 0);
    pool.busy.store(false, Ordering::Release);
    assert!(
        !job.panicked.load(Ordering::Relaxed),
        "a CPU kernel panicked on a pool thread"
    );
}

/// Calls `f(start, end)` for the runs `0..per`, `per..2 * per`, ... of `0..n` (the last
/// one shorter), split as [`for_each_chunk`] splits its chunks.
///
/// # Panics
///
/// If a call of `f` panicked.
pub(crate) fn for_each_run(n: usize, per: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    let per = per.max(1);
    for_each_chunk(n.div_ceil(per), &|c| f(c * per, ((c + 1) * per).min(n)));
}

/// A buffer whose disjoint parts the chunks of one split write, each its own.
pub(crate) struct Disjoint<T>(*mut T);

// SAFETY: the chunks write disjoint parts (the contract of `part`) of a buffer that
// outlives the split.
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    /// The buffer, to be split.
    pub(crate) fn new(buffer: &mut [T]) -> Self {
        Self(buffer.as_mut_ptr())
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    ///
    /// They lie inside the buffer, which is still alive, and no other chunk reads or
    /// writes them while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn part(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_from_many_callers() {
        let callers: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..200 {
                        let chunks = 1 + (round + t) % 9;
                        let hits: Vec<AtomicUsize> =
                            (0..chunks).map(|_| AtomicUsize::new(0)).collect();
                        for_each_chunk(chunks, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.join().unwrap();
        }
    }

    #[test]
    fn runs_cover_every_index_once_in_order_within_each() {
        for n in [0, 1, 7, 64, 1000, 1025] {
            for per in [0, 1, 3, 64, 1024, 5000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for_each_run(n, per, &|start, end| {
                    assert!(start < end && end <= n && end - start <= per.max(1));
                    for h in &hits[start..end] {
                        h.fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "{n} {per}"
                );
            }
        }
    }

    #[test]
    fn a_nested_split_runs_and_a_panic_reaches_the_caller() {
        let total = AtomicUsize::new(0);
        for_each_chunk(3, &|_| {
            for_each_chunk(4, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let caught = catch_unwind(|| {
            for_each_chunk(4, &|i| assert!(i != 2, "chunk 2 fails"));
        });
        // The caller's thread panics with the chunk's own message (run here or on rayon's
        // pool) or the pool's report of a helper's panic.
        let payload = caught.expect_err("the chunk's panic reaches the caller");
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned());
        assert!(
            matches!(
                message.as_deref(),
                Some("chunk 2 fails" | "a CPU kernel panicked on a pool thread")
            ),
            "{message:?}"
        );
        // The pool still works afterwards.
        let after = AtomicUsize::new(0);
        for_each_chunk(5, &|_| {
            after.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(after.load(Ordering::Relaxed), 5);
    }
}
