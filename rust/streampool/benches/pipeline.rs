//! The producer/consumer pipeline across streams (`streampool::harness::pipeline`),
//! driven from Rust: P producer threads, each on its own stream, allocate a chunk, fill it
//! with a kernel and hand it (with an event) to their consumer thread, which waits on the
//! event, runs a compute kernel of about `--kernel-us`, checks every `--check-every`-th
//! chunk and frees the chunk on its own stream.
//!
//! One line per run, resources interleaved and repeated (`--reps`): chunks/s, the share
//! of host time inside allocator calls, the longest single allocator call, peak reserved
//! beside peak live bytes, and the check's mismatches (which must be 0); then per resource
//! and pair count the min/median/max of chunks/s over the repetitions.
//!
//! ```text
//! cargo bench -p streampool --bench pipeline -- [--pairs 1,4,8] [--chunk 1MiB]
//!     [--chunks 2000] [--kernel-us 20] [--check-every 16] [--queue 4] [--reps 3]
//!     [--resources sharded,async] [--sim] [--sim-eager]
//! ```
//! `--resources` takes any of (e.g. `sharded,async,sharded-h1,sharded-h2-b8,latency-sharded`):
//! `async` (the device's current driver pool), `sharded` (the sharded pool over it),
//! `sharded-h1` (the same with `headroom` 1: more memory, fewer driver calls per chunk;
//! `-h<headroom>`, `-hnone` and `-b<event_batch>` set those options), `latency-sharded` (the
//! latency histogram adaptor over the sharded pool). Runs on the CUDA driver when there is
//! one (unless `--sim`), else on the simulated device, and says so (those numbers measure
//! the simulator, not a GPU). `--sim-eager` runs the simulated
//! device's work as soon as it may (a GPU that keeps up). Each line also gives the
//! resource's own driver calls per chunk, by kind, where it counts them (event records,
//! event queries, stream waits, synchronisations, growths).

use std::sync::Arc;

use streampool::adaptors::LatencyHistogramAdaptor;
use streampool::device::cuda::CudaBackend;
use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::harness::pipeline::{pipeline, PipelineOptions};
use streampool::resource::ResourceRef;
use streampool::{parse_size, CudaAsyncMemoryResource, PoolOptions, ShardedPoolMemoryResource};

struct Args {
    pairs: Vec<usize>,
    resources: Vec<String>,
    reps: usize,
    sim: bool,
    sim_eager: bool,
    options: PipelineOptions,
}

fn args() -> Args {
    let mut a = Args {
        pairs: vec![1, 4, 8],
        resources: vec!["sharded".into(), "async".into()],
        reps: 3,
        sim: false,
        sim_eager: false,
        options: PipelineOptions { chunks_per_pair: 2000, check_every: 16, ..Default::default() },
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        let o = &mut a.options;
        match k.as_str() {
            "--pairs" => a.pairs = v().split(',').map(|t| t.parse().expect("--pairs")).collect(),
            "--resources" => a.resources = v().split(',').map(String::from).collect(),
            "--reps" => a.reps = v().parse().expect("--reps"),
            "--chunk" => o.chunk_bytes = parse_size(&v()).expect("--chunk"),
            "--chunks" => o.chunks_per_pair = v().parse().expect("--chunks"),
            "--kernel-us" => o.kernel_us = v().parse().expect("--kernel-us"),
            "--check-every" => o.check_every = v().parse().expect("--check-every"),
            "--queue" => o.queue_depth = v().parse().expect("--queue"),
            "--sim" => a.sim = true,
            "--sim-eager" => (a.sim, a.sim_eager) = (true, true),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn make(name: &str, b: &BackendRef) -> ResourceRef {
    let driver = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    // The driver's pool is the device's, shared: start from what it holds now.
    let _ = driver.trim_to(0);
    let sharded = |options: PoolOptions| -> ResourceRef {
        Arc::new(ShardedPoolMemoryResource::new(driver.clone(), options).unwrap())
    };
    match name {
        "async" => driver,
        "latency-sharded" => Arc::new(LatencyHistogramAdaptor::new(sharded(PoolOptions::default())).unwrap()),
        _ => sharded(pool_options(name)),
    }
}

/// `sharded`, then `-h<headroom>` (`-hnone`: no budget) and `-b<event_batch>` in any order.
fn pool_options(name: &str) -> PoolOptions {
    let usage = || -> ! {
        panic!("unknown resource {name} (async, sharded[-h<headroom>][-b<event batch>], latency-sharded)")
    };
    let mut parts = name.split('-');
    if parts.next() != Some("sharded") {
        usage();
    }
    let mut o = PoolOptions::default();
    for part in parts {
        match part.split_at(1) {
            ("h", "none") => o.headroom = None,
            ("h", v) => o.headroom = Some(v.parse().unwrap_or_else(|_| usage())),
            ("b", v) => o.event_batch = v.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    o
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
}

fn main() {
    let a = args();
    let cuda = if a.sim { Err("--sim".to_string()) } else { CudaBackend::get().map_err(|e| e.to_string()) };
    let backend: BackendRef = match cuda {
        Ok(cuda) => {
            let info = streampool::device::Backend::device_info(&*cuda, 0).unwrap();
            println!("device: {} ({})", info.name, streampool::device::Backend::describe(&*cuda));
            cuda
        }
        Err(e) => {
            eprintln!("no CUDA driver ({e}): running on the simulated device; these numbers measure the simulator and the host");
            let device = SimDevice::new(16 << 30);
            device.set_eager(a.sim_eager);
            let sim: BackendRef = device;
            println!("device: {} (simulated{})", sim.describe(), if a.sim_eager { ", eager" } else { "" });
            sim
        }
    };
    let o = a.options;
    println!(
        "chunk {} B, {} chunks per pair, kernel {} us, check every {}, queue {}",
        o.chunk_bytes, o.chunks_per_pair, o.kernel_us, o.check_every, o.queue_depth
    );
    for &pairs in &a.pairs {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); a.resources.len()];
        for rep in 0..a.reps {
            for (i, name) in a.resources.iter().enumerate() {
                let mr = make(name, &backend);
                let r = pipeline(&*mr, &PipelineOptions { pairs, ..o }).unwrap();
                rates[i].push(r.chunks_per_second);
                let reserved = r.peak_reserved_bytes.map_or("-".into(), |b| mib(b as f64));
                let per = |n: u64| n as f64 / r.chunks as f64;
                let calls = r.driver_calls.map_or("-".into(), |c| {
                    format!(
                        "{:.3} (records {:.3} queries {:.3} waits {:.3} syncs {:.4} growths {:.4})",
                        per(c.total()),
                        per(c.event_records),
                        per(c.event_queries),
                        per(c.stream_waits),
                        per(c.synchronizations),
                        per(c.growths)
                    )
                });
                println!(
                    "pipeline pairs={pairs} rep={rep} {name:<16} {:>9.0} chunks/s  alloc {:>5.2}% of host time  \
                     longest call {:>7.3} ms  reserved {reserved} / live {}  syncs {} waits {}  mismatches {}  \
                     driver calls per chunk {calls}",
                    r.chunks_per_second,
                    100.0 * r.alloc_share,
                    r.longest_call_ns as f64 * 1e-6,
                    mib(r.peak_live_bytes as f64),
                    r.synchronizations.map_or("-".into(), |n| n.to_string()),
                    r.waits.map_or("-".into(), |n| n.to_string()),
                    r.mismatches,
                );
                assert_eq!(r.mismatches, 0, "data corruption in the pipeline on {name}");
            }
        }
        for (name, mut v) in a.resources.iter().zip(rates) {
            v.sort_by(f64::total_cmp);
            println!(
                "summary  pairs={pairs} {name:<16} chunks/s min {:.0} median {:.0} max {:.0}",
                v[0],
                v[v.len() / 2],
                v[v.len() - 1]
            );
        }
    }
}
