/* Width-generic fp32 vectors for the kernels: 16 lanes with AVX-512 (F, BW, VL, DQ), 8 with
 * AVX2 + FMA, SIMD_WIDTH 0 elsewhere (then the kernels' fast paths are not compiled).
 *
 * bf16 stays in memory and is widened in registers: bf16 -> fp32 is a 16-bit shift, and a
 * 32-bit word holding two bf16 (a "pair", as vdpbf16ps takes them) splits into the two
 * fp32 values with one shift and one and. fp32 -> bf16 rounds to nearest even with the
 * integer trick torch uses (NaN stays a quiet NaN, subnormals are kept: unlike
 * vcvtneps2bf16, which flushes them). The NaN test is on the integer bits, so it holds
 * under -ffast-math too. Also 2^x and e^x polynomials and a transposing reduction.
 *
 * On AVX-512 every helper is the instruction sequence the kernels used before this
 * header existed. Part of the kernels' build: native.py hashes the headers with the
 * sources.
 */
#ifndef TREADLE_SIMD_H
#define TREADLE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define SIMD_WIDTH 16
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_WIDTH 8
#else
#define SIMD_WIDTH 0
#endif

#if SIMD_WIDTH
#include <immintrin.h>

#define SIMD_INLINE static inline __attribute__((always_inline))

#if SIMD_WIDTH == 16
typedef __m512 vf;   /* SIMD_WIDTH floats */
typedef __m512i vi;  /* SIMD_WIDTH 32-bit words (bf16 pairs) */
typedef __m256i vh;  /* SIMD_WIDTH bf16 */

SIMD_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
SIMD_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
SIMD_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
SIMD_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
SIMD_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
SIMD_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
SIMD_INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
/* a * b + c and c - a * b, one rounding */
SIMD_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
SIMD_INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE vf vf_load(const float *p) { return _mm512_load_ps(p); }
SIMD_INLINE void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
SIMD_INLINE void vf_store(float *p, vf v) { _mm512_store_ps(p, v); }
SIMD_INLINE float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
SIMD_INLINE float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
SIMD_INLINE vf vf_round(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* x * 2^n for integral n (overflows to inf, underflows through subnormals to 0) */
SIMD_INLINE vf vf_scale2(vf x, vf n) { return _mm512_scalef_ps(x, n); }

/* x where lane < n, else fill (n may be <= 0 or >= the width) */
SIMD_INLINE vf vf_first(vf x, int64_t n, float fill) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), m, x);
}
/* x with its first k lanes replaced by fill (k <= 0: x; k >= 16: all fill) */
SIMD_INLINE vf vf_from(vf x, int64_t k, float fill) {
    const __mmask16 m = k <= 0 ? (__mmask16)0xffff : k >= 16 ? 0
                        : (__mmask16)(0xffffu & ~((1u << k) - 1u));
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), m, x);
}

SIMD_INLINE vi vi_loadu(const void *p) { return _mm512_loadu_si512(p); }
SIMD_INLINE vi vi_load(const void *p) { return _mm512_load_si512(p); }
/* n < 2 * SIMD_WIDTH bf16 from p as words, zero beyond */
SIMD_INLINE vi vi_load_bf16_n(const uint16_t *p, int64_t n) {
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
SIMD_INLINE vf vf_from_words(vi w) { return _mm512_castsi512_ps(w); }
SIMD_INLINE vi vi_from_floats(vf v) { return _mm512_castps_si512(v); }
SIMD_INLINE vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
SIMD_INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
SIMD_INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
SIMD_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
SIMD_INLINE vi vi_slli16(vi a) { return _mm512_slli_epi32(a, 16); }
SIMD_INLINE vi vi_srli16(vi a) { return _mm512_srli_epi32(a, 16); }
SIMD_INLINE vi vi_blend_gt(vi a, vi b, vi x, vi y) {  /* x where a > b (signed), else y */
    return _mm512_mask_mov_epi32(y, _mm512_cmpgt_epi32_mask(a, b), x);
}
SIMD_INLINE vh vh_loadu(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
SIMD_INLINE vh vh_load_n(const uint16_t *p, int64_t n) {
    return _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
}
SIMD_INLINE void vh_storeu(uint16_t *p, vh h) { _mm256_storeu_si256((__m256i *)p, h); }
SIMD_INLINE void vh_store_n(uint16_t *p, vh h, int64_t n) {
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1u), h);
}
SIMD_INLINE vi vi_from_halves(vh h) { return _mm512_cvtepu16_epi32(h); }
SIMD_INLINE vh vh_from_words(vi w) { return _mm512_cvtepi32_epi16(w); }  /* low halves */

/* Lane t of the result: the sum of a[t]'s lanes (t < 16). */
SIMD_INLINE vf vf_transpose_reduce(const vf *a) {
    __m512 l1[8], l2[4], l3[2];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [t0 t1 t0 t1] */
        l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: [t0 t1 t2 t3] */
        l2[i] = _mm512_add_ps(_mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
    #pragma GCC unroll 2
    for (int i = 0; i < 2; i++)  /* 128-bit lanes: [t0-3 t0-3 t4-7 t4-7] */
        l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88),
                         _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD));
}

#else /* SIMD_WIDTH == 8 */
typedef __m256 vf;
typedef __m256i vi;
typedef __m128i vh;

SIMD_INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
SIMD_INLINE vf vf_set1(float x) { return _mm256_set1_ps(x); }
SIMD_INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
SIMD_INLINE vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
SIMD_INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
SIMD_INLINE vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
SIMD_INLINE vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
SIMD_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
SIMD_INLINE vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
SIMD_INLINE vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE vf vf_load(const float *p) { return _mm256_load_ps(p); }
SIMD_INLINE void vf_storeu(float *p, vf v) { _mm256_storeu_ps(p, v); }
SIMD_INLINE void vf_store(float *p, vf v) { _mm256_store_ps(p, v); }
SIMD_INLINE float vf_reduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
SIMD_INLINE float vf_reduce_max(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
SIMD_INLINE vf vf_round(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* x * 2^n for integral n in [-150, 128], one rounding like vscalefps: the power is
   applied in two halves, each a normal float. */
SIMD_INLINE vf vf_scale2(vf x, vf n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(x, s1), s2);
}

SIMD_INLINE vf vf_first(vf x, int64_t n, float fill) {
    const int32_t k = n >= 8 ? 8 : n <= 0 ? 0 : (int32_t)n;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(k), lanes);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(keep));
}
SIMD_INLINE vf vf_from(vf x, int64_t k, float fill) {
    const int32_t c = k >= 8 ? 8 : k <= 0 ? 0 : (int32_t)k;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i drop = _mm256_cmpgt_epi32(_mm256_set1_epi32(c), lanes);
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_castsi256_ps(drop));
}

SIMD_INLINE vi vi_loadu(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
SIMD_INLINE vi vi_load(const void *p) { return _mm256_load_si256((const __m256i *)p); }
SIMD_INLINE vi vi_load_bf16_n(const uint16_t *p, int64_t n) {
    uint16_t buf[16] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)buf);
}
SIMD_INLINE vf vf_from_words(vi w) { return _mm256_castsi256_ps(w); }
SIMD_INLINE vi vi_from_floats(vf v) { return _mm256_castps_si256(v); }
SIMD_INLINE vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
SIMD_INLINE vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
SIMD_INLINE vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
SIMD_INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
SIMD_INLINE vi vi_slli16(vi a) { return _mm256_slli_epi32(a, 16); }
SIMD_INLINE vi vi_srli16(vi a) { return _mm256_srli_epi32(a, 16); }
SIMD_INLINE vi vi_blend_gt(vi a, vi b, vi x, vi y) {
    return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(a, b));
}
SIMD_INLINE vh vh_loadu(const uint16_t *p) { return _mm_loadu_si128((const __m128i *)p); }
SIMD_INLINE vh vh_load_n(const uint16_t *p, int64_t n) {
    uint16_t buf[8] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return _mm_loadu_si128((const __m128i *)buf);
}
SIMD_INLINE void vh_storeu(uint16_t *p, vh h) { _mm_storeu_si128((__m128i *)p, h); }
SIMD_INLINE void vh_store_n(uint16_t *p, vh h, int64_t n) {
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, h);
    memcpy(p, buf, (size_t)n * sizeof(uint16_t));
}
SIMD_INLINE vi vi_from_halves(vh h) { return _mm256_cvtepu16_epi32(h); }
SIMD_INLINE vh vh_from_words(vi w) {  /* the words are < 2^16: packing does not saturate */
    const __m256i packed = _mm256_packus_epi32(w, w);  /* per 128-bit lane: w0-3 w0-3 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

SIMD_INLINE vf vf_transpose_reduce(const vf *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif /* SIMD_WIDTH */

/* ---- shared by both widths ---------------------------------------------------------- */

/* SIMD_WIDTH bf16 as fp32. */
SIMD_INLINE vf vf_bf16_load(const uint16_t *p) {
    return vf_from_words(vi_slli16(vi_from_halves(vh_loadu(p))));
}
/* The first n (<= SIMD_WIDTH) bf16 at p, zero beyond. */
SIMD_INLINE vf vf_bf16_load_n(const uint16_t *p, int64_t n) {
    return vf_from_words(vi_slli16(vi_from_halves(vh_load_n(p, n))));
}
/* The bf16 pairs of words w: the first element of each (low half) and the second. */
SIMD_INLINE vf vf_pair_lo(vi w) { return vf_from_words(vi_slli16(w)); }
SIMD_INLINE vf vf_pair_hi(vi w) { return vf_from_words(vi_and(w, vi_set1((int32_t)0xffff0000))); }

/* v rounded to nearest even at bf16 precision: the bf16 is the high half of each word
   (the low half is left over). NaN -> quiet NaN. */
SIMD_INLINE vi vi_bf16_round(vf v) {
    const vi u = vi_from_floats(v);
    const vi lsb = vi_and(vi_srli16(u), vi_set1(1));
    const vi rounded = vi_add(u, vi_add(lsb, vi_set1(0x7fff)));
    const vi quiet = vi_or(u, vi_set1(0x00400000));
    const vi nan = vi_and(u, vi_set1(0x7fffffff));
    return vi_blend_gt(nan, vi_set1(0x7f800000), quiet, rounded);
}
/* v rounded to bf16, as fp32 */
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
/* One vcvtneps2bf16 where the CPU has it: the same nearest-even rounding and quiet NaNs,
   except that subnormal floats (below 2^-126) are taken and given as zero. */
SIMD_INLINE vh vh_from_floats(vf v) { return (vh)_mm512_cvtneps_pbh(v); }
SIMD_INLINE vf vf_bf16_round(vf v) { return vf_from_words(vi_slli16(vi_from_halves(vh_from_floats(v)))); }
#else
SIMD_INLINE vf vf_bf16_round(vf v) {
    return vf_from_words(vi_and(vi_bf16_round(v), vi_set1((int32_t)0xffff0000)));
}
SIMD_INLINE vh vh_from_floats(vf v) { return vh_from_words(vi_srli16(vi_bf16_round(v))); }
#endif
SIMD_INLINE void vf_bf16_store(uint16_t *p, vf v) { vh_storeu(p, vh_from_floats(v)); }
SIMD_INLINE void vf_bf16_store_n(uint16_t *p, vf v, int64_t n) {
    vh_store_n(p, vh_from_floats(v), n);
}

/* 2^x, ~1e-7 relative error; x below -126 gives (about) 0, never inf. The attention
   kernels keep their scores in the exp2 domain (scale * log2(e) folded in). */
SIMD_INLINE vf vf_exp2(vf x) {
    x = vf_max(x, vf_set1(-127.f));
#if SIMD_WIDTH == 8
    x = vf_min(x, vf_set1(127.f));  /* vf_scale2's range */
#endif
    const vf n = vf_round(x);
    const vf f = vf_sub(x, n); /* [-0.5, 0.5] */
    vf p = vf_set1(1.535336188e-4f);
    p = vf_fmadd(p, f, vf_set1(1.339887440e-3f));
    p = vf_fmadd(p, f, vf_set1(9.618437357e-3f));
    p = vf_fmadd(p, f, vf_set1(5.550332471e-2f));
    p = vf_fmadd(p, f, vf_set1(2.402264791e-1f));
    p = vf_fmadd(p, f, vf_set1(6.931472028e-1f));
    p = vf_fmadd(p, f, vf_set1(1.0f));
    return vf_scale2(p, n);
}

/* e^x within a few float ulps (Cephes' polynomial, range-reduced by ln 2); overflows to
   inf, underflows to 0. Bit-identical at both widths. */
SIMD_INLINE vf vf_exp(vf x) {
    x = vf_max(vf_min(x, vf_set1(89.0f)), vf_set1(-104.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_scale2(p, n);
}

#endif /* SIMD_WIDTH */
#endif /* TREADLE_SIMD_H */
