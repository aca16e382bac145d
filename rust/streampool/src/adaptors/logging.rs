//! A CSV event log in RMM's format, and its parser.
//!
//! The format is what RMM's `logging_resource_adaptor` writes (its logger pattern
//! `%t,%H:%M:%S.%f,%v`, then `allocate,%p,%zu,<stream>`; rapidsai/rmm
//! `cpp/src/mr/detail/logging_resource_adaptor_impl.cpp`) and what its replay benchmark
//! reads (`cpp/benchmarks/utilities/log_parser.hpp`):
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140573312345856,14:03:22.123456,allocate,0x7f8a40000000,1024,0x5581c6e0a0f0
//! 140573312345856,14:03:22.123789,allocate failure,(nil),68719476736,0
//! 140573312345856,14:03:22.124012,free,0x7f8a40000000,1024,0x5581c6e0a0f0
//! ```
//!
//! Thread: the OS thread id (decimal). Time: the time of day, to the microsecond (UTC
//! here; RMM writes local time). Pointer: hexadecimal, `(nil)` for none. Stream: the
//! stream handle in hexadecimal, `0` for the legacy default stream.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{as_own_oom, upstream_properties};
use crate::device::{DevPtr, RawStream};
use crate::error::{record_if_failed, Error, Result};
use crate::resource::{check_depth, MemoryResource, ResourceRef};
use crate::stream::Stream;

/// The first line of every log.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// A function that takes one log line (without its line break).
pub type LogCallback = Arc<dyn Fn(&str) -> Result<()> + Send + Sync>;

/// Where a [`LoggingAdaptor`] writes.
#[derive(Clone)]
pub enum LogSink {
    /// A file, created (or truncated) when the adaptor is made.
    File(PathBuf),
    /// A function given each line (the header first), without its line break.
    Callback(LogCallback),
}

impl fmt::Debug for LogSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LogSink::File(p) => f.debug_tuple("File").field(p).finish(),
            LogSink::Callback(_) => f.write_str("Callback(..)"),
        }
    }
}

/// An event of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogAction {
    /// `allocate`: an allocation that succeeded.
    Allocate,
    /// `allocate failure`: an allocation that failed (pointer `(nil)`).
    AllocateFailure,
    /// `free`.
    Free,
}

impl LogAction {
    fn as_str(self) -> &'static str {
        match self {
            LogAction::Allocate => "allocate",
            LogAction::AllocateFailure => "allocate failure",
            LogAction::Free => "free",
        }
    }
}

/// One line of a log.
#[derive(Debug, Clone, PartialEq)]
pub struct LogEvent {
    /// The thread's id.
    pub thread: u64,
    /// Seconds since midnight for RMM's `hh:mm:ss.micro` (UTC in logs written here), or
    /// the number as written when the line has a plain number.
    pub time: f64,
    /// What happened.
    pub action: LogAction,
    /// The address (0 for `(nil)`).
    pub ptr: DevPtr,
    /// The size in bytes.
    pub bytes: usize,
    /// The stream handle.
    pub stream: RawStream,
}

/// Logs every allocation and free to files and functions, one CSV line each (RMM's
/// `logging_resource_adaptor`; see the module docs for the format).
///
/// Invariant: every line is complete when the call that made it returns: each is one
/// unbuffered `write` to the file (opened for appending, so concurrent lines never
/// interleave), so a crash loses at most the line being written. A free is logged
/// *before* the upstream free and an allocation *after* the upstream allocation, so an
/// address's `free` always precedes the `allocate` that reuses it, on any thread.
///
/// A failing sink (a callback that returns an error, a full disk): on allocate, the
/// memory is freed again (and a `free` line written, best effort, so the other sinks'
/// logs stay balanced) and the sink's error is returned, so nothing leaks and the caller
/// sees it; on free, the free still happens and succeeds, and the sink's error is recorded
/// ([`drop_errors`](crate::drop_errors); from Python, the sink's exception goes to
/// `sys.unraisablehook`): an error from a free means that nothing was freed, which the
/// adaptors above rely on to keep their counts. A free that the upstream then refuses is
/// still in the log (the log records requests, as RMM's does). No lock is held while a
/// sink runs.
///
/// Sizes: frees are logged and forwarded as given, wrong sizes included (the log records
/// requests); the upstream checks them where it can.
///
/// What a reader of the log may miss: calls in flight, and the exact order of lines from
/// different threads within a microsecond.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use streampool::device::sim::SimDevice;
/// use streampool::{parse_log, CudaAsyncMemoryResource, LogSink, LoggingAdaptor, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let lines = Arc::new(Mutex::new(Vec::<String>::new()));
/// let sink = { let l = lines.clone(); LogSink::Callback(Arc::new(move |s: &str| Ok(l.lock().unwrap().push(s.into())))) };
/// let mr = LoggingAdaptor::new(Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?), vec![sink])?;
/// let p = mr.allocate(1024, &Stream::legacy())?;
/// mr.deallocate(p, 1024, &Stream::legacy())?;
/// let events = parse_log(&lines.lock().unwrap().join("\n"))?;
/// assert_eq!((events.len(), events[0].ptr, events[1].bytes), (2, p, 1024));
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct LoggingAdaptor {
    upstream: ResourceRef,
    file: Option<(PathBuf, File)>,
    callbacks: Vec<LogCallback>,
}

impl LoggingAdaptor {
    /// Logs to `sinks` (at most one file); the file is created or truncated and every
    /// sink is given the header line.
    pub fn new(upstream: ResourceRef, sinks: Vec<LogSink>) -> Result<Self> {
        check_depth("LoggingResourceAdaptor", [&upstream])?;
        let mut file = None;
        let mut callbacks = Vec::new();
        for sink in sinks {
            match sink {
                LogSink::File(path) if file.is_some() => {
                    return Err(Error::invalid(format!(
                        "LoggingResourceAdaptor: one log file at most (a second one: {})",
                        path.display()
                    )))
                }
                LogSink::File(path) => {
                    let cannot_create = |e: std::io::Error| {
                        Error::io("LoggingResourceAdaptor: cannot create the log file", &path, &e)
                    };
                    std::fs::write(&path, format!("{LOG_HEADER}\n")).map_err(cannot_create)?;
                    let f = OpenOptions::new().append(true).open(&path).map_err(cannot_create)?;
                    file = Some((path, f));
                }
                LogSink::Callback(cb) => {
                    cb(LOG_HEADER)?;
                    callbacks.push(cb);
                }
            }
        }
        Ok(LoggingAdaptor { upstream, file, callbacks })
    }

    /// Makes the file's lines durable (`fsync`); every line already reached the
    /// operating system when it was logged. A file that cannot be synchronised (`/dev/null`,
    /// `/dev/stderr`, a pipe: `EINVAL`) has nothing to make durable, and flushes without
    /// error, as RMM's flush (a stdio flush) does there.
    pub fn flush(&self) -> Result<()> {
        match &self.file {
            Some((path, f)) => match f.sync_data() {
                Err(e)
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported
                    ) =>
                {
                    Err(io_error(path, e))
                }
                _ => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// The log file, if it logs to one.
    pub fn file_name(&self) -> Option<&Path> {
        self.file.as_ref().map(|(p, _)| p.as_path())
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    /// Writes one line to every sink; the first error, after trying them all.
    fn log(&self, action: LogAction, ptr: DevPtr, bytes: usize, stream: RawStream) -> Result<()> {
        let line = format_line(os_thread_id(), action, ptr, bytes, stream);
        let mut first_error = None;
        if let Some((path, file)) = &self.file {
            // One write call for the whole line (with its break): an append is atomic.
            let mut f: &File = file;
            if let Err(e) = f.write_all(format!("{line}\n").as_bytes()) {
                first_error.get_or_insert(io_error(path, e));
            }
        }
        for cb in &self.callbacks {
            if let Err(e) = cb(&line) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl MemoryResource for LoggingAdaptor {
    upstream_properties!("LoggingResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let s = stream.handle();
        match self.upstream.allocate(bytes, stream) {
            Ok(ptr) => {
                if let Err(e) = self.log(LogAction::Allocate, ptr, bytes, s) {
                    // Best effort: the sink's error is the one returned; a failure of the
                    // clean-up is recorded (see `drop_errors`).
                    let what = || {
                        format!("LoggingResourceAdaptor: undoing an allocation whose log line failed ({e})")
                    };
                    record_if_failed(what, self.log(LogAction::Free, ptr, bytes, s));
                    record_if_failed(what, self.upstream.deallocate(ptr, bytes, stream));
                    return Err(e);
                }
                Ok(ptr)
            }
            Err(e) => {
                // The allocation's own error wins over a sink's.
                let _ = self.log(LogAction::AllocateFailure, 0, bytes, s);
                Err(as_own_oom(e, bytes, self))
            }
        }
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        let logged = self.log(LogAction::Free, ptr, bytes, stream.handle());
        self.upstream.deallocate(ptr, bytes, stream)?;
        // Freed: reporting the sink's failure as this call's would tell the adaptors above
        // that nothing was freed (they would keep counting the memory, and a retry would
        // free it twice).
        record_if_failed(
            || {
                format!("LoggingResourceAdaptor: the log line of a free of {bytes} bytes at {ptr:#x}, which was freed")
            },
            logged,
        );
        Ok(())
    }

    // The fast path is not forwarded (the trait's default: every call takes the full
    // path). A file sink's write may block, which must not happen with the GIL held; a
    // free is logged before its upstream free, so a free that the upstream's fast path
    // then sent to the full path would be logged twice; and a sink that fails makes the
    // adaptor free the memory again, which may wait. Logging is for finding out what a
    // program does, not for its hot path.
}

impl fmt::Debug for LoggingAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoggingAdaptor")
            .field("file", &self.file_name())
            .field("callbacks", &self.callbacks.len())
            .field("upstream", &self.upstream)
            .finish()
    }
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::io("LoggingResourceAdaptor: cannot write the log file", path, &e)
}

/// A line as RMM writes it: `%p` gives `(nil)` for null, and a null stream prints as `0`.
fn format_line(thread: u64, action: LogAction, ptr: DevPtr, bytes: usize, stream: RawStream) -> String {
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros()) % 86_400_000_000;
    let (h, m, s, us) =
        (micros / 3_600_000_000, micros / 60_000_000 % 60, micros / 1_000_000 % 60, micros % 1_000_000);
    let ptr = if ptr == 0 { "(nil)".to_string() } else { format!("{ptr:#x}") };
    let stream = if stream == 0 { "0".to_string() } else { format!("{stream:#x}") };
    format!("{thread},{h:02}:{m:02}:{s:02}.{us:06},{},{ptr},{bytes},{stream}", action.as_str())
}

/// The OS thread id (what RMM's logger prints for `%t`), where the system tells it;
/// otherwise a number derived from Rust's thread id.
fn os_thread_id() -> u64 {
    thread_local! {
        static ID: u64 = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|p| p.file_name()?.to_str()?.parse().ok())
            .unwrap_or_else(|| {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                std::thread::current().id().hash(&mut h);
                h.finish()
            });
    }
    ID.with(|id| *id)
}

/// Parses a log written by [`LoggingAdaptor`] or by RMM. The header line is required;
/// blank lines are skipped; a bad line is [`Error::InvalidArgument`] naming its number
/// (1-based) and what is wrong with it.
///
/// Pointer and Stream are hexadecimal with or without `0x` (RMM prints both through
/// C++'s hexadecimal formatting); `(nil)` is 0. Time is `hh:mm:ss.fraction` (seconds
/// since midnight) or a plain number of seconds, from 0 to [`MAX_LOG_TIME_S`]. `deallocate`, which RMM's user guide
/// shows for frees, is read as `free`.
pub fn parse_log(text: &str) -> Result<Vec<LogEvent>> {
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty());
    match lines.next() {
        Some((_, header)) if header == LOG_HEADER => {}
        Some((n, other)) => {
            return Err(Error::invalid(format!(
                "log line {n}: expected the header `{LOG_HEADER}`, found `{other}`"
            )))
        }
        None => return Err(Error::invalid(format!("empty log: expected the header `{LOG_HEADER}`"))),
    }
    lines
        .map(|(n, line)| {
            parse_line(line).map_err(|why| Error::invalid(format!("log line {n}: {why}: `{line}`")))
        })
        .collect()
}

fn parse_line(line: &str) -> Result<LogEvent, String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let [thread, time, action, ptr, bytes, stream] = fields[..] else {
        return Err(format!("expected 6 comma-separated fields, found {}", fields.len()));
    };
    let action = match action {
        "allocate" => LogAction::Allocate,
        "allocate failure" => LogAction::AllocateFailure,
        "free" | "deallocate" => LogAction::Free,
        other => return Err(format!("unknown action `{other}` (allocate, allocate failure or free)")),
    };
    Ok(LogEvent {
        thread: thread.parse().map_err(|_| format!("bad thread id `{thread}`"))?,
        time: parse_time(time).ok_or_else(|| format!("bad time `{time}`"))?,
        action,
        ptr: parse_hex(ptr).ok_or_else(|| format!("bad pointer `{ptr}`"))?,
        bytes: bytes.parse().map_err(|_| format!("bad size `{bytes}`"))?,
        stream: parse_hex(stream).ok_or_else(|| format!("bad stream `{stream}`"))?,
    })
}

fn parse_hex(s: &str) -> Option<u64> {
    if s == "(nil)" {
        return Some(0);
    }
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    u64::from_str_radix(digits, 16).ok()
}

fn parse_time(s: &str) -> Option<f64> {
    let parts: Vec<&str> = s.split(':').collect();
    let secs = match parts[..] {
        [secs] => secs.parse().ok()?,
        [h, m, secs] => {
            let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
            let secs: f64 = secs.parse().ok()?;
            if m >= 60 || !(0.0..61.0).contains(&secs) {
                return None;
            }
            f64::from(h) * 3600.0 + f64::from(m) * 60.0 + secs
        }
        _ => return None,
    };
    // Times are kept in nanoseconds (an `i64` in a replay's trace): at most about 292 years.
    (0.0..=MAX_LOG_TIME_S).contains(&secs).then_some(secs)
}

/// The latest time a log line may have, in seconds: `i64::MAX` nanoseconds, rounded down
/// (292 years; a time of day, or seconds since 1970, fit with room to spare).
pub const MAX_LOG_TIME_S: f64 = 9.2e9;
