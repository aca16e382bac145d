//! A simulated device whose stream synchronisations (as one does for a borrowed stream
//! that its owner destroys meanwhile), waits on events and device synchronisations fail
//! on demand: everything else is the device's.
//! Included by the test binaries that use it (`#[path]`), not by `common`.

#![allow(dead_code)]
// Each unsafe call passes its caller's arguments on to the simulated device unchanged:
// the caller's contract is the device's.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::CStr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::*;
use streampool::{Error, Result};

#[derive(Debug)]
pub struct FailingSyncs {
    pub inner: Arc<SimDevice>,
    /// Every stream synchronisation fails while set.
    pub fail_stream_syncs: AtomicBool,
    /// The next this many `cuStreamWaitEvent` fail.
    pub fail_waits: AtomicUsize,
    /// The next this many `cuCtxSynchronize` fail.
    pub fail_ctx_syncs: AtomicUsize,
}

impl FailingSyncs {
    pub fn new(inner: Arc<SimDevice>) -> Arc<Self> {
        Arc::new(FailingSyncs {
            inner,
            fail_stream_syncs: false.into(),
            fail_waits: 0.into(),
            fail_ctx_syncs: 0.into(),
        })
    }
}

/// Whether the next call of a kind counted by `n` fails (counting it down).
fn fails(n: &AtomicUsize) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |k| k.checked_sub(1)).is_ok()
}

fn injected(call: &'static str) -> Error {
    Error::Driver { call, code: 999, name: "CUDA_ERROR_INJECTED".into(), context: "a test's failure".into() }
}

impl Backend for FailingSyncs {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn check_open(&self) -> Result<()> {
        self.inner.check_open()
    }
    fn driver_version(&self) -> Result<i32> {
        self.inner.driver_version()
    }
    fn device_count(&self) -> Result<i32> {
        self.inner.device_count()
    }
    fn current_device(&self) -> Result<i32> {
        self.inner.current_device()
    }
    fn device_info(&self, dev: i32) -> Result<DeviceInfo> {
        self.inner.device_info(dev)
    }
    fn mem_get_info(&self, dev: i32) -> Result<(usize, usize)> {
        self.inner.mem_get_info(dev)
    }
    fn mem_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.inner.mem_alloc(dev, bytes)
    }
    fn mem_free(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        self.inner.mem_free(dev, ptr)
    }
    fn mem_alloc_managed(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.inner.mem_alloc_managed(dev, bytes)
    }
    fn mem_host_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.inner.mem_host_alloc(dev, bytes)
    }
    fn mem_free_host(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        self.inner.mem_free_host(dev, ptr)
    }
    fn pool_default(&self, dev: i32, managed: bool) -> Result<RawPool> {
        self.inner.pool_default(dev, managed)
    }
    fn pool_current(&self, dev: i32, managed: bool) -> Result<RawPool> {
        self.inner.pool_current(dev, managed)
    }
    fn pool_set_current(&self, dev: i32, pool: RawPool) -> Result<()> {
        self.inner.pool_set_current(dev, pool)
    }
    fn pool_create(&self, dev: i32, props: &PoolProps) -> Result<RawPool> {
        self.inner.pool_create(dev, props)
    }
    fn pool_destroy(&self, dev: i32, pool: RawPool) -> Result<()> {
        self.inner.pool_destroy(dev, pool)
    }
    fn pool_get_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr) -> Result<u64> {
        self.inner.pool_get_attr(dev, pool, attr)
    }
    fn pool_set_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr, value: u64) -> Result<()> {
        self.inner.pool_set_attr(dev, pool, attr, value)
    }
    fn pool_trim_to(&self, dev: i32, pool: RawPool, keep_bytes: usize) -> Result<()> {
        self.inner.pool_trim_to(dev, pool, keep_bytes)
    }
    fn pool_alloc_async(&self, dev: i32, pool: RawPool, bytes: usize, stream: RawStream) -> Result<DevPtr> {
        self.inner.pool_alloc_async(dev, pool, bytes, stream)
    }
    fn free_async(&self, dev: i32, ptr: DevPtr, stream: RawStream) -> Result<()> {
        self.inner.free_async(dev, ptr, stream)
    }
    fn vmm_granularity(&self, dev: i32) -> Result<usize> {
        self.inner.vmm_granularity(dev)
    }
    fn vmm_reserve(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.inner.vmm_reserve(dev, bytes)
    }
    fn vmm_free(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.inner.vmm_free(dev, ptr, bytes)
    }
    fn vmm_map(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<RawVmm> {
        self.inner.vmm_map(dev, ptr, bytes)
    }
    fn vmm_unmap(&self, dev: i32, ptr: DevPtr, bytes: usize, handle: RawVmm) -> Result<()> {
        self.inner.vmm_unmap(dev, ptr, bytes, handle)
    }
    fn pointer_pool(&self, dev: i32, ptr: DevPtr) -> Result<Option<RawPool>> {
        self.inner.pointer_pool(dev, ptr)
    }
    fn pointer_range(&self, dev: i32, ptr: DevPtr) -> Result<(DevPtr, usize)> {
        self.inner.pointer_range(dev, ptr)
    }
    fn pointer_device(&self, dev: i32, ptr: DevPtr) -> Result<i32> {
        self.inner.pointer_device(dev, ptr)
    }
    fn stream_create(&self, dev: i32, blocking: bool) -> Result<RawStream> {
        self.inner.stream_create(dev, blocking)
    }
    fn stream_destroy(&self, dev: i32, stream: RawStream) -> Result<()> {
        self.inner.stream_destroy(dev, stream)
    }
    fn stream_id(&self, dev: i32, stream: RawStream) -> Result<u64> {
        self.inner.stream_id(dev, stream)
    }
    fn stream_device(&self, stream: RawStream) -> Result<i32> {
        self.inner.stream_device(stream)
    }
    fn stream_vouched(&self, stream: RawStream) {
        self.inner.stream_vouched(stream)
    }
    fn stream_destroyed(&self, stream: RawStream) -> bool {
        self.inner.stream_destroyed(stream)
    }
    fn stream_synchronize(&self, dev: i32, stream: RawStream) -> Result<()> {
        if self.fail_stream_syncs.load(Ordering::SeqCst) {
            return Err(Error::InvalidStream(format!("stream {stream:#x} was destroyed meanwhile")));
        }
        self.inner.stream_synchronize(dev, stream)
    }
    fn stream_query(&self, dev: i32, stream: RawStream) -> Result<bool> {
        self.inner.stream_query(dev, stream)
    }
    fn stream_capturing(&self, dev: i32, stream: RawStream) -> Result<bool> {
        self.inner.stream_capturing(dev, stream)
    }
    fn exchange_capture_mode(&self, relaxed: bool, previous: u32) -> Result<u32> {
        self.inner.exchange_capture_mode(relaxed, previous)
    }
    fn stream_wait_event(&self, dev: i32, stream: RawStream, event: RawEvent) -> Result<()> {
        if fails(&self.fail_waits) {
            return Err(injected("cuStreamWaitEvent"));
        }
        self.inner.stream_wait_event(dev, stream, event)
    }
    fn event_create(&self, dev: i32) -> Result<RawEvent> {
        self.inner.event_create(dev)
    }
    fn event_destroy(&self, dev: i32, event: RawEvent) -> Result<()> {
        self.inner.event_destroy(dev, event)
    }
    fn event_record(&self, dev: i32, event: RawEvent, stream: RawStream) -> Result<()> {
        self.inner.event_record(dev, event, stream)
    }
    fn event_query(&self, dev: i32, event: RawEvent) -> Result<bool> {
        self.inner.event_query(dev, event)
    }
    fn event_synchronize(&self, dev: i32, event: RawEvent) -> Result<()> {
        self.inner.event_synchronize(dev, event)
    }
    fn memset_d8_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.inner.memset_d8_async(dev, ptr, value, bytes, stream)
    }
    unsafe fn memcpy_async(
        &self,
        dev: i32,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        unsafe { self.inner.memcpy_async(dev, dst, src, bytes, stream) }
    }
    fn prefetch_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        to: Location,
        stream: RawStream,
    ) -> Result<()> {
        self.inner.prefetch_async(dev, ptr, bytes, to, stream)
    }
    fn mem_advise(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        advice: Advice,
        location: Location,
    ) -> Result<()> {
        self.inner.mem_advise(dev, ptr, bytes, advice, location)
    }
    fn mem_range_last_prefetch_location(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
    ) -> Result<Option<Location>> {
        self.inner.mem_range_last_prefetch_location(dev, ptr, bytes)
    }
    fn ctx_synchronize(&self, dev: i32) -> Result<()> {
        if fails(&self.fail_ctx_syncs) {
            return Err(injected("cuCtxSynchronize"));
        }
        self.inner.ctx_synchronize(dev)
    }
    fn pool_export_fd(&self, dev: i32, pool: RawPool) -> Result<OwnedFd> {
        self.inner.pool_export_fd(dev, pool)
    }
    fn pool_import_fd(&self, dev: i32, fd: BorrowedFd<'_>) -> Result<RawPool> {
        self.inner.pool_import_fd(dev, fd)
    }
    fn pool_export_pointer(&self, dev: i32, ptr: DevPtr) -> Result<PtrExportData> {
        self.inner.pool_export_pointer(dev, ptr)
    }
    fn pool_import_pointer(&self, dev: i32, pool: RawPool, data: &PtrExportData) -> Result<DevPtr> {
        self.inner.pool_import_pointer(dev, pool, data)
    }
    fn module_load_data(&self, dev: i32, image: &CStr) -> Result<RawModule> {
        self.inner.module_load_data(dev, image)
    }
    fn module_get_function(&self, dev: i32, module: RawModule, name: &CStr) -> Result<RawFunction> {
        self.inner.module_get_function(dev, module, name)
    }
    unsafe fn launch_kernel(
        &self,
        dev: i32,
        function: RawFunction,
        grid: u32,
        block: u32,
        params: &[u64],
        stream: RawStream,
    ) -> Result<()> {
        unsafe { self.inner.launch_kernel(dev, function, grid, block, params, stream) }
    }
    fn device_can_access_peer(&self, dev: i32, peer: i32) -> Result<bool> {
        self.inner.device_can_access_peer(dev, peer)
    }
    fn ctx_enable_peer_access(&self, dev: i32, peer: i32) -> Result<()> {
        self.inner.ctx_enable_peer_access(dev, peer)
    }
    fn pool_set_access(&self, dev: i32, pool: RawPool, accessor: i32, enabled: bool) -> Result<()> {
        self.inner.pool_set_access(dev, pool, accessor, enabled)
    }
    fn pool_get_access(&self, dev: i32, pool: RawPool, accessor: i32) -> Result<bool> {
        self.inner.pool_get_access(dev, pool, accessor)
    }
    unsafe fn memcpy_peer_async(
        &self,
        dev: i32,
        dst: DevPtr,
        dst_dev: i32,
        src: DevPtr,
        src_dev: i32,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        unsafe { self.inner.memcpy_peer_async(dev, dst, dst_dev, src, src_dev, bytes, stream) }
    }
}
