//! The window workload of `../shared/peers/bench_rmm.cpp` ("mt"), for streampool's
//! resources: T threads, each on its own non-blocking stream, each keeping a ring of 16
//! live allocations of log-uniform size in [1 KiB, 4 MiB] (8192 pre-generated per thread),
//! freeing the oldest before each new one (the loop of `bench_rmm.cpp`'s `run_mt`, with its
//! counters padded to cache lines as there). 100 ms of warm-up, then aggregate allocations per second in
//! one common window (the main thread snapshots per-thread counters at its start and
//! end), and the slowest thread's share of the mean; beside it, the least CPU time any thread
//! got in the window and the slowest thread's operations per CPU-second against the mean
//! (which tell a thread the OS ran less from one the pool slowed). Also the one-thread
//! "fixed" pairs.
//!
//! ```text
//! cargo bench -p streampool --bench window -- [--secs 0.5] [--reps 3]
//!     [--threads 1,2,4,8,16] [--resources sharded,async,control] [--events-every N] [--json FILE]
//!     [--sim] [--same-sizes]
//! ```
//! Runs on the CUDA driver when there is one (unless `--sim`), else on the simulated device
//! (and says so: those numbers measure the simulator and the host, not a GPU).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use streampool::device::cuda::CudaBackend;
use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::device::DevPtr;
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, MemoryKind, MemoryResource, PoolOptions, PoolStats, ShardedPoolMemoryResource,
    Stream,
};

const WINDOW: usize = 16;
/// Pre-generated sizes per thread, as in `bench_rmm.cpp`.
const SIZES: usize = 8192;

struct Args {
    secs: f64,
    reps: usize,
    threads: Vec<usize>,
    resources: Vec<String>,
    json: Option<String>,
    events_every: usize,
    sim: bool,
    /// Every thread draws the same sizes (a diagnostic: how much of the spread between
    /// threads comes from their different size sequences).
    same_sizes: bool,
}

fn args() -> Args {
    let mut a = Args {
        secs: 0.5,
        reps: 3,
        threads: vec![1, 2, 4, 8, 16],
        resources: vec!["sharded".into(), "async".into()],
        json: None,
        events_every: PoolOptions::default().events_every,
        sim: false,
        same_sizes: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--secs" => a.secs = v().parse().expect("--secs"),
            "--reps" => a.reps = v().parse().expect("--reps"),
            "--threads" => a.threads = v().split(',').map(|t| t.parse().expect("--threads")).collect(),
            "--resources" => a.resources = v().split(',').map(String::from).collect(),
            "--json" => a.json = Some(v()),
            "--events-every" => a.events_every = v().parse().expect("--events-every"),
            "--sim" => a.sim = true,
            "--same-sizes" => a.same_sizes = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// The resource of `name`, and the pool itself when it is one (for its counters).
fn make(
    name: &str,
    b: &BackendRef,
    events_every: usize,
) -> (ResourceRef, Option<Arc<ShardedPoolMemoryResource>>) {
    let async_mr: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    match name {
        "async" => (async_mr, None),
        "sharded" => {
            let pool = Arc::new(
                ShardedPoolMemoryResource::new(async_mr, PoolOptions { events_every, ..Default::default() })
                    .unwrap(),
            );
            (pool.clone(), Some(pool))
        }
        "control" => (Arc::new(Control { backend: b.clone() }), None),
        other => panic!("unknown resource {other} (sharded, async, control)"),
    }
}

/// A control, not a resource: each call does a fixed amount of arithmetic on its own
/// registers (no memory shared, no lock, nothing that depends on the sizes) and hands out
/// a made-up address. Its threads can differ in speed only because their cores do, so the
/// window's fairness figures for it measure the machine.
#[derive(Debug)]
struct Control {
    backend: BackendRef,
}

impl MemoryResource for Control {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "control"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, _: &Stream) -> streampool::Result<DevPtr> {
        let mut x = bytes as u64 | 1;
        for _ in 0..40 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        Ok(std::hint::black_box(x) | 1 << 40)
    }
    fn do_deallocate(&self, ptr: DevPtr, _: usize, _: &Stream) -> streampool::Result<()> {
        std::hint::black_box(ptr);
        Ok(())
    }
}

/// Log-uniform sizes in [1 KiB, 4 MiB], pre-generated (xorshift; the same per seed).
fn sizes(seed: u64, n: usize) -> Vec<usize> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            (1024.0 * 4096f64.powf(u)) as usize
        })
        .collect()
}

struct MtResult {
    allocs_per_sec: f64,
    ns_per_op_per_thread: f64,
    slowest_share: f64,
    /// The least CPU time any thread got, as a share of the window.
    least_on_cpu: f64,
    /// The slowest thread's operations per CPU-second, as a share of the mean: near 1 when
    /// threads differ only in how long the OS ran them.
    slowest_per_cpu_share: f64,
    /// A pool's events recorded, growths, and steals, waits and synchronisations, in the
    /// window.
    in_window: Option<[u64; 3]>,
}

/// A thread's operation count, on a cache line of its own (as `bench_rmm.cpp`'s
/// `PaddedCounter`): counters side by side would make every thread's store evict the
/// others' line, and the benchmark would measure that.
#[repr(align(128))]
struct Counter {
    ops: AtomicU64,
    /// The thread's CPU time (ns), stored every 256 operations: a thread that gets fewer
    /// operations done than others only because the OS ran it less shows here.
    cpu_ns: AtomicU64,
}

/// This thread's CPU time in ns (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn run_mt(
    (mr, pool): &(ResourceRef, Option<Arc<ShardedPoolMemoryResource>>),
    b: &BackendRef,
    threads: usize,
    secs: f64,
    same_sizes: bool,
) -> MtResult {
    let counters: Arc<Vec<Counter>> = Arc::new(
        (0..threads).map(|_| Counter { ops: AtomicU64::new(0), cpu_ns: AtomicU64::new(0) }).collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (mr, b, counters, stop, ready) =
                (mr.clone(), b.clone(), counters.clone(), stop.clone(), ready.clone());
            std::thread::spawn(move || {
                let stream = Stream::create(&b, 0, false).unwrap();
                let sizes = sizes(if same_sizes { 1 } else { t as u64 + 1 }, SIZES);
                // A ring of WINDOW live allocations, filled before the start.
                let mut k = 0usize;
                let mut ring: Vec<(u64, usize)> = (0..WINDOW)
                    .map(|_| {
                        let n = sizes[k % SIZES];
                        k += 1;
                        (mr.allocate(n, &stream).unwrap(), n)
                    })
                    .collect();
                let (mut head, mut ops) = (0usize, 0u64);
                ready.wait();
                while !stop.load(Ordering::Relaxed) {
                    let (p, n) = ring[head];
                    mr.deallocate(p, n, &stream).unwrap();
                    let n = sizes[k % SIZES];
                    k += 1;
                    ring[head] = (mr.allocate(n, &stream).unwrap(), n);
                    head = (head + 1) % WINDOW;
                    ops += 1;
                    if ops % 256 == 0 {
                        counters[t].cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
                    }
                    counters[t].ops.store(ops, Ordering::Relaxed);
                }
                for (p, n) in ring {
                    mr.deallocate(p, n, &stream).unwrap();
                }
                b.stream_synchronize(0, stream.handle()).unwrap();
            })
        })
        .collect();
    ready.wait();
    std::thread::sleep(Duration::from_millis(100));
    let snapshot = || -> Vec<(u64, u64)> {
        counters.iter().map(|c| (c.ops.load(Ordering::Relaxed), c.cpu_ns.load(Ordering::Relaxed))).collect()
    };
    let stats0 = pool.as_ref().map(|p| p.stats());
    let start = snapshot();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let end = snapshot();
    let stats1 = pool.as_ref().map(|p| p.stats());
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let per: Vec<f64> = start.iter().zip(&end).map(|(s, e)| (e.0 - s.0) as f64).collect();
    let cpu: Vec<f64> = start.iter().zip(&end).map(|(s, e)| (e.1 - s.1) as f64 / 1e9).collect();
    let per_cpu: Vec<f64> =
        per.iter().zip(&cpu).map(|(ops, c)| if *c > 0.0 { ops / c } else { 0.0 }).collect();
    let mean_per_cpu = per_cpu.iter().sum::<f64>() / threads as f64;
    let total: f64 = per.iter().sum();
    let mean = total / threads as f64;
    let slowest = per.iter().cloned().fold(f64::INFINITY, f64::min);
    MtResult {
        allocs_per_sec: total / elapsed,
        ns_per_op_per_thread: if mean > 0.0 { elapsed * 1e9 / mean } else { f64::INFINITY },
        slowest_share: if mean > 0.0 { slowest / mean } else { 0.0 },
        least_on_cpu: cpu.iter().cloned().fold(f64::INFINITY, f64::min) / elapsed,
        slowest_per_cpu_share: per_cpu.iter().cloned().fold(f64::INFINITY, f64::min) / mean_per_cpu,
        in_window: stats0.zip(stats1).map(|(s0, s1)| {
            let slow = |s: &PoolStats| s.completed_steals + s.cross_stream_waits + s.synchronizations;
            [
                s1.events_recorded - s0.events_recorded,
                s1.upstream_growths - s0.upstream_growths,
                slow(&s1) - slow(&s0),
            ]
        }),
    }
}

/// One thread, one stream: median ns per allocate+free pair of `n` bytes.
fn run_fixed(mr: &ResourceRef, b: &BackendRef, n: usize, reps: usize) -> f64 {
    let stream = Stream::create(b, 0, false).unwrap();
    let mut samples = Vec::new();
    for _ in 0..reps.max(3) {
        let iters = 20_000;
        let t0 = Instant::now();
        for _ in 0..iters {
            let p = mr.allocate(n, &stream).unwrap();
            mr.deallocate(p, n, &stream).unwrap();
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e9 / iters as f64);
    }
    b.stream_synchronize(0, stream.handle()).unwrap();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[samples.len() / 2]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let a = args();
    let cuda = if a.sim { Err("--sim".to_string()) } else { CudaBackend::get().map_err(|e| e.to_string()) };
    let (backend, device): (BackendRef, String) = match cuda {
        Ok(cuda) => {
            let info = streampool::device::Backend::device_info(&*cuda, 0).unwrap();
            let d = format!("{} ({})", info.name, streampool::device::Backend::describe(&*cuda));
            (cuda, d)
        }
        Err(e) => {
            eprintln!(
                "no CUDA driver ({e}): running on the simulated device; these numbers measure the simulator and the host"
            );
            let sim: BackendRef = SimDevice::new(64 << 30);
            let d = sim.describe();
            (sim, d)
        }
    };
    println!("device: {device}");
    let mut json = Vec::new();
    for name in &a.resources {
        for &n in &[256usize, 64 << 10, 4 << 20] {
            let (mr, _) = make(name, &backend, a.events_every);
            let ns = run_fixed(&mr, &backend, n, a.reps);
            println!("fixed  {name:<8} {n:>8} B  {ns:8.1} ns/pair");
            json.push(format!(
                r#"{{"workload":"fixed","resource":"{name}","bytes":{n},"ns_per_pair":{ns:.1}}}"#
            ));
        }
        for &t in &a.threads {
            let runs: Vec<MtResult> = (0..a.reps)
                .map(|_| run_mt(&make(name, &backend, a.events_every), &backend, t, a.secs, a.same_sizes))
                .collect();
            let rate = median(runs.iter().map(|r| r.allocs_per_sec).collect());
            let ns = median(runs.iter().map(|r| r.ns_per_op_per_thread).collect());
            let share = median(runs.iter().map(|r| r.slowest_share).collect());
            let on_cpu = median(runs.iter().map(|r| r.least_on_cpu).collect());
            let per_cpu = median(runs.iter().map(|r| r.slowest_per_cpu_share).collect());
            let counts = match runs.iter().filter_map(|r| r.in_window).max() {
                Some([e, g, s]) => {
                    format!("; in the window at most {e} events, {g} growths, {s} steals/waits/syncs")
                }
                None => String::new(),
            };
            println!(
                "window {name:<8} T={t:<2}  {:8.3} M allocs/s  {ns:8.1} ns/op/thread  slowest {share:.2}  \
                 (least on CPU {on_cpu:.2} of the window; per CPU-second, slowest {per_cpu:.2}{counts})",
                rate / 1e6
            );
            json.push(format!(
                r#"{{"workload":"window","resource":"{name}","threads":{t},"allocs_per_sec":{rate:.0},"ns_per_op_per_thread":{ns:.1},"slowest_share":{share:.3},"least_on_cpu":{on_cpu:.3},"slowest_per_cpu_share":{per_cpu:.3}}}"#
            ));
        }
    }
    if let Some(path) = a.json {
        std::fs::write(&path, format!("{{\"device\":{device:?},\"results\":[{}]}}\n", json.join(",")))
            .unwrap();
    }
}
