/* Shared pieces of the weight-only quantized kernels (quant_dequant.c, quant_gemv.c,
 * quant_dot.c): the block formats, the ISA level this file is compiled for, scalar and
 * vector dequantization of 32-element chunks, horizontal sums and the in-order prefetch.
 *
 * Block layouts (GGUF / ggml, little endian, a row of K weights is K / block blocks):
 *   Q8_0  34 bytes / 32: fp16 d, int8 q[32]                  w = d * q
 *   Q4_0  18 bytes / 32: fp16 d, u8 qs[16]                   w = d * (q - 8)
 *         (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble)
 *   Q4_1  20 bytes / 32: fp16 d, fp16 m, u8 qs[16]           w = d * q + m
 *   Q4_K 144 bytes / 256: fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]; sub-block j
 *         (32 elements) has 6-bit scale sc_j and min mn_j packed in `scales`; sub-blocks
 *         2i and 2i + 1 are the low and high nibbles of qs[32i .. 32i + 32]:
 *         w = d * sc_j * q - dmin * mn_j
 *   INT8  (treadle's own, made at load): int8 q[Kp] per row, Kp = K rounded up to 64
 *         (zero padded), one fp32 scale per output row: w = scale[n] * q
 *
 * ISA levels, chosen by the compiler flags (native.py builds with -march=native; tests
 * also build -march=x86-64-v3, -march=skylake-avx512 and a baseline to run the other
 * levels on one machine):
 *   QK_AVX512  AVX-512 F/BW/DQ/VL (+F16C)  16-lane fp32, 64-byte int8 steps
 *   QK_AVX2    AVX2 + FMA + F16C           8-lane fp32, 32-byte int8 steps
 *   QK_SCALAR  anything else (plain C)
 * and, on top: QK_BF16 (AVX-512 BF16: vdpbf16ps), QK_VNNI (AVX-512 VNNI or AVX-VNNI:
 * vpdpbusd at the level's width; otherwise pmaddubsw + pmaddwd).
 */
#ifndef TREADLE_QUANT_SIMD_H
#define TREADLE_QUANT_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "omp_team.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

enum { QF_Q8_0 = 0, QF_Q4_0 = 1, QF_Q4_1 = 2, QF_Q4_K = 3, QF_INT8 = 4, QF_COUNT = 5 };

/* CALL(F) with F the compile-time format equal to the run-time `fmt`: one copy of an
 * inlined loop per format, the format a constant in each (a new format is one line here). */
#define QF_DISPATCH(fmt, CALL) do {          \
        switch (fmt) {                       \
        case QF_Q8_0: CALL(QF_Q8_0); break;  \
        case QF_Q4_0: CALL(QF_Q4_0); break;  \
        case QF_Q4_1: CALL(QF_Q4_1); break;  \
        case QF_Q4_K: CALL(QF_Q4_K); break;  \
        default: CALL(QF_INT8); break;       \
        }                                    \
    } while (0)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__F16C__) && defined(__FMA__)
#define QK_AVX512 1
#if defined(__AVX512BF16__)
#define QK_BF16 1
#endif
#if defined(__AVX512VNNI__)
#define QK_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QK_AVX2 1
#if defined(__AVXVNNI__)
#define QK_VNNI 1
#endif
#else
#define QK_SCALAR 1
#endif
/* AMX (quant_amx.c: bf16 tiles; quant_amx_dot.c: int8 tiles), Linux only (the tile state
 * must be requested from the kernel). Compiled in by function target attributes on every
 * AVX-512 BF16 (tiles of bf16) or AVX-512 (tiles of int8) x86-64 build, or by the -mamx
 * flags; quant_amx_available() says whether this CPU runs them. */
#if QK_AVX512 && defined(__linux__) && defined(__x86_64__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#if QK_BF16
#define QK_AMX 1
#define QK_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif
#define QK_AMX_INT8 1
#define QK_AMX_INT8_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif

/* Bit flags of what this build runs (quant_isa()). */
#define QK_ISA_AVX512 1
#define QK_ISA_AVX2 2
#define QK_ISA_BF16 4
#define QK_ISA_VNNI 8
#define QK_ISA_AMX_BF16 16
#define QK_ISA_AMX_INT8 32

/* Elements per block and bytes per block (INT8: per 64-element step of a padded row). */
static const int qk_block_elems[QF_COUNT] = {32, 32, 32, 256, 64};
static const int qk_block_bytes[QF_COUNT] = {34, 18, 20, 144, 64};

static inline float qk_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 1023) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float qk_bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch does (inputs here are finite). */
static inline uint16_t qk_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u) return (uint16_t)((bits >> 16) | ((bits & 0xFFFF) ? 0x40 : 0));
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Sub-block j's 6-bit scale and min of a Q4_K block's 12 packed bytes. */
static inline void qk_q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Chunk c (32 elements) of a row: w = scale * q + bias, q the chunk's raw integers
 * (signed for Q8_0/INT8, 0..15 for the 4-bit formats), `*q` pointing at its bytes and
 * `*hi` whether the 4-bit values are the high nibbles. INT8's scale is per row, applied
 * by the caller: here scale = 1. */
static inline void qk_chunk(int fmt, const uint8_t *row, int64_t c, float *scale, float *bias,
                            const uint8_t **q, int *hi) {
    const uint8_t *b;
    *hi = 0;
    switch (fmt) {
    case QF_Q8_0:
        b = row + c * 34;
        *scale = qk_fp16(b); *bias = 0.0f; *q = b + 2;
        return;
    case QF_Q4_0:
        b = row + c * 18;
        *scale = qk_fp16(b); *bias = -8.0f * *scale; *q = b + 2;
        return;
    case QF_Q4_1:
        b = row + c * 20;
        *scale = qk_fp16(b); *bias = qk_fp16(b + 2); *q = b + 4;
        return;
    case QF_Q4_K: {
        int j = (int)(c & 7), sc, mn;
        b = row + (c >> 3) * 144;
        qk_q4k_scale_min(b + 4, j, &sc, &mn);
        *scale = qk_fp16(b) * (float)sc;
        *bias = -(qk_fp16(b + 2) * (float)mn);
        *q = b + 16 + 32 * (j >> 1);
        *hi = j & 1;
        return;
    }
    default:
        *scale = 1.0f; *bias = 0.0f; *q = row + c * 32;
        return;
    }
}

/* The 32 integers of a chunk as floats (scalar; the reference for the vector forms). */
static inline void qk_chunk_ints(int fmt, const uint8_t *q, int hi, float *out) {
    if (fmt == QF_Q8_0 || fmt == QF_INT8) {
        for (int e = 0; e < 32; e++) out[e] = (float)(int8_t)q[e];
    } else if (fmt == QF_Q4_K) {
        for (int e = 0; e < 32; e++) out[e] = (float)(hi ? q[e] >> 4 : q[e] & 15);
    } else {
        for (int e = 0; e < 16; e++) {
            out[e] = (float)(q[e] & 15);
            out[e + 16] = (float)(q[e] >> 4);
        }
    }
}

/* Chunk c of a row dequantized (fp32, scalar). rscale: INT8's row scale (else ignored). */
static inline void qk_dequant_chunk_scalar(int fmt, const uint8_t *row, int64_t c,
                                           float rscale, float *out) {
    float scale, bias, v[32];
    const uint8_t *q;
    int hi;
    qk_chunk(fmt, row, c, &scale, &bias, &q, &hi);
    if (fmt == QF_INT8) scale = rscale;
    qk_chunk_ints(fmt, q, hi, v);
    for (int e = 0; e < 32; e++) out[e] = fmt == QF_Q8_0 || fmt == QF_INT8
                                          ? v[e] * scale : __builtin_fmaf(v[e], scale, bias);
}

#if QK_AVX512 || QK_AVX2
#if QK_AVX512
typedef __m512 qk_vf;
typedef __m512i qk_vi;
#define QK_VL 16
#define qk_vf_zero _mm512_setzero_ps
#define qk_vf_set1 _mm512_set1_ps
#define qk_vf_load _mm512_loadu_ps
#define qk_vf_store _mm512_storeu_ps
#define qk_vf_fma _mm512_fmadd_ps
#define qk_vf_mul _mm512_mul_ps
#define qk_vf_add _mm512_add_ps
/* VL (16) integers of a chunk as floats, starting at element e0 (0 or 16). */
static inline __m512 qk_vf_ints(int fmt, const uint8_t *q, int hi, int e0) {
    if (fmt == QF_Q8_0 || fmt == QF_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + e0))));
    __m512i v;
    if (fmt == QF_Q4_K) {
        v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + e0)));
        v = hi ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    } else {
        v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        v = e0 ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    }
    return _mm512_cvtepi32_ps(v);
}
static inline float qk_vf_hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 qk_vf;
typedef __m256i qk_vi;
#define QK_VL 8
#define qk_vf_zero _mm256_setzero_ps
#define qk_vf_set1 _mm256_set1_ps
#define qk_vf_load _mm256_loadu_ps
#define qk_vf_store _mm256_storeu_ps
#define qk_vf_fma _mm256_fmadd_ps
#define qk_vf_mul _mm256_mul_ps
#define qk_vf_add _mm256_add_ps
/* VL (8) integers of a chunk as floats, starting at element e0 (0, 8, 16, 24). */
static inline __m256 qk_vf_ints(int fmt, const uint8_t *q, int hi, int e0) {
    if (fmt == QF_Q8_0 || fmt == QF_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + e0))));
    __m256i v;
    if (fmt == QF_Q4_K) {
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + e0)));
        v = hi ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    } else {
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + (e0 & 15))));
        v = e0 >= 16 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    }
    return _mm256_cvtepi32_ps(v);
}
static inline float qk_vf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Dequantized values e0 .. e0 + VL of a chunk: scale * q + bias. */
static inline qk_vf qk_vf_dequant(int fmt, const uint8_t *q, int hi, int e0, qk_vf scale,
                                  qk_vf bias) {
    qk_vf v = qk_vf_ints(fmt, q, hi, e0);
    return fmt == QF_Q8_0 || fmt == QF_INT8 ? qk_vf_mul(v, scale) : qk_vf_fma(v, scale, bias);
}

/* sums[i] = horizontal sum of acc[i], i < 16 (AVX-512) or < 8 (AVX2): a shuffle tree
 * that adds pairs of vectors at each level, so a whole tile costs ~2 ops per output. */
static inline void qk_reduce(const qk_vf *acc, float *sums) {
#if QK_AVX512
    /* The tree leaves sum(in[i]) at lane 4 * (i % 4) + i / 4; feeding in[i] =
     * acc[4 * (i % 4) + i / 4] (the permutation is its own inverse) puts sum(acc[e]) at
     * lane e. */
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        int p = 2 * i, r = 2 * i + 1;
        __m512 x = acc[4 * (p % 4) + p / 4], y = acc[4 * (r % 4) + r / 4];
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
    _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                         _mm512_shuffle_ps(c[0], c[1], 0xDD)));
#else
    /* Leaves sum(in[i]) at lane 4 * (i % 2) + i / 2; in[i] = acc[4 * (i % 2) + i / 2]
     * undoes it (lane e = 2 * (e % 4) + e / 4 holds in[...] = acc[e]). */
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++) {
        int p = 2 * i, r = 2 * i + 1;
        __m256 x = acc[4 * (p % 2) + p / 2], y = acc[4 * (r % 2) + r / 2];
        a[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    for (int i = 0; i < 2; i++) b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    _mm256_storeu_ps(sums, _mm256_hadd_ps(b[0], b[1]));
#endif
}
#endif /* QK_AVX512 || QK_AVX2 */

/* Round n floats to bf16 into out. */
static inline void qk_store_bf16(uint16_t *out, const float *v, int n) {
#if QK_BF16
    if (n == 16) {
        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v)));
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = qk_f32_to_bf16(v[i]);
}

/* Row `row` (K weights) dequantized into out: fp32, or bf16 rounded to nearest even
 * when out_bf16. rscale: INT8's row scale. */
static inline __attribute__((always_inline)) void qk_dequant_row_fmt(
        const int fmt, const uint8_t *row, int64_t K, float rscale, void *out, int out_bf16) {
    float *of = (float *)out;
    uint16_t *ob = (uint16_t *)out;
    for (int64_t c = 0; c < K / 32; c++) {
#if QK_AVX512 || QK_AVX2
        float scale, bias;
        const uint8_t *q;
        int hi;
        qk_chunk(fmt, row, c, &scale, &bias, &q, &hi);
        if (fmt == QF_INT8) scale = rscale;
        qk_vf vs = qk_vf_set1(scale), vb = qk_vf_set1(bias);
        for (int e0 = 0; e0 < 32; e0 += QK_VL) {
            qk_vf v = qk_vf_dequant(fmt, q, hi, e0, vs, vb);
            if (!out_bf16) {
                qk_vf_store(of + c * 32 + e0, v);
                continue;
            }
#if QK_BF16
            _mm256_storeu_si256((__m256i *)(ob + c * 32 + e0), (__m256i)_mm512_cvtneps_pbh(v));
#elif QK_AVX512
            __m512i b = _mm512_castps_si512(v);
            b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                    _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
            _mm256_storeu_si256((__m256i *)(ob + c * 32 + e0),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
#else
            __m256i b = _mm256_castps_si256(v);
            b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                    _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
            b = _mm256_srli_epi32(b, 16);
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                              _mm256_extracti128_si256(b, 1));
            _mm_storeu_si128((__m128i *)(ob + c * 32 + e0), packed);
#endif
        }
#else
        float v[32];
        qk_dequant_chunk_scalar(fmt, row, c, rscale, v);
        for (int e = 0; e < 32; e++) {
            if (out_bf16) ob[c * 32 + e] = qk_f32_to_bf16(v[e]);
            else of[c * 32 + e] = v[e];
        }
#endif
    }
    if (K % 32) {  /* INT8 only: the last partial chunk */
        float v[32];
        int64_t c = K / 32;
        qk_dequant_chunk_scalar(fmt, row, c, rscale, v);
        for (int64_t e = 0; e < K - c * 32; e++) {
            if (out_bf16) ob[c * 32 + e] = qk_f32_to_bf16(v[e]);
            else of[c * 32 + e] = v[e];
        }
    }
}

/* A Q4_K block's 8 sub-block scales d * sc_j and negated mins -dmin * mn_j. The 12
 * packed bytes, as three 32-bit words u0 (bytes 0-3), u1 (4-7), u2 (8-11): sc_0..3 are
 * the low 6 bits of u0's bytes, mn_0..3 of u1's; sc_4..7 are u2's low nibbles with the
 * top 2 bits of u0's bytes above them, mn_4..7 u2's high nibbles with u1's top bits. */
static inline void qk_q4k_params(const uint8_t *blk, float *sc, float *mn) {
    uint32_t u0, u1, u2, s[2], m[2];
    memcpy(&u0, blk + 4, 4);
    memcpy(&u1, blk + 8, 4);
    memcpy(&u2, blk + 12, 4);
    s[0] = u0 & 0x3F3F3F3Fu;
    s[1] = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
    m[0] = u1 & 0x3F3F3F3Fu;
    m[1] = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
    float d = qk_fp16(blk), dmin = qk_fp16(blk + 2);
#if QK_AVX512 || QK_AVX2
    __m128i vs = _mm_loadl_epi64((const __m128i *)s), vm = _mm_loadl_epi64((const __m128i *)m);
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(vs)),
                                       _mm256_set1_ps(d)));
    _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(vm)),
                                       _mm256_set1_ps(-dmin)));
#else
    const uint8_t *sb = (const uint8_t *)s, *mb = (const uint8_t *)m;
    for (int j = 0; j < 8; j++) {
        sc[j] = d * (float)sb[j];
        mn[j] = -(dmin * (float)mb[j]);
    }
#endif
}

/* Finish a tile: sums[m * NT + n] -> y, times INT8's row scale, plus bias. */
static inline __attribute__((always_inline)) void qk_store_tile(
        const int MT, const int NT, int fmt, const float *sums, const float *scales,
        const float *bias, void *y, int64_t ldy, int y_bf16, int64_t n0, int nvalid) {
    float out[16];
    for (int m = 0; m < MT; m++) {
        for (int n = 0; n < nvalid; n++) {
            float v = sums[m * NT + n];
            if (fmt == QF_INT8) v *= scales[n0 + n];
            if (bias) v += bias[n0 + n];
            out[n] = v;
        }
        if (y_bf16) qk_store_bf16((uint16_t *)y + m * ldy + n0, out, nvalid);
        else memcpy((float *)y + m * ldy + n0, out, nvalid * sizeof(float));
    }
}

static inline void qk_dequant_row(int fmt, const uint8_t *row, int64_t K, float rscale,
                                  void *out, int out_bf16) {
#define CALL(F) qk_dequant_row_fmt(F, row, K, rscale, out, out_bf16)
    QF_DISPATCH(fmt, CALL);
#undef CALL
}

/* In-order software prefetch into L2 of the weight bytes a thread reads next: each tile
 * (NT rows, one contiguous range of bytes) prefetches the same number of bytes PF_DIST
 * ahead of itself, spread over its k steps. Tiles read NT row streams at once, too short
 * for the hardware prefetchers to train on (see gemv_bf16.c). */
#ifndef QK_PF_DIST
#define QK_PF_DIST 8192
#endif
typedef struct {
    const char *p, *end;
    int64_t lines;
} qk_pf;

static inline qk_pf qk_pf_tile(const uint8_t *tile, int64_t tile_bytes, int64_t steps,
                               const uint8_t *range_end) {
    qk_pf pf;
    pf.p = (const char *)tile + QK_PF_DIST;
    pf.end = (const char *)tile + QK_PF_DIST + tile_bytes;
    if (pf.end > (const char *)range_end) pf.end = (const char *)range_end;
    pf.lines = (tile_bytes / 64 + steps) / (steps > 0 ? steps : 1);
    return pf;
}

static inline void qk_pf_step(qk_pf *pf) {
#if defined(__x86_64__) || defined(__i386__)
    for (int64_t i = 0; i < pf->lines && pf->p < pf->end; i++, pf->p += 64)
        _mm_prefetch(pf->p, _MM_HINT_T1);
#else
    (void)pf;
#endif
}

static inline void qk_pf_range(const uint8_t *begin, int64_t bytes, const uint8_t *range_end) {
#if defined(__x86_64__) || defined(__i386__)
    const char *p = (const char *)begin, *end = p + bytes;
    if (end > (const char *)range_end) end = (const char *)range_end;
    for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
#else
    (void)begin; (void)bytes; (void)range_end;
#endif
}

static inline void qk_pf_warm(const uint8_t *begin, const uint8_t *range_end) {
    qk_pf_range(begin, QK_PF_DIST, range_end);
}

/* Checks shared by the entry points: 0, or -1 for an unknown format / K the format
 * cannot hold / a row shorter than its blocks. */
static inline int qk_check(int fmt, int64_t K, int64_t row_bytes) {
    if (fmt < 0 || fmt >= QF_COUNT || K <= 0) return -1;
    if (fmt == QF_INT8) return row_bytes >= (K + 63) / 64 * 64 ? 0 : -1;
    if (K % qk_block_elems[fmt]) return -1;
    return row_bytes >= K / qk_block_elems[fmt] * qk_block_bytes[fmt] ? 0 : -1;
}

#endif
