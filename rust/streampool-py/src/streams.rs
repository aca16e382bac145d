//! `streampool.Stream`, the default-stream constants, and the one conversion that every
//! `stream=` argument goes through.

use std::borrow::Cow;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use pyo3::exceptions::{PyNotImplementedError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyInt, PyTuple};
use streampool::device::{self, BackendRef, RawStream};
use streampool::Stream;

use crate::errors::{detached, OrRaise};

/// A CUDA stream: one streampool created and owns, one borrowed from another library, or
/// one of the default streams.
///
/// `Stream(device=None, blocking=False)` creates a stream on `device` (the current device
/// when None) of the current backend (the CUDA driver, or the active simulated device).
/// It is non-blocking unless `blocking` (or `flags=CudaStreamFlags.SYNC_DEFAULT`, also
/// second positionally as RMM's `Stream(obj=None, flags=None)`): it does not synchronise
/// with the legacy default stream. It is destroyed when the last reference
/// to it (including buffers made on it) goes away.
///
/// `Stream(obj)`, as RMM's: wraps another library's stream (an object with
/// `__cuda_stream__`, a `torch.cuda.Stream`, a `cupy.cuda.Stream`, a Numba stream, or a
/// `streampool.Stream`), keeping `obj` alive.
///
/// Example::
///
///     s = streampool.Stream()                                       # new, non-blocking
///     b = streampool.Stream(flags=mr.CudaStreamFlags.SYNC_DEFAULT)  # new, blocking
///     t = streampool.Stream(torch.cuda.current_stream())            # torch's (PyTorch, a GPU)
#[derive(Debug)]
#[pyclass(frozen, module = "streampool", name = "Stream")]
pub struct PyStream {
    pub(crate) inner: Stream,
    /// The object a wrapped stream came from (`Stream(obj)`), kept alive with it.
    owner: Option<Py<PyAny>>,
}

static DEFAULT_STREAM: PyOnceLock<Py<PyStream>> = PyOnceLock::new();
static PER_THREAD_DEFAULT_STREAM: PyOnceLock<Py<PyStream>> = PyOnceLock::new();

/// `streampool.DEFAULT_STREAM` (also `LEGACY_DEFAULT_STREAM`: handles 0 and 1 are one
/// stream), one object for the whole process.
pub(crate) fn default_stream(py: Python<'_>) -> PyResult<&Py<PyStream>> {
    DEFAULT_STREAM.get_or_try_init(py, || Py::new(py, PyStream::from(Stream::legacy())))
}

/// `streampool.PER_THREAD_DEFAULT_STREAM`.
pub(crate) fn per_thread_stream(py: Python<'_>) -> PyResult<&Py<PyStream>> {
    PER_THREAD_DEFAULT_STREAM.get_or_try_init(py, || Py::new(py, PyStream::from(Stream::per_thread())))
}

impl From<Stream> for PyStream {
    fn from(inner: Stream) -> Self {
        PyStream { inner, owner: None }
    }
}

/// `CudaStreamFlags` values (RMM's, which are the driver's `CU_STREAM_DEFAULT` and
/// `CU_STREAM_NON_BLOCKING`).
const SYNC_DEFAULT: i64 = 0;
const NON_BLOCKING: i64 = 1;

/// Whether a new stream blocks, from `blocking=` and `flags=` (a `CudaStreamFlags` or its
/// int value), which must agree when both are given.
fn blocking_from(blocking: Option<bool>, flags: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let Some(flags) = flags.filter(|f| !f.is_none()) else { return Ok(blocking.unwrap_or(false)) };
    // Any integer (CudaStreamFlags, a NumPy integer: whatever has `__index__`), not a bool.
    let Some(int) = crate::as_index(flags)? else {
        return Err(PyTypeError::new_err(format!(
            "flags must be an integer, CudaStreamFlags.SYNC_DEFAULT (0) or CudaStreamFlags.NON_BLOCKING (1), \
             got {} of type {}",
            flags.repr()?,
            flags.get_type().name()?
        )));
    };
    let value = int.extract::<i64>().ok();
    let from_flags = match value {
        Some(SYNC_DEFAULT) => true,
        Some(NON_BLOCKING) => false,
        _ => {
            return Err(PyValueError::new_err(format!(
                "flags must be CudaStreamFlags.SYNC_DEFAULT (0) or CudaStreamFlags.NON_BLOCKING (1), got {}",
                flags.repr()?
            )))
        }
    };
    match blocking {
        Some(b) if b != from_flags => Err(PyValueError::new_err(format!(
            "blocking={} contradicts flags={}; give one of them",
            if b { "True" } else { "False" },
            flags.repr()?
        ))),
        _ => Ok(from_flags),
    }
}

impl PyStream {
    /// The backend and device to wait on: the stream's own, or for a default stream (which
    /// exists everywhere) the current backend's current device.
    fn placement(&self) -> streampool::Result<(BackendRef, i32)> {
        match self.inner.binding() {
            Some((backend, device)) => Ok((backend.clone(), device)),
            None => {
                let backend = device::backend()?;
                let device = backend.current_device()?;
                Ok((backend, device))
            }
        }
    }

    fn key(&self) -> (Option<u64>, RawStream) {
        (self.inner.binding().map(|(b, _)| b.id()), self.inner.handle())
    }

    /// `Stream(obj)`: another library's stream (or one of ours), kept alive with the
    /// wrapper. Options that only make sense for a new stream are refused.
    fn wrap(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        blocking: Option<bool>,
        flags: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if device.is_some_and(|d| !d.is_none()) || blocking.is_some() || flags.is_some_and(|f| !f.is_none()) {
            return Err(PyTypeError::new_err(
                "Stream(obj) wraps an existing stream: device=, blocking= and flags= only apply to a new \
                 stream (Stream(device=..., blocking=...))",
            ));
        }
        if obj.is_instance_of::<PyInt>() {
            // RMM's Stream(obj) refuses ints too; here an int could be read as a device or as
            // a handle, so neither guess is made.
            let ty = obj.get_type().fully_qualified_name()?;
            return Err(PyTypeError::new_err(format!(
                "Stream(obj) takes a stream object, not {ty} {}: use Stream(device={}) for a new stream on a \
                 device, or pass a raw handle directly as any stream= argument",
                obj.repr()?,
                obj.repr()?
            )));
        }
        if let Ok(ours) = obj.cast::<PyStream>() {
            let ours = ours.get();
            let owner = ours.owner.as_ref().map(|o| o.clone_ref(py)).unwrap_or_else(|| obj.clone().unbind());
            return Ok(PyStream { inner: ours.inner.clone(), owner: Some(owner) });
        }
        let backend = detached(py, device::backend)?;
        let inner = foreign_stream(py, obj, &backend, false)?;
        Ok(PyStream { inner, owner: Some(obj.clone().unbind()) })
    }
}

#[pymethods]
impl PyStream {
    /// The object a wrapped stream came from, for the collector (a cycle through
    /// `Stream(self)` held by `self` is collected).
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.owner)
    }

    #[new]
    #[pyo3(signature = (obj=None, flags=None, *, device=None, blocking=None))]
    fn new(
        py: Python<'_>,
        obj: Option<&Bound<'_, PyAny>>,
        flags: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        blocking: Option<bool>,
    ) -> PyResult<Self> {
        if let Some(obj) = obj.filter(|o| !o.is_none()) {
            return Self::wrap(py, obj, device, blocking, flags);
        }
        let device = crate::device_arg(device, "device")?;
        let blocking = blocking_from(blocking, flags)?;
        let inner = detached(py, move || {
            let (backend, device) = streampool::resources::bind(device)?;
            Stream::create(&backend, device, blocking)
        })?;
        Ok(PyStream::from(inner))
    }

    /// The driver's handle as an integer: 0 for the legacy default stream, 2 for the
    /// per-thread default stream.
    #[getter]
    fn handle(&self) -> RawStream {
        self.inner.handle()
    }

    /// The device the stream belongs to; None for the default streams, which exist on
    /// every device.
    #[getter]
    fn device(&self) -> Option<i32> {
        self.inner.binding().map(|(_, d)| d)
    }

    /// Waits until all work enqueued on the stream has completed (GIL released). On a
    /// stream streampool made, the sharded pool learns from it that the frees made on the
    /// stream before it have completed: other streams reuse that memory with no event.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let (backend, device) = self.placement().or_raise(py)?;
        let stream = self.inner.clone();
        detached(py, move || stream.synchronize(&backend, device))
    }

    /// Orders the work enqueued on this stream from now on after the work enqueued on
    /// `other` so far: an event recorded on `other`, which this stream waits for; the host
    /// does not wait (as `torch.cuda.Stream.wait_stream`). `other` is any stream a
    /// `stream=` argument takes (a `streampool.Stream`, another library's stream object, a
    /// handle), of this stream's device or another. Use it to hand memory between streams:
    /// before memory written on `other` is read on this stream, and before memory that
    /// `other` still reads is freed on this one.
    ///
    /// Example::
    ///
    ///     producer, consumer = streampool.Stream(), streampool.Stream()
    ///     buf = streampool.DeviceBuffer.to_device(b"data", stream=producer)
    ///     consumer.wait_stream(producer)  # the consumer's kernels see the copy
    fn wait_stream(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<()> {
        let (backend, device) = self.placement().or_raise(py)?;
        let other = to_stream(py, Some(other), || &backend)?.into_owned();
        let other_device = other.device_or(device);
        let this = self.inner.clone();
        detached(py, move || this.wait_for(&backend, device, &other, other_device))
    }

    /// The cuda.core stream protocol: `(version, handle)`.
    fn __cuda_stream__(&self) -> (i32, RawStream) {
        (0, self.inner.handle())
    }

    fn __int__(&self) -> RawStream {
        self.inner.handle()
    }

    fn __eq__(&self, other: PyRef<'_, PyStream>) -> bool {
        self.key() == other.key()
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.key().hash(&mut h);
        h.finish()
    }

    /// True for the default streams (legacy and per-thread), as RMM's `is_default()`.
    fn is_default(&self) -> bool {
        self.inner.is_legacy() || self.inner.is_per_thread()
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        if s.is_legacy() {
            "<Stream legacy default (handle 0)>".to_string()
        } else if s.is_per_thread() {
            "<Stream per-thread default (handle 2)>".to_string()
        } else {
            let how = if s.is_owned() { "owned" } else { "borrowed" };
            let device = self.device().unwrap_or(0);
            format!("<Stream {:#x} {how}, device {device}>", s.handle())
        }
    }
}

/// The one conversion behind every `stream=` argument, resolved against the backend of
/// the object that will use the stream:
///
/// * None: the legacy default stream;
/// * a `streampool.Stream`;
/// * an int handle (0 and 1: legacy default, 2: per-thread default, else a live stream);
/// * any object with `__cuda_stream__()` (cuda.core's protocol: `(version, handle)`);
/// * `torch.cuda.Stream` (`.cuda_stream`), `cupy.cuda.Stream` (`.ptr`), Numba streams
///   (`.handle.value`, or `int(stream)`).
///
/// A handle that names no live stream raises InvalidStreamError; anything else TypeError.
///
/// The common forms cost no more than a type check: a `streampool.Stream` is borrowed, not
/// cloned (an owned stream's clone is an atomic increment and decrement), and `backend`, a
/// chain of virtual calls through a resource's adaptors, is asked only for a handle.
/// Inlined: returned through memory, the result is read back in wider loads than it was
/// written with, a store-forwarding stall of a few nanoseconds on every call.
#[inline]
pub(crate) fn to_stream<'a, 'b>(
    py: Python<'_>,
    obj: Option<&'a Bound<'_, PyAny>>,
    backend: impl FnOnce() -> &'b BackendRef,
) -> PyResult<Cow<'a, Stream>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Cow::Owned(Stream::legacy())) };
    if let Ok(s) = obj.cast::<PyStream>() {
        return Ok(Cow::Borrowed(&s.get().inner));
    }
    foreign_stream(py, obj, backend(), true).map(Cow::Owned)
}

/// A DLPack consumer's `stream`: as [`to_stream`], but a bare handle is taken as live, as
/// DLPack's contract has it (the consumer passes a stream of its own, current), even where
/// its value is that of a stream streampool destroyed: the driver reuses handle values, and
/// another library's new stream may carry one (`cupy.from_dlpack` inside `with
/// cupy.cuda.Stream():` was refused so on the H200).
pub(crate) fn consumer_stream(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    backend: &BackendRef,
) -> PyResult<Stream> {
    if obj.is_instance_of::<PyInt>() {
        return Stream::borrowed_live(backend, handle_value(obj, obj)?).or_raise(py);
    }
    to_stream(py, Some(obj), || backend).map(Cow::into_owned)
}

/// Another library's stream object (or a bare handle) as a stream; `for_call`: for one
/// call, where a capturing stream is wrapped as such ([`Stream::borrowed_for_call`]),
/// else (a `streampool.Stream` that lives on) refused while it captures.
fn foreign_stream(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    backend: &BackendRef,
    for_call: bool,
) -> PyResult<Stream> {
    let handle = match foreign_handle(obj)? {
        Some(h) => h,
        None => {
            let ty = obj.get_type().fully_qualified_name()?;
            return Err(PyTypeError::new_err(format!(
                "cannot use a {ty} as a stream: pass a streampool.Stream, an int handle, an object \
                 with __cuda_stream__ (cuda.core), a torch.cuda.Stream, a cupy.cuda.Stream or a Numba \
                 stream"
            )));
        }
    };
    let stream_handle = handle_value(obj, &handle)?;
    // A stream object that is alive vouches for its handle, which may then be asked whether
    // it captures a CUDA graph; a bare int does not (the question crashes the driver on a
    // destroyed stream's handle).
    if obj.is_instance_of::<PyInt>() {
        return Stream::borrowed(backend, stream_handle).or_raise(py);
    }
    let stream = Stream::borrowed_for_call(backend, stream_handle).or_raise(py)?;
    if stream.is_capturing() && !for_call {
        return Err(streampool::Error::InvalidStream(format!(
            "stream {stream_handle:#x} is capturing a CUDA graph: a streampool.Stream made from it during \
             the capture would stay marked so after it; pass the capturing library's stream object as \
             each call's stream= instead (docs/frameworks.md, \"CUDA graphs\")"
        )))
        .or_raise(py);
    }
    Ok(stream)
}

/// The handle an object carries, as a Python int, or None when it is not a stream we know.
fn foreign_handle<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(None);
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(Some(obj.clone()));
    }
    if let Some(proto) = obj.getattr_opt("__cuda_stream__")? {
        let pair = proto.call0()?;
        let pair = pair.cast::<PyTuple>().ok().filter(|p| p.len() == 2).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "__cuda_stream__() must return a (version, handle) pair, not {}",
                pair.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        if pair.get_item(0)?.extract::<i64>().ok() != Some(0) {
            return Err(PyNotImplementedError::new_err(format!(
                "__cuda_stream__ protocol version {} is not supported (only version 0; it returned {})",
                pair.get_item(0)?.repr()?,
                pair.repr()?
            )));
        }
        return Ok(Some(pair.get_item(1)?));
    }
    if let Some(h) = obj.getattr_opt("cuda_stream")? {
        return Ok(Some(h)); // torch.cuda.Stream
    }
    // `.ptr` and `.handle` are common names: an object that exports memory (a DeviceBuffer,
    // an array) is refused rather than having its address taken for a stream.
    let ty = obj.get_type();
    if ty.hasattr("__cuda_array_interface__")? || ty.hasattr("__dlpack__")? {
        return Ok(None);
    }
    if let Some(h) = obj.getattr_opt("ptr")? {
        return Ok(Some(h)); // cupy.cuda.Stream
    }
    if let Some(h) = obj.getattr_opt("handle")? {
        // Numba: a ctypes c_void_p whose `.value` is the address (None for the null
        // stream), or, in numba-cuda over cuda.bindings, a `CUstream` that converts with int().
        return match h.getattr_opt("value")? {
            Some(v) if v.is_none() => Ok(Some(0_i32.into_pyobject(obj.py())?.into_any())),
            Some(v) => Ok(Some(v)),
            None => Ok(Some(crate::handle_int(&h)?.unwrap_or(h))),
        };
    }
    let module = obj.get_type().module().map(|m| m.to_string()).unwrap_or_default();
    if module.split('.').next() == Some("numba") {
        return Ok(Some(obj.call_method0("__int__")?)); // other Numba stream objects
    }
    Ok(None)
}

fn handle_value(obj: &Bound<'_, PyAny>, handle: &Bound<'_, PyAny>) -> PyResult<RawStream> {
    if !handle.is_instance_of::<PyInt>() || handle.is_instance_of::<PyBool>() {
        let ty = obj.get_type().fully_qualified_name()?;
        return Err(PyTypeError::new_err(format!("the stream handle of a {ty} is not an int: {handle}")));
    }
    handle
        .extract::<RawStream>()
        .map_err(|_| PyValueError::new_err(format!("{handle} is not a stream handle (must be in 0..2**64)")))
}
