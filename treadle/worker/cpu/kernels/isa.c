/* What this build of the kernels was compiled with, for worker/native.py to report (the
 * ISA level's flags decide it: see worker/cpu_isa.py).
 */
#include "simd.h"

/* fp32 lanes of the kernels' vector paths: 16 (AVX-512), 8 (AVX2) or 0 (none). */
int kernels_simd_width(void) { return SIMD_WIDTH; }

/* Whether the bf16 dot products use vdpbf16ps (AVX-512 BF16) rather than widening. */
int kernels_have_dpbf16(void) {
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
    return 1;
#else
    return 0;
#endif
}
