/* bf16 linear layer for many rows on AVX-512 BF16, on a copy of the weight packed at load:
 * y[M, N] = x[M, K] . W[N, K]^T (+ bias), a register-tiled GEMM on vdpbf16ps.
 *
 * gemv_bf16.c reads W in its row-major layout: each (x row, W row) pair accumulates 16
 * lanes along K and is reduced at the end, and each vector load feeds at most 4
 * products. Past ~16 rows a linear is bound by arithmetic, and that kernel ran at 60-70%
 * of vdpbf16ps's rate (SmolLM2-135M's layers, Zen 4). Here the lanes are 16 output
 * columns instead, as vdpbf16ps wants them for an outer product: the packed layout, per
 * group of 16 rows of W (N padded to 16 with zeros) and per pair of K positions (K padded
 * to even with a zero), holds the 16 rows' two values side by side,
 *     packed[g][p][2 * i + e] = W[16 g + i][2 p + e]      (32 bf16 = one zmm per pair p)
 * with a group's pairs contiguous (K + 1) / 2 * 64 bytes. One vdpbf16ps multiplies a pair of
 * one x row, broadcast, into 16 columns' sums; a register tile is up to 8 x rows by 3
 * groups, or up to 12 rows by 2 groups at 9-12 rows (24 accumulators; column_groups), so
 * each W vector feeds up to 8 or 12 products, in fp32, with no reduction at the end: the
 * sums round once to bf16 (nearest-even, as torch) after the bias is added.
 *
 * Loops: the rows in blocks of MB (their x stays in L2), then each thread's share of
 * column tiles (2 or 3 groups: the tile's W panel is read from memory once per row block and
 * from L2 by the block's other row tiles), then the row tiles. OpenMP splits the column
 * tiles statically. While a column tile runs, its row tiles prefetch the thread's next
 * panel into L2, a slice each, one line or so per K pair: otherwise the first row tile of
 * every panel waited on memory (SmolLM2-135M's layers, Zen 4, 2 threads: a step's
 * linears 9-13% faster at 4-24 rows, 4-5% at 48-64, 2% at 128). Not at one row, where
 * the loop only streams W and the prefetches cost more than they hide. K need not be even
 * nor N a multiple of 16; x rows may be strided (ldx), W packed by gemm_bf16_vnni_pack, y
 * rows dense.
 *
 * gemm_bf16_vnni_f32 stores the same bf16 roundings widened to float32 (an LM head's
 * logits as the sampler reads them), and gemm_bf16_vnni_argmax runs the same loops for
 * an LM head whose rows are all greedy:
 * instead of storing y, each tile keeps every row's running maximum of the values y would
 * hold, so the step neither writes the logits nor reads them back (a 48-row step's
 * logits are 4.7 MB in bf16 and 9.4 MB once widened for the sampler).
 *
 * Built where the level has AVX-512 BF16; elsewhere gemm_bf16_vnni_available() returns 0
 * and the callers keep their other kernels.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "omp_team.h"

typedef uint16_t bf16_t;

/* Elements (bf16) of the packed copy of an N x K weight. */
int64_t gemm_bf16_vnni_packed_elems(int64_t N, int64_t K) {
    if (N <= 0 || K <= 0) return 0;
    return (N + 15) / 16 * ((K + 1) / 2) * 32;
}

/* w [N, K] row-major into out (gemm_bf16_vnni_packed_elems(N, K) elements). Returns 0.
 * Runs once per weight at load. */
int gemm_bf16_vnni_pack(const bf16_t *w, int64_t N, int64_t K, bf16_t *out) {
    const int64_t groups = (N + 15) / 16, pairs = (K + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        bf16_t *dst = out + g * pairs * 32;
        for (int64_t p = 0; p < pairs; p++)
            for (int i = 0; i < 16; i++) {
                const int64_t n = 16 * g + i;
                for (int e = 0; e < 2; e++) {
                    const int64_t k = 2 * p + e;
                    dst[p * 32 + 2 * i + e] = n < N && k < K ? w[n * K + k] : 0;
                }
            }
    }
    return 0;
}

#if defined(__AVX512BF16__)

#include <immintrin.h>

/* Register tiles: up to 8 x rows by 3 groups of 16 columns, or up to 12 rows by 2 groups
 * (24 accumulators either way); see column_groups. */
#define MR 12   /* most x rows of a register tile */
#define NG 3    /* most 16-column groups of a register tile */
#ifndef MB
#define MB 128  /* x rows per block */
#endif

/* Where a tile's sums go: rounded to bf16 into y (rows ldy apart); or rounded to bf16 and
 * widened back into yf (float32, rows ldy apart: what torch's .float() of y gives); or,
 * when best is set, into each row's running maximum instead (argmax: best / best_at
 * [rows][16], one per lane; a lane keeps its first column of an equal value, its columns
 * growing). */
typedef struct {
    bf16_t *y;
    float *yf;
    int64_t ldy;
    float *best;
    int32_t *best_at;
} out_t;

/* `o` from its row r on. */
static inline out_t at_row(out_t o, int64_t r) {
    return (out_t){o.y ? o.y + r * o.ldy : NULL, o.yf ? o.yf + r * o.ldy : NULL, o.ldy,
                   o.best ? o.best + 16 * r : NULL, o.best_at ? o.best_at + 16 * r : NULL};
}

/* One x pair (x[2p], x[2p + 1]) broadcast to every lane; `last`: only x[2p] (K odd), the
 * other half zero (the packed W is zero there, but x past K may be anything). */
static inline __m512bh x_pair(const bf16_t *x, int64_t p, int last) {
    uint32_t v;
    if (last) {
        v = x[2 * p];
    } else {
        memcpy(&v, x + 2 * p, sizeof v);
    }
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* One K pair p of the tile: rows x[0 .. R) against groups 0 .. G of wp; `last`: the pair
 * holds only K's last, odd position. */
static inline __attribute__((always_inline)) void pair_step(
        const int R, const int G, const bf16_t *x, int64_t ldx, const bf16_t *wp,
        int64_t group_elems, int64_t p, int last, __m512 acc[MR][NG]) {
    __m512bh w[NG];
    for (int j = 0; j < G; j++)
        w[j] = (__m512bh)_mm512_loadu_si512(wp + j * group_elems + p * 32);
    for (int r = 0; r < R; r++) {
        const __m512bh xb = x_pair(x + r * ldx, p, last);
        for (int j = 0; j < G; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, w[j]);
    }
}

/* Rows x[0 .. R) against groups g .. g + G of the packed weight (wp points at group g),
 * into y columns n0 .. n0 + 16 G (only those below N stored), prefetching pf_lines lines
 * from pf into L2 meanwhile. */
static inline __attribute__((always_inline)) void tile(
        const int R, const int G, const bf16_t *x, int64_t ldx, const bf16_t *wp,
        int64_t group_elems, int64_t K, const bf16_t *bias, const out_t *o,
        int64_t n0, int64_t N, const char *pf, int64_t pf_lines) {
    __m512 acc[MR][NG];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < G; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t full = K / 2;
    /* The next column tile's panel, pf_lines lines of it, spread over this tile's pairs. */
    const int64_t per = pf_lines ? (pf_lines + full - 1) / full : 0;
    for (int64_t p = 0; p < full; p++) {
        for (int64_t i = 0; i < per; i++) {
            const int64_t line = p * per + i;
            if (line < pf_lines) _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
        }
        pair_step(R, G, x, ldx, wp, group_elems, p, 0, acc);
    }
    if (K & 1) pair_step(R, G, x, ldx, wp, group_elems, full, 1, acc);
    for (int j = 0; j < G; j++) {
        const int64_t n = n0 + 16 * j;
        if (n >= N) break;
        const __mmask16 mask = N - n >= 16 ? (__mmask16)0xFFFF
                                           : (__mmask16)((1u << (N - n)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(mask, bias + n)), 16));
        for (int r = 0; r < R; r++) {
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
            if (o->y) {
                _mm256_mask_storeu_epi16(o->y + r * o->ldy + n, mask, out);
                continue;
            }
            /* The value y would hold, widened back. */
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(out), 16));
            if (o->yf) {
                _mm512_mask_storeu_ps(o->yf + r * o->ldy + n, mask, v);
                continue;
            }
            /* Columns past N never win. */
            float *best = o->best + 16 * r;
            int32_t *at = o->best_at + 16 * r;
            const __m512 cur = _mm512_loadu_ps(best);
            const __mmask16 gt = _mm512_mask_cmp_ps_mask(mask, v, cur, _CMP_GT_OQ);
            _mm512_storeu_ps(best, _mm512_mask_blend_ps(gt, cur, v));
            const __m512i col = _mm512_add_epi32(_mm512_set1_epi32((int)n),
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
            _mm512_storeu_si512(at, _mm512_mask_blend_epi32(
                    gt, _mm512_loadu_si512(at), col));
        }
    }
}

/* Rows [0, R) of a row tile against G groups, R and G as literals (registers). */
static inline __attribute__((always_inline)) void tile_rows(
        const int R, int G, const bf16_t *x, int64_t ldx, const bf16_t *wp,
        int64_t group_elems, int64_t K, const bf16_t *bias, const out_t *o,
        int64_t n0, int64_t N, const char *pf, int64_t pf_lines) {
    switch (G) {
    case 1: tile(R, 1, x, ldx, wp, group_elems, K, bias, o, n0, N, pf, pf_lines); break;
    case 2: tile(R, 2, x, ldx, wp, group_elems, K, bias, o, n0, N, pf, pf_lines); break;
    /* Three groups only with at most 8 rows (column_groups): 24 accumulators at most. */
    case 3: if (R <= 8) tile(R <= 8 ? R : 8, 3, x, ldx, wp, group_elems, K, bias, o, n0, N,
                             pf, pf_lines); break;
    default: break;
    }
}

/* A column tile of G groups for rows [0, M) of a block, in `row_tiles` row tiles of as
 * even a size as they split into (the first M % row_tiles one row larger); each row tile
 * prefetches its slice of `next` (the next panel, next_bytes long; NULL: none). */
static void column_tile(int G, const bf16_t *x, int64_t ldx, const bf16_t *wp,
                        int64_t group_elems, int64_t K, const bf16_t *bias, out_t o,
                        int64_t n0, int64_t N, int64_t M, int64_t row_tiles,
                        const bf16_t *next, int64_t next_bytes) {
    const int64_t lines = next ? (next_bytes + 63) / 64 : 0;
    const int64_t per_tile = (lines + row_tiles - 1) / row_tiles;
    const int64_t base = M / row_tiles, larger = M % row_tiles;
    int64_t r0 = 0;
    for (int64_t i = 0; i < row_tiles; i++) {
        const int64_t rows = base + (i < larger);
        const bf16_t *xr = x + r0 * ldx;
        const out_t tile_out = at_row(o, r0);
        const int64_t first_line = i * per_tile;
        const int64_t pf_lines = first_line >= lines ? 0
            : (lines - first_line < per_tile ? lines - first_line : per_tile);
        const char *pf = (const char *)next + 64 * first_line;
#define ROWS(R) case R: tile_rows(R, G, xr, ldx, wp, group_elems, K, bias, &tile_out, n0, N, pf, pf_lines); break;
        switch ((int)rows) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10)
        ROWS(11) ROWS(12)
        default: break;
        }
#undef ROWS
        r0 += rows;
    }
}

int gemm_bf16_vnni_available(void) { return 1; }

/* 16-column groups per column tile for M rows (those of the first row block of MB, what
 * splits the columns between threads): 2 at 9-12 rows, where all of M is one 12 x 2 register
 * tile; otherwise 3, with row tiles of at most 8 rows split evenly (17 rows: 6 + 6 + 5, not
 * 8 + 8 + 1). With only 8 x 3 tiles, 9-12 rows ran as an 8-row tile and a 1-4-row one
 * that read the whole panel again (from L2) for few products per load: a step's linears
 * at 9 / 12 rows took 11.0 / 11.3 ms against 9.0 / 10.6 with the 12 x 2 tile (SmolLM2-135M's
 * layers, Zen 4, 2 threads), while at 13-32 rows 12 x 2 tiles were slower than 8 x 3. */
static int column_groups(int64_t M) {
    const int64_t m = M < MB ? M : MB;
    return m > 8 && m <= 12 ? 2 : 3;
}

/* Column tiles of ng groups of 16 output columns: the GEMM's units of work. */
static int64_t num_tiles(int64_t N, int ng) { return ((N + 15) / 16 + ng - 1) / ng; }

/* The GEMM's loops for this thread of the team: its share of column tiles, rows in blocks
 * of MB, each block's sums into `o` at that block's rows. */
static void thread_share(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                         out_t o, int64_t M, int64_t N, int64_t K) {
    const int64_t groups = (N + 15) / 16, group_elems = (K + 1) / 2 * 32;
    const int ng = column_groups(M);
    int64_t t0, t1;
    team_share(num_tiles(N, ng), &t0, &t1);
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = M - m0 < MB ? M - m0 : MB;
        const out_t block = at_row(o, m0);
        /* Two groups only where all of M is one tile; otherwise row tiles of at most 8
           rows (in a last, smaller block too). */
        const int64_t row_tiles = ng == 2 ? 1 : (mb + 7) / 8;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t g = t * ng;
            const int G = groups - g < ng ? (int)(groups - g) : ng;
            /* The next panel of this thread's share (none after its last, or at one row:
               see the top). */
            const int64_t next_groups = t + 1 < t1 && M > 1
                ? (groups - g - ng < ng ? groups - g - ng : ng) : 0;
            column_tile(G, x + m0 * ldx, ldx, wp + g * group_elems, group_elems, K, bias,
                        block, 16 * g, N, mb, row_tiles,
                        next_groups ? wp + (g + ng) * group_elems : NULL,
                        next_groups * group_elems * (int64_t)sizeof(bf16_t));
        }
    }
}

/* The whole GEMM into `o` (y or yf) on a team of threads. Returns 0. */
static int stored(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                  out_t o, int64_t M, int64_t N, int64_t K, int threads) {
    if (M <= 0 || N <= 0) return 0;
    threads = team_size(threads, num_tiles(N, column_groups(M)));
    #pragma omp parallel num_threads(threads) if(threads > 1)
    thread_share(x, ldx, wp, bias, o, M, N, K);
    return 0;
}

/* y[M, N] (rows ldy apart) = x[M, K] (rows ldx apart) . W^T + bias[N] (NULL: none), W
 * packed by gemm_bf16_vnni_pack. threads <= 0: OpenMP's default. Returns 0. */
int gemm_bf16_vnni(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                   bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return stored(x, ldx, wp, bias, (out_t){y, NULL, ldy, NULL, NULL}, M, N, K, threads);
}

/* gemm_bf16_vnni with each output rounded to bf16 as there and stored widened to float32
 * (y rows ldy floats apart): an LM head's logits for the sampler, without the bf16 copy
 * and the pass that widens it. Returns 0. */
int gemm_bf16_vnni_f32(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                       float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return stored(x, ldx, wp, bias, (out_t){NULL, y, ldy, NULL, NULL}, M, N, K, threads);
}

/* A greedy choice without the logits: per row of x, the first column of the largest value
 * gemm_bf16_vnni would write into y (its bf16 rounding, bias included; NaN never chosen),
 * into idx[M] (-1 where every value is NaN). Each thread keeps 16 lanes of running
 * maxima per row over its share of the columns, which grow within a share, and the lanes
 * and shares are merged at the end, ties to the lower column. Returns 0, or -2 when out of
 * memory. */
int gemm_bf16_vnni_argmax(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                          int64_t *idx, int64_t M, int64_t N, int64_t K, int threads) {
    if (M <= 0) return 0;
    if (N <= 0 || N > INT32_MAX) return -1;
    threads = team_size(threads, num_tiles(N, column_groups(M)));
    const int64_t lanes = 16 * M;
    float *best = malloc(sizeof(float) * lanes * threads);
    int32_t *best_at = malloc(sizeof(int32_t) * lanes * threads);
    if (!best || !best_at) { free(best); free(best_at); return -2; }
    for (int64_t i = 0; i < lanes * threads; i++) { best[i] = -INFINITY; best_at[i] = -1; }
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        const out_t o = {NULL, NULL, 0, best + lanes * t, best_at + lanes * t};
        thread_share(x, ldx, wp, bias, o, M, N, K);
    }
    for (int64_t r = 0; r < M; r++) {
        float top = -INFINITY;
        int64_t at = -1;
        for (int t = 0; t < threads; t++)
            for (int l = 0; l < 16; l++) {
                const int64_t i = lanes * t + 16 * r + l;
                if (best_at[i] < 0) continue;
                if (at < 0 || best[i] > top || (best[i] == top && best_at[i] < at)) {
                    top = best[i];
                    at = best_at[i];
                }
            }
        idx[r] = at;
    }
    free(best);
    free(best_at);
    return 0;
}

#else

int gemm_bf16_vnni_available(void) { return 0; }

int gemm_bf16_vnni_f32(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                       float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)ldy; (void)M; (void)N; (void)K;
    (void)threads;
    return -1;
}

int gemm_bf16_vnni_argmax(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                          int64_t *idx, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)wp; (void)bias; (void)idx; (void)M; (void)N; (void)K;
    (void)threads;
    return -1;
}

int gemm_bf16_vnni(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                   bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)ldy; (void)M; (void)N; (void)K;
    (void)threads;
    return -1;
}

#endif
