/* Quantized linear layer for decode rows on AVX-512 VNNI, on weights repacked at load so
 * that one vpdpbusd multiplies 4 weights of each of 16 output rows: y[M, N] = x[M, K] .
 * W[N, K]^T (+ bias), x quantized per 32-element chunk to int8 exactly as quant_dot.c
 * does it (quant_xq.h), so both paths compute the same integer sums.
 *
 * quant_dot.c keeps GGUF's row-major blocks: each (x row, weight row) pair accumulates
 * 16 lanes along K, scaled per chunk by a broadcast fp16 scale, and is reduced at the end;
 * at 1-4 rows that per-chunk, per-row scaling (scale loads and broadcasts, a multiply and
 * one or two FMAs for every 64 products) made it compute-bound at ~10 GB/s of blocks.
 * Here the lanes are the output rows instead. The r16 layout, per group of 16 weight rows
 * and per chunk c of 32 values (a group's chunks contiguous, groups one after another, N
 * padded to 16 rows of zeros):
 *   Q8_0  8 vectors of 64 bytes, vector j = the 4 values 4j .. 4j + 3 of each of the 16
 *         rows (flipped to unsigned, q + 128), then the 16 rows' fp16 scales: 544 bytes
 *   INT8  the same 8 vectors without scales (the row scales stay fp32 [N]): 512 bytes
 *   Q4_0  4 vectors of 64 bytes, vector j = bytes 4j .. 4j + 3 of each row's 16 packed
 *         bytes (low nibbles: values 4j .., high nibbles: 16 + 4j ..), then the fp16
 *         scales: 288 bytes
 *   Q4_1  as Q4_0, then the fp16 scales and the fp16 mins: 320 bytes
 *   Q4_K  a chunk is one 32-value sub-block: its nibbles as Q4_0's (values 4j .. 4j + 3
 *         in vector j's low nibbles, 16 + 4j .. in its high ones), then the 16 rows'
 *         6-bit scales and mins as bytes: 288 bytes; after a super-block's 8 chunks, the
 *         16 rows' fp16 d and fp16 dmin: 2,368 bytes per 256 values of 16 rows, 2.8% more
 *         than the GGUF blocks (whose 12 bytes pack the 16 six-bit numbers)
 * the same bytes per weight as the GGUF blocks but for Q4_K. Per chunk and x row: one
 * int32 start (the unsigned offset times the chunk's sum of qx), 8 vpdpbusd against the
 * chunk's 4-byte x groups broadcast, a convert, and one FMA by (the 16 scales x dx) (Q4_1: one more by the
 * 16 mins x dx * sum(qx)); weights are loaded and unpacked once per chunk for up to 8 x
 * rows; from 9 x rows on (Q8_0, INT8; the Q4 formats from 32, their nibbles unpacked
 * once per pair of groups), two groups (32 output rows) run at a time, 6 x rows a pass,
 * so that each x group broadcast feeds two vpdpbusd (r16_group2: Q8_0 1.1-1.35x at
 * 16-512 rows, the Q4 formats 1.01-1.10x at 32-64 and 1.09-1.21x at 512, measured on a
 * Xeon with AVX-512 VNNI; bit-identical per row). Q4_K runs as Q4_1 does, with d x the
 * sub-block's scale for the scale and dmin x its min for the min, subtracted
 * (w = d sc q - dmin mn), both made per chunk for the 16 rows.
 *
 * AVX2 without VNNI (R16_AVX2) runs the same layout as two 8-row halves per vector: one
 * 32-byte load is 4 values of each of 8 rows. pmaddubsw multiplies unsigned by signed
 * bytes into saturating int16 pairs, so Q4_0 / Q4_1 nibbles (0..15) times qx (-127..127)
 * are summed over a chunk's 8 groups in int16 (16 products of at most 1,905 each: no
 * saturation) and widened once by pmaddwd; Q8_0 and INT8 are flipped back to signed
 * bytes and multiplied as |w| times qx with w's sign (at most 2 x 128 x 127 per pair),
 * widened per group, with no unsigned offset to correct. The sums are the same integers
 * as the VNNI build's. Up to R16_AVX2_MT x rows per pass (their accumulators stay in the
 * 16 registers).
 *
 * OpenMP splits the 16-row groups statically; each thread streams its part in order.
 * Built where the level has AVX-512 VNNI or AVX2 without VNNI (AVX-VNNI builds keep
 * quant_dot.c's path, as measured before this existed); elsewhere the entry points
 * return -2 and the path rule (models/quant_weights.py) never picks this path.
 */

#include "quant_xq.h"

#define R16_MAX_MT 8   /* x rows per pass over the weights (AVX-512) */
#define R16_AVX2_MT 4  /* the same with AVX2: 2 x 4 accumulators */
#define R16_PAIR_MT 6  /* x rows per pass of two groups at once (AVX-512) */
#define R16_PAIR_MIN_ROWS 9  /* Q8_0 / INT8: from this many x rows on (at 8 or fewer: one
                                pass either way, and no gain measured) */
#define R16_PAIR_MIN_ROWS_Q4 32  /* the Q4 formats: their unpacking pays from here on
                                    (0.83-0.98x at 9-24 rows, 1.01-1.10x at 32) */

#if QK_AVX512 && QK_VNNI
#define R16_BUILT 1
#define R16_AVX2 0
#elif QK_AVX2 && !QK_VNNI
#define R16_BUILT 1
#define R16_AVX2 1
#else
#define R16_BUILT 0
#define R16_AVX2 0
#endif

#define Q4K_CHUNK 288                   /* one 32-value sub-block of a group, Q4_K */
#define Q4K_SUPER (8 * Q4K_CHUNK + 64)  /* 256 values: 8 chunks, then d and dmin */

static int r16_covered(int fmt) {
    return fmt == QF_Q8_0 || fmt == QF_INT8 || fmt == QF_Q4_0 || fmt == QF_Q4_1
        || fmt == QF_Q4_K;
}

/* Bytes of one group's chunk in the r16 layout (0: format not covered). */
static int64_t r16_chunk_bytes(int fmt) {
    switch (fmt) {
    case QF_Q8_0: return 544;
    case QF_INT8: return 512;
    case QF_Q4_0: return 288;
    case QF_Q4_1: return 320;
    case QF_Q4_K: return Q4K_CHUNK;
    default: return 0;
    }
}

static int64_t r16_nchunks(int fmt, int64_t K) {
    return fmt == QF_INT8 ? (K + 63) / 64 * 2 : K / 32;
}

/* Bytes of one group of 16 rows. */
static int64_t r16_group_bytes(int fmt, int64_t K) {
    return fmt == QF_Q4_K ? K / 256 * Q4K_SUPER : r16_nchunks(fmt, K) * r16_chunk_bytes(fmt);
}

/* Chunk c of a group's bytes gw. */
static inline const uint8_t *r16_chunk(int fmt, const uint8_t *gw, int64_t c) {
    return fmt == QF_Q4_K ? gw + (c >> 3) * Q4K_SUPER + (c & 7) * Q4K_CHUNK
                          : gw + c * r16_chunk_bytes(fmt);
}

/* Bytes the r16 layout of an N x K weight takes; -1 for a format or K it does not hold. */
int64_t quant_r16_bytes(int fmt, int64_t N, int64_t K) {
    if (!r16_covered(fmt) || K <= 0 || N <= 0 || (fmt != QF_INT8 && K % 32)
        || (fmt == QF_Q4_K && K % 256)) return -1;
    return (N + 15) / 16 * r16_group_bytes(fmt, K);
}

/* The inverse of qk_q4k_scale_min (quant_simd.h) into zeroed bytes s: sub-block j's
 * 6-bit scale and min into a block's 12 packed bytes. */
static void q4k_put(uint8_t *s, int j, uint8_t sc, uint8_t mn) {
    if (j < 4) {
        s[j] |= sc;
        s[j + 4] |= mn;
    } else {
        s[j + 4] |= (uint8_t)((sc & 15) | ((mn & 15) << 4));
        s[j - 4] |= (uint8_t)((sc >> 4) << 6);
        s[j] |= (uint8_t)((mn >> 4) << 6);
    }
}

/* One row r's Q4_K blocks into (pack) or out of (!pack, blocks zeroed) group bytes gw. */
static void q4k_r16_row(uint8_t *row, uint8_t *gw, int r, int64_t K, int pack) {
    for (int64_t s = 0; s < K / 256; s++) {
        uint8_t *blk = row + s * 144, *sup = gw + s * Q4K_SUPER;
        for (int j = 0; j < 8; j++) {
            uint8_t *ch = sup + j * Q4K_CHUNK;
            for (int e = 0; e < 32; e++) {  /* value e of sub-block j */
                uint8_t *q = blk + 16 + 32 * (j / 2) + e;
                const int qs = 4 * (j % 2);
                uint8_t *v = ch + ((e % 16) / 4) * 64 + r * 4 + e % 4;
                const int vs = 4 * (e / 16);
                if (pack) *v |= (uint8_t)(((*q >> qs) & 15) << vs);
                else *q |= (uint8_t)(((*v >> vs) & 15) << qs);
            }
            if (pack) {
                int sc, mn;
                qk_q4k_scale_min(blk + 4, j, &sc, &mn);
                ch[256 + r] = (uint8_t)sc;
                ch[272 + r] = (uint8_t)mn;
            } else {
                q4k_put(blk + 4, j, ch[256 + r], ch[272 + r]);
            }
        }
        uint8_t *d = sup + 8 * Q4K_CHUNK + r * 2;
        if (pack) {
            memcpy(d, blk, 2);
            memcpy(d + 32, blk + 2, 2);
        } else {
            memcpy(blk, d, 2);
            memcpy(blk + 2, d + 32, 2);
        }
    }
}

/* Repack w (N rows of row_bytes, GGUF blocks or INT8 rows) into out
 * (quant_r16_bytes(fmt, N, K) bytes). Returns 0, or -1 for a format, K or row size the
 * layout does not hold. Plain C: it runs once per weight at load. */
int quant_r16_pack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                   uint8_t *out) {
    if (quant_r16_bytes(fmt, N, K) < 0 || qk_check(fmt, K, row_bytes)) return -1;
    const int64_t nchunks = r16_nchunks(fmt, K), cb = r16_chunk_bytes(fmt);
    const int64_t ngroups = (N + 15) / 16, gstride = r16_group_bytes(fmt, K);
    memset(out, 0, (size_t)(ngroups * gstride));
    for (int64_t g = 0; g < ngroups; g++)
        for (int r = 0; r < 16 && g * 16 + r < N; r++) {
            const uint8_t *row = w + (g * 16 + r) * row_bytes;
            if (fmt == QF_Q4_K) {  /* read only: packing never writes the row */
                q4k_r16_row((uint8_t *)row, out + g * gstride, r, K, 1);
                continue;
            }
            for (int64_t c = 0; c < nchunks; c++) {
                uint8_t *dst = out + (g * nchunks + c) * cb;
                if (fmt == QF_Q8_0 || fmt == QF_INT8) {
                    const uint8_t *q = fmt == QF_Q8_0 ? row + c * 34 + 2 : row + c * 32;
                    for (int j = 0; j < 8; j++)
                        for (int e = 0; e < 4; e++)
                            dst[j * 64 + r * 4 + e] = (uint8_t)(q[4 * j + e] ^ 0x80);
                    if (fmt == QF_Q8_0) memcpy(dst + 512 + r * 2, row + c * 34, 2);
                } else {
                    const int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
                    const uint8_t *blk = row + c * bs;
                    for (int j = 0; j < 4; j++)
                        memcpy(dst + j * 64 + r * 4, blk + off + 4 * j, 4);
                    memcpy(dst + 256 + r * 2, blk, 2);                           /* d */
                    if (fmt == QF_Q4_1) memcpy(dst + 288 + r * 2, blk + 2, 2);  /* m */
                }
            }
        }
    return 0;
}

/* The inverse of quant_r16_pack: w (N rows of row_bytes) from `packed`, byte for byte the
 * blocks that were packed (INT8 rows padded to 64 as packed; bytes past them zero). Where
 * the r16 path runs at every row count the GGUF blocks are not kept beside the packed
 * copy (models/quant_weights.py), and the few readers of blocks (the weight cache,
 * dequantizing, fusing rows at load) get them from here. Returns 0, or -1 as pack does. */
int quant_r16_unpack(int fmt, const uint8_t *packed, int64_t row_bytes, int64_t N, int64_t K,
                     uint8_t *w) {
    if (quant_r16_bytes(fmt, N, K) < 0 || qk_check(fmt, K, row_bytes)) return -1;
    const int64_t nchunks = r16_nchunks(fmt, K), cb = r16_chunk_bytes(fmt);
    for (int64_t n = 0; n < N; n++) {
        const int64_t g = n / 16, r = n % 16;
        uint8_t *row = w + n * row_bytes;
        if (fmt == QF_INT8 || fmt == QF_Q4_K) memset(row, 0, (size_t)row_bytes);
        if (fmt == QF_Q4_K) {  /* unpacking never writes the packed bytes */
            q4k_r16_row(row, (uint8_t *)packed + g * r16_group_bytes(fmt, K), (int)r, K, 0);
            continue;
        }
        for (int64_t c = 0; c < nchunks; c++) {
            const uint8_t *src = packed + (g * nchunks + c) * cb;
            if (fmt == QF_Q8_0 || fmt == QF_INT8) {
                uint8_t *q = fmt == QF_Q8_0 ? row + c * 34 + 2 : row + c * 32;
                for (int j = 0; j < 8; j++)
                    for (int e = 0; e < 4; e++)
                        q[4 * j + e] = (uint8_t)(src[j * 64 + r * 4 + e] ^ 0x80);
                if (fmt == QF_Q8_0) memcpy(row + c * 34, src + 512 + r * 2, 2);
            } else {
                const int bs = fmt == QF_Q4_0 ? 18 : 20, off = fmt == QF_Q4_0 ? 2 : 4;
                uint8_t *blk = row + c * bs;
                for (int j = 0; j < 4; j++)
                    memcpy(blk + off + 4 * j, src + j * 64 + r * 4, 4);
                memcpy(blk, src + 256 + r * 2, 2);                           /* d */
                if (fmt == QF_Q4_1) memcpy(blk + 2, src + 288 + r * 2, 2);  /* m */
            }
        }
    }
    return 0;
}

#if QK_AVX512 && QK_VNNI
/* The 16 rows' scale (d) and min term (mn) of chunk ch (chunk c of group gw). */
static inline __attribute__((always_inline)) void r16_scales(
        const int FMT, const uint8_t *gw, const uint8_t *ch, int64_t c, __m512 *d, __m512 *mn) {
    if (FMT == QF_Q8_0)
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 512)));
    else if (FMT == QF_Q4_0 || FMT == QF_Q4_1)
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 256)));
    if (FMT == QF_Q4_1)
        *mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 288)));
    if (FMT == QF_Q4_K) {  /* d x scale and dmin x min of the 16 rows' sub-block */
        const uint8_t *sup = gw + (c >> 3) * Q4K_SUPER + 8 * Q4K_CHUNK;
        *d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup)),
                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                               _mm_loadu_si128((const __m128i *)(ch + 256)))));
        *mn = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + 32))),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                _mm_loadu_si128((const __m128i *)(ch + 272)))));
    }
}

/* x rows m0 .. m0 + MT against group g: out[mt][16] (fp32, before row scales and bias). */
static inline __attribute__((always_inline)) void r16_group(
        const int FMT, const int MT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq,
        const int32_t *ci, const float *cdx, const float *ct, int64_t m0, __m512 *out,
        const uint8_t *pf_end) {
    const int64_t cb = r16_chunk_bytes(FMT), kp = xq->kp;
    for (int i = 0; i < MT; i++) out[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t c = 0; c < nchunks; c++) {
        const uint8_t *ch = r16_chunk(FMT, gw, c);
        const char *pf = (const char *)ch + QK_PF_DIST;
        /* Q4_K: a super-block's last chunk also covers the d and dmin after it */
        const int64_t span = FMT == QF_Q4_K && (c & 7) == 7 ? cb + 64 : cb;
        if (pf_end)
            for (int64_t p = 0; p < span; p += 64)
                if (pf + p < (const char *)pf_end) _mm_prefetch(pf + p, _MM_HINT_T1);
        __m512i wv[8];
        __m512 d = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
        if (FMT == QF_Q8_0 || FMT == QF_INT8) {
            for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(ch + j * 64);
        } else {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(ch + j * 64);
                wv[j] = _mm512_and_si512(v, low4);
                wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        }
        r16_scales(FMT, gw, ch, c, &d, &mn);
        /* One accumulator per x row, the rows innermost: MT independent vpdpbusd chains
         * side by side (a row's 8 in a chain took 8 x its latency per chunk, which the
         * core had to overlap across rows on its own), each x group broadcast from memory
         * (a load, not a shuffle port). Integer sums: the same in any order. */
        __m512i acc[R16_MAX_MT];
        for (int i = 0; i < MT; i++) acc[i] = _mm512_set1_epi32(ci[(m0 + i) * nchunks + c]);
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < MT; i++) {
                int32_t xg;  /* qx values 4j .. 4j + 3 of row m0 + i's chunk */
                memcpy(&xg, xq->q + (m0 + i) * kp + c * 32 + 4 * j, sizeof xg);
                acc[i] = _mm512_dpbusd_epi32(acc[i], wv[j], _mm512_set1_epi32(xg));
            }
        for (int i = 0; i < MT; i++) {
            const int64_t at = (m0 + i) * nchunks + c;
            const __m512 f = _mm512_cvtepi32_ps(acc[i]), dx = _mm512_set1_ps(cdx[at]);
            if (FMT == QF_INT8) {
                out[i] = _mm512_fmadd_ps(f, dx, out[i]);
            } else {
                out[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dx), out[i]);
                if (FMT == QF_Q4_1)
                    out[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ct[at]), out[i]);
                if (FMT == QF_Q4_K)  /* w = d sc q - dmin mn: the min term subtracted */
                    out[i] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(ct[at]), out[i]);
            }
        }
    }
}

/* The groups gw and gw + gstride against x rows m0 .. m0 + MT at once: each x group
 * broadcast feeds two vpdpbusd (one per group), so a chunk takes half r16_group's
 * broadcast loads per product and keeps 2 x MT accumulator chains in flight. The weight
 * vectors are loaded one j at a time: Q8_0 / INT8 from the chunks, the Q4 formats from
 * wb, their nibbles unpacked once for every pass (r16_unpack_pair; unpacked per pass
 * they ran 0.7-0.8x, from the extra work and the registers it took). Per group the same
 * integer sums and the same float steps in the same order as r16_group: bit-identical
 * outputs. out[g * MT + i]. */
static inline __attribute__((always_inline)) void r16_group2(
        const int FMT, const int MT, const uint8_t *gw, int64_t gstride, int64_t nchunks,
        const uint8_t *wb, const qk_xq *xq, const int32_t *ci, const float *cdx,
        const float *ct, int64_t m0, __m512 *out, const uint8_t *pf_end) {
    const int64_t cb = r16_chunk_bytes(FMT), kp = xq->kp;
    const int q8 = FMT == QF_Q8_0 || FMT == QF_INT8;
    for (int i = 0; i < 2 * MT; i++) out[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nchunks; c++) {
        const uint8_t *ch[2] = {r16_chunk(FMT, gw, c), r16_chunk(FMT, gw + gstride, c)};
        const uint8_t *wsrc[2] = {q8 ? ch[0] : wb + c * 1024, q8 ? ch[1] : wb + c * 1024 + 512};
        if (pf_end)
            for (int g = 0; g < 2; g++) {
                const char *pf = (const char *)ch[g] + 2 * QK_PF_DIST;
                for (int64_t p = 0; p < cb; p += 64)
                    if (pf + p < (const char *)pf_end) _mm_prefetch(pf + p, _MM_HINT_T1);
            }
        __m512i acc[2 * R16_PAIR_MT];
        for (int i = 0; i < MT; i++)
            acc[i] = acc[MT + i] = _mm512_set1_epi32(ci[(m0 + i) * nchunks + c]);
        for (int j = 0; j < 8; j++) {
            const __m512i w0 = _mm512_loadu_si512(wsrc[0] + j * 64);
            const __m512i w1 = _mm512_loadu_si512(wsrc[1] + j * 64);
            for (int i = 0; i < MT; i++) {
                int32_t xg;
                memcpy(&xg, xq->q + (m0 + i) * kp + c * 32 + 4 * j, sizeof xg);
                const __m512i xb = _mm512_set1_epi32(xg);
                acc[i] = _mm512_dpbusd_epi32(acc[i], w0, xb);
                acc[MT + i] = _mm512_dpbusd_epi32(acc[MT + i], w1, xb);
            }
        }
        for (int g = 0; g < 2; g++) {
            __m512 d = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
            r16_scales(FMT, gw + g * gstride, ch[g], c, &d, &mn);
            for (int i = 0; i < MT; i++) {
                const int64_t at = (m0 + i) * nchunks + c;
                const __m512 f = _mm512_cvtepi32_ps(acc[g * MT + i]), dx = _mm512_set1_ps(cdx[at]);
                __m512 *o = &out[g * MT + i];
                if (FMT == QF_INT8) {
                    *o = _mm512_fmadd_ps(f, dx, *o);
                } else {
                    *o = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dx), *o);
                    if (FMT == QF_Q4_1)
                        *o = _mm512_fmadd_ps(mn, _mm512_set1_ps(ct[at]), *o);
                    if (FMT == QF_Q4_K)
                        *o = _mm512_fnmadd_ps(mn, _mm512_set1_ps(ct[at]), *o);
                }
            }
        }
    }
}

/* Q4 formats: the nibbles of the groups gw and gw + gstride as unsigned bytes in wb,
 * chunk c's 8 vectors of the first group at wb + 1024 c and of the second 512 bytes on,
 * in r16_group's order (vector j < 4: the low nibbles of packed vector j, values 4j ..;
 * j >= 4: the high nibbles of packed vector j - 4, values 16 + 4(j - 4) ..). */
static inline __attribute__((always_inline)) void r16_unpack_pair(
        const int FMT, const uint8_t *gw, int64_t gstride, int64_t nchunks, uint8_t *wb,
        const uint8_t *pf_end) {
    const __m512i low4 = _mm512_set1_epi8(15);
    const int64_t cb = r16_chunk_bytes(FMT);
    for (int64_t c = 0; c < nchunks; c++)
        for (int g = 0; g < 2; g++) {
            const uint8_t *ch = r16_chunk(FMT, gw + g * gstride, c);
            const char *pf = (const char *)ch + 2 * QK_PF_DIST;
            for (int64_t p = 0; p < cb; p += 64)
                if (pf + p < (const char *)pf_end) _mm_prefetch(pf + p, _MM_HINT_T1);
            uint8_t *dst = wb + c * 1024 + g * 512;
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(ch + j * 64);
                _mm512_storeu_si512(dst + j * 64, _mm512_and_si512(v, low4));
                _mm512_storeu_si512(dst + (4 + j) * 64,
                                    _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            }
        }
}

/* One group's rows m0 .. m0 + mt of out: INT8's row scales, the bias, stored to y. */
static inline __attribute__((always_inline)) void r16_store(
        const int FMT, const __m512 *out, int64_t mt, int64_t m0, int64_t n0, int64_t N,
        const float *scales, const float *bias, void *y, int64_t ldy, int y_bf16) {
    const int nvalid = N - n0 < 16 ? (int)(N - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    const __m512 sc = FMT == QF_INT8 ? _mm512_maskz_loadu_ps(mask, scales + n0) : _mm512_set1_ps(1.0f);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < mt; i++) {
        __m512 v = _mm512_add_ps(_mm512_mul_ps(out[i], sc), b);
        const int64_t m = m0 + i;
        if (y_bf16) {
            float tmp[16];
            _mm512_storeu_ps(tmp, v);
            qk_store_bf16((uint16_t *)y + m * ldy + n0, tmp, nvalid);
        } else {
            _mm512_mask_storeu_ps((float *)y + m * ldy + n0, mask, v);
        }
    }
}

/* The groups at gw (rows n0 ..) and after it against every x row; wb: a thread's buffer
 * of 1024 bytes per chunk for the Q4 formats' nibbles (unused for Q8_0 / INT8). */
static inline __attribute__((always_inline)) void r16_rows2(
        const int FMT, const uint8_t *gw, int64_t gstride, int64_t nchunks, uint8_t *wb,
        const qk_xq *xq, const int32_t *ci, const float *cdx, const float *ct, int64_t M,
        int64_t n0, int64_t N, const float *scales, const float *bias, void *y, int64_t ldy,
        int y_bf16, const uint8_t *pf_end) {
    const int q8 = FMT == QF_Q8_0 || FMT == QF_INT8;
    if (!q8) r16_unpack_pair(FMT, gw, gstride, nchunks, wb, pf_end);
    for (int64_t m0 = 0; m0 < M; m0 += R16_PAIR_MT) {
        const int64_t mt = M - m0 < R16_PAIR_MT ? M - m0 : R16_PAIR_MT;
        /* the next groups are prefetched on the first pass (Q4: while unpacking) */
        const uint8_t *pf = m0 == 0 && q8 ? pf_end : NULL;
        __m512 out[2 * R16_PAIR_MT];
#define PASS(MT) r16_group2(FMT, MT, gw, gstride, nchunks, wb, xq, ci, cdx, ct, m0, out, pf)
        switch (mt) {  /* out[g * mt + i]: the literal row count is the stride */
        case 1: PASS(1); break;
        case 2: PASS(2); break;
        case 3: PASS(3); break;
        case 4: PASS(4); break;
        case 5: PASS(5); break;
        default: PASS(6); break;
        }
#undef PASS
        r16_store(FMT, out, mt, m0, n0, N, scales, bias, y, ldy, y_bf16);
        r16_store(FMT, out + mt, mt, m0, n0 + 16, N, scales, bias, y, ldy, y_bf16);
    }
}

static inline __attribute__((always_inline)) void r16_rows(
        const int FMT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq, const int32_t *ci,
        const float *cdx, const float *ct, int64_t M, int64_t n0, int64_t N,
        const float *scales, const float *bias, void *y, int64_t ldy, int y_bf16,
        const uint8_t *pf_end) {
    for (int64_t m0 = 0; m0 < M; m0 += R16_MAX_MT) {
        const int64_t mt = M - m0 < R16_MAX_MT ? M - m0 : R16_MAX_MT;
        /* the next group is prefetched on the first pass; later passes find it cached */
        const uint8_t *pf = m0 == 0 ? pf_end : NULL;
        __m512 out[R16_MAX_MT];
        switch (mt) {  /* literal row counts, so that the accumulators stay in registers */
        case 1: r16_group(FMT, 1, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 2: r16_group(FMT, 2, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 3: r16_group(FMT, 3, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 4: r16_group(FMT, 4, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 5: r16_group(FMT, 5, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 6: r16_group(FMT, 6, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        case 7: r16_group(FMT, 7, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        default: r16_group(FMT, 8, gw, nchunks, xq, ci, cdx, ct, m0, out, pf); break;
        }
        r16_store(FMT, out, mt, m0, n0, N, scales, bias, y, ldy, y_bf16);
    }
}
#endif

#if R16_AVX2
/* x rows m0 .. m0 + MT against group g: out[2 * i + h] = the 8 sums of row i and half h
 * (fp32, before row scales and bias). */
static inline __attribute__((always_inline)) void r16_group_avx2(
        const int FMT, const int MT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq,
        const int32_t *ci, const float *cdx, const float *ct, int64_t m0, __m256 *out,
        const uint8_t *pf_end) {
    const int64_t cb = r16_chunk_bytes(FMT), kp = xq->kp;
    const int q8 = FMT == QF_Q8_0 || FMT == QF_INT8;
    for (int i = 0; i < 2 * MT; i++) out[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < nchunks; c++) {
        const uint8_t *ch = r16_chunk(FMT, gw, c);
        const char *pf = (const char *)ch + QK_PF_DIST;
        const int64_t span = FMT == QF_Q4_K && (c & 7) == 7 ? cb + 64 : cb;
        for (int64_t p = 0; p < span; p += 64)
            if (pf + p < (const char *)pf_end) _mm_prefetch(pf + p, _MM_HINT_T1);
        int32_t xg[R16_AVX2_MT][8];  /* each row's chunk of qx as 8 groups of 4 */
        for (int i = 0; i < MT; i++) memcpy(xg[i], xq->q + (m0 + i) * kp + c * 32, sizeof xg[i]);
        for (int h = 0; h < 2; h++) {  /* rows 8h .. 8h + 7 of the group */
            __m256i wv[8], aw[8];
            __m256 d = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
            if (q8) {
                for (int j = 0; j < 8; j++) {
                    wv[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(ch + j * 64 + h * 32)),
                                             flip);
                    aw[j] = _mm256_abs_epi8(wv[j]);
                }
            } else {
                for (int j = 0; j < 4; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(ch + j * 64 + h * 32));
                    wv[j] = _mm256_and_si256(v, low4);
                    wv[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
            }
            if (FMT == QF_Q8_0)
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ch + 512 + h * 16)));
            else if (FMT == QF_Q4_0 || FMT == QF_Q4_1)
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ch + 256 + h * 16)));
            if (FMT == QF_Q4_1)
                mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ch + 288 + h * 16)));
            if (FMT == QF_Q4_K) {  /* as the AVX-512 build, for rows 8h .. 8h + 7 */
                const uint8_t *sup = gw + (c >> 3) * Q4K_SUPER + 8 * Q4K_CHUNK + h * 16;
                d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sup)),
                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                      _mm_loadl_epi64((const __m128i *)(ch + 256 + h * 8)))));
                mn = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 32))),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                       _mm_loadl_epi64((const __m128i *)(ch + 272 + h * 8)))));
            }
            for (int i = 0; i < MT; i++) {
                const int64_t at = (m0 + i) * nchunks + c;
                __m256i acc;
                if (q8) {
                    acc = _mm256_setzero_si256();
                    for (int j = 0; j < 8; j++) {
                        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xg[i][j]), wv[j]);
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], xs),
                                                                      ones));
                    }
                } else {
                    __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(xg[i][0]));
                    for (int j = 1; j < 8; j++)
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[j],
                                                                         _mm256_set1_epi32(xg[i][j])));
                    acc = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(ci[at]));
                }
                const __m256 f = _mm256_cvtepi32_ps(acc), dx = _mm256_set1_ps(cdx[at]);
                __m256 *o = &out[2 * i + h];
                if (FMT == QF_INT8) {
                    *o = _mm256_fmadd_ps(f, dx, *o);
                } else {
                    *o = _mm256_fmadd_ps(f, _mm256_mul_ps(d, dx), *o);
                    if (FMT == QF_Q4_1)
                        *o = _mm256_fmadd_ps(mn, _mm256_set1_ps(ct[at]), *o);
                    if (FMT == QF_Q4_K)
                        *o = _mm256_fnmadd_ps(mn, _mm256_set1_ps(ct[at]), *o);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void r16_rows(
        const int FMT, const uint8_t *gw, int64_t nchunks, const qk_xq *xq, const int32_t *ci,
        const float *cdx, const float *ct, int64_t M, int64_t n0, int64_t N,
        const float *scales, const float *bias, void *y, int64_t ldy, int y_bf16,
        const uint8_t *pf_end) {
    const int nvalid = N - n0 < 16 ? (int)(N - n0) : 16;
    float sc[16], b[16];
    for (int r = 0; r < 16; r++) {
        sc[r] = FMT == QF_INT8 && r < nvalid ? scales[n0 + r] : 1.0f;
        b[r] = bias && r < nvalid ? bias[n0 + r] : 0.0f;
    }
    for (int64_t m0 = 0; m0 < M; m0 += R16_AVX2_MT) {
        const int64_t mt = M - m0 < R16_AVX2_MT ? M - m0 : R16_AVX2_MT;
        __m256 out[2 * R16_AVX2_MT];
        switch (mt) {  /* literal row counts, so that the accumulators stay in registers */
        case 1: r16_group_avx2(FMT, 1, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 2: r16_group_avx2(FMT, 2, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        case 3: r16_group_avx2(FMT, 3, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        default: r16_group_avx2(FMT, 4, gw, nchunks, xq, ci, cdx, ct, m0, out, pf_end); break;
        }
        for (int64_t i = 0; i < mt; i++) {
            float v[16];
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(v + 8 * h, _mm256_add_ps(
                    _mm256_mul_ps(out[2 * i + h], _mm256_loadu_ps(sc + 8 * h)),
                    _mm256_loadu_ps(b + 8 * h)));
            const int64_t m = m0 + i;
            if (y_bf16)
                qk_store_bf16((uint16_t *)y + m * ldy + n0, v, nvalid);
            else
                memcpy((float *)y + m * ldy + n0, v, sizeof(float) * (size_t)nvalid);
        }
    }
}
#endif

/* y[M, N] (rows ldy apart; bf16 or fp32) = x[M, K] (rows ldx apart; bf16 or fp32) .
 * W^T + bias (fp32 [N] or NULL), W in the r16 layout (quant_r16_pack); scales: INT8's
 * fp32 row scales. threads <= 0: OpenMP's default. Returns 0; -1 for a format or K the
 * layout does not hold; -2 where this build has neither AVX-512 VNNI nor plain AVX2
 * (R16_BUILT); -3 out of memory. */
int quant_gemv_r16(int fmt, const uint8_t *packed, const float *scales, const void *x,
                   int64_t ldx, int x_bf16, const float *bias, void *y, int64_t ldy,
                   int y_bf16, int64_t M, int64_t N, int64_t K, int threads) {
    if (quant_r16_bytes(fmt, N > 0 ? N : 1, K) < 0 || (fmt == QF_INT8 && !scales)) return -1;
#if R16_BUILT
    if (M <= 0 || N <= 0) return 0;
    qk_xq xq;
    if (alloc_xq(&xq, M, K)) return -3;
    const int64_t nchunks = r16_nchunks(fmt, K), ngroups = (N + 15) / 16;
    const int64_t gstride = r16_group_bytes(fmt, K);
    /* the unsigned weights' offset, subtracted through each chunk's start (the AVX2 path
     * multiplies Q8_0 / INT8 as signed bytes: none there) */
    const int offset = fmt == QF_Q4_0 ? 8 : fmt == QF_Q4_1 || fmt == QF_Q4_K ? 0
                     : R16_AVX2 ? 0 : 128;
    /* per x row and chunk: the int32 start, dx, and dx * sum(qx) (Q4_1's min term) */
    int32_t *ci = malloc(sizeof(int32_t) * (size_t)(M * nchunks));
    float *cdx = malloc(sizeof(float) * (size_t)(M * nchunks));
    float *ct = malloc(sizeof(float) * (size_t)(M * nchunks));
    if (!ci || !cdx || !ct) {
        free(ci); free(cdx); free(ct); free(xq.q);
        return -3;
    }
    threads = team_size(threads, ngroups);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row(x, ldx, x_bf16, m, K, &xq, offset);
            for (int64_t c = 0; c < nchunks; c++) {
                const int64_t l0 = m * (xq.kp / 4) + c * 8;
                int32_t start = 0;
                for (int l = 0; l < 8; l++) start += xq.init[l0 + l];
                ci[m * nchunks + c] = start;
                cdx[m * nchunks + c] = xq.de[l0];
                ct[m * nchunks + c] = xq.te[l0] * 8.0f;
            }
        }
        int64_t g0, g1;
        team_share(ngroups, &g0, &g1);
        const uint8_t *pf_end = packed + g1 * gstride;
#if !R16_AVX2
        /* the Q4 formats' pairs: this thread's unpacked nibbles (without it, one group at
           a time as below) */
        uint8_t *wb = NULL;
        const int q8 = fmt == QF_Q8_0 || fmt == QF_INT8;
        if (!q8 && M >= R16_PAIR_MIN_ROWS_Q4 && g1 - g0 >= 2)
            wb = aligned_alloc(64, (size_t)(nchunks * 1024));
#endif
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *gw = packed + g * gstride;
#if !R16_AVX2
            if (g + 1 < g1 && (q8 ? M >= R16_PAIR_MIN_ROWS : wb != NULL)) {
#define CALL2(F) r16_rows2(F, gw, gstride, nchunks, wb, &xq, ci, cdx, ct, M, g * 16, N, \
                           scales, bias, y, ldy, y_bf16, pf_end)
                QF_DISPATCH(fmt, CALL2);
#undef CALL2
                g++;
                continue;
            }
#endif
#define CALL(F) r16_rows(F, gw, nchunks, &xq, ci, cdx, ct, M, g * 16, N, scales, bias, y, \
                         ldy, y_bf16, pf_end)
            QF_DISPATCH(fmt, CALL);
#undef CALL
        }
#if !R16_AVX2
        free(wb);
#endif
    }
    free(ci); free(cdx); free(ct); free(xq.q);
    return 0;
#else
    (void)packed; (void)x; (void)ldx; (void)x_bf16; (void)bias; (void)y; (void)ldy;
    (void)y_bf16; (void)M; (void)threads;
    return -2;
#endif
}

/* Whether quant_gemv_r16 runs in this build (AVX-512 with VNNI, or AVX2 without VNNI). */
int quant_r16_available(void) {
#if R16_BUILT
    return 1;
#else
    return 0;
#endif
}
