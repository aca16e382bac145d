//! Memory resources (`streampool.mr`) and the current resource of each device.
//!
//! Every resource is a subclass of `MemoryResource`, which holds the core resource as a
//! `ResourceRef` and implements `allocate`/`deallocate` once for all of them. A subclass
//! adds only its constructor and its own properties.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use pyo3::PyClass;
use streampool::device::{self, BackendRef, DevPtr};
use streampool::resources::{check_device, ManagedMemoryResource, PinnedHostMemoryResource};
use streampool::{
    AsyncPoolOptions, CudaAsyncMemoryResource, CudaMemoryResource, LogSink, LoggingAdaptor, MemoryKind,
    ResourceRef,
};

use crate::buffer::refuse_buffer_pointer;
use crate::errors::{detached, OrRaise};
use crate::gil::fast_path_settled;
use crate::streams::to_stream;
use crate::{device_arg, ptr_arg, size_arg};

/// Base class of every memory resource. Not constructible itself.
///
/// The stream-ordered contract: memory from `allocate(nbytes, stream)` may be used by work
/// enqueued on `stream` after the call; `deallocate(ptr, nbytes, stream)` makes it reusable
/// by work ordered after everything enqueued on `stream` before the call.
#[derive(Debug)]
#[pyclass(frozen, subclass, module = "streampool.mr", name = "MemoryResource")]
pub struct PyMemoryResource {
    pub(crate) inner: ResourceRef,
}

impl PyMemoryResource {
    /// The initializer for a subclass's base part (also for adaptors defined elsewhere).
    pub(crate) fn base(inner: ResourceRef) -> PyClassInitializer<Self> {
        PyClassInitializer::from(PyMemoryResource { inner })
    }
}

pub(crate) fn memory_kind_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Device => "device",
        MemoryKind::Managed => "managed",
        MemoryKind::PinnedHost => "pinned_host",
    }
}

#[pymethods]
impl PyMemoryResource {
    /// Allocates `nbytes` (an int, or a string such as "1MiB") for use on `stream`
    /// (default: the legacy default stream). Returns the address; 0 for 0 bytes.
    #[pyo3(signature = (nbytes, stream=None))]
    fn allocate(
        &self,
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DevPtr> {
        let bytes = size_arg(nbytes, "nbytes")?;
        // Made under a simulated device that was exited: refused, even where the resource
        // could serve the request from memory it holds (a pool's free lists).
        self.inner.backend().check_open().or_raise(py)?;
        let stream = to_stream(py, stream, || self.inner.backend())?;
        // The fast path keeps the GIL: releasing and retaking it costs more than the
        // allocation and makes threads convoy. Only what can wait releases it (and
        // `fast_path_settled`, now and then, to let waiting threads have it).
        if let Some(settled) = self.inner.try_allocate(bytes, &stream) {
            fast_path_settled(py);
            return settled.or_raise(py);
        }
        let (mr, stream) = (self.inner.clone(), stream.into_owned());
        detached(py, move || mr.allocate(bytes, &stream))
    }

    /// Frees `ptr` (of `nbytes` bytes, as allocated) for reuse by work ordered after what
    /// is enqueued on `stream` now (default: the legacy default stream). The address of an
    /// open DeviceBuffer that Python code has read is refused: the buffer frees it itself.
    #[pyo3(signature = (ptr, nbytes, stream=None))]
    fn deallocate(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ptr = ptr_arg(ptr)?;
        let bytes = size_arg(nbytes, "nbytes")?;
        refuse_buffer_pointer(py, ptr)?;
        let stream = to_stream(py, stream, || self.inner.backend())?;
        if let Some(settled) = self.inner.try_deallocate(ptr, bytes, &stream) {
            fast_path_settled(py);
            return settled.or_raise(py);
        }
        let (mr, stream) = (self.inner.clone(), stream.into_owned());
        detached(py, move || mr.deallocate(ptr, bytes, &stream))
    }

    /// The device ordinal this resource is bound to.
    #[getter]
    fn device(&self) -> i32 {
        self.inner.device()
    }

    /// "device", "managed" or "pinned_host".
    #[getter]
    fn memory_kind(&self) -> &'static str {
        memory_kind_name(self.inner.memory_kind())
    }

    /// The backend the resource lives on, e.g. "CUDA driver 13.0" or "simulated device #1 (16 GiB)".
    #[getter]
    fn backend(&self) -> String {
        self.inner.backend().describe()
    }

    fn __repr__(&self) -> String {
        format!("<{:?}>", self.inner)
    }
}

/// Defines a Python class over a driver pool resource ([`CudaAsyncMemoryResource`], of device
/// or managed memory): the struct, its initializer and its pool properties, written once.
/// The caller gives the class's docs, names and constructor (`#[new]`), which must end in
/// `Self::init(mr)`.
macro_rules! async_pool_class {
    ($(#[$doc:meta])* $ty:ident, $pyname:tt, { $($new:tt)* }) => {
        $(#[$doc])*
        #[derive(Debug)]
        #[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = $pyname)]
        pub struct $ty {
            inner: Arc<CudaAsyncMemoryResource>,
        }

        impl $ty {
            pub(crate) fn init(inner: CudaAsyncMemoryResource) -> PyClassInitializer<Self> {
                let inner = Arc::new(inner);
                PyMemoryResource::base(inner.clone()).add_subclass($ty { inner })
            }

            /// The class over `inner` whose allocations go through `through` (an adaptor
            /// over `inner`: `streampool profile`'s logging one), its pool methods `inner`'s.
            #[allow(dead_code)] // one of the two classes has no such use
            pub(crate) fn init_through(
                inner: Arc<CudaAsyncMemoryResource>,
                through: ResourceRef,
            ) -> PyClassInitializer<Self> {
                PyMemoryResource::base(through).add_subclass($ty { inner })
            }
        }

        #[pymethods]
        impl $ty {
            $($new)*

            /// The driver pool handle (`CUmemoryPool` as an int). A `PoolHandle`: an int that
            /// can also be called, for RMM's `pool_handle()`.
            #[getter]
            fn pool_handle(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
                pool_handle_object(py, self.inner.pool_handle())
            }

            /// True when this resource created its pool (and destroys it when collected).
            #[getter]
            fn owns_pool(&self) -> bool {
                self.inner.owns_pool()
            }

            /// Bytes the pool keeps at a synchronisation before releasing memory to the system.
            #[getter]
            fn release_threshold(&self, py: Python<'_>) -> PyResult<u64> {
                ask(py, &self.inner, |mr| mr.release_threshold())
            }

            /// Bytes the pool holds from the system.
            #[getter]
            fn reserved_bytes(&self, py: Python<'_>) -> PyResult<usize> {
                ask(py, &self.inner, |mr| mr.reserved_bytes())
            }

            /// Bytes handed out by the pool (for a shared pool, other libraries' too).
            #[getter]
            fn used_bytes(&self, py: Python<'_>) -> PyResult<usize> {
                ask(py, &self.inner, |mr| mr.used_bytes())
            }

            /// The devices other than the pool's own that may read and write its memory
            /// (`cuMemPoolGetAccess`), in order.
            #[getter]
            fn peer_access(&self, py: Python<'_>) -> PyResult<Vec<i32>> {
                let mr = self.inner.clone();
                detached(py, move || mr.peer_access())
            }

            /// Grants (or, with `enabled=False`, withdraws) read-write access to the pool's
            /// memory, present and future, from work on `device` (`cuMemPoolSetAccess`).
            #[pyo3(signature = (device, enabled=true))]
            fn set_peer_access(&self, py: Python<'_>, device: &Bound<'_, PyAny>, enabled: bool) -> PyResult<()> {
                let peer = required_device(device)?;
                let mr = self.inner.clone();
                detached(py, move || mr.set_peer_access(peer, enabled))
            }

            /// Releases free memory to the system until the pool holds at most `nbytes`.
            fn trim_to(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
                let keep = size_arg(nbytes, "nbytes")?;
                let mr = self.inner.clone();
                detached(py, move || mr.trim_to(keep))
            }
        }
    };
}

static POOL_HANDLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `streampool._types.PoolHandle(handle)`: an int that is also callable, so that both
/// streampool's `pool_handle` (a property) and RMM's `pool_handle()` (a method) work.
fn pool_handle_object(py: Python<'_>, handle: u64) -> PyResult<Py<PyAny>> {
    let cls = POOL_HANDLE.import(py, "streampool._types", "PoolHandle")?;
    Ok(cls.call1((handle,))?.unbind())
}

/// A `device` argument that must name a device (None is refused: there is no default).
fn required_device(device: &Bound<'_, PyAny>) -> PyResult<i32> {
    crate::required_device_arg(device, "device")
}

/// `peer_access=`: None, or an iterable of device ordinals (each checked as a `device`);
/// an empty one still asks for a pool of its own.
fn peer_access_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<i32>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "peer_access must be a list of device ordinals, such as [{obj}], not an int"
        )));
    }
    let mut devices = Vec::new();
    for item in obj.try_iter().map_err(|_| {
        PyTypeError::new_err(
            "peer_access must be a list of device ordinals (the devices that may access the pool)",
        )
    })? {
        let d = crate::required_device_arg(&item?, "each device of peer_access")?;
        if !devices.contains(&d) {
            devices.push(d);
        }
    }
    Ok(Some(devices))
}

/// The options of a pool of its own, from Python arguments (None: not given).
fn pool_options(
    initial_pool_size: Option<&Bound<'_, PyAny>>,
    release_threshold: Option<&Bound<'_, PyAny>>,
    enable_ipc: bool,
) -> PyResult<AsyncPoolOptions> {
    Ok(AsyncPoolOptions {
        initial_pool_size: initial_pool_size.map(|s| size_arg(s, "initial_pool_size")).transpose()?,
        release_threshold: release_threshold.map(|s| size_arg(s, "release_threshold")).transpose()?,
        enable_ipc,
        peer_access: None,
    })
}

async_pool_class! {
    /// The driver's stream-ordered pool (`cuMemAllocFromPoolAsync`): the recommended resource.
    ///
    /// With no options it uses the device's current pool, shared with every library that uses
    /// the driver's pool. With `initial_pool_size`, `release_threshold`, `enable_ipc` or
    /// `peer_access` (even an empty list) it creates a pool of its own, destroyed with the
    /// resource.
    ///
    /// Sizes are not checked on free: the driver's free takes no size, so
    /// `deallocate(ptr, 1 << 40)` frees the allocation at `ptr`, whatever its size. Wrap it
    /// in a TrackingResourceAdaptor to have wrong sizes refused.
    ///
    /// Example::
    ///
    ///     pool = mr.CudaAsyncMemoryResource()  # the device's default pool, shared with other libraries
    ///     own = mr.CudaAsyncMemoryResource(initial_pool_size="1GiB", release_threshold="4GiB")  # a pool of its own
    ///     ptr = own.allocate(1 << 20)
    ///     own.deallocate(ptr, 1 << 20)
    PyCudaAsyncMemoryResource, "CudaAsyncMemoryResource", {
        #[new]
        #[pyo3(
            signature = (initial_pool_size=None, release_threshold=None, enable_ipc=None, device=None, peer_access=None),
            text_signature = "(initial_pool_size=None, release_threshold=None, enable_ipc=False, device=None, peer_access=None)"
        )]
        fn new(
            py: Python<'_>,
            initial_pool_size: Option<&Bound<'_, PyAny>>,
            release_threshold: Option<&Bound<'_, PyAny>>,
            enable_ipc: Option<&Bound<'_, PyAny>>,
            device: Option<&Bound<'_, PyAny>>,
            peer_access: Option<&Bound<'_, PyAny>>,
        ) -> PyResult<PyClassInitializer<Self>> {
            let device = device_arg(device, "device")?;
            let enable_ipc = crate::flag_arg(enable_ipc, "enable_ipc")?;
            let mut options = pool_options(initial_pool_size, release_threshold, enable_ipc)?;
            options.peer_access = peer_access_arg(peer_access)?;
            let mr = detached(py, move || CudaAsyncMemoryResource::new(device, options))?;
            Ok(Self::init(mr))
        }
    }
}

async_pool_class! {
    /// The CUDA 13 driver's stream-ordered pool of managed memory, for work larger than the
    /// GPU: with no options the device's current managed pool (the default one's release
    /// threshold raised to the maximum), with options a managed pool of its own. Needs a
    /// CUDA 13 driver and a GPU with concurrent managed access (UnsupportedError saying which
    /// is missing otherwise). Sizes are not checked on free (the driver's free takes none).
    PyCudaAsyncManagedMemoryResource, "CudaAsyncManagedMemoryResource", {
        #[new]
        #[pyo3(signature = (initial_pool_size=None, release_threshold=None, device=None))]
        fn new(
            py: Python<'_>,
            initial_pool_size: Option<&Bound<'_, PyAny>>,
            release_threshold: Option<&Bound<'_, PyAny>>,
            device: Option<&Bound<'_, PyAny>>,
        ) -> PyResult<PyClassInitializer<Self>> {
            let device = device_arg(device, "device")?;
            let options = pool_options(initial_pool_size, release_threshold, false)?;
            let mr = detached(py, move || {
                let (backend, device) = streampool::resources::bind(device)?;
                CudaAsyncMemoryResource::managed(backend, device, options)
            })?;
            Ok(Self::init(mr))
        }
    }
}

/// Asks a driver pool resource something (a driver call) with the GIL released.
fn ask<T: Send + 'static>(
    py: Python<'_>,
    mr: &Arc<CudaAsyncMemoryResource>,
    f: impl FnOnce(&CudaAsyncMemoryResource) -> streampool::Result<T> + Send + 'static,
) -> PyResult<T> {
    let mr = mr.clone();
    detached(py, move || f(&mr))
}

/// Allocates from a driver pool someone else owns (PyTorch's, CuPy's), never destroying it.
/// Sizes are not checked on free (the driver's free takes none).
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = "CudaAsyncViewMemoryResource")]
pub struct PyCudaAsyncViewMemoryResource {
    inner: Arc<CudaAsyncMemoryResource>,
}

#[pymethods]
impl PyCudaAsyncViewMemoryResource {
    #[new]
    #[pyo3(signature = (pool_handle, device=None))]
    fn new(
        py: Python<'_>,
        pool_handle: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let given = device_arg(device, "device")?;
        // An int, or what converts to one with int(): a `cuda.bindings` handle object
        // (`driver.CUmemoryPool`, `runtime.cudaMemPool_t`), as RMM reads it. Not its
        // `getPtr()`: that is where the object stores the handle, a host address.
        let handle = match pool_handle.is_instance_of::<pyo3::types::PyFloat>() {
            true => None, // int() would truncate it into some number
            false => crate::handle_int(pool_handle)?,
        };
        let pool = handle.and_then(|h| h.extract::<u64>().ok()).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{pool_handle} is not a memory pool handle (an int in 0..2**64, or a cuda.bindings CUmemoryPool \
                 or cudaMemPool_t)"
            ))
        })?;
        let inner =
            Arc::new(detached(py, move || CudaAsyncMemoryResource::view(device::backend()?, given, pool))?);
        Ok(PyMemoryResource::base(inner.clone()).add_subclass(Self { inner }))
    }

    /// The driver pool handle this resource allocates from (a `PoolHandle`: an int that
    /// can also be called, for RMM's `pool_handle()`).
    #[getter]
    fn pool_handle(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        pool_handle_object(py, self.inner.pool_handle())
    }

    /// Bytes the pool holds from the system (whoever allocated them).
    #[getter]
    fn reserved_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        ask(py, &self.inner, |mr| mr.reserved_bytes())
    }

    /// Bytes handed out by the pool (whoever allocated them).
    #[getter]
    fn used_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        ask(py, &self.inner, |mr| mr.used_bytes())
    }

    /// Always False: a view never destroys the pool.
    #[getter]
    fn owns_pool(&self) -> bool {
        false
    }
}

/// Plain device memory (`cuMemAlloc`/`cuMemFree`). Every free waits for the device. Sizes
/// are not checked on free (`cuMemFree` takes none).
///
/// Example::
///
///     plain = mr.CudaMemoryResource()
///     ptr = plain.allocate(4096)
///     plain.deallocate(ptr, 4096)
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = "CudaMemoryResource")]
pub struct PyCudaMemoryResource;

/// Managed (unified) memory (`cuMemAllocManaged`), for work larger than device memory.
/// Sizes are not checked on free (`cuMemFree` takes none).
///
/// Example::
///
///     managed = mr.ManagedMemoryResource()
///     buf = streampool.DeviceBuffer(size=1 << 20, mr=managed)
///     buf.prefetch()  # to the buffer's device, on its stream
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = "ManagedMemoryResource")]
pub struct PyManagedMemoryResource;

/// Page-locked host memory (`cuMemHostAlloc`). Sizes are not checked on free
/// (`cuMemFreeHost` takes none).
///
/// Example::
///
///     pinned = mr.PinnedHostMemoryResource()
///     staging = streampool.DeviceBuffer(size=1 << 20, mr=pinned)
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.mr", name = "PinnedHostMemoryResource")]
pub struct PyPinnedHostMemoryResource;

fn plain<R, S>(
    py: Python<'_>,
    make: fn(Option<i32>) -> streampool::Result<R>,
    device: Option<&Bound<'_, PyAny>>,
    sub: S,
) -> PyResult<PyClassInitializer<S>>
where
    R: streampool::MemoryResource + 'static,
    S: PyClass<BaseType = PyMemoryResource>,
{
    let device = device_arg(device, "device")?;
    let mr = detached(py, move || make(device))?;
    Ok(PyMemoryResource::base(Arc::new(mr)).add_subclass(sub))
}

#[pymethods]
impl PyCudaMemoryResource {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<PyClassInitializer<Self>> {
        plain(py, CudaMemoryResource::new, device, Self)
    }
}

#[pymethods]
impl PyManagedMemoryResource {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<PyClassInitializer<Self>> {
        plain(py, ManagedMemoryResource::new, device, Self)
    }
}

#[pymethods]
impl PyPinnedHostMemoryResource {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<PyClassInitializer<Self>> {
        plain(py, PinnedHostMemoryResource::new, device, Self)
    }
}

// ---------------------------------------------------------------------------------------
// The current resource of each device.
//
// Keyed by (backend id, device) so that under a simulated device you get its resources
// and, once it is gone, the CUDA driver's again. The lock is held only for map operations:
// no Python code and no driver call runs under it (resources are made before, and
// replaced objects are dropped after).

type Registry = HashMap<(u64, i32), Py<PyMemoryResource>>;
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<Registry>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

// The registry as the C entry points (`capi`) see it, with no GIL: the core resource of
// each (backend id, device), written under the registry's lock (so in the same order as
// the registry) and read by the C entry points only when `GENERATION` has moved since
// they last looked (they keep what they read per thread). A device nobody has set or
// asked for from Python gets, from the C side, an initial resource of its own: the same
// driver pool as the one Python makes, which replaces it here when Python makes it.

type Snapshot = Vec<((u64, i32), ResourceRef)>;
static SNAPSHOT: RwLock<Snapshot> = RwLock::new(Vec::new());
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// A number that changes whenever the current resource of some device changes.
#[inline]
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Sets (`Some`) or forgets (`None`) the core resource of `key` in the snapshot; returns
/// what it replaced, for the caller to drop after its locks.
fn publish(key: (u64, i32), mr: Option<ResourceRef>) -> Option<ResourceRef> {
    let mut snap = SNAPSHOT.write().unwrap_or_else(|e| e.into_inner());
    let at = snap.iter().position(|(k, _)| *k == key);
    let replaced = match (at, mr) {
        (Some(i), Some(mr)) => Some(std::mem::replace(&mut snap[i].1, mr)),
        (Some(i), None) => Some(snap.swap_remove(i).1),
        (None, Some(mr)) => {
            snap.push((key, mr));
            None
        }
        (None, None) => None,
    };
    GENERATION.fetch_add(1, Ordering::AcqRel);
    replaced
}

/// The core resource of `device` of `backend` for the C entry points: the current one, or
/// the initial one (made here, outside every lock, when Python has not made it yet).
pub(crate) fn core_resource(backend: &BackendRef, device: i32) -> streampool::Result<ResourceRef> {
    let key = (backend.id(), device);
    let find = || {
        let snap = SNAPSHOT.read().unwrap_or_else(|e| e.into_inner());
        snap.iter().find(|(k, _)| *k == key).map(|(_, mr)| mr.clone())
    };
    if let Some(mr) = find() {
        return Ok(mr);
    }
    // Under `streampool profile`, the logging adaptor that Python's look-up finds too.
    let made: ResourceRef = match profiled_initial(backend, device)? {
        Some(profiled) => profiled.logged,
        None => Arc::new(CudaAsyncMemoryResource::on(backend.clone(), device, Default::default())?),
    };
    // Under the registry's lock, so that a resource Python sets meanwhile is not overwritten.
    let _reg = registry();
    if let Some(mr) = find() {
        return Ok(mr);
    }
    publish(key, Some(made.clone()));
    Ok(made)
}

fn current_placement(py: Python<'_>, device: Option<i32>) -> PyResult<(BackendRef, i32)> {
    // Once the backend exists, naming the current device waits for nothing (the driver
    // reads the thread's context): the GIL stays held, as on the allocation fast path.
    // Releasing it here made every buffer on the default resource hand the GIL round.
    if let Some(backend) = device::backend_ready() {
        let device = check_device(&backend, device).or_raise(py)?;
        return Ok((backend, device));
    }
    detached(py, move || {
        let backend = device::backend()?;
        let device = check_device(&backend, device)?;
        Ok((backend, device))
    })
}

fn resource_for(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyMemoryResource>> {
    let (backend, device) = current_placement(py, device)?;
    let key = (backend.id(), device);
    if let Some(mr) = registry().as_ref().and_then(|r| r.get(&key)) {
        return Ok(mr.clone_ref(py));
    }
    // Made outside the lock; if another thread wins the race, its resource is kept.
    let made = initial_resource(py, backend, device)?;
    let (mr, replaced) = {
        let mut reg = registry();
        let mr = reg.get_or_insert_with(HashMap::new).entry(key).or_insert(made).clone_ref(py);
        let replaced = publish(key, Some(mr.get().inner.clone()));
        (mr, replaced)
    };
    drop(replaced); // after the lock: it may be the last reference
    Ok(mr)
}

/// The initial resource of every device: the driver's pool (under `streampool profile`,
/// a `CudaAsyncMemoryResource` whose allocations go through the logging adaptor over it,
/// [`profiled_initial`], so that the program finds the class and the methods it would
/// find unprofiled).
fn initial_resource(py: Python<'_>, backend: BackendRef, device: i32) -> PyResult<Py<PyMemoryResource>> {
    let profiled = {
        let backend = backend.clone();
        detached(py, move || profiled_initial(&backend, device))?
    };
    if let Some(Profiled { pool, logged }) = profiled {
        let made = Bound::new(py, PyCudaAsyncMemoryResource::init_through(pool, logged))?;
        return Ok(made.into_super().unbind());
    }
    let made = detached(py, move || CudaAsyncMemoryResource::on(backend, device, Default::default()))?;
    let made = Bound::new(py, PyCudaAsyncMemoryResource::init(made))?;
    Ok(made.into_super().unbind())
}

// `streampool profile`'s log. Each device's initial resource is made, as the device is first
// used (from Python or from the C entry points, whichever comes first), as the driver's pool
// under a logging adaptor writing to the log (device N > 0 to `LOG.devN`): nothing touches
// the device at start-up, so a program that forks before its first use runs as it would
// unprofiled. Made natively, under a lock of its own and never with Python code, so that
// the C entry points, which run without the GIL, need none. The program's device is the one
// profiled (the driver, or the simulated device of STREAMPOOL_DEVICE=sim): a simulated
// device the program enters itself keeps its own resources, unlogged.
struct Profile {
    log: std::path::PathBuf,
    made: HashMap<i32, Profiled>,
}

/// A device's initial resource under `streampool profile`: the driver's pool, and the
/// logging adaptor over it through which it is used.
#[derive(Clone)]
struct Profiled {
    pool: Arc<CudaAsyncMemoryResource>,
    logged: ResourceRef,
}

static PROFILE: Mutex<Option<Profile>> = Mutex::new(None);
static PROFILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Under `streampool profile`, device `device`'s initial resource on `backend`: the driver's
/// pool and the logging adaptor over it, the same every time; `None` otherwise.
fn profiled_initial(backend: &BackendRef, device: i32) -> streampool::Result<Option<Profiled>> {
    // A forked child: its parent's lock may be held for ever by a thread the child has not
    // (the backend, made before the lock is taken, marks such a child).
    if !PROFILING.load(Ordering::Acquire) || device::forked() {
        return Ok(None);
    }
    // A simulated device the program enters itself (a dry run, a test fixture) is not the
    // program's device: its resources stay unlogged, and the program's device is logged.
    if device::active_sim().is_some_and(|sim| device::Backend::id(&*sim) == backend.id()) {
        return Ok(None);
    }
    let mut slot = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(profile) = slot.as_mut() else { return Ok(None) };
    if let Some(made) = profile.made.get(&device) {
        return Ok(Some(made.clone()));
    }
    let mut path = profile.log.clone().into_os_string();
    if device > 0 {
        path.push(format!(".dev{device}"));
    }
    let pool = Arc::new(CudaAsyncMemoryResource::on(backend.clone(), device, Default::default())?);
    let logged: ResourceRef = Arc::new(LoggingAdaptor::new(pool.clone(), vec![LogSink::File(path.into())])?);
    let made = Profiled { pool, logged };
    profile.made.insert(device, made.clone());
    Ok(Some(made))
}

/// Sets (a path) or clears (None) `streampool profile`'s log: from now on, each device's
/// initial resource, as the device is first used, is the driver's pool under a logging
/// adaptor writing there (device N > 0 to ``LOG.devN``). Resources made already stay. For
/// ``streampool profile``'s start-up hook; not a public API.
/// Cleared (None) in a forked child, it never waits: a thread of the parent may have held
/// the lock at the fork, and the state is then left as it is.
#[pyfunction]
pub(crate) fn _set_profile_log(log: Option<std::path::PathBuf>) {
    let Some(log) = log else {
        PROFILING.store(false, Ordering::Release);
        let previous = match PROFILE.try_lock() {
            Ok(mut slot) => slot.take(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        drop(previous); // after the lock: the adaptors may be the last references
        return;
    };
    let previous = {
        let mut slot = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
        PROFILING.store(true, Ordering::Release);
        slot.replace(Profile { log, made: HashMap::new() })
    };
    drop(previous);
}

fn set_resource(
    py: Python<'_>,
    device: Option<i32>,
    mr: &Bound<'_, PyMemoryResource>,
) -> PyResult<Option<Py<PyMemoryResource>>> {
    let (backend, device) = current_placement(py, device)?;
    // An imported IPC resource, or an adaptor over one: every allocation would fail.
    let mut below = Some(mr.clone().into_any());
    while let Some(resource) = below {
        if resource.is_instance_of::<crate::ipc::PyIpcImportedMemoryResource>() {
            return Err(PyValueError::new_err(format!(
                "{} cannot be the resource of a device: {} holds one buffer imported from another process \
                 and allocates nothing else. Keep the device's resource, and use the imported buffer \
                 (streampool.ipc.import_buffer) as it is",
                mr.repr()?,
                if resource.is(mr) { "it".to_owned() } else { format!("{} below it", resource.repr()?) }
            )));
        }
        below = resource.getattr_opt("upstream_mr")?;
    }
    let res = &mr.get().inner;
    if res.backend().id() != backend.id() || res.device() != device {
        return Err(PyValueError::new_err(format!(
            "{} belongs to device {} of {}; it cannot be the resource of device {device} of {}",
            mr.repr()?,
            res.device(),
            res.backend().describe(),
            backend.describe()
        )));
    }
    let key = (backend.id(), device);
    // Warned before the change (a warning made an error, `-W error`, then leaves the
    // resource as it was, as `reinitialize`'s does).
    let changes = SNAPSHOT
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|(k, old)| *k == key && !Arc::ptr_eq(old, res));
    if changes {
        warn_live_allocations(py, device, &mr.repr()?.to_string())?;
    }
    let (previous, replaced) = {
        let mut reg = registry();
        let previous = reg.get_or_insert_with(HashMap::new).insert(key, mr.clone().unbind());
        (previous, publish(key, Some(res.clone())))
    };
    drop(replaced); // after the lock: it may be the last reference
    match previous {
        Some(p) => Ok(Some(p)),
        // Nobody had asked yet: the previous resource was the initial one, not made yet.
        // Returned (made now) so that `old = set_...(new); ...; set_...(old)` restores;
        // None only when it cannot be made (a device without memory pools).
        None => Ok(initial_resource(py, backend, device).ok()),
    }
}

/// Warns where allocations made on `device` through the C entry points are live while
/// its resource changes to `next`: they would be freed through a resource that did not
/// make them.
fn warn_live_allocations(py: Python<'_>, device: i32, next: &str) -> PyResult<()> {
    let live = crate::capi::live::live_allocations(device);
    if live <= 0 {
        return Ok(());
    }
    let message = format!(
        "{live} allocation(s) made on device {device} through streampool's C entry points (PyTorch's \
         allocator, or ctypes) are live, and will be freed through {next}, which did not make them: \
         memory corruption where it accepts them. Free that memory first, or set the resource before \
         the library allocates"
    );
    let message = std::ffi::CString::new(message).expect("no NUL in the message");
    PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(), &message, 1)
}

/// Forgets the resources of a backend that is going away (a simulated device that is
/// deactivated), so they do not keep it alive.
pub(crate) fn forget_backend(backend_id: u64) {
    let removed: (Vec<Py<PyMemoryResource>>, Vec<ResourceRef>) = {
        let mut reg = registry();
        let snapshot_keys: Vec<_> = {
            let snap = SNAPSHOT.read().unwrap_or_else(|e| e.into_inner());
            snap.iter().map(|(k, _)| *k).filter(|(b, _)| *b == backend_id).collect()
        };
        let core = snapshot_keys.into_iter().filter_map(|k| publish(k, None)).collect();
        let map = reg.get_or_insert_with(HashMap::new);
        let keys: Vec<_> = map.keys().filter(|(b, _)| *b == backend_id).copied().collect();
        (keys.into_iter().filter_map(|k| map.remove(&k)).collect(), core)
    };
    drop(removed); // after the lock: dropping may run Python code
}

/// The resource of the current device (a `CudaAsyncMemoryResource` until one is set).
#[pyfunction]
pub(crate) fn get_current_device_resource(py: Python<'_>) -> PyResult<Py<PyMemoryResource>> {
    resource_for(py, None)
}

/// Makes `mr` the resource of the current device; returns the previous one (None only
/// when there was none and the initial one cannot be made).
///
/// Example::
///
///     pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
///     previous = mr.set_current_device_resource(pool)
///     buf = streampool.DeviceBuffer(size=1 << 20)  # from the pool
///     mr.set_current_device_resource(previous)
#[pyfunction]
pub(crate) fn set_current_device_resource(
    py: Python<'_>,
    mr: &Bound<'_, PyMemoryResource>,
) -> PyResult<Option<Py<PyMemoryResource>>> {
    set_resource(py, None, mr)
}

/// The resource of `device` (a `CudaAsyncMemoryResource` until one is set).
#[pyfunction]
pub(crate) fn get_per_device_resource(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
) -> PyResult<Py<PyMemoryResource>> {
    resource_for(py, Some(required_device(device)?))
}

/// Makes `mr` the resource of `device`; returns the previous one. `mr` must be bound to
/// that device of the current backend.
#[pyfunction]
pub(crate) fn set_per_device_resource(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    mr: &Bound<'_, PyMemoryResource>,
) -> PyResult<Option<Py<PyMemoryResource>>> {
    set_resource(py, Some(required_device(device)?), mr)
}

/// Forgets the resource of every device of the current backend, so that each goes back
/// to its initial resource (what `reinitialize` does first, as RMM's). The resources are
/// dropped after the lock is released.
#[pyfunction]
pub(crate) fn _reset_device_resources(py: Python<'_>) -> PyResult<()> {
    let backend = detached(py, device::backend)?;
    for device in 0..detached(py, || backend.device_count())? {
        warn_live_allocations(py, device, "its initial resource")?;
    }
    forget_backend(backend.id());
    Ok(())
}

/// `(free, total)` bytes of `device`'s memory (the current device when None), as the
/// driver reports them (`cuMemGetInfo`): RMM's `available_device_memory()`.
///
/// Example::
///
///     free, total = mr.available_device_memory()
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn available_device_memory(
    py: Python<'_>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(usize, usize)> {
    let device = device_arg(device, "device")?;
    detached(py, move || {
        let backend = device::backend()?;
        let device = check_device(&backend, device)?;
        backend.mem_get_info(device)
    })
}

/// The current device of the current backend.
#[pyfunction]
pub(crate) fn get_current_device(py: Python<'_>) -> PyResult<i32> {
    detached(py, || device::backend()?.current_device())
}
