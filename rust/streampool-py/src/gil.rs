//! Handing the GIL over on the fast path.
//!
//! The fast path keeps the GIL, and CPython takes it from a thread that never blocks only
//! when a waiter has waited a whole switch interval (5 ms) with no switch meanwhile, then
//! gives it to whichever waiter wakes first: threads that allocate in a loop starve one
//! another. So every `OFFER_GIL_EVERY` fast-path calls the GIL is released until another
//! thread has taken it. Releasing it alone, or with a yield of the CPU, rarely hands it
//! over where the waiters sleep on idle cores: this thread retakes it before a woken waiter
//! runs (measured on 2 cores, 2 threads: 1% and 6% of offers; waiting as below: 99%).
//!
//! The statics are written only with the GIL held (relaxed loads and stores count exactly);
//! the wait reads `FAST_CALLS` without it, to see another thread's call.
//!
//! Calls that can block release the GIL for their whole length instead:
//! [`crate::errors::detached`].

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Fast-path calls so far, wrapping: another thread's call while this one waits means it
/// took the GIL.
static FAST_CALLS: AtomicU32 = AtomicU32::new(0);
/// Offers still to skip, and how many offers nobody took in a row: a thread alone (or
/// beside threads that do not use the fast path) offers ever less often, down to one
/// offer in 64, so that it does not wait each time.
static SKIP: AtomicU32 = AtomicU32::new(0);
static MISSES: AtomicU32 = AtomicU32::new(0);

/// Chosen by measurement (benchmarks/bench_pool.py, window workload, 2 to 8 threads on
/// 2 cores): every 1024 calls (about 0.2 ms) the slowest thread got 0.83 to 0.99 of the
/// mean share (0.25 to 0.55 without hand-overs), every 4096 only 0.67 to 0.82 at 4 and 8
/// threads. Each hand-over idles the GIL for a waiter's wake-up (median 14 us there).
const OFFER_GIL_EVERY: u32 = 1024;
/// Longer than nearly every wake-up measured (1 to 45 us).
const HANDOVER_WAIT: Duration = Duration::from_micros(50);

/// Calls settled on the fast path so far (wrapping at 2**32): for tests that check a
/// resource keeps the GIL.
#[pyfunction]
pub(crate) fn _fast_path_calls() -> u32 {
    FAST_CALLS.load(Ordering::Relaxed)
}

/// Counts a call settled on the fast path and, every `OFFER_GIL_EVERY` calls, hands the
/// GIL to a waiting thread, if there is one.
pub(crate) fn fast_path_settled(py: Python<'_>) {
    let calls = FAST_CALLS.load(Ordering::Relaxed).wrapping_add(1);
    FAST_CALLS.store(calls, Ordering::Relaxed);
    if !calls.is_multiple_of(OFFER_GIL_EVERY) {
        return;
    }
    let skip = SKIP.load(Ordering::Relaxed);
    if skip > 0 {
        SKIP.store(skip - 1, Ordering::Relaxed);
        return;
    }
    let taken = py.detach(|| {
        let start = Instant::now();
        while FAST_CALLS.load(Ordering::Relaxed) == calls {
            if start.elapsed() >= HANDOVER_WAIT {
                return false;
            }
            std::thread::yield_now();
        }
        true
    });
    let misses = if taken { 0 } else { (MISSES.load(Ordering::Relaxed) + 1).min(6) };
    MISSES.store(misses, Ordering::Relaxed);
    SKIP.store((1 << misses) - 1, Ordering::Relaxed);
}

extern "C" {
    /// Whether this thread holds the GIL (its thread state is the current one). Not in the
    /// limited API's headers, but exported by every CPython this module supports.
    fn PyGILState_Check() -> std::ffi::c_int;
}

/// `Python::try_attach`, also where PyO3 counts this thread as attached while foreign code
/// it called released the GIL behind its back: a resource's Python callback that calls a
/// library op or a `ctypes` function (which release the GIL), which then allocates or frees
/// through streampool on the same thread (the C entry points), re-enters with PyO3's count
/// above 0 and no GIL. PyO3 would run Python code without it (a crash); here the GIL is
/// taken for the call (`PyGILState_Ensure` restores the thread's saved state) and given
/// back after. None where the interpreter cannot be attached (it is shutting down).
///
/// A thread in Python code that CPython (before 3.14) ends while the interpreter finalises
/// (a daemon thread whose callback let the GIL go, for I/O say, then took it back) is ended
/// by `pthread_exit`, whose unwinding would run PyO3's guard here and give back a thread
/// state that is no longer current: CPython aborts the process. Such a thread is stopped
/// here instead, for good, as CPython 3.14 and PyO3's own attach do.
pub(crate) fn try_attach<R>(f: impl FnOnce(Python<'_>) -> R) -> Option<R> {
    Python::try_attach(|py| {
        let in_python = HangIfEnded;
        // SAFETY: only reads this thread's state.
        let result = if unsafe { PyGILState_Check() } == 1 {
            f(py)
        } else {
            // SAFETY: the interpreter is initialised (PyO3 attached once on this thread)
            // and this thread does not hold the GIL; `Release` is given the state `Ensure`
            // returned.
            let state = unsafe { pyo3::ffi::PyGILState_Ensure() };
            let result = f(py);
            // SAFETY: the state this thread's `PyGILState_Ensure` returned, released once.
            unsafe { pyo3::ffi::PyGILState_Release(state) };
            result
        };
        std::mem::forget(in_python);
        result
    })
}

/// Dropped only when the call it guards did not return: unwound by a Rust panic (which
/// goes on), or by CPython ending the thread (`pthread_exit` is no panic), which stops here.
struct HangIfEnded;

impl Drop for HangIfEnded {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        loop {
            std::thread::park();
        }
    }
}
