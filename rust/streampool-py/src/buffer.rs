//! `streampool.DeviceBuffer`: memory from a resource, ordered on a stream, exported through
//! the CUDA array interface and DLPack, freed on its stream when collected or closed.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyCapsule, PyDict, PyString, PyTuple};
use streampool::device::{self, Advice, BackendRef, DevPtr, Location};
use streampool::{managed, Allocation, Error, Stream};

use crate::dlpack;
use crate::errors::{buffer_error, detached, to_pyerr, OrRaise};
use crate::gil::fast_path_settled;
use crate::resources::{get_current_device_resource, PyMemoryResource};
use crate::streams::{default_stream, to_stream};
use crate::{ptr_arg, size_arg};

/// Untyped memory of `size` bytes from `mr` (default: the current device's resource),
/// ordered on `stream` (default: the legacy default stream).
///
/// The memory may be used by work enqueued on `stream` after the buffer is made; it is
/// freed on that stream when the buffer is collected or `close()`d. A buffer made on the
/// per-thread default stream stays ordered with the stream of the thread that made it:
/// used, exported or collected on another thread, it is ordered through the legacy default
/// stream. Exports: the CUDA array interface (v3) and DLPack (a 1-D uint8 tensor).
///
/// Example::
///
///     buf = streampool.DeviceBuffer(size=1 << 20)  # from the current device's resource
///     buf.copy_from_host(bytes(range(256)) * 4096)
///     print(list(buf.tobytes()[:4]))  # [0, 1, 2, 3]
///     copy = buf.copy()  # another buffer, its own memory
#[derive(Debug)]
#[pyclass(frozen, weakref, module = "streampool", name = "DeviceBuffer")]
pub struct DeviceBuffer {
    // The lock is held only to look at, share, take or replace the memory.
    memory: Mutex<Memory>,
    // At most the allocation's size (`capacity()`); changed only with the lock held.
    size: AtomicUsize,
    // True once Python code has been shown the current memory's address (see `EXPOSED`).
    exposed: AtomicBool,
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

    /// Gives up this hold on the memory, freeing it when it was the last (see [`release`]).
    fn let_go(self) {
        match self {
            Memory::Own(alloc) => release(alloc),
            // Exactly one holder gets the allocation back, however many let go at once; the
            // others only drop a reference, which never waits.
            Memory::Shared(shared) => {
                if let Some(alloc) = Arc::into_inner(shared) {
                    release(alloc);
                }
            }
            Memory::Closed => {}
        }
    }
}

/// Frees `alloc` now: without waiting where the resource can (keeping the GIL, as the fast
/// path does), else with the GIL released (freeing can wait for the device: `cuMemFree`),
/// or with it held when the interpreter is shutting down and that is the only option. A
/// free its resource refuses as a double or unknown free is reported (see
/// [`report_refused_free`]); other failures (a driver torn down at exit) are recorded.
pub(crate) fn release(mut alloc: Allocation) {
    let (ptr, bytes) = (alloc.ptr(), alloc.bytes());
    // The resource's name, for a failure's record: read off the fast path only.
    let name = |alloc: &Allocation| alloc.resource().name().to_string();
    // `try_release` leaves a null pointer whenever it settles the free: dropping `alloc`
    // afterwards frees nothing again.
    let (result, resource) = match alloc.try_release() {
        Some(Ok(())) => return,
        Some(Err(e)) => (Err(e), name(&alloc)),
        None => {
            let resource = name(&alloc);
            let mut alloc = Some(alloc);
            let result = crate::gil::try_attach(|py| {
                let alloc = alloc.take();
                let since = crate::errors::stash_mark();
                let result = py.detach(move || alloc.map_or(Ok(()), Allocation::free));
                crate::errors::report_swallowed_log_errors(py, &result, since);
                result
            });
            let result = match alloc {
                Some(alloc) => alloc.free(),
                None => result.unwrap_or(Ok(())),
            };
            (result, resource)
        }
    };
    if let Err(e) = result {
        report_refused_free(ptr, bytes, &resource, e);
    }
}

/// Reports a free refused when a buffer let go of its memory: an invalid pointer (freed by
/// hand before?) to `sys.unraisablehook`, anything else to `streampool.drop_errors()`, and
/// an exception of a Python callback (a `CallbackMemoryResource`'s deallocate function, a
/// logging callback) to both, as the original exception, as RMM reports it.
fn report_refused_free(ptr: DevPtr, bytes: usize, resource: &str, e: Error) {
    if !matches!(e, Error::InvalidPointer(_)) {
        // Nobody to raise to (a driver torn down at exit, a failing logging sink): recorded,
        // as the core's `Allocation` records its own (`streampool.drop_errors()`).
        streampool::record_drop_error(
            &format!("dropping an Allocation of {bytes} bytes at {ptr:#x} from {resource}"),
            &e,
        );
        if matches!(e, Error::Callback(_) | Error::CallbackOutOfMemory(_)) {
            let _ = crate::gil::try_attach(|py| to_pyerr(py, e).write_unraisable(py, None));
        }
        return;
    }
    let _ = crate::gil::try_attach(|py| {
        let e = Error::InvalidPointer(format!(
            "freeing a DeviceBuffer's memory ({bytes} bytes at {ptr:#x}) failed: was its pointer freed \
             by hand? ({e})"
        ));
        to_pyerr(py, e).write_unraisable(py, None);
    });
}

// ---------------------------------------------------------------------------------------
// Pointers of live buffers that Python code has seen.
//
// `MemoryResource.deallocate(buf.ptr, buf.size)` frees a buffer's memory behind its back:
// the buffer's own free later is then a double free, and memory handed out in between can
// alias memory still in use. The binding refuses such a free when the pointer is in this
// set: the addresses of open buffers that Python code has been shown (`ptr`, the CUDA array
// interface, DLPack), which is how Python code comes by a buffer's pointer. Making a buffer
// costs nothing for this (the set is filled when an address is first read, and a buffer
// that was never read never touches it); a raw `deallocate` costs one relaxed load while
// the set is empty, and one uncontended lock and look-up otherwise.

static EXPOSED: Mutex<BTreeSet<DevPtr>> = Mutex::new(BTreeSet::new());
/// The set's size, read without the lock: the common case (no buffer's address shown)
/// skips it. Written with the lock held.
static EXPOSED_COUNT: AtomicUsize = AtomicUsize::new(0);

fn exposed_set() -> MutexGuard<'static, BTreeSet<DevPtr>> {
    EXPOSED.lock().unwrap_or_else(|e| e.into_inner())
}

/// InvalidPointerError when `ptr` is the address of an open DeviceBuffer whose address
/// Python code has seen: freeing it by hand would make the buffer's own free a double free.
pub(crate) fn refuse_buffer_pointer(py: Python<'_>, ptr: DevPtr) -> PyResult<()> {
    if EXPOSED_COUNT.load(Ordering::Relaxed) == 0 || !exposed_set().contains(&ptr) {
        return Ok(());
    }
    Err(to_pyerr(
        py,
        Error::InvalidPointer(format!(
            "{ptr:#x} is the memory of an open DeviceBuffer, which frees it itself; close the buffer \
             (or let it be collected) instead of deallocating its pointer"
        )),
    ))
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
        Ok(DeviceBuffer {
            memory: Mutex::new(Memory::Own(alloc)),
            size: AtomicUsize::new(size),
            exposed: AtomicBool::new(false),
            mr,
            stream,
        })
    }

    fn slot(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn len(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }

    /// The allocation, shared from now on; ValueError once closed.
    fn live(&self) -> PyResult<Arc<Allocation>> {
        self.share(false).map(|(alloc, _)| alloc)
    }

    /// [`DeviceBuffer::live`] with the size read together with it: a `resize` on another
    /// thread, or by Python code that an argument's conversion runs, can change the size
    /// and the allocation after, so a size read later need not fit this allocation.
    fn live_sized(&self) -> PyResult<(Arc<Allocation>, usize)> {
        self.share(false)
    }

    /// [`DeviceBuffer::live_sized`], for handing the address to Python code or a consumer:
    /// the address is recorded in `EXPOSED` (with the lock held, so that a concurrent
    /// `resize` cannot leave a stale entry).
    pub(crate) fn live_exposed(&self) -> PyResult<(Arc<Allocation>, usize)> {
        self.share(true)
    }

    /// Refuses a buffer of a simulated device since exited: its memory is gone (unmapped,
    /// for an expandable pool's), and nothing may hand out its address or use it.
    fn check_device_open(&self) -> PyResult<()> {
        // InvalidArgumentError (a ValueError), as the resource's own calls raise for it.
        self.mr.get().inner.backend().check_open().map_err(|e| Python::attach(|py| to_pyerr(py, e)))
    }

    /// The allocation and the size, read under the lock that `resize` sets both under.
    fn share(&self, expose: bool) -> PyResult<(Arc<Allocation>, usize)> {
        self.check_device_open()?;
        let mut slot = self.slot();
        let shared = match std::mem::take(&mut *slot) {
            Memory::Own(alloc) => Arc::new(alloc),
            Memory::Shared(alloc) => alloc,
            Memory::Closed => return Err(closed()),
        };
        if expose {
            self.expose(shared.ptr());
        }
        *slot = Memory::Shared(shared.clone());
        Ok((shared, self.len()))
    }

    /// Records `ptr`, the current memory's address, as seen by Python code. The caller
    /// holds the memory's lock.
    fn expose(&self, ptr: DevPtr) {
        if ptr != 0 && !self.exposed.swap(true, Ordering::Relaxed) {
            let mut set = exposed_set();
            set.insert(ptr);
            EXPOSED_COUNT.store(set.len(), Ordering::Relaxed);
        }
    }

    /// Forgets `ptr`, the current memory's address, before the buffer gives the memory up.
    /// The caller holds the memory's lock (or `&mut self`).
    fn unexpose(&self, ptr: DevPtr) {
        if self.exposed.swap(false, Ordering::Relaxed) {
            let mut set = exposed_set();
            set.remove(&ptr);
            EXPOSED_COUNT.store(set.len(), Ordering::Relaxed);
        }
    }

    /// Takes the memory out (the buffer is closed from then on), forgetting its address.
    fn take(&self) -> Memory {
        let mut slot = self.slot();
        if let Some(alloc) = slot.get() {
            self.unexpose(alloc.ptr());
        }
        std::mem::take(&mut *slot)
    }

    /// The stream an operation is ordered on: `stream` when given, else the buffer's own.
    ///
    /// Every method that uses the memory on the device goes through here (or through
    /// `Allocation::stream`), never through the `stream` object as given: the buffer's own
    /// stream is kept resolved, so that one made on the per-thread default stream stays
    /// ordered with the thread that made it when it is used from another (see
    /// `Stream::resolved`: there it is the legacy default stream, ordered after that
    /// thread's per-thread stream).
    fn op_stream(py: Python<'_>, alloc: &Allocation, stream: Option<&Bound<'_, PyAny>>) -> PyResult<Stream> {
        match stream.filter(|s| !s.is_none()) {
            Some(s) => Ok(to_stream(py, Some(s), || alloc.resource().backend())?.into_owned()),
            None => Ok(alloc.stream().clone()),
        }
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
        self.on_device(py, bytes, stream, move |alloc, backend, device, stream| {
            let (dst, src) = if to_host { (host, alloc.ptr()) } else { (alloc.ptr(), host) };
            // SAFETY: the host side is valid for `bytes` (checked by the callers) and stays
            // so until this function returns, after the synchronisation below (of the
            // whole device, should the stream's fail); the device side is this live
            // allocation, at least `bytes` long.
            unsafe { backend.memcpy_async(device, dst, src, bytes, stream.handle())? };
            streampool::device::synchronize_after_copy(backend, device, stream.handle())
        })
    }

    /// Runs `work` on the live allocation with the GIL released, on the stream an
    /// operation is ordered on ([`Self::op_stream`], checked to be of the buffer's device),
    /// with the allocation's backend and device; nothing to do for 0 bytes.
    fn on_device(
        &self,
        py: Python<'_>,
        bytes: usize,
        stream: Option<&Bound<'_, PyAny>>,
        work: impl FnOnce(&Allocation, &BackendRef, i32, &Stream) -> streampool::Result<()> + Send,
    ) -> PyResult<()> {
        let alloc = self.live()?;
        let stream = Self::op_stream(py, &alloc, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        if bytes > alloc.bytes() {
            // Sized before a `resize` (another thread's, or one that converting an argument
            // ran) moved the buffer to a smaller allocation.
            return Err(PyValueError::new_err(format!(
                "the buffer was resized during this call: {bytes} bytes no longer fit its {} bytes",
                alloc.bytes()
            )));
        }
        detached(py, move || {
            let resource = alloc.resource();
            let (backend, device) = (resource.backend(), resource.device());
            stream.check(backend, device)?;
            work(&alloc, backend, device, &stream)
        })
    }

    /// Enqueues a copy of `bytes` from device address `src` to the buffer's start, on
    /// `stream` (the buffer's own when None), with the GIL released; returns once it is
    /// enqueued. When the source's data is ordered on `source` (another buffer's stream, or
    /// the stream a CUDA array interface names, with the device it is of: a default stream
    /// is each device's own) and that is another stream, the copy is ordered after the work
    /// enqueued there, and that stream after the copy, so that the source's owner may free
    /// or overwrite it in its own stream order. `keep` is held until the copy is enqueued
    /// and ordered.
    fn copy_in(
        &self,
        py: Python<'_>,
        src: DevPtr,
        bytes: usize,
        stream: Option<&Bound<'_, PyAny>>,
        source: Option<Ordered>,
        keep: Option<Arc<Allocation>>,
    ) -> PyResult<()> {
        self.on_device(py, bytes, stream, move |alloc, backend, device, stream| {
            let at = (stream, stream.device_or(device));
            let source = source.filter(|(s, d)| (s.handle(), *d) != (stream.handle(), at.1));
            if let Some((s, d)) = &source {
                order(backend, at, (s, *d))?;
            }
            // SAFETY: the destination is this live allocation, at least `bytes` long (checked
            // by the callers); the source is device memory that the caller says holds
            // `bytes`, ordered as above, and kept alive by `keep` or its owner.
            unsafe { backend.memcpy_async(device, alloc.ptr(), src, bytes, stream.handle())? };
            if let Some((s, d)) = &source {
                order(backend, (s, *d), at)?;
            }
            drop(keep);
            Ok(())
        })
    }

    /// Enqueues a copy of the first `bytes` of `src`, a live allocation of any device of the
    /// buffer's backend, to the buffer's start, on `stream` (the buffer's own when None), with
    /// `cuMemcpyPeerAsync`, which needs no peer access; returns once it is enqueued. The copy
    /// is ordered after the work enqueued on the source's stream so far, and that stream
    /// after the copy, so that the source's owner may free or overwrite it in its own order.
    fn copy_peer_in(
        &self,
        py: Python<'_>,
        src: Arc<Allocation>,
        bytes: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.on_device(py, bytes, stream, move |alloc, backend, device, stream| {
            let src_dev = src.resource().device();
            device::check_same_backend(backend, src.resource().backend(), "the source buffer")?;
            let source = src.stream();
            stream.wait_for(backend, device, source, src_dev)?;
            // SAFETY: both sides are live allocations (`src` is held until the copy is
            // enqueued and its stream ordered after it) of at least `bytes` bytes, ordered
            // as above on both streams.
            unsafe {
                backend.memcpy_peer_async(
                    device,
                    alloc.ptr(),
                    device,
                    src.ptr(),
                    src_dev,
                    bytes,
                    stream.handle(),
                )?
            };
            source.wait_for(backend, src_dev, stream, device)
        })
    }

    /// Moves the contents to a new allocation of `capacity` bytes (on the buffer's own
    /// stream) and sets the size to `new_size`: the first `min(size, new_size)` bytes are
    /// copied on `stream` (the buffer's own when None; another stream is ordered after the
    /// buffer's, and the buffer's after the copy), and the old memory is freed on the
    /// buffer's stream.
    fn reallocate(
        &self,
        py: Python<'_>,
        capacity: usize,
        new_size: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (old, size) = self.live_sized()?;
        let copy_on = Self::op_stream(py, &old, stream)?;
        let bytes = size.min(new_size);
        let new = detached(py, move || {
            let resource = old.resource();
            let (backend, device) = (resource.backend(), resource.device());
            copy_on.check(backend, device)?;
            let home = old.stream();
            let new = Allocation::new(resource.clone(), capacity, home.clone())?;
            if bytes > 0 {
                let other = copy_on.handle() != home.handle();
                let (copy_at, home_at) = ((&copy_on, device), (home, device));
                if other {
                    order(backend, copy_at, home_at)?;
                }
                // SAFETY: both sides are live allocations (`old` is held here) of at least
                // `bytes` bytes, ordered on `copy_on` as above.
                unsafe { backend.memcpy_async(device, new.ptr(), old.ptr(), bytes, copy_on.handle())? };
                if other {
                    order(backend, home_at, copy_at)?;
                }
            }
            Ok(new)
        })?;
        let previous = {
            let mut slot = self.slot();
            let Some(current) = slot.get() else {
                drop(slot);
                release(new);
                return Err(closed());
            };
            self.unexpose(current.ptr());
            self.size.store(new_size, Ordering::Relaxed);
            std::mem::replace(&mut *slot, Memory::Own(new))
        };
        // Outside the lock: freeing can wait.
        previous.let_go();
        Ok(())
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

/// Orders `waiter` after the work enqueued on `on` so far: an event recorded on `on`,
/// waited on by `waiter`; each stream with the device it is of (a foreign source's stream
/// may be another device's than the buffer's): the event is made on `on`'s device.
fn order(backend: &BackendRef, waiter: (&Stream, i32), on: (&Stream, i32)) -> streampool::Result<()> {
    waiter.0.wait_for(backend, waiter.1, on.0, on.1)
}

/// A stream, with the device it is of (a default stream is every device's: this names one).
type Ordered = (Stream, i32);

/// A CUDA array interface as a source of bytes: `(address, bytes, stream)`, checked to be
/// C-contiguous, unmasked, and not a null pointer with bytes to copy. The stream comes with
/// the device it is of: a default stream (1, 2) is that of the device whose memory the
/// address is (the producer's context), found from the driver, else `device`'s.
fn cai_source(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    backend: &BackendRef,
    device: i32,
) -> PyResult<(DevPtr, usize, Option<Ordered>)> {
    let Some(cai) = obj.getattr_opt("__cuda_array_interface__")? else {
        let ty = obj.get_type().fully_qualified_name()?;
        return Err(PyTypeError::new_err(format!(
            "cuda_ary must be a DeviceBuffer or have __cuda_array_interface__, not {ty}"
        )));
    };
    let cai = cai
        .cast_into::<PyDict>()
        .map_err(|_| PyTypeError::new_err("cuda_ary's __cuda_array_interface__ must be a dict"))?;
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(key)?.ok_or_else(|| {
            PyValueError::new_err(format!("cuda_ary's __cuda_array_interface__ has no '{key}'"))
        })
    };
    let bad = |what: &str| PyValueError::new_err(format!("cuda_ary's __cuda_array_interface__: {what}"));
    let shape: Vec<usize> =
        item("shape")?.extract().map_err(|_| bad("shape must be a tuple of ints >= 0"))?;
    let typestr: String = item("typestr")?.extract().map_err(|_| bad("typestr must be a string"))?;
    let itemsize = typestr
        .get(2..)
        .map(|rest| rest.chars().take_while(char::is_ascii_digit).collect::<String>())
        .and_then(|digits| digits.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| bad(&format!("cannot read an item size from typestr {typestr:?}")))?;
    let (ptr, _readonly): (Bound<'_, PyAny>, bool) =
        item("data")?.extract().map_err(|_| bad("data must be a (pointer, read_only) tuple"))?;
    let ptr = ptr_arg(&ptr)?;
    if cai.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(bad("masked arrays cannot be copied"));
    }
    let bytes = shape
        .iter()
        .try_fold(itemsize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(&format!("shape {shape:?} is too large")))?;
    if let Some(strides) = cai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<isize> =
            strides.extract().map_err(|_| bad("strides must be None or a tuple of ints"))?;
        // C-contiguous: each stride is the bytes of one step along its axis (axes of
        // length 1 may have any stride; an empty array is contiguous).
        let mut expected = itemsize;
        let contiguous = bytes == 0
            || strides.len() == shape.len()
                && shape.iter().zip(&strides).rev().all(|(&d, &s)| {
                    let ok = d == 1 || usize::try_from(s).is_ok_and(|s| s == expected);
                    expected *= d;
                    ok
                });
        if !contiguous {
            return Err(PyValueError::new_err(format!(
                "cuda_ary must be C-contiguous; its strides are {strides:?} for shape {shape:?}"
            )));
        }
    }
    if ptr == 0 && bytes > 0 {
        return Err(bad(&format!("null data pointer for {bytes} bytes")));
    }
    // Version 3's stream: None means no synchronisation; 0 is disallowed (ambiguous); 1 is
    // the legacy default stream and 2 the per-thread default stream.
    let stream = match cai.get_item("stream")?.filter(|s| !s.is_none()) {
        None => None,
        Some(s) => {
            if s.extract::<i64>().is_ok_and(|h| h == 0) {
                return Err(bad("stream 0 is disallowed (use 1 for the legacy default stream)"));
            }
            let stream = to_stream(py, Some(&s), || backend)?.into_owned();
            let home = match stream.binding() {
                Some((_, d)) => d,
                None if bytes > 0 => {
                    let b = backend.clone();
                    py.detach(move || b.pointer_device(device, ptr)).unwrap_or(device)
                }
                None => device,
            };
            Some((stream, home))
        }
    };
    Ok((ptr, bytes, stream))
}

/// The `numpy.empty` function, or None when numpy is not installed.
fn numpy_empty(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
    static EMPTY: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
    EMPTY
        .get_or_init(py, || py.import("numpy").and_then(|np| np.getattr("empty")).ok().map(Bound::unbind))
        .as_ref()
        .map(|f| f.bind(py))
}

/// The advice names `DeviceBuffer.advise` takes, and what they mean to the driver.
fn advice_arg(advice: &str) -> PyResult<Advice> {
    Advice::ALL.into_iter().find(|a| a.name() == advice).ok_or_else(|| {
        let names: Vec<String> = Advice::ALL.iter().map(|a| format!("'{}'", a.name())).collect();
        PyValueError::new_err(format!("unknown advice '{advice}'; expected one of {}", names.join(", ")))
    })
}

fn closed() -> PyErr {
    PyValueError::new_err("DeviceBuffer is closed")
}

/// A location from Python: None (`default`), "host" or -1 (`cudaCpuDeviceId`, as RMM's
/// callers pass it), or a device ordinal (an int >= 0).
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
    let Some(int) = crate::as_index(obj)? else {
        let ty = obj.get_type().fully_qualified_name()?;
        return Err(PyTypeError::new_err(format!(
            "device must be a device ordinal (an int >= 0), \"host\" or None, not {ty}"
        )));
    };
    match int.extract::<i32>() {
        Ok(ordinal) if ordinal >= 0 => Ok(Location::Device(ordinal)),
        Ok(CPU_DEVICE_ID) => Ok(Location::Host),
        _ => Err(PyValueError::new_err(format!(
            "device must be a device ordinal (an int >= 0), \"host\" or -1 (the host, CUDA's \
             cudaCpuDeviceId), not {obj}"
        ))),
    }
}

/// CUDA's `cudaCpuDeviceId`: the host, as a device argument.
const CPU_DEVICE_ID: i32 = -1;

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
    /// The collector sees the resource and the stream object it holds, so that a cycle
    /// through a buffer (a stream wrapper that keeps the buffers made on it, an object
    /// whose logging callback made its own buffer) is collected: the other objects of the
    /// cycle are cleared, and the buffer freed then.
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.mr)?;
        visit.call(&self.stream)
    }

    #[new]
    #[pyo3(
        signature = (size=None, stream=None, mr=None, *, ptr=None),
        text_signature = "(size=0, stream=None, mr=None, *, ptr=None)"
    )]
    fn new(
        py: Python<'_>,
        size: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
        ptr: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let size = match size.filter(|s| !s.is_none()) {
            Some(s) => size_arg(s, "size")?,
            None => 0,
        };
        match ptr.filter(|p| !p.is_none()) {
            None => Self::make(py, size, stream, mr),
            Some(src) => Self::make_copy(py, ptr_arg(src)?, size, stream, mr),
        }
    }

    /// The device address (0 for an empty buffer).
    #[getter]
    fn ptr(&self) -> PyResult<DevPtr> {
        self.check_device_open()?;
        let slot = self.slot();
        let ptr = slot.get().map(Allocation::ptr).ok_or_else(closed)?;
        self.expose(ptr);
        Ok(ptr)
    }

    /// The size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.len()
    }

    /// The size in bytes (same as `size`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.len()
    }

    /// The bytes allocated (at least `size`; `reserve` and a shrinking `resize` leave room).
    fn capacity(&self) -> PyResult<usize> {
        self.slot().get().map(Allocation::bytes).ok_or_else(closed)
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
        self.len()
    }

    /// The size in bytes, as RMM reports it (the device memory, not the host object).
    fn __sizeof__(&self) -> usize {
        self.len()
    }

    /// The CUDA array interface, version 3: a 1-D array of `size` uint8, with the stream
    /// its data is ordered on (1: legacy default stream, 2: per-thread default stream). A
    /// buffer made on the per-thread default stream reports 2 on the thread that made it
    /// and 1 on others (2 would name the reader's own per-thread stream).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // As this thread names it: a per-thread buffer of another thread reports 1.
        let (alloc, size) = self.live_exposed()?;
        let stream = Self::stream_of(&alloc);
        let stream_value = if stream.is_legacy() { 1 } else { stream.handle() };
        let d = PyDict::new(py);
        d.set_item("shape", (size,))?;
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
    /// passes `max_version >= (1, 0)`). `stream` is the consumer's stream, made to wait for
    /// the buffer's stream (DLPack's convention: -1 no synchronisation, 1 the legacy default
    /// stream, 2 the per-thread default stream, else a stream handle or object; None: the
    /// legacy default stream, and for managed or pinned memory, which the host may read, the
    /// host waits for the buffer's stream too). When the consumer lets go of the tensor,
    /// the buffer's stream waits for the consumer's, so that the memory's free follows its
    /// work; the consumer's stream object is kept alive until then (the object given, or,
    /// for a handle, CuPy's or PyTorch's current stream where it has that handle: their
    /// `from_dlpack` passes it, and CuPy destroys a stream with its object).
    /// `dl_device=(1, 0)` (the CPU) is accepted for managed and pinned memory, with
    /// `stream=None` only (the host waits), refused for device memory; a device other than
    /// the buffer's is refused (DLPack does not copy).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let max_version = max_version.filter(|v| !v.is_none()).map(dlpack_version).transpose()?;
        let this = slf.get();
        let (alloc, size) = this.live_exposed()?;
        let ours = this.__dlpack_device__();
        let exported = dlpack::exported_device(ours, dl_device)?;
        if copy == Some(true) {
            return Err(buffer_error("DeviceBuffer cannot export a copy; copy=True is not supported"));
        }
        let to_host = exported.0 == dlpack::KDL_CPU;
        let host_may_read = to_host || ours.0 != dlpack::KDL_CUDA;
        let consumer = dlpack::order_consumer(slf.py(), &alloc, stream, host_may_read, to_host)?;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        dlpack::export(slf, alloc, size, exported, versioned, consumer)
    }

    /// Copies the buffer to host memory and waits for the copy (GIL released). Without
    /// `ary`, returns a new numpy uint8 array (a bytearray when numpy is not installed);
    /// with `ary` (any writable, C-contiguous buffer of at least `size` bytes), fills and
    /// returns it. `stream`: where the copy is ordered (default: the buffer's own stream).
    #[pyo3(signature = (ary=None, stream=None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        ary: Option<&Bound<'py, PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.live()?;
        let size = self.len();
        if let Some(ary) = ary.filter(|a| !a.is_none()) {
            self.fill(py, ary, size, stream, "ary")?;
            return Ok(ary.clone());
        }
        if let Some(empty) = numpy_empty(py) {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", "u1")?;
            let array = empty.call((size,), Some(&kwargs))?;
            self.fill(py, &array, size, stream, "the array")?;
            return Ok(array);
        }
        let bytes = PyByteArray::new_with(py, size, |host| {
            self.transfer(py, host.as_mut_ptr() as u64, size, true, stream)
        })?;
        Ok(bytes.into_any())
    }

    /// Copies a host buffer (any buffer-protocol object of at most `size` bytes) to the
    /// start of the buffer and waits for the copy (GIL released). `stream`: where the copy
    /// is ordered (default: the buffer's own stream).
    #[pyo3(signature = (ary, stream=None))]
    fn copy_from_host(
        &self,
        py: Python<'_>,
        ary: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.live()?;
        let buf = host_buffer(ary, false, "ary")?;
        if buf.len_bytes() > self.len() {
            return Err(PyValueError::new_err(format!(
                "ary has {} bytes; the buffer holds only {}",
                buf.len_bytes(),
                self.len()
            )));
        }
        self.transfer(py, buf.buf_ptr() as u64, buf.len_bytes(), false, stream)
    }

    /// Copies device memory to the start of the buffer, on `stream` (default: the buffer's
    /// own), without waiting for the copy. `cuda_ary` is another DeviceBuffer or any object
    /// with a C-contiguous `__cuda_array_interface__` of at most `size` bytes. When the
    /// source names a stream (its own stream, or the interface's v3 `stream`) other than
    /// the copy's, the copy is ordered after the work enqueued there, and that stream after
    /// the copy. The buffer's own stream is not ordered after a copy on another `stream`:
    /// order it (`buf.stream.wait_stream(stream)`, or synchronise `stream`) before the
    /// buffer is used there or freed, which happens on its own stream. A DeviceBuffer of
    /// another device is copied between the devices (`cuMemcpyPeerAsync`, which needs no
    /// peer access).
    #[pyo3(signature = (cuda_ary, stream=None))]
    fn copy_from_device(
        &self,
        py: Python<'_>,
        cuda_ary: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.live()?;
        let (ptr, bytes, source, keep) = match cuda_ary.cast::<DeviceBuffer>() {
            Ok(other) => {
                let other = other.get();
                let (alloc, size) = other.live_sized()?;
                let backend = self.mr.get().inner.backend();
                device::check_same_backend(backend, alloc.resource().backend(), "the source buffer")
                    .or_raise(py)?;
                let device = alloc.resource().device();
                (alloc.ptr(), size, Some((alloc.stream().clone(), device)), Some(alloc))
            }
            Err(_) => {
                let (ptr, bytes, source) =
                    cai_source(py, cuda_ary, self.mr.get().inner.backend(), self.device())?;
                (ptr, bytes, source, None)
            }
        };
        if bytes > self.len() {
            return Err(PyValueError::new_err(format!(
                "cuda_ary has {bytes} bytes; the buffer holds only {}",
                self.len()
            )));
        }
        // A buffer of another device: a copy between the devices.
        if let Some(other) = keep.as_ref().filter(|a| a.resource().device() != self.device()) {
            return self.copy_peer_in(py, other.clone(), bytes, stream);
        }
        self.copy_in(py, ptr, bytes, stream, source, keep)
    }

    /// The contents as bytes (a copy to the host, waited for), ordered on `stream`
    /// (default: the buffer's own stream).
    #[pyo3(signature = (stream=None))]
    fn tobytes<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.live()?;
        let size = self.len();
        PyBytes::new_with(py, size, |host| self.transfer(py, host.as_mut_ptr() as u64, size, true, stream))
    }

    /// `tobytes()`.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.tobytes(py, None)
    }

    /// A new buffer holding a copy of `b` (any buffer-protocol object).
    #[staticmethod]
    #[pyo3(signature = (b, stream=None, mr=None))]
    fn to_device(
        py: Python<'_>,
        b: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let buf = host_buffer(b, false, "b")?;
        let made = Self::make(py, buf.len_bytes(), stream, mr)?;
        made.transfer(py, buf.buf_ptr() as u64, buf.len_bytes(), false, None)?;
        Ok(made)
    }

    /// A deep copy: a new buffer of `size` bytes from the same resource, on the same
    /// stream, filled by a copy enqueued on that stream (not waited for).
    fn copy(&self, py: Python<'_>) -> PyResult<Self> {
        let (alloc, size) = self.live_sized()?;
        let made = Self::make(py, size, Some(self.stream.bind(py)), Some(self.mr.bind(py).clone()))?;
        let source = (alloc.stream().clone(), alloc.resource().device());
        made.copy_in(py, alloc.ptr(), size, None, Some(source), Some(alloc))?;
        Ok(made)
    }

    /// A new buffer on `device` (a device ordinal) holding a copy of this one: allocated from
    /// `mr` (default: that device's current resource, `get_per_device_resource(device)`) on
    /// `stream` (a stream of that device; default: its legacy default stream), filled by a
    /// copy between the devices (`cuMemcpyPeerAsync`, which needs no peer access) enqueued
    /// there and not waited for. The copy is ordered after this buffer's stream, and this
    /// buffer's stream after the copy. To the same device, it is `copy()` into `mr`.
    #[pyo3(signature = (device, stream=None, mr=None))]
    fn copy_to_device(
        &self,
        py: Python<'_>,
        device: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let target = crate::required_device_arg(device, "device")?;
        let (alloc, size) = self.live_sized()?;
        let backend = alloc.resource().backend().clone();
        detached(py, move || streampool::resources::check_device(&backend, Some(target)).map(drop))?;
        let mr = match mr {
            Some(mr) => {
                let bound = mr.get().inner.device();
                if bound != target {
                    return Err(PyValueError::new_err(format!(
                        "mr is a resource of device {bound}, but copy_to_device({target}) makes the copy on \
                         device {target}; pass a resource of device {target}, or none for its current resource"
                    )));
                }
                mr
            }
            None => crate::resources::get_per_device_resource(py, device)?.into_bound(py),
        };
        let made = Self::make(py, size, stream, Some(mr))?;
        made.copy_peer_in(py, alloc, size, None)?;
        Ok(made)
    }

    /// The device ordinal the memory belongs to (its resource's device).
    #[getter]
    fn device(&self) -> i32 {
        self.mr.get().inner.device()
    }

    /// `copy()`.
    fn __copy__(&self, py: Python<'_>) -> PyResult<Self> {
        self.copy(py)
    }

    /// `copy()` (the memory is all a buffer holds that a deep copy could duplicate).
    fn __deepcopy__(&self, py: Python<'_>, memo: &Bound<'_, PyAny>) -> PyResult<Self> {
        let _ = memo;
        self.copy(py)
    }

    /// Sets the size to `new_size`. Within `capacity()` nothing moves (growing exposes
    /// bytes of unspecified value); beyond it the contents move to a new allocation of
    /// `new_size` bytes on the buffer's stream, copied on `stream` (default: the buffer's
    /// own; another stream is ordered after the buffer's and the buffer's after the copy),
    /// and the old memory is freed on the buffer's stream. `ptr` changes then: addresses
    /// read before are stale (memory exported through DLPack stays valid for its consumer).
    #[pyo3(signature = (new_size, stream=None))]
    fn resize(
        &self,
        py: Python<'_>,
        new_size: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let new_size = size_arg(new_size, "new_size")?;
        self.check_stream(py, stream)?;
        {
            let slot = self.slot();
            let capacity = slot.get().map(Allocation::bytes).ok_or_else(closed)?;
            if new_size <= capacity {
                self.size.store(new_size, Ordering::Relaxed);
                return Ok(());
            }
        }
        self.reallocate(py, new_size, new_size, stream)
    }

    /// Makes `capacity()` at least `new_capacity` bytes, keeping the size and contents:
    /// when it grows, the contents move as in `resize` (and `ptr` changes).
    #[pyo3(signature = (new_capacity, stream=None))]
    fn reserve(
        &self,
        py: Python<'_>,
        new_capacity: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let new_capacity = size_arg(new_capacity, "new_capacity")?;
        self.check_stream(py, stream)?;
        if new_capacity <= self.capacity()? {
            return Ok(());
        }
        self.reallocate(py, new_capacity, self.len(), stream)
    }

    /// Pickles through a host copy; unpickling allocates from the current resource (in a
    /// Dask worker process with streampool's plugin, the worker's resource).
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        self.__reduce_ex__(py, 4)
    }

    /// As `__reduce__`; with protocol 5 or later the host copy is a `pickle.PickleBuffer`,
    /// which a `buffer_callback` can take out of band.
    fn __reduce_ex__<'py>(
        &self,
        py: Python<'py>,
        protocol: i64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let rebuild = py.import("streampool._native")?.getattr("_rebuild_device_buffer")?;
        let mut data = self.tobytes(py, None)?.into_any();
        if protocol >= 5 {
            data = py.import("pickle")?.getattr("PickleBuffer")?.call1((data,))?;
        }
        Ok((rebuild, PyTuple::new(py, [data])?))
    }

    /// Prefetches the memory to `device`: a device ordinal, "host", or None for the device
    /// of the buffer's resource, in order on `stream` (default: the buffer's own stream; a
    /// stream of any device, such as the one of the device that will read the pages), so
    /// that work enqueued there afterwards finds its pages in place. Returns at once (GIL
    /// released); the pages move as the stream runs. Memory that is not managed has
    /// nothing to move: the call checks its arguments and does nothing (as RMM's).
    #[pyo3(signature = (device=None, stream=None))]
    fn prefetch(
        &self,
        py: Python<'_>,
        device: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let alloc = self.live()?;
        let resource = alloc.resource().clone();
        let to = location_arg(device, Location::Device(resource.device()))?;
        let stream = Self::op_stream(py, &alloc, stream)?;
        if managed::require_managed(resource.as_ref(), "prefetch", "this buffer's").is_err() {
            // Nothing to move; the stream and the device are still checked, as
            // `managed::prefetch` checks them for managed memory.
            let on = managed::prefetch_device(&stream, resource.device());
            stream.check(resource.backend(), on).or_raise(py)?;
            return match to {
                Location::Device(d) => detached(py, move || {
                    streampool::resources::check_device(resource.backend(), Some(d)).map(drop)
                }),
                Location::Host => Ok(()),
            };
        }
        detached(py, move || alloc.prefetch(Some(to), Some(&stream)))
    }

    /// Advises the driver how the memory (managed memory only) will be used: `advice` is one
    /// of "read_mostly", "unset_read_mostly", "preferred_location",
    /// "unset_preferred_location", "accessed_by", "unset_accessed_by"; `device` (a device
    /// ordinal, "host", or None for the buffer's device) is the location the advice is
    /// about, and is ignored by the read-mostly pair and "unset_preferred_location" (as the
    /// driver ignores it; it is not checked either). The driver takes no advice on memory
    /// of a managed pool (CudaAsyncManagedMemoryResource): UnsupportedError.
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
    /// When the free fails (a `CallbackMemoryResource` whose function raised, say), the
    /// buffer stays open, and closing it again tries again; one that the resource refuses as
    /// not its own (freed by hand: InvalidPointerError) is closed.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        // Taken in a statement of its own: the lock is released before the GIL is.
        let was_exposed = self.exposed.load(Ordering::Relaxed);
        let memory = self.take();
        let alloc = match memory {
            Memory::Own(alloc) => alloc,
            // The last holder frees; the others only drop a reference.
            Memory::Shared(shared) => match Arc::into_inner(shared) {
                Some(alloc) => alloc,
                None => return Ok(()),
            },
            Memory::Closed => return Ok(()),
        };
        match detached(py, move || Ok(alloc.try_free()))? {
            Ok(()) => Ok(()),
            Err((kept, e)) => {
                if let Some(alloc) = kept {
                    let mut slot = self.slot();
                    // Open again, and guarded again: a hand free of an address Python
                    // code has read is refused while the buffer owns it.
                    if was_exposed {
                        self.expose(alloc.ptr());
                    }
                    *slot = Memory::Own(alloc);
                }
                Err(to_pyerr(py, e))
            }
        }
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
        let size = self.len();
        Ok(match self.slot().get() {
            Some(a) => format!("<DeviceBuffer size={size} ptr={:#x} stream={stream} mr={mr}>", a.ptr()),
            None => format!("<DeviceBuffer size={size} closed mr={mr}>"),
        })
    }
}

impl DeviceBuffer {
    /// `DeviceBuffer(ptr=src, size=size, ...)`: a new buffer filled by a copy of `size`
    /// bytes at `src`, enqueued on the buffer's stream and, when that is the legacy default
    /// stream, waited for (as RMM does). `src` 0 copies nothing, as in RMM.
    fn make_copy(
        py: Python<'_>,
        src: DevPtr,
        size: usize,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyMemoryResource>>,
    ) -> PyResult<Self> {
        let made = Self::make(py, size, stream, mr)?;
        // `ptr=0` is RMM's default: no source, the memory is left as allocated.
        if src != 0 && size > 0 {
            made.copy_in(py, src, size, None, None, None)?;
            let alloc = made.live()?;
            if alloc.stream().is_legacy() {
                detached(py, move || {
                    let resource = alloc.resource();
                    alloc.stream().synchronize(resource.backend(), resource.device())
                })?;
            }
        }
        Ok(made)
    }

    /// Fills `out` (a writable, C-contiguous host buffer of at least `size` bytes; `what`
    /// names it in errors) with the buffer's contents.
    fn fill(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        size: usize,
        stream: Option<&Bound<'_, PyAny>>,
        what: &str,
    ) -> PyResult<()> {
        let buf = host_buffer(out, true, what)?;
        if buf.len_bytes() < size {
            return Err(PyValueError::new_err(format!(
                "{what} has {} bytes; the buffer needs {size}",
                buf.len_bytes()
            )));
        }
        self.transfer(py, buf.buf_ptr() as u64, size, true, stream)
    }

    /// TypeError (or the stream's own error) for a `stream` argument that is not a stream
    /// of the buffer's backend; nothing for None.
    fn check_stream(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        if let Some(s) = stream.filter(|s| !s.is_none()) {
            let resource = &self.mr.get().inner;
            let s = to_stream(py, Some(s), || resource.backend())?;
            s.check(resource.backend(), resource.device()).or_raise(py)?;
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // No lock to take: `&mut self` means nobody else holds a reference.
        let memory = std::mem::take(self.memory.get_mut().unwrap_or_else(|e| e.into_inner()));
        if *self.exposed.get_mut() {
            if let Some(alloc) = memory.get() {
                self.unexpose(alloc.ptr());
            }
        }
        // A pool's fast path frees without waiting: `release` keeps the GIL for it.
        memory.let_go();
    }
}

/// Unpickles a DeviceBuffer: a copy of `data` in memory from the current resource, or, in
/// a Dask worker process where streampool's plugin set up one device, from that device's
/// resource (`streampool.dask._arrival_resource`): a LocalCluster's workers all see every
/// GPU, and the current device of each is 0.
#[pyfunction]
pub(crate) fn _rebuild_device_buffer(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<DeviceBuffer> {
    let modules = py.import("sys")?.getattr("modules")?;
    // Not while the module is still being imported (its function not defined yet).
    let arrival = modules
        .cast::<pyo3::types::PyDict>()?
        .get_item("streampool.dask")?
        .and_then(|dask| dask.getattr("_arrival_resource").ok());
    // None (no plugin here) is no resource: the current one.
    let mr = match arrival {
        Some(f) => f.call0()?.cast_into::<PyMemoryResource>().ok(),
        None => None,
    };
    DeviceBuffer::to_device(py, data, None, mr)
}

/// A consumer's `max_version`: a `(major, minor)` of ints >= 0 (any size: a version above
/// the ones this buffer knows is as good as the highest). ValueError naming it otherwise.
fn dlpack_version(v: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    let bad = || PyValueError::new_err(format!("max_version must be a (major, minor) of ints >= 0, got {v}"));
    let parts: Vec<Bound<'_, PyAny>> = match v.cast::<pyo3::types::PyTuple>() {
        Ok(t) if t.len() == 2 => t.iter().collect(),
        _ => return Err(bad()),
    };
    let mut out = [0u64; 2];
    for (slot, part) in out.iter_mut().zip(&parts) {
        // An int, or what stands for one (`__index__`: numpy's integers), not a bool; what
        // `__index__` raises is the form's fault, but Ctrl-C (not an Exception) goes on.
        let n = match crate::as_index(part) {
            Ok(Some(n)) => n,
            Ok(None) => return Err(bad()),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyException>(v.py()) => return Err(bad()),
            Err(e) => return Err(e),
        };
        if n.lt(0)? {
            return Err(bad());
        }
        *slot = n.extract::<u64>().unwrap_or(u64::MAX);
    }
    Ok((out[0], out[1]))
}
