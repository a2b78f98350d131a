/* Quantized linear layer, integer path: y[M, N] = x[M, K] . W[N, K]^T (+ bias) with x
 * quantized per 32-element chunk to int8 (d = amax / 127, q = round(x / d), nearest
 * even) and the products taken in int8 x int8 -> int32, as llama.cpp does with its Q8
 * activations. The weight formats are those of quant_simd.h.
 *
 * Per chunk c of a weight row, w = s_c * qw + b_c and x ~= dx_c * qx, so
 *   sum w x = s_c * dx_c * sum(qw * qx) + b_c * T_c,   T_c = dx_c * sum(qx).
 * The integer sums come 4 products per int32 lane from vpdpbusd (AVX-512 VNNI, or the
 * 256-bit AVX-VNNI) or pmaddubsw + pmaddwd (AVX2, AVX-512BW), 8 lanes per chunk; the
 * lanes are scaled by s_c * dx_c and summed in fp32 accumulators, reduced once per tile.
 * vpdpbusd wants unsigned weights: Q8_0 / INT8 weights are flipped to qw + 128 and the
 * lane starts at -128 * (its 4 qx); Q4_0's -8 offset is the same start with -8. For Q4_1
 * and Q4_K the b_c * T_c term is one more FMA against T_c / 8 spread over the 8 lanes.
 * pmaddubsw saturates at 16 bits, so there Q8_0 / INT8 multiply |qx| by qw * sign(qx)
 * (exact for qw in [-127, 127], which is all ggml's quantizer and ours produce).
 *
 * The activation side (qx, the lane starts, dx_c and T_c / 8 per lane) is made once per
 * call by all threads, then the tiles (16 accumulators on AVX-512, 8 on AVX2: 4x4, 2x8,
 * 1x16 rows of x by rows of W) run over blocks of BLOCK_N weight rows split statically
 * across OpenMP threads, prefetching W in order like quant_gemv.c.
 */

#include "quant_xq.h"

#ifndef BLOCK_N
#define BLOCK_N 16
#endif
#if QK_VNNI
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif

/* What the lane starts subtract: the unsigned flip of Q8_0 / INT8 (VNNI only) or Q4_0's 8. */
static int offset_of(int fmt) {
#if QK_VNNI
    if (fmt == QF_Q8_0 || fmt == QF_INT8) return 128;
#endif
    return fmt == QF_Q4_0 ? 8 : 0;
}

#if QK_AVX512 || QK_AVX2
#if QK_AVX512
#define NACC 16
#define AW 64 /* elements per step: two chunks */
typedef __mmask64 qk_xmask;
static inline __m512 scale_pair(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
static inline __m512i lo_hi(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline __m512i nibbles16x2(__m128i a, __m128i b) {
    /* [a.lo | a.hi | b.lo | b.hi]: each block's 32 elements in order */
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1), m = _mm256_set1_epi8(15);
    __m512i z = lo_hi(_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    return _mm512_shuffle_i64x2(z, z, 0xD8);
}
/* Weight bytes of chunks c0, c0 + 1 of a row (the second zero when absent). */
static inline __m512i weights(int fmt, const uint8_t *row, int64_t c0, int two) {
    switch (fmt) {
    case QF_Q8_0: {
        __m256i a = _mm256_loadu_si256((const __m256i *)(row + c0 * 34 + 2));
        __m256i b = two ? _mm256_loadu_si256((const __m256i *)(row + c0 * 34 + 36))
                        : _mm256_setzero_si256();
        return lo_hi(a, b);
    }
    case QF_Q4_0:
    case QF_Q4_1: {
        int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
        __m128i a = _mm_loadu_si128((const __m128i *)(row + c0 * bs + off));
        __m128i b = two ? _mm_loadu_si128((const __m128i *)(row + (c0 + 1) * bs + off))
                        : _mm_setzero_si128();
        return nibbles16x2(a, b);
    }
    case QF_Q4_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(row + (c0 >> 3) * 144 + 16 + 16 * (c0 & 7)));
        __m256i m = _mm256_set1_epi8(15);
        return lo_hi(_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    }
    default:
        return _mm512_loadu_si512(row + c0 * 32);
    }
}
#define VI_LOAD(p) _mm512_loadu_si512(p)
#define VI_ZERO _mm512_setzero_si512
#define VI_XOR80(v) _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80))
#define VI_ADD32 _mm512_add_epi32
#define VI_CVT _mm512_cvtepi32_ps
#if QK_VNNI
#define VI_DOT(init, u, s) _mm512_dpbusd_epi32(init, u, s)
#else
#define VI_DOT(init, u, s) \
    _mm512_add_epi32(init, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif
#define VI_ABS _mm512_abs_epi8
#define VI_NEGMASK(x) _mm512_movepi8_mask(x)
#define VI_SIGNW(w, mask) _mm512_mask_sub_epi8(w, mask, _mm512_setzero_si512(), w)
#else /* AVX2 */
#define NACC 8
#define AW 32 /* elements per step: one chunk */
typedef __m256i qk_xmask;
static inline __m256 scale_pair(float a, float b) { (void)b; return _mm256_set1_ps(a); }
static inline __m256i weights(int fmt, const uint8_t *row, int64_t c0, int two) {
    (void)two;
    __m256i m = _mm256_set1_epi8(15);
    switch (fmt) {
    case QF_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(row + c0 * 34 + 2));
    case QF_Q4_0:
    case QF_Q4_1: {
        int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
        __m128i a = _mm_loadu_si128((const __m128i *)(row + c0 * bs + off));
        __m128i lo = _mm_and_si128(a, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_set1_epi8(15));
        return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    case QF_Q4_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(row + (c0 >> 3) * 144 + 16 + 32 * ((c0 & 7) >> 1)));
        return (c0 & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m) : _mm256_and_si256(v, m);
    }
    default:
        return _mm256_loadu_si256((const __m256i *)(row + c0 * 32));
    }
}
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_ZERO _mm256_setzero_si256
#define VI_XOR80(v) _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80))
#define VI_ADD32 _mm256_add_epi32
#define VI_CVT _mm256_cvtepi32_ps
#if QK_VNNI
#define VI_DOT(init, u, s) _mm256_dpbusd_avx_epi32(init, u, s)
#else
#define VI_DOT(init, u, s) \
    _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#define VI_ABS _mm256_abs_epi8
#define VI_NEGMASK(x) (x)
#define VI_SIGNW(w, x) _mm256_sign_epi8(w, x)
#endif

/* One MT x NT tile: rows m of xq against W rows n0 .. n0 + NT (rows past nvalid re-read
 * the last valid one); kp / AW steps. */
static inline __attribute__((always_inline)) void tile(
        const int FMT, const int MT, const int NT, const uint8_t *w, int64_t row_bytes,
        const float *scales, const qk_xq *xq, int64_t m0, int64_t nchunks, const float *bias,
        void *y, int64_t ldy, int y_bf16, int64_t n0, int nvalid, qk_pf *pf) {
    const int minterm = FMT == QF_Q4_1 || FMT == QF_Q4_K;
    const int has_init = FMT == QF_Q4_0 || (HAS_VNNI && (FMT == QF_Q8_0 || FMT == QF_INT8));
    const int pair = AW == 64;
    qk_vf acc[NACC];
    for (int i = 0; i < NACC; i++) acc[i] = qk_vf_zero();
    const uint8_t *wr[16];
    for (int n = 0; n < NT; n++) wr[n] = w + (n0 + (n < nvalid ? n : nvalid - 1)) * row_bytes;
    float ksc[16][8], kmn[16][8];
    const int64_t lanes = xq->kp / 4;
    for (int64_t c0 = 0; c0 < nchunks; c0 += AW / 32) {
        const int two = pair && c0 + 1 < nchunks;
        if (pf) qk_pf_step(pf);
        if (FMT == QF_Q4_K && (c0 & 7) == 0)
            for (int n = 0; n < NT; n++) qk_q4k_params(wr[n] + (c0 >> 3) * 144, ksc[n], kmn[n]);
        qk_vi wv[16];
        qk_vf sv[16], mv[16];
        for (int n = 0; n < NT; n++) {
            wv[n] = weights(FMT, wr[n], c0, two);
#if QK_VNNI
            if (FMT == QF_Q8_0 || FMT == QF_INT8) wv[n] = VI_XOR80(wv[n]);
#endif
            if (FMT == QF_Q4_K) {
                sv[n] = scale_pair(ksc[n][c0 & 7], pair ? ksc[n][(c0 & 7) + 1] : 0.0f);
                mv[n] = scale_pair(kmn[n][c0 & 7], pair ? kmn[n][(c0 & 7) + 1] : 0.0f);
            } else if (FMT != QF_INT8) {
                int bs = qk_block_bytes[FMT];
                const uint8_t *b0 = wr[n] + c0 * bs;
                float s1 = two ? qk_fp16(b0 + bs) : 0.0f;
                sv[n] = scale_pair(qk_fp16(b0), s1);
                if (FMT == QF_Q4_1) mv[n] = scale_pair(qk_fp16(b0 + 2), two ? qk_fp16(b0 + bs + 2) : 0.0f);
            }
        }
        for (int m = 0; m < MT; m++) {
            const int64_t row = m0 + m, l = row * lanes + c0 * 8;
            qk_vi xv = VI_LOAD(xq->q + row * xq->kp + c0 * 32);
            qk_vi init = has_init ? VI_LOAD(xq->init + l) : VI_ZERO();
            qk_vf de = qk_vf_load(xq->de + l), te = qk_vf_zero();
            if (minterm) te = qk_vf_load(xq->te + l);
#if !QK_VNNI
            qk_vi xabs = xv;
            qk_xmask xneg = VI_NEGMASK(xv);
            if (FMT == QF_Q8_0 || FMT == QF_INT8) xabs = VI_ABS(xv);
#endif
            for (int n = 0; n < NT; n++) {
                qk_vi t;
#if !QK_VNNI
                if (FMT == QF_Q8_0 || FMT == QF_INT8)
                    t = VI_DOT(init, xabs, VI_SIGNW(wv[n], xneg));
                else
#endif
                    t = VI_DOT(init, wv[n], xv);
                qk_vf f = VI_CVT(t);
                qk_vf *a = &acc[m * NT + n];
                if (FMT == QF_INT8) {
                    *a = qk_vf_fma(f, de, *a);
                } else {
                    *a = qk_vf_fma(f, qk_vf_mul(sv[n], de), *a);
                    if (minterm) *a = qk_vf_fma(mv[n], te, *a);
                }
            }
        }
    }
    float sums[16];
    qk_reduce(acc, sums);
    qk_store_tile(MT, NT, FMT, sums, scales, bias, y, ldy, y_bf16, n0, nvalid);
}

static inline __attribute__((always_inline)) void row_chunk(
        const int FMT, int mt, const uint8_t *w, int64_t row_bytes, const float *scales,
        const qk_xq *xq, int64_t m0, int64_t nchunks, const float *bias, char *y,
        int64_t ldy, int y_bf16, int64_t nb, int64_t ne, const uint8_t *range_end,
        int prefetch) {
    const int nt = NACC / mt;
    char *ym = y + m0 * ldy * (y_bf16 ? 2 : 4);
    for (int64_t n = nb; n < ne; n += nt) {
        int nvalid = ne - n < nt ? (int)(ne - n) : nt;
        qk_pf pf = qk_pf_tile(w + n * row_bytes, nvalid * row_bytes,
                              (nchunks + AW / 32 - 1) / (AW / 32), range_end);
        qk_pf *ppf = prefetch ? &pf : 0;
        if (mt == 4) tile(FMT, 4, NACC / 4, w, row_bytes, scales, xq, m0, nchunks, bias, ym, ldy, y_bf16, n, nvalid, ppf);
        else if (mt == 2) tile(FMT, 2, NACC / 2, w, row_bytes, scales, xq, m0, nchunks, bias, ym, ldy, y_bf16, n, nvalid, ppf);
        else tile(FMT, 1, NACC, w, row_bytes, scales, xq, m0, nchunks, bias, ym, ldy, y_bf16, n, nvalid, ppf);
    }
}

static inline __attribute__((always_inline)) void all_rows(
        const int FMT, const uint8_t *w, int64_t row_bytes, const float *scales,
        const qk_xq *xq, int64_t M, int64_t nchunks, const float *bias, char *y, int64_t ldy,
        int y_bf16, int64_t nb, int64_t ne, const uint8_t *range_end) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
        row_chunk(FMT, 4, w, row_bytes, scales, xq, m, nchunks, bias, y, ldy, y_bf16, nb, ne, range_end, m == 0);
    if (m + 2 <= M) {
        row_chunk(FMT, 2, w, row_bytes, scales, xq, m, nchunks, bias, y, ldy, y_bf16, nb, ne, range_end, m == 0);
        m += 2;
    }
    if (m < M)
        row_chunk(FMT, 1, w, row_bytes, scales, xq, m, nchunks, bias, y, ldy, y_bf16, nb, ne, range_end, m == 0);
}
#endif /* QK_AVX512 || QK_AVX2 */

#if QK_SCALAR
/* Plain C: the same integer sums, one output at a time. */
static void dot_scalar(int fmt, const uint8_t *row, float rscale, const qk_xq *xq, int64_t m,
                       int64_t nchunks, float *out) {
    float acc = 0.0f;
    for (int64_t c = 0; c < nchunks; c++) {
        float scale, b, qw[32];
        const uint8_t *q;
        int hi;
        qk_chunk(fmt, row, c, &scale, &b, &q, &hi);
        qk_chunk_ints(fmt, q, hi, qw);
        const int8_t *qx = xq->q + m * xq->kp + c * 32;
        int32_t isum = 0, xsum = 0;
        for (int e = 0; e < 32; e++) {
            isum += (int32_t)qw[e] * qx[e];
            xsum += qx[e];
        }
        float dx = xq->de[m * (xq->kp / 4) + c * 8];
        acc += scale * dx * (float)isum + b * dx * (float)xsum;
    }
    *out = fmt == QF_INT8 ? acc * rscale : acc;
}
#endif

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (rows ldx apart; bf16 or fp32) .
 * W^T + bias (fp32 [N] or NULL), with x quantized per chunk to int8. W: N rows of
 * row_bytes; scales: INT8's fp32 row scales. threads <= 0: OpenMP's default. Returns 0;
 * -1 for a bad format, K or row size; -3 when out of memory. */
int quant_gemv_dot(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                   int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int threads) {
    if (qk_check(fmt, K, row_bytes) || (fmt == QF_INT8 && !scales)) return -1;
    if (M <= 0 || N <= 0) return 0;
    qk_xq xq;
    if (alloc_xq(&xq, M, K)) return -3;
    /* INT8 rows hold kp bytes (zero padded); other formats exactly K / 32 chunks. */
    int64_t nchunks = fmt == QF_INT8 ? xq.kp / 32 : K / 32;
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
    int offset = offset_of(fmt);
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, ldx, x_bf16, m, K, &xq, offset);
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        const uint8_t *range_end = w + (b1 * BLOCK_N < N ? b1 * BLOCK_N : N) * row_bytes;
        if (b0 < b1) qk_pf_warm(w + b0 * BLOCK_N * row_bytes, range_end);
        for (int64_t blk = b0; blk < b1; blk++) {
            int64_t nb = blk * BLOCK_N, ne = nb + BLOCK_N < N ? nb + BLOCK_N : N;
#if QK_AVX512 || QK_AVX2
#define CALL(F) all_rows(F, w, row_bytes, scales, &xq, M, nchunks, bias, (char *)y, ldy, \
                         y_bf16, nb, ne, range_end)
            QF_DISPATCH(fmt, CALL);
#undef CALL
#else
            for (int64_t n = nb; n < ne; n++)
                for (int64_t m = 0; m < M; m++) {
                    float v;
                    dot_scalar(fmt, w + n * row_bytes, scales ? scales[n] : 1.0f, &xq, m, nchunks, &v);
                    if (bias) v += bias[n];
                    if (y_bf16) ((uint16_t *)y)[m * ldy + n] = qk_f32_to_bf16(v);
                    else ((float *)y)[m * ldy + n] = v;
                }
#endif
        }
    }
    free(xq.q);
    return 0;
}

/* For tests: x quantized as quant_gemv_dot does it. q: [M][kp] int8 (kp = K rounded up to
 * 64, zero past K); d: [M][kp / 32] chunk scales. Returns kp, or -3 when out of memory. */
int64_t quant_quantize_x(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         int8_t *q, float *d) {
    qk_xq xq;
    if (alloc_xq(&xq, M, K)) return -3;
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x, ldx, x_bf16, m, K, &xq, 0);
        for (int64_t c = 0; c < xq.kp / 32; c++) d[m * (xq.kp / 32) + c] = xq.de[m * (xq.kp / 4) + c * 8];
    }
    memcpy(q, xq.q, (size_t)(M * xq.kp));
    free(xq.q);
    return xq.kp;
}
