/* Quantized linear layer, dequantize-in-register path: y[M, N] = x[M, K] . W[N, K]^T
 * (+ bias), W in a block format of quant_simd.h, kept quantized; for the few rows of a
 * decode step (any M works; the caller picks this path where it is the faster one,
 * treadle/models/quant_weights.py says which and why).
 *
 * Each 32-element chunk of NT weight rows is widened in registers to fp32 (scale * q +
 * bias) and, where x is bf16 and the CPU has AVX-512 BF16, rounded to bf16 and fed to
 * vdpbf16ps (the weight then carries the same rounding as a dequantized-bf16 model);
 * otherwise multiplied into fp32 accumulators by FMA with x in fp32 (AVX-512F, AVX2).
 * A tile is MT rows of x by NT rows of W with 16 (AVX-512) or 8 (AVX2) accumulators,
 * reduced by one shuffle tree; M is covered in chunks of 4, 2 and 1 rows, each chunk
 * re-reading the block of BLOCK_N weight rows from cache (only the first prefetches).
 *
 * `buffered` (path b2) instead dequantizes each block of BLOCK_N rows once into a
 * per-thread buffer (bf16 or fp32, in L1/L2) and runs the same tiles on the dense buffer:
 * one dequantization per block instead of one per row chunk, for M > 4.
 *
 * OpenMP splits the blocks statically (each thread streams one contiguous part of W,
 * prefetched in order, quant_simd.h); x is first copied into a dense zero-padded
 * scratch (bf16 or fp32) by all threads.
 */

#include "quant_simd.h"

#ifndef BLOCK_N
#define BLOCK_N 16
#endif
#define QF_DENSE 100 /* pseudo-format: the tile reads a dense dequantized buffer */

#if QK_AVX512 || QK_AVX2
#if QK_AVX512
#define NACC 16
#else
#define NACC 8
#endif

/* One MT x NT tile in fp32: x rows (fp32 scratch, ldx apart) against W rows n0 .. n0+NT
 * (rows beyond nvalid re-read the last valid one). FMT == QF_DENSE: w is an fp32 buffer
 * (row_bytes apart) and `fmt` the real format (for the INT8 scale). */
static inline __attribute__((always_inline)) void tile_f32(
        const int FMT, const int MT, const int NT, int fmt, const uint8_t *w,
        int64_t row_bytes, const float *scales, const float *x, int64_t ldx, int64_t K,
        const float *bias, void *y, int64_t ldy, int y_bf16, int64_t n0, int nvalid,
        int64_t w_row0, qk_pf *pf) {
    qk_vf acc[NACC];
    for (int i = 0; i < NACC; i++) acc[i] = qk_vf_zero();
    const uint8_t *wr[16];
    for (int n = 0; n < NT; n++) wr[n] = w + (n0 - w_row0 + (n < nvalid ? n : nvalid - 1)) * row_bytes;
    for (int64_t c = 0; c < K / 32; c++) {
        const uint8_t *q[16];
        int hi[16];
        qk_vf vs[16], vb[16];
        if (pf) qk_pf_step(pf);
        if (FMT != QF_DENSE) {
            for (int n = 0; n < NT; n++) {
                float s, b;
                qk_chunk(FMT, wr[n], c, &s, &b, &q[n], &hi[n]);
                vs[n] = qk_vf_set1(s);
                vb[n] = qk_vf_set1(b);
            }
        }
        for (int e0 = 0; e0 < 32; e0 += QK_VL) {
            qk_vf wv[16];
            for (int n = 0; n < NT; n++) {
                if (FMT == QF_DENSE)
                    wv[n] = qk_vf_load((const float *)wr[n] + c * 32 + e0);
                else if (FMT == QF_INT8)
                    wv[n] = qk_vf_ints(FMT, q[n], 0, e0);
                else
                    wv[n] = qk_vf_dequant(FMT, q[n], hi[n], e0, vs[n], vb[n]);
            }
            for (int m = 0; m < MT; m++) {
                qk_vf xv = qk_vf_load(x + m * ldx + c * 32 + e0);
                for (int n = 0; n < NT; n++) acc[m * NT + n] = qk_vf_fma(wv[n], xv, acc[m * NT + n]);
            }
        }
    }
    float sums[16];
    qk_reduce(acc, sums);
    qk_store_tile(MT, NT, fmt, sums, scales, bias, y, ldy, y_bf16, n0, nvalid);
}

#if QK_BF16
/* The same tile with bf16 x (scratch) and vdpbf16ps; weights rounded to bf16. */
static inline __attribute__((always_inline)) void tile_bf16(
        const int FMT, const int MT, const int NT, int fmt, const uint8_t *w,
        int64_t row_bytes, const float *scales, const uint16_t *x, int64_t ldx, int64_t K,
        const float *bias, void *y, int64_t ldy, int y_bf16, int64_t n0, int nvalid,
        int64_t w_row0, qk_pf *pf) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *wr[16];
    for (int n = 0; n < NT; n++) wr[n] = w + (n0 - w_row0 + (n < nvalid ? n : nvalid - 1)) * row_bytes;
    for (int64_t c = 0; c < K / 32; c++) {
        __m512bh wv[16];
        if (pf) qk_pf_step(pf);
        for (int n = 0; n < NT; n++) {
            if (FMT == QF_DENSE) {
                wv[n] = (__m512bh)_mm512_loadu_si512(wr[n] + c * 64);
                continue;
            }
            float s, b;
            const uint8_t *q;
            int hi;
            qk_chunk(FMT, wr[n], c, &s, &b, &q, &hi);
            __m512 lo16, hi16;
            if (FMT == QF_INT8) { /* exact in bf16; the row scale comes at the end */
                lo16 = qk_vf_ints(FMT, q, 0, 0);
                hi16 = qk_vf_ints(FMT, q, 0, 16);
            } else {
                __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
                lo16 = qk_vf_dequant(FMT, q, hi, 0, vs, vb);
                hi16 = qk_vf_dequant(FMT, q, hi, 16, vs, vb);
            }
            wv[n] = _mm512_cvtne2ps_pbh(hi16, lo16);
        }
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + c * 32);
            for (int n = 0; n < NT; n++) acc[m * NT + n] = _mm512_dpbf16_ps(acc[m * NT + n], xv, wv[n]);
        }
    }
    float sums[16];
    qk_reduce(acc, sums);
    qk_store_tile(MT, NT, fmt, sums, scales, bias, y, ldy, y_bf16, n0, nvalid);
}
#endif

/* Rows [m0, m0 + mt) of x against W rows [nb, ne) (mt in {1, 2, 4}); FMT constant. */
static inline __attribute__((always_inline)) void row_chunk(
        const int FMT, int fmt, int use_bf16, int mt, const uint8_t *w, int64_t row_bytes,
        const float *scales, const void *x, int64_t ldx, int64_t K, const float *bias,
        void *y, int64_t ldy, int y_bf16, int64_t nb, int64_t ne, int64_t w_row0,
        const uint8_t *range_end, int prefetch) {
    const int nt = NACC / mt;
    for (int64_t n = nb; n < ne; n += nt) {
        int nvalid = ne - n < nt ? (int)(ne - n) : nt;
        qk_pf pf = qk_pf_tile(w + (n - w_row0) * row_bytes, nvalid * row_bytes, K / 32, range_end);
        qk_pf *ppf = prefetch ? &pf : 0;
#if QK_BF16
        if (use_bf16) {
            const uint16_t *xb = (const uint16_t *)x;
            if (mt == 4) tile_bf16(FMT, 4, 4, fmt, w, row_bytes, scales, xb, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
            else if (mt == 2) tile_bf16(FMT, 2, 8, fmt, w, row_bytes, scales, xb, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
            else tile_bf16(FMT, 1, 16, fmt, w, row_bytes, scales, xb, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
            continue;
        }
#else
        (void)use_bf16;
#endif
        const float *xf = (const float *)x;
        if (mt == 4) tile_f32(FMT, 4, NACC / 4, fmt, w, row_bytes, scales, xf, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
        else if (mt == 2) tile_f32(FMT, 2, NACC / 2, fmt, w, row_bytes, scales, xf, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
        else tile_f32(FMT, 1, NACC, fmt, w, row_bytes, scales, xf, ldx, K, bias, y, ldy, y_bf16, n, nvalid, w_row0, ppf);
    }
}

/* All rows of x against W rows [nb, ne): chunks of 4, then 2, then 1. */
static inline __attribute__((always_inline)) void all_rows(
        const int FMT, int fmt, int use_bf16, const uint8_t *w, int64_t row_bytes,
        const float *scales, const char *x, int64_t ldx, int64_t xsize, int64_t K,
        const float *bias, char *y, int64_t ldy, int y_bf16, int64_t M, int64_t nb,
        int64_t ne, int64_t w_row0, const uint8_t *range_end, int prefetch) {
    int64_t ysize = y_bf16 ? 2 : 4, m = 0;
    for (; m + 4 <= M; m += 4)
        row_chunk(FMT, fmt, use_bf16, 4, w, row_bytes, scales, x + m * ldx * xsize, ldx, K,
                  bias, y + m * ldy * ysize, ldy, y_bf16, nb, ne, w_row0, range_end, prefetch && m == 0);
    if (m + 2 <= M) {
        row_chunk(FMT, fmt, use_bf16, 2, w, row_bytes, scales, x + m * ldx * xsize, ldx, K,
                  bias, y + m * ldy * ysize, ldy, y_bf16, nb, ne, w_row0, range_end, prefetch && m == 0);
        m += 2;
    }
    if (m < M)
        row_chunk(FMT, fmt, use_bf16, 1, w, row_bytes, scales, x + m * ldx * xsize, ldx, K,
                  bias, y + m * ldy * ysize, ldy, y_bf16, nb, ne, w_row0, range_end, prefetch && m == 0);
}

#endif /* QK_AVX512 || QK_AVX2 */

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (rows ldx apart; bf16 or fp32) .
 * W^T + bias (fp32 [N] or NULL). W: N rows of row_bytes; scales: INT8's fp32 row scales.
 * buffered: path b2 (block dequantized once into a buffer). threads <= 0: OpenMP's
 * default. Returns 0; -1 for a bad format, K or row size; -3 when out of memory. */
int quant_gemv_deq(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                   int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int buffered,
                   int threads) {
    if (qk_check(fmt, K, row_bytes) || (fmt == QF_INT8 && !scales)) return -1;
    if (M <= 0 || N <= 0) return 0;
    int64_t kp = (K + 31) / 32 * 32, num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
#if QK_BF16
    int use_bf16 = x_bf16;
#else
    int use_bf16 = 0;
#endif
    int64_t xsize = use_bf16 ? 2 : 4;
    char *xs = aligned_alloc(64, (size_t)((M * kp * xsize + 63) / 64 * 64));
    if (!xs) return -3;
    int status = 0;
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t k = 0; k < kp; k++) {
                float v = 0.0f;
                if (k < K)
                    v = x_bf16 ? qk_bf16_to_f32(((const uint16_t *)x)[m * ldx + k])
                               : ((const float *)x)[m * ldx + k];
                if (use_bf16)
                    ((uint16_t *)xs)[m * kp + k] = k < K && x_bf16 ? ((const uint16_t *)x)[m * ldx + k]
                                                                    : qk_f32_to_bf16(v);
                else
                    ((float *)xs)[m * kp + k] = v;
            }
        }
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        const uint8_t *range_end = w + (b1 * BLOCK_N < N ? b1 * BLOCK_N : N) * row_bytes;
        char *buf = 0;
        if (buffered && M > 0) {
            buf = aligned_alloc(64, (size_t)(BLOCK_N * kp * xsize));
            if (!buf) {
                #pragma omp atomic write
                status = -3;
            }
        }
        if (b0 < b1) qk_pf_warm(w + b0 * BLOCK_N * row_bytes, range_end);
        for (int64_t blk = b0; blk < b1 && (!buffered || buf); blk++) {
            int64_t nb = blk * BLOCK_N, ne = nb + BLOCK_N < N ? nb + BLOCK_N : N;
#if QK_AVX512 || QK_AVX2
            if (buf) {
                for (int64_t n = nb; n < ne; n++) {
                    qk_pf_range(w + n * row_bytes + QK_PF_DIST, row_bytes, range_end);
                    qk_dequant_row(fmt, w + n * row_bytes, kp, 1.0f,
                                   buf + (n - nb) * kp * xsize, use_bf16);
                }
                /* the buffer's row 0 is W's row nb */
                all_rows(QF_DENSE, fmt, use_bf16, (const uint8_t *)buf, kp * xsize, scales, xs,
                         kp, xsize, kp, bias, (char *)y, ldy, y_bf16, M, nb, ne, nb, range_end, 0);
                continue;
            }
#define CALL(F) all_rows(F, F, use_bf16, w, row_bytes, scales, xs, kp, xsize, kp, bias, \
                         (char *)y, ldy, y_bf16, M, nb, ne, 0, range_end, 1)
            QF_DISPATCH(fmt, CALL);
#undef CALL
#else
            (void)range_end;
            /* Plain C: one output at a time, W's chunks dequantized on the fly. */
            for (int64_t n = nb; n < ne; n++) {
                const uint8_t *row = w + n * row_bytes;
                for (int64_t m = 0; m < M; m++) {
                    const float *xr = (const float *)xs + m * kp;
                    float acc = 0.0f, v[32];
                    for (int64_t c = 0; c < kp / 32; c++) {
                        qk_dequant_chunk_scalar(fmt, row, c, 1.0f, v);
                        for (int e = 0; e < 32; e++) acc += v[e] * xr[c * 32 + e];
                    }
                    if (fmt == QF_INT8) acc *= scales[n];
                    if (bias) acc += bias[n];
                    if (y_bf16) ((uint16_t *)y)[m * ldy + n] = qk_f32_to_bf16(acc);
                    else ((float *)y)[m * ldy + n] = acc;
                }
            }
#endif
        }
        free(buf);
    }
    free(xs);
    return status;
}
