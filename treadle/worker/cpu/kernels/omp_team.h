/* A kernel's OpenMP team: how many threads to start for a number of work units, and each
 * thread's contiguous share of them. Shared by the kernels that split their weight rows
 * (or blocks of them) across threads; without OpenMP, one thread does it all. */
#ifndef TREADLE_OMP_TEAM_H
#define TREADLE_OMP_TEAM_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* threads <= 0: OpenMP's default; never more threads than units of work (at least one). */
static inline int team_size(int threads, int64_t work) {
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();
    if (threads > work) threads = (int)(work > 0 ? work : 1);
    return threads;
#else
    (void)threads; (void)work;
    return 1;
#endif
}

/* Inside a parallel region: this thread's share [b0, b1) of n units. */
static inline void team_share(int64_t n, int64_t *b0, int64_t *b1) {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    *b0 = n * t / nt;
    *b1 = n * (t + 1) / nt;
}

#endif
