/* The machine's memory-read rate as the kernels see it, for the benchmarks
 * (treadle/bench/linear_kernel.py reports each kernel's GB/s against it): a plain sum of
 * 64-bit words over one buffer, split into contiguous parts over OpenMP threads, eight
 * independent accumulators per thread so that the adds (vectorised by gcc) never limit
 * it; optionally each 64-byte line is software-prefetched some bytes ahead, as the
 * kernels do (one core's outstanding misses alone may not keep memory busy). The engine
 * does not use it.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Sum of the n 64-bit words at p (returned so that the reads cannot be dropped), with
   lines prefetched prefetch_bytes ahead (0: none; a prefetch past the end is harmless).
   threads <= 0: OpenMP's default. */
uint64_t read_probe_sum(const uint64_t *p, int64_t n, int threads, int64_t prefetch_bytes) {
    uint64_t total = 0;
    const int64_t ahead = prefetch_bytes / 8;
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    #pragma omp parallel num_threads(threads) reduction(+:total) if(threads > 1)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int64_t begin = n * t / nt / 8 * 8, end = t == nt - 1 ? n : n * (t + 1) / nt / 8 * 8;
        uint64_t acc[8] = {0};
        int64_t i = begin;
        if (ahead > 0) {
            for (; i + 8 <= end; i += 8) {
                __builtin_prefetch(p + i + ahead);
                for (int j = 0; j < 8; j++) acc[j] += p[i + j];
            }
        } else {
            for (; i + 8 <= end; i += 8)
                for (int j = 0; j < 8; j++) acc[j] += p[i + j];
        }
        for (; i < end; i++) acc[0] += p[i];
        for (int j = 0; j < 8; j++) total += acc[j];
    }
    return total;
}
