/* x rows as AMX B tiles for tdpbf16ps: pair j (elements 2j, 2j + 1) of K chunk c of row m
 * at xb[m / 16][c][j][m % 16][0..1], each group of 16 rows gstride elements (K rounded up
 * to 32, times 16 rows) apart, zero padded past M and K. Shared by gemm_bf16_amx.c and
 * quant_amx.c, with the tile configuration both load (amx_configure_tiles). */
#ifndef TREADLE_AMX_PACK_H
#define TREADLE_AMX_PACK_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

/* Palette 1 with tiles 0 .. ntiles - 1 of 16 rows x 64 bytes, for this thread (the
 * kernels' C, A and B tiles are all that size). */
__attribute__((target("amx-tile"))) static inline void amx_configure_tiles(int ntiles) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < ntiles; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* gcc (12) does not count ldtilecfg as reading its operand: without this barrier it
       dropped the stores above as dead where this function was not inlined, and the
       tile configuration was loaded from garbage (a SIGSEGV). */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif

/* Tile loads and stores with compiler barriers: gcc 12's _tile_loadd and _tile_stored are
   asm statements that do not declare the memory they read or write, so without these the
   compiler may keep a buffer's new values in registers past the load that should see them,
   or read a buffer before the store that fills it. They emit no instruction. */
#define AMX_FENCE() __asm__ volatile("" ::: "memory")
#define AMX_LOAD(tile, base, stride) \
    do { AMX_FENCE(); _tile_loadd(tile, base, stride); AMX_FENCE(); } while (0)
#define AMX_STORE(tile, base, stride) \
    do { AMX_FENCE(); _tile_stored(tile, base, stride); AMX_FENCE(); } while (0)

/* Group g (rows 16 g .. 16 g + 15 of the M rows of x, ldx apart) into dst. */
static inline void amx_pack_group(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                  int64_t g, uint16_t *dst16, int64_t gstride) {
    uint32_t *dst = (uint32_t *)dst16;
    memset(dst, 0, (size_t)gstride * 2);
    for (int64_t r = 0; r < 16 && g * 16 + r < M; r++) {
        const uint16_t *xr = x + (g * 16 + r) * ldx;
        for (int64_t k = 0; k + 1 < K; k += 2) {
            uint32_t pair;
            memcpy(&pair, xr + k, 4);
            dst[(k / 32) * 256 + ((k % 32) / 2) * 16 + r] = pair;
        }
        if (K % 2) dst[((K - 1) / 32) * 256 + (((K - 1) % 32) / 2) * 16 + r] = xr[K - 1];
    }
}

/* Every group of x into xb. */
static inline void amx_pack_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                 uint16_t *xb, int64_t gstride) {
    for (int64_t g = 0; g < (M + 15) / 16; g++)
        amx_pack_group(x, ldx, M, K, g, xb + g * gstride, gstride);
}

#endif
