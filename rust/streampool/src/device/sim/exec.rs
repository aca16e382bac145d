//! Streams as queues of operations, and their execution.
//!
//! Each operation gets, when it is enqueued, a vector clock of what it is ordered after:
//! its stream's running clock (earlier operations there, and whatever the stream waited
//! for), plus, by the legacy stream's barrier, the running clocks of every blocking
//! stream (for an operation on the legacy stream) or the legacy stream's (for one on a
//! blocking stream). Work that had completed when an operation was enqueued is ordered
//! before it too, but instead of being joined into every clock it is covered by the
//! global completion counter: an operation remembers the counter's value at its
//! enqueue, and each execution bumps the counter. Clocks therefore only hold entries of
//! work still in flight, and are pruned as it completes.
//!
//! An operation is runnable when it is at the head of its stream and every other entry
//! of its clock has completed. Waits (event waits, the pool's inserted waits) are
//! operations too, so a stream that waits is not idle until the wait is satisfied.
//! Dependencies only point to earlier enqueues, so running always terminates.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::clock::VClock;

/// Operations queued and not run, on all streams, beyond which the oldest work that may
/// run does ([`super::SimDevice::ran_early`]): a program that never synchronises keeps at
/// most this backlog (about 30 MiB of operations).
pub const MAX_BACKLOG_OPS: usize = 1 << 16;
/// Entries of the queued operations' clocks beyond which work runs early as well: a chain
/// of streams each waiting on the one before (a stream per task, handing memory on) gives
/// each new operation a clock entry per stream still in flight, quadratic in the chain.
pub const MAX_BACKLOG_ENTRIES: usize = 1 << 21;
use super::detector::{OpInfo, OpKind, Stamp};
use super::{State, StreamState};

/// What an operation does when it runs.
#[derive(Debug)]
pub(super) enum Work {
    /// Fill `[ptr, ptr + bytes)` (simulated memory) with `value`: memsets and kernels
    /// that write.
    Fill { ptr: u64, bytes: usize, value: u8 },
    /// Copy; each side is simulated memory (`*_sim`) or foreign host memory.
    Copy { dst: u64, src: u64, bytes: usize, dst_sim: bool, src_sim: bool },
    /// A kernel that reads simulated memory.
    Read { ptr: u64, bytes: usize },
    /// One of streampool's kernels (`cuLaunchKernel`), which computes on the memory.
    Kernel(super::kernel::Launch),
    /// Prefetches, event records and waits touch no memory.
    Nothing,
}

impl Work {
    /// The simulated-memory ranges it touches, in order: `(start, end, writes)`.
    pub(super) fn accesses(&self) -> Vec<(u64, u64, bool)> {
        let end = |p: u64, n: usize| p + n as u64;
        match *self {
            Work::Fill { ptr, bytes, .. } => vec![(ptr, end(ptr, bytes), true)],
            Work::Read { ptr, bytes } => vec![(ptr, end(ptr, bytes), false)],
            Work::Copy { dst, src, bytes, dst_sim, src_sim } => {
                let mut v = Vec::with_capacity(2);
                if src_sim {
                    v.push((src, end(src, bytes), false));
                }
                if dst_sim {
                    v.push((dst, end(dst, bytes), true));
                }
                v
            }
            Work::Kernel(ref launch) => launch.accesses(),
            Work::Nothing => Vec::new(),
        }
    }
}

/// An enqueued operation.
#[derive(Debug)]
pub(super) struct Op {
    seq: u64,
    clock: VClock,
    enqueued_at: u64,
    work: Work,
    info: Arc<OpInfo>,
}

/// Whether op `seq` of stream `stream` has completed. A stream that is gone (destroyed,
/// its queue drained) completed everything.
pub(super) fn seq_done(streams: &BTreeMap<u64, StreamState>, stream: u64, seq: u64) -> bool {
    streams.get(&stream).is_none_or(|s| s.completed >= seq)
}

fn thread_name() -> String {
    let t = std::thread::current();
    t.name().map(str::to_owned).unwrap_or_else(|| format!("{:?}", t.id()))
}

impl State {
    pub(super) fn is_done(&self, stream: u64, seq: u64) -> bool {
        seq_done(&self.streams, stream, seq)
    }

    /// Drops the entries of work that has completed.
    fn prune(&self, clock: &mut VClock) {
        clock.retain(|s, n| !self.is_done(s, n));
    }

    /// What an operation enqueued on `sid` now would be ordered after, besides its own
    /// stream's earlier work: the stream's running clock plus the legacy barrier. Also
    /// the free point of `cuMemFreeAsync` on that stream.
    pub(super) fn point_clock(&self, sid: u64) -> VClock {
        let st = &self.streams[&sid];
        let mut clock = st.clock.clone();
        if st.legacy {
            for (&id, other) in &self.streams {
                if id != sid && other.dev == st.dev && other.blocking {
                    clock.join(&other.clock);
                }
            }
        } else if st.blocking {
            let legacy = self.devices[st.dev as usize].legacy;
            clock.join(&self.streams[&legacy].clock);
        }
        self.prune(&mut clock);
        clock
    }

    /// Enqueues `work` on stream `sid`, ordered also after `deps`; returns its clock.
    pub(super) fn enqueue(
        &mut self,
        sid: u64,
        work: Work,
        kind: OpKind,
        label: &str,
        deps: Option<&VClock>,
    ) -> VClock {
        let mut clock = self.point_clock(sid);
        if let Some(deps) = deps {
            clock.join(deps);
            self.prune(&mut clock);
        }
        let st = self.streams.get_mut(&sid).expect("resolved stream");
        st.seq += 1;
        clock.raise(sid, st.seq);
        let info = OpInfo {
            stream: st.handle,
            stream_id: sid,
            seq: st.seq,
            kind,
            label: label.to_owned(),
            thread: thread_name(),
        };
        st.clock = clock.clone();
        self.clock_entries += clock.len();
        st.queue.push_back(Op {
            seq: st.seq,
            clock: clock.clone(),
            enqueued_at: self.completions,
            work,
            info: Arc::new(info),
        });
        self.pending += 1;
        if self.pending > MAX_BACKLOG_OPS || self.clock_entries > MAX_BACKLOG_ENTRIES {
            self.run_backlog();
        }
        clock
    }

    /// Runs queued work, streams in turn, until half the backlog's bounds are left (or
    /// nothing may run): see [`super::SimDevice::ran_early`].
    /// A stream's work runs on while it may (the next stream is looked for only then: in a
    /// chain of streams each waiting on the last, the next one may run once this one's
    /// work has, so the look finds it at once).
    fn run_backlog(&mut self) {
        while self.pending > MAX_BACKLOG_OPS / 2 || self.clock_entries > MAX_BACKLOG_ENTRIES / 2 {
            let sid = self.cursor;
            if self.streams.contains_key(&sid) && self.runnable(sid) {
                self.execute_head(sid);
            } else if !self.step_any() {
                break;
            }
            self.ran_early += 1;
        }
        // What ran is ordered before everything queued now and later (each was enqueued
        // after it completed, or will be): the race detector forgets it, as it forgets
        // everything once nothing is queued, so that its state does not grow with what ran.
        let oldest = self.streams.values().filter_map(|s| s.queue.front()).map(|op| op.enqueued_at).min();
        self.shadow.forget_completed_by(oldest.unwrap_or(self.completions));
    }

    /// Makes later work on `sid` wait for `deps` (work on other streams), with a wait
    /// operation when some of it is still in flight.
    pub(super) fn add_dependency(&mut self, sid: u64, deps: &VClock, kind: OpKind, label: &str) {
        let mut deps = deps.clone();
        deps.retain(|s, n| s != sid && !self.is_done(s, n));
        // On the legacy default stream the call is an action all the same: the legacy stream
        // waits for every blocking stream, and they wait for it ("Stream synchronization
        // behavior" in the driver's documentation), which an operation queued there models.
        // With no other stream's work pending it orders nothing (it would complete at once,
        // and later work is ordered after what has completed), so none is queued: a free on
        // an idle device's legacy stream is complete when it returns, as on a GPU.
        let barrier = self.streams[&sid].legacy && self.point_clock(sid).iter().any(|(s, _)| s != sid);
        if !deps.is_empty() || barrier {
            self.enqueue(sid, Work::Nothing, kind, label, Some(&deps));
        }
    }

    /// Whether the head of `sid`'s queue may run now.
    pub(super) fn runnable(&self, sid: u64) -> bool {
        let Some(head) = self.streams.get(&sid).and_then(|s| s.queue.front()) else { return false };
        head.clock.iter().all(|(s, n)| s == sid || self.is_done(s, n))
    }

    /// Runs the head of `sid`'s queue (which must be runnable): checks its accesses
    /// against the shadow state, then performs them.
    pub(super) fn execute_head(&mut self, sid: u64) {
        let st = self.streams.get_mut(&sid).expect("stream with work");
        let op = st.queue.pop_front().expect("stream with work");
        st.completed = op.seq;
        if !st.live && st.queue.is_empty() {
            self.streams.remove(&sid);
        }
        self.pending -= 1;
        self.clock_entries -= op.clock.len();
        self.completions += 1;
        let me = Stamp {
            stream: sid,
            seq: op.seq,
            enqueued_at: op.enqueued_at,
            completed_at: self.completions,
            info: op.info.clone(),
        };
        for (start, end, writes) in op.work.accesses() {
            self.shadow.access(start, end, writes, &me, &op.clock, &mut self.races);
        }
        self.perform(&op.work);
        if self.pending == 0 {
            // Everything recorded has completed: every later operation is ordered after
            // all of it, so the shadow state has nothing left to say.
            self.shadow.clear();
        }
    }

    /// The effect of an operation on memory. Simulated memory is touched only while it
    /// is still backed (a buggy program may free it with the operation still queued).
    fn perform(&self, work: &Work) {
        let mut_ptr = |addr: u64| std::ptr::with_exposed_provenance_mut::<u8>(addr as usize);
        match *work {
            Work::Fill { ptr, bytes, value } => {
                if self.backed(ptr, bytes) {
                    // SAFETY: `[ptr, ptr + bytes)` lies inside a live `HostBlock` of this
                    // device (checked just above, under the state lock that every free
                    // takes), whose provenance was exposed when it was allocated.
                    unsafe { std::ptr::write_bytes(mut_ptr(ptr), value, bytes) }
                }
            }
            Work::Copy { dst, src, bytes, dst_sim, src_sim } => {
                if (!dst_sim || self.backed(dst, bytes)) && (!src_sim || self.backed(src, bytes)) {
                    // SAFETY: each simulated side lies inside a live `HostBlock` (checked
                    // just above); each foreign host side is valid for `bytes` bytes until
                    // the copy completes, by the contract of `Backend::memcpy_async`.
                    // `copy` allows the two to overlap.
                    unsafe {
                        std::ptr::copy(
                            std::ptr::with_exposed_provenance::<u8>(src as usize),
                            mut_ptr(dst),
                            bytes,
                        )
                    }
                }
            }
            Work::Kernel(ref launch) => {
                if launch.accesses().iter().all(|&(s, e, _)| self.backed(s, (e - s) as usize)) {
                    launch.run();
                }
            }
            Work::Read { .. } | Work::Nothing => {}
        }
    }

    /// Runs work until op `target` of stream `sid` has completed, running only what it
    /// depends on (heads of the streams its clock names, transitively).
    pub(super) fn drive(&mut self, sid: u64, target: u64) {
        let mut stack = vec![(sid, target)];
        while let Some(&(s, n)) = stack.last() {
            if self.is_done(s, n) {
                stack.pop();
                continue;
            }
            let head = self.streams[&s].queue.front().expect("unfinished work is queued");
            let dep = head.clock.iter().find(|&(d, m)| d != s && !self.is_done(d, m));
            match dep {
                Some(dep) => stack.push(dep),
                None => self.execute_head(s),
            }
        }
    }

    /// Runs everything enqueued so far on device `dev`'s streams, and what that work
    /// depends on (a synchronous call that waits for one device's context, as
    /// `cuCtxSynchronize`): other devices' work that nothing of `dev` waits for stays queued.
    pub(super) fn run_all(&mut self, dev: i32) {
        let targets: Vec<(u64, u64)> =
            self.streams.iter().filter(|(_, s)| s.dev == dev).map(|(&id, s)| (id, s.seq)).collect();
        for (sid, seq) in targets {
            self.drive(sid, seq);
        }
    }

    /// Runs one runnable operation, taking streams round-robin; false when none is.
    pub(super) fn step_any(&mut self) -> bool {
        let after = self.cursor;
        let next = self
            .streams
            .range(after + 1..)
            .chain(self.streams.range(..=after))
            .map(|(&id, _)| id)
            .find(|&id| self.runnable(id));
        match next {
            Some(id) => {
                self.cursor = id;
                self.execute_head(id);
                true
            }
            None => false,
        }
    }

    /// The simulated-memory ranges that queued operations will touch.
    pub(super) fn pending_ranges(&self) -> Vec<(u64, u64)> {
        self.streams
            .values()
            .flat_map(|s| s.queue.iter())
            .flat_map(|op| op.work.accesses())
            .map(|(s, e, _)| (s, e))
            .collect()
    }
}
