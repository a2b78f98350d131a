/* Quantized linear layer for many bf16 rows on a CPU without bf16 arithmetic (AVX2 + FMA,
 * or AVX-512F without AVX-512 BF16): y[M, N] (bf16) = x[M, K] (bf16) . W^T + bias (fp32
 * [N] or NULL), W as GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K) or INT8 rows with fp32 row
 * scales (layouts: quant_simd.h).
 *
 * The register-tiled GEMM of gemm_widen.h, whose panels are dequantized here straight
 * from the blocks: each 8-row group of a panel is dequantized row by row into an fp32
 * scratch (qk_dequant_row, the same values as quant_dequant.c gives) and transposed into
 * the panel, so no dense copy of the weight is made, not even a tile of it, and each
 * block is read once per call. This is the prefill path of QuantizedLinear where torch's
 * bf16 linear would be emulated (models/quant_weights.py `choose_path`: "gemm").
 */

#include "quant_simd.h"
#include "simd.h"

#if SIMD_WIDTH
#include "gemm_widen.h"

typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t row_bytes;
    const float *scales, *bias;
} quant_weight;

static void pack_quant(const void *ctx, int64_t K, int64_t n0, int nvalid, float *panel,
                       float *bias, int64_t next_n0, int nnext, float *scratch) {
    const quant_weight *q = ctx;
    for (int r0 = 0; r0 < GW_NR; r0 += 8) {
        const float *rows[8];
        for (int i = 0; i < 8; i++) {
            const int64_t n = n0 + (r0 + i < nvalid ? r0 + i : nvalid - 1);
            if (r0 + i < nvalid || i == 0)
                qk_dequant_row(q->fmt, q->w + n * q->row_bytes, K,
                               q->scales ? q->scales[n] : 1.0f, scratch + i * K, 0);
            rows[i] = r0 + i < nvalid || i == 0 ? scratch + i * K : rows[i - 1];
        }
        gw_transpose_rows(rows, K, r0, panel);
        for (int i = r0; i < r0 + 8 && i < nnext; i++)  /* the next panel's blocks, into L2 */
            for (int64_t b = 0; b < q->row_bytes; b += 64)
                _mm_prefetch((const char *)(q->w + (next_n0 + i) * q->row_bytes + b), _MM_HINT_T1);
    }
    if (bias)
        for (int i = 0; i < GW_NR; i++) bias[i] = q->bias[n0 + (i < nvalid ? i : nvalid - 1)];
}

int quant_gemm_widen_available(void) { return 1; }

/* Returns 0; -1 for a format, K or row size the blocks cannot hold (or INT8 without
 * scales); -2 when a buffer cannot be allocated or this build has no vector unit. */
int quant_gemm_widen(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                     const uint16_t *x, int64_t ldx, const float *bias, uint16_t *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (qk_check(fmt, K, row_bytes) || (fmt == QF_INT8 && !scales)) return -1;
    if (M <= 0 || N <= 0) return 0;
    const quant_weight q = {fmt, w, row_bytes, fmt == QF_INT8 ? scales : 0, bias};
    return gw_gemm(x, ldx, y, ldy, M, N, K, bias != 0, pack_quant, &q, threads);
}

#else

int quant_gemm_widen_available(void) { return 0; }

int quant_gemm_widen(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                     const uint16_t *x, int64_t ldx, const float *bias, uint16_t *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)fmt; (void)w; (void)row_bytes; (void)scales; (void)x; (void)ldx; (void)bias;
    (void)y; (void)ldy; (void)M; (void)N; (void)K; (void)threads;
    return -2;
}

#endif
