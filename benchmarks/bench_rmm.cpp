// The peers' side of the benchmarks, from C++: allocation/free throughput of RAPIDS RMM
// 26.10 memory resources and raw cudaMallocAsync/cudaFreeAsync, single- and
// multi-threaded. The same workloads as rust/streampool/benches/window.rs (streampool's
// side), so that the figures compare; built and run on a GPU machine by
// benchmarks/gpu-bench.sh and benchmarks/pinned.sh (benchmarks/README.md).
//
// Workload "mt" (the window workload; the same as bench_py.py part B):
//   T threads, each with its own non-blocking stream; each thread keeps a FIFO
//   window of 16 live allocations; every step frees the oldest and allocates a
//   new one of log-uniform random size in [1 KiB, 4 MiB] (pre-generated sizes).
//   100 ms warm-up, then aggregate allocs/s inside one common window: the main
//   thread snapshots per-thread op counters at the window's start and end.
// Workload "fixed" (bench_py.py part A in C++): one thread, one non-blocking stream,
//   allocate+free pairs of a fixed size; median ns per pair over repetitions.
// Section "probe": per-call cost of cudaStreamGetId/cudaEventRecord and the
//   driver equivalents, and 64 KiB pairs on cudart- vs driver-created streams.
// Usage: bench_rmm [secs=0.5] [reps=3] [name-filter|all] [sections=probe,fixed,mt]
//
// Build (no GPU needed, nvcc 13; X = the unpacked librmm-cu13 and rapids-logger wheels;
// -I$X/librmm/include/rapids first, so that the CCCL bundled with RMM wins):
//   nvcc -std=c++17 -O2 -I$X/librmm/include/rapids -I$X/librmm/include \
//     -I$X/rapids_logger/include bench_rmm.cpp -o bench_rmm -L$X/librmm/lib64 \
//     -L$X/rapids_logger/lib64 -lrmm -lrapids_logger -Xlinker -rpath -Xlinker '$ORIGIN'
//   (then copy librmm.so and librapids_logger.so next to the binary; gpu-bench.sh
//   links with an rpath to $X instead).
//   Add -DRMM_LOG_ACTIVE_LEVEL=RAPIDS_LOGGER_LOG_LEVEL_TRACE for the "trace" variant.
#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/binning_memory_resource.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_),      \
                   __FILE__, __LINE__, #x);                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

using clk = std::chrono::steady_clock;
static constexpr std::size_t kAlign = 256;

// Raw stream-ordered allocator on the device's default memory pool.
struct raw_async {
  void* allocate(cuda::stream_ref s, std::size_t n, std::size_t)
  {
    void* p = nullptr;
    CK(cudaMallocAsync(&p, n, s.get()));
    return p;
  }
  void deallocate(cuda::stream_ref s, void* p, std::size_t, std::size_t) noexcept
  {
    cudaFreeAsync(p, s.get());
  }
};

struct alignas(64) PaddedCounter {
  std::atomic<std::uint64_t> v{0};
};

struct MtResult {
  double aps;          // aggregate allocs/s inside the common window
  double ns_thr;       // T / aps * 1e9: mean ns per alloc+free per thread
  double min_share;    // min over threads of ops_i / mean ops (fairness)
  double max_share;
};

// Type-erased wrapper so every resource goes through the same call shape.
// (Templates below call the concrete type directly: no virtual dispatch.)
struct Entry {
  std::string name;
  std::function<MtResult(int, double)> mt;
  std::function<double(std::size_t, cudaStream_t)> fixed;  // returns ns/pair
};

static std::vector<std::size_t> make_sizes(std::uint64_t seed, std::size_t n)
{
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(1024.0), std::log(4.0 * 1024 * 1024));
  std::vector<std::size_t> v(n);
  for (auto& s : v) s = static_cast<std::size_t>(std::exp(u(rng)));
  return v;
}

// Throughput is measured inside one common window: the main thread snapshots
// every thread's op counter at the window's start and end (threads keep
// running before and after), so a straggler stuck in one slow call cannot
// stretch the denominator.
template <class MR>
MtResult run_mt(MR& mr, int T, double secs)
{
  constexpr int W = 16;
  std::atomic<int> ready{0};
  std::atomic<int> phase{0};  // 0 wait, 1 run, 2 stop
  std::vector<PaddedCounter> cnt(T);
  std::vector<std::thread> th;
  for (int t = 0; t < T; ++t) {
    th.emplace_back([&, t] {
      cudaStream_t st;
      CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cuda::stream_ref sr{st};
      auto sizes = make_sizes(1234 + t, 8192);
      void* ptr[W];
      std::size_t sz[W];
      std::size_t k = 0;
      for (int i = 0; i < W; ++i) {
        sz[i]  = sizes[k++ & 8191];
        ptr[i] = mr.allocate(sr, sz[i], kAlign);
      }
      int head = 0;
      ready.fetch_add(1);
      while (phase.load(std::memory_order_acquire) == 0) {}
      std::uint64_t c = 0;
      while (phase.load(std::memory_order_relaxed) == 1) {
        mr.deallocate(sr, ptr[head], sz[head], kAlign);
        sz[head]  = sizes[k++ & 8191];
        ptr[head] = mr.allocate(sr, sz[head], kAlign);
        head      = (head + 1) % W;
        cnt[t].v.store(++c, std::memory_order_relaxed);
      }
      for (int i = 0; i < W; ++i) mr.deallocate(sr, ptr[i], sz[i], kAlign);
      CK(cudaStreamSynchronize(st));
      CK(cudaStreamDestroy(st));
    });
  }
  while (ready.load() < T) std::this_thread::yield();
  phase.store(1, std::memory_order_release);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // warm-up
  std::vector<std::uint64_t> s0(T), s1(T);
  auto t0 = clk::now();
  for (int t = 0; t < T; ++t) s0[t] = cnt[t].v.load(std::memory_order_relaxed);
  std::this_thread::sleep_for(std::chrono::duration<double>(secs));
  for (int t = 0; t < T; ++t) s1[t] = cnt[t].v.load(std::memory_order_relaxed);
  auto t1 = clk::now();
  phase.store(2, std::memory_order_release);
  for (auto& x : th) x.join();
  double el = std::chrono::duration<double>(t1 - t0).count();
  double tot = 0, mn = 1e300, mx = 0;
  for (int t = 0; t < T; ++t) {
    double d = double(s1[t] - s0[t]);
    tot += d;
    mn = std::min(mn, d);
    mx = std::max(mx, d);
  }
  double mean = tot / T;
  MtResult r;
  r.aps       = tot / el;
  r.ns_thr    = r.aps > 0 ? T * 1e9 / r.aps : -1;
  r.min_share = mean > 0 ? mn / mean : 0;
  r.max_share = mean > 0 ? mx / mean : 0;
  return r;
}

template <class MR>
double run_fixed(MR& mr, std::size_t n, cudaStream_t ext = nullptr)
{
  cudaStream_t st = ext;
  if (!ext) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cuda::stream_ref sr{st};
  auto pair = [&] {
    void* p = mr.allocate(sr, n, kAlign);
    mr.deallocate(sr, p, n, kAlign);
  };
  for (int i = 0; i < 200; ++i) pair();
  // calibrate to ~20 ms per repetition
  int iters = 50;
  for (;;) {
    auto t0 = clk::now();
    for (int i = 0; i < iters; ++i) pair();
    double s = std::chrono::duration<double>(clk::now() - t0).count();
    if (s > 0.01 || iters > (1 << 22)) {
      iters = std::max(20, int(iters * 0.02 / s));
      break;
    }
    iters *= 4;
  }
  std::vector<double> r;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = clk::now();
    for (int i = 0; i < iters; ++i) pair();
    r.push_back(std::chrono::duration<double>(clk::now() - t0).count() * 1e9 / iters);
  }
  CK(cudaStreamSynchronize(st));
  if (!ext) CK(cudaStreamDestroy(st));
  std::sort(r.begin(), r.end());
  return r[r.size() / 2];
}

template <class MR>
Entry make_entry(std::string name, MR& mr)
{
  return Entry{name,
               [&mr](int T, double secs) { return run_mt(mr, T, secs); },
               [&mr](std::size_t n, cudaStream_t s) { return run_fixed(mr, n, s); }};
}

static double cpu_canary_ns()
{
  // fixed integer work, ~1e7 dependent steps: a CPU-speed canary for noisy VMs
  auto t0            = clk::now();
  volatile std::uint64_t sink = 0;
  std::uint64_t x    = 88172645463325252ull;
  for (int i = 0; i < 10000000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
  }
  sink = x;
  (void)sink;
  return std::chrono::duration<double>(clk::now() - t0).count() * 1e9 / 1e7;
}

template <class F>
static double time_call_ns(F&& f, int iters = 100000)
{
  for (int i = 0; i < 1000; ++i) f();
  std::vector<double> r;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clk::now();
    for (int i = 0; i < iters; ++i) f();
    r.push_back(std::chrono::duration<double>(clk::now() - t0).count() * 1e9 / iters);
  }
  std::sort(r.begin(), r.end());
  return r[2];
}

int main(int argc, char** argv)
{
  double secs      = argc > 1 ? std::atof(argv[1]) : 0.5;
  int reps         = argc > 2 ? std::atoi(argv[2]) : 3;
  std::string only = argc > 3 ? argv[3] : "";
  if (only == "all") only = "";
  std::string sections = argc > 4 ? argv[4] : "probe,fixed,mt";
  auto want = [&](char const* s) { return sections.find(s) != std::string::npos; };
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  int drv = 0, rt = 0;
  CK(cudaDriverGetVersion(&drv));
  CK(cudaRuntimeGetVersion(&rt));
  std::printf("# driver %d runtime(bench) %d rmm %s secs=%.2f reps=%d sections=%s\n", drv, rt,
              RMM_VERSION, secs, reps, sections.c_str());
  std::printf("# cpu canary (xorshift step) %.3f ns\n", cpu_canary_ns());

  // Raw: default pool of device 0, release threshold raised so that memory is
  // not returned to the OS at synchronisation points (what rmm's async mr does).
  cudaMemPool_t defpool;
  CK(cudaDeviceGetDefaultMemPool(&defpool, 0));
  std::uint64_t thr = UINT64_MAX;
  CK(cudaMemPoolSetAttribute(defpool, cudaMemPoolAttrReleaseThreshold, &thr));

  const std::size_t GiB = 1ull << 30;
  raw_async raw;
  rmm::mr::cuda_memory_resource cuda_mr;
  rmm::mr::cuda_async_memory_resource async_mr;  // defaults
  rmm::mr::pool_memory_resource pool_cuda(cuda_mr, 4 * GiB);
  rmm::mr::pool_memory_resource pool_async(async_mr, 4 * GiB);
  rmm::mr::arena_memory_resource arena(cuda_mr, 8 * GiB);
  rmm::mr::binning_memory_resource binning(async_mr, 10, 22);

  std::vector<Entry> es;
  es.push_back(make_entry("raw_cudaMallocAsync", raw));
  es.push_back(make_entry("rmm_cuda_async", async_mr));
  es.push_back(make_entry("rmm_pool(cuda)", pool_cuda));
  es.push_back(make_entry("rmm_pool(async)", pool_async));
  es.push_back(make_entry("rmm_arena(cuda)", arena));
  es.push_back(make_entry("rmm_binning(async,1K-4M)", binning));
  es.push_back(make_entry("rmm_cuda(cudaMalloc)", cuda_mr));

  if (want("probe")) {
    // driver entry points through cudart (no link-time dependency on libcuda)
    auto drvfn = [](char const* name) {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q;
      CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
      if (!fn) {
        std::fprintf(stderr, "no driver entry point %s\n", name);
        std::exit(3);
      }
      return fn;
    };
    auto cuStreamCreate = (CUresult(*)(CUstream*, unsigned))drvfn("cuStreamCreate");
    auto cuStreamGetId  = (CUresult(*)(CUstream, unsigned long long*))drvfn("cuStreamGetId");
    auto cuEventCreate  = (CUresult(*)(CUevent*, unsigned))drvfn("cuEventCreate");
    auto cuEventRecord  = (CUresult(*)(CUevent, CUstream))drvfn("cuEventRecord");
    auto cuStreamSynchronize = (CUresult(*)(CUstream))drvfn("cuStreamSynchronize");
    auto cuStreamDestroy     = (CUresult(*)(CUstream))drvfn("cuStreamDestroy");
    // Own-runtime stream vs a stream created through the driver API (foreign to this
    // binary's static cudart, as streams made by another library are).
    cudaStream_t s_rt;
    CK(cudaStreamCreateWithFlags(&s_rt, cudaStreamNonBlocking));
    CUstream s_drv;
    if (cuStreamCreate(&s_drv, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) std::exit(3);
    cudaEvent_t ev;
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    CUevent dev_ev;
    cuEventCreate(&dev_ev, CU_EVENT_DISABLE_TIMING);
    std::printf("\n## C++ probe: per-call cost, ns (median of 5 x 100k)\n");
    struct S {
      char const* n;
      cudaStream_t s;
    } ss[] = {{"cudart-created stream", s_rt}, {"driver-created stream", (cudaStream_t)s_drv}};
    for (auto& x : ss) {
      unsigned long long id;
      std::printf("PROBE %-22s cudaStreamGetId %8.1f  cudaEventRecord %8.1f  cuStreamGetId %8.1f  "
                  "cuEventRecord %8.1f\n",
                  x.n, time_call_ns([&] { cudaStreamGetId(x.s, &id); }),
                  time_call_ns([&] { cudaEventRecord(ev, x.s); }),
                  time_call_ns([&] { cuStreamGetId((CUstream)x.s, &id); }),
                  time_call_ns([&] { cuEventRecord(dev_ev, (CUstream)x.s); }));
    }
    CK(cudaStreamSynchronize(s_rt));
    cuStreamSynchronize(s_drv);
    std::printf("\n## C++ single-thread 64KiB alloc+free pair by stream origin, ns\n");
    for (auto& e : es) {
      if (e.name.find("cudaMalloc)") != std::string::npos) continue;
      std::printf("PAIRSTREAM %-26s cudart-stream %8.0f  driver-stream %8.0f\n", e.name.c_str(),
                  e.fixed(65536, s_rt), e.fixed(65536, (cudaStream_t)s_drv));
    }
    CK(cudaStreamSynchronize(s_rt));
    CK(cudaStreamDestroy(s_rt));
    cuStreamDestroy(s_drv);
    std::fflush(stdout);
  }

  // ---- fixed-size single-thread pairs
  const std::size_t sizes[] = {256, 64 * 1024, 4 * 1024 * 1024, 256ull * 1024 * 1024};
  if (want("fixed")) {
    std::printf("\n## C++ single-thread alloc+free pair, ns (median of 7)\n");
    std::printf("%-26s %10s %10s %10s %10s\n", "resource", "256B", "64KiB", "4MiB", "256MiB");
    for (auto& e : es) {
      if (!only.empty() && e.name.find(only) == std::string::npos) continue;
      std::printf("%-26s", e.name.c_str());
      for (auto n : sizes) {
        try {
          std::printf(" %10.0f", e.fixed(n, nullptr));
        } catch (std::exception const& ex) {
          std::printf(" %10s", "ERR");
          std::fprintf(stderr, "fixed %s %zu: %s\n", e.name.c_str(), n, ex.what());
        }
        std::fflush(stdout);
      }
      std::printf("\n");
    }
  }

  // ---- multi-thread window workload
  if (want("mt")) {
    const int Ts[] = {1, 2, 4, 8, 16};
    std::printf("\n## C++ multi-thread (window 16, log-uniform 1KiB-4MiB), per rep\n");
    std::printf("RAW resource T rep allocs_per_s ns_per_op_thread min_share max_share\n");
    struct Row {
      std::string name;
      int T;
      double med_aps, min_aps, max_aps, med_ns, min_share;
    };
    std::vector<Row> rows;
    for (auto& e : es) {
      if (!only.empty() && e.name.find(only) == std::string::npos) continue;
      for (int T : Ts) {
        double s = secs;
        if (e.name.find("cudaMalloc)") != std::string::npos) s = std::min(secs, 0.25);
        std::vector<double> aps, nsv, shr;
        for (int r = 0; r < reps; ++r) {
          MtResult m{};
          try {
            m = e.mt(T, s);
          } catch (std::exception const& ex) {
            std::printf("RAW %s %d %d ERROR %s\n", e.name.c_str(), T, r, ex.what());
            std::fflush(stdout);
            continue;
          }
          aps.push_back(m.aps);
          nsv.push_back(m.ns_thr);
          shr.push_back(m.min_share);
          std::printf("RAW %s %d %d %.0f %.1f %.2f %.2f\n", e.name.c_str(), T, r, m.aps, m.ns_thr,
                      m.min_share, m.max_share);
          std::fflush(stdout);
        }
        if (aps.empty()) continue;
        auto a2 = aps;
        auto n2 = nsv;
        std::sort(a2.begin(), a2.end());
        std::sort(n2.begin(), n2.end());
        rows.push_back({e.name, T, a2[a2.size() / 2], a2.front(), a2.back(), n2[n2.size() / 2],
                        *std::min_element(shr.begin(), shr.end())});
      }
    }
    std::printf("\n## C++ multi-thread summary: aggregate allocs/s in a common window (median [min-max] "
                "of %d reps); ns/op/thr = T/aggregate; min_share = slowest thread's ops / mean\n",
                reps);
    std::printf("%-26s %3s %12s %27s %11s %9s\n", "resource", "T", "allocs/s", "[min - max]",
                "ns/op/thr", "min_share");
    for (auto& r : rows)
      std::printf("%-26s %3d %12.0f   [%10.0f - %10.0f] %11.1f %9.2f\n", r.name.c_str(), r.T,
                  r.med_aps, r.min_aps, r.max_aps, r.med_ns, r.min_share);
  }
  std::printf("# cpu canary (end) %.3f ns\n", cpu_canary_ns());
  return 0;
}
