//! The lock-sharded stream-ordered pool. The design, the policy order and the reasons
//! are in `IMPLEMENTATION.md` beside this file.

mod addrmap;
mod freelist;

#[cfg(not(loom))]
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;

use freelist::{class_size, FreeBlock, FreeList, NotFreed};

use crate::device::{BackendRef, DevPtr};
use crate::error::{Error, Result};
use crate::resource::{
    checked_allocate, checked_deallocate, settle_allocate, settle_deallocate, MemoryKind, MemoryResource,
    ResourceRef, ALIGNMENT,
};
use crate::size::align_up;
use crate::stream::{Event, Stream};
use std::sync::Arc;

use crate::sync::{lock, read, write, AtomicU64, AtomicUsize, Mutex, Ordering, RwLock, ShardLock};

/// Growth never asks the upstream for less than this (unless the maximum leaves less).
pub const MIN_CHUNK: usize = 2 << 20;
/// Events a shard keeps in flight at most.
const MAX_EVENTS: usize = 16;
/// While no stream is short of memory, a shard's interval between events doubles after
/// each event, up to this many times `events_every`.
const MAX_EVENT_BACKOFF: usize = 64;
/// Growth asks for at most this beyond the request.
pub const MAX_GROWTH_STEP: usize = 1 << 30;

/// How much a growth asks the upstream for, beyond the request.
#[derive(Debug, Clone, Copy)]
enum Growth {
    /// The request, exactly (`initial_pool_size`).
    Exact,
    /// A quarter of what the pool holds, between `MIN_CHUNK` and `MAX_GROWTH_STEP`: few
    /// upstream calls for large pools, small steps for small ones.
    Geometric,
}

/// How a [`ShardedPoolMemoryResource`] grows, records events and gives memory back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolOptions {
    /// Bytes taken from the upstream at creation (rounded up to 256). `None`: nothing up
    /// front; the pool grows on demand.
    pub initial_pool_size: Option<usize>,
    /// The most the pool holds from the upstream (rounded down to 256). `None`: no limit
    /// but the upstream's.
    pub maximum_pool_size: Option<usize>,
    /// Free bytes the pool may keep; beyond this, chunks that are entirely free (and whose
    /// frees have completed) go back to the upstream whenever the pool learns of them
    /// (after a synchronisation, in `release`). `None`: keep everything.
    pub release_threshold: Option<usize>,
    /// A stream records an event (in one of its frees) after this many frees, so that
    /// other streams can tell when those blocks are free to take. While no stream is short
    /// of memory, each event doubles a stream's interval, up to 64 times this.
    pub events_every: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            initial_pool_size: None,
            maximum_pool_size: None,
            release_threshold: None,
            events_every: 64,
        }
    }
}

/// What the pool holds and how often each step of its policy was taken.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub reserved_bytes: usize,
    /// Bytes handed out and not yet freed.
    pub used_bytes: usize,
    /// Free bytes in the shards and the common list (reserved = used + free).
    pub free_bytes: usize,
    /// Free bytes in the common list (completed, usable by any stream).
    pub common_free_bytes: usize,
    /// Free bytes per shard, by stream key.
    pub shard_free_bytes: Vec<(u64, usize)>,
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
    /// Device synchronisations before failing (`cuCtxSynchronize`), the last resort.
    pub synchronizations: u64,
    /// Events recorded in frees.
    pub events_recorded: u64,
}

/// The lock-sharded stream-ordered pool (RMM's `pool_memory_resource`, without its one
/// lock): suballocates memory from any upstream resource with one shard of free blocks per
/// stream, so that threads on different streams never wait for one another on the hot
/// path.
///
/// # Policy (in order; `IMPLEMENTATION.md` has the reasons)
///
/// An allocation on stream S takes the first that works:
/// 1. the best-fitting block in S's own shard (blocks freed on S, or already ordered for
///    S): no event, no driver call;
/// 2. a block in the common list (frees known complete, usable by any stream);
/// 3. a block in another stream's shard whose free has completed (an event recorded in
///    that stream's frees reads complete);
/// 4. a new chunk from the upstream, allocated on S, while under `maximum_pool_size`;
/// 5. a block in another stream's shard whose free is covered by a recorded but
///    unfinished event: S is made to wait on it (`cuStreamWaitEvent`, counted);
/// 6. synchronise the device, move every free block to the common list, coalesce, give
///    whole free chunks back to the upstream and try 2 and 4 again (counted);
/// 7. `OutOfMemory`.
///
/// # Bad input
/// A free must pass the size it allocated (as in RMM). A double free, an address the pool
/// did not hand out, or a size that does not round to the allocation's (sizes are rounded
/// to 256 bytes, and above 4 KiB to one of 8 steps per power of two) is always refused with
/// [`Error::InvalidPointer`], and changes nothing (every live allocation has a record).
///
/// # Thread safety
/// Any thread may allocate and free on any stream. Each shard has its own lock; the
/// common list, the chunk table and the shard map have theirs, taken only off the hot
/// path. No lock is held across a call into the upstream. Sizes are rounded up to 256
/// bytes.
pub struct ShardedPoolMemoryResource {
    upstream: ResourceRef,
    /// The upstream's, kept here: every call asks for them (no dynamic call each time).
    backend: BackendRef,
    device: i32,
    #[cfg_attr(loom, allow(dead_code))]
    uid: u64,
    options: PoolOptions,
    maximum: usize,
    shards: RwLock<HashMap<u64, Arc<Shard>>>,
    common: Mutex<FreeList>,
    chunks: RwLock<Arc<ChunkTable>>,
    next_chunk: AtomicU64,
    reserved: AtomicUsize,
    /// Bumped when an allocation had to look beyond the completed blocks: every stream
    /// then records an event at its next free, so that its blocks can be taken.
    demand: AtomicU64,
    counters: Counters,
}

/// Written off the hot path (an event every batch of frees, steals, growth), read by
/// `stats`: on cache lines of their own, so that these writes do not evict the fields every
/// allocation reads (the demand count, the chunk table's generation, the options).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Counters {
    grown_bytes: AtomicU64,
    released_bytes: AtomicU64,
    growths: AtomicU64,
    completed_steals: AtomicU64,
    waits: AtomicU64,
    syncs: AtomicU64,
    events: AtomicU64,
}

/// The chunk table: every upstream allocation, sorted by start. Replaced (never changed
/// in place) on growth and release; read off the hot path only.
#[derive(Debug, Default)]
struct ChunkTable {
    sorted: Vec<Chunk>,
}

impl ChunkTable {
    /// The chunk that `[ptr, ptr + size)` lies in, if `ptr` is on a 256-byte boundary of it.
    fn containing(&self, ptr: DevPtr, size: usize) -> Option<&Chunk> {
        let after = self.sorted.partition_point(|c| c.start <= ptr);
        let c = &self.sorted[after.checked_sub(1)?];
        let fits = ptr + size as u64 <= c.start + c.size as u64 && (ptr - c.start) % ALIGNMENT as u64 == 0;
        fits.then_some(c)
    }

    fn by_id(&self, id: u64) -> Option<&Chunk> {
        self.sorted.iter().find(|c| c.id == id)
    }
}

#[derive(Debug, Clone)]
struct Chunk {
    start: u64,
    size: usize,
    id: u64,
}

/// One stream's free blocks. See `IMPLEMENTATION.md` for epochs. On cache lines of its
/// own: threads on different streams share nothing on the hot path.
#[derive(Debug)]
#[repr(align(128))]
struct Shard {
    key: u64,
    state: ShardLock<ShardState>,
}

#[derive(Debug, Default)]
struct ShardState {
    free: FreeList,
    /// The open epoch: blocks entering the shard now get it.
    epoch: u64,
    /// Blocks that entered in the open epoch.
    unevented: usize,
    /// Recorded events, oldest first: `(e, event)` covers every block of epoch <= e.
    events: VecDeque<(u64, Arc<Event>)>,
    /// Every block of an epoch below this has completed.
    completed: u64,
    /// The pool's demand count this shard last answered.
    seen_demand: u64,
    /// Another stream looked for completed blocks here and found none: record an event at
    /// the next free.
    wanted: bool,
    /// Frees between events now: `events_every`, doubled after each event recorded while
    /// nobody was short of memory (up to `MAX_EVENT_BACKOFF` times), reset on demand.
    interval: usize,
    spare_events: Vec<Arc<Event>>,
    /// Bytes allocated on this stream minus bytes freed on it (may go below zero for one
    /// shard when memory is freed on another stream; the sum is exact).
    used: i64,
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

impl ShardedPoolMemoryResource {
    /// A pool over `upstream`. `maximum_pool_size` below `initial_pool_size` is an error.
    pub fn new(upstream: ResourceRef, options: PoolOptions) -> Result<Self> {
        let round_down = |n: usize| n / ALIGNMENT * ALIGNMENT;
        let maximum = options.maximum_pool_size.map_or(usize::MAX, round_down);
        let initial = options.initial_pool_size.map(|n| align_up(n, ALIGNMENT)).unwrap_or(0);
        if initial > maximum {
            return Err(Error::invalid(format!(
                "maximum_pool_size ({maximum}) is below initial_pool_size ({initial})"
            )));
        }
        if options.maximum_pool_size == Some(0) {
            return Err(Error::invalid("maximum_pool_size must be at least 256 bytes"));
        }
        if options.events_every == 0 {
            return Err(Error::invalid("events_every must be at least 1"));
        }
        let pool = ShardedPoolMemoryResource {
            backend: upstream.backend().clone(),
            device: upstream.device(),
            upstream,
            uid: NEXT_POOL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            options,
            maximum,
            shards: RwLock::new(HashMap::new()),
            common: Mutex::new(FreeList::default()),
            chunks: RwLock::new(Arc::default()),
            next_chunk: AtomicU64::new(1),
            reserved: AtomicUsize::new(0),
            demand: AtomicU64::new(0),
            counters: Counters::default(),
        };
        if initial > 0 {
            let legacy = Stream::legacy();
            let chunk = pool.grow(initial, &legacy, Growth::Exact)?;
            pool.backend().stream_synchronize(pool.device(), legacy.handle())?;
            lock(&pool.common).insert(chunk.start, FreeBlock { size: chunk.size, chunk: chunk.id, epoch: 0 });
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    /// What the pool holds and how often each policy step ran. Exact when no other thread
    /// is allocating or freeing.
    pub fn stats(&self) -> PoolStats {
        let shards: Vec<Arc<Shard>> = read(&self.shards).values().cloned().collect();
        let mut used = 0i64;
        let mut shard_free_bytes: Vec<(u64, usize)> = shards
            .iter()
            .map(|s| {
                let st = s.state.lock();
                used += st.used;
                (s.key, st.free.bytes())
            })
            .collect();
        shard_free_bytes.sort_unstable();
        let common_free_bytes = lock(&self.common).bytes();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            reserved_bytes: self.reserved.load(Ordering::Relaxed),
            used_bytes: used.max(0) as usize,
            free_bytes: common_free_bytes + shard_free_bytes.iter().map(|s| s.1).sum::<usize>(),
            common_free_bytes,
            shard_free_bytes,
            grown_bytes: get(&c.grown_bytes),
            released_bytes: get(&c.released_bytes),
            upstream_growths: get(&c.growths),
            completed_steals: get(&c.completed_steals),
            cross_stream_waits: get(&c.waits),
            synchronizations: get(&c.syncs),
            events_recorded: get(&c.events),
        }
    }

    /// Gives every entirely free chunk whose frees are known to have completed back to
    /// the upstream; returns the bytes released. (Synchronise first to release more.)
    pub fn release(&self) -> Result<usize> {
        self.harvest_completed();
        self.trim(0)
    }

    /// Runs `f` on the shard of `key`, found among this thread's (or made on first use).
    /// Under loom, looked up in the pool every time: the model then sees every shared access.
    #[inline]
    fn with_shard<T>(&self, key: u64, f: impl FnOnce(&Shard) -> T) -> T {
        #[cfg(loom)]
        return f(&self.shard_slow(key));
        #[cfg(not(loom))]
        LOCALS.with(|cell| {
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
                        list.push(Local { pool: self.uid, key, shard: self.shard_slow(key) });
                        list.len() - 1
                    }
                };
            }
            f(&list[*last].shard)
        })
    }

    /// The chunk table now (off the hot path).
    fn table(&self) -> Arc<ChunkTable> {
        read(&self.chunks).clone()
    }

    /// The shard of `key`, made on first use. Two threads using a new stream at once get
    /// the same shard: it is inserted under the write lock, re-checked there.
    fn shard_slow(&self, key: u64) -> Arc<Shard> {
        if let Some(s) = read(&self.shards).get(&key) {
            return s.clone();
        }
        let mut map = write(&self.shards);
        map.entry(key)
            .or_insert_with(|| {
                Arc::new(Shard {
                    key,
                    state: ShardLock::new(ShardState {
                        interval: self.options.events_every,
                        ..Default::default()
                    }),
                })
            })
            .clone()
    }

    fn other_shards(&self, key: u64) -> Vec<Arc<Shard>> {
        read(&self.shards).values().filter(|s| s.key != key).cloned().collect()
    }

    /// Takes at least `size` bytes (by `growth`, see [`Growth`]) from
    /// the upstream on `stream` as a new chunk (not yet listed as free anywhere). The
    /// reservation is made before the upstream call and rolled back if it fails, so
    /// concurrent growths never pass the maximum.
    fn grow(&self, size: usize, stream: &Stream, growth: Growth) -> Result<Chunk> {
        let mut reserved = self.reserved.load(Ordering::Relaxed);
        let chunk = loop {
            let room = self.maximum.saturating_sub(reserved);
            if size > room {
                return Err(self.out_of_memory(size));
            }
            let want = match growth {
                Growth::Exact => size,
                Growth::Geometric => {
                    let step = (reserved / 4).clamp(MIN_CHUNK, MAX_GROWTH_STEP);
                    align_up(size.max(step), MIN_CHUNK).min(room / ALIGNMENT * ALIGNMENT).max(size)
                }
            };
            match self.reserved.compare_exchange_weak(
                reserved,
                reserved + want,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break want,
                Err(now) => reserved = now,
            }
        };
        let start = match self.upstream.allocate(chunk, stream) {
            Ok(p) => p,
            Err(e) => {
                self.reserved.fetch_sub(chunk, Ordering::AcqRel);
                return Err(e);
            }
        };
        let c = Chunk { start, size: chunk, id: self.next_chunk.fetch_add(1, Ordering::Relaxed) };
        {
            let mut table = write(&self.chunks);
            let mut next: Vec<Chunk> = table.sorted.clone();
            let at = next.partition_point(|x| x.start < start);
            next.insert(at, c.clone());
            *table = Arc::new(ChunkTable { sorted: next });
        }
        self.counters.growths.fetch_add(1, Ordering::Relaxed);
        self.counters.grown_bytes.fetch_add(chunk as u64, Ordering::Relaxed);
        Ok(c)
    }

    fn out_of_memory(&self, requested: usize) -> Error {
        let stats = self.stats();
        let available = self.maximum.saturating_sub(stats.reserved_bytes) + stats.free_bytes;
        Error::OutOfMemory {
            requested,
            available: Some(available.min(self.maximum)),
            resource: format!(
                "ShardedPoolMemoryResource ({} bytes reserved, {} in use{})",
                stats.reserved_bytes,
                stats.used_bytes,
                if self.maximum == usize::MAX {
                    String::new()
                } else {
                    format!(", maximum {}", self.maximum)
                }
            ),
        }
    }

    /// Moves every block known complete from every shard to the common list.
    fn harvest_completed(&self) {
        for shard in self.other_shards(u64::MAX) {
            let blocks = {
                let mut st = shard.state.lock();
                st.refresh();
                let done = st.completed;
                st.free.drain(|e| e < done)
            };
            let mut common = lock(&self.common);
            for (ptr, b) in blocks {
                common.insert(ptr, FreeBlock { epoch: 0, ..b });
            }
        }
    }

    /// Gives whole free chunks of the common list back to the upstream until at most
    /// `keep` free bytes remain; returns the bytes released.
    fn trim(&self, keep: usize) -> Result<usize> {
        let whole = {
            let table = self.table();
            let is_whole = |ptr: u64, b: &FreeBlock| {
                table.by_id(b.chunk).is_some_and(|c| c.start == ptr && c.size == b.size)
            };
            let mut common = lock(&self.common);
            let free_now = common.bytes();
            let mut candidates = common.take_whole_chunks(is_whole);
            // Keep the largest chunks when only some must go.
            candidates.sort_by_key(|(_, b)| std::cmp::Reverse(b.size));
            let mut excess = free_now.saturating_sub(keep);
            let mut release = Vec::new();
            for (ptr, b) in candidates {
                if excess >= b.size {
                    excess -= b.size;
                    release.push((ptr, b));
                } else {
                    common.insert(ptr, b);
                }
            }
            release
        };
        let mut released = 0;
        for (ptr, b) in whole {
            // Complete, so any stream orders the free; the legacy one always exists.
            self.upstream.deallocate(ptr, b.size, &Stream::legacy())?;
            {
                let mut table = write(&self.chunks);
                let next: Vec<Chunk> = table.sorted.iter().filter(|c| c.start != ptr).cloned().collect();
                *table = Arc::new(ChunkTable { sorted: next });
            }
            self.reserved.fetch_sub(b.size, Ordering::AcqRel);
            self.counters.released_bytes.fetch_add(b.size as u64, Ordering::Relaxed);
            released += b.size;
        }
        Ok(released)
    }

    fn keep_under_threshold(&self) -> Result<()> {
        if let Some(threshold) = self.options.release_threshold {
            let stats = self.stats();
            if stats.free_bytes > threshold {
                self.trim(threshold)?;
            }
        }
        Ok(())
    }

    /// Steps 2 to 7 of the policy; returns the address and its chunk.
    fn allocate_slow(&self, size: usize, stream: &Stream, key: u64) -> Result<(DevPtr, u64)> {
        // 2. completed blocks in the common list
        if let Some((ptr, b)) = lock(&self.common).take(size, |_| true) {
            return Ok((ptr, b.chunk));
        }
        // 3. completed blocks of other streams
        let others = self.other_shards(key);
        for shard in &others {
            let mut st = shard.state.lock();
            if st.free.bytes() == 0 {
                continue;
            }
            // This stream's memory is wanted: it records an event at its next free (its
            // interval may have grown long), so that what it frees can be taken next time
            // rather than memory grown anew.
            st.wanted = true;
            st.refresh();
            let done = st.completed;
            if let Some((ptr, b)) = st.free.take(size, |e| e < done) {
                self.counters.completed_steals.fetch_add(1, Ordering::Relaxed);
                return Ok((ptr, b.chunk));
            }
        }
        // 4. grow on this stream
        match self.grow(size, stream, Growth::Geometric) {
            Ok(chunk) => return Ok((self.place_chunk(&chunk, size, key), chunk.id)),
            Err(e) if e.is_out_of_memory() => {}
            Err(e) => return Err(e),
        }
        // Memory is short: ask every stream to record an event at its next free, so that
        // what it frees from now on can be taken by others.
        self.demand.fetch_add(1, Ordering::Relaxed);
        // 5. wait on another stream's recorded event
        for shard in &others {
            let taken = {
                let mut st = shard.state.lock();
                st.refresh();
                // Only blocks an event covers (or known complete): blocks of an epoch that
                // a concurrent synchronisation closed without an event are neither.
                let covered = st.events.back().map_or(0, |(e, _)| e + 1).max(st.completed);
                st.free.take(size, |e| e < covered).map(|(ptr, b)| (ptr, b.chunk, st.covering(b.epoch)))
            };
            if let Some((ptr, chunk, event)) = taken {
                if let Some(event) = event {
                    if let Err(e) = stream.wait(&event) {
                        // Not handed out: put it back where it was (its shard's epoch
                        // ordering still holds for it).
                        self.return_block(ptr, size, chunk);
                        return Err(e);
                    }
                    self.counters.waits.fetch_add(1, Ordering::Relaxed);
                }
                return Ok((ptr, chunk));
            }
        }
        // 6. synchronise, gather, coalesce, release, retry
        self.synchronize_and_gather()?;
        if let Some((ptr, b)) = lock(&self.common).take(size, |_| true) {
            return Ok((ptr, b.chunk));
        }
        self.trim(0)?;
        match self.grow(size, stream, Growth::Geometric) {
            Ok(chunk) => Ok((self.place_chunk(&chunk, size, key), chunk.id)),
            Err(e) if e.is_out_of_memory() => Err(self.out_of_memory(size)),
            Err(e) => Err(e),
        }
    }

    /// A fresh chunk grown on the stream of `key`: the first `size` bytes are handed out,
    /// the rest goes to that stream's shard (memory from an async upstream is ordered for
    /// the growing stream only, so it is treated as freed there).
    fn place_chunk(&self, chunk: &Chunk, size: usize, key: u64) -> DevPtr {
        if chunk.size > size {
            let shard = self.shard_slow(key);
            let mut st = shard.state.lock();
            let epoch = st.epoch;
            st.free.insert(
                chunk.start + size as u64,
                FreeBlock { size: chunk.size - size, chunk: chunk.id, epoch },
            );
            st.unevented += 1;
        }
        chunk.start
    }

    /// A block taken but not handed out (its wait failed: rare) goes to the common list
    /// after a device synchronisation, which completes its free.
    fn return_block(&self, ptr: DevPtr, size: usize, chunk: u64) {
        let _ = self.backend().ctx_synchronize(self.device());
        lock(&self.common).insert(ptr, FreeBlock { size, chunk, epoch: 0 });
    }

    fn synchronize_and_gather(&self) -> Result<()> {
        // Close every shard's open epoch first: blocks freed before the synchronisation
        // starts are complete after it; blocks freed meanwhile get the next epoch.
        let shards = self.other_shards(u64::MAX);
        let closed: Vec<u64> = shards
            .iter()
            .map(|s| {
                let mut st = s.state.lock();
                let e = st.epoch;
                st.epoch += 1;
                st.unevented = 0;
                e
            })
            .collect();
        self.backend().ctx_synchronize(self.device())?;
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        for (shard, e) in shards.iter().zip(closed) {
            let mut st = shard.state.lock();
            st.completed = st.completed.max(e + 1);
            while st.events.front().is_some_and(|(ev, _)| *ev <= e) {
                let (_, ev) = st.events.pop_front().expect("checked");
                st.spare(ev);
            }
        }
        self.harvest_completed();
        self.keep_under_threshold()
    }

    /// Records an event on `stream` covering the shard's open epoch (inside a free on
    /// that stream, so the stream is alive).
    fn record(&self, st: &mut ShardState, stream: &Stream) -> Result<()> {
        st.refresh();
        if st.events.len() >= MAX_EVENTS {
            // The oldest have not finished: more would not make blocks takeable sooner.
            // The open epoch stays open, and the next record (after another batch of
            // frees, not at every free) covers it.
            st.unevented = 0;
            return Ok(());
        }
        let event = match st.spare_events.pop() {
            Some(e) => e,
            None => Arc::new(Event::new(self.backend(), self.device())?),
        };
        event.record(stream)?;
        let epoch = st.epoch;
        st.events.push_back((epoch, event));
        st.epoch += 1;
        st.unevented = 0;
        self.counters.events.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl ShardState {
    /// Whether another stream asked for this stream's memory since its last event (it
    /// looked into this shard, or the pool's demand count moved).
    #[inline]
    fn asked(&self, demand: u64) -> bool {
        self.wanted || demand != self.seen_demand
    }

    /// Whether the next free is to record an event: asked for, or the interval is up.
    #[inline]
    fn event_due(&self, demand: u64) -> bool {
        self.asked(demand) || self.unevented + 1 >= self.interval
    }

    /// Advances `completed` past every recorded event that has finished.
    fn refresh(&mut self) {
        while let Some((e, ev)) = self.events.front() {
            if !ev.query().unwrap_or(false) {
                break;
            }
            self.completed = self.completed.max(e + 1);
            let (_, ev) = self.events.pop_front().expect("checked");
            self.spare(ev);
        }
    }

    /// The event that covers blocks of `epoch`, or None when they are known complete.
    fn covering(&self, epoch: u64) -> Option<Arc<Event>> {
        if epoch < self.completed {
            return None;
        }
        self.events.iter().find(|(e, _)| *e >= epoch).map(|(_, ev)| ev.clone())
    }

    fn spare(&mut self, event: Arc<Event>) {
        // Reused only when no waiter still holds it (a re-record would make it wait longer).
        if Arc::strong_count(&event) == 1 && self.spare_events.len() < 8 {
            self.spare_events.push(event);
        }
    }
}

impl ShardedPoolMemoryResource {
    /// Step 1 of the policy. `None` when `!blocking` and the shard's lock is taken.
    #[inline]
    fn take_own(&self, size: usize, key: u64, blocking: bool) -> Option<Option<DevPtr>> {
        self.with_shard(key, |shard| {
            let mut st = if blocking { shard.state.lock() } else { shard.state.try_lock()? };
            let ptr = st.free.allocate(size);
            if ptr.is_some() {
                st.used += size as i64;
            }
            Some(ptr)
        })
    }

    /// Records an allocation of the slow path (steps 2 to 6) as live in its stream's shard.
    fn record_live(&self, ptr: DevPtr, size: usize, chunk: u64, key: u64) {
        let shard = self.shard_slow(key);
        let mut st = shard.state.lock();
        st.free.insert_live(ptr, size, chunk);
        st.used += size as i64;
    }

    /// Frees a block allocated on `stream` into its shard (`size` rounded by
    /// [`class_size`]), recording an event when one is due. The answer is small, so that
    /// the hot path keeps it in registers (an `Option<Result<..>>` of the crate's error,
    /// built and copied on the stack, stalled the loads that read it back).
    #[inline]
    fn free_own(&self, ptr: DevPtr, size: usize, stream: &Stream, blocking: bool) -> OwnFree {
        let key = stream.key(self.backend(), self.device());
        let demand = self.demand.load(Ordering::Relaxed);
        self.with_shard(key, |shard| {
            let mut st = if blocking {
                shard.state.lock()
            } else {
                match shard.state.try_lock() {
                    Some(st) if !st.event_due(demand) => st,
                    _ => return OwnFree::Busy,
                }
            };
            let epoch = st.epoch;
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
    /// `None` when `!blocking` and that would wait for a lock, call the driver, or look
    /// through other shards (a block allocated on another stream).
    fn free_into(&self, ptr: DevPtr, bytes: usize, stream: &Stream, blocking: bool) -> Option<Result<()>> {
        let size = class_size(bytes);
        match self.free_own(ptr, size, stream, blocking) {
            OwnFree::Done => Some(Ok(())),
            OwnFree::Busy => None,
            OwnFree::NotHere if !blocking => None,
            OwnFree::NotHere => {
                let key = stream.key(self.backend(), self.device());
                Some(self.free_foreign(ptr, size, bytes, stream, key, self.demand.load(Ordering::Relaxed)))
            }
            OwnFree::WrongSize(had) => Some(Err(wrong_size(ptr, had, bytes))),
        }
    }

    /// A free on one stream of a block allocated on another: the block leaves the shard it
    /// was allocated from and enters this stream's (its memory is now last used here).
    fn free_foreign(
        &self,
        ptr: DevPtr,
        size: usize,
        bytes: usize,
        stream: &Stream,
        key: u64,
        demand: u64,
    ) -> Result<()> {
        let mut chunk = None;
        for shard in self.other_shards(key) {
            let mut st = shard.state.lock();
            match st.free.take_live(ptr, size) {
                Ok(c) => {
                    st.used -= size as i64;
                    chunk = Some(c);
                    break;
                }
                Err(NotFreed::Unknown) => {}
                Err(NotFreed::WrongSize(had)) => return Err(wrong_size(ptr, had, bytes)),
            }
        }
        let Some(chunk) = chunk else {
            return Err(Error::InvalidPointer(if self.table().containing(ptr, size).is_some() {
                format!("{ptr:#x} is not an outstanding allocation of this ShardedPoolMemoryResource (double free?)")
            } else {
                format!("{ptr:#x} (+{bytes} bytes) does not lie in memory of this ShardedPoolMemoryResource")
            }));
        };
        let shard = self.shard_slow(key);
        let mut st = shard.state.lock();
        let epoch = st.epoch;
        st.free.insert(ptr, FreeBlock { size, chunk, epoch });
        self.after_free(&mut st, stream, demand);
        Ok(())
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
        st.interval = if st.asked(demand) {
            self.options.events_every
        } else {
            st.interval.saturating_mul(2).min(self.options.events_every * MAX_EVENT_BACKOFF)
        };
        st.seen_demand = demand;
        st.wanted = false;
        // Failing to record only delays reuse by other streams.
        let _ = self.record(st, stream);
    }

    /// The same-stream fast path of an allocation (policy step 1), for sizes and streams
    /// that need no check beyond a comparison; `None` sends the caller to the full path.
    #[inline]
    fn allocate_own(&self, bytes: usize, stream: &Stream, blocking: bool) -> Option<DevPtr> {
        // 0 (the null pointer) and impossible sizes are settled by the full path.
        if bytes.wrapping_sub(1) >= isize::MAX as usize || !stream.is_bound_to(self.backend(), self.device())
        {
            return None;
        }
        self.take_own(class_size(bytes), stream.key(self.backend(), self.device()), blocking).flatten()
    }

    /// True when a free passes the trait's checks by comparisons alone (a pointer and a
    /// size that are not 0, a stream of this backend object and device).
    #[inline]
    fn plainly_freeable(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> bool {
        ptr != 0 && bytes != 0 && stream.is_bound_to(self.backend(), self.device())
    }

    /// The same-stream fast path of a free: true once freed.
    #[inline]
    fn deallocate_own(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> bool {
        self.plainly_freeable(ptr, bytes, stream)
            && matches!(self.free_own(ptr, class_size(bytes), stream, true), OwnFree::Done)
    }

    #[cold]
    #[inline(never)]
    fn allocate_cold(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        checked_allocate(self, bytes, stream)
    }

    #[cold]
    #[inline(never)]
    fn deallocate_cold(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        checked_deallocate(self, ptr, bytes, stream)
    }
}

/// What a free in its stream's own shard came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnFree {
    Done,
    /// Not tried (`!blocking`): the lock is taken, or an event is due (a driver call).
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

    // The four entry points try the same-stream path first (small answers, in registers)
    // and leave everything else, the checks' errors included, to the full path out of line.
    // That path looks into the stream's own shard once more (a fit may have appeared; a
    // cross-stream free then searches the others): one more look-up on a path that costs
    // far more anyway. Passing the first answer down instead made the fast path 2-5 ns
    // slower on the window bench.
    #[inline]
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        match self.allocate_own(bytes, stream, true) {
            Some(ptr) => Ok(ptr),
            None => self.allocate_cold(bytes, stream),
        }
    }

    #[inline]
    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if self.deallocate_own(ptr, bytes, stream) {
            return Ok(());
        }
        self.deallocate_cold(ptr, bytes, stream)
    }

    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if let Some(ptr) = self.allocate_own(bytes, stream, false) {
            return Some(Ok(ptr));
        }
        // Settled by the checks (the null pointer, an error), or the full path's to do.
        settle_allocate(self, bytes, stream)
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        // One look into the stream's own shard, whichever way the checks are passed.
        if !self.plainly_freeable(ptr, bytes, stream) {
            if let Some(settled) = settle_deallocate(self, ptr, bytes, stream) {
                return Some(settled);
            }
        }
        self.free_into(ptr, bytes, stream, false)
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let size = class_size(bytes);
        let key = stream.key(self.backend(), self.device());
        let result = match self.take_own(size, key, true).flatten() {
            Some(ptr) => Ok(ptr),
            None => self.allocate_slow(size, stream, key).map(|(ptr, chunk)| {
                self.record_live(ptr, size, chunk, key);
                ptr
            }),
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
        self.free_into(ptr, bytes, stream, true).unwrap_or(Ok(()))
    }
}

impl Drop for ShardedPoolMemoryResource {
    fn drop(&mut self) {
        // Every use of the pool's memory must finish before it goes back; failures (the
        // driver torn down at exit) have nobody to report to.
        let _ = self.backend().ctx_synchronize(self.device());
        let table = self.table();
        for c in table.sorted.iter() {
            let _ = self.upstream.deallocate(c.start, c.size, &Stream::legacy());
        }
    }
}

impl fmt::Debug for ShardedPoolMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ShardedPoolMemoryResource(reserved={}, maximum={}, upstream={:?})",
            self.reserved.load(Ordering::Relaxed),
            self.maximum,
            self.upstream
        )
    }
}

/// Loom models of the shard logic: `make test-loom`. Each runs every interleaving of two
/// threads (within loom's bounds) through the real pool over the simulated device; the
/// device itself is not modelled (its lock is never held across a pool lock).
///
/// Cross-shard reuse racing with growth under a maximum is not modelled here: such a
/// model (two streams, growth failing, a wait or a synchronisation, then reuse) stops inside
/// loom 0.7.3 itself, at "expected to be able to acquire lock" in its mutex, and an earlier
/// one at "TODO: this sometimes fails" in its atomics; neither was traced to the pool (the
/// same scenario passes as a stress test under eight threads). tests/pool.rs covers it with
/// stress tests and random interleavings.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::device::sim::SimDevice;
    use crate::resources::CudaMemoryResource;

    fn pool(options: PoolOptions) -> (Arc<ShardedPoolMemoryResource>, BackendRef) {
        let sim: BackendRef = SimDevice::new(64 << 20);
        let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(sim.clone(), 0));
        (Arc::new(ShardedPoolMemoryResource::new(upstream, options).unwrap()), sim)
    }

    /// A thread that allocates `n` bytes on `s` and frees them; joins to the address.
    fn use_once(
        p: &Arc<ShardedPoolMemoryResource>,
        s: &Stream,
        n: usize,
    ) -> loom::thread::JoinHandle<DevPtr> {
        let (p, s) = (p.clone(), s.clone());
        loom::thread::spawn(move || {
            let x = p.allocate(n, &s).unwrap();
            p.deallocate(x, n, &s).unwrap();
            x
        })
    }

    fn check(p: &ShardedPoolMemoryResource) {
        let s = p.stats();
        assert_eq!(s.reserved_bytes, s.used_bytes + s.free_bytes, "{s:?}");
        assert_eq!(s.used_bytes, 0, "{s:?}");
    }

    /// Two threads use a new stream for the first time at once: one shard, nothing lost,
    /// no block handed out twice.
    #[test]
    fn loom_first_use_of_a_stream() {
        crate::sync::model(|| {
            let (p, b) = pool(PoolOptions { initial_pool_size: Some(1 << 20), ..Default::default() });
            let s = Stream::create(&b, 0, false).unwrap();
            let other = use_once(&p, &s, 4096);
            let y = p.allocate(4096, &s).unwrap();
            other.join().unwrap();
            p.deallocate(y, 4096, &s).unwrap();
            check(&p);
            assert_eq!(p.stats().shard_free_bytes.iter().filter(|(k, _)| *k == s.key(&b, 0)).count(), 1);
        });
    }

    /// Two threads allocate and free on one stream at once: its shard's free list is shared,
    /// blocks split and merge under its lock; nothing is handed out twice, nothing is lost.
    #[test]
    fn loom_one_stream_two_threads() {
        crate::sync::model(|| {
            let (p, b) = pool(PoolOptions { initial_pool_size: Some(1 << 20), ..Default::default() });
            let s = Stream::create(&b, 0, false).unwrap();
            let other = use_once(&p, &s, 8192);
            let y = p.allocate(4096, &s).unwrap();
            let z = p.allocate(4096, &s).unwrap();
            assert_ne!(y, z);
            p.deallocate(y, 4096, &s).unwrap();
            p.deallocate(z, 4096, &s).unwrap();
            other.join().unwrap();
            check(&p);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The chunk look-up finds the same chunk as a scan of every chunk, for chunks of
        /// any size and alignment.
        #[test]
        fn chunk_lookup_matches_a_scan(
            gaps in proptest::collection::vec((0u64..20_000, 1usize..40_000), 1..12),
            probes in proptest::collection::vec((0u64..600_000, 1usize..4), 1..64),
        ) {
            let (mut at, mut chunks) = (1u64 << 40, Vec::new());
            for (i, (gap, granules)) in gaps.into_iter().enumerate() {
                at += gap * 256;
                chunks.push(Chunk { start: at, size: granules * 256, id: i as u64 + 1 });
                at += granules as u64 * 256;
            }
            let table = ChunkTable { sorted: chunks.clone() };
            for (offset, granules) in probes {
                let ptr = (1u64 << 40) + offset * 64;
                let size = granules * 256;
                let scan = chunks.iter().find(|c| {
                    c.start <= ptr && ptr + size as u64 <= c.start + c.size as u64 && (ptr - c.start) % 256 == 0
                });
                prop_assert_eq!(table.containing(ptr, size).map(|c| c.id), scan.map(|c| c.id));
            }
            for c in &chunks {
                prop_assert_eq!(table.by_id(c.id).map(|c| c.start), Some(c.start));
            }
        }
    }
}
