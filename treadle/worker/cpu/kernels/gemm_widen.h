/* The register-tiled fp32 GEMM of the levels without bf16 arithmetic (AVX2 + FMA, or
 * AVX-512F), shared by the dense bf16 linear (gemm_bf16_widen.c) and the quantized one
 * (quant_gemm_widen.c): y[M, N] (bf16) = x[M, K] (bf16) . W^T + bias, where only the
 * making of W's panels differs (widening bf16 rows, or dequantizing blocks).
 *
 * As in a BLAS sgemm: x is widened to fp32 once per call (shared by the threads); each
 * thread takes a contiguous run of GW_NR-row panels of W (two vectors: 16 rows with AVX2,
 * 32 with AVX-512), has the caller's packer write each one once as a k-major fp32 buffer
 * (panel[k * GW_NR + r]), then sweeps every row of x over it. The micro-kernel holds a
 * GW_MR x GW_NR block of y in GW_MR * 2 vector accumulators (6 x 16 with AVX2's 16
 * registers, 12 x 32 with AVX-512's 32) and per k loads two vectors of the panel and
 * broadcasts GW_MR values of x: GW_MR * 2 FMAs for 2 + GW_MR loads, bound by the FMA
 * units. Sums run in k order, one FMA each, and are rounded to bf16 nearest-even
 * (simd.h). Needs SIMD_WIDTH (simd.h); the includer checks it.
 */
#ifndef TREADLE_GEMM_WIDEN_H
#define TREADLE_GEMM_WIDEN_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "omp_team.h"
#include "simd.h"

#define GW_NR (2 * SIMD_WIDTH) /* columns of y (rows of W) per panel */
#if SIMD_WIDTH == 16
#define GW_MR 12               /* rows of y per micro-kernel: 24 accumulators of 32 */
#else
#define GW_MR 6                /* 12 accumulators of 16 */
#endif

/* Writes panel[k * GW_NR + r] (fp32, 64-byte aligned) for W rows n0 .. n0 + GW_NR
 * (rows past nvalid: any finite values, their sums are never stored) and bias[r] (fp32,
 * when bias is not NULL). next_n0 / nnext: the rows of the thread's next panel (nnext 0:
 * none), to prefetch. scratch: gw_scratch_floats(K) floats of this thread's own. */
typedef void (*gw_pack_fn)(const void *ctx, int64_t K, int64_t n0, int nvalid, float *panel,
                           float *bias, int64_t next_n0, int nnext, float *scratch);

static inline float gw_bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* In-register 8 x 8 transpose of fp32. */
static inline __attribute__((always_inline)) void gw_transpose8(__m256 *v) {
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

/* 8 fp32 rows (rows[i], from k on) into panel columns r0 .. r0 + 8, k in [0, K). */
static inline void gw_transpose_rows(const float *const *rows, int64_t K, int r0,
                                     float *panel) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps(rows[i] + k);
        gw_transpose8(v);
        for (int i = 0; i < 8; i++) _mm256_store_ps(panel + (k + i) * GW_NR + r0, v[i]);
    }
    for (; k < K; k++)
        for (int i = 0; i < 8; i++) panel[k * GW_NR + r0 + i] = rows[i][k];
}

/* MT rows of xf (fp32, rows K apart) against one panel: y rows of ldy, columns n0 ..
 * n0 + nvalid, plus bias (fp32 [GW_NR] or NULL). */
static inline __attribute__((always_inline)) void gw_micro(
        const int MT, const float *xf, int64_t K, const float *panel, const float *bias,
        uint16_t *y, int64_t ldy, int64_t n0, int nvalid) {
    vf acc[2 * GW_MR];
    for (int i = 0; i < 2 * MT; i++) acc[i] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = vf_load(panel + k * GW_NR), w1 = vf_load(panel + k * GW_NR + SIMD_WIDTH);
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
        uint16_t *row = y + m * ldy + n0;
        if (nvalid == GW_NR) {
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

#define GW_MICRO_CASE(mt) \
    case mt: gw_micro(mt, xf, K, panel, bias, y, ldy, n0, nvalid); break;

static void gw_micro_rows(int mt, const float *xf, int64_t K, const float *panel,
                          const float *bias, uint16_t *y, int64_t ldy, int64_t n0, int nvalid) {
    switch (mt) {
    GW_MICRO_CASE(1) GW_MICRO_CASE(2) GW_MICRO_CASE(3) GW_MICRO_CASE(4) GW_MICRO_CASE(5)
    GW_MICRO_CASE(6)
#if GW_MR > 6
    GW_MICRO_CASE(7) GW_MICRO_CASE(8) GW_MICRO_CASE(9) GW_MICRO_CASE(10) GW_MICRO_CASE(11)
    GW_MICRO_CASE(12)
#endif
    default: break;
    }
}

/* Floats of scratch each thread's packer gets (8 rows of K: one 8-row group at a time). */
static inline int64_t gw_scratch_floats(int64_t K) { return 8 * K; }

/* y[M, N] (rows ldy apart) = x[M, K] (bf16, rows ldx apart) . W^T (+ the packer's bias
 * when with_bias), W's panels from pack(ctx, ...). threads <= 0: OpenMP's default.
 * Returns 0, or -2 when a buffer cannot be allocated. M, N, K >= 1. */
static int gw_gemm(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int64_t M,
                   int64_t N, int64_t K, int with_bias, gw_pack_fn pack, const void *ctx,
                   int threads) {
    const int64_t num_panels = (N + GW_NR - 1) / GW_NR;
    float *xf = aligned_alloc(64, (size_t)((M * K * sizeof(float) + 63) / 64 * 64));
    if (!xf) return -2;
    threads = team_size(threads, num_panels);
    int status = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *src = x + m * ldx;
            float *dst = xf + m * K;
            int64_t k = 0;
            for (; k + SIMD_WIDTH <= K; k += SIMD_WIDTH) vf_storeu(dst + k, vf_bf16_load(src + k));
            for (; k < K; k++) dst[k] = gw_bf16_to_float(src[k]);
        }
        /* (the loop's barrier: every row of xf is written before any panel reads it) */
        int64_t p0, p1;
        team_share(num_panels, &p0, &p1);
        float *panel = aligned_alloc(64, (size_t)(K * GW_NR * sizeof(float)));
        float *scratch = malloc(sizeof(float) * (size_t)gw_scratch_floats(K));
        float bias[GW_NR] __attribute__((aligned(64)));
        if (!panel || !scratch) {
            #pragma omp atomic write
            status = -2;
        } else {
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * GW_NR;
                const int nvalid = (int)(N - n0 < GW_NR ? N - n0 : GW_NR);
                const int64_t next = n0 + GW_NR;
                const int nnext = p + 1 < p1 ? (int)(N - next < GW_NR ? N - next : GW_NR) : 0;
                pack(ctx, K, n0, nvalid, panel, with_bias ? bias : 0, next, nnext, scratch);
                int64_t m = 0;
                for (; m + GW_MR <= M; m += GW_MR)
                    gw_micro_rows(GW_MR, xf + m * K, K, panel, with_bias ? bias : 0,
                                  y + m * ldy, ldy, n0, nvalid);
                if (m < M)
                    gw_micro_rows((int)(M - m), xf + m * K, K, panel, with_bias ? bias : 0,
                                  y + m * ldy, ldy, n0, nvalid);
            }
        }
        free(panel);
        free(scratch);
    }
    free(xf);
    return status;
}

#endif
