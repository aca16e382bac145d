//! Streams that capture a CUDA graph, on the simulated device (which refuses what the
//! driver refuses during a capture, and invalidates it as the driver does): the driver's
//! pool, adaptors over it and the sharded pool over it allocate graph memory on a
//! capturing stream without harming the capture; every other resource refuses, saying
//! why, with the capture intact and the resource usable.

use std::sync::Arc;

mod common;
use common::{sim, stream};

use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::resource::ResourceRef;
use streampool::{
    BinningMemoryResource, CudaAsyncMemoryResource, CudaMemoryResource, Error, FixedSizeMemoryResource,
    MemoryResource, ShardedPoolMemoryResource, StatisticsAdaptor, Stream,
};

const MIB: usize = 1 << 20;

fn async_pool(b: &BackendRef) -> ResourceRef {
    Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap())
}

/// A capture begun on a new stream of device 0, and that stream as the entry points wrap
/// it (without asking its identity).
fn capturing(sim: &Arc<SimDevice>, b: &BackendRef) -> (Stream, Stream) {
    let s = stream(b);
    sim.begin_capture(0, s.handle()).unwrap();
    assert!(b.stream_capturing(0, s.handle()).unwrap());
    let c = Stream::capturing(b, 0, s.handle());
    assert!(c.is_capturing() && !s.is_capturing());
    (s, c)
}

#[test]
fn the_simulated_device_refuses_what_a_capture_forbids() {
    let (sim, b) = sim();
    let (s, _) = capturing(&sim, &b);
    // Asking the stream's identity invalidates the capture, as on a 13.0 driver.
    let e = b.stream_id(0, s.handle()).unwrap_err();
    assert!(matches!(e, Error::Driver { code: 900, .. }), "{e}");
    let e = sim.end_capture(0, s.handle()).unwrap_err();
    assert!(matches!(e, Error::Driver { code: 901, .. }), "{e}");
    assert!(!b.stream_capturing(0, s.handle()).unwrap());

    // Graph memory on the capturing stream is legal; a free there of memory allocated
    // before the capture is CUDA_ERROR_INVALID_VALUE, and the capture goes on.
    let pool = b.pool_default(0, false).unwrap();
    let before = b.pool_alloc_async(0, pool, MIB, s.handle()).unwrap();
    sim.begin_capture(0, s.handle()).unwrap();
    let inside = b.pool_alloc_async(0, pool, MIB, s.handle()).unwrap();
    b.free_async(0, inside, s.handle()).unwrap();
    let e = b.free_async(0, before, s.handle()).unwrap_err();
    assert!(matches!(e, Error::Driver { code: 1, .. }), "{e}");
    // A synchronous allocation anywhere on the device: unsafe during a (global) capture.
    assert!(matches!(b.mem_alloc(0, MIB), Err(Error::Driver { code: 900, .. })));
    assert!(sim.end_capture(0, s.handle()).is_err());
    b.free_async(0, before, s.handle()).unwrap();
}

#[test]
fn the_drivers_pool_and_adaptors_over_it_allocate_graph_memory_in_a_capture() {
    let (sim, b) = sim();
    let stats = Arc::new(StatisticsAdaptor::new(async_pool(&b)).unwrap());
    assert!(stats.serves_capture());
    let (s, c) = capturing(&sim, &b);
    let p = stats.allocate(MIB, &c).unwrap();
    let q = stats.allocate(3 * MIB, &c).unwrap();
    stats.deallocate(p, MIB, &c).unwrap();
    sim.end_capture(0, s.handle()).unwrap();
    // Graph memory freed after its capture, on an ordinary stream.
    stats.deallocate(q, 3 * MIB, &s).unwrap();
    assert_eq!(stats.statistics().current_bytes, 0);
}

#[test]
fn the_sharded_pool_passes_a_captures_allocations_to_its_upstream() {
    let (sim, b) = sim();
    let pool = Arc::new(ShardedPoolMemoryResource::new(async_pool(&b), Default::default()).unwrap());
    assert!(pool.serves_capture());
    let s = stream(&b);
    // The pool's own memory, allocated before the capture.
    let own = pool.allocate(MIB, &s).unwrap();
    let reserved = pool.stats().reserved_bytes;
    sim.begin_capture(0, s.handle()).unwrap();
    let c = Stream::capturing(&b, 0, s.handle());
    let p = pool.try_allocate(MIB, &c).unwrap_or_else(|| pool.allocate(MIB, &c)).unwrap();
    let q = pool.allocate(2 * MIB, &c).unwrap();
    assert!(p != own && q != own);
    // Not the pool's: nothing reserved or used for them.
    assert_eq!(pool.stats().reserved_bytes, reserved);
    assert_eq!(pool.stats().used_bytes, own_used(&pool));
    // Freed in the capture: a free node of the graph. A wrong size is refused first.
    assert!(matches!(pool.deallocate(p, 7, &c), Err(Error::InvalidPointer(_))));
    pool.deallocate(p, MIB, &c).unwrap();
    // The pool's own memory cannot be freed on the capturing stream: refused, capture
    // intact, the block still live.
    let e = pool.deallocate(own, MIB, &c).unwrap_err();
    assert!(e.to_string().contains("before the capture"), "{e}");
    sim.end_capture(0, s.handle()).unwrap();
    // After the capture: the graph memory through the fast path's refusal to the full
    // path, the pool's own as usual.
    assert!(pool.try_deallocate(q, 2 * MIB, &s).is_none());
    pool.deallocate(q, 2 * MIB, &s).unwrap();
    pool.deallocate(own, MIB, &s).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    // Freed twice: the pool no longer knows it.
    assert!(pool.deallocate(q, 2 * MIB, &s).is_err());
}

fn own_used(pool: &ShardedPoolMemoryResource) -> usize {
    // One 1 MiB allocation of the pool's own, as its size class counts it.
    let used = pool.stats().used_bytes;
    assert!(used >= MIB, "{used}");
    used
}

#[test]
fn resources_that_cannot_serve_a_capture_refuse_it_and_stay_usable() {
    let (sim, b) = sim();
    let upstream = async_pool(&b);
    let cases: Vec<ResourceRef> = vec![
        Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap()),
        Arc::new(FixedSizeMemoryResource::new(upstream.clone(), MIB, 4).unwrap()),
        Arc::new(BinningMemoryResource::new(upstream.clone(), Some(10), Some(20)).unwrap()),
        Arc::new(
            ShardedPoolMemoryResource::new(
                Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap()),
                Default::default(),
            )
            .unwrap(),
        ),
    ];
    for mr in cases {
        assert!(!mr.serves_capture(), "{}", mr.name());
        let (s, c) = capturing(&sim, &b);
        let e = mr.allocate(4096, &c).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidStream(m) if m.contains("capturing a CUDA graph") && m.contains(mr.name())),
            "{}: {e}",
            mr.name()
        );
        assert!(mr.try_allocate(4096, &c).is_none_or(|r| r.is_err()), "{}", mr.name());
        // The capture was not harmed, and the resource serves ordinary streams.
        sim.end_capture(0, s.handle()).unwrap();
        let p = mr.allocate(4096, &s).unwrap();
        mr.deallocate(p, 4096, &s).unwrap();
    }
}

#[test]
fn a_refused_free_of_graph_memory_keeps_it_freeable() {
    let sim = SimDevice::with_devices(256 << 20, 2);
    let b: BackendRef = sim.clone();
    let pool = ShardedPoolMemoryResource::new(async_pool(&b), Default::default()).unwrap();
    let (s, c) = capturing(&sim, &b);
    let p = pool.allocate(MIB, &c).unwrap();
    sim.end_capture(0, s.handle()).unwrap();
    // A stream of the other device: refused by the checks, the record kept.
    let other = Stream::create(&b, 1, false).unwrap();
    assert!(matches!(pool.deallocate(p, MIB, &other), Err(Error::InvalidStream(_))));
    // Refused by the driver (a free on another stream while a capture is under way): kept.
    let t = stream(&b);
    sim.begin_capture(0, t.handle()).unwrap();
    assert!(matches!(pool.deallocate(p, MIB, &s), Err(Error::Driver { code: 900, .. })));
    assert!(sim.end_capture(0, t.handle()).is_err());
    pool.deallocate(p, MIB, &s).unwrap();
}

#[test]
fn the_drivers_pool_says_a_free_from_before_the_capture_waits_for_its_end() {
    let (sim, b) = sim();
    let pool = async_pool(&b);
    let s = stream(&b);
    let before = pool.allocate(MIB, &s).unwrap();
    sim.begin_capture(0, s.handle()).unwrap();
    let c = Stream::capturing(&b, 0, s.handle());
    let e = pool.deallocate(before, MIB, &c).unwrap_err();
    assert!(matches!(&e, Error::InvalidStream(m) if m.contains("once the capture has ended")), "{e}");
    sim.end_capture(0, s.handle()).unwrap();
    pool.deallocate(before, MIB, &s).unwrap();
}

#[test]
fn the_simulated_device_follows_an_invalidated_capture_and_the_legacy_stream() {
    let sim = SimDevice::with_devices(256 << 20, 2);
    let b: BackendRef = sim.clone();
    let pool = b.pool_default(0, false).unwrap();
    // An invalidated capture refuses work on its stream until it ends.
    let s = stream(&b);
    sim.begin_capture(0, s.handle()).unwrap();
    assert!(b.stream_query(0, s.handle()).is_err());
    assert!(matches!(b.pool_alloc_async(0, pool, MIB, s.handle()), Err(Error::Driver { code: 901, .. })));
    assert!(sim.end_capture(0, s.handle()).is_err());
    // The global mode is the process's: a synchronous allocation on device 1 is refused
    // while device 0 captures.
    sim.begin_capture(0, s.handle()).unwrap();
    assert!(matches!(b.mem_alloc(1, MIB), Err(Error::Driver { code: 900, .. })));
    assert!(sim.end_capture(0, s.handle()).is_err());
    // The legacy stream while a blocking stream captures: 906, and the capture invalidated.
    let blocking = Stream::create(&b, 0, true).unwrap();
    sim.begin_capture(0, blocking.handle()).unwrap();
    assert!(matches!(b.stream_id(0, 0), Err(Error::Driver { code: 906, .. })));
    assert!(sim.end_capture(0, blocking.handle()).is_err());
    // A non-blocking stream's capture leaves the legacy stream alone.
    sim.begin_capture(0, s.handle()).unwrap();
    b.event_create(0).and_then(|e| b.event_record(0, e, 0)).unwrap();
    sim.end_capture(0, s.handle()).unwrap();
}

#[test]
fn the_relaxed_capture_mode_makes_the_potentially_unsafe_calls_this_threads() {
    let (sim, b) = sim();
    let (s, _) = capturing(&sim, &b);
    let t = stream(&b);
    let pool = b.pool_default(0, false).unwrap();
    // Another stream's allocation and free, in the relaxed mode: taken, the capture intact.
    let p = streampool::device::with_relaxed_capture(&b, || b.pool_alloc_async(0, pool, MIB, t.handle()))
        .unwrap();
    streampool::device::with_relaxed_capture(&b, || b.free_async(0, p, t.handle())).unwrap();
    // The mode is restored: the same call outside refuses again (and invalidates).
    assert!(matches!(b.pool_alloc_async(0, pool, MIB, t.handle()), Err(Error::Driver { code: 900, .. })));
    assert!(sim.end_capture(0, s.handle()).is_err());
    // Calls on the capturing stream that conflict with it are refused in every mode.
    let (s, _) = capturing(&sim, &b);
    assert!(streampool::device::with_relaxed_capture(&b, || b.stream_query(0, s.handle())).is_err());
    assert!(sim.end_capture(0, s.handle()).is_err());
}
