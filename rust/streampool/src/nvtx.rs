//! Opt-in NVTX ranges around allocator calls, so that an Nsight Systems timeline shows
//! allocator time next to kernels.
//!
//! With `STREAMPOOL_NVTX=1` (or `true`, `yes`, `on`, in any case) in the environment (read
//! once, at the first use; a value that is neither on nor off gets a warning), the NVTX
//! library is loaded at run time: `libnvToolsExt.so.1` (or `libnvToolsExt.so`), else
//! `libnvtx3interop.so.1` (or `libnvtx3interop.so`), the CUDA toolkit's exports of the
//! NVTX 3 API. Nothing is linked: without the variable nothing is loaded, and when no
//! library can be loaded a warning is printed once on stderr and ranges stay off. The
//! [`LatencyHistogramAdaptor`](crate::adaptors::LatencyHistogramAdaptor) wraps each
//! allocate and deallocate in a range ("streampool allocate", "streampool deallocate").
//! Off, a range costs one load of a flag.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

type Push = unsafe extern "C" fn(*const c_char) -> c_int;
type Pop = unsafe extern "C" fn() -> c_int;

/// The loaded library's range functions.
struct Nvtx {
    push: Push,
    pop: Pop,
    /// Keeps the library loaded (the function pointers point into it).
    _lib: libloading::Library,
}

const LIBRARIES: &[&str] =
    &["libnvToolsExt.so.1", "libnvToolsExt.so", "libnvtx3interop.so.1", "libnvtx3interop.so"];

static NVTX: OnceLock<Option<Nvtx>> = OnceLock::new();

/// Writes a warning to stderr, if it can: a closed or broken stderr loses the warning, never
/// the allocation that asked for ranges (`eprintln!` panics there).
fn warn(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "streampool: {text}");
}

fn load() -> Option<Nvtx> {
    let value = match std::env::var("STREAMPOOL_NVTX") {
        Err(std::env::VarError::NotPresent) => return None,
        Ok(v) => v,
        Err(std::env::VarError::NotUnicode(v)) => format!("{v:?}"),
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => {}
        "" | "0" | "false" | "no" | "off" => return None,
        _ => {
            warn(&format!(
                "the environment variable STREAMPOOL_NVTX is {value:?}, which is neither on (1, true, \
                 yes, on) nor off (0, false, no, off, empty): NVTX ranges stay off"
            ));
            return None;
        }
    }
    for name in LIBRARIES {
        // SAFETY: loading an NVTX library runs its initialisers, which is what asking for
        // NVTX ranges (STREAMPOOL_NVTX=1) means.
        let Ok(lib) = (unsafe { libloading::Library::new(*name) }) else { continue };
        // SAFETY: the NVTX API declares these two functions with exactly these C types
        // (`int nvtxRangePushA(const char*)`, `int nvtxRangePop(void)`).
        let found = unsafe { (lib.get::<Push>(b"nvtxRangePushA\0"), lib.get::<Pop>(b"nvtxRangePop\0")) };
        if let (Ok(push), Ok(pop)) = found {
            let (push, pop) = (*push, *pop);
            return Some(Nvtx { push, pop, _lib: lib });
        }
    }
    warn(&format!(
        "STREAMPOOL_NVTX is {value:?}, but no NVTX library could be loaded ({}); allocator calls get no \
         NVTX ranges (install the CUDA toolkit's NVTX, or put its directory on LD_LIBRARY_PATH)",
        LIBRARIES.join(", ")
    ));
    None
}

/// True when ranges are on (the library loaded); loads it at the first call.
#[inline]
pub fn enabled() -> bool {
    NVTX.get_or_init(load).is_some()
}

/// An NVTX range, open until dropped; nothing when ranges are off. Not `Send`: NVTX's
/// push/pop ranges are per thread, and a range dropped on another thread would close
/// that thread's innermost range instead.
///
/// ```compile_fail
/// fn send<T: Send>(_: T) {}
/// send(streampool::nvtx::Range::new(c"allocate"));
/// ```
#[must_use = "the range closes when this is dropped"]
#[derive(Debug)]
pub struct Range(bool, std::marker::PhantomData<*const ()>);

impl Range {
    /// Opens a range named `name` (when ranges are on).
    #[inline]
    pub fn new(name: &CStr) -> Range {
        match NVTX.get_or_init(load) {
            Some(n) => {
                // SAFETY: `push` is the library's `nvtxRangePushA`, which copies the
                // NUL-terminated name; the library stays loaded for the process.
                unsafe { (n.push)(name.as_ptr()) };
                Range(true, std::marker::PhantomData)
            }
            None => Range(false, std::marker::PhantomData),
        }
    }
}

impl Drop for Range {
    #[inline]
    fn drop(&mut self) {
        if let (true, Some(Some(n))) = (self.0, NVTX.get()) {
            // SAFETY: `pop` is the library's `nvtxRangePop`, closing the range this opened.
            unsafe { (n.pop)() };
        }
    }
}
