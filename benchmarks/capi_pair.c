/* Times allocate+free pairs through two C functions given by address (streampool's
 * exported streampool_alloc/streampool_free), with no Python between the calls:
 * bench_frameworks.py compiles it (cc -O2 -shared -fPIC) and calls it through ctypes. */
#include <stddef.h>
#include <time.h>

typedef void *(*alloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);

/* Mean ns per pair over `iters` pairs of `size` bytes on `stream`; `*failures` counts the
 * allocations that returned NULL (not freed). */
double pair_ns(void *alloc, void *release, size_t size, int device, void *stream, long iters,
               long *failures) {
    alloc_fn a = (alloc_fn)alloc;
    free_fn f = (free_fn)release;
    struct timespec t0, t1;
    long bad = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iters; i++) {
        void *p = a(size, device, stream);
        if (p == NULL) {
            bad++;
            continue;
        }
        f(p, size, device, stream);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *failures = bad;
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)iters;
}
