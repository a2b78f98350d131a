/* The activation side of the integer paths (quant_dot.c, quant_amx_dot.c): x quantized
 * per 32-element chunk to int8, d = amax / 127, q = round(x / d) to nearest even, with
 * per 4-element lane copies of what the kernels multiply by (see quant_dot.c). */
#ifndef TREADLE_QUANT_XQ_H
#define TREADLE_QUANT_XQ_H

#include "quant_simd.h"

/* The quantized activations of M rows, each kp (K rounded up to 64) elements long. */
typedef struct {
    int8_t *q;      /* [M][kp] */
    int32_t *init;  /* [M][kp / 4]: per 4-element lane, -offset * the lane's sum of q */
    float *de;      /* [M][kp / 4]: per lane, dx of its chunk */
    float *te;      /* [M][kp / 4]: per lane, T / 8 of its chunk */
    int64_t kp;
} qk_xq;

/* Quantize chunk c of row m (32 values in v, zero past K). */
static inline void quantize_chunk(const float *v, qk_xq *xq, int64_t m, int64_t c, int offset) {
    int8_t *q = xq->q + m * xq->kp + c * 32;
    int64_t l0 = m * (xq->kp / 4) + c * 8;
#if QK_AVX512
    __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));  /* nearest even (MXCSR default) */
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    __m256i q8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)),
                                         _mm512_cvtepi32_epi8(q1), 1);
#elif QK_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vv[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        vv[i] = _mm256_loadu_ps(v + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, vv[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(vv[i], vid));
        total = _mm256_add_epi32(total, qi[i]);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    int32_t sum = _mm_cvtsi128_si32(t);
    /* the packs work per 128-bit lane: restore element order with one dword permute */
    __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
#if QK_AVX512 || QK_AVX2
    _mm256_storeu_si256((__m256i *)q, q8);
    __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8),
                                      _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i *)(xq->init + l0), _mm256_mullo_epi32(lanes, _mm256_set1_epi32(-offset)));
    _mm256_storeu_ps(xq->de + l0, _mm256_set1_ps(d));
    _mm256_storeu_ps(xq->te + l0, _mm256_set1_ps(d * (float)sum * 0.125f));
#else
    float amax = 0.0f;
    for (int e = 0; e < 32; e++) {
        float a = v[e] < 0 ? -v[e] : v[e];
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int e = 0; e < 32; e++) {
        q[e] = (int8_t)__builtin_nearbyintf(v[e] * id);
        sum += q[e];
    }
    for (int l = 0; l < 8; l++) {
        xq->init[l0 + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
        xq->de[l0 + l] = d;
        xq->te[l0 + l] = d * (float)sum * 0.125f;
    }
#endif
}

/* Row m of x into xq (called by all threads on their rows). */
static inline void quantize_row(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t K,
                         qk_xq *xq, int offset) {
    for (int64_t c = 0; c < xq->kp / 32; c++) {
        float v[32];
        int64_t k0 = c * 32;
        if (k0 + 32 <= K && x_bf16) {
            const uint16_t *xb = (const uint16_t *)x + m * ldx + k0;
#if QK_AVX512
            for (int i = 0; i < 2; i++)
                _mm512_storeu_ps(v + 16 * i, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16 * i))), 16)));
#elif QK_AVX2
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(v + 8 * i, _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + 8 * i))), 16)));
#else
            for (int e = 0; e < 32; e++) v[e] = qk_bf16_to_f32(xb[e]);
#endif
        } else if (k0 + 32 <= K) {
            memcpy(v, (const float *)x + m * ldx + k0, sizeof v);
        } else {
            for (int e = 0; e < 32; e++) {
                int64_t k = k0 + e;
                v[e] = k >= K ? 0.0f
                     : x_bf16 ? qk_bf16_to_f32(((const uint16_t *)x)[m * ldx + k])
                              : ((const float *)x)[m * ldx + k];
            }
        }
        quantize_chunk(v, xq, m, c, offset);
    }
}

static inline int alloc_xq(qk_xq *xq, int64_t M, int64_t K) {
    xq->kp = (K + 63) / 64 * 64;
    char *p = aligned_alloc(64, (size_t)(M * xq->kp * 4));
    if (!p) return -3;
    xq->q = (int8_t *)p;
    xq->init = (int32_t *)(p + M * xq->kp);
    xq->de = (float *)(p + 2 * M * xq->kp);
    xq->te = (float *)(p + 3 * M * xq->kp);
    return 0;
}

#endif
