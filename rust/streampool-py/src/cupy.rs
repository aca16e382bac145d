//! CuPy's allocator function, with no Python code on its path.
//!
//! CuPy calls its allocator with the GIL held, once per allocation, and wraps what it
//! returns in its own objects: so the cost of an allocation through streampool is the
//! Python work around the call, not the pool. [`CupyAllocator`] is a callable object that
//! does that work here: it reads CuPy's current stream through the C function that CuPy's
//! own extension modules use (`cupy.cuda.stream.get_current_stream_ptr`, found in the
//! module's `__pyx_capi__`; through `cupy.cuda.get_current_stream()` where that is
//! missing), allocates on the thread's kept resource and stream as the C entry points do
//! ([`crate::capi::with_current`]), and hands CuPy an `UnownedMemory` whose owner is a
//! [`CupyMemory`]: when CuPy lets go of the memory, the owner frees it through the resource
//! that made it, on the stream it was allocated on (as CuPy's `MemoryAsync` and RMM's
//! allocator do), with no Python method in between. CuPy may destroy that stream first:
//! the owner keeps a weak reference to CuPy's stream object (never to a default stream,
//! which lives for the process) and, once it is gone, frees on CuPy's current stream, as
//! CuPy does. Not for an external stream (`cupy.cuda.ExternalStream`, how CuPy runs on
//! PyTorch's streams): CuPy never destroys it, and its object, gone at the end of a
//! `with` block, says nothing of the stream, on which the memory is freed. Memory
//! allocated on the per-thread default stream and let go of on another thread is freed
//! on the legacy default stream, which is ordered after the allocating thread's.
//!
//! The fast path keeps the GIL (the resource's `try_allocate`); what may wait (growing a
//! pool, waiting on another stream) releases it.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::Mutex;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;
use streampool::device::{DevPtr, RawStream, LEGACY_STREAM, LEGACY_STREAM_ALIAS, PER_THREAD_STREAM};
use streampool::ResourceRef;

use crate::capi;
use crate::errors::{detached, OrRaise};
use crate::gil::fast_path_settled;

/// `cupy.cuda.stream.get_current_stream_ptr`: `intptr_t (void)`, called with the GIL held.
type StreamFn = unsafe extern "C" fn() -> isize;

/// How CuPy's current stream is read.
enum CurrentStream {
    /// CuPy's C function, from a capsule of `cupy.cuda.stream.__pyx_capi__`.
    Native(StreamFn),
    /// `cupy.cuda.get_current_stream`, whose result has the handle in `ptr`.
    Python(Py<PyAny>),
}

/// The allocator function for `cupy.cuda.set_allocator`: ``allocator(nbytes)`` allocates
/// `nbytes` on CuPy's current stream through streampool's current resource of the current
/// device and returns a `cupy.cuda.MemoryPointer`. Made by `streampool.allocators.cupy`,
/// which passes CuPy's classes in.
#[pyclass(module = "streampool._native", name = "CupyAllocator", frozen)]
pub(crate) struct CupyAllocator {
    /// `cupy.cuda.UnownedMemory` and `cupy.cuda.MemoryPointer`.
    unowned: Py<PyAny>,
    pointer: Py<PyAny>,
    current: CurrentStream,
    /// `cupy.cuda.get_current_stream`, for the stream object behind a handle, and
    /// `weakref.ref`.
    get_current_stream: Py<PyAny>,
    weak_ref: Py<PyAny>,
    /// A weak reference to CuPy's stream object, by handle, for the streams allocated on
    /// lately (at most [`MAX_STREAM_REFS`]; one dead is replaced when its handle comes back).
    stream_refs: Mutex<HashMap<RawStream, (Py<PyAny>, bool)>>,
    /// `cupy.cuda.ExternalStream`, or None: an external stream's object says nothing of its
    /// stream's life (CuPy never destroys it; its owner, PyTorch say, keeps it).
    external_stream: Option<Py<PyAny>>,
    /// The class out of memory raises, a subclass of streampool's `OutOfMemoryError` that
    /// is CuPy's `cupy.cuda.memory.OutOfMemoryError` too; None: streampool's own.
    out_of_memory: Option<Py<PyType>>,
}

/// How many streams' weak references an allocator keeps before it starts afresh.
const MAX_STREAM_REFS: usize = 256;

/// The default streams live for the process: memory allocated on them needs no reference.
fn is_default_stream(handle: RawStream) -> bool {
    matches!(handle, LEGACY_STREAM | LEGACY_STREAM_ALIAS | PER_THREAD_STREAM)
}

/// Whether the object behind a weak reference is still alive.
fn alive(py: Python<'_>, weak: &Py<PyAny>) -> bool {
    weak.call0(py).is_ok_and(|o| !o.is_none(py))
}

#[pymethods]
impl CupyAllocator {
    /// `stream_capsule` is `cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]`, or
    /// None to read the stream through `get_current_stream` (slower); `external_stream` is
    /// `cupy.cuda.ExternalStream`; `out_of_memory` the class out of memory raises (a
    /// subclass of streampool's `OutOfMemoryError`, made with its arguments).
    #[new]
    #[pyo3(signature = (unowned_memory, memory_pointer, get_current_stream, stream_capsule=None, external_stream=None, out_of_memory=None))]
    fn new(
        py: Python<'_>,
        unowned_memory: Py<PyAny>,
        memory_pointer: Py<PyAny>,
        get_current_stream: Py<PyAny>,
        stream_capsule: Option<&Bound<'_, PyAny>>,
        external_stream: Option<Py<PyAny>>,
        out_of_memory: Option<Bound<'_, PyType>>,
    ) -> PyResult<Self> {
        if let Some(class) = &out_of_memory {
            if !class.is_subclass(crate::errors::out_of_memory_class(py)?)? {
                return Err(PyTypeError::new_err(format!(
                    "out_of_memory must be a subclass of streampool.OutOfMemoryError, not {}",
                    class.name()?
                )));
            }
        }
        let current = match stream_capsule {
            Some(capsule) => CurrentStream::Native(stream_function(capsule)?),
            None => CurrentStream::Python(get_current_stream.clone_ref(py)),
        };
        Ok(CupyAllocator {
            unowned: unowned_memory,
            pointer: memory_pointer,
            current,
            get_current_stream,
            weak_ref: py.import("weakref")?.getattr("ref")?.unbind(),
            stream_refs: Mutex::new(HashMap::new()),
            external_stream: external_stream.filter(|t| !t.is_none(py)),
            out_of_memory: out_of_memory.map(Bound::unbind),
        })
    }

    /// Whether CuPy's current stream is read through its C function (the fast way).
    #[getter]
    fn native_stream_lookup(&self) -> bool {
        matches!(self.current, CurrentStream::Native(_))
    }

    fn __call__(slf: &Bound<'_, Self>, nbytes: usize) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let handle = this.stream_handle(py)?;
        // Before allocating: nothing to free if it fails.
        let origin = match is_default_stream(handle) || nbytes == 0 {
            true => None,
            false => this.stream_ref(py, handle)?,
        };
        // CuPy's current stream is alive: it may be asked whether it captures a CUDA graph
        // (CuPy announces no capture), and is then served graph memory or refused.
        let (device, mr, fast) = capi::with_current_asking(None, handle, true, |device, mr, stream| {
            let fast = mr.try_allocate(nbytes, stream).ok_or_else(|| stream.clone());
            Ok((device, mr.clone(), fast))
        })
        .or_raise(py)?;
        let ptr = match fast {
            Ok(settled) => {
                fast_path_settled(py);
                settled.or_raise(py)
            }
            Err(stream) => {
                let mr = mr.clone();
                detached(py, move || {
                    capi::relaxed_if_announced(mr.backend(), || mr.allocate(nbytes, &stream))
                })
            }
        }
        .map_err(|e| this.as_out_of_memory(py, e))?;
        // Made before CuPy's objects, so that a failure there frees the memory.
        let owner = match ptr {
            0 => py.None(),
            _ => {
                let allocator = slf.clone().unbind();
                let thread = (handle == PER_THREAD_STREAM).then(|| std::thread::current().id());
                let memory =
                    CupyMemory { allocator, mr, ptr, size: nbytes, device, stream: handle, origin, thread };
                Py::new(py, memory)?.into_any()
            }
        };
        let memory = this.unowned.call1(py, (ptr, nbytes, owner, device))?;
        this.pointer.call1(py, (memory, 0))
    }
}

impl CupyAllocator {
    /// An out-of-memory error made again as the class given for it (CuPy's too), with the
    /// same message and attributes; any other error as it is.
    fn as_out_of_memory(&self, py: Python<'_>, e: PyErr) -> PyErr {
        let Some(class) = &self.out_of_memory else { return e };
        let value = e.value(py);
        let made = (|| {
            if !value.is_instance(crate::errors::out_of_memory_class(py)?)? {
                return Ok(None);
            }
            let args = (value.str()?, value.getattr("requested")?, value.getattr("available")?);
            Ok::<_, PyErr>(Some(class.bind(py).call1(args)?))
        })();
        match made {
            Ok(Some(made)) => PyErr::from_value(made),
            _ => e,
        }
    }

    /// A weak reference to CuPy's current stream object, whose handle is `handle`: the one
    /// kept for that handle while its object lives, else a new one; None for an external
    /// stream (`cupy.cuda.ExternalStream`), whose memory is freed on its handle whatever
    /// becomes of the object (the stream is its owner's, alive after the object is gone).
    /// The lock is never held while Python code runs (which may let another thread take
    /// the GIL and wait for it).
    fn stream_ref(&self, py: Python<'_>, handle: RawStream) -> PyResult<Option<Py<PyAny>>> {
        let refs = || self.stream_refs.lock().unwrap_or_else(|e| e.into_inner());
        let kept = refs().get(&handle).map(|(w, external)| (w.clone_ref(py), *external));
        if let Some((weak, external)) = kept.filter(|(w, _)| alive(py, w)) {
            return Ok((!external).then_some(weak));
        }
        let stream = self.get_current_stream.call0(py)?;
        let external = match &self.external_stream {
            Some(class) => stream.bind(py).is_instance(class.bind(py))?,
            None => false,
        };
        let weak = self.weak_ref.call1(py, (stream,))?;
        let gone = {
            let mut refs = refs();
            let cleared = match refs.len() >= MAX_STREAM_REFS {
                true => std::mem::take(&mut *refs),
                false => HashMap::new(),
            };
            (refs.insert(handle, (weak.clone_ref(py), external)), cleared)
        };
        drop(gone); // after the lock: dropping may run Python code
        Ok((!external).then_some(weak))
    }

    /// CuPy's current stream of the calling thread.
    fn stream_handle(&self, py: Python<'_>) -> PyResult<RawStream> {
        match &self.current {
            CurrentStream::Native(f) => {
                // SAFETY: the capsule's signature was checked; the GIL is held, as CuPy's
                // own callers hold it.
                let handle = unsafe { f() };
                match (handle, PyErr::take(py)) {
                    (_, Some(e)) => Err(e),
                    (handle, None) => Ok(handle as RawStream),
                }
            }
            CurrentStream::Python(f) => f.call0(py)?.getattr(py, "ptr")?.extract(py),
        }
    }
}

/// The C function in a Cython capsule of signature `intptr_t (void)`.
fn stream_function(capsule: &Bound<'_, PyAny>) -> PyResult<StreamFn> {
    let wrong = || PyTypeError::new_err(format!("not CuPy's get_current_stream_ptr capsule: {capsule:?}"));
    let obj = capsule.as_ptr();
    // SAFETY: a PyCapsule is checked for before its name and pointer are read.
    unsafe {
        if ffi::PyCapsule_CheckExact(obj) == 0 {
            return Err(wrong());
        }
        let name = ffi::PyCapsule_GetName(obj);
        if name.is_null() {
            ffi::PyErr_Clear();
            return Err(wrong());
        }
        let signature = CStr::from_ptr(name).to_string_lossy();
        let signature: String = signature.split_whitespace().collect();
        if !signature.starts_with("intptr_t(void)") {
            return Err(wrong());
        }
        let pointer: *mut c_void = ffi::PyCapsule_GetPointer(obj, name);
        if pointer.is_null() {
            ffi::PyErr_Clear();
            return Err(wrong());
        }
        Ok(std::mem::transmute::<*mut c_void, StreamFn>(pointer))
    }
}

/// Owns one allocation handed to CuPy (the `owner` of its `UnownedMemory`): frees it
/// through the resource that made it when CuPy lets go, on the stream it was allocated on
/// while CuPy's object of that stream lives, else on CuPy's current stream of the
/// releasing thread (the device's legacy default stream when that one is another
/// device's). A failure to free is said on stderr and kept for
/// `streampool.allocators.last_error()`, as nothing can be raised there.
#[pyclass(module = "streampool._native", name = "CupyMemory", frozen)]
pub(crate) struct CupyMemory {
    allocator: Py<CupyAllocator>,
    mr: ResourceRef,
    ptr: DevPtr,
    size: usize,
    device: i32,
    /// The stream it was allocated on, and a weak reference to CuPy's object of it (None
    /// for a default stream and an external one).
    stream: RawStream,
    origin: Option<Py<PyAny>>,
    /// The allocating thread, for memory allocated on its per-thread default stream.
    thread: Option<std::thread::ThreadId>,
}

#[pymethods]
impl CupyMemory {
    fn __repr__(&self) -> String {
        format!("CupyMemory(ptr={:#x}, size={}, device={})", self.ptr, self.size, self.device)
    }
}

impl Drop for CupyMemory {
    fn drop(&mut self) {
        let (mr, ptr, size, device) = (&self.mr, self.ptr, self.size, self.device);
        let what = || format!("freeing CuPy's memory (ptr={ptr:#x}, size={size}, device={device})");
        if mr.backend().check_open().is_err() {
            return; // made on a simulated device since exited: the memory went with it
        }
        Python::attach(|py| {
            let handle = match &self.origin {
                Some(weak) if !alive(py, weak) => {
                    // At interpreter shutdown CuPy may be gone: the legacy stream then.
                    self.allocator.get().stream_handle(py).unwrap_or(LEGACY_STREAM)
                }
                // Another thread's per-thread default stream cannot be named here (handle 2
                // is this thread's own): the legacy default stream is ordered after it.
                _ if self.thread.is_some_and(|t| t != std::thread::current().id()) => LEGACY_STREAM,
                _ => self.stream,
            };
            // Asked whether it captures only when known alive (the question crashes the driver
            // on a destroyed stream's handle): a stream whose CuPy object was kept (alive, or
            // else CuPy's current one took its place), or this thread's per-thread one; not an
            // ExternalStream's, which its owner may have destroyed.
            let ask = self.origin.is_some() || handle == PER_THREAD_STREAM;
            let free_on = |handle| {
                capi::with_current_asking(Some(device), handle, ask, |_, _, stream| {
                    Ok(mr.try_deallocate(ptr, size, stream).ok_or_else(|| stream.clone()))
                })
            };
            // A current stream of another device cannot order this device's free: the
            // legacy stream then. A stream that is gone (an ExternalStream's, destroyed by
            // its owner) orders nothing either: once the device is synchronised nothing uses
            // the memory, and the legacy stream frees it.
            let fast = free_on(handle).or_else(|e| match (handle, e) {
                (LEGACY_STREAM, e) => Err(e),
                (h, streampool::Error::InvalidStream(_)) if h == self.stream => {
                    Ok(Ok(py.detach(|| capi::free_after_device_sync(device, ptr, size, Some(mr)))))
                }
                _ => free_on(LEGACY_STREAM),
            });
            let freed = match fast {
                Ok(Ok(settled)) => settled,
                Ok(Err(stream)) => py.detach(|| {
                    capi::relaxed_if_announced(mr.backend(), || mr.deallocate(ptr, size, &stream))
                }),
                Err(e) => Err(e),
            };
            if let Err(e) = freed {
                capi::failed::<()>(what, e, true);
            }
        });
    }
}
