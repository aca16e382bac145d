//! One error type for the whole crate. Errors are data: every variant carries what a
//! caller (or the Python binding, which maps each variant in one `match`) needs to say
//! what went wrong without parsing a message.

/// The crate's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in streampool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request that the resource could not meet.
    #[error("out of memory: {resource} could not allocate {requested} bytes{}", fmt_available(*.available))]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// What the resource (or device) had free, where it knows.
        available: Option<usize>,
        /// The resource that refused, e.g. `CudaAsyncMemoryResource`.
        resource: String,
    },
    /// A CUDA driver call returned an error.
    #[error("{call} failed: {name} ({code}){}", fmt_context(context))]
    Driver {
        /// The driver function, e.g. `cuMemAllocFromPoolAsync`.
        call: &'static str,
        /// The `CUresult` value.
        code: i32,
        /// The `CUresult` name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// What streampool was doing, where that helps.
        context: String,
    },
    /// No usable CUDA driver on this machine (library missing, `cuInit` failed, no device).
    #[error("no CUDA driver found: {0}. To run without a GPU, use the simulated device: `with streampool.sim.SimulatedDevice(): ...` in Python, `let _guard = SimDevice::new(capacity).activate()?;` in Rust, or STREAMPOOL_DEVICE=sim in the environment")]
    DriverNotFound(String),
    /// The driver is present but lacks something this call needs (e.g. a CUDA 13 feature).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A bad argument: a size, a device, a setting.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A pointer the resource does not own, a double free, or a size that does not match.
    #[error("invalid pointer: {0}")]
    InvalidPointer(String),
    /// A stream (or event) that is destroyed, unknown, of another device or of another backend.
    #[error("invalid stream: {0}")]
    InvalidStream(String),
    /// A file could not be created or written (a log file), with the operating system's
    /// error: bindings raise their language's own (Python: `OSError` of the errno's class,
    /// such as `FileNotFoundError`, with `filename` set).
    #[error("{what} {}: {message}", path.display())]
    Io {
        /// What streampool was doing, e.g. "LoggingResourceAdaptor: cannot create the log file".
        what: String,
        /// The file.
        path: std::path::PathBuf,
        /// The operating system's error number, where there is one (`ENOENT`, `EACCES`).
        errno: Option<i32>,
        /// The operating system's words, e.g. "No such file or directory (os error 2)".
        message: String,
    },
    /// A user callback (a failure callback, a logging sink) failed. Bindings that call into
    /// another language keep the original exception and raise it instead.
    #[error("callback failed: {0}")]
    Callback(String),
    /// A user's allocate function reported that it had no memory to give (a Python
    /// `MemoryError`): out of memory to the adaptors above it (a failure callback retries),
    /// and, like [`Error::Callback`], raised as the original exception by the bindings.
    #[error("out of memory: {0}")]
    CallbackOutOfMemory(String),
}

fn fmt_available(available: Option<usize>) -> String {
    match plausible_available(available) {
        Some(a) => format!(" ({a} bytes available)"),
        None => String::new(),
    }
}

/// `available` where it can be a real figure: no memory holds more than `isize::MAX`
/// bytes, so a larger one is a "no limit" sentinel leaking through (`usize::MAX` less
/// something) and means "unknown".
pub fn plausible_available(available: Option<usize>) -> Option<usize> {
    available.filter(|&a| a <= isize::MAX as usize)
}

fn fmt_context(context: &str) -> String {
    if context.is_empty() {
        String::new()
    } else {
        format!(" while {context}")
    }
}

impl Error {
    /// [`Error::Io`] from a failed operation on `path`.
    pub fn io(what: impl Into<String>, path: &std::path::Path, e: &std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            path: path.to_owned(),
            errno: e.raw_os_error(),
            message: e.to_string(),
        }
    }

    /// A plain invalid-argument error.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// True for [`Error::OutOfMemory`] and for the driver's `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. } | Error::CallbackOutOfMemory(_))
            || matches!(self, Error::Driver { code, .. } if *code == CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Adds what streampool was doing to a driver error; other errors pass through.
    pub fn context(self, what: impl Into<String>) -> Self {
        match self {
            Error::Driver { call, code, name, context } if context.is_empty() => {
                Error::Driver { call, code, name, context: what.into() }
            }
            e => e,
        }
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY`, as the driver (and the simulated device) report it.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (interpreter exit).
pub const CUDA_ERROR_DEINITIALIZED: i32 = 4;
/// `CUDA_ERROR_INVALID_CONTEXT`: no context current (or a destroyed one).
pub const CUDA_ERROR_INVALID_CONTEXT: i32 = 201;
/// `CUDA_ERROR_INVALID_DEVICE`: not a device, or one that cannot do what was asked.
pub const CUDA_ERROR_INVALID_DEVICE: i32 = 101;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;

// ---------------------------------------------------------------------------------------
// Failures that nobody can be told of.

/// Messages [`drop_errors`] keeps: the most recent ones.
const DROP_ERRORS_KEPT: usize = 16;

/// Failures recorded by [`record_drop_error`]: how many, and the last few messages.
/// std's lock, not `crate::sync`'s: a static, which loom's cannot be (and no model
/// checks this).
static DROP_ERRORS: std::sync::Mutex<DropErrorLog> =
    std::sync::Mutex::new(DropErrorLog { count: 0, recent: std::collections::VecDeque::new() });

struct DropErrorLog {
    count: u64,
    recent: std::collections::VecDeque<String>,
}

/// What [`drop_errors`] reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DropErrors {
    /// Failures recorded since the process started.
    pub count: u64,
    /// The messages of the most recent ones (at most 16), oldest first.
    pub recent: Vec<String>,
}

/// The failures that happened where nobody could be told: in a `Drop` (an [`Allocation`]
/// freed by going out of scope, a stream or event destroyed with its last handle, a
/// resource giving its memory back), or while cleaning up after another error (memory
/// freed again after a failed prefetch or log line). Such a failure is recorded here
/// rather than ignored or panicked on (a panic in a `Drop` can abort the process, and
/// never may cross into Python).
///
/// Some are expected: at process exit the driver may be torn down before the last
/// objects are dropped. Read it in tests and when looking for leaks.
///
/// [`Allocation`]: crate::Allocation
pub fn drop_errors() -> DropErrors {
    let log = DROP_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    DropErrors { count: log.count, recent: log.recent.iter().cloned().collect() }
}

/// Records a failure that has nobody to report to (see [`drop_errors`]); `what` says what
/// was being done, e.g. `"dropping an Allocation of 4096 bytes"`. Never panics, never
/// blocks for long (a lock held only to push a message), and allocates only the message.
pub fn record_drop_error(what: &str, error: &Error) {
    let message = format!("{what}: {error}");
    let mut log = DROP_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    log.count += 1;
    if log.recent.len() == DROP_ERRORS_KEPT {
        log.recent.pop_front();
    }
    log.recent.push_back(message);
}

/// [`record_drop_error`] for a result: records its error, if any.
pub(crate) fn record_if_failed(what: impl FnOnce() -> String, result: Result<()>) {
    if let Err(e) = result {
        record_drop_error(&what(), &e);
    }
}

/// Records, on a resource's drop, the allocations never freed whose memory goes back to
/// the upstream with the resource's own (`what`: how many bytes or blocks): a leak the
/// program should hear of, since any later use of them is a use after free.
pub(crate) fn record_leak_on_drop(resource: &str, what: &str) {
    record_drop_error(
        &format!("dropping a {resource}"),
        &Error::InvalidPointer(format!(
            "{what} still allocated from it (never freed); their memory goes back to the upstream with the \
             {resource}'s, so using or freeing them now is a use after free"
        )),
    );
}

/// The device synchronisation a resource makes before it gives its memory back on drop,
/// its failure recorded. A closed backend (a simulated device since exited) has no work
/// left to wait for: nothing is asked of it, and nothing is recorded.
pub(crate) fn synchronize_on_drop(
    backend: &crate::device::BackendRef,
    device: i32,
    what: impl FnOnce() -> String,
) {
    if backend.check_open().is_ok() {
        record_if_failed(what, backend.ctx_synchronize(device));
    }
}
