use std::sync::Arc;

use super::pool::CHUNK;
use super::*;
use crate::error::{
    CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY,
};

const MIB: usize = 1 << 20;

fn sim() -> Arc<SimDevice> {
    SimDevice::new(64 * MIB)
}

fn stream(sim: &SimDevice, blocking: bool) -> RawStream {
    sim.stream_create(0, blocking).unwrap()
}

/// Copies `bytes` of simulated memory at `ptr` to the host, on `s`, and waits for it.
fn to_host(sim: &SimDevice, ptr: DevPtr, bytes: usize, s: RawStream) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` outlives the copy, which completes in the synchronisation below.
    unsafe { sim.memcpy_async(0, host.as_mut_ptr() as u64, ptr, bytes, s).unwrap() };
    sim.stream_synchronize(0, s).unwrap();
    host
}

fn attr(sim: &SimDevice, pool: RawPool, a: PoolAttr) -> usize {
    sim.pool_get_attr(0, pool, a).unwrap() as usize
}

#[test]
fn describes_itself() {
    let sim = SimDevice::new(16 << 30);
    let d = sim.describe();
    assert!(d.starts_with("simulated device #") && d.ends_with("(16 GiB)"), "{d}");
    assert!(sim.id() > 0);
    assert_ne!(sim.id(), SimDevice::new(MIB).id());
    assert_eq!(sim.kind(), BackendKind::Simulated);
    assert_eq!(sim.driver_version().unwrap(), 13000);
    assert_eq!(sim.device_count().unwrap(), 1);
    let info = sim.device_info(0).unwrap();
    assert_eq!(info.total_bytes, 16 << 30);
    assert!(info.memory_pools && info.managed_pools && info.concurrent_managed_access && info.posix_fd_ipc);
    assert!(matches!(sim.device_info(1), Err(Error::InvalidArgument(_))));
    assert_eq!(sim.mem_get_info(0).unwrap(), (16 << 30, 16 << 30));
}

#[test]
fn same_stream_work_is_ordered() {
    let sim = sim();
    let s = stream(&sim, false);
    let p = sim.mem_alloc(0, 4096).unwrap();
    assert_eq!(p % 256, 0);
    sim.write(s, p, 4096).unwrap();
    sim.read(s, p, 4096).unwrap();
    sim.memset_d8_async(0, p, 7, 100, s).unwrap();
    sim.write(s, p + 50, 100).unwrap();
    assert_eq!(sim.pending(), 4);
    sim.run();
    assert_eq!(sim.pending(), 0);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn two_streams_writing_the_same_bytes_race() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    sim.write_labeled(a, p, 4096, "producer").unwrap();
    sim.write_labeled(b, p + 1024, 1024, "consumer").unwrap();
    sim.run();
    let races = sim.races();
    assert_eq!(races.len(), 1, "{races:?}");
    let r = &races[0];
    assert_eq!((r.earlier.stream, r.earlier.label.as_str()), (a, "producer"));
    assert_eq!((r.later.stream, r.later.label.as_str()), (b, "consumer"));
    assert_eq!(r.range, (p + 1024, p + 2048));
    let text = r.to_string();
    assert!(text.contains("write 'producer' on stream 0x1000"), "{text}");
    assert!(text.contains("is not ordered before write 'consumer' on stream 0x1010"), "{text}");
    // Taking them forgets them.
    assert_eq!(sim.take_races().len(), 1);
    assert!(sim.races().is_empty());
}

#[test]
fn a_read_after_an_unordered_write_races_and_concurrent_reads_do_not() {
    let sim = sim();
    let (a, b, c) = (stream(&sim, false), stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 256).unwrap();
    sim.read(a, p, 256).unwrap();
    sim.read(b, p, 256).unwrap();
    sim.run();
    assert!(sim.races().is_empty());
    sim.write(c, p, 256).unwrap();
    sim.read_labeled(a, p, 16, "reader").unwrap();
    assert!(sim.step(c).unwrap() && sim.step(a).unwrap());
    let races = sim.take_races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert!(races[0].earlier_writes && !races[0].later_writes);
    assert_eq!(races[0].later.label, "reader");
}

#[test]
fn an_event_wait_orders_two_streams() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    let e = sim.event_create(0).unwrap();
    sim.write(a, p, 4096).unwrap();
    sim.event_record(0, e, a).unwrap();
    sim.stream_wait_event(0, b, e).unwrap();
    sim.write(b, p, 4096).unwrap();
    // b's head is the wait, which cannot run before a's work.
    assert!(!sim.step(b).unwrap());
    assert!(!sim.stream_query(0, b).unwrap());
    assert!(sim.step(a).unwrap());
    assert!(!sim.step(b).unwrap(), "the record has not run yet");
    assert!(sim.step(a).unwrap());
    assert!(sim.event_query(0, e).unwrap());
    assert!(sim.step(b).unwrap());
    assert!(sim.step(b).unwrap());
    assert!(!sim.step(b).unwrap());
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    // Transitively: c waits on an event of b recorded after b waited on a.
    let c = stream(&sim, false);
    let e2 = sim.event_create(0).unwrap();
    sim.write(a, p, 64).unwrap();
    sim.event_record(0, e, a).unwrap();
    sim.stream_wait_event(0, b, e).unwrap();
    sim.event_record(0, e2, b).unwrap();
    sim.stream_wait_event(0, c, e2).unwrap();
    sim.write(c, p, 64).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn work_completed_before_an_enqueue_is_ordered_before_it() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    sim.write(a, p, 4096).unwrap();
    assert!(sim.step(a).unwrap());
    sim.write(b, p, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    // Enqueued before it completed: a race, whatever order they then run in.
    sim.write(a, p, 4096).unwrap();
    sim.write(b, p, 4096).unwrap();
    assert!(sim.step(b).unwrap());
    assert!(sim.step(a).unwrap());
    assert_eq!(sim.take_races().len(), 1);
}

#[test]
fn the_legacy_stream_synchronises_with_blocking_streams_only() {
    let sim = sim();
    let blocking = stream(&sim, true);
    let non_blocking = stream(&sim, false);
    let p = sim.mem_alloc(0, 4096).unwrap();
    for (first, second) in [(blocking, LEGACY_STREAM), (LEGACY_STREAM_ALIAS, blocking)] {
        sim.write(first, p, 4096).unwrap();
        sim.write(second, p, 4096).unwrap();
        // The second cannot run first.
        assert!(!sim.step(second).unwrap());
        sim.run();
    }
    // The per-thread default stream is blocking too.
    sim.write(PER_THREAD_STREAM, p, 4096).unwrap();
    sim.write(LEGACY_STREAM, p, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    for (first, second) in [(non_blocking, LEGACY_STREAM), (LEGACY_STREAM, non_blocking)] {
        sim.write(first, p, 4096).unwrap();
        sim.write(second, p, 4096).unwrap();
        sim.run();
        assert_eq!(sim.take_races().len(), 1, "{first:#x} then {second:#x}");
    }
}

#[test]
fn an_event_wait_on_the_legacy_stream_is_a_barrier_whatever_the_event() {
    // "When an action is taken in the legacy stream such as a kernel launch or
    // cudaStreamWaitEvent(), the legacy stream first waits on all blocking streams [...]
    // and then all blocking streams wait on the legacy stream": X's write is ordered before
    // Y's read by the wait alone, whatever the event is.
    for prep in ["never recorded", "complete", "recorded on the legacy stream", "pending elsewhere"] {
        let sim = sim();
        let (x, y, z) = (stream(&sim, true), stream(&sim, true), stream(&sim, false));
        let p = sim.mem_alloc(0, 8192).unwrap();
        let e = sim.event_create(0).unwrap();
        match prep {
            "complete" => {
                sim.event_record(0, e, z).unwrap();
                sim.run();
            }
            "recorded on the legacy stream" => sim.event_record(0, e, LEGACY_STREAM).unwrap(),
            "pending elsewhere" => {
                sim.write(z, p + 4096, 8).unwrap();
                sim.event_record(0, e, z).unwrap();
            }
            _ => {}
        }
        sim.write(x, p, 64).unwrap();
        sim.stream_wait_event(0, LEGACY_STREAM, e).unwrap();
        sim.read(y, p, 64).unwrap();
        sim.run();
        assert!(sim.races().is_empty(), "event {prep}: {:?}", sim.races());
    }
}

#[test]
fn a_kernel_on_a_default_stream_runs_on_the_device_of_its_memory() {
    let sim = SimDevice::with_devices(MIB * 64, 2);
    let p1 = sim.mem_alloc(1, 4096).unwrap();
    let blocking1 = sim.stream_create(1, true).unwrap();
    // Device 1's legacy stream, ordered with device 1's blocking streams.
    sim.write(blocking1, p1, 4096).unwrap();
    sim.write(LEGACY_STREAM, p1, 4096).unwrap();
    sim.read(blocking1, p1, 4096).unwrap();
    assert_eq!(sim.queued(blocking1).unwrap(), 2);
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn stream_handles_are_reused_most_recent_first_and_dead_handles_are_refused() {
    let sim = sim();
    let s: Vec<RawStream> = (0..3).map(|_| stream(&sim, false)).collect();
    assert_eq!(s, vec![0x1000, 0x1010, 0x1020]);
    let ids: Vec<u64> = s.iter().map(|&h| sim.stream_id(0, h).unwrap()).collect();
    assert_eq!(sim.stream_device(s[1]).unwrap(), 0);
    sim.stream_destroy(0, s[0]).unwrap();
    sim.stream_destroy(0, s[2]).unwrap();
    for call in [
        sim.stream_synchronize(0, s[0]),
        sim.write(s[2], 0, 0),
        sim.stream_destroy(0, s[0]),
        sim.stream_device(s[2]).map(drop),
    ] {
        match call {
            Err(Error::InvalidStream(m)) => assert!(m.contains("0x1000") || m.contains("0x1020"), "{m}"),
            other => panic!("expected InvalidStream, got {other:?}"),
        }
    }
    assert!(matches!(sim.stream_query(0, 0x4242), Err(Error::InvalidStream(m)) if m.contains("0x4242")));
    assert_eq!(stream(&sim, false), s[2]);
    assert_eq!(stream(&sim, false), s[0]);
    assert_eq!(stream(&sim, false), 0x1030);
    // Reused handles name new streams.
    let new_id = sim.stream_id(0, s[2]).unwrap();
    assert!(!ids.contains(&new_id));
    // The default streams exist everywhere and cannot be destroyed.
    assert!(sim.stream_destroy(0, LEGACY_STREAM).is_err());
    assert_eq!(sim.stream_id(0, LEGACY_STREAM).unwrap(), sim.stream_id(0, LEGACY_STREAM_ALIAS).unwrap());
    assert_eq!(sim.stream_device(PER_THREAD_STREAM).unwrap(), 0);
}

#[test]
fn work_on_a_destroyed_stream_still_runs() {
    let sim = sim();
    let s = stream(&sim, false);
    let p = sim.mem_alloc(0, 4096).unwrap();
    sim.memset_d8_async(0, p, 0x5a, 4096, s).unwrap();
    sim.stream_destroy(0, s).unwrap();
    assert_eq!(sim.pending(), 1);
    // Its handle now names a new, idle stream.
    assert_eq!(stream(&sim, false), s);
    assert_eq!(sim.queued(s).unwrap(), 0);
    assert!(!sim.step(s).unwrap());
    sim.run();
    assert_eq!(sim.pending(), 0);
    assert!(to_host(&sim, p, 4096, LEGACY_STREAM).iter().all(|&b| b == 0x5a));
    // And a device-wide synchronisation runs it too.
    let t = stream(&sim, false);
    sim.memset_d8_async(0, p, 1, 4096, t).unwrap();
    sim.stream_destroy(0, t).unwrap();
    sim.ctx_synchronize(0).unwrap();
    assert_eq!(sim.pending(), 0);
}

#[test]
fn memset_and_memcpy_move_the_right_bytes() {
    let sim = sim();
    let s = stream(&sim, false);
    let a = sim.mem_alloc(0, 1000).unwrap();
    let pool = sim.pool_default(0, false).unwrap();
    let b = sim.pool_alloc_async(0, pool, 1000, s).unwrap();
    sim.memset_d8_async(0, a, 0xab, 1000, s).unwrap();
    sim.memset_d8_async(0, a + 10, 0xcd, 5, s).unwrap();
    let src: Vec<u8> = (0..=255).collect();
    // SAFETY: `src` outlives the copy (synchronised before it is dropped).
    unsafe { sim.memcpy_async(0, b, src.as_ptr() as u64, 256, s).unwrap() };
    // SAFETY: both sides are simulated memory.
    unsafe { sim.memcpy_async(0, a + 500, b, 256, s).unwrap() };
    assert_eq!(sim.pending(), 4, "nothing runs before it is asked to");
    let host = to_host(&sim, a, 1000, s);
    assert!(host[..10].iter().all(|&x| x == 0xab));
    assert!(host[10..15].iter().all(|&x| x == 0xcd));
    assert!(host[15..500].iter().all(|&x| x == 0xab));
    assert_eq!(&host[500..756], &src[..]);
    assert!(host[756..].iter().all(|&x| x == 0xab));
    // Kernel writes leave a non-zero pattern, different for successive writes.
    sim.write(s, a, 10).unwrap();
    sim.write(s, a + 10, 10).unwrap();
    let host = to_host(&sim, a, 20, s);
    assert!(host[0] != 0 && host[..10].iter().all(|&x| x == host[0]));
    assert!(host[10] != 0 && host[10] != host[0]);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn touching_memory_outside_a_live_allocation_is_refused_when_enqueued() {
    let sim = sim();
    let s = stream(&sim, false);
    let p = sim.mem_alloc(0, 4096).unwrap();
    // An overrun says so, and by how much (not "use after free").
    match sim.write(s, p + 4000, 200) {
        Err(Error::InvalidPointer(m)) => {
            assert!(
                m.contains("runs 104 bytes past the end of the live allocation") && m.contains("overrun"),
                "{m}"
            );
            assert!(!m.contains("use after free"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    sim.mem_free(0, p).unwrap();
    match sim.write(s, p, 16) {
        Err(Error::InvalidPointer(m)) => assert!(m.contains("use after free"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(sim.memset_d8_async(0, p, 0, 16, s).is_err());
    assert!(sim.prefetch_async(0, p, 16, Location::Device(0), s).is_err());
    let pool = sim.pool_default(0, false).unwrap();
    let q = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    sim.free_async(0, q, s).unwrap();
    // Inside the pool's chunk, but freed: refused even as a copy's host side.
    let mut host = [0u8; 16];
    // SAFETY: refused before anything is enqueued.
    let err = unsafe { sim.memcpy_async(0, host.as_mut_ptr() as u64, q, 16, s) }.unwrap_err();
    assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
    assert!(sim.read(s, q, 1).is_err());
    // An address that is neither the device's nor mapped host memory is refused when the
    // copy is enqueued, rather than faulting when it runs; mapped host memory is copied.
    let unmapped = 0xdead_0000u64;
    let p2 = sim.mem_alloc(0, 4096).unwrap();
    // SAFETY: refused before anything is enqueued.
    match unsafe { sim.memcpy_async(0, p2, unmapped, 16, s) } {
        Err(Error::InvalidPointer(m)) => assert!(m.contains("nor host memory"), "{m}"),
        other => panic!("{other:?}"),
    }
    // SAFETY: refused before anything is enqueued.
    assert!(unsafe { sim.memcpy_async(0, unmapped, p2, 16, s) }.is_err());
    let src = [7u8; 16];
    // SAFETY: `src` outlives the copy, which the synchronisation below completes.
    unsafe { sim.memcpy_async(0, p2, src.as_ptr() as u64, 16, s) }.unwrap();
    sim.stream_synchronize(0, s).unwrap();
    sim.mem_free(0, p2).unwrap();
    // Zero bytes is a no-op wherever it points; an unknown stream is still refused.
    sim.write(s, 0, 0).unwrap();
    assert!(sim.write(0x9990, p, 0).is_err());
    assert_eq!(sim.pending(), 0);
}

#[test]
fn bad_frees_are_refused_and_change_nothing() {
    let sim = sim();
    let s = stream(&sim, false);
    let pool = sim.pool_default(0, false).unwrap();
    let dev = sim.mem_alloc(0, 4096).unwrap();
    let host = sim.mem_host_alloc(0, 4096).unwrap();
    let pooled = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    let expect_bad = |r: Result<()>, ptr: DevPtr| match r {
        Err(Error::InvalidPointer(m)) => assert!(m.contains(&format!("{ptr:#x}")), "{m}"),
        other => panic!("expected InvalidPointer for {ptr:#x}, got {other:?}"),
    };
    expect_bad(sim.mem_free_host(0, pooled), pooled);
    expect_bad(sim.mem_free(0, host), host);
    expect_bad(sim.mem_free_host(0, dev), dev);
    expect_bad(sim.free_async(0, dev, s), dev);
    expect_bad(sim.free_async(0, dev + 256, s), dev + 256);
    expect_bad(sim.mem_free(0, 0xdead_0000), 0xdead_0000);
    expect_bad(sim.mem_free(0, dev + 16), dev + 16);
    // Nothing was freed by the refusals.
    sim.write(s, dev, 4096).unwrap();
    sim.write(s, host, 4096).unwrap();
    sim.write(s, pooled, 4096).unwrap();
    sim.mem_free(0, dev).unwrap();
    sim.mem_free_host(0, host).unwrap();
    sim.free_async(0, pooled, s).unwrap();
    // Double frees.
    expect_bad(sim.mem_free(0, dev), dev);
    expect_bad(sim.mem_free_host(0, host), host);
    expect_bad(sim.free_async(0, pooled, s), pooled);
    // Null is a no-op.
    sim.mem_free(0, 0).unwrap();
    sim.free_async(0, 0, s).unwrap();
    assert_eq!(sim.pointer_pool(0, pooled).map_err(|_| ()), Err(()));
    assert!(matches!(sim.pointer_device(0, pooled), Err(Error::InvalidPointer(_))));
}

#[test]
fn a_pointer_tells_its_device() {
    let sim = SimDevice::with_devices(64 * MIB, 2);
    let on1 = sim.mem_alloc(1, 4096).unwrap();
    let pooled = sim.pool_alloc_async(0, sim.pool_default(0, false).unwrap(), 4096, LEGACY_STREAM).unwrap();
    assert_eq!(sim.pointer_device(0, on1 + 100).unwrap(), 1, "asked from any device's context");
    assert_eq!(sim.pointer_device(1, pooled).unwrap(), 0);
    sim.mem_free(1, on1).unwrap();
    sim.free_async(0, pooled, LEGACY_STREAM).unwrap();
}

#[test]
fn mem_free_takes_pool_memory_without_waiting_for_its_work() {
    // As the driver documents cuMemFree: it frees stream-ordered memory too, with no
    // synchronisation; the caller must have waited for the memory's work.
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let pool = sim.pool_default(0, false).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, a).unwrap();
    sim.write_labeled(a, p, 4096, "write before the free").unwrap();
    sim.mem_free(0, p).unwrap();
    assert_eq!(sim.queued(a).unwrap(), 1, "nothing was waited for");
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemCurrent), 0);
    assert!(matches!(sim.mem_free(0, p), Err(Error::InvalidPointer(_))), "a second free");
    // The block is any stream's at once: reused while that write is queued, a race.
    let q = sim.pool_alloc_async(0, pool, 4096, b).unwrap();
    assert_eq!(p, q);
    sim.write_labeled(b, q, 4096, "write after reuse").unwrap();
    sim.run();
    assert_eq!(sim.take_races().len(), 1);
    // Freed once its work has completed, reuse is clean.
    sim.stream_synchronize(0, b).unwrap();
    sim.mem_free(0, q).unwrap();
    let r = sim.pool_alloc_async(0, pool, 4096, a).unwrap();
    sim.write(a, r, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn synchronous_frees_wait_for_the_whole_device() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    let q = sim.mem_alloc(0, 4096).unwrap();
    sim.write(a, p, 4096).unwrap();
    sim.write(b, q, 4096).unwrap();
    sim.mem_free(0, q).unwrap();
    assert_eq!(sim.pending(), 0);
    // After it, any stream may use what the device had written.
    sim.write(b, p, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn a_synchronisation_of_one_device_leaves_other_devices_work_unordered() {
    // cuCtxSynchronize, and the calls that synchronise implicitly, wait for one context's
    // work: an unordered pair of device 1 stays a race across a synchronisation of device 0.
    for call in ["cuCtxSynchronize", "cuMemFree", "cuMemFreeHost", "cuMemUnmap"] {
        let sim = SimDevice::with_devices(16 * MIB, 2);
        let (x, y) = (sim.stream_create(1, false).unwrap(), sim.stream_create(1, false).unwrap());
        let s0 = sim.stream_create(0, false).unwrap();
        let p = sim.mem_alloc(1, 4096).unwrap();
        let q = sim.mem_alloc(0, 4096).unwrap();
        sim.write(s0, q, 4096).unwrap();
        sim.write_labeled(x, p, 4096, "device 1's write").unwrap();
        match call {
            "cuCtxSynchronize" => sim.ctx_synchronize(0).unwrap(),
            "cuMemFree" => sim.mem_free(0, q).unwrap(),
            "cuMemFreeHost" => sim.mem_free_host(0, sim.mem_host_alloc(0, 4096).unwrap()).unwrap(),
            _ => {
                let base = sim.vmm_reserve(0, G).unwrap();
                let handle = sim.vmm_map(0, base, G).unwrap();
                sim.vmm_unmap(0, base, G, handle).unwrap();
            }
        }
        assert_eq!(sim.queued(s0).unwrap(), 0, "{call} waits for device 0's work");
        assert_eq!(sim.queued(x).unwrap(), 1, "{call} does not wait for device 1's");
        sim.read_labeled(y, p, 4096, "device 1's read").unwrap();
        sim.run();
        assert_eq!(sim.take_races().len(), 1, "{call}");
        // Device 1's own synchronisation orders them.
        sim.write(x, p, 4096).unwrap();
        sim.ctx_synchronize(1).unwrap();
        sim.read(y, p, 4096).unwrap();
        sim.run();
        assert!(sim.races().is_empty(), "{call}: {:?}", sim.races());
    }
}

#[test]
fn a_copy_into_pageable_memory_is_complete_when_it_returns() {
    // "For transfers from device memory to pageable host memory, the function will return
    // only once the copy has completed"; into pinned host memory it stays asynchronous.
    let sim = sim();
    let (s, other) = (stream(&sim, false), stream(&sim, false));
    let (p, unrelated) = (sim.mem_alloc(0, 64).unwrap(), sim.mem_alloc(0, 64).unwrap());
    sim.write(other, unrelated, 64).unwrap();
    sim.memset_d8_async(0, p, 7, 64, s).unwrap();
    let mut host = vec![0u8; 64];
    // SAFETY: `host` outlives the copy, which has completed when the call returns.
    unsafe { sim.memcpy_async(0, host.as_mut_ptr() as u64, p, 64, s) }.unwrap();
    assert_eq!(host, [7; 64]);
    assert_eq!(sim.queued(s).unwrap(), 0);
    assert_eq!(sim.queued(other).unwrap(), 1, "work the copy does not follow stays queued");
    sim.memset_d8_async(0, p, 9, 64, s).unwrap();
    let pinned = sim.mem_host_alloc(0, 64).unwrap();
    // SAFETY: simulated memory on both sides.
    unsafe { sim.memcpy_async(0, pinned, p, 64, s) }.unwrap();
    assert_eq!(sim.queued(s).unwrap(), 2, "a copy into pinned memory is queued");
    assert_eq!(to_host(&sim, pinned, 64, s), [9; 64]);
}

#[test]
fn host_waits_run_only_what_they_wait_for() {
    let sim = sim();
    let (a, b, c) = (stream(&sim, false), stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    let e = sim.event_create(0).unwrap();
    assert!(sim.event_query(0, e).unwrap(), "an event never recorded counts as completed");
    sim.event_synchronize(0, e).unwrap();
    sim.write(a, p, 64).unwrap();
    sim.event_record(0, e, a).unwrap();
    sim.stream_wait_event(0, b, e).unwrap();
    sim.write(b, p, 64).unwrap();
    sim.write(c, p + 64, 64).unwrap();
    assert!(!sim.event_query(0, e).unwrap());
    assert_eq!(sim.pending(), 5, "queries run nothing");
    sim.stream_synchronize(0, b).unwrap();
    assert!(sim.stream_query(0, a).unwrap() && sim.stream_query(0, b).unwrap());
    assert!(sim.event_query(0, e).unwrap());
    assert_eq!(sim.queued(c).unwrap(), 1);
    sim.write(a, p, 64).unwrap();
    sim.event_record(0, e, a).unwrap();
    sim.write(a, p, 64).unwrap();
    sim.event_synchronize(0, e).unwrap();
    assert_eq!(sim.queued(a).unwrap(), 1);
    assert_eq!(sim.pending(), 2);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    // Unknown events are refused, naming them.
    sim.event_destroy(0, e).unwrap();
    assert!(matches!(sim.event_query(0, e), Err(Error::InvalidStream(m)) if m.contains(&format!("{e:#x}"))));
    assert!(sim.event_destroy(0, e).is_err());
    assert!(sim.stream_wait_event(0, a, e).is_err());
}

#[test]
fn per_thread_default_streams_are_distinct_per_thread() {
    let sim = sim();
    let p = sim.mem_alloc(0, 4096).unwrap();
    let mine = sim.stream_id(0, PER_THREAD_STREAM).unwrap();
    assert_eq!(sim.stream_id(0, PER_THREAD_STREAM).unwrap(), mine);
    sim.write_labeled(PER_THREAD_STREAM, p, 4096, "main thread").unwrap();
    let other = {
        let sim = sim.clone();
        std::thread::Builder::new()
            .name("worker".into())
            .spawn(move || {
                sim.write_labeled(PER_THREAD_STREAM, p, 4096, "worker thread").unwrap();
                // A host wait on handle 2 waits for this thread's stream only.
                sim.stream_synchronize(0, PER_THREAD_STREAM).unwrap();
                sim.stream_id(0, PER_THREAD_STREAM).unwrap()
            })
            .unwrap()
            .join()
            .unwrap()
    };
    assert_ne!(other, mine);
    assert_eq!(sim.queued(PER_THREAD_STREAM).unwrap(), 1);
    sim.run();
    let races = sim.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!((races[0].earlier.thread.as_str(), races[0].earlier.stream), ("worker", PER_THREAD_STREAM));
    assert_eq!(races[0].later.label, "main thread");
}

#[test]
fn the_pool_reuses_a_block_on_the_same_stream_without_waiting() {
    let sim = sim();
    let s = stream(&sim, false);
    let pool = sim.pool_current(0, false).unwrap();
    assert_eq!(pool, sim.pool_default(0, false).unwrap());
    let p = sim.pool_alloc_async(0, pool, 65536, s).unwrap();
    assert_eq!(sim.pointer_pool(0, p + 100).unwrap(), Some(pool));
    // Keeps `p` apart from the chunk's never-used rest, which would fit too.
    let guard = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    sim.write(s, p, 65536).unwrap();
    sim.free_async(0, p, s).unwrap();
    let q = sim.pool_alloc_async(0, pool, 65536, s).unwrap();
    assert_eq!(p, q, "preferred over never-used memory");
    assert_eq!(sim.queued(s).unwrap(), 1, "no wait inserted");
    sim.write(s, q, 65536).unwrap();
    sim.free_async(0, q, s).unwrap();
    sim.free_async(0, guard, s).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn a_chunk_is_not_released_under_queued_work() {
    // A buggy program: c writes a block that a then frees with no ordering. The free
    // completes at once, but the chunk must stay until c's write has run.
    let sim = sim();
    let (a, c) = (stream(&sim, false), stream(&sim, false));
    let pool = sim.pool_default(0, false).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, a).unwrap();
    sim.write(c, p, 4096).unwrap();
    sim.free_async(0, p, a).unwrap();
    sim.stream_synchronize(0, a).unwrap();
    sim.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), CHUNK);
    sim.run();
    sim.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 0);
}

#[test]
fn cross_stream_reuse_orders_the_allocating_stream_only() {
    let sim = sim();
    let (a, b, c) = (stream(&sim, false), stream(&sim, false), stream(&sim, false));
    let pool = sim.pool_default(0, false).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, a).unwrap();
    sim.write_labeled(a, p, 4096, "first owner").unwrap();
    sim.free_async(0, p, a).unwrap();
    // The write has not run: b gets the block with a wait on a's free point.
    let q = sim.pool_alloc_async(0, pool, 4096, b).unwrap();
    assert_eq!(p, q);
    assert_eq!(sim.queued(b).unwrap(), 1, "the driver's inserted wait");
    sim.write_labeled(b, q, 4096, "second owner").unwrap();
    assert!(!sim.step(b).unwrap());
    // A third stream that uses the memory with no ordering of its own is caught.
    sim.write_labeled(c, q, 4096, "third stream").unwrap();
    sim.run();
    let races = sim.races();
    assert!(!races.is_empty());
    assert!(races.iter().all(|r| r.earlier.stream == c || r.later.stream == c), "{races:?}");
    assert!(races.iter().any(|r| r.to_string().contains("third stream")), "{races:?}");
}

#[test]
fn reuse_after_the_free_completed_needs_no_wait() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let pool = sim.pool_create(0, &PoolProps::default()).unwrap();
    sim.pool_set_attr(0, pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, a).unwrap();
    sim.write(a, p, 4096).unwrap();
    sim.free_async(0, p, a).unwrap();
    sim.stream_synchronize(0, a).unwrap();
    let q = sim.pool_alloc_async(0, pool, 4096, b).unwrap();
    assert_eq!(p, q);
    assert_eq!(sim.queued(b).unwrap(), 0);
    sim.write(b, q, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn the_legacy_stream_orders_with_other_threads_per_thread_streams() {
    // Another thread cannot name a thread's per-thread stream (handle 2 is its own), but
    // the legacy stream synchronises with it as with any blocking stream, both ways.
    let sim = sim();
    let p = sim.mem_alloc(0, 4096).unwrap();
    let on_worker = |f: fn(&SimDevice, DevPtr)| {
        let sim = sim.clone();
        std::thread::spawn(move || f(&sim, p)).join().unwrap()
    };
    let non_blocking = stream(&sim, false);
    let event = sim.event_create(0).unwrap();

    // The worker's write, then the legacy stream's read and an event recorded there.
    on_worker(|sim, p| sim.write_labeled(PER_THREAD_STREAM, p, 4096, "worker's write").unwrap());
    sim.read_labeled(LEGACY_STREAM, p, 4096, "legacy read").unwrap();
    sim.event_record(0, event, LEGACY_STREAM).unwrap();
    sim.stream_wait_event(0, non_blocking, event).unwrap();
    sim.read_labeled(non_blocking, p, 4096, "waiter's read").unwrap();
    // Nothing of the worker's has run: the legacy read cannot run first.
    assert!(!sim.step(LEGACY_STREAM).unwrap());
    // A host wait on an event recorded on the legacy stream waits for the worker's write.
    sim.event_synchronize(0, event).unwrap();
    assert_eq!(sim.queued(LEGACY_STREAM).unwrap(), 0);
    sim.run();

    // The other way: a legacy write, then a write on another thread's per-thread stream.
    sim.write_labeled(LEGACY_STREAM, p, 4096, "legacy write").unwrap();
    on_worker(|sim, p| sim.write_labeled(PER_THREAD_STREAM, p, 4096, "worker's later write").unwrap());
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());

    // A third thread's per-thread stream is not ordered after the worker's.
    on_worker(|sim, p| sim.write_labeled(PER_THREAD_STREAM, p, 4096, "worker's write").unwrap());
    sim.read_labeled(PER_THREAD_STREAM, p, 4096, "main's per-thread read").unwrap();
    sim.run();
    assert_eq!(sim.take_races().len(), 1);
}

#[test]
fn a_free_on_the_legacy_stream_is_ordered_after_blocking_streams() {
    // An allocation made on one thread's per-thread stream, freed on the legacy stream
    // by another thread, reused on a non-blocking stream.
    let sim = sim();
    let pool = sim.pool_default(0, false).unwrap();
    let p = {
        let sim = sim.clone();
        std::thread::spawn(move || {
            let p = sim.pool_alloc_async(0, pool, 2048, PER_THREAD_STREAM).unwrap();
            sim.write(PER_THREAD_STREAM, p, 2048).unwrap();
            p
        })
        .join()
        .unwrap()
    };
    sim.free_async(0, p, LEGACY_STREAM).unwrap();
    let s = stream(&sim, false);
    let q = sim.pool_alloc_async(0, pool, 2048, s).unwrap();
    assert_eq!(p, q);
    sim.write(s, q, 2048).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn pool_allocations_and_frees_on_the_legacy_stream_are_barriers() {
    // cuMemAllocAsync and cuMemFreeAsync use standard default stream semantics: on the legacy
    // stream each is an action after every blocking stream's earlier work and before its
    // later work. On a blocking stream of its own, neither orders other streams.
    for call in ["cuMemAllocFromPoolAsync", "cuMemFreeAsync"] {
        for legacy in [true, false] {
            let sim = sim();
            let (a, b) = (stream(&sim, true), stream(&sim, true));
            let on = if legacy { LEGACY_STREAM } else { stream(&sim, true) };
            let pool = sim.pool_default(0, false).unwrap();
            let held = sim.pool_alloc_async(0, pool, 4096, on).unwrap();
            sim.run();
            let p = sim.mem_alloc(0, 4096).unwrap();
            sim.write_labeled(a, p, 4096, "write on blocking a").unwrap();
            match call {
                "cuMemFreeAsync" => sim.free_async(0, held, on).unwrap(),
                _ => drop(sim.pool_alloc_async(0, pool, 4096, on).unwrap()),
            }
            sim.read_labeled(b, p, 4096, "read on blocking b").unwrap();
            sim.run();
            assert_eq!(sim.take_races().len(), usize::from(!legacy), "{call}, legacy {legacy}");
        }
    }
}

#[test]
fn out_of_memory_is_the_drivers_error() {
    let sim = SimDevice::new(8 * MIB);
    let s = stream(&sim, false);
    let pool = sim.pool_default(0, false).unwrap();
    let expect_oom = |r: Result<DevPtr>, call: &str| match r {
        Err(e @ Error::Driver { .. }) => {
            assert!(e.is_out_of_memory());
            let Error::Driver { call: c, code, name, .. } = e else { unreachable!() };
            assert_eq!(
                (c, code, name.as_str()),
                (call, CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY")
            );
        }
        other => panic!("expected out of memory from {call}, got {other:?}"),
    };
    expect_oom(sim.mem_alloc(0, 8 * MIB + 1), "cuMemAlloc");
    expect_oom(sim.mem_alloc(0, usize::MAX), "cuMemAlloc");
    expect_oom(sim.mem_alloc_managed(0, 9 * MIB), "cuMemAllocManaged");
    expect_oom(sim.pool_alloc_async(0, pool, 9 * MIB, s), "cuMemAllocFromPoolAsync");
    expect_oom(sim.pool_alloc_async(0, pool, usize::MAX, s), "cuMemAllocFromPoolAsync");
    assert!(matches!(sim.mem_alloc(0, 0), Err(Error::Driver { code: CUDA_ERROR_INVALID_VALUE, .. })));
    let big = sim.mem_alloc(0, 6 * MIB).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap(), (2 * MIB, 8 * MIB));
    let small = sim.pool_alloc_async(0, pool, MIB, s).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap(), (0, 8 * MIB));
    expect_oom(sim.pool_alloc_async(0, pool, 2 * MIB, s), "cuMemAllocFromPoolAsync");
    expect_oom(sim.mem_alloc(0, 256), "cuMemAlloc");
    // Pinned host memory does not count.
    let pinned = sim.mem_host_alloc(0, 16 * MIB).unwrap();
    // The pool still serves what fits in its chunk.
    let more = sim.pool_alloc_async(0, pool, MIB, s).unwrap();
    sim.free_async(0, more, s).unwrap();
    sim.free_async(0, small, s).unwrap();
    // Its idle chunk makes room for a larger one (released before growing).
    sim.stream_synchronize(0, s).unwrap();
    sim.mem_free(0, big).unwrap();
    let whole = sim.pool_alloc_async(0, pool, 8 * MIB, s).unwrap();
    sim.free_async(0, whole, s).unwrap();
    sim.mem_free_host(0, pinned).unwrap();
}

#[test]
fn a_zero_release_threshold_releases_at_synchronisation() {
    let sim = sim();
    let s = stream(&sim, false);
    let pool = sim.pool_default(0, false).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReleaseThreshold), 0);
    let p = sim.pool_alloc_async(0, pool, MIB, s).unwrap();
    sim.write(s, p, MIB).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), CHUNK);
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemCurrent), MIB);
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB - CHUNK);
    sim.free_async(0, p, s).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemCurrent), 0);
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), CHUNK, "nothing released before a sync");
    sim.stream_synchronize(0, s).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 0);
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemHigh), CHUNK);
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemHigh), MIB);
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB);

    // With the threshold at its maximum, a pool keeps what it has.
    sim.pool_set_attr(0, pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
    let p = sim.pool_alloc_async(0, pool, 3 * MIB, s).unwrap();
    sim.free_async(0, p, s).unwrap();
    sim.ctx_synchronize(0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 2 * CHUNK);
    // High-water marks reset to the current value when set to 0.
    sim.pool_set_attr(0, pool, PoolAttr::UsedMemHigh, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemHigh), 0);
    sim.pool_set_attr(0, pool, PoolAttr::ReservedMemHigh, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemHigh), 2 * CHUNK);
    assert!(matches!(sim.pool_set_attr(0, pool, PoolAttr::UsedMemHigh, 5), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        sim.pool_set_attr(0, pool, PoolAttr::UsedMemCurrent, 0),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn trim_releases_idle_chunks_only() {
    let sim = sim();
    let s = stream(&sim, false);
    let pool = sim.pool_create(0, &PoolProps::default()).unwrap();
    sim.pool_set_attr(0, pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
    let big = sim.pool_alloc_async(0, pool, 3 * MIB, s).unwrap();
    let small = sim.pool_alloc_async(0, pool, 2 * MIB, s).unwrap();
    let kept = sim.pool_alloc_async(0, pool, 2 * MIB, s).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 4 * MIB + 2 * CHUNK);
    sim.write(s, big, 3 * MIB).unwrap();
    sim.free_async(0, big, s).unwrap();
    sim.free_async(0, small, s).unwrap();
    // The write before the free has not run: nothing can be released.
    sim.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 4 * MIB + 2 * CHUNK);
    sim.stream_synchronize(0, s).unwrap();
    sim.pool_trim_to(0, pool, 5 * MIB).unwrap();
    let left = attr(&sim, pool, PoolAttr::ReservedMemCurrent);
    assert!((CHUNK..=5 * MIB).contains(&left), "{left}");
    sim.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), CHUNK, "the chunk in use stays");
    sim.free_async(0, kept, s).unwrap();
    sim.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(attr(&sim, pool, PoolAttr::ReservedMemCurrent), 0);
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB);
}

#[test]
fn pools_are_created_made_current_and_destroyed() {
    let sim = sim();
    let s = stream(&sim, false);
    let default = sim.pool_default(0, false).unwrap();
    let managed = sim.pool_default(0, true).unwrap();
    assert_ne!(default, managed);
    assert_eq!(sim.pool_current(0, true).unwrap(), managed);
    let mine = sim.pool_create(0, &PoolProps { posix_fd_ipc: true, managed: false }).unwrap();
    assert!(![default, managed].contains(&mine));
    sim.pool_set_current(0, mine).unwrap();
    assert_eq!(sim.pool_current(0, false).unwrap(), mine);
    assert_eq!(sim.pool_current(0, true).unwrap(), managed);
    let m = sim.pool_alloc_async(0, managed, 4096, s).unwrap();
    assert_eq!(sim.pointer_pool(0, m).unwrap(), Some(managed));
    let plain = sim.mem_alloc_managed(0, 4096).unwrap();
    assert_eq!(sim.pointer_pool(0, plain).unwrap(), None);
    sim.prefetch_async(0, plain, 4096, Location::Device(0), s).unwrap();
    sim.prefetch_async(0, m, 4096, Location::Host, s).unwrap();
    assert!(sim.prefetch_async(0, m, 4096, Location::Device(3), s).is_err());

    assert!(matches!(sim.pool_destroy(0, default), Err(Error::InvalidArgument(_))));
    // Destroyed with an allocation live: refused for new work, released once it is freed.
    let p = sim.pool_alloc_async(0, mine, 4096, s).unwrap();
    sim.pool_destroy(0, mine).unwrap();
    assert_eq!(sim.pool_current(0, false).unwrap(), default);
    for r in [
        sim.pool_alloc_async(0, mine, 16, s).map(drop),
        sim.pool_get_attr(0, mine, PoolAttr::UsedMemCurrent).map(drop),
        sim.pool_destroy(0, mine),
        sim.pool_set_current(0, mine),
    ] {
        assert!(matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(&format!("{mine:#x}"))), "{r:?}");
    }
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB - CHUNK - 4096 - CHUNK);
    sim.free_async(0, p, s).unwrap();
    sim.ctx_synchronize(0).unwrap();
    sim.free_async(0, m, s).unwrap();
    sim.mem_free(0, plain).unwrap();
    sim.ctx_synchronize(0).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB);
    assert!(matches!(
        sim.pool_get_attr(0, 0x1234, PoolAttr::ReleaseThreshold),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_closed_device_refuses_calls_but_allows_frees() {
    let sim = sim();
    let s = stream(&sim, false);
    let e = sim.event_create(0).unwrap();
    let pool = sim.pool_create(0, &PoolProps::default()).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    let d = sim.mem_alloc(0, 4096).unwrap();
    let h = sim.mem_host_alloc(0, 4096).unwrap();
    sim.write(s, d, 4096).unwrap();
    sim.deactivate();
    assert!(sim.is_closed());
    let closed = |r: Result<()>| match r {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("is closed; objects made under it cannot be used outside it"), "{m}")
        }
        other => panic!("expected closed, got {other:?}"),
    };
    closed(sim.mem_alloc(0, 16).map(drop));
    closed(sim.stream_synchronize(0, s));
    closed(sim.write(s, d, 16));
    closed(sim.step(s).map(drop));
    closed(sim.driver_version().map(drop));
    closed(sim.pool_alloc_async(0, pool, 16, s).map(drop));
    closed(sim.event_record(0, e, s));
    assert!(!sim.step_any());
    sim.run();
    assert!(matches!(sim.activate(), Err(Error::InvalidArgument(_))));
    // The free family succeeds silently, even for nonsense.
    sim.free_async(0, p, s).unwrap();
    sim.mem_free(0, d).unwrap();
    sim.mem_free_host(0, h).unwrap();
    sim.mem_free(0, 0xbad).unwrap();
    sim.pool_destroy(0, pool).unwrap();
    sim.event_destroy(0, e).unwrap();
    sim.stream_destroy(0, s).unwrap();
}

#[test]
fn several_devices_keep_their_streams_apart() {
    let sim = SimDevice::with_devices(16 * MIB, 2);
    assert_eq!(sim.device_count().unwrap(), 2);
    let s1 = sim.stream_create(1, false).unwrap();
    assert_eq!(sim.stream_device(s1).unwrap(), 1);
    assert!(matches!(sim.stream_synchronize(0, s1), Err(Error::InvalidStream(_))));
    sim.stream_synchronize(1, s1).unwrap();
    assert!(matches!(sim.mem_alloc(2, 16), Err(Error::InvalidArgument(_))));
    assert_ne!(sim.pool_default(0, false).unwrap(), sim.pool_default(1, false).unwrap());
    assert_ne!(sim.stream_id(0, LEGACY_STREAM).unwrap(), sim.stream_id(1, LEGACY_STREAM).unwrap());
    let p = sim.mem_alloc(1, 15 * MIB).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 16 * MIB);
    assert_eq!(sim.mem_get_info(1).unwrap().0, MIB);
    sim.write(s1, p, 16).unwrap();
    sim.mem_free(1, p).unwrap();
    assert!(sim.describe().contains("2 devices, 16 MiB each"), "{}", sim.describe());
}

#[test]
fn races_are_deduplicated_and_capped() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    // One write over many segments: one race per pair of operations.
    for i in 0..16 {
        sim.write(a, p + i * 256, 128).unwrap();
    }
    sim.write(b, p, 4096).unwrap();
    sim.run();
    let races = sim.take_races();
    assert_eq!(races.len(), 16);
    sim.mem_free(0, p).unwrap();
    let q = sim.mem_alloc(0, 256 * 1100).unwrap();
    for i in 0..1100u64 {
        sim.write(a, q + i * 256, 256).unwrap();
        sim.write(b, q + i * 256, 256).unwrap();
    }
    sim.run();
    assert_eq!(sim.races().len(), MAX_RACES);
    assert_eq!(sim.races_dropped(), 100);
}

#[test]
fn many_threads_may_drive_the_device_at_once() {
    let sim = sim();
    let pool = sim.pool_default(0, false).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let sim = sim.clone();
            std::thread::spawn(move || {
                let s = sim.stream_create(0, false).unwrap();
                for i in 0..200 {
                    let p = sim.pool_alloc_async(0, pool, 1000 + i, s).unwrap();
                    sim.write(s, p, 1000 + i).unwrap();
                    sim.free_async(0, p, s).unwrap();
                    if i % 3 == 0 {
                        sim.step_any();
                    }
                }
                sim.stream_synchronize(0, s).unwrap();
                sim.stream_destroy(0, s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    assert_eq!(attr(&sim, pool, PoolAttr::UsedMemCurrent), 0);
}

fn is_invalid_value(r: Result<impl std::fmt::Debug>, call: &str) -> bool {
    matches!(r, Err(Error::Driver { call: c, code: CUDA_ERROR_INVALID_VALUE, .. }) if c == call)
}

#[test]
fn prefetch_records_the_last_location_asked_for_per_range() {
    let sim = SimDevice::with_devices(64 * MIB, 2);
    let s = stream(&sim, false);
    let m = sim.mem_alloc_managed(0, 8192).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 8192).unwrap(), None, "never prefetched");
    sim.prefetch_async(0, m, 8192, Location::Device(0), s).unwrap();
    // The request, as the driver reports it: before the prefetch has run.
    assert_eq!(sim.queued(s).unwrap(), 1);
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 8192).unwrap(), Some(Location::Device(0)));
    sim.prefetch_async(0, m + 4096, 4096, Location::Host, s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 4096).unwrap(), Some(Location::Device(0)));
    assert_eq!(sim.mem_range_last_prefetch_location(0, m + 4096, 4096).unwrap(), Some(Location::Host));
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 8192).unwrap(), None, "split between two places");
    sim.prefetch_async(0, m, 4096, Location::Device(1), s).unwrap();
    sim.prefetch_async(0, m + 4096, 4096, Location::Device(1), s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 8192).unwrap(), Some(Location::Device(1)));
    sim.stream_synchronize(0, s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, m, 8192).unwrap(), Some(Location::Device(1)));
    // A managed pool's memory too; a new allocation starts with no location.
    let pool = sim.pool_default(0, true).unwrap();
    let p = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, p, 4096).unwrap(), None);
    sim.prefetch_async(0, p, 4096, Location::Host, s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, p, 4096).unwrap(), Some(Location::Host));
    sim.free_async(0, p, s).unwrap();
    let q = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    assert_eq!(sim.mem_range_last_prefetch_location(0, q, 4096).unwrap(), None);
    sim.free_async(0, q, s).unwrap();
    sim.mem_free(0, m).unwrap();
    assert!(sim.races().is_empty());
}

#[test]
fn prefetch_advice_and_queries_refuse_memory_that_is_not_managed() {
    let sim = sim();
    let s = stream(&sim, false);
    let device = sim.mem_alloc(0, 4096).unwrap();
    let pinned = sim.mem_host_alloc(0, 4096).unwrap();
    let pool = sim.pool_default(0, false).unwrap();
    let from_pool = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    for ptr in [device, pinned, from_pool] {
        assert!(is_invalid_value(
            sim.prefetch_async(0, ptr, 4096, Location::Device(0), s),
            "cuMemPrefetchAsync"
        ));
        for advice in [Advice::SetReadMostly, Advice::SetPreferredLocation, Advice::UnsetAccessedBy] {
            assert!(is_invalid_value(
                sim.mem_advise(0, ptr, 4096, advice, Location::Device(0)),
                "cuMemAdvise"
            ));
        }
        assert!(is_invalid_value(
            sim.mem_range_last_prefetch_location(0, ptr, 4096),
            "cuMemRangeGetAttribute"
        ));
    }
    assert_eq!(sim.queued(s).unwrap(), 0, "nothing enqueued");
    // Managed memory: every advice, for the device or the host.
    let m = sim.mem_alloc_managed(0, 4096).unwrap();
    for advice in Advice::ALL {
        sim.mem_advise(0, m, 4096, advice, Location::Device(0)).unwrap();
        sim.mem_advise(0, m, 4096, advice, Location::Host).unwrap();
    }
    // A device that does not exist, except where the location is ignored.
    assert!(matches!(
        sim.mem_advise(0, m, 4096, Advice::SetPreferredLocation, Location::Device(5)),
        Err(Error::InvalidArgument(_))
    ));
    sim.mem_advise(0, m, 4096, Advice::SetReadMostly, Location::Device(5)).unwrap();
    // Past the end, or freed: not a live allocation.
    assert!(matches!(
        sim.mem_advise(0, m, 4097, Advice::SetReadMostly, Location::Host),
        Err(Error::InvalidPointer(_))
    ));
    sim.free_async(0, from_pool, s).unwrap();
    for ptr in [device, m] {
        sim.mem_free(0, ptr).unwrap();
    }
    sim.mem_free_host(0, pinned).unwrap();
    assert!(matches!(
        sim.mem_advise(0, m, 16, Advice::SetReadMostly, Location::Host),
        Err(Error::InvalidPointer(_))
    ));
    assert!(matches!(sim.prefetch_async(0, m, 16, Location::Host, s), Err(Error::InvalidPointer(_))));
}

#[test]
fn managed_pool_memory_takes_prefetches_but_no_advice() {
    // As the driver (580, on an H200) does: CUDA_ERROR_NOT_SUPPORTED from cuMemAdvise.
    let sim = SimDevice::new(64 * MIB);
    let s = sim.stream_create(0, false).unwrap();
    for pool in [
        sim.pool_default(0, true).unwrap(),
        sim.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }).unwrap(),
    ] {
        let p = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
        for advice in [Advice::SetReadMostly, Advice::SetPreferredLocation, Advice::UnsetAccessedBy] {
            match sim.mem_advise(0, p, 4096, advice, Location::Device(0)) {
                Err(Error::Driver { call: "cuMemAdvise", code: CUDA_ERROR_NOT_SUPPORTED, .. }) => {}
                other => panic!("{advice:?}: {other:?}"),
            }
        }
        sim.prefetch_async(0, p, 4096, Location::Host, s).unwrap();
        assert_eq!(sim.mem_range_last_prefetch_location(0, p, 4096).unwrap(), Some(Location::Host));
        sim.free_async(0, p, s).unwrap();
    }
}

#[test]
fn the_default_capacity_fits_the_host() {
    let capacity = default_capacity();
    assert!((MIB..=MAX_DEFAULT_CAPACITY).contains(&capacity), "{capacity}");
    assert_eq!(capacity % MIB, 0);
    if let Some(available) =
        std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| proc_field(&m, "MemAvailable:"))
    {
        // What was available a moment ago, give or take what other processes did since.
        assert!(capacity <= (available << 10) * 2, "{capacity} vs {available} KiB available");
    }
    assert_eq!(proc_field("Max address space  unlimited  unlimited  bytes\n", "Max address space"), None);
    assert_eq!(proc_field("VmSize:\t  1024 kB\n", "VmSize:"), Some(1024));
}

#[test]
fn device_counts_are_clamped() {
    assert_eq!(SimDevice::with_devices(MIB, 0).device_count().unwrap(), 1);
    assert_eq!(SimDevice::with_devices(MIB, -3).device_count().unwrap(), 1);
    assert_eq!(SimDevice::with_devices(MIB, i32::MAX).device_count().unwrap(), MAX_DEVICES);
}

#[test]
fn an_older_driver_or_a_gpu_without_concurrent_managed_access_has_no_managed_pools() {
    let sim = sim();
    assert!(sim.device_info(0).unwrap().managed_pools);
    sim.set_driver_version(12040);
    assert_eq!(sim.driver_version().unwrap(), 12040);
    assert!(!sim.device_info(0).unwrap().managed_pools);
    for r in [
        sim.pool_default(0, true),
        sim.pool_current(0, true),
        sim.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }),
    ] {
        match r {
            Err(Error::Unsupported(m)) => {
                assert_eq!(m, "managed memory pools need a CUDA 13 driver (found 12.4)")
            }
            other => panic!("{other:?}"),
        }
    }
    sim.pool_default(0, false).unwrap();
    sim.set_driver_version(13000);
    sim.set_concurrent_managed_access(false);
    let info = sim.device_info(0).unwrap();
    assert!(!info.managed_pools && !info.concurrent_managed_access);
    match sim.pool_default(0, true) {
        Err(Error::Unsupported(m)) => assert!(m.contains("concurrent managed access"), "{m}"),
        other => panic!("{other:?}"),
    }
    sim.set_concurrent_managed_access(true);
    sim.pool_default(0, true).unwrap();
}

#[test]
fn without_concurrent_managed_access_advice_naming_a_gpu_is_refused() {
    // As the driver documents cuMemAdvise: a GPU as preferred location, or as accessed by,
    // needs CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS; the host, and other advice, do not.
    let sim = sim();
    let m = sim.mem_alloc_managed(0, 4096).unwrap();
    sim.set_concurrent_managed_access(false);
    for advice in [Advice::SetPreferredLocation, Advice::SetAccessedBy] {
        match sim.mem_advise(0, m, 4096, advice, Location::Device(0)) {
            Err(Error::Driver { call: "cuMemAdvise", code: CUDA_ERROR_INVALID_DEVICE, .. }) => {}
            other => panic!("{advice:?}: {other:?}"),
        }
        sim.mem_advise(0, m, 4096, advice, Location::Host).unwrap();
    }
    for advice in [Advice::UnsetPreferredLocation, Advice::UnsetAccessedBy, Advice::SetReadMostly] {
        sim.mem_advise(0, m, 4096, advice, Location::Device(0)).unwrap();
    }
    sim.set_concurrent_managed_access(true);
    sim.mem_advise(0, m, 4096, Advice::SetAccessedBy, Location::Device(0)).unwrap();
}

#[test]
fn work_on_one_device_needs_access_to_anothers_memory() {
    let sim = SimDevice::with_devices(16 * MIB, 2);
    let s1 = sim.stream_create(1, false).unwrap();
    let plain = sim.mem_alloc(0, 4096).unwrap();
    let pool = sim.pool_create(0, &PoolProps::default()).unwrap();
    let pooled = sim.pool_alloc_async(0, pool, 4096, LEGACY_STREAM).unwrap();
    let managed = sim.mem_alloc_managed(0, 4096).unwrap();
    let pinned = sim.mem_host_alloc(0, 4096).unwrap();
    let mine = sim.mem_alloc(1, 4096).unwrap();
    let refused = |r: Result<()>, what: &str| match r {
        Err(Error::InvalidPointer(m)) => {
            assert!(m.contains("memory of device 0") && m.contains("device 1 cannot access"), "{m}");
            assert!(m.contains(what), "{m} lacks {what}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Without access: kernels, memsets and plain copies are refused, naming the grant.
    refused(sim.read(s1, plain, 4096), "cuCtxEnablePeerAccess");
    refused(sim.write(s1, pooled, 4096), "cuMemPoolSetAccess");
    refused(sim.memset_d8_async(1, pooled, 1, 4096, s1), "cuMemPoolSetAccess");
    // SAFETY: simulated memory on both sides (refused before anything is enqueued).
    refused(unsafe { sim.memcpy_async(1, mine, pooled, 4096, s1) }, "cuMemPoolSetAccess");
    assert_eq!(sim.queued(s1).unwrap(), 0, "nothing was enqueued");
    // A plain copy of `cuMemAlloc` memory is a peer copy under unified addressing.
    // SAFETY: simulated memory on both sides.
    unsafe { sim.memcpy_async(1, mine, plain, 4096, s1) }.unwrap();
    sim.stream_synchronize(1, s1).unwrap();
    // Managed and pinned memory are everyone's; a device's own memory is its own.
    sim.read(s1, managed, 4096).unwrap();
    sim.read(s1, pinned, 4096).unwrap();
    sim.write(s1, mine, 4096).unwrap();
    // A pool grant covers pool memory only; a context grant covers `cuMemAlloc` memory only.
    assert!(!sim.pool_get_access(0, pool, 1).unwrap());
    assert!(sim.pool_get_access(0, pool, 0).unwrap(), "the owner always has access");
    sim.pool_set_access(0, pool, 1, true).unwrap();
    assert!(sim.pool_get_access(0, pool, 1).unwrap());
    sim.read(s1, pooled, 4096).unwrap();
    refused(sim.read(s1, plain, 4096), "cuCtxEnablePeerAccess");
    sim.ctx_enable_peer_access(1, 0).unwrap();
    sim.ctx_enable_peer_access(1, 0).unwrap();
    sim.read(s1, plain, 4096).unwrap();
    // Withdrawn, the pool's memory is refused again; the other pool of device 0 never had it.
    sim.pool_set_access(0, pool, 1, false).unwrap();
    refused(sim.read(s1, pooled, 4096), "cuMemPoolSetAccess");
    let default = sim.pool_default(0, false).unwrap();
    let other = sim.pool_alloc_async(0, default, 4096, LEGACY_STREAM).unwrap();
    refused(sim.read(s1, other, 4096), "cuMemPoolSetAccess");
    // The owner's access cannot be withdrawn.
    assert!(is_invalid_value(sim.pool_set_access(0, pool, 0, false), "cuMemPoolSetAccess"));
    sim.pool_set_access(0, pool, 0, true).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    for p in [pooled, other] {
        sim.free_async(0, p, LEGACY_STREAM).unwrap();
    }
    for p in [plain, managed, mine] {
        sim.mem_free(if p == mine { 1 } else { 0 }, p).unwrap();
    }
    sim.mem_free_host(0, pinned).unwrap();
}

#[test]
fn devices_without_a_peer_path_refuse_grants() {
    let sim = SimDevice::with_devices(16 * MIB, 3);
    assert!(sim.device_can_access_peer(0, 1).unwrap());
    assert!(!sim.device_can_access_peer(1, 1).unwrap(), "not its own peer");
    assert!(matches!(sim.device_can_access_peer(0, 3), Err(Error::InvalidArgument(_))));
    sim.set_peer_capable(0, 2, false).unwrap();
    assert!(!sim.device_can_access_peer(2, 0).unwrap() && !sim.device_can_access_peer(0, 2).unwrap());
    assert!(sim.device_can_access_peer(1, 2).unwrap());
    let pool = sim.pool_create(0, &PoolProps::default()).unwrap();
    let code = |r: Result<()>| match r {
        Err(Error::Driver { code, .. }) => code,
        other => panic!("expected a driver error, got {other:?}"),
    };
    assert_eq!(code(sim.pool_set_access(0, pool, 2, true)), 101, "CUDA_ERROR_INVALID_DEVICE");
    assert_eq!(code(sim.ctx_enable_peer_access(2, 0)), 217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED");
    assert_eq!(code(sim.ctx_enable_peer_access(1, 1)), 101);
    assert!(matches!(sim.set_peer_capable(0, 3, true), Err(Error::InvalidArgument(_))));
    // Copies need no peer path.
    let s2 = sim.stream_create(2, false).unwrap();
    let src = sim.pool_alloc_async(0, pool, 4096, LEGACY_STREAM).unwrap();
    sim.memset_d8_async(0, src, 9, 4096, LEGACY_STREAM).unwrap();
    sim.stream_synchronize(0, LEGACY_STREAM).unwrap();
    let dst = sim.mem_alloc(2, 4096).unwrap();
    // SAFETY: simulated memory on both sides.
    unsafe { sim.memcpy_peer_async(2, dst, 2, src, 0, 4096, s2) }.unwrap();
    sim.ctx_synchronize(2).unwrap();
    let mut host = vec![0u8; 4096];
    // SAFETY: `host` outlives the copy, which completes in the synchronisation below.
    unsafe { sim.memcpy_async(2, host.as_mut_ptr() as u64, dst, 4096, s2) }.unwrap();
    sim.stream_synchronize(2, s2).unwrap();
    assert!(host.iter().all(|&b| b == 9));
    // The sides must be the devices named.
    // SAFETY: refused before anything is enqueued.
    let wrong = unsafe { sim.memcpy_peer_async(2, dst, 1, src, 0, 4096, s2) };
    assert!(
        matches!(wrong, Err(Error::InvalidPointer(m)) if m.contains("memory of device 2, not of device 1"))
    );
    sim.free_async(0, src, LEGACY_STREAM).unwrap();
    sim.mem_free(2, dst).unwrap();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn a_copy_between_devices_is_ordered_by_events_across_them() {
    let sim = SimDevice::with_devices(16 * MIB, 2);
    let (s0, s1) = (sim.stream_create(0, false).unwrap(), sim.stream_create(1, false).unwrap());
    let src = sim.mem_alloc(0, 4096).unwrap();
    let dst = sim.mem_alloc(1, 4096).unwrap();
    sim.write_labeled(s0, src, 4096, "producer on device 0").unwrap();
    // Unordered: the copy on device 1 races with the write on device 0.
    // SAFETY: simulated memory on both sides.
    unsafe { sim.memcpy_peer_async(1, dst, 1, src, 0, 4096, s1) }.unwrap();
    sim.run();
    assert_eq!(sim.take_races().len(), 1);
    // Ordered through an event of device 0 that device 1's stream waits on.
    sim.write(s0, src, 4096).unwrap();
    let event = sim.event_create(0).unwrap();
    sim.event_record(0, event, s0).unwrap();
    sim.stream_wait_event(1, s1, event).unwrap();
    // SAFETY: as above.
    unsafe { sim.memcpy_peer_async(1, dst, 1, src, 0, 4096, s1) }.unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

/// Eager execution: work runs as it is enqueued once what it waits on has run, so events
/// complete at once.
#[test]
fn an_eager_device_runs_work_as_it_is_enqueued() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let p = sim.mem_alloc(0, 4096).unwrap();
    sim.write(a, p, 4096).unwrap();
    sim.set_eager(true);
    assert_eq!(sim.pending(), 0, "queued work runs when eager execution starts");
    let e = sim.event_create(0).unwrap();
    sim.write(a, p, 4096).unwrap();
    sim.event_record(0, e, a).unwrap();
    assert_eq!(sim.pending(), 0);
    assert!(sim.event_query(0, e).unwrap());
    sim.stream_wait_event(0, b, e).unwrap();
    sim.write(b, p, 4096).unwrap();
    assert_eq!(sim.pending(), 0);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    sim.set_eager(false);
    sim.write(a, p, 64).unwrap();
    assert_eq!(sim.pending(), 1);
}

// ---------------------------------------------------------------------------------------
// Virtual memory management
// ---------------------------------------------------------------------------------------

const G: usize = VMM_GRANULARITY;

fn is_driver_error(r: Result<impl std::fmt::Debug>, call: &str, code: i32) -> bool {
    matches!(r, Err(Error::Driver { call: c, code: k, .. }) if c == call && k == code)
}

/// Copies `bytes` from the host slice into simulated memory at `ptr` on `s`, and waits.
fn from_host(sim: &SimDevice, ptr: DevPtr, data: &[u8], s: RawStream) {
    // SAFETY: `data` outlives the copy, which completes in the synchronisation below.
    unsafe { sim.memcpy_async(0, ptr, data.as_ptr() as u64, data.len(), s) }.unwrap();
    sim.stream_synchronize(0, s).unwrap();
}

#[test]
fn vmm_adjacent_mappings_are_one_range() {
    let sim = sim();
    let s = stream(&sim, false);
    assert_eq!(sim.vmm_granularity(0).unwrap(), G);
    let base = sim.vmm_reserve(0, 4 * G).unwrap();
    assert_eq!(base % G as u64, 0, "reservations are aligned to the granularity");
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB, "address space costs no memory");
    let boundary = base + 2 * G as u64;
    let first = sim.vmm_map(0, base, 2 * G).unwrap();
    let second = sim.vmm_map(0, boundary, 2 * G).unwrap();
    assert_ne!(first, second);
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB - 4 * G);
    assert!(to_host(&sim, base, 4 * G, s).iter().all(|&b| b == 0), "mapped memory starts zeroed");

    // A memset over both, a copy from the host across the boundary, a copy within the
    // device from across the boundary to the end, a kernel across the boundary.
    sim.memset_d8_async(0, base, 0x11, 4 * G, s).unwrap();
    let pattern: Vec<u8> = (0..G).map(|i| (i % 251) as u8).collect();
    let at = boundary - (G / 2) as u64;
    from_host(&sim, at, &pattern, s);
    // SAFETY: both sides are mapped memory of this device.
    unsafe { sim.memcpy_async(0, base + 3 * G as u64, at, G, s) }.unwrap();
    sim.write(s, boundary - 64, 128).unwrap();
    sim.read(s, base, 4 * G).unwrap();
    let seen = to_host(&sim, base, 4 * G, s);
    let g = G;
    assert!(seen[..g + g / 2].iter().all(|&b| b == 0x11));
    assert_eq!(&seen[g + g / 2..2 * g - 64], &pattern[..g / 2 - 64]);
    let written = seen[2 * g - 64];
    assert!(written != 0 && seen[2 * g - 64..2 * g + 64].iter().all(|&b| b == written));
    assert_eq!(&seen[2 * g + 64..2 * g + g / 2], &pattern[g / 2 + 64..]);
    assert!(seen[2 * g + g / 2..3 * g].iter().all(|&b| b == 0x11));
    assert_eq!(&seen[3 * g..], &pattern[..]);
    assert!(sim.races().is_empty(), "{:?}", sim.races());

    sim.vmm_unmap(0, base, 2 * G, first).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB - 2 * G);
    // The second mapping stands alone, its data kept.
    assert_eq!(to_host(&sim, base + 3 * G as u64, G, s), pattern);
    sim.vmm_unmap(0, boundary, 2 * G, second).unwrap();
    sim.vmm_free(0, base, 4 * G).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB);
    // Mapped again, the same place is fresh memory.
    let again = sim.vmm_reserve(0, 2 * G).unwrap();
    let h = sim.vmm_map(0, again, 2 * G).unwrap();
    assert!(![first, second].contains(&h), "handles are not reused");
    assert!(to_host(&sim, again, 2 * G, s).iter().all(|&b| b == 0));
    sim.vmm_unmap(0, again, 2 * G, h).unwrap();
    sim.vmm_free(0, again, 2 * G).unwrap();
}

#[test]
fn vmm_refusals_are_the_drivers_and_change_nothing() {
    const INVALID: i32 = CUDA_ERROR_INVALID_VALUE;
    let sim = sim();
    let s = stream(&sim, false);
    let base = sim.vmm_reserve(0, 4 * G).unwrap();
    let h = sim.vmm_map(0, base + G as u64, G).unwrap();
    sim.memset_d8_async(0, base + G as u64, 0x5a, G, s).unwrap();
    let free = sim.mem_get_info(0).unwrap().0;
    let heap = sim.mem_alloc(0, 4096).unwrap();
    let free_after_heap = sim.mem_get_info(0).unwrap().0;
    let end = base + 4 * G as u64;

    // Reservations: sizes that are not a non-zero multiple of the granularity.
    for bytes in [0, 1, 4096, G + 4096, G - 1] {
        assert!(is_driver_error(sim.vmm_reserve(0, bytes), "cuMemAddressReserve", INVALID), "{bytes}");
    }
    // Maps: sizes (cuMemCreate), then places (cuMemMap).
    for bytes in [0, 1, G + 1, G / 2] {
        assert!(is_driver_error(sim.vmm_map(0, base, bytes), "cuMemCreate", INVALID), "{bytes}");
    }
    let bad_places = [
        (base + 4096, G),             // not on a granule
        (base + G as u64, G),         // over the mapping
        (base, 2 * G),                // partly over it
        (base + 3 * G as u64, 2 * G), // past the reservation's end
        (end, G),                     // just after it
        (base - G as u64, G),         // just before it
        (heap, G),                    // not reserved at all
        (u64::MAX - 4096, G),         // wrapping around
    ];
    for (ptr, bytes) in bad_places {
        assert!(is_driver_error(sim.vmm_map(0, ptr, bytes), "cuMemMap", INVALID), "{ptr:#x} +{bytes}");
    }
    // Unmaps: not the mapping's start, not its size, not its handle, not a mapping.
    assert!(is_driver_error(sim.vmm_unmap(0, base, G, h), "cuMemUnmap", INVALID));
    assert!(is_driver_error(sim.vmm_unmap(0, base + G as u64 + 4096, G - 4096, h), "cuMemUnmap", INVALID));
    assert!(is_driver_error(sim.vmm_unmap(0, base + G as u64, 2 * G, h), "cuMemUnmap", INVALID));
    assert!(is_driver_error(sim.vmm_unmap(0, base + G as u64, G / 2, h), "cuMemUnmap", INVALID));
    assert!(is_driver_error(sim.vmm_unmap(0, base + G as u64, G, h + 0x10), "cuMemRelease", INVALID));
    assert!(is_driver_error(sim.vmm_unmap(0, heap, 4096, h), "cuMemUnmap", INVALID));
    // Frees: not the reservation's start or size, and not while anything is mapped.
    assert!(is_driver_error(sim.vmm_free(0, base + G as u64, 3 * G), "cuMemAddressFree", INVALID));
    assert!(is_driver_error(sim.vmm_free(0, base, 2 * G), "cuMemAddressFree", INVALID));
    assert!(is_driver_error(sim.vmm_free(0, heap, 4096), "cuMemAddressFree", INVALID));
    match sim.vmm_free(0, base, 4 * G) {
        Err(e @ Error::Driver { call: "cuMemAddressFree", code: INVALID, .. }) => {
            let text = e.to_string();
            assert!(text.contains("1 mapping(s) are left") && text.contains("unmap them first"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    // Other calls refuse mapped memory as theirs.
    assert!(
        matches!(sim.mem_free(0, base + G as u64), Err(Error::InvalidPointer(m)) if m.contains("cuMemUnmap"))
    );
    assert!(matches!(sim.free_async(0, base + G as u64, s), Err(Error::InvalidPointer(_))));
    assert!(is_invalid_value(
        sim.prefetch_async(0, base + G as u64, G, Location::Device(0), s),
        "cuMemPrefetchAsync"
    ));
    assert_eq!(sim.pointer_pool(0, base + G as u64).unwrap(), None);

    // Nothing changed: the same memory free, the mapping there with its data, usable.
    assert_eq!(sim.mem_get_info(0).unwrap().0, free_after_heap);
    assert!(to_host(&sim, base + G as u64, G, s).iter().all(|&b| b == 0x5a));
    sim.write(s, base + G as u64, G).unwrap();
    sim.mem_free(0, heap).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, free);
    // And all of it is released properly.
    sim.vmm_unmap(0, base + G as u64, G, h).unwrap();
    assert!(is_driver_error(sim.vmm_unmap(0, base + G as u64, G, h), "cuMemUnmap", INVALID), "twice");
    sim.vmm_free(0, base, 4 * G).unwrap();
    assert!(is_driver_error(sim.vmm_free(0, base, 4 * G), "cuMemAddressFree", INVALID), "twice");
    assert_eq!(sim.mem_get_info(0).unwrap().0, 64 * MIB);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}

#[test]
fn vmm_mappings_count_against_the_capacity() {
    let sim = SimDevice::new(4 * G);
    let s = stream(&sim, false);
    // Address space is not memory: far more than the capacity may be reserved.
    let base = sim.vmm_reserve(0, 64 * G).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap(), (4 * G, 4 * G));
    let a = sim.vmm_map(0, base, 2 * G).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 2 * G);
    // Other memory competes for the rest.
    let plain = sim.mem_alloc(0, G).unwrap();
    let pool = sim.pool_default(0, false).unwrap();
    let pooled = sim.pool_alloc_async(0, pool, 4096, s).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 0);
    // Over the capacity: cuMemCreate's out of memory, and nothing changed.
    let err = sim.vmm_map(0, base + 2 * G as u64, G).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    assert!(is_driver_error(Err::<(), _>(err), "cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY));
    assert!(sim.memset_d8_async(0, base + 2 * G as u64, 1, 16, s).is_err(), "not mapped");
    assert!(sim.mem_alloc(0, G).unwrap_err().is_out_of_memory(), "mapped memory is taken");
    sim.free_async(0, pooled, s).unwrap();
    sim.pool_trim_to(0, pool, 0).unwrap();
    sim.stream_synchronize(0, s).unwrap();
    sim.pool_trim_to(0, pool, 0).unwrap();
    sim.mem_free(0, plain).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 2 * G);
    let b = sim.vmm_map(0, base + 2 * G as u64, 2 * G).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 0);
    sim.vmm_unmap(0, base, 2 * G, a).unwrap();
    sim.vmm_unmap(0, base + 2 * G as u64, 2 * G, b).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 4 * G);
    sim.vmm_free(0, base, 64 * G).unwrap();
}

#[test]
fn vmm_unmapped_parts_of_a_reservation_are_refused() {
    let sim = sim();
    let s = stream(&sim, false);
    let base = sim.vmm_reserve(0, 4 * G).unwrap();
    let (lo, hi) = (base + G as u64, base + 2 * G as u64);
    let h = sim.vmm_map(0, lo, G).unwrap();
    let mut host = vec![0u8; 4 * G];
    let plain = sim.mem_alloc(0, 4 * G).unwrap();
    let refused = |r: Result<()>| assert!(matches!(r, Err(Error::InvalidPointer(_))), "{r:?}");
    for (ptr, bytes) in [(base, 64), (lo - 32, 64), (hi - 32, 64), (hi, 64), (lo, G + 1), (base, 4 * G)] {
        refused(sim.memset_d8_async(0, ptr, 1, bytes, s));
        refused(sim.write(s, ptr, bytes));
        refused(sim.read(s, ptr, bytes));
        // Reserved address space is the device's, never foreign host memory.
        // SAFETY: refused before anything is enqueued.
        refused(unsafe { sim.memcpy_async(0, host.as_mut_ptr() as u64, ptr, bytes, s) });
        // SAFETY: as above.
        refused(unsafe { sim.memcpy_async(0, ptr, host.as_ptr() as u64, bytes, s) });
        // SAFETY: as above.
        refused(unsafe { sim.memcpy_async(0, ptr, plain, bytes, s) });
    }
    assert_eq!(sim.pending(), 0);
    // The mapped part takes all of them.
    sim.memset_d8_async(0, lo, 3, G, s).unwrap();
    // SAFETY: `host` outlives the copy (synchronised below).
    unsafe { sim.memcpy_async(0, host.as_mut_ptr() as u64, hi - 64, 64, s) }.unwrap();
    sim.stream_synchronize(0, s).unwrap();
    assert!(host[..64].iter().all(|&b| b == 3));
    // Once unmapped, no longer.
    sim.vmm_unmap(0, lo, G, h).unwrap();
    refused(sim.memset_d8_async(0, lo, 1, 64, s));
    match sim.write(s, lo, 64) {
        Err(Error::InvalidPointer(m)) => assert!(m.contains("not inside a live allocation"), "{m}"),
        other => panic!("{other:?}"),
    }
    sim.vmm_free(0, base, 4 * G).unwrap();
    // Nor once the reservation is gone (the address may be anything's now).
    refused(sim.memset_d8_async(0, lo, 1, 64, s));
}

#[test]
fn vmm_memory_of_one_reservation_on_two_devices_is_two_ranges() {
    let sim = SimDevice::with_devices(16 * G, 2);
    let s0 = sim.stream_create(0, false).unwrap();
    let s1 = sim.stream_create(1, false).unwrap();
    let base = sim.vmm_reserve(0, 4 * G).unwrap();
    let boundary = base + G as u64;
    let a = sim.vmm_map(0, base, G).unwrap();
    let b = sim.vmm_map(1, boundary, G).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 15 * G);
    assert_eq!(sim.mem_get_info(1).unwrap().0, 15 * G);
    sim.memset_d8_async(0, base, 1, G, s0).unwrap();
    sim.memset_d8_async(1, boundary, 2, G, s1).unwrap();
    // Each device reaches its own mapping only, and nothing spans the two.
    for (dev, stream, ptr) in [(0, s0, boundary), (1, s1, base)] {
        let err = sim.memset_d8_async(dev, ptr, 0, 64, stream).unwrap_err();
        assert!(matches!(&err, Error::InvalidPointer(m) if m.contains("cuMemSetAccess")), "{err:?}");
    }
    assert!(sim.memset_d8_async(0, boundary - 32, 0, 64, s0).is_err());
    // Copies between the devices' mappings go through cuMemcpyPeerAsync.
    // SAFETY: both sides are mapped memory of the devices named.
    unsafe { sim.memcpy_peer_async(1, boundary, 1, base, 0, 64, s1) }.unwrap();
    sim.ctx_synchronize(0).unwrap();
    sim.ctx_synchronize(1).unwrap();
    sim.vmm_unmap(0, base, G, a).unwrap();
    sim.vmm_unmap(1, boundary, G, b).unwrap();
    sim.vmm_free(0, base, 4 * G).unwrap();
    assert_eq!(sim.mem_get_info(1).unwrap().0, 16 * G);
}

#[test]
fn vmm_races_are_found_across_mappings_and_unmap_waits_for_the_device() {
    let sim = sim();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    let base = sim.vmm_reserve(0, 2 * G).unwrap();
    let boundary = base + G as u64;
    let h1 = sim.vmm_map(0, base, G).unwrap();
    let h2 = sim.vmm_map(0, boundary, G).unwrap();
    sim.write_labeled(a, boundary - 256, 512, "across").unwrap();
    sim.write_labeled(b, boundary - 64, 128, "unordered").unwrap();
    sim.run();
    let races = sim.take_races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].range, (boundary - 64, boundary + 64));
    // Ordered by an event, no race.
    let e = sim.event_create(0).unwrap();
    sim.write(a, base, 2 * G).unwrap();
    sim.event_record(0, e, a).unwrap();
    sim.stream_wait_event(0, b, e).unwrap();
    sim.read(b, boundary - 8, 16).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    // Unmapping is synchronous: queued work runs first, while the memory is there.
    sim.memset_d8_async(0, base, 9, 2 * G, a).unwrap();
    sim.memset_d8_async(0, boundary, 7, 16, b).unwrap();
    assert_eq!(sim.pending(), 2);
    sim.vmm_unmap(0, boundary, G, h2).unwrap();
    assert_eq!(sim.pending(), 0);
    assert!(to_host(&sim, base, G, a).iter().all(|&x| x == 9));
    sim.vmm_unmap(0, base, G, h1).unwrap();
    sim.vmm_free(0, base, 2 * G).unwrap();
}

#[test]
fn vmm_closing_the_device_releases_reservations() {
    let sim = sim();
    let s = stream(&sim, false);
    let base = sim.vmm_reserve(0, 4 * G).unwrap();
    let h = sim.vmm_map(0, base, 2 * G).unwrap();
    let other = sim.vmm_reserve(0, 2 * G).unwrap();
    sim.memset_d8_async(0, base, 1, 2 * G, s).unwrap();
    sim.deactivate();
    {
        let st = sim.lock();
        assert!(st.reservations.is_empty());
        assert!(st.allocs.is_empty(), "mapped ranges are gone from the live allocations");
        assert_eq!(st.free_bytes(0), 64 * MIB);
    }
    assert!(matches!(sim.vmm_reserve(0, G), Err(Error::InvalidArgument(_))));
    assert!(matches!(sim.vmm_map(0, base, G), Err(Error::InvalidArgument(_))));
    assert!(matches!(sim.vmm_granularity(0), Err(Error::InvalidArgument(_))));
    // Their owners' releases succeed silently.
    sim.vmm_unmap(0, base, 2 * G, h).unwrap();
    sim.vmm_free(0, base, 4 * G).unwrap();
    sim.vmm_free(0, other, 2 * G).unwrap();
    // Dropping a device that was never closed releases them too.
    let open = SimDevice::new(8 * G);
    let p = open.vmm_reserve(0, 4 * G).unwrap();
    open.vmm_map(0, p, 2 * G).unwrap();
    drop(open);
}

mod vmm_model {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a model (which granules of one reservation are mapped, and by which
        /// mapping): maps and unmaps anywhere, good and bad. Each succeeds exactly when the
        /// model says it may, a refusal changes nothing, the free memory is the capacity
        /// less what is mapped, and a memset is accepted exactly when every byte it
        /// touches is mapped.
        #[test]
        fn maps_and_unmaps_match_a_model(
            ops in proptest::collection::vec((0u8..3, 0u64..8, 1usize..4, 0u64..8, 1usize..4), 1..60),
        ) {
            const N: u64 = 8;
            let sim = SimDevice::new(6 * G);
            let s = sim.stream_create(0, false).unwrap();
            let base = sim.vmm_reserve(0, N as usize * G).unwrap();
            let at = |slot: u64| base + slot * G as u64;
            // Per granule: the mapping (start slot, granules, handle) holding it.
            let mut model: Vec<Option<(u64, u64, RawVmm)>> = vec![None; N as usize];
            for (op, slot, granules, probe, probe_granules) in ops {
                let n = granules as u64;
                let mapped: usize = model.iter().flatten().count() * G;
                match op {
                    0 => {
                        let fits = slot + n <= N;
                        let free = fits && (slot..slot + n).all(|i| model[i as usize].is_none());
                        let room = mapped + granules * G <= 6 * G;
                        match sim.vmm_map(0, at(slot), granules * G) {
                            Ok(h) => {
                                prop_assert!(free && room);
                                for i in slot..slot + n {
                                    model[i as usize] = Some((slot, n, h));
                                }
                            }
                            Err(e) => prop_assert!(!free || !room, "{e:?}"),
                        }
                    }
                    _ => {
                        // Unmap the mapping at `slot` with its size (op 1) or a wrong one (op 2).
                        let known = model.get(slot as usize).copied().flatten().filter(|m| m.0 == slot);
                        let (size, handle) = match (known, op) {
                            (Some((_, n, h)), 1) => (n as usize * G, h),
                            (Some((_, n, h)), _) => ((n as usize + granules) * G, h),
                            (None, _) => (granules * G, vmm::FIRST_HANDLE),
                        };
                        let r = sim.vmm_unmap(0, at(slot), size, handle);
                        if let (Some((_, n, _)), 1) = (known, op) {
                            prop_assert!(r.is_ok(), "{r:?}");
                            for i in slot..slot + n {
                                model[i as usize] = None;
                            }
                        } else {
                            prop_assert!(r.is_err());
                        }
                    }
                }
                let mapped = model.iter().flatten().count() * G;
                prop_assert_eq!(sim.mem_get_info(0).unwrap().0, 6 * G - mapped);
                // A probe that starts half a granule early, so that it spans granules.
                let start = at(probe) + (G / 2) as u64;
                let bytes = probe_granules * G / 2;
                let first = probe * 2 + 1;
                let covered = (first..first + probe_granules as u64)
                    .all(|half| model.get((half / 2) as usize).copied().flatten().is_some());
                let r = sim.memset_d8_async(0, start, 1, bytes, s);
                prop_assert_eq!(r.is_ok(), covered, "probe [{:#x}, +{}): {:?}", start, bytes, r);
            }
            sim.stream_synchronize(0, s).unwrap();
            for (i, m) in model.iter().enumerate() {
                if let Some((slot, n, h)) = *m {
                    if slot == i as u64 {
                        sim.vmm_unmap(0, at(slot), n as usize * G, h).unwrap();
                    }
                }
            }
            sim.vmm_free(0, base, N as usize * G).unwrap();
            prop_assert_eq!(sim.mem_get_info(0).unwrap().0, 6 * G);
        }
    }
}

#[test]
fn a_program_that_never_synchronises_keeps_a_bounded_backlog() {
    let sim = sim();
    let s = stream(&sim, false);
    let p = sim.mem_alloc(0, 4096).unwrap();
    // Far more work than the backlog holds, on one stream, never synchronised.
    for _ in 0..(MAX_BACKLOG_OPS + MAX_BACKLOG_OPS / 2) {
        sim.write(s, p, 64).unwrap();
    }
    assert!(sim.pending() <= MAX_BACKLOG_OPS, "{}", sim.pending());
    assert!(sim.ran_early() >= (MAX_BACKLOG_OPS / 2) as u64, "{}", sim.ran_early());
    // Under the bounds nothing runs early, and races are found as before.
    let fresh = SimDevice::new(64 * MIB);
    let (a, b) = (stream(&fresh, false), stream(&fresh, false));
    let q = fresh.mem_alloc(0, 4096).unwrap();
    fresh.write(a, q, 4096).unwrap();
    fresh.write(b, q, 4096).unwrap();
    fresh.run();
    assert_eq!((fresh.races().len(), fresh.ran_early()), (1, 0));
}

#[test]
fn a_chain_of_streams_each_waiting_on_the_last_keeps_bounded_clocks() {
    // A stream per task, each ordered after the one before by an event, none synchronised:
    // each new operation's clock holds an entry per stream in flight (quadratic in the
    // chain). The backlog's bound on clock entries runs work early instead.
    let sim = sim();
    let p = sim.mem_alloc(0, 4096).unwrap();
    let mut last: Option<RawStream> = None;
    for _ in 0..4000 {
        let s = stream(&sim, false);
        if let Some(prev) = last {
            let e = sim.event_create(0).unwrap();
            sim.event_record(0, e, prev).unwrap();
            sim.stream_wait_event(0, s, e).unwrap();
            sim.event_destroy(0, e).unwrap();
            sim.stream_destroy(0, prev).unwrap();
        }
        sim.write(s, p, 64).unwrap();
        last = Some(s);
    }
    assert!(sim.ran_early() > 0);
    sim.run();
    assert!(sim.races().is_empty(), "{}", sim.races()[0]);
}

#[test]
fn a_short_chain_of_streams_runs_nothing_early_and_its_race_is_found() {
    // A writes, 900 streams each waiting on the last are queued, B writes the same bytes:
    // A and B are not ordered. Below the backlog's bounds nothing runs early.
    let sim = sim();
    let p = sim.mem_alloc(0, 4096).unwrap();
    let (a, b) = (stream(&sim, false), stream(&sim, false));
    sim.write(a, p, 64).unwrap();
    let q = sim.mem_alloc(0, 4096).unwrap();
    let mut last = stream(&sim, false);
    for _ in 0..900 {
        let s = stream(&sim, false);
        let e = sim.event_create(0).unwrap();
        sim.event_record(0, e, last).unwrap();
        sim.stream_wait_event(0, s, e).unwrap();
        sim.event_destroy(0, e).unwrap();
        sim.write(s, q, 64).unwrap();
        sim.stream_destroy(0, last).unwrap();
        last = s;
    }
    sim.write(b, p, 64).unwrap();
    assert_eq!(sim.ran_early(), 0);
    sim.run();
    assert_eq!(sim.races().len(), 1, "{:?}", sim.races());
}

#[test]
fn what_ran_early_leaves_the_race_detector() {
    // A read of one buffer on a new stream per task, never synchronised: each destroyed
    // stream's read stays in the shadow state until it is known ordered before everything
    // queued; what ran early is, so the shadow state stays bounded.
    let sim = sim();
    let p = sim.mem_alloc(0, 4096).unwrap();
    for _ in 0..(MAX_BACKLOG_OPS * 2) {
        let s = stream(&sim, false);
        sim.read(s, p, 4096).unwrap();
        sim.stream_destroy(0, s).unwrap();
    }
    assert!(sim.ran_early() > 0);
    let stamps = sim.lock().shadow.stamps();
    assert!(stamps <= MAX_BACKLOG_OPS, "{stamps}");
}
