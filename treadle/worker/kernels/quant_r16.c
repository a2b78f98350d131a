/* Quantized linear layer for decode rows on AVX-512 VNNI, on weights repacked at load so
 * that one vpdpbusd multiplies 4 weights of each of 16 output rows: y[M, N] = x[M, K] .
 * W[N, K]^T (+ bias), x quantized per 32-element chunk to int8 exactly as quant_dot.c
 * does it (quant_xq.h), so both paths compute the same integer sums.
 *
 * quant_dot.c keeps GGUF's row-major blocks: each (x row, weight row) pair accumulates
 * 16 lanes along K, scaled per chunk by a broadcast fp16 scale, and is reduced at the end;
 * at 1-4 rows that per-chunk, per-row scaling (scale loads and broadcasts, a multiply and
 * one or two FMAs for every 64 products) made it compute-bound at ~10 GB/s of blocks.
 * Here the lanes are the output rows instead. The r16 layout, per group of 16 weight rows
 * and per chunk c of 32 values (a group's chunks contiguous, groups one after another, N
 * padded to 16 rows of zeros):
 *   Q8_0  8 vectors of 64 bytes, vector j = the 4 values 4j .. 4j + 3 of each of the 16
 *         rows (flipped to unsigned, q + 128), then the 16 rows' fp16 scales: 544 bytes
 *   INT8  the same 8 vectors without scales (the row scales stay fp32 [N]): 512 bytes
 *   Q4_0  4 vectors of 64 bytes, vector j = bytes 4j .. 4j + 3 of each row's 16 packed
 *         bytes (low nibbles: values 4j .., high nibbles: 16 + 4j ..), then the fp16
 *         scales: 288 bytes
 *   Q4_1  as Q4_0, then the fp16 scales and the fp16 mins: 320 bytes
 * the same bytes per weight as the GGUF blocks. Per chunk and x row: one int32 start (the
 * unsigned offset times the chunk's sum of qx), 8 vpdpbusd against the chunk's 4-byte x
 * groups broadcast, a convert, and one FMA by (the 16 scales x dx) (Q4_1: one more by the
 * 16 mins x dx * sum(qx)); weights are loaded and unpacked once per chunk for up to 8 x
 * rows. Q4_K is not covered (its 6-bit sub-block scales; it keeps quant_dot.c).
 *
 * OpenMP splits the 16-row groups statically; each thread streams its part in order.
 * Built where the level has AVX-512 VNNI; elsewhere the entry points return -2 and the
 * path rule (models/quant_weights.py) never picks this path.
 */

#include "quant_xq.h"

#define R16_MAX_MT 8 /* x rows per pass over the weights */

static int r16_covered(int fmt) {
    return fmt == QF_Q8_0 || fmt == QF_INT8 || fmt == QF_Q4_0 || fmt == QF_Q4_1;
}

/* Bytes of one group's chunk in the r16 layout (0: format not covered). */
static int64_t r16_chunk_bytes(int fmt) {
    switch (fmt) {
    case QF_Q8_0: return 544;
    case QF_INT8: return 512;
    case QF_Q4_0: return 288;
    case QF_Q4_1: return 320;
    default: return 0;
    }
}

static int64_t r16_nchunks(int fmt, int64_t K) {
    return fmt == QF_INT8 ? (K + 63) / 64 * 2 : K / 32;
}

/* Bytes the r16 layout of an N x K weight takes; -1 for a format or K it does not hold. */
int64_t quant_r16_bytes(int fmt, int64_t N, int64_t K) {
    if (!r16_covered(fmt) || K <= 0 || N <= 0 || (fmt != QF_INT8 && K % 32)) return -1;
    return (N + 15) / 16 * r16_nchunks(fmt, K) * r16_chunk_bytes(fmt);
}

/* Repack w (N rows of row_bytes, GGUF blocks or INT8 rows) into out
 * (quant_r16_bytes(fmt, N, K) bytes). Returns 0, or -1 for a format, K or row size the
 * layout does not hold. Plain C: it runs once per weight at load. */
int quant_r16_pack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                   uint8_t *out) {
    if (quant_r16_bytes(fmt, N, K) < 0 || qk_check(fmt, K, row_bytes)) return -1;
    const int64_t nchunks = r16_nchunks(fmt, K), cb = r16_chunk_bytes(fmt);
    const int64_t ngroups = (N + 15) / 16;
    memset(out, 0, (size_t)(ngroups * nchunks * cb));
    for (int64_t g = 0; g < ngroups; g++)
        for (int r = 0; r < 16 && g * 16 + r < N; r++) {
            const uint8_t *row = w + (g * 16 + r) * row_bytes;
            for (int64_t c = 0; c < nchunks; c++) {
                uint8_t *dst = out + (g * nchunks + c) * cb;
                if (fmt == QF_Q8_0 || fmt == QF_INT8) {
                    const uint8_t *q = fmt == QF_Q8_0 ? row + c * 34 + 2 : row + c * 32;
                    for (int j = 0; j < 8; j++)
                        for (int e = 0; e < 4; e++)
                            dst[j * 64 + r * 4 + e] = (uint8_t)(q[4 * j + e] ^ 0x80);
                    if (fmt == QF_Q8_0) memcpy(dst + 512 + r * 2, row + c * 34, 2);
                } else {
                    const int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
                    const uint8_t *blk = row + c * bs;
                    for (int j = 0; j < 4; j++)
                        memcpy(dst + j * 64 + r * 4, blk + off + 4 * j, 4);
                    memcpy(dst + 256 + r * 2, blk, 2);                           /* d */
                    if (fmt == QF_Q4_1) memcpy(dst + 288 + r * 2, blk + 2, 2);  /* m */
                }
            }
        }
    return 0;
}

#if QK_AVX512 && QK_VNNI
/* x rows m0 .. m0 + MT against group g: out[mt][16] (fp32, before row scales and bias). */
static inline __attribute__((always_inline)) void r16_group(
        const int FMT, const int MT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq,
        const int32_t *ci, const float *cdx, const float *ct, int64_t m0, __m512 *out,
        const uint8_t *pf_end) {
    const int64_t cb = r16_chunk_bytes(FMT), kp = xq->kp;
    for (int i = 0; i < MT; i++) out[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t c = 0; c < nchunks; c++) {
        const uint8_t *ch = gw + c * cb;
        const char *pf = (const char *)ch + QK_PF_DIST;
        for (int64_t p = 0; p < cb; p += 64)
            if (pf + p < (const char *)pf_end) _mm_prefetch(pf + p, _MM_HINT_T1);
        __m512i wv[8];
        __m512 d = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
        if (FMT == QF_Q8_0 || FMT == QF_INT8) {
            for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(ch + j * 64);
        } else {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(ch + j * 64);
                wv[j] = _mm512_and_si512(v, low4);
                wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        }
        if (FMT == QF_Q8_0)
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 512)));
        else if (FMT != QF_INT8)
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 256)));
        if (FMT == QF_Q4_1)
            mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 288)));
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i, at = m * nchunks + c;
            int32_t xg[8];  /* the chunk's qx as 8 groups of 4 (memcpy: no aliasing) */
            memcpy(xg, xq->q + m * kp + c * 32, sizeof xg);
            __m512i acc = _mm512_set1_epi32(ci[at]);
            for (int j = 0; j < 8; j++)
                acc = _mm512_dpbusd_epi32(acc, wv[j], _mm512_set1_epi32(xg[j]));
            const __m512 f = _mm512_cvtepi32_ps(acc), dx = _mm512_set1_ps(cdx[at]);
            if (FMT == QF_INT8) {
                out[i] = _mm512_fmadd_ps(f, dx, out[i]);
            } else {
                out[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dx), out[i]);
                if (FMT == QF_Q4_1) out[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ct[at]), out[i]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void r16_rows(
        const int FMT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq, const int32_t *ci,
        const float *cdx, const float *ct, int64_t M, int64_t n0, int64_t N,
        const float *scales, const float *bias, void *y, int64_t ldy, int y_bf16,
        const uint8_t *pf_end) {
    const int nvalid = N - n0 < 16 ? (int)(N - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    const __m512 sc = FMT == QF_INT8 ? _mm512_maskz_loadu_ps(mask, scales + n0) : _mm512_set1_ps(1.0f);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < M; m0 += R16_MAX_MT) {
        const int64_t mt = M - m0 < R16_MAX_MT ? M - m0 : R16_MAX_MT;
        __m512 out[R16_MAX_MT];
        switch (mt) {  /* literal row counts, so that the accumulators stay in registers */
        case 1: r16_group(FMT, 1, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 2: r16_group(FMT, 2, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 3: r16_group(FMT, 3, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 4: r16_group(FMT, 4, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 5: r16_group(FMT, 5, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 6: r16_group(FMT, 6, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 7: r16_group(FMT, 7, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        default: r16_group(FMT, 8, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        }
        for (int64_t i = 0; i < mt; i++) {
            __m512 v = _mm512_add_ps(_mm512_mul_ps(out[i], sc), b);
            const int64_t m = m0 + i;
            if (y_bf16) {
                float tmp[16];
                _mm512_storeu_ps(tmp, v);
                qk_store_bf16((uint16_t *)y + m * ldy + n0, tmp, nvalid);
            } else {
                _mm512_mask_storeu_ps((float *)y + m * ldy + n0, mask, v);
            }
        }
    }
}
#endif

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (rows ldx apart; bf16 or fp32) .
 * W^T + bias (fp32 [N] or NULL), W in the r16 layout (quant_r16_pack); scales: INT8's
 * fp32 row scales. threads <= 0: OpenMP's default. Returns 0; -1 for a format or K the
 * layout does not hold; -2 where this build has no AVX-512 VNNI; -3 out of memory. */
int quant_gemv_r16(int fmt, const uint8_t *packed, const float *scales, const void *x,
                   int64_t ldx, int x_bf16, const float *bias, void *y, int64_t ldy,
                   int y_bf16, int64_t M, int64_t N, int64_t K, int threads) {
    if (quant_r16_bytes(fmt, N > 0 ? N : 1, K) < 0 || (fmt == QF_INT8 && !scales)) return -1;
#if QK_AVX512 && QK_VNNI
    if (M <= 0 || N <= 0) return 0;
    qk_xq xq;
    if (alloc_xq(&xq, M, K)) return -3;
    const int64_t nchunks = r16_nchunks(fmt, K), ngroups = (N + 15) / 16;
    const int64_t gstride = nchunks * r16_chunk_bytes(fmt);
    const int offset = fmt == QF_Q4_0 ? 8 : fmt == QF_Q4_1 ? 0 : 128;
    /* per x row and chunk: the int32 start, dx, and dx * sum(qx) (Q4_1's min term) */
    int32_t *ci = malloc(sizeof(int32_t) * (size_t)(M * nchunks));
    float *cdx = malloc(sizeof(float) * (size_t)(M * nchunks));
    float *ct = malloc(sizeof(float) * (size_t)(M * nchunks));
    if (!ci || !cdx || !ct) {
        free(ci); free(cdx); free(ct); free(xq.q);
        return -3;
    }
    threads = qk_threads(threads, ngroups);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row(x, ldx, x_bf16, m, K, &xq, offset);
            for (int64_t c = 0; c < nchunks; c++) {
                const int64_t l0 = m * (xq.kp / 4) + c * 8;
                int32_t start = 0;
                for (int l = 0; l < 8; l++) start += xq.init[l0 + l];
                ci[m * nchunks + c] = start;
                cdx[m * nchunks + c] = xq.de[l0];
                ct[m * nchunks + c] = xq.te[l0] * 8.0f;
            }
        }
        int64_t g0, g1;
        qk_split(ngroups, &g0, &g1);
        const uint8_t *pf_end = packed + g1 * gstride;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *gw = packed + g * gstride;
#define CALL(F) r16_rows(F, gw, nchunks, &xq, ci, cdx, ct, M, g * 16, N, scales, bias, y, \
                         ldy, y_bf16, pf_end)
            switch (fmt) {
            case QF_Q8_0: CALL(QF_Q8_0); break;
            case QF_Q4_0: CALL(QF_Q4_0); break;
            case QF_Q4_1: CALL(QF_Q4_1); break;
            default: CALL(QF_INT8); break;
            }
#undef CALL
        }
    }
    free(ci); free(cdx); free(ct); free(xq.q);
    return 0;
#else
    (void)packed; (void)x; (void)ldx; (void)x_bf16; (void)bias; (void)y; (void)ldy;
    (void)y_bf16; (void)M; (void)threads;
    return -2;
#endif
}

/* Whether quant_gemv_r16 runs in this build (AVX-512 with VNNI). */
int quant_r16_available(void) {
#if QK_AVX512 && QK_VNNI
    return 1;
#else
    return 0;
#endif
}
