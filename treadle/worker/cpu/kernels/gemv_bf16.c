/* Small-batch bf16 linear layer: y[M, N] = x[M, K] . W[N, K]^T (+ bias), for the few rows
 * of a decode step, reading the weight in its original row-major [N, K] layout.
 *
 * At 1-16 rows a linear layer is bound by reading the weight once, so the kernel streams
 * W once and reuses each vector load of it for up to 4 rows of x, with fp32
 * accumulation. A tile is MT rows of x by NT rows of W with MT * NT = NACC accumulators
 * (one per lane of a vector), folded at the end into one vector of NACC sums in
 * row-major tile order, rounded to bf16 nearest-even like torch. Two tile bodies:
 *  - AVX-512 BF16: `_mm512_dpbf16_ps` on 32 bf16 pairs per load, 16 accumulators, a
 *    4-level shuffle tree (the accumulators enter it permuted so that the sums come out
 *    in tile order);
 *  - AVX-512F or AVX2 without it (simd.h, 16 or 8 lanes): the same loads of bf16 pairs,
 *    each split into its two fp32 halves by a shift and an and (bf16 -> fp32 is a 16-bit
 *    shift), two FMAs per pair where vdpbf16ps does one; NACC = 16 or 8 accumulators.
 * M is covered by chunks of 4, 2 and 1 rows; W is walked in blocks of BLOCK_N rows, small
 * enough that the later row chunks re-read the block from cache rather than memory, and
 * prefetched in order a few blocks ahead. OpenMP splits the blocks statically, so each
 * thread streams one contiguous part of W.
 *
 * K need not be a multiple of the load (the tail is a masked or copied, zero-filled load)
 * and N need not be a multiple of the tile (the last tile re-reads a valid row and stores
 * only the valid outputs). x rows may be strided (ldx); W and y rows are dense.
 *
 * Without AVX-512 or AVX2 (SIMD_WIDTH 0) gemv_bf16_available() returns 0 and callers use
 * torch.
 */

#include <stdint.h>
#include <string.h>

#include "omp_team.h"
#include "simd.h"

#if SIMD_WIDTH
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
#define GEMV_DPBF16 1
#else
#define GEMV_DPBF16 0
#endif

#ifndef BLOCK_N
#define BLOCK_N 16
#endif
/* Software prefetch of W, PF_BLOCKS blocks ahead, into L2. A block is BLOCK_N rows of
 * only K * 2 bytes each (1152 at K = 576): the tiles read NT short row streams at once,
 * too short for the hardware prefetchers to train on (measured: 35-60% of the machine's
 * single-core read bandwidth without, 90-100% with). */
#ifndef PF_BLOCKS
#define PF_BLOCKS 2
#endif

typedef uint16_t bf16_t;

#define NACC SIMD_WIDTH              /* accumulators per tile */
#define KSTEP (2 * SIMD_WIDTH)       /* bf16 of a W row per k step: one vector of pairs */
#define KSTEP_BYTES (4 * SIMD_WIDTH)

static inline float bf16_to_float(bf16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The tile's NACC sums, plus the bias, rounded to bf16 and stored row by row. */
static inline __attribute__((always_inline)) void store_tile(
        const int MT, const int NT, vf sums, const bf16_t *bias, bf16_t *y, int64_t ldy,
        int64_t n0, int nvalid) {
    if (bias) {
        float b[NACC];
        for (int e = 0; e < NACC; e++) {
            int n = e % NT;
            b[e] = bf16_to_float(bias[n0 + (n < nvalid ? n : nvalid - 1)]);
        }
        sums = vf_add(sums, vf_loadu(b));
    }
    bf16_t out[NACC];
#if GEMV_DPBF16
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(sums));
#else
    vf_bf16_store(out, sums);
#endif
    for (int m = 0; m < MT; m++) {
        if (nvalid == NT)
            memcpy(y + m * ldy + n0, out + m * NT, NT * sizeof(bf16_t));
        else
            memcpy(y + m * ldy + n0, out + m * NT, nvalid * sizeof(bf16_t));
    }
}

#if GEMV_DPBF16

/* One 64-byte load of 32 bf16, zero where `mask` is clear (the tail of K). */
static inline __m512bh load32(const bf16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* The 16 horizontal sums: out[e] = sum of the lanes of v[e]. */
static inline __m512 reduce16(const __m512 *v) {
    /* The tree puts the sum of its i-th input at lane 4*(i%4) + i/4; feeding it
     * v[4*(i%4) + i/4] as the i-th input (the permutation is its own inverse) puts
     * sum(v[e]) at e. */
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        int p = 2 * i, q = 2 * i + 1;
        __m512 x = v[4 * (p % 4) + p / 4], y = v[4 * (q % 4) + q / 4];
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* One MT x NT tile: rows x[0..MT) against W rows n0..n0+NT (only `nvalid` of them real). */
static inline __attribute__((always_inline)) void tile(
        const int MT, const int NT, const bf16_t *x, int64_t ldx, const bf16_t *w,
        int64_t K, const bf16_t *bias, bf16_t *y, int64_t ldy, int64_t n0, int nvalid,
        const char **pf) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const bf16_t *wr[16];
    for (int n = 0; n < NT; n++) wr[n] = w + (n0 + (n < nvalid ? n : nvalid - 1)) * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[16];
        if (*pf) {
            for (int n = 0; n < NT; n++) _mm_prefetch(*pf + n * 64, _MM_HINT_T1);
            *pf += NT * 64;
        }
        for (int n = 0; n < NT; n++) wv[n] = load32(wr[n] + k, (__mmask32)-1);
        for (int m = 0; m < MT; m++) {
            __m512bh xv = load32(x + m * ldx + k, (__mmask32)-1);
            for (int n = 0; n < NT; n++)
                acc[m * NT + n] = _mm512_dpbf16_ps(acc[m * NT + n], xv, wv[n]);
        }
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[16];
        for (int n = 0; n < NT; n++) wv[n] = load32(wr[n] + k, mask);
        for (int m = 0; m < MT; m++) {
            __m512bh xv = load32(x + m * ldx + k, mask);
            for (int n = 0; n < NT; n++)
                acc[m * NT + n] = _mm512_dpbf16_ps(acc[m * NT + n], xv, wv[n]);
        }
    }
    store_tile(MT, NT, reduce16(acc), bias, y, ldy, n0, nvalid);
}

#else /* widening: bf16 pairs split into fp32 halves, two FMAs per pair */

/* KSTEP bf16 at p as pairs (tail < 0), or the last `tail` of a row, zero-filled. */
static inline __attribute__((always_inline)) vi load_step(const bf16_t *p, int64_t tail) {
    return tail < 0 ? vi_loadu(p) : vi_load_bf16_n(p, tail);
}

/* One k step of W rows wr[0..NT) against x rows [0, MT), into the tile's accumulators. */
static inline __attribute__((always_inline)) void step(
        const int MT, const int NT, const bf16_t *x, int64_t ldx, const bf16_t *const *wr,
        int64_t k, int64_t tail, vf *acc) {
    if (MT >= NT) {  /* the W halves stay in registers while each x row streams by */
        vf wl[NACC], wh[NACC];
        for (int n = 0; n < NT; n++) {
            const vi wv = load_step(wr[n] + k, tail);
            wl[n] = vf_pair_lo(wv);
            wh[n] = vf_pair_hi(wv);
        }
        for (int m = 0; m < MT; m++) {
            const vi xv = load_step(x + m * ldx + k, tail);
            const vf xl = vf_pair_lo(xv), xh = vf_pair_hi(xv);
            for (int n = 0; n < NT; n++) {
                acc[m * NT + n] = vf_fmadd(xl, wl[n], acc[m * NT + n]);
                acc[m * NT + n] = vf_fmadd(xh, wh[n], acc[m * NT + n]);
            }
        }
    } else {  /* the x halves stay while each W row streams by */
        vf xl[4], xh[4];
        for (int m = 0; m < MT; m++) {
            const vi xv = load_step(x + m * ldx + k, tail);
            xl[m] = vf_pair_lo(xv);
            xh[m] = vf_pair_hi(xv);
        }
        for (int n = 0; n < NT; n++) {
            const vi wv = load_step(wr[n] + k, tail);
            const vf wl = vf_pair_lo(wv), wh = vf_pair_hi(wv);
            for (int m = 0; m < MT; m++) {
                acc[m * NT + n] = vf_fmadd(xl[m], wl, acc[m * NT + n]);
                acc[m * NT + n] = vf_fmadd(xh[m], wh, acc[m * NT + n]);
            }
        }
    }
}

/* One MT x NT tile: rows x[0..MT) against W rows n0..n0+NT (only `nvalid` of them real). */
static inline __attribute__((always_inline)) void tile(
        const int MT, const int NT, const bf16_t *x, int64_t ldx, const bf16_t *w,
        int64_t K, const bf16_t *bias, bf16_t *y, int64_t ldy, int64_t n0, int nvalid,
        const char **pf) {
    vf acc[NACC];
    for (int i = 0; i < NACC; i++) acc[i] = vf_zero();
    const bf16_t *wr[NACC];
    for (int n = 0; n < NT; n++) wr[n] = w + (n0 + (n < nvalid ? n : nvalid - 1)) * K;
    int64_t k = 0;
    for (; k + KSTEP <= K; k += KSTEP) {
        if (*pf) {  /* NT steps' worth of the block ahead, as the dpbf16 tile does */
            for (int i = 0; i < NT * KSTEP_BYTES; i += 64) _mm_prefetch(*pf + i, _MM_HINT_T1);
            *pf += NT * KSTEP_BYTES;
        }
        step(MT, NT, x, ldx, wr, k, -1, acc);
    }
    if (k < K) step(MT, NT, x, ldx, wr, k, K - k, acc);
    store_tile(MT, NT, vf_transpose_reduce(acc), bias, y, ldy, n0, nvalid);
}

#endif /* GEMV_DPBF16 */

/* Rows [0, mt) of x (mt in {1, 2, 4}) against W rows [nb, ne). */
static void row_chunk(int mt, const bf16_t *x, int64_t ldx, const bf16_t *w, int64_t K,
                      const bf16_t *bias, bf16_t *y, int64_t ldy, int64_t nb, int64_t ne,
                      const char *pf) {
    enum { N4 = NACC / 4, N2 = NACC / 2, N1 = NACC };
    switch (mt) {
    case 4:
        for (int64_t n = nb; n < ne; n += N4)
            tile(4, N4, x, ldx, w, K, bias, y, ldy, n, ne - n < N4 ? (int)(ne - n) : N4,
                 &pf);
        break;
    case 2:
        for (int64_t n = nb; n < ne; n += N2)
            tile(2, N2, x, ldx, w, K, bias, y, ldy, n, ne - n < N2 ? (int)(ne - n) : N2,
                 &pf);
        break;
    default:
        for (int64_t n = nb; n < ne; n += N1)
            tile(1, N1, x, ldx, w, K, bias, y, ldy, n, ne - n < N1 ? (int)(ne - n) : N1,
                 &pf);
        break;
    }
}

int gemv_bf16_available(void) { return 1; }

/* y[M, N] (dense rows of ldy) = x[M, K] (rows ldx apart) . w[N, K]^T + bias[N] (NULL: none).
 * threads <= 0: OpenMP's default. Returns 0. */
int gemv_bf16(const bf16_t *x, int64_t ldx, const bf16_t *w, const bf16_t *bias, bf16_t *y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (M <= 0 || N <= 0) return 0;
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        /* The first blocks of this thread's part, which no earlier block prefetches. */
        int64_t warm_end = (b0 + PF_BLOCKS < b1 ? b0 + PF_BLOCKS : b1) * BLOCK_N;
        const char *p = (const char *)(w + b0 * BLOCK_N * K);
        const char *end = (const char *)(w + (warm_end < N ? warm_end : N) * K);
        for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
        for (int64_t blk = b0; blk < b1; blk++) {
            int64_t nb = blk * BLOCK_N, ne = nb + BLOCK_N < N ? nb + BLOCK_N : N;
            int64_t m = 0;
            /* The first row chunk (the one that reads the block from memory) prefetches,
             * NT lines per k step, which sweeps one block's rows in order per block. */
            const char *pf = (const char *)(w + (nb + PF_BLOCKS * BLOCK_N) * K);
            if (nb + PF_BLOCKS * BLOCK_N >= N || PF_BLOCKS == 0) pf = 0;
            for (; m + 4 <= M; m += 4)
                row_chunk(4, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, nb, ne,
                          m == 0 ? pf : 0);
            if (m + 2 <= M) {
                row_chunk(2, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, nb, ne,
                          m == 0 ? pf : 0);
                m += 2;
            }
            if (m < M)
                row_chunk(1, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, nb, ne,
                          m == 0 ? pf : 0);
        }
    }
    return 0;
}

#else

int gemv_bf16_available(void) { return 0; }

int gemv_bf16(const void *x, int64_t ldx, const void *w, const void *bias, void *y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)M; (void)N; (void)K;
    (void)threads;
    return -1;
}

#endif
