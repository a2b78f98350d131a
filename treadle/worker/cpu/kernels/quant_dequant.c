/* Dequantization of quantized weight rows (layouts: quant_simd.h) into fp32 or bf16:
 * the prefill path's tiles (treadle/models/quant_weights.py dequantizes N-row tiles into a
 * bf16 buffer and hands them to oneDNN) and `QuantizedLinear.dequantize()`.
 *
 * Also the build's identity: quant_isa() says which ISA level and extensions the
 * quantized kernels were compiled with (AMX: compiled in; quant_amx_available() says
 * whether the OS lets it run).
 */

#include "quant_simd.h"

int quant_isa(void) {
    int flags = 0;
#if QK_AVX512
    flags |= QK_ISA_AVX512;
#endif
#if QK_AVX2
    flags |= QK_ISA_AVX2;
#endif
#if QK_BF16
    flags |= QK_ISA_BF16;
#endif
#if QK_VNNI
    flags |= QK_ISA_VNNI;
#endif
#if QK_AMX
    flags |= QK_ISA_AMX_BF16;
#endif
#if QK_AMX_INT8
    flags |= QK_ISA_AMX_INT8;
#endif
    return flags;
}

/* Rows [n0, n1) of w (row_bytes apart; INT8: scales[n] per row, else NULL) into out
 * (rows ldo elements apart, fp32 or bf16). Returns 0, or -1 for a bad format or K. */
int quant_dequant(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                  int64_t n0, int64_t n1, int64_t K, void *out, int64_t ldo, int out_bf16,
                  int threads) {
    if (qk_check(fmt, K, row_bytes) || n0 < 0 || n1 < n0 || (fmt == QF_INT8 && !scales))
        return -1;
    int64_t rows = n1 - n0, esize = out_bf16 ? 2 : 4;
    threads = team_size(threads, rows / 8);
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = n0 + r;
        qk_dequant_row(fmt, w + n * row_bytes, K, scales ? scales[n] : 1.0f,
                       (char *)out + r * ldo * esize, out_bf16);
    }
    return 0;
}
