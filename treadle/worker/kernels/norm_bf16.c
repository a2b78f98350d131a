/* Fused elementwise steps of a bf16 decoder layer, one call each instead of several
 * torch ops (at the few rows of a decode step their cost is the per-op dispatch, not the
 * arithmetic):
 *
 *  - add_rms_norm_bf16: hidden += delta (rounded to bf16, as torch's in-place add), then
 *    out = bf16(bf16(hidden * rsqrt(mean(hidden^2) + eps)) * weight), the numerics of
 *    treadle.models.llama.rms_norm (normalized in float32, cast, then scaled in bf16).
 *  - silu_mul_bf16: out = bf16(bf16(silu(gate)) * up) from the fused [M, 2*I] gate_up
 *    projection, as F.silu followed by an in-place multiply.
 *  - rope_kv_bf16: rotary embedding of queries and keys (rotate_half layout) with the
 *    roundings of treadle.models.rope.apply_rotary (o1 = bf16(bf16(x1 c) - bf16(x2 s)),
 *    o2 = bf16(bf16(x2 c) + bf16(x1 s))), rotated queries written to a contiguous
 *    [M, heads, head_dim], rotated keys and the values stored at each token's KV-cache
 *    slot: one call for what took a dozen torch ops and two index copies.
 *
 * Results can differ from torch in the last float bit (summation order, exp) and so,
 * rarely, by one bf16 ulp. Compiled where the build machine has AVX512-BF16; elsewhere
 * the functions return -1 and callers use torch.
 */

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows per call above which the rows are split over threads. */
#define PARALLEL_ROWS 64

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

typedef uint16_t bf16_t;

static inline __m512 load_bf16(const bf16_t *p, __mmask16 mask) {
    __m256i v = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 round_bf16(__m512 v) {
    __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline void store_bf16(bf16_t *p, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

static void add_rms_norm_row(bf16_t *h, const bf16_t *d, const bf16_t *w, bf16_t *out,
                             int64_t H, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
        __mmask16 mask = tail_mask(H - j);
        __m512 v = load_bf16(h + j, mask);
        if (d) {
            v = round_bf16(_mm512_add_ps(v, load_bf16(d + j, mask)));
            store_bf16(h + j, v, mask);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float variance = _mm512_reduce_add_ps(acc) / (float)H;
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(variance + eps));
    for (int64_t j = 0; j < H; j += 16) {
        __mmask16 mask = tail_mask(H - j);
        __m512 v = round_bf16(_mm512_mul_ps(load_bf16(h + j, mask), inv));
        store_bf16(out + j, _mm512_mul_ps(v, load_bf16(w + j, mask)), mask);
    }
}

int add_rms_norm_bf16(bf16_t *hidden, const bf16_t *delta, const bf16_t *weight, bf16_t *out,
                      int64_t M, int64_t H, float eps) {
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        add_rms_norm_row(hidden + m * H, delta ? delta + m * H : 0, weight, out + m * H, H, eps);
    return 0;
}

/* exp(x), within a few float ulps (Cephes' polynomial, range-reduced by ln 2). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);  /* p * 2^n; overflows to inf, underflows to 0 */
}

int silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t M, int64_t I) {
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *g = gate_up + m * 2 * I, *u = g + I;
        bf16_t *o = out + m * I;
        for (int64_t j = 0; j < I; j += 16) {
            __mmask16 mask = tail_mask(I - j);
            __m512 x = load_bf16(g + j, mask);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
            store_bf16(o + j, _mm512_mul_ps(s, load_bf16(u + j, mask)), mask);
        }
    }
    return 0;
}

/* Rotate `heads` vectors of length 2 * half at src (stride D between heads) into dst. */
static inline void rotate_heads(const bf16_t *src, bf16_t *dst, int64_t dst_stride,
                                int64_t heads, int64_t D, const bf16_t *c, const bf16_t *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        const bf16_t *x = src + h * D;
        bf16_t *o = dst + h * dst_stride;
        for (int64_t j = 0; j < half; j += 16) {
            __mmask16 mask = tail_mask(half - j);
            __m512 x1 = load_bf16(x + j, mask), x2 = load_bf16(x + half + j, mask);
            __m512 cv = load_bf16(c + j, mask), sv = load_bf16(s + j, mask);
            store_bf16(o + j, _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, cv)),
                                            round_bf16(_mm512_mul_ps(x2, sv))), mask);
            store_bf16(o + half + j, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, cv)),
                                                   round_bf16(_mm512_mul_ps(x1, sv))), mask);
        }
    }
}

/* qk: [M, heads + kv_heads, D] rows qk_row apart (queries then keys); v: [M, kv_heads, D]
   rows v_row apart; cos, sin: [M, D / 2] rows cs_row apart; slots: [M] cache slots;
   q_out: [M, heads, D]; k_cache, v_cache: [kv_heads, slots_per_head, D]. */
int rope_kv_bf16(const bf16_t *qk, int64_t qk_row, const bf16_t *v, int64_t v_row,
                 const bf16_t *cos, const bf16_t *sin, int64_t cs_row, const int64_t *slots,
                 bf16_t *q_out, bf16_t *k_cache, bf16_t *v_cache, int64_t M, int64_t heads,
                 int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    if (D % 2) return -1;
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *row = qk + m * qk_row, *c = cos + m * cs_row, *s = sin + m * cs_row;
        rotate_heads(row, q_out + m * heads * D, D, heads, D, c, s);
        rotate_heads(row + heads * D, k_cache + slots[m] * D, slots_per_head * D, kv_heads, D,
                     c, s);
        for (int64_t g = 0; g < kv_heads; g++) {
            const bf16_t *src = v + m * v_row + g * D;
            bf16_t *dst = v_cache + (g * slots_per_head + slots[m]) * D;
            for (int64_t j = 0; j < D; j++) dst[j] = src[j];
        }
    }
    return 0;
}

#else

int rope_kv_bf16(const void *qk, int64_t qk_row, const void *v, int64_t v_row,
                 const void *cos, const void *sin, int64_t cs_row, const int64_t *slots,
                 void *q_out, void *k_cache, void *v_cache, int64_t M, int64_t heads,
                 int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    (void)qk; (void)qk_row; (void)v; (void)v_row; (void)cos; (void)sin; (void)cs_row;
    (void)slots; (void)q_out; (void)k_cache; (void)v_cache; (void)M; (void)heads;
    (void)kv_heads; (void)D; (void)slots_per_head;
    return -1;
}

int add_rms_norm_bf16(void *hidden, const void *delta, const void *weight, void *out,
                      int64_t M, int64_t H, float eps) {
    (void)hidden; (void)delta; (void)weight; (void)out; (void)M; (void)H; (void)eps;
    return -1;
}

int silu_mul_bf16(const void *gate_up, void *out, int64_t M, int64_t I) {
    (void)gate_up; (void)out; (void)M; (void)I;
    return -1;
}

#endif
