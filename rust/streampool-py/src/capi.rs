//! C entry points exported by the extension module, for the allocators of other libraries
//! (PyTorch's `torch.cuda.memory.CUDAPluggableAllocator` loads this module's file and calls
//! two of them, the C++ pair below):
//!
//! ```c
//! void* streampool_alloc(size_t size, int device, cudaStream_t stream);
//! void  streampool_free(void* ptr, size_t size, int device, cudaStream_t stream);
//! ```
//!
//! Both go through the current resource of `device` (what `set_current_device_resource`
//! set, or the initial `CudaAsyncMemoryResource`), so pools, adaptors and statistics apply
//! to the memory of the library that calls them. Stream handle 0 (or 1) is the legacy
//! default stream, 2 the calling thread's per-thread default stream.
//!
//! What the path does not do: take the GIL or touch a Python object (it runs on any
//! thread, attached to Python or not), or unwind into the caller (a panic is caught). A
//! failure gives NULL (allocation), a line on stderr, and a record that
//! `streampool.allocators.last_error()` reads. The backend makes the device's context
//! current around every driver call, as for every other call of the library.
//!
//! Two more allocation entry points, for callers that handle failures themselves, say
//! nothing on stderr (the failure is still recorded):
//!
//! ```c
//! void* streampool_try_alloc(size_t size, int device, cudaStream_t stream);
//! void* streampool_alloc_cxx(size_t size, int device, cudaStream_t stream);
//! ```
//!
//! `streampool_try_alloc` gives NULL, for callers that check for it (PyTorch's caching
//! allocator in a `MemPool`, which frees what it caches and tries again before it raises:
//! a line for each attempt would report failures the program never sees).
//! `streampool_alloc_cxx`, which PyTorch is given otherwise with `streampool_free_cxx`
//! (`streampool_free`, counted: the pair keeps PyTorch's memory statistics, [`torch_stats`]),
//! is `streampool_alloc`, but a failure throws a C++ exception (a `std::bad_alloc`
//! carrying the message when out of memory, a `std::runtime_error` otherwise), as RMM's
//! allocator for PyTorch does. PyTorch's pluggable allocator does not check for NULL: a
//! tensor whose allocation failed got a null pointer, and the first kernel to touch it
//! left the CUDA context unusable. PyTorch turns the exception into a Python
//! `RuntimeError` with the message, and the program goes on. Once
//! [`_use_torch_out_of_memory`] has found PyTorch's libraries in the process (the Python
//! module does that when it hands this function to PyTorch), out of memory throws
//! PyTorch's own `c10::OutOfMemoryError` instead, which PyTorch raises as
//! `torch.OutOfMemoryError`, the error a program catches to retry with less. An
//! out-of-memory message begins "CUDA out of memory.", as PyTorch's does.
//!
//! What it costs: each thread keeps the backend, the resource of each device and the
//! streams it has seen, and looks them up again only when the current resource or the
//! backend has changed (one atomic load each); a stream other than a default one costs one
//! `cuStreamGetId`, which tells a new stream from an old one whose handle value was reused.
//! The resource's own fast path (`try_allocate`: the sharded pool's shard, the adaptors'
//! counters) comes first, on what the thread kept, answering in small values; the rest
//! (a first call, a changed resource, a new stream, the resource's slow path) takes the
//! full path. On the development machine's simulated device a pair over the sharded pool
//! went from 104 to 65 ns on the legacy stream, 158 to 120 ns on a stream of its own.
//! Two atomic loads more (frees put off, captures announced: [`capture`]) stand for the
//! CUDA graph captures, which cost nothing else while none is announced.
//!
//! A caveat shared with RMM's allocators: memory is freed through the resource that is
//! current at the free. Set the resource before the library allocates, and keep it while
//! that memory lives: a resource that did not make it may accept the free (the driver's
//! pool takes the start of a pool's chunk) and hand live memory out again. So each thread
//! counts the allocations it made and freed per device ([`live`]), and a change of a
//! device's resource while some are live warns. A replaced resource stays alive in the
//! caches of the threads that used it until each calls again.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;
use streampool::device::{self, BackendRef, DevPtr, RawStream, LEGACY_STREAM};
use streampool::error::CUDA_ERROR_DEINITIALIZED;
use streampool::stream::Stream;
use streampool::{Error, Result};

use crate::resources;

/// How many streams other than the default ones a thread remembers.
const STREAMS_KEPT: usize = 16;

static LEGACY: Stream = Stream::legacy();
static PER_THREAD: Stream = Stream::per_thread();

/// Allocates `size` bytes on `device` for use on `stream` through the device's current
/// resource. NULL on failure (the error is kept for `streampool.allocators.last_error()`,
/// and said on stderr); NULL for a size of 0 too, as the resources give.
#[no_mangle]
pub extern "C" fn streampool_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    allocate(size, device, stream, true)
}

/// [`streampool_alloc`] for callers that check for NULL, such as PyTorch's caching
/// allocator in a `MemPool` (which frees what it caches and tries again before it raises):
/// a failure is kept for `streampool.allocators.last_error()` but not said on stderr.
#[no_mangle]
pub extern "C" fn streampool_try_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    allocate(size, device, stream, false)
}

/// The allocation entry points' path; a failure is said on stderr when `say`.
#[inline(always)]
fn allocate(size: usize, device: c_int, stream: *mut c_void, say: bool) -> *mut c_void {
    let handle = stream as RawStream;
    let what = || alloc_call(size, device, handle);
    let made = |&ptr: &DevPtr| i64::from(ptr != 0);
    if let Some(ptr) =
        fast_path(device, handle, what, say, 0, made, |mr, stream| mr.try_allocate(size, stream))
    {
        return ptr as *mut c_void;
    }
    let ptr = guarded(what, say, || {
        capture::drain();
        with_current(Some(device), handle, |device, mr, stream| {
            let ptr = match mr.try_allocate(size, stream) {
                Some(settled) => settled,
                None => mr.allocate(size, stream),
            }?;
            if stream.is_capturing() && ptr != 0 {
                capture::allocated(device, ptr, stream.handle());
            }
            Ok(ptr)
        })
    })
    .unwrap_or(0);
    count_live(device, made(&ptr));
    ptr as *mut c_void
}

extern "C-unwind" {
    /// Throws a C++ exception with the message (cxx/throw.cpp); never returns.
    fn streampool_throw_allocation_failure(message: *const c_char, len: usize, is_out_of_memory: c_int) -> !;
}

extern "C" {
    /// Makes out of memory throw PyTorch's `c10::OutOfMemoryError` where this process has
    /// loaded PyTorch (cxx/throw.cpp); 1 when it does. Throws nothing out.
    fn streampool_use_torch_out_of_memory() -> c_int;
}

/// From now on, [`streampool_alloc_cxx`] out of memory throws PyTorch's
/// `c10::OutOfMemoryError` (`torch.OutOfMemoryError` in Python), made from the PyTorch
/// libraries this process has loaded; returns False where it cannot (PyTorch not loaded,
/// or a build whose symbols differ), and the exception stays a `std::bad_alloc`.
#[pyfunction]
pub(crate) fn _use_torch_out_of_memory() -> bool {
    // SAFETY: no arguments; the C++ catches everything it throws itself.
    unsafe { streampool_use_torch_out_of_memory() != 0 }
}

/// [`streampool_alloc`] for C++ callers: a failure throws a C++ exception (see the module
/// docs) instead of giving NULL; NULL only for a size of 0. The failure is recorded for
/// `streampool.allocators.last_error()`; the exception says it, not stderr (a caller may
/// catch it and go on: PyTorch's cuDNN convolutions try smaller workspaces when out of
/// memory).
///
/// With [`streampool_free_cxx`] it keeps PyTorch's memory statistics ([`torch_stats`]).
#[no_mangle]
pub extern "C-unwind" fn streampool_alloc_cxx(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let ptr = allocate(size, device, stream, false);
    if ptr.is_null() && size > 0 {
        throw_this_threads_failure(size, device, stream as RawStream);
    }
    if !ptr.is_null() {
        torch_stats::allocated(device, size);
    }
    ptr
}

/// [`streampool_free`] for the memory [`streampool_alloc_cxx`] gave, counted as freed in
/// the statistics that pair keeps ([`torch_stats`]). PyTorch is given the two.
#[no_mangle]
pub extern "C" fn streampool_free_cxx(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    // A refused free (a double free, a pointer or size the resource did not hand out)
    // changes no count: the counts never go below what is live.
    if free(ptr, size, device, stream) && !ptr.is_null() {
        torch_stats::freed(device, size);
    }
}

/// PyTorch's memory statistics for what it allocates through streampool: PyTorch's
/// pluggable allocator keeps none (`torch.cuda.memory_stats()` raises under it), so the
/// C++ pair counts, per device, the bytes and the allocations it gave and took back: now,
/// at most (since the last reset), and in all (since the last reset), as PyTorch's own
/// `Stat`s do. Shared counters: a pair costs a few atomic operations on its device's line
/// (on the development machine, within its spread: `benchmarks/RESULTS.md`, "what
/// counting PyTorch's statistics costs a pair").
pub(crate) mod torch_stats {
    use std::ffi::c_int;
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

    /// Devices counted (ordinals from 0); the rest are not.
    const DEVICES: usize = 64;

    /// One of PyTorch's `Stat`s: `current`, `peak`, `allocated`, `freed`.
    struct Stat {
        current: AtomicI64,
        peak: AtomicI64,
        allocated: AtomicU64,
        freed: AtomicU64,
    }

    impl Stat {
        const fn new() -> Self {
            Stat {
                current: AtomicI64::new(0),
                peak: AtomicI64::new(0),
                allocated: AtomicU64::new(0),
                freed: AtomicU64::new(0),
            }
        }

        fn increase(&self, amount: i64) {
            let now = self.current.fetch_add(amount, Relaxed) + amount;
            // A locked write only for a new peak (`fetch_max` alone always writes).
            if now > self.peak.load(Relaxed) {
                self.peak.fetch_max(now, Relaxed);
            }
            self.allocated.fetch_add(amount as u64, Relaxed);
        }

        fn decrease(&self, amount: i64) {
            self.current.fetch_sub(amount, Relaxed);
            self.freed.fetch_add(amount as u64, Relaxed);
        }

        /// Never below 0 nor wrapped: a free of a wrong size, which a resource that does not
        /// track sizes (the driver's pool) accepts, cannot show as negative or huge counts.
        /// (The peak is never below 0: it starts there, and a reset clamps what it copies.)
        fn read(&self) -> [i64; 4] {
            let [allocated, freed] =
                [&self.allocated, &self.freed].map(|c| i64::try_from(c.load(Relaxed)).unwrap_or(i64::MAX));
            [self.current.load(Relaxed).max(0), self.peak.load(Relaxed), allocated, freed]
        }
    }

    /// A device's counters, on cache lines of their own.
    #[repr(align(128))]
    struct Device {
        bytes: Stat,
        allocations: Stat,
        out_of_memory: AtomicU64,
    }

    static COUNTS: [Device; DEVICES] =
        [const { Device { bytes: Stat::new(), allocations: Stat::new(), out_of_memory: AtomicU64::new(0) } };
            DEVICES];

    fn of(device: c_int) -> Option<&'static Device> {
        usize::try_from(device).ok().and_then(|d| COUNTS.get(d))
    }

    pub(super) fn allocated(device: c_int, size: usize) {
        if let Some(d) = of(device) {
            d.bytes.increase(bytes(size));
            d.allocations.increase(1);
        }
    }

    pub(super) fn freed(device: c_int, size: usize) {
        if let Some(d) = of(device) {
            d.bytes.decrease(bytes(size));
            d.allocations.decrease(1);
        }
    }

    /// A size as a count: sizes beyond `i64::MAX` are refused by every resource, and count
    /// as that most.
    fn bytes(size: usize) -> i64 {
        i64::try_from(size).unwrap_or(i64::MAX)
    }

    pub(super) fn out_of_memory(device: c_int) {
        if let Some(d) = of(device) {
            d.out_of_memory.fetch_add(1, Relaxed);
        }
    }

    /// `(bytes, allocations, out-of-memory failures)` of `device`, each stat as
    /// `[current, peak, allocated, freed]`; zeros for a device beyond those counted.
    pub(crate) fn read(device: c_int) -> ([i64; 4], [i64; 4], u64) {
        of(device).map_or(([0; 4], [0; 4], 0), |d| {
            (d.bytes.read(), d.allocations.read(), d.out_of_memory.load(Relaxed))
        })
    }

    /// PyTorch's resets: the peaks to what is current, or the totals to 0.
    pub(crate) fn reset(device: c_int, peak: bool) {
        let Some(d) = of(device) else { return };
        for stat in [&d.bytes, &d.allocations] {
            if peak {
                stat.peak.store(stat.current.load(Relaxed).max(0), Relaxed);
            } else {
                stat.allocated.store(0, Relaxed);
                stat.freed.store(0, Relaxed);
            }
        }
        if !peak {
            d.out_of_memory.store(0, Relaxed);
        }
    }
}

#[cold]
#[inline(never)]
fn throw_this_threads_failure(size: usize, device: c_int, handle: RawStream) -> ! {
    let (message, out_of_memory) = MY_FAILURE
        .try_with(|mine| mine.take())
        .ok()
        .flatten()
        .unwrap_or_else(|| (format!("{}: no memory was given", alloc_call(size, device, handle)), false));
    // Out of memory begins as PyTorch's own message does, which programs and frameworks
    // look for to retry with less (PyTorch Lightning's and Accelerate's batch-size finders).
    let message = if out_of_memory {
        torch_stats::out_of_memory(device);
        format!("CUDA out of memory. streampool: {message}")
    } else {
        format!("streampool: {message}")
    };
    // SAFETY: the pointer and length are those of `message`, alive during the call, which
    // copies them before it throws. The exception unwinds through this frame (declared
    // "C-unwind"), dropping `message`, into the C++ caller.
    unsafe {
        streampool_throw_allocation_failure(
            message.as_ptr().cast(),
            message.len(),
            c_int::from(out_of_memory),
        )
    }
}

/// Frees `ptr` (of `size` bytes, as allocated on `device`) for reuse after the work
/// enqueued on `stream` so far, through the device's current resource. A failure is kept
/// for `streampool.allocators.last_error()`.
#[no_mangle]
pub extern "C" fn streampool_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    free(ptr, size, device, stream);
}

/// [`streampool_free`]: true when the resource took the memory back, false when it refused
/// (the failure recorded).
#[inline]
fn free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) -> bool {
    let (ptr, handle) = (ptr as DevPtr, stream as RawStream);
    let what = || free_call(ptr, size, device, handle);
    let taken = |mr: &streampool::ResourceRef, stream: &Stream| {
        mr.try_deallocate(ptr, size, stream).map(|settled| settled.map(|()| true))
    };
    if let Some(freed) = fast_path(device, handle, what, true, false, |_| -1, taken) {
        return freed;
    }
    guarded(what, true, || {
        match free_full(ptr, size, device, handle) {
            Ok(()) => {
                count_live(device, -1);
                Ok(())
            }
            // No driver, and a simulated device was in use before: the memory was its,
            // and went with it when it was exited (as a DeviceBuffer's free, silently).
            Err(Error::DriverNotFound(_)) if device::backend_epoch() > 0 => Ok(()),
            Err(e) => Err(e),
        }
    })
    .is_some()
}

/// The full path of a free through the entry points (uncounted): the device's current
/// resource, on the stream `handle` names; a free a CUDA graph capture forbids is put off
/// ([`capture::free`]).
fn free_full(ptr: DevPtr, size: usize, device: c_int, handle: RawStream) -> Result<()> {
    if let Some(done) = capture::free_announced(device, ptr, size, handle) {
        return done;
    }
    capture::drain();
    capture::forget(device, ptr);
    let done =
        with_current(Some(device), handle, |_, mr, stream| match mr.try_deallocate(ptr, size, stream) {
            Some(settled) => settled,
            None => mr.deallocate(ptr, size, stream),
        });
    // (Not while a capture is announced: the synchronisation would invalidate it.)
    match capture::announced() {
        true => done,
        false => or_where_stream_gone(done, handle, device, ptr, size, None),
    }
}

/// `done`, a free on the stream `handle` names; where it failed because that stream is gone
/// (destroyed by its owner while the memory lived: PyTorch frees on the stream it recorded,
/// however long after), and the driver said so (it may as well crash on such a handle: the
/// caller must keep the stream alive, as for cuMemFreeAsync), the free made again once the
/// device is synchronised, when nothing uses the memory, on the legacy default stream
/// ([`free_after_device_sync`]).
fn or_where_stream_gone(
    done: Result<()>,
    handle: RawStream,
    device: c_int,
    ptr: DevPtr,
    size: usize,
    mr: Option<&streampool::ResourceRef>,
) -> Result<()> {
    match done {
        Err(Error::InvalidStream(_)) if handle != LEGACY_STREAM => {
            free_after_device_sync(device, ptr, size, mr)
        }
        done => done,
    }
}

/// Frees `ptr` (`size` bytes of `device`) on the device's legacy default stream once the
/// device is synchronised: for memory whose stream is gone (destroyed by its owner), which
/// orders nothing any more. Through `mr` when given, else the device's current resource.
pub(crate) fn free_after_device_sync(
    device: c_int,
    ptr: DevPtr,
    size: usize,
    mr: Option<&streampool::ResourceRef>,
) -> Result<()> {
    with_current(Some(device), LEGACY_STREAM, |device, current, legacy| {
        let mr = mr.unwrap_or(current);
        mr.backend().ctx_synchronize(device)?;
        mr.deallocate(ptr, size, legacy)
    })
}

/// Allocations made through the C entry points and not yet freed through them, per device:
/// memory that a change of the device's resource would have freed through a resource that
/// did not make it ([`live_allocations`], read when the resource is set). Each thread
/// counts in a line of its own, so the hot path writes no shared memory.
pub(crate) mod live {
    use std::ffi::c_int;
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::{Arc, Mutex};

    /// Devices counted (ordinals from 0); the rest are not.
    const DEVICES: usize = 64;

    struct Counts([AtomicI64; DEVICES]);

    impl Counts {
        const fn new() -> Self {
            Counts([const { AtomicI64::new(0) }; DEVICES])
        }
    }

    /// Every live thread's counts, and what exited threads left.
    static THREADS: Mutex<Vec<Arc<Counts>>> = Mutex::new(Vec::new());
    static EXITED: Counts = Counts::new();

    /// A thread's counts, registered while it lives (kept in the thread's `PerThread`);
    /// folded into `EXITED` when it exits.
    pub(crate) struct Mine(Arc<Counts>);

    impl Mine {
        pub(crate) fn register() -> Self {
            let counts = Arc::new(Counts::new());
            THREADS.lock().unwrap_or_else(|e| e.into_inner()).push(counts.clone());
            Mine(counts)
        }

        /// Adds `delta` to this thread's count of `device` (only this thread writes it).
        #[inline]
        pub(crate) fn add(&self, device: c_int, delta: i64) {
            if let Some(c) = usize::try_from(device).ok().and_then(|d| self.0 .0.get(d)) {
                c.store(c.load(Ordering::Relaxed) + delta, Ordering::Relaxed);
            }
        }
    }

    impl Drop for Mine {
        fn drop(&mut self) {
            let mut threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
            for (total, mine) in EXITED.0.iter().zip(&self.0 .0) {
                total.fetch_add(mine.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            threads.retain(|t| !Arc::ptr_eq(t, &self.0));
        }
    }

    /// Allocations of `device` made through the C entry points and live now (as far as
    /// the threads' counts, read without stopping them, tell).
    pub(crate) fn live_allocations(device: i32) -> i64 {
        let Ok(d) = usize::try_from(device) else { return 0 };
        if d >= DEVICES {
            return 0;
        }
        let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
        EXITED.0[d].load(Ordering::Relaxed)
            + threads.iter().map(|t| t.0[d].load(Ordering::Relaxed)).sum::<i64>()
    }

    /// Forgets every count: the backend whose memory they counted went away.
    pub(crate) fn forget() {
        let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
        for counts in threads.iter().map(|t| &t.0).chain([&EXITED.0]) {
            for c in counts {
                c.store(0, Ordering::Relaxed);
            }
        }
    }
}

static FAILURES: AtomicU64 = AtomicU64::new(0);
static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Runs `f`, catching a panic; a failure is recorded (`what` names the call; said on
/// stderr too when `say`) and gives None.
fn guarded<T>(what: impl FnOnce() -> String, say: bool, f: impl FnOnce() -> Result<T>) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Some(value),
        Ok(Err(e)) => failed(what, e, say),
        Err(panic) => panicked(what, panic),
    }
}

#[cold]
#[inline(never)]
fn panicked<T>(what: impl FnOnce() -> String, panic: Box<dyn Any + Send>) -> Option<T> {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    record(what, format!("panicked (a bug in streampool; please report it): {text}"), false, false)
}

/// Records the failure `e` of the call `what` names, said on stderr too when `say`; gives
/// None.
#[cold]
#[inline(never)]
pub(crate) fn failed<T>(what: impl FnOnce() -> String, e: Error, say: bool) -> Option<T> {
    // The driver going away (process exit, a library freeing from a static destructor) is
    // recorded but not said: nothing is printed at shutdown.
    let quiet = !say || matches!(e, Error::Driver { code: CUDA_ERROR_DEINITIALIZED, .. });
    record(what, e.to_string(), quiet, e.is_out_of_memory())
}

fn alloc_call(size: usize, device: c_int, handle: RawStream) -> String {
    format!("streampool_alloc(size={size}, device={device}, stream={handle:#x})")
}

fn free_call(ptr: DevPtr, size: usize, device: c_int, handle: RawStream) -> String {
    format!("streampool_free(ptr={ptr:#x}, size={size}, device={device}, stream={handle:#x})")
}

thread_local! {
    /// The calling thread's most recent failure and whether it was out of memory: what
    /// [`streampool_alloc_cxx`] throws (`LAST_ERROR` may hold another thread's by then).
    static MY_FAILURE: RefCell<Option<(String, bool)>> = const { RefCell::new(None) };
}

/// Counts a failure and keeps its message (said on stderr unless `quiet`), for every
/// thread and for the calling one; gives None.
#[cold]
fn record<T>(what: impl FnOnce() -> String, message: String, quiet: bool, out_of_memory: bool) -> Option<T> {
    FAILURES.fetch_add(1, Ordering::Relaxed);
    let message = format!("{}: {message}", what());
    // Said on stderr too: a caller of the C functions may not check for NULL, so the
    // first sign of a failed allocation may be a kernel's illegal-address error.
    if !quiet {
        // Not `eprintln!`, which panics where stderr is closed: nothing may unwind from here.
        let _ = writeln!(std::io::stderr(), "streampool: {message}");
    }
    // A thread that is exiting has no thread-locals left: its failure is kept only below.
    let _ = MY_FAILURE.try_with(|mine| *mine.borrow_mut() = Some((message.clone(), out_of_memory)));
    *LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
    None
}

/// `(failures so far, the most recent failure's message)` of the C entry points, from any
/// thread: what `streampool.allocators.last_error()` reads.
#[pyfunction]
pub(crate) fn _capi_last_error() -> (u64, Option<String>) {
    let last = LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (FAILURES.load(Ordering::Relaxed), last)
}

/// `(begins, ends)` of captures announced on the calling thread so far
/// ([`streampool_capture_begin`], [`streampool_capture_end`]): `streampool.allocators.torch`
/// compares them around PyTorch's capture calls to end an announcement that a failed call
/// left behind, and only that.
#[pyfunction]
pub(crate) fn _capture_hook_calls() -> (u64, u64) {
    capture::hook_calls()
}

/// While `on`, the capture hooks called on this thread announce nothing: set around
/// PyTorch's calls that open and close a `torch.cuda.use_mem_pool` region
/// (`streampool.allocators.torch`), which calls the same hooks as a capture.
#[pyfunction]
pub(crate) fn _capture_hooks_open_a_region(on: bool) {
    capture::set_region_hooks(on);
}

/// PyTorch's memory statistics of `device` ([`torch_stats`]): `(bytes, allocations,
/// out-of-memory failures, reserved)`, each stat `[current, peak, allocated, freed]`, and
/// `reserved` the device's current resource's `(reserved bytes, their peak)` where it
/// reports them (None otherwise, or where the device cannot be reached).
#[pyfunction]
pub(crate) fn _torch_memory_stats(py: Python<'_>, device: c_int) -> TorchStats {
    let (bytes, allocations, out_of_memory) = torch_stats::read(device);
    let reserved = py.detach(move || {
        // The driver's pool attributes are not asked during a capture (it would be
        // invalidated): reserved bytes are unknown then.
        if capture::announced() {
            return None;
        }
        let footprint = current_resource(device)?.footprint()?;
        Some((footprint.reserved_bytes, footprint.peak_reserved_bytes))
    });
    (bytes, allocations, out_of_memory, reserved)
}

type TorchStats = ([i64; 4], [i64; 4], u64, Option<(usize, usize)>);

/// PyTorch's resets of `device`'s statistics ([`torch_stats`]): with `peak`, the peaks to
/// what is current (the current resource's peak of reserved bytes too); otherwise the
/// totals and the count of out-of-memory failures to 0.
#[pyfunction]
pub(crate) fn _torch_reset_memory_stats(py: Python<'_>, device: c_int, peak: bool) {
    torch_stats::reset(device, peak);
    if peak && !capture::announced() {
        py.detach(move || current_resource(device).map(|mr| mr.reset_peak_footprint()));
    }
}

/// `device`'s current resource as the C entry points use it; None where there is no
/// backend or no such device.
fn current_resource(device: c_int) -> Option<streampool::ResourceRef> {
    resources::core_resource(&device::backend().ok()?, device).ok()
}

/// What a thread keeps between calls (see the module docs).
#[derive(Default)]
struct Current {
    /// `device::backend_epoch()` and `resources::generation()` when `backend` was read.
    epoch: u64,
    generation: u64,
    backend: Option<BackendRef>,
    resources: Vec<(i32, streampool::ResourceRef)>,
    /// (stream key, device, stream) of the streams seen, most recent last.
    streams: Vec<(u64, i32, Stream)>,
}

/// What a thread keeps, in one thread-local (one look-up a call): its `Current`, and its
/// count of live allocations ([`live`]).
struct PerThread {
    current: RefCell<Current>,
    live: live::Mine,
}

thread_local! {
    static THREAD: PerThread = PerThread { current: RefCell::new(Current::default()), live: live::Mine::register() };
}

/// Adds `delta` to this thread's count of live allocations of `device` (the full path's;
/// the fast path counts through the thread-local it already holds).
fn count_live(device: c_int, delta: i64) {
    if delta != 0 {
        let _ = THREAD.try_with(|t| t.live.add(device, delta));
    }
}

/// The common case in few instructions and small values: this thread's resource of
/// `device` and the stream of `handle` as kept from an earlier call (both still current),
/// and the resource's non-blocking path (`f`). `Some` when that settled the call (a failure
/// recorded, and said on stderr when `say`, giving `on_failure`); `None` leaves it to the full path. A success adds
/// `live(value)` to the thread's count of live allocations. The full path's `Result` is
/// large, and passing it up through the layers cost tens of nanoseconds a call in stores
/// and reloads.
#[inline]
fn fast_path<T: Copy>(
    device: c_int,
    handle: RawStream,
    what: impl FnOnce() -> String + Copy,
    say: bool,
    on_failure: T,
    live: impl FnOnce(&T) -> i64,
    f: impl FnOnce(&streampool::ResourceRef, &Stream) -> Option<Result<T>>,
) -> Option<T> {
    if capture::pending() || capture::announced() {
        return None; // a capture announced, or frees put off: the full path's
    }
    let settled = catch_unwind(AssertUnwindSafe(|| {
        let kept = THREAD.try_with(|t| {
            let current = t.current.try_borrow().ok()?;
            let (mr, stream) = current.kept(device, handle)?;
            let settled = f(mr, stream);
            if let Some(Ok(value)) = &settled {
                t.live.add(device, live(value));
            }
            settled
        });
        match kept {
            Ok(Some(Ok(value))) => Some(value),
            Ok(Some(Err(e))) => {
                failed::<T>(what, e, say);
                Some(on_failure)
            }
            Ok(None) | Err(_) => None,
        }
    }));
    settled.unwrap_or_else(|panic| {
        panicked::<T>(what, panic);
        Some(on_failure)
    })
}

/// Runs `f` with `device` (the calling thread's current device when `None`), its current
/// resource and the stream `handle` names, as this thread keeps them.
pub(crate) fn with_current<T>(
    device: Option<c_int>,
    handle: RawStream,
    f: impl FnOnce(i32, &streampool::ResourceRef, &Stream) -> Result<T>,
) -> Result<T> {
    with_current_asking(device, handle, capture::announced(), f)
}

/// [`with_current`], asking the stream whether it captures a CUDA graph when `ask` (and it
/// is not the legacy default stream): a capturing stream is wrapped as such
/// ([`Stream::capturing`]). Ask only of a stream known to be alive: the question on a
/// destroyed handle crashes the driver.
pub(crate) fn with_current_asking<T>(
    device: Option<c_int>,
    handle: RawStream,
    ask: bool,
    f: impl FnOnce(i32, &streampool::ResourceRef, &Stream) -> Result<T>,
) -> Result<T> {
    let mut f = Some(f);
    let kept = THREAD.try_with(|t| match t.current.try_borrow_mut() {
        Ok(mut current) => Some(current.run(device, handle, ask, f.take().expect("called once"))),
        // Re-entered (a resource whose allocation allocates through these entry points).
        Err(_) => None,
    });
    match (kept, f) {
        (Ok(Some(result)), _) => result,
        // Re-entered, or this thread's storage is gone (a call from a thread-local
        // destructor): look everything up afresh.
        (_, Some(f)) => Current::default().run(device, handle, ask, f),
        (_, None) => unreachable!("`f` is taken only when it runs"),
    }
}

impl Current {
    fn run<T>(
        &mut self,
        device: Option<c_int>,
        handle: RawStream,
        ask: bool,
        f: impl FnOnce(i32, &streampool::ResourceRef, &Stream) -> Result<T>,
    ) -> Result<T> {
        if self.fresh().is_none() {
            // Read before the lookups below: a change made meanwhile shows next time.
            let (epoch, generation) = (device::backend_epoch(), resources::generation());
            *self = Current { epoch, generation, backend: Some(device::backend()?), ..Default::default() };
        }
        let backend = self.backend.as_ref().expect("set above");
        let device = match device {
            Some(device) => device,
            None => backend.current_device()?,
        };
        let at = match self.resources.iter().position(|(d, _)| *d == device) {
            Some(at) => at,
            None => {
                let device = streampool::resources::check_device(backend, Some(device))?;
                self.resources.push((device, resources::core_resource(backend, device)?));
                self.resources.len() - 1
            }
        };
        if ask && may_capture(handle) && backend.stream_capturing(device, handle).unwrap_or(false) {
            // Its identity cannot be asked: that would invalidate the capture.
            let stream = Stream::capturing(backend, device, handle);
            return f(device, &self.resources[at].1, &stream);
        }
        let stream = stream(&mut self.streams, backend, device, handle)?;
        if capture::announced() {
            // Not a capturing stream, while a capture is under way: what the capture would
            // refuse in its global or thread-local mode (a free or an allocation on this
            // stream, a pool's growth) is this thread's to make in the relaxed mode.
            return device::with_relaxed_capture(backend, || f(device, &self.resources[at].1, stream));
        }
        f(device, &self.resources[at].1, stream)
    }

    /// The backend, when neither it nor the current resources changed since it was read.
    #[inline]
    fn fresh(&self) -> Option<&BackendRef> {
        // A forked child takes the slow path, whose look-up of the backend refuses it.
        if device::forked() {
            return None;
        }
        let backend = self.backend.as_ref()?;
        let same = self.epoch == device::backend_epoch() && self.generation == resources::generation();
        same.then_some(backend)
    }

    /// The resource of `device` and the stream of `handle` as kept from earlier calls, when
    /// both are kept and still current (the fast path's look-up: nothing is added).
    #[inline]
    fn kept(&self, device: c_int, handle: RawStream) -> Option<(&streampool::ResourceRef, &Stream)> {
        let backend = self.fresh()?;
        let (_, mr) = self.resources.iter().find(|(d, _)| *d == device)?;
        let stream = match default_stream(handle) {
            Some(stream) => stream,
            None => {
                let key = backend.stream_id(device, handle).ok()?;
                &self.streams[seen_at(&self.streams, key, device)?].2
            }
        };
        Some((mr, stream))
    }
}

/// `f`, in the relaxed capture mode while a capture is announced (see [`capture`]).
pub(crate) fn relaxed_if_announced<T>(backend: &BackendRef, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match capture::announced() {
        true => device::with_relaxed_capture(backend, f),
        false => f(),
    }
}

/// Whether the stream `handle` names can be capturing a CUDA graph: any but the legacy
/// default stream, which cannot.
#[inline]
fn may_capture(handle: RawStream) -> bool {
    !matches!(handle, device::LEGACY_STREAM | device::LEGACY_STREAM_ALIAS)
}

/// Called by PyTorch (its pluggable allocator's `beginAllocateToPool` hook, which
/// `streampool.allocators.torch.use()` sets) just before it begins capturing a CUDA graph
/// on `device`, or by a C caller around a capture of its own: until the matching
/// [`streampool_capture_end`], the entry points ask each stream whether it captures
/// (`cuStreamIsCapturing`; every other question about a capturing stream invalidates the
/// capture) and put off the frees a capture forbids. The other arguments are PyTorch's (a
/// memory pool id and a stream filter, passed by reference) and are not read.
#[no_mangle]
pub extern "C" fn streampool_capture_begin(
    _device: c_int,
    _pool_a: u64,
    _pool_b: u64,
    _filter: *const c_void,
) {
    capture::begin();
}

/// The end of the capture [`streampool_capture_begin`] announced (PyTorch's
/// `endAllocateToPool` hook, called once its capture has ended). Call it however the
/// capture ends, failed included: until then frees through the entry points wait (PyTorch
/// skips its hook when the capture failed; `streampool.allocators.torch.use()` wraps
/// `torch.cuda.CUDAGraph.capture_begin` and `capture_end` to call it then).
#[no_mangle]
pub extern "C" fn streampool_capture_end(_device: c_int, _pool_a: u64, _pool_b: u64) {
    capture::end();
}

/// CUDA graph captures through the entry points (docs/frameworks.md, "CUDA graphs"). While
/// a capture is announced ([`streampool_capture_begin`]), the entry points ask streams
/// whether they capture; outside, they ask nothing (a program that never captures makes
/// no call more, and a stream destroyed by its owner is never asked that: the question on
/// a destroyed handle crashed the process on an H100, as any on such a handle may). CuPy's allocator asks its current
/// stream (alive) at every call. Allocations on capturing streams are graph memory; a free
/// on a capturing stream of memory from before its capture waits until the stream no
/// longer captures; calls on other streams while a capture is announced are made in the
/// relaxed capture mode, where the driver takes them.
pub(crate) mod capture {
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::ffi::c_int;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    use std::sync::Mutex;
    use std::thread::ThreadId;

    use streampool::device::{self, DevPtr, RawStream, LEGACY_STREAM, PER_THREAD_STREAM};
    use streampool::stream::Stream;
    use streampool::{Error, ResourceRef, Result};

    /// Captures announced and not yet ended (PyTorch's hooks come in pairs, nested for a
    /// `torch.cuda.use_mem_pool` region inside a capture).
    static ANNOUNCED: AtomicUsize = AtomicUsize::new(0);
    static STATE: Mutex<State> = Mutex::new(State { captured: None, seen: Vec::new(), deferred: Vec::new() });
    /// Entries of `State::captured`.
    static CAPTURED: AtomicUsize = AtomicUsize::new(0);
    /// `State::deferred` is not empty.
    static PENDING: AtomicBool = AtomicBool::new(false);

    struct State {
        /// Live allocations made on capturing streams, by (device, address): the stream
        /// and `device::backend_epoch()` they were made on.
        captured: Option<HashMap<(c_int, DevPtr), (RawStream, u64)>>,
        /// The streams seen capturing since captures were first announced (allocations'
        /// streams, alive), with the thread for handle 2: when none of them captures any
        /// more while an announcement stays, that capture failed (PyTorch then calls no
        /// end hook) and the announcement is let go.
        seen: Vec<(c_int, RawStream, Option<ThreadId>)>,
        /// Frees put off until no capture is announced.
        deferred: Vec<Deferred>,
    }

    struct Deferred {
        device: c_int,
        handle: RawStream,
        /// Handle 2 names the calling thread's per-thread stream: another thread frees on
        /// the legacy default stream, which is ordered after it.
        thread: Option<ThreadId>,
        /// The backend's epoch when put off: a backend replaced since (a simulated device
        /// exited) took the memory with it.
        epoch: u64,
        /// The resource current when the free came, which made the memory.
        mr: ResourceRef,
        ptr: DevPtr,
        size: usize,
    }

    fn lock() -> std::sync::MutexGuard<'static, State> {
        STATE.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn this_thread(handle: RawStream) -> Option<ThreadId> {
        (handle == PER_THREAD_STREAM).then(|| std::thread::current().id())
    }

    thread_local! {
        /// `(begins, ends)` announced by this thread: PyTorch calls its hooks on the thread
        /// that begins or ends the capture, so a wrapper of its capture calls can tell
        /// whether a call that failed reached its hook ([`hook_calls`]).
        static HOOK_CALLS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        /// The hooks called now on this thread open or close a memory pool region, not a
        /// capture ([`set_region_hooks`]).
        static REGION: Cell<bool> = const { Cell::new(false) };
    }

    pub(crate) fn begin() {
        if REGION.get() {
            return;
        }
        let mut st = lock();
        if ANNOUNCED.fetch_add(1, Relaxed) == 0 {
            st.seen.clear();
        }
        HOOK_CALLS.with(|c| c.set((c.get().0 + 1, c.get().1)));
    }

    pub(crate) fn end() {
        if REGION.get() {
            return;
        }
        let _ = ANNOUNCED.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
        HOOK_CALLS.with(|c| c.set((c.get().0, c.get().1 + 1)));
    }

    /// While `on`, the begin and end hooks called on this thread announce nothing: PyTorch
    /// calls them too around a `torch.cuda.use_mem_pool` region, which captures nothing,
    /// and an announcement there would keep every free waiting until the region's end.
    pub(crate) fn set_region_hooks(on: bool) {
        REGION.set(on);
    }

    /// `(begins, ends)` this thread has announced so far.
    pub(crate) fn hook_calls() -> (u64, u64) {
        HOOK_CALLS.with(Cell::get)
    }

    /// Whether a capture is announced: allocations then ask their stream whether it
    /// captures, frees ask nothing and wait unless they are graph memory, and other calls
    /// are made in the relaxed capture mode.
    #[inline]
    pub(crate) fn announced() -> bool {
        ANNOUNCED.load(Relaxed) != 0
    }

    /// `ptr` was allocated on `handle`, a capturing stream.
    pub(crate) fn allocated(device: c_int, ptr: DevPtr, handle: RawStream) {
        let mut st = lock();
        let epoch = device::backend_epoch();
        st.captured.get_or_insert_with(HashMap::new).insert((device, ptr), (handle, epoch));
        CAPTURED.fetch_add(1, Relaxed);
        let seen = (device, handle, this_thread(handle));
        if !st.seen.contains(&seen) {
            st.seen.push(seen);
        }
    }

    /// Takes the record of graph memory at `ptr`: the stream it was allocated on.
    fn take_captured(device: c_int, ptr: DevPtr) -> Option<RawStream> {
        if CAPTURED.load(Relaxed) == 0 {
            return None;
        }
        let taken = lock().captured.as_mut().and_then(|m| m.remove(&(device, ptr)));
        taken.map(|_| CAPTURED.fetch_sub(1, Relaxed));
        taken.filter(|&(_, epoch)| epoch == device::backend_epoch()).map(|(handle, _)| handle)
    }

    /// Forgets graph memory at `ptr` freed once no capture is announced (the usual path
    /// frees it: the driver's pool, or the sharded pool's record of it).
    pub(crate) fn forget(device: c_int, ptr: DevPtr) {
        take_captured(device, ptr);
    }

    /// Whether an announcement stays only because its capture failed (every stream seen
    /// capturing has stopped): then it is let go.
    fn failed() -> bool {
        let me = std::thread::current().id();
        let mut st = lock();
        if st.seen.is_empty() {
            return false;
        }
        let Ok(backend) = device::backend() else { return false };
        let ended = st.seen.iter().all(|&(device, handle, thread)| match thread {
            Some(t) if t != me => false, // not this thread's to ask
            _ => !backend.stream_capturing(device, handle).unwrap_or(true),
        });
        if ended {
            st.seen.clear();
            ANNOUNCED.store(0, Relaxed);
        }
        ended
    }

    /// A free through the entry points while a capture is announced; `None` when none is
    /// (or the one announced has failed). The free's stream is not asked anything (it may
    /// have been destroyed by its owner: PyTorch frees on the allocation's stream however
    /// long after). Graph memory is freed on the stream it was allocated on (a free node
    /// while that stream captures); anything else waits until no capture is announced, as
    /// PyTorch's own cudaMallocAsync allocator does (on the capturing stream the driver
    /// refuses it; on another the global and thread-local modes do, and the capture is
    /// invalidated; in a pool the block could be reused while the graph may read it).
    pub(crate) fn free_announced(
        device: c_int,
        ptr: DevPtr,
        size: usize,
        handle: RawStream,
    ) -> Option<Result<()>> {
        if !announced() || ptr == 0 || failed() {
            return None;
        }
        let backend = match device::backend() {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let mr = super::current_resource(device)?;
        if let Some(allocated_on) = take_captured(device, ptr) {
            let stream = Stream::capturing(&backend, device, allocated_on);
            return Some(device::with_relaxed_capture(&backend, || mr.deallocate(ptr, size, &stream)));
        }
        let mut st = lock();
        let epoch = device::backend_epoch();
        st.deferred.push(Deferred { device, handle, thread: this_thread(handle), epoch, mr, ptr, size });
        PENDING.store(true, Relaxed);
        Some(Ok(()))
    }

    /// Whether frees are put off (the fast paths then take the full path, which frees
    /// them once no capture is announced).
    #[inline]
    pub(crate) fn pending() -> bool {
        PENDING.load(Relaxed)
    }

    /// Frees what was put off, once no capture is announced: through the resource that
    /// was current at the free, on its stream (another thread's per-thread stream's on the
    /// legacy one; a stream gone, after a device synchronisation, on the legacy one).
    pub(crate) fn drain() {
        if !pending() || announced() {
            return;
        }
        let taken = {
            let mut st = lock();
            PENDING.store(false, Relaxed);
            std::mem::take(&mut st.deferred)
        };
        let me = std::thread::current().id();
        let mut left = Vec::new();
        for d in taken {
            if d.epoch != device::backend_epoch() {
                continue;
            }
            if announced() {
                left.push(d); // a capture announced meanwhile: not into it
                continue;
            }
            let handle = match d.thread {
                Some(t) if t != me => LEGACY_STREAM,
                _ => d.handle,
            };
            let backend = d.mr.backend();
            let done =
                Stream::borrowed_live(backend, handle).and_then(|s| d.mr.deallocate(d.ptr, d.size, &s));
            let done = super::or_where_stream_gone(done, handle, d.device, d.ptr, d.size, Some(&d.mr));
            match done {
                Ok(()) | Err(Error::DriverNotFound(_)) => {}
                Err(e) => {
                    let (ptr, size) = (d.ptr, d.size);
                    let what =
                        || format!("a free put off during a CUDA graph capture (ptr={ptr:#x}, size={size})");
                    super::failed::<()>(what, e, true);
                }
            }
        }
        if !left.is_empty() {
            let mut st = lock();
            st.deferred.extend(left);
            PENDING.store(true, Relaxed);
        }
    }
}

/// Where the stream of `key` on `device` is among the streams a thread has seen.
#[inline]
fn seen_at(seen: &[(u64, i32, Stream)], key: u64, device: i32) -> Option<usize> {
    seen.iter().position(|(k, d, _)| *k == key && *d == device)
}

/// The default stream `handle` names (0 or 1: the legacy one, 2: the per-thread one).
fn default_stream(handle: RawStream) -> Option<&'static Stream> {
    match handle {
        device::LEGACY_STREAM | device::LEGACY_STREAM_ALIAS => Some(&LEGACY),
        device::PER_THREAD_STREAM => Some(&PER_THREAD),
        _ => None,
    }
}

/// The stream `handle` names, for use on `device`: a default stream, or one this thread
/// has seen (told from a new stream with a reused handle value by its key), or one looked
/// up now and kept.
fn stream<'a>(
    seen: &'a mut Vec<(u64, i32, Stream)>,
    backend: &BackendRef,
    device: i32,
    handle: RawStream,
) -> Result<&'a Stream> {
    if let Some(stream) = default_stream(handle) {
        return Ok(stream);
    }
    let key = backend.stream_id(device, handle).map_err(|e| match e {
        Error::InvalidStream(_) => e,
        e => Error::InvalidStream(format!("stream handle {handle:#x} of device {device}: {e}")),
    })?;
    if let Some(at) = seen_at(seen, key, device) {
        return Ok(&seen[at].2);
    }
    // The caller's stream is live (PyTorch's allocator, CuPy's current stream).
    let stream = Stream::borrowed_live(backend, handle)?;
    stream.check(backend, device)?;
    if seen.len() == STREAMS_KEPT {
        seen.remove(0);
    }
    seen.push((key, device, stream));
    Ok(&seen.last().expect("pushed").2)
}
