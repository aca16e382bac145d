//! `streampool.DeviceBuffer`: memory from a resource, ordered on a stream, exported through
//! the CUDA array interface and DLPack, freed on its stream when collected or closed.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyCapsule, PyDict, PyInt, PyString, PyTuple};
use streampool::device::{Advice, DevPtr, Location};
use streampool::{managed, Allocation, Stream};

use crate::dlpack;
use crate::errors::{buffer_error, detached, fast_path_settled, OrRaise};
use crate::resources::{get_current_device_resource, PyMemoryResource};
use crate::size_arg;
use crate::streams::{default_stream, to_stream};

/// Untyped memory of `size` bytes from `mr` (default: the current device's resource),
/// ordered on `stream` (default: the legacy default stream).
///
/// The memory may be used by work enqueued on `stream` after the buffer is made; it is
/// freed on that stream when the buffer is collected or `close()`d. Exports: the CUDA
/// array interface (v3) and DLPack (a 1-D uint8 tensor).
#[derive(Debug)]
#[pyclass(frozen, weakref, module = "streampool", name = "DeviceBuffer")]
pub struct DeviceBuffer {
    // The lock is held only to look at, share or take the memory.
    memory: Mutex<Memory>,
    size: usize,
    mr: Py<PyMemoryResource>,
    // The stream object as given (a torch or cupy stream stays alive with the buffer).
    stream: Py<PyAny>,
}

/// A buffer's memory: its own until something shares it (an in-flight copy or a DLPack
/// consumer holds an `Arc`, which keeps the memory valid even if the buffer is closed
/// meanwhile). Most buffers are never shared: an `Arc` up front would cost each one a heap
/// allocation and free.
#[derive(Debug, Default)]
enum Memory {
    Own(Allocation),
    Shared(Arc<Allocation>),
    #[default]
    Closed,
}

impl Memory {
    fn get(&self) -> Option<&Allocation> {
        match self {
            Memory::Own(alloc) => Some(alloc),
            Memory::Shared(alloc) => Some(alloc),
            Memory::Closed => None,
        }
    }
}

/// Drops `value` with the GIL released (freeing can wait for the device: `cuMemFree`),
/// unless the interpreter is shutting down, when dropping it with the GIL held is the only
/// option.
fn drop_detached<T: Send>(value: T) {
    let mut value = Some(value);
    let _ = Python::try_attach(|py| {
        let value = value.take();
        py.detach(move || drop(value));
    });
    drop(value);
}

impl DeviceBuffer {
    fn make(
        py: Python<'_>,
        size: usize,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let mr = match mr {
            Some(mr) => mr.unbind(),
            None => get_current_device_resource(py)?,
        };
        let resource = &mr.get().inner;
        let core_stream = to_stream(py, stream, || resource.backend())?;
        let alloc = match Allocation::try_new(resource, size, &core_stream) {
            Some(settled) => {
                fast_path_settled(py);
                settled.or_raise(py)?
            }
            None => {
                let (resource, core_stream) = (resource.clone(), core_stream.into_owned());
                detached(py, move || Allocation::new(resource, size, core_stream))?
            }
        };
        let stream = match stream.filter(|s| !s.is_none()) {
            Some(s) => s.clone().unbind(),
            None => default_stream(py)?.clone_ref(py).into_any(),
        };
        Ok(DeviceBuffer { memory: Mutex::new(Memory::Own(alloc)), size, mr, stream })
    }

    fn slot(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocation, shared from now on; ValueError once closed.
    fn live(&self) -> PyResult<Arc<Allocation>> {
        let mut slot = self.slot();
        let shared = match std::mem::take(&mut *slot) {
            Memory::Own(alloc) => Arc::new(alloc),
            Memory::Shared(alloc) => alloc,
            Memory::Closed => return Err(closed()),
        };
        *slot = Memory::Shared(shared.clone());
        Ok(shared)
    }

    /// Copies `bytes` between the buffer's start and host memory at `host`, on `stream`
    /// (the buffer's own when None), and waits for the copy, with the GIL released. The
    /// caller keeps the host memory alive and unchanged in size until this returns.
    fn transfer(
        &self,
        py: Python<'_>,
        host: u64,
        bytes: usize,
        to_host: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let alloc = self.live()?;
        let resource = alloc.resource().clone();
        let stream = match stream.filter(|s| !s.is_none()) {
            Some(s) => to_stream(py, Some(s), || resource.backend())?.into_owned(),
            None => alloc.stream().clone(),
        };
        if bytes == 0 {
            return Ok(());
        }
        detached(py, move || {
            let (backend, device) = (resource.backend(), resource.device());
            stream.check(backend, device)?;
            let (dst, src) = if to_host { (host, alloc.ptr()) } else { (alloc.ptr(), host) };
            // SAFETY: the host side is valid for `bytes` (checked by the callers) and stays
            // so until this function returns, after the synchronisation below; the device
            // side is this live allocation, at least `bytes` long.
            unsafe { backend.memcpy_async(device, dst, src, bytes, stream.handle())? };
            backend.stream_synchronize(device, stream.handle())
        })
    }

    fn stream_of(alloc: &Allocation) -> &Stream {
        alloc.stream()
    }

    /// The live allocation, checked to be managed memory for `what`: ValueError when
    /// closed, InvalidArgumentError naming the resource when not managed.
    fn live_managed(&self, py: Python<'_>, what: &str) -> PyResult<Arc<Allocation>> {
        let alloc = self.live()?;
        managed::require_managed(alloc.resource().as_ref(), what, "this buffer's").or_raise(py)?;
        Ok(alloc)
    }
}

/// The advice names `DeviceBuffer.advise` takes, and what they mean to the driver.
const ADVICE: [(&str, Advice); 6] = [
    ("read_mostly", Advice::SetReadMostly),
    ("unset_read_mostly", Advice::UnsetReadMostly),
    ("preferred_location", Advice::SetPreferredLocation),
    ("unset_preferred_location", Advice::UnsetPreferredLocation),
    ("accessed_by", Advice::SetAccessedBy),
    ("unset_accessed_by", Advice::UnsetAccessedBy),
];

fn advice_arg(advice: &str) -> PyResult<Advice> {
    ADVICE.iter().find(|(name, _)| *name == advice).map(|&(_, a)| a).ok_or_else(|| {
        let names: Vec<String> = ADVICE.iter().map(|(name, _)| format!("'{name}'")).collect();
        PyValueError::new_err(format!("unknown advice '{advice}'; expected one of {}", names.join(", ")))
    })
}

fn closed() -> PyErr {
    PyValueError::new_err("DeviceBuffer is closed")
}

/// A location from Python: None (`default`), "host", or a device ordinal (an int >= 0).
fn location_arg(obj: Option<&Bound<'_, PyAny>>, default: Location) -> PyResult<Location> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(default) };
    if let Ok(text) = obj.cast::<PyString>() {
        return match &*text.to_cow()? {
            "host" => Ok(Location::Host),
            other => Err(PyValueError::new_err(format!(
                "device must be a device ordinal (an int >= 0), \"host\" or None, not '{other}'"
            ))),
        };
    }
    // An int, or anything with `__index__` (numpy integers), but not a bool.
    let int = match obj.is_instance_of::<PyBool>() {
        false if obj.is_instance_of::<PyInt>() => Some(obj.clone()),
        false => obj.call_method0("__index__").ok(),
        true => None,
    };
    let Some(int) = int else {
        let ty = obj.get_type().fully_qualified_name()?;
        return Err(PyTypeError::new_err(format!(
            "device must be a device ordinal (an int >= 0), \"host\" or None, not {ty}"
        )));
    };
    match int.extract::<i32>() {
        Ok(ordinal) if ordinal >= 0 => Ok(Location::Device(ordinal)),
        _ => Err(PyValueError::new_err(format!(
            "device must be a device ordinal (an int >= 0) or \"host\", not {obj}"
        ))),
    }
}

fn location_value(py: Python<'_>, location: Option<Location>) -> PyResult<Py<PyAny>> {
    Ok(match location {
        None => py.None(),
        Some(Location::Host) => PyString::new(py, "host").into_any().unbind(),
        Some(Location::Device(ordinal)) => ordinal.into_pyobject(py)?.into_any().unbind(),
    })
}

/// A host buffer (buffer protocol), checked to be C-contiguous (and writable when asked).
fn host_buffer(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<PyUntypedBuffer> {
    let buf = PyUntypedBuffer::get(obj).map_err(|e| {
        let ty = obj.get_type().fully_qualified_name().map(|t| t.to_string()).unwrap_or_default();
        let err = PyTypeError::new_err(format!("{what} must support the buffer protocol, not {ty}"));
        err.set_cause(obj.py(), Some(e));
        err
    })?;
    if writable && buf.readonly() {
        return Err(PyValueError::new_err(format!("{what} is read-only")));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be C-contiguous")));
    }
    Ok(buf)
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    #[pyo3(signature = (size=None, stream=None, mr=None), text_signature = "(size=0, stream=None, mr=None)")]
    fn new(
        py: Python<'_>,
        size: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let size = match size.filter(|s| !s.is_none()) {
            Some(s) => size_arg(s, "size")?,
            None => 0,
        };
        Self::make(py, size, stream, mr)
    }

    /// The device address (0 for an empty buffer).
    #[getter]
    fn ptr(&self) -> PyResult<DevPtr> {
        self.slot().get().map(Allocation::ptr).ok_or_else(closed)
    }

    /// The size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// The size in bytes (same as `size`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.size
    }

    /// The stream the buffer was made on, as given (DEFAULT_STREAM when none was).
    #[getter]
    fn stream(&self, py: Python<'_>) -> Py<PyAny> {
        self.stream.clone_ref(py)
    }

    /// The resource the memory came from.
    #[getter]
    fn mr(&self, py: Python<'_>) -> Py<PyMemoryResource> {
        self.mr.clone_ref(py)
    }

    /// True once `close()` has been called, or once the simulated device the buffer was
    /// made on has been exited (the buffer can no longer be used).
    #[getter]
    fn closed(&self) -> bool {
        self.slot().get().is_none() || self.mr.get().inner.backend().check_open().is_err()
    }

    fn __len__(&self) -> usize {
        self.size
    }

    /// The CUDA array interface, version 3: a 1-D array of `size` uint8, with the stream
    /// its data is ordered on (1: legacy default stream, 2: per-thread default stream).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let alloc = self.live()?;
        let stream = Self::stream_of(&alloc);
        let stream_value = if stream.is_legacy() { 1 } else { stream.handle() };
        let d = PyDict::new(py);
        d.set_item("shape", (self.size,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (alloc.ptr(), false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", stream_value)?;
        Ok(d)
    }

    /// `(device_type, device_id)`: kDLCUDA (2) for device memory, kDLCUDAManaged (13) for
    /// managed memory, kDLCUDAHost (3) for pinned host memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let mr = &self.mr.get().inner;
        dlpack::dl_device(mr.memory_kind(), mr.device())
    }

    /// A DLPack capsule of the buffer as a 1-D uint8 tensor (versioned when the consumer
    /// passes `max_version >= (1, 0)`). `stream` is the consumer's stream (None: the legacy
    /// default stream, -1: no synchronisation); it is made to wait for the buffer's stream.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let this = slf.get();
        let alloc = this.live()?;
        let ours = this.__dlpack_device__();
        if let Some(asked) = dl_device.filter(|d| *d != ours) {
            return Err(buffer_error(format!(
                "DeviceBuffer lives on DLPack device {ours:?}; it cannot be exported to {asked:?} without a copy"
            )));
        }
        if copy == Some(true) {
            return Err(buffer_error("DeviceBuffer cannot export a copy; copy=True is not supported"));
        }
        dlpack::order_consumer(slf.py(), &alloc, stream)?;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        dlpack::export(slf, alloc, ours, versioned)
    }

    /// Copies the buffer to host memory and waits for the copy (GIL released). Without
    /// `out`, returns a new bytearray; with `out` (any writable, C-contiguous buffer of at
    /// least `size` bytes), fills and returns it. `stream`: where the copy is ordered
    /// (default: the buffer's own stream).
    #[pyo3(signature = (out=None, stream=None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.live()?;
        match out.filter(|o| !o.is_none()) {
            None => {
                let bytes = PyByteArray::new_with(py, self.size, |host| {
                    self.transfer(py, host.as_mut_ptr() as u64, self.size, true, stream)
                })?;
                Ok(bytes.into_any())
            }
            Some(out) => {
                let buf = host_buffer(out, true, "out")?;
                if buf.len_bytes() < self.size {
                    return Err(PyValueError::new_err(format!(
                        "out has {} bytes; the buffer needs {}",
                        buf.len_bytes(),
                        self.size
                    )));
                }
                self.transfer(py, buf.buf_ptr() as u64, self.size, true, stream)?;
                drop(buf);
                Ok(out.clone())
            }
        }
    }

    /// Copies a host buffer (any buffer-protocol object of at most `size` bytes) to the
    /// start of the buffer and waits for the copy (GIL released). `stream`: where the copy
    /// is ordered (default: the buffer's own stream).
    #[pyo3(signature = (obj, stream=None))]
    fn copy_from_host(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.live()?;
        let buf = host_buffer(obj, false, "the host object")?;
        if buf.len_bytes() > self.size {
            return Err(PyValueError::new_err(format!(
                "the host object has {} bytes; the buffer holds only {}",
                buf.len_bytes(),
                self.size
            )));
        }
        self.transfer(py, buf.buf_ptr() as u64, buf.len_bytes(), false, stream)
    }

    /// The contents as bytes (a copy to the host, ordered on the buffer's stream).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.live()?;
        PyBytes::new_with(py, self.size, |host| {
            self.transfer(py, host.as_mut_ptr() as u64, self.size, true, None)
        })
    }

    /// A new buffer holding a copy of `host_bytes` (any buffer-protocol object).
    #[staticmethod]
    #[pyo3(signature = (host_bytes, stream=None, mr=None))]
    fn to_device(
        py: Python<'_>,
        host_bytes: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let buf = host_buffer(host_bytes, false, "host_bytes")?;
        let made = Self::make(py, buf.len_bytes(), stream, mr)?;
        made.transfer(py, buf.buf_ptr() as u64, buf.len_bytes(), false, None)?;
        Ok(made)
    }

    /// Pickles through a host copy; unpickling allocates from the current resource.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let rebuild = py.import("streampool._native")?.getattr("_rebuild_device_buffer")?;
        let data = self.tobytes(py)?;
        Ok((rebuild, PyTuple::new(py, [data])?))
    }

    /// Prefetches the memory (managed memory only) to `device`: a device ordinal, "host", or
    /// None for the device of the buffer's resource, in order on `stream` (default: the
    /// buffer's own stream), so that work enqueued there afterwards finds its pages in
    /// place. Returns at once (GIL released); the pages move as the stream runs.
    #[pyo3(signature = (device=None, stream=None))]
    fn prefetch(
        &self,
        py: Python<'_>,
        device: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let alloc = self.live_managed(py, "prefetch")?;
        let resource = alloc.resource().clone();
        let to = location_arg(device, Location::Device(resource.device()))?;
        let stream = match stream.filter(|s| !s.is_none()) {
            Some(s) => to_stream(py, Some(s), || resource.backend())?.into_owned(),
            None => alloc.stream().clone(),
        };
        detached(py, move || alloc.prefetch(Some(to), Some(&stream)))
    }

    /// Advises the driver how the memory (managed memory only) will be used: `advice` is one
    /// of "read_mostly", "unset_read_mostly", "preferred_location",
    /// "unset_preferred_location", "accessed_by", "unset_accessed_by"; `device` (a device
    /// ordinal, "host", or None for the buffer's device) is the location the advice is
    /// about, and is ignored by the read-mostly pair.
    #[pyo3(signature = (advice, device=None))]
    fn advise(&self, py: Python<'_>, advice: &str, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let advice = advice_arg(advice)?;
        let alloc = self.live_managed(py, "advice")?;
        let location = location_arg(device, Location::Device(alloc.resource().device()))?;
        detached(py, move || alloc.advise(advice, location))
    }

    /// Where the whole buffer (managed memory only) was last asked to be prefetched: a
    /// device ordinal, "host", or None when it never was (or its parts went to different
    /// places). The driver reports the request, not whether the pages have arrived.
    #[getter]
    fn last_prefetch_location(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let alloc = self.live_managed(py, "the last prefetch location")?;
        let location = detached(py, move || alloc.last_prefetch_location())?;
        location_value(py, location)
    }

    /// Frees the memory now, on its stream (later use raises ValueError; closing again does
    /// nothing). Memory still used by a DLPack consumer is freed when that consumer is done.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        // Taken in a statement of its own: the lock is released before the GIL is.
        let memory = std::mem::take(&mut *self.slot());
        let alloc = match memory {
            Memory::Own(alloc) => alloc,
            Memory::Shared(shared) => match Arc::try_unwrap(shared) {
                Ok(alloc) => alloc,
                Err(shared) => {
                    py.detach(move || drop(shared));
                    return Ok(());
                }
            },
            Memory::Closed => return Ok(()),
        };
        detached(py, move || alloc.free())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Closes the buffer; exceptions propagate.
    #[pyo3(signature = (exc_type=None, exc_value=None, traceback=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc_value: Option<&Bound<'_, PyAny>>,
        traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let _ = (exc_type, exc_value, traceback);
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mr = self.mr.bind(py).repr()?;
        let stream = self.stream.bind(py).repr()?;
        Ok(match self.slot().get() {
            Some(a) => {
                format!("<DeviceBuffer size={} ptr={:#x} stream={stream} mr={mr}>", self.size, a.ptr())
            }
            None => format!("<DeviceBuffer size={} closed mr={mr}>", self.size),
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // No lock to take: `&mut self` means nobody else holds a reference.
        let mut alloc = match std::mem::take(self.memory.get_mut().unwrap_or_else(|e| e.into_inner())) {
            Memory::Own(alloc) => alloc,
            Memory::Shared(shared) => match Arc::try_unwrap(shared) {
                Ok(alloc) => alloc,
                Err(shared) => return drop_detached(shared),
            },
            Memory::Closed => return,
        };
        // A pool's fast path frees without waiting: keep the GIL for it.
        if alloc.try_release().is_none() {
            drop_detached(alloc);
        }
    }
}

/// Unpickles a DeviceBuffer: a copy of `data` in memory from the current resource.
#[pyfunction]
pub(crate) fn _rebuild_device_buffer(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<DeviceBuffer> {
    DeviceBuffer::to_device(py, data, None, None)
}
