//! The slow path of the pool: policy steps 2 to 7 (`IMPLEMENTATION.md`), frees across
//! streams, the footprint budget, gathering free blocks and retiring shards.

use std::sync::Arc;

use super::chunks::{Chunk, MAX_GROWTH_STEP, MIN_CHUNK};
use super::freelist::{FreeBlock, NotFreed};
use super::shard::Shard;
use super::{wrong_size, ShardedPoolMemoryResource};
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::stream::Stream;
use crate::sync::{lock, write, Ordering};

impl ShardedPoolMemoryResource {
    /// Steps 2 to 7 of the policy; returns the address, recorded live in the shard of
    /// `stream` (key `key`).
    pub(super) fn allocate_slow(&self, size: usize, stream: &Stream, key: u64) -> Result<DevPtr> {
        let found = |(ptr, chunk): (DevPtr, u64)| {
            self.record_live(ptr, size, chunk, stream, key);
            Ok(ptr)
        };
        // 2. completed blocks in the common list
        if let Some(ptr) = self.import_common(size, stream, key) {
            return Ok(ptr);
        }
        // 3. completed blocks of other streams; retired shards give all theirs to the
        // common list
        let others = self.other_shards(key);
        if let Some(taken) = self.take_completed(size, &others) {
            return found(taken);
        }
        if let Some(ptr) = self.import_common(size, stream, key) {
            return Ok(ptr);
        }
        // 4. grow on this stream, within the footprint budget
        let (want, allowed) = self.growth(size);
        match self.grow_under(size, want, allowed, stream) {
            Ok(Some(chunk)) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
            Ok(None) => {}
            Err(e) if e.is_out_of_memory() => {}
            Err(e) => return Err(e),
        }
        // Memory is short: ask every stream to record an event at its next free, so that
        // what it frees from now on can be taken by others.
        self.demand.fetch_add(1, Ordering::Relaxed);
        // 5. wait on another stream's recorded event
        if let Some(taken) = self.take_covered(size, stream, &others)? {
            return found(taken);
        }
        // 6. synchronise, gather, coalesce, release, retry (past the budget, not the
        // maximum). Other threads may take what was gathered in the meantime (into their
        // shards, as completed blocks): at the maximum, look again a few times before
        // saying out of memory.
        const ATTEMPTS: usize = 3;
        for attempt in 1..=ATTEMPTS {
            self.synchronize_and_gather()?;
            if attempt == 1 && !lock(&self.common).fits(size) {
                // Whole free chunks cannot serve the request: give them back first.
                self.trim(0)?;
            }
            if let Some(ptr) = self.import_common(size, stream, key) {
                return Ok(ptr);
            }
            if let Some(taken) = self.take_completed(size, &self.other_shards(key)) {
                return found(taken);
            }
            match self.grow(size, want, stream) {
                Ok(chunk) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
                Err(e) if e.is_out_of_memory() && attempt < ATTEMPTS => {}
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Step 2: moves every block of the common list (all complete, so usable by this
    /// stream, and by other streams as completed blocks of this shard: epoch 0) into the
    /// shard of `stream`, and allocates there. The free space of a chunk is then in one
    /// list, where it merges, rather than split between the common list and a shard (with
    /// it split, one stream alone needed 1.75 times its peak live bytes on the window
    /// workload).
    fn import_common(&self, size: usize, stream: &Stream, key: u64) -> Option<DevPtr> {
        let blocks = {
            let mut common = lock(&self.common);
            if common.bytes() < size {
                return None;
            }
            common.drain(|_| true)
        };
        let shard = self.shard_slow(key, stream);
        let mut st = shard.state.lock();
        for (ptr, b) in blocks {
            st.free.insert(ptr, FreeBlock { epoch: 0, ..b });
        }
        let ptr = st.free.allocate(size)?;
        st.used += size as i64;
        Some(ptr)
    }

    /// Step 3: a block of another shard whose free has completed. Retired shards (their
    /// stream is gone) give every completed block to the common list on the way, and leave
    /// the pool once empty.
    fn take_completed(&self, size: usize, others: &[Arc<Shard>]) -> Option<(DevPtr, u64)> {
        for shard in others {
            let (taken, retired_blocks, empty) = {
                let mut st = shard.state.lock();
                if st.free.bytes() == 0 {
                    (None, Vec::new(), st.retired && st.used == 0)
                } else {
                    st.refresh();
                    let done = st.completed;
                    if st.retired {
                        let blocks = st.free.drain(|e| e < done);
                        (None, blocks, st.free.bytes() == 0 && st.used == 0)
                    } else {
                        // This stream's memory is wanted: it records an event at its next
                        // free (its interval may have grown long), so that what it frees
                        // can be taken next time rather than memory grown anew.
                        st.wanted = true;
                        (st.free.take(size, |e| e < done), Vec::new(), false)
                    }
                }
            };
            if !retired_blocks.is_empty() {
                self.to_common(retired_blocks);
            }
            if empty {
                self.forget(shard);
            }
            if let Some((ptr, b)) = taken {
                self.counters.completed_steals.fetch_add(1, Ordering::Relaxed);
                return Some((ptr, b.chunk));
            }
        }
        None
    }

    /// Step 5: a block of another shard that a recorded event covers; `stream` waits on
    /// that event (unless the block is known complete).
    /// Retired shards come first, the emptiest first: taking their last blocks lets them
    /// leave the pool (on a device that has not finished their work yet, such shards
    /// would otherwise pile up, one per stream that came and went).
    fn take_covered(
        &self,
        size: usize,
        stream: &Stream,
        others: &[Arc<Shard>],
    ) -> Result<Option<(DevPtr, u64)>> {
        let mut order: Vec<(bool, usize, &Arc<Shard>)> = others
            .iter()
            .map(|s| {
                let st = s.state.lock();
                (!st.retired, st.free.bytes(), s)
            })
            .filter(|(_, bytes, _)| *bytes >= size)
            .collect();
        order.sort_by_key(|(live, bytes, _)| (*live, *bytes));
        for (_, _, shard) in order {
            let taken = {
                let mut st = shard.state.lock();
                st.refresh();
                // Only blocks an event covers (or known complete): blocks of an epoch that
                // a concurrent synchronisation closed without an event are neither.
                let covered = st.covered();
                st.free.take(size, |e| e < covered).map(|(ptr, b)| (ptr, b.chunk, st.covering(b.epoch)))
            };
            if let Some((ptr, chunk, event)) = taken {
                self.forget_if_done(shard);
                if let Some(event) = event {
                    if let Err(e) = stream.wait(&event) {
                        // Not handed out: put it back where it was (its shard's epoch
                        // ordering still holds for it).
                        self.return_block(ptr, size, chunk);
                        return Err(e);
                    }
                    self.counters.waits.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(Some((ptr, chunk)));
            }
        }
        Ok(None)
    }

    /// How much to grow by for a request of `size` bytes, and the most the pool may then
    /// hold (the footprint budget's allowance, or the maximum without a headroom): the
    /// request, or a step of an eighth of the peak live bytes (between [`MIN_CHUNK`] and
    /// [`MAX_GROWTH_STEP`]) when that is more, rounded to [`MIN_CHUNK`]. The allowance is
    /// the peak live bytes plus the headroom of them, at least [`MIN_CHUNK`].
    fn growth(&self, size: usize) -> (usize, usize) {
        // The budget follows the most ever live (as seen here, on growth), not what is live
        // now: the target is peak reserved against peak live, and a pool sized for its
        // peak needs no growth when the peak comes back.
        let now = self.used_now().saturating_add(size);
        let live = self.peak_live.fetch_max(now, Ordering::Relaxed).max(now);
        let step = (live / 8).clamp(MIN_CHUNK, MAX_GROWTH_STEP);
        let want = size.max(step).next_multiple_of(MIN_CHUNK);
        let allowed = match self.options.headroom {
            Some(headroom) => live.saturating_add(((live as f64 * headroom) as usize).max(MIN_CHUNK)),
            None => usize::MAX,
        };
        (want, allowed)
    }

    /// The bytes handed out now (rounded), summed over the shards (off the hot path: on
    /// growth only).
    fn used_now(&self) -> usize {
        let used: i64 = self.other_shards(u64::MAX).iter().map(|s| s.state.lock().used_bytes()).sum();
        used.max(0) as usize
    }

    /// A fresh chunk grown on `stream` (key `key`): the first `size` bytes are handed out,
    /// the rest goes to that stream's shard (memory from an async upstream is ordered for
    /// the growing stream only, so it is treated as freed there).
    fn place_chunk(&self, chunk: &Chunk, size: usize, stream: &Stream, key: u64) -> DevPtr {
        if chunk.size > size {
            let shard = self.shard_slow(key, stream);
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

    /// Records an allocation of the slow path (steps 2 to 6) as live in its stream's shard.
    pub(super) fn record_live(&self, ptr: DevPtr, size: usize, chunk: u64, stream: &Stream, key: u64) {
        let shard = self.shard_slow(key, stream);
        let mut st = shard.state.lock();
        st.free.insert_live(ptr, size, chunk);
        st.used += size as i64;
    }

    /// A free on one stream of a block allocated on another: the block leaves the shard it
    /// was allocated from and enters this stream's (its memory is now last used here).
    pub(super) fn free_foreign(
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
        let shard = self.shard_slow(key, stream);
        let mut st = shard.state.lock();
        let epoch = st.epoch;
        st.free.insert(ptr, FreeBlock { size, chunk, epoch });
        self.after_free(&mut st, stream, demand);
        Ok(())
    }

    /// Adds blocks known complete to the common list.
    fn to_common(&self, blocks: Vec<(DevPtr, FreeBlock)>) {
        let mut common = lock(&self.common);
        for (ptr, b) in blocks {
            common.insert(ptr, FreeBlock { epoch: 0, ..b });
        }
    }

    /// Drops a retired shard that holds nothing (threads may still hold it in their
    /// caches: its key is never used again, so they never look at it).
    fn forget(&self, shard: &Arc<Shard>) {
        let mut map = write(&self.shards);
        if map.get(&shard.key).is_some_and(|s| Arc::ptr_eq(s, shard)) {
            map.remove(&shard.key);
        }
    }

    fn forget_if_done(&self, shard: &Arc<Shard>) {
        let done = {
            let st = shard.state.lock();
            st.retired && st.free.bytes() == 0 && st.used == 0
        };
        if done {
            self.forget(shard);
        }
    }

    /// Moves every block known complete from every shard to the common list, and drops
    /// retired shards left empty.
    fn harvest_completed(&self) {
        for shard in self.other_shards(u64::MAX) {
            let (blocks, empty) = {
                let mut st = shard.state.lock();
                st.refresh();
                let done = st.completed;
                let blocks = st.free.drain(|e| e < done);
                (blocks, st.retired && st.free.bytes() == 0 && st.used == 0)
            };
            self.to_common(blocks);
            if empty {
                self.forget(&shard);
            }
        }
    }

    /// Closes every shard's open epoch, synchronises the device, and gathers every free
    /// block in the common list (then keeps under the release threshold).
    pub(super) fn synchronize_and_gather(&self) -> Result<()> {
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
            shard.state.lock().complete_through(e);
        }
        self.harvest_completed();
        self.keep_under_threshold()
    }

    fn keep_under_threshold(&self) -> Result<()> {
        if let Some(threshold) = self.options.release_threshold {
            if self.stats().free_bytes > threshold {
                self.trim(threshold)?;
            }
        }
        Ok(())
    }

    /// An `OutOfMemory` for `requested` bytes, naming what limited it: the maximum, or
    /// the upstream (which could still give `upstream_available`, where it said).
    pub(super) fn out_of_memory(&self, requested: usize, upstream_available: Option<usize>) -> Error {
        let stats = self.stats();
        let room = self.maximum.saturating_sub(stats.reserved_bytes);
        let at_maximum = self.maximum != usize::MAX && requested > room;
        let growable = match (self.maximum == usize::MAX, upstream_available) {
            (true, a) => a,
            (false, Some(a)) => Some(a.min(room)),
            (false, None) => Some(room),
        };
        let limit = if at_maximum {
            format!(", maximum_pool_size {} reached", self.maximum)
        } else {
            format!(", the upstream {} had no more", self.upstream.name())
        };
        Error::OutOfMemory {
            requested,
            available: growable.map(|g| g.saturating_add(stats.free_bytes)),
            resource: format!(
                "ShardedPoolMemoryResource ({} bytes reserved, {} in use, {} free in blocks too small or not yet reusable{limit})",
                stats.reserved_bytes, stats.used_bytes, stats.free_bytes
            ),
        }
    }

    /// The error for a growth of `size` bytes that the upstream refused with `e`.
    pub(super) fn out_of_memory_after(&self, size: usize, e: Error) -> Error {
        match e {
            Error::OutOfMemory { available, .. } => self.out_of_memory(size, available),
            other => other,
        }
    }
}
