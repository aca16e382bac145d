//! The lock-sharded stream-ordered pool. The design, the policy order and the reasons
//! are in `IMPLEMENTATION.md` beside this file.
//!
//! * `mod.rs`: the resource, its options and statistics, and the same-stream hot path;
//! * `shard.rs`: one stream's shard, its epochs and events, its retirement;
//! * `policy.rs`: the slow path (policy steps 2 to 7), frees across streams, the
//!   footprint budget, gathering and release;
//! * `chunks.rs`: the upstream chunks: growth, the chunk table, giving chunks back;
//! * `region.rs`: growth in place (`PoolOptions::expandable`);
//! * `common.rs`: the common list (completed blocks any stream may use) and its size;
//! * `heap.rs`: one heap for every stream (`PoolOptions::one_heap`): frees pending on
//!   their events, and the waits that order reuse;
//! * `freelist.rs`, `addrmap.rs`: a shard's blocks;
//! * `loom_tests.rs`: loom models of the shard logic over the simulated device (a
//!   stream's first use, the fast path's steals, sweeps, retirement, `release`), built
//!   with `--cfg loom` only (`make test-loom`).

mod addrmap;
mod chunks;
mod common;
mod freelist;
mod heap;
mod policy;
mod region;
mod shard;

#[cfg(all(test, loom))]
mod loom_tests;

#[cfg(not(loom))]
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use chunks::ChunkTable;
use freelist::{class_size, FreeBlock, NotFreed};
use shard::{Shard, ShardState, MAX_EVENT_BACKOFF};

use crate::device::{BackendRef, DevPtr};
use crate::error::{Error, Result};
use crate::resource::{
    checked_allocate, checked_deallocate, settle_allocate, settle_deallocate, Footprint, MemoryKind,
    MemoryResource, ResourceRef, ALIGNMENT,
};
use std::time::Duration;

use crate::size::align_up;
use crate::stream::Stream;
use crate::sync::{read, write, AtomicU64, AtomicUsize, Mutex, Ordering, RwLock};

/// How a [`ShardedPoolMemoryResource`] grows, records events and gives memory back.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolOptions {
    /// Bytes taken from the upstream at creation (rounded up to 256). `None`: nothing up
    /// front; the pool grows on demand.
    pub initial_pool_size: Option<usize>,
    /// The most the pool holds from the upstream (rounded up to 256). `None`: no limit
    /// but the upstream's.
    pub maximum_pool_size: Option<usize>,
    /// Free bytes the pool may keep; beyond this, chunks that are entirely free go back to
    /// the upstream after each of the pool's own device synchronisations (a gathering, when
    /// memory runs short: policy step 6), the one moment it knows every free complete: the
    /// whole free chunks of the common list (where the gathering put every completed
    /// block), largest first, while the common list holds more than this beyond them.
    /// A program's own synchronisations do not trigger it; [`release`](ShardedPoolMemoryResource::release)
    /// gives back everything free. `None`: keep everything.
    pub release_threshold: Option<usize>,
    /// A stream records an event (in one of its frees) after this many frees, so that
    /// other streams can tell when those blocks are free to take. While no stream is short
    /// of memory, each event doubles a stream's interval, up to 64 times this.
    pub events_every: usize,
    /// The fewest frees one event covers when another stream asks for this stream's
    /// memory (it looked here and found no completed block, or took this stream's
    /// completed blocks). 1, the default: the next free records. More: fewer driver calls
    /// per block handed between streams, for more memory held meanwhile (the asking
    /// stream grows, within `headroom`, until the event comes).
    pub event_batch: usize,
    /// The footprint budget: free memory the pool may hold beyond the peak live bytes (the
    /// most seen live when growth was considered), as a fraction of them (at least 2 MiB),
    /// before it reuses another stream's
    /// memory by making a stream wait (or, last, by a synchronisation) instead of growing.
    /// Below the budget, growing is preferred to waiting (a wait couples two streams);
    /// an allocation is never refused for the budget's sake. `None`: grow whenever no
    /// completed block fits (the least waiting, the most memory), unless the shards of
    /// streams that have ended hold the request's size (gathered first). Default 0.15.
    /// The budget bounds policy step 4's growth; within [`gather_interval`](Self::gather_interval)
    /// of a gathering the pool may grow to 4 times the budget's allowance (the peak live
    /// bytes plus the headroom: by default about 4.6 times the peak live bytes), and a
    /// `gather_interval` of zero keeps it near the budget.
    pub headroom: Option<f64>,
    /// At the budget the pool gathers (synchronises the device and collects every free
    /// block), which stops every thread that needs memory meanwhile; within this long of
    /// the last gathering's start a thread short of memory grows past the budget instead,
    /// up to four times the budget's allowance (the peak live bytes plus the headroom;
    /// beyond that, and at the maximum, it still gathers). The trade between memory and
    /// speed: on the H200, window workload at 16 threads, zero held 1.7 times the peak live
    /// bytes at 3.5-5.5 M allocations/s, the default of 100 µs 3.9 times at 97-107 M/s
    /// (`benchmarks/RESULTS.md`, "Commits 85cb897 and 8ba5d69"); zero with
    /// [`expandable`](Self::expandable) and [`steal_whole_blocks`](Self::steal_whole_blocks)
    /// held 1.5-1.6 times at 4 and 16 threads, at 6.4-7.1 M/s on 16 (the least this pool
    /// holds there; the driver's pool, 1.6-2.1: "Commits d54cde1 and 939a767").
    pub gather_interval: Duration,
    /// Grow in place: reserve one range of addresses (the size of the device, or the
    /// maximum) when the pool is made, and grow by mapping device memory at its end with
    /// the driver's virtual memory calls (`cuMemCreate`, `cuMemMap`), so that new memory
    /// joins the free block before it. Memory in separate chunks cannot serve a block
    /// larger than any chunk's free run, however much is free in all of them; so a pool
    /// that grows in place holds less (the window workload at one thread on the H200: 1.22
    /// times the peak live bytes against 1.41-1.49; `benchmarks/RESULTS.md`, "Commit
    /// fed316e"). Growth maps memory itself rather than asking the upstream,
    /// which must be device memory (`CudaMemoryResource`, `CudaAsyncMemoryResource`), not
    /// an adaptor; the upstream serves only what the range cannot hold. Like PyTorch's
    /// `expandable_segments`. Default `false`.
    pub expandable: bool,
    /// A stream short of memory that takes a completed free block from another stream's
    /// shard takes the whole block, not only the bytes it asked for: the rest joins its
    /// own shard, where its later frees merge with it. Memory then moves between streams
    /// in whole blocks, instead of leaving a piece in each shard that neither can merge.
    /// The trade: much less memory held on many threads, at about half the allocation
    /// speed there, since streams then take memory from one another several times as
    /// often (on the H200, window workload at 16 threads: 2.1-2.7 times the peak live
    /// bytes at 39-57 M allocations/s, against 3.2-4.0 at 82-140 M/s without;
    /// `benchmarks/RESULTS.md`, "Commit 84adecc"). One stream alone is unaffected. Default `false`.
    pub steal_whole_blocks: bool,
    /// One heap for every stream, the least memory on many threads: no shards; every free
    /// goes to one list behind one lock, where it merges with its free neighbours at once,
    /// whichever stream freed them. Each free records an event on its stream, and a stream
    /// handed memory that another stream freed, not yet known complete, waits on that
    /// event (`cuStreamWaitEvent`), as the driver's own pool orders its reuse. So streams
    /// wait on one another where the default pool keeps them apart, and every allocation
    /// and free takes the one lock and a driver call or two. The pool grows only when
    /// nothing free fits. With [`expandable`](Self::expandable), the leanest pool:
    /// `benchmarks/RESULTS.md` has its memory and speed beside the others'. Of the other
    /// options only `initial_pool_size`, `maximum_pool_size` and `expandable` apply;
    /// `release_threshold` and `steal_whole_blocks` are refused with it. Default `false`.
    pub one_heap: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            initial_pool_size: None,
            maximum_pool_size: None,
            release_threshold: None,
            events_every: 64,
            event_batch: 1,
            headroom: Some(0.15),
            gather_interval: Duration::from_micros(100),
            expandable: false,
            steal_whole_blocks: false,
            one_heap: false,
        }
    }
}

/// What the pool holds and how often each step of its policy was taken.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub reserved_bytes: usize,
    /// The most bytes held from the upstream at any time.
    pub peak_reserved_bytes: usize,
    /// Bytes handed out and not yet freed (as rounded: see the type's docs).
    pub used_bytes: usize,
    /// Free bytes in the shards and the common list (reserved = used + free).
    pub free_bytes: usize,
    /// Free bytes in the common list (completed, usable by any stream).
    pub common_free_bytes: usize,
    /// Free bytes per shard, by stream key.
    pub shard_free_bytes: Vec<(u64, usize)>,
    /// Shards whose stream was destroyed and that still hold blocks.
    pub retired_shards: usize,
    /// Bytes ever taken from the upstream (grown = reserved + released).
    pub grown_bytes: u64,
    /// Bytes given back to the upstream.
    pub released_bytes: u64,
    /// Times the pool grew from the upstream.
    pub upstream_growths: u64,
    /// Blocks taken from another stream's shard after their free completed (no wait).
    pub completed_steals: u64,
    /// Waits inserted into a stream on another stream's event (`cuStreamWaitEvent`).
    pub cross_stream_waits: u64,
    /// Device synchronisations (`cuCtxSynchronize`): the last resort before failing or
    /// growing past the footprint budget, and every `release`.
    pub synchronizations: u64,
    /// Events recorded: in frees (an event due), and by policy step 5 on a consumer's
    /// stream, to cover the blocks it hands over (a retiring stream's last event is not
    /// counted).
    pub events_recorded: u64,
    /// Queries of recorded events (`cuEventQuery`), to learn which frees have completed.
    pub event_queries: u64,
}

/// The lock-sharded stream-ordered pool (RMM's `pool_memory_resource`, without its one
/// lock): suballocates memory from any upstream resource with one shard of free blocks per
/// stream, so that threads on different streams never wait for one another on the hot
/// path.
///
/// # Policy (in order; `IMPLEMENTATION.md` has the reasons)
///
/// An allocation on stream S takes the first that works:
/// 1. a block in S's own shard (blocks freed on S, or already ordered for S), a good fit
///    rather than the best: the head of the first non-empty size list whose blocks all fit
///    (TLSF's); no event, no driver call;
/// 2. a block in the common list (frees known complete, usable by any stream);
/// 3. a block in another stream's shard whose free has completed (an event recorded in
///    that stream's frees reads complete);
/// 4. a new chunk from the upstream, allocated on S, sized to the request and to the live
///    bytes, while the pool stays within its footprint budget ([`PoolOptions::headroom`])
///    and under `maximum_pool_size`;
/// 5. a block in another stream's shard whose free is covered by a recorded but
///    unfinished event: S is made to wait on it (`cuStreamWaitEvent`, counted);
/// 6. one thread at a time: synchronise the device, move every free block to the common
///    list, coalesce and take the block there; else give whole free chunks back to the
///    upstream and grow (now past the budget, by the request rounded to 2 MiB, still
///    under the maximum) (counted). Within `gather_interval` of the last gathering, a
///    thread grows past the budget instead, up to four times the budget's allowance;
/// 7. `OutOfMemory`.
///
/// # Streams that end
/// When a stream streampool created is destroyed, its shard records a last event and is
/// retired: its blocks go to the common list once that event completes (or are taken by
/// step 5 before), and the shard is dropped once empty. Shards of borrowed handles (other
/// libraries' streams) cannot see their stream end; their blocks are reached by steps 3,
/// 5 and 6.
///
/// # Bad input
/// A free must pass the size it allocated (as in RMM). A double free, an address the pool
/// did not hand out, or a size that does not round to the allocation's (sizes are rounded
/// to 256 bytes, and from above 4 KiB to below 64 MiB to one of 16 steps per power of two;
/// from 64 MiB up to 256 bytes only) is always refused with
/// [`Error::InvalidPointer`], and changes nothing (every live allocation has a record).
///
/// # Thread safety
/// Any thread may allocate and free on any stream. Each shard has its own lock; the
/// common list, the chunk table and the shard map have theirs, taken only off the hot
/// path. No lock is held across a call into the upstream (an expandable pool's range lock
/// is held across its mapping calls to the driver). Locks held together are taken in one
/// order (gathering, the expandable pool's range, common list, a shard, shard map), never
/// two shards at once, and none of them on the hot path but the shard's own.
///
/// # Example
/// Producers on threads of their own fill chunks on their streams and hand them to a
/// consumer, which frees them on its stream; the pool orders the reuse:
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{
///     Allocation, BackendRef, CudaAsyncMemoryResource, PoolOptions, ResourceRef, ShardedPoolMemoryResource, Stream,
/// };
///
/// let sim = SimDevice::new(1 << 30);
/// let backend: BackendRef = sim.clone();
/// let upstream: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default())?);
/// let pool: ResourceRef = Arc::new(ShardedPoolMemoryResource::new(upstream, PoolOptions::default())?);
/// let consumer = Stream::create(&backend, 0, false)?;
/// let producers: Vec<_> = (0..4)
///     .map(|_| {
///         let (pool, backend, sim) = (pool.clone(), backend.clone(), sim.clone());
///         std::thread::spawn(move || -> streampool::Result<Vec<Allocation>> {
///             let stream = Stream::create(&backend, 0, false)?;
///             (0..8)
///                 .map(|_| {
///                     let chunk = Allocation::new(pool.clone(), 1 << 20, stream.clone())?;
///                     sim.write(stream.handle(), chunk.ptr(), 1 << 20)?; // the producer's kernel
///                     Ok(chunk)
///                 })
///                 .collect()
///         })
///     })
///     .collect();
/// for producer in producers {
///     for mut chunk in producer.join().unwrap()? {
///         chunk.set_stream(consumer.clone())?; // ordered after the producer's work
///         sim.read(consumer.handle(), chunk.ptr(), 1 << 20)?; // the consumer's kernel
///     } // each chunk is freed on the consumer's stream as it goes
/// }
/// sim.run();
/// assert!(sim.races().is_empty());
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct ShardedPoolMemoryResource {
    upstream: ResourceRef,
    /// This resource and the chain below it (`MemoryResource::depth`).
    depth: usize,
    /// The upstream's, kept here: every call asks for them (no dynamic call each time).
    backend: BackendRef,
    device: i32,
    #[cfg_attr(loom, allow(dead_code))]
    uid: u64,
    options: PoolOptions,
    maximum: usize,
    /// By key, so that the looks through other shards go in the same order in every run
    /// (and loom's models are deterministic).
    shards: RwLock<BTreeMap<u64, Arc<Shard>>>,
    common: common::Common,
    chunks: RwLock<Arc<ChunkTable>>,
    /// The expandable pool's range (`PoolOptions::expandable`), chunk `REGION_CHUNK`.
    region: Option<region::Region>,
    /// Chunk ids from the upstream, from 2.
    next_chunk: AtomicU64,
    reserved: AtomicUsize,
    /// Bumped when policy step 4 could not grow (the footprint budget, the maximum, or the
    /// upstream out of memory): every stream then records an event at its next free, so
    /// that its blocks can be taken.
    demand: AtomicU64,
    /// The most bytes seen live (rounded, with the request) when growth was considered:
    /// the footprint budget's base.
    peak_live: AtomicUsize,
    /// Shards at which the next new one sweeps out the spent shards of borrowed streams
    /// (`sweep_borrowed`).
    sweep_at: AtomicUsize,
    counters: Counters,
    /// Allocations made on streams capturing a CUDA graph, passed to the upstream (graph
    /// memory, which the pool's shards never hold), by address: their size. Looked at
    /// only on the cold paths, and there only while not empty (`captured_count`).
    captured: crate::sync::Mutex<std::collections::HashMap<DevPtr, usize>>,
    captured_count: AtomicUsize,
    /// With one heap: the frees not known complete, and the bytes in use.
    heap: heap::Pending,
}

/// Written off the hot path (an event every batch of frees, steals, growth), read by
/// `stats`: on cache lines of their own, so that these writes do not evict the fields every
/// allocation reads (the demand count, the options).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Counters {
    grown_bytes: AtomicU64,
    released_bytes: AtomicU64,
    peak_reserved: AtomicUsize,
    growths: AtomicU64,
    completed_steals: AtomicU64,
    waits: AtomicU64,
    syncs: AtomicU64,
    events: AtomicU64,
    queries: AtomicU64,
    /// Gatherings so far (policy step 6); held while gathering, one step-6 gatherer at a
    /// time. `release()` synchronises and harvests without it and is not counted here (its
    /// start is stamped in `last_gather_ns` all the same).
    gathers: Mutex<u64>,
    /// When the last gathering started (`crate::clock::monotonic_ns`).
    last_gather_ns: AtomicU64,
}

// A process-wide counter, not shared state of a model: std's atomic, also under loom.
static NEXT_POOL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A shard a thread used, kept by the thread so that the hot path reads nothing shared
/// but the shard itself.
#[cfg(not(loom))]
struct Local {
    pool: u64,
    key: u64,
    shard: Arc<Shard>,
}

#[cfg(not(loom))]
thread_local! {
    /// This thread's shards of every pool, with the index of the last one used (a thread
    /// that works on one stream finds it with one comparison).
    static LOCALS: RefCell<(usize, Vec<Local>)> = const { RefCell::new((0, Vec::new())) };
}

/// Shards a thread keeps (the oldest go first).
#[cfg(not(loom))]
const THREAD_CACHE: usize = 64;
/// Shards at which a new one first sweeps out borrowed streams' spent ones (`sweep_borrowed`).
const SWEEP_SHARDS: usize = 256;

impl ShardedPoolMemoryResource {
    /// A pool over `upstream`. `maximum_pool_size` below `initial_pool_size` or below 256
    /// bytes, `events_every` or `event_batch` of 0 and a negative or non-finite `headroom` are errors.
    pub fn new(upstream: ResourceRef, options: PoolOptions) -> Result<Self> {
        // Rounded up, as `initial_pool_size` is: equal sizes stay equal, and a maximum holds
        // an allocation of its own size.
        let round_up =
            |n: usize| n.checked_next_multiple_of(ALIGNMENT).unwrap_or(usize::MAX / ALIGNMENT * ALIGNMENT);
        let maximum = options.maximum_pool_size.map_or(usize::MAX, round_up);
        let initial = match options.initial_pool_size {
            Some(n) if n > isize::MAX as usize => {
                return Err(Error::invalid(format!(
                    "initial_pool_size {n} is larger than any device (at most {} bytes)",
                    isize::MAX
                )))
            }
            n => n.map(|n| align_up(n, ALIGNMENT)).unwrap_or(0),
        };
        if options.maximum_pool_size.is_some_and(|m| m < ALIGNMENT) {
            return Err(Error::invalid(format!(
                "maximum_pool_size must be at least {ALIGNMENT} bytes (got {})",
                options.maximum_pool_size.unwrap_or(0)
            )));
        }
        if initial > maximum {
            return Err(Error::invalid(format!(
                "maximum_pool_size ({maximum}) is below initial_pool_size ({initial})"
            )));
        }
        if options.events_every == 0 {
            return Err(Error::invalid("events_every must be at least 1"));
        }
        if options.event_batch == 0 {
            return Err(Error::invalid("event_batch must be at least 1"));
        }
        if options.one_heap && (options.release_threshold.is_some() || options.steal_whole_blocks) {
            return Err(Error::invalid(
                "one_heap takes neither release_threshold nor steal_whole_blocks: its one heap has no \
                 shards to steal from, and gives memory back at release()",
            ));
        }
        let depth = crate::resource::check_depth("ShardedPoolMemoryResource", [&upstream])?;
        if let Some(h) = options.headroom {
            if !(h.is_finite() && h >= 0.0) {
                return Err(Error::invalid(format!("headroom must be a finite fraction >= 0 (got {h})")));
            }
        }
        let region =
            if options.expandable { Some(region::Region::reserve(&upstream, maximum)?) } else { None };
        let pool = ShardedPoolMemoryResource {
            depth,
            backend: upstream.backend().clone(),
            device: upstream.device(),
            upstream,
            uid: NEXT_POOL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            options,
            maximum,
            shards: RwLock::new(BTreeMap::new()),
            common: common::Common::new(region.is_some()),
            chunks: RwLock::new(Arc::default()),
            region,
            next_chunk: AtomicU64::new(2),
            reserved: AtomicUsize::new(0),
            demand: AtomicU64::new(0),
            peak_live: AtomicUsize::new(0),
            captured: Default::default(),
            captured_count: AtomicUsize::new(0),
            sweep_at: AtomicUsize::new(SWEEP_SHARDS),
            counters: Counters::default(),
            heap: Default::default(),
        };
        if initial > 0 {
            let legacy = Stream::legacy();
            let chunk = pool.grow(initial, initial, &legacy, None)?;
            pool.backend().stream_synchronize(pool.device(), legacy.handle())?;
            pool.common.lock().insert(chunk.start, FreeBlock { size: chunk.size, chunk: chunk.id, epoch: 0 });
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    /// The options the pool was made with.
    pub fn options(&self) -> &PoolOptions {
        &self.options
    }

    /// What the pool holds and how often each policy step ran. Exact when no other thread
    /// is allocating or freeing.
    pub fn stats(&self) -> PoolStats {
        let shards: Vec<Arc<Shard>> = read(&self.shards).values().cloned().collect();
        let (mut used, mut retired_shards) = (0i64, 0);
        let mut shard_free_bytes: Vec<(u64, usize)> = shards
            .iter()
            .map(|s| {
                let st = s.state.lock();
                used += st.used_bytes();
                retired_shards += st.retired as usize;
                (s.key, st.free.bytes())
            })
            .collect();
        shard_free_bytes.sort_unstable();
        let common_free_bytes = self.common.lock().bytes();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            // What was grown and not given back: `self.reserved` also counts reservations
            // made before the upstream is asked, of which some fail.
            reserved_bytes: get(&c.grown_bytes).saturating_sub(get(&c.released_bytes)) as usize,
            peak_reserved_bytes: c.peak_reserved.load(Ordering::Relaxed),
            used_bytes: used.max(0) as usize + self.heap.used(),
            free_bytes: common_free_bytes + shard_free_bytes.iter().map(|s| s.1).sum::<usize>(),
            common_free_bytes,
            shard_free_bytes,
            retired_shards,
            grown_bytes: get(&c.grown_bytes),
            released_bytes: get(&c.released_bytes),
            upstream_growths: get(&c.growths),
            completed_steals: get(&c.completed_steals),
            cross_stream_waits: get(&c.waits),
            synchronizations: get(&c.syncs),
            events_recorded: get(&c.events),
            event_queries: get(&c.queries),
        }
    }

    /// Gives every entirely free chunk back to the upstream (the free blocks of a chunk that
    /// also holds a live allocation stay): synchronises the device (so that every free, on
    /// any stream, has completed), gathers every shard's free blocks in the common list,
    /// and returns every entirely free chunk. Afterwards the pool holds exactly the
    /// chunks that live allocations lie in. With [`PoolOptions::expandable`] the memory is
    /// one growing range, which can only be shrunk from its end: what lies above the highest
    /// live allocation is unmapped, what lies below it stays. Returns the bytes released.
    ///
    /// The upstream may keep what it gets back: the device's default pool behind
    /// `CudaAsyncMemoryResource()` keeps freed memory for reuse (its release threshold is
    /// the maximum), so to hand it to the system call that resource's `trim_to(0)` too.
    ///
    /// The footprint budget ([`PoolOptions::headroom`]) starts again from what is live now.
    ///
    /// It synchronises and gathers as policy step 6 does, but outside step 6's gathering
    /// lock and without counting a gathering (threads in step 6 do not look in what it
    /// gathered first); its start counts as the last gathering's for
    /// [`PoolOptions::gather_interval`].
    pub fn release(&self) -> Result<usize> {
        // Everything free goes, the release threshold notwithstanding, and is counted.
        drop(self.synchronize_and_harvest()?);
        let released = self.trim(0)?;
        self.peak_live.store(self.stats().used_bytes, Ordering::Relaxed);
        Ok(released)
    }

    /// Runs `f` on the shard of `stream` (whose key is `key`), found among this thread's
    /// (or made on first use). Under loom, looked up in the pool every time: the model then
    /// sees every shared access.
    #[inline]
    fn with_shard<T>(&self, key: u64, stream: &Stream, f: impl FnOnce(&Arc<Shard>) -> T) -> T {
        #[cfg(loom)]
        return f(&self.shard_slow(key, stream));
        #[cfg(not(loom))]
        let mut f = Some(f);
        #[cfg(not(loom))]
        let cached = LOCALS.try_with(|cell| {
            let f = f.take().expect("called once");
            let mut locals = cell.borrow_mut();
            let (last, list) = &mut *locals;
            let hit = |l: &Local| l.pool == self.uid && l.key == key;
            if !list.get(*last).is_some_and(hit) {
                *last = match list.iter().position(hit) {
                    Some(i) => i,
                    None => {
                        if list.len() >= THREAD_CACHE {
                            list.remove(0);
                        }
                        list.push(Local { pool: self.uid, key, shard: self.shard_slow(key, stream) });
                        list.len() - 1
                    }
                };
            }
            f(&list[*last].shard)
        });
        // From a thread-local destructor, after this thread's cache went: looked up in the
        // pool.
        #[cfg(not(loom))]
        cached.unwrap_or_else(|_| (f.take().expect("not called"))(&self.shard_slow(key, stream)))
    }

    /// The shard of `stream` (key `key`), made on first use. Two threads using a new stream
    /// at once get the same shard: it is inserted under the write lock, re-checked there.
    /// A new shard of a stream streampool owns is retired when that stream is destroyed.
    fn shard_slow(&self, key: u64, stream: &Stream) -> Arc<Shard> {
        if let Some(s) = read(&self.shards).get(&key) {
            return s.clone();
        }
        let shard = {
            let mut map = write(&self.shards);
            if let Some(s) = map.get(&key) {
                return s.clone();
            }
            let owner = stream.is_owned().then(|| stream.handle());
            let shard =
                Arc::new(Shard::new(key, &self.options, owner, stream.is_borrowed(), stream.sync_marks()));
            map.insert(key, shard.clone());
            if map.len() >= self.sweep_at.load(Ordering::Relaxed) {
                drop(map);
                self.sweep_borrowed();
            }
            shard
        };
        let (weak, backend, device) = (Arc::downgrade(&shard), self.backend.clone(), self.device);
        let at_exit = weak.clone();
        // Hooks of a shard that has gone (its pool dropped) are dropped as the stream or
        // thread gets others: one stream used by a pool per task keeps no hook per pool.
        let alive = |w: &std::sync::Weak<Shard>| -> crate::stream::HookAlive {
            let w = w.clone();
            Box::new(move || w.strong_count() > 0)
        };
        stream.on_destroy_while(
            alive(&weak),
            Box::new(move |s: &Stream| {
                if let Some(shard) = weak.upgrade() {
                    shard.retire(&backend, device, s);
                }
            }),
        );
        // A thread's per-thread default stream ends with the thread. Asked for from one of
        // the thread's thread-local destructors, after its exit hooks ran (one that a
        // release dropped the retired shard under), the shard is retired at once: else
        // it would stay in the pool for ever, neither retired nor borrowed.
        let hooked = stream.on_thread_exit_while(
            alive(&at_exit),
            Box::new(move || {
                if let Some(shard) = at_exit.upgrade() {
                    shard.retire_at_thread_exit();
                }
            }),
        );
        if !hooked && stream.is_per_thread() {
            shard.retire_at_thread_exit();
        }
        shard
    }

    /// Drops the shards of borrowed streams (another library's streams, handles passed as
    /// ints) that hold nothing, neither free blocks nor live ones, and that no thread
    /// holds, in its cache of shards or in a call. The pool cannot see such a stream's end,
    /// so a program that makes a stream per task would otherwise leave a shard per task,
    /// and every new stream's look through the others would grow with them. Nothing can
    /// enter a shard that no thread holds once it is out of the map (the map's write lock
    /// keeps new holders out while it is checked; a look that reaches it through a hint only
    /// takes from it); the stream's next use makes a new one. Runs when a new shard
    /// brings the map to `sweep_at`, which then doubles what is left (at least
    /// `SWEEP_SHARDS`): its cost per new shard stays constant; and after each gathering.
    fn sweep_borrowed(&self) {
        let gone: Vec<Arc<Shard>> = {
            let mut map = write(&self.shards);
            let spent: Vec<u64> = map
                .values()
                .filter(|s| {
                    s.borrowed
                        && Arc::strong_count(s) == 1
                        && s.state.try_lock().is_some_and(|st| st.free.bytes() == 0 && st.used == 0)
                })
                .map(|s| s.key)
                .collect();
            let gone = spent.iter().filter_map(|k| map.remove(k)).collect();
            self.sweep_at.store((2 * map.len()).max(SWEEP_SHARDS), Ordering::Relaxed);
            gone
        };
        drop(gone); // their events are destroyed outside the map's lock
    }

    /// Every shard but the one of `key`.
    fn other_shards(&self, key: u64) -> Vec<Arc<Shard>> {
        policy::others(&read(&self.shards), key)
    }

    /// Every shard.
    fn all_shards(&self) -> Vec<Arc<Shard>> {
        read(&self.shards).values().cloned().collect()
    }

    /// Step 1 of the policy. `None` when `!blocking` and the shard's lock is taken.
    #[inline]
    fn take_own(&self, size: usize, stream: &Stream, key: u64, blocking: bool) -> Option<Option<DevPtr>> {
        self.with_shard(key, stream, |shard| {
            let mut st = policy::lock_shard(shard, blocking)?;
            let ptr = st.free.allocate(size);
            if ptr.is_some() {
                st.used += size as i64;
            }
            Some(ptr)
        })
    }

    /// Frees a block allocated on `stream` into its shard (`size` rounded by
    /// [`class_size`]), recording an event when one is due. The answer is small, so that
    /// the hot path keeps it in registers (an `Option<Result<..>>` of the crate's error,
    /// built and copied on the stack, stalled the loads that read it back).
    #[inline]
    fn free_own(&self, ptr: DevPtr, size: usize, stream: &Stream, blocking: bool) -> OwnFree {
        let key = stream.key(self.backend(), self.device());
        let demand = self.demand.load(Ordering::Relaxed);
        self.with_shard(key, stream, |shard| {
            let Some(mut st) = policy::lock_shard(shard, blocking) else {
                return OwnFree::Busy;
            };
            let epoch = st.entry_epoch();
            match st.free.free(ptr, size, epoch) {
                Ok(()) => {
                    st.used -= size as i64;
                    self.after_free(&mut st, stream, demand);
                    OwnFree::Done
                }
                Err(NotFreed::Unknown) => OwnFree::NotHere,
                Err(NotFreed::WrongSize(had)) => OwnFree::WrongSize(had),
            }
        })
    }

    /// Frees a block into the shard of `stream`, recording an event when one is due.
    /// `None` when `!blocking` and that would wait for a lock or look through other shards
    /// (a block allocated on another stream, found elsewhere than where this stream's last
    /// such free found its block).
    fn free_into(&self, ptr: DevPtr, bytes: usize, stream: &Stream, blocking: bool) -> Option<Result<()>> {
        let size = class_size(bytes);
        match self.free_own(ptr, size, stream, blocking) {
            OwnFree::Done => Some(Ok(())),
            OwnFree::Busy => None,
            // The own shard borrowed from the thread's cache, not cloned (`take_completed`).
            OwnFree::NotHere => {
                let key = stream.key(self.backend(), self.device());
                self.with_shard(key, stream, |own| self.free_foreign(own, ptr, size, bytes, stream, blocking))
            }
            OwnFree::WrongSize(had) => Some(Err(wrong_size(ptr, had, bytes))),
        }
    }

    /// Counts a free into the open epoch and records an event when one is due: after
    /// `interval` frees, or at once when another stream is short of memory. While nobody
    /// needs this stream's memory, each event doubles the interval to the next (a stream
    /// that frees a lot records rarely); being asked resets it.
    #[inline]
    fn after_free(&self, st: &mut ShardState, stream: &Stream, demand: u64) {
        let due = st.event_due(demand);
        st.unevented += 1;
        if due {
            self.event_due_now(st, stream, demand);
        }
    }

    #[cold]
    #[inline(never)]
    fn event_due_now(&self, st: &mut ShardState, stream: &Stream, demand: u64) {
        st.interval = if st.asked(demand) || st.drawn {
            self.options.events_every
        } else {
            st.interval.saturating_mul(2).min(self.options.events_every * MAX_EVENT_BACKOFF)
        };
        st.seen_demand = demand;
        st.wanted = false;
        st.drawn = false;
        // With an event batch (memory held for fewer driver calls), a stream synchronised
        // since its last due event records none: its synchronisations complete its blocks
        // (`ShardState::refresh`). Without one (the default), the event is recorded: it
        // completes as soon as the stream's work before the free has run, which in a
        // pipeline that synchronises before each free is at once, where the next
        // synchronisation comes a chunk of work later; with little headroom, producers
        // would wait on the consumers' streams meanwhile (`IMPLEMENTATION.md`, "Epochs").
        if st.batch > 1 && st.synced_since_due() {
            st.unevented = 0;
            return;
        }
        // The events that have completed make room for this one, and their blocks become
        // takeable by other streams without a query of theirs (measured together with the
        // queries of each look: policy.rs, `take_completed`).
        let queries = st.refresh();
        self.count_queries(queries);
        // Failing to record only delays reuse by other streams.
        if let Ok(true) = st.record_event(self.backend(), self.device(), stream.handle(), false) {
            self.counters.events.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn count_queries(&self, n: u64) {
        if n > 0 {
            self.counters.queries.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The same-stream fast path of an allocation (policy step 1), for sizes and streams
    /// that need no check beyond a comparison; `None` sends the caller to the full path.
    #[inline]
    fn allocate_own(&self, bytes: usize, stream: &Stream, blocking: bool) -> Option<DevPtr> {
        // 0 (the null pointer) and impossible sizes are settled by the full path.
        if bytes.wrapping_sub(1) >= isize::MAX as usize
            || !stream.is_bound_to(self.backend(), self.device())
            || self.options.one_heap
        {
            return None;
        }
        let key = stream.key(self.backend(), self.device());
        self.take_own(class_size(bytes), stream, key, blocking).flatten()
    }

    /// True when a free passes the trait's checks by comparisons alone (a pointer that is
    /// not 0, a size from 1 to `isize::MAX`, a stream of this backend object and device).
    #[inline]
    fn plainly_freeable(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> bool {
        ptr != 0
            && bytes.wrapping_sub(1) < isize::MAX as usize
            && stream.is_bound_to(self.backend(), self.device())
    }

    /// The same-stream fast path of a free: true once freed.
    #[inline]
    fn deallocate_own(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> bool {
        !self.options.one_heap
            && self.plainly_freeable(ptr, bytes, stream)
            && matches!(self.free_own(ptr, class_size(bytes), stream, true), OwnFree::Done)
    }

    #[cold]
    #[inline(never)]
    fn allocate_cold(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        if stream.is_capturing() {
            return self.allocate_captured(bytes, stream);
        }
        checked_allocate(self, bytes, stream)
    }

    #[cold]
    #[inline(never)]
    fn deallocate_cold(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if stream.is_capturing() {
            return self.deallocate_captured(ptr, bytes, stream);
        }
        if self.captured_count.load(Ordering::Relaxed) != 0 {
            // Graph memory freed after its capture, on any stream: the upstream's, once the
            // checks have passed (a refused free keeps the record).
            if let Some(settled) = settle_deallocate(self, ptr, bytes, stream) {
                return settled;
            }
            if let Some(size) = self.take_captured(ptr, bytes)? {
                return self.free_captured(ptr, size, stream);
            }
        }
        checked_deallocate(self, ptr, bytes, stream)
    }

    /// An allocation on a stream capturing a CUDA graph: the upstream's (graph memory).
    /// The hot paths never see such a stream (`Stream::is_bound_to` is false for it).
    fn allocate_captured(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        if let Some(settled) = settle_allocate(self, bytes, stream) {
            return settled;
        }
        let ptr = self.upstream.allocate(bytes, stream)?;
        self.record_captured(ptr, bytes);
        Ok(ptr)
    }

    /// Keeps the record of captured memory at `ptr`, of `size` bytes.
    fn record_captured(&self, ptr: DevPtr, size: usize) {
        crate::sync::lock(&self.captured).insert(ptr, size);
        self.captured_count.fetch_add(1, Ordering::Relaxed);
    }

    fn deallocate_captured(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if let Some(settled) = settle_deallocate(self, ptr, bytes, stream) {
            return settled;
        }
        match self.take_captured(ptr, bytes)? {
            // In the capture that allocated it: a free node of the graph.
            Some(size) => self.free_captured(ptr, size, stream),
            // The pool's own memory, freed on a capturing stream: its blocks would be
            // reused while the graph still uses them, and the event that orders a reuse
            // cannot be recorded in a capture.
            None => Err(Error::InvalidStream(format!(
                "{ptr:#x} was allocated before the capture of stream {:#x} began: the pool cannot \
                 free it on that stream while it captures a CUDA graph; free it once the capture \
                 has ended (streampool's allocator entry points for PyTorch and CuPy defer such \
                 frees themselves)",
                stream.handle()
            ))),
        }
    }

    /// Gives captured memory back to the upstream; its record (taken) goes back when the
    /// upstream refuses (the driver does while another stream captures), so that a later
    /// free can still find it.
    fn free_captured(&self, ptr: DevPtr, size: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate(ptr, size, stream).inspect_err(|_| self.record_captured(ptr, size))
    }

    /// Forgets the captured allocation at `ptr`, checking its size: its size, or `None`
    /// when `ptr` is not one.
    fn take_captured(&self, ptr: DevPtr, bytes: usize) -> Result<Option<usize>> {
        let mut captured = crate::sync::lock(&self.captured);
        match captured.get(&ptr) {
            None => Ok(None),
            Some(&size) if size != bytes => Err(Error::InvalidPointer(format!(
                "{ptr:#x} (allocated in a CUDA graph capture, through the upstream) freed with size \
                 {bytes}, allocated with {size}"
            ))),
            Some(&size) => {
                captured.remove(&ptr);
                self.captured_count.fetch_sub(1, Ordering::Relaxed);
                Ok(Some(size))
            }
        }
    }
}

/// Whether `stream` is the calling thread's per-thread default stream while the thread
/// exits: a call from one of its thread-local destructors, after the pool's exit hook
/// retired that stream's shard, which may leave the pool at any moment (a release, a
/// look). Such calls go to the legacy default stream, ordered after the per-thread one
/// (which is blocking), so that the retired shard gets nothing more. A compare for every
/// other stream; for a per-thread one, a look at a thread-local.
#[inline]
fn exiting_per_thread(stream: &Stream) -> bool {
    stream.is_per_thread() && crate::stream::thread_exiting()
}

/// What a free in its stream's own shard came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnFree {
    Done,
    /// Not tried (`!blocking`): the lock is taken.
    Busy,
    /// The shard has no live block there: allocated on another stream, or a bad free.
    NotHere,
    /// The live block there has this size.
    WrongSize(usize),
}

fn wrong_size(ptr: DevPtr, had: usize, bytes: usize) -> Error {
    Error::InvalidPointer(format!("{ptr:#x} was allocated with {had} bytes (rounded) but freed with {bytes}"))
}

impl MemoryResource for ShardedPoolMemoryResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        "ShardedPoolMemoryResource"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }
    fn depth(&self) -> usize {
        self.depth
    }
    /// From [`Self::stats`]: the peak is since the pool was made (it is not reset).
    fn footprint(&self) -> Option<Footprint> {
        let s = self.stats();
        Some(Footprint {
            reserved_bytes: s.reserved_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            synchronizations: Some(s.synchronizations),
            waits: Some(s.cross_stream_waits),
            events_recorded: Some(s.events_recorded),
            event_queries: Some(s.event_queries),
            growths: Some(s.upstream_growths),
        })
    }

    // The four entry points try the same-stream path first (small answers, in registers)
    // and leave everything else, the checks' errors included, to the full path out of line.
    // That path looks into the stream's own shard once more (a fit may have appeared; a
    // cross-stream free then searches the others): one more look-up on a path that costs
    // far more anyway. Passing the first answer down instead made the fast path 2-5 ns
    // slower on the window bench.
    #[inline]
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        if exiting_per_thread(stream) {
            return self.allocate_cold(bytes, &Stream::legacy());
        }
        match self.allocate_own(bytes, stream, true) {
            Some(ptr) => Ok(ptr),
            None => self.allocate_cold(bytes, stream),
        }
    }

    #[inline]
    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if exiting_per_thread(stream) {
            return self.deallocate_cold(ptr, bytes, &Stream::legacy());
        }
        if self.deallocate_own(ptr, bytes, stream) {
            return Ok(());
        }
        self.deallocate_cold(ptr, bytes, stream)
    }

    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if exiting_per_thread(stream) {
            return None; // the full path, on the legacy stream
        }
        if let Some(ptr) = self.allocate_own(bytes, stream, false) {
            return Some(Ok(ptr));
        }
        if stream.is_capturing() {
            return None; // the upstream's, on the full path
        }
        // Settled by the checks (the null pointer, an error); else completed blocks of
        // other streams' shards (policy step 3) when no lock must be waited for; else the
        // full path's.
        if let Some(settled) = settle_allocate(self, bytes, stream) {
            return Some(settled);
        }
        if self.options.one_heap {
            return None; // a lock that others hold, and driver calls: the full path's
        }
        let key = stream.key(self.backend(), self.device());
        self.take_completed_live(class_size(bytes), stream, key, false).map(Ok)
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        if exiting_per_thread(stream) || self.options.one_heap {
            return None; // the full path (on the legacy stream; or one heap's)
        }
        // One look into the stream's own shard, whichever way the checks are passed.
        if !self.plainly_freeable(ptr, bytes, stream) {
            if stream.is_capturing() || self.captured_count.load(Ordering::Relaxed) != 0 {
                return None; // a capture's, or perhaps graph memory: the full path's
            }
            if let Some(settled) = settle_deallocate(self, ptr, bytes, stream) {
                return Some(settled);
            }
        }
        self.free_into(ptr, bytes, stream, false)
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let size = class_size(bytes);
        let key = stream.key(self.backend(), self.device());
        let result = if self.options.one_heap {
            self.heap_allocate(size, stream, key)
        } else {
            match self.take_own(size, stream, key, true).flatten() {
                Some(ptr) => Ok(ptr),
                None => self.allocate_slow(size, stream, key),
            }
        };
        match result {
            Ok(ptr) => Ok(ptr),
            // Name the size asked, not the rounded one.
            Err(Error::OutOfMemory { available, resource, .. }) => {
                Err(Error::OutOfMemory { requested: bytes, available, resource })
            }
            Err(e) => Err(e),
        }
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if self.options.one_heap {
            return self.heap_deallocate(ptr, class_size(bytes), bytes, stream);
        }
        self.free_into(ptr, bytes, stream, true).unwrap_or(Ok(()))
    }

    /// As its upstream: captured allocations are the upstream's.
    fn serves_capture(&self) -> bool {
        self.upstream.serves_capture()
    }
}

impl Drop for ShardedPoolMemoryResource {
    fn drop(&mut self) {
        // In a forked child the chunks are the parent's, and a shard's lock may have been
        // held by one of its threads at the fork: nothing is given back or locked.
        if crate::device::forked() {
            return;
        }
        // Every use of the pool's memory must finish before it goes back; failures (the
        // driver torn down at exit) are recorded (`streampool::drop_errors`).
        crate::error::synchronize_on_drop(self.backend(), self.device(), || {
            "ShardedPoolMemoryResource's synchronisation on drop".into()
        });
        let live = self.stats().used_bytes;
        if live > 0 {
            crate::error::record_leak_on_drop("ShardedPoolMemoryResource", &format!("{live} bytes were"));
        }
        let captured = crate::sync::lock(&self.captured).values().sum::<usize>();
        if captured > 0 {
            // The upstream's memory, whose free must come through this pool: no one can now.
            crate::error::record_leak_on_drop(
                "ShardedPoolMemoryResource",
                &format!("{captured} bytes of CUDA graph memory (allocated in captures, through the upstream) were"),
            );
        }
        let table = self.table();
        for c in table.sorted.iter().filter(|c| c.id != region::REGION_CHUNK) {
            let freed = self.upstream.deallocate(c.start, c.size, &Stream::legacy());
            crate::error::record_if_failed(
                || format!("ShardedPoolMemoryResource's chunk {:#x} on drop", c.start),
                freed,
            );
        }
        self.drop_region();
        // Threads keep the shards they used in their caches (until they have used
        // `THREAD_CACHE` others): emptied, a shard holds no event, so the backend (a
        // simulated device's memory) goes with the pool rather than with those threads.
        for shard in read(&self.shards).values() {
            *shard.state.lock() = ShardState::default();
        }
    }
}

impl fmt::Debug for ShardedPoolMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reserved = self.reserved.load(Ordering::Relaxed);
        write!(f, "ShardedPoolMemoryResource(reserved={reserved}, maximum=")?;
        match self.maximum {
            usize::MAX => write!(f, "none")?,
            maximum => write!(f, "{maximum}")?,
        }
        write!(f, ", upstream={:?})", self.upstream)
    }
}
