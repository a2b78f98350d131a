/* bf16 linear layer for many rows on a CPU without bf16 arithmetic (AVX2 + FMA, or AVX-512F
 * without AVX-512 BF16): y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 accumulation, the
 * weight kept bf16 in memory in its row-major [N, K] layout.
 *
 * gemv_bf16.c streams W once for a few rows: each tile widens its bf16 pairs again for
 * every 4 rows of x and folds its accumulators across lanes at the end, which is the
 * right trade at 1-16 rows (bound by reading W) and not at the 17-512 rows of a batch of
 * decodes or a prefill chunk, where arithmetic dominates. Here, as in a BLAS sgemm:
 *   - x is widened to fp32 once per call (M x K, shared by the threads);
 *   - each thread takes a contiguous run of NR-row panels of W (NR = two vectors: 16 rows
 *     with AVX2, 32 with AVX-512), widens and transposes each panel once into a k-major
 *     fp32 buffer (8 x 8 blocks through registers), then sweeps every row of x over it;
 *   - the micro-kernel holds an MR x NR block of y in MR * 2 vector accumulators (6 x 16
 *     with AVX2's 16 registers, 12 x 32 with AVX-512's 32), and per k loads two vectors of
 *     the panel and broadcasts MR values of x: MR * 2 FMAs for 2 + MR loads, so it is
 *     bound by the FMA units, not by loads or widening.
 * The sums are rounded to bf16 nearest-even (simd.h, as torch rounds). Sums run in k order
 * per output, one FMA each: the results differ from gemv_bf16's (which sums lanes of k,
 * then folds) by fp32 rounding only.
 *
 * Any M, N, K >= 1; x rows may be strided (ldx), W and y rows are dense (y: ldy). Without
 * AVX-512 or AVX2 (SIMD_WIDTH 0) gemm_bf16_widen_available() returns 0 and the entry
 * point -1.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#if SIMD_WIDTH

typedef uint16_t bf16_t;

#define NR (2 * SIMD_WIDTH) /* columns of y (rows of W) per panel */
#if SIMD_WIDTH == 16
#define MR 12               /* rows of y per micro-kernel: 24 accumulators of 32 */
#else
#define MR 6                /* 12 accumulators of 16 */
#endif

static inline float bf16_to_float(bf16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 rows of 8 bf16 (a row per pointer, from k) widened, as 8 vectors of fp32. */
static inline __attribute__((always_inline)) void load8x8(const bf16_t *const *rows, int64_t k,
                                                          __m256 *v) {
    for (int i = 0; i < 8; i++)
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rows[i] + k))), 16));
}

/* In-register 8 x 8 transpose of fp32. */
static inline __attribute__((always_inline)) void transpose8(__m256 *v) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        v[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* W rows n0 .. n0 + NR (rows past nvalid repeat the last real one: their sums are never
 * stored) as panel[k * NR + r], fp32, k in [0, K). Prefetches the `nnext` rows at `next`
 * (the thread's next panel) into L2 as it goes: a panel is NR short row streams, too
 * short for the hardware prefetchers to train on (gemv_bf16.c measured the same). */
static void pack_panel(const bf16_t *w, int64_t K, int64_t n0, int nvalid, float *panel,
                       const bf16_t *next, int nnext) {
    for (int r0 = 0; r0 < NR; r0 += 8) {
        const bf16_t *rows[8];
        for (int i = 0; i < 8; i++)
            rows[i] = w + (n0 + (r0 + i < nvalid ? r0 + i : nvalid - 1)) * K;
        const int pf_rows = nnext - r0 < 0 ? 0 : nnext - r0 < 8 ? nnext - r0 : 8;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v[8];
            if (k % 32 == 0)  /* one 64-byte line of each next row per 32 values */
                for (int i = 0; i < pf_rows; i++)
                    _mm_prefetch((const char *)(next + (r0 + i) * K + k), _MM_HINT_T1);
            load8x8(rows, k, v);
            transpose8(v);
            for (int i = 0; i < 8; i++) _mm256_store_ps(panel + (k + i) * NR + r0, v[i]);
        }
        for (; k < K; k++)
            for (int i = 0; i < 8; i++) panel[k * NR + r0 + i] = bf16_to_float(rows[i][k]);
    }
}

/* MT rows of xf (fp32, rows K apart) against one panel: y rows of ldy, columns n0 ..
 * n0 + nvalid, plus bias (fp32 [NR] or NULL). */
static inline __attribute__((always_inline)) void micro(
        const int MT, const float *xf, int64_t K, const float *panel, const float *bias,
        bf16_t *y, int64_t ldy, int64_t n0, int nvalid) {
    vf acc[2 * MR];
    for (int i = 0; i < 2 * MT; i++) acc[i] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = vf_load(panel + k * NR), w1 = vf_load(panel + k * NR + SIMD_WIDTH);
        for (int m = 0; m < MT; m++) {
            const vf xv = vf_set1(xf[m * K + k]);
            acc[2 * m] = vf_fmadd(xv, w0, acc[2 * m]);
            acc[2 * m + 1] = vf_fmadd(xv, w1, acc[2 * m + 1]);
        }
    }
    for (int m = 0; m < MT; m++) {
        vf lo = acc[2 * m], hi = acc[2 * m + 1];
        if (bias) {
            lo = vf_add(lo, vf_load(bias));
            hi = vf_add(hi, vf_load(bias + SIMD_WIDTH));
        }
        bf16_t *row = y + m * ldy + n0;
        if (nvalid == NR) {
            vf_bf16_store(row, lo);
            vf_bf16_store(row + SIMD_WIDTH, hi);
        } else if (nvalid > SIMD_WIDTH) {
            vf_bf16_store(row, lo);
            vf_bf16_store_n(row + SIMD_WIDTH, hi, nvalid - SIMD_WIDTH);
        } else {
            vf_bf16_store_n(row, lo, nvalid);
        }
    }
}

#define MICRO_CASE(mt) \
    case mt: micro(mt, xf, K, panel, bias, y, ldy, n0, nvalid); break;

static void micro_rows(int mt, const float *xf, int64_t K, const float *panel,
                       const float *bias, bf16_t *y, int64_t ldy, int64_t n0, int nvalid) {
    switch (mt) {
    MICRO_CASE(1) MICRO_CASE(2) MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6)
#if MR > 6
    MICRO_CASE(7) MICRO_CASE(8) MICRO_CASE(9) MICRO_CASE(10) MICRO_CASE(11) MICRO_CASE(12)
#endif
    default: break;
    }
}

int gemm_bf16_widen_available(void) { return 1; }

/* y[M, N] (rows ldy apart) = x[M, K] (rows ldx apart) . w[N, K]^T + bias[N] (NULL: none).
 * threads <= 0: OpenMP's default. Returns 0, or -2 when a buffer cannot be allocated. */
int gemm_bf16_widen(const bf16_t *x, int64_t ldx, const bf16_t *w, const bf16_t *bias,
                    bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {  /* an empty sum: the bias alone */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0;
        return 0;
    }
    const int64_t num_panels = (N + NR - 1) / NR;
    float *xf = aligned_alloc(64, (size_t)((M * K * sizeof(float) + 63) / 64 * 64));
    if (!xf) return -2;
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();
    if (threads > num_panels) threads = (int)num_panels;
#else
    threads = 1;
#endif
    int status = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int t = 0, nt = 1;
#endif
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const bf16_t *src = x + m * ldx;
            float *dst = xf + m * K;
            int64_t k = 0;
            for (; k + SIMD_WIDTH <= K; k += SIMD_WIDTH) vf_storeu(dst + k, vf_bf16_load(src + k));
            for (; k < K; k++) dst[k] = bf16_to_float(src[k]);
        }
        /* (the loop's barrier: every row of xf is written before any panel reads it) */
        const int64_t p0 = num_panels * t / nt, p1 = num_panels * (t + 1) / nt;
        float *panel = aligned_alloc(64, (size_t)(K * NR * sizeof(float)));
        float bias_f[NR] __attribute__((aligned(64)));
        if (!panel) {
            #pragma omp atomic write
            status = -2;
        } else {
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * NR;
                const int nvalid = (int)(N - n0 < NR ? N - n0 : NR);
                const int64_t nn = p + 1 < p1 ? (N - n0 - NR < NR ? N - n0 - NR : NR) : 0;
                pack_panel(w, K, n0, nvalid, panel, w + (n0 + NR) * K, (int)nn);
                if (bias)
                    for (int i = 0; i < NR; i++)
                        bias_f[i] = bf16_to_float(bias[n0 + (i < nvalid ? i : nvalid - 1)]);
                int64_t m = 0;
                for (; m + MR <= M; m += MR)
                    micro_rows(MR, xf + m * K, K, panel, bias ? bias_f : 0, y + m * ldy, ldy,
                               n0, nvalid);
                if (m < M)
                    micro_rows((int)(M - m), xf + m * K, K, panel, bias ? bias_f : 0,
                               y + m * ldy, ldy, n0, nvalid);
            }
            free(panel);
        }
    }
    free(xf);
    return status;
}

#else

int gemm_bf16_widen_available(void) { return 0; }

int gemm_bf16_widen(const void *x, int64_t ldx, const void *w, const void *bias, void *y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)M; (void)N; (void)K;
    (void)threads;
    return -1;
}

#endif
