//! What the replayer (`streampool::harness::replay`) itself costs per event, and the same
//! log on real resources beside it.
//!
//! The log: T threads, each on its own stream, each keeping a ring of 16 live allocations
//! of log-uniform size in [1 KiB, 4 MiB] and freeing the oldest before each new one (the
//! window workload), N allocations per thread, replayed flat out (`gap_scale` 0). On the
//! null resource (which hands out no memory and takes no time) the time per event of one
//! thread is the replayer's own overhead: the target is at most 100 ns.
//!
//! ```text
//! cargo bench -p streampool --bench replay -- [--threads 1,4] [--allocs 200000] [--reps 3]
//!     [--resources null,sharded,async] [--sim]
//! ```

use std::sync::Arc;

use streampool::device::cuda::CudaBackend;
use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::harness::replay::{replay, Op, Record, ReplayOptions};
use streampool::harness::NullMemoryResource;
use streampool::resource::ResourceRef;
use streampool::{CudaAsyncMemoryResource, PoolOptions, ShardedPoolMemoryResource};

const WINDOW: u64 = 16;

fn log(threads: u32, allocs: u64) -> Vec<Record> {
    let mut out = Vec::with_capacity((threads as u64 * allocs * 2) as usize);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut size = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        (1024.0 * 4096f64.powf(u)) as u64
    };
    let mut sizes = vec![0u64; (threads as u64 * allocs) as usize];
    for s in sizes.iter_mut() {
        *s = size();
    }
    let id = |t: u32, i: u64| ((t as u64) << 40) | i;
    for i in 0..allocs + WINDOW {
        for t in 0..threads {
            let rec = |op, i: u64| Record {
                t_ns: i,
                size: sizes[(t as u64 * allocs + i) as usize],
                alloc_id: id(t, i),
                thread: t,
                stream: t,
                op,
            };
            if i >= WINDOW {
                out.push(rec(Op::Free, i - WINDOW));
            }
            if i < allocs {
                out.push(rec(Op::Allocate, i));
            }
        }
    }
    out
}

fn main() {
    let mut threads = vec![1u32, 4];
    let mut allocs = 200_000u64;
    let mut reps = 3;
    let mut resources = vec!["null".to_string(), "sharded".into(), "async".into()];
    let mut sim = false;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--threads" => threads = v().split(',').map(|t| t.parse().expect("--threads")).collect(),
            "--allocs" => allocs = v().parse().expect("--allocs"),
            "--reps" => reps = v().parse().expect("--reps"),
            "--resources" => resources = v().split(',').map(String::from).collect(),
            "--sim" => sim = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let backend: BackendRef = match if sim { None } else { CudaBackend::get().ok() } {
        Some(cuda) => {
            println!("device: {}", streampool::device::Backend::describe(&*cuda));
            cuda
        }
        None => {
            let s: BackendRef = SimDevice::new(64 << 30);
            println!("device: {} (simulated: real resources' figures measure the simulator)", s.describe());
            s
        }
    };
    for &t in &threads {
        let records = log(t, allocs);
        let per_thread = records.len() as f64 / t as f64;
        for name in &resources {
            let mut ns = Vec::new();
            for _ in 0..reps {
                let mr: ResourceRef = match name.as_str() {
                    "null" => Arc::new(NullMemoryResource::on(backend.clone(), 0)),
                    "async" => {
                        Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default()).unwrap())
                    }
                    "sharded" => Arc::new(
                        ShardedPoolMemoryResource::new(
                            Arc::new(
                                CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default()).unwrap(),
                            ),
                            PoolOptions::default(),
                        )
                        .unwrap(),
                    ),
                    other => panic!("unknown resource {other} (null, sharded, async)"),
                };
                let r =
                    replay(&*mr, &records, ReplayOptions { gap_scale: 0.0, ..Default::default() }).unwrap();
                ns.push(r.seconds * 1e9 / per_thread);
            }
            ns.sort_by(f64::total_cmp);
            println!(
                "replay threads={t} {name:<8} {:>7.1} ns/event per thread (min {:.1}, max {:.1}; {} events per thread)",
                ns[ns.len() / 2],
                ns[0],
                ns[ns.len() - 1],
                per_thread as u64
            );
        }
    }
}
