//! Errors: the core's [`streampool::Error`] becomes a Python exception in one `match`.
//!
//! The exception classes are defined in Python (`streampool/_errors.py`, so that they
//! pickle and carry attributes like any Python exception) and imported here the first
//! time one is raised.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pyo3::call::PyCallArgs;
use pyo3::exceptions::{PyBufferError, PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use streampool::Error;

static STREAMPOOL_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OUT_OF_MEMORY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CUDA_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DRIVER_NOT_FOUND: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static UNSUPPORTED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_POINTER: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_STREAM: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SIM_ACTIVE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The Python exception for a core error. `InvalidArgument` becomes InvalidArgumentError,
/// a ValueError that is also a StreampoolError (a closed simulated device reports itself
/// so, and callers catching StreampoolError should see it).
pub(crate) fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    if !matches!(e, Error::Callback(_)) {
        // Whatever a callback stashed on this thread was not what failed this call.
        clear_callback_errors();
    }
    match e {
        Error::OutOfMemory { requested, available, resource: _ } => {
            let available = streampool::error::plausible_available(available);
            raise(py, &OUT_OF_MEMORY, "OutOfMemoryError", (msg, requested, available))
        }
        Error::Driver { call, code, name, context: _ } => {
            raise(py, &CUDA_ERROR, "CudaError", (msg, call, code, name))
        }
        Error::DriverNotFound(_) => raise(py, &DRIVER_NOT_FOUND, "CudaDriverNotFoundError", (msg,)),
        Error::Unsupported(_) => raise(py, &UNSUPPORTED, "UnsupportedError", (msg,)),
        Error::InvalidArgument(_) => raise(py, &INVALID_ARGUMENT, "InvalidArgumentError", (msg,)),
        Error::InvalidPointer(_) => raise(py, &INVALID_POINTER, "InvalidPointerError", (msg,)),
        Error::InvalidStream(_) => raise(py, &INVALID_STREAM, "InvalidStreamError", (msg,)),
        // OSError(errno, strerror, filename) becomes the errno's subclass (FileNotFoundError,
        // PermissionError, ...), whose text names the file.
        Error::Io { what, path, errno: Some(errno), message } => {
            PyOSError::new_err((errno, format!("{what}: {message}"), path.into_os_string()))
        }
        Error::Io { .. } => PyOSError::new_err(msg),
        // A Python callback raised: its own exception, unchanged, when this thread stashed it.
        Error::Callback(what) => match take_callback_error(&what) {
            Some(original) => original,
            None => raise(py, &STREAMPOOL_ERROR, "StreampoolError", (msg,)),
        },
        // `Error` is #[non_exhaustive]: a variant added to the core later is still a
        // StreampoolError until it gets its own class here.
        _ => raise(py, &STREAMPOOL_ERROR, "StreampoolError", (msg,)),
    }
}

/// `SimulatedDeviceActiveError(msg)` (a StreampoolError and a RuntimeError).
pub(crate) fn sim_active_error(py: Python<'_>, msg: String) -> PyErr {
    raise(py, &SIM_ACTIVE, "SimulatedDeviceActiveError", (msg,))
}

/// `BufferError(msg)`: what the DLPack standard asks producers to raise.
pub(crate) fn buffer_error(msg: impl Into<String>) -> PyErr {
    PyBufferError::new_err(msg.into())
}

fn raise<'py, A>(py: Python<'py>, class: &PyOnceLock<Py<PyType>>, name: &str, args: A) -> PyErr
where
    A: PyCallArgs<'py>,
{
    let made = class.import(py, "streampool._errors", name).and_then(|cls| cls.call1(args));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // Only reachable when the package is broken (streampool/_errors.py missing).
        Err(import_failed) => {
            let err = PyRuntimeError::new_err(format!("streampool: cannot raise {name}"));
            err.set_cause(py, Some(import_failed));
            err
        }
    }
}

/// `.or_raise(py)` on a core result: the error as its Python exception.
pub(crate) trait OrRaise<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> OrRaise<T> for streampool::Result<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}

/// Runs `f` with the GIL released and maps its error: the one way this crate calls into
/// anything that can block (a driver call, a lock inside a resource, a device wait).
pub(crate) fn detached<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: Send + FnOnce() -> streampool::Result<T>,
    T: Send,
{
    // A stash left by a call whose error was swallowed (a free in a `Drop`) is not this
    // call's: start clean.
    clear_callback_errors();
    py.detach(f).or_raise(py)
}

// ---------------------------------------------------------------------------------------
// Handing the GIL over on the fast path.
//
// The fast path keeps the GIL, and CPython takes it from a thread that never blocks only
// when a waiter has waited a whole switch interval (5 ms) with no switch meanwhile, then
// gives it to whichever waiter wakes first: threads that allocate in a loop starve one
// another. So every `OFFER_GIL_EVERY` fast-path calls the GIL is released until another
// thread has taken it. Releasing it alone, or with a yield of the CPU, rarely hands it
// over where the waiters sleep on idle cores: this thread retakes it before a woken waiter
// runs (measured on 2 cores, 2 threads: 1% and 6% of offers; waiting as below: 99%).
//
// The statics are written only with the GIL held (relaxed loads and stores count exactly);
// the wait reads `FAST_CALLS` without it, to see another thread's call.

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

/// Counts a call settled on the fast path and, every `OFFER_GIL_EVERY` calls, hands the
/// GIL to a waiting thread, if there is one.
pub(crate) fn fast_path_settled(py: Python<'_>) {
    let calls = FAST_CALLS.load(Ordering::Relaxed).wrapping_add(1);
    FAST_CALLS.store(calls, Ordering::Relaxed);
    if calls % OFFER_GIL_EVERY != 0 {
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

// ---------------------------------------------------------------------------------------
// Exceptions raised by Python callbacks (failure callbacks, logging sinks, stack capture).
//
// The core sees a callback's failure as `Error::Callback(what)`. The callback runs
// synchronously on the thread that called into the resource, so the closure stashes the
// original exception in a thread-local, keyed by `what`, and `to_pyerr`, on the same
// thread, raises that very object. Every `detached` call starts with an empty stash, and
// `to_pyerr` empties it, so a stale exception never surfaces in an unrelated error.

/// Stashed exceptions kept per thread at most: a call that fails raises the one it names.
const STASH_LIMIT: usize = 8;

thread_local! {
    static CALLBACK_ERRORS: RefCell<Vec<(String, PyErr)>> = const { RefCell::new(Vec::new()) };
}

/// The core error for a Python callback that raised `err`, keeping `err` to be raised by
/// `to_pyerr` on this thread. `what` names the callback ("failure callback", "logging sink").
pub(crate) fn callback_error(py: Python<'_>, what: &str, err: PyErr) -> Error {
    let ty = err.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "exception".into());
    let text = err.value(py).str().map(|s| s.to_string()).unwrap_or_default();
    // The serial number keeps two failures with the same text apart.
    let serial = STASH_SERIAL.fetch_add(1, Ordering::Relaxed);
    let key = format!("{what} raised {ty}: {text} (#{serial})");
    let displaced = CALLBACK_ERRORS.with(|stash| {
        let mut stash = stash.borrow_mut();
        let displaced = if stash.len() >= STASH_LIMIT { Some(stash.remove(0)) } else { None };
        stash.push((key.clone(), err));
        displaced
    });
    drop(displaced); // outside the borrow: dropping an exception may run Python code
    Error::Callback(key)
}

static STASH_SERIAL: AtomicU64 = AtomicU64::new(0);

fn take_callback_error(key: &str) -> Option<PyErr> {
    let all = CALLBACK_ERRORS.with(|stash| std::mem::take(&mut *stash.borrow_mut()));
    all.into_iter().find(|(k, _)| k == key).map(|(_, err)| err)
}

fn clear_callback_errors() {
    let all = CALLBACK_ERRORS.with(|stash| std::mem::take(&mut *stash.borrow_mut()));
    drop(all);
}
