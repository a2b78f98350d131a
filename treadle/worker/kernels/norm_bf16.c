/* Fused elementwise steps of a bf16 decoder layer, one call each instead of several
 * torch ops (at the few rows of a decode step their cost is the per-op dispatch, not the
 * arithmetic):
 *
 *  - add_rms_norm_bf16: hidden += delta (rounded to bf16, as torch's in-place add), then
 *    out = bf16(bf16(hidden * rsqrt(mean(hidden^2) + eps)) * weight), the numerics of
 *    treadle.models.llama.rms_norm (normalized in float32, cast, then scaled in bf16).
 *  - silu_mul_bf16: out = bf16(bf16(silu(gate)) * up) from the fused [M, 2*I] gate_up
 *    projection, as F.silu followed by an in-place multiply.
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

#else

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
