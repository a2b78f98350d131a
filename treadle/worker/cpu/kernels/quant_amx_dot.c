/* Quantized linear layer on AMX-INT8: y[M, N] = x[M, K] . W[N, K]^T (+ bias) with x
 * quantized per 32-element chunk to int8 as in quant_dot.c, for any M, where the CPU has
 * AMX-INT8 and the OS grants the tile state (quant_amx_available()).
 *
 * Per chunk c, a 16 x 16 int32 tile of sum(qw * qx) over the chunk's 32 elements comes
 * from one tdpbssd (Q8_0, INT8: signed weights) or tdpbusd (4-bit: unsigned 0..15), A =
 * 16 weight rows x 32 bytes, B = the chunk of 16 x rows in the 4-byte interleaved layout
 * AMX wants. Q8_0 and INT8 weights are tile-loaded straight from their blocks (a row's 32
 * quants are contiguous; the tile stride is the row size); 4-bit blocks are unpacked to
 * bytes once per block of 16 rows. Each chunk's tile is then stored and scaled in
 * AVX-512: acc[n] (16 x rows) += s_n,c * dx_c * C[n] + b_n,c * T_c, with s, b the
 * chunk's weight scale and offset/min (quant_dot.c's algebra) gathered for the 16 rows
 * at once. The scaling per chunk is what bounds this path; two C tiles alternate so that
 * it overlaps the next chunk's product.
 *
 * OpenMP splits blocks of 16 weight rows statically; each thread loads its own tile
 * configuration and releases the tiles before returning.
 */

#include "quant_xq.h"

#if QK_AMX_INT8
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0, 1: C (16 x 16 int32); 4, 5: A (16 rows x 32 bytes); 6, 7: B (8 x 64 bytes). */
QK_AMX_INT8_TARGET static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = 16;
    cfg.colsb[0] = cfg.colsb[1] = 64;
    cfg.rows[4] = cfg.rows[5] = 16;
    cfg.colsb[4] = cfg.colsb[5] = 32;
    cfg.rows[6] = cfg.rows[7] = 8;
    cfg.colsb[6] = cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
}

/* The chunks' weight scales s[c][n] and offsets b[c][n] of 16 rows (row r of `rows`,
 * rows_stride apart), as in quant_dot.c: w = s * q + b. */
static void weight_params(int fmt, const uint8_t *rows, int64_t rows_stride, int64_t nchunks,
                          float *s, float *b) {
    if (fmt == QF_Q4_K) {
        for (int n = 0; n < 16; n++)
            for (int64_t sb = 0; sb < nchunks / 8; sb++) {
                float sc[8], mn[8];
                qk_q4k_params(rows + n * rows_stride + sb * 144, sc, mn);
                for (int j = 0; j < 8; j++) {
                    s[(sb * 8 + j) * 16 + n] = sc[j];
                    b[(sb * 8 + j) * 16 + n] = mn[j];
                }
            }
        return;
    }
    const int bs = qk_block_bytes[fmt];
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                             11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)rows_stride));
    for (int64_t c = 0; c < nchunks; c++) {
        /* dwords at each row's block start: fp16 d in the low half (m 2 bytes on) */
        const uint8_t *base = rows + c * bs;
        __m512i d = _mm512_i32gather_epi32(idx, (const void *)base, 1);
        __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
        _mm512_storeu_ps(s + c * 16, dv);
        if (fmt == QF_Q4_0) {
            _mm512_storeu_ps(b + c * 16, _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f)));
        } else if (fmt == QF_Q4_1) {
            __m512i m = _mm512_i32gather_epi32(idx, (const void *)(base + 2), 1);
            _mm512_storeu_ps(b + c * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m)));
        }
    }
}

/* 4-bit blocks of 16 rows as bytes 0..15 in element order: out[r][kp]. */
static void unpack_nibbles(int fmt, const uint8_t *rows, int64_t rows_stride, int64_t nchunks,
                           uint8_t *out, int64_t kp) {
    const __m128i m15 = _mm_set1_epi8(15);
    for (int n = 0; n < 16; n++) {
        const uint8_t *row = rows + n * rows_stride;
        uint8_t *o = out + n * kp;
        for (int64_t c = 0; c < nchunks; c++) {
            if (fmt == QF_Q4_K) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row + (c >> 3) * 144 + 16 + 32 * ((c & 7) >> 1)));
                v = (c & 1) ? _mm256_srli_epi16(v, 4) : v;
                _mm256_storeu_si256((__m256i *)(o + c * 32), _mm256_and_si256(v, _mm256_set1_epi8(15)));
            } else {
                int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
                __m128i v = _mm_loadu_si128((const __m128i *)(row + c * bs + off));
                _mm_storeu_si128((__m128i *)(o + c * 32), _mm_and_si128(v, m15));
                _mm_storeu_si128((__m128i *)(o + c * 32 + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m15));
            }
        }
    }
}

/* acc[n] += s[n] * dx * C[n] + b[n] * T for one chunk's stored tile. */
static inline __attribute__((always_inline)) void scale_chunk(
        const int FMT, __m512 *acc, const int32_t *tile, const float *s, const float *b,
        __m512 dx, __m512 t) {
    for (int n = 0; n < 16; n++) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(tile + n * 16));
        if (FMT == QF_INT8) {
            acc[n] = _mm512_fmadd_ps(v, dx, acc[n]);
        } else if (FMT == QF_Q8_0) {
            acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(v, dx), _mm512_set1_ps(s[n]), acc[n]);
        } else {
            acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(v, dx), _mm512_set1_ps(s[n]), acc[n]);
            acc[n] = _mm512_fmadd_ps(t, _mm512_set1_ps(b[n]), acc[n]);
        }
    }
}

#define ISSUE(c, CT, AT, BT) do {                                              \
        _tile_zero(CT);                                                          \
        _tile_loadd(AT, a_base + (c) * a_step, a_stride);                        \
        _tile_loadd(BT, xb + (g * nchunks + (c)) * 512, 64);                     \
        if (FMT == QF_Q8_0 || FMT == QF_INT8) _tile_dpbssd(CT, AT, BT);          \
        else _tile_dpbusd(CT, AT, BT);                                           \
    } while (0)
#define DRAIN(c, CT) do {                                                        \
        _tile_stored(CT, tile, 64);                                              \
        scale_chunk(FMT, acc, tile, s + (c) * 16, b + (c) * 16,                  \
                    _mm512_loadu_ps(xs + (g * nchunks + (c)) * 32),              \
                    _mm512_loadu_ps(xs + (g * nchunks + (c)) * 32 + 16));        \
    } while (0)

/* One block of 16 weight rows (A tiles at a_base + c * a_step, rows a_stride apart)
 * against every 16-row group of x; writes y rows' columns n0 .. n0 + nvalid. */
QK_AMX_INT8_TARGET static inline __attribute__((always_inline)) void block_groups(
        const int FMT, const uint8_t *a_base, int64_t a_step, int64_t a_stride,
        const int8_t *xb, const float *xs, int64_t nchunks, int64_t M, const float *s,
        const float *b, const float *scales, const float *bias, void *y, int64_t ldy,
        int y_bf16, int64_t n0, int64_t nvalid) {
    int32_t tile[256] __attribute__((aligned(64)));
    for (int64_t g = 0; g < (M + 15) / 16; g++) {
        __m512 acc[16];
        for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 1 < nchunks; c += 2) {
            ISSUE(c, 0, 4, 6);
            if (c > 0) DRAIN(c - 1, 1);
            ISSUE(c + 1, 1, 5, 7);
            DRAIN(c, 0);
        }
        if (c < nchunks) {
            ISSUE(c, 0, 4, 6);
            if (c > 0) DRAIN(c - 1, 1);
            DRAIN(c, 0);
        } else if (nchunks > 0) {
            DRAIN(nchunks - 1, 1);
        }
        float out[16][16];
        for (int n = 0; n < 16; n++) _mm512_storeu_ps(out[n], acc[n]);
        for (int64_t mm = 0; mm < 16 && g * 16 + mm < M; mm++) {
            float row[16];
            for (int64_t n = 0; n < nvalid; n++) {
                float v = out[n][mm];
                if (FMT == QF_INT8) v *= scales[n0 + n];
                if (bias) v += bias[n0 + n];
                row[n] = v;
            }
            int64_t m = g * 16 + mm;
            if (y_bf16) qk_store_bf16((uint16_t *)y + m * ldy + n0, row, (int)nvalid);
            else memcpy((float *)y + m * ldy + n0, row, (size_t)nvalid * 4);
        }
    }
}
#endif

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (bf16 or fp32, rows ldx apart) . W^T
 * + bias (fp32 [N] or NULL), x quantized per chunk to int8. Returns 0; -1 for a bad
 * format, K or row size; -2 where this build has no AMX-INT8; -3 when out of memory. */
#if QK_AMX_INT8
QK_AMX_INT8_TARGET
#endif
int quant_gemm_amx_dot(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                       const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                       int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int threads) {
#if QK_AMX_INT8
    if (qk_check(fmt, K, row_bytes) || (fmt == QF_INT8 && !scales)) return -1;
    if (M <= 0 || N <= 0) return 0;
    qk_xq xq;
    if (alloc_xq(&xq, M, K)) return -3;
    int64_t nchunks = fmt == QF_INT8 ? xq.kp / 32 : K / 32, ngroups = (M + 15) / 16;
    int64_t num_blocks = (N + 15) / 16;
    /* B tiles [g][c]: 8 rows (4-element groups) x 16 x rows x 4 bytes; xs [g][c]: dx and T
     * per x row of the group */
    int8_t *xb = aligned_alloc(64, (size_t)(ngroups * nchunks * 512));
    float *xs = aligned_alloc(64, (size_t)(ngroups * nchunks * 32 * 4));
    if (!xb || !xs) {
        free(xb); free(xs); free(xq.q);
        return -3;
    }
    int status = 0;
    threads = team_size(threads, num_blocks);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, ldx, x_bf16, m, K, &xq, 0);
        #pragma omp for schedule(static)
        for (int64_t gc = 0; gc < ngroups * nchunks; gc++) {
            int64_t g = gc / nchunks, c = gc % nchunks;
            uint32_t *dst = (uint32_t *)(xb + gc * 512);
            float *dx = xs + gc * 32;
            for (int r = 0; r < 16; r++) {
                int64_t m = g * 16 + r;
                for (int j = 0; j < 8; j++) {
                    uint32_t v = 0;
                    if (m < M) memcpy(&v, xq.q + m * xq.kp + c * 32 + 4 * j, 4);
                    dst[j * 16 + r] = v;
                }
                dx[r] = m < M ? xq.de[m * (xq.kp / 4) + c * 8] : 0.0f;
                dx[16 + r] = m < M ? xq.te[m * (xq.kp / 4) + c * 8] * 8.0f : 0.0f;
            }
        }
        int64_t b0, b1;
        team_share(num_blocks, &b0, &b1);
        const uint8_t *range_end = w + (b1 * 16 < N ? b1 * 16 : N) * row_bytes;
        int64_t kp = nchunks * 32;
        float *s = aligned_alloc(64, (size_t)(nchunks * 16 * 4 * 2));
        uint8_t *unpacked = aligned_alloc(64, (size_t)(16 * kp));
        uint8_t *tail = aligned_alloc(64, (size_t)((16 * row_bytes + 63) / 64 * 64));
        if (!s || !unpacked || !tail) {
            #pragma omp atomic write
            status = -3;
        } else if (b0 < b1) {
            float *b = s + nchunks * 16;
            memset(b, 0, (size_t)(nchunks * 16 * 4));
            configure_tiles();
            qk_pf_warm(w + b0 * 16 * row_bytes, range_end);
            for (int64_t blk = b0; blk < b1; blk++) {
                int64_t n0 = blk * 16, nvalid = N - n0 < 16 ? N - n0 : 16;
                const uint8_t *rows = w + n0 * row_bytes;
                if (nvalid < 16) {  /* the last rows, zero padded: tiles read 16 rows */
                    memset(tail, 0, (size_t)(16 * row_bytes));
                    memcpy(tail, rows, (size_t)(nvalid * row_bytes));
                    rows = tail;
                }
                qk_pf_range(w + n0 * row_bytes + QK_PF_DIST, 16 * row_bytes, range_end);
                if (fmt != QF_INT8) weight_params(fmt, rows, row_bytes, nchunks, s, b);
                if (fmt == QF_Q8_0)
                    block_groups(QF_Q8_0, rows + 2, 34, row_bytes, xb, xs, nchunks, M, s, b,
                                 scales, bias, y, ldy, y_bf16, n0, nvalid);
                else if (fmt == QF_INT8)
                    block_groups(QF_INT8, rows, 32, row_bytes, xb, xs, nchunks, M, s, b,
                                 scales, bias, y, ldy, y_bf16, n0, nvalid);
                else {
                    unpack_nibbles(fmt, rows, row_bytes, nchunks, unpacked, kp);
                    if (fmt == QF_Q4_0)
                        block_groups(QF_Q4_0, unpacked, 32, kp, xb, xs, nchunks, M, s, b,
                                     scales, bias, y, ldy, y_bf16, n0, nvalid);
                    else if (fmt == QF_Q4_1)
                        block_groups(QF_Q4_1, unpacked, 32, kp, xb, xs, nchunks, M, s, b,
                                     scales, bias, y, ldy, y_bf16, n0, nvalid);
                    else
                        block_groups(QF_Q4_K, unpacked, 32, kp, xb, xs, nchunks, M, s, b,
                                     scales, bias, y, ldy, y_bf16, n0, nvalid);
                }
            }
            _tile_release();
        }
        free(s); free(unpacked); free(tail);
    }
    free(xb); free(xs); free(xq.q);
    return status;
#else
    (void)fmt; (void)w; (void)row_bytes; (void)scales; (void)x; (void)ldx; (void)x_bf16;
    (void)bias; (void)y; (void)ldy; (void)y_bf16; (void)M; (void)N; (void)K; (void)threads;
    return -2;
#endif
}
