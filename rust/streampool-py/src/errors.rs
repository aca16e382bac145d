//! Errors: the core's [`streampool::Error`] becomes a Python exception in one `match`.
//!
//! The exception classes are defined in Python (`streampool/_errors.py`, so that they
//! pickle and carry attributes like any Python exception) and imported here the first
//! time one is raised.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};

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
    if !matches!(e, Error::Callback(_) | Error::CallbackOutOfMemory(_)) && outermost() {
        // Whatever a callback stashed on this thread was not what failed this call (inside
        // a callback, the stash is still the calls' in progress around it).
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
        Error::Callback(what) | Error::CallbackOutOfMemory(what) => match take_callback_error(&what) {
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

/// `streampool.OutOfMemoryError`, the class of [`Error::OutOfMemory`]'s exception.
pub(crate) fn out_of_memory_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    OUT_OF_MEMORY.import(py, "streampool._errors", "OutOfMemoryError")
}

fn raise<'py, A>(py: Python<'py>, class: &PyOnceLock<Py<PyType>>, name: &str, args: A) -> PyErr
where
    A: PyCallArgs<'py>,
{
    let cls = match class.import(py, "streampool._errors", name) {
        Ok(cls) => cls,
        // Only reachable when the package is broken (streampool/_errors.py missing).
        Err(import_failed) => {
            let err = PyRuntimeError::new_err(format!("streampool: cannot raise {name}"));
            err.set_cause(py, Some(import_failed));
            return err;
        }
    };
    // Making the exception runs Python code, where a pending signal's exception (Ctrl-C's
    // KeyboardInterrupt) may be raised instead: that one goes on, as it would have a moment
    // later.
    match cls.call1(args) {
        Ok(exc) => PyErr::from_value(exc),
        Err(raised) => raised,
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
    // call's: start clean, unless this call runs inside a callback of another call on this
    // thread, whose callbacks' exceptions are still to be raised.
    if outermost() {
        clear_callback_errors();
    }
    let since = stash_mark();
    let result = {
        let _depth = InCall::enter();
        py.detach(f)
    };
    report_swallowed_log_errors(py, &result, since);
    result.or_raise(py)
}

thread_local! {
    /// Calls into the library in progress on this thread: a callback's own call (a failure
    /// callback that frees a cached buffer) runs inside its caller's.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// No call of this thread is in progress around the current one.
fn outermost() -> bool {
    DEPTH.with(|d| d.get() == 0)
}

/// A call in progress on this thread, for as long as it lives (a panic included).
struct InCall;

impl InCall {
    fn enter() -> Self {
        DEPTH.with(|d| d.set(d.get() + 1));
        InCall
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// The serial number the next stashed exception gets: those from `stash_mark()` on were
/// stashed by the call that asked (or the calls inside its callbacks).
pub(crate) fn stash_mark() -> u64 {
    STASH_SERIAL.load(Ordering::Relaxed)
}

/// Sends to `sys.unraisablehook` the exceptions of logging callbacks that a call did not
/// raise (`result` is its outcome): a free whose log line failed still frees, and
/// succeeds; a log line of a failed allocation gives way to the allocation's own error.
/// The exception that `result` names, if any, stays stashed for `to_pyerr`, as do those
/// stashed before `since` ([`stash_mark`]), which are the calls' around this one.
pub(crate) fn report_swallowed_log_errors<T>(py: Python<'_>, result: &streampool::Result<T>, since: u64) {
    let keep = match result {
        Err(Error::Callback(k) | Error::CallbackOutOfMemory(k)) => Some(k.as_str()),
        _ => None,
    };
    let swallowed: Vec<PyErr> = CALLBACK_ERRORS.with(|stash| {
        let mut stash = stash.borrow_mut();
        if stash.is_empty() {
            return Vec::new();
        }
        let (log, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *stash).into_iter().partition(|s| {
            s.serial >= since && s.key.starts_with(LOGGING_CALLBACK) && Some(s.key.as_str()) != keep
        });
        *stash = rest;
        log.into_iter().map(|s| s.err).collect()
    });
    // The others reported first: Ctrl-C delivered again is the last Python this runs (a
    // report after it could run the signal's handler inside itself, and lose it again).
    let (interrupts, others): (Vec<PyErr>, Vec<PyErr>) =
        swallowed.into_iter().partition(|e| is_redeliverable_interrupt(py, e));
    for e in others {
        e.write_unraisable(py, None);
    }
    if !interrupts.is_empty() {
        redeliver_ctrl_c();
    }
}

/// A `KeyboardInterrupt` raised by Python code that the library ran for the user where it
/// cannot pass an exception on (a stack capture, a log line of a free that succeeded, a
/// log on failure): Ctrl-C is delivered again (`PyErr_SetInterruptEx`), so that the
/// program gets it at its next chance instead of losing it. True when `e` was one. Call
/// it last: Python code run after it may run the signal's handler, and lose it again.
pub(crate) fn redeliver_interrupt(py: Python<'_>, e: &PyErr) -> bool {
    let yes = is_redeliverable_interrupt(py, e);
    if yes {
        redeliver_ctrl_c();
    }
    yes
}

/// A `KeyboardInterrupt` on the main thread: Ctrl-C reaches the main thread only, so one
/// raised by code on another thread is that code's own exception, reported as such.
fn is_redeliverable_interrupt(py: Python<'_>, e: &PyErr) -> bool {
    if !e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
        return false;
    }
    let on_main = py.import("threading").and_then(|t| {
        let (current, main) = (t.call_method0("current_thread")?, t.call_method0("main_thread")?);
        Ok(current.is(&main))
    });
    on_main.unwrap_or(false)
}

fn redeliver_ctrl_c() {
    // SAFETY: callable from any thread, with or without the GIL (CPython's documentation).
    unsafe { pyo3::ffi::PyErr_SetInterruptEx(libc::SIGINT) };
}

/// What a logging callback's stashed exception is named by (see [`callback_error`]).
pub(crate) const LOGGING_CALLBACK: &str = "logging callback";

// ---------------------------------------------------------------------------------------
// Exceptions raised by Python callbacks (failure callbacks, logging sinks, stack capture).
//
// The core sees a callback's failure as `Error::Callback(what)`. The callback runs
// synchronously on the thread that called into the resource, so the closure stashes the
// original exception in a thread-local, keyed by `what`, and `to_pyerr`, on the same
// thread, raises that very object. An outermost call (none of this thread's in progress
// around it) starts with an empty stash, and `to_pyerr` empties it there, so a stale
// exception never surfaces in an unrelated error; a call made inside a callback (a
// failure callback closing a cached buffer) leaves the stash of the calls around it
// alone, and reports as swallowed only the log callbacks' exceptions stashed since it
// began.

/// Stashed exceptions kept per thread at most: a call that fails raises the one it names.
const STASH_LIMIT: usize = 8;

thread_local! {
    static CALLBACK_ERRORS: RefCell<Vec<Stashed>> = const { RefCell::new(Vec::new()) };
}

/// A callback's exception, kept until the call it failed raises it.
struct Stashed {
    serial: u64,
    key: String,
    err: PyErr,
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
        stash.push(Stashed { serial, key: key.clone(), err });
        displaced
    });
    drop(displaced); // outside the borrow: dropping an exception may run Python code
    Error::Callback(key)
}

static STASH_SERIAL: AtomicU64 = AtomicU64::new(0);

/// The exception stashed as `key`, taken out; the others stay for the calls in progress
/// around this one (all go when this call is the outermost).
fn take_callback_error(key: &str) -> Option<PyErr> {
    let outermost = outermost();
    let (found, others) = CALLBACK_ERRORS.with(|stash| {
        let mut stash = stash.borrow_mut();
        let at = stash.iter().position(|s| s.key == key);
        let found = at.map(|i| stash.remove(i));
        let others = if outermost { std::mem::take(&mut *stash) } else { Vec::new() };
        (found, others)
    });
    drop(others); // outside the borrow: dropping an exception may run Python code
    found.map(|s| s.err)
}

fn clear_callback_errors() {
    let all = CALLBACK_ERRORS.with(|stash| std::mem::take(&mut *stash.borrow_mut()));
    drop(all);
}
