/* Causal attention for prefill chunks (several new tokens of one request) over the paged
 * KV cache, on CPU: a flash-attention loop written for two cores.
 *
 * Why our own: torch's CPU scaled_dot_product_attention reached ~55 GFLOP/s of useful
 * (causal) work on a 512-token chunk and ~120 GFLOP/s on long contexts (bf16, 2 Zen 4
 * cores, torch 2.13): an explicit mask is read in full and masked tiles are computed
 * anyway. At 512 new tokens over 0-512 positions attention took a third of the step.
 *
 * One call handles every prefill span of a step, in two phases of one parallel region:
 *  1. pack: each span's context (all positions up to its last new token), per KV head,
 *     into the layouts vdpbf16ps wants, in the caller's workspace:
 *       K: tiles of 32 keys; per pair of dims (d, d+1), the 32 keys' pairs side by side,
 *          so one zmm holds 16 keys' pairs and a broadcast query pair scores 16 keys.
 *       V: per pair of keys (j, j+1), every dim's pair side by side, so a broadcast pair
 *          of probabilities adds 16 dims of two keys' values.
 *     Positions past the context are zero. Packing reads each K/V byte once per call
 *     (O(context x head_dim)); the compute phase reuses it for every query row.
 *  2. compute, in parallel over (span, query head, block of 16 rows): a micro-kernel of
 *     R query rows walks the key tiles up to the last row's position: 32 scores per row
 *     from bf16 pairs (exact products, fp32 sums), causal mask only on tiles that cross
 *     the diagonal, online softmax in the exp2 domain. Tiles wholly above the diagonal
 *     are never visited. Two micro-kernels read the same packed layout:
 *      - AVX-512 BF16 (R = 4 at head_dim 64, 2 at 128): vdpbf16ps on broadcast query
 *        pairs, probabilities rounded to bf16 and multiplied into fp32 accumulators held
 *        in registers;
 *      - AVX-512F or AVX2 without it (simd.h, 16 or 8 lanes, R = 4): each packed word
 *        split into its two fp32 halves (a shift and an and) and two FMAs against
 *        broadcast fp32 query values; probabilities stay fp32; the accumulators live in
 *        L1 and are walked one vector of dims at a time over a tile's 32 keys.
 *
 *      - AMX tiles (amx = 1 where paged_prefill_amx_available: the AVX-512 BF16 build
 *        on a CPU with AMX-BF16; head_dim 64 and 128, no window): blocks of 16 query
 *        rows, scores and probabilities x values by tdpbf16ps straight from the same
 *        packed tiles (a K tile's 16-key halves and a V tile's 16-dim columns are B
 *        tiles as they lie), the online softmax in zmm registers between them
 *        (amx_rows). Per layer call 1.4-1.7x faster than torch's SDPA on oneDNN's AMX
 *        kernels, which on these CPUs beat the vdpbf16ps kernel (docs/benchmarks.md).
 *
 * Sliding windows (window > 0, Gemma 3's local layers; the widening kernels only): a
 * query at position p sees keys [p - window + 1, p]. Tiles wholly before the first row's
 * window are neither packed nor visited, and no table entry of a block wholly before the
 * span's first window is read (a sliding KV group keeps stale ids there:
 * core/kv/sliding.py); tiles crossing a row's lower bound are masked as the diagonal is.
 *
 * Layouts: q [tokens, q_row_stride] bf16 with head h of row t at q + t * q_row_stride +
 * h * head_dim; out [tokens, num_heads * head_dim]; k_cache, v_cache [num_kv_heads,
 * num_blocks, block_size, head_dim]; spans [num_spans, 3] int64 (first row in q/out, new
 * tokens, positions before the chunk); block_tables [num_spans, max_blocks] int64.
 * workspace: paged_prefill_workspace_bytes() bytes, 64-byte aligned. amx: nonzero to
 * compute on AMX tiles where that path exists (else ignored).
 *
 * int8 caches (paged_prefill_q8_bf16; rows of head_dim int8 values and a float16 scale,
 * worker/kv_quant.py): the pack phase reads the int8 rows and writes each value times its
 * row's scale, rounded to bf16, into the same packed tiles; the compute phase is the one
 * above. The cache itself is read once per call, as int8, and never copied whole.
 *
 * Only these fast paths exist: without AVX-512 or AVX2, for another head_dim (64 and 128;
 * 256 on the widening kernels), or with a window on the AVX-512 BF16 build, the entry
 * points report it and the caller uses torch's attention.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define KT 32          /* keys per tile */
#define ROWS_PER_ITEM 16 /* query rows per unit of parallel work */
#define HDMAX_ALL 256  /* the largest head_dim of any kernel (the q8 packing's buffers) */

/* Span s's context (every position up to its last new token), padded to whole tiles. */
static int64_t span_padded_ctx(const int64_t *spans, int64_t s) {
    return (spans[3 * s + 1] + spans[3 * s + 2] + KT - 1) / KT * KT;
}

/* uint32 words (bf16 pairs) of span s's packed K and V, all KV heads. */
static int64_t span_words(const int64_t *spans, int64_t s, int64_t num_kv_heads,
                          int64_t head_dim) {
    return 2 * num_kv_heads * span_padded_ctx(spans, s) * (head_dim / 2);
}

/* Bytes of packed K and V for every span (see the layouts above). */
int64_t paged_prefill_workspace_bytes(const int64_t *spans, int64_t num_spans,
                                      int64_t num_kv_heads, int64_t head_dim) {
    int64_t words = 0;
    for (int64_t s = 0; s < num_spans; s++) words += span_words(spans, s, num_kv_heads, head_dim);
    return words * (int64_t)sizeof(uint32_t);
}

#if SIMD_WIDTH
#define HAVE_PREFILL_KERNEL 1
#else
#define HAVE_PREFILL_KERNEL 0
#endif
#if defined(__AVX512BF16__) && SIMD_WIDTH == 16
#define PREFILL_DPBF16 1
#define R64 4   /* query rows per micro-kernel call at head_dim 64 */
#define R128 2  /* and at 128 */
#else
#define PREFILL_DPBF16 0
#define R64 4
#define R128 4
#define R256 4
#endif
/* head_dim 256 and the window bound exist on the widening kernels only: the vdpbf16ps
   kernel holds R x head_dim / 16 accumulators in registers (256 would leave one row),
   and no machine here runs it to test either. */
#define PREFILL_WIDE_HEADS (!PREFILL_DPBF16)

#if HAVE_PREFILL_KERNEL

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define NEG_BIG (-1e30f)

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int8_t *k8, *v8;  /* an int8 cache instead (q8): rows of head_dim + 2 bytes */
    int q8;
    const int64_t *spans, *block_tables;
    uint16_t *out;
    uint32_t *workspace;
    int64_t num_spans, num_heads, num_kv_heads, num_blocks, block_size, max_blocks;
    int64_t q_row_stride;
    int64_t window;  /* 0: none; else a query at p sees keys [p - window + 1, p] */
    float c;  /* scale * log2(e) */
} prefill_args;

/* First position span s's queries may see (0 without a window). */
static int64_t span_low(const prefill_args *a, int64_t s) {
    const int64_t low = a->window ? a->spans[3 * s + 2] - a->window + 1 : 0;
    return low > 0 ? low : 0;
}

/* First position whose block table entry may be read: the start of the block holding
   span_low (a sliding group's entries for blocks wholly before it are stale). */
static int64_t span_first_read(const prefill_args *a, int64_t s) {
    return span_low(a, s) / a->block_size * a->block_size;
}

/* Offset (in uint32 pairs) of span s's packed K for KV head 0; V follows all K heads. */
static int64_t span_offset(const prefill_args *a, int64_t s, int64_t hd) {
    int64_t off = 0;
    for (int64_t i = 0; i < s; i++) off += span_words(a->spans, i, a->num_kv_heads, hd);
    return off;
}

/* Span s's packed K tiles for KV head kv (see pack_tile); its packed V tiles into *v. */
static uint32_t *packed_kv(const prefill_args *a, int64_t s, int64_t kv, int64_t hd,
                           uint32_t **v) {
    const int64_t head_words = span_padded_ctx(a->spans, s) * (hd / 2);
    uint32_t *k = a->workspace + span_offset(a, s, hd) + kv * head_words;
    *v = k + a->num_kv_heads * head_words;
    return k;
}

/* Pack tile t (keys [32t, 32t + 32)) of span s, KV head h. */
static void pack_tile(const prefill_args *a, int64_t s, int64_t h, int64_t t, int64_t hd) {
    const int64_t ctx = a->spans[3 * s + 1] + a->spans[3 * s + 2];
    const int64_t half = hd / 2, bs = a->block_size;
    uint32_t *vp, *kp = packed_kv(a, s, h, hd, &vp);
    const int64_t *table = a->block_tables + s * a->max_blocks;
    const int64_t first = span_first_read(a, s);
    if ((t + 1) * KT <= span_low(a, s)) return;  /* before every query's window */
    const uint16_t *k_rows[KT], *v_rows[KT];
    for (int64_t j = 0; j < KT; j++) {
        const int64_t pos = t * KT + j;
        const int64_t slot = pos < ctx && pos >= first
                             ? (h * a->num_blocks + table[pos / bs]) * bs + pos % bs : -1;
        k_rows[j] = slot < 0 ? NULL : a->k_cache + slot * hd;
        v_rows[j] = slot < 0 ? NULL : a->v_cache + slot * hd;
    }
    uint32_t *ktile = kp + t * KT * half;  /* [half][32 keys] */
    for (int64_t j = 0; j < KT; j++) {
        const uint32_t *krow = (const uint32_t *)k_rows[j];
        for (int64_t d = 0; d < half; d++) ktile[d * KT + j] = krow ? krow[d] : 0;
    }
    uint32_t *vtile = vp + t * (KT / 2) * hd;  /* [16 key pairs][hd] */
    for (int64_t jp = 0; jp < KT / 2; jp++) {
        const uint16_t *v0 = v_rows[2 * jp], *v1 = v_rows[2 * jp + 1];
        for (int64_t d = 0; d < hd; d++)
            vtile[jp * hd + d] = (v0 ? v0[d] : 0u) | ((uint32_t)(v1 ? v1[d] : 0u) << 16);
    }
}

/* fp32 -> bf16 bits, nearest even (no NaN: products of int8 and a finite scale). */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* pack_tile from an int8 cache: each value times its row's scale, as bf16. */
static void pack_tile_q8(const prefill_args *a, int64_t s, int64_t h, int64_t t, int64_t hd) {
    const int64_t ctx = a->spans[3 * s + 1] + a->spans[3 * s + 2];
    const int64_t half = hd / 2, bs = a->block_size, row = hd + 2;
    uint32_t *vp, *kp = packed_kv(a, s, h, hd, &vp);
    const int64_t *table = a->block_tables + s * a->max_blocks;
    const int64_t first = span_first_read(a, s);
    if ((t + 1) * KT <= span_low(a, s)) return;  /* before every query's window */
    /* the tile's keys and values as bf16 (zero past ctx and before the first block read) */
    uint16_t kb[KT][HDMAX_ALL], vb[KT][HDMAX_ALL];
    for (int64_t j = 0; j < KT; j++) {
        const int64_t pos = t * KT + j;
        if (pos >= ctx || pos < first) {
            memset(kb[j], 0, sizeof(uint16_t) * hd);
            memset(vb[j], 0, sizeof(uint16_t) * hd);
            continue;
        }
        const int64_t slot = (h * a->num_blocks + table[pos / bs]) * bs + pos % bs;
        const int8_t *kr = a->k8 + slot * row, *vr = a->v8 + slot * row;
        _Float16 ks16, vs16;
        memcpy(&ks16, kr + hd, sizeof(ks16));
        memcpy(&vs16, vr + hd, sizeof(vs16));
        const float ks = (float)ks16, vs = (float)vs16;
        for (int64_t d = 0; d < hd; d++) {
            kb[j][d] = (uint16_t)bf16_bits((float)kr[d] * ks);
            vb[j][d] = (uint16_t)bf16_bits((float)vr[d] * vs);
        }
    }
    uint32_t *ktile = kp + t * KT * half;
    for (int64_t j = 0; j < KT; j++)
        for (int64_t d = 0; d < half; d++)
            ktile[d * KT + j] = kb[j][2 * d] | ((uint32_t)kb[j][2 * d + 1] << 16);
    uint32_t *vtile = vp + t * (KT / 2) * hd;
    for (int64_t jp = 0; jp < KT / 2; jp++)
        for (int64_t d = 0; d < hd; d++)
            vtile[jp * hd + d] = vb[2 * jp][d] | ((uint32_t)vb[2 * jp + 1][d] << 16);
}

/* Bounds of R and HD: the micro-kernels' arrays have these fixed sizes. Sized by the
   literal arguments instead, they were variable-length arrays, which gcc keeps in memory:
   the 16 value accumulators of R = 4, HD = 64 were loaded and stored around every
   vdpbf16ps. */
#define RMAX 4

#if PREFILL_DPBF16

#define HDMAX 128

/* R query rows of one head (rows i0.. of the chunk, `valid` of them real; the others
   repeat the last real row and are not stored) against the packed context. */
ALWAYS_INLINE void rows_kernel(const prefill_args *a, const uint16_t *q0, uint16_t *o0,
                               int64_t valid, int64_t first_pos, const uint32_t *kp,
                               const uint32_t *vp, const int HD, const int R) {
    const int64_t q_stride = a->q_row_stride, o_stride = a->num_heads * HD;
    const uint32_t *qr[RMAX];
    int64_t limit[RMAX];
    for (int r = 0; r < R; r++) {
        const int64_t rr = r < valid ? r : valid - 1;
        qr[r] = (const uint32_t *)(q0 + rr * q_stride);
        limit[r] = first_pos + rr;
    }
    __m512 acc[RMAX][HDMAX / 16];
    float m[RMAX];
    __m512 l[RMAX];  /* per-lane partial sums of the probabilities, reduced at the end */
    for (int r = 0; r < R; r++) {
        m[r] = NEG_BIG;
        l[r] = _mm512_setzero_ps();
        for (int c = 0; c < HD / 16; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const __m512 cv = _mm512_set1_ps(a->c);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t num_tiles = (first_pos + valid + KT - 1) / KT;
    uint32_t pbuf[RMAX][KT / 2] __attribute__((aligned(64)));
    for (int64_t t = 0; t < num_tiles; t++) {
        const uint32_t *kt = kp + t * KT * (HD / 2);
        __m512 s[RMAX][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        #pragma GCC unroll 8
        for (int dp = 0; dp < HD / 2; dp++) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + dp * KT);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + dp * KT + 16);
            for (int r = 0; r < R; r++) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qr[r][dp]);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
            }
        }
        const int64_t key0 = t * KT;
        const int diagonal = key0 + KT - 1 > first_pos;
        for (int r = 0; r < R; r++) {
            __m512 x0 = _mm512_mul_ps(s[r][0], cv), x1 = _mm512_mul_ps(s[r][1], cv);
            __mmask16 v0 = 0xffff, v1 = 0xffff;
            if (diagonal) {
                const __m512i lim = _mm512_set1_epi32((int)(limit[r] - key0));
                v0 = _mm512_cmple_epi32_mask(iota, lim);
                v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16)), lim);
                x0 = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_BIG), v0, x0);
                x1 = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_BIG), v1, x1);
            }
            const float tmax = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            if (tmax > m[r]) {
                const float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(
                    vf_exp2(_mm512_set1_ps(m[r] - tmax))));
                const __m512 av = _mm512_set1_ps(alpha);
                l[r] = _mm512_mul_ps(l[r], av);
                for (int c = 0; c < HD / 16; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], av);
                m[r] = tmax;
            }
            const __m512 mv = _mm512_set1_ps(m[r]);
            const __m512 p0 = _mm512_maskz_mov_ps(v0, vf_exp2(_mm512_sub_ps(x0, mv)));
            const __m512 p1 = _mm512_maskz_mov_ps(v1, vf_exp2(_mm512_sub_ps(x1, mv)));
            l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
            _mm512_store_si512(pbuf[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const uint32_t *vt = vp + t * (KT / 2) * HD;
        #pragma GCC unroll 4
        for (int jp = 0; jp < KT / 2; jp++) {
            __m512bh pv[RMAX];
            for (int r = 0; r < R; r++) pv[r] = (__m512bh)_mm512_set1_epi32((int)pbuf[r][jp]);
            for (int c = 0; c < HD / 16; c++) {
                const __m512bh v = (__m512bh)_mm512_load_si512(vt + jp * HD + 16 * c);
                for (int r = 0; r < R; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv[r], v);
            }
        }
    }
    for (int r = 0; r < valid && r < R; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
        for (int c = 0; c < HD / 16; c++)
            _mm256_storeu_si256((__m256i *)(o0 + r * o_stride + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
    }
}


#if defined(__x86_64__) && defined(__linux__)
#define PREFILL_AMX 1
#include "amx_pack.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define AMX_ROWS 16  /* query rows per tile */
_Static_assert(ROWS_PER_ITEM == AMX_ROWS, "amx_rows takes a whole item in one block");

/* Tiles (all 16 rows x 64 bytes): 0 .. HD/32 - 1 the block's queries (A, 32 dims each);
   4 scores (C, 16 keys); 5 a K or V tile (B); 6 probabilities (A, 32 keys); 7 a block of
   16 output dims (C). */
AMX_TARGET static void amx_prefill_configure(void) { amx_configure_tiles(8); }
AMX_TARGET static void amx_prefill_release(void) { _tile_release(); }

/* The scores of the block's queries (A tiles 0 .. NQ - 1) against keys 16 kh .. 16 kh + 15
   of the packed K tile kt, into sbuf's columns col ... (C tile 4, B tile 5): a K tile's
   rows are dim pairs, 32 keys apart, so its 16-key halves are B tiles as they lie (rows
   128 bytes apart). */
#define AMX_SCORES(kt, kh, NQ, sbuf, col) do {                                        \
        _tile_zero(4);                                                                \
        AMX_LOAD(5, (kt) + 16 * (kh), KT * 4); _tile_dpbf16ps(4, 0, 5);               \
        AMX_LOAD(5, (kt) + 16 * KT + 16 * (kh), KT * 4); _tile_dpbf16ps(4, 1, 5);     \
        if ((NQ) > 2) {                                                               \
            AMX_LOAD(5, (kt) + 32 * KT + 16 * (kh), KT * 4);                          \
            _tile_dpbf16ps(4, 2, 5);                                                  \
            AMX_LOAD(5, (kt) + 48 * KT + 16 * (kh), KT * 4);                          \
            _tile_dpbf16ps(4, 3, 5);                                                  \
        }                                                                             \
        AMX_STORE(4, &(sbuf)[0][col], sizeof (sbuf)[0]);                              \
    } while (0)

#define ROUND_TILES 4  /* K tiles (32 keys each) per round of the online softmax */
#define ROUND_KEYS (ROUND_TILES * KT)
#define ROUND_VECS (ROUND_KEYS / 16)

/* Rows [i0, i0 + valid) of one head (valid <= 16) against the packed context, on AMX
   tiles, in rounds of up to 128 keys:
    - the 16 x 128 scores (exact bf16 products, fp32 sums, as vdpbf16ps gives them) by
      tdpbf16ps, the queries held in tiles 0 .. HD/32 - 1;
    - the online softmax of rows_kernel on them in zmm registers (the same exp2, mask and
      bf16 rounding of the probabilities), one maximum and at most one rescale per row
      and round;
    - the probabilities (A tile 6) times the V tiles (B tile 5: their key-pair rows are B
      tiles as they lie) by tdpbf16ps, each block of 16 output dims summed over the round
      in C tile 7 and added once into fp32 accumulators in L1.
   Measured per layer call (benchmarks/attention_kernel.py --prefill, SmolLM2's 9/3 heads,
   2 threads, Xeon with AMX): rounds of one K tile took the same time as these; four C
   tiles of output dims at once with the queries reloaded each round, with or without a
   branch around the rescale, were 5-15% slower on long contexts. The calling thread
   has configured the tiles (amx_prefill_configure). */
AMX_TARGET static inline __attribute__((always_inline))
void amx_rows(const prefill_args *a, const uint16_t *q0, uint16_t *o0, int64_t valid,
              int64_t first_pos, const uint32_t *kp, const uint32_t *vp, const int HD) {
    const int64_t q_stride = a->q_row_stride, o_stride = a->num_heads * HD;
    uint16_t qbuf[AMX_ROWS][HDMAX] __attribute__((aligned(64)));
    float sbuf[AMX_ROWS][ROUND_KEYS] __attribute__((aligned(64)));
    uint16_t pbuf[AMX_ROWS][ROUND_KEYS] __attribute__((aligned(64)));
    float obuf[AMX_ROWS][HDMAX] __attribute__((aligned(64)));
    float pv[AMX_ROWS][16] __attribute__((aligned(64)));
    float lbuf[AMX_ROWS][16] __attribute__((aligned(64)));  /* per-lane sums, as rows_kernel */
    float m[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) {
        if (r < valid) memcpy(qbuf[r], q0 + r * q_stride, (size_t)HD * 2);
        else memset(qbuf[r], 0, (size_t)HD * 2);  /* a padding row: scores 0, not stored */
        for (int c = 0; c < HD / 16; c++) _mm512_store_ps(obuf[r] + 16 * c, _mm512_setzero_ps());
        _mm512_store_ps(lbuf[r], _mm512_setzero_ps());
        m[r] = NEG_BIG;
    }
    AMX_LOAD(0, qbuf[0], sizeof qbuf[0]);
    AMX_LOAD(1, qbuf[0] + 32, sizeof qbuf[0]);
    if (HD > 64) {
        AMX_LOAD(2, qbuf[0] + 64, sizeof qbuf[0]);
        AMX_LOAD(3, qbuf[0] + 96, sizeof qbuf[0]);
    }
    const __m512 cv = _mm512_set1_ps(a->c);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t num_tiles = (first_pos + valid + KT - 1) / KT;
    for (int64_t t0 = 0; t0 < num_tiles; t0 += ROUND_TILES) {
        const int nt = num_tiles - t0 < ROUND_TILES ? (int)(num_tiles - t0) : ROUND_TILES;
        for (int u = 0; u < nt; u++) {
            const uint32_t *kt = kp + (t0 + u) * KT * (HD / 2);
            AMX_SCORES(kt, 0, HD / 32, sbuf, 32 * u);
            AMX_SCORES(kt, 1, HD / 32, sbuf, 32 * u + 16);
        }
        const int64_t key0 = t0 * KT;
        const int nv = 2 * nt;
        const int diagonal = key0 + nv * 16 - 1 > first_pos;
        for (int r = 0; r < AMX_ROWS; r++) {
            __m512 x[ROUND_VECS];
            __mmask16 keep[ROUND_VECS];
            __m512 mx = _mm512_set1_ps(NEG_BIG);
            const __m512i lim = _mm512_set1_epi32((int)(first_pos + r - key0));
            for (int v = 0; v < ROUND_VECS; v++) {
                if (v >= nv) break;
                x[v] = _mm512_mul_ps(_mm512_load_ps(sbuf[r] + 16 * v), cv);
                keep[v] = 0xffff;
                if (diagonal) {
                    keep[v] = _mm512_cmple_epi32_mask(
                        _mm512_add_epi32(iota, _mm512_set1_epi32(16 * v)), lim);
                    x[v] = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_BIG), keep[v], x[v]);
                }
                mx = _mm512_max_ps(mx, x[v]);
            }
            const float tmax = _mm512_reduce_max_ps(mx);
            __m512 lsum = _mm512_load_ps(lbuf[r]);
            if (tmax > m[r]) {
                const __m512 av = vf_exp2(_mm512_set1_ps(m[r] - tmax));
                lsum = _mm512_mul_ps(lsum, av);
                for (int c = 0; c < HD / 16; c++)
                    _mm512_store_ps(obuf[r] + 16 * c,
                                    _mm512_mul_ps(_mm512_load_ps(obuf[r] + 16 * c), av));
                m[r] = tmax;
            }
            const __m512 mv = _mm512_set1_ps(m[r]);
            for (int v = 0; v < ROUND_VECS; v += 2) {
                if (v >= nv) break;
                const __m512 p0 = _mm512_maskz_mov_ps(keep[v], vf_exp2(_mm512_sub_ps(x[v], mv)));
                const __m512 p1 = _mm512_maskz_mov_ps(keep[v + 1],
                                                      vf_exp2(_mm512_sub_ps(x[v + 1], mv)));
                lsum = _mm512_add_ps(lsum, _mm512_add_ps(p0, p1));
                _mm512_store_si512(pbuf[r] + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            _mm512_store_ps(lbuf[r], lsum);
        }
        for (int c = 0; c < HD / 16; c++) {
            _tile_zero(7);
            for (int u = 0; u < nt; u++) {
                AMX_LOAD(6, pbuf[0] + 32 * u, sizeof pbuf[0]);
                AMX_LOAD(5, vp + (t0 + u) * (KT / 2) * HD + 16 * c, HD * 4);
                _tile_dpbf16ps(7, 6, 5);
            }
            AMX_STORE(7, pv[0], 64);
            for (int r = 0; r < AMX_ROWS; r++)
                _mm512_store_ps(obuf[r] + 16 * c, _mm512_add_ps(_mm512_load_ps(obuf[r] + 16 * c),
                                                                _mm512_load_ps(pv[r])));
        }
    }
    for (int r = 0; r < valid; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lbuf[r])));
        for (int c = 0; c < HD / 16; c++)
            _mm256_storeu_si256((__m256i *)(o0 + r * o_stride + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(obuf[r] + 16 * c), inv)));
    }
}

/* Rows [i0, i1) (at most 16) of span s, query head h, on AMX tiles. */
AMX_TARGET static inline __attribute__((always_inline))
void amx_item(const prefill_args *a, int64_t s, int64_t h, int64_t i0, int64_t i1,
              const int HD) {
    const int64_t row = a->spans[3 * s], start = a->spans[3 * s + 2];
    uint32_t *vp, *kp = packed_kv(a, s, h / (a->num_heads / a->num_kv_heads), HD, &vp);
    amx_rows(a, a->q + (row + i0) * a->q_row_stride + h * HD,
             a->out + (row + i0) * a->num_heads * HD + h * HD, i1 - i0, start + i0, kp, vp,
             HD);
}

AMX_TARGET static void amx_item_64(const prefill_args *a, int64_t s, int64_t h, int64_t i0,
                                   int64_t i1) {
    amx_item(a, s, h, i0, i1, 64);
}
AMX_TARGET static void amx_item_128(const prefill_args *a, int64_t s, int64_t h, int64_t i0,
                                    int64_t i1) {
    amx_item(a, s, h, i0, i1, 128);
}

/* Whether this CPU has AMX-BF16 and Linux grants this process the tile state
   (gemm_bf16_amx.c, the same library). */
int gemm_bf16_amx_available(void);

#endif /* x86-64 Linux */

#else /* widening */

#define VW SIMD_WIDTH
#define HDMAX 256

/* R query rows of one head (rows i0.. of the chunk, `valid` of them real; the others
   repeat the last real row and are not stored) against the packed context. */
ALWAYS_INLINE void rows_kernel(const prefill_args *a, const uint16_t *q0, uint16_t *o0,
                               int64_t valid, int64_t first_pos, const uint32_t *kp,
                               const uint32_t *vp, const int HD, const int R) {
    const int64_t q_stride = a->q_row_stride, o_stride = a->num_heads * HD;
    float qf[RMAX][HDMAX] __attribute__((aligned(64)));   /* the queries, widened */
    float acc[RMAX][HDMAX] __attribute__((aligned(64)));
    float sbuf[RMAX][KT] __attribute__((aligned(64)));  /* a tile's raw scores, then probabilities */
    int64_t limit[RMAX], low[RMAX];  /* the keys each row sees: [low, limit] */
    float m[RMAX];
    vf l[RMAX];  /* per-lane partial sums of the probabilities, reduced at the end */
    for (int r = 0; r < R; r++) {
        const int64_t rr = r < valid ? r : valid - 1;
        const uint16_t *qr = q0 + rr * q_stride;
        for (int d = 0; d < HD; d += VW) {
            vf_store(qf[r] + d, vf_bf16_load(qr + d));
            vf_store(acc[r] + d, vf_zero());
        }
        limit[r] = first_pos + rr;
        low[r] = a->window && limit[r] - a->window + 1 > 0 ? limit[r] - a->window + 1 : 0;
        m[r] = NEG_BIG;
        l[r] = vf_zero();
    }
    const vf cv = vf_set1(a->c);
    const int64_t num_tiles = (first_pos + valid + KT - 1) / KT;
    for (int64_t t = low[0] / KT; t < num_tiles; t++) {
        const uint32_t *kt = kp + t * KT * (HD / 2);
        for (int v = 0; v < KT / VW; v++) {  /* VW keys' scores for every row */
            /* Even and odd dims in separate sums: one chain of two dependent FMAs per
               row and pair held the FMA units to half their rate (latency, not ports). */
            vf s0[RMAX], s1[RMAX];
            for (int r = 0; r < R; r++) s0[r] = s1[r] = vf_zero();
            #pragma GCC unroll 4
            for (int dp = 0; dp < HD / 2; dp++) {
                const vi w = vi_load(kt + dp * KT + v * VW);
                const vf k0 = vf_pair_lo(w), k1 = vf_pair_hi(w);
                for (int r = 0; r < R; r++) {
                    s0[r] = vf_fmadd(vf_set1(qf[r][2 * dp]), k0, s0[r]);
                    s1[r] = vf_fmadd(vf_set1(qf[r][2 * dp + 1]), k1, s1[r]);
                }
            }
            for (int r = 0; r < R; r++)
                vf_store(sbuf[r] + v * VW, vf_mul(vf_add(s0[r], s1[r]), cv));
        }
        const int64_t key0 = t * KT;
        const int diagonal = key0 + KT - 1 > first_pos;
        for (int r = 0; r < R; r++) {
            const int64_t n = limit[r] - key0 + 1;  /* keys of the tile up to this row */
            const int64_t below = low[r] - key0;  /* keys of the tile before its window */
            vf x[KT / VW];
            vf mx = vf_set1(NEG_BIG);
            for (int v = 0; v < KT / VW; v++) {
                x[v] = vf_load(sbuf[r] + v * VW);
                if (diagonal) x[v] = vf_first(x[v], n - v * VW, NEG_BIG);
                if (below > 0) x[v] = vf_from(x[v], below - v * VW, NEG_BIG);
                mx = vf_max(mx, x[v]);
            }
            const float tmax = vf_reduce_max(mx);
            if (tmax > m[r]) {
                const float alpha = exp2f(m[r] - tmax);
                const vf av = vf_set1(alpha);
                l[r] = vf_mul(l[r], av);
                for (int d = 0; d < HD; d += VW) vf_store(acc[r] + d, vf_mul(vf_load(acc[r] + d), av));
                m[r] = tmax;
            }
            const vf mv = vf_set1(m[r]);
            for (int v = 0; v < KT / VW; v++) {
                vf p = vf_exp2(vf_sub(x[v], mv));
                if (diagonal) p = vf_first(p, n - v * VW, 0.f);
                if (below > 0) p = vf_from(p, below - v * VW, 0.f);
                l[r] = vf_add(l[r], p);
                vf_store(sbuf[r] + v * VW, p);
            }
        }
        const uint32_t *vt = vp + t * (KT / 2) * HD;
        for (int d = 0; d < HD; d += VW) {  /* one vector of dims over the tile's keys */
            vf o0[RMAX], o1[RMAX];  /* even and odd keys, as the scores above */
            for (int r = 0; r < R; r++) {
                o0[r] = vf_load(acc[r] + d);
                o1[r] = vf_zero();
            }
            #pragma GCC unroll 4
            for (int jp = 0; jp < KT / 2; jp++) {
                const vi w = vi_load(vt + jp * HD + d);
                const vf v0 = vf_pair_lo(w), v1 = vf_pair_hi(w);
                for (int r = 0; r < R; r++) {
                    o0[r] = vf_fmadd(vf_set1(sbuf[r][2 * jp]), v0, o0[r]);
                    o1[r] = vf_fmadd(vf_set1(sbuf[r][2 * jp + 1]), v1, o1[r]);
                }
            }
            for (int r = 0; r < R; r++) vf_store(acc[r] + d, vf_add(o0[r], o1[r]));
        }
    }
    for (int r = 0; r < valid && r < R; r++) {
        const vf inv = vf_set1(1.f / vf_reduce_add(l[r]));
        for (int d = 0; d < HD; d += VW)
            vf_bf16_store(o0 + r * o_stride + d, vf_mul(vf_load(acc[r] + d), inv));
    }
}

#endif /* PREFILL_DPBF16 */

/* Rows [i0, i1) of span s, query head h. */
ALWAYS_INLINE void item(const prefill_args *a, int64_t s, int64_t h, int64_t i0, int64_t i1,
                        const int HD, const int R) {
    const int64_t row = a->spans[3 * s], start = a->spans[3 * s + 2];
    uint32_t *vp, *kp = packed_kv(a, s, h / (a->num_heads / a->num_kv_heads), HD, &vp);
    for (int64_t i = i0; i < i1; i += R) {
        const int64_t valid = i1 - i < R ? i1 - i : R;
        rows_kernel(a, a->q + (row + i) * a->q_row_stride + h * HD,
                    a->out + (row + i) * a->num_heads * HD + h * HD, valid, start + i, kp, vp,
                    HD, R);
    }
}

static void item_64(const prefill_args *a, int64_t s, int64_t h, int64_t i0, int64_t i1) {
    item(a, s, h, i0, i1, 64, R64);
}
static void item_128(const prefill_args *a, int64_t s, int64_t h, int64_t i0, int64_t i1) {
    item(a, s, h, i0, i1, 128, R128);
}
#if PREFILL_WIDE_HEADS
static void item_256(const prefill_args *a, int64_t s, int64_t h, int64_t i0, int64_t i1) {
    item(a, s, h, i0, i1, 256, R256);
}
#endif

#endif /* HAVE_PREFILL_KERNEL */

/* Whether paged_prefill_bf16 runs for this head_dim, with a window (window > 0) or
   without, in this build. */
int paged_prefill_available(int64_t head_dim, int64_t window) {
#if HAVE_PREFILL_KERNEL && PREFILL_WIDE_HEADS
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
    return HAVE_PREFILL_KERNEL && window <= 0 && (head_dim == 64 || head_dim == 128);
#endif
}

/* Whether the compute phase can run on AMX tiles for this head_dim (without a window):
   the AVX-512 BF16 build on x86-64 Linux, a CPU with AMX-BF16, and the tile state granted
   to this process. */
int paged_prefill_amx_available(int64_t head_dim) {
#ifdef PREFILL_AMX
    static int granted = -1;
    if (granted < 0) granted = gemm_bf16_amx_available();
    return granted && (head_dim == 64 || head_dim == 128);
#else
    (void)head_dim;
    return 0;
#endif
}

static int prefill(const uint16_t *q, int64_t q_row_stride, const void *k_cache,
                   const void *v_cache, int q8, const int64_t *spans,
                   const int64_t *block_tables, uint16_t *out, void *workspace,
                   int64_t num_spans, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t num_blocks, int64_t block_size,
                   int64_t max_blocks, float scale, int64_t window, int64_t amx) {
    if (!paged_prefill_available(head_dim, window) || num_heads % num_kv_heads != 0 ||
        ((uintptr_t)workspace & 63) != 0 || window < 0)
        return -1;
    amx = amx && window == 0 && paged_prefill_amx_available(head_dim);
#if HAVE_PREFILL_KERNEL
    void (*fn)(const prefill_args *, int64_t, int64_t, int64_t, int64_t) =
        head_dim == 64 ? item_64 : item_128;
#if PREFILL_WIDE_HEADS
    if (head_dim == 256) fn = item_256;
#endif
#ifdef PREFILL_AMX
    if (amx) fn = head_dim == 64 ? amx_item_64 : amx_item_128;
#endif
    const prefill_args a = {q, q8 ? NULL : k_cache, q8 ? NULL : v_cache,
                            q8 ? k_cache : NULL, q8 ? v_cache : NULL, q8,
                            spans, block_tables, out, workspace,
                            num_spans, num_heads, num_kv_heads, num_blocks, block_size,
                            max_blocks, q_row_stride, window, scale * 1.4426950408889634f};
    /* Work lists: (span, KV head, tile) to pack, (span, head, row block) to compute. */
    int64_t num_pack = 0, num_items = 0;
    for (int64_t s = 0; s < num_spans; s++) {
        num_pack += num_kv_heads * span_padded_ctx(spans, s) / KT;
        num_items += num_heads * ((spans[3 * s + 1] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM);
    }
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < num_pack; w++) {
            int64_t s = 0, rest = w;
            for (;; s++) {
                const int64_t tiles = span_padded_ctx(spans, s) / KT;
                if (rest < num_kv_heads * tiles) {
                    if (q8) pack_tile_q8(&a, s, rest / tiles, rest % tiles, head_dim);
                    else pack_tile(&a, s, rest / tiles, rest % tiles, head_dim);
                    break;
                }
                rest -= num_kv_heads * tiles;
            }
        }
#ifdef PREFILL_AMX
        if (amx) amx_prefill_configure();
#endif
        /* Longest rows (most keys) first, so the last items to start are the short ones. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; w++) {
            int64_t s = 0, rest = w;
            for (;; s++) {
                const int64_t blocks = (spans[3 * s + 1] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
                if (rest < num_heads * blocks) {
                    const int64_t b = blocks - 1 - rest / num_heads, h = rest % num_heads;
                    const int64_t i0 = b * ROWS_PER_ITEM;
                    const int64_t i1 = i0 + ROWS_PER_ITEM < spans[3 * s + 1]
                                       ? i0 + ROWS_PER_ITEM : spans[3 * s + 1];
                    fn(&a, s, h, i0, i1);
                    break;
                }
                rest -= num_heads * blocks;
            }
        }
#ifdef PREFILL_AMX
        if (amx) amx_prefill_release();
#endif
    }
    return 0;
#else
    return -1;  /* not reached: paged_prefill_available is 0 in this build */
#endif
}

int paged_prefill_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *spans,
                       const int64_t *block_tables, uint16_t *out, void *workspace,
                       int64_t num_spans, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t num_blocks, int64_t block_size,
                       int64_t max_blocks, float scale, int64_t window, int64_t amx) {
    return prefill(q, q_row_stride, k_cache, v_cache, 0, spans, block_tables, out, workspace,
                   num_spans, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                   max_blocks, scale, window, amx);
}

/* The same over an int8 cache: k_cache, v_cache [num_kv_heads, num_blocks, block_size,
   head_dim + 2]. */
int paged_prefill_q8_bf16(const uint16_t *q, int64_t q_row_stride, const int8_t *k_cache,
                          const int8_t *v_cache, const int64_t *spans,
                          const int64_t *block_tables, uint16_t *out, void *workspace,
                          int64_t num_spans, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_blocks, int64_t block_size,
                          int64_t max_blocks, float scale, int64_t window, int64_t amx) {
    return prefill(q, q_row_stride, k_cache, v_cache, 1, spans, block_tables, out, workspace,
                   num_spans, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                   max_blocks, scale, window, amx);
}
