//! The fill, check and compute kernels: on the simulated device (corruption found, races
//! seen, bad launches refused), and on a GPU (`STREAMPOOL_GPU_TESTS=1`, `--include-ignored`).

// Every kernel here runs on memory the test allocated for it (or, where a launch is to be
// refused, on addresses the simulated device checks): the unsafe blocks all rest on that.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use std::sync::Arc;

use common::{assert_no_races, sim, stream};
use streampool::device::cuda::CudaBackend;
use streampool::device::sim::OpKind;
use streampool::device::BackendRef;
use streampool::kernels::{self, pattern_word};
use streampool::{CudaAsyncMemoryResource, CudaMemoryResource, Error, MemoryResource, Stream};

/// Fills, computes and checks a buffer, then plants one bad word and finds exactly it.
fn fill_compute_check_and_find_a_planted_word(b: &BackendRef, mr: &dyn MemoryResource) {
    let s = stream(b);
    let bytes = (1 << 20) + 12; // a tail of 4 bytes that is neither filled nor checked
    let p = mr.allocate(bytes, &s).unwrap();
    unsafe { kernels::fill(b, 0, p, bytes, 11, &s) }.unwrap();
    unsafe { kernels::compute(b, 0, p, bytes, &s, 4) }.unwrap();
    assert_eq!(unsafe { kernels::check(b, 0, p, bytes, 11, &s) }.unwrap(), 0);
    assert_eq!(
        unsafe { kernels::check(b, 0, p, bytes, 12, &s) }.unwrap(),
        (bytes / 8) as u64,
        "another seed"
    );
    // Word 1000 gets word 999's value: misplaced data.
    let planted = pattern_word(11, 999);
    // SAFETY: `planted` outlives the copy (the check below synchronises the stream first).
    unsafe { b.memcpy_async(0, p + 8000, &planted as *const u64 as u64, 8, s.handle()) }.unwrap();
    assert_eq!(unsafe { kernels::check(b, 0, p, bytes, 11, &s) }.unwrap(), 1);
    // The words of a filled buffer read back as the pattern, little-endian.
    let mut host = [0u64; 4];
    // SAFETY: `host` outlives the copy: the stream is synchronised before it is read.
    unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, p, 32, s.handle()) }.unwrap();
    b.stream_synchronize(0, s.handle()).unwrap();
    assert_eq!(host, [0, 1, 2, 3].map(|i| pattern_word(11, i)));
    mr.deallocate(p, bytes, &s).unwrap();
}

#[test]
fn fill_and_check_find_a_planted_corruption_on_the_simulated_device() {
    let (sim, b) = sim();
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    fill_compute_check_and_find_a_planted_word(&b, &mr);
    assert_no_races(&sim);
}

#[test]
fn a_kernel_on_another_stream_races_the_reuse_after_a_free() {
    let (sim, b) = sim();
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    let (s1, s2) = (stream(&b), stream(&b));
    let p = mr.allocate(4096, &s1).unwrap();
    // Wrong: a kernel on s2 uses memory ordered on s1, which frees it without waiting.
    unsafe { kernels::fill(&b, 0, p, 4096, 1, &s2) }.unwrap();
    mr.deallocate(p, 4096, &s1).unwrap();
    let q = mr.allocate(4096, &s1).unwrap();
    assert_eq!(q, p, "same-stream reuse");
    unsafe { kernels::fill(&b, 0, q, 4096, 2, &s1) }.unwrap();
    sim.run();
    let races = sim.take_races();
    assert_eq!(races.len(), 1, "{races:?}");
    let r = &races[0];
    assert_eq!((r.earlier.kind, r.later.kind), (OpKind::Kernel, OpKind::Kernel));
    // Whichever ran first, the two fills are unordered.
    let mut pair = [r.earlier.stream, r.later.stream];
    pair.sort();
    assert_eq!(pair, [s1.handle(), s2.handle()]);
    assert!(r.to_string().contains("kernel 'streampool_fill'"), "{r}");
    // Ordered both ways with events, as a real program must, the same hand-off is clean.
    let (to_s2, to_s1) = (streampool::Event::new(&b, 0).unwrap(), streampool::Event::new(&b, 0).unwrap());
    to_s2.record(&s1).unwrap();
    s2.wait(&to_s2).unwrap();
    unsafe { kernels::fill(&b, 0, q, 4096, 3, &s2) }.unwrap();
    to_s1.record(&s2).unwrap();
    s1.wait(&to_s1).unwrap();
    mr.deallocate(q, 4096, &s1).unwrap();
    let r = mr.allocate(4096, &s1).unwrap();
    unsafe { kernels::fill(&b, 0, r, 4096, 4, &s1) }.unwrap();
    assert_eq!(unsafe { kernels::check(&b, 0, r, 4096, 4, &s1) }.unwrap(), 0);
    mr.deallocate(r, 4096, &s1).unwrap();
    assert_no_races(&sim);
}

#[test]
fn bad_launches_are_refused_and_change_nothing() {
    let (sim, b) = sim();
    let mr = CudaMemoryResource::on(b.clone(), 0).unwrap();
    let s = Stream::legacy();
    let p = mr.allocate(1024, &s).unwrap();
    let e = unsafe { kernels::fill(&b, 0, p + 4, 64, 1, &s) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("8-byte aligned"), "{e}");
    let e = unsafe { kernels::fill(&b, 0, p, 2048, 1, &s) }.unwrap_err();
    assert!(e.to_string().contains("runs 1024 bytes past the end of the live allocation"), "{e}");
    let e = unsafe { kernels::check(&b, 0, 0, 64, 1, &s) }.unwrap_err();
    assert!(matches!(e, Error::InvalidPointer(_)), "{e}");
    assert_eq!(unsafe { kernels::check(&b, 0, p, 7, 1, &s) }.unwrap(), 0, "no whole word: nothing to check");
    mr.deallocate(p, 1024, &s).unwrap();
    // Freed memory is refused (use after free), as the driver would fault.
    assert!(unsafe { kernels::fill(&b, 0, p, 1024, 1, &s) }.is_err());
    // Another device's PTX: the simulated device runs only streampool's kernels.
    let other =
        std::ffi::CString::new(".version 7.0\n.target sm_52\n.visible .entry mine(\n)\n{ ret; }").unwrap();
    let e = b.module_load_data(0, &other).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("\"mine\""), "{e}");
    assert_eq!(sim.pending(), 0);
}

/// A check of fewer than 8 bytes checks no word, but still synchronises its stream, as
/// documented: a program (the stress workload) frees the memory on another stream after
/// the check, which is safe only if the memory's earlier work on the check's stream (here
/// a previous owner's kernels, still pending when it freed the memory) has completed.
#[test]
fn a_check_of_no_whole_word_still_synchronises_its_stream() {
    let (sim, b) = sim();
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    let (s1, s2) = (stream(&b), stream(&b));
    // A previous owner frees its memory on s1 with kernels still pending there. (`n`,
    // live throughout, keeps the freed block from merging with free memory after it, which
    // would make the pool order its reuse after s1's work.)
    let p = mr.allocate(64, &s1).unwrap();
    let n = mr.allocate(64, &s1).unwrap();
    unsafe { kernels::fill(&b, 0, p, 64, 1, &s1) }.unwrap();
    unsafe { kernels::compute(&b, 0, p, 64, &s1, 1) }.unwrap();
    unsafe { kernels::fill(&b, 0, p, 64, 2, &s1) }.unwrap();
    mr.deallocate(p, 64, &s1).unwrap();
    // The next owner, on s1 too (ordered after those kernels), holds 4 bytes: no word.
    let q = mr.allocate(4, &s1).unwrap();
    assert_eq!(q, p, "same-stream reuse");
    unsafe { kernels::fill(&b, 0, q, 4, 3, &s1) }.unwrap(); // launches nothing
    assert_eq!(unsafe { kernels::check(&b, 0, q, 4, 3, &s1) }.unwrap(), 0);
    assert_eq!(sim.pending(), 0, "the check synchronised s1: nothing of s1 is left pending");
    // So the memory may be freed on s2 and reused there at once.
    mr.deallocate(q, 4, &s2).unwrap();
    let r = mr.allocate(64, &s2).unwrap();
    assert_eq!(r, p, "same-stream reuse on s2");
    unsafe { kernels::fill(&b, 0, r, 64, 4, &s2) }.unwrap();
    assert_eq!(
        unsafe { kernels::check(&b, 0, r, 64, 4, &s2) }.unwrap(),
        0,
        "s1's pending fill overwrote s2's"
    );
    mr.deallocate(r, 64, &s2).unwrap();
    mr.deallocate(n, 64, &s1).unwrap();
    assert_no_races(&sim);
}

#[test]
fn kernels_take_their_simulated_duration() {
    let (_sim, b) = sim();
    let mr = CudaMemoryResource::on(b.clone(), 0).unwrap();
    let s = Stream::legacy();
    let bytes = 8 << 20;
    let p = mr.allocate(bytes, &s).unwrap();
    // 8 MiB touched twice per pass, 4 passes: 64 MiB at 1 byte/ps, plus the launch.
    unsafe { kernels::compute(&b, 0, p, bytes, &s, 4) }.unwrap();
    let t = std::time::Instant::now();
    s.synchronize(&b, 0).unwrap();
    let floor = kernels::SIM_KERNEL_LAUNCH_NS + (64 << 20) / kernels::SIM_KERNEL_BYTES_PER_NS;
    assert!(t.elapsed().as_nanos() as u64 >= floor);
    mr.deallocate(p, bytes, &s).unwrap();
}

fn gpu() -> Option<BackendRef> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    Some(CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"))
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn the_ptx_kernels_fill_compute_and_check_on_a_gpu() {
    let Some(b) = gpu() else { return };
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    fill_compute_check_and_find_a_planted_word(&b, &mr);
    // Many concurrent checks on many streams: each has its own counter.
    let mr = Arc::new(mr);
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let (b, mr) = (b.clone(), mr.clone());
            scope.spawn(move || {
                let s = Stream::create(&b, 0, false).unwrap();
                for round in 0..50u64 {
                    let bytes = 256 << 10;
                    let p = mr.allocate(bytes, &s).unwrap();
                    unsafe { kernels::fill(&b, 0, p, bytes, t * 1000 + round, &s) }.unwrap();
                    unsafe { kernels::compute(&b, 0, p, bytes, &s, 2) }.unwrap();
                    assert_eq!(unsafe { kernels::check(&b, 0, p, bytes, t * 1000 + round, &s) }.unwrap(), 0);
                    mr.deallocate(p, bytes, &s).unwrap();
                }
            });
        }
    });
}

#[path = "common/failing.rs"]
mod failing;
use failing::FailingSyncs;

#[inline(never)]
fn a_later_frame(sim: &streampool::device::sim::SimDevice) -> Vec<u64> {
    let mut frame = [0u64; 4096];
    std::hint::black_box(&mut frame);
    sim.run();
    std::hint::black_box(&mut frame);
    frame.into_iter().filter(|&w| w != 0).collect()
}

#[test]
fn a_check_whose_synchronisation_fails_leaves_no_copy_into_its_frame() {
    use std::sync::atomic::Ordering;
    let sim = streampool::device::sim::SimDevice::new(64 << 20);
    let failing = FailingSyncs::new(sim.clone());
    let b: BackendRef = failing.clone();
    let s = Stream::legacy();
    let p = b.mem_alloc(0, 4096).unwrap();
    unsafe { kernels::fill(&b, 0, p, 4096, 7, &s) }.unwrap();
    assert_eq!(unsafe { kernels::check(&b, 0, p, 4096, 7, &s) }.unwrap(), 0);
    failing.fail_stream_syncs.store(true, Ordering::SeqCst);
    // Another seed: 512 words differ, and the count's copy to the host is queued when the
    // synchronisation fails. The whole device is synchronised then: the copy has run (into
    // a word of the heap, kept), and nothing is left to write into a later stack frame.
    let err = unsafe { kernels::check(&b, 0, p, 4096, 8, &s) }.unwrap_err();
    assert!(matches!(err, Error::InvalidStream(_)), "{err}");
    assert_eq!(sim.pending(), 0, "work left queued after the failed check");
    failing.fail_stream_syncs.store(false, Ordering::SeqCst);
    assert_eq!(a_later_frame(&sim), Vec::<u64>::new());
    b.mem_free(0, p).unwrap();
}
