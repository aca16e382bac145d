//! The driver's stream-ordered pool (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`).

use std::fmt;

use crate::device::{BackendRef, DevPtr, PoolAttr, PoolProps, RawPool};
use crate::error::{Error, Result};
use crate::resource::{out_of_memory, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// Options that make [`CudaAsyncMemoryResource`] create a pool of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AsyncPoolOptions {
    /// Bytes to reserve up front (allocated and freed once at creation).
    pub initial_pool_size: Option<usize>,
    /// Bytes the pool keeps at a synchronisation; default: all of them (`u64::MAX`).
    pub release_threshold: Option<usize>,
    /// Allow exporting the pool's memory to other processes (POSIX file descriptors).
    pub enable_ipc: bool,
}

impl AsyncPoolOptions {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// The recommended default resource: the CUDA driver's stream-ordered pool (RMM's
/// `cuda_async_memory_resource`).
///
/// * With no options it allocates from the device's *current* pool, so its memory is
///   shared with every library that uses the driver's pool (PyTorch's and CuPy's async
///   backends, cuDF through RMM's async resource). When that pool is the device's
///   default pool, its release threshold is raised to the maximum: the default of 0
///   hands all free memory back to the system at every synchronisation, which makes the
///   next allocations slow. A current pool that someone else has set is never changed.
/// * With options it creates and owns a pool (release threshold: the maximum unless
///   given; `initial_pool_size` primes it; `enable_ipc` makes it exportable), destroyed
///   with the resource.
/// * [`CudaAsyncMemoryResource::view`] allocates from a pool someone else owns (RMM's
///   `cuda_async_view_memory_resource`) and never destroys it.
///
/// On out-of-memory it synchronises the allocating stream once (so frees still in
/// flight on it return to the pool) and retries before failing.
///
/// ```no_run
/// use streampool::{CudaAsyncMemoryResource, MemoryResource, Stream};
/// let mr = CudaAsyncMemoryResource::new(None, Default::default())?;
/// let stream = Stream::legacy();
/// let ptr = mr.allocate(1 << 20, &stream)?;
/// mr.deallocate(ptr, 1 << 20, &stream)?;
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct CudaAsyncMemoryResource {
    backend: BackendRef,
    device: i32,
    pool: RawPool,
    owns_pool: bool,
    name: &'static str,
}

impl CudaAsyncMemoryResource {
    /// On the current backend and `device` (the current device when `None`).
    pub fn new(device: Option<i32>, options: AsyncPoolOptions) -> Result<Self> {
        let (backend, device) = super::bind(device)?;
        Self::on(backend, device, options)
    }

    /// On a given backend and device.
    pub fn on(backend: BackendRef, device: i32, options: AsyncPoolOptions) -> Result<Self> {
        let info = backend.device_info(device)?;
        if !info.memory_pools {
            return Err(Error::Unsupported(format!(
                "device {device} ({}) does not support the driver's memory pools; use CudaMemoryResource",
                info.name
            )));
        }
        if options.is_default() {
            let pool = backend.pool_current(device, false)?;
            if pool == backend.pool_default(device, false)? {
                backend.pool_set_attr(device, pool, PoolAttr::ReleaseThreshold, u64::MAX)?;
            }
            return Ok(Self { backend, device, pool, owns_pool: false, name: "CudaAsyncMemoryResource" });
        }
        if options.enable_ipc && !info.posix_fd_ipc {
            return Err(Error::Unsupported(format!(
                "device {device} ({}) cannot export pool memory through POSIX file descriptors",
                info.name
            )));
        }
        let props = PoolProps { posix_fd_ipc: options.enable_ipc, managed: false };
        let pool = backend.pool_create(device, &props)?;
        let mr = Self { backend, device, pool, owns_pool: true, name: "CudaAsyncMemoryResource" };
        let threshold = options.release_threshold.map_or(u64::MAX, |t| t as u64);
        mr.backend.pool_set_attr(device, pool, PoolAttr::ReleaseThreshold, threshold)?;
        if let Some(init) = options.initial_pool_size.filter(|&n| n > 0) {
            let stream = Stream::legacy();
            let ptr = mr.allocate(init, &stream)?;
            mr.deallocate(ptr, init, &stream)?;
            mr.backend.stream_synchronize(device, stream.handle())?;
        }
        Ok(mr)
    }

    /// A resource over a pool someone else owns (RMM's `cuda_async_view_memory_resource`);
    /// the pool is checked to be valid and is never destroyed here.
    pub fn view(backend: BackendRef, device: i32, pool: RawPool) -> Result<Self> {
        if pool == 0 {
            return Err(Error::invalid("pool handle 0 (null) is not a memory pool"));
        }
        backend.pool_get_attr(device, pool, PoolAttr::ReleaseThreshold).map_err(|e| {
            Error::invalid(format!("{pool:#x} is not a valid memory pool handle on device {device} ({e})"))
        })?;
        Ok(Self { backend, device, pool, owns_pool: false, name: "CudaAsyncViewMemoryResource" })
    }

    /// The driver pool handle (`CUmemoryPool` as an integer).
    pub fn pool_handle(&self) -> RawPool {
        self.pool
    }

    /// True when this resource created the pool and destroys it when dropped.
    pub fn owns_pool(&self) -> bool {
        self.owns_pool
    }

    /// Bytes the pool holds from the system (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_bytes(&self) -> Result<usize> {
        self.attr(PoolAttr::ReservedMemCurrent)
    }

    /// Bytes handed out by the pool (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`); for a shared
    /// pool this includes other libraries' allocations.
    pub fn used_bytes(&self) -> Result<usize> {
        self.attr(PoolAttr::UsedMemCurrent)
    }

    /// The pool's release threshold in bytes.
    pub fn release_threshold(&self) -> Result<u64> {
        self.backend.pool_get_attr(self.device, self.pool, PoolAttr::ReleaseThreshold)
    }

    /// Releases free memory back to the system until the pool holds at most `keep_bytes`
    /// (`cuMemPoolTrimTo`), so that allocators that do not use the pool (cuBLAS
    /// workspaces, NCCL, plain `cudaMalloc` users) can have it.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        self.backend.pool_trim_to(self.device, self.pool, keep_bytes)
    }

    fn attr(&self, attr: PoolAttr) -> Result<usize> {
        let v = self.backend.pool_get_attr(self.device, self.pool, attr)?;
        Ok(usize::try_from(v).unwrap_or(usize::MAX))
    }
}

impl MemoryResource for CudaAsyncMemoryResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        self.name
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let (b, dev, s) = (&self.backend, self.device, stream.handle());
        match b.pool_alloc_async(dev, self.pool, bytes, s) {
            Err(e) if e.is_out_of_memory() => {
                // Frees still in flight on this stream return to the pool once it drains.
                b.stream_synchronize(dev, s)?;
                b.pool_alloc_async(dev, self.pool, bytes, s).map_err(|e| out_of_memory(e, bytes, self))
            }
            r => r,
        }
    }

    fn do_deallocate(&self, ptr: DevPtr, _bytes: usize, stream: &Stream) -> Result<()> {
        self.backend.free_async(self.device, ptr, stream.handle())
    }
}

impl Drop for CudaAsyncMemoryResource {
    fn drop(&mut self) {
        if self.owns_pool {
            // Outstanding allocations keep the pool's memory until they are freed (the
            // driver's rule); a failure at process exit has nobody to report to.
            let _ = self.backend.pool_destroy(self.device, self.pool);
        }
    }
}

impl fmt::Debug for CudaAsyncMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(device={}, pool={:#x}, owns_pool={}, {})",
            self.name,
            self.device,
            self.pool,
            self.owns_pool,
            self.backend.describe()
        )
    }
}
