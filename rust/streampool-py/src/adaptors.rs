//! The adaptors (`streampool.mr`): resources that wrap another resource and add one thing
//! each, with RMM's Python names, and the Python callbacks they call.
//!
//! Every adaptor extends `UpstreamResourceAdaptor` (a `MemoryResource`), which keeps the
//! Python upstream object alive and returns it as given (`upstream`, `get_upstream()`);
//! the base `MemoryResource` holds the core adaptor as its `ResourceRef`, so allocation
//! goes through the one `allocate`/`deallocate` of the base class.
//!
//! # Calling into Python from a resource
//!
//! `allocate`/`deallocate` release the GIL before calling the core. A failure callback, a
//! logging sink or a stack capture then re-attaches ([`crate::gil::try_attach`], which
//! also holds where foreign code released the GIL behind PyO3's back) on the same
//! thread, runs the Python code, and returns. The core adaptors hold no lock across these
//! calls (each adaptor's docs say so), so a callback may allocate from or free into the
//! same stack without deadlock. An exception a callback raises is stashed by
//! [`callback_error`] and raised, unchanged, to the caller of `allocate`/`deallocate`.
//! When the interpreter cannot be attached (it is shutting down), a logging sink is
//! skipped, a failure callback answers "do not retry", and a stack is not captured.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyIndexError, PyMemoryError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyString, PyTuple, PyType};
use pyo3::{PyClass, PyTraverseError};
use streampool::adaptors::{
    self, BinningMemoryResource, FailureCallback, FailureCallbackAdaptor, FixedSizeMemoryResource, Histogram,
    LatencyHistogramAdaptor, LimitingAdaptor, LogAction, LogSink, LoggingAdaptor, PrefetchAdaptor,
    StackCapture, Statistics, StatisticsAdaptor, TrackingAdaptor,
};
use streampool::device::{BackendRef, DevPtr, RawStream};
use streampool::{MemoryKind, MemoryResource, ResourceRef, Stream};

use crate::errors::{callback_error, detached, to_pyerr, OrRaise};
use crate::resources::PyMemoryResource;
use crate::streams::{default_stream, per_thread_stream, PyStream};
use crate::{count_arg, size_arg};

/// Locks a mutex of this module. Each is held only to clone, push or take a Python
/// reference, with the GIL held and without running Python code, so it is never
/// contended across a GIL switch.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The initializer of an adaptor: the base `MemoryResource` holding the core adaptor, the
/// `UpstreamResourceAdaptor` holding the Python upstream, then the class itself, made by
/// `sub` from the upstream's [`Upstream`] slot (which the class keeps and traverses).
pub(crate) fn init<S>(
    inner: ResourceRef,
    upstream: &Bound<'_, PyMemoryResource>,
    sub: impl FnOnce(Upstream) -> S,
) -> PyClassInitializer<S>
where
    S: PyClass<BaseType = PyUpstreamResourceAdaptor>,
{
    let slot = Upstream(Slot::new(upstream.clone().unbind()));
    PyMemoryResource::base(inner)
        .add_subclass(PyUpstreamResourceAdaptor { upstream: slot.clone() })
        .add_subclass(sub(slot))
}

pub(crate) fn upstream_ref(upstream: &Bound<'_, PyMemoryResource>) -> ResourceRef {
    upstream.get().inner.clone()
}

/// A byte count that must be positive (a limit, a block size).
fn positive_size(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() && obj.lt(1)? {
        return Err(PyValueError::new_err(format!("{what} must be > 0, got {obj}")));
    }
    match size_arg(obj, what)? {
        0 => Err(PyValueError::new_err(format!("{what} must be > 0, got {obj}"))),
        n => Ok(n),
    }
}

// ---------------------------------------------------------------------------------------
// Python callbacks.

/// A Python object that an adaptor holds and shows to the garbage collector: the slot can
/// be emptied by the collector (`__clear__`) to break a reference cycle through it (a
/// failure callback that frees into its own adaptor, an upstream whose callback refers to
/// the adaptor over it). `__traverse__` must not call into Python, nor wait: it visits the
/// object under a `try_lock`, which only ever competes with the short holds below.
pub(crate) struct Slot<T>(Mutex<Option<Py<T>>>);

impl<T> std::fmt::Debug for Slot<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let filled = self.0.try_lock().map(|s| if s.is_some() { "filled" } else { "cleared" });
        f.debug_tuple("Slot").field(&filled.unwrap_or("busy")).finish()
    }
}

impl<T> Slot<T> {
    fn new(obj: Py<T>) -> Arc<Self> {
        Arc::new(Slot(Mutex::new(Some(obj))))
    }

    /// The object; `None` once the collector has cleared the slot.
    fn get(&self, py: Python<'_>) -> Option<Py<T>> {
        lock(&self.0).as_ref().map(|f| f.clone_ref(py))
    }

    fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Skipping a reference under contention only makes the collector keep more alive.
        if let Ok(slot) = self.0.try_lock() {
            if let Some(obj) = slot.as_ref() {
                visit.call(obj)?;
            }
        }
        Ok(())
    }

    fn clear(&self) {
        let obj = lock(&self.0).take();
        drop(obj); // after the lock: dropping may run Python code
    }
}

/// A Python callable that the core calls through a closure; an empty slot acts as "do
/// nothing".
type CallbackSlot = Slot<PyAny>;

/// The upstream of an adaptor as given from Python: shared by `UpstreamResourceAdaptor`,
/// which returns it, and the adaptor's own class, whose `__traverse__` and `__clear__`
/// let the collector find and break cycles through it.
#[derive(Debug, Clone)]
pub(crate) struct Upstream(Arc<Slot<PyMemoryResource>>);

impl Upstream {
    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.0.traverse(visit)
    }

    pub(crate) fn clear(&self) {
        self.0.clear();
    }
}

fn require_callable(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Py<PyAny>> {
    if obj.is_callable() {
        return Ok(obj.clone().unbind());
    }
    let ty = obj.get_type().fully_qualified_name()?;
    Err(PyTypeError::new_err(format!("{what} must be callable, not {ty}")))
}

fn failure_callback(slot: Arc<CallbackSlot>) -> FailureCallback {
    Arc::new(move |bytes: usize| {
        crate::gil::try_attach(|py| {
            let Some(f) = slot.get(py) else { return Ok(false) };
            // Its answer's truth, as RMM reads it (None: no retry). Ctrl-C ends a loop of
            // retries also when the callback runs no Python code of its own (`bool`).
            let retry = f.bind(py).call1((bytes,)).and_then(|answer| answer.is_truthy());
            let retry = retry.and_then(|retry| py.check_signals().map(|()| retry));
            retry.map_err(|e| callback_error(py, "failure callback", e))
        })
        .unwrap_or(Ok(false))
    })
}

thread_local! {
    /// The logging callbacks running on this thread (their slots' addresses).
    static WRITING: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A logging callback running on this thread, for as long as it lives.
struct Writing(usize);

impl Drop for Writing {
    fn drop(&mut self) {
        let _ = WRITING.try_with(|w| w.borrow_mut().retain(|&id| id != self.0));
    }
}

fn log_callback(slot: Arc<CallbackSlot>) -> LogSink {
    LogSink::Callback(Arc::new(move |line: &str| {
        // A callback that allocates or frees through its own adaptor would log that too,
        // from inside itself, without end (each failed level also logs its undo): refused.
        let id = Arc::as_ptr(&slot) as usize;
        if WRITING.try_with(|w| w.borrow().contains(&id)).unwrap_or(false) {
            return Err(streampool::Error::invalid(format!(
                "LoggingResourceAdaptor: its logging callback used the adaptor it logs for, whose line \
                 ({line}) would call the callback again from inside itself; allocate and free through \
                 another resource there"
            )));
        }
        let _writing = WRITING.try_with(|w| w.borrow_mut().push(id)).ok().map(|()| Writing(id));
        crate::gil::try_attach(|py| {
            let Some(f) = slot.get(py) else { return Ok(()) };
            f.bind(py)
                .call1((line,))
                .map(drop)
                .map_err(|e| callback_error(py, crate::errors::LOGGING_CALLBACK, e))
        })
        .unwrap_or(Ok(()))
    }))
}

static CURRENT_THREAD: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The allocating thread as Python knows it, "name (ident N)"
/// (`threading.current_thread()`); the Rust thread's name and id when the interpreter
/// is not available.
fn python_thread() -> String {
    let label = crate::gil::try_attach(|py| -> PyResult<String> {
        let label = || -> PyResult<String> {
            let thread = CURRENT_THREAD.import(py, "threading", "current_thread")?.call0()?;
            let name: String = thread.getattr("name")?.extract()?;
            Ok(format!("{name} (ident {})", thread.getattr("ident")?))
        };
        label().inspect_err(|e| {
            crate::errors::redeliver_interrupt(py, e);
        })
    });
    match label {
        Some(Ok(text)) => text,
        _ => {
            let t = std::thread::current();
            format!("{} ({:?})", t.name().unwrap_or("unnamed thread"), t.id())
        }
    }
}

/// The Python stack of the thread that is allocating (`traceback.format_stack()`).
fn python_stack() -> String {
    let stack = crate::gil::try_attach(|py| {
        let stack = || -> PyResult<String> {
            let frames = py.import("traceback")?.call_method0("format_stack")?;
            PyString::new(py, "").call_method1("join", (frames,))?.extract()
        };
        stack().unwrap_or_else(|e| {
            // The text first: a Ctrl-C delivered again must be the last Python run here.
            let text = format!("(the Python stack could not be captured: {e})\n");
            crate::errors::redeliver_interrupt(py, &e);
            text
        })
    });
    stack.unwrap_or_else(|| "(no Python stack: the interpreter is not available)\n".into())
}

// ---------------------------------------------------------------------------------------
// The base of every adaptor.

/// Base class of the resources that wrap another one (RMM's `UpstreamResourceAdaptor`).
/// Not constructible itself.
#[derive(Debug)]
#[pyclass(frozen, subclass, extends = PyMemoryResource, module = "streampool.mr", name = "UpstreamResourceAdaptor")]
pub struct PyUpstreamResourceAdaptor {
    upstream: Upstream,
}

impl PyUpstreamResourceAdaptor {
    fn upstream_object(&self, py: Python<'_>) -> PyResult<Py<PyMemoryResource>> {
        self.upstream.0.get(py).ok_or_else(|| {
            PyValueError::new_err(
                "the upstream is gone: the garbage collector cleared it, breaking a reference cycle this adaptor was part of",
            )
        })
    }
}

#[pymethods]
impl PyUpstreamResourceAdaptor {
    /// The resource this one wraps, as it was given.
    #[getter(upstream)]
    fn upstream_property(&self, py: Python<'_>) -> PyResult<Py<PyMemoryResource>> {
        self.upstream_object(py)
    }

    /// The resource this one wraps (RMM's name; same as `upstream`).
    fn get_upstream(&self, py: Python<'_>) -> PyResult<Py<PyMemoryResource>> {
        self.upstream_object(py)
    }

    /// The resource this one wraps (RMM's attribute; same as `upstream`).
    #[getter]
    fn upstream_mr(&self, py: Python<'_>) -> PyResult<Py<PyMemoryResource>> {
        self.upstream_object(py)
    }

    /// `StatisticsResourceAdaptor[PoolMemoryResource]` in an annotation (the typing stub
    /// makes the adaptors generic in their upstream's type): a `types.GenericAlias`.
    #[classmethod]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        cls.py().import("types")?.getattr("GenericAlias")?.call1((cls, item))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let name = slf.get_type().name()?;
        let upstream = match slf.get().upstream.0.get(slf.py()) {
            Some(up) => up.bind(slf.py()).repr()?.to_string(),
            None => "(cleared)".into(),
        };
        Ok(format!("<{name} over {upstream}>"))
    }
    // No `__traverse__` here: each adaptor's own class traverses (and clears) the upstream,
    // which it shares through `Upstream`. pyo3 0.30 finds a base's traverse by comparing
    // function addresses, and the identical no-op traverses of the classes above and below
    // this one may share an address, which would send a traverse defined here into endless
    // recursion.
}

// ---------------------------------------------------------------------------------------
// Statistics.

static STATISTICS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `streampool.statistics.Statistics(...)`: a Python dataclass, as RMM's.
fn statistics_object(py: Python<'_>, s: Statistics) -> PyResult<Py<PyAny>> {
    let cls = STATISTICS.import(py, "streampool.statistics", "Statistics")?;
    let args = (s.current_bytes, s.current_count, s.peak_bytes, s.peak_count, s.total_bytes, s.total_count);
    Ok(cls.call1(args)?.unbind())
}

/// Counts what passes through it: current, peak and total bytes and allocations, on a
/// stack of counters (`push_counters`/`pop_counters`) for measuring code blocks. A free of
/// more bytes than are in use through it raises InvalidPointerError (it keeps no record per
/// allocation, so it cannot check sizes otherwise: wrap an upstream that takes any size,
/// as the driver's pool does, in a TrackingResourceAdaptor to have wrong sizes refused).
///
/// Example::
///
///     stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
///     ptr = stats.allocate(1 << 20)
///     print(stats.allocation_counts.current_bytes)  # 1048576
///     stats.deallocate(ptr, 1 << 20)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "StatisticsResourceAdaptor")]
pub struct PyStatisticsResourceAdaptor {
    inner: Arc<StatisticsAdaptor>,
    upstream: Upstream,
}

#[pymethods]
impl PyStatisticsResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyMemoryResource>) -> PyResult<PyClassInitializer<Self>> {
        let inner = Arc::new(StatisticsAdaptor::new(upstream_ref(upstream_mr)).or_raise(upstream_mr.py())?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// The counters on top of the stack, as a `Statistics`.
    #[getter]
    fn allocation_counts(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mr = self.inner.clone();
        let s = detached(py, move || Ok(mr.statistics()))?;
        statistics_object(py, s)
    }

    /// Pushes zeroed counters; returns the counters on top before the push.
    fn push_counters(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mr = self.inner.clone();
        let s = detached(py, move || Ok(mr.push_counters()))?;
        statistics_object(py, s)
    }

    /// Pops the counters on top (adding them into the ones below) and returns them.
    /// IndexError when only the base counters are left (as RMM's).
    fn pop_counters(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mr = self.inner.clone();
        let s = py.detach(move || mr.pop_counters()).map_err(|e| match e {
            streampool::Error::InvalidArgument(m) => PyIndexError::new_err(m),
            other => to_pyerr(py, other),
        })?;
        statistics_object(py, s)
    }
}

// ---------------------------------------------------------------------------------------
// Latency histograms.

/// Records how long each allocate and deallocate call takes, in histograms of log-spaced
/// buckets (4 per power of two), lock-free and cheap enough to leave on (two time-stamp
/// counter reads and a few plain updates of the calling thread's own counters per call,
/// no atomic read-modify-write). `histogram()` returns, for
/// "allocate" and "deallocate": count, total_ns, max_ns, p50_ns, p90_ns, p99_ns, p999_ns
/// (the upper bound of the bucket holding that rank, so at most 25 % above) and buckets,
/// a list of (upper bound in ns, calls). With STREAMPOOL_NVTX=1 in the environment, each
/// call is also an NVTX range, for Nsight Systems timelines (the NVTX library is loaded
/// at run time; without it, a warning once).
///
/// Example::
///
///     timed = mr.LatencyHistogramResourceAdaptor(mr.CudaAsyncMemoryResource())
///     p = timed.allocate(1 << 20)
///     timed.deallocate(p, 1 << 20)
///     print(timed.histogram()["allocate"]["p99_ns"])
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "LatencyHistogramResourceAdaptor")]
pub struct PyLatencyHistogramResourceAdaptor {
    inner: Arc<LatencyHistogramAdaptor>,
    upstream: Upstream,
}

fn histogram_dict<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count)?;
    d.set_item("total_ns", h.total_ns)?;
    d.set_item("max_ns", h.max_ns)?;
    d.set_item("p50_ns", h.p50_ns)?;
    d.set_item("p90_ns", h.p90_ns)?;
    d.set_item("p99_ns", h.p99_ns)?;
    d.set_item("p999_ns", h.p999_ns)?;
    d.set_item("buckets", h.buckets.clone())?;
    Ok(d)
}

#[pymethods]
impl PyLatencyHistogramResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyMemoryResource>) -> PyResult<PyClassInitializer<Self>> {
        let inner =
            Arc::new(LatencyHistogramAdaptor::new(upstream_ref(upstream_mr)).or_raise(upstream_mr.py())?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// The histograms so far: {"allocate": {...}, "deallocate": {...}}.
    fn histogram<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.inner.histogram();
        let d = PyDict::new(py);
        d.set_item("allocate", histogram_dict(py, &h.allocate)?)?;
        d.set_item("deallocate", histogram_dict(py, &h.deallocate)?)?;
        Ok(d)
    }

    /// Forgets every call recorded so far (a call made at the same moment on another thread
    /// may be forgotten too).
    fn reset(&self) {
        self.inner.reset()
    }
}

// ---------------------------------------------------------------------------------------
// Tracking.

/// One outstanding allocation of a `TrackingResourceAdaptor`.
#[derive(Debug, Clone, PartialEq)]
#[pyclass(frozen, eq, module = "streampool.mr", name = "AllocationRecord")]
pub struct PyAllocationRecord {
    /// The address.
    #[pyo3(get)]
    ptr: DevPtr,
    /// The size in bytes, as asked.
    #[pyo3(get)]
    size: usize,
    /// The handle of the stream it was allocated on.
    #[pyo3(get)]
    stream: RawStream,
    /// The allocating Python thread: its name and ident, e.g. "MainThread (ident 1403...)".
    #[pyo3(get)]
    thread: String,
    /// The Python stack at the allocation, when the adaptor captures stacks.
    #[pyo3(get)]
    stack: Option<String>,
}

#[pymethods]
impl PyAllocationRecord {
    fn __repr__(&self) -> String {
        format!(
            "AllocationRecord(ptr={:#x}, size={}, stream={:#x}, thread={:?})",
            self.ptr, self.size, self.stream, self.thread
        )
    }
}

/// Tracks every outstanding allocation (address, size, stream, thread and, with
/// `capture_stacks`, the Python stack). Frees of pointers it did not hand out, double
/// frees and sizes that do not match raise InvalidPointerError.
///
/// Example::
///
///     tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True)
///     ptr = tracked.allocate(4096)
///     print(tracked.get_outstanding_allocations_str())  # where each live allocation was made
///     tracked.deallocate(ptr, 4096)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "TrackingResourceAdaptor")]
pub struct PyTrackingResourceAdaptor {
    inner: Arc<TrackingAdaptor>,
    upstream: Upstream,
}

#[pymethods]
impl PyTrackingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, capture_stacks=None), text_signature = "(upstream_mr, capture_stacks=False)")]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        capture_stacks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let capture_stacks = crate::flag_arg(capture_stacks, "capture_stacks")?;
        let capture: Option<StackCapture> = capture_stacks.then(|| Arc::new(python_stack) as StackCapture);
        let inner = TrackingAdaptor::new(upstream_ref(upstream_mr), capture)
            .or_raise(upstream_mr.py())?
            .with_thread_label(Arc::new(python_thread));
        let inner = Arc::new(inner);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// Bytes allocated and not yet freed.
    fn get_allocated_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        let mr = self.inner.clone();
        detached(py, move || Ok(mr.allocated_bytes()))
    }

    /// The leak report: one entry per outstanding allocation (address, size, stream,
    /// thread, and the stack when captured).
    fn get_outstanding_allocations_str(&self, py: Python<'_>) -> PyResult<String> {
        let mr = self.inner.clone();
        detached(py, move || Ok(mr.outstanding_report()))
    }

    /// Logs the leak report to the `streampool` logger (Python `logging`) at WARNING
    /// level, when anything is outstanding.
    fn log_outstanding_allocations(&self, py: Python<'_>) -> PyResult<()> {
        let mr = self.inner.clone();
        let (count, report) = detached(py, move || Ok((mr.outstanding().len(), mr.outstanding_report())))?;
        if count == 0 {
            return Ok(());
        }
        crate::log_record(py, 30, &report)
    }

    /// The outstanding allocations, as `AllocationRecord`s.
    fn outstanding(&self, py: Python<'_>) -> PyResult<Vec<PyAllocationRecord>> {
        let mr = self.inner.clone();
        let records = detached(py, move || Ok(mr.outstanding()))?;
        Ok(records
            .into_iter()
            .map(|r| PyAllocationRecord {
                ptr: r.ptr,
                size: r.bytes,
                stream: r.stream,
                thread: r.thread,
                stack: r.stack,
            })
            .collect())
    }
}

// ---------------------------------------------------------------------------------------
// Logging.

/// One event of an allocation log (`streampool.logs.parse_log`).
#[derive(Debug, Clone, PartialEq)]
#[pyclass(frozen, eq, module = "streampool.logs", name = "LogEvent")]
pub struct PyLogEvent {
    /// The id of the thread that acted.
    #[pyo3(get)]
    thread: u64,
    /// When, in seconds (since the epoch, or since midnight for RMM's `HH:MM:SS.us`).
    #[pyo3(get)]
    time: f64,
    /// "allocate", "allocate failure" or "free".
    #[pyo3(get)]
    action: &'static str,
    /// The address (0 for a failed allocation).
    #[pyo3(get)]
    ptr: DevPtr,
    /// The size in bytes.
    #[pyo3(get)]
    size: usize,
    /// The stream handle.
    #[pyo3(get)]
    stream: RawStream,
}

fn action_name(action: &LogAction) -> &'static str {
    match action {
        LogAction::Allocate => "allocate",
        LogAction::AllocateFailure => "allocate failure",
        LogAction::Free => "free",
    }
}

#[pymethods]
impl PyLogEvent {
    fn __repr__(&self) -> String {
        format!(
            "LogEvent(thread={}, time={}, action={:?}, ptr={:#x}, size={}, stream={:#x})",
            self.thread, self.time, self.action, self.ptr, self.size, self.stream
        )
    }
}

/// Parses an allocation log in RMM's CSV format (`Thread,Time,Action,Pointer,Size,Stream`).
#[pyfunction]
pub(crate) fn _parse_log(py: Python<'_>, text: String) -> PyResult<Vec<PyLogEvent>> {
    let events = detached(py, move || adaptors::parse_log(&text))?;
    Ok(events
        .into_iter()
        .map(|e| PyLogEvent {
            thread: e.thread,
            time: e.time,
            action: action_name(&e.action),
            ptr: e.ptr,
            size: e.bytes,
            stream: e.stream,
        })
        .collect())
}

/// Writes a CSV line per event (RMM's format) to a file, flushed after every line, and/or
/// hands each line to a Python callback. Frees are logged and passed on with the size given.
///
/// Example::
///
///     logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), log_file_name="alloc.csv")
///     logged.deallocate(logged.allocate(4096), 4096)
///     logged.flush()  # alloc.csv: one line per call, RMM's CSV format
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "LoggingResourceAdaptor")]
pub struct PyLoggingResourceAdaptor {
    inner: Arc<LoggingAdaptor>,
    callback: Option<Arc<CallbackSlot>>,
    upstream: Upstream,
}

/// Where the log goes when no file and no callback is given: `STREAMPOOL_LOG_FILE`, then
/// RMM's `RMM_LOG_FILE`.
fn log_file_from_env() -> Option<PathBuf> {
    ["STREAMPOOL_LOG_FILE", "RMM_LOG_FILE"]
        .iter()
        .filter_map(std::env::var_os)
        .find(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The path made absolute with its `.` and `..` folded away as text, as Python's
/// `os.path.abspath` (with which RMM names its log file) does.
fn abspath(f: PathBuf) -> PathBuf {
    let mut out = PathBuf::new();
    for part in std::path::absolute(&f).unwrap_or(f).components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            part => out.push(part),
        }
    }
    out
}

#[pymethods]
impl PyLoggingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, log_file_name=None, callback=None))]
    fn new(
        py: Python<'_>,
        upstream_mr: &Bound<'_, PyMemoryResource>,
        log_file_name: Option<PathBuf>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let callback = callback.map(|f| require_callable(f, "callback")).transpose()?.map(CallbackSlot::new);
        let file = match (log_file_name, &callback) {
            (Some(name), _) => Some(name),
            (None, Some(_)) => None,
            (None, None) => Some(log_file_from_env().ok_or_else(|| {
                PyValueError::new_err(
                    "LoggingResourceAdaptor needs a log file: pass log_file_name= or callback=, \
                     or set STREAMPOOL_LOG_FILE (or RMM_LOG_FILE)",
                )
            })?),
        };
        let file = file.map(abspath);
        let mut sinks: Vec<LogSink> = file.into_iter().map(LogSink::File).collect();
        sinks.extend(callback.iter().map(|slot| log_callback(slot.clone())));
        let upstream = upstream_ref(upstream_mr);
        let inner = Arc::new(detached(py, move || LoggingAdaptor::new(upstream, sinks))?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, callback, upstream }))
    }

    /// Writes out whatever the file sink buffers (every line is already flushed as it is
    /// written; this is for RMM compatibility and after errors).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let mr = self.inner.clone();
        detached(py, move || mr.flush())
    }

    /// The absolute path of the log file (a str, as RMM's), or None when logging only to a
    /// callback.
    fn get_file_name(&self) -> Option<std::ffi::OsString> {
        self.inner.file_name().map(|p| p.as_os_str().to_owned())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(slot) = &self.callback {
            slot.traverse(&visit)?;
        }
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        if let Some(slot) = &self.callback {
            slot.clear();
        }
        self.upstream.clear();
    }
}

// ---------------------------------------------------------------------------------------
// Limiting, failure callback, prefetch.

/// Refuses allocations that would take the bytes outstanding through it over
/// `allocation_limit` (an int, or a string such as "2GiB"), with OutOfMemoryError. A free
/// of more bytes than are allocated through it raises InvalidPointerError (it keeps no
/// record per allocation, so it cannot check sizes otherwise: wrap an upstream that takes
/// any size, as the driver's pool does, in a TrackingResourceAdaptor to have wrong sizes
/// refused).
///
/// Example::
///
///     limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), allocation_limit="1GiB")
///     ptr = limited.allocate(1 << 20)
///     print(limited.get_allocated_bytes())  # 1048576
///     limited.deallocate(ptr, 1 << 20)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "LimitingResourceAdaptor")]
pub struct PyLimitingResourceAdaptor {
    inner: Arc<LimitingAdaptor>,
    upstream: Upstream,
}

#[pymethods]
impl PyLimitingResourceAdaptor {
    #[new]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        allocation_limit: &Bound<'_, PyAny>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let limit = positive_size(allocation_limit, "allocation_limit")?;
        let inner =
            Arc::new(LimitingAdaptor::new(upstream_ref(upstream_mr), limit).or_raise(upstream_mr.py())?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// Bytes allocated through this adaptor and not yet freed.
    fn get_allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes()
    }

    /// The limit, in bytes.
    fn get_allocation_limit(&self) -> usize {
        self.inner.limit()
    }
}

/// Calls `callback(nbytes)` when the upstream runs out of memory; when its result is true
/// (as `bool()` reads it, RMM's rule) the allocation is tried again, else the error reaches
/// the caller. The callback runs with no lock of the resource held, so it may free memory
/// into the same stack. An exception it raises reaches the caller of `allocate` unchanged.
/// A callback that always answers true retries until Ctrl-C (checked after every call).
///
/// Example::
///
///     cache = []
///
///     def on_failure(nbytes):
///         freed = bool(cache)
///         cache.clear()  # give cached buffers back, then try again
///         return freed
///
///     upstream = mr.FailureCallbackResourceAdaptor(mr.CudaAsyncMemoryResource(), on_failure)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "FailureCallbackResourceAdaptor")]
pub struct PyFailureCallbackResourceAdaptor {
    callback: Arc<CallbackSlot>,
    upstream: Upstream,
}

#[pymethods]
impl PyFailureCallbackResourceAdaptor {
    #[new]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        callback: &Bound<'_, PyAny>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let callback = CallbackSlot::new(require_callable(callback, "callback")?);
        let inner =
            FailureCallbackAdaptor::new(upstream_ref(upstream_mr), failure_callback(callback.clone()))
                .or_raise(upstream_mr.py())?;
        Ok(init(Arc::new(inner), upstream_mr, |upstream| Self { callback, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.callback.traverse(&visit)?;
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.callback.clear();
        self.upstream.clear();
    }
}

/// Prefetches every allocation to the device on the allocating stream
/// (`cuMemPrefetchAsync`): for managed memory, which otherwise migrates on first touch.
/// Frees are passed on as given.
///
/// Example::
///
///     prefetched = mr.PrefetchResourceAdaptor(mr.ManagedMemoryResource())
///     buf = streampool.DeviceBuffer(size=1 << 20, mr=prefetched)  # prefetched to the device
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "PrefetchResourceAdaptor")]
pub struct PyPrefetchResourceAdaptor {
    upstream: Upstream,
}

#[pymethods]
impl PyPrefetchResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyMemoryResource>) -> PyResult<PyClassInitializer<Self>> {
        let inner = PrefetchAdaptor::new(upstream_ref(upstream_mr)).or_raise(upstream_mr.py())?;
        Ok(init(Arc::new(inner), upstream_mr, |upstream| Self { upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }
}

// ---------------------------------------------------------------------------------------
// Callbacks as a resource.

/// The core resource behind `CallbackMemoryResource`: every allocation and free is a call
/// of a Python function, with the GIL re-taken and no lock held across the call (the
/// slots' locks are held only to clone the function).
struct CallbackResource {
    backend: BackendRef,
    device: i32,
    allocate: Arc<CallbackSlot>,
    deallocate: Arc<CallbackSlot>,
}

impl std::fmt::Debug for CallbackResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // As every resource's: its device and backend.
        write!(f, "CallbackMemoryResource(device={}, {})", self.device, self.backend.describe())
    }
}

/// The stream as the Python object a callback receives: the default-stream constants for
/// the default streams, otherwise a `Stream` over the same handle.
fn stream_object(py: Python<'_>, stream: &Stream) -> PyResult<Py<PyStream>> {
    if stream.is_legacy() {
        Ok(default_stream(py)?.clone_ref(py))
    } else if stream.is_per_thread() {
        Ok(per_thread_stream(py)?.clone_ref(py))
    } else {
        Py::new(py, PyStream::from(stream.clone()))
    }
}

/// The address an allocate function returned: an int (or an object with `__index__`, such
/// as a NumPy integer, but not a bool) in `0..2**64`, else TypeError or ValueError, naming
/// what came back.
fn returned_ptr(answer: &Bound<'_, PyAny>) -> PyResult<DevPtr> {
    let Some(answer) = crate::as_index(answer)? else {
        let ty = answer.get_type().fully_qualified_name()?;
        return Err(PyTypeError::new_err(format!(
            "the allocate function of a CallbackMemoryResource must return the address as an int, not {ty}"
        )));
    };
    answer.extract::<DevPtr>().map_err(|_| {
        PyValueError::new_err(format!(
            "the allocate function of a CallbackMemoryResource returned {answer}, which is not an address \
             (must be in 0..2**64)"
        ))
    })
}

/// The interpreter is needed to call a Python function; at shutdown there is none.
fn no_interpreter(what: &str) -> streampool::Error {
    streampool::Error::Unsupported(format!("{what}: the Python interpreter is not available (shutting down)"))
}

impl MemoryResource for CallbackResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        "CallbackMemoryResource"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> streampool::Result<DevPtr> {
        const WHAT: &str = "allocate function";
        crate::gil::try_attach(|py| {
            let Some(f) = self.allocate.get(py) else { return Err(no_interpreter(WHAT)) };
            let call = || -> PyResult<DevPtr> {
                let answer = f.bind(py).call1((bytes, stream_object(py, stream)?))?;
                returned_ptr(&answer)
            };
            match call() {
                // A null pointer for a real request: the function had no memory to give.
                Ok(0) => Err(streampool::Error::OutOfMemory {
                    requested: bytes,
                    available: None,
                    resource: "CallbackMemoryResource (its allocate function returned 0)".into(),
                }),
                // Every resource's memory is 256-byte aligned: pools carve blocks out of
                // it, and kernels work on aligned words. Given back, then refused.
                Ok(ptr) if ptr % 256 != 0 => {
                    let given_back = self.do_deallocate(ptr, bytes, stream).err();
                    Err(streampool::Error::InvalidArgument(format!(
                        "CallbackMemoryResource's allocate function returned {ptr:#x}, which is not \
                         256-byte aligned (every resource's memory is){}",
                        given_back.map_or(String::new(), |e| format!("; giving it back failed too: {e}"))
                    )))
                }
                Ok(ptr) => Ok(ptr),
                // A MemoryError is out of memory to the adaptors above (a failure callback
                // retries, as RMM's does), and reaches the caller unchanged.
                Err(e) => match (e.is_instance_of::<PyMemoryError>(py), callback_error(py, WHAT, e)) {
                    (true, streampool::Error::Callback(key)) => {
                        Err(streampool::Error::CallbackOutOfMemory(key))
                    }
                    (_, other) => Err(other),
                },
            }
        })
        .unwrap_or_else(|| Err(no_interpreter(WHAT)))
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> streampool::Result<()> {
        const WHAT: &str = "deallocate function";
        crate::gil::try_attach(|py| {
            let Some(f) = self.deallocate.get(py) else { return Err(no_interpreter(WHAT)) };
            let call = || -> PyResult<()> {
                f.bind(py).call1((ptr, bytes, stream_object(py, stream)?))?;
                Ok(())
            };
            call().map_err(|e| callback_error(py, WHAT, e))
        })
        .unwrap_or_else(|| Err(no_interpreter(WHAT)))
    }
}

/// Allocates and frees through two Python functions, RMM's `CallbackMemoryResource`:
/// `allocate_func(size, stream) -> ptr` and `deallocate_func(ptr, size, stream)`, where
/// `stream` is a `streampool.Stream`. For debugging and experiments: every call takes the
/// GIL. An exception either function raises reaches the caller of allocate/deallocate
/// unchanged; an allocate result that is not an int raises TypeError there, and an address
/// that is not 256-byte aligned is given back to `deallocate_func` and refused
/// (InvalidArgumentError).
///
/// Example::
///
///     base = mr.CudaAsyncMemoryResource()
///
///     def allocate(size, stream):
///         print(f"allocating {size} bytes")
///         return base.allocate(size, stream)
///
///     def deallocate(ptr, size, stream):
///         base.deallocate(ptr, size, stream)
///
///     streampool.set_current_device_resource(mr.CallbackMemoryResource(allocate, deallocate))
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = "CallbackMemoryResource")]
pub struct PyCallbackMemoryResource {
    allocate: Arc<CallbackSlot>,
    deallocate: Arc<CallbackSlot>,
}

#[pymethods]
impl PyCallbackMemoryResource {
    #[new]
    #[pyo3(signature = (allocate_func, deallocate_func, *, device=None))]
    fn new(
        py: Python<'_>,
        allocate_func: &Bound<'_, PyAny>,
        deallocate_func: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let device = crate::device_arg(device, "device")?;
        let allocate = CallbackSlot::new(require_callable(allocate_func, "allocate_func")?);
        let deallocate = CallbackSlot::new(require_callable(deallocate_func, "deallocate_func")?);
        let (backend, device) = detached(py, move || streampool::resources::bind(device))?;
        let inner =
            CallbackResource { backend, device, allocate: allocate.clone(), deallocate: deallocate.clone() };
        Ok(PyMemoryResource::base(Arc::new(inner)).add_subclass(Self { allocate, deallocate }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.allocate.traverse(&visit)?;
        self.deallocate.traverse(&visit)
    }

    fn __clear__(&self) {
        self.allocate.clear();
        self.deallocate.clear();
    }
}

// ---------------------------------------------------------------------------------------
// Fixed-size blocks and binning.

/// Hands out blocks of one size (`block_size`, default 1 MiB) carved from chunks of
/// `blocks_to_preallocate` blocks taken from the upstream as needed; an allocation larger
/// than a block raises OutOfMemoryError (a MemoryError, as RMM's `out_of_memory`), naming
/// the block size. Not a general resource: the bins of
/// `BinningMemoryResource` are made of these.
///
/// Example::
///
///     blocks = mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), block_size="1MiB")
///     ptr = blocks.allocate(1000)  # any size up to the block size takes one block
///     blocks.deallocate(ptr, 1000)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "FixedSizeMemoryResource")]
pub struct PyFixedSizeMemoryResource {
    inner: Arc<FixedSizeMemoryResource>,
    blocks_to_preallocate: usize,
    upstream: Upstream,
}

#[pymethods]
impl PyFixedSizeMemoryResource {
    #[new]
    #[pyo3(
        signature = (upstream_mr, block_size=None, blocks_to_preallocate=None),
        text_signature = "(upstream_mr, block_size=None, blocks_to_preallocate=128)"
    )]
    fn new(
        py: Python<'_>,
        upstream_mr: &Bound<'_, PyMemoryResource>,
        block_size: Option<&Bound<'_, PyAny>>,
        blocks_to_preallocate: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let block_size = block_size.map(|b| positive_size(b, "block_size")).transpose()?.unwrap_or(1 << 20);
        let blocks_to_preallocate = match blocks_to_preallocate {
            Some(n) => count_arg(n, "blocks_to_preallocate", 1, usize::MAX as u64)? as usize,
            None => 128,
        };
        let upstream = upstream_ref(upstream_mr);
        let inner =
            detached(py, move || FixedSizeMemoryResource::new(upstream, block_size, blocks_to_preallocate))?;
        let inner = Arc::new(inner);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, blocks_to_preallocate, upstream }))
    }

    /// The size of every block, in bytes (as asked, rounded up to 256).
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_bytes()
    }

    /// Blocks taken from the upstream at a time.
    #[getter]
    fn blocks_to_preallocate(&self) -> usize {
        self.blocks_to_preallocate
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }
}

/// Routes each allocation to the bin of the smallest size class that fits it, and larger
/// ones to the upstream. With `min_size_exponent` and `max_size_exponent`, starts with a
/// `FixedSizeMemoryResource` bin for every power of two in
/// `[2**min_size_exponent, 2**max_size_exponent]`; `add_bin` adds more. A free with another
/// size than allocated, a double free or a pointer it did not hand out raises
/// InvalidPointerError.
///
/// Example::
///
///     upstream = mr.CudaAsyncMemoryResource()
///     binning = mr.BinningMemoryResource(upstream, 18, 22)  # bins of 256 KiB to 4 MiB
///     ptr = binning.allocate(300_000)  # from the 512 KiB bin
///     binning.deallocate(ptr, 300_000)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "BinningMemoryResource")]
pub struct PyBinningMemoryResource {
    inner: Arc<BinningMemoryResource>,
    // The bin resources given from Python, kept alive with this one.
    bin_mrs: Mutex<Vec<Py<PyMemoryResource>>>,
    upstream: Upstream,
}

/// A size exponent: None or -1 (RMM's "none"), else an int in `0..=MAX_SIZE_EXPONENT`,
/// refused with the core's own message.
fn exponent_arg(value: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u32>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(None) };
    match count_arg(value, what, 0, u64::from(adaptors::MAX_SIZE_EXPONENT)) {
        Ok(e) => Ok(Some(e as u32)),
        Err(e) if e.is_instance_of::<PyTypeError>(value.py()) => Err(e),
        Err(_) if value.eq(-1)? => Ok(None),
        Err(_) => Err(adaptors::size_exponent_error(what, value)).or_raise(value.py()),
    }
}

#[pymethods]
impl PyBinningMemoryResource {
    #[new]
    #[pyo3(signature = (upstream_mr, min_size_exponent=None, max_size_exponent=None))]
    fn new(
        py: Python<'_>,
        upstream_mr: &Bound<'_, PyMemoryResource>,
        min_size_exponent: Option<&Bound<'_, PyAny>>,
        max_size_exponent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let min = exponent_arg(min_size_exponent, "min_size_exponent")?;
        let max = exponent_arg(max_size_exponent, "max_size_exponent")?;
        let upstream = upstream_ref(upstream_mr);
        let inner = Arc::new(detached(py, move || BinningMemoryResource::new(upstream, min, max))?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self {
            inner,
            bin_mrs: Mutex::new(Vec::new()),
            upstream,
        }))
    }

    /// Adds a bin for allocations up to `allocation_size` bytes (rounded up to 256; and
    /// larger than the next smaller bin), served by `bin_resource`, or by a new
    /// `FixedSizeMemoryResource` of that block size when None. For a size that has a bin
    /// already: None changes nothing (as RMM), a resource replaces the bin's (ValueError
    /// while that bin has allocations outstanding).
    ///
    /// Example::
    ///
    ///     binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 20)
    ///     binning.add_bin(1 << 15, mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource()))
    #[pyo3(signature = (allocation_size, bin_resource=None))]
    fn add_bin(
        &self,
        py: Python<'_>,
        allocation_size: &Bound<'_, PyAny>,
        bin_resource: Option<&Bound<'_, PyMemoryResource>>,
    ) -> PyResult<()> {
        let size = positive_size(allocation_size, "allocation_size")?;
        let resource = bin_resource.map(upstream_ref);
        let mr = self.inner.clone();
        detached(py, move || mr.add_bin(size, resource))?;
        let mut given = lock(&self.bin_mrs);
        if let Some(bin) = bin_resource {
            given.push(bin.clone().unbind());
        }
        // The bins as they are now, read under the lock: a snapshot taken before it could
        // miss a bin another thread added meanwhile, whose resource would then be dropped
        // from `bin_mrs`. (The bins' lock is never held across Python code.)
        let bins = self.inner.bins();
        // A replaced resource is no longer a bin: it is not kept alive (dropped after the lock).
        let in_use = |m: &Py<PyMemoryResource>| {
            bins.iter().any(|(_, r)| std::ptr::addr_eq(Arc::as_ptr(&m.get().inner), Arc::as_ptr(r)))
        };
        let (keep, dropped): (Vec<_>, Vec<_>) = std::mem::take(&mut *given).into_iter().partition(in_use);
        *given = keep;
        drop(given);
        drop(dropped);
        Ok(())
    }

    /// The bin resources given to `add_bin`, in the order given (RMM's `bin_mrs`).
    #[getter]
    fn bin_mrs(&self, py: Python<'_>) -> Vec<Py<PyMemoryResource>> {
        lock(&self.bin_mrs).iter().map(|m| m.clone_ref(py)).collect()
    }

    /// Every bin as `(allocation_size, resource)`, smallest first. Bins made here (no
    /// resource given) appear as plain `MemoryResource` objects.
    #[getter]
    fn bins<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let mr = self.inner.clone();
        let bins = detached(py, move || Ok(mr.bins()))?;
        let given: Vec<Py<PyMemoryResource>> = self.bin_mrs(py);
        bins.into_iter()
            .map(|(size, resource)| {
                let same = |m: &&Py<PyMemoryResource>| {
                    std::ptr::addr_eq(Arc::as_ptr(&m.get().inner), Arc::as_ptr(&resource))
                };
                let obj = match given.iter().find(same) {
                    Some(m) => m.clone_ref(py),
                    None => Py::new(py, PyMemoryResource::base(resource))?,
                };
                PyTuple::new(py, [size.into_pyobject(py)?.into_any(), obj.into_bound(py).into_any()])
            })
            .collect()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(bins) = self.bin_mrs.try_lock() {
            for bin in bins.iter() {
                visit.call(bin)?;
            }
        }
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        let bins = std::mem::take(&mut *lock(&self.bin_mrs));
        drop(bins); // after the lock: dropping may run Python code
        self.upstream.clear();
    }
}
