/* bf16 linear layer for many rows on a CPU without bf16 arithmetic (AVX2 + FMA, or AVX-512F
 * without AVX-512 BF16): y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 accumulation, the
 * weight kept bf16 in memory in its row-major [N, K] layout.
 *
 * gemv_bf16.c streams W once for a few rows: each tile widens its bf16 pairs again for
 * every 4 rows of x and folds its accumulators across lanes at the end, which is the
 * right trade at 1-16 rows (bound by reading W) and not at the 17-512 rows of a batch of
 * decodes or a prefill chunk, where arithmetic dominates. Here W's panels are widened and
 * transposed once per call (8 x 8 blocks through registers) for the register-tiled GEMM
 * of gemm_widen.h. The results differ from gemv_bf16's (which sums lanes of k, then
 * folds) by fp32 rounding only.
 *
 * Any M, N, K >= 1; x rows may be strided (ldx), W and y rows are dense (y: ldy). Without
 * AVX-512 or AVX2 (SIMD_WIDTH 0) gemm_bf16_widen_available() returns 0 and the entry
 * point -1.
 */

#include <stdint.h>
#include <string.h>

#include "simd.h"

#if SIMD_WIDTH
#include "gemm_widen.h"

typedef uint16_t bf16_t;

typedef struct {
    const bf16_t *w, *bias;
} dense_weight;

/* W rows n0 .. n0 + GW_NR (rows past nvalid repeat the last real one) widened into the
 * panel. Prefetches the next panel's rows into L2 as it goes: a panel is GW_NR short row
 * streams, too short for the hardware prefetchers to train on (gemv_bf16.c measured the
 * same): on an AMD EPYC (Zen 3) a step's linears at 12 and 16 rows took 19% and 32% less
 * time with it. */
static void pack_dense(const void *ctx, int64_t K, int64_t n0, int nvalid, float *panel,
                       float *bias, int64_t next_n0, int nnext, float *scratch) {
    (void)scratch;
    const dense_weight *d = ctx;
    for (int r0 = 0; r0 < GW_NR; r0 += 8) {
        const bf16_t *rows[8];
        for (int i = 0; i < 8; i++)
            rows[i] = d->w + (n0 + (r0 + i < nvalid ? r0 + i : nvalid - 1)) * K;
        const int pf_rows = nnext - r0 < 0 ? 0 : nnext - r0 < 8 ? nnext - r0 : 8;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v[8];
            if (k % 32 == 0)  /* one 64-byte line of each next row per 32 values */
                for (int i = 0; i < pf_rows; i++)
                    _mm_prefetch((const char *)(d->w + (next_n0 + r0 + i) * K + k), _MM_HINT_T1);
            for (int i = 0; i < 8; i++)
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rows[i] + k))), 16));
            gw_transpose8(v);
            for (int i = 0; i < 8; i++) _mm256_store_ps(panel + (k + i) * GW_NR + r0, v[i]);
        }
        for (; k < K; k++)
            for (int i = 0; i < 8; i++) panel[k * GW_NR + r0 + i] = gw_bf16_to_float(rows[i][k]);
    }
    if (bias)
        for (int i = 0; i < GW_NR; i++)
            bias[i] = gw_bf16_to_float(d->bias[n0 + (i < nvalid ? i : nvalid - 1)]);
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
    const dense_weight d = {w, bias};
    return gw_gemm(x, ldx, y, ldy, M, N, K, bias != 0, pack_dense, &d, threads);
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
