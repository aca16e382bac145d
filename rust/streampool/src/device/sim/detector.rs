//! The happens-before race detector: shadow state per byte range, checked when each
//! memory-accessing operation executes.
//!
//! Each byte range remembers its last write and, per stream, its latest read since that
//! write. An executing write must be ordered after the last write and after every read
//! since; an executing read after the last write. "Ordered" is the design's definition
//! (same stream, event waits, completion before enqueue, the legacy barrier), computed
//! by [`Stamp::ordered_before`] from the later op's vector clock and the completion
//! order. Shadow state is keyed by address only, so it outlives frees: memory reused
//! across streams without ordering is caught at the first conflicting access.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use super::clock::VClock;
use crate::device::{DevPtr, RawStream};

/// At most this many races are kept; later ones are counted but dropped.
pub const MAX_RACES: usize = 1000;

/// What an operation on a simulated stream does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `cuMemsetD8Async`.
    Memset,
    /// `cuMemcpyAsync` (reads its source, writes its destination).
    Memcpy,
    /// A simulated kernel that writes ([`super::SimDevice::write`]).
    Write,
    /// A simulated kernel that reads ([`super::SimDevice::read`]).
    Read,
    /// `cuMemPrefetchAsync` (no memory access).
    Prefetch,
    /// `cuEventRecord`.
    EventRecord,
    /// A wait on other streams' work: `cuStreamWaitEvent`, or one the pool model inserts.
    Wait,
    /// `cuLaunchKernel` of one of streampool's kernels (labelled with its name).
    Kernel,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::Memset => "memset",
            OpKind::Memcpy => "memcpy",
            OpKind::Write => "write",
            OpKind::Read => "read",
            OpKind::Prefetch => "prefetch",
            OpKind::EventRecord => "event record",
            OpKind::Wait => "wait",
            OpKind::Kernel => "kernel",
        })
    }
}

/// One operation, as a race report names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpInfo {
    /// The stream handle it was enqueued with (0 for the legacy stream, 2 for a
    /// per-thread default stream).
    pub stream: RawStream,
    /// The stream's never-reused id (`cuStreamGetId`).
    pub stream_id: u64,
    /// Its position on that stream, from 1.
    pub seq: u64,
    /// What it does.
    pub kind: OpKind,
    /// The label it was given (empty for driver calls).
    pub label: String,
    /// The host thread that enqueued it (its name, or its id).
    pub thread: String,
}

impl fmt::Display for OpInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if !self.label.is_empty() {
            write!(f, " '{}'", self.label)?;
        }
        write!(
            f,
            " on stream {:#x} (#{}, op {}, thread {})",
            self.stream, self.stream_id, self.seq, self.thread
        )
    }
}

/// Two conflicting accesses to the same bytes, neither ordered before the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Race {
    /// The access that executed first.
    pub earlier: OpInfo,
    /// Whether the earlier access wrote (else it read).
    pub earlier_writes: bool,
    /// The access that executed later and was not ordered after `earlier`.
    pub later: OpInfo,
    /// Whether the later access wrote (else it read).
    pub later_writes: bool,
    /// The bytes both touched: `[start, end)`.
    pub range: (DevPtr, DevPtr),
}

impl fmt::Display for Race {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |info: &OpInfo, writes: bool| match (info.kind, writes) {
            (OpKind::Memcpy, true) => " (its write)",
            (OpKind::Memcpy, false) => " (its read)",
            _ => "",
        };
        write!(
            f,
            "race on [{:#x},{:#x}): {}{} is not ordered before {}{}",
            self.range.0,
            self.range.1,
            self.earlier,
            side(&self.earlier, self.earlier_writes),
            self.later,
            side(&self.later, self.later_writes),
        )
    }
}

/// An operation at the point where it touches memory: who it is and what it is ordered
/// after.
#[derive(Debug, Clone)]
pub(super) struct Stamp {
    pub(super) stream: u64,
    pub(super) seq: u64,
    /// Value of the global completion counter when the op was enqueued.
    pub(super) enqueued_at: u64,
    /// Value of the completion counter that the op's execution produced.
    pub(super) completed_at: u64,
    pub(super) info: Arc<OpInfo>,
}

impl Stamp {
    /// Whether `self` (an access already executed) is ordered before `later`, whose
    /// clock is `later_clock`: `later`'s stream had waited for it (its clock covers it,
    /// which includes same-stream order), or it had completed when `later` was enqueued.
    fn ordered_before(&self, later: &Stamp, later_clock: &VClock) -> bool {
        later_clock.get(self.stream) >= self.seq || self.completed_at <= later.enqueued_at
    }
}

#[derive(Debug, Clone)]
struct Segment {
    end: u64,
    write: Option<Stamp>,
    /// The latest read per stream since `write`.
    reads: Vec<Stamp>,
}

/// Shadow state of every byte the simulated device has touched.
#[derive(Debug, Default)]
pub(super) struct Shadow {
    segs: BTreeMap<u64, Segment>,
}

impl Shadow {
    /// Forgets everything. Sound only when no work is pending: every access recorded
    /// has then completed, so every later op is ordered after all of them.
    pub(super) fn clear(&mut self) {
        self.segs.clear();
    }

    /// Forgets the accesses of operations that completed at or before `t` (the completion
    /// counter): sound when every queued operation was enqueued at `t` or later, since it,
    /// and every later one, is then ordered after them. Segments left with no access go.
    pub(super) fn forget_completed_by(&mut self, t: u64) {
        self.segs.retain(|_, seg| {
            seg.reads.retain(|r| r.completed_at > t);
            if seg.write.as_ref().is_some_and(|w| w.completed_at <= t) {
                seg.write = None;
            }
            seg.write.is_some() || !seg.reads.is_empty()
        });
    }

    /// Splits the segment that strictly contains `at`, so that a segment starts there.
    fn split(&mut self, at: u64) {
        let Some((_, seg)) = self.segs.range_mut(..at).next_back() else { return };
        if seg.end <= at {
            return;
        }
        let right = seg.clone();
        seg.end = at;
        self.segs.insert(at, right);
    }

    /// Checks an access of `[start, end)` by `me` (with clock `clock`) against the
    /// shadow state, reports conflicts to `log`, and records the access.
    pub(super) fn access(
        &mut self,
        start: u64,
        end: u64,
        writes: bool,
        me: &Stamp,
        clock: &VClock,
        log: &mut RaceLog,
    ) {
        if start >= end {
            return;
        }
        self.split(start);
        self.split(end);
        let keys: Vec<u64> = self.segs.range(start..end).map(|(&k, _)| k).collect();
        for &k in &keys {
            let seg = &self.segs[&k];
            let range = (k, seg.end);
            if let Some(w) = &seg.write {
                if !w.ordered_before(me, clock) {
                    log.report(w, true, me, writes, range);
                }
            }
            if writes {
                for r in &seg.reads {
                    if !r.ordered_before(me, clock) {
                        log.report(r, false, me, true, range);
                    }
                }
            }
        }
        if writes {
            // One segment for the whole range: the write supersedes all that was there.
            for k in &keys {
                self.segs.remove(k);
            }
            self.segs.insert(start, Segment { end, write: Some(me.clone()), reads: Vec::new() });
            return;
        }
        // A read: note it in each segment, and fill the gaps with fresh segments.
        let mut cursor = start;
        let mut gaps = Vec::new();
        for &k in &keys {
            if k > cursor {
                gaps.push((cursor, k));
            }
            let seg = self.segs.get_mut(&k).expect("key listed above");
            match seg.reads.iter_mut().find(|r| r.stream == me.stream) {
                Some(r) => *r = me.clone(),
                None => seg.reads.push(me.clone()),
            }
            cursor = seg.end;
        }
        if cursor < end {
            gaps.push((cursor, end));
        }
        for (s, e) in gaps {
            self.segs.insert(s, Segment { end: e, write: None, reads: vec![me.clone()] });
        }
    }

    #[cfg(test)]
    pub(super) fn segments(&self) -> usize {
        self.segs.len()
    }

    /// Accesses recorded, over every segment.
    #[cfg(test)]
    pub(super) fn stamps(&self) -> usize {
        self.segs.values().map(|s| s.reads.len() + s.write.is_some() as usize).sum()
    }
}

/// The races found so far, each pair of operations once.
#[derive(Debug, Default)]
pub(super) struct RaceLog {
    races: Vec<Race>,
    /// (earlier stream, earlier seq, later stream, later seq) -> index in `races`.
    seen: HashMap<(u64, u64, u64, u64), usize>,
    dropped: usize,
}

impl RaceLog {
    fn report(
        &mut self,
        earlier: &Stamp,
        earlier_writes: bool,
        later: &Stamp,
        later_writes: bool,
        range: (u64, u64),
    ) {
        let key = (earlier.stream, earlier.seq, later.stream, later.seq);
        if let Some(&i) = self.seen.get(&key) {
            let r = &mut self.races[i].range;
            *r = (r.0.min(range.0), r.1.max(range.1));
            return;
        }
        if self.races.len() >= MAX_RACES {
            self.dropped += 1;
            return;
        }
        self.seen.insert(key, self.races.len());
        self.races.push(Race {
            earlier: (*earlier.info).clone(),
            earlier_writes,
            later: (*later.info).clone(),
            later_writes,
            range,
        });
    }

    pub(super) fn races(&self) -> Vec<Race> {
        self.races.clone()
    }

    pub(super) fn take(&mut self) -> Vec<Race> {
        self.seen.clear();
        self.dropped = 0;
        std::mem::take(&mut self.races)
    }

    pub(super) fn dropped(&self) -> usize {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(stream: u64, seq: u64, enqueued_at: u64, completed_at: u64, kind: OpKind) -> Stamp {
        let info = OpInfo {
            stream: 0x1000 + stream,
            stream_id: stream,
            seq,
            kind,
            label: format!("op{stream}.{seq}"),
            thread: "t".into(),
        };
        Stamp { stream, seq, enqueued_at, completed_at, info: Arc::new(info) }
    }

    fn clock(entries: &[(u64, u64)]) -> VClock {
        let mut c = VClock::default();
        for &(s, n) in entries {
            c.raise(s, n);
        }
        c
    }

    #[test]
    fn unordered_write_after_write_is_reported_once_per_pair() {
        let mut shadow = Shadow::default();
        let mut log = RaceLog::default();
        let a = stamp(1, 1, 0, 1, OpKind::Write);
        shadow.access(100, 200, true, &a, &clock(&[(1, 1)]), &mut log);
        // Enqueued before `a` completed, not waiting for it.
        let b = stamp(2, 1, 0, 2, OpKind::Write);
        shadow.access(150, 250, true, &b, &clock(&[(2, 1)]), &mut log);
        shadow.access(120, 160, true, &b, &clock(&[(2, 1)]), &mut log);
        let races = log.races();
        assert_eq!(races.len(), 1, "{races:?}");
        assert_eq!(races[0].range, (120, 200));
        assert_eq!(races[0].earlier.label, "op1.1");
        assert_eq!(races[0].later.label, "op2.1");
    }

    #[test]
    fn ordered_by_clock_or_by_completion() {
        let mut shadow = Shadow::default();
        let mut log = RaceLog::default();
        let a = stamp(1, 3, 0, 1, OpKind::Write);
        shadow.access(0, 64, true, &a, &clock(&[(1, 3)]), &mut log);
        // Waited for stream 1 up to op 3.
        let b = stamp(2, 1, 0, 2, OpKind::Read);
        shadow.access(0, 64, false, &b, &clock(&[(1, 3), (2, 1)]), &mut log);
        // Enqueued after `b` completed (completion counter 2), so ordered after it.
        let c = stamp(3, 1, 2, 3, OpKind::Write);
        shadow.access(0, 64, true, &c, &clock(&[(3, 1)]), &mut log);
        assert!(log.races().is_empty(), "{:?}", log.races());
        // Not ordered after `c`'s write: a race, read after write.
        let d = stamp(4, 1, 2, 4, OpKind::Read);
        shadow.access(32, 96, false, &d, &clock(&[(4, 1)]), &mut log);
        let races = log.races();
        assert_eq!(races.len(), 1);
        assert!(races[0].earlier_writes && !races[0].later_writes);
        assert_eq!(races[0].range, (32, 64));
    }

    #[test]
    fn write_after_unordered_read_is_a_race_and_reads_do_not_conflict() {
        let mut shadow = Shadow::default();
        let mut log = RaceLog::default();
        let r1 = stamp(1, 1, 0, 1, OpKind::Read);
        let r2 = stamp(2, 1, 0, 2, OpKind::Read);
        shadow.access(0, 10, false, &r1, &clock(&[(1, 1)]), &mut log);
        shadow.access(5, 15, false, &r2, &clock(&[(2, 1)]), &mut log);
        assert!(log.races().is_empty());
        // Waits for stream 1 only.
        let w = stamp(3, 1, 0, 3, OpKind::Memcpy);
        shadow.access(0, 15, true, &w, &clock(&[(1, 1), (3, 1)]), &mut log);
        let races = log.races();
        assert_eq!(races.len(), 1, "{races:?}");
        assert_eq!(races[0].earlier.label, "op2.1");
        assert_eq!(races[0].range, (5, 15));
        let text = races[0].to_string();
        assert!(text.contains("read 'op2.1' on stream 0x1002"), "{text}");
        assert!(text.contains("memcpy 'op3.1' on stream 0x1003 (#3, op 1, thread t) (its write)"), "{text}");
        // The write merged everything under it into one segment.
        assert_eq!(shadow.segments(), 1);
        assert_eq!(log.take().len(), 1);
        assert!(log.races().is_empty());
    }
}
