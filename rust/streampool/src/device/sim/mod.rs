//! The simulated device: host memory standing in for device memory, streams as queues
//! whose work runs only when told, and a happens-before race detector.
//!
//! # Model
//!
//! * **Memory.** Every allocation is a real, zeroed host allocation aligned to 256
//!   bytes, so pointers are host addresses and data round-trips through memset/memcpy.
//!   Device, managed and pool memory count against the capacity the device was made
//!   with (managed memory does not oversubscribe here, so that out-of-memory paths of
//!   managed resources are testable); pinned host memory does not. Every call that
//!   names memory is validated against the live allocations: freeing something not
//!   live (double free, foreign pointer) or with the wrong call, and touching bytes
//!   outside a live allocation (use after free), are errors, and change nothing.
//! * **Streams.** Handles 0 and 1 are the legacy default stream and 2 the calling
//!   thread's per-thread default stream (one per host thread, made on first use). Created
//!   streams get handles counting up from `0x1000`; a destroyed stream's handle is
//!   reused, most recently destroyed first, while its queued work still runs. Each
//!   stream also has an id that is never reused (`cuStreamGetId`). A handle that names
//!   no live stream is an error.
//! * **Execution.** Work runs only when the program says so: [`SimDevice::step`],
//!   [`SimDevice::step_any`], [`SimDevice::run`], or a host synchronisation (stream,
//!   event, context; `cuMemFree` and `cuMemFreeHost`, which wait for the memory's device;
//!   a copy into pageable host memory, which waits for itself). A synchronisation runs
//!   only what it waits for (a context's: that device's work, and what that depends on).
//!   Event and stream queries never run work, so a host loop that polls a query until
//!   the work is done waits for ever unless something runs it: [`SimDevice::set_eager`]
//!   (the device of `STREAMPOOL_DEVICE=sim` is reached through
//!   [`crate::device::simulated`]). The ordering model (module `exec`) is the design's
//!   "ordered".
//! * **Race detector.** Each memory access is checked when it executes against the
//!   previous conflicting access to the same bytes (module `detector`); unordered pairs are
//!   kept as [`Race`]s, each pair once.
//! * **Pools.** The driver's stream-ordered pools with its default reuse policy,
//!   release threshold, trimming and attributes (module `pool`). `cuMemFree` takes pool
//!   memory as the driver does, without synchronising; `cuMemFreeAsync` of memory not from
//!   a pool is refused (a stream-ordered free of other memory is not modelled).
//! * **Managed memory.** `cuMemAllocManaged` memory and managed pools' memory accept
//!   prefetches, and `cuMemAllocManaged` memory advice; other live memory is refused as
//!   the driver refuses it (`CUDA_ERROR_INVALID_VALUE`; advice on a managed pool's memory,
//!   `CUDA_ERROR_NOT_SUPPORTED`). A prefetch is an operation on its stream, and the range's
//!   last prefetch location is recorded when it is *enqueued*, as the driver's
//!   `CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION` reports the last location asked for,
//!   not one reached. The device reports a CUDA 13.0 driver and concurrent managed access;
//!   [`SimDevice::set_driver_version`] and [`SimDevice::set_concurrent_managed_access`]
//!   make it report less, and then refuse managed pools as such a driver does.
//! * **Virtual memory.** Reserved address space and device memory mapped into it, with a
//!   granularity of [`VMM_GRANULARITY`] (module `vmm`). Mapped memory counts against the
//!   capacity; adjacent mappings of one reservation are one range that accesses may span.
//!
//! # Lifetime
//!
//! [`SimDevice::activate`] makes a device the process's backend until its [`SimGuard`]
//! is dropped; the device is then closed: every call on it fails with a clear error,
//! except the destroy and free family, which succeed silently (objects dropped after a
//! simulation ends must neither fail nor print). All state lives in the device, behind
//! one lock that is never held across a call out of this module.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::CStr;
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::device::{
    Advice, Backend, BackendKind, DevPtr, DeviceInfo, Location, PoolAttr, PoolProps, PtrExportData, RawEvent,
    RawFunction, RawModule, RawPool, RawStream, RawVmm, LEGACY_STREAM, LEGACY_STREAM_ALIAS,
    PER_THREAD_STREAM,
};
use crate::error::{Error, Result, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY};

mod capture;
mod clock;
mod detector;
mod exec;
mod ipc;
mod kernel;
mod memory;
mod peer;
mod pool;
#[cfg(test)]
mod tests;
mod vmm;

use clock::VClock;
pub use detector::{OpInfo, OpKind, Race, MAX_RACES};
use exec::{Op, Work};
pub use exec::{MAX_BACKLOG_ENTRIES, MAX_BACKLOG_OPS};
use memory::{invalid_device, invalid_value, AllocKind};
use pool::Pool;
pub use vmm::VMM_GRANULARITY;

/// The driver version the simulated device reports (CUDA 13.0).
pub const SIM_DRIVER_VERSION: i32 = 13000;

/// The most devices one simulated backend has ([`SimDevice::with_devices`]).
pub const MAX_DEVICES: i32 = 1024;

/// The largest capacity [`default_capacity`] gives: 16 GiB.
pub const MAX_DEFAULT_CAPACITY: usize = 16 << 30;

/// The capacity of a simulated device made without one: what this process may take of the
/// host's memory now (`MemAvailable` in `/proc/meminfo`, and what the address-space limit
/// of `ulimit -v` leaves), rounded down to a whole MiB, at most [`MAX_DEFAULT_CAPACITY`]
/// and at least 1 MiB. Simulated memory is host memory: a capacity beyond what the host can give
/// would turn out-of-memory into a host failure (or the kernel's OOM killer) instead of
/// the device's clean [`Error::OutOfMemory`]. Where neither figure can be read, 16 GiB.
pub fn default_capacity() -> usize {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|m| proc_field(m, "MemAvailable:")).map(|kib| kib << 10);
    let limits = std::fs::read_to_string("/proc/self/limits").ok();
    let status = std::fs::read_to_string("/proc/self/status").ok();
    let in_use = status.as_deref().and_then(|s| proc_field(s, "VmSize:")).map_or(0, |kib| kib << 10);
    let address_space =
        limits.as_deref().and_then(|l| proc_field(l, "Max address space")).map(|l| l.saturating_sub(in_use));
    let capacity = [available, address_space].into_iter().flatten().fold(MAX_DEFAULT_CAPACITY, usize::min);
    (capacity >> 20).max(1) << 20
}

/// The first number after `key` at the start of a line of a `/proc` file (`None` for
/// "unlimited" or no such line).
fn proc_field(text: &str, key: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// The first handle of a created stream; later ones count up by `STREAM_HANDLE_STEP`.
const FIRST_STREAM_HANDLE: RawStream = 0x1000;
const STREAM_HANDLE_STEP: RawStream = 0x10;
/// The first event handle; later ones count up by 0x10.
const FIRST_EVENT_HANDLE: RawEvent = 0xe000_0000;

/// Ids of simulated devices; 0 is the CUDA backend.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A simulated CUDA device (or several, with [`SimDevice::with_devices`]). See the
/// module docs for what it models. Any thread may call anything.
pub struct SimDevice {
    id: u64,
    capacity: usize,
    devices: i32,
    closed: AtomicBool,
    /// What `cuDriverGetVersion` reports ([`SIM_DRIVER_VERSION`] unless set).
    driver_version: AtomicI32,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS` (true unless set).
    concurrent_managed_access: AtomicBool,
    state: Mutex<State>,
    /// Run work as soon as it may ([`SimDevice::set_eager`]).
    eager: AtomicBool,
}

/// Keeps a [`SimDevice`] active (the process's backend) until dropped; dropping it
/// closes the device.
#[must_use = "the device is deactivated (and closed) when the guard is dropped"]
pub struct SimGuard {
    device: Arc<SimDevice>,
}

impl SimGuard {
    /// The active device.
    pub fn device(&self) -> &Arc<SimDevice> {
        &self.device
    }
}

impl Drop for SimGuard {
    fn drop(&mut self) {
        self.device.deactivate();
    }
}

impl fmt::Debug for SimGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimGuard({})", self.device.describe())
    }
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDevice")
            .field("id", &self.id)
            .field("capacity", &self.capacity)
            .field("devices", &self.devices)
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

/// Everything the device knows, behind one lock.
#[derive(Debug)]
struct State {
    /// "simulated device #N", for messages.
    name: String,
    /// Per device.
    capacity: usize,
    devices: Vec<DevState>,
    /// Streams by id, including destroyed ones whose work has not all run.
    streams: BTreeMap<u64, StreamState>,
    /// Live created streams by handle.
    handles: HashMap<RawStream, u64>,
    /// Per-thread default streams by (thread, device).
    per_thread: HashMap<(ThreadId, i32), u64>,
    /// Handles of destroyed streams, the most recently destroyed last.
    free_handles: Vec<RawStream>,
    next_handle: RawStream,
    next_stream_id: u64,
    events: HashMap<RawEvent, EventState>,
    next_event: RawEvent,
    /// Live allocations by address (pool allocations included).
    allocs: BTreeMap<u64, memory::Alloc>,
    /// Pool chunks by address: (length, pool).
    chunks: BTreeMap<u64, (usize, RawPool)>,
    pools: BTreeMap<RawPool, Pool>,
    /// Pools imported from other processes (module `ipc`).
    imports: BTreeMap<RawPool, ipc::ImportedPool>,
    next_pool: RawPool,
    /// Operations executed so far (the completion order).
    completions: u64,
    /// Operations queued on all streams.
    pending: usize,
    /// Entries of the queued operations' clocks, summed (what the backlog costs beside
    /// the operations themselves: `exec::MAX_BACKLOG_ENTRIES`).
    clock_entries: usize,
    /// Operations run early because the backlog was full (`exec::MAX_BACKLOG_OPS`).
    ran_early: u64,
    /// Stream id last stepped by `step_any`.
    cursor: u64,
    /// Kernel writes enqueued so far (their fill pattern).
    writes: u64,
    /// Loaded modules: the kernels of each.
    modules: HashMap<RawModule, Vec<kernel::Kernel>>,
    next_module: RawModule,
    /// Kernel handles from `cuModuleGetFunction`.
    functions: HashMap<RawFunction, kernel::Kernel>,
    next_function: RawFunction,
    shadow: detector::Shadow,
    races: detector::RaceLog,
    /// Which device's work may touch which device's memory (module `peer`).
    peers: peer::Peers,
    /// Reservations of address space by address, with their mappings (module `vmm`).
    reservations: BTreeMap<u64, vmm::Reservation>,
    next_vmm: RawVmm,
    /// Live allocations made on a capturing stream (module `capture`).
    captured_allocs: std::collections::BTreeSet<DevPtr>,
}

#[derive(Debug)]
struct DevState {
    /// Id of its legacy default stream.
    legacy: u64,
    /// Bytes of device and managed allocations.
    allocated: usize,
    /// Bytes reserved by its pools.
    reserved: usize,
    /// Default and current pools, indexed by `managed as usize`.
    default_pool: [RawPool; 2],
    current_pool: [RawPool; 2],
}

#[derive(Debug)]
struct StreamState {
    /// The handle it is known by (0 for legacy, 2 for per-thread).
    handle: RawStream,
    dev: i32,
    /// Synchronises with the legacy stream (the legacy and per-thread default streams,
    /// and streams created blocking).
    blocking: bool,
    legacy: bool,
    /// False once destroyed.
    live: bool,
    /// Last sequence number given out.
    seq: u64,
    /// Last sequence number executed.
    completed: u64,
    /// What later work on the stream is ordered after (pruned of completed work).
    clock: VClock,
    queue: VecDeque<Op>,
    /// Capturing a graph (module `capture`): `Some(invalidated)`.
    capture: Option<bool>,
}

impl StreamState {
    fn new(handle: RawStream, dev: i32, blocking: bool, legacy: bool) -> Self {
        StreamState {
            handle,
            dev,
            blocking,
            legacy,
            live: true,
            seq: 0,
            completed: 0,
            clock: VClock::default(),
            queue: VecDeque::new(),
            capture: None,
        }
    }
}

#[derive(Debug)]
struct EventState {
    dev: i32,
    /// Where it was last recorded: the record operation (stream id, seq) and its clock.
    recorded: Option<(u64, u64, VClock)>,
    /// Last recorded on a capturing stream.
    captured: bool,
}

/// `CUDA_ERROR_OUT_OF_MEMORY` from `call`.
fn oom(call: &'static str) -> Error {
    Error::Driver {
        call,
        code: CUDA_ERROR_OUT_OF_MEMORY,
        name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        context: String::new(),
    }
}

/// The host's allocator refusing to back `bytes` of simulated memory (`ulimit -v`, a
/// machine with less memory than the capacity): [`Error::OutOfMemory`] naming the host as
/// what limited the request, since the device may have had room.
fn host_refused(st: &State, bytes: usize) -> Error {
    Error::OutOfMemory {
        requested: bytes,
        available: None,
        resource: format!(
            "the host memory behind {} (the host refused; the device's {} capacity is more than \
             this process can get: give it a smaller capacity_bytes, or STREAMPOOL_SIM_CAPACITY)",
            st.name,
            human_bytes(st.capacity)
        ),
    }
}

/// "16 GiB", "64 MiB", "1000 bytes".
fn human_bytes(n: usize) -> String {
    for (unit, name) in [(1usize << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if n >= unit && n.is_multiple_of(unit) {
            return format!("{} {name}", n / unit);
        }
    }
    format!("{n} bytes")
}

impl State {
    fn new(id: u64, capacity: usize, devices: i32) -> Self {
        let mut st = State {
            name: format!("simulated device #{id}"),
            capacity,
            devices: Vec::new(),
            streams: BTreeMap::new(),
            handles: HashMap::new(),
            per_thread: HashMap::new(),
            free_handles: Vec::new(),
            next_handle: FIRST_STREAM_HANDLE,
            next_stream_id: 1,
            events: HashMap::new(),
            next_event: FIRST_EVENT_HANDLE,
            allocs: BTreeMap::new(),
            chunks: BTreeMap::new(),
            pools: BTreeMap::new(),
            imports: BTreeMap::new(),
            next_pool: pool::FIRST_POOL,
            completions: 0,
            pending: 0,
            clock_entries: 0,
            ran_early: 0,
            cursor: 0,
            writes: 0,
            modules: HashMap::new(),
            next_module: kernel::FIRST_MODULE,
            functions: HashMap::new(),
            next_function: kernel::FIRST_FUNCTION,
            shadow: Default::default(),
            races: Default::default(),
            peers: Default::default(),
            reservations: BTreeMap::new(),
            next_vmm: vmm::FIRST_HANDLE,
            captured_allocs: Default::default(),
        };
        for dev in 0..devices {
            let legacy = st.new_stream(LEGACY_STREAM, dev, true, true);
            let pools = [st.new_pool(dev, false, true), st.new_pool(dev, true, true)];
            st.devices.push(DevState {
                legacy,
                allocated: 0,
                reserved: 0,
                default_pool: pools,
                current_pool: pools,
            });
        }
        st
    }

    fn new_stream(&mut self, handle: RawStream, dev: i32, blocking: bool, legacy: bool) -> u64 {
        let id = self.next_stream_id;
        self.next_stream_id += 1;
        self.streams.insert(id, StreamState::new(handle, dev, blocking, legacy));
        id
    }

    /// The id of the stream `handle` names in a call for device `dev` (`None`: the
    /// device of a created stream, device 0 for the default streams).
    fn resolve(&mut self, dev: Option<i32>, handle: RawStream) -> Result<u64> {
        match handle {
            LEGACY_STREAM | LEGACY_STREAM_ALIAS => {
                let dev = dev.unwrap_or(0);
                self.refuse_legacy_while_blocking_captures(dev)?;
                Ok(self.devices[dev as usize].legacy)
            }
            PER_THREAD_STREAM => {
                let key = (std::thread::current().id(), dev.unwrap_or(0));
                if let Some(&id) = self.per_thread.get(&key) {
                    return Ok(id);
                }
                let id = self.new_stream(PER_THREAD_STREAM, key.1, true, false);
                self.per_thread.insert(key, id);
                Ok(id)
            }
            h => {
                let Some(&id) = self.handles.get(&h) else {
                    return Err(Error::InvalidStream(format!(
                        "{h:#x} names no live stream of {} (never created, or destroyed)",
                        self.name
                    )));
                };
                let owner = self.streams[&id].dev;
                match dev {
                    Some(d) if d != owner => Err(Error::InvalidStream(format!(
                        "stream {h:#x} belongs to device {owner} of {}, not to device {d}",
                        self.name
                    ))),
                    _ => Ok(id),
                }
            }
        }
    }

    fn event(&self, handle: RawEvent) -> Result<&EventState> {
        self.events.get(&handle).ok_or_else(|| {
            Error::InvalidStream(format!(
                "event {handle:#x} is not a live event of {} (never created, or destroyed)",
                self.name
            ))
        })
    }

    fn event_done(&self, handle: RawEvent) -> Result<bool> {
        Ok(match &self.event(handle)?.recorded {
            Some((sid, seq, _)) => self.is_done(*sid, *seq),
            None => true,
        })
    }

    /// Enqueues a copy (`cuMemcpyAsync`, `cuMemcpyPeerAsync`) on `sid`. Into pageable host
    /// memory the call returns only once the copy has completed ("API synchronization
    /// behavior": from device memory, and from host memory as every host-to-host copy),
    /// so the host waits for it and for what it follows; into simulated memory (pinned host
    /// memory included) it stays queued.
    fn enqueue_copy(&mut self, sid: u64, copy: Work) {
        let pageable_dst = matches!(copy, Work::Copy { dst_sim: false, .. });
        self.enqueue(sid, copy, OpKind::Memcpy, "", None);
        if pageable_dst {
            let seq = self.streams[&sid].seq;
            self.drive(sid, seq);
        }
    }

    /// A host synchronisation: runs what `sid` has queued up to `seq`, then lets pools
    /// release memory above their thresholds.
    fn host_wait(&mut self, sid: u64, seq: u64) {
        self.drive(sid, seq);
        self.apply_thresholds();
    }
}

impl SimDevice {
    /// A simulated device with `capacity_bytes` of device memory.
    pub fn new(capacity_bytes: usize) -> Arc<SimDevice> {
        Self::with_devices(capacity_bytes, 1)
    }

    /// `devices` simulated devices (ordinals `0..devices`) of `capacity_bytes` each, behind
    /// one backend. `devices` is clamped to `1..=`[`MAX_DEVICES`] (the Python binding
    /// refuses other values with a ValueError).
    pub fn with_devices(capacity_bytes: usize, devices: i32) -> Arc<SimDevice> {
        let devices = devices.clamp(1, MAX_DEVICES);
        crate::device::watch_fork();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Arc::new(SimDevice {
            id,
            capacity: capacity_bytes,
            devices,
            closed: AtomicBool::new(false),
            driver_version: AtomicI32::new(SIM_DRIVER_VERSION),
            concurrent_managed_access: AtomicBool::new(true),
            state: Mutex::new(State::new(id, capacity_bytes, devices)),
            eager: AtomicBool::new(false),
        })
    }

    /// Makes this device the process's backend (what [`crate::device::backend`] returns)
    /// until the guard is dropped. Fails when another simulated device is active, or
    /// when this one is closed.
    pub fn activate(self: &Arc<Self>) -> Result<SimGuard> {
        self.check_open()?;
        crate::device::set_active_sim(Some(self.clone()))?;
        Ok(SimGuard { device: self.clone() })
    }

    /// Closes the device, and stops it being the process's backend if it was. Every call
    /// that reaches it is refused from now on (frees succeed silently); memory that a
    /// resource already holds (a pool's free blocks) may still be handed out without
    /// asking it, so a resource should not be used after its device is closed. Reserved
    /// address space, and the memory mapped into it, goes back to the host now; other
    /// memory when the device is dropped.
    pub fn deactivate(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.lock().release_vmm();
        if crate::device::active_sim().is_some_and(|a| a.id == self.id) {
            let _ = crate::device::set_active_sim(None);
        }
    }

    /// `cuStreamBeginCapture` (global mode) on `stream` of device `dev`: from now until
    /// [`end_capture`](Self::end_capture), the calls a capture forbids fail as the driver's
    /// do and invalidate it (module `capture`); work on the stream still runs.
    pub fn begin_capture(&self, dev: i32, stream: RawStream) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.begin_capture(sid, stream)
        })
    }

    /// `cuStreamEndCapture`: ends `stream`'s capture; `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
    /// when a forbidden call invalidated it.
    pub fn end_capture(&self, dev: i32, stream: RawStream) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.end_capture(sid, stream)
        })
    }

    /// Whether the device has been closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Device memory of each device, in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes the device report driver `version` (e.g. 12040 for CUDA 12.4) from now on.
    /// Below 13000 it has no managed pools: asking for one is refused as the CUDA backend
    /// refuses it on such a driver ([`Error::Unsupported`]). Pools already made stay.
    pub fn set_driver_version(&self, version: i32) {
        self.driver_version.store(version, Ordering::SeqCst);
    }

    /// Makes the device report (or not) concurrent managed access from now on; without it
    /// there are no managed pools, and prefetches and advice that names a GPU as preferred
    /// location or as accessed by are refused (`CUDA_ERROR_INVALID_DEVICE`), as the driver
    /// does.
    pub fn set_concurrent_managed_access(&self, yes: bool) {
        self.concurrent_managed_access.store(yes, Ordering::SeqCst);
    }

    /// Makes devices `a` and `b` able (or not) to reach each other's memory from now on
    /// (`cuDeviceCanAccessPeer` both ways; every pair of distinct devices can until told
    /// otherwise), to test code that meets GPUs without a peer link. Taking it away also
    /// disables context peer access between them; pools' grants stay.
    pub fn set_peer_capable(&self, a: i32, b: i32, yes: bool) -> Result<()> {
        self.check_dev(a)?;
        self.check_dev(b)?;
        self.with(None, |st| {
            st.peers.set_capable(a, b, yes);
            Ok(())
        })
    }

    fn managed_pools(&self) -> bool {
        self.driver_version.load(Ordering::SeqCst) >= 13000
            && self.concurrent_managed_access.load(Ordering::SeqCst)
    }

    /// What the CUDA backend says of managed pools where the device has none.
    fn require_managed_pools(&self, dev: i32) -> Result<()> {
        if self.managed_pools() {
            return Ok(());
        }
        let version = self.driver_version.load(Ordering::SeqCst);
        if version < 13000 {
            return Err(Error::Unsupported(format!(
                "managed memory pools need a CUDA 13 driver (found {}.{})",
                version / 1000,
                (version % 1000) / 10
            )));
        }
        Err(Error::Unsupported(format!(
            "managed memory pools need concurrent managed access, which device {dev} of simulated device #{} lacks",
            self.id
        )))
    }

    /// A simulated kernel that writes `[ptr, ptr + bytes)` on `stream`: each byte gets
    /// the same value, different for successive writes (never 0).
    pub fn write(&self, stream: RawStream, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.kernel(stream, ptr, bytes, "", true)
    }

    /// [`Self::write`], named `label` in race reports.
    pub fn write_labeled(&self, stream: RawStream, ptr: DevPtr, bytes: usize, label: &str) -> Result<()> {
        self.kernel(stream, ptr, bytes, label, true)
    }

    /// A simulated kernel that reads `[ptr, ptr + bytes)` on `stream`.
    pub fn read(&self, stream: RawStream, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.kernel(stream, ptr, bytes, "", false)
    }

    /// [`Self::read`], named `label` in race reports.
    pub fn read_labeled(&self, stream: RawStream, ptr: DevPtr, bytes: usize, label: &str) -> Result<()> {
        self.kernel(stream, ptr, bytes, label, false)
    }

    /// A simulated kernel on `stream` that writes (or reads) `[ptr, ptr + bytes)`. A
    /// default stream handle (legacy or per-thread) names that stream of the device whose
    /// memory `ptr` is, as in a program that made that device current.
    pub fn kernel(
        &self,
        stream: RawStream,
        ptr: DevPtr,
        bytes: usize,
        label: &str,
        writes: bool,
    ) -> Result<()> {
        self.with(None, |st| {
            // A default stream is the one of the device whose memory the kernel touches (as
            // a program makes that device current first); device 0's for a bad address.
            let owner = st.alloc_containing(ptr, bytes.max(1)).map(|(_, a)| a.dev);
            let sid = st.resolve(owner, stream).or_else(|_| st.resolve(None, stream))?;
            if bytes == 0 {
                return Ok(());
            }
            let dev = st.streams[&sid].dev;
            st.check_range(ptr, bytes, if writes { "write" } else { "read" })?;
            st.check_access(
                dev,
                ptr,
                bytes,
                if writes { "a kernel writing" } else { "a kernel reading" },
                false,
            )?;
            if writes {
                st.writes += 1;
                let value = (st.writes % 255) as u8 + 1;
                st.enqueue(sid, Work::Fill { ptr, bytes, value }, OpKind::Write, label, None);
            } else {
                st.enqueue(sid, Work::Read { ptr, bytes }, OpKind::Read, label, None);
            }
            Ok(())
        })
    }

    /// Runs the operation at the head of `stream`'s queue if it may run now; false when
    /// the queue is empty or the head waits for other work.
    pub fn step(&self, stream: RawStream) -> Result<bool> {
        self.with(None, |st| {
            let sid = st.resolve(None, stream)?;
            if st.runnable(sid) {
                st.execute_head(sid);
                return Ok(true);
            }
            Ok(false)
        })
    }

    /// Runs one operation that may run now, taking streams in turn (destroyed streams'
    /// remaining work included); false when there is none (or the device is closed).
    pub fn step_any(&self) -> bool {
        self.with(None, |st| Ok(st.step_any())).unwrap_or(false)
    }

    /// Eager execution (off by default): from now on, every call runs all work that may
    /// run before it returns, so work completes as soon as what it waits on has, as on a
    /// GPU running work with no kernels (events recorded on an idle stream complete at
    /// once). Off, work runs only when stepped or synchronised. Work that has run before
    /// other work is enqueued is ordered before it (as always here), so an eager device
    /// finds no races: use it to model a GPU's timing (footprints, completions), and a
    /// device that runs work when told to check orderings.
    pub fn set_eager(&self, yes: bool) {
        self.eager.store(yes, Ordering::Relaxed);
        if yes {
            self.run();
        }
    }

    /// Runs everything queued, streams in turn, until no stream has work.
    pub fn run(&self) {
        while self.step_any() {}
    }

    /// Operations queued on all streams and not yet run.
    pub fn pending(&self) -> usize {
        self.lock().pending
    }

    /// Operations queued on `stream` and not yet run.
    pub fn queued(&self, stream: RawStream) -> Result<usize> {
        self.with(None, |st| {
            let sid = st.resolve(None, stream)?;
            Ok(st.streams[&sid].queue.len())
        })
    }

    /// The races found so far (at most [`MAX_RACES`]), in the order they were found.
    pub fn races(&self) -> Vec<Race> {
        self.lock().races.races()
    }

    /// The races found so far; forgets them.
    pub fn take_races(&self) -> Vec<Race> {
        self.lock().races.take()
    }

    /// Events created and not yet destroyed (a test's check that state kept per stream
    /// does not keep an event per stream ever used).
    pub fn live_events(&self) -> usize {
        self.lock().events.len()
    }

    /// Races found beyond [`MAX_RACES`], which were not kept.
    pub fn races_dropped(&self) -> usize {
        self.lock().races.dropped()
    }

    /// Operations run early because too much work waited unrun: more than
    /// [`MAX_BACKLOG_OPS`] operations, or clocks of more than [`MAX_BACKLOG_ENTRIES`]
    /// entries, queued and never synchronised. A GPU's queues are bounded too (a launch
    /// waits when they are full); here the work that may run then runs, streams in turn,
    /// until half of that is left. Work queued afterwards is ordered after what ran, so a
    /// race between the two goes unreported: a count above 0 says the program queued more
    /// than the detector follows between synchronisations. A chain of streams each waiting
    /// on the last gives each new operation a clock entry per stream in flight: it reaches
    /// the bound on entries after about 1,100 such streams, with a few thousand operations.
    pub fn ran_early(&self) -> u64 {
        self.lock().ran_early
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_open(&self) -> Result<()> {
        crate::device::check_not_forked()?;
        if self.is_closed() {
            return Err(Error::InvalidArgument(format!(
                "simulated device #{} is closed; objects made under it cannot be used outside it",
                self.id
            )));
        }
        Ok(())
    }

    fn check_dev(&self, dev: i32) -> Result<()> {
        if (0..self.devices).contains(&dev) {
            return Ok(());
        }
        let why = crate::resources::no_such_device(&self.describe(), self.devices);
        Err(Error::InvalidArgument(format!("device {dev} {why}")))
    }

    /// Runs `f` on the state of an open device, for device `dev` if given.
    fn with<T>(&self, dev: Option<i32>, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        self.check_open()?;
        if let Some(d) = dev {
            self.check_dev(d)?;
        }
        let mut st = self.lock();
        let result = f(&mut st);
        if st.pending > 0 && self.eager.load(Ordering::Relaxed) {
            while st.step_any() {}
        }
        result
    }

    /// [`Self::with`] for the destroy and free family: silent success once closed, and in a
    /// forked child.
    fn with_release(&self, dev: i32, f: impl FnOnce(&mut State) -> Result<()>) -> Result<()> {
        // Nor in a forked child, where the parent's objects are let go without their device
        // (whose lock a thread of the parent may have held at the fork).
        if self.is_closed() || crate::device::forked() {
            return Ok(());
        }
        self.with(Some(dev), f)
    }
}

impl Backend for SimDevice {
    fn kind(&self) -> BackendKind {
        BackendKind::Simulated
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn check_open(&self) -> Result<()> {
        SimDevice::check_open(self)
    }

    fn describe(&self) -> String {
        if self.devices == 1 {
            format!("simulated device #{} ({})", self.id, human_bytes(self.capacity))
        } else {
            format!(
                "simulated device #{} ({} devices, {} each)",
                self.id,
                self.devices,
                human_bytes(self.capacity)
            )
        }
    }

    fn driver_version(&self) -> Result<i32> {
        self.check_open()?;
        Ok(self.driver_version.load(Ordering::SeqCst))
    }

    fn device_count(&self) -> Result<i32> {
        self.check_open()?;
        Ok(self.devices)
    }

    fn current_device(&self) -> Result<i32> {
        self.check_open()?;
        Ok(0)
    }

    fn device_info(&self, dev: i32) -> Result<DeviceInfo> {
        self.with(Some(dev), |_| {
            Ok(DeviceInfo {
                ordinal: dev,
                name: "streampool simulated device".into(),
                total_bytes: self.capacity,
                memory_pools: true,
                managed_pools: self.managed_pools(),
                concurrent_managed_access: self.concurrent_managed_access.load(Ordering::SeqCst),
                posix_fd_ipc: true,
            })
        })
    }

    fn mem_get_info(&self, dev: i32) -> Result<(usize, usize)> {
        self.with(Some(dev), |st| Ok((st.free_bytes(dev), st.capacity)))
    }

    fn mem_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemAlloc")?;
            st.alloc_plain(dev, bytes, AllocKind::Device)
        })
    }

    fn mem_free(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        self.with_release(dev, |st| {
            st.refuse_while_capturing("cuMemFree")?;
            st.captured_allocs.remove(&ptr);
            if ptr == 0 {
                Ok(())
            } else {
                st.free_plain(ptr, false)
            }
        })
    }

    fn mem_alloc_managed(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemAllocManaged")?;
            st.alloc_plain(dev, bytes, AllocKind::Managed)
        })
    }

    fn mem_host_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemHostAlloc")?;
            st.alloc_plain(dev, bytes, AllocKind::Pinned)
        })
    }

    fn mem_free_host(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        self.with_release(dev, |st| {
            st.refuse_while_capturing("cuMemFreeHost")?;
            if ptr == 0 {
                Ok(())
            } else {
                st.free_plain(ptr, true)
            }
        })
    }

    fn pool_default(&self, dev: i32, managed: bool) -> Result<RawPool> {
        if managed {
            self.require_managed_pools(dev)?;
        }
        self.with(Some(dev), |st| Ok(st.devices[dev as usize].default_pool[managed as usize]))
    }

    fn pool_current(&self, dev: i32, managed: bool) -> Result<RawPool> {
        if managed {
            self.require_managed_pools(dev)?;
        }
        self.with(Some(dev), |st| Ok(st.devices[dev as usize].current_pool[managed as usize]))
    }

    fn pool_set_current(&self, dev: i32, pool: RawPool) -> Result<()> {
        self.with(Some(dev), |st| {
            let p = st.pool(pool)?;
            if p.dev != dev {
                return Err(Error::InvalidArgument(format!(
                    "pool {pool:#x} belongs to device {}, so it cannot be device {dev}'s current pool",
                    p.dev
                )));
            }
            let managed = p.managed as usize;
            st.devices[dev as usize].current_pool[managed] = pool;
            Ok(())
        })
    }

    fn pool_create(&self, dev: i32, props: &PoolProps) -> Result<RawPool> {
        if props.managed {
            self.require_managed_pools(dev)?;
        }
        if props.managed && props.posix_fd_ipc {
            // As the driver: managed pools have no IPC handle types.
            return Err(invalid_value("cuMemPoolCreate").context("managed memory pools cannot be exported"));
        }
        self.with(Some(dev), |st| {
            // An exportable pool's chunks live in a shared-memory file (module `ipc`).
            let arena = match props.posix_fd_ipc {
                true => Some(ipc::Arena::new(dev).map_err(|e| {
                    Error::Unsupported(format!(
                        "a shared-memory file for an exportable pool could not be made: {e}"
                    ))
                })?),
                false => None,
            };
            let pool = st.new_pool(dev, props.managed, false);
            st.pools.get_mut(&pool).expect("just made").arena = arena;
            Ok(pool)
        })
    }

    fn pool_destroy(&self, dev: i32, pool: RawPool) -> Result<()> {
        self.with_release(dev, |st| st.pool_destroy(pool))
    }

    fn pool_get_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr) -> Result<u64> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemPoolGetAttribute")?;
            st.pool_attr(pool, attr)
        })
    }

    fn pool_set_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr, value: u64) -> Result<()> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemPoolSetAttribute")?;
            st.set_pool_attr(pool, attr, value)
        })
    }

    fn pool_trim_to(&self, dev: i32, pool: RawPool, keep_bytes: usize) -> Result<()> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuMemPoolTrimTo")?;
            st.pool_trim(pool, keep_bytes)
        })
    }

    fn pool_alloc_async(&self, dev: i32, pool: RawPool, bytes: usize, stream: RawStream) -> Result<DevPtr> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            let captured = st.check_capture_alloc(sid)?;
            let ptr = st.pool_alloc(pool, bytes, sid)?;
            if captured {
                st.captured_allocs.insert(ptr);
            }
            Ok(ptr)
        })
    }

    fn free_async(&self, dev: i32, ptr: DevPtr, stream: RawStream) -> Result<()> {
        self.with_release(dev, |st| {
            let sid = st.resolve(Some(dev), stream)?;
            if ptr == 0 {
                return Ok(());
            }
            st.check_capture_free(sid, ptr)?;
            st.pool_free(ptr, sid)?;
            st.captured_allocs.remove(&ptr);
            Ok(())
        })
    }

    fn vmm_granularity(&self, dev: i32) -> Result<usize> {
        self.with(Some(dev), |_| Ok(VMM_GRANULARITY))
    }

    fn vmm_reserve(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.with(Some(dev), |st| st.vmm_reserve(bytes))
    }

    fn vmm_free(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.with_release(dev, |st| st.vmm_free(ptr, bytes))
    }

    fn vmm_map(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<RawVmm> {
        self.with(Some(dev), |st| st.vmm_map(dev, ptr, bytes))
    }

    fn vmm_unmap(&self, dev: i32, ptr: DevPtr, bytes: usize, handle: RawVmm) -> Result<()> {
        self.with_release(dev, |st| st.vmm_unmap(ptr, bytes, handle))
    }

    fn pointer_pool(&self, dev: i32, ptr: DevPtr) -> Result<Option<RawPool>> {
        self.with(Some(dev), |st| {
            Ok(match st.live_alloc_at(ptr)?.1.kind {
                AllocKind::Pool(p) | AllocKind::Imported(p) => Some(p),
                _ => None,
            })
        })
    }

    fn pointer_range(&self, dev: i32, ptr: DevPtr) -> Result<(DevPtr, usize)> {
        self.with(Some(dev), |st| st.live_alloc_at(ptr).map(|(start, a)| (start, a.bytes)))
    }

    fn pointer_device(&self, dev: i32, ptr: DevPtr) -> Result<i32> {
        self.with(Some(dev), |st| st.live_alloc_at(ptr).map(|(_, a)| a.dev))
    }

    fn stream_create(&self, dev: i32, blocking: bool) -> Result<RawStream> {
        self.with(Some(dev), |st| {
            let handle = st.free_handles.pop().unwrap_or_else(|| {
                let h = st.next_handle;
                st.next_handle += STREAM_HANDLE_STEP;
                h
            });
            let id = st.new_stream(handle, dev, blocking, false);
            st.handles.insert(handle, id);
            Ok(handle)
        })
    }

    fn stream_destroy(&self, dev: i32, stream: RawStream) -> Result<()> {
        self.with_release(dev, |st| {
            if matches!(stream, LEGACY_STREAM | LEGACY_STREAM_ALIAS | PER_THREAD_STREAM) {
                return Err(Error::InvalidStream(format!(
                    "stream {stream:#x} is a default stream, which cannot be destroyed"
                )));
            }
            let sid = st.resolve(Some(dev), stream)?;
            st.handles.remove(&stream);
            st.free_handles.push(stream);
            let s = st.streams.get_mut(&sid).expect("resolved");
            s.live = false;
            // Its queued work still runs (the stream stays, under its id, until then).
            if s.queue.is_empty() {
                st.streams.remove(&sid);
            }
            Ok(())
        })
    }

    fn stream_id(&self, dev: i32, stream: RawStream) -> Result<u64> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.refuse_on_capturing(sid, "cuStreamGetId")?;
            Ok(sid)
        })
    }

    fn stream_destroyed(&self, stream: RawStream) -> bool {
        // A handle no live stream has (defaults resolve to this thread's); false where the
        // device cannot be asked (closed, or a forked child).
        matches!(self.with(None, |st| st.resolve(None, stream).map(drop)), Err(Error::InvalidStream(_)))
    }

    fn stream_device(&self, stream: RawStream) -> Result<i32> {
        self.with(None, |st| {
            let sid = st.resolve(None, stream)?;
            st.refuse_on_capturing(sid, "cuStreamGetDevice")?;
            Ok(st.streams[&sid].dev)
        })
    }

    fn exchange_capture_mode(&self, relaxed: bool, previous: u32) -> Result<u32> {
        let was = capture::RELAXED.with(|r| r.replace(relaxed || previous == 2));
        Ok(if was { 2 } else { 0 })
    }

    fn stream_capturing(&self, dev: i32, stream: RawStream) -> Result<bool> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            Ok(st.capturing(sid))
        })
    }

    fn stream_synchronize(&self, dev: i32, stream: RawStream) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.refuse_on_capturing(sid, "cuStreamSynchronize")?;
            st.refuse_while_capturing("cuStreamSynchronize")?;
            let seq = st.streams[&sid].seq;
            st.host_wait(sid, seq);
            Ok(())
        })
    }

    fn stream_query(&self, dev: i32, stream: RawStream) -> Result<bool> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.refuse_on_capturing(sid, "cuStreamQuery")?;
            st.refuse_while_capturing("cuStreamQuery")?;
            Ok(st.streams[&sid].queue.is_empty())
        })
    }

    fn stream_wait_event(&self, dev: i32, stream: RawStream, event: RawEvent) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.check_capture_wait(sid, event)?;
            // An event never recorded orders nothing, as in the driver (on the legacy stream
            // the call is still a barrier with the blocking streams: see `add_dependency`).
            let clock = st.event(event)?.recorded.as_ref().map(|(_, _, c)| c.clone()).unwrap_or_default();
            st.add_dependency(sid, &clock, OpKind::Wait, "cuStreamWaitEvent");
            Ok(())
        })
    }

    fn event_create(&self, dev: i32) -> Result<RawEvent> {
        self.with(Some(dev), |st| {
            let handle = st.next_event;
            st.next_event += 0x10;
            st.events.insert(handle, EventState { dev, recorded: None, captured: false });
            Ok(handle)
        })
    }

    fn event_destroy(&self, dev: i32, event: RawEvent) -> Result<()> {
        self.with_release(dev, |st| {
            st.event(event)?;
            st.events.remove(&event);
            Ok(())
        })
    }

    fn event_record(&self, dev: i32, event: RawEvent, stream: RawStream) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            st.refuse_if_invalidated(sid, "cuEventRecord")?;
            let ev_dev = st.event(event)?.dev;
            let stream_dev = st.streams[&sid].dev;
            if ev_dev != stream_dev {
                return Err(Error::InvalidStream(format!(
                    "event {event:#x} belongs to device {ev_dev}, stream {stream:#x} to device {stream_dev}"
                )));
            }
            let clock = st.enqueue(sid, Work::Nothing, OpKind::EventRecord, "", None);
            let seq = st.streams[&sid].seq;
            let captured = st.capturing(sid);
            let e = st.events.get_mut(&event).expect("checked above");
            e.recorded = Some((sid, seq, clock));
            e.captured = captured;
            Ok(())
        })
    }

    fn event_query(&self, dev: i32, event: RawEvent) -> Result<bool> {
        self.with(Some(dev), |st| {
            st.check_event_use(event, "cuEventQuery")?;
            st.event_done(event)
        })
    }

    fn event_synchronize(&self, dev: i32, event: RawEvent) -> Result<()> {
        self.with(Some(dev), |st| {
            st.check_event_use(event, "cuEventSynchronize")?;
            let (sid, seq) = match &st.event(event)?.recorded {
                Some((sid, seq, _)) => (*sid, *seq),
                None => return Ok(()),
            };
            st.host_wait(sid, seq);
            Ok(())
        })
    }

    fn memset_d8_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            if bytes == 0 {
                return Ok(());
            }
            st.check_range(ptr, bytes, "cuMemsetD8Async")?;
            st.check_access(dev, ptr, bytes, "cuMemsetD8Async", false)?;
            st.enqueue(sid, Work::Fill { ptr, bytes, value }, OpKind::Memset, "", None);
            Ok(())
        })
    }

    unsafe fn memcpy_async(
        &self,
        dev: i32,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            if bytes == 0 {
                return Ok(());
            }
            let dst_sim = st.classify_copy_side(dst, bytes, "cuMemcpyAsync destination")?;
            let src_sim = st.classify_copy_side(src, bytes, "cuMemcpyAsync source")?;
            if dst_sim {
                st.check_access(dev, dst, bytes, "cuMemcpyAsync (destination)", true)?;
            }
            if src_sim {
                st.check_access(dev, src, bytes, "cuMemcpyAsync (source)", true)?;
            }
            st.enqueue_copy(sid, Work::Copy { dst, src, bytes, dst_sim, src_sim });
            Ok(())
        })
    }

    fn prefetch_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        to: Location,
        stream: RawStream,
    ) -> Result<()> {
        self.with(Some(dev), |st| {
            if let Location::Device(d) = to {
                self.check_dev(d)?;
            }
            let sid = st.resolve(Some(dev), stream)?;
            // As the driver documents it: the target GPU and the stream's device need
            // concurrent managed access (a prefetch to the host too); all of the simulated
            // devices have it or none do.
            if !self.concurrent_managed_access.load(Ordering::SeqCst) {
                return Err(invalid_device("cuMemPrefetchAsync"));
            }
            if bytes == 0 {
                return Ok(());
            }
            let start = st.check_managed_range(ptr, bytes, "cuMemPrefetchAsync")?;
            st.enqueue(sid, Work::Nothing, OpKind::Prefetch, "", None);
            // As the driver reports it: the location asked for, not one reached.
            let alloc = st.allocs.get_mut(&start).expect("checked above");
            alloc.prefetched.record(ptr, ptr + bytes as u64, to);
            Ok(())
        })
    }

    fn mem_advise(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        advice: Advice,
        location: Location,
    ) -> Result<()> {
        self.with(Some(dev), |st| {
            if let (Location::Device(d), false) = (location, advice.ignores_location()) {
                self.check_dev(d)?;
                // As the driver documents it: a GPU as preferred location, or as a processor
                // the pages stay mapped for, needs concurrent managed access.
                if matches!(advice, Advice::SetPreferredLocation | Advice::SetAccessedBy)
                    && !self.concurrent_managed_access.load(Ordering::SeqCst)
                {
                    return Err(invalid_device("cuMemAdvise"));
                }
            }
            if bytes == 0 {
                return Ok(());
            }
            // Advice changes where pages live and how they are mapped, never their contents:
            // validated, and otherwise nothing to simulate.
            let start = st.check_managed_range(ptr, bytes, "cuMemAdvise")?;
            if matches!(st.allocs[&start].kind, AllocKind::Pool(_)) {
                // As the driver does (seen with driver 580 on an H200): memory from a
                // managed memory pool takes no advice, which plain managed memory takes.
                return Err(Error::Driver {
                    call: "cuMemAdvise",
                    code: CUDA_ERROR_NOT_SUPPORTED,
                    name: "CUDA_ERROR_NOT_SUPPORTED".into(),
                    context: String::new(),
                });
            }
            Ok(())
        })
    }

    fn mem_range_last_prefetch_location(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
    ) -> Result<Option<Location>> {
        self.with(Some(dev), |st| {
            if bytes == 0 {
                return Err(invalid_value("cuMemRangeGetAttribute"));
            }
            let start = st.check_managed_range(ptr, bytes, "cuMemRangeGetAttribute")?;
            Ok(st.allocs[&start].prefetched.location(ptr, ptr + bytes as u64))
        })
    }

    fn ctx_synchronize(&self, dev: i32) -> Result<()> {
        self.with(Some(dev), |st| {
            st.refuse_while_capturing("cuCtxSynchronize")?;
            st.run_all(dev);
            st.apply_thresholds();
            Ok(())
        })
    }

    fn pool_export_fd(&self, dev: i32, pool: RawPool) -> Result<OwnedFd> {
        self.with(Some(dev), |st| st.pool_export_fd(pool))
    }

    fn pool_import_fd(&self, dev: i32, fd: BorrowedFd<'_>) -> Result<RawPool> {
        self.with(Some(dev), |st| st.pool_import_fd(dev, fd))
    }

    fn pool_export_pointer(&self, dev: i32, ptr: DevPtr) -> Result<PtrExportData> {
        self.with(Some(dev), |st| st.pool_export_pointer(ptr))
    }

    fn pool_import_pointer(&self, dev: i32, pool: RawPool, data: &PtrExportData) -> Result<DevPtr> {
        self.with(Some(dev), |st| st.pool_import_pointer(dev, pool, data))
    }

    fn module_load_data(&self, dev: i32, image: &CStr) -> Result<RawModule> {
        self.with(Some(dev), |st| st.module_load(image.to_bytes()))
    }

    fn module_get_function(&self, dev: i32, module: RawModule, name: &CStr) -> Result<RawFunction> {
        let name = name.to_str().map_err(|_| Error::invalid("cuModuleGetFunction: the name is not UTF-8"))?;
        self.with(Some(dev), |st| st.module_function(module, name))
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
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            let work = st.kernel_work(st.streams[&sid].dev, function, grid, block, params)?;
            let label = match &work {
                Work::Kernel(launch) => launch.kernel.name(),
                _ => unreachable!("kernel_work gives kernels"),
            };
            st.enqueue(sid, work, OpKind::Kernel, label, None);
            Ok(())
        })
    }

    // Several devices: peer access and copies between devices (module `peer`).

    fn device_can_access_peer(&self, dev: i32, peer: i32) -> Result<bool> {
        self.check_dev(peer)?;
        self.with(Some(dev), |st| Ok(st.peers.can_access(dev, peer)))
    }

    fn ctx_enable_peer_access(&self, dev: i32, peer: i32) -> Result<()> {
        self.check_dev(peer)?;
        self.with(Some(dev), |st| st.enable_peer_access(dev, peer))
    }

    fn pool_set_access(&self, dev: i32, pool: RawPool, accessor: i32, enabled: bool) -> Result<()> {
        self.check_dev(accessor)?;
        self.with(Some(dev), |st| st.set_pool_access(pool, accessor, enabled))
    }

    fn pool_get_access(&self, dev: i32, pool: RawPool, accessor: i32) -> Result<bool> {
        self.check_dev(accessor)?;
        self.with(Some(dev), |st| st.pool_access(pool, accessor))
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
        self.check_dev(dst_dev)?;
        self.check_dev(src_dev)?;
        self.with(Some(dev), |st| {
            let sid = st.resolve(Some(dev), stream)?;
            if bytes == 0 {
                return Ok(());
            }
            let dst_sim = st.check_peer_side(dst, dst_dev, bytes, "cuMemcpyPeerAsync destination")?;
            let src_sim = st.check_peer_side(src, src_dev, bytes, "cuMemcpyPeerAsync source")?;
            st.enqueue_copy(sid, Work::Copy { dst, src, bytes, dst_sim, src_sim });
            Ok(())
        })
    }
}
