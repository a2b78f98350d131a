/* Paged attention for decode tokens (one query token per request), on CPU.
 *
 * For each (request, KV head) pair, in parallel: walk the request's blocks once,
 * score the GQA group's query heads against each block's keys, and fold the block
 * into an online softmax (running max, running sum, running weighted values).
 * Every K/V byte is read exactly once, with no gathered copy and no padding.
 *
 * Sliding window (the `_window` entry points; window 0: none): a row with context length
 * ctx attends to positions [max(0, ctx - window), ctx) only (transformers' convention:
 * the window counts the query itself, at ctx - 1). Its walk starts at the block holding
 * the window's first position, and in that block at that position: the table's entries
 * for blocks wholly before the window are never read (a sliding KV group frees those
 * blocks and leaves stale ids there: core/kv/sliding.py), nor are that block's rows
 * before the window. On the fast path the chunks of the first block then start mid-block
 * (nothing in the fold assumes aligned chunks: loads are unaligned, and the block's last
 * chunk is short and zero-padded like a context's tail). The context ranges below count
 * only the window's blocks, from its first one.
 *
 * Layouts (contiguous):
 *   q, out        [num_reqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim]
 *   block_table   [num_reqs, max_blocks] (int64), ctx_lens [num_reqs] (int64)
 * Built at run time by treadle/worker/native.py; T is float or bfloat16 (uint16_t).
 *
 * Two implementations:
 *  - fast path (the vectors of simd.h: 16 lanes with AVX-512, 8 with AVX2; compiled when
 *    the ISA level has one of them): head_dim 64 or 128 with 1..8 query heads per KV head,
 *    and head_dim 256 (Gemma 3) with 1..4, specialised at compile time (constant trip
 *    counts, accumulators in registers where they fit). Each (head_dim, group, query
 *    dtype, cache kind) is an instantiation; 256 stops at 4 heads (Gemma 3: 4 at 270M and
 *    1B, 2 at 4B-27B) to bound the compile: its 16 instantiations took gcc's CPU time
 *    for this file from ~27 to ~37 s (avx512bf16), ~30 to ~39 s (avx512) and ~42 to ~54 s
 *    (avx2), half of it the int8 caches'. Keys are walked in chunks of one vector's width of tokens (any
 *    block_size): the scores of a chunk come from vector dot products (bf16 pairs with
 *    vdpbf16ps on AVX-512 BF16, exact products, fp32 sums; elsewhere each key vector is
 *    widened to fp32 once and scored against every query head of the group) folded by one
 *    transpose-reduce, one online-softmax update per chunk
 *    with a vectorised exp2, values accumulated in fp32 (with vdpbf16ps on two tokens'
 *    bf16 values at once, the probabilities rounded to bf16, on AVX-512 BF16: see
 *    fold_values_dpbf16; elsewhere FMAs on widened values); the next block is prefetched when
 *    it does not follow the current one in memory. Work is split over (request, KV head) and, when there are too few of those to
 *    keep every thread busy (small batches, long contexts), over context ranges too, whose
 *    partial softmaxes are merged at the end (flash-decoding). The `_fixed` and `_window`
 *    entry points take the ranges' length instead (split_tokens, rounded up to whole
 *    blocks; 0: none): every context (window) longer than that is cut at the same
 *    positions whatever else the call holds, and its parts merged in order, so a row's
 *    result depends on its context (and window) alone, not on the batch (batch-invariant
 *    engines: docs/batch_invariance.md).
 *  - generic path (any shape, any CPU): the plain loops below, auto-vectorised by gcc.
 *
 * int8 caches (paged_decode_q8_*; worker/kv_quant.py): each cached row is head_dim int8
 * values and a float16 scale (row stride head_dim + 2 bytes). Dequantized in registers,
 * with the scales folded out of the inner loops: a token's score is scale_k * (q . k_int)
 * and its value weight p * scale_v, so the int8 values are only widened to fp32 (no
 * multiply per element) and no dequantized copy of any block is made.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define MAX_GROUP_DIM 4096   /* query heads per KV head x head_dim */
#define MAX_GROUP_TOKENS 8192 /* query heads per KV head x block_size */
#define MAX_GROUP 64          /* query heads per KV head */

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float f) { return f; }

/* The first position a row with ctx positions attends to under a window of `window`
   positions (the query, at ctx - 1, included); window <= 0: no window. */
static inline int64_t window_first(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Generic path                                                                          */
/* ------------------------------------------------------------------------------------ */

#define DEFINE_GENERIC_DECODE(NAME, T, LOAD, STORE)                                          \
static int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_table,      \
         const int64_t *ctx_lens, T *out, int64_t num_reqs, int64_t num_heads,             \
         int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,   \
         int64_t max_blocks, float scale, int64_t window) {                                \
    const int64_t group = num_heads / num_kv_heads;                                        \
    /* Small batches run on one thread: a parallel region's barrier costs more than the  \
       work, and on an oversubscribed machine it can wait out a whole time slice. */      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) if(num_reqs * num_kv_heads > 8)") \
    for (int64_t r = 0; r < num_reqs; r++) {                                               \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                       \
            float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM], kf[MAX_GROUP_DIM];                 \
            float scores[MAX_GROUP_TOKENS], run_max[MAX_GROUP], run_sum[MAX_GROUP];                      \
            const int64_t ctx = ctx_lens[r];                                               \
            const T *qr = q + (r * num_heads + h * group) * head_dim;                      \
            for (int64_t i = 0; i < group * head_dim; i++) qf[i] = LOAD(qr[i]) * scale;    \
            memset(acc, 0, sizeof(float) * group * head_dim);                              \
            for (int64_t g = 0; g < group; g++) { run_max[g] = -INFINITY; run_sum[g] = 0; } \
            const int64_t first = window_first(ctx, window);                               \
            for (int64_t start = first - first % block_size; start < ctx; start += block_size) { \
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;     \
                const int64_t t0 = first > start ? first - start : 0; /* window's start */  \
                const int64_t block = block_table[r * max_blocks + start / block_size];    \
                const int64_t base = ((h * num_blocks + block) * block_size) * head_dim;   \
                const T *kb = k_cache + base, *vb = v_cache + base;                        \
                for (int64_t t = t0; t < n; t++) {                                         \
                    float *kt = kf;                                                        \
                    for (int64_t d = 0; d < head_dim; d++) kt[d] = LOAD(kb[t * head_dim + d]); \
                    for (int64_t g = 0; g < group; g++) {                                  \
                        const float *qg = qf + g * head_dim;                               \
                        float s = 0.f;                                                     \
                        for (int64_t d = 0; d < head_dim; d++) s += qg[d] * kt[d];         \
                        scores[g * block_size + t] = s;                                    \
                    }                                                                      \
                }                                                                          \
                for (int64_t g = 0; g < group; g++) {                                      \
                    float *sg = scores + g * block_size;                                   \
                    float block_max = sg[t0];                                              \
                    for (int64_t t = t0 + 1; t < n; t++) block_max = sg[t] > block_max ? sg[t] : block_max; \
                    const float new_max = block_max > run_max[g] ? block_max : run_max[g]; \
                    const float correction = expf(run_max[g] - new_max);                   \
                    float block_sum = 0.f;                                                 \
                    for (int64_t t = t0; t < n; t++) {                                     \
                        sg[t] = expf(sg[t] - new_max);                                     \
                        block_sum += sg[t];                                                \
                    }                                                                      \
                    run_sum[g] = run_sum[g] * correction + block_sum;                      \
                    run_max[g] = new_max;                                                  \
                    float *ag = acc + g * head_dim;                                        \
                    for (int64_t d = 0; d < head_dim; d++) ag[d] *= correction;            \
                }                                                                          \
                for (int64_t t = t0; t < n; t++) {                                         \
                    float *vt = kf;                                                        \
                    for (int64_t d = 0; d < head_dim; d++) vt[d] = LOAD(vb[t * head_dim + d]); \
                    for (int64_t g = 0; g < group; g++) {                                  \
                        const float p = scores[g * block_size + t];                        \
                        float *ag = acc + g * head_dim;                                    \
                        for (int64_t d = 0; d < head_dim; d++) ag[d] += p * vt[d];         \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
            T *o = out + (r * num_heads + h * group) * head_dim;                           \
            for (int64_t g = 0; g < group; g++) {                                          \
                const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;               \
                for (int64_t d = 0; d < head_dim; d++)                                     \
                    o[g * head_dim + d] = STORE(acc[g * head_dim + d] * inv);              \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    return 0;                                                                              \
}


DEFINE_GENERIC_DECODE(generic_decode_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_GENERIC_DECODE(generic_decode_f32, float, f32_load, f32_store)

static inline float row_scale(const int8_t *row, int64_t head_dim) {
    _Float16 s;
    memcpy(&s, row + head_dim, sizeof(s));
    return (float)s;
}

/* The generic loops over an int8 cache: rows of head_dim values + a float16 scale. */
#define DEFINE_GENERIC_DECODE_Q8(NAME, T, LOAD, STORE)                                       \
static int NAME(const T *q, const int8_t *k_cache, const int8_t *v_cache,                    \
         const int64_t *block_table, const int64_t *ctx_lens, T *out, int64_t num_reqs,      \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,      \
         int64_t block_size, int64_t max_blocks, float scale, int64_t window) {              \
    const int64_t group = num_heads / num_kv_heads, row = head_dim + 2;                      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) if(num_reqs * num_kv_heads > 8)") \
    for (int64_t r = 0; r < num_reqs; r++) {                                                 \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                         \
            float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM];                                     \
            const int64_t ctx = ctx_lens[r];                                                 \
            const T *qr = q + (r * num_heads + h * group) * head_dim;                        \
            for (int64_t i = 0; i < group * head_dim; i++) qf[i] = LOAD(qr[i]) * scale;      \
            memset(acc, 0, sizeof(float) * group * head_dim);                                \
            float run_max[MAX_GROUP], run_sum[MAX_GROUP];                                    \
            for (int64_t g = 0; g < group; g++) { run_max[g] = -1e30f; run_sum[g] = 0; }      \
            for (int64_t pos = window_first(ctx, window); pos < ctx; pos++) {                \
                const int64_t block = block_table[r * max_blocks + pos / block_size];        \
                const int64_t at = ((h * num_blocks + block) * block_size + pos % block_size) * row; \
                const int8_t *kt = k_cache + at, *vt = v_cache + at;                         \
                const float ks = row_scale(kt, head_dim), vs = row_scale(vt, head_dim);      \
                for (int64_t g = 0; g < group; g++) {                                        \
                    const float *qg = qf + g * head_dim;                                     \
                    float dot = 0.f;                                                         \
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * (float)kt[d];      \
                    const float s = dot * ks;                                                \
                    const float new_max = s > run_max[g] ? s : run_max[g];                   \
                    const float correction = expf(run_max[g] - new_max);                     \
                    const float p = expf(s - new_max);                                       \
                    run_sum[g] = run_sum[g] * correction + p;                                \
                    run_max[g] = new_max;                                                    \
                    float *ag = acc + g * head_dim;                                          \
                    const float pv = p * vs;                                                 \
                    for (int64_t d = 0; d < head_dim; d++)                                   \
                        ag[d] = ag[d] * correction + pv * (float)vt[d];                      \
                }                                                                            \
            }                                                                                \
            T *o = out + (r * num_heads + h * group) * head_dim;                             \
            for (int64_t g = 0; g < group; g++) {                                            \
                const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;                 \
                for (int64_t d = 0; d < head_dim; d++)                                       \
                    o[g * head_dim + d] = STORE(acc[g * head_dim + d] * inv);                \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    return 0;                                                                                \
}

DEFINE_GENERIC_DECODE_Q8(generic_decode_q8_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_GENERIC_DECODE_Q8(generic_decode_q8_f32, float, f32_load, f32_store)

/* ------------------------------------------------------------------------------------ */
/* Fast path (AVX-512 or AVX2)                                                           */
/* ------------------------------------------------------------------------------------ */

#if SIMD_WIDTH

#define FAST_GROUP_MAX 8         /* query heads per KV head, head_dim 64 and 128 */
#define FAST_GROUP_MAX_256 4     /* the same at head_dim 256 (compile time: see the top) */
#define CHUNK SIMD_WIDTH         /* tokens scored together: one vector of scores */
#define VW SIMD_WIDTH            /* floats per vector */
#define MAX_HD 256               /* head_dim, at most */
#define MAX_HDV (MAX_HD / VW)    /* vectors per head, at most */
#define MAX_GROUP_HD 1024        /* query heads per KV head x head_dim, at most (8 x 128, 4 x 256) */
#define NEG_BIG (-1e30f)         /* "minus infinity" without inf (compiled with fast-math) */
/* Below this many K/V bytes in a call, one thread does it all: a parallel region's
   barrier costs more than the work, and on an oversubscribed machine it can wait out a
   whole time slice. */
#define PARALLEL_MIN_BYTES (256 * 1024)
/* Fewer (request, KV head) pairs than this many per thread: split the contexts too. */
#define UNITS_PER_THREAD 8
#define MIN_SPLIT_TOKENS 128     /* no context range shorter than this */
/* Tokens per iteration of the value loop: unrolling all of a chunk compiles twice as slowly
   (every shape is instantiated) for no measurable gain. */
#define V_UNROLL 4

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define PRAGMA(x) _Pragma(#x)
#define UNROLL(n) PRAGMA(GCC unroll n)

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_table, *ctx_lens;
    void *out;
    int64_t num_heads, num_kv_heads, num_blocks, block_size, max_blocks;
    float c;                     /* scale * log2(e): scores are kept in the exp2 domain */
    int64_t window;              /* positions a row attends to, its own included (0: all) */
} decode_args;

/* One piece of work: request r, KV head h, blocks [b0, b1) (in the first block of a
   window, only its positions from the window's first on); writes the normalised result
   to out (part < 0) or its partial softmax to partials slot part. */
typedef struct { int64_t r, b0, b1, part; } work_item;

/* VW consecutive elements as fp32 (bf16 widened). */
ALWAYS_INLINE vf load_vec(const void *base, int64_t i, const int bf16) {
    return bf16 ? vf_bf16_load((const uint16_t *)base + i) : vf_loadu((const float *)base + i);
}

ALWAYS_INLINE void store_vec(void *base, int64_t i, vf x, const int bf16) {
    if (bf16) vf_bf16_store((uint16_t *)base + i, x);
    else vf_storeu((float *)base + i, x);
}

#define CACHE_F32 0
#define CACHE_BF16 1
#define CACHE_I8 2  /* int8 rows of HD values and a float16 scale (row stride HD + 2) */

/* Bytes of one cached K or V row (one token, one KV head) of this kind. */
ALWAYS_INLINE int64_t cache_row_bytes(const int HD, const int kind) {
    return kind == CACHE_I8 ? HD + 2 : (int64_t)HD * (kind == CACHE_BF16 ? 2 : 4);
}

/* VW consecutive elements from element i of a cached K or V row of this kind, as fp32. */
ALWAYS_INLINE vf load_cached(const void *row, int64_t i, const int kind) {
    if (kind == CACHE_I8) {
        const int8_t *p = (const int8_t *)row + i;
#if SIMD_WIDTH == 16
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
    }
    return load_vec(row, i, kind == CACHE_BF16);
}

/* Raw scores (q . k, unscaled) of the CHUNK tokens at k for each of the G query heads of
   a group: scores[g] has token t in lane t. qf: the group's query heads widened to fp32.
   Each key vector is widened once and used by every head (scoring head by head widened
   the same keys G times: on CPUs without bf16 dot products the widening, not the memory,
   bounded the kernel). */
ALWAYS_INLINE void chunk_scores(const float *qf, const void *k, vf *scores, const int HD,
                                const int G, const int kind) {
    const int64_t row = cache_row_bytes(HD, kind);
    vf a[FAST_GROUP_MAX * CHUNK];
    #pragma GCC unroll 64
    for (int t = 0; t < CHUNK; t++) {
        const char *kt = (const char *)k + t * row;
        vf kv[MAX_HDV];  /* a fixed size: a variable-length array stays in memory */
        if (kind == CACHE_BF16) {  /* bf16 pairs: even elements by a shift, odd by an and */
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j += 2) {
                const vi w = vi_loadu((const uint16_t *)kt + VW * j);
                kv[j] = vf_pair_lo(w);
                kv[j + 1] = vf_pair_hi(w);
            }
        } else {
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j++) kv[j] = load_cached(kt, VW * j, kind);
        }
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            vf s = vf_mul(kv[0], vf_load(qf + g * HD));
            #pragma GCC unroll 64
            for (int j = 1; j < HD / VW; j++) s = vf_fmadd(kv[j], vf_load(qf + g * HD + VW * j), s);
            a[g * CHUNK + t] = s;
        }
    }
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++) scores[g] = vf_transpose_reduce(a + g * CHUNK);
}

#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
/* chunk_scores for one bf16 query head qg with bf16 pairs: exact products, fp32 sums. */
ALWAYS_INLINE vf chunk_scores_dpbf16(const uint16_t *qg, const uint16_t *k, const int HD) {
    vf a[CHUNK];
    __m512i qv[MAX_HD / 32];
    #pragma GCC unroll 64
    for (int j = 0; j < HD / 32; j++) qv[j] = _mm512_loadu_si512(qg + 32 * j);
    #pragma GCC unroll 64
    for (int t = 0; t < CHUNK; t++) {
        const uint16_t *kt = k + (int64_t)t * HD;
        a[t] = _mm512_setzero_ps();
        #pragma GCC unroll 64
        for (int j = 0; j < HD / 32; j++)
            a[t] = _mm512_dpbf16_ps(a[t], (__m512bh)_mm512_loadu_si512(kt + 32 * j),
                                    (__m512bh)qv[j]);
    }
    return vf_transpose_reduce(a);
}
#endif

/* The group's query heads at q (G x HD, bf16 or fp32) as fp32 in qf. pairs: in the order
   chunk_scores reads bf16 keys, each 2 * VW elements as their VW even ones then their VW
   odd ones (a dot product's terms in another order). */
ALWAYS_INLINE void widen_queries(const void *q, float *qf, const int HD, const int G,
                                 const int bf16, const int pairs) {
    if (pairs) {
        #pragma GCC unroll 64
        for (int j = 0; j < G * (HD / VW); j += 2) {
            const vi w = vi_loadu((const uint16_t *)q + VW * j);
            vf_store(qf + VW * j, vf_pair_lo(w));
            vf_store(qf + VW * (j + 1), vf_pair_hi(w));
        }
        return;
    }
    #pragma GCC unroll 64
    for (int j = 0; j < G * (HD / VW); j++) vf_store(qf + VW * j, load_vec(q, VW * j, bf16));
}

/* Accumulators one pass of the value loop keeps in registers, beside a value vector and
   the group's probabilities: 16 vector registers on AVX2, 32 on AVX-512. */
#if SIMD_WIDTH == 16
#define VALUE_ACC_REGS 24
#else
#define VALUE_ACC_REGS 12
#endif

/* Vectors of dims per pass: all of a head's, halved until every head of the group fits. */
ALWAYS_INLINE int value_block(const int HD, const int G) {
    int jb = HD / VW;
    while (jb > 1 && G * jb > VALUE_ACC_REGS) jb /= 2;
    return jb;
}

/* acc[g] = acc[g] * corr[g] + the CHUNK tokens' values at v weighted by p_buf[g] (token
   by token, in order). A pass holds a block of dims of every head of the group in
   registers over the whole chunk, so each accumulator is loaded and stored once per
   chunk: updated in memory token by token (24 of them at head_dim 64 and a group of 3 on
   AVX2, past its 16 registers) the stores, not the FMAs, set the pace. */
ALWAYS_INLINE void fold_values(vf *acc, const vf *corr, const float *p_buf, const void *v,
                               const int HD, const int G, const int kind) {
    const int JB = value_block(HD, G);
    const int64_t row = cache_row_bytes(HD, kind);
    #pragma GCC unroll 16
    for (int j0 = 0; j0 < HD / VW; j0 += JB) {
        vf o[MAX_GROUP_HD / VW];
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            #pragma GCC unroll 64
            for (int jj = 0; jj < JB; jj++)
                o[g * JB + jj] = vf_mul(acc[g * (HD / VW) + j0 + jj], corr[g]);
        }
        UNROLL(V_UNROLL)
        for (int t = 0; t < CHUNK; t++) {
            const char *vr = (const char *)v + t * row;
            vf pt[FAST_GROUP_MAX];
            #pragma GCC unroll 64
            for (int g = 0; g < G; g++) pt[g] = vf_set1(p_buf[g * CHUNK + t]);
            #pragma GCC unroll 64
            for (int jj = 0; jj < JB; jj++) {
                const vf vt = load_cached(vr, VW * (j0 + jj), kind);
                #pragma GCC unroll 64
                for (int g = 0; g < G; g++) o[g * JB + jj] = vf_fmadd(pt[g], vt, o[g * JB + jj]);
            }
        }
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            #pragma GCC unroll 64
            for (int jj = 0; jj < JB; jj++) acc[g * (HD / VW) + j0 + jj] = o[g * JB + jj];
        }
    }
}

#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
/* fold_values for bf16 values with vdpbf16ps: two tokens' values per instruction, with
   the probabilities rounded to bf16 (as the prefill kernel rounds them). Rows t and t + 1
   are interleaved word by word (vpunpck{l,h}wd), so each 32-bit lane holds one dim of both
   tokens and a broadcast pair of probabilities weights them; the unpack works within
   128-bit lanes, so the accumulators hold the dims permuted (unpermute_values puts them
   back once per work item). Half the vector instructions of the fp32 FMAs on widened
   values, which bounded the kernel: from L3 it read ~24 GB/s a core. */
ALWAYS_INLINE int value_block_dp(const int HD, const int G) {
    int cb = HD / 16;
    while (cb > 2 && G * cb > VALUE_ACC_REGS) cb /= 2;
    return cb;
}

ALWAYS_INLINE void fold_values_dpbf16(vf *acc, const vf *corr, const float *p_buf,
                                      const uint16_t *v, const int HD, const int G) {
    uint32_t pp[FAST_GROUP_MAX][CHUNK / 2] __attribute__((aligned(64)));
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++)
        _mm256_store_si256((__m256i *)pp[g], vh_from_floats(vf_load(p_buf + g * CHUNK)));
    const int C = HD / 16, CB = value_block_dp(HD, G);
    #pragma GCC unroll 16
    for (int c0 = 0; c0 < C; c0 += CB) {
        __m512 o[MAX_GROUP_HD / VW];
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            #pragma GCC unroll 64
            for (int cc = 0; cc < CB; cc++) o[g * CB + cc] = vf_mul(acc[g * C + c0 + cc], corr[g]);
        }
        UNROLL(4)
        for (int tp = 0; tp < CHUNK / 2; tp++) {
            const uint16_t *ra = v + (int64_t)(2 * tp) * HD, *rb = ra + HD;
            __m512bh pv[FAST_GROUP_MAX];
            #pragma GCC unroll 64
            for (int g = 0; g < G; g++) pv[g] = (__m512bh)_mm512_set1_epi32((int)pp[g][tp]);
            #pragma GCC unroll 64
            for (int cc = 0; cc < CB; cc += 2) {
                const int d0 = 16 * (c0 + cc);  /* 32 dims per pair of accumulators */
                const __m512i a = _mm512_loadu_si512(ra + d0), b = _mm512_loadu_si512(rb + d0);
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                #pragma GCC unroll 64
                for (int g = 0; g < G; g++) {
                    o[g * CB + cc] = _mm512_dpbf16_ps(o[g * CB + cc], pv[g], lo);
                    o[g * CB + cc + 1] = _mm512_dpbf16_ps(o[g * CB + cc + 1], pv[g], hi);
                }
            }
        }
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            #pragma GCC unroll 64
            for (int cc = 0; cc < CB; cc++) acc[g * C + c0 + cc] = o[g * CB + cc];
        }
    }
}

/* The accumulators of fold_values_dpbf16 in dim order: of each pair (2j, 2j + 1), lane
   4L + k of the first holds dim 32j + 8L + k and of the second dim 32j + 8L + 4 + k. */
ALWAYS_INLINE void unpermute_values(vf *acc, const int HD, const int G) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                             30, 31);
    #pragma GCC unroll 64
    for (int j = 0; j < G * (HD / 16); j += 2) {
        const __m512 lo = acc[j], hi = acc[j + 1];
        acc[j] = _mm512_permutex2var_ps(lo, first, hi);
        acc[j + 1] = _mm512_permutex2var_ps(lo, second, hi);
    }
}
#endif

/* Fold the first n of the CHUNK tokens at k (keys) and v (values) into the group's online
   softmax. All CHUNK rows are read: the caller pads a short chunk with zeros. */
ALWAYS_INLINE void fold_chunk(const void *q, const float *qf, const void *k, const void *v,
                              int64_t n, float c, float *m, vf *l, vf *acc, const int HD,
                              const int G, const int bf16) {
    float p_buf[FAST_GROUP_MAX * CHUNK] __attribute__((aligned(64)));
    vf scores[FAST_GROUP_MAX], corr[FAST_GROUP_MAX];
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
    if (bf16) {
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++)
            scores[g] = chunk_scores_dpbf16((const uint16_t *)q + (int64_t)g * HD, k, HD);
    } else
#endif
    chunk_scores(qf, k, scores, HD, G, bf16 ? CACHE_BF16 : CACHE_F32);
    (void)q;  /* only the vdpbf16ps path reads the bf16 queries themselves */
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++) {
        vf x = vf_mul(scores[g], vf_set1(c));
        x = vf_first(x, n, NEG_BIG);
        const float cmax = vf_reduce_max(x);
        const float new_max = cmax > m[g] ? cmax : m[g];
        corr[g] = vf_exp2(vf_set1(m[g] - new_max));
        const vf p = vf_first(vf_exp2(vf_sub(x, vf_set1(new_max))), n, 0.f);
        m[g] = new_max;
        l[g] = vf_fmadd(l[g], corr[g], p);
        vf_store(p_buf + g * CHUNK, p);
    }
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
    if (bf16) {
        fold_values_dpbf16(acc, corr, p_buf, (const uint16_t *)v, HD, G);
        return;
    }
#endif
    fold_values(acc, corr, p_buf, v, HD, G, bf16 ? CACHE_BF16 : CACHE_F32);
}

/* Into L2, not L1: a block's K and V rows are 64 lines of prefetches at once, more than
   L1's miss buffers hold, and the block is read ~1,000 cycles later. On a Zen 4 (2
   threads, blocks scattered as a long decode lays them) _MM_HINT_T0 read 13-14 GB/s,
   _MM_HINT_T1 19-20 GB/s (4 x 1070 and 48 x 450 tokens); 2-4 blocks ahead was no better
   than the next one. */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
ALWAYS_INLINE void prefetch_rows(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, PF_HINT);
}

/* One work item: the group of query heads of (r, h) over blocks [b0, b1). */
ALWAYS_INLINE void run_item(const decode_args *a, int64_t h, const work_item *w,
                            float *partial, const int HD, const int G, const int bf16) {
    const int esz = bf16 ? 2 : 4;
    const int64_t row = HD * esz, chunk_bytes = CHUNK * row;
    const int64_t bs = a->block_size, ctx = a->ctx_lens[w->r];
    const int64_t head0 = w->r * a->num_heads + h * G;
    const char *q = (const char *)a->q + head0 * row;
    const char *kh = (const char *)a->k_cache + h * a->num_blocks * bs * row;
    const char *vh = (const char *)a->v_cache + h * a->num_blocks * bs * row;
    const int64_t *table = a->block_table + w->r * a->max_blocks;
    float qf[MAX_GROUP_HD] __attribute__((aligned(64)));
    widen_queries(q, qf, HD, G, bf16, bf16);
    float m[FAST_GROUP_MAX];
    vf l[FAST_GROUP_MAX], acc[MAX_GROUP_HD / VW];
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++) { m[g] = NEG_BIG; l[g] = vf_zero(); }
    #pragma GCC unroll 64
    for (int j = 0; j < G * (HD / VW); j++) acc[j] = vf_zero();

    char kpad[CHUNK * MAX_HD * 4] __attribute__((aligned(64)));
    char vpad[CHUNK * MAX_HD * 4] __attribute__((aligned(64)));
    const int64_t first = window_first(ctx, a->window);
    for (int64_t b = w->b0; b < w->b1; b++) {
        const int64_t tokens = ctx - b * bs < bs ? ctx - b * bs : bs;
        /* The window's first block is read from its first position: chunks then start
           mid-block, and the block's last one is short (padded below). */
        const int64_t t0 = first > b * bs ? first - b * bs : 0;
        const char *kb = kh + table[b] * bs * row, *vb = vh + table[b] * bs * row;
        for (int64_t t = t0; t < tokens; t += CHUNK) {
            /* Fetch the next block while this one computes, unless it follows this one
               in memory: then the hardware prefetcher streams it, and better. */
            if (t == t0 && b + 1 < w->b1 && table[b + 1] != table[b] + 1) {
                const int64_t nb = bs < CHUNK ? bs * row : chunk_bytes;
                prefetch_rows(kh + table[b + 1] * bs * row, nb);
                prefetch_rows(vh + table[b + 1] * bs * row, nb);
            }
            const int64_t n = tokens - t < CHUNK ? tokens - t : CHUNK;
            const char *kc = kb + t * row, *vc = vb + t * row;
            if (n < CHUNK) {  /* the context's last tokens, or a block shorter than a chunk */
                memcpy(kpad, kc, n * row);
                memcpy(vpad, vc, n * row);
                memset(kpad + n * row, 0, (CHUNK - n) * row);
                memset(vpad + n * row, 0, (CHUNK - n) * row);
                kc = kpad;
                vc = vpad;
            }
            fold_chunk(q, qf, kc, vc, n, a->c, m, l, acc, HD, G, bf16);
        }
    }
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
    if (bf16) unpermute_values(acc, HD, G);
#endif

    if (w->part < 0) {
        char *o = (char *)a->out + head0 * HD * esz;
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            const float sum = vf_reduce_add(l[g]);
            const vf inv = vf_set1(sum > 0.f ? 1.f / sum : 0.f);
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j++)
                store_vec(o, (int64_t)g * HD + VW * j, vf_mul(acc[g * (HD / VW) + j], inv), bf16);
        }
    } else {
        /* partial layout per (part, h): G x [max, sum, acc[HD]] */
        float *p = partial + (w->part * a->num_kv_heads + h) * G * (HD + 2);
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++, p += HD + 2) {
            p[0] = m[g];
            p[1] = vf_reduce_add(l[g]);
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j++) vf_storeu(p + 2 + VW * j, acc[g * (HD / VW) + j]);
        }
    }
}

/* ---- int8 cache: rows of HD int8 values and a float16 scale ---------------------- */

/* fold_chunk over int8 rows: the key scales multiply the chunk's scores, the value
   scales the probabilities (the softmax sums keep the unscaled ones). */
ALWAYS_INLINE void fold_chunk_q8(const float *qf, const int8_t *k, const int8_t *v, int64_t n,
                                 float c, float *m, vf *l, vf *acc, const int HD, const int G) {
    float p_buf[FAST_GROUP_MAX * CHUNK] __attribute__((aligned(64)));
    float ks[CHUNK] __attribute__((aligned(64))), vs[CHUNK] __attribute__((aligned(64)));
    for (int t = 0; t < CHUNK; t++) {
        ks[t] = row_scale(k + (int64_t)t * (HD + 2), HD);
        vs[t] = row_scale(v + (int64_t)t * (HD + 2), HD);
    }
    const vf kscale = vf_mul(vf_load(ks), vf_set1(c)), vscale = vf_load(vs);
    vf scores[FAST_GROUP_MAX], corr[FAST_GROUP_MAX];
    chunk_scores(qf, k, scores, HD, G, CACHE_I8);
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++) {
        vf x = vf_mul(scores[g], kscale);
        x = vf_first(x, n, NEG_BIG);
        const float cmax = vf_reduce_max(x);
        const float new_max = cmax > m[g] ? cmax : m[g];
        corr[g] = vf_exp2(vf_set1(m[g] - new_max));
        const vf p = vf_first(vf_exp2(vf_sub(x, vf_set1(new_max))), n, 0.f);
        m[g] = new_max;
        l[g] = vf_fmadd(l[g], corr[g], p);
        vf_store(p_buf + g * CHUNK, vf_mul(p, vscale));
    }
    fold_values(acc, corr, p_buf, v, HD, G, CACHE_I8);
}

/* run_item over an int8 cache (queries and output bf16 or fp32). */
ALWAYS_INLINE void run_item_q8(const decode_args *a, int64_t h, const work_item *w,
                               float *partial, const int HD, const int G, const int bf16) {
    const int64_t row = HD + 2, chunk_bytes = CHUNK * row;
    const int64_t bs = a->block_size, ctx = a->ctx_lens[w->r];
    const int64_t head0 = w->r * a->num_heads + h * G;
    const int8_t *kh = (const int8_t *)a->k_cache + h * a->num_blocks * bs * row;
    const int8_t *vh = (const int8_t *)a->v_cache + h * a->num_blocks * bs * row;
    const int64_t *table = a->block_table + w->r * a->max_blocks;
    float qf[MAX_GROUP_HD] __attribute__((aligned(64)));
    widen_queries((const char *)a->q + head0 * HD * (bf16 ? 2 : 4), qf, HD, G, bf16, 0);
    float m[FAST_GROUP_MAX];
    vf l[FAST_GROUP_MAX], acc[MAX_GROUP_HD / VW];
    #pragma GCC unroll 64
    for (int g = 0; g < G; g++) { m[g] = NEG_BIG; l[g] = vf_zero(); }
    #pragma GCC unroll 64
    for (int j = 0; j < G * (HD / VW); j++) acc[j] = vf_zero();

    int8_t kpad[CHUNK * (MAX_HD + 2)] __attribute__((aligned(64)));
    int8_t vpad[CHUNK * (MAX_HD + 2)] __attribute__((aligned(64)));
    const int64_t first = window_first(ctx, a->window);
    for (int64_t b = w->b0; b < w->b1; b++) {
        const int64_t tokens = ctx - b * bs < bs ? ctx - b * bs : bs;
        const int64_t t0 = first > b * bs ? first - b * bs : 0;  /* as in run_item */
        const int8_t *kb = kh + table[b] * bs * row, *vb = vh + table[b] * bs * row;
        for (int64_t t = t0; t < tokens; t += CHUNK) {
            if (t == t0 && b + 1 < w->b1 && table[b + 1] != table[b] + 1) {
                const int64_t nb = bs < CHUNK ? bs * row : chunk_bytes;
                prefetch_rows((const char *)(kh + table[b + 1] * bs * row), nb);
                prefetch_rows((const char *)(vh + table[b + 1] * bs * row), nb);
            }
            const int64_t n = tokens - t < CHUNK ? tokens - t : CHUNK;
            const int8_t *kc = kb + t * row, *vc = vb + t * row;
            if (n < CHUNK) {  /* zero rows: values and scales 0 */
                memcpy(kpad, kc, n * row);
                memcpy(vpad, vc, n * row);
                memset(kpad + n * row, 0, (CHUNK - n) * row);
                memset(vpad + n * row, 0, (CHUNK - n) * row);
                kc = kpad;
                vc = vpad;
            }
            fold_chunk_q8(qf, kc, vc, n, a->c, m, l, acc, HD, G);
        }
    }
    const int esz = bf16 ? 2 : 4;
    if (w->part < 0) {
        char *o = (char *)a->out + head0 * HD * esz;
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++) {
            const float sum = vf_reduce_add(l[g]);
            const vf inv = vf_set1(sum > 0.f ? 1.f / sum : 0.f);
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j++)
                store_vec(o, (int64_t)g * HD + VW * j, vf_mul(acc[g * (HD / VW) + j], inv), bf16);
        }
    } else {
        float *p = partial + (w->part * a->num_kv_heads + h) * G * (HD + 2);
        #pragma GCC unroll 64
        for (int g = 0; g < G; g++, p += HD + 2) {
            p[0] = m[g];
            p[1] = vf_reduce_add(l[g]);
            #pragma GCC unroll 64
            for (int j = 0; j < HD / VW; j++) vf_storeu(p + 2 + VW * j, acc[g * (HD / VW) + j]);
        }
    }
}

typedef void (*item_fn)(const decode_args *, int64_t, const work_item *, float *);

#define ITEM_FN_Q8(B, HD, G) \
    static void item_q8_##B##_##HD##_##G(const decode_args *a, int64_t h, const work_item *w, \
                                         float *partial) { run_item_q8(a, h, w, partial, HD, G, B); }
#define ITEM_FNS_Q8(B, HD) ITEM_FN_Q8(B, HD, 1) ITEM_FN_Q8(B, HD, 2) ITEM_FN_Q8(B, HD, 3) \
    ITEM_FN_Q8(B, HD, 4) ITEM_FN_Q8(B, HD, 5) ITEM_FN_Q8(B, HD, 6) ITEM_FN_Q8(B, HD, 7) \
    ITEM_FN_Q8(B, HD, 8)
#define ITEM_FNS4_Q8(B, HD) ITEM_FN_Q8(B, HD, 1) ITEM_FN_Q8(B, HD, 2) ITEM_FN_Q8(B, HD, 3) \
    ITEM_FN_Q8(B, HD, 4)
ITEM_FNS_Q8(0, 64)
ITEM_FNS_Q8(0, 128)
ITEM_FNS4_Q8(0, 256)
ITEM_FNS_Q8(1, 64)
ITEM_FNS_Q8(1, 128)
ITEM_FNS4_Q8(1, 256)
#define ITEM_ROW_Q8(B, HD) {item_q8_##B##_##HD##_1, item_q8_##B##_##HD##_2, \
    item_q8_##B##_##HD##_3, item_q8_##B##_##HD##_4, item_q8_##B##_##HD##_5, \
    item_q8_##B##_##HD##_6, item_q8_##B##_##HD##_7, item_q8_##B##_##HD##_8}
#define ITEM_ROW4_Q8(B, HD) {item_q8_##B##_##HD##_1, item_q8_##B##_##HD##_2, \
    item_q8_##B##_##HD##_3, item_q8_##B##_##HD##_4, NULL, NULL, NULL, NULL}
static const item_fn ITEM_FNS_Q8_TABLE[2][3][FAST_GROUP_MAX] = {
    {ITEM_ROW_Q8(0, 64), ITEM_ROW_Q8(0, 128), ITEM_ROW4_Q8(0, 256)},
    {ITEM_ROW_Q8(1, 64), ITEM_ROW_Q8(1, 128), ITEM_ROW4_Q8(1, 256)}};

#define ITEM_FN(B, HD, G) \
    static void item_##B##_##HD##_##G(const decode_args *a, int64_t h, const work_item *w, \
                                      float *partial) { run_item(a, h, w, partial, HD, G, B); }
#define ITEM_FNS(B, HD) ITEM_FN(B, HD, 1) ITEM_FN(B, HD, 2) ITEM_FN(B, HD, 3) ITEM_FN(B, HD, 4) \
    ITEM_FN(B, HD, 5) ITEM_FN(B, HD, 6) ITEM_FN(B, HD, 7) ITEM_FN(B, HD, 8)
#define ITEM_FNS4(B, HD) ITEM_FN(B, HD, 1) ITEM_FN(B, HD, 2) ITEM_FN(B, HD, 3) ITEM_FN(B, HD, 4)
ITEM_FNS(0, 64)
ITEM_FNS(0, 128)
ITEM_FNS4(0, 256)
ITEM_FNS(1, 64)
ITEM_FNS(1, 128)
ITEM_FNS4(1, 256)
#define ITEM_ROW(B, HD) {item_##B##_##HD##_1, item_##B##_##HD##_2, item_##B##_##HD##_3, \
    item_##B##_##HD##_4, item_##B##_##HD##_5, item_##B##_##HD##_6, item_##B##_##HD##_7, \
    item_##B##_##HD##_8}
#define ITEM_ROW4(B, HD) {item_##B##_##HD##_1, item_##B##_##HD##_2, item_##B##_##HD##_3, \
    item_##B##_##HD##_4, NULL, NULL, NULL, NULL}
static const item_fn ITEM_FNS_TABLE[2][3][FAST_GROUP_MAX] = {
    {ITEM_ROW(0, 64), ITEM_ROW(0, 128), ITEM_ROW4(0, 256)},
    {ITEM_ROW(1, 64), ITEM_ROW(1, 128), ITEM_ROW4(1, 256)}};

/* head_dim 64, 128 with 1..8 query heads per KV head; 256 with 1..4 (Gemma 3: 4 at 270M
   and 1B, 2 at 4B-27B), each of those an instantiation (see the top: compile time). */
static int has_fast_path(int64_t head_dim, int64_t group) {
    if (group < 1) return 0;
    if (head_dim == 64 || head_dim == 128) return group <= FAST_GROUP_MAX;
    return head_dim == 256 && group <= FAST_GROUP_MAX_256;
}

/* Returns -1 when the shape has no fast path, else the kernel's status. */
static int fast_decode(const decode_args *a, int64_t num_reqs, int64_t head_dim, int bf16,
                       int q8, int64_t split_tokens) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    if (!has_fast_path(head_dim, group)) return -1;
    const int hd = head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2;
    const item_fn fn = q8 ? ITEM_FNS_Q8_TABLE[bf16][hd][group - 1]
                          : ITEM_FNS_TABLE[bf16][hd][group - 1];
    const int64_t bs = a->block_size, kvh = a->num_kv_heads;

    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* Only the blocks inside each row's window count (and are ever read): the range of
       blocks [first / bs, ceil(ctx / bs)) of a row. */
    int64_t total_blocks = 0, total_tokens = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t ctx = a->ctx_lens[r] > 0 ? a->ctx_lens[r] : 0;
        const int64_t first = window_first(ctx, a->window);
        total_tokens += ctx - first;
        total_blocks += (ctx + bs - 1) / bs - first / bs;
    }
    const int64_t bytes = total_tokens * kvh * 2 * (q8 ? head_dim + 2 : head_dim * (bf16 ? 2 : 4));
    const int parallel = threads > 1 && bytes >= PARALLEL_MIN_BYTES;

    /* Context range per work item, in blocks: whole contexts unless there are too few
       (request, KV head) pairs to share among the threads. */
    int64_t split_blocks = INT64_MAX;
    const int64_t target = (int64_t)UNITS_PER_THREAD * threads;
    if (split_tokens >= 0) {  /* fixed ranges: the same cuts for a context in every call */
        if (split_tokens > 0) split_blocks = (split_tokens + bs - 1) / bs;
    } else if (parallel && num_reqs * kvh < target) {
        const int64_t min_blocks = (MIN_SPLIT_TOKENS + bs - 1) / bs;
        split_blocks = (total_blocks * kvh + target - 1) / target;
        if (split_blocks < min_blocks) split_blocks = min_blocks;
    }
    int64_t num_items = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t ctx = a->ctx_lens[r] > 0 ? a->ctx_lens[r] : 0;
        const int64_t nb = (ctx + bs - 1) / bs - window_first(ctx, a->window) / bs;
        num_items += nb <= split_blocks ? 1 : (nb + split_blocks - 1) / split_blocks;
    }
    work_item *items = malloc(sizeof(work_item) * (num_items + num_reqs));
    if (!items) return 2;
    work_item *merges = items + num_items;  /* split requests: r, first part, count */
    int64_t num_parts = 0, num_merges = 0, i = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        /* blocks [fb, fb + nb): the window's (all of the context's without one) */
        const int64_t ctx = a->ctx_lens[r] > 0 ? a->ctx_lens[r] : 0;
        const int64_t fb = window_first(ctx, a->window) / bs, nb = (ctx + bs - 1) / bs - fb;
        if (nb <= split_blocks) {
            items[i++] = (work_item){r, fb, fb + nb, -1};
            continue;
        }
        const int64_t parts = (nb + split_blocks - 1) / split_blocks;
        merges[num_merges++] = (work_item){r, num_parts, parts, 0};
        for (int64_t s = 0; s < parts; s++) {
            /* even parts; fixed ranges: split_blocks each from the window's first block,
               the last one shorter (so the cuts depend on the context and window alone) */
            const int64_t b0 = split_tokens > 0 ? s * split_blocks : nb * s / parts;
            const int64_t b1 = split_tokens > 0 ? (s + 1 == parts ? nb : b0 + split_blocks)
                                                : nb * (s + 1) / parts;
            items[i++] = (work_item){r, fb + b0, fb + b1, num_parts++};
        }
    }
    float *partial = NULL;
    if (num_parts) {
        partial = malloc(sizeof(float) * num_parts * kvh * group * (head_dim + 2));
        if (!partial) { free(items); return 2; }
    }

    #pragma omp parallel if(parallel)
    {
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t u = 0; u < num_items * kvh; u++)
            fn(a, u % kvh, &items[u / kvh], partial);
        if (num_merges) {
            #pragma omp barrier
            #pragma omp for schedule(static)
            for (int64_t u = 0; u < num_merges * kvh; u++) {
                const work_item *mg = &merges[u / kvh];
                const int64_t h = u % kvh;
                const int64_t stride = kvh * group * (head_dim + 2);
                for (int64_t g = 0; g < group; g++) {
                    const float *p0 = partial + (mg->b0 * kvh + h) * group * (head_dim + 2)
                                      + g * (head_dim + 2);
                    float mx = NEG_BIG;
                    for (int64_t s = 0; s < mg->b1; s++)
                        mx = p0[s * stride] > mx ? p0[s * stride] : mx;
                    float sum = 0.f;
                    vf o[MAX_HDV];
                    for (int j = 0; j < head_dim / VW; j++) o[j] = vf_zero();
                    for (int64_t s = 0; s < mg->b1; s++) {
                        const float *ps = p0 + s * stride;
                        const float ws = exp2f(ps[0] - mx);
                        sum += ws * ps[1];
                        for (int j = 0; j < head_dim / VW; j++)
                            o[j] = vf_fmadd(vf_set1(ws), vf_loadu(ps + 2 + VW * j), o[j]);
                    }
                    const vf inv = vf_set1(sum > 0.f ? 1.f / sum : 0.f);
                    const int64_t base = (mg->r * a->num_heads + h * group + g) * head_dim;
                    for (int j = 0; j < head_dim / VW; j++)
                        store_vec(a->out, base + VW * j, vf_mul(o[j], inv), bf16);
                }
            }
        }
    }
    free(partial);
    free(items);
    return 0;
}
#endif /* SIMD_WIDTH */

/* ------------------------------------------------------------------------------------ */
/* Exported entry points                                                                 */
/* ------------------------------------------------------------------------------------ */

/* NAME: contexts split across threads as the batch suits (see the top); NAME##_fixed:
   split at every split_tokens (0: never; negative: as NAME), whatever the batch;
   NAME##_window: the same with a sliding window (each row attends to its last `window`
   positions, its own included; 0 or less: all of them). The generic path never splits a
   context. */
#define DEFINE_PAGED_DECODE(NAME, T, C, GENERIC, BF16, Q8)                                  \
int NAME##_window(const T *q, const C *k_cache, const C *v_cache,                           \
                  const int64_t *block_table, const int64_t *ctx_lens, T *out,              \
                  int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,                \
                  int64_t head_dim, int64_t num_blocks, int64_t block_size,                 \
                  int64_t max_blocks, float scale, int64_t split_tokens, int64_t window) {  \
    const int64_t group = num_heads / num_kv_heads;                                         \
    if (group > MAX_GROUP || group * head_dim > MAX_GROUP_DIM                               \
        || group * block_size > MAX_GROUP_TOKENS)                                           \
        return 1;                                                                           \
    if (window < 0) window = 0;                                                             \
    FAST_PATH(BF16, Q8)                                                                     \
    (void)split_tokens;                                                                     \
    return GENERIC(q, k_cache, v_cache, block_table, ctx_lens, out, num_reqs, num_heads,    \
                   num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale,       \
                   window);                                                                 \
}                                                                                           \
int NAME##_fixed(const T *q, const C *k_cache, const C *v_cache,                            \
                 const int64_t *block_table, const int64_t *ctx_lens, T *out,               \
                 int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,                 \
                 int64_t head_dim, int64_t num_blocks, int64_t block_size,                  \
                 int64_t max_blocks, float scale, int64_t split_tokens) {                   \
    return NAME##_window(q, k_cache, v_cache, block_table, ctx_lens, out, num_reqs,         \
                         num_heads, num_kv_heads, head_dim, num_blocks, block_size,         \
                         max_blocks, scale, split_tokens, 0);                               \
}                                                                                           \
int NAME(const T *q, const C *k_cache, const C *v_cache, const int64_t *block_table,       \
         const int64_t *ctx_lens, T *out, int64_t num_reqs, int64_t num_heads,              \
         int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,    \
         int64_t max_blocks, float scale) {                                                 \
    return NAME##_fixed(q, k_cache, v_cache, block_table, ctx_lens, out, num_reqs,          \
                        num_heads, num_kv_heads, head_dim, num_blocks, block_size,          \
                        max_blocks, scale, -1);                                             \
}

#if SIMD_WIDTH
#define FAST_PATH(BF16, Q8)                                                                 \
    {                                                                                       \
        const decode_args a = {q, k_cache, v_cache, block_table, ctx_lens, out, num_heads,  \
                               num_kv_heads, num_blocks, block_size, max_blocks,            \
                               scale * 1.4426950408889634f, window};                        \
        const int status = fast_decode(&a, num_reqs, head_dim, BF16, Q8, split_tokens);     \
        if (status >= 0) return status;                                                     \
    }
#else
#define FAST_PATH(BF16, Q8)
#endif

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, uint16_t, generic_decode_bf16, 1, 0)
DEFINE_PAGED_DECODE(paged_decode_f32, float, float, generic_decode_f32, 0, 0)
/* int8 caches: k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim + 2] */
DEFINE_PAGED_DECODE(paged_decode_q8_bf16, uint16_t, int8_t, generic_decode_q8_bf16, 1, 1)
DEFINE_PAGED_DECODE(paged_decode_q8_f32, float, int8_t, generic_decode_q8_f32, 0, 1)

/* Whether a head_dim and query heads per KV head take the fast path in this build. */
int paged_decode_fast_path(int64_t head_dim, int64_t group) {
#if SIMD_WIDTH
    return has_fast_path(head_dim, group);
#else
    (void)head_dim; (void)group;
    return 0;
#endif
}
