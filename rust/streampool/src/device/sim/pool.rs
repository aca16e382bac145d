//! The driver's stream-ordered memory pool, as the driver behaves by default.
//!
//! A pool reserves backing memory in chunks (multiples of [`CHUNK`], counted against the
//! device capacity) and hands out blocks of them. A freed block remembers its *free
//! point*: the stream it was freed on and that stream's clock at `cuMemFreeAsync`
//! (everything ordered before the free). `cuMemAllocFromPoolAsync(bytes, B)` takes the
//! smallest block that fits, from the first class that has one:
//!
//! 0. a block freed on B itself: B's own order covers the earlier uses;
//! 1. a block never used, or whose free point has completed: completion covers them;
//! 2. any other free block: the driver inserts a wait on the free point into B alone
//!    (its "internal dependencies"), so the block is ordered for B but for no other
//!    stream;
//!
//! and failing all three grows the pool by a chunk, or returns
//! `CUDA_ERROR_OUT_OF_MEMORY` when the capacity is reached (after releasing the pool's
//! own idle chunks). Neighbouring free blocks of one chunk are coalesced; the merged
//! block waits for both free points. At every host synchronisation a pool releases
//! whole idle chunks while it holds more than its release threshold; `cuMemPoolTrimTo`
//! does the same down to a given size. An idle chunk is one with no allocation, whose
//! frees have completed, and that no queued operation still touches.

use std::collections::{BTreeMap, BTreeSet};

use super::clock::VClock;
use super::detector::OpKind;
use super::memory::{round_up, Alloc, AllocKind, HostBlock, ALIGN};
use super::{host_refused, oom, State, StreamState};
use crate::device::{DevPtr, PoolAttr, RawPool};
use crate::error::{Error, Result};

/// Pools grow by multiples of this.
pub(super) const CHUNK: usize = 2 << 20;

/// First pool handle; later ones count up from it.
pub(super) const FIRST_POOL: RawPool = 0x5000_0000;

#[derive(Debug)]
pub(super) struct Pool {
    pub(super) dev: i32,
    pub(super) managed: bool,
    pub(super) is_default: bool,
    /// Destroyed by the program; released once its last allocation is freed.
    pub(super) destroyed: bool,
    /// The shared file its chunks live in, for a pool created with `posix_fd_ipc`.
    pub(super) arena: Option<super::ipc::Arena>,
    /// Other devices granted access to its memory (`cuMemPoolSetAccess`).
    pub(super) access: BTreeSet<i32>,
    threshold: u64,
    chunks: BTreeMap<u64, Chunk>,
    free: BTreeMap<u64, FreeBlock>,
    reserved: usize,
    reserved_high: usize,
    used: usize,
    used_high: usize,
}

#[derive(Debug)]
struct Chunk {
    block: HostBlock,
    /// Its offset in the pool's [`super::ipc::Arena`], for an exportable pool.
    offset: Option<u64>,
    /// Bytes of it handed out.
    used: usize,
}

#[derive(Debug)]
struct FreeBlock {
    size: usize,
    /// `None`: never used, or every use completed.
    point: Option<FreePoint>,
}

#[derive(Debug, Clone)]
struct FreePoint {
    /// The stream it was freed on; `None` after merging blocks freed on two streams.
    stream: Option<u64>,
    /// What the free was ordered after (only entries not completed when it was taken).
    clock: VClock,
}

fn done(streams: &BTreeMap<u64, StreamState>, clock: &VClock) -> bool {
    clock.iter().all(|(s, n)| super::exec::seq_done(streams, s, n))
}

/// Drops a free point whose work has all completed: such a block is as good as new.
fn settle(streams: &BTreeMap<u64, StreamState>, point: Option<FreePoint>) -> Option<FreePoint> {
    point.filter(|p| !done(streams, &p.clock))
}

fn merge(a: Option<FreePoint>, b: Option<FreePoint>) -> Option<FreePoint> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(mut a), Some(b)) => {
            if a.stream != b.stream {
                a.stream = None;
            }
            a.clock.join(&b.clock);
            Some(a)
        }
    }
}

impl Pool {
    pub(super) fn new(dev: i32, managed: bool, is_default: bool) -> Self {
        Pool {
            dev,
            managed,
            is_default,
            destroyed: false,
            arena: None,
            access: BTreeSet::new(),
            threshold: 0,
            chunks: BTreeMap::new(),
            free: BTreeMap::new(),
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
        }
    }

    /// The base of the chunk holding `addr` and the chunk's offset in the pool's file.
    pub(super) fn chunk_offset(&self, addr: u64) -> Option<(u64, u64)> {
        let (&base, chunk) = self.chunks.range(..=addr).next_back()?;
        Some((base, chunk.offset?))
    }

    fn chunk_of(&mut self, addr: u64) -> (u64, &mut Chunk) {
        let (&base, chunk) = self.chunks.range_mut(..=addr).next_back().expect("block inside a chunk");
        (base, chunk)
    }

    /// Returns `[addr, addr + size)` to the free list, merged with free neighbours in
    /// its chunk.
    fn insert_free(&mut self, mut addr: u64, mut size: usize, mut point: Option<FreePoint>) {
        let (base, chunk) = self.chunk_of(addr);
        let chunk_end = base + chunk.block.len() as u64;
        let next = addr + size as u64;
        if next < chunk_end {
            if let Some(n) = self.free.remove(&next) {
                size += n.size;
                point = merge(point, n.point);
            }
        }
        if let Some((&prev, p)) = self.free.range(base..addr).next_back() {
            if prev + p.size as u64 == addr {
                let p = self.free.remove(&prev).expect("found above");
                addr = prev;
                size += p.size;
                point = merge(point, p.point);
            }
        }
        self.free.insert(addr, FreeBlock { size, point });
    }
}

impl State {
    pub(super) fn new_pool(&mut self, dev: i32, managed: bool, is_default: bool) -> RawPool {
        let handle = self.next_pool;
        self.next_pool += 1;
        self.pools.insert(handle, Pool::new(dev, managed, is_default));
        handle
    }

    /// A pool the program may use (not destroyed).
    pub(super) fn pool(&self, handle: RawPool) -> Result<&Pool> {
        match self.pools.get(&handle) {
            Some(p) if !p.destroyed => Ok(p),
            _ => Err(Error::InvalidArgument(format!(
                "{handle:#x} is not a live memory pool of {} (never created, or destroyed)",
                self.name
            ))),
        }
    }

    fn pool_mut(&mut self, handle: RawPool) -> Result<&mut Pool> {
        self.pool(handle)?;
        Ok(self.pools.get_mut(&handle).expect("checked above"))
    }

    /// `cuMemAllocFromPoolAsync`.
    pub(super) fn pool_alloc(&mut self, handle: RawPool, bytes: usize, sid: u64) -> Result<DevPtr> {
        const CALL: &str = "cuMemAllocFromPoolAsync";
        let pool = self.pool(handle)?;
        if bytes == 0 {
            return Err(Error::Driver {
                call: CALL,
                code: crate::error::CUDA_ERROR_INVALID_VALUE,
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                context: String::new(),
            });
        }
        let size = round_up(bytes, ALIGN).ok_or_else(|| oom(CALL))?;
        let class = |point: &Option<FreePoint>| match point {
            None => 1,
            Some(p) if p.stream == Some(sid) => 0,
            Some(p) if done(&self.streams, &p.clock) => 1,
            Some(_) => 2,
        };
        let pick = pool
            .free
            .iter()
            .filter(|(_, b)| b.size >= size)
            .min_by_key(|(&addr, b)| (class(&b.point), b.size, addr))
            .map(|(&addr, b)| (addr, class(&b.point)));
        let (addr, wait) = match pick {
            Some((addr, class)) => (addr, class == 2),
            None => (self.grow(handle, size)?, false),
        };
        let pool = self.pools.get_mut(&handle).expect("checked above");
        let block = pool.free.remove(&addr).expect("picked above");
        if block.size > size {
            pool.free.insert(
                addr + size as u64,
                FreeBlock { size: block.size - size, point: block.point.clone() },
            );
        }
        pool.chunk_of(addr).1.used += size;
        pool.used += size;
        pool.used_high = pool.used_high.max(pool.used);
        let dev = pool.dev;
        // The driver's internal dependency for a class 2 block: B waits for the free point;
        // no other stream is ordered by it. On the legacy default stream the call is also a
        // barrier with the blocking streams (it "uses standard default stream semantics"),
        // which `add_dependency` queues there while their work is pending.
        let deps = match wait {
            true => block.point.expect("class 2 blocks have a free point").clock,
            false => VClock::default(),
        };
        self.add_dependency(sid, &deps, OpKind::Wait, "wait inserted by cuMemAllocFromPoolAsync");
        self.allocs.insert(
            addr,
            Alloc {
                bytes,
                size,
                kind: AllocKind::Pool(handle),
                dev,
                block: None,
                prefetched: Default::default(),
            },
        );
        Ok(addr)
    }

    /// Adds a chunk that holds `size` bytes; returns its address (one free block).
    fn grow(&mut self, handle: RawPool, size: usize) -> Result<u64> {
        const CALL: &str = "cuMemAllocFromPoolAsync";
        let len = round_up(size, CHUNK).ok_or_else(|| oom(CALL))?;
        let dev = self.pools[&handle].dev;
        if len > self.free_bytes(dev) {
            // Make room with this pool's own idle chunks before giving up.
            self.release_chunks(handle, 0);
            if len > self.free_bytes(dev) {
                return Err(oom(CALL));
            }
        }
        let mapped = self
            .pools
            .get_mut(&handle)
            .expect("checked by the caller")
            .arena
            .as_mut()
            .map(|a| a.map_chunk(len));
        let (block, offset) = match mapped {
            Some(Ok((block, offset))) => (block, Some(offset)),
            Some(Err(_)) => return Err(host_refused(self, len)),
            None => (HostBlock::new(len).ok_or_else(|| host_refused(self, len))?, None),
        };
        let base = block.addr();
        self.chunks.insert(base, (len, handle));
        self.devices[dev as usize].reserved += len;
        let pool = self.pools.get_mut(&handle).expect("checked by the caller");
        pool.chunks.insert(base, Chunk { block, offset, used: 0 });
        pool.free.insert(base, FreeBlock { size: len, point: None });
        pool.reserved += len;
        pool.reserved_high = pool.reserved_high.max(pool.reserved);
        Ok(base)
    }

    /// `cuMemFreeAsync`. Validates before anything else, so that a bad pointer changes
    /// nothing.
    pub(super) fn pool_free(&mut self, ptr: DevPtr, sid: u64) -> Result<()> {
        let handle = match self.allocs.get(&ptr).map(|a| a.kind) {
            Some(AllocKind::Pool(h)) => h,
            Some(_) => {
                return Err(Error::InvalidPointer(format!(
                    "cuMemFreeAsync({ptr:#x}): the pointer was not allocated from a memory pool, \
                     and the simulated device does not model a stream-ordered free of other \
                     memory (free it with cuMemFree or cuMemFreeHost)"
                )))
            }
            None => {
                return Err(Error::InvalidPointer(format!(
                    "cuMemFreeAsync({ptr:#x}): not the start of a live allocation of {} \
                     (double free, or foreign pointer)",
                    self.name
                )))
            }
        };
        // On the legacy default stream the free is a barrier with the blocking streams, as
        // the allocation is (see `pool_alloc`); the free point then follows the barrier.
        self.add_dependency(sid, &VClock::default(), OpKind::Wait, "cuMemFreeAsync");
        self.free_to_pool(ptr, handle, Some(sid));
        Ok(())
    }

    /// Returns the pool allocation at `ptr`, of pool `handle`, to its pool: freed in the
    /// order of stream `sid` (`cuMemFreeAsync`), or with `None` as though every use of it
    /// had completed (`cuMemFree`, which the driver documents as not synchronising for
    /// such memory: the caller must have waited for its work, and a block reused while
    /// that work is still queued races with it in the detector).
    pub(super) fn free_to_pool(&mut self, ptr: DevPtr, handle: RawPool, sid: Option<u64>) {
        let a = self.allocs.remove(&ptr).expect("checked by the caller");
        let point = sid.map(|sid| FreePoint { stream: Some(sid), clock: self.point_clock(sid) });
        let point = settle(&self.streams, point);
        let pool = self.pools.get_mut(&handle).expect("a pool outlives its allocations");
        pool.chunk_of(ptr).1.used -= a.size;
        pool.used -= a.size;
        pool.insert_free(ptr, a.size, point);
        if pool.destroyed {
            self.reap(handle);
        }
    }

    /// Releases idle chunks of a pool, highest address first, while it holds more than
    /// `keep` bytes.
    pub(super) fn release_chunks(&mut self, handle: RawPool, keep: usize) {
        let Some(pool) = self.pools.get(&handle) else { return };
        if pool.reserved <= keep {
            return;
        }
        let mut idle: Vec<(u64, usize)> = pool
            .chunks
            .iter()
            .rev()
            .filter(|(base, c)| {
                c.used == 0
                    && pool.free.get(base).is_some_and(|b| {
                        b.size == c.block.len()
                            && b.point.as_ref().is_none_or(|p| done(&self.streams, &p.clock))
                    })
            })
            .map(|(&base, c)| (base, c.block.len()))
            .collect();
        if !idle.is_empty() {
            // A buggy program may still have work queued on memory it freed: keep it.
            let busy = self.pending_ranges();
            idle.retain(|&(base, len)| !busy.iter().any(|&(s, e)| s < base + len as u64 && base < e));
        }
        let pool = self.pools.get_mut(&handle).expect("checked above");
        for (base, len) in idle {
            if pool.reserved <= keep {
                break;
            }
            pool.free.remove(&base);
            if let Some(Chunk { offset: Some(offset), .. }) = pool.chunks.remove(&base) {
                if let Some(arena) = &pool.arena {
                    arena.punch(offset, len);
                }
            }
            pool.reserved -= len;
            self.chunks.remove(&base);
            self.devices[pool.dev as usize].reserved -= len;
        }
    }

    /// A destroyed pool goes once its last allocation is freed and its chunks idle.
    fn reap(&mut self, handle: RawPool) {
        if self.pools.get(&handle).is_some_and(|p| p.destroyed && p.used == 0) {
            self.release_chunks(handle, 0);
            if self.pools[&handle].reserved == 0 {
                self.pools.remove(&handle);
            }
        }
    }

    /// What every host synchronisation does to pools: release down to each threshold.
    pub(super) fn apply_thresholds(&mut self) {
        let handles: Vec<(RawPool, bool, u64)> =
            self.pools.iter().map(|(&h, p)| (h, p.destroyed, p.threshold)).collect();
        for (h, destroyed, threshold) in handles {
            if destroyed {
                self.reap(h);
            } else {
                self.release_chunks(h, usize::try_from(threshold).unwrap_or(usize::MAX));
            }
        }
    }

    /// `cuMemPoolTrimTo`.
    pub(super) fn pool_trim(&mut self, handle: RawPool, keep: usize) -> Result<()> {
        self.pool(handle)?;
        self.release_chunks(handle, keep);
        Ok(())
    }

    /// `cuMemPoolDestroy`.
    pub(super) fn pool_destroy(&mut self, handle: RawPool) -> Result<()> {
        if self.destroy_imported_pool(handle) {
            return Ok(());
        }
        let pool = self.pool(handle)?;
        if pool.is_default {
            return Err(Error::InvalidArgument(format!(
                "pool {handle:#x} is the default pool of device {}, which cannot be destroyed",
                pool.dev
            )));
        }
        let (dev, managed) = (pool.dev as usize, pool.managed as usize);
        // Destroying a device's current pool makes its default pool current again.
        let d = &mut self.devices[dev];
        if d.current_pool[managed] == handle {
            d.current_pool[managed] = d.default_pool[managed];
        }
        self.pools.get_mut(&handle).expect("checked above").destroyed = true;
        self.reap(handle);
        Ok(())
    }

    /// `cuMemPoolGetAttribute`.
    pub(super) fn pool_attr(&self, handle: RawPool, attr: PoolAttr) -> Result<u64> {
        let p = self.pool(handle)?;
        Ok(match attr {
            PoolAttr::ReleaseThreshold => p.threshold,
            PoolAttr::ReservedMemCurrent => p.reserved as u64,
            PoolAttr::ReservedMemHigh => p.reserved_high as u64,
            PoolAttr::UsedMemCurrent => p.used as u64,
            PoolAttr::UsedMemHigh => p.used_high as u64,
        })
    }

    /// `cuMemPoolSetAttribute`: the threshold, and resets of the high-water marks (to
    /// the current value, as the driver does when given 0).
    pub(super) fn set_pool_attr(&mut self, handle: RawPool, attr: PoolAttr, value: u64) -> Result<()> {
        let p = self.pool_mut(handle)?;
        match attr {
            PoolAttr::ReleaseThreshold => p.threshold = value,
            PoolAttr::ReservedMemHigh | PoolAttr::UsedMemHigh if value != 0 => {
                return Err(Error::InvalidArgument(format!(
                    "{attr:?} of pool {handle:#x} can only be reset, by setting it to 0 (got {value})"
                )))
            }
            PoolAttr::ReservedMemHigh => p.reserved_high = p.reserved,
            PoolAttr::UsedMemHigh => p.used_high = p.used,
            PoolAttr::ReservedMemCurrent | PoolAttr::UsedMemCurrent => {
                return Err(Error::InvalidArgument(format!("{attr:?} of pool {handle:#x} is read-only")))
            }
        }
        Ok(())
    }
}
