/* Quantized linear layer on AMX: y[M, N] = x[M, K] . W[N, K]^T (+ bias) for bf16 x, any
 * M, where the CPU has AMX-BF16 (Sapphire Rapids and later) and the OS grants the tile
 * state (quant_amx_available() asks Linux for it once).
 *
 * The weight is the A operand, so its dequantized rows need no re-layout: each block of
 * 16 weight rows is dequantized once into a bf16 buffer [16][Kp] (L1) whose 32-element
 * column slices are the A tiles (16 rows x 64 bytes). x is the B operand: packed once per
 * call into the pair-interleaved layout tdpbf16ps wants, [M/16][Kp/32][16 pairs][16 x
 * rows][2], zero padded. A block multiplies every K chunk against up to four 16-row
 * groups of x at a time (four C tiles, 16 weight rows x 16 x rows each, fp32), then the
 * C tiles are stored and written transposed into y. The dequantization (the same
 * rounding to bf16 as quant_gemv.c's vdpbf16ps path) is most of the work up to ~64 rows:
 * one pass over W per call whatever M is.
 *
 * OpenMP splits the weight blocks statically (one contiguous part of W per thread, read
 * in order and prefetched ahead); every thread loads its own tile configuration and
 * releases the tiles before returning, so oneDNN's AMX kernels find them as they expect.
 */

#include "quant_simd.h"
#include "amx_pack.h"

#if QK_AMX || QK_AMX_INT8
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Whether this CPU has the AMX units compiled in (AMX-TILE, and AMX-BF16 / AMX-INT8 for
 * the paths built) and Linux granted this process the tile state. */
int quant_amx_available(void) {
#if QK_AMX || QK_AMX_INT8
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return 0;
#if QK_AMX
    if (!(d & (1u << 22))) return 0;  /* AMX-BF16 */
#endif
    if (!(d & (1u << 25))) return 0;  /* AMX-INT8 */
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: process-wide, idempotent. */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

#if QK_AMX
/* Tiles 0-3: C (fp32 16 x 16); 4: A (16 weight rows x 32 bf16); 5, 6: B (16 pairs x 16
 * x rows). */
QK_AMX_TARGET static void configure_tiles(void) { amx_configure_tiles(7); }

/* B tiles alternate between tiles 5 and 6 (literal tile numbers: the intrinsics take them as
 * immediates) so that a load need not wait for the previous product to finish reading. */
#define DP(C, B) do { _tile_loadd(B, xb + (g0 + C) * gstride + c * 512, 64); \
                      _tile_dpbf16ps(C, 4, B); } while (0)
#define STORE(C) _tile_stored(C, tmp[C], 64)

/* x rows [16 g0, 16 (g0 + G)) against the 16 dequantized weight rows in a. */
QK_AMX_TARGET static void group_pass(int G, const uint16_t *a, int64_t kp, const uint16_t *xb, int64_t g0,
                       int64_t gstride, float tmp[4][16][16]) {
    int64_t nchunks = kp / 32;
    _tile_zero(0);
    if (G > 1) _tile_zero(1);
    if (G > 2) _tile_zero(2);
    if (G > 3) _tile_zero(3);
    for (int64_t c = 0; c < nchunks; c++) {
        _tile_loadd(4, a + c * 32, kp * 2);
        DP(0, 5);
        if (G > 1) DP(1, 6);
        if (G > 2) DP(2, 5);
        if (G > 3) DP(3, 6);
    }
    STORE(0);
    if (G > 1) STORE(1);
    if (G > 2) STORE(2);
    if (G > 3) STORE(3);
}
#endif

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (bf16, rows ldx apart) . W^T + bias
 * (fp32 [N] or NULL). W: N rows of row_bytes; scales: INT8's row scales. threads <= 0:
 * OpenMP's default. Returns 0; -1 for a bad format, K or row size; -2 where this build
 * has no AMX; -3 when out of memory. */
#if QK_AMX
QK_AMX_TARGET
#endif
int quant_gemm_amx(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const uint16_t *x, int64_t ldx, const float *bias, void *y, int64_t ldy,
                   int y_bf16, int64_t M, int64_t N, int64_t K, int threads) {
#if QK_AMX
    if (qk_check(fmt, K, row_bytes) || (fmt == QF_INT8 && !scales)) return -1;
    if (M <= 0 || N <= 0) return 0;
    int64_t kp = (K + 31) / 32 * 32, nchunks = kp / 32, ngroups = (M + 15) / 16;
    int64_t gstride = nchunks * 512, num_blocks = (N + 15) / 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(ngroups * gstride * 2));
    if (!xb) return -3;
    int status = 0;
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < ngroups; g++)
            amx_pack_group(x, ldx, M, K, g, xb + g * gstride, gstride);
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        const uint8_t *range_end = w + (b1 * 16 < N ? b1 * 16 : N) * row_bytes;
        uint16_t *a = aligned_alloc(64, (size_t)(16 * kp * 2));
        if (!a) {
            #pragma omp atomic write
            status = -3;
        }
        if (a && b0 < b1) {
            float tmp[4][16][16];
            configure_tiles();
            qk_pf_warm(w + b0 * 16 * row_bytes, range_end);
            for (int64_t blk = b0; blk < b1; blk++) {
                int64_t n0 = blk * 16, nvalid = N - n0 < 16 ? N - n0 : 16;
                for (int64_t r = 0; r < nvalid; r++) {
                    qk_pf_range(w + (n0 + r) * row_bytes + QK_PF_DIST, row_bytes, range_end);
                    qk_dequant_row(fmt, w + (n0 + r) * row_bytes, kp, 1.0f, a + r * kp, 1);
                }
                if (nvalid < 16) memset(a + nvalid * kp, 0, (size_t)((16 - nvalid) * kp * 2));
                for (int64_t g0 = 0; g0 < ngroups; g0 += 4) {
                    int G = ngroups - g0 < 4 ? (int)(ngroups - g0) : 4;
                    group_pass(G, a, kp, xb, g0, gstride, tmp);
                    for (int gi = 0; gi < G; gi++) {
                        for (int64_t mm = 0; mm < 16 && (g0 + gi) * 16 + mm < M; mm++) {
                            int64_t m = (g0 + gi) * 16 + mm;
                            float out[16];
                            for (int64_t n = 0; n < nvalid; n++) {
                                float v = tmp[gi][n][mm];
                                if (fmt == QF_INT8) v *= scales[n0 + n];
                                if (bias) v += bias[n0 + n];
                                out[n] = v;
                            }
                            if (y_bf16) qk_store_bf16((uint16_t *)y + m * ldy + n0, out, (int)nvalid);
                            else memcpy((float *)y + m * ldy + n0, out, (size_t)nvalid * 4);
                        }
                    }
                }
            }
            _tile_release();
        }
        free(a);
    }
    free(xb);
    return status;
#else
    (void)fmt; (void)w; (void)row_bytes; (void)scales; (void)x; (void)ldx; (void)bias;
    (void)y; (void)ldy; (void)y_bf16; (void)M; (void)N; (void)K; (void)threads;
    return -2;
#endif
}
