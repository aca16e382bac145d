//! The adaptors' own promises, beyond the conformance suite: numbers equal a model's,
//! refusals change nothing, limits hold under threads, callbacks may re-enter, logs
//! round-trip (ours and RMM's), and the binning and fixed-size resources route and reuse
//! as documented. Each test makes its own simulated device and never activates it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use proptest::prelude::*;
use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr, Location};
use streampool::resource::{MemoryKind, MemoryResource, ResourceRef};
use streampool::{
    parse_log, BinningMemoryResource, CudaAsyncMemoryResource, CudaMemoryResource, Error,
    FailureCallbackAdaptor, FixedSizeMemoryResource, LimitingAdaptor, LogAction, LogSink, LoggingAdaptor,
    ManagedMemoryResource, PrefetchAdaptor, Result, Statistics, StatisticsAdaptor, Stream, TrackingAdaptor,
    LOG_HEADER,
};

fn sim(capacity: usize) -> (Arc<SimDevice>, BackendRef) {
    let sim = SimDevice::new(capacity);
    let backend: BackendRef = sim.clone();
    (sim, backend)
}

fn async_mr(b: &BackendRef) -> ResourceRef {
    Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap())
}

fn streams(b: &BackendRef, n: usize) -> Vec<Stream> {
    (0..n).map(|_| Stream::create(b, 0, false).unwrap()).collect()
}

fn assert_no_races(sim: &SimDevice) {
    sim.run();
    let races = sim.races();
    assert!(races.is_empty(), "{} races, first: {}", races.len(), races[0]);
}

// ---------------------------------------------------------------------------------------
// Statistics

/// RMM's counters, written the obvious way.
#[derive(Clone, Copy, Default)]
struct ModelCounter {
    value: i64,
    peak: i64,
    total: i64,
}

#[derive(Clone, Copy, Default)]
struct ModelCounters {
    bytes: ModelCounter,
    count: ModelCounter,
}

impl ModelCounter {
    fn add(&mut self, n: i64) {
        self.value += n;
        self.peak = self.peak.max(self.value);
        self.total += n;
    }
    fn merge(&mut self, child: ModelCounter) {
        self.peak = self.peak.max(self.value + child.peak);
        self.value += child.value;
        self.total += child.total;
    }
}

impl ModelCounters {
    fn stats(&self) -> Statistics {
        let c = |v: i64| usize::try_from(v).unwrap_or(0);
        Statistics {
            current_bytes: c(self.bytes.value),
            current_count: c(self.count.value),
            peak_bytes: c(self.bytes.peak).max(c(self.bytes.value)),
            peak_count: c(self.count.peak).max(c(self.count.value)),
            total_bytes: c(self.bytes.total),
            total_count: c(self.count.total),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// After every operation of any sequence of allocations, frees, pushes and pops, the
    /// adaptor's numbers are the model's.
    #[test]
    fn statistics_equal_a_model(ops in proptest::collection::vec((0u8..6, 1usize..100_000, any::<usize>()), 1..80)) {
        let (_sim, b) = sim(1 << 30);
        let mr = StatisticsAdaptor::new(async_mr(&b)).unwrap();
        let s = Stream::legacy();
        let mut model = vec![ModelCounters::default()];
        let mut live: Vec<(DevPtr, usize)> = vec![];
        for (op, bytes, pick) in ops {
            match op {
                0..=2 => {
                    live.push((mr.allocate(bytes, &s).unwrap(), bytes));
                    let top = model.last_mut().unwrap();
                    top.bytes.add(bytes as i64);
                    top.count.add(1);
                }
                3 if !live.is_empty() => {
                    let (ptr, bytes) = live.swap_remove(pick % live.len());
                    mr.deallocate(ptr, bytes, &s).unwrap();
                    let top = model.last_mut().unwrap();
                    top.bytes.value -= bytes as i64;
                    top.count.value -= 1;
                }
                4 => {
                    prop_assert_eq!(mr.push_counters(), model.last().unwrap().stats());
                    model.push(ModelCounters::default());
                }
                _ => match mr.pop_counters() {
                    Ok(popped) => {
                        let child = model.pop().unwrap();
                        prop_assert_eq!(popped, child.stats());
                        let top = model.last_mut().unwrap();
                        top.bytes.merge(child.bytes);
                        top.count.merge(child.count);
                    }
                    Err(e) => {
                        prop_assert!(matches!(e, Error::InvalidArgument(_)), "{:?}", e);
                        prop_assert_eq!(model.len(), 1);
                    }
                },
            }
            prop_assert_eq!(mr.statistics(), model.last().unwrap().stats());
        }
        for (ptr, bytes) in live {
            mr.deallocate(ptr, bytes, &s).unwrap();
        }
    }
}

#[test]
fn statistics_refusals_count_nothing() {
    let (_sim, b) = sim(64 << 20);
    let mr = StatisticsAdaptor::new(async_mr(&b)).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(1000, &s).unwrap();
    assert!(mr.allocate(128 << 20, &s).unwrap_err().is_out_of_memory());
    assert!(mr.deallocate(0xdead_0000, 256, &s).is_err());
    let stats = mr.statistics();
    assert_eq!((stats.current_bytes, stats.total_count), (1000, 1));
    let err = mr.pop_counters().unwrap_err();
    assert!(err.to_string().contains("only the base counters remain"), "{err}");
    mr.deallocate(p, 1000, &s).unwrap();
    assert_eq!(mr.statistics().current_bytes, 0);
}

#[test]
fn statistics_under_threads_are_exact() {
    let (_sim, b) = sim(1 << 30);
    let mr = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let mr = mr.clone();
            std::thread::spawn(move || {
                let s = Stream::per_thread();
                for i in 0..200 {
                    let bytes = 256 * (1 + (t + i) % 7);
                    let p = mr.allocate(bytes, &s).unwrap();
                    mr.deallocate(p, bytes, &s).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let total: usize = (0..8).flat_map(|t| (0..200).map(move |i| 256 * (1 + (t + i) % 7))).sum();
    let stats = mr.statistics();
    assert_eq!((stats.current_bytes, stats.current_count, stats.total_count), (0, 0, 1600));
    assert_eq!(stats.total_bytes, total);
    assert!(stats.peak_count >= 1 && stats.peak_count <= 8, "{stats:?}");
}

// ---------------------------------------------------------------------------------------
// Tracking

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// `outstanding()` is exactly the set allocated and not freed after any sequence, and
    /// double frees, unknown pointers and size mismatches are refused with nothing changed.
    #[test]
    fn tracking_reports_exactly_the_outstanding_set(
        ops in proptest::collection::vec((0u8..6, 1usize..50_000, any::<usize>()), 1..60),
    ) {
        let (sim, b) = sim(1 << 30);
        let mr = TrackingAdaptor::new(async_mr(&b), None).unwrap();
        let ss = streams(&b, 3);
        let mut live: BTreeMap<DevPtr, (usize, u64)> = BTreeMap::new();
        let mut freed: Vec<DevPtr> = vec![];
        for (op, bytes, pick) in ops {
            let s = &ss[pick % ss.len()];
            let before = mr.outstanding();
            match op {
                0..=2 => {
                    let p = mr.allocate(bytes, s).unwrap();
                    sim.write(s.handle(), p, bytes).unwrap();
                    live.insert(p, (bytes, s.handle()));
                }
                3 if !live.is_empty() => {
                    let (&p, &(n, h)) = live.iter().nth(pick % live.len()).unwrap();
                    let s = ss.iter().find(|s| s.handle() == h).unwrap();
                    mr.deallocate(p, n, s).unwrap();
                    live.remove(&p);
                    freed.push(p);
                }
                4 if !live.is_empty() => {
                    // The wrong size: refused, nothing changes.
                    let (&p, &(n, _)) = live.iter().nth(pick % live.len()).unwrap();
                    let err = mr.deallocate(p, n + 1, s).unwrap_err();
                    prop_assert!(matches!(&err, Error::InvalidPointer(m) if m.contains(&n.to_string()) && m.contains(&(n + 1).to_string())), "{}", err);
                    prop_assert_eq!(mr.outstanding(), before);
                }
                _ => {
                    // A double free (when the address is not live again), or an unknown pointer.
                    let p = freed.iter().copied().find(|p| !live.contains_key(p)).unwrap_or(0xdead_0000);
                    let err = mr.deallocate(p, 256, s).unwrap_err();
                    prop_assert!(matches!(&err, Error::InvalidPointer(m) if m.contains("not an outstanding allocation")), "{}", err);
                    prop_assert_eq!(mr.outstanding(), before);
                }
            }
            let got: Vec<(DevPtr, usize, u64)> = mr.outstanding().iter().map(|r| (r.ptr, r.bytes, r.stream)).collect();
            let want: Vec<(DevPtr, usize, u64)> = live.iter().map(|(&p, &(n, h))| (p, n, h)).collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(mr.allocated_bytes(), live.values().map(|v| v.0).sum::<usize>());
        }
        for (p, (n, h)) in live {
            mr.deallocate(p, n, ss.iter().find(|s| s.handle() == h).unwrap()).unwrap();
        }
        prop_assert!(mr.outstanding().is_empty());
        assert_no_races(&sim);
    }
}

#[test]
fn tracking_report_names_every_leak_with_its_stack() {
    let (_sim, b) = sim(1 << 30);
    let capture: streampool::StackCapture = Arc::new(|| "frame one\nframe two".to_string());
    let mr = TrackingAdaptor::new(async_mr(&b), Some(capture)).unwrap();
    let s = Stream::legacy();
    let (p, q) = (mr.allocate(1000, &s).unwrap(), mr.allocate(24, &s).unwrap());
    let report = mr.outstanding_report();
    assert!(
        report.starts_with("2 outstanding allocations, 1024 bytes, in TrackingResourceAdaptor"),
        "{report}"
    );
    assert!(report.contains(&format!("{p:#x}: 1000 bytes")) && report.contains(&format!("{q:#x}: 24 bytes")));
    assert!(report.contains("      frame two"), "{report}");
    let records = mr.outstanding();
    assert_eq!(records[0].stack.as_deref(), Some("frame one\nframe two"));
    assert!(records[0].thread.contains("tracking_report_names_every_leak"), "{}", records[0].thread);
    mr.deallocate(p, 1000, &s).unwrap();
    mr.deallocate(q, 24, &s).unwrap();
    assert_eq!(mr.outstanding_report(), "", "nothing outstanding: an empty report, as RMM's");
}

#[test]
fn tracking_with_backtraces_records_a_rust_stack() {
    let (_sim, b) = sim(1 << 30);
    let mr = TrackingAdaptor::with_backtraces(async_mr(&b)).unwrap();
    let p = mr.allocate(256, &Stream::legacy()).unwrap();
    assert!(mr.outstanding()[0].stack.as_ref().is_some_and(|s| !s.is_empty()));
    mr.deallocate(p, 256, &Stream::legacy()).unwrap();
}

// ---------------------------------------------------------------------------------------
// Limiting

/// Forwards to an upstream, keeping the bytes in use and their peak.
#[derive(Debug)]
struct Metered {
    upstream: ResourceRef,
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl MemoryResource for Metered {
    fn backend(&self) -> &BackendRef {
        self.upstream.backend()
    }
    fn device(&self) -> i32 {
        self.upstream.device()
    }
    fn name(&self) -> &str {
        "Metered"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let p = self.upstream.allocate(bytes, stream)?;
        let now = self.in_use.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        Ok(p)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        // Counted down before the memory goes back, so that the count never lags below
        // what the upstream holds.
        self.in_use.fetch_sub(bytes, Ordering::SeqCst);
        self.upstream.deallocate(ptr, bytes, stream)
    }
}

#[test]
fn the_limit_is_never_exceeded_under_8_threads() {
    const LIMIT: usize = 1 << 20;
    let (_sim, b) = sim(1 << 30);
    let metered =
        Arc::new(Metered { upstream: async_mr(&b), in_use: AtomicUsize::new(0), peak: AtomicUsize::new(0) });
    let mr = Arc::new(LimitingAdaptor::new(metered.clone(), LIMIT).unwrap());
    let refusals = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8usize)
        .map(|t| {
            let (mr, metered, refusals) = (mr.clone(), metered.clone(), refusals.clone());
            std::thread::spawn(move || {
                let s = Stream::per_thread();
                let mut held = vec![];
                let mut x = t as u64 * 7919 + 1;
                for _ in 0..400 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let bytes = 1 + (x >> 33) as usize % (LIMIT / 6);
                    match mr.allocate(bytes, &s) {
                        Ok(p) => held.push((p, bytes)),
                        Err(Error::OutOfMemory { requested, available: Some(a), resource }) => {
                            assert_eq!(requested, bytes);
                            assert!(a < bytes, "refused {bytes} with {a} available");
                            assert!(resource.contains(&format!("limit {LIMIT} bytes")), "{resource}");
                            refusals.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                    assert!(mr.allocated_bytes() <= LIMIT);
                    assert!(metered.in_use.load(Ordering::SeqCst) <= LIMIT);
                    // Up to 12 held, a twelfth of the limit on average: each thread reaches
                    // the limit by itself (70-150 refusals each, run alone), so the check
                    // below holds however the threads happen to overlap.
                    if held.len() >= 12 || (x & 7 == 0 && !held.is_empty()) {
                        let (p, n) = held.swap_remove((x >> 40) as usize % held.len());
                        mr.deallocate(p, n, &s).unwrap();
                    }
                }
                for (p, n) in held {
                    mr.deallocate(p, n, &s).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(metered.peak.load(Ordering::SeqCst) <= LIMIT);
    assert!(refusals.load(Ordering::Relaxed) > 0, "the test should reach the limit");
    assert_eq!(mr.allocated_bytes(), 0);
}

#[test]
fn limiting_bad_input() {
    let (_sim, b) = sim(64 << 20);
    let err = LimitingAdaptor::new(async_mr(&b), 0).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("above 0")), "{err}");
    let mr = LimitingAdaptor::new(async_mr(&b), 1 << 20).unwrap();
    assert_eq!(mr.limit(), 1 << 20);
    let s = Stream::legacy();
    let p = mr.allocate(512 << 10, &s).unwrap();
    let err = mr.allocate(768 << 10, &s).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("limit 1048576 bytes, 524288 in use")
            && text.contains("786432 bytes (524288 bytes available)")
            && !text.contains("counts as"),
        "{text}"
    );
    // A request that fits only unrounded says how it was counted.
    let small = LimitingAdaptor::new(async_mr(&b), 1000).unwrap();
    let text = small.allocate(1000, &s).unwrap_err().to_string();
    assert!(text.contains("counts as 1024 bytes"), "{text}");
    // A free the upstream refuses gives no room back; an upstream failure below the limit
    // rolls its reservation back.
    assert!(mr.deallocate(0xdead_0000, 4096, &s).is_err());
    assert_eq!(mr.allocated_bytes(), 512 << 10);
    let big = LimitingAdaptor::new(async_mr(&b), usize::MAX / 2).unwrap();
    let err = big.allocate(128 << 20, &s).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { resource, .. } if resource.starts_with("LimitingResourceAdaptor (from ")),
        "{err:?}"
    );
    assert_eq!(big.allocated_bytes(), 0);
    mr.deallocate(p, 512 << 10, &s).unwrap();
    assert_eq!(mr.allocated_bytes(), 0);
}

// ---------------------------------------------------------------------------------------
// Failure callback

/// A limited stack with `held` allocations filling it.
fn filled(limit: usize) -> (Arc<SimDevice>, Arc<LimitingAdaptor>, Vec<DevPtr>) {
    let (sim, b) = sim(1 << 30);
    let limited = Arc::new(LimitingAdaptor::new(async_mr(&b), limit).unwrap());
    let held = (0..4).map(|_| limited.allocate(limit / 4, &Stream::legacy()).unwrap()).collect();
    (sim, limited, held)
}

#[test]
fn failure_callback_retries_while_it_says_true() {
    let (_sim, limited, held) = filled(1 << 20);
    let held = Arc::new(Mutex::new(held));
    let calls = Arc::new(AtomicUsize::new(0));
    let (h, c, l) = (held.clone(), calls.clone(), limited.clone());
    let mr = FailureCallbackAdaptor::new(
        limited.clone(),
        Arc::new(move |bytes| {
            assert_eq!(bytes, 600 << 10);
            c.fetch_add(1, Ordering::SeqCst);
            // Frees one held allocation per call: the third call makes room.
            let p = h.lock().unwrap().pop().unwrap();
            l.deallocate(p, 256 << 10, &Stream::legacy())?;
            Ok(true)
        }),
    )
    .unwrap();
    let p = mr.allocate(600 << 10, &Stream::legacy()).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    mr.deallocate(p, 600 << 10, &Stream::legacy()).unwrap();
    for p in held.lock().unwrap().drain(..) {
        limited.deallocate(p, 256 << 10, &Stream::legacy()).unwrap();
    }
    assert_eq!(limited.allocated_bytes(), 0);
}

#[test]
fn failure_callback_saying_false_gives_the_out_of_memory_error() {
    let (_sim, limited, held) = filled(1 << 20);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let mr = FailureCallbackAdaptor::new(
        limited.clone(),
        Arc::new(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            Ok(false)
        }),
    )
    .unwrap();
    let err = mr.allocate(4096, &Stream::legacy()).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { requested: 4096, available: Some(0), resource } if resource.starts_with("FailureCallbackResourceAdaptor (from ")),
        "{err:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Other errors do not call it.
    let foreign_sim = SimDevice::new(1 << 20);
    let foreign: BackendRef = foreign_sim.clone();
    assert!(mr.allocate(4096, &Stream::create(&foreign, 0, false).unwrap()).is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    for p in held {
        mr.deallocate(p, 256 << 10, &Stream::legacy()).unwrap();
    }
    assert_eq!(limited.allocated_bytes(), 0);
}

#[test]
fn a_failing_callback_is_returned_and_nothing_is_corrupted() {
    let (_sim, limited, held) = filled(1 << 20);
    let mr = FailureCallbackAdaptor::new(
        limited.clone(),
        Arc::new(|bytes| Err(Error::Callback(format!("python raised MemoryError({bytes})")))),
    )
    .unwrap();
    let err = mr.allocate(4096, &Stream::legacy()).unwrap_err();
    assert_eq!(err, Error::Callback("python raised MemoryError(4096)".into()));
    assert_eq!(limited.allocated_bytes(), 1 << 20, "the failed attempt reserved nothing");
    mr.deallocate(held[0], 256 << 10, &Stream::legacy()).unwrap();
    let p = mr.allocate(4096, &Stream::legacy()).unwrap();
    mr.deallocate(p, 4096, &Stream::legacy()).unwrap();
    for &p in &held[1..] {
        mr.deallocate(p, 256 << 10, &Stream::legacy()).unwrap();
    }
}

/// The callback frees through the top of the stack it is part of (tracking over
/// statistics over the callback adaptor over a limit): no lock is held while it runs.
#[test]
fn a_callback_may_free_into_its_own_stack() {
    let (_sim, b) = sim(1 << 30);
    let limited = Arc::new(LimitingAdaptor::new(async_mr(&b), 1 << 20).unwrap());
    let top: Arc<OnceLock<Arc<TrackingAdaptor>>> = Arc::new(OnceLock::new());
    let victims: Arc<Mutex<Vec<DevPtr>>> = Arc::default();
    let (t, v) = (top.clone(), victims.clone());
    let retry = Arc::new(
        FailureCallbackAdaptor::new(
            limited.clone(),
            Arc::new(move |_| {
                let Some(p) = v.lock().unwrap().pop() else { return Ok(false) };
                t.get().unwrap().deallocate(p, 512 << 10, &Stream::legacy())?;
                Ok(true)
            }),
        )
        .unwrap(),
    );
    let stats = Arc::new(StatisticsAdaptor::new(retry).unwrap());
    let tracking = Arc::new(TrackingAdaptor::new(stats.clone(), None).unwrap());
    top.set(tracking.clone()).unwrap();
    let s = Stream::legacy();
    victims
        .lock()
        .unwrap()
        .extend([tracking.allocate(512 << 10, &s).unwrap(), tracking.allocate(512 << 10, &s).unwrap()]);
    let p = tracking.allocate(768 << 10, &s).unwrap();
    assert!(victims.lock().unwrap().is_empty(), "both freed to make room for 768 KiB");
    assert_eq!(tracking.outstanding().len(), 1);
    let stats_now = stats.statistics();
    assert_eq!(
        (stats_now.current_bytes, stats_now.peak_bytes, stats_now.total_count),
        (768 << 10, 1 << 20, 3)
    );
    tracking.deallocate(p, 768 << 10, &s).unwrap();
    assert_eq!(limited.allocated_bytes(), 0);
}

// ---------------------------------------------------------------------------------------
// Logging

fn temp_log(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("streampool-{name}-{}.csv", std::process::id()))
}

#[test]
fn a_log_round_trips_through_the_parser() {
    let (_sim, b) = sim(64 << 20);
    let path = temp_log("round-trip");
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let l = lines.clone();
    let sink = LogSink::Callback(Arc::new(move |line: &str| {
        l.lock().unwrap().push(line.to_string());
        Ok(())
    }));
    let mr = LoggingAdaptor::new(async_mr(&b), vec![LogSink::File(path.clone()), sink]).unwrap();
    assert_eq!(mr.file_name(), Some(path.as_path()));
    let s = Stream::create(&b, 0, false).unwrap();
    let p = mr.allocate(1000, &s).unwrap();
    let q = mr.allocate(4096, &Stream::legacy()).unwrap();
    assert!(mr.allocate(128 << 20, &s).unwrap_err().is_out_of_memory());
    mr.deallocate(p, 1000, &s).unwrap();
    mr.deallocate(q, 4096, &Stream::legacy()).unwrap();
    let other = {
        let mr = &mr;
        std::thread::scope(|sc| {
            sc.spawn(move || mr.allocate(256, &Stream::per_thread()).unwrap()).join().unwrap()
        })
    };
    mr.flush().unwrap();

    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with(&format!("{LOG_HEADER}\n")), "{text}");
    assert!(text.contains(",allocate failure,(nil),134217728,"), "{text}");
    let events = parse_log(&text).unwrap();
    let got: Vec<(LogAction, DevPtr, usize, u64)> =
        events.iter().map(|e| (e.action, e.ptr, e.bytes, e.stream)).collect();
    let h = s.handle();
    assert_eq!(
        got,
        vec![
            (LogAction::Allocate, p, 1000, h),
            (LogAction::Allocate, q, 4096, 0),
            (LogAction::AllocateFailure, 0, 128 << 20, h),
            (LogAction::Free, p, 1000, h),
            (LogAction::Free, q, 4096, 0),
            (LogAction::Allocate, other, 256, 2),
        ]
    );
    assert!(events[..5].iter().all(|e| e.thread == events[0].thread));
    assert_ne!(events[5].thread, events[0].thread, "another thread, another id");
    assert!(events.iter().all(|e| (0.0..86_401.0).contains(&e.time)));
    // The callback saw the same lines, header first.
    let from_callback = lines.lock().unwrap().join("\n");
    assert_eq!(parse_log(&from_callback).unwrap(), events);
    mr.deallocate(other, 256, &Stream::per_thread()).unwrap();
    let _ = std::fs::remove_file(path);
}

/// RMM's format, as its `logging_resource_adaptor` writes it on Linux: the logger
/// pattern `%t,%H:%M:%S.%f,%v` and the message `allocate,%p,%zu,<stream>` (rapidsai/rmm
/// `cpp/src/mr/detail/logging_resource_adaptor_impl.cpp`; `%p` prints `(nil)` for the
/// null pointer of a failure; the stream is `format_stream` of `rmm/detail/format.hpp`,
/// C++'s hexadecimal pointer output, `0` for the default stream). Its replay benchmark's
/// parser is `cpp/benchmarks/utilities/log_parser.hpp`. The last two lines are in the
/// shape RMM's user guide shows (epoch seconds, `deallocate`).
const RMM_LOG: &str = "Thread,Time,Action,Pointer,Size,Stream
140737353938752,13:45:10.482113,allocate,0x7fffc4000000,1024,0
140737353938752,13:45:10.482190,allocate,0x7fffc4000400,2048,0x55555a1f2e40
140737336104512,13:45:10.482301,allocate failure,(nil),85899345920,0x55555a1f2e40
140737353938752,13:45:10.482377,free,0x7fffc4000000,1024,0
140573312345856,1634567890.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020
140573312345856,1634567890.345678,deallocate,0x7f8a40000000,1024,0x7f8a38001020
";

#[test]
fn a_log_in_rmm_format_parses() {
    let events = parse_log(RMM_LOG).unwrap();
    assert_eq!(events.len(), 6);
    let e = &events[1];
    assert_eq!(
        (e.thread, e.action, e.ptr, e.bytes, e.stream),
        (140737353938752, LogAction::Allocate, 0x7fffc4000400, 2048, 0x55555a1f2e40)
    );
    assert!((e.time - (13.0 * 3600.0 + 45.0 * 60.0 + 10.482190)).abs() < 1e-6, "{}", e.time);
    assert_eq!(
        (events[2].action, events[2].ptr, events[2].bytes),
        (LogAction::AllocateFailure, 0, 85899345920)
    );
    assert_eq!((events[3].action, events[3].stream), (LogAction::Free, 0));
    assert_eq!(events[4].time, 1634567890.123456);
    assert_eq!(events[5].action, LogAction::Free);
    // Windows line ends and blank lines are fine too.
    assert_eq!(parse_log(&RMM_LOG.replace('\n', "\r\n\r\n")).unwrap(), events);
}

#[test]
fn bad_logs_are_refused_naming_the_line() {
    let err = parse_log("").unwrap_err();
    assert!(err.to_string().contains("expected the header"), "{err}");
    let err = parse_log("1,00:00:00.0,allocate,0x100,1,0\n").unwrap_err();
    assert!(err.to_string().contains("log line 1: expected the header"), "{err}");
    for (bad, why) in [
        ("1,00:00:00.0,allocate,0x100,1", "expected 6 comma-separated fields, found 5"),
        ("1,00:00:00.0,reallocate,0x100,1,0", "unknown action `reallocate`"),
        ("x,00:00:00.0,allocate,0x100,1,0", "bad thread id"),
        ("1,00:99:00.0,allocate,0x100,1,0", "bad time"),
        ("1,-5,allocate,0x100,1,0", "bad time"),
        ("1,1e300,allocate,0x100,1,0", "bad time"),
        ("1,99999999999,allocate,0x100,1,0", "bad time"),
        ("1,4294967295:00:00.0,allocate,0x100,1,0", "bad time"),
        ("1,nan,allocate,0x100,1,0", "bad time"),
        ("1,00:00:00.0,allocate,0xZZ,1,0", "bad pointer"),
        ("1,00:00:00.0,allocate,0x100,-1,0", "bad size"),
        ("1,00:00:00.0,allocate,0x100,1,stream", "bad stream"),
    ] {
        let text = format!("{LOG_HEADER}\n2,00:00:00.0,free,0x100,1,0\n{bad}\n");
        let err = parse_log(&text).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, Error::InvalidArgument(_)) && msg.contains("log line 3") && msg.contains(why),
            "{msg}"
        );
    }
}

#[test]
fn a_failing_sink_undoes_an_allocation_and_records_a_free() {
    let (_sim, b) = sim(64 << 20);
    let stats = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let path = temp_log("failing-sink");
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = fail.clone();
    let sink = LogSink::Callback(Arc::new(move |_: &str| {
        if f.load(Ordering::SeqCst) {
            Err(Error::Callback("sink raised".into()))
        } else {
            Ok(())
        }
    }));
    let logging: ResourceRef =
        Arc::new(LoggingAdaptor::new(stats.clone(), vec![LogSink::File(path.clone()), sink]).unwrap());
    // Counting adaptors above the logging one: their counts must follow what was freed.
    let limited = Arc::new(LimitingAdaptor::new(logging, 1 << 20).unwrap());
    let mr = TrackingAdaptor::new(limited.clone(), None).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(4096, &s).unwrap();
    fail.store(true, Ordering::SeqCst);
    assert_eq!(mr.allocate(1000, &s).unwrap_err(), Error::Callback("sink raised".into()));
    assert_eq!(stats.statistics().current_bytes, 4096, "the failed allocation was freed again");
    assert_eq!(limited.allocated_bytes(), 4096);
    let before = streampool::drop_errors().count;
    mr.deallocate(p, 4096, &s).unwrap(); // freed: the sink's failure is recorded, not returned
    assert_eq!(stats.statistics().current_bytes, 0, "the free happened");
    assert_eq!((limited.allocated_bytes(), mr.allocated_bytes()), (0, 0), "and is counted above");
    let errors = streampool::drop_errors();
    assert!(errors.count > before);
    assert!(
        errors.recent.iter().any(|m| m.contains("which was freed: ") && m.contains("sink raised")),
        "{errors:?}"
    );
    assert!(matches!(mr.deallocate(p, 4096, &s), Err(Error::InvalidPointer(_))), "no double free");
    fail.store(false, Ordering::SeqCst);
    let q = mr.allocate(1000, &s).unwrap();
    mr.deallocate(q, 1000, &s).unwrap();
    // The file's log stays balanced: every allocate has its free.
    let events = parse_log(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let actions: Vec<LogAction> = events.iter().map(|e| e.action).collect();
    use LogAction::{Allocate, Free};
    assert_eq!(actions, vec![Allocate, Allocate, Free, Free, Allocate, Free]);
    // A sink failing on the header, and two files, are refused at construction.
    let err = LoggingAdaptor::new(
        stats.clone(),
        vec![LogSink::Callback(Arc::new(|_| Err(Error::Callback("no".into()))))],
    );
    assert!(err.is_err());
    let two = LoggingAdaptor::new(stats, vec![LogSink::File(path.clone()), LogSink::File(path.clone())]);
    assert!(matches!(two, Err(Error::InvalidArgument(_))));
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_log_to_a_file_that_cannot_be_synchronised_flushes() {
    // fsync answers EINVAL for /dev/null (and pipes, terminals): nothing to make durable.
    let (_sim, b) = sim(64 << 20);
    let mr = LoggingAdaptor::new(async_mr(&b), vec![LogSink::File("/dev/null".into())]).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(1000, &s).unwrap();
    mr.deallocate(p, 1000, &s).unwrap();
    mr.flush().unwrap();
}

#[test]
fn an_unwritable_log_file_is_a_clear_error() {
    let (_sim, b) = sim(64 << 20);
    let path = std::env::temp_dir().join("streampool-no-such-dir").join("x").join("log.csv");
    let err = LoggingAdaptor::new(async_mr(&b), vec![LogSink::File(path.clone())]).unwrap_err();
    assert!(err.to_string().contains("streampool-no-such-dir"), "{err}");
    // The operating system's error, as data: a binding raises its own (Python: FileNotFoundError).
    match err {
        Error::Io { path: p, errno, what, .. } => {
            assert_eq!((p, errno), (path, Some(2)));
            assert!(what.contains("cannot create the log file"), "{what}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_out_of_memory_behind_a_chunk_names_the_chunk_and_the_limit() {
    let (_sim, b) = sim(256 << 20);
    let limited: ResourceRef = Arc::new(LimitingAdaptor::new(async_mr(&b), 100 << 20).unwrap());
    let fixed = FixedSizeMemoryResource::new(limited.clone(), 1 << 20, 200).unwrap();
    let err = fixed.allocate(1000, &Stream::legacy()).unwrap_err();
    let Error::OutOfMemory { requested: 1000, available: Some(available), resource } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*available, 100 << 20, "measured against the chunk's request, which it names");
    assert!(
        resource.contains("limit 104857600 bytes") && resource.contains("asked for 209715200 bytes"),
        "{err}"
    );
    // Still usable with chunks that fit.
    let small = FixedSizeMemoryResource::new(limited, 1 << 20, 10).unwrap();
    let p = small.allocate(1000, &Stream::legacy()).unwrap();
    small.deallocate(p, 1000, &Stream::legacy()).unwrap();
}

#[test]
fn pinned_host_memory_does_not_report_the_devices_free_memory() {
    // The device's free memory says nothing of what limited a host allocation; the
    // simulated device does not count pinned memory, so the host refuses a huge request.
    let (_sim, b) = sim(64 << 20);
    let pinned = streampool::PinnedHostMemoryResource::on(b, 0).unwrap();
    let err = pinned.allocate(1 << 62, &Stream::legacy()).unwrap_err();
    assert!(matches!(&err, Error::OutOfMemory { available: None, .. }), "{err:?}");
    assert!(err.to_string().contains("host's pinned memory"), "{err}");
    assert!(!err.to_string().contains("capacity"), "pinned memory is not the device's: {err}");
    let p = pinned.allocate(4096, &Stream::legacy()).unwrap();
    pinned.deallocate(p, 4096, &Stream::legacy()).unwrap();
}

#[test]
fn tracking_names_threads_with_the_label_it_is_given() {
    let (_sim, b) = sim(64 << 20);
    let plain = TrackingAdaptor::new(async_mr(&b), None).unwrap();
    let labelled =
        TrackingAdaptor::new(async_mr(&b), None).unwrap().with_thread_label(Arc::new(|| "worker 7".into()));
    let s = Stream::legacy();
    let (p, q) = (plain.allocate(256, &s).unwrap(), labelled.allocate(256, &s).unwrap());
    assert!(plain.outstanding()[0].thread.contains("ThreadId("), "{:?}", plain.outstanding());
    assert_eq!(labelled.outstanding()[0].thread, "worker 7");
    assert!(labelled.outstanding_report().contains("thread worker 7"));
    plain.deallocate(p, 256, &s).unwrap();
    labelled.deallocate(q, 256, &s).unwrap();
}

// ---------------------------------------------------------------------------------------
// Prefetch

#[test]
fn prefetch_only_managed_memory_on_the_allocating_stream() {
    let (sim, b) = sim(256 << 20);
    let s = Stream::create(&b, 0, false).unwrap();
    // What the adaptor enqueues on the stream beyond what its upstream does.
    let extra = |upstream: ResourceRef| {
        let queued_by = |mr: &dyn MemoryResource| {
            let p = mr.allocate(1 << 20, &s).unwrap();
            let n = sim.queued(s.handle()).unwrap();
            let prefetched = b.mem_range_last_prefetch_location(0, p, 1 << 20).ok().flatten();
            mr.deallocate(p, 1 << 20, &s).unwrap();
            sim.run();
            (n, prefetched)
        };
        let (base, _) = queued_by(&*upstream);
        let (with, prefetched) = queued_by(&PrefetchAdaptor::new(upstream).unwrap());
        (with - base, prefetched)
    };
    let managed = extra(Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap()));
    assert_eq!(
        managed,
        (1, Some(Location::Device(0))),
        "one prefetch to the device, on the allocating stream"
    );
    assert_eq!(extra(async_mr(&b)), (0, None), "nothing for device memory");
    assert_eq!(extra(Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap())), (0, None));
    assert_no_races(&sim);
}

// ---------------------------------------------------------------------------------------
// Binning and fixed-size blocks

#[test]
fn binning_routes_sizes_to_the_smallest_bin_that_fits() {
    let (sim, b) = sim(256 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = BinningMemoryResource::new(upstream.clone(), None, None).unwrap();
    let bins: Vec<Arc<StatisticsAdaptor>> =
        (0..3).map(|_| Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap())).collect();
    for (size, bin) in [(4096, &bins[1]), (256, &bins[0]), (65536, &bins[2])] {
        mr.add_bin(size, Some(bin.clone())).unwrap();
    }
    assert_eq!(mr.bins().iter().map(|b| b.0).collect::<Vec<_>>(), vec![256, 4096, 65536]);
    // A size beyond any allocation (it would round to 0) is refused, the bins unchanged.
    for huge in [usize::MAX, isize::MAX as usize + 1, isize::MAX as usize] {
        let err = mr.add_bin(huge, None).unwrap_err();
        assert!(err.to_string().contains("larger than any allocation"), "{err}");
    }
    assert_eq!(mr.bins().len(), 3);
    let s = Stream::legacy();
    let mut live = vec![];
    for (bytes, want) in [(1, 0), (256, 0), (257, 1), (4096, 1), (4097, 2), (65536, 2), (65537, 3)] {
        let counts = |i: usize| {
            if i == 3 {
                upstream.statistics().total_count
            } else {
                bins[i].statistics().total_count
            }
        };
        let before = counts(want);
        live.push((mr.allocate(bytes, &s).unwrap(), bytes));
        assert_eq!(counts(want), before + 1, "{bytes} bytes should go to route {want}");
    }
    for (p, n) in live {
        mr.deallocate(p, n, &s).unwrap();
    }
    assert!(bins.iter().all(|b| b.statistics().current_count == 0));
    assert_eq!(upstream.statistics().current_count, 0);
    assert_no_races(&sim);
}

#[test]
fn binning_bad_input_is_refused_and_changes_nothing() {
    let (_sim, b) = sim(256 << 20);
    let bad = |r: Result<BinningMemoryResource>, why: &str| {
        let err = r.unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument(m) if m.contains(why)), "{err}");
    };
    bad(
        BinningMemoryResource::new(async_mr(&b), Some(10), Some(8)),
        "min_size_exponent (10) must be <= max_size_exponent (8)",
    );
    bad(
        BinningMemoryResource::new(async_mr(&b), Some(8), Some(41)),
        "max_size_exponent must be in 0..=40 (bins of 1 byte to 1 TiB) or None, got 41",
    );
    bad(BinningMemoryResource::new(async_mr(&b), Some(64), Some(70)), "min_size_exponent must be in 0..=40");
    bad(BinningMemoryResource::new(async_mr(&b), Some(8), None), "both");
    let mr = BinningMemoryResource::new(async_mr(&b), Some(8), Some(12)).unwrap();
    let sizes = |mr: &BinningMemoryResource| mr.bins().iter().map(|b| b.0).collect::<Vec<_>>();
    let before = sizes(&mr);
    let add_err = |size, r| mr.add_bin(size, r).unwrap_err().to_string();
    // As RMM: a size that has a bin already (after rounding up to 256) changes nothing.
    mr.add_bin(1024, None).unwrap();
    mr.add_bin(1000, None).unwrap();
    assert!(add_err(0, None).contains("0 bytes"));
    let (_other_sim, other) = sim(1 << 20);
    assert!(add_err(300, Some(async_mr(&other))).contains("simulated device"));
    assert_eq!(sizes(&mr), before);
    // A bin that would take sizes from a route with allocations outstanding.
    let s = Stream::legacy();
    let p = mr.allocate(600, &s).unwrap(); // the 1024-byte bin
    assert!(add_err(700, None).contains("1 allocation(s) outstanding"));
    let big = mr.allocate(1 << 20, &s).unwrap(); // the upstream
    assert!(add_err(1 << 21, None).contains("the upstream"));
    assert_eq!(sizes(&mr), before);
    mr.deallocate(p, 600, &s).unwrap();
    mr.add_bin(700, None).unwrap();
    mr.deallocate(big, 1 << 20, &s).unwrap();
    mr.add_bin(1 << 21, None).unwrap();
    // A resource for a size that has a bin replaces the bin's resource, but not while
    // that bin has allocations outstanding.
    let r = mr.allocate(3000, &s).unwrap(); // the 4096-byte bin
    let replacement: ResourceRef = async_mr(&b);
    assert!(add_err(4096, Some(replacement.clone())).contains("replace bins before allocating"));
    mr.deallocate(r, 3000, &s).unwrap();
    mr.add_bin(4000, Some(replacement.clone())).unwrap(); // rounded up to 4096
    let bin = mr.bins().into_iter().find(|(size, _)| *size == 4096).unwrap().1;
    assert!(Arc::ptr_eq(&bin, &replacement));
    // Still usable, and a free of a foreign pointer is refused by its bin.
    let q = mr.allocate(650, &s).unwrap();
    assert!(matches!(mr.deallocate(0xdead_0000, 650, &s), Err(Error::InvalidPointer(_))));
    mr.deallocate(q, 650, &s).unwrap();
}

#[test]
fn fixed_size_takes_another_streams_blocks_after_waiting_on_its_event() {
    let (sim, b) = sim(256 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = FixedSizeMemoryResource::new(upstream.clone(), 4096, 4).unwrap();
    let ss = streams(&b, 2);
    let (a, bb) = (&ss[0], &ss[1]);
    let p = mr.allocate(4096, a).unwrap();
    sim.write_labeled(a.handle(), p, 4096, "producer on A").unwrap();
    mr.deallocate(p, 4096, a).unwrap();
    assert_eq!(mr.allocate(100, a).unwrap(), p, "A reuses its own block at once");
    sim.write(a.handle(), p, 100).unwrap();
    mr.deallocate(p, 100, a).unwrap();
    // B has no blocks: it takes A's list (p among them), ordered after A's frees by a
    // wait on A's event, rather than growing a chunk of its own.
    let q = mr.allocate(4096, bb).unwrap();
    sim.write_labeled(bb.handle(), q, 4096, "consumer on B").unwrap();
    assert_eq!(upstream.statistics().current_count, 1, "one chunk: B did not grow");
    let rest: Vec<DevPtr> = (0..3).map(|_| mr.allocate(4096, bb).unwrap()).collect();
    assert!(rest.contains(&p) || q == p, "every block of A's chunk serves B");
    for &r in &rest {
        sim.write(bb.handle(), r, 4096).unwrap();
        mr.deallocate(r, 4096, bb).unwrap();
    }
    mr.deallocate(q, 4096, bb).unwrap();
    assert_no_races(&sim);
    // A hand-off loop (A allocates and writes, B waits for A, reads and frees) keeps one
    // chunk, not one per round.
    for _ in 0..1000 {
        let x = mr.allocate(4096, a).unwrap();
        sim.write(a.handle(), x, 4096).unwrap();
        bb.wait_for(&b, 0, a, 0).unwrap();
        sim.read(bb.handle(), x, 4096).unwrap();
        mr.deallocate(x, 4096, bb).unwrap();
    }
    assert_no_races(&sim);
    assert_eq!(upstream.statistics().current_count, 1, "the hand-off reuses the one chunk");
    // Bad input.
    // Above the block size: out of memory, as RMM's ("maximum allocation size exceeded").
    let too_large = mr.allocate(4097, a).unwrap_err();
    assert!(
        matches!(&too_large, Error::OutOfMemory { requested: 4097, available: Some(4096), .. }),
        "{too_large:?}"
    );
    assert!(too_large.to_string().contains("blocks of 4096 bytes are the most it serves"), "{too_large}");
    assert!(matches!(mr.deallocate(p, 4096, a), Err(Error::InvalidPointer(m)) if m.contains("double free")));
    assert!(matches!(mr.deallocate(p, 8192, a), Err(Error::InvalidPointer(_))));
    assert!(matches!(FixedSizeMemoryResource::new(async_mr(&b), 0, 4), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        FixedSizeMemoryResource::new(async_mr(&b), 256, usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
}

/// Threads on streams of their own, each writing every block it gets, then handing it to
/// the next thread's stream (which waits for the writer's) to be freed there: blocks move
/// between the streams through step 3, and the race detector finds no use of a block on
/// one stream that is not ordered after its use on another. The memory stays at what the
/// threads hold together, not a chunk per round.
#[test]
fn fixed_size_blocks_moving_between_threads_streams_are_ordered() {
    let (sim, b) = sim(64 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = Arc::new(FixedSizeMemoryResource::new(upstream.clone(), 4096, 4).unwrap());
    let ss = streams(&b, 4);
    std::thread::scope(|scope| {
        for t in 0..ss.len() {
            let (mr, sim, b, ss) = (mr.clone(), sim.clone(), b.clone(), &ss);
            scope.spawn(move || {
                let (mine, next) = (&ss[t], &ss[(t + 1) % ss.len()]);
                for round in 0..300 {
                    // 1 to 4 blocks at once, by thread and round.
                    let held: Vec<DevPtr> =
                        (0..1 + (t + round) % 4).map(|_| mr.allocate(4096, mine).unwrap()).collect();
                    for &p in &held {
                        sim.write_labeled(mine.handle(), p, 4096, &format!("thread {t} round {round}"))
                            .unwrap();
                    }
                    next.wait_for(&b, 0, mine, 0).unwrap();
                    for p in held {
                        mr.deallocate(p, 4096, next).unwrap();
                    }
                }
            });
        }
    });
    assert_no_races(&sim);
    let chunks = upstream.statistics().peak_count;
    assert!(chunks <= 12, "{chunks} chunks of 4 blocks for 4 threads holding at most 4 blocks each");
}

/// A stream per task, one after another: each takes the blocks the last one freed, and
/// the lists and events of streams that are gone leave with their blocks (an event kept
/// per stream ever used grew without end, the out-of-memory path that used to prune them
/// never being reached).
#[test]
fn fixed_size_keeps_no_list_or_event_per_stream_ever_used() {
    let (sim, b) = sim(64 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = FixedSizeMemoryResource::new(upstream.clone(), 4096, 4).unwrap();
    let before = sim.live_events();
    for _ in 0..2000 {
        let s = Stream::create(&b, 0, false).unwrap();
        let held: Vec<DevPtr> = (0..2).map(|_| mr.allocate(4096, &s).unwrap()).collect();
        for p in held {
            sim.write(s.handle(), p, 4096).unwrap();
            mr.deallocate(p, 4096, &s).unwrap();
        }
    }
    assert_no_races(&sim);
    assert_eq!(upstream.statistics().peak_count, 1, "one chunk serves every stream in turn");
    let events = sim.live_events() - before;
    assert!(events <= 4, "{events} events live after 2000 streams");
}

/// An upstream whose frees fail while `failing` is set (the driver torn down, say).
#[derive(Debug)]
struct FlakyFrees {
    upstream: ResourceRef,
    failing: std::sync::atomic::AtomicBool,
}

impl MemoryResource for FlakyFrees {
    fn backend(&self) -> &BackendRef {
        self.upstream.backend()
    }
    fn device(&self) -> i32 {
        self.upstream.device()
    }
    fn name(&self) -> &str {
        "FlakyFrees"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.upstream.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        if self.failing.swap(false, Ordering::SeqCst) {
            return Err(Error::invalid("the upstream's free failed"));
        }
        self.upstream.deallocate(ptr, bytes, stream)
    }
}

/// A chunk the upstream refuses to take back stays the resource's, and the others are
/// given back all the same (they were lost: taken off the resource's chunks, never freed).
#[test]
fn fixed_size_release_gives_back_every_chunk_it_can() {
    let (_sim, b) = sim(64 << 20);
    let counted = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let flaky = Arc::new(FlakyFrees { upstream: counted.clone(), failing: false.into() });
    let mr = FixedSizeMemoryResource::new(flaky.clone(), 4096, 1).unwrap();
    let s = Stream::legacy();
    let held: Vec<DevPtr> = (0..3).map(|_| mr.allocate(4096, &s).unwrap()).collect();
    for p in held {
        mr.deallocate(p, 4096, &s).unwrap();
    }
    flaky.failing.store(true, Ordering::SeqCst); // the first give-back fails
    assert!(mr.release_free_chunks().is_err());
    assert_eq!(counted.statistics().current_count, 1, "the two others went back");
    drop(mr);
    assert_eq!(counted.statistics().current_count, 0, "the kept one went back on drop");
}

/// A chunk the upstream refused to take back keeps its blocks: they serve the next
/// requests (a new chunk was grown, and the kept one could never be released again).
#[test]
fn fixed_size_a_chunk_kept_after_a_refused_free_keeps_its_blocks() {
    let (_sim, b) = sim(64 << 20);
    let counted = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let flaky = Arc::new(FlakyFrees { upstream: counted.clone(), failing: false.into() });
    let mr = FixedSizeMemoryResource::new(flaky.clone(), 4096, 4).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(4096, &s).unwrap();
    mr.deallocate(p, 4096, &s).unwrap();
    flaky.failing.store(true, Ordering::SeqCst);
    assert!(mr.release_free_chunks().is_err());
    let held: Vec<DevPtr> = (0..4).map(|_| mr.allocate(4096, &s).unwrap()).collect();
    assert_eq!(counted.statistics().total_count, 1, "the kept chunk's 4 blocks served them");
    for p in held {
        mr.deallocate(p, 4096, &s).unwrap();
    }
    assert_eq!(mr.release_free_chunks().unwrap(), 4 * 4096);
    assert_eq!(counted.statistics().current_count, 0);
}

/// When the upstream is out of memory, blocks freed on other streams are reused, but
/// only after a device synchronisation has ordered their earlier uses.
#[test]
fn fixed_size_reclaims_other_streams_blocks_when_out_of_memory() {
    let (sim, b) = sim(8 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = FixedSizeMemoryResource::new(upstream.clone(), 1 << 20, 4).unwrap();
    let ss = streams(&b, 2);
    let (a, bb) = (&ss[0], &ss[1]);
    let on_a: Vec<DevPtr> = (0..8).map(|_| mr.allocate(1 << 20, a).unwrap()).collect();
    for &p in &on_a {
        sim.write_labeled(a.handle(), p, 1 << 20, "A").unwrap();
        mr.deallocate(p, 1 << 20, a).unwrap();
    }
    // The device is full of A's blocks: B gets one of them, ordered by the synchronisation.
    let q = mr.allocate(1 << 20, bb).unwrap();
    assert!(on_a.contains(&q));
    sim.write_labeled(bb.handle(), q, 1 << 20, "B").unwrap();
    mr.deallocate(q, 1 << 20, bb).unwrap();
    assert_no_races(&sim);
    // Out of blocks and of memory: a clear error naming the resource.
    let held: Vec<DevPtr> = (0..8).map(|_| mr.allocate(1 << 20, bb).unwrap()).collect();
    let err = mr.allocate(1, bb).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { resource, .. } if resource.starts_with("FixedSizeMemoryResource")),
        "{err:?}"
    );
    for p in held {
        mr.deallocate(p, 1 << 20, bb).unwrap();
    }
    assert_eq!(upstream.statistics().current_count, 2, "two chunks");
    drop(mr);
    assert_eq!(upstream.statistics().current_count, 0, "chunks returned on drop");
}

// ---------------------------------------------------------------------------------------
// Every adaptor

#[test]
fn adaptors_forward_properties_and_have_rmm_names() {
    let (_sim, b) = sim(64 << 20);
    let managed: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let all: Vec<ResourceRef> = vec![
        Arc::new(StatisticsAdaptor::new(managed.clone()).unwrap()),
        Arc::new(TrackingAdaptor::new(managed.clone(), None).unwrap()),
        Arc::new(LoggingAdaptor::new(managed.clone(), vec![]).unwrap()),
        Arc::new(LimitingAdaptor::new(managed.clone(), 1).unwrap()),
        Arc::new(FailureCallbackAdaptor::new(managed.clone(), Arc::new(|_| Ok(false))).unwrap()),
        Arc::new(PrefetchAdaptor::new(managed.clone()).unwrap()),
        Arc::new(BinningMemoryResource::new(managed.clone(), None, None).unwrap()),
        Arc::new(FixedSizeMemoryResource::new(managed.clone(), 256, 1).unwrap()),
    ];
    let names: Vec<&str> = all.iter().map(|m| m.name()).collect();
    assert_eq!(
        names,
        [
            "StatisticsResourceAdaptor",
            "TrackingResourceAdaptor",
            "LoggingResourceAdaptor",
            "LimitingResourceAdaptor",
            "FailureCallbackResourceAdaptor",
            "PrefetchResourceAdaptor",
            "BinningMemoryResource",
            "FixedSizeMemoryResource"
        ]
    );
    for mr in &all {
        assert_eq!((mr.memory_kind(), mr.device(), mr.backend().id()), (MemoryKind::Managed, 0, b.id()));
        assert!(format!("{mr:?}").contains("ManagedMemoryResource"), "{mr:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Depth: every call recurses through a chain, so chains deeper than MAX_DEPTH are refused.

/// A leaf resource that remembers the lowest stack address its calls ran at.
#[derive(Debug)]
struct StackProbe {
    inner: ResourceRef,
    lowest: AtomicUsize,
}

impl StackProbe {
    fn new(b: &BackendRef) -> Arc<Self> {
        Arc::new(StackProbe { inner: async_mr(b), lowest: AtomicUsize::new(usize::MAX) })
    }

    fn mark(&self) {
        let here = 0u8;
        self.lowest.fetch_min(std::ptr::addr_of!(here) as usize, Ordering::Relaxed);
    }
}

impl MemoryResource for StackProbe {
    fn backend(&self) -> &BackendRef {
        self.inner.backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "StackProbe"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.mark();
        self.inner.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.mark();
        self.inner.deallocate(ptr, bytes, stream)
    }
}

/// Kinds of level that [`chain_of`] makes.
const KINDS: usize = 7;

/// `n` adaptors over `base`, cycling through every kind (the logging adaptor with a
/// callback sink, the tracking adaptor with stacks off: the call path, not the capture).
fn chain(base: ResourceRef, n: usize) -> Result<ResourceRef> {
    chain_of(0..KINDS, base, n)
}

/// `n` adaptors over `base`, cycling through `kinds`.
fn chain_of(kinds: std::ops::Range<usize>, base: ResourceRef, n: usize) -> Result<ResourceRef> {
    let mut mr = base;
    for kind in kinds.cycle().take(n) {
        mr = match kind {
            0 => Arc::new(StatisticsAdaptor::new(mr)?),
            1 => Arc::new(TrackingAdaptor::new(mr, None)?),
            2 => Arc::new(LoggingAdaptor::new(mr, vec![LogSink::Callback(Arc::new(|_| Ok(())))])?),
            3 => Arc::new(LimitingAdaptor::new(mr, usize::MAX)?),
            4 => Arc::new(FailureCallbackAdaptor::new(mr, Arc::new(|_| Ok(false)))?),
            5 => Arc::new(PrefetchAdaptor::new(mr)?),
            _ => Arc::new(BinningMemoryResource::new(mr, None, None)?),
        };
    }
    Ok(mr)
}

/// Runs `f` on a thread with a Rust thread's default stack (2 MiB).
fn on_2mib_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new().stack_size(2 << 20).spawn(f).unwrap().join().unwrap()
}

/// The stack that an allocation, a free and an `Allocation`'s drop take at most through
/// the deepest chain allowed of each kind of level, all kinds mixed last; each on a fresh
/// 2 MiB thread, which also drops the chain from the top.
#[test]
fn the_deepest_chain_allowed_allocates_frees_and_drops_on_a_2mib_stack() {
    let (_sim, b) = sim(64 << 20);
    for kinds in (0..KINDS).map(|k| k..k + 1).chain(std::iter::once(0..KINDS)) {
        let probe = StackProbe::new(&b);
        let top = chain_of(kinds.clone(), probe.clone(), streampool::MAX_DEPTH - 1).unwrap();
        assert_eq!(top.depth(), streampool::MAX_DEPTH);
        let used = on_2mib_thread(move || {
            let here = 0u8;
            let start = std::ptr::addr_of!(here) as usize;
            let s = Stream::legacy();
            let p = top.allocate(1000, &s).unwrap();
            top.deallocate(p, 1000, &s).unwrap();
            let guard = streampool::Allocation::new(top.clone(), 4096, s).unwrap();
            drop(guard);
            drop(top); // the whole chain, from the top, on this thread
            start - probe.lowest.load(Ordering::Relaxed)
        });
        let per_level = used / streampool::MAX_DEPTH;
        println!(
            "kinds {kinds:?}: {used} bytes of stack for {} levels, {per_level} per level",
            streampool::MAX_DEPTH
        );
        // What MAX_DEPTH's comment promises: at most a quarter of the stack.
        assert!(used < 512 << 10, "kinds {kinds:?}: {used} bytes of stack for the deepest chain");
    }
}

#[test]
fn a_chain_deeper_than_the_limit_is_refused_and_the_chain_below_still_works() {
    let (sim, b) = sim(64 << 20);
    let top = chain(async_mr(&b), streampool::MAX_DEPTH - 1).unwrap();
    let makers: Vec<Box<dyn Fn(ResourceRef) -> Result<ResourceRef>>> = vec![
        Box::new(|u| Ok(Arc::new(StatisticsAdaptor::new(u)?))),
        Box::new(|u| Ok(Arc::new(TrackingAdaptor::new(u, None)?))),
        Box::new(|u| Ok(Arc::new(LoggingAdaptor::new(u, vec![])?))),
        Box::new(|u| Ok(Arc::new(LimitingAdaptor::new(u, 1 << 20)?))),
        Box::new(|u| Ok(Arc::new(FailureCallbackAdaptor::new(u, Arc::new(|_| Ok(false)))?))),
        Box::new(|u| Ok(Arc::new(PrefetchAdaptor::new(u)?))),
        Box::new(|u| Ok(Arc::new(BinningMemoryResource::new(u, None, None)?))),
        Box::new(|u| Ok(Arc::new(FixedSizeMemoryResource::new(u, 256, 1)?))),
    ];
    for make in &makers {
        let err = make(top.clone()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let limit = streampool::MAX_DEPTH;
        assert!(
            msg.contains(&format!("{} resources deep", limit + 1))
                && msg.contains(&format!("limit of {limit}")),
            "{msg}"
        );
    }
    let s = Stream::legacy();
    let p = top.allocate(4096, &s).unwrap();
    top.deallocate(p, 4096, &s).unwrap();
    assert_no_races(&sim);
}

#[test]
fn a_bin_may_not_deepen_a_binning_resource_once_wrapped_nor_call_back_into_it() {
    let (_sim, b) = sim(64 << 20);
    let binning = Arc::new(BinningMemoryResource::new(async_mr(&b), None, None).unwrap());
    // Before anything is built over it, a deep bin deepens it.
    binning.add_bin(1024, Some(chain(async_mr(&b), 3).unwrap())).unwrap();
    assert_eq!(binning.depth(), 5);
    let stats: ResourceRef = Arc::new(StatisticsAdaptor::new(binning.clone()).unwrap());
    // Now a bin as deep is fine, a deeper one is refused, and so is one over `binning`.
    binning.add_bin(2048, Some(chain(async_mr(&b), 3).unwrap())).unwrap();
    let err = binning.add_bin(4096, Some(chain(async_mr(&b), 4).unwrap())).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("add bins before wrapping it"),
        "{err}"
    );
    let err = binning.add_bin(8192, Some(stats.clone())).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(binning.bins().iter().map(|(size, _)| *size).collect::<Vec<_>>(), [1024, 2048]);
    let s = Stream::legacy();
    for bytes in [1000, 2000, 8000] {
        let p = stats.allocate(bytes, &s).unwrap();
        stats.deallocate(p, bytes, &s).unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// Wrong sizes: refused where the resource can tell, and nothing changes.

#[test]
fn binning_refuses_a_free_with_another_size_in_both_directions() {
    let (sim, b) = sim(64 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = BinningMemoryResource::new(upstream.clone(), Some(8), Some(12)).unwrap(); // 256 B .. 4 KiB
    let s = Stream::legacy();
    let small = mr.allocate(300, &s).unwrap(); // a block of the 512-byte bin's chunk
    let big = mr.allocate(1 << 20, &s).unwrap(); // the upstream
    let before = upstream.statistics();
    for (ptr, wrong, right) in
        [(small, 1 << 20, 300), (big, 300, 1 << 20), (small, 1000, 300), (small, 200, 300)]
    {
        let err = mr.deallocate(ptr, wrong, &s).unwrap_err();
        assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
        assert!(
            err.to_string().contains(&format!("allocated with {right} bytes but freed with {wrong}")),
            "{err}"
        );
    }
    let err = mr.deallocate(small + 256, 300, &s).unwrap_err();
    assert!(err.to_string().contains("not an outstanding allocation"), "{err}");
    assert_eq!(upstream.statistics(), before, "nothing reached the upstream");
    // Still usable, and nothing handed out overlaps what is live.
    let mut live = vec![(small, 300), (big, 1 << 20)];
    for bytes in [300, 300, 500, 1 << 20, 4096] {
        let p = mr.allocate(bytes, &s).unwrap();
        assert!(live.iter().all(|&(q, n)| p + bytes as u64 <= q || q + n as u64 <= p), "{p:#x} overlaps");
        live.push((p, bytes));
    }
    for (p, bytes) in live {
        mr.deallocate(p, bytes, &s).unwrap();
    }
    let err = mr.deallocate(small, 300, &s).unwrap_err();
    assert!(err.to_string().contains("double free"), "{err}");
    assert_no_races(&sim);
}

#[test]
fn limiting_counts_each_allocation_rounded_up_to_256_bytes_as_rmm() {
    let (_sim, b) = sim(64 << 20);
    let mr = LimitingAdaptor::new(async_mr(&b), 1000).unwrap();
    let s = Stream::legacy();
    let ps: Vec<_> = (0..3).map(|_| mr.allocate(10, &s).unwrap()).collect();
    assert_eq!(mr.allocated_bytes(), 768);
    let err = mr.allocate(10, &s).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { available: Some(232), .. }), "{err}");
    for p in ps {
        mr.deallocate(p, 10, &s).unwrap();
    }
    assert_eq!(mr.allocated_bytes(), 0);
    // A size too large to round is refused, not wrapped.
    assert!(mr.allocate(usize::MAX - 3, &s).unwrap_err().is_out_of_memory());
    assert_eq!(mr.allocated_bytes(), 0);
}

#[test]
fn limiting_refuses_a_free_of_more_than_is_in_use_and_never_wraps() {
    let (_sim, b) = sim(64 << 20);
    let upstream = Arc::new(TrackingAdaptor::new(async_mr(&b), None).unwrap());
    let mr = LimitingAdaptor::new(upstream.clone(), 1 << 20).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(1000, &s).unwrap();
    let err = mr.deallocate(p, 4000, &s).unwrap_err();
    assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
    // 1000 bytes count as 1024 (rounded up to 256, as RMM's adaptor counts them).
    assert!(err.to_string().contains("4000 bytes, but only 1024 bytes are allocated"), "{err}");
    assert_eq!((mr.allocated_bytes(), upstream.outstanding().len()), (1024, 1), "nothing changed");
    mr.deallocate(p, 1000, &s).unwrap();
    assert_eq!(mr.allocated_bytes(), 0);
    assert!(mr.deallocate(p, 1000, &s).is_err(), "a free with nothing in use");
    assert_eq!(mr.allocated_bytes(), 0);
    // The whole limit is still there.
    let q = mr.allocate(1 << 20, &s).unwrap();
    mr.deallocate(q, 1 << 20, &s).unwrap();
}

#[test]
fn statistics_refuse_a_free_of_more_than_is_in_use() {
    let (_sim, b) = sim(64 << 20);
    let upstream = Arc::new(TrackingAdaptor::new(async_mr(&b), None).unwrap());
    let mr = StatisticsAdaptor::new(upstream.clone()).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(1000, &s).unwrap();
    mr.push_counters(); // a scope that frees what was allocated before it: allowed
    let before = mr.statistics();
    let err = mr.deallocate(p, 4000, &s).unwrap_err();
    assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
    assert!(err.to_string().contains("1000 bytes in 1 allocation(s) are in use"), "{err}");
    assert_eq!((mr.statistics(), upstream.outstanding().len()), (before, 1), "nothing changed");
    mr.deallocate(p, 1000, &s).unwrap();
    let err = mr.deallocate(p, 1000, &s).unwrap_err();
    assert!(err.to_string().contains("0 bytes in 0 allocation(s)"), "{err}");
    let popped = mr.pop_counters().unwrap();
    assert_eq!(
        (popped.total_count, mr.statistics().current_bytes, mr.statistics().total_bytes),
        (0, 0, 1000)
    );
}

// ---------------------------------------------------------------------------------------
// The fast path (try_allocate / try_deallocate) is forwarded where that is correct.

/// A resource over the simulated device's async pool whose fast path always settles the
/// call (counted), as a pool's does on a hit.
#[derive(Debug)]
struct FastUpstream {
    inner: ResourceRef,
    kind: MemoryKind,
    fast: AtomicUsize,
    slow: AtomicUsize,
}

impl FastUpstream {
    fn new(inner: ResourceRef) -> Arc<Self> {
        let kind = inner.memory_kind();
        Arc::new(FastUpstream { inner, kind, fast: AtomicUsize::new(0), slow: AtomicUsize::new(0) })
    }

    fn counts(&self) -> (usize, usize) {
        (self.fast.load(Ordering::Relaxed), self.slow.load(Ordering::Relaxed))
    }
}

impl MemoryResource for FastUpstream {
    fn backend(&self) -> &BackendRef {
        self.inner.backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "FastUpstream"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.kind
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.slow.fetch_add(1, Ordering::Relaxed);
        self.inner.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.slow.fetch_add(1, Ordering::Relaxed);
        self.inner.deallocate(ptr, bytes, stream)
    }
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        self.fast.fetch_add(1, Ordering::Relaxed);
        Some(self.inner.allocate(bytes, stream))
    }
    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        self.fast.fetch_add(1, Ordering::Relaxed);
        Some(self.inner.deallocate(ptr, bytes, stream))
    }
}

#[test]
fn adaptors_forward_the_fast_path_where_it_is_correct() {
    let (_sim, b) = sim(64 << 20);
    let s = Stream::legacy();
    type Make = fn(ResourceRef) -> ResourceRef;
    // (name, adaptor, the upstream's (fast, slow) calls for an allocation and its free)
    let cases: [(&str, Make, (usize, usize)); 8] = [
        ("statistics", |u| Arc::new(StatisticsAdaptor::new(u).unwrap()), (2, 0)),
        ("tracking", |u| Arc::new(TrackingAdaptor::new(u, None).unwrap()), (2, 0)),
        // The stack capture is the full path's; the free captures nothing.
        ("tracking with stacks", |u| Arc::new(TrackingAdaptor::with_backtraces(u).unwrap()), (1, 1)),
        ("limiting", |u| Arc::new(LimitingAdaptor::new(u, 1 << 20).unwrap()), (2, 0)),
        (
            "failure callback",
            |u| Arc::new(FailureCallbackAdaptor::new(u, Arc::new(|_| Ok(false))).unwrap()),
            (2, 0),
        ),
        ("prefetch", |u| Arc::new(PrefetchAdaptor::new(u).unwrap()), (2, 0)),
        ("binning", |u| Arc::new(BinningMemoryResource::new(u, None, None).unwrap()), (2, 0)),
        ("logging", |u| Arc::new(LoggingAdaptor::new(u, vec![]).unwrap()), (0, 2)),
    ];
    for (name, make, expected) in cases {
        let upstream = FastUpstream::new(async_mr(&b));
        let mr = make(upstream.clone());
        let p = match mr.try_allocate(4096, &s) {
            Some(result) => result.unwrap(),
            None => mr.allocate(4096, &s).unwrap(),
        };
        match mr.try_deallocate(p, 4096, &s) {
            Some(result) => result.unwrap(),
            None => mr.deallocate(p, 4096, &s).unwrap(),
        }
        assert_eq!(upstream.counts(), expected, "{name}: (fast, slow) calls of the upstream");
        assert_eq!(mr.try_allocate(0, &s).map(Result::unwrap).unwrap_or(0), 0, "{name}");
    }
    // Over managed memory the prefetch is a driver call: the full path.
    let upstream = FastUpstream::new(Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap()));
    assert!(PrefetchAdaptor::new(upstream).unwrap().try_allocate(4096, &s).is_none());
}

#[test]
fn the_fast_path_keeps_the_adaptors_books() {
    let (_sim, b) = sim(64 << 20);
    let s = Stream::legacy();
    let upstream: ResourceRef = FastUpstream::new(async_mr(&b));
    let stats = StatisticsAdaptor::new(upstream.clone()).unwrap();
    let p = stats.try_allocate(1000, &s).unwrap().unwrap();
    assert_eq!(stats.statistics().current_bytes, 1000);
    assert!(matches!(stats.try_deallocate(p, 5000, &s), Some(Err(Error::InvalidPointer(_)))));
    stats.try_deallocate(p, 1000, &s).unwrap().unwrap();
    assert_eq!((stats.statistics().current_bytes, stats.statistics().total_bytes), (0, 1000));

    let limiting = LimitingAdaptor::new(upstream.clone(), 4096).unwrap();
    let p = limiting.try_allocate(4096, &s).unwrap().unwrap();
    assert!(matches!(limiting.try_allocate(1, &s), Some(Err(Error::OutOfMemory { .. }))));
    assert!(matches!(limiting.try_deallocate(p, 8192, &s), Some(Err(Error::InvalidPointer(_)))));
    limiting.try_deallocate(p, 4096, &s).unwrap().unwrap();
    assert_eq!(limiting.allocated_bytes(), 0);

    let tracking = TrackingAdaptor::new(upstream.clone(), None).unwrap();
    let p = tracking.try_allocate(1000, &s).unwrap().unwrap();
    assert_eq!(tracking.outstanding().len(), 1);
    assert!(matches!(tracking.try_deallocate(p, 999, &s), Some(Err(Error::InvalidPointer(_)))));
    tracking.try_deallocate(p, 1000, &s).unwrap().unwrap();
    assert!(matches!(tracking.try_deallocate(p, 1000, &s), Some(Err(Error::InvalidPointer(_)))));
    assert_eq!(tracking.allocated_bytes(), 0);

    let binning = BinningMemoryResource::new(upstream, None, None).unwrap();
    let p = binning.try_allocate(1000, &s).unwrap().unwrap();
    assert!(matches!(binning.try_deallocate(p, 2000, &s), Some(Err(Error::InvalidPointer(_)))));
    binning.try_deallocate(p, 1000, &s).unwrap().unwrap();
}

#[test]
fn statistics_over_the_sharded_pool_take_its_fast_path() {
    let (_sim, b) = sim(64 << 20);
    let pool: ResourceRef =
        Arc::new(streampool::ShardedPoolMemoryResource::new(async_mr(&b), Default::default()).unwrap());
    let stats = StatisticsAdaptor::new(pool).unwrap();
    let s = Stream::create(&b, 0, false).unwrap();
    let p = stats.allocate(4096, &s).unwrap(); // grows the pool: the full path
    stats.deallocate(p, 4096, &s).unwrap();
    for _ in 0..10 {
        let p = stats.try_allocate(4096, &s).expect("a block freed on this stream").unwrap();
        stats.try_deallocate(p, 4096, &s).expect("into this stream's own shard").unwrap();
    }
    let counted = stats.statistics();
    assert_eq!((counted.total_count, counted.current_count), (11, 0));
}

// ---------------------------------------------------------------------------------------
// Failures in Drop are recorded.

/// A resource whose frees fail.
#[derive(Debug)]
struct FailingFree {
    inner: ResourceRef,
}

impl MemoryResource for FailingFree {
    fn backend(&self) -> &BackendRef {
        self.inner.backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "FailingFree"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.inner.allocate(bytes, stream)
    }
    fn do_deallocate(&self, _ptr: DevPtr, _bytes: usize, _stream: &Stream) -> Result<()> {
        Err(Error::Callback("a free that fails on purpose".into()))
    }
}

#[test]
fn a_failure_in_drop_is_recorded() {
    let (_sim, b) = sim(64 << 20);
    let mr: ResourceRef = Arc::new(FailingFree { inner: async_mr(&b) });
    let before = streampool::drop_errors().count;
    let guard = streampool::Allocation::new(mr.clone(), 4096, Stream::legacy()).unwrap();
    let ptr = guard.ptr();
    drop(guard);
    let after = streampool::drop_errors();
    assert!(after.count > before, "{after:?}");
    let expected = format!("dropping an Allocation of 4096 bytes at {ptr:#x} from FailingFree");
    let found = after.recent.iter().find(|m| m.starts_with(&expected)).expect("the message is kept");
    assert!(found.contains("a free that fails on purpose"), "{found}");
    // A fixed-size resource gives its chunks back in its Drop.
    let before = streampool::drop_errors().count;
    let fixed = FixedSizeMemoryResource::new(mr, 256, 4).unwrap();
    let p = fixed.allocate(256, &Stream::legacy()).unwrap();
    fixed.deallocate(p, 256, &Stream::legacy()).unwrap();
    drop(fixed);
    assert!(streampool::drop_errors().count > before);
    assert!(streampool::drop_errors()
        .recent
        .iter()
        .any(|m| m.starts_with("dropping a FixedSizeMemoryResource")));
}

#[test]
fn drop_errors_keep_the_last_16_messages() {
    let _one = RECENT_DROP_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    for i in 0..20 {
        streampool::record_drop_error(&format!("test message {i}"), &Error::invalid("x"));
    }
    let recent = streampool::drop_errors().recent;
    assert_eq!(recent.len(), 16);
    // Other tests may record meanwhile; this one's last message is among the last few.
    assert!(recent.iter().any(|m| m.starts_with("test message 19")), "{recent:?}");
    assert!(!recent.iter().any(|m| m.starts_with("test message 0:")), "{recent:?}");
}

/// A stream per task: each new stream takes a chunk of its own from a bin, and nothing else
/// reuses it. Once the device is full, a request of another bin (or for the upstream) gets
/// the bins' wholly free chunks given back rather than an out-of-memory with nothing live.
#[test]
fn binning_gives_free_chunks_back_when_the_upstream_runs_out() {
    let (sim, b) = sim(64 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = BinningMemoryResource::new(upstream.clone(), Some(10), Some(20)).unwrap();
    // 40 streams, each holding a 1 MiB block at once, then freeing it: the 1 MiB bin's
    // chunks are wholly free.
    let ss = streams(&b, 40);
    let live: Vec<DevPtr> = ss.iter().map(|s| mr.allocate(1 << 20, s).unwrap()).collect();
    for (s, &p) in ss.iter().zip(&live) {
        sim.write(s.handle(), p, 1 << 20).unwrap();
        mr.deallocate(p, 1 << 20, s).unwrap();
    }
    let held = upstream.statistics().current_bytes;
    assert!(held >= 32 << 20, "the 1 MiB bin holds the 40 blocks' chunks: {held}");
    // The 1 KiB bin's first chunk, then a request larger than every bin.
    let s = Stream::legacy();
    let small = mr.allocate(1000, &s).unwrap();
    let large = mr.allocate(48 << 20, &s).unwrap();
    assert!(upstream.statistics().current_bytes < held + (48 << 20), "chunks went back");
    mr.deallocate(large, 48 << 20, &s).unwrap();
    mr.deallocate(small, 1000, &s).unwrap();
    assert_no_races(&sim);
}

#[test]
fn fixed_size_releases_its_wholly_free_chunks_and_keeps_the_rest() {
    let (sim, b) = sim(64 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)).unwrap());
    let mr = FixedSizeMemoryResource::new(upstream.clone(), 4096, 4).unwrap();
    let ss = streams(&b, 3);
    let blocks: Vec<Vec<DevPtr>> =
        ss.iter().map(|s| (0..4).map(|_| mr.allocate(4096, s).unwrap()).collect()).collect();
    assert_eq!(upstream.statistics().current_bytes, 3 * 4 * 4096, "a chunk per stream");
    // Streams 0 and 1 free everything; stream 2 keeps one block.
    for (s, mine) in ss.iter().zip(&blocks) {
        for &p in mine.iter().take(if s.handle() == ss[2].handle() { 3 } else { 4 }) {
            sim.write(s.handle(), p, 4096).unwrap();
            mr.deallocate(p, 4096, s).unwrap();
        }
    }
    assert_eq!(mr.release_free_chunks().unwrap(), 2 * 4 * 4096);
    assert_eq!(upstream.statistics().current_bytes, 4 * 4096);
    // The kept chunk's free blocks serve any stream now; the outstanding one is untouched.
    let other = Stream::create(&b, 0, false).unwrap();
    let again: Vec<DevPtr> = (0..3).map(|_| mr.allocate(4096, &other).unwrap()).collect();
    assert_eq!(upstream.statistics().current_bytes, 4 * 4096, "no growth");
    assert!(again.iter().all(|p| blocks[2][..3].contains(p)));
    assert!(mr.deallocate(blocks[2][3], 4096, &ss[2]).is_ok());
    assert!(mr.deallocate(blocks[2][3], 4096, &ss[2]).is_err(), "still checked: a double free");
    for p in again {
        mr.deallocate(p, 4096, &other).unwrap();
    }
    assert_eq!(mr.release_free_chunks().unwrap(), 4 * 4096);
    assert_eq!(upstream.statistics().current_bytes, 0);
    assert_no_races(&sim);
}

/// Held by the tests that read [`streampool::drop_errors`]'s recent messages after
/// recording several, and by the one that records 20: those would push theirs out.
static RECENT_DROP_ERRORS: Mutex<()> = Mutex::new(());

/// Whether one of the recent drop errors contains `text`.
fn drop_error_said(text: &str) -> bool {
    streampool::drop_errors().recent.iter().any(|m| m.contains(text))
}

#[test]
fn dropping_a_resource_with_blocks_outstanding_is_recorded() {
    let _one = RECENT_DROP_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    // Their chunks go back upstream with the resource: what was never freed now dangles.
    let (_sim, b) = sim(64 << 20);
    let s = Stream::create(&b, 0, false).unwrap();
    let fixed = FixedSizeMemoryResource::new(async_mr(&b), 4864, 8).unwrap();
    fixed.allocate(4000, &s).unwrap();
    let freed = fixed.allocate(4000, &s).unwrap();
    fixed.deallocate(freed, 4000, &s).unwrap();
    drop(fixed);
    let said = "dropping a FixedSizeMemoryResource: invalid pointer: 1 block of 4864 bytes was still allocated from it";
    assert!(drop_error_said(said), "{:#?}", streampool::drop_errors());
    let binning = BinningMemoryResource::new(async_mr(&b), None, None).unwrap();
    binning.add_bin(7936, None).unwrap();
    for _ in 0..2 {
        binning.allocate(7000, &s).unwrap();
    }
    drop(binning);
    assert!(
        drop_error_said("2 blocks of 7936 bytes were still allocated"),
        "{:#?}",
        streampool::drop_errors()
    );
    let pool = streampool::ShardedPoolMemoryResource::new(async_mr(&b), Default::default()).unwrap();
    pool.allocate(1 << 20, &s).unwrap();
    drop(pool);
    let said = "dropping a ShardedPoolMemoryResource: invalid pointer: 1048576 bytes were still allocated";
    assert!(drop_error_said(said), "{:#?}", streampool::drop_errors());
}
