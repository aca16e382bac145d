//! Fixed-size blocks carved from upstream chunks, reused per stream.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use super::{as_own_oom, upstream_properties};
use crate::device::DevPtr;
use crate::error::{record_if_failed, synchronize_on_drop, Error, Result};
use crate::resource::{check_depth, MemoryResource, ResourceRef, ALIGNMENT};
use crate::stream::{Event, Stream};
use crate::sync::{lock, Mutex};

/// Blocks of one size, carved from chunks of the upstream (RMM's
/// `fixed_size_memory_resource`); the default bin of [`super::BinningMemoryResource`].
/// Not a general resource: a request larger than the block is an
/// [`Error::OutOfMemory`] (as RMM's `out_of_memory`) that names the block size, so that a
/// failure callback above hears of it.
///
/// Stream-ordered reuse policy (RMM's, with one event per stream):
/// 1. A free puts the block on the free list of the freeing stream, keyed by the
///    stream's never-reused id (`cuStreamGetId`; the per-thread default stream counts
///    per thread), after recording that list's event on the stream: the event's latest
///    record covers every block on the list. The freeing stream reuses its own blocks at
///    once: same-stream reuse needs no ordering.
/// 2. Blocks that every stream may use: those reclaimed by step 5 (their frees have
///    completed).
/// 3. Another stream's blocks: the fullest other list is taken whole, the allocating
///    stream is made to wait on that list's event (`cuStreamWaitEvent`: the host does not
///    wait; the wait is for the event's latest record at that moment, which may cover
///    frees made on that stream since, so the streams are tied a little more than the
///    blocks need), and the blocks join the allocating stream's list once its own event is
///    recorded after the wait (so that a stream taking them from it later is ordered
///    after the wait too). As RMM's pools, this couples the two streams on the device,
///    and keeps memory to what the streams need together rather than a chunk per stream.
/// 4. Otherwise it grows: one chunk of `block_bytes * blocks_per_chunk` from the upstream
///    *on the allocating stream*, all of whose blocks go to that stream's list, covered by
///    its event recorded after the upstream call (memory from a stream-ordered upstream is
///    ordered for the stream it was allocated on only).
/// 5. When the upstream is out of memory, it waits for the whole device once
///    (`cuCtxSynchronize`: every free made before has then completed, so those blocks are
///    safe for any stream), makes the blocks freed before the wait usable by all (step 2),
///    and tries steps 2 to 4 again before failing. The blocks stay on their lists during
///    the wait, so that another thread short of memory meanwhile finds them too; and while
///    other threads' growths or step-3 takings are on their way (blocks that no list shows
///    meanwhile) or their frees change the lists, step 5 is tried again (a few times)
///    rather than failing.
///
/// Chunks go back to the upstream when the resource is dropped (after a device
/// synchronisation, on the legacy default stream), and, those whose blocks are all free,
/// on [`release_free_chunks`](Self::release_free_chunks) (which a
/// [`super::BinningMemoryResource`] calls on its bins when a request finds the upstream
/// out of memory). The blocks of destroyed streams are taken by steps 3 and 5 (an event
/// outlives its stream); a list that empties (taken by step 3, used up by its own stream,
/// or emptied by step 5) leaves, its event kept for the lists to come.
///
/// Invariant: a block is either outstanding, on exactly one list, or held by the one call
/// taking it in step 3; a free of a block that is not outstanding, or with a size above
/// the block size, is refused ([`Error::InvalidPointer`]) and changes nothing. (It records
/// blocks, not sizes: a free with another size that fits the block frees the same block,
/// and is accepted.) One lock guards the lists; it is never held across a call into the
/// upstream, nor across a device synchronisation or a wait. An event is recorded (and,
/// once per list, created) under it, so that a record and the blocks it covers enter a
/// list together. A free whose event cannot be recorded (a driver failure) is refused, the
/// block still outstanding. A list's event is kept only once recorded, so that a wait on
/// it is never a wait on nothing.
///
/// The cost: an event record per free (a driver call, as in RMM's pools), and a wait and
/// a record per list taken in step 3.
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, FixedSizeMemoryResource, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let upstream = Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?);
/// let mr = FixedSizeMemoryResource::new(upstream, 4096, 16)?;
/// let s = Stream::legacy();
/// let p = mr.allocate(4000, &s)?;
/// mr.deallocate(p, 4000, &s)?;
/// assert_eq!(mr.allocate(4096, &s)?, p, "same-stream reuse");
/// assert!(mr.allocate(4097, &s).is_err());
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct FixedSizeMemoryResource {
    upstream: ResourceRef,
    block_bytes: usize,
    blocks_per_chunk: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Free blocks by the id of the stream that freed them.
    by_stream: HashMap<u64, List>,
    /// The number the next free gets.
    frees: u64,
    /// Growths between their upstream call and their blocks' entry in a list.
    growing: usize,
    /// Step-3 takings between their two locked steps.
    taking: usize,
    /// Free blocks whose frees have completed: any stream may take them.
    ready: Vec<DevPtr>,
    outstanding: HashSet<DevPtr>,
    chunks: Vec<DevPtr>,
    /// Events of lists that left, none of them waited on: the next lists take them.
    spare: Vec<Arc<Event>>,
}

/// The most events kept for lists to come.
const SPARE_EVENTS: usize = 64;

impl State {
    /// Removes stream `id`'s list (emptied), its event kept for the next list
    /// ([`Self::keep_spare`]). A program that makes a stream per task (or a borrowed handle
    /// per call, where the driver gives no stream ids) so keeps a list per stream in use,
    /// not per stream ever used.
    fn retire(&mut self, id: u64) {
        if let Some(event) = self.by_stream.remove(&id).and_then(|list| list.event) {
            self.keep_spare(event);
        }
    }

    /// Keeps the event of a list that left for the next list, rather than destroying it
    /// and making another under the lock (which made binning over the driver's pool four
    /// times slower at 8 pairs on an H100), when nobody else holds it for a wait; else it
    /// goes with its last holder.
    fn keep_spare(&mut self, event: Arc<Event>) {
        if Arc::strong_count(&event) == 1 && self.spare.len() < SPARE_EVENTS {
            self.spare.push(event);
        }
    }
}

/// One stream's free blocks, each with the number of its free, and the event whose
/// latest record on the stream covers them all (None until the first record).
#[derive(Default)]
struct List {
    blocks: Vec<(DevPtr, u64)>,
    event: Option<Arc<Event>>,
}

impl FixedSizeMemoryResource {
    /// Blocks of `block_bytes` (rounded up to [`ALIGNMENT`]), carved from chunks of
    /// `blocks_per_chunk` blocks allocated from `upstream`.
    pub fn new(upstream: ResourceRef, block_bytes: usize, blocks_per_chunk: usize) -> Result<Self> {
        if block_bytes == 0 || blocks_per_chunk == 0 {
            return Err(Error::invalid(format!(
                "FixedSizeMemoryResource: block_bytes ({block_bytes}) and blocks_per_chunk ({blocks_per_chunk}) must be above 0"
            )));
        }
        check_depth("FixedSizeMemoryResource", [&upstream])?;
        let block_bytes = block_bytes
            .checked_next_multiple_of(ALIGNMENT)
            .filter(|b| b.checked_mul(blocks_per_chunk).is_some_and(|c| c <= isize::MAX as usize))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "FixedSizeMemoryResource: chunks of {blocks_per_chunk} blocks of {block_bytes} bytes are too large"
                ))
            })?;
        Ok(FixedSizeMemoryResource {
            upstream,
            block_bytes,
            blocks_per_chunk,
            state: Mutex::new(State::default()),
        })
    }

    /// The size of every block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The resource the chunks come from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    fn chunk_bytes(&self) -> usize {
        self.block_bytes * self.blocks_per_chunk
    }

    /// A free block for stream `id`: its own first, then one every stream may use.
    fn take_free(&self, id: u64) -> Option<DevPtr> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let own = st.by_stream.get_mut(&id).and_then(|l| Some((l.blocks.pop()?.0, l.blocks.is_empty())));
        let ptr = match own {
            Some((ptr, emptied)) => {
                if emptied {
                    st.retire(id);
                }
                ptr
            }
            None => st.ready.pop()?,
        };
        st.outstanding.insert(ptr);
        Some(ptr)
    }

    /// Records stream `id`'s event on `stream` (a spare one, or a new one, on the list's
    /// first record), under the lock, so that its latest record covers every block on the
    /// list once the caller adds its own: records and additions are made in one locked
    /// step, and records on one stream follow one another.
    fn record(&self, st: &mut State, id: u64, stream: &Stream) -> Result<()> {
        if let Some(event) = st.by_stream.get(&id).and_then(|l| l.event.as_ref()) {
            return event.record(stream);
        }
        let event = match st.spare.pop() {
            Some(event) => event,
            None => Arc::new(Event::new(self.upstream.backend(), self.upstream.device())?),
        };
        event.record(stream)?; // kept only once recorded
        st.by_stream.entry(id).or_default().event = Some(event);
        Ok(())
    }

    /// Step 3: the fullest other stream's list, for `stream` (after a wait on its event);
    /// one block is returned, the rest go to `stream`'s list. None when no other list has
    /// blocks, or on a failed wait or record (the blocks back on their list, still covered
    /// by its event).
    fn take_from_another(&self, id: u64, stream: &Stream) -> Option<DevPtr> {
        let (from, mut taken, theirs) = {
            let mut st = lock(&self.state);
            let (&from, list) = st
                .by_stream
                .iter_mut()
                .filter(|(&other, l)| other != id && !l.blocks.is_empty())
                .max_by_key(|(_, l)| l.blocks.len())?;
            let theirs = list.event.clone()?; // a list with blocks has its event
            let taken = std::mem::take(&mut list.blocks);
            st.retire(from); // its event goes once this wait is done
            st.taking += 1;
            (from, taken, theirs)
        };
        let waited = stream.wait(&theirs);
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.taking -= 1;
        // The blocks left after this request's join this stream's list, covered by its
        // event recorded after the wait.
        let ordered =
            waited.and_then(|()| if taken.len() > 1 { self.record(st, id, stream) } else { Ok(()) });
        if ordered.is_err() {
            // A list made again meanwhile has an event recorded after these frees.
            let list = st.by_stream.entry(from).or_default();
            list.event.get_or_insert(theirs);
            list.blocks.extend(taken);
            return None;
        }
        st.keep_spare(theirs); // waited on: the next list's (that stream's next free's)
        let (ptr, _) = taken.pop()?;
        if !taken.is_empty() {
            st.by_stream.entry(id).or_default().blocks.extend(taken);
        }
        st.outstanding.insert(ptr);
        Some(ptr)
    }

    /// Step 4: a new chunk on `stream`; one block is returned, the rest go to its list.
    fn grow(&self, id: u64, stream: &Stream) -> Result<DevPtr> {
        lock(&self.state).growing += 1;
        let grown = self.upstream.allocate(self.chunk_bytes(), stream);
        let mut st = lock(&self.state);
        st.growing -= 1;
        let chunk = grown?;
        let listed = self.blocks_per_chunk > 1; // its other blocks go to the list
        if let Err(e) = if listed { self.record(&mut st, id, stream) } else { Ok(()) } {
            drop(st); // no event covers the chunk for other streams: it goes back
            record_if_failed(
                || "giving back a chunk whose event could not be recorded".to_string(),
                self.upstream.deallocate(chunk, self.chunk_bytes(), stream),
            );
            return Err(e);
        }
        st.chunks.push(chunk);
        let n = st.frees;
        st.frees += 1;
        let blocks = (1..self.blocks_per_chunk).rev().map(|i| (chunk + (i * self.block_bytes) as u64, n));
        st.by_stream.entry(id).or_default().blocks.extend(blocks);
        st.outstanding.insert(chunk);
        Ok(chunk)
    }

    /// Gives back to the upstream every chunk none of whose blocks is outstanding, after a
    /// device synchronisation (every free made before has then completed); returns the
    /// bytes given back. The free blocks of the chunks kept become usable by every stream
    /// (step 2); blocks freed meanwhile stay on their lists, and so do their chunks.
    /// On a failed synchronisation nothing changes.
    pub fn release_free_chunks(&self) -> Result<usize> {
        let released = self.after_sync(|st| {
            let mut chunks = st.chunks.clone();
            chunks.sort_unstable();
            // Every block lies in one chunk: the last that starts at or below it.
            let chunk_of = |block: DevPtr| chunks[chunks.partition_point(|&c| c <= block) - 1];
            let mut free_in: HashMap<DevPtr, usize> = HashMap::new();
            for &block in &st.ready {
                *free_in.entry(chunk_of(block)).or_default() += 1;
            }
            let whole: HashSet<DevPtr> =
                free_in.into_iter().filter(|&(_, n)| n == self.blocks_per_chunk).map(|(c, _)| c).collect();
            st.chunks.retain(|c| !whole.contains(c));
            st.ready.retain(|&b| !whole.contains(&chunk_of(b)));
            whole.into_iter().collect::<Vec<DevPtr>>()
        })?;
        // Every chunk is given back, whatever befalls the others; one the upstream refuses
        // stays this resource's (given back when it is dropped), and the first such error
        // is the answer.
        let mut failed = None;
        for &chunk in &released {
            if let Err(e) = self.upstream.deallocate(chunk, self.chunk_bytes(), &Stream::legacy()) {
                // Kept: the chunk and its blocks (all free, complete) as they were.
                let mut st = lock(&self.state);
                st.chunks.push(chunk);
                st.ready.extend((0..self.blocks_per_chunk).map(|i| chunk + (i * self.block_bytes) as u64));
                failed.get_or_insert(e);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(released.len() * self.chunk_bytes()),
        }
    }

    /// Step 5: every block freed before the device synchronisation is safe for all.
    fn reclaim(&self) -> Result<()> {
        self.after_sync(|_| ())
    }

    /// Synchronises the device, then, under the lock, makes every block freed before the
    /// synchronisation began usable by all (its free has completed) and runs `then`.
    /// Blocks freed meanwhile stay on their lists. On a failed synchronisation nothing
    /// changes.
    fn after_sync<T>(&self, then: impl FnOnce(&mut State) -> T) -> Result<T> {
        let mark = lock(&self.state).frees;
        self.upstream.backend().ctx_synchronize(self.upstream.device())?;
        let mut st = lock(&self.state);
        let st = &mut *st;
        for list in st.by_stream.values_mut() {
            // A block's number is that of its last free (or its chunk's growth), made on the
            // stream whose list it entered first: below the mark, that free had been made
            // before the synchronisation began, so it has completed, whichever list holds
            // the block now. Blocks taken from another list (step 3) keep their numbers, so
            // a list is no longer in order of them: all are looked at.
            let (done, kept): (Vec<_>, Vec<_>) = list.blocks.drain(..).partition(|&(_, n)| n < mark);
            list.blocks = kept;
            st.ready.extend(done.into_iter().map(|(p, _)| p));
        }
        // The lists of streams that are gone (and of any stream, once empty) leave.
        let emptied: Vec<u64> =
            st.by_stream.iter().filter(|(_, l)| l.blocks.is_empty()).map(|(&id, _)| id).collect();
        for id in emptied {
            st.retire(id);
        }
        Ok(then(st))
    }
}

/// How many times step 5 is tried while other threads' growths and frees change the lists.
const RECLAIMS: usize = 16;

impl MemoryResource for FixedSizeMemoryResource {
    upstream_properties!("FixedSizeMemoryResource", depth);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        if bytes > self.block_bytes {
            // Out of memory, as RMM's ("maximum allocation size exceeded"): a failure
            // callback above hears of it, and Python's `except MemoryError` catches it.
            return Err(Error::OutOfMemory {
                requested: bytes,
                available: Some(self.block_bytes),
                resource: format!(
                    "FixedSizeMemoryResource, whose blocks of {} bytes are the most it serves,",
                    self.block_bytes
                ),
            });
        }
        let id = stream.key(self.backend(), self.device());
        if let Some(ptr) = self.take_free(id).or_else(|| self.take_from_another(id, stream)) {
            return Ok(ptr);
        }
        let mut failed = match self.grow(id, stream) {
            Err(e) if e.is_out_of_memory() => e,
            result => return result,
        };
        // Step 5, again while other threads change the lists meanwhile: a growth whose
        // chunk is not on a list yet, or blocks freed since, may serve this request.
        for _ in 0..RECLAIMS {
            let before = {
                let st = lock(&self.state);
                (st.frees, st.growing, st.taking)
            };
            self.reclaim()?;
            if let Some(ptr) = self.take_free(id).or_else(|| self.take_from_another(id, stream)) {
                return Ok(ptr);
            }
            failed = match self.grow(id, stream) {
                Err(e) if e.is_out_of_memory() => e,
                result => return result,
            };
            let st = lock(&self.state);
            if (st.frees, st.growing, st.taking) == before && before.1 == 0 && before.2 == 0 {
                break; // nothing changed and nothing is on its way: out of memory
            }
            drop(st);
            #[cfg(loom)]
            loom::thread::yield_now();
            #[cfg(not(loom))]
            std::thread::yield_now();
        }
        Err(as_own_oom(failed, bytes, self))
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if bytes > self.block_bytes {
            return Err(Error::InvalidPointer(format!(
                "{ptr:#x} freed with {bytes} bytes, more than the block size of this FixedSizeMemoryResource ({} bytes)",
                self.block_bytes
            )));
        }
        let id = stream.key(self.backend(), self.device());
        let mut st = lock(&self.state);
        let st = &mut *st;
        if !st.outstanding.contains(&ptr) {
            return Err(Error::InvalidPointer(format!(
                "{ptr:#x} is not an outstanding block of this FixedSizeMemoryResource (double free, or not allocated here)"
            )));
        }
        // The event recorded after the block's uses on the stream, then the block listed;
        // when it cannot be recorded, the free does not happen.
        self.record(st, id, stream)?;
        st.outstanding.remove(&ptr);
        let n = st.frees;
        st.frees += 1;
        st.by_stream.entry(id).or_default().blocks.push((ptr, n));
        Ok(())
    }
}

impl Drop for FixedSizeMemoryResource {
    fn drop(&mut self) {
        // Every use of every block is ordered before the chunks' frees; a failure (the
        // driver torn down at exit) has nobody to report to: it is recorded.
        let what = || "dropping a FixedSizeMemoryResource".to_string();
        synchronize_on_drop(self.upstream.backend(), self.upstream.device(), what);
        let mut st = lock(&self.state);
        let live = st.outstanding.len();
        if live > 0 {
            let (blocks, were) = if live == 1 { ("block", "was") } else { ("blocks", "were") };
            let what = format!("{live} {blocks} of {} bytes {were}", self.block_bytes);
            crate::error::record_leak_on_drop("FixedSizeMemoryResource", &what);
        }
        let chunks = std::mem::take(&mut st.chunks);
        drop(st);
        for chunk in chunks {
            record_if_failed(what, self.upstream.deallocate(chunk, self.chunk_bytes(), &Stream::legacy()));
        }
    }
}

impl fmt::Debug for FixedSizeMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("FixedSizeMemoryResource")
            .field("block_bytes", &self.block_bytes)
            .field("blocks_per_chunk", &self.blocks_per_chunk)
            .field("chunks", &st.chunks.len())
            .field("outstanding", &st.outstanding.len())
            .field("upstream", &self.upstream)
            .finish()
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::adaptors::LimitingAdaptor;
    use crate::device::sim::SimDevice;
    use crate::device::BackendRef;
    use crate::resources::CudaMemoryResource;

    /// Room upstream for one chunk of two blocks, both freed on stream A. A thread on
    /// stream B takes A's list (step 3: its blocks on no list while it waits on A's event)
    /// and uses one block, while the main thread asks for one on stream C. At most one
    /// block is ever outstanding besides C's, so neither request may fail: C's step 5 must
    /// wait for B's taking rather than report out of memory.
    #[test]
    fn loom_blocks_in_a_step_3_taking_are_not_out_of_memory() {
        crate::sync::model(|| {
            let sim: BackendRef = SimDevice::new(64 << 20);
            let plain: ResourceRef = Arc::new(CudaMemoryResource::on(sim.clone(), 0).unwrap());
            let limited: ResourceRef = Arc::new(LimitingAdaptor::new(plain, 2 * 4096).unwrap());
            let mr = Arc::new(FixedSizeMemoryResource::new(limited, 4096, 2).unwrap());
            let [a, b, c] = [0; 3].map(|_| Stream::create(&sim, 0, false).unwrap());
            let x = mr.allocate(4096, &a).unwrap();
            let y = mr.allocate(4096, &a).unwrap();
            mr.deallocate(x, 4096, &a).unwrap();
            mr.deallocate(y, 4096, &a).unwrap();
            let t = {
                let mr = mr.clone();
                loom::thread::spawn(move || {
                    let p = mr.allocate(4096, &b).expect("B: out of memory with a block free");
                    mr.deallocate(p, 4096, &b).unwrap();
                })
            };
            let q = mr.allocate(4096, &c);
            t.join().unwrap();
            mr.deallocate(q.expect("C: out of memory with a block free"), 4096, &c).unwrap();
        });
    }
}
