//! Sharing pool memory between processes (`streampool::ipc`): a real second process (this
//! test binary, run again) imports what this one exported. On the simulated device, and
//! with `STREAMPOOL_GPU_TESTS=1` the round trip runs on the GPU (device 0) instead.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::process::Command;
use std::sync::Arc;

use streampool::device::cuda::CudaBackend;
use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr, PoolProps, LEGACY_STREAM};
use streampool::ipc::{export, export_from, IpcImportedMemoryResource};
use streampool::{
    Allocation, AsyncPoolOptions, CudaAsyncMemoryResource, Error, MemoryResource, ResourceRef,
    ShardedPoolMemoryResource, StatisticsAdaptor, Stream,
};

mod common;
use common::sim;

/// The environment variable that makes [`importing_process`] the child's side.
const CHILD: &str = "STREAMPOOL_IPC_TEST_CHILD";
const BYTES: usize = 12_345;

/// The simulated device (kept alive by the first element), or with
/// `STREAMPOOL_GPU_TESTS=1` the CUDA driver.
fn sim_or_gpu() -> (Option<Arc<SimDevice>>, BackendRef) {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() == Ok("1") {
        return (None, CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"));
    }
    let (sim, b) = sim();
    (Some(sim), b)
}

fn ipc_resource(b: &BackendRef) -> ResourceRef {
    let options = AsyncPoolOptions { enable_ipc: true, ..Default::default() };
    Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, options).unwrap())
}

fn read(b: &BackendRef, ptr: DevPtr, bytes: usize) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` outlives the copy: the stream is synchronised before it is read.
    unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, ptr, bytes, LEGACY_STREAM) }.unwrap();
    b.stream_synchronize(0, LEGACY_STREAM).unwrap();
    host
}

fn fill(b: &BackendRef, ptr: DevPtr, value: u8, bytes: usize) {
    b.memset_d8_async(0, ptr, value, bytes, LEGACY_STREAM).unwrap();
}

/// The importing side of [`a_buffer_round_trips_between_two_processes`]; without its
/// environment variable (an ordinary test run) there is nothing to do.
#[test]
fn importing_process() {
    let Ok(args) = std::env::var(CHILD) else { return };
    let fields: Vec<&str> = args.split(':').collect();
    let [fd, data, bytes, pid] = fields[..] else { panic!("bad {CHILD}: {args}") };
    let fd: i32 = fd.parse().unwrap();
    let data: Vec<u8> =
        (0..data.len()).step_by(2).map(|i| u8::from_str_radix(&data[i..i + 2], 16).unwrap()).collect();
    let (_sim, b) = sim_or_gpu();
    // SAFETY: the parent left this descriptor open (not close-on-exec) for this process.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let pid: u32 = pid.parse().unwrap();
    if _sim.is_some() {
        // Export data the simulated driver refuses (the layout is the simulated device's):
        // another pool's identity, bytes beyond the pool's file. Nothing stays imported.
        let refused = |at: usize, value: u8, why: &str| {
            let mut bad = data.clone();
            bad[at] ^= value;
            let e = IpcImportedMemoryResource::import(b.clone(), 0, fd, &bad, BYTES, pid).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        };
        refused(16, 1, "another pool");
        refused(31, 0x40, "does not hold");
    }
    let mr: ResourceRef = Arc::new(
        IpcImportedMemoryResource::import(b.clone(), 0, fd, &data, bytes.parse().unwrap(), pid).unwrap(),
    );
    let buf = Allocation::new(mr.clone(), BYTES, Stream::legacy()).unwrap();
    assert_eq!(read(&b, buf.ptr(), BYTES), vec![0xab; BYTES], "the exporter's bytes");
    // A second buffer over the same import is refused.
    let again = Allocation::new(mr.clone(), BYTES, Stream::legacy()).unwrap_err();
    assert!(again.to_string().contains("cannot allocate"), "{again}");
    // Not synchronised: freeing the import waits for the fill itself (`cuMemFree` of pool
    // memory does not, and the simulated device refuses a free with work on it queued).
    fill(&b, buf.ptr(), 0xcd, BYTES);
    let errors = streampool::drop_errors().count;
    drop(buf); // cuMemFree: the exporter may free once this process has exited
    drop(mr); // releases the imported pool (cuMemPoolDestroy)
    let after = streampool::drop_errors();
    assert_eq!(after.count, errors, "freeing the import or releasing its pool failed: {:?}", after.recent);
}

#[test]
fn a_buffer_round_trips_between_two_processes() {
    let (_sim, b) = sim_or_gpu();
    if !b.device_info(0).unwrap().posix_fd_ipc {
        return; // a GPU whose pools cannot be exported (the simulated device's can)
    }
    let mr = ipc_resource(&b);
    let buf = Allocation::new(mr, BYTES, Stream::legacy()).unwrap();
    fill(&b, buf.ptr(), 0xab, BYTES);
    let shared = export(&b, 0, buf.ptr(), BYTES, &Stream::legacy()).unwrap();
    assert_eq!(shared.pid, std::process::id());
    // The child inherits the descriptor under the same number.
    // SAFETY: clearing close-on-exec of a descriptor this test owns.
    assert_eq!(unsafe { libc::fcntl(shared.fd.as_raw_fd(), libc::F_SETFD, 0) }, 0);
    let data: String = shared.data.iter().map(|b| format!("{b:02x}")).collect();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "importing_process", "--include-ignored", "--quiet"])
        .env(CHILD, format!("{}:{data}:{}:{}", shared.fd.as_raw_fd(), shared.bytes, shared.pid))
        .status()
        .unwrap();
    assert!(status.success(), "the importing process failed: {status}");
    assert_eq!(read(&b, buf.ptr(), BYTES), vec![0xcd; BYTES], "the importer's bytes");
}

#[test]
fn memory_that_cannot_be_shared_is_refused_naming_the_fix() {
    let (_sim, b) = sim();
    let stream = Stream::legacy();
    let check = |e: Error, why: &str| {
        let text = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(text.contains("CudaAsyncMemoryResource(enable_ipc=True)") && text.contains(why), "{text}");
    };
    // The device's default pool was not made for sharing.
    let plain = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    let ptr = plain.allocate(4096, &stream).unwrap();
    check(export(&b, 0, ptr, 4096, &stream).unwrap_err(), "POSIX file-descriptor handles");
    plain.deallocate(ptr, 4096, &stream).unwrap();
    // Nor is memory from cuMemAlloc.
    let ptr = b.mem_alloc(0, 4096).unwrap();
    check(export(&b, 0, ptr, 4096, &stream).unwrap_err(), "does not come from a memory pool");
    b.mem_free(0, ptr).unwrap();
    // Only whole allocations of an exportable pool.
    let mr = ipc_resource(&b);
    let ptr = mr.allocate(8192, &stream).unwrap();
    check(export(&b, 0, ptr + 256, 4096, &stream).unwrap_err(), "not its start");
    assert!(export(&b, 0, 0, 0, &stream).unwrap_err().to_string().contains("empty buffer"));
    let e = export(&b, 0, ptr, 1 << 30, &stream).unwrap_err().to_string();
    assert!(e.contains("cannot share 1073741824 bytes") && e.contains("its allocation is 8192 bytes"), "{e}");
    // A stream of another device (here, another simulated device's) is refused, not synchronised.
    let (_other_sim, other) = sim();
    let foreign = Stream::create(&other, 0, false).unwrap();
    assert!(matches!(
        export(&b, 0, ptr, 8192, &foreign),
        Err(Error::InvalidStream(_) | Error::InvalidArgument(_))
    ));
    // Refusals change nothing: the allocation still exports.
    export(&b, 0, ptr, 8192, &stream).unwrap();
    mr.deallocate(ptr, 8192, &stream).unwrap();
    // From a resource: an adaptor that passes allocations through exports them; a pool over
    // the same resource refuses every piece, the one at its chunk's start too (the pointer
    // alone would let that one through).
    let stats: ResourceRef = Arc::new(StatisticsAdaptor::new(mr.clone()).unwrap());
    let ptr = stats.allocate(4096, &stream).unwrap();
    export_from(&*stats, ptr, 4096, &stream).unwrap();
    stats.deallocate(ptr, 4096, &stream).unwrap();
    let pool = ShardedPoolMemoryResource::new(mr.clone(), Default::default()).unwrap();
    let first = pool.allocate(1024, &stream).unwrap();
    let second = pool.allocate(1024, &stream).unwrap();
    for p in [first, second] {
        check(export_from(&pool, p, 1024, &stream).unwrap_err(), "pieces of larger allocations");
        pool.deallocate(p, 1024, &stream).unwrap();
    }
}

#[test]
fn bad_imports_are_refused() {
    let (_sim, b) = sim();
    let mr = ipc_resource(&b);
    let buf = Allocation::new(mr, 4096, Stream::legacy()).unwrap();
    let shared = export(&b, 0, buf.ptr(), 4096, &Stream::legacy()).unwrap();
    let import = |data: &[u8], pid: u32| {
        IpcImportedMemoryResource::import(b.clone(), 0, shared.fd.as_fd(), data, 4096, pid)
            .unwrap_err()
            .to_string()
    };
    let e = import(&shared.data[..63], shared.pid + 1);
    assert!(e.contains("must be the 64 bytes") && e.contains("got 63"), "{e}");
    let e = import(&shared.data, std::process::id());
    assert!(e.contains("exported by this process"), "{e}");
    // A process that has exited (and been reaped).
    let mut gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    let e = import(&shared.data, gone_pid);
    assert!(e.contains(&format!("pid {gone_pid}")) && e.contains("has exited"), "{e}");
}

#[test]
fn the_simulated_driver_refuses_what_the_driver_refuses() {
    let (sim_a, a) = sim();
    let pool = a.pool_create(0, &PoolProps { posix_fd_ipc: true, managed: false }).unwrap();
    let ptr = a.pool_alloc_async(0, pool, 4096, LEGACY_STREAM).unwrap();
    let fd = a.pool_export_fd(0, pool).unwrap();
    let data = a.pool_export_pointer(0, ptr).unwrap();
    let invalid = |e: Error, why: &str| {
        assert!(matches!(&e, Error::Driver { name, .. } if name == "CUDA_ERROR_INVALID_VALUE"), "{e:?}");
        assert!(e.to_string().contains(why), "{e}");
    };
    // Importing in the exporting process, even into another simulated device.
    let (_sim_b, other) = sim();
    invalid(other.pool_import_fd(0, fd.as_fd()).unwrap_err(), "exported by this process");
    // A descriptor that names no exported pool.
    let not_a_pool = std::fs::File::open("/dev/null").unwrap();
    invalid(other.pool_import_fd(0, not_a_pool.as_fd()).unwrap_err(), "does not name a pool");
    // A file made to look like a pool's, not sealed against shrinking: imported, it could
    // be cut short under the mappings of its allocations (a SIGBUS at the next access).
    let mut forged = tempfile_in_tmp("forged-sim-pool");
    let mut header = b"streampool-simip".to_vec();
    header.extend_from_slice(&7u64.to_le_bytes());
    header.extend_from_slice(&1u32.to_le_bytes()); // "exported" by another process
    header.extend_from_slice(&0i32.to_le_bytes()); // device 0
    std::io::Write::write_all(&mut forged, &header).unwrap();
    forged.set_len(4 << 20).unwrap();
    invalid(other.pool_import_fd(0, forged.as_fd()).unwrap_err(), "does not name a pool");
    // A pool without IPC handles, managed IPC pools.
    let plain = a.pool_create(0, &PoolProps::default()).unwrap();
    invalid(a.pool_export_fd(0, plain).unwrap_err(), "not created with POSIX");
    invalid(a.pool_create(0, &PoolProps { posix_fd_ipc: true, managed: true }).unwrap_err(), "managed");
    // Export data is 64 opaque bytes that name the allocation.
    assert_eq!(data.len(), 64);
    assert_ne!(
        data,
        a.pool_export_pointer(0, a.pool_alloc_async(0, pool, 4096, LEGACY_STREAM).unwrap()).unwrap()
    );
    drop(fd);
    drop(sim_a);
}

#[test]
fn an_exportable_pool_grows_releases_and_exports_like_any_pool() {
    let (_sim, b) = sim();
    let options = AsyncPoolOptions { enable_ipc: true, release_threshold: Some(0), ..Default::default() };
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, options).unwrap();
    let stream = Stream::legacy();
    let first = mr.allocate(3 << 20, &stream).unwrap();
    fill(&b, first, 0x11, 3 << 20);
    let before = export(&b, 0, first, 3 << 20, &stream).unwrap();
    assert!(mr.reserved_bytes().unwrap() >= 3 << 20);
    mr.deallocate(first, 3 << 20, &stream).unwrap();
    b.stream_synchronize(0, LEGACY_STREAM).unwrap(); // releases down to the threshold
    assert_eq!(mr.reserved_bytes().unwrap(), 0);
    // Memory grown again is zeroed, counted and exported under new export data.
    let second = mr.allocate(3 << 20, &stream).unwrap();
    assert_eq!(read(&b, second, 4096), vec![0; 4096]);
    assert!(mr.reserved_bytes().unwrap() >= 3 << 20);
    let after = export(&b, 0, second, 3 << 20, &stream).unwrap();
    assert_ne!(before.data, after.data, "released file offsets are not reused");
    mr.deallocate(second, 3 << 20, &stream).unwrap();
}

/// A new file under the temporary directory, removed at once (it lives while open).
fn tempfile_in_tmp(name: &str) -> std::fs::File {
    let path =
        std::env::temp_dir().join(format!("{name}-{}-{:?}", std::process::id(), std::thread::current().id()));
    let file =
        std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}
