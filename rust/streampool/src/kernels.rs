//! Fill, check and compute kernels that need no compiler: PTX text written by hand,
//! JIT-compiled by the driver (`cuModuleLoadData`) the first time a device uses them, and
//! launched through the device seam
//! ([`Backend::launch_kernel`](crate::device::Backend::launch_kernel)). On the simulated
//! device the same calls run simulated kernels that read and write the memory as the
//! real ones do, go through the race detector like any stream work, and take a
//! simulated duration (see [`SIM_KERNEL_LAUNCH_NS`]).
//!
//! The pattern: word `i` (8 bytes, little-endian) of a buffer filled with seed `s` is
//! [`pattern_word`]`(s, i)`, a cheap hash of both, so data that lands at the wrong
//! place, or comes from another buffer, or was overwritten, is found by [`check`].
//! A buffer of `bytes` bytes holds `bytes / 8` words; its last `bytes % 8` bytes are
//! neither filled nor checked. Pointers must be 8-byte aligned (every allocation is).
//!
//! ```
//! use std::sync::Arc;
//! use streampool::device::sim::SimDevice;
//! use streampool::{kernels, CudaAsyncMemoryResource, MemoryResource, Stream};
//!
//! let sim = SimDevice::new(1 << 30);
//! let mr = CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?;
//! let s = Stream::legacy();
//! let p = mr.allocate(4096, &s)?;
//! unsafe { kernels::fill(mr.backend(), 0, p, 4096, 7, &s) }?;
//! unsafe { kernels::compute(mr.backend(), 0, p, 4096, &s, 3) }?; // reads and writes, leaves the data
//! assert_eq!(unsafe { kernels::check(mr.backend(), 0, p, 4096, 7, &s) }?, 0);
//! assert_eq!(unsafe { kernels::check(mr.backend(), 0, p, 4096, 8, &s) }?, 512); // another seed
//! mr.deallocate(p, 4096, &s)?;
//! # Ok::<(), streampool::Error>(())
//! ```

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::Mutex;

use crate::device::{BackendRef, DevPtr, RawFunction};
use crate::error::{Error, Result};
use crate::stream::Stream;

/// The fill kernel's name: `(ptr, words, seed)`, writes [`pattern_word`] to every word.
pub const FILL: &str = "streampool_fill";
/// The check kernel's name: `(ptr, words, seed, counter)`, adds the number of words that
/// differ from the pattern to the `u64` at `counter` (one atomic add per thread).
pub const CHECK: &str = "streampool_check";
/// The compute kernel's name: `(ptr, words, iterations, multiplier, inverse)`: each of
/// `iterations` passes reads every word, multiplies it by `multiplier` and then by
/// `inverse` (its inverse modulo 2^64), and writes it back. Real memory traffic and
/// arithmetic, and the data is left as it was, so [`check`] still passes afterwards.
pub const COMPUTE: &str = "streampool_compute";

/// The odd multiplier of the compute kernel (and of the pattern's hash).
pub const COMPUTE_MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;
/// [`COMPUTE_MULTIPLIER`]'s inverse modulo 2^64.
pub const COMPUTE_INVERSE: u64 = inverse_mod_2_64(COMPUTE_MULTIPLIER);

/// Threads per block of every launch.
pub const BLOCK: u32 = 256;
/// The most blocks of a launch (each thread loops over the words, grid-stride).
pub const MAX_GRID: u32 = 4096;

/// On the simulated device, what a kernel takes besides its bytes: 2 µs, about a launch
/// and a short kernel on a GPU. A simulated kernel that runs (when its stream is
/// synchronised, or stepped) keeps the thread that runs it busy for
/// `SIM_KERNEL_LAUNCH_NS + bytes touched / SIM_KERNEL_BYTES_PER_NS` nanoseconds at least
/// (bytes touched: the buffer once for fill and check, twice per pass for compute), so
/// that workloads see kernel time there too, up to [`SIM_KERNEL_MAX_NS`]. Simulated
/// kernels run one at a time, and a compute kernel's passes, which leave the data as it
/// was, run as one.
pub const SIM_KERNEL_LAUNCH_NS: u64 = 2_000;
/// On the simulated device, the longest a kernel takes (10 ms): it runs under the
/// simulator's lock, which every other call on the device waits for meanwhile.
pub const SIM_KERNEL_MAX_NS: u64 = 10_000_000;
/// On the simulated device, the bytes per nanosecond a kernel moves (1 TB/s).
pub const SIM_KERNEL_BYTES_PER_NS: u64 = 1_000;

/// Word `index` of a buffer filled with `seed`: a cheap mix (splitmix64's finaliser
/// over `seed + index * COMPUTE_MULTIPLIER`), injective in `index` for a given seed.
#[inline]
pub fn pattern_word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_mul(COMPUTE_MULTIPLIER));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^ (z >> 27)
}

const fn inverse_mod_2_64(odd: u64) -> u64 {
    // Newton's iteration doubles the correct low bits each step: 3, 6, 12, 24, 48, 96.
    let mut inv = odd;
    let mut i = 0;
    while i < 5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// The three kernels, for PTX ISA 7.0 and `sm_52`, so that any driver from CUDA 11.0 on
/// JIT-compiles them for whatever GPU it drives. Every parameter is a `.u64`; the hash
/// constants are [`pattern_word`]'s, written as signed decimals (as nvcc writes them).
pub const PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry streampool_fill(
    .param .u64 p_ptr,
    .param .u64 p_words,
    .param .u64 p_seed
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_seed];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.s64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
FILL_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra FILL_DONE;
    mul.lo.s64 %rd7, %rd4, -7046029254386353131;
    add.s64 %rd7, %rd7, %rd3;
    shr.u64 %rd8, %rd7, 30;
    xor.b64 %rd7, %rd7, %rd8;
    mul.lo.s64 %rd7, %rd7, -4658895280553007687;
    shr.u64 %rd8, %rd7, 27;
    xor.b64 %rd7, %rd7, %rd8;
    shl.b64 %rd9, %rd4, 3;
    add.s64 %rd10, %rd1, %rd9;
    st.global.u64 [%rd10], %rd7;
    add.s64 %rd4, %rd4, %rd6;
    bra FILL_LOOP;
FILL_DONE:
    ret;
}

.visible .entry streampool_check(
    .param .u64 p_ptr,
    .param .u64 p_words,
    .param .u64 p_seed,
    .param .u64 p_counter
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_seed];
    ld.param.u64 %rd11, [p_counter];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd11, %rd11;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.s64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd12, 0;
CHECK_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra CHECK_DONE;
    mul.lo.s64 %rd7, %rd4, -7046029254386353131;
    add.s64 %rd7, %rd7, %rd3;
    shr.u64 %rd8, %rd7, 30;
    xor.b64 %rd7, %rd7, %rd8;
    mul.lo.s64 %rd7, %rd7, -4658895280553007687;
    shr.u64 %rd8, %rd7, 27;
    xor.b64 %rd7, %rd7, %rd8;
    shl.b64 %rd9, %rd4, 3;
    add.s64 %rd10, %rd1, %rd9;
    ld.global.u64 %rd13, [%rd10];
    setp.ne.u64 %p2, %rd13, %rd7;
    selp.u64 %rd14, 1, 0, %p2;
    add.s64 %rd12, %rd12, %rd14;
    add.s64 %rd4, %rd4, %rd6;
    bra CHECK_LOOP;
CHECK_DONE:
    setp.eq.u64 %p1, %rd12, 0;
    @%p1 bra CHECK_RET;
    atom.global.add.u64 %rd15, [%rd11], %rd12;
CHECK_RET:
    ret;
}

.visible .entry streampool_compute(
    .param .u64 p_ptr,
    .param .u64 p_words,
    .param .u64 p_iterations,
    .param .u64 p_multiplier,
    .param .u64 p_inverse
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_iterations];
    ld.param.u64 %rd11, [p_multiplier];
    ld.param.u64 %rd12, [p_inverse];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd7, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.s64 %rd7, %rd7, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd13, 0;
PASS_LOOP:
    setp.ge.u64 %p1, %rd13, %rd3;
    @%p1 bra COMPUTE_DONE;
    mov.u64 %rd4, %rd7;
WORD_LOOP:
    setp.ge.u64 %p2, %rd4, %rd2;
    @%p2 bra WORD_DONE;
    shl.b64 %rd9, %rd4, 3;
    add.s64 %rd10, %rd1, %rd9;
    ld.volatile.global.u64 %rd14, [%rd10];
    mul.lo.s64 %rd14, %rd14, %rd11;
    mul.lo.s64 %rd14, %rd14, %rd12;
    st.volatile.global.u64 [%rd10], %rd14;
    add.s64 %rd4, %rd4, %rd6;
    bra WORD_LOOP;
WORD_DONE:
    add.s64 %rd13, %rd13, 1;
    bra PASS_LOOP;
COMPUTE_DONE:
    ret;
}
"#;

/// Bytes of each block of check counters (one `u64` per concurrent check).
const COUNTER_BLOCK: usize = 4096;

/// The kernels loaded on one device of one backend, and its check counters.
#[derive(Debug)]
struct Loaded {
    fill: RawFunction,
    check: RawFunction,
    compute: RawFunction,
    /// Free 8-byte counters in device memory (`cuMemAlloc`ed in blocks, kept for the
    /// process: a few KiB per device).
    counters: Mutex<Vec<DevPtr>>,
}

/// Loaded modules by (backend id, device): each loaded once, never unloaded (the
/// primary context that holds it is never released either), so their handles live for
/// the process (a few dozen bytes per device, and per simulated device made).
static LOADED: Mutex<BTreeMap<(u64, i32), &'static Loaded>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// The last device this thread launched on: launches from many threads take no lock.
    static LAST: Cell<Option<((u64, i32), &'static Loaded)>> = const { Cell::new(None) };
}

fn loaded(backend: &BackendRef, dev: i32) -> Result<&'static Loaded> {
    let key = (backend.id(), dev);
    if let Some((k, l)) = LAST.try_with(Cell::get).ok().flatten() {
        if k == key {
            return Ok(l);
        }
    }
    let l = loaded_slow(backend, dev)?;
    let _ = LAST.try_with(|last| last.set(Some((key, l))));
    Ok(l)
}

#[cold]
fn loaded_slow(backend: &BackendRef, dev: i32) -> Result<&'static Loaded> {
    let mut map = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&l) = map.get(&(backend.id(), dev)) {
        return Ok(l);
    }
    // Loaded under the map's lock: a JIT compile takes milliseconds once per device, and
    // two threads must not both load (each would leak a module).
    let image = CString::new(PTX).expect("the PTX has no NUL");
    let module = backend.module_load_data(dev, &image)?;
    let function =
        |name: &str| backend.module_get_function(dev, module, &CString::new(name).expect("no NUL"));
    let l: &'static Loaded = Box::leak(Box::new(Loaded {
        fill: function(FILL)?,
        check: function(CHECK)?,
        compute: function(COMPUTE)?,
        counters: Mutex::new(Vec::new()),
    }));
    map.insert((backend.id(), dev), l);
    Ok(l)
}

/// Words of `bytes` at `ptr`, refusing a pointer that is not 8-byte aligned.
fn words(ptr: DevPtr, bytes: usize, what: &str) -> Result<u64> {
    if !ptr.is_multiple_of(8) {
        return Err(Error::invalid(format!(
            "{what}: ptr {ptr:#x} is not 8-byte aligned (the kernels work on 8-byte words; every \
             allocation is 256-byte aligned)"
        )));
    }
    if ptr == 0 && bytes > 0 {
        return Err(Error::InvalidPointer(format!("{what}: null pointer with size {bytes}")));
    }
    if ptr.checked_add(bytes as u64).is_none() {
        return Err(Error::InvalidPointer(format!(
            "{what}: {bytes} bytes at {ptr:#x} run past the end of the address space"
        )));
    }
    Ok((bytes / 8) as u64)
}

fn grid(words: u64) -> u32 {
    words.div_ceil(BLOCK as u64).clamp(1, MAX_GRID as u64) as u32
}

/// # Safety
///
/// `params` are `function`'s parameters, in order, and the memory they name is as
/// [`fill`]'s contract says.
unsafe fn launch(
    backend: &BackendRef,
    dev: i32,
    function: RawFunction,
    words: u64,
    params: &[u64],
    stream: &Stream,
) -> Result<()> {
    // SAFETY: this function's contract: `params` are the parameters the PTX above declares
    // for `function`, and the memory is the caller's (the public functions' contract).
    unsafe { backend.launch_kernel(dev, function, grid(words), BLOCK, params, stream.handle()) }
}

/// Enqueues on `stream` a kernel that fills `[ptr, ptr + bytes)` with the pattern of
/// `seed` (see the module docs).
///
/// # Safety
///
/// `ptr` must be memory of `dev` of `backend` that the caller owns, at least `bytes` bytes
/// long, that nothing else reads or writes until the kernel has run (work ordered on
/// `stream`, or after it). The driver cannot check an address: one that is not device
/// memory faults the context, and where the GPU can reach host memory (pinned memory,
/// and all of it on systems with HMM or ATS) the kernel writes whatever lies there. The
/// simulated device checks it and refuses the launch.
pub unsafe fn fill(
    backend: &BackendRef,
    dev: i32,
    ptr: DevPtr,
    bytes: usize,
    seed: u64,
    stream: &Stream,
) -> Result<()> {
    stream.check(backend, dev)?;
    let n = words(ptr, bytes, "fill")?;
    if n == 0 {
        return Ok(());
    }
    let k = loaded(backend, dev)?;
    // SAFETY: the fill kernel's parameters; the memory is as this function's contract says.
    unsafe { launch(backend, dev, k.fill, n, &[ptr, n, seed], stream) }
}

/// Checks `[ptr, ptr + bytes)` against the pattern of `seed` with a kernel on `stream`,
/// waits for it (synchronising `stream`), and returns the number of 8-byte words that
/// differ. Same memory contract as [`fill`]. Below 8 bytes (no whole word) nothing is
/// launched and 0 returned, but `stream` is still synchronised: callers free the memory on
/// another stream after a check, which is ordered only if the memory's earlier work on
/// `stream` has completed.
///
/// # Safety
///
/// As for [`fill`] (the kernel reads the memory and writes a counter of its own).
pub unsafe fn check(
    backend: &BackendRef,
    dev: i32,
    ptr: DevPtr,
    bytes: usize,
    seed: u64,
    stream: &Stream,
) -> Result<u64> {
    stream.check(backend, dev)?;
    let n = words(ptr, bytes, "check")?;
    if n == 0 {
        // Nothing to check, but the synchronisation is part of the contract (see above).
        stream.synchronize(backend, dev)?;
        return Ok(0);
    }
    let k = loaded(backend, dev)?;
    let counter = take_counter(backend, dev, k)?;
    // The count's host word is on the heap, not this frame: should the synchronisation
    // fail with the copy still queued, the word is leaked, never reused (the copy would
    // have written into whatever used this frame next).
    let slot: *mut u64 = Box::into_raw(Box::new(0u64));
    let host = slot as usize as DevPtr;
    let run = || -> Result<()> {
        backend.memset_d8_async(dev, counter, 0, 8, stream.handle())?;
        // SAFETY: the check kernel's parameters; the memory is as this function's contract
        // says, and `counter` is a word of this device's that this call holds.
        unsafe { launch(backend, dev, k.check, n, &[ptr, n, seed, counter], stream) }?;
        // SAFETY: `slot` is a live heap word, freed below only once the copy has completed
        // (the stream synchronised), and leaked otherwise; `counter` is this device's.
        unsafe { backend.memcpy_async(dev, host, counter, 8, stream.handle()) }?;
        crate::device::synchronize_after_copy(backend, dev, stream.handle())
    };
    match run() {
        Ok(()) => {
            k.counters.lock().unwrap_or_else(|e| e.into_inner()).push(counter);
            // SAFETY: `slot` came from `Box::into_raw` above and the copy that wrote it
            // (behind the compiler's back, through the exposed address) has completed.
            Ok(*unsafe { Box::from_raw(slot) })
        }
        // The counter and the host word may still be written by queued work: neither is
        // handed out again (8 bytes each, on a failure).
        Err(e) => Err(e),
    }
}

/// Enqueues on `stream` a kernel that makes `iterations` read-modify-write passes over
/// `[ptr, ptr + bytes)` and leaves the data as it was (see [`COMPUTE`]): kernel time in
/// proportion to `iterations × bytes`, for workloads that need some. Same memory contract
/// as [`fill`]. Nothing is launched for 0 iterations.
///
/// # Safety
///
/// As for [`fill`] (the kernel reads and writes the memory).
pub unsafe fn compute(
    backend: &BackendRef,
    dev: i32,
    ptr: DevPtr,
    bytes: usize,
    stream: &Stream,
    iterations: u32,
) -> Result<()> {
    stream.check(backend, dev)?;
    let n = words(ptr, bytes, "compute")?;
    if n == 0 || iterations == 0 {
        return Ok(());
    }
    let k = loaded(backend, dev)?;
    let params = [ptr, n, iterations as u64, COMPUTE_MULTIPLIER, COMPUTE_INVERSE];
    // SAFETY: the compute kernel's parameters; the memory is as this function's contract says.
    unsafe { launch(backend, dev, k.compute, n, &params, stream) }
}

fn take_counter(backend: &BackendRef, dev: i32, k: &Loaded) -> Result<DevPtr> {
    let mut free = k.counters.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = free.pop() {
        return Ok(c);
    }
    let block = backend.mem_alloc(dev, COUNTER_BLOCK)?;
    free.extend((1..COUNTER_BLOCK as u64 / 8).map(|i| block + 8 * i));
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inverse_is_an_inverse_and_the_pattern_is_injective_in_the_index() {
        assert_eq!(COMPUTE_MULTIPLIER.wrapping_mul(COMPUTE_INVERSE), 1);
        let words: std::collections::HashSet<u64> = (0..10_000).map(|i| pattern_word(42, i)).collect();
        assert_eq!(words.len(), 10_000);
        assert_ne!(pattern_word(1, 0), pattern_word(2, 0));
    }

    #[test]
    fn the_ptx_declares_the_three_kernels_with_the_hash_constants() {
        for name in [FILL, CHECK, COMPUTE] {
            assert!(PTX.contains(&format!(".visible .entry {name}(")), "{name}");
        }
        // The constants in the PTX are the hash's, as signed decimals.
        assert!(PTX.contains(&(COMPUTE_MULTIPLIER as i64).to_string()));
        assert!(PTX.contains(&(0xBF58_476D_1CE4_E5B9u64 as i64).to_string()));
    }
}
