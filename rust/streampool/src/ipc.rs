//! Sharing device memory with another process: RMM's IPC through the driver's pools.
//!
//! The exporting process allocates from a pool made for it
//! ([`CudaAsyncMemoryResource`](crate::CudaAsyncMemoryResource) with
//! [`AsyncPoolOptions::enable_ipc`](crate::AsyncPoolOptions::enable_ipc)) and calls
//! [`export`]: the pool's POSIX file descriptor and 64 bytes that name the allocation
//! (`cuMemPoolExportToShareableHandle`, `cuMemPoolExportPointer`). The descriptor travels
//! to the other process over a Unix socket (`SCM_RIGHTS`); there
//! [`IpcImportedMemoryResource::import`] imports the pool and the allocation
//! (`cuMemPoolImportFromShareableHandle`, `cuMemPoolImportPointer`), at another address.
//!
//! The driver's rules, and how this module keeps them:
//!
//! * Only memory of a pool created with POSIX file-descriptor handles can be shared, and
//!   only whole allocations: anything else is refused by [`export`] naming the fix.
//! * The importer must not touch the memory before its allocation has completed in the
//!   exporter: [`export`] synchronises the buffer's stream first, so the allocation and
//!   every write enqueued before the export are complete when the handle exists.
//! * The importer frees its pointer (after a device synchronisation: `cuMemFree` of pool
//!   memory does not wait for the work on it) before the exporter frees the allocation; the exporter keeps the memory alive until the
//!   importer says it is done (a message over the same socket, in the examples). Imports
//!   are refused when the exporting process has already exited.
//! * A pool is imported in another process: importing into the exporting process is
//!   refused (use the memory directly there).

use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::device::{BackendRef, DevPtr, PtrExportData, RawPool, PTR_EXPORT_DATA_BYTES};
use crate::error::{record_if_failed, Error, Result};
use crate::resource::{MemoryKind, MemoryResource};
use crate::stream::Stream;
use crate::sync::{lock, Mutex, MutexGuard};

/// What the Python API names as the fix for memory that cannot be shared.
const FIX: &str = "allocate it from CudaAsyncMemoryResource(enable_ipc=True), a pool of its own made for \
                   sharing (not through a suballocating resource such as a pool or binning resource)";

/// One exported allocation: everything another process needs to import it.
#[derive(Debug)]
pub struct IpcExport {
    /// The pool's descriptor, owned: send it (`SCM_RIGHTS`), then close it.
    pub fd: OwnedFd,
    /// `CUmemPoolPtrExportData`: names the allocation within the pool.
    pub data: PtrExportData,
    /// Bytes shared (the buffer's size).
    pub bytes: usize,
    /// The device ordinal the memory lives on, in the exporting process.
    pub device: i32,
    /// The exporting process.
    pub pid: u32,
}

/// The imported memory's resource, as it names itself (and as an export refuses it).
const IMPORTED_NAME: &str = "IpcImportedMemoryResource";

fn not_shareable(ptr: DevPtr, why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("the memory at {ptr:#x} cannot be shared with another process ({why}); {FIX}"))
}

/// Exports `bytes` bytes at `ptr` (the start of an allocation of an exportable pool on
/// `device`, of at least `bytes` bytes), after synchronising `stream`, the stream the
/// memory is used on (of `backend` and `device`): the allocation and every write enqueued
/// on it before the call are complete when this returns, as the importer needs.
pub fn export(
    backend: &BackendRef,
    device: i32,
    ptr: DevPtr,
    bytes: usize,
    stream: &Stream,
) -> Result<IpcExport> {
    if ptr == 0 || bytes == 0 {
        return Err(Error::invalid("an empty buffer (0 bytes) has no memory to share with another process"));
    }
    stream.check(backend, device)?;
    let pool = match backend.pointer_pool(device, ptr) {
        Ok(Some(pool)) => pool,
        Ok(None) => return Err(not_shareable(ptr, "it does not come from a memory pool")),
        Err(e) => return Err(not_shareable(ptr, e)),
    };
    // As `Stream::synchronize` does it: for another thread's per-thread default stream
    // through an event on the legacy stream, which covers the owner's work.
    stream.synchronize(backend, device)?;
    let fd = backend.pool_export_fd(device, pool).map_err(|e| not_shareable(ptr, e))?;
    let data = backend.pool_export_pointer(device, ptr).map_err(|e| not_shareable(ptr, e))?;
    // The importer maps `bytes` bytes: no more than the allocation has.
    let (_, size) = backend.pointer_range(device, ptr).map_err(|e| not_shareable(ptr, e))?;
    if bytes > size {
        return Err(Error::invalid(format!(
            "cannot share {bytes} bytes at {ptr:#x}: its allocation is {size} bytes"
        )));
    }
    Ok(IpcExport { fd, data, bytes, device, pid: std::process::id() })
}

/// [`export`] of an allocation of `resource` (`bytes` bytes at `ptr`, used on `stream`),
/// refused unless the resource hands out whole allocations of the driver
/// ([`MemoryResource::whole_allocations`]): a piece of a pool's or a binning resource's
/// larger allocation would share that whole allocation, and its other pieces with it, for
/// as long as the importer holds it, and the piece's start may or may not be the
/// allocation's start (so an export would work for some pieces and not others).
pub fn export_from(
    resource: &dyn MemoryResource,
    ptr: DevPtr,
    bytes: usize,
    stream: &Stream,
) -> Result<IpcExport> {
    if ptr != 0 && bytes != 0 && resource.name() == IMPORTED_NAME {
        return Err(Error::invalid(format!(
            "the memory at {ptr:#x} was imported from another process and cannot be exported again: \
             pass its handle on instead (a copy of it, copy.copy(handle), for each further process)"
        )));
    }
    if ptr != 0 && bytes != 0 && !resource.whole_allocations() {
        return Err(not_shareable(
            ptr,
            format!(
                "{} may hand out pieces of larger allocations, which cannot be shared: it, or a resource \
                 under it, suballocates (a pool, a binning or arena resource) or cannot say that it does \
                 not (a CallbackMemoryResource); export memory allocated by the IPC pool's \
                 CudaAsyncMemoryResource, directly or through adaptors that pass allocations through",
                resource.name()
            ),
        ));
    }
    export(resource.backend(), resource.device(), ptr, bytes, stream)
}

/// Whether process `pid` is still running (a process of another user counts). One that
/// has exited but that its parent has not yet waited for (a zombie, as an exporter is
/// between its exit and its parent's `join()`) has exited: its memory is gone with it.
fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    // The state follows the command name in /proc/PID/stat, which may itself hold spaces
    // and parentheses: it is the field after the last ')'. Unreadable: taken as running.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat_state(&stat), Some('Z' | 'X' | 'x')),
        Err(_) => true,
    }
}

/// The state letter of a /proc/PID/stat line.
fn stat_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The memory another process exported, imported into this one: a resource that hands out
/// that one allocation (once, to the buffer made over it) and frees it with `cuMemFree`
/// when the buffer lets go of it, then releases the imported pool when dropped.
///
/// Python's `streampool.ipc.import_buffer` makes one and a `DeviceBuffer` over it.
pub struct IpcImportedMemoryResource {
    backend: BackendRef,
    device: i32,
    pool: RawPool,
    ptr: DevPtr,
    bytes: usize,
    /// (handed out, freed).
    state: Mutex<(bool, bool)>,
}

impl IpcImportedMemoryResource {
    /// Imports the allocation that `data` names in the pool that `fd` names (both from an
    /// [`IpcExport`] of process `exporter_pid`), `bytes` bytes of it, on `device`.
    ///
    /// Refused, naming the cause: data that is not 64 bytes, 0 bytes, a handle of this
    /// process, an exporter that has exited, more bytes than the exported allocation holds,
    /// and whatever the driver refuses (a descriptor that names no exported pool, data of
    /// another pool).
    pub fn import(
        backend: BackendRef,
        device: i32,
        fd: BorrowedFd<'_>,
        data: &[u8],
        bytes: usize,
        exporter_pid: u32,
    ) -> Result<Self> {
        let data: &PtrExportData = data.try_into().map_err(|_| {
            Error::invalid(format!(
                "export_data must be the {PTR_EXPORT_DATA_BYTES} bytes of CUmemPoolPtrExportData that \
                 streampool.ipc.export made, got {} bytes",
                data.len()
            ))
        })?;
        if bytes == 0 {
            return Err(Error::invalid("nbytes must be at least 1: an exported buffer is never empty"));
        }
        if exporter_pid == std::process::id() {
            return Err(Error::invalid(
                "this handle was exported by this process, and the driver imports a pool only in another \
                 process: use the exported buffer itself here",
            ));
        }
        if !process_exists(exporter_pid) {
            return Err(Error::invalid(format!(
                "the exporting process (pid {exporter_pid}) has exited, and its memory with it: the exporter \
                 must keep the buffer alive until every importer has freed its import"
            )));
        }
        let pool = hold_imported_pool(&backend, device, fd)?;
        let ptr = match backend.pool_import_pointer(device, pool, data) {
            Ok(ptr) => ptr,
            Err(e) => {
                release_imported_pool(&backend, device, pool, " after a failed import");
                return Err(e);
            }
        };
        // From here on, dropping `imported` frees the import and releases the pool.
        let imported = Self { backend, device, pool, ptr, bytes, state: Mutex::new((false, false)) };
        let (base, len) = imported.backend.pointer_range(device, ptr)?;
        let holds = (base + len as DevPtr).saturating_sub(ptr);
        if bytes as DevPtr > holds {
            return Err(Error::invalid(format!(
                "the handle says {bytes} bytes, but the exported allocation holds {holds}: send the \
                 handle that streampool.ipc.export made, unchanged"
            )));
        }
        Ok(imported)
    }

    /// The imported memory's address in this process.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// Bytes imported.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn state(&self) -> MutexGuard<'_, (bool, bool)> {
        lock(&self.state)
    }
}

impl fmt::Debug for IpcImportedMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (handed_out, freed) = *self.state();
        let state = match (handed_out, freed) {
            (_, true) => "freed",
            (true, false) => "in use",
            (false, false) => "not yet handed out",
        };
        write!(
            f,
            "IpcImportedMemoryResource(device={}, ptr={:#x}, bytes={}, pool={:#x}, {state}, {})",
            self.device,
            self.ptr,
            self.bytes,
            self.pool,
            self.backend.describe()
        )
    }
}

impl MemoryResource for IpcImportedMemoryResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        IMPORTED_NAME
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    fn do_allocate(&self, bytes: usize, _stream: &Stream) -> Result<DevPtr> {
        let mut state = self.state();
        if state.0 {
            return Err(Error::invalid(format!(
                "IpcImportedMemoryResource holds one imported buffer of {} bytes, already handed out: it \
                 cannot allocate; copy the data into a buffer of another resource instead",
                self.bytes
            )));
        }
        if bytes != self.bytes {
            return Err(Error::invalid(format!(
                "IpcImportedMemoryResource holds one imported buffer of {} bytes, which is all it can hand \
                 out: {bytes} bytes were asked for",
                self.bytes
            )));
        }
        state.0 = true;
        Ok(self.ptr)
    }

    fn do_deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: &Stream) -> Result<()> {
        let mut state = self.state();
        if ptr != self.ptr || !state.0 || state.1 {
            return Err(Error::InvalidPointer(format!(
                "{ptr:#x} is not the live imported buffer of this IpcImportedMemoryResource"
            )));
        }
        // `cuMemFree` of pool memory does not wait for the work on it, and the exporter
        // may free and reuse the memory as soon as this returns: every use of it in this
        // process completes first. On a backend that is gone (a simulated device since
        // closed) there is no work left to wait for, and the free succeeds silently, as
        // every resource's does there.
        if self.backend.check_open().is_ok() {
            self.backend.ctx_synchronize(self.device)?;
        }
        self.backend.mem_free(self.device, ptr)?;
        state.1 = true;
        Ok(())
    }
}

impl Drop for IpcImportedMemoryResource {
    fn drop(&mut self) {
        let (device, ptr, pool) = (self.device, self.ptr, self.pool);
        if !self.state().1 {
            let what = || format!("freeing the imported memory at {ptr:#x}");
            // As in `do_deallocate`: the driver does not wait for the work on it.
            crate::error::synchronize_on_drop(&self.backend, device, what);
            record_if_failed(what, self.backend.mem_free(device, ptr));
        }
        release_imported_pool(&self.backend, device, pool, "");
    }
}

/// The imports of each imported pool alive in this process, by backend, device and pool
/// handle. The driver gives a pool imported again in a process the same handle (seen with
/// driver 580 on an H100), and one `cuMemPoolDestroy` releases it for every import: the
/// last import to go destroys it.
fn imported_pools() -> std::sync::MutexGuard<'static, ImportCounts> {
    static POOLS: std::sync::OnceLock<std::sync::Mutex<ImportCounts>> = std::sync::OnceLock::new();
    POOLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Imports alive, by (backend id, device, pool handle).
type ImportCounts = std::collections::HashMap<(u64, i32, RawPool), usize>;

/// Imports the pool `fd` names on `device` and counts this import of it. Under the count's
/// lock, so that the last import of the same pool cannot destroy it between the driver's
/// answer and the count.
fn hold_imported_pool(backend: &BackendRef, device: i32, fd: BorrowedFd<'_>) -> Result<RawPool> {
    let mut pools = imported_pools();
    let pool = backend.pool_import_fd(device, fd)?;
    *pools.entry((backend.id(), device, pool)).or_insert(0) += 1;
    Ok(pool)
}

/// Ends one import of `pool`; the last one destroys it (`when`, appended to the record of
/// a failure, says when: "" or " after a failed import").
fn release_imported_pool(backend: &BackendRef, device: i32, pool: RawPool, when: &str) {
    let mut pools = imported_pools();
    let key = (backend.id(), device, pool);
    let left = pools.get_mut(&key).map(|n| {
        *n -= 1;
        *n
    });
    if left.unwrap_or(0) == 0 {
        pools.remove(&key);
        record_if_failed(
            || format!("releasing the imported pool {pool:#x} of device {device}{when}"),
            backend.pool_destroy(device, pool),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{process_exists, stat_state};

    #[test]
    fn the_state_is_read_after_the_command_name() {
        assert_eq!(stat_state("42 (python3) S 1 42 42 0"), Some('S'));
        assert_eq!(stat_state("42 (a) b) Z) Z 1 42"), Some('Z'));
        assert_eq!(stat_state("42 (no state)"), None);
        assert_eq!(stat_state("garbage"), None);
    }

    #[test]
    fn an_exited_process_not_yet_waited_for_has_exited() {
        assert!(process_exists(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().expect("spawn `true`");
        // Until it is waited for, the exited child stays a zombie: kill(pid, 0) succeeds.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while process_exists(child.id()) {
            assert!(std::time::Instant::now() < deadline, "`true` still running after 30 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).expect("a zombie's stat");
        assert_eq!(stat_state(&stat), Some('Z'));
        child.wait().expect("reap");
        assert!(!process_exists(child.id()));
    }
}
