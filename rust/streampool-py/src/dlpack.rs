//! DLPack export of a `DeviceBuffer`: a 1-D uint8 tensor in a capsule.
//!
//! The layout is DLPack's C ABI (`dlpack.h`, version 1.1). A versioned capsule
//! ("dltensor_versioned") is made for consumers that ask with `max_version >= (1, 0)`, a
//! legacy one ("dltensor") otherwise. The tensor keeps the `DeviceBuffer` and its
//! allocation alive until the consumer calls the deleter, so closing the buffer while a
//! consumer still uses the memory only defers the free.

use std::ffi::{c_void, CStr};
use std::ptr::{null_mut, NonNull};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyCapsule, PyInt};
use streampool::error::record_drop_error;
use streampool::{Allocation, Event, MemoryKind, Stream};

use crate::buffer::{self, DeviceBuffer};
use crate::errors::{buffer_error, detached};
use crate::streams::consumer_stream;

/// `kDLCPU`: host memory.
pub(crate) const KDL_CPU: i32 = 1;
/// `kDLCUDA`: device memory.
pub(crate) const KDL_CUDA: i32 = 2;
/// `kDLCUDAHost`: page-locked host memory.
pub(crate) const KDL_CUDA_HOST: i32 = 3;
/// `kDLCUDAManaged`: managed (unified) memory.
pub(crate) const KDL_CUDA_MANAGED: i32 = 13;

/// The device a buffer on DLPack device `ours` is exported as, for a consumer that asks
/// for `asked` (None: its own). Managed and pinned memory may be exported to the CPU (the
/// host reads it where it is), and managed memory to its own GPU as plain device memory
/// (kernels there read it where it is); anything else needs a copy, which DLPack does not
/// make.
pub(crate) fn exported_device(ours: (i32, i32), asked: Option<(i32, i32)>) -> PyResult<(i32, i32)> {
    let Some(asked) = asked.filter(|a| *a != ours) else { return Ok(ours) };
    if asked.0 == KDL_CPU && asked.1 != 0 {
        return Err(buffer_error(format!(
            "dl_device {asked:?} names CPU {}: DLPack's CPU device is (1, 0)",
            asked.1
        )));
    }
    if asked.0 == KDL_CPU && ours.0 != KDL_CUDA {
        return Ok((KDL_CPU, 0));
    }
    if ours.0 == KDL_CUDA_MANAGED && asked == (KDL_CUDA, ours.1) {
        return Ok(asked);
    }
    Err(buffer_error(if asked.0 == KDL_CPU {
        format!(
            "DeviceBuffer holds device memory (DLPack device {ours:?}), which the host cannot read: \
             copy it to the host first (buf.copy_to_host()), or allocate it from a \
             ManagedMemoryResource or PinnedHostMemoryResource"
        )
    } else if asked.0 == ours.0 {
        format!(
            "DeviceBuffer is on device {} but the consumer is on device {}: DLPack does not copy \
             between devices; make the buffer on the consumer's device (DeviceBuffer(..., \
             mr=<a resource of device {}>)) or copy it there",
            ours.1, asked.1, asked.1
        )
    } else {
        format!(
            "DeviceBuffer lives on DLPack device {ours:?}; it cannot be exported to {asked:?} without a copy"
        )
    }))
}

/// `(device_type, device_id)` of memory of `kind` on `device`.
pub(crate) fn dl_device(kind: MemoryKind, device: i32) -> (i32, i32) {
    match kind {
        MemoryKind::Device => (KDL_CUDA, device),
        MemoryKind::Managed => (KDL_CUDA_MANAGED, device),
        MemoryKind::PinnedHost => (KDL_CUDA_HOST, 0),
    }
}

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `kDLUInt`.
const KDL_UINT: u8 = 1;

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The two managed-tensor layouts, so that one deleter and one capsule destructor serve both.
trait Managed: Sized + 'static {
    /// The capsule name before a consumer renames it to `used_...`.
    const NAME: &'static CStr;
    fn new(tensor: DLTensor) -> Self;
    fn tensor(&mut self) -> &mut DLTensor;
    fn ctx(&self) -> *mut c_void;
    fn set_ctx(&mut self, ctx: *mut c_void);
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)>;
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensor { dl_tensor, manager_ctx: null_mut(), deleter: Some(delete::<Self>) }
    }
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn ctx(&self) -> *mut c_void {
        self.manager_ctx
    }
    fn set_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 1 },
            manager_ctx: null_mut(),
            deleter: Some(delete::<Self>),
            flags: 0,
            dl_tensor,
        }
    }
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn ctx(&self) -> *mut c_void {
        self.manager_ctx
    }
    fn set_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
}

/// What keeps the memory valid while a consumer holds the tensor, and the consumer's
/// stream, whose work on it every later free must follow.
struct Keep {
    owner: Py<DeviceBuffer>,
    alloc: Arc<Allocation>,
    consumer: Option<Consumer>,
}

/// The consumer's stream, which the memory's free follows, and the Python object that owns
/// that stream, kept alive with the export so that the stream still exists when the
/// deleter orders the free after it: a stream used after it was destroyed is undefined
/// behaviour on the CUDA driver (it crashed the process on the H200), and CuPy destroys a
/// stream when its object dies, with arrays made on it maybe still alive.
pub(crate) struct Consumer {
    stream: Stream,
    owner: Option<Py<PyAny>>,
}

/// One export: the managed tensor (first, so that its address is the export's), the
/// shape and strides it points to, and what it keeps alive. `manager_ctx` points here.
#[repr(C)]
struct Export<M> {
    managed: M,
    shape: [i64; 1],
    strides: [i64; 1],
    keep: Keep,
}

/// The deleter DLPack consumers call once they are done with the tensor (from any thread,
/// with or without the GIL).
unsafe extern "C" fn delete<M: Managed>(managed: *mut M) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the tensor of an `Export<M>` that `export` leaked with
    // `Box::into_raw` and whose `manager_ctx` is that box; the DLPack contract calls the
    // deleter once, so the box is reclaimed once.
    let export = unsafe { Box::from_raw((*managed).ctx().cast::<Export<M>>()) };
    let Keep { owner, alloc, consumer } = export.keep;
    // The consumer lets go on the host, maybe with its kernels still queued: the buffer's
    // stream, on which the memory is freed (now, or by the buffer later), waits for them.
    let stream_owner = consumer.and_then(|Consumer { stream, owner }| {
        order_after_consumer(&alloc, &stream);
        owner
    });
    // The last holder frees the memory, reporting a refused (double) free.
    if let Some(alloc) = Arc::into_inner(alloc) {
        buffer::release(alloc);
    }
    let mut owners = Some((owner, stream_owner));
    // Dropping a Python reference needs the interpreter; at shutdown it may be gone, and a
    // leaked reference is the only safe outcome then.
    if crate::gil::try_attach(|_py| drop(owners.take())).is_none() {
        std::mem::forget(owners);
    }
}

/// Makes the stream of `alloc` wait for the work enqueued on `consumer` so far. Where that
/// cannot be done (the consumer's stream was destroyed), the device is synchronised
/// instead, so that the free that follows is safe all the same. On a simulated device
/// since closed there is nothing to order.
fn order_after_consumer(alloc: &Allocation, consumer: &Stream) {
    let resource = alloc.resource();
    let (backend, device) = (resource.backend(), resource.device());
    if backend.check_open().is_err() {
        return;
    }
    if let Err(e) = alloc.stream().wait_for(backend, device, consumer, device) {
        record_drop_error("ordering a DLPack export's memory after its consumer's stream", &e);
        if let Err(e) = backend.ctx_synchronize(device) {
            record_drop_error("synchronising the device for a DLPack export's free", &e);
        }
    }
}

/// The capsule's destructor: frees the tensor unless a consumer took it (renaming the
/// capsule to "used_dltensor..." and taking over the call to the deleter).
unsafe extern "C" fn destroy_capsule<M: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a live capsule and the GIL held; `PyCapsule_IsValid`
    // checks the name (and sets no exception), and a capsule of that name made here holds
    // a `*mut M` from `export`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr()).cast::<M>();
            if let Some(deleter) = (*managed).deleter() {
                deleter(managed);
            }
        }
    }
}

/// The capsule for `__dlpack__` of the first `len` bytes of `alloc`: versioned when
/// `versioned`, legacy otherwise.
/// `consumer`: the consumer's stream (from [`order_consumer`]), which the memory's free
/// will follow.
pub(crate) fn export<'py>(
    owner: &Bound<'py, DeviceBuffer>,
    alloc: Arc<Allocation>,
    len: usize,
    device: (i32, i32),
    versioned: bool,
    consumer: Option<Consumer>,
) -> PyResult<Bound<'py, PyCapsule>> {
    if versioned {
        make::<DLManagedTensorVersioned>(owner, alloc, len, device, consumer)
    } else {
        make::<DLManagedTensor>(owner, alloc, len, device, consumer)
    }
}

fn make<'py, M: Managed>(
    owner: &Bound<'py, DeviceBuffer>,
    alloc: Arc<Allocation>,
    len: usize,
    (device_type, device_id): (i32, i32),
    consumer: Option<Consumer>,
) -> PyResult<Bound<'py, PyCapsule>> {
    let py = owner.py();
    let len = i64::try_from(len).map_err(|_| buffer_error("buffer too large for DLPack"))?;
    let tensor = DLTensor {
        data: alloc.ptr() as *mut c_void,
        device: DLDevice { device_type, device_id },
        ndim: 1,
        dtype: DLDataType { code: KDL_UINT, bits: 8, lanes: 1 },
        shape: null_mut(),
        strides: null_mut(),
        byte_offset: 0,
    };
    let keep = Keep { owner: owner.clone().unbind(), alloc, consumer };
    let raw = Box::into_raw(Box::new(Export { managed: M::new(tensor), shape: [len], strides: [1], keep }));
    // SAFETY: `raw` is a fresh, valid box; the shape and strides it points to live in the
    // same box, which outlives the tensor (it is the tensor).
    let managed = unsafe {
        let e = &mut *raw;
        e.managed.tensor().shape = e.shape.as_mut_ptr();
        e.managed.tensor().strides = e.strides.as_mut_ptr();
        e.managed.set_ctx(raw.cast());
        NonNull::from(&mut e.managed).cast::<c_void>()
    };
    // SAFETY: the pointer is the managed tensor, valid until its deleter runs, which the
    // destructor calls only for a capsule no consumer took.
    let capsule = unsafe {
        PyCapsule::new_with_pointer_and_destructor(py, managed, M::NAME, Some(destroy_capsule::<M>))
    };
    capsule.inspect_err(|_| {
        // SAFETY: no capsule was made, so nobody else will reclaim the box.
        unsafe { delete::<M>(managed.as_ptr().cast()) }
    })
}

/// Orders the consumer's `stream` (DLPack's convention: -1 asks for no synchronisation, 0
/// is ambiguous and refused, None is the legacy default stream) after the work enqueued on
/// the buffer's stream: an event recorded there, waited on by the consumer stream. With
/// None and `host_may_read` (memory the host can read, whose consumer may be the host, as
/// numpy's is: it names no stream), the host waits for the event as well. Both streams are
/// as the calling thread names them: the buffer's stream is kept resolved, so for a buffer
/// made on another thread's per-thread default stream the event is recorded on the legacy
/// default stream, after all of that thread's earlier work (`Stream::resolved`). A consumer
/// stream of another device is refused: DLPack does not copy between devices. An export to
/// the host (`to_host`: `dl_device` of kDLCPU) takes `stream=None` only, as the array
/// API's `__dlpack__` says, and the host waits.
///
/// Returns the consumer's stream where the memory's free must follow its work: not for
/// -1 (the consumer keeps its own order), the host (it has waited), or the buffer's own
/// stream; with it, the Python object that owns that stream, where one is known
/// ([`stream_owner`]).
pub(crate) fn order_consumer(
    py: Python<'_>,
    alloc: &Arc<Allocation>,
    stream: Option<&Bound<'_, PyAny>>,
    host_may_read: bool,
    to_host: bool,
) -> PyResult<Option<Consumer>> {
    let backend = alloc.resource().backend().clone();
    let device = alloc.resource().device();
    let given = stream.filter(|s| !s.is_none());
    if to_host && given.is_some() {
        return Err(buffer_error(
            "an export to the host (dl_device=(1, 0)) takes stream=None: the host has no stream, and \
             waits for the buffer's work before the export returns",
        ));
    }
    let host_waits = host_may_read && given.is_none();
    let consumer = match given {
        None => Stream::legacy(),
        Some(s) => {
            if s.is_instance_of::<PyBool>() {
                return Err(buffer_error(format!("stream={s} is a bool: pass None, -1, 1, 2 or a stream")));
            }
            if s.is_instance_of::<PyInt>() {
                match s.extract::<i64>() {
                    Ok(-1) => return Ok(None),
                    Ok(0) => {
                        return Err(buffer_error(
                            "stream=0 is ambiguous in DLPack: pass 1 for the legacy default stream, 2 for \
                             the per-thread default stream, -1 for no synchronisation, or a stream handle",
                        ))
                    }
                    _ => {}
                }
            }
            consumer_stream(py, s, &backend)?
        }
    };
    if let Some((_, theirs)) = consumer.binding().filter(|(_, d)| *d != device) {
        return Err(buffer_error(format!(
            "the consumer's stream is on device {theirs} but the DeviceBuffer on device {device}: \
             DLPack does not copy between devices; make the buffer on device {theirs} or copy it there"
        )));
    }
    let producer = alloc.stream().clone();
    // One stream for this thread (handle 2 is this thread's own on both sides).
    if producer.handle() == consumer.handle() && !host_waits {
        return Ok(None);
    }
    let owner =
        if host_waits { None } else { given.and_then(|s| stream_owner(s, consumer.handle(), device)) };
    let consumer = detached(py, move || {
        let event = Event::new(&backend, device)?;
        event.record(&producer)?;
        if host_waits {
            event.synchronize()?;
        }
        consumer.wait(&event)?;
        // Past the check above, the host waited or the consumer's stream is another.
        Ok((!host_waits).then_some(consumer))
    })?;
    // Resolved: handle 2 names the calling thread's per-thread stream, and the deleter may
    // run on another thread, where the legacy default stream stands for this one.
    Ok(consumer.map(|stream| Consumer { stream: stream.resolved(), owner }))
}

/// The Python object that owns the consumer's stream `handle` (of `device`), to keep alive
/// until the consumer lets go: the stream object given, where one was (a
/// `streampool.Stream` too: one that wraps another library's stream keeps that alive); for
/// a bare handle (DLPack's convention, as CuPy's and PyTorch's `from_dlpack` pass their
/// current stream), CuPy's or PyTorch's current stream where it has that handle (only
/// where the library is already imported, and PyTorch's CUDA initialised: nothing is
/// imported here). None for the default streams, which never end, and otherwise: a bare
/// handle of another library's stream is trusted to outlive the tensor made on it.
fn stream_owner(given: &Bound<'_, PyAny>, handle: u64, device: i32) -> Option<Py<PyAny>> {
    if handle <= 2 {
        return None;
    }
    if !given.is_instance_of::<PyInt>() {
        return Some(given.clone().unbind());
    }
    let modules = given.py().import("sys").and_then(|sys| sys.getattr("modules")).ok()?;
    let imported = |name: &str| modules.get_item(name).ok().filter(|m| !m.is_none());
    let has_handle = |s: &Bound<'_, PyAny>, attr: &str| {
        s.getattr(attr).and_then(|h| h.extract::<u64>()).ok() == Some(handle)
    };
    if let Some(cupy) = imported("cupy") {
        if let Ok(current) = cupy.getattr("cuda").and_then(|cuda| cuda.call_method0("get_current_stream")) {
            if has_handle(&current, "ptr") {
                return Some(current.unbind());
            }
        }
    }
    let cuda = imported("torch")?.getattr("cuda").ok()?;
    if cuda.call_method0("is_initialized").and_then(|b| b.extract::<bool>()).ok() != Some(true) {
        return None;
    }
    let current = cuda.call_method1("current_stream", (device,)).ok()?;
    has_handle(&current, "cuda_stream").then(|| current.unbind())
}
