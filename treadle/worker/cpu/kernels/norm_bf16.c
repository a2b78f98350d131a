/* Fused elementwise steps of a bf16 decoder layer, one call each instead of several
 * torch ops (at the few rows of a decode step their cost is the per-op dispatch, not the
 * arithmetic):
 *
 *  - add_rms_norm_bf16: hidden += delta (rounded to bf16, as torch's in-place add), then
 *    out = bf16(bf16(hidden * rsqrt(mean(hidden^2) + eps)) * weight), the numerics of
 *    treadle.models.llama.rms_norm (normalized in float32, cast, then scaled in bf16).
 *  - silu_mul_bf16: out = bf16(bf16(silu(gate)) * up) from the fused [M, 2*I] gate_up
 *    projection, as F.silu followed by an in-place multiply.
 *  - rope_kv_bf16: rotary embedding of queries and keys (rotate_half layout) with the
 *    roundings of treadle.models.rope.apply_rotary (o1 = bf16(bf16(x1 c) - bf16(x2 s)),
 *    o2 = bf16(bf16(x2 c) + bf16(x1 s))), rotated queries written to a contiguous
 *    [M, heads, head_dim], rotated keys and the values stored at each token's KV-cache
 *    slot: one call for what took a dozen torch ops and two index copies.
 *  - gemma_add_norm_bf16, gemma_head_norms_bf16, gelu_tanh_mul_bf16: Gemma 3's layer
 *    steps (models/gemma3.py): its RMSNorm scales by (1 + weight) in fp32 and rounds
 *    once; a sublayer's post-norm, the residual add and the next pre-norm in one call;
 *    the per-head q/k norms in place; GeGLU with the tanh-approximated GELU.
 *  - rope_kv_q8_bf16: the same rotation, with keys and values stored quantized to int8
 *    rows of the KV cache (worker/kv_quant.py: head_dim int8 values, then the float16
 *    scale fp16(max|x| / 127); q = nearest-even(x / scale)), bit-exact with
 *    kv_quant.quantize.
 *
 * Results can differ from torch in the last float bit (summation order, exp) and so,
 * rarely, by one bf16 ulp; rope_kv is bit-exact (each value is one product or sum of
 * exact products, rounded to nearest even as torch rounds) down to the subnormals, which
 * the AVX-512 BF16 build's roundings (one vcvtneps2bf16 each, simd.h) take and give as
 * zero: that instruction made silu_mul 25-32% and add_rms_norm 21-42% faster than the
 * integer rounding (12 and 512 rows, one Zen 4 thread). Written once on the vectors
 * of simd.h: 16 lanes with AVX-512, 8 with AVX2 (bf16 widened to fp32 in registers, no
 * bf16 instruction needed); where neither exists the functions return -1 and callers
 * use torch.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

/* Rows per call above which the rows are split over threads. */
#define PARALLEL_ROWS 64
/* silu_mul's rows are split over threads from this many gate values on: an exp and a
 * divide per value make a decode step's 16 rows x 1536 (SmolLM2-135M) ~15 us on one
 * thread, several times what waking the other threads costs (4 rows: 5.5 -> 3.9 us). */
#define PARALLEL_SILU_VALUES 4096

#if SIMD_WIDTH
#define W SIMD_WIDTH

typedef uint16_t bf16_t;

/* The W (or, at a row's end, fewer) bf16 at p as fp32; zero beyond. */
static inline vf load_bf16(const bf16_t *p, int64_t remaining) {
    return remaining >= W ? vf_bf16_load(p) : vf_bf16_load_n(p, remaining);
}

static inline void store_bf16(bf16_t *p, vf v, int64_t remaining) {
    if (remaining >= W) vf_bf16_store(p, v);
    else vf_bf16_store_n(p, v, remaining);
}

static void add_rms_norm_row(bf16_t *h, const bf16_t *d, const bf16_t *w, bf16_t *out,
                             int64_t H, float eps) {
    vf acc = vf_zero();
    for (int64_t j = 0; j < H; j += W) {
        vf v = load_bf16(h + j, H - j);
        if (d) {
            v = vf_bf16_round(vf_add(v, load_bf16(d + j, H - j)));
            store_bf16(h + j, v, H - j);
        }
        acc = vf_fmadd(v, v, acc);
    }
    float variance = vf_reduce_add(acc) / (float)H;
    vf inv = vf_set1(1.0f / sqrtf(variance + eps));
    for (int64_t j = 0; j < H; j += W) {
        vf v = vf_bf16_round(vf_mul(load_bf16(h + j, H - j), inv));
        store_bf16(out + j, vf_mul(v, load_bf16(w + j, H - j)), H - j);
    }
}

int add_rms_norm_bf16(bf16_t *hidden, const bf16_t *delta, const bf16_t *weight, bf16_t *out,
                      int64_t M, int64_t H, float eps) {
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        add_rms_norm_row(hidden + m * H, delta ? delta + m * H : 0, weight, out + m * H, H, eps);
    return 0;
}

int silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t M, int64_t I) {
    #pragma omp parallel for schedule(static) if(M >= 2 && M * I >= PARALLEL_SILU_VALUES)
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *g = gate_up + m * 2 * I, *u = g + I;
        bf16_t *o = out + m * I;
        for (int64_t j = 0; j < I; j += W) {
            vf x = load_bf16(g + j, I - j);
            vf e = vf_exp(vf_sub(vf_zero(), x));
            vf s = vf_bf16_round(vf_div(x, vf_add(e, vf_set1(1.0f))));
            store_bf16(o + j, vf_mul(s, load_bf16(u + j, I - j)), I - j);
        }
    }
    return 0;
}

/* ---- Gemma 3's layer steps (models/gemma3.py) ------------------------------------ */

/* out = bf16(x * rsqrt(mean(x^2) + eps) * (1 + w)), computed in fp32 and rounded once:
   Gemma's RMSNorm (models/gemma3.py gemma_rms_norm). out may be x. */
static void gemma_norm_row(const bf16_t *x, const bf16_t *w, bf16_t *out, int64_t H,
                           float eps) {
    vf acc = vf_zero();
    for (int64_t j = 0; j < H; j += W) {
        const vf v = load_bf16(x + j, H - j);
        acc = vf_fmadd(v, v, acc);
    }
    const vf inv = vf_set1(1.0f / sqrtf(vf_reduce_add(acc) / (float)H + eps));
    const vf one = vf_set1(1.0f);
    for (int64_t j = 0; j < H; j += W)
        store_bf16(out + j, vf_mul(vf_mul(load_bf16(x + j, H - j), inv),
                                   vf_add(one, load_bf16(w + j, H - j))), H - j);
}

/* hidden += gemma_norm(delta, delta_weight) (the normed delta rounded to bf16, then the
   sum, as torch's in-place add; skipped when delta is NULL), then out =
   gemma_norm(hidden, weight) (skipped when weight is NULL). One call for a sublayer's
   post-norm, its residual add and the next sublayer's pre-norm. */
int gemma_add_norm_bf16(bf16_t *hidden, const bf16_t *delta, const bf16_t *delta_weight,
                        const bf16_t *weight, bf16_t *out, int64_t M, int64_t H, float eps) {
    if (delta && !delta_weight) return -1;
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        bf16_t *h = hidden + m * H;
        if (delta) {
            const bf16_t *d = delta + m * H;
            vf acc = vf_zero();
            for (int64_t j = 0; j < H; j += W) {
                const vf v = load_bf16(d + j, H - j);
                acc = vf_fmadd(v, v, acc);
            }
            const vf inv = vf_set1(1.0f / sqrtf(vf_reduce_add(acc) / (float)H + eps));
            const vf one = vf_set1(1.0f);
            for (int64_t j = 0; j < H; j += W) {
                const vf normed = vf_bf16_round(vf_mul(
                    vf_mul(load_bf16(d + j, H - j), inv),
                    vf_add(one, load_bf16(delta_weight + j, H - j))));
                store_bf16(h + j, vf_add(load_bf16(h + j, H - j), normed), H - j);
            }
        }
        if (weight) gemma_norm_row(h, weight, out + m * H, H, eps);
    }
    return 0;
}

/* The per-head norms of queries (q_weight) and keys (k_weight), in place: qkv is [M, ...]
   rows `row` apart, each starting with heads query vectors and kv_heads key vectors of
   D values. */
int gemma_head_norms_bf16(bf16_t *qkv, int64_t row, const bf16_t *q_weight,
                          const bf16_t *k_weight, int64_t M, int64_t heads, int64_t kv_heads,
                          int64_t D, float eps) {
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            bf16_t *x = qkv + m * row + h * D;
            gemma_norm_row(x, h < heads ? q_weight : k_weight, x, D, eps);
        }
    return 0;
}

/* out = bf16(bf16(gelu_tanh(gate)) * up) from the fused [M, 2*I] gate_up projection, as
   F.gelu(approximate="tanh") then an in-place multiply. gelu_tanh(x) = 0.5 x (1 +
   tanh(y)) = x / (1 + exp(-2y)), y = sqrt(2/pi) (x + 0.044715 x^3): the second form has
   no cancellation near 0 and no tanh. */
int gelu_tanh_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t M, int64_t I) {
    const float two_beta = 2.0f * 0.7978845608028654f, kappa = 0.044715f;
    #pragma omp parallel for schedule(static) if(M >= 2 && M * I >= PARALLEL_SILU_VALUES)
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *g = gate_up + m * 2 * I, *u = g + I;
        bf16_t *o = out + m * I;
        for (int64_t j = 0; j < I; j += W) {
            const vf x = load_bf16(g + j, I - j);
            const vf y2 = vf_mul(vf_set1(two_beta),
                                 vf_fmadd(vf_mul(vf_set1(kappa), x), vf_mul(x, x), x));
            const vf e = vf_exp(vf_sub(vf_zero(), y2));
            const vf gelu = vf_bf16_round(vf_div(x, vf_add(e, vf_set1(1.0f))));
            store_bf16(o + j, vf_mul(gelu, load_bf16(u + j, I - j)), I - j);
        }
    }
    return 0;
}

/* Rotate `heads` vectors of length 2 * half at src (stride D between heads) into dst. */
static inline void rotate_heads(const bf16_t *src, bf16_t *dst, int64_t dst_stride,
                                int64_t heads, int64_t D, const bf16_t *c, const bf16_t *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        const bf16_t *x = src + h * D;
        bf16_t *o = dst + h * dst_stride;
        for (int64_t j = 0; j < half; j += W) {
            const int64_t n = half - j;
            vf x1 = load_bf16(x + j, n), x2 = load_bf16(x + half + j, n);
            vf cv = load_bf16(c + j, n), sv = load_bf16(s + j, n);
            store_bf16(o + j, vf_sub(vf_bf16_round(vf_mul(x1, cv)),
                                     vf_bf16_round(vf_mul(x2, sv))), n);
            store_bf16(o + half + j, vf_add(vf_bf16_round(vf_mul(x2, cv)),
                                            vf_bf16_round(vf_mul(x1, sv))), n);
        }
    }
}

/* qk: [M, heads + kv_heads, D] rows qk_row apart (queries then keys); v: [M, kv_heads, D]
   rows v_row apart; cos, sin: [M, D / 2] rows cs_row apart; slots: [M] cache slots;
   q_out: [M, heads, D]; k_cache, v_cache: [kv_heads, slots_per_head, D]. */
int rope_kv_bf16(const bf16_t *qk, int64_t qk_row, const bf16_t *v, int64_t v_row,
                 const bf16_t *cos, const bf16_t *sin, int64_t cs_row, const int64_t *slots,
                 bf16_t *q_out, bf16_t *k_cache, bf16_t *v_cache, int64_t M, int64_t heads,
                 int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    if (D % 2) return -1;
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *row = qk + m * qk_row, *c = cos + m * cs_row, *s = sin + m * cs_row;
        rotate_heads(row, q_out + m * heads * D, D, heads, D, c, s);
        rotate_heads(row + heads * D, k_cache + slots[m] * D, slots_per_head * D, kv_heads, D,
                     c, s);
        for (int64_t g = 0; g < kv_heads; g++) {
            const bf16_t *src = v + m * v_row + g * D;
            bf16_t *dst = v_cache + (g * slots_per_head + slots[m]) * D;
            for (int64_t j = 0; j < D; j++) dst[j] = src[j];
        }
    }
    return 0;
}

/* One K or V vector of D bf16 -> an int8 row: D values, then the float16 scale. */
static inline void quantize_row_q8(const bf16_t *x, int8_t *dst, int64_t D) {
    float amax = 0.f;
    for (int64_t j = 0; j < D; j++) {
        union { uint32_t u; float f; } w = {.u = (uint32_t)x[j] << 16};
        const float a = fabsf(w.f);
        amax = a > amax ? a : amax;
    }
    float ratio = amax / 127.f;
    ratio = ratio < 65504.f ? ratio : 65504.f;  /* float16's largest */
    const _Float16 scale16 = (_Float16)ratio;   /* nearest even, as torch rounds */
    const float scale = (float)scale16;
    for (int64_t j = 0; j < D; j++) {
        union { uint32_t u; float f; } w = {.u = (uint32_t)x[j] << 16};
        float q = scale > 0.f ? nearbyintf(w.f / scale) : 0.f;
        q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
        dst[j] = (int8_t)q;
    }
    memcpy(dst + D, &scale16, sizeof(scale16));
}

#define MAX_Q8_KV (64 * 256)  /* kv_heads x head_dim of one token's rotated keys */

/* rope_kv_bf16 with an int8 cache: k_cache, v_cache [kv_heads, slots_per_head, D + 2]. */
int rope_kv_q8_bf16(const bf16_t *qk, int64_t qk_row, const bf16_t *v, int64_t v_row,
                    const bf16_t *cos, const bf16_t *sin, int64_t cs_row, const int64_t *slots,
                    bf16_t *q_out, int8_t *k_cache, int8_t *v_cache, int64_t M, int64_t heads,
                    int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    if (D % 2 || kv_heads * D > MAX_Q8_KV) return -1;
    const int64_t row_bytes = D + (int64_t)sizeof(_Float16);
    #pragma omp parallel for schedule(static) if(M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        bf16_t keys[MAX_Q8_KV];
        const bf16_t *row = qk + m * qk_row, *c = cos + m * cs_row, *s = sin + m * cs_row;
        rotate_heads(row, q_out + m * heads * D, D, heads, D, c, s);
        rotate_heads(row + heads * D, keys, D, kv_heads, D, c, s);
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = (g * slots_per_head + slots[m]) * row_bytes;
            quantize_row_q8(keys + g * D, k_cache + at, D);
            quantize_row_q8(v + m * v_row + g * D, v_cache + at, D);
        }
    }
    return 0;
}

#else

int rope_kv_q8_bf16(const void *qk, int64_t qk_row, const void *v, int64_t v_row,
                    const void *cos, const void *sin, int64_t cs_row, const int64_t *slots,
                    void *q_out, void *k_cache, void *v_cache, int64_t M, int64_t heads,
                    int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    (void)qk; (void)qk_row; (void)v; (void)v_row; (void)cos; (void)sin; (void)cs_row;
    (void)slots; (void)q_out; (void)k_cache; (void)v_cache; (void)M; (void)heads;
    (void)kv_heads; (void)D; (void)slots_per_head;
    return -1;
}

int rope_kv_bf16(const void *qk, int64_t qk_row, const void *v, int64_t v_row,
                 const void *cos, const void *sin, int64_t cs_row, const int64_t *slots,
                 void *q_out, void *k_cache, void *v_cache, int64_t M, int64_t heads,
                 int64_t kv_heads, int64_t D, int64_t slots_per_head) {
    (void)qk; (void)qk_row; (void)v; (void)v_row; (void)cos; (void)sin; (void)cs_row;
    (void)slots; (void)q_out; (void)k_cache; (void)v_cache; (void)M; (void)heads;
    (void)kv_heads; (void)D; (void)slots_per_head;
    return -1;
}

int add_rms_norm_bf16(void *hidden, const void *delta, const void *weight, void *out,
                      int64_t M, int64_t H, float eps) {
    (void)hidden; (void)delta; (void)weight; (void)out; (void)M; (void)H; (void)eps;
    return -1;
}

int silu_mul_bf16(const void *gate_up, void *out, int64_t M, int64_t I) {
    (void)gate_up; (void)out; (void)M; (void)I;
    return -1;
}

int gemma_add_norm_bf16(void *hidden, const void *delta, const void *delta_weight,
                        const void *weight, void *out, int64_t M, int64_t H, float eps) {
    (void)hidden; (void)delta; (void)delta_weight; (void)weight; (void)out; (void)M; (void)H;
    (void)eps;
    return -1;
}

int gemma_head_norms_bf16(void *qkv, int64_t row, const void *q_weight, const void *k_weight,
                          int64_t M, int64_t heads, int64_t kv_heads, int64_t D, float eps) {
    (void)qkv; (void)row; (void)q_weight; (void)k_weight; (void)M; (void)heads;
    (void)kv_heads; (void)D; (void)eps;
    return -1;
}

int gelu_tanh_mul_bf16(const void *gate_up, void *out, int64_t M, int64_t I) {
    (void)gate_up; (void)out; (void)M; (void)I;
    return -1;
}

#endif
