//! One heap for every stream ([`PoolOptions::one_heap`](super::PoolOptions::one_heap)):
//! every free block lies in the common list, whichever stream freed it, and merges there
//! with its free neighbours at once. A free records an event on its stream; the range it
//! freed stays *pending* (with that event) until the event is known complete. A stream
//! that is handed memory in a range another stream freed, not yet known complete, waits on
//! that free's event (`cuStreamWaitEvent`) before it can use it: the ordering that the
//! driver's own pool inserts, with the pool's fit (`IMPLEMENTATION.md`, "One heap").
//!
//! Pending ranges never overlap and cover free memory only: a range handed out leaves the
//! pending map (its events waited on), and its next free makes a new entry, whose event
//! follows that wait on its stream, or follows the caller's own ordering when the free
//! comes on another stream (the stream-ordered contract). So a block is ordered after
//! every earlier free of its bytes.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use super::freelist::NotFreed;
use super::ShardedPoolMemoryResource;
use crate::device::DevPtr;
use crate::error::Result;
use crate::resource::MemoryResource;
use crate::stream::{Event, Stream};
use crate::sync::{lock, Mutex, Ordering};

/// Events kept for reuse at most (each is a driver object).
const SPARE_EVENTS: usize = 1024;
/// Oldest frees whose events a free queries, to forget the ranges that completed.
const QUERIES_PER_FREE: usize = 2;

/// A range whose free is not known complete: where it ends, the stream that freed it
/// (its key) and the event recorded there by the free.
#[derive(Clone)]
struct Entry {
    end: u64,
    stream: u64,
    event: Arc<Event>,
}

/// The pending frees of a pool with one heap, and its live bytes. Locked after the
/// common list when both are held.
#[derive(Default)]
pub(super) struct Pending {
    state: Mutex<State>,
    /// Held across a growth: one thread grows at a time, and a thread that waited for
    /// another's growth looks in the heap again first (taken before the range's lock and
    /// the common list's).
    growing: Mutex<()>,
}

#[derive(Default)]
struct State {
    /// Pending ranges by start; they never overlap.
    ranges: BTreeMap<u64, Entry>,
    /// Every free's range and event, oldest first, until the event is known complete
    /// (the entries of a range may have been cut since: into parts within it).
    recent: VecDeque<(u64, u64, Arc<Event>)>,
    /// Frees ever put in `recent` (the next one's number): the first of them is
    /// `pushed - recent.len()`.
    pushed: u64,
    /// Events whose frees completed, for later frees to record again.
    spare: Vec<Arc<Event>>,
    /// Bytes handed out (rounded).
    used: usize,
}

impl State {
    /// Takes the parts of pending ranges within `[p, q)` out of the map, and returns them;
    /// the parts outside stay.
    fn cut(&mut self, p: u64, q: u64) -> Vec<(u64, Entry)> {
        let mut out = Vec::new();
        let before = self.ranges.range(..p).next_back().map(|(&a, e)| (a, e.clone()));
        if let Some((a, e)) = before.filter(|(_, e)| e.end > p) {
            self.ranges.insert(a, Entry { end: p, ..e.clone() });
            if e.end > q {
                self.ranges.insert(q, e.clone());
            }
            out.push((p, Entry { end: e.end.min(q), ..e }));
        }
        let inside: Vec<u64> = self.ranges.range(p..q).map(|(&a, _)| a).collect();
        for a in inside {
            let e = self.ranges.remove(&a).expect("listed");
            if e.end > q {
                self.ranges.insert(q, e.clone());
            }
            out.push((a, Entry { end: e.end.min(q), ..e }));
        }
        out
    }

    /// Makes `[p, q)`, freed on `stream` (its key), pending on `event`.
    fn pend(&mut self, p: u64, q: u64, stream: u64, event: Arc<Event>) {
        self.ranges.insert(p, Entry { end: q, stream, event: event.clone() });
        self.recent.push_back((p, q, event));
        self.pushed += 1;
    }

    /// Counts `size` bytes at `p` as handed out, and takes the pending parts of their range
    /// out of the map (to be waited on).
    fn hand_out(&mut self, p: u64, size: usize) -> Vec<(u64, Entry)> {
        self.used += size;
        self.cut(p, p + size as u64)
    }

    /// Forgets the parts of `[p, q)` still pending on `event` (it completed).
    fn forget(&mut self, p: u64, q: u64, event: &Arc<Event>) {
        let done: Vec<u64> =
            self.ranges.range(p..q).filter(|(_, e)| Arc::ptr_eq(&e.event, event)).map(|(&a, _)| a).collect();
        for a in done {
            self.ranges.remove(&a);
        }
    }

    /// Keeps `event` for reuse when nothing else holds it.
    fn recycle(&mut self, event: Arc<Event>) {
        if Arc::strong_count(&event) == 1 && self.spare.len() < SPARE_EVENTS {
            self.spare.push(event);
        }
    }

    /// The lowest address at or above `p` from which no pending range reaches `q`.
    fn clear_from(&self, p: u64, q: u64) -> u64 {
        let before = self.ranges.range(..p).next_back().map_or(p, |(_, e)| e.end.max(p));
        self.ranges.range(p..q).map(|(_, e)| e.end).max().map_or(before, |end| end.max(before)).min(q)
    }
}

impl Pending {
    /// Bytes handed out.
    pub(super) fn used(&self) -> usize {
        lock(&self.state).used
    }

    /// The number of the next free: [`Self::forget_before`] it after a device
    /// synchronisation that started after this call.
    pub(super) fn mark(&self) -> u64 {
        lock(&self.state).pushed
    }

    /// Forgets the ranges of the frees numbered below `mark` (their events completed: the
    /// device was synchronised since [`Self::mark`]), those still pending.
    pub(super) fn forget_before(&self, mark: u64) {
        let mut st = lock(&self.state);
        while st.pushed - (st.recent.len() as u64) < mark {
            let (p, q, event) = st.recent.pop_front().expect("counted");
            st.forget(p, q, &event);
            st.recycle(event);
        }
    }

    /// Whether no pending range lies within `[p, p + size)` (memory that may be given
    /// back).
    pub(super) fn settled(&self, p: u64, size: usize) -> bool {
        lock(&self.state).clear_from(p, p + size as u64) == p
    }

    /// The lowest address at or above `p` from which `[.., q)` holds no pending range.
    pub(super) fn clear_from(&self, p: u64, q: u64) -> u64 {
        lock(&self.state).clear_from(p, q)
    }
}

impl ShardedPoolMemoryResource {
    /// An allocation of `size` bytes (a class size) on `stream` from the one heap, grown
    /// when nothing fits.
    pub(super) fn heap_allocate(&self, size: usize, stream: &Stream, key: u64) -> Result<DevPtr> {
        if size > self.maximum {
            return Err(self.beyond_maximum(size));
        }
        if let Some(ptr) = self.heap_take(size, stream, key)? {
            return Ok(ptr);
        }
        // Growth maps memory or asks the upstream (tens of microseconds or more), while
        // other threads free: whoever waited for it looks again before growing too.
        let _growing = lock(&self.heap.growing);
        if let Some(ptr) = self.heap_take(size, stream, key)? {
            return Ok(ptr);
        }
        let (want, _, now) = self.growth(size);
        let chunk = match self.grow(size, want, stream, None) {
            Ok(chunk) => chunk,
            Err(e) if e.is_out_of_memory() => {
                // Whole free chunks cannot serve it: once every free has completed, give
                // them back and grow one as large as they were together.
                drop(self.synchronize_and_harvest()?);
                let released = self.trim(0)?;
                if let Some(ptr) = self.heap_take(size, stream, key)? {
                    return Ok(ptr);
                }
                self.grow(size, want.max(released), stream, None)?
            }
            Err(e) => return Err(e),
        };
        self.peak_live.fetch_max(now, Ordering::Relaxed);
        // The chunk's first `size` bytes are handed out; the rest is free, ordered for the
        // growing stream only (an asynchronous upstream's memory) or, grown in place, the
        // free block that ended the range with the new memory after it.
        let rest = chunk.size - size;
        let event = if rest > 0 && chunk.id != super::region::REGION_CHUNK {
            Some(self.heap_record(stream)?)
        } else {
            None
        };
        let parts = {
            let mut common = self.common.lock();
            common.insert_live(chunk.start, size, chunk.id);
            let mut st = lock(&self.heap.state);
            let rest_at = chunk.start + size as u64;
            if rest > 0 {
                common.insert(rest_at, super::freelist::FreeBlock { size: rest, chunk: chunk.id, epoch: 0 });
                if let Some(event) = event {
                    st.pend(rest_at, chunk.start + chunk.size as u64, key, event);
                }
            }
            st.hand_out(chunk.start, size)
        };
        self.heap_order(chunk.start, size, stream, key, parts)?;
        Ok(chunk.start)
    }

    /// A block of `size` bytes from the one heap for `stream` (key `key`), ordered after
    /// the pending frees of its bytes; `None` when none fits.
    fn heap_take(&self, size: usize, stream: &Stream, key: u64) -> Result<Option<DevPtr>> {
        let (ptr, parts) = {
            let mut common = self.common.lock();
            let Some(ptr) = common.allocate(size) else { return Ok(None) };
            (ptr, lock(&self.heap.state).hand_out(ptr, size))
        };
        self.heap_order(ptr, size, stream, key, parts)?;
        Ok(Some(ptr))
    }

    /// Makes `stream` wait on the events of the pending parts of the block at `ptr` that
    /// other streams freed. On a failure the block goes back, pending as it was.
    fn heap_order(
        &self,
        ptr: DevPtr,
        size: usize,
        stream: &Stream,
        key: u64,
        parts: Vec<(u64, Entry)>,
    ) -> Result<()> {
        let mut waited: Vec<&Arc<Event>> = Vec::new();
        let mut failed = None;
        for (_, e) in &parts {
            if e.stream == key || waited.iter().any(|w| Arc::ptr_eq(w, &e.event)) {
                continue;
            }
            if let Err(err) = self.backend().stream_wait_event(self.device(), stream.handle(), e.event.raw())
            {
                failed = Some(err);
                break;
            }
            self.counters.waits.fetch_add(1, Ordering::Relaxed);
            waited.push(&e.event);
        }
        let Some(err) = failed else { return Ok(()) };
        let mut common = self.common.lock();
        common.free(ptr, size, 0).expect("handed out just now");
        let mut st = lock(&self.heap.state);
        st.used -= size;
        for (a, e) in parts {
            st.ranges.insert(a, e);
        }
        Err(err)
    }

    /// A free of the block at `ptr` (`bytes` asked, `size` its class size) on `stream`:
    /// into the heap, pending on an event recorded on `stream`.
    pub(super) fn heap_deallocate(
        &self,
        ptr: DevPtr,
        size: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        let key = stream.key(self.backend(), self.device());
        {
            // The event is recorded under the heap's lock: recorded before it, the block was
            // out of the heap meanwhile, while other threads that needed memory grew (on an
            // H100, window workload: 1.15-1.27 times the peak live bytes at 2 threads,
            // against 1.11-1.21, and 15-20 % slower at 4 and 16 threads, the threads' driver
            // calls contending in the driver instead: `benchmarks/RESULTS.md`).
            let mut common = self.common.lock();
            let event = self.heap_record(stream)?;
            let freed = common.free(ptr, size, 0);
            let mut st = lock(&self.heap.state);
            match freed {
                Ok(()) => {
                    st.used -= size;
                    st.pend(ptr, ptr + size as u64, key, event);
                }
                Err(why) => {
                    st.recycle(event);
                    drop(st);
                    return Err(match why {
                        NotFreed::WrongSize(had) => super::wrong_size(ptr, had, bytes),
                        NotFreed::Unknown => self.not_outstanding(ptr, size, bytes),
                    });
                }
            }
        }
        self.heap_settle();
        Ok(())
    }

    /// An event recorded on `stream` now (a spare one, or a new one).
    fn heap_record(&self, stream: &Stream) -> Result<Arc<Event>> {
        let spare = lock(&self.heap.state).spare.pop();
        let event = match spare {
            Some(event) => event,
            None => Arc::new(Event::new(self.backend(), self.device())?),
        };
        event.record(stream)?;
        self.counters.events.fetch_add(1, Ordering::Relaxed);
        Ok(event)
    }

    /// Queries the oldest frees' events (a few), and forgets the ranges of those that
    /// completed: what stays pending stays few, and a later allocation there waits on
    /// nothing.
    fn heap_settle(&self) {
        for _ in 0..QUERIES_PER_FREE {
            let Some((p, q, event)) = lock(&self.heap.state).recent.front().cloned() else { return };
            self.counters.queries.fetch_add(1, Ordering::Relaxed);
            if !matches!(event.query(), Ok(true)) {
                return;
            }
            let mut st = lock(&self.heap.state);
            if !st.recent.front().is_some_and(|f| Arc::ptr_eq(&f.2, &event)) {
                return; // another free forgot it first
            }
            st.recent.pop_front();
            st.forget(p, q, &event);
            st.recycle(event);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;
    use crate::device::BackendRef;
    use proptest::prelude::*;

    fn event() -> Arc<Event> {
        thread_local! {
            static SIM: BackendRef = SimDevice::new(1 << 20);
        }
        SIM.with(|b| Arc::new(Event::new(b, 0).unwrap()))
    }

    /// The pending map against a model of bytes: after any frees (of ranges not pending)
    /// and takes, every byte is pending on the free that last freed it and was not taken
    /// since, ranges never overlap, and a take returns exactly the pending parts of its
    /// range.
    #[test]
    fn cut_keeps_the_map_exact() {
        proptest!(ProptestConfig::with_cases(200), |(ops in proptest::collection::vec((any::<bool>(), 0u64..64, 1u64..16), 1..60))| {
            let mut st = State::default();
            let mut model: Vec<Option<usize>> = vec![None; 80];
            let mut events = Vec::new();
            for (free, p, n) in ops {
                let q = p + n;
                if free {
                    if (p..q).any(|b| model[b as usize].is_some()) {
                        continue; // pending bytes are free: a free of them is a double free
                    }
                    let id = events.len();
                    events.push(event());
                    st.ranges.insert(p, Entry { end: q, stream: id as u64, event: events[id].clone() });
                    (p..q).for_each(|b| model[b as usize] = Some(id));
                } else {
                    let parts = st.cut(p, q);
                    let mut got: Vec<Option<usize>> = vec![None; n as usize];
                    for (a, e) in &parts {
                        prop_assert!(*a >= p && e.end <= q && *a < e.end);
                        (*a..e.end).for_each(|b| got[(b - p) as usize] = Some(e.stream as usize));
                    }
                    let want: Vec<Option<usize>> = (p..q).map(|b| model[b as usize]).collect();
                    prop_assert_eq!(got, want);
                    (p..q).for_each(|b| model[b as usize] = None);
                }
                let mut last = 0;
                for (&a, e) in &st.ranges {
                    prop_assert!(a >= last && a < e.end, "ranges overlap or are empty");
                    last = e.end;
                    for b in a..e.end {
                        prop_assert_eq!(model[b as usize], Some(e.stream as usize));
                    }
                }
                let pending = model.iter().filter(|m| m.is_some()).count() as u64;
                prop_assert_eq!(pending, st.ranges.iter().map(|(a, e)| e.end - a).sum::<u64>());
                for p in 0..70u64 {
                    let q = p + 8;
                    let from = st.clear_from(p, q);
                    prop_assert!((from..q).all(|b| model[b as usize].is_none()));
                    prop_assert!(from == p || model[from as usize - 1].is_some());
                }
            }
        });
    }

    /// A completed free is forgotten in every part its range was cut into, and only its.
    #[test]
    fn forget_drops_every_part_of_one_free() {
        let mut st = State::default();
        let (a, b) = (event(), event());
        st.ranges.insert(0, Entry { end: 100, stream: 1, event: a.clone() });
        st.ranges.insert(100, Entry { end: 120, stream: 2, event: b.clone() });
        let cut = st.cut(40, 60);
        assert_eq!(cut.len(), 1);
        assert_eq!(st.ranges.len(), 3, "0..40 and 60..100 of the first, and the second");
        st.forget(0, 100, &a);
        assert_eq!(st.ranges.keys().copied().collect::<Vec<_>>(), vec![100]);
        drop(cut);
        st.recycle(a);
        assert_eq!(st.spare.len(), 1);
        st.recycle(b.clone());
        assert_eq!(st.spare.len(), 1, "held by the map still: not reused");
    }
}
