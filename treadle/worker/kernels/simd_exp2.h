/* 2^x on 16 floats with AVX-512, shared by the attention kernels (paged_decode.c,
 * paged_prefill.c), which keep their scores in the exp2 domain (scale * log2(e) folded
 * into the scores). ~1e-7 relative error; x below -126 gives (about) 0, never inf.
 * Part of the kernels' build: worker/native.py hashes the headers with the sources.
 */
#ifndef TREADLE_SIMD_EXP2_H
#define TREADLE_SIMD_EXP2_H
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.535336188e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
