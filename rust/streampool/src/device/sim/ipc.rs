//! Sharing a pool's memory with another process, as the driver does with POSIX file
//! descriptors (`cuMemPoolExportToShareableHandle` and the calls after it).
//!
//! A pool created with `posix_fd_ipc` keeps its chunks in one shared-memory file (an
//! [`Arena`]: `memfd_create`), each chunk mapped shared at its own offset. Exporting the
//! pool hands out a duplicate of that file's descriptor; another process (its own
//! simulated device) imports it, and each exported allocation is named by its offset in
//! the file and its size ([`PtrExportData`]). Importing an allocation maps that range of
//! the file, so both processes see the same bytes at different addresses, as on the
//! driver. The first chunk-sized slot of the file holds a header (a magic string, the
//! pool's identity, the exporting process and device), which is how an import recognises
//! the file and refuses a descriptor or export data that is not a simulated pool's.
//!
//! Released chunks are cut out of the file (`fallocate` punching a hole), and their
//! offsets are never reused: an importer that still maps one (a program that freed the
//! exported memory before the importer did, against the driver's rule) keeps a harmless
//! private range rather than seeing memory handed out again.
//!
//! What the model does not see: the exporter's frees. Data that names an allocation the
//! exporter has freed still imports (the driver may refuse it); the rule that the
//! importer frees first is the program's to keep.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::memory::{invalid_value, round_up, Alloc, AllocKind, HostBlock, ALIGN};
use super::pool::CHUNK;
use super::{host_refused, State};
use crate::device::{DevPtr, PtrExportData, RawPool, PTR_EXPORT_DATA_BYTES};
use crate::error::{Error, Result};

/// Starts the file's header and every export data.
const MAGIC: &[u8; 16] = b"streampool-simip";
/// Where chunks start in the file: after one chunk-sized slot for the header, so that
/// chunk offsets are multiples of any page size up to [`CHUNK`].
const FIRST_CHUNK: u64 = CHUNK as u64;

/// Identities of exportable pools: unique per process, and with the process id, per host.
static NEXT_ARENA: AtomicU64 = AtomicU64::new(1);

/// The shared-memory file behind an exportable pool.
#[derive(Debug)]
pub(super) struct Arena {
    file: File,
    id: u64,
    /// The next chunk's offset.
    next: u64,
}

fn driver_refuses(call: &'static str, why: String) -> Error {
    invalid_value(call).context(why)
}

impl Arena {
    pub(super) fn new(dev: i32) -> std::io::Result<Arena> {
        // SAFETY: the name is a NUL-terminated string; the flags are valid.
        let fd = unsafe {
            libc::memfd_create(c"streampool-sim-pool".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `memfd_create` returned a new descriptor that nothing else owns.
        let file = File::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        let id = (u64::from(std::process::id()) << 32) | NEXT_ARENA.fetch_add(1, Ordering::Relaxed);
        let mut header = [0u8; 32];
        header[..16].copy_from_slice(MAGIC);
        header[16..24].copy_from_slice(&id.to_le_bytes());
        header[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        header[28..32].copy_from_slice(&dev.to_le_bytes());
        file.set_len(FIRST_CHUNK)?;
        file.write_all_at(&header, 0)?;
        // The file only grows: sealed against shrinking, so that no process it is shared
        // with can cut it under another's mappings (their next touch would be a SIGBUS).
        // SAFETY: an open descriptor of a memfd made with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arena { file, id, next: FIRST_CHUNK })
    }

    /// A new chunk of `len` bytes at the end of the file: its mapping and offset.
    pub(super) fn map_chunk(&mut self, len: usize) -> std::io::Result<(HostBlock, u64)> {
        let offset = self.next;
        self.file.set_len(offset + len as u64)?;
        let block = HostBlock::map(self.file.as_fd(), offset, len)?;
        self.next += len as u64;
        Ok((block, offset))
    }

    /// Gives the host back the memory of a released chunk (the file keeps its size).
    pub(super) fn punch(&self, offset: u64, len: usize) {
        let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
        // SAFETY: an open descriptor; failure (a kernel without hole punching) only keeps
        // the memory until the file is closed.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
    }
}

/// A pool imported from another process: its file, checked to be a simulated pool's.
#[derive(Debug)]
pub(super) struct ImportedPool {
    file: File,
    id: u64,
    /// The exporting process.
    pid: u32,
}

/// What export data says: the pool's identity, the allocation's offset in the pool's file
/// and its size.
fn encode(id: u64, offset: u64, bytes: usize) -> PtrExportData {
    let mut data = [0u8; PTR_EXPORT_DATA_BYTES];
    data[..16].copy_from_slice(MAGIC);
    data[16..24].copy_from_slice(&id.to_le_bytes());
    data[24..32].copy_from_slice(&offset.to_le_bytes());
    data[32..40].copy_from_slice(&(bytes as u64).to_le_bytes());
    data
}

fn decode(data: &PtrExportData) -> Option<(u64, u64, usize)> {
    if &data[..16] != MAGIC {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
    Some((word(16), word(24), usize::try_from(word(32)).ok()?))
}

impl State {
    /// `cuMemPoolExportToShareableHandle`.
    pub(super) fn pool_export_fd(&self, handle: RawPool) -> Result<OwnedFd> {
        const CALL: &str = "cuMemPoolExportToShareableHandle";
        let pool = self.pool(handle)?;
        let Some(arena) = &pool.arena else {
            return Err(driver_refuses(
                CALL,
                format!("pool {handle:#x} was not created with POSIX file-descriptor handles"),
            ));
        };
        arena.file.as_fd().try_clone_to_owned().map_err(|e| {
            driver_refuses(CALL, format!("duplicating the descriptor of pool {handle:#x} failed: {e}"))
        })
    }

    /// `cuMemPoolImportFromShareableHandle`: refuses a descriptor that is not a simulated
    /// pool's, and a pool this process exported (import it in another process).
    pub(super) fn pool_import_fd(&mut self, dev: i32, fd: BorrowedFd<'_>) -> Result<RawPool> {
        const CALL: &str = "cuMemPoolImportFromShareableHandle";
        let raw = fd.as_raw_fd();
        let file = File::from(
            fd.try_clone_to_owned()
                .map_err(|e| driver_refuses(CALL, format!("file descriptor {raw} cannot be used: {e}")))?,
        );
        // A simulated pool's file is sealed against shrinking, which the mappings of its
        // imported allocations rely on (a file cut short under a mapping is a SIGBUS on
        // the next access): one without the seal is not a pool's.
        // SAFETY: F_GET_SEALS reads the seals of an open descriptor; no memory is passed.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        let mut header = [0u8; 32];
        if seals < 0
            || seals & libc::F_SEAL_SHRINK == 0
            || file.read_exact_at(&mut header, 0).is_err()
            || &header[..16] != MAGIC
        {
            return Err(driver_refuses(
                CALL,
                format!("file descriptor {raw} does not name a pool exported by a simulated device"),
            ));
        }
        let id = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        let pid = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
        let pool_dev = i32::from_le_bytes(header[28..32].try_into().expect("4 bytes"));
        if pid == std::process::id() {
            return Err(driver_refuses(
                CALL,
                "the pool was exported by this process; a pool is imported in another process".into(),
            ));
        }
        if pool_dev != dev {
            return Err(driver_refuses(
                CALL,
                format!("the pool lives on device {pool_dev}, not on device {dev}"),
            ));
        }
        // As the driver does (seen with driver 580 on an H100): a pool imported again in
        // this process is the same pool, under the same handle, and one `cuMemPoolDestroy`
        // releases it for every import.
        if let Some((&handle, _)) = self.imports.iter().find(|(_, p)| (p.id, p.pid) == (id, pid)) {
            return Ok(handle);
        }
        let handle = self.next_pool;
        self.next_pool += 1;
        self.imports.insert(handle, ImportedPool { file, id, pid });
        Ok(handle)
    }

    /// `cuMemPoolExportPointer`.
    pub(super) fn pool_export_pointer(&self, ptr: DevPtr) -> Result<PtrExportData> {
        const CALL: &str = "cuMemPoolExportPointer";
        let Some(a) = self.allocs.get(&ptr) else {
            let why = match self.alloc_containing(ptr, 1) {
                Some((start, _)) => format!("{ptr:#x} is inside the allocation at {start:#x}, not its start"),
                None => format!("{ptr:#x} is not a live allocation of {}", self.name),
            };
            return Err(driver_refuses(CALL, why));
        };
        let AllocKind::Pool(handle) = a.kind else {
            return Err(driver_refuses(CALL, format!("{ptr:#x} was not allocated from a memory pool")));
        };
        let pool = &self.pools[&handle];
        let Some(arena) = &pool.arena else {
            return Err(driver_refuses(
                CALL,
                format!("{ptr:#x} comes from pool {handle:#x}, which was not created with POSIX file-descriptor handles"),
            ));
        };
        let (base, offset) = pool.chunk_offset(ptr).expect("an exportable pool's chunks are in its file");
        Ok(encode(arena.id, offset + (ptr - base), a.bytes))
    }

    /// `cuMemPoolImportPointer`: maps the allocation's bytes of the pool's file.
    pub(super) fn pool_import_pointer(
        &mut self,
        dev: i32,
        handle: RawPool,
        data: &PtrExportData,
    ) -> Result<DevPtr> {
        const CALL: &str = "cuMemPoolImportPointer";
        let Some(pool) = self.imports.get(&handle) else {
            return Err(driver_refuses(
                CALL,
                format!("{handle:#x} is not a pool imported into {}", self.name),
            ));
        };
        let Some((id, offset, bytes)) = decode(data) else {
            return Err(driver_refuses(CALL, "the export data was not made by a simulated device".into()));
        };
        if id != pool.id {
            return Err(driver_refuses(CALL, "the export data names an allocation of another pool".into()));
        }
        let size = round_up(bytes.max(1), ALIGN).ok_or_else(|| invalid_value(CALL))?;
        let file_len = pool.file.metadata().map(|m| m.len()).unwrap_or(0);
        if offset < FIRST_CHUNK || offset.checked_add(size as u64).is_none_or(|end| end > file_len) {
            return Err(driver_refuses(CALL, "the export data names bytes the pool does not hold".into()));
        }
        let block = HostBlock::map(pool.file.as_fd(), offset, size).map_err(|_| host_refused(self, size))?;
        let addr = block.addr();
        let alloc = Alloc {
            bytes,
            size,
            kind: AllocKind::Imported(handle),
            dev,
            block: Some(block),
            prefetched: Default::default(),
        };
        self.allocs.insert(addr, alloc);
        Ok(addr)
    }

    /// `cuMemPoolDestroy` of an imported pool: true when `handle` was one. Its imported
    /// allocations keep their mappings until freed.
    pub(super) fn destroy_imported_pool(&mut self, handle: RawPool) -> bool {
        self.imports.remove(&handle).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::Arena;

    /// An exportable pool's file grows and has holes punched, but no process it is shared
    /// with can shrink it under the others' mappings.
    #[test]
    fn an_arena_grows_and_cannot_be_cut() {
        let mut arena = Arena::new(0).unwrap();
        let (block, offset) = arena.map_chunk(2 << 20).unwrap();
        arena.punch(offset, 2 << 20);
        assert!(arena.file.set_len(0).is_err(), "the file was cut under a mapping");
        drop(block);
    }
}
