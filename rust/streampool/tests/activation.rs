//! Process-wide activation of a simulated device. One test function, since activation is
//! global to the process and tests in one binary run in parallel.

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::{backend, BackendKind};
use streampool::{Allocation, CudaAsyncMemoryResource, Error, MemoryResource, Stream};

#[test]
fn activation_is_process_wide_and_objects_stay_on_their_device() {
    let first = SimDevice::new(64 << 20);
    let guard = first.activate().unwrap();
    assert_eq!(backend().unwrap().kind(), BackendKind::Simulated);
    assert_eq!(backend().unwrap().id(), streampool::device::Backend::id(&*first));

    // Another thread sees the same device.
    let id = std::thread::spawn(|| backend().unwrap().id()).join().unwrap();
    assert_eq!(id, streampool::device::Backend::id(&*first));

    // A second one cannot be entered at the same time.
    let second = SimDevice::new(64 << 20);
    assert!(matches!(second.activate(), Err(Error::InvalidArgument(_))));
    let again = first.activate().unwrap_err().to_string();
    assert!(again.contains("is already active in this process (this one: activated twice)"), "{again}");

    let mr = Arc::new(CudaAsyncMemoryResource::new(None, Default::default()).unwrap());
    let stream = Stream::create(&backend().unwrap(), 0, false).unwrap();
    let live = Allocation::new(mr.clone(), 1 << 20, stream.clone()).unwrap();
    let pool: streampool::ResourceRef =
        Arc::new(streampool::FixedSizeMemoryResource::new(mr.clone(), 4096, 4).unwrap());
    Allocation::new(pool.clone(), 100, Stream::legacy()).unwrap().free().unwrap(); // a free block kept
    drop(guard);

    // Outside it, its objects are refused with a clear error, and freeing is silent.
    let err = mr.allocate(256, &Stream::legacy()).unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
    // Also where the resource could serve the request without the device (a pool's own
    // free list): an allocation checks the backend first.
    assert!(matches!(Allocation::new(pool.clone(), 100, Stream::legacy()), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        Allocation::try_new(&pool, 100, &Stream::legacy()),
        Some(Err(Error::InvalidArgument(_)))
    ));
    assert!(streampool::device::Backend::check_open(&*first).is_err());
    drop(live);

    // The next one is independent of the first, and refuses the first one's streams.
    let _g2 = second.activate().unwrap();
    let mr2 = CudaAsyncMemoryResource::new(None, Default::default()).unwrap();
    let err = mr2.allocate(256, &stream).unwrap_err();
    assert!(matches!(err, Error::InvalidStream(_)), "{err:?}");
    let ptr = mr2.allocate(256, &Stream::legacy()).unwrap();
    mr2.deallocate(ptr, 256, &Stream::legacy()).unwrap();
    drop(stream);
}
