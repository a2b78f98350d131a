/* bf16 linear layer on AMX tiles for a decode step's 4-64 rows (and, for batch-invariant
 * engines, every row count): y[M, N] = x[M, K] . W[N, K]^T (+ bias), the weight read
 * once, straight from its row-major bf16 layout.
 *
 * At these rows a linear layer is still bound by reading its weight, but the dot-product
 * kernel (gemv_bf16.c) pays a vdpbf16ps per 32 products per row, and oneDNN's packed
 * kernel, on AMX tiles too, costs 13.9-15.7 ms for all of a SmolLM2-135M step's linears at
 * 4-16 rows where reading the weights takes 8.3 ms (docs/benchmarks.md). Here one
 * tdpbf16ps multiplies 16 weight rows by 32 columns against 16 rows of x, so up to 64
 * rows take four per 64 bytes of each weight row:
 *  - W is the A operand: 16 weight rows x 32 bf16 of K, loaded as a tile with the row
 *    stride K (no re-layout, no copy);
 *  - x is the B operand, packed once per call into the pair-interleaved layout
 *    [M/16][K/32][16 pairs][16 rows][2] (amx_pack.h);
 *  - four C tiles (16 weight rows x 16 x rows, fp32) per block of 16 weight rows, stored
 *    and written transposed into y, rounded to bf16 nearest-even like torch.
 * Past 64 rows each block of 16 weight rows takes the rows 64 at a time (the block's A
 * tiles come from L1 again for every 64 rows). Each output is the sum of its tdpbf16ps
 * over K in order, from zero, whichever rows share the call: a row's results do not
 * depend on how many rows there are (docs/batch_invariance.md).
 * OpenMP splits the weight blocks statically, each thread prefetching its own part two
 * blocks ahead (a tile load reads 16 short row streams, too short for the hardware
 * prefetchers). Every thread loads its tile configuration and releases the tiles before
 * returning (oneDNN's kernels configure their own).
 *
 * Built into every x86-64 AVX-512 BF16 level through function target attributes, and used
 * only where the CPU has AMX-BF16 and Linux grants the tile state
 * (gemm_bf16_amx_available). Needs K a multiple of 32 and N of 16 (every projection of
 * the models served here); otherwise it returns -1 and the caller keeps oneDNN.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "omp_team.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__AVX512BF16__)
#define GEMM_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_pack.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define PASS_ROWS 64  /* x rows per pass over a block: four C tiles */
#define PF_AHEAD 2  /* blocks of 16 weight rows */

int gemm_bf16_amx_available(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return 0;  /* AMX-BF16, AMX-TILE */
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: process-wide, idempotent. */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* Tiles 0-3: C; 4: A (16 weight rows x 32 bf16); 5-7: B (16 pairs x 16 x rows). */
AMX_TARGET static void configure(void) { amx_configure_tiles(8); }

/* B tiles rotate over 5-7 so that a load need not wait for the product before it to
 * finish reading. */
#define DP(C, B) do { _tile_loadd(B, xb + (C) * gstride + c * 512, 64); \
                      _tile_dpbf16ps(C, 4, B); } while (0)

/* The 16 weight rows at w (K apart) against every group of x: tmp[g][n][m]. */
AMX_TARGET static void block_pass(int G, const uint16_t *w, int64_t K, const uint16_t *xb,
                                  int64_t gstride, const char *pf, float tmp[4][16][16]) {
    const int64_t nchunks = K / 32;
    _tile_zero(0);
    if (G > 1) _tile_zero(1);
    if (G > 2) _tile_zero(2);
    if (G > 3) _tile_zero(3);
    for (int64_t c = 0; c < nchunks; c++) {
        if (pf)  /* this chunk's line of each of the block PF_AHEAD ahead */
            for (int r = 0; r < 16; r++) _mm_prefetch(pf + r * K * 2 + c * 64, _MM_HINT_T1);
        _tile_loadd(4, w + c * 32, K * 2);
        DP(0, 5);
        if (G > 1) DP(1, 6);
        if (G > 2) DP(2, 7);
        if (G > 3) DP(3, 5);
    }
    _tile_stored(0, tmp[0], 64);
    if (G > 1) _tile_stored(1, tmp[1], 64);
    if (G > 2) _tile_stored(2, tmp[2], 64);
    if (G > 3) _tile_stored(3, tmp[3], 64);
}

/* Returns 0; -1 when not covered (M < 1, K % 32, N % 16); -3 out of memory. */
AMX_TARGET int gemm_bf16_amx(const uint16_t *x, int64_t ldx, const uint16_t *w,
                             const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t M,
                             int64_t N, int64_t K, int threads) {
    if (M <= 0 || K <= 0 || K % 32 || N <= 0 || N % 16) return -1;
    const int64_t ngroups = (M + 15) / 16, gstride = K / 32 * 512, num_blocks = N / 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(ngroups * gstride * 2));
    if (!xb) return -3;
    amx_pack_rows(x, ldx, M, K, xb, gstride);
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        float tmp[4][16][16];
        /* Output row m of a block is column m % 16 of its group's C tile. */
        const __m512i column = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(16));
        configure();
        for (int64_t blk = b0; blk < b0 + PF_AHEAD && blk < b1; blk++)
            for (int64_t p = 0; p < 16 * K * 2; p += 64)
                _mm_prefetch((const char *)(w + blk * 16 * K) + p, _MM_HINT_T1);
        for (int64_t blk = b0; blk < b1; blk++) {
            const int64_t n0 = blk * 16;
            const char *pf = blk + PF_AHEAD < b1 ? (const char *)(w + (n0 + 16 * PF_AHEAD) * K)
                                                 : 0;
            for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
                const int64_t rows = M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS;
                block_pass((int)((rows + 15) / 16), w + n0 * K, K, xb + m0 / 16 * gstride,
                           gstride, m0 ? 0 : pf, tmp);
                for (int64_t m = 0; m < rows; m++) {
                    const int64_t g = m / 16, mm = m % 16;
                    __m512 v = _mm512_i32gather_ps(column, &tmp[g][0][mm], 4);
                    if (bias) {
                        const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + n0));
                        v = _mm512_add_ps(v, _mm512_castsi512_ps(
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
                    }
                    _mm256_storeu_si256((__m256i *)(y + (m0 + m) * ldy + n0),
                                        (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
        _tile_release();
    }
    free(xb);
    return 0;
}

#else

int gemm_bf16_amx_available(void) { return 0; }

int gemm_bf16_amx(const void *x, int64_t ldx, const void *w, const void *bias, void *y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)M; (void)N; (void)K;
    (void)threads;
    return -2;
}

#endif
