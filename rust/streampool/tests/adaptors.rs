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
        let mr = StatisticsAdaptor::new(async_mr(&b));
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
    let mr = StatisticsAdaptor::new(async_mr(&b));
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
    let mr = Arc::new(StatisticsAdaptor::new(async_mr(&b)));
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
        let mr = TrackingAdaptor::new(async_mr(&b), None);
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
    let mr = TrackingAdaptor::new(async_mr(&b), Some(capture));
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
    assert!(mr.outstanding_report().starts_with("0 outstanding allocations, 0 bytes"));
}

#[test]
fn tracking_with_backtraces_records_a_rust_stack() {
    let (_sim, b) = sim(1 << 30);
    let mr = TrackingAdaptor::with_backtraces(async_mr(&b));
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
                    if held.len() > 3 || (x & 1 == 0 && !held.is_empty()) {
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
            && text.contains("786432 bytes (524288 bytes available)"),
        "{text}"
    );
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
    );
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
    );
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
    );
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
    let retry = Arc::new(FailureCallbackAdaptor::new(
        limited.clone(),
        Arc::new(move |_| {
            let Some(p) = v.lock().unwrap().pop() else { return Ok(false) };
            t.get().unwrap().deallocate(p, 512 << 10, &Stream::legacy())?;
            Ok(true)
        }),
    ));
    let stats = Arc::new(StatisticsAdaptor::new(retry));
    let tracking = Arc::new(TrackingAdaptor::new(stats.clone(), None));
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
fn a_failing_sink_frees_the_allocation_and_returns_its_error() {
    let (_sim, b) = sim(64 << 20);
    let stats = Arc::new(StatisticsAdaptor::new(async_mr(&b)));
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
    let mr = LoggingAdaptor::new(stats.clone(), vec![LogSink::File(path.clone()), sink]).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(4096, &s).unwrap();
    fail.store(true, Ordering::SeqCst);
    assert_eq!(mr.allocate(1000, &s).unwrap_err(), Error::Callback("sink raised".into()));
    assert_eq!(stats.statistics().current_bytes, 4096, "the failed allocation was freed again");
    assert_eq!(mr.deallocate(p, 4096, &s).unwrap_err(), Error::Callback("sink raised".into()));
    assert_eq!(stats.statistics().current_bytes, 0, "the free happened");
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
    let pinned = streampool::PinnedHostMemoryResource::on(b, 0);
    let err = pinned.allocate(1 << 62, &Stream::legacy()).unwrap_err();
    assert!(matches!(&err, Error::OutOfMemory { available: None, .. }), "{err:?}");
    assert!(err.to_string().contains("host"), "{err}");
    let p = pinned.allocate(4096, &Stream::legacy()).unwrap();
    pinned.deallocate(p, 4096, &Stream::legacy()).unwrap();
}

#[test]
fn tracking_names_threads_with_the_label_it_is_given() {
    let (_sim, b) = sim(64 << 20);
    let plain = TrackingAdaptor::new(async_mr(&b), None);
    let labelled = TrackingAdaptor::new(async_mr(&b), None).with_thread_label(Arc::new(|| "worker 7".into()));
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
        let (with, prefetched) = queued_by(&PrefetchAdaptor::new(upstream));
        (with - base, prefetched)
    };
    let managed = extra(Arc::new(ManagedMemoryResource::on(b.clone(), 0)));
    assert_eq!(
        managed,
        (1, Some(Location::Device(0))),
        "one prefetch to the device, on the allocating stream"
    );
    assert_eq!(extra(async_mr(&b)), (0, None), "nothing for device memory");
    assert_eq!(extra(Arc::new(CudaMemoryResource::on(b.clone(), 0))), (0, None));
    assert_no_races(&sim);
}

// ---------------------------------------------------------------------------------------
// Binning and fixed-size blocks

#[test]
fn binning_routes_sizes_to_the_smallest_bin_that_fits() {
    let (sim, b) = sim(256 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)));
    let mr = BinningMemoryResource::new(upstream.clone(), None, None).unwrap();
    let bins: Vec<Arc<StatisticsAdaptor>> =
        (0..3).map(|_| Arc::new(StatisticsAdaptor::new(async_mr(&b)))).collect();
    for (size, bin) in [(4096, &bins[1]), (256, &bins[0]), (65536, &bins[2])] {
        mr.add_bin(size, Some(bin.clone())).unwrap();
    }
    assert_eq!(mr.bins().iter().map(|b| b.0).collect::<Vec<_>>(), vec![256, 4096, 65536]);
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
    assert!(add_err(1024, None).contains("overlapping bins"));
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
    // Still usable, and a free of a foreign pointer is refused by its bin.
    let q = mr.allocate(650, &s).unwrap();
    assert!(matches!(mr.deallocate(0xdead_0000, 650, &s), Err(Error::InvalidPointer(_))));
    mr.deallocate(q, 650, &s).unwrap();
}

#[test]
fn fixed_size_reuses_on_the_freeing_stream_only() {
    let (sim, b) = sim(256 << 20);
    let mr = FixedSizeMemoryResource::new(async_mr(&b), 4096, 4).unwrap();
    let ss = streams(&b, 2);
    let (a, bb) = (&ss[0], &ss[1]);
    let p = mr.allocate(4096, a).unwrap();
    sim.write_labeled(a.handle(), p, 4096, "producer on A").unwrap();
    mr.deallocate(p, 4096, a).unwrap();
    let q = mr.allocate(4096, bb).unwrap();
    assert_ne!(p, q, "B does not get A's block while A's write may be pending");
    sim.write_labeled(bb.handle(), q, 4096, "consumer on B").unwrap();
    assert_eq!(mr.allocate(100, a).unwrap(), p, "A reuses its own block");
    sim.write(a.handle(), p, 100).unwrap();
    mr.deallocate(p, 100, a).unwrap();
    mr.deallocate(q, 4096, bb).unwrap();
    assert_no_races(&sim);
    // Bad input.
    assert!(matches!(mr.allocate(4097, a), Err(Error::InvalidArgument(_))));
    assert!(matches!(mr.deallocate(p, 4096, a), Err(Error::InvalidPointer(m)) if m.contains("double free")));
    assert!(matches!(mr.deallocate(p, 8192, a), Err(Error::InvalidPointer(_))));
    assert!(matches!(FixedSizeMemoryResource::new(async_mr(&b), 0, 4), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        FixedSizeMemoryResource::new(async_mr(&b), 256, usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
}

/// When the upstream is out of memory, blocks freed on other streams are reused, but
/// only after a device synchronisation has ordered their earlier uses.
#[test]
fn fixed_size_reclaims_other_streams_blocks_when_out_of_memory() {
    let (sim, b) = sim(8 << 20);
    let upstream = Arc::new(StatisticsAdaptor::new(async_mr(&b)));
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
    let managed: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0));
    let all: Vec<ResourceRef> = vec![
        Arc::new(StatisticsAdaptor::new(managed.clone())),
        Arc::new(TrackingAdaptor::new(managed.clone(), None)),
        Arc::new(LoggingAdaptor::new(managed.clone(), vec![]).unwrap()),
        Arc::new(LimitingAdaptor::new(managed.clone(), 1).unwrap()),
        Arc::new(FailureCallbackAdaptor::new(managed.clone(), Arc::new(|_| Ok(false)))),
        Arc::new(PrefetchAdaptor::new(managed.clone())),
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
