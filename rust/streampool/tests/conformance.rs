//! The conformance suite: every resource, on the simulated device, passes the same tests.
//! A new resource is one line in `conformance!` at the bottom.
//!
//! Each test makes its own simulated device and never activates it (activation is
//! process-wide and tests run in parallel), so resources are built with `on(backend, ..)`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::{MemoryKind, ResourceRef};
use streampool::{Allocation, Error, Stream, ALIGNMENT};

const CAPACITY: usize = 256 << 20;

/// A resource under test, with the simulated device it runs on.
struct Fixture {
    sim: Arc<SimDevice>,
    backend: BackendRef,
    mr: ResourceRef,
    /// Whether the resource's memory counts against the device capacity (pinned host
    /// memory does not).
    bounded: bool,
}

impl Fixture {
    fn new(make: fn(BackendRef) -> ResourceRef) -> Self {
        let sim = SimDevice::new(CAPACITY);
        let backend: BackendRef = sim.clone();
        let mr = make(backend.clone());
        let bounded = mr.memory_kind() != MemoryKind::PinnedHost;
        Fixture { sim, backend, mr, bounded }
    }

    fn stream(&self) -> Stream {
        Stream::create(&self.backend, 0, false).unwrap()
    }

    fn assert_no_races(&self) {
        self.sim.run();
        let races = self.sim.races();
        assert!(races.is_empty(), "{} races, first: {}", races.len(), races[0]);
    }
}

fn overlaps(live: &HashMap<DevPtr, usize>, ptr: DevPtr, bytes: usize) -> Option<(DevPtr, usize)> {
    live.iter().find(|(&p, &n)| ptr < p + n as u64 && p < ptr + bytes as u64).map(|(&p, &n)| (p, n))
}

fn zero_size(f: Fixture) {
    let s = f.stream();
    assert_eq!(f.mr.allocate(0, &s).unwrap(), 0);
    f.mr.deallocate(0, 0, &s).unwrap();
}

fn sizes_alignment_and_no_overlap(f: Fixture) {
    let s = f.stream();
    let mut live = HashMap::new();
    for bytes in [1usize, 7, 255, 256, 257, 4096, 4097, 65_536, 1 << 20, 3 << 20, 32 << 20] {
        let ptr = f.mr.allocate(bytes, &s).unwrap();
        assert_ne!(ptr, 0);
        assert_eq!(ptr as usize % ALIGNMENT, 0, "{bytes} bytes at {ptr:#x}");
        assert_eq!(overlaps(&live, ptr, bytes), None, "{bytes} bytes at {ptr:#x}");
        f.sim.write(s.handle(), ptr, bytes).unwrap();
        live.insert(ptr, bytes);
    }
    for (ptr, bytes) in live {
        f.mr.deallocate(ptr, bytes, &s).unwrap();
    }
    f.assert_no_races();
}

fn same_stream_reuse(f: Fixture) {
    let s = f.stream();
    for _ in 0..50 {
        let ptr = f.mr.allocate(1 << 16, &s).unwrap();
        f.sim.write(s.handle(), ptr, 1 << 16).unwrap();
        f.sim.read(s.handle(), ptr, 1 << 16).unwrap();
        f.mr.deallocate(ptr, 1 << 16, &s).unwrap();
    }
    f.assert_no_races();
}

/// Memory written on stream A and freed there (the write still pending) must not be
/// handed to stream B before B is ordered after the write.
fn cross_stream_reuse(f: Fixture) {
    let streams: Vec<Stream> = (0..4).map(|_| f.stream()).collect();
    for round in 0..40 {
        let s = &streams[round % streams.len()];
        let bytes = 4096 << (round % 5);
        let ptr = f.mr.allocate(bytes, s).unwrap();
        f.sim.write(s.handle(), ptr, bytes).unwrap();
        f.sim.read(s.handle(), ptr, bytes).unwrap();
        f.mr.deallocate(ptr, bytes, s).unwrap();
        if round % 7 == 0 {
            f.sim.step(streams[0].handle()).unwrap();
        }
    }
    f.assert_no_races();
}

fn legacy_and_per_thread_streams(f: Fixture) {
    for s in [Stream::legacy(), Stream::per_thread()] {
        let ptr = f.mr.allocate(1024, &s).unwrap();
        f.sim.write(s.handle(), ptr, 1024).unwrap();
        f.mr.deallocate(ptr, 1024, &s).unwrap();
    }
    f.assert_no_races();
}

fn frees_from_other_threads(f: Fixture) {
    let f = Arc::new(f);
    let s = f.stream();
    let ptrs: Vec<DevPtr> = (0..64).map(|_| f.mr.allocate(1000, &s).unwrap()).collect();
    let handed = Arc::new(Mutex::new(ptrs));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (f, handed, s) = (f.clone(), handed.clone(), s.clone());
            std::thread::spawn(move || loop {
                let Some(ptr) = handed.lock().unwrap().pop() else { break };
                f.mr.deallocate(ptr, 1000, &s).unwrap();
                let mine = f.mr.allocate(512, &s).unwrap();
                f.mr.deallocate(mine, 512, &s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    f.assert_no_races();
}

fn allocation_guard(f: Fixture) {
    let s = f.stream();
    let a = Allocation::new(f.mr.clone(), 4096, s.clone()).unwrap();
    f.sim.write(s.handle(), a.ptr(), 4096).unwrap();
    assert_eq!(a.bytes(), 4096);
    drop(a);
    let b = Allocation::new(f.mr.clone(), 0, s.clone()).unwrap();
    assert_eq!(b.ptr(), 0);
    b.free().unwrap();
    // Made on the per-thread stream, dropped on another thread: still ordered.
    let pt = Allocation::new(f.mr.clone(), 2048, Stream::per_thread()).unwrap();
    f.sim.write(2, pt.ptr(), 2048).unwrap();
    std::thread::spawn(move || drop(pt)).join().unwrap();
    let again = f.mr.allocate(2048, &s).unwrap();
    f.sim.write(s.handle(), again, 2048).unwrap();
    f.mr.deallocate(again, 2048, &s).unwrap();
    f.assert_no_races();
}

fn out_of_memory(f: Fixture) {
    if !f.bounded {
        return;
    }
    let s = f.stream();
    let err = f.mr.allocate(CAPACITY + 1, &s).unwrap_err();
    match &err {
        Error::OutOfMemory { requested, resource, .. } => {
            assert_eq!(*requested, CAPACITY + 1);
            // The resource's name, optionally followed by details ("(limit ..., ... in use)").
            assert!(resource.starts_with(f.mr.name()), "{resource:?} should name {}", f.mr.name());
        }
        e => panic!("expected OutOfMemory, got {e:?}"),
    }
    assert!(err.to_string().contains(&(CAPACITY + 1).to_string()), "{err}");
    let err = f.mr.allocate(usize::MAX, &s).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    // Still usable, and what was asked of it after the failure is not lost.
    let ptr = f.mr.allocate(CAPACITY / 2, &s).unwrap();
    f.mr.deallocate(ptr, CAPACITY / 2, &s).unwrap();
    f.assert_no_races();
}

fn bad_input(f: Fixture) {
    let s = f.stream();
    assert!(matches!(f.mr.deallocate(0, 16, &s), Err(Error::InvalidPointer(_))));
    let ptr = f.mr.allocate(256, &s).unwrap();
    assert!(matches!(f.mr.deallocate(ptr, 0, &s), Err(Error::InvalidPointer(_))));
    // A stream of another simulated device is refused, naming it.
    let other = SimDevice::new(1 << 20);
    let other_backend: BackendRef = other.clone();
    let foreign = Stream::create(&other_backend, 0, false).unwrap();
    let err = f.mr.allocate(256, &foreign).unwrap_err();
    assert!(matches!(err, Error::InvalidStream(_)), "{err:?}");
    assert!(f.mr.deallocate(ptr, 256, &foreign).is_err());
    // A destroyed stream's handle names no stream.
    let gone = f.stream();
    let handle = gone.handle();
    drop(gone);
    assert!(Stream::borrowed(&f.backend, handle).is_err());
    // Frees of memory it does not own are refused by every resource on the simulator.
    let bogus = 0xdead_0000_u64;
    assert!(f.mr.deallocate(bogus, 256, &s).is_err());
    // Still usable, and nothing was lost.
    f.mr.deallocate(ptr, 256, &s).unwrap();
    let ptr = f.mr.allocate(256, &s).unwrap();
    f.mr.deallocate(ptr, 256, &s).unwrap();
    f.assert_no_races();
}

fn random_ops(f: &Fixture, ops: &[(u8, usize, usize)]) {
    let streams: Vec<Stream> = (0..3).map(|_| f.stream()).collect();
    let mut live: HashMap<DevPtr, (usize, usize)> = HashMap::new();
    for &(op, a, b) in ops {
        match op % 4 {
            0 | 1 => {
                let bytes = 1 + a % (1 << 18);
                let si = b % streams.len();
                let ptr = f.mr.allocate(bytes, &streams[si]).unwrap();
                let sizes: HashMap<DevPtr, usize> = live.iter().map(|(&p, &(n, _))| (p, n)).collect();
                assert_eq!(overlaps(&sizes, ptr, bytes), None);
                f.sim.write(streams[si].handle(), ptr, bytes).unwrap();
                live.insert(ptr, (bytes, si));
            }
            2 => {
                if let Some(&ptr) = live.keys().nth(a % live.len().max(1)) {
                    let (bytes, si) = live.remove(&ptr).unwrap();
                    f.mr.deallocate(ptr, bytes, &streams[si]).unwrap();
                }
            }
            _ => {
                f.sim.step(streams[b % streams.len()].handle()).unwrap();
            }
        }
    }
    for (ptr, (bytes, si)) in live {
        f.mr.deallocate(ptr, bytes, &streams[si]).unwrap();
    }
    f.assert_no_races();
}

macro_rules! conformance {
    ($($name:ident => $make:expr;)*) => {$(
        mod $name {
            use super::*;
            fn fixture() -> Fixture { Fixture::new($make) }
            #[test] fn zero_size() { super::zero_size(fixture()) }
            #[test] fn sizes_alignment_and_no_overlap() { super::sizes_alignment_and_no_overlap(fixture()) }
            #[test] fn same_stream_reuse() { super::same_stream_reuse(fixture()) }
            #[test] fn cross_stream_reuse() { super::cross_stream_reuse(fixture()) }
            #[test] fn legacy_and_per_thread_streams() { super::legacy_and_per_thread_streams(fixture()) }
            #[test] fn frees_from_other_threads() { super::frees_from_other_threads(fixture()) }
            #[test] fn allocation_guard() { super::allocation_guard(fixture()) }
            #[test] fn out_of_memory() { super::out_of_memory(fixture()) }
            #[test] fn bad_input() { super::bad_input(fixture()) }
            proptest! {
                #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
                #[test]
                fn random_ops(ops in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 1..60)) {
                    super::random_ops(&fixture(), &ops)
                }
            }
        }
    )*};
}

conformance! {
    cuda_async_current_pool => |b| Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap());
    cuda_async_own_pool => |b| Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, streampool::AsyncPoolOptions {
        initial_pool_size: Some(8 << 20), release_threshold: None, enable_ipc: true, ..Default::default() }).unwrap());
    cuda_async_view => |b| {
        let pool = b.pool_create(0, &Default::default()).unwrap();
        Arc::new(streampool::CudaAsyncMemoryResource::view(b, Some(0), pool).unwrap())
    };
    cuda => |b| Arc::new(streampool::CudaMemoryResource::on(b, 0).unwrap());
    managed => |b| Arc::new(streampool::ManagedMemoryResource::on(b, 0).unwrap());
    cuda_async_managed => |b| Arc::new(streampool::CudaAsyncManagedMemoryResource::on(b, 0, Default::default()).unwrap());
    cuda_async_managed_own_pool => |b| Arc::new(streampool::CudaAsyncManagedMemoryResource::on(b, 0, streampool::AsyncPoolOptions {
        initial_pool_size: Some(8 << 20), ..Default::default() }).unwrap());
    pinned_host => |b| Arc::new(streampool::PinnedHostMemoryResource::on(b, 0).unwrap());
    sharded_pool_over_async => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap()), Default::default()).unwrap());
    sharded_pool_over_cuda => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaMemoryResource::on(b, 0).unwrap()), streampool::PoolOptions {
            initial_pool_size: Some(16 << 20), events_every: 4, ..Default::default() }).unwrap());
    sharded_pool_batched => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap()), streampool::PoolOptions {
            headroom: Some(2.0), event_batch: 8, ..Default::default() }).unwrap());
    sharded_pool_expandable => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap()), streampool::PoolOptions {
            expandable: true, ..Default::default() }).unwrap());
    sharded_pool_expandable_bounded => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaMemoryResource::on(b, 0).unwrap()), streampool::PoolOptions {
            expandable: true, initial_pool_size: Some(3 << 20), maximum_pool_size: Some(200 << 20),
            release_threshold: Some(8 << 20), ..Default::default() }).unwrap());
    sharded_pool_lean => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap()), streampool::PoolOptions {
            expandable: true, steal_whole_blocks: true, gather_interval: std::time::Duration::ZERO, events_every: 1,
            ..Default::default() }).unwrap());
    sharded_pool_one_heap => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap()), streampool::PoolOptions {
            one_heap: true, ..Default::default() }).unwrap());
    sharded_pool_one_heap_expandable => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::CudaMemoryResource::on(b, 0).unwrap()), streampool::PoolOptions {
            one_heap: true, expandable: true, maximum_pool_size: Some(200 << 20), ..Default::default() }).unwrap());
    sharded_pool_bounded => |b| Arc::new(streampool::ShardedPoolMemoryResource::new(
        Arc::new(streampool::ManagedMemoryResource::on(b, 0).unwrap()), streampool::PoolOptions {
            maximum_pool_size: Some(200 << 20), release_threshold: Some(8 << 20), ..Default::default() }).unwrap());
    statistics => |b| Arc::new(streampool::StatisticsAdaptor::new(async_mr(b)).unwrap());
    latency_histogram => |b| Arc::new(streampool::adaptors::LatencyHistogramAdaptor::new(async_mr(b)).unwrap());
    tracking => |b| Arc::new(streampool::TrackingAdaptor::new(async_mr(b), None).unwrap());
    tracking_with_backtraces => |b| Arc::new(streampool::TrackingAdaptor::with_backtraces(async_mr(b)).unwrap());
    logging => |b| logging_over(async_mr(b), Some(streampool::LogSink::Callback(Arc::new(|_| Ok(())))));
    limiting => |b| Arc::new(streampool::LimitingAdaptor::new(async_mr(b), 2 * CAPACITY).unwrap());
    failure_callback => |b| Arc::new(streampool::FailureCallbackAdaptor::new(async_mr(b), Arc::new(|_| Ok(false))).unwrap());
    prefetch => |b| Arc::new(streampool::PrefetchAdaptor::new(async_mr(b)).unwrap());
    prefetch_managed => |b| Arc::new(streampool::PrefetchAdaptor::new(Arc::new(streampool::ManagedMemoryResource::on(b, 0).unwrap())).unwrap());
    binning => |b| {
        let mr = streampool::BinningMemoryResource::new(async_mr(b.clone()), Some(8), Some(20)).unwrap();
        mr.add_bin(4 << 20, Some(Arc::new(streampool::CudaMemoryResource::on(b, 0).unwrap()))).unwrap();
        Arc::new(mr)
    };
    adaptor_stack => |b| {
        let stats = Arc::new(streampool::StatisticsAdaptor::new(async_mr(b)).unwrap());
        let limited = Arc::new(streampool::LimitingAdaptor::new(stats, 2 * CAPACITY).unwrap());
        let tracked = Arc::new(streampool::TrackingAdaptor::new(limited, None).unwrap());
        let retried = Arc::new(streampool::FailureCallbackAdaptor::new(tracked, Arc::new(|_| Ok(false))).unwrap());
        logging_over(retried, None)
    };
}

/// The driver's pool, under the adaptors.
fn async_mr(b: BackendRef) -> ResourceRef {
    Arc::new(streampool::CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap())
}

/// A logging adaptor writing to a fresh file in the temporary directory (tests run in
/// parallel), unlinked at once: the adaptor keeps writing to it, and nothing is left behind.
fn logging_over(upstream: ResourceRef, also: Option<streampool::LogSink>) -> ResourceRef {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("streampool-conformance-{}-{n}.csv", std::process::id()));
    let sinks = std::iter::once(streampool::LogSink::File(path.clone())).chain(also).collect();
    let mr = streampool::LoggingAdaptor::new(upstream, sinks).unwrap();
    std::fs::remove_file(path).unwrap();
    Arc::new(mr)
}
