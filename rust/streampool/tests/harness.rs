//! The replayer and the pipeline on the simulated device.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{assert_no_races, sim};
use proptest::prelude::*;
use streampool::device::{BackendRef, DevPtr, RawStream};
use streampool::harness::pipeline::{pipeline, pipeline_until, LongCalls, PipelineOptions};
use streampool::harness::replay::{
    encode, parse, replay, replay_until, Op, Record, ReplayOptions, ReplayReport,
};
use streampool::harness::NullMemoryResource;
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, Error, LimitingAdaptor, MemoryKind, MemoryResource, PoolOptions,
    ShardedPoolMemoryResource, Stream,
};

/// Records every call it passes on: (stream handle, allocate?, size); with `spin`, every
/// n-th allocation spins on the CPU for a while first; with `nap`, every
/// n-th allocation sleeps that long first.
#[derive(Debug)]
struct Recorder {
    upstream: ResourceRef,
    calls: Mutex<Vec<(RawStream, bool, usize)>>,
    nap: Option<(usize, Duration)>,
    spin: Option<(usize, Duration)>,
    /// Panics at this allocation (counted from 1).
    panic_at: Option<usize>,
}

impl Recorder {
    fn new(upstream: ResourceRef) -> Self {
        Recorder { upstream, calls: Mutex::new(Vec::new()), nap: None, spin: None, panic_at: None }
    }
}

impl MemoryResource for Recorder {
    fn backend(&self) -> &BackendRef {
        self.upstream.backend()
    }
    fn device(&self) -> i32 {
        self.upstream.device()
    }
    fn name(&self) -> &str {
        "Recorder"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }
    fn footprint(&self) -> Option<streampool::Footprint> {
        self.upstream.footprint()
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> streampool::Result<DevPtr> {
        let n = {
            let mut calls = self.calls.lock().unwrap();
            calls.push((stream.handle(), true, bytes));
            calls.iter().filter(|c| c.1).count()
        };
        assert_ne!(self.panic_at, Some(n), "Recorder: a panic, as asked");
        if let Some((every, nap)) = self.nap {
            if n % every == 0 {
                std::thread::sleep(nap);
            }
        }
        if let Some((every, spin)) = self.spin {
            // Most of the time in this program's own loop, little in reading the clock.
            let start = std::time::Instant::now();
            while n % every == 0 && start.elapsed() < spin {
                for _ in 0..1000 {
                    std::hint::spin_loop();
                }
            }
        }
        self.upstream.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> streampool::Result<()> {
        self.calls.lock().unwrap().push((stream.handle(), false, bytes));
        self.upstream.deallocate(ptr, bytes, stream)
    }
}

fn rec(t_ns: u64, op: Op, size: u64, alloc_id: u64, thread: u32, stream: u32) -> Record {
    Record { t_ns, size, alloc_id, thread, stream, op }
}

/// A log of 3 threads on streams 10, 20, 30 (one each), 200 allocations of distinct sizes,
/// a third of them freed by the next thread on its stream.
fn log() -> Vec<Record> {
    let mut out = Vec::new();
    let mut t = 0;
    let mut pending: Vec<(u64, u64, u32)> = Vec::new(); // (id, size, thread to free it)
    for i in 0..200u64 {
        let thread = (i % 3) as u32;
        let size = 256 * (i + 1) + 8 * i;
        t += 1000;
        out.push(rec(t, Op::Allocate, size, 0x1000 + i, thread, 10 * (thread + 1)));
        let freer = if i % 3 == 0 { (thread + 1) % 3 } else { thread };
        pending.push((0x1000 + i, size, freer));
        if pending.len() > 5 {
            let (id, size, freer) = pending.remove(0);
            t += 500;
            out.push(rec(t, Op::Free, size, id, freer, 10 * (freer + 1)));
        }
    }
    for (id, _size, freer) in pending {
        out.push(rec(t, Op::Free, 0, id, freer, 10 * (freer + 1)));
    }
    out
}

/// Per stream, the sequence of (allocate?, size): recorded streams keyed by label, replayed
/// ones by handle; both then listed by their first size, so they compare as sets of
/// sequences.
fn per_stream<K: Ord>(ops: impl Iterator<Item = (K, bool, usize)>) -> Vec<Vec<(bool, usize)>> {
    let mut by: BTreeMap<K, Vec<(bool, usize)>> = BTreeMap::new();
    for (k, a, s) in ops {
        by.entry(k).or_default().push((a, s));
    }
    let mut v: Vec<_> = by.into_values().collect();
    v.sort();
    v
}

#[test]
fn replay_keeps_the_recorded_sequence_of_operations_per_stream() {
    let (sim, b) = sim();
    let records = log();
    let sizes: BTreeMap<u64, u64> =
        records.iter().filter(|r| r.op == Op::Allocate).map(|r| (r.alloc_id, r.size)).collect();
    let expected =
        per_stream(records.iter().map(|r| (r.stream, r.op == Op::Allocate, sizes[&r.alloc_id] as usize)));
    let pool = sharded_pool(&b);
    for gap_scale in [0.0, 1.0] {
        let mr = Recorder::new(pool.clone());
        let report = replay(
            &mr,
            &parse(&encode(&records)).unwrap(),
            ReplayOptions { gap_scale, ..Default::default() },
        )
        .unwrap();
        let calls = mr.calls.into_inner().unwrap();
        assert_eq!(per_stream(calls.into_iter()), expected, "gap_scale {gap_scale}");
        assert_eq!((report.events, report.threads, report.streams), (400, 3, 3));
        assert_eq!((report.allocate.count, report.free.count, report.oom_events), (200, 200, 0));
        // The replay's own peak, as its threads ran (the log's gaps are 1 µs: no order in
        // time is kept): at least the largest allocation, at most all of them.
        let (largest, all) = (sizes.values().max().unwrap(), sizes.values().sum::<u64>());
        assert!((*largest..=all).contains(&report.peak_live_bytes), "{}", report.peak_live_bytes);
        assert!(report.peak_reserved_bytes.unwrap() >= report.peak_live_bytes as usize);
        assert!(report.allocate.p50 <= report.allocate.p99 && report.allocate.p99 <= report.allocate.max);
        assert!(report.synchronizations.is_some() && report.waits.is_some());
    }
    // The cross-stream frees were ordered by events: no race on reuse.
    assert_no_races(&sim);
}

#[test]
fn replay_refuses_bad_logs_naming_the_record() {
    let (_sim, b) = sim();
    let mr = NullMemoryResource::on(b, 0);
    let e = parse(&[0u8; 41]).unwrap_err();
    assert!(e.to_string().contains("41 bytes is not a multiple of 40"), "{e}");
    let mut bytes = encode(&[rec(0, Op::Allocate, 64, 1, 0, 0)]);
    bytes[32] = 7;
    let e = parse(&bytes).unwrap_err();
    assert!(e.to_string().contains("record 0: op 7"), "{e}");
    let cases = [
        (
            vec![rec(0, Op::Allocate, 64, 1, 0, 0), rec(1, Op::Free, 64, 2, 0, 0)],
            "record 1: free of allocation id 2",
        ),
        (
            vec![rec(0, Op::Allocate, 64, 1, 0, 0), rec(1, Op::Allocate, 64, 1, 0, 0)],
            "record 1: allocation id 1 is allocated again",
        ),
        (
            vec![
                rec(0, Op::Allocate, 64, 1, 0, 0),
                rec(1, Op::Free, 64, 1, 0, 0),
                rec(2, Op::Free, 64, 1, 0, 0),
            ],
            "record 2: free of allocation id 1, which is not live",
        ),
        (
            vec![rec(0, Op::Allocate, 64, 1, 0, 0), rec(1, Op::Free, 32, 1, 0, 0)],
            "record 1: free of allocation id 1 with size 32",
        ),
    ];
    for (records, words) in cases {
        let e = replay(&mr, &records, ReplayOptions::default()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(words), "{e}");
    }
    let e = replay(&mr, &[], ReplayOptions { gap_scale: -1.0, ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("gap_scale"), "{e}");
    // An id may come back once freed; an empty log replays to nothing.
    let again = [
        rec(0, Op::Allocate, 64, 1, 0, 0),
        rec(1, Op::Free, 0, 1, 0, 0),
        rec(2, Op::Allocate, 128, 1, 0, 0),
        rec(3, Op::Free, 128, 1, 0, 0),
    ];
    assert_eq!(replay(&mr, &again, ReplayOptions::default()).unwrap().events, 4);
    assert_eq!(replay(&mr, &[], ReplayOptions::default()).unwrap().events, 0);
}

#[test]
fn replay_skips_allocations_that_run_out_of_memory_and_their_frees() {
    let (_sim, b) = sim();
    let limited = LimitingAdaptor::new(
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap()),
        1 << 20,
    )
    .unwrap();
    let records = [
        rec(0, Op::Allocate, 768 << 10, 1, 0, 0),
        rec(1, Op::Allocate, 512 << 10, 2, 0, 0), // over the limit: skipped
        rec(2, Op::Free, 0, 2, 1, 1),             // its free (on another thread): skipped too
        rec(3, Op::Free, 0, 1, 1, 1),
        rec(4, Op::Allocate, 128 << 10, 3, 0, 0), // fits before or after that free; never freed
    ];
    let r = replay(&limited, &records, ReplayOptions { gap_scale: 0.0, ..Default::default() }).unwrap();
    assert_eq!((r.oom_events, r.allocate.count, r.free.count), (1, 2, 1));
    // The replay's own peak: record 4 on thread 0 may come before record 3's free on thread 1.
    assert!([768 << 10, 896 << 10].contains(&r.peak_live_bytes), "{}", r.peak_live_bytes);
    // Everything was given back, the never-freed allocation too.
    assert_eq!(limited.allocated_bytes(), 0);
}

#[test]
fn replay_measures_what_its_threads_had_live_at_once() {
    // Listed one thread after another, but timed: thread 0 holds 3 MiB from 0 to 100 ms,
    // thread 1 5 MiB from 10 to 110 ms. In recorded order 5 MiB is the most live; the
    // replay, keeping the times, has both live for 90 ms.
    let (_sim, b) = sim();
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    let ms = 1_000_000;
    let records = [
        rec(0, Op::Allocate, 3 << 20, 1, 0, 0),
        rec(100 * ms, Op::Free, 0, 1, 0, 0),
        rec(10 * ms, Op::Allocate, 5 << 20, 2, 1, 1),
        rec(110 * ms, Op::Free, 0, 2, 1, 1),
    ];
    let r = replay(&mr, &records, ReplayOptions { gap_scale: 1.0, ..Default::default() }).unwrap();
    assert_eq!(r.peak_live_bytes, 8 << 20);
    // A free on another thread waits for its allocation: both are live when it is called.
    let records = [
        rec(0, Op::Allocate, 3 << 20, 1, 0, 0),
        rec(0, Op::Allocate, 5 << 20, 2, 1, 1),
        rec(0, Op::Free, 0, 1, 1, 1),
        rec(0, Op::Free, 0, 2, 1, 1),
    ];
    assert_eq!(
        replay(&mr, &records, ReplayOptions { gap_scale: 0.0, ..Default::default() })
            .unwrap()
            .peak_live_bytes,
        8 << 20
    );
}

/// A producer thread allocates a chunk every 2 µs on its stream; a consumer thread frees
/// each 1 µs later on its own. The program never had two chunks live.
fn producer_consumer(chunks: u64) -> Vec<Record> {
    let mut out = Vec::new();
    for i in 0..chunks {
        out.push(rec(2_000 * i, Op::Allocate, 1 << 20, i, 0, 0));
        out.push(rec(2_000 * i + 1_000, Op::Free, 0, i, 1, 1));
    }
    out
}

/// Replays on another thread, failing (rather than hanging the suite) if it has not ended
/// within 20 s (a replay of these logs takes milliseconds, a few seconds on a loaded host).
fn replay_in_time(mr: ResourceRef, records: Vec<Record>, options: ReplayOptions) -> ReplayReport {
    let (tx, rx) = std::sync::mpsc::channel();
    let log = format!("{records:?}");
    std::thread::spawn(move || {
        let _ = tx.send(replay(&*mr, &records, options));
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(report) => report.unwrap(),
        Err(_) => panic!("the replay did not end within 20 s ({options:?}): {log}"),
    }
}

#[test]
fn no_replay_thread_runs_further_ahead_of_the_others_than_the_lead() {
    let (_sim, b) = sim();
    let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let flat = |lead| ReplayOptions { gap_scale: 0.0, max_lead_ns: lead };
    // In recorded order (no lead): the producer's next allocation waits for the free before
    // it, so one chunk is live at a time, as in the program.
    let peak = replay_in_time(mr.clone(), producer_consumer(300), flat(Some(0))).peak_live_bytes;
    assert_eq!(peak, 1 << 20);
    // 10 µs of lead: the producer is at most 10 µs (5 chunks) ahead, and one more in the call.
    let peak = replay_in_time(mr.clone(), producer_consumer(300), flat(Some(10_000))).peak_live_bytes;
    assert!((1 << 20..=7 << 20).contains(&peak), "{peak}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 8, ..ProptestConfig::default() })]

    /// Whatever the times (a thread's may go back, threads may be far apart) and whichever
    /// thread frees what, a replay with a lead ends: the thread with the earliest time can
    /// always go on, and a free waiting for another thread's allocation does not hold that
    /// thread back.
    #[test]
    fn a_replay_with_a_lead_always_ends(
        ops in proptest::collection::vec((0u32..4, 0u64..5_000, any::<bool>(), 0u32..4), 1..120),
        lead in prop_oneof![Just(0u64), Just(1_000u64), Just(1_000_000u64)],
    ) {
        // (thread, time, free the oldest live allocation?, the freeing thread); a freed
        // id is allocated again (as logs that use addresses as ids do).
        let (mut records, mut live, mut ids) = (Vec::new(), std::collections::VecDeque::new(), Vec::new());
        let mut next = 0u64;
        for (thread, t, free, freer) in ops {
            if free && !live.is_empty() {
                let id = live.pop_front().unwrap();
                records.push(rec(t, Op::Free, 0, id, freer, freer));
                ids.push(id);
            } else {
                let id = ids.pop().unwrap_or_else(|| {
                    next += 1;
                    next
                });
                records.push(rec(t, Op::Allocate, 256, id, thread, thread));
                live.push_back(id);
            }
        }
        let (_sim, b) = sim();
        let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
        let n = records.len() as u64;
        let events = replay_in_time(mr, records, ReplayOptions { gap_scale: 0.0, max_lead_ns: Some(lead) }).events;
        prop_assert_eq!(events, n);
    }
}

/// The sharded pool over the simulated device's pool, and the pipeline's options for
/// `pairs` pairs of `chunks` chunks of 64 KiB each.
fn pipeline_setup(
    b: &BackendRef,
    pairs: usize,
    chunks: usize,
) -> (ShardedPoolMemoryResource, PipelineOptions) {
    let pool = ShardedPoolMemoryResource::new(
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap()),
        PoolOptions::default(),
    )
    .unwrap();
    let o = PipelineOptions {
        pairs,
        chunk_bytes: 64 << 10,
        chunks_per_pair: chunks,
        kernel_us: 5.0,
        queue_depth: 3,
        check_every: 1,
        long_call_ns: 0,
        null_call_ns: 0,
    };
    (pool, o)
}

#[test]
fn a_stopped_pipeline_frees_what_it_sent_and_says_so() {
    let (_sim, b) = sim();
    let (pool, o) = pipeline_setup(&b, 2, 1_000_000);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let err = std::thread::scope(|scope| {
        let run = scope.spawn(|| pipeline_until(&pool, &o, &stop));
        std::thread::sleep(std::time::Duration::from_millis(100));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        run.join().unwrap().unwrap_err()
    });
    assert!(err.to_string().contains("stopped"), "{err}");
    assert_eq!(pool.stats().used_bytes, 0, "every chunk sent was freed");
}

#[test]
fn the_pipeline_moves_every_chunk_intact_across_streams() {
    let (sim, b) = sim();
    let (pool, o) = pipeline_setup(&b, 3, 40);
    let r = pipeline(&pool, &o).unwrap();
    assert_eq!((r.long_calls, r.null_calls), (None, None));
    assert_eq!((r.chunks, r.checked, r.mismatches), (120, 120, 0));
    assert_eq!((r.allocate.count, r.free.count), (120, 120));
    assert!(r.compute_iterations >= 1);
    assert!(r.peak_live_bytes >= 64 << 10 && r.peak_live_bytes <= 3 * 5 * (64 << 10), "{r:?}");
    assert!(r.peak_reserved_bytes.unwrap() >= r.peak_live_bytes as usize);
    assert!(r.alloc_share > 0.0 && r.alloc_share < 1.0 && r.longest_call_ns >= r.allocate.p50);
    assert_eq!(pool.stats().used_bytes, 0);
    assert_no_races(&sim);
    // Bad shapes are refused.
    for bad in [
        PipelineOptions { pairs: 0, ..o },
        PipelineOptions { chunk_bytes: 4, ..o },
        PipelineOptions { kernel_us: f64::NAN, ..o },
        PipelineOptions { null_call_ns: 1_000, ..o }, // without long_call_ns
        PipelineOptions { long_call_ns: 1_000, null_call_ns: 100_001, ..o },
    ] {
        assert!(matches!(pipeline(&pool, &bad), Err(Error::InvalidArgument(_))));
    }
}

#[test]
fn the_pipeline_tells_which_long_calls_slept_were_switched_out_or_ran_and_where() {
    let (_sim, b) = sim();
    let pool = sharded_pool(&b);
    // Every 10th allocation sleeps 30 ms: 6 of the 60. A sleep is a voluntary context
    // switch, so each of those calls is long, and slept or (switched out too) preempted;
    // the watchdog, looking every 0.1 ms, finds such a thread in its sleep.
    let mut napping = Recorder::new(pool.clone());
    napping.nap = Some((10, Duration::from_millis(30)));
    let o = PipelineOptions {
        pairs: 2,
        chunk_bytes: 64 << 10,
        chunks_per_pair: 30,
        kernel_us: 0.0,
        long_call_ns: 10_000_000,
        ..PipelineOptions::default()
    };
    let long = pipeline(&napping, &o).unwrap().long_calls.expect("asked for");
    assert_eq!(long.over_ns, 10_000_000);
    assert!(long.calls >= 6, "{long:?}");
    assert!(long.sampled.total() <= long.calls, "{long:?}");
    if cfg!(target_os = "linux") {
        assert!(long.preempted + long.slept >= 6 && long.on_cpu() <= long.calls - 6, "{long:?}");
        assert!(long.sampled.sleep >= 1, "{long:?}");
    }
    // Spinning instead (12 calls), the watchdog finds a running one in streampool's code
    // (this test's program holds both). Every running look is counted once in
    // `running_in`. (Whether the calls count as on the CPU or preempted depends on the
    // machine's load: on two cores, a 30 ms spin is most often switched out.)
    let mut spinning = Recorder::new(pool.clone());
    spinning.spin = Some((5, Duration::from_millis(30)));
    let long = pipeline(&spinning, &o).unwrap().long_calls.expect("asked for");
    assert!(long.calls >= 12, "{long:?}");
    assert_eq!(long.sampled.running_in.total(), long.sampled.running, "{long:?}");
    if cfg!(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))) {
        assert!(long.sampled.running_in.streampool >= 1, "{long:?}");
    }
    // Without naps, no call of this pipeline takes a second.
    let r = pipeline(&*pool, &PipelineOptions { long_call_ns: 1_000_000_000, ..o }).unwrap();
    assert_eq!(r.long_calls, Some(LongCalls { over_ns: 1_000_000_000, ..LongCalls::default() }));
    assert_eq!(r.null_calls, None); // not asked
                                    // Null calls: one after each of the 120 allocator calls, each spinning 20 µs, so each
                                    // is over a threshold of 10 µs, and classified once.
    let r = pipeline(&*pool, &PipelineOptions { long_call_ns: 10_000, null_call_ns: 20_000, ..o }).unwrap();
    let null = r.null_calls.expect("asked for");
    assert_eq!((null.over_ns, null.calls), (10_000, 120), "{null:?}");
    assert_eq!(null.sampled, Default::default(), "the watchdog looks at allocator calls only");
    assert!(null.preempted + null.slept + null.stolen <= null.calls, "{null:?}");
}

#[test]
fn the_latency_adaptor_counts_every_call_on_both_paths_and_forwards_the_footprint() {
    use streampool::adaptors::LatencyHistogramAdaptor;
    let (_sim, b) = sim();
    let pool = sharded_pool(&b);
    let mr = LatencyHistogramAdaptor::new(pool).unwrap();
    let s = Stream::legacy();
    let mut ptrs = Vec::new();
    for i in 0..100 {
        ptrs.push(mr.allocate(1024 * (i + 1), &s).unwrap());
    }
    for (i, p) in ptrs.iter().enumerate() {
        mr.deallocate(*p, 1024 * (i + 1), &s).unwrap();
    }
    // The pool's fast path, forwarded: timed too.
    for _ in 0..50 {
        let p = mr.try_allocate(1024, &s).expect("the pool settles a same-stream reuse").unwrap();
        mr.try_deallocate(p, 1024, &s).expect("and its free").unwrap();
    }
    // A refused free is a call too.
    assert!(mr.deallocate(0x1234_5600, 64, &s).is_err());
    let h = mr.histogram();
    assert_eq!((h.allocate.count, h.deallocate.count), (150, 151));
    assert_eq!(h.allocate.buckets.iter().map(|b| b.1).sum::<u64>(), 150);
    let a = &h.allocate;
    assert!(
        a.p50_ns <= a.p90_ns && a.p90_ns <= a.p99_ns && a.p99_ns <= a.p999_ns && a.p999_ns <= a.max_ns,
        "{a:?}"
    );
    assert!(a.total_ns >= a.max_ns && a.max_ns > 0.0);
    assert!(mr.footprint().unwrap().peak_reserved_bytes >= 100 * 1024);
    mr.reset();
    assert_eq!(mr.histogram(), Default::default());
}

/// The sharded pool over the driver's pool (with its defaults), on `b`.
fn sharded_pool(b: &BackendRef) -> ResourceRef {
    Arc::new(
        ShardedPoolMemoryResource::new(
            Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap()),
            PoolOptions::default(),
        )
        .unwrap(),
    )
}

fn gpu() -> Option<BackendRef> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    Some(streampool::device::cuda::CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"))
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn replay_and_pipeline_on_a_gpu() {
    let Some(b) = gpu() else { return };
    let driver: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let sharded: ResourceRef =
        Arc::new(ShardedPoolMemoryResource::new(driver.clone(), PoolOptions::default()).unwrap());
    let records = log();
    for mr in [driver, sharded] {
        let recorder = Recorder::new(mr.clone());
        let r = replay(&recorder, &records, ReplayOptions { gap_scale: 0.0, ..Default::default() }).unwrap();
        assert_eq!((r.events, r.oom_events, r.allocate.count, r.free.count), (400, 0, 200, 200));
        let sizes: BTreeMap<u64, u64> =
            records.iter().filter(|r| r.op == Op::Allocate).map(|r| (r.alloc_id, r.size)).collect();
        let expected =
            per_stream(records.iter().map(|r| (r.stream, r.op == Op::Allocate, sizes[&r.alloc_id] as usize)));
        assert_eq!(per_stream(recorder.calls.into_inner().unwrap().into_iter()), expected);
        let o = PipelineOptions {
            pairs: 4,
            chunk_bytes: 1 << 20,
            chunks_per_pair: 300,
            kernel_us: 20.0,
            queue_depth: 4,
            check_every: 1,
            long_call_ns: 0,
            null_call_ns: 0,
        };
        let p = pipeline(&*mr, &o).unwrap();
        assert_eq!((p.chunks, p.checked, p.mismatches), (1200, 1200, 0), "{} {p:?}", mr.name());
        assert!(p.compute_iterations >= 1);
        assert!(p.peak_reserved_bytes.unwrap() >= p.peak_live_bytes as usize);
    }
}

#[test]
fn replay_refuses_more_threads_than_it_runs() {
    use streampool::harness::replay::MAX_THREADS;
    let (_sim, b) = sim();
    let mr = NullMemoryResource::on(b, 0);
    let records: Vec<Record> =
        (0..=MAX_THREADS as u32).map(|t| rec(t as u64, Op::Allocate, 256, t as u64, t, 0)).collect();
    let e = replay(&mr, &records, ReplayOptions::default()).unwrap_err();
    assert!(e.to_string().contains(&format!("record {MAX_THREADS}: thread {MAX_THREADS}")), "{e}");
    assert_eq!(
        replay(&mr, &records[..MAX_THREADS], ReplayOptions { gap_scale: 0.0, ..Default::default() })
            .unwrap()
            .threads,
        MAX_THREADS
    );
}

#[test]
fn a_panicking_resource_stops_the_replay_and_nothing_waits_for_it() {
    let (_sim, b) = sim();
    let mut recorder = Recorder::new(Arc::new(NullMemoryResource::on(b.clone(), 0)));
    recorder.panic_at = Some(1);
    // Thread 1's allocation panics; thread 0 would wait for it to free it.
    let records = [rec(0, Op::Allocate, 256, 1, 1, 1), rec(1, Op::Free, 0, 1, 0, 0)];
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        replay(&recorder, &records, ReplayOptions { gap_scale: 0.0, ..Default::default() })
    }));
    let payload = result.expect_err("the panic is resumed");
    let text = payload.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("a panic, as asked"), "{text}");
}

#[test]
fn a_replay_stops_when_asked_and_frees_what_it_holds() {
    let (_sim, b) = sim();
    let limited = LimitingAdaptor::new(Arc::new(NullMemoryResource::on(b.clone(), 0)), 1 << 30).unwrap();
    // An hour between the allocation and its free.
    let records = [rec(0, Op::Allocate, 4096, 1, 0, 0), rec(3_600_000_000_000, Op::Free, 0, 1, 0, 0)];
    let stop = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        let replaying = s.spawn(|| {
            replay_until(&limited, &records, ReplayOptions { gap_scale: 1.0, ..Default::default() }, &stop)
        });
        while limited.allocated_bytes() == 0 {
            std::thread::yield_now();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        replaying.join().unwrap()
    });
    match result {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("stopped before its end"), "{m}"),
        other => panic!("expected the stop, got {other:?}"),
    }
    assert_eq!(limited.allocated_bytes(), 0);
    // A replay that would outlast the log format's times is refused before it starts.
    match replay(&limited, &records, ReplayOptions { gap_scale: 1e300, ..Default::default() }) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("the replay would take"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
