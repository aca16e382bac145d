//! The window workload of `benchmarks/bench_rmm.cpp` ("mt"), for streampool's
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
//! Every window figure comes with memory: the peak of the live bytes (sizes asked for,
//! summed over the threads) and the peak of what the resource reserved from the device
//! (the pool's `peak_reserved_bytes`; for `async`, the driver pool's reserved memory,
//! sampled), and their ratio. The live bytes are sampled every millisecond, which misses
//! short peaks (so the ratio reads high: on the simulated device at 4 threads the sampled
//! peak was 15 % under the exact one); `--exact-live` counts them exactly, in one shared
//! counter that every operation updates (which costs speed: use it for memory figures).
//!
//! `--handoff` makes it the producer/consumer soak: each thread, when it evicts a block,
//! hands half of them (at random) to the next thread after recording an event on its own
//! stream; that thread waits on the event and frees the block on its own stream. At most 16
//! blocks are in flight to a thread; beyond that the evicting thread frees the block itself.
//!
//! ```text
//! cargo bench -p streampool --bench window -- [--secs 0.5] [--reps 3]
//!     [--threads 1,2,4,8,16] [--resources sharded,async] [--events-every N] [--json FILE]
//!     [--sim] [--sim-eager] [--same-sizes] [--handoff] [--no-fixed] [--headroom F|none] [--exact-live]
//!     [--every SECS] [--gather-us MICROSECONDS] [--expandable] [--steal-whole] [--one-heap]
//! ```
//! `--resources` takes any of `sharded`, `latency-sharded` (the latency histogram adaptor over
//! the sharded pool), `async` (the driver's pool) and `control` (touches no memory).
//! Runs on the CUDA driver when there is one (unless `--sim`), else on the simulated device
//! (and says so: those numbers measure the simulator and the host, not a GPU). `--sim-eager`
//! (implies `--sim`) runs the simulator's work as soon as it is enqueued, as a GPU runs
//! work with no kernels; without it, work runs only at synchronisations, and events
//! recorded by the pool complete only then.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
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
    /// On the simulated device, run work as soon as it is enqueued (`SimDevice::set_eager`),
    /// as a GPU runs work with no kernels: events complete at once.
    sim_eager: bool,
    /// Every thread draws the same sizes (a diagnostic: how much of the spread between
    /// threads comes from their different size sequences).
    same_sizes: bool,
    handoff: bool,
    fixed: bool,
    /// The pool's footprint budget (`PoolOptions::headroom`).
    headroom: Option<f64>,
    /// The pool's `PoolOptions::gather_interval`, in microseconds.
    gather_us: Option<u64>,
    /// Count the live bytes exactly (a shared counter) rather than by sampling.
    exact_live: bool,
    /// Print the peak reserved and live bytes every this many seconds of the window (a
    /// soak's plateau).
    every: Option<f64>,
    /// The pool grows in place (`PoolOptions::expandable`).
    expandable: bool,
    /// Steals take whole blocks (`PoolOptions::steal_whole_blocks`).
    steal_whole: bool,
    /// One heap for every stream (`PoolOptions::one_heap`).
    one_heap: bool,
}

impl Args {
    fn pool_options(&self) -> PoolOptions {
        let mut o = PoolOptions {
            events_every: self.events_every,
            headroom: self.headroom,
            expandable: self.expandable,
            steal_whole_blocks: self.steal_whole,
            one_heap: self.one_heap,
            ..Default::default()
        };
        if let Some(us) = self.gather_us {
            o.gather_interval = std::time::Duration::from_micros(us);
        }
        o
    }
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
        sim_eager: false,
        same_sizes: false,
        handoff: false,
        fixed: true,
        headroom: PoolOptions::default().headroom,
        gather_us: None,
        exact_live: false,
        every: None,
        expandable: false,
        steal_whole: false,
        one_heap: false,
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
            "--sim-eager" => (a.sim, a.sim_eager) = (true, true),
            "--same-sizes" => a.same_sizes = true,
            "--handoff" => a.handoff = true,
            "--no-fixed" => a.fixed = false,
            "--headroom" => a.headroom = v().parse().ok(),
            "--gather-us" => a.gather_us = Some(v().parse().expect("--gather-us")),
            "--exact-live" => a.exact_live = true,
            "--expandable" => a.expandable = true,
            "--steal-whole" => a.steal_whole = true,
            "--one-heap" => a.one_heap = true,
            "--every" => a.every = Some(v().parse().expect("--every")),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// The resource of `name`, and the pool itself when it is one (for its counters).
/// A resource under test, with what tells its reserved memory.
struct Made {
    mr: ResourceRef,
    pool: Option<Arc<ShardedPoolMemoryResource>>,
    driver_pool: Option<Arc<CudaAsyncMemoryResource>>,
}

impl Made {
    /// Bytes reserved from the device now (the pool's peak, or the driver pool's reserved).
    fn reserved(&self) -> usize {
        match (&self.pool, &self.driver_pool) {
            (Some(p), _) => p.stats().peak_reserved_bytes,
            (None, Some(d)) => d.reserved_bytes().unwrap_or(0),
            _ => 0,
        }
    }
}

fn make(name: &str, b: &BackendRef, options: &PoolOptions) -> Made {
    let driver = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    // The driver's pool is the device's, shared: start from what it holds now.
    let _ = driver.trim_to(0);
    let async_mr: ResourceRef = driver.clone();
    match name {
        "async" => Made { mr: async_mr, pool: None, driver_pool: Some(driver) },
        "sharded" => {
            let pool = Arc::new(ShardedPoolMemoryResource::new(async_mr, options.clone()).unwrap());
            Made { mr: pool.clone(), pool: Some(pool), driver_pool: None }
        }
        // The latency histogram adaptor over the sharded pool: its cost beside "sharded".
        "latency-sharded" => {
            let pool = Arc::new(ShardedPoolMemoryResource::new(async_mr, options.clone()).unwrap());
            let mr = Arc::new(streampool::adaptors::LatencyHistogramAdaptor::new(pool.clone()).unwrap());
            Made { mr, pool: Some(pool), driver_pool: None }
        }
        "control" => Made { mr: Arc::new(Control { backend: b.clone() }), pool: None, driver_pool: None },
        other => panic!("unknown resource {other} (sharded, latency-sharded, async, control)"),
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
    /// Peak live bytes (sampled, or exact) and peak reserved bytes, warm-up included.
    peak_live: usize,
    peak_reserved: usize,
    /// The threads' own peaks of live bytes, summed: what a resource needs that serves each
    /// thread only from memory that thread freed (a floor for memory reused across streams
    /// only through synchronisation). Meaningless with hand-offs.
    own_peaks: usize,
    /// A pool's counts over the whole run, warm-up included: growths, completed steals,
    /// waits, synchronisations (where the footprint comes from).
    whole_run: Option<[u64; 4]>,
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
    /// The live bytes this thread allocated less those it freed (sizes asked for), stored
    /// at every operation. With hand-offs a thread frees blocks that others allocated, so
    /// one thread's figure may be negative; the sum over threads is what is live.
    live: AtomicI64,
    /// The most the thread's own count reached (stored when it stops).
    own_peak: AtomicI64,
}

/// This thread's CPU time in ns (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A block handed to another thread: its address and size, and the event after which
/// the other thread may use it.
type Handoff = (u64, usize, streampool::Event);

fn run_mt(made: &Made, b: &BackendRef, threads: usize, a: &Args) -> MtResult {
    let (secs, same_sizes, handoff, exact_live) = (a.secs, a.same_sizes, a.handoff, a.exact_live);
    let (mr, pool) = (&made.mr, &made.pool);
    let counters: Arc<Vec<Counter>> = Arc::new(
        (0..threads)
            .map(|_| Counter {
                ops: AtomicU64::new(0),
                cpu_ns: AtomicU64::new(0),
                live: AtomicI64::new(0),
                own_peak: AtomicI64::new(0),
            })
            .collect(),
    );
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| std::sync::mpsc::sync_channel::<Handoff>(WINDOW)).unzip();
    let done = Arc::new(Barrier::new(threads));
    let exact: Arc<Option<(AtomicI64, AtomicI64)>> =
        Arc::new(exact_live.then(|| (AtomicI64::new(0), AtomicI64::new(0))));
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let (mr, b, counters, stop, ready, done, exact) = (
                mr.clone(),
                b.clone(),
                counters.clone(),
                stop.clone(),
                ready.clone(),
                done.clone(),
                exact.clone(),
            );
            let next = senders[(t + 1) % threads].clone();
            std::thread::spawn(move || {
                let stream = Stream::create(&b, 0, false).unwrap();
                let sizes = sizes(if same_sizes { 1 } else { t as u64 + 1 }, SIZES);
                let mut coin = t as u64 * 0x9e37_79b9 + 1;
                let mut live = 0i64;
                let mut own_peak = 0i64;
                // Every allocation and free also goes through `count` (exact peak live).
                let count = |delta: i64| {
                    if let Some((now, peak)) = &*exact {
                        let v = now.fetch_add(delta, Ordering::Relaxed) + delta;
                        if delta > 0 {
                            peak.fetch_max(v, Ordering::Relaxed);
                        }
                    }
                };
                // A ring of WINDOW live allocations, filled before the start.
                let mut k = 0usize;
                let mut ring: Vec<(u64, usize)> = (0..WINDOW)
                    .map(|_| {
                        let n = sizes[k % SIZES];
                        k += 1;
                        live += n as i64;
                        count(n as i64);
                        (mr.allocate(n, &stream).unwrap(), n)
                    })
                    .collect();
                let (mut head, mut ops) = (0usize, 0u64);
                let receive = |live: &mut i64| {
                    while let Ok((p, n, ev)) = inbox.try_recv() {
                        stream.wait(&ev).unwrap();
                        mr.deallocate(p, n, &stream).unwrap();
                        *live -= n as i64;
                        count(-(n as i64));
                    }
                };
                ready.wait();
                while !stop.load(Ordering::Relaxed) {
                    let (p, n) = ring[head];
                    coin ^= coin << 13;
                    coin ^= coin >> 7;
                    coin ^= coin << 17;
                    // Half the blocks go to the next thread, which frees them after this
                    // stream's work so far; at most WINDOW are in flight to a thread (a
                    // thread the OS runs less would otherwise collect blocks without end),
                    // beyond which this thread frees them itself.
                    let handed = handoff && coin.is_multiple_of(2) && {
                        let ev = streampool::Event::new(&b, 0).unwrap();
                        ev.record(&stream).unwrap();
                        next.try_send((p, n, ev)).is_ok()
                    };
                    if !handed {
                        mr.deallocate(p, n, &stream).unwrap();
                        live -= n as i64;
                        count(-(n as i64));
                    }
                    if handoff {
                        receive(&mut live);
                    }
                    let n = sizes[k % SIZES];
                    k += 1;
                    ring[head] = (mr.allocate(n, &stream).unwrap(), n);
                    live += n as i64;
                    count(n as i64);
                    head = (head + 1) % WINDOW;
                    ops += 1;
                    if ops % 256 == 0 {
                        counters[t].cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
                    }
                    counters[t].ops.store(ops, Ordering::Relaxed);
                    counters[t].live.store(live, Ordering::Relaxed);
                    own_peak = own_peak.max(live);
                }
                counters[t].own_peak.store(own_peak, Ordering::Relaxed);
                for (p, n) in ring {
                    mr.deallocate(p, n, &stream).unwrap();
                }
                done.wait();
                receive(&mut live);
                b.stream_synchronize(0, stream.handle()).unwrap();
            })
        })
        .collect();
    drop(senders);
    ready.wait();
    // Peak live: the sum of the threads' live bytes, sampled every millisecond (from the
    // first allocation, warm-up included); it can only miss a peak, so the ratio shown is
    // if anything too high. With `--exact-live`, the shared counter's peak instead.
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (counters, sampling) = (counters.clone(), sampling.clone());
        std::thread::spawn(move || {
            let mut peak = 0i64;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(counters.iter().map(|c| c.live.load(Ordering::Relaxed)).sum());
                std::thread::sleep(Duration::from_millis(1));
            }
            peak as usize
        })
    };
    let mut peak_reserved = made.reserved();
    std::thread::sleep(Duration::from_millis(100));
    let snapshot = || -> Vec<(u64, u64)> {
        counters.iter().map(|c| (c.ops.load(Ordering::Relaxed), c.cpu_ns.load(Ordering::Relaxed))).collect()
    };
    let stats0 = pool.as_ref().map(|p| p.stats());
    let start = snapshot();
    let t0 = Instant::now();
    match a.every {
        Some(every) => {
            // The peak live so far: exact, or the threads' counts now.
            let live_now = || match &*exact {
                Some((_, peak)) => peak.load(Ordering::Relaxed).max(0),
                None => counters.iter().map(|c| c.live.load(Ordering::Relaxed)).sum(),
            };
            while t0.elapsed().as_secs_f64() + every <= secs {
                std::thread::sleep(Duration::from_secs_f64(every));
                let growths = pool.as_ref().map_or(0, |p| p.stats().upstream_growths);
                println!(
                    "  {:6.1} s: peak reserved {:.0} MiB, live {:.0} MiB ({}), {growths} growths",
                    t0.elapsed().as_secs_f64(),
                    made.reserved() as f64 / (1 << 20) as f64,
                    live_now() as f64 / (1 << 20) as f64,
                    if exact_live { "peak" } else { "now" },
                );
            }
            std::thread::sleep(Duration::from_secs_f64((secs - t0.elapsed().as_secs_f64()).max(0.0)));
        }
        None => std::thread::sleep(Duration::from_secs_f64(secs)),
    }
    let end = snapshot();
    let stats1 = pool.as_ref().map(|p| p.stats());
    let elapsed = t0.elapsed().as_secs_f64();
    peak_reserved = peak_reserved.max(made.reserved());
    sampling.store(false, Ordering::Relaxed);
    let sampled = sampler.join().unwrap();
    let peak_live = match &*exact {
        Some((_, peak)) => peak.load(Ordering::Relaxed).max(0) as usize,
        None => sampled,
    };
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
        peak_live,
        peak_reserved,
        own_peaks: counters.iter().map(|c| c.own_peak.load(Ordering::Relaxed).max(0) as usize).sum(),
        whole_run: pool.as_ref().map(|p| {
            let s = p.stats();
            [s.upstream_growths, s.completed_steals, s.cross_stream_waits, s.synchronizations]
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
            let sim = SimDevice::new(64 << 30);
            sim.set_eager(a.sim_eager);
            let sim: BackendRef = sim;
            let d = sim.describe();
            (sim, d)
        }
    };
    println!("device: {device}");
    let mut json = Vec::new();
    for name in &a.resources {
        for &n in if a.fixed { &[256usize, 64 << 10, 4 << 20][..] } else { &[] } {
            let mr = make(name, &backend, &a.pool_options()).mr;
            let ns = run_fixed(&mr, &backend, n, a.reps);
            println!("fixed  {name:<8} {n:>8} B  {ns:8.1} ns/pair");
            json.push(format!(
                r#"{{"workload":"fixed","resource":"{name}","bytes":{n},"ns_per_pair":{ns:.1}}}"#
            ));
        }
        for &t in &a.threads {
            let runs: Vec<MtResult> = (0..a.reps)
                .map(|_| {
                    let made = make(name, &backend, &a.pool_options());
                    run_mt(&made, &backend, t, &a)
                })
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
            // Memory: the worst round's ratio, and its figures.
            let worst = runs
                .iter()
                .max_by(|x, y| {
                    let r = |m: &MtResult| m.peak_reserved as f64 / m.peak_live.max(1) as f64;
                    r(x).partial_cmp(&r(y)).unwrap()
                })
                .expect("at least one round");
            let (live, reserved) = (worst.peak_live, worst.peak_reserved);
            let own = if a.handoff || t == 1 {
                String::new()
            } else {
                format!(
                    "; the threads' own peaks sum to {:.2} times the peak live",
                    worst.own_peaks as f64 / live.max(1) as f64
                )
            };
            let ratio = if reserved == 0 { f64::NAN } else { reserved as f64 / live.max(1) as f64 };
            let workload = if a.handoff { "handoff" } else { "window" };
            let counted = if a.exact_live { "exact" } else { "sampled" };
            let whole = match worst.whole_run {
                Some([g, st, w, sy]) => {
                    format!("; whole run of that round: {g} growths, {st} completed steals, {w} waits, {sy} syncs")
                }
                None => String::new(),
            };
            println!(
                "{workload} {name:<8} T={t:<2}  {:8.3} M allocs/s  {ns:8.1} ns/op/thread  slowest {share:.2}  \
                 reserved/live {ratio:.2} ({:.0}/{:.0} MiB, worst round, live {counted})  \
                 (least on CPU {on_cpu:.2} of the window; per CPU-second, slowest {per_cpu:.2}{counts}{whole}{own})",
                rate / 1e6,
                reserved as f64 / (1 << 20) as f64,
                live as f64 / (1 << 20) as f64,
            );
            json.push(format!(
                r#"{{"workload":"{workload}","resource":"{name}","threads":{t},"allocs_per_sec":{rate:.0},"ns_per_op_per_thread":{ns:.1},"slowest_share":{share:.3},"least_on_cpu":{on_cpu:.3},"slowest_per_cpu_share":{per_cpu:.3},"peak_live_bytes":{live},"live_counted":"{counted}","peak_reserved_bytes":{reserved},"threads_own_peaks_bytes":{}}}"#,
                worst.own_peaks
            ));
        }
    }
    if let Some(path) = a.json {
        std::fs::write(&path, format!("{{\"device\":{device:?},\"results\":[{}]}}\n", json.join(",")))
            .unwrap();
    }
}
