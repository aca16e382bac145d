//! Every resource against the real driver (run with `STREAMPOOL_GPU_TESTS=1` on a GPU
//! machine; without it these tests return at once, see DEVELOPERS.md).
//!
//! The reuse test keeps stream A busy writing one pattern into a block, frees the block
//! on A while that work is still running, reallocates on stream B and writes another
//! pattern there: if a resource handed A's block to B without ordering, A's late writes
//! would land over B's and the read-back would show them. The sharded pool gets the same
//! test bounded to one block, so that every reallocation on B must reuse the block A just
//! freed; there B also reads A's pattern first (it must be ordered after A's writes).

use std::sync::Arc;

use streampool::device::cuda::CudaBackend;
use streampool::device::BackendRef;
use streampool::resource::ResourceRef;
use streampool::{
    AsyncPoolOptions, CudaAsyncMemoryResource, CudaMemoryResource, Error, ManagedMemoryResource,
    MemoryResource, PinnedHostMemoryResource, PoolOptions, ShardedPoolMemoryResource, Stream,
};

const MIB: usize = 1 << 20;

fn gpu() -> Option<BackendRef> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    Some(CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"))
}

fn resources(b: &BackendRef) -> Vec<ResourceRef> {
    let own = AsyncPoolOptions { initial_pool_size: Some(64 * MIB), ..Default::default() };
    vec![
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap()),
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, own).unwrap()),
        Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap()),
        Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap()),
        Arc::new(PinnedHostMemoryResource::on(b.clone(), 0).unwrap()),
    ]
}

fn read_back(b: &BackendRef, ptr: u64, bytes: usize, stream: &Stream) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` outlives the copy: the stream is synchronised before it is read.
    unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, ptr, bytes, stream.handle()) }.unwrap();
    b.stream_synchronize(0, stream.handle()).unwrap();
    host
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn memset_on_one_stream_then_reuse_on_another_reads_back_correctly() {
    let Some(b) = gpu() else { return };
    for mr in resources(&b) {
        let bytes = if mr.name() == "PinnedHostMemoryResource" { 4 * MIB } else { 64 * MIB };
        let (a, other) = (Stream::create(&b, 0, false).unwrap(), Stream::create(&b, 0, false).unwrap());
        for round in 0..8u8 {
            let p = mr.allocate(bytes, &a).unwrap();
            assert_eq!(p % 256, 0);
            for _ in 0..16 {
                b.memset_d8_async(0, p, 0xA0 + round, bytes, a.handle()).unwrap();
            }
            mr.deallocate(p, bytes, &a).unwrap();
            let q = mr.allocate(bytes, &other).unwrap();
            b.memset_d8_async(0, q, 0x11, bytes, other.handle()).unwrap();
            let host = read_back(&b, q, bytes, &other);
            let bad = host.iter().filter(|&&x| x != 0x11).count();
            assert_eq!(bad, 0, "{}: {bad} bytes overwritten after reuse (round {round})", mr.name());
            mr.deallocate(q, bytes, &other).unwrap();
        }
        b.ctx_synchronize(0).unwrap();
    }
}

/// Sharded pools holding exactly one block of `bytes`, over the driver's pool and over
/// `cuMemAlloc`: with an event at every free (B waits on A's event, or takes the block
/// once that event completed) and with the default interval (the first handover goes
/// through a device synchronisation, the last resort; later ones through the events the
/// pool, short of memory, asks every stream for), with a batch of 8 frees per asked-for
/// event (a pool at its maximum still hands the block over, by a wait or a synchronisation),
/// and with one heap for every stream (B waits on the event of A's free).
fn bounded_pools(b: &BackendRef, bytes: usize) -> Vec<(String, ShardedPoolMemoryResource)> {
    let upstreams: [(&str, ResourceRef); 2] = [
        ("async", Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap())),
        ("cuda", Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap())),
    ];
    let mut pools = Vec::new();
    for (name, upstream) in upstreams {
        for (events_every, event_batch, one_heap) in
            [(1, 1, false), (64, 1, false), (64, 8, false), (64, 1, true)]
        {
            let options = PoolOptions {
                initial_pool_size: Some(bytes),
                maximum_pool_size: Some(bytes),
                events_every,
                event_batch,
                one_heap,
                ..Default::default()
            };
            let pool = ShardedPoolMemoryResource::new(upstream.clone(), options).unwrap();
            pools.push((
                format!("pool over {name}, events_every {events_every}, event_batch {event_batch}, one_heap {one_heap}"),
                pool,
            ));
        }
    }
    pools
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn sharded_pool_reuse_on_another_stream_reads_back_correctly() {
    let Some(b) = gpu() else { return };
    let bytes = 64 * MIB;
    for (name, pool) in bounded_pools(&b, bytes) {
        let (a, other) = (Stream::create(&b, 0, false).unwrap(), Stream::create(&b, 0, false).unwrap());
        for round in 0..8u8 {
            let pattern = 0xA0 + round;
            let p = pool.allocate(bytes, &a).unwrap();
            for _ in 0..16 {
                b.memset_d8_async(0, p, pattern, bytes, a.handle()).unwrap();
            }
            pool.deallocate(p, bytes, &a).unwrap();
            let q = pool.allocate(bytes, &other).unwrap();
            assert_eq!(q, p, "{name}: the only block was not reused (round {round})");
            let host = read_back(&b, q, bytes, &other);
            let missed = host.iter().filter(|&&x| x != pattern).count();
            assert_eq!(missed, 0, "{name}: {missed} bytes of A's writes not seen on B (round {round})");
            b.memset_d8_async(0, q, 0x11, bytes, other.handle()).unwrap();
            let host = read_back(&b, q, bytes, &other);
            let bad = host.iter().filter(|&&x| x != 0x11).count();
            assert_eq!(bad, 0, "{name}: {bad} bytes overwritten after reuse (round {round})");
            pool.deallocate(q, bytes, &other).unwrap();
        }
        let stats = pool.stats();
        let handovers = stats.completed_steals + stats.cross_stream_waits + stats.synchronizations;
        assert!(handovers >= 8, "{name}: {stats:?}");
        b.ctx_synchronize(0).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn out_of_memory_and_bad_frees_are_clear_errors() {
    let Some(b) = gpu() else { return };
    for mr in resources(&b) {
        if mr.name() == "PinnedHostMemoryResource" || mr.name() == "ManagedMemoryResource" {
            continue; // asking the host (or managed memory) for petabytes is not a test to run
        }
        let s = Stream::create(&b, 0, false).unwrap();
        let err = mr.allocate(1 << 50, &s).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 1 << 50), "{err:?}");
        let (free, total) = b.mem_get_info(0).unwrap();
        assert!(free > total / 2, "{}: the failed attempt left {free} of {total} bytes free", mr.name());
        let p = mr.allocate(MIB, &s).unwrap();
        mr.deallocate(p, MIB, &s).unwrap();
        b.stream_synchronize(0, s.handle()).unwrap();
    }
    let cuda = CudaMemoryResource::on(b.clone(), 0).unwrap();
    let s = Stream::legacy();
    let p = cuda.allocate(MIB, &s).unwrap();
    cuda.deallocate(p, MIB, &s).unwrap();
    let err = cuda.deallocate(p, MIB, &s).unwrap_err();
    assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn threads_share_a_resource() {
    let Some(b) = gpu() else { return };
    let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let (mr, b) = (mr.clone(), b.clone());
            std::thread::spawn(move || {
                let s = if i % 2 == 0 { Stream::per_thread() } else { Stream::create(&b, 0, false).unwrap() };
                for n in 1..200usize {
                    let p = mr.allocate(n * 4096, &s).unwrap();
                    b.memset_d8_async(0, p, i as u8, n * 4096, s.handle()).unwrap();
                    mr.deallocate(p, n * 4096, &s).unwrap();
                }
                b.stream_synchronize(0, s.handle()).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
