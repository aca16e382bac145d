//! Randomised multi-threaded stress of the sharded pool on the simulated device: threads
//! that create and destroy streams, allocate random sizes, free on the allocating stream or
//! hand blocks to other threads/streams (event, free on the home stream, or a host
//! synchronisation), short-lived threads on their per-thread default stream, and a side
//! thread that releases and steps the device. Checks: no race the simulated device sees,
//! no two live allocations overlap, exact accounting at quiescence, release() leaves
//! nothing free to give back, no drop errors.
//!
//! `POOLRACE_SEEDS=a..b` (default 0..16), `POOLRACE_OPS` (per thread per round, default 400),
//! `POOLRACE_ROUNDS` (default 3), `POOLRACE_THREADS` (default 6).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;
use common::XorShift;

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, CudaMemoryResource, Event, MemoryResource, PoolOptions,
    ShardedPoolMemoryResource, Stream,
};

const MIB: usize = 1 << 20;

#[derive(Clone)]
enum Home {
    /// An owned stream or the legacy stream: usable from any thread.
    Shared(Stream),
    /// The allocating thread's per-thread default stream: only an event hands it over.
    PerThread,
}

struct Handoff {
    ptr: DevPtr,
    n: usize,
    home: Home,
    /// 0: event recorded on home after the last use; 1: free on the home stream itself
    /// (by another thread); 2: the receiver synchronises home on the host, then frees on
    /// its own stream.
    kind: u8,
    event: Option<Event>,
    from: usize,
}

struct Shared {
    pool: Arc<ShardedPoolMemoryResource>,
    sim: Arc<SimDevice>,
    b: BackendRef,
    live: Mutex<BTreeMap<DevPtr, (u64, String)>>,
    queue: Mutex<Vec<Handoff>>,
    limited: bool,
    stop: AtomicBool,
}

impl Shared {
    fn claim(&self, ptr: DevPtr, n: usize, who: String) {
        let mut live = self.live.lock().unwrap();
        let end = ptr + n as u64;
        if let Some((&q, (qend, qwho))) = live.range(..end).next_back() {
            assert!(
                *qend <= ptr || q >= end,
                "OVERLAP: {ptr:#x}+{n} ({who}) with {q:#x}..{qend:#x} ({qwho})"
            );
        }
        live.insert(ptr, (end, who));
    }
    fn unclaim(&self, ptr: DevPtr) {
        assert!(self.live.lock().unwrap().remove(&ptr).is_some(), "unclaim of unknown {ptr:#x}");
    }

    fn alloc(&self, n: usize, s: &Stream, who: &str) -> Option<DevPtr> {
        // Half the time the binding's fast path first (every lock tried, never waited for).
        let fast =
            if (n ^ (s.handle() as usize)).is_multiple_of(2) { self.pool.try_allocate(n, s) } else { None };
        match fast.unwrap_or_else(|| self.pool.allocate(n, s)) {
            Ok(ptr) => {
                self.claim(ptr, n, format!("{who} {n}B on {s:?}"));
                self.sim.write_labeled(s.handle(), ptr, n, &format!("{who} alloc {ptr:#x}+{n}")).unwrap();
                Some(ptr)
            }
            Err(e) if e.is_out_of_memory() && self.limited => None,
            Err(e) => panic!("allocate {n} on {s:?}: {e}"),
        }
    }

    fn free(&self, ptr: DevPtr, n: usize, s: &Stream, who: &str) {
        self.sim.read_labeled(s.handle(), ptr, n, &format!("{who} last read {ptr:#x}")).unwrap();
        self.unclaim(ptr);
        let fast =
            if (ptr as usize / 256).is_multiple_of(2) { self.pool.try_deallocate(ptr, n, s) } else { None };
        fast.unwrap_or_else(|| self.pool.deallocate(ptr, n, s))
            .unwrap_or_else(|e| panic!("free {ptr:#x}+{n} on {s:?}: {e}"));
    }

    /// Receives a hand-off on `mine` (an owned stream of the receiving thread).
    fn receive(&self, h: Handoff, mine: &Stream, who: &str) {
        match (h.kind, &h.home) {
            (1, Home::Shared(home)) => {
                self.free(h.ptr, h.n, home, &format!("{who} (from t{}) on home", h.from))
            }
            (2, Home::Shared(home)) => {
                if std::env::var("POOLRACE_MUTANT").is_err() {
                    home.synchronize(&self.b, 0).unwrap();
                }
                self.free(h.ptr, h.n, mine, &format!("{who} (from t{}) after host sync", h.from));
            }
            _ => {
                mine.wait(h.event.as_ref().expect("event hand-off")).unwrap();
                self.free(h.ptr, h.n, mine, &format!("{who} (from t{}) after event", h.from));
            }
        }
    }
}

fn size(rng: &mut XorShift) -> usize {
    match rng.next() % 10 {
        0..=3 => 1 + (rng.next() % 4096) as usize,
        4..=7 => rng.size().min(MIB),
        _ => 1 + (rng.next() % (6 * MIB as u64)) as usize,
    }
}

struct Live {
    ptr: DevPtr,
    n: usize,
    home: Home,
}

fn home_stream(h: &Home) -> Stream {
    match h {
        Home::Shared(s) => s.clone(),
        Home::PerThread => Stream::per_thread(),
    }
}

/// A thread that lives for a few operations on its per-thread default stream, then exits
/// (its shard retires), handing what it still holds to the queue with events.
fn short_lived(sh: Arc<Shared>, seed: u64, parent: usize) {
    let mut rng = XorShift::new(seed);
    let who = format!("t{parent}-child{seed:x}");
    let pt = Stream::per_thread();
    let mut mine = Vec::new();
    for _ in 0..(1 + rng.next() % 12) {
        if let Some(ptr) = sh.alloc(size(&mut rng), &pt, &who) {
            // size re-drawn is wrong; keep the size with the pointer instead
            mine.push(ptr);
        }
    }
    // (sizes: the claim map knows them)
    let sized: Vec<(DevPtr, usize)> = {
        let live = sh.live.lock().unwrap();
        mine.iter().map(|&p| (p, (live[&p].0 - p) as usize)).collect()
    };
    for (ptr, n) in sized {
        match rng.next() % 3 {
            0 => sh.free(ptr, n, &pt, &who),
            _ => {
                let ev = Event::new(&sh.b, 0).unwrap();
                ev.record(&pt).unwrap();
                sh.queue.lock().unwrap().push(Handoff {
                    ptr,
                    n,
                    home: Home::PerThread,
                    kind: 0,
                    event: Some(ev),
                    from: parent,
                });
            }
        }
    }
    if rng.next().is_multiple_of(2) {
        sh.sim.step_any();
    }
}

fn worker(sh: Arc<Shared>, t: usize, seed: u64, ops: usize, mut live: Vec<Live>) -> Vec<Live> {
    let mut rng = XorShift::new(seed.wrapping_mul(1000003).wrapping_add(t as u64));
    let who = format!("t{t}");
    let mut streams: Vec<Stream> =
        (0..1 + rng.next() % 3).map(|_| Stream::create(&sh.b, 0, false).unwrap()).collect();
    let pick = |rng: &mut XorShift, streams: &Vec<Stream>| -> Home {
        match rng.next() % 20 {
            0..=1 => Home::PerThread,
            2 => Home::Shared(Stream::legacy()),
            _ => Home::Shared(streams[(rng.next() % streams.len() as u64) as usize].clone()),
        }
    };
    for _ in 0..ops {
        let mut op = rng.next() % 100;
        if op <= 37 && live.len() >= 16 {
            op = 38 + op % 40; // bounded live set: free or hand off instead
        }
        if (70..=78).contains(&op) && sh.queue.lock().unwrap().len() >= 24 {
            op = 79; // bounded queue: receive instead
        }
        match op {
            0..=37 => {
                let home = pick(&mut rng, &streams);
                let s = home_stream(&home);
                let n = size(&mut rng);
                if let Some(ptr) = sh.alloc(n, &s, &who) {
                    live.push(Live { ptr, n, home });
                }
            }
            38..=57 if !live.is_empty() => {
                let l = live.swap_remove((rng.next() % live.len() as u64) as usize);
                sh.free(l.ptr, l.n, &home_stream(&l.home), &format!("{who} own"));
            }
            58..=65 if !live.is_empty() => {
                // Another of my streams, ordered by an event.
                let l = live.swap_remove((rng.next() % live.len() as u64) as usize);
                let to = streams[(rng.next() % streams.len() as u64) as usize].clone();
                let ev = Event::new(&sh.b, 0).unwrap();
                ev.record(&home_stream(&l.home)).unwrap();
                to.wait(&ev).unwrap();
                if rng.next().is_multiple_of(2) {
                    sh.sim
                        .write_labeled(to.handle(), l.ptr, l.n, &format!("{who} moved {:#x}", l.ptr))
                        .unwrap();
                    live.push(Live { ptr: l.ptr, n: l.n, home: Home::Shared(to) });
                } else {
                    sh.free(l.ptr, l.n, &to, &format!("{who} event-moved"));
                }
            }
            66..=69 if !live.is_empty() => {
                // Another of my streams, ordered by a host synchronisation of home.
                let l = live.swap_remove((rng.next() % live.len() as u64) as usize);
                let to = streams[(rng.next() % streams.len() as u64) as usize].clone();
                home_stream(&l.home).synchronize(&sh.b, 0).unwrap();
                sh.free(l.ptr, l.n, &to, &format!("{who} synced-moved"));
            }
            70..=78 if !live.is_empty() => {
                let l = live.swap_remove((rng.next() % live.len() as u64) as usize);
                let kind = match l.home {
                    Home::PerThread => 0,
                    _ => (rng.next() % 3) as u8,
                };
                let event = (kind == 0).then(|| {
                    let ev = Event::new(&sh.b, 0).unwrap();
                    ev.record(&home_stream(&l.home)).unwrap();
                    ev
                });
                sh.queue.lock().unwrap().push(Handoff {
                    ptr: l.ptr,
                    n: l.n,
                    home: l.home,
                    kind,
                    event,
                    from: t,
                });
            }
            79..=85 => {
                let h = {
                    let mut q = sh.queue.lock().unwrap();
                    if q.is_empty() {
                        None
                    } else {
                        let i = (rng.next() % q.len() as u64) as usize;
                        Some(q.swap_remove(i))
                    }
                };
                if let Some(h) = h {
                    let mine = streams[(rng.next() % streams.len() as u64) as usize].clone();
                    sh.receive(h, &mine, &who);
                }
            }
            86..=89 => {
                if rng.next().is_multiple_of(2) && streams.len() < 5 {
                    streams.push(Stream::create(&sh.b, 0, false).unwrap());
                } else if streams.len() > 1 {
                    // Destroyed once the last clone (held by live blocks or hand-offs) goes.
                    streams.swap_remove((rng.next() % streams.len() as u64) as usize);
                }
            }
            90..=94 => {
                for _ in 0..rng.next() % 8 {
                    sh.sim.step_any();
                }
            }
            95 => {
                let s = &streams[(rng.next() % streams.len() as u64) as usize];
                s.synchronize(&sh.b, 0).unwrap();
            }
            96..=97 => {
                let (sh2, seed2) = (sh.clone(), rng.next());
                std::thread::spawn(move || short_lived(sh2, seed2, t)).join().unwrap();
            }
            _ => {
                // Per-thread stream blocks must be settled before this thread exits.
            }
        }
    }
    // Blocks on this thread's per-thread stream cannot outlive it as `PerThread`: hand them
    // over with an event.
    let mut keep = Vec::new();
    for l in live {
        if matches!(l.home, Home::PerThread) {
            let ev = Event::new(&sh.b, 0).unwrap();
            ev.record(&Stream::per_thread()).unwrap();
            sh.queue.lock().unwrap().push(Handoff {
                ptr: l.ptr,
                n: l.n,
                home: l.home,
                kind: 0,
                event: Some(ev),
                from: t,
            });
        } else {
            keep.push(l);
        }
    }
    keep
}

fn options_for(seed: u64) -> (PoolOptions, bool, &'static str) {
    let mut r = XorShift::new(seed ^ 0xabcdef);
    let bit = |r: &mut XorShift| r.next().is_multiple_of(2);
    let expandable = bit(&mut r);
    let o = PoolOptions {
        initial_pool_size: if r.next().is_multiple_of(4) { Some(3 * MIB + 512) } else { None },
        maximum_pool_size: match r.next() % 4 {
            0 => Some(40 * MIB),
            3 => Some(20 * MIB + 256),
            1 => Some(96 * MIB + 4096),
            _ => None,
        },
        release_threshold: if bit(&mut r) { Some(2 * MIB) } else { None },
        events_every: [1, 3, 64][(r.next() % 3) as usize],
        event_batch: [1, 1, 4][(r.next() % 3) as usize],
        headroom: [None, Some(0.0), Some(0.15)][(r.next() % 3) as usize],
        gather_interval: if bit(&mut r) { Duration::ZERO } else { Duration::from_micros(100) },
        expandable,
        steal_whole_blocks: bit(&mut r),
        one_heap: false,
    };
    let mut sync_upstream = bit(&mut r);
    // One seed in four: one heap for every stream, with and without growth in place, over
    // either upstream (the other seeds keep their options).
    let o = if seed % 4 == 3 {
        sync_upstream = (seed / 8) % 2 == 1;
        let expandable = (seed / 4).is_multiple_of(2);
        PoolOptions { one_heap: true, release_threshold: None, steal_whole_blocks: false, expandable, ..o }
    } else {
        o
    };
    let limited = o.maximum_pool_size.is_some();
    (o, limited, if sync_upstream { "CudaMemoryResource" } else { "CudaAsyncMemoryResource" })
}

fn run_seed(seed: u64, threads: usize, rounds: usize, ops: usize) {
    let (options, limited, up) = options_for(seed);
    eprintln!("seed {seed}: {up} {options:?}");
    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef = if up == "CudaMemoryResource" {
        Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap())
    } else {
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap())
    };
    let pool = Arc::new(ShardedPoolMemoryResource::new(upstream, options.clone()).unwrap());
    let sh = Arc::new(Shared {
        pool: pool.clone(),
        sim: sim.clone(),
        b: b.clone(),
        live: Mutex::new(BTreeMap::new()),
        queue: Mutex::new(Vec::new()),
        limited,
        stop: AtomicBool::new(false),
    });
    let errors_before = streampool::drop_errors().count;
    let mut carried: Vec<Vec<Live>> = (0..threads).map(|_| Vec::new()).collect();
    for round in 0..rounds {
        sh.stop.store(false, Ordering::Relaxed);
        let side = {
            let sh = sh.clone();
            std::thread::spawn(move || {
                let mut rng = XorShift::new(seed + 77 + round as u64);
                while !sh.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(rng.next() % 3000));
                    match rng.next() % 4 {
                        0 => {
                            sh.pool.release().unwrap();
                        }
                        1 => sh.sim.run(),
                        _ => {
                            for _ in 0..rng.next() % 32 {
                                sh.sim.step_any();
                            }
                        }
                    }
                    let _ = sh.pool.stats();
                }
            })
        };
        let handles: Vec<_> = carried
            .drain(..)
            .enumerate()
            .map(|(t, live)| {
                let sh = sh.clone();
                std::thread::spawn(move || worker(sh, t, seed * 131 + round as u64, ops, live))
            })
            .collect();
        carried = handles.into_iter().map(|h| h.join().unwrap()).collect();
        sh.stop.store(true, Ordering::Relaxed);
        side.join().unwrap();
        // Quiescent: hand-offs left in the queue are received on a fresh stream.
        let s = Stream::create(&b, 0, false).unwrap();
        let left: Vec<Handoff> = sh.queue.lock().unwrap().drain(..).collect();
        for h in left {
            sh.receive(h, &s, "main");
        }
        drop(s);
        let st = pool.stats();
        assert_eq!(st.reserved_bytes, st.used_bytes + st.free_bytes, "seed {seed} round {round}: {st:?}");
        assert_eq!(
            st.grown_bytes,
            st.reserved_bytes as u64 + st.released_bytes,
            "seed {seed} round {round}: {st:?}"
        );
        let live_n: usize = carried.iter().flatten().map(|l| l.n).sum();
        assert!(st.used_bytes >= live_n, "seed {seed} round {round}: used {} < live {live_n}", st.used_bytes);
        if let Some(m) = options.maximum_pool_size {
            assert!(st.reserved_bytes <= m, "seed {seed}: reserved {} > maximum {m}", st.reserved_bytes);
        }
        // Release with live blocks: they stay usable; a second release finds nothing.
        pool.release().unwrap();
        for l in carried.iter().flatten() {
            let s = home_stream(&l.home);
            sh.sim.write_labeled(s.handle(), l.ptr, l.n, "after release").unwrap();
        }
        let again = pool.release().unwrap();
        assert_eq!(
            again,
            0,
            "seed {seed} round {round}: a second release gave back {again}: {:?}",
            pool.stats()
        );
        let races = sim.take_races();
        assert!(races.is_empty(), "seed {seed} round {round}: {} races, first: {}", races.len(), races[0]);
    }
    // Everything freed: release leaves nothing.
    for l in carried.into_iter().flatten() {
        sh.free(l.ptr, l.n, &home_stream(&l.home), "final");
    }
    sim.run();
    let races = sim.take_races();
    assert!(races.is_empty(), "seed {seed} final: {} races, first: {}", races.len(), races[0]);
    let st = pool.stats();
    assert_eq!(st.used_bytes, 0, "seed {seed}: {st:?}");
    assert_eq!(st.reserved_bytes, st.free_bytes, "seed {seed}: {st:?}");
    pool.release().unwrap();
    let st = pool.stats();
    assert_eq!((st.reserved_bytes, st.free_bytes), (0, 0), "seed {seed}: release after every free: {st:?}");
    assert!(sh.live.lock().unwrap().is_empty());
    drop(sh);
    drop(pool);
    eprintln!(
        "seed {seed} stats: growths {} steals {} waits {} syncs {} events {} queries {} released {}",
        st.upstream_growths,
        st.completed_steals,
        st.cross_stream_waits,
        st.synchronizations,
        st.events_recorded,
        st.event_queries,
        st.released_bytes
    );
    let errs = streampool::drop_errors();
    assert_eq!(errs.count, errors_before, "seed {seed}: drop errors {:?}", errs.recent);
}

#[test]
fn pool_race_stress() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let seeds = env("POOLRACE_SEEDS", "0..16");
    let (a, z) = seeds.split_once("..").unwrap();
    let (a, z): (u64, u64) = (a.parse().unwrap(), z.parse().unwrap());
    let ops: usize = env("POOLRACE_OPS", "400").parse().unwrap();
    let rounds: usize = env("POOLRACE_ROUNDS", "3").parse().unwrap();
    let threads: usize = env("POOLRACE_THREADS", "6").parse().unwrap();
    for seed in a..z {
        let t0 = std::time::Instant::now();
        run_seed(seed, threads, rounds, ops);
        eprintln!("seed {seed} ok in {:?}", t0.elapsed());
    }
}
