//! `Allocation` handed from one stream to another (`set_stream`), given up (`into_raw`),
//! and the simulated device of the process reached from Rust (`device::simulated`).

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::{Allocation, BackendRef, CudaAsyncMemoryResource, Error, ResourceRef, Stream};

fn setup() -> (Arc<SimDevice>, BackendRef, ResourceRef) {
    let sim = SimDevice::with_devices(64 << 20, 2);
    let backend: BackendRef = sim.clone();
    let mr: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default()).unwrap());
    (sim, backend, mr)
}

/// A producer writes a chunk on its stream and hands it to a consumer, which reads it and
/// frees it on its own stream; then the consumer's stream gets the memory again and writes
/// it. `hand_over` moves the chunk; the result is the races found.
fn producer_to_consumer(hand_over: impl Fn(&mut Allocation, &Stream, &ResourceRef)) -> usize {
    let (sim, backend, mr) = setup();
    let (producer, consumer) =
        (Stream::create(&backend, 0, false).unwrap(), Stream::create(&backend, 0, false).unwrap());
    let mut chunk = Allocation::new(mr.clone(), 4096, producer.clone()).unwrap();
    sim.write_labeled(producer.handle(), chunk.ptr(), 4096, "producer fills").unwrap();
    hand_over(&mut chunk, &consumer, &mr);
    drop(chunk);
    let again = Allocation::new(mr.clone(), 4096, consumer.clone()).unwrap();
    sim.write_labeled(consumer.handle(), again.ptr(), 4096, "consumer reuses").unwrap();
    drop(again);
    sim.run();
    sim.races().len()
}

#[test]
fn a_chunk_moved_to_the_consumers_stream_is_freed_there_after_the_producers_work() {
    // The control: the chunk freed on the consumer's stream by hand, with no ordering, is
    // handed out there again while the producer may still write it.
    let unordered = producer_to_consumer(|chunk, consumer, mr| {
        let (ptr, bytes) = (chunk.ptr(), chunk.bytes());
        let taken = std::mem::replace(chunk, Allocation::new(mr.clone(), 256, consumer.clone()).unwrap());
        let (_, raw, _, _) = taken.into_raw();
        assert_eq!(raw, ptr);
        mr.deallocate(ptr, bytes, consumer).unwrap();
    });
    assert!(unordered > 0, "the unordered free went unnoticed");
    let moved = producer_to_consumer(|chunk, consumer, _| chunk.set_stream(consumer.clone()).unwrap());
    assert_eq!(moved, 0);
}

#[test]
fn set_stream_refuses_another_devices_stream_and_changes_nothing() {
    let (sim, backend, mr) = setup();
    let stream = Stream::create(&backend, 0, false).unwrap();
    let mut chunk = Allocation::new(mr.clone(), 4096, stream.clone()).unwrap();
    let elsewhere = Stream::create(&backend, 1, false).unwrap();
    let err = chunk.set_stream(elsewhere).unwrap_err();
    assert!(matches!(err, Error::InvalidStream(_) | Error::InvalidArgument(_)), "{err}");
    assert_eq!(chunk.stream().handle(), stream.handle());
    // A move to its own stream records nothing; then the free is as ever.
    let pending = sim.pending();
    chunk.set_stream(stream.clone()).unwrap();
    assert_eq!(sim.pending(), pending);
    chunk.free().unwrap();
    sim.run();
    assert!(sim.races().is_empty());
}

#[test]
fn into_raw_gives_the_memory_up_without_freeing_it() {
    let (_sim, backend, mr) = setup();
    let stream = Stream::create(&backend, 0, false).unwrap();
    let before = mr.backend().mem_get_info(0).unwrap().0;
    let (owner, ptr, bytes, on) = Allocation::new(mr.clone(), 1 << 20, stream.clone()).unwrap().into_raw();
    assert!(Arc::ptr_eq(&owner, &mr) && bytes == 1 << 20 && on.handle() == stream.handle());
    owner.deallocate(ptr, bytes, &on).unwrap(); // once: the allocation freed nothing
    stream.synchronize(&backend, 0).unwrap();
    assert!(mr.backend().mem_get_info(0).unwrap().0 <= before);
}

#[test]
fn the_simulated_device_of_the_process_is_reachable() {
    // Without STREAMPOOL_DEVICE=sim and no device activated (activation is tested in its
    // own binary), there is none; with it, the process's device, the backend's.
    let found = streampool::device::simulated().unwrap();
    assert_eq!(found.is_some(), streampool::device::env_selects_sim());
    if let Some(sim) = found {
        assert_eq!(streampool::device::Backend::id(&*sim), streampool::device::backend().unwrap().id());
    }
}

#[test]
fn an_allocation_copies_to_and_from_host_memory_in_its_streams_order() {
    let (sim, backend, mr) = setup();
    let stream = Stream::create(&backend, 0, false).unwrap();
    let memory = Allocation::new(mr.clone(), 1000, stream.clone()).unwrap();
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    memory.copy_from_host(&data).unwrap();
    let mut back = vec![0u8; 1000];
    memory.copy_to_host(&mut back).unwrap();
    assert_eq!(back, data);
    let mut head = [0u8; 10];
    memory.copy_to_host(&mut head).unwrap(); // a prefix
    assert_eq!(head, data[..10]);
    // Longer than the allocation: refused, nothing copied; empty: nothing to do.
    let e = memory.copy_from_host(&[9u8; 1001]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(
        e.to_string()
            .contains("a copy of 1001 bytes from host memory is longer than the allocation (1000 bytes)"),
        "{e}"
    );
    let e = memory.copy_to_host(&mut [0u8; 1001]).unwrap_err();
    assert!(
        e.to_string()
            .contains("a copy of 1001 bytes into host memory is longer than the allocation (1000 bytes)"),
        "{e}"
    );
    memory.copy_from_host(&[]).unwrap();
    memory.copy_to_host(&mut back).unwrap();
    assert_eq!(back, data);
    // Ordered on the allocation's stream: no race with the work before or after it.
    sim.write_labeled(stream.handle(), memory.ptr(), 1000, "a kernel writes").unwrap();
    memory.copy_to_host(&mut back).unwrap();
    drop(memory);
    assert!(sim.races().is_empty(), "{:?}", sim.races());
}
