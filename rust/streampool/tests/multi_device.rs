//! Several devices on one simulated backend: resources bound to their device, threads
//! allocating on every device at once, copies between devices ordered by events across
//! them, and pool memory that another device may use only once granted.

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, LEGACY_STREAM};
use streampool::{
    AsyncPoolOptions, CudaAsyncMemoryResource, CudaMemoryResource, Error, ManagedMemoryResource,
    MemoryResource, PinnedHostMemoryResource, ResourceRef, ShardedPoolMemoryResource, Stream,
};

mod common;
use common::{assert_no_races, XorShift};

const MIB: usize = 1 << 20;

fn two_devices() -> (Arc<SimDevice>, BackendRef) {
    let sim = SimDevice::with_devices(64 * MIB, 2);
    let backend: BackendRef = sim.clone();
    (sim, backend)
}

fn sharded(b: &BackendRef, device: i32) -> ResourceRef {
    let upstream = Arc::new(CudaAsyncMemoryResource::on(b.clone(), device, Default::default()).unwrap());
    Arc::new(ShardedPoolMemoryResource::new(upstream, Default::default()).unwrap())
}

#[test]
fn threads_allocate_on_both_devices_at_once_without_races() {
    let (sim, b) = two_devices();
    let pools = [sharded(&b, 0), sharded(&b, 1)];
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (sim, b) = (sim.clone(), b.clone());
            let mr = pools[t % 2].clone();
            std::thread::spawn(move || {
                let device = (t % 2) as i32;
                let s = Stream::create(&b, device, false).unwrap();
                let mut sizes = XorShift::new(t as u64);
                for _ in 0..100 {
                    let bytes = sizes.size() / 8;
                    let p = mr.allocate(bytes, &s).unwrap();
                    sim.write(s.handle(), p, bytes).unwrap();
                    mr.deallocate(p, bytes, &s).unwrap();
                    sim.step_any();
                }
                s.synchronize(&b, device).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_no_races(&sim);
    // Each device's memory was its own: both pools hold memory of their device only.
    assert!(b.mem_get_info(0).unwrap().0 < 64 * MIB && b.mem_get_info(1).unwrap().0 < 64 * MIB);
}

#[test]
fn a_resource_refuses_streams_of_another_device() {
    let (_sim, b) = two_devices();
    let s1 = Stream::create(&b, 1, false).unwrap();
    for mr in [
        sharded(&b, 0),
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap()) as ResourceRef,
        Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap()),
    ] {
        match mr.allocate(256, &s1) {
            Err(Error::InvalidStream(m)) => assert!(m.contains("belongs to device 1"), "{m}"),
            other => panic!("expected InvalidStream, got {other:?}"),
        }
        // Still usable on its own device.
        let p = mr.allocate(256, &Stream::legacy()).unwrap();
        mr.deallocate(p, 256, &Stream::legacy()).unwrap();
    }
}

#[test]
fn a_resource_for_a_device_that_does_not_exist_is_refused_when_made() {
    let (_sim, b) = two_devices();
    for device in [2, -1] {
        let refusals = [
            CudaMemoryResource::on(b.clone(), device).map(|_| ()),
            ManagedMemoryResource::on(b.clone(), device).map(|_| ()),
            PinnedHostMemoryResource::on(b.clone(), device).map(|_| ()),
            CudaAsyncMemoryResource::on(b.clone(), device, Default::default()).map(|_| ()),
        ];
        for refused in refusals {
            match refused {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(&format!("device {device}")), "{m}"),
                other => panic!("device {device}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}

#[test]
fn managed_memory_is_prefetched_to_the_device_that_reads_it_on_that_devices_stream() {
    let (sim, b) = two_devices();
    let mr: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let a = streampool::Allocation::new(mr, 1 << 20, Stream::legacy()).unwrap();
    let reader = Stream::create(&b, 1, false).unwrap();
    a.prefetch(Some(streampool::device::Location::Device(1)), Some(&reader)).unwrap();
    assert_eq!(sim.queued(reader.handle()).unwrap(), 1, "on the reader's stream");
    assert_eq!(a.last_prefetch_location().unwrap(), Some(streampool::device::Location::Device(1)));
    // A stream of another backend is still refused.
    let other = SimDevice::new(64 * MIB);
    let foreign = Stream::create(&(other.clone() as BackendRef), 0, false).unwrap();
    assert!(matches!(a.prefetch(None, Some(&foreign)), Err(Error::InvalidStream(_))));
    sim.run();
    assert_no_races(&sim);
}

#[test]
fn peer_access_opens_a_pool_to_another_device_and_no_other_pool() {
    let (sim, b) = two_devices();
    let s1 = Stream::create(&b, 1, false).unwrap();
    let opts = AsyncPoolOptions { peer_access: Some(vec![1]), ..Default::default() };
    let shared = CudaAsyncMemoryResource::on(b.clone(), 0, opts).unwrap();
    assert_eq!(shared.peer_access().unwrap(), vec![1]);
    let private = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    assert_eq!(private.peer_access().unwrap(), Vec::<i32>::new());
    let legacy = Stream::legacy();
    let (a, p) = (shared.allocate(4096, &legacy).unwrap(), private.allocate(4096, &legacy).unwrap());
    b.ctx_synchronize(0).unwrap();
    sim.read(s1.handle(), a, 4096).unwrap();
    assert!(
        matches!(sim.read(s1.handle(), p, 4096), Err(Error::InvalidPointer(m)) if m.contains("device 1 cannot access"))
    );
    // The harness's kernels (cuLaunchKernel) follow the same grants as simulated work.
    // SAFETY: `a` is this test's 4 KiB, granted to device 1; nothing else uses it.
    unsafe { streampool::kernels::fill(&b, 1, a, 4096, 3, &s1) }.unwrap();
    // SAFETY: `p` is this test's too; the simulated device refuses device 1's access.
    match unsafe { streampool::kernels::fill(&b, 1, p, 4096, 3, &s1) } {
        Err(Error::InvalidPointer(m)) => {
            assert!(m.contains("device 1 cannot access") && m.contains("fill"), "{m}")
        }
        other => panic!("expected InvalidPointer, got {other:?}"),
    }
    shared.set_peer_access(1, false).unwrap();
    assert!(sim.read(s1.handle(), a, 4096).is_err());
    // Refused grants name the devices and change nothing.
    for (peer, words) in [(0, "pool's own device"), (2, "peer device 2 does not exist")] {
        match shared.set_peer_access(peer, true) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(words), "{m}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    sim.set_peer_capable(0, 1, false).unwrap();
    match CudaAsyncMemoryResource::on(
        b.clone(),
        0,
        AsyncPoolOptions { peer_access: Some(vec![1]), ..Default::default() },
    ) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("device 1 cannot access memory of device 0"), "{m}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    shared.deallocate(a, 4096, &legacy).unwrap();
    private.deallocate(p, 4096, &legacy).unwrap();
    assert_no_races(&sim);
}

#[test]
fn a_copy_between_devices_waits_for_its_source_and_holds_back_its_reuse() {
    let (sim, b) = two_devices();
    let (s0, s1) = (Stream::create(&b, 0, false).unwrap(), Stream::create(&b, 1, false).unwrap());
    let (mr0, mr1) = (sharded(&b, 0), sharded(&b, 1));
    let src = mr0.allocate(MIB, &s0).unwrap();
    sim.write_labeled(s0.handle(), src, MIB, "producer on device 0").unwrap();
    let dst = mr1.allocate(MIB, &s1).unwrap();
    // What DeviceBuffer.copy_to_device does: the copy on device 1 after the source's work,
    // the source's stream after the copy; then the source is freed and reused on device 0.
    s1.wait_for(&b, 1, &s0, 0).unwrap();
    // SAFETY: both live allocations of MIB bytes, ordered as above.
    unsafe { b.memcpy_peer_async(1, dst, 1, src, 0, MIB, s1.handle()) }.unwrap();
    s0.wait_for(&b, 0, &s1, 1).unwrap();
    mr0.deallocate(src, MIB, &s0).unwrap();
    let again = mr0.allocate(MIB, &s0).unwrap();
    sim.write_labeled(s0.handle(), again, MIB, "next user on device 0").unwrap();
    assert_no_races(&sim);
    // Without the second ordering, the next user's write races with the copy's read.
    sim.write(s0.handle(), again, MIB).unwrap();
    b.stream_synchronize(0, s0.handle()).unwrap();
    // SAFETY: as above.
    unsafe { b.memcpy_peer_async(1, dst, 1, again, 0, MIB, s1.handle()) }.unwrap();
    sim.write_labeled(s0.handle(), again, MIB, "unordered writer").unwrap();
    sim.run();
    assert_eq!(sim.take_races().len(), 1);
    mr0.deallocate(again, MIB, &s0).unwrap();
    mr1.deallocate(dst, MIB, &s1).unwrap();
    b.stream_synchronize(0, LEGACY_STREAM).unwrap();
}

#[test]
fn a_stream_waits_for_an_event_of_another_device() {
    let (sim, b) = two_devices();
    let (s0, s1) = (Stream::create(&b, 0, false).unwrap(), Stream::create(&b, 1, false).unwrap());
    // Device 1 writes its memory, device 0 then copies it: ordered by an event of device 1.
    let (src, dst) = (b.mem_alloc(1, 4096).unwrap(), b.mem_alloc(0, 4096).unwrap());
    sim.write(s1.handle(), src, 4096).unwrap();
    let done = streampool::Event::new(&b, 1).unwrap();
    done.record(&s1).unwrap();
    s0.wait(&done).unwrap();
    // SAFETY: both are live allocations of 4096 bytes, freed after the stream is synchronised.
    unsafe { b.memcpy_peer_async(0, dst, 0, src, 1, 4096, s0.handle()) }.unwrap();
    s0.synchronize(&b, 0).unwrap();
    assert_no_races(&sim);
    // A stream of another backend is still refused.
    let other: BackendRef = SimDevice::new(MIB);
    let foreign = Stream::create(&other, 0, false).unwrap();
    assert!(foreign.wait(&done).is_err());
    b.mem_free(0, dst).unwrap();
    b.mem_free(1, src).unwrap();
}
