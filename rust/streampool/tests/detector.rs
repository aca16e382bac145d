//! Proof that the suite can fail: a deliberately broken resource that hands freed memory
//! to any stream with no ordering is caught by the simulated device's race detector,
//! and the report names both operations.

use std::sync::{Arc, Mutex};

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::{MemoryKind, MemoryResource};
use streampool::{CudaMemoryResource, Result, Stream};

/// Caches freed blocks and reuses them on any stream, forgetting the stream they were
/// freed on: exactly the bug the stream-ordered contract forbids.
#[derive(Debug)]
struct BrokenReuse {
    upstream: CudaMemoryResource,
    free: Mutex<Vec<(DevPtr, usize)>>,
}

impl MemoryResource for BrokenReuse {
    fn backend(&self) -> &BackendRef {
        self.upstream.backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "BrokenReuse"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let mut free = self.free.lock().unwrap();
        if let Some(i) = free.iter().position(|&(_, n)| n >= bytes) {
            return Ok(free.swap_remove(i).0);
        }
        drop(free);
        self.upstream.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, _stream: &Stream) -> Result<()> {
        self.free.lock().unwrap().push((ptr, bytes));
        Ok(())
    }
}

#[test]
fn broken_cross_stream_reuse_is_reported() {
    let sim = SimDevice::new(64 << 20);
    let backend: BackendRef = sim.clone();
    let mr = BrokenReuse {
        upstream: CudaMemoryResource::on(backend.clone(), 0).unwrap(),
        free: Mutex::new(vec![]),
    };
    let (a, b) = (Stream::create(&backend, 0, false).unwrap(), Stream::create(&backend, 0, false).unwrap());
    let p = mr.allocate(4096, &a).unwrap();
    sim.write_labeled(a.handle(), p, 4096, "producer").unwrap();
    mr.deallocate(p, 4096, &a).unwrap();
    let q = mr.allocate(4096, &b).unwrap();
    assert_eq!(p, q, "the broken resource reuses the block");
    sim.write_labeled(b.handle(), q, 4096, "consumer").unwrap();
    sim.run();
    let races = sim.races();
    assert_eq!(races.len(), 1, "{races:?}");
    let text = races[0].to_string();
    assert!(text.contains("producer") && text.contains("consumer"), "{text}");
}

#[test]
fn the_same_program_with_an_event_is_clean() {
    let sim = SimDevice::new(64 << 20);
    let backend: BackendRef = sim.clone();
    let mr = BrokenReuse {
        upstream: CudaMemoryResource::on(backend.clone(), 0).unwrap(),
        free: Mutex::new(vec![]),
    };
    let (a, b) = (Stream::create(&backend, 0, false).unwrap(), Stream::create(&backend, 0, false).unwrap());
    let p = mr.allocate(4096, &a).unwrap();
    sim.write(a.handle(), p, 4096).unwrap();
    let ev = streampool::Event::new(&backend, 0).unwrap();
    ev.record(&a).unwrap();
    b.wait(&ev).unwrap();
    mr.deallocate(p, 4096, &a).unwrap();
    let q = mr.allocate(4096, &b).unwrap();
    sim.write(b.handle(), q, 4096).unwrap();
    sim.run();
    assert!(sim.races().is_empty(), "{:?}", sim.races());
    let _ = Arc::clone(&sim);
}
