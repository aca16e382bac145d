//! All locks and atomics of the resources come from here, so that the same code is
//! model-checked by loom (`RUSTFLAGS="--cfg loom" cargo test -p streampool --lib loom`,
//! or `make test-loom`) and runs on `std` otherwise.

// A menu: not every item is used by every configuration of the crate.
#![allow(unused_imports)]

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks a mutex, recovering it if a panicking thread poisoned it (the data the
/// resources keep behind locks stays consistent at every unlock).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read-locks an `RwLock`, recovering it from poisoning as [`lock`] does.
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// Read-locks an `RwLock` if no writer holds it now (recovering it from poisoning).
pub(crate) fn try_read<T>(l: &RwLock<T>) -> Option<RwLockReadGuard<'_, T>> {
    tried(l.try_read())
}

/// Locks a mutex if it is free now (recovering it from poisoning).
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    tried(m.try_lock())
}

/// The guard of a lock tried: `None` when it would wait; a poisoned lock is recovered as
/// [`lock`] does.
fn tried<G>(result: std::sync::TryLockResult<G>) -> Option<G> {
    match result {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Write-locks an `RwLock`, recovering it from poisoning as [`lock`] does.
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// Runs a loom model with at most 5 preemptions per execution, so that the models finish
/// in seconds (unbounded, the adaptors' models take minutes, and pass);
/// `LOOM_MAX_PREEMPTIONS` in the environment overrides the bound.
#[cfg(all(test, loom))]
pub(crate) fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(5, f)
}

/// [`model`] with at most `preemptions` preemptions per execution (unless
/// `LOOM_MAX_PREEMPTIONS` says otherwise): for a model whose threads run long paths (a
/// release), which a bound of 5 makes take minutes.
#[cfg(all(test, loom))]
pub(crate) fn model_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(preemptions);
    }
    // The pool's models run its real shard lock, whose waiters spin (yielding to loom on
    // every turn): more branches per execution than loom's default of 1000 allows.
    builder.max_branches = builder.max_branches.max(50_000);
    builder.check(f);
}

/// The lock of a stream's shard: state that one thread uses almost always, for tens of
/// nanoseconds at a time. Taking it is one atomic exchange and releasing it a plain store,
/// where std's mutex needs an atomic read-modify-write for each. What that saves is small:
/// on the H200's host (a Xeon VM), a build whose shard lock was a plain store differed by
/// less than the host's noise, and the lock and the thread-local look-up each cost at most
/// about 10 % of a pool operation (`benchmarks/RESULTS.md`, "Commit f68cb39"). A waiter
/// spins briefly, then yields its time slice until the lock is free. The same code runs
/// under loom, on loom's atomics and its tracked cell, so that the models check this lock
/// itself (mutual exclusion, and the Acquire/Release pair ordering the guarded accesses).
pub(crate) struct ShardLock<T> {
    locked: AtomicBool,
    value: ShardCell<T>,
}

#[cfg(loom)]
type ShardCell<T> = loom::cell::UnsafeCell<T>;
#[cfg(not(loom))]
type ShardCell<T> = std::cell::UnsafeCell<T>;

// SAFETY: the value is reached only through a `ShardGuard`, and `locked` lets one guard
// exist at a time (Acquire on taking, Release on giving back order the accesses).
unsafe impl<T: Send> Sync for ShardLock<T> {}

impl<T> ShardLock<T> {
    pub(crate) fn new(value: T) -> Self {
        ShardLock { locked: AtomicBool::new(false), value: ShardCell::new(value) }
    }

    /// The lock if it is free now.
    pub(crate) fn try_lock(&self) -> Option<ShardGuard<'_, T>> {
        // `then`, not `then_some`: a guard made and dropped on failure would unlock the holder.
        // Under loom, a compare-exchange (no store when taken): a swap that finds the lock
        // held stores `true` again, and loom explores each such store without end.
        #[cfg(not(loom))]
        let taken = !self.locked.swap(true, Ordering::Acquire);
        #[cfg(loom)]
        let taken = self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok();
        taken.then(|| ShardGuard {
            lock: self,
            _not_send: std::marker::PhantomData,
            #[cfg(loom)]
            value: std::mem::ManuallyDrop::new(self.value.get_mut()),
        })
    }

    pub(crate) fn lock(&self) -> ShardGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            if let Some(guard) = self.try_lock() {
                return guard;
            }
            // Under loom the waiter retries the exchange itself (a read-modify-write reads
            // the latest value), yielding to the model between tries: a relaxed load may
            // read a stale `true` for ever there, which loom explores as a branch without
            // end. Elsewhere it waits on plain loads (no cache line bouncing between waiters).
            #[cfg(loom)]
            {
                let _ = &mut spins;
                loom::thread::yield_now();
            }
            #[cfg(not(loom))]
            while self.locked.load(Ordering::Relaxed) {
                if spins < 100 {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl<T> std::fmt::Debug for ShardLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardLock { .. }")
    }
}

/// Holds a [`ShardLock`]; gives it back when dropped. Neither `Send` nor, for a `T` that
/// is not `Sync`, `Sync` (as std's `MutexGuard`): a guard shared between threads would
/// hand both a `&T`.
pub(crate) struct ShardGuard<'a, T> {
    lock: &'a ShardLock<T>,
    _not_send: std::marker::PhantomData<*const ()>,
    /// Loom's record of this guard's access to the value, ended before the unlock.
    #[cfg(loom)]
    value: std::mem::ManuallyDrop<loom::cell::MutPtr<T>>,
}

// SAFETY: a shared guard gives only `&T`, which threads may share when `T: Sync`.
unsafe impl<T: Sync> Sync for ShardGuard<'_, T> {}

impl<T> std::ops::Deref for ShardGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `ShardLock`), so nothing else refers to
        // the value while it lives.
        #[cfg(not(loom))]
        return unsafe { &*self.lock.value.get() };
        // SAFETY: as above; loom checks it.
        #[cfg(loom)]
        return unsafe { &*loom::cell::MutPtr::deref(&self.value) };
    }
}

impl<T> std::ops::DerefMut for ShardGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this reference unique.
        #[cfg(not(loom))]
        return unsafe { &mut *self.lock.value.get() };
        // SAFETY: as above; loom checks it.
        #[cfg(loom)]
        return unsafe { loom::cell::MutPtr::deref(&self.value) };
    }
}

impl<T> Drop for ShardGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and not used after.
        #[cfg(loom)]
        unsafe {
            std::mem::ManuallyDrop::drop(&mut self.value)
        };
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::ShardLock;

    /// Threads adding under the lock lose no update (a non-atomic read-modify-write that
    /// two threads interleave would), and `try_lock` fails while the lock is held.
    #[test]
    fn shard_lock_excludes() {
        let lock = ShardLock::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50_000 {
                        let mut g = lock.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 200_000);
        let held = lock.lock();
        assert!(lock.try_lock().is_none());
        drop(held);
        assert!(lock.try_lock().is_some());
    }
}

/// The shard lock itself, model-checked: two threads take it (one with `lock`, one with
/// `try_lock` until it gets it) and change the guarded value; loom's tracked cell fails the
/// model if the two guards ever overlap, and the count shows no update is lost.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::ShardLock;
    use loom::sync::Arc;

    #[test]
    fn loom_shard_lock_excludes() {
        super::model(|| {
            let lock = Arc::new(ShardLock::new(0u32));
            let other = lock.clone();
            let t = loom::thread::spawn(move || {
                let mut g = other.lock();
                *g += 1;
            });
            loop {
                if let Some(mut g) = lock.try_lock() {
                    *g += 1;
                    break;
                }
                loom::thread::yield_now();
            }
            t.join().unwrap();
            assert_eq!(*lock.lock(), 2);
        });
    }
}
