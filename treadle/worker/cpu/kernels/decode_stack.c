/* Every decoder layer of a bf16 Llama-family model for a decode step, in one call.
 *
 * At the few rows of a decode step (one per request) each layer is ten kernel calls of a
 * few to a few hundred microseconds, and the Python between them (module calls, the
 * wrappers' checks, ctypes' argument conversion) cost about 2 ms of a 20 ms step of
 * SmolLM2-135M's 30 layers (docs/benchmarks.md, "A decode step without Python between
 * the kernels"). This driver runs the same kernels in the same order with the same
 * roundings, so its results are bit-identical to the layer-by-layer path:
 *
 *   x = rms_norm(h += down_prev)        add_rms_norm_bf16 (no add on the first layer)
 *   qkv = x . Wqkv^T (+ b)              gemm_bf16_vnni, gemv_bf16, gemm_bf16_amx or
 *                                       gemm_bf16_widen (by rows and packed copies, as
 *                                       NativeLayerOps.linear routes them)
 *   q = rope(q); cache <- rope(k), v    rope_kv_bf16
 *   a = attention(q, cache)             paged_decode_bf16 (its context split as the
 *                                       backend asks: decode_split)
 *   x = rms_norm(h += a . Wo^T (+ b))   gemv_bf16, add_rms_norm_bf16
 *   down = silu_mul(x . Wgu^T) . Wd^T   gemv_bf16, silu_mul_bf16, gemv_bf16
 *
 * and after the last layer out = final_norm(h += down). A linear whose weight is kept
 * quantized (--quantization: GGUF blocks or INT8) calls the quantized kernel of the path
 * the caller chose for this step's rows and that format (quant_dot.c, quant_amx_dot.c,
 * quant_amx.c, quant_gemv.c, quant_r16.c, quant_gemm_widen.c), as QuantizedLinear.apply
 * would. The caller checks that the
 * step qualifies (every row one decoded token, rows within the linear kernels' limits, a
 * bf16 cache, no sliding window, no adapters, one rank): see worker/decode_stack.py.
 *
 * decode_stack_gemma_bf16 (at the end) is Gemma 3's driver: the same linears, its own
 * norms, GeGLU, and per layer the tables, slots, pool, RoPE and window of its kind (global
 * or local): see worker/cpu/gemma_stack.py.
 */

#include <stdint.h>
#include <stdlib.h>

typedef uint16_t bf16_t;

/* The kernels this driver calls (gemv_bf16.c, norm_bf16.c, paged_decode.c). */
int gemv_bf16(const bf16_t *x, int64_t ldx, const bf16_t *w, const bf16_t *bias, bf16_t *y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int gemm_bf16_amx(const bf16_t *x, int64_t ldx, const bf16_t *w, const bf16_t *bias,
                  bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int gemm_bf16_widen(const bf16_t *x, int64_t ldx, const bf16_t *w, const bf16_t *bias,
                    bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int gemm_bf16_vnni(const bf16_t *x, int64_t ldx, const bf16_t *wp, const bf16_t *bias,
                   bf16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int add_rms_norm_bf16(bf16_t *hidden, const bf16_t *delta, const bf16_t *weight, bf16_t *out,
                      int64_t M, int64_t H, float eps);
int silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t M, int64_t I);
int rope_kv_bf16(const bf16_t *qk, int64_t qk_row, const bf16_t *v, int64_t v_row,
                 const bf16_t *cos, const bf16_t *sin, int64_t cs_row, const int64_t *slots,
                 bf16_t *q_out, bf16_t *k_cache, bf16_t *v_cache, int64_t M, int64_t heads,
                 int64_t kv_heads, int64_t D, int64_t slots_per_head);
/* The quantized kernels (quant_*.c): x and y bf16 here. */
int quant_gemv_dot(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                   int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int threads);
int quant_gemm_amx_dot(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                       const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                       int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int threads);
int quant_gemm_amx(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const uint16_t *x, int64_t ldx, const float *bias, void *y, int64_t ldy,
                   int y_bf16, int64_t M, int64_t N, int64_t K, int threads);
int quant_gemv_r16(int fmt, const uint8_t *packed, const float *scales, const void *x,
                   int64_t ldx, int x_bf16, const float *bias, void *y, int64_t ldy,
                   int y_bf16, int64_t M, int64_t N, int64_t K, int threads);
int quant_gemm_widen(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                     const uint16_t *x, int64_t ldx, const float *bias, uint16_t *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int quant_gemv_deq(int fmt, const uint8_t *w, int64_t row_bytes, const float *scales,
                   const void *x, int64_t ldx, int x_bf16, const float *bias, void *y,
                   int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int buffered,
                   int threads);
int paged_decode_bf16_fixed(const bf16_t *q, const bf16_t *k_cache, const bf16_t *v_cache,
                            const int64_t *block_table, const int64_t *ctx_lens, bf16_t *out,
                            int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t split_tokens);

/* The Gemma 3 layer kernels (norm_bf16.c) and the windowed decode attention
   (paged_decode.c: window 0 is the whole context). */
int gemma_add_norm_bf16(bf16_t *hidden, const bf16_t *delta, const bf16_t *delta_weight,
                        const bf16_t *weight, bf16_t *out, int64_t M, int64_t H, float eps);
int gemma_head_norms_bf16(bf16_t *qkv, int64_t row, const bf16_t *q_weight,
                          const bf16_t *k_weight, int64_t M, int64_t heads, int64_t kv_heads,
                          int64_t D, float eps);
int gelu_tanh_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t M, int64_t I);
int paged_decode_bf16_window(const bf16_t *q, const bf16_t *k_cache, const bf16_t *v_cache,
                             const int64_t *block_table, const int64_t *ctx_lens, bf16_t *out,
                             int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t num_blocks, int64_t block_size,
                             int64_t max_blocks, float scale, int64_t split_tokens,
                             int64_t window);

/* One linear layer's weight [N, K]: dense bf16 (fmt < 0; bias bf16 [N] or NULL; packed:
 * the packed GEMM's copy (gemm_bf16_vnni.c) or NULL) or quantized (fmt: quant_simd.h's
 * format number; w: N rows of row_bytes; packed: the r16 layout (quant_r16.c) or NULL;
 * scales: INT8's row scales, else NULL; bias fp32 [N] or NULL). */
typedef struct {
    const void *w, *bias;
    const float *scales;
    const uint8_t *packed;
    int64_t row_bytes, fmt;
} stack_linear;

/* One layer's parameters and cache, as the model holds them. */
typedef struct {
    const bf16_t *input_norm, *post_norm;       /* [H] */
    stack_linear qkv;                            /* [(heads + 2 kv_heads) D, H] */
    stack_linear o;                              /* [H, heads D] */
    stack_linear gate_up;                        /* [2 I, H] */
    stack_linear down;                           /* [H, I] */
    bf16_t *k_cache, *v_cache;                   /* [kv_heads, num_blocks, block_size, D] */
} decode_layer;

/* Quantized kernel paths, as worker/decode_stack.py numbers them. */
enum { QP_DOT = 0, QP_AMX_DOT = 1, QP_AMX = 2, QP_DEQ = 3, QP_DEQ_BUFFERED = 4, QP_R16 = 5,
       QP_GEMM = 6 };
#define NUM_QUANT_FORMATS 5

/* The model's sizes (one rank holds the whole model). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
    int64_t amx_first, amx_last;  /* rows the AMX tile kernel takes (0, 0: none) */
    int64_t widen_first;          /* rows from which the widening GEMM takes (0: none) */
    int64_t vnni;                 /* 1: dense linears on their packed copies, every row */
    int64_t quant_path[NUM_QUANT_FORMATS];  /* this step's path per quantized format */
    float eps, scale;
    int64_t decode_split;         /* the attention's context ranges (paged_decode.c's
                                     split_tokens: negative as the batch suits) */
} decode_dims;

/* One linear, y [M, N] rows N apart. Dense: on the packed GEMM where the caller enabled
 * it (every dense weight has its copy), on AMX tiles where the caller enabled them for
 * these rows (it checked the shapes), the widening GEMM from the rows the caller gave,
 * else the dot-product kernel. Quantized: the path the caller chose for this format and
 * these rows. */
static int linear(const decode_dims *d, const bf16_t *x, int64_t ldx, const stack_linear *L,
                  bf16_t *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (L->fmt < 0) {
        if (d->vnni)
            return L->packed ? gemm_bf16_vnni(x, ldx, (const bf16_t *)L->packed, L->bias, y,
                                              N, M, N, K, threads) : -1;
        if (M >= d->amx_first && M <= d->amx_last)
            return gemm_bf16_amx(x, ldx, L->w, L->bias, y, N, M, N, K, threads);
        if (d->widen_first && M >= d->widen_first)
            return gemm_bf16_widen(x, ldx, L->w, L->bias, y, N, M, N, K, threads);
        return gemv_bf16(x, ldx, L->w, L->bias, y, N, M, N, K, threads);
    }
    if (L->fmt >= NUM_QUANT_FORMATS) return -1;
    const int fmt = (int)L->fmt;
    switch (d->quant_path[fmt]) {
    case QP_DOT:
        return quant_gemv_dot(fmt, L->w, L->row_bytes, L->scales, x, ldx, 1, L->bias, y, N, 1,
                              M, N, K, threads);
    case QP_AMX_DOT:
        return quant_gemm_amx_dot(fmt, L->w, L->row_bytes, L->scales, x, ldx, 1, L->bias, y,
                                  N, 1, M, N, K, threads);
    case QP_AMX:
        return quant_gemm_amx(fmt, L->w, L->row_bytes, L->scales, x, ldx, L->bias, y, N, 1,
                              M, N, K, threads);
    case QP_R16:
        if (!L->packed) return -1;
        return quant_gemv_r16(fmt, L->packed, L->scales, x, ldx, 1, L->bias, y, N, 1, M, N, K,
                              threads);
    case QP_GEMM:
        return quant_gemm_widen(fmt, L->w, L->row_bytes, L->scales, x, ldx, L->bias, y, N, M, N,
                                K, threads);
    case QP_DEQ:
    case QP_DEQ_BUFFERED:
        return quant_gemv_deq(fmt, L->w, L->row_bytes, L->scales, x, ldx, 1, L->bias, y, N,
                              1, M, N, K, d->quant_path[fmt] == QP_DEQ_BUFFERED, threads);
    default:
        return -1;
    }
}

/* hidden [M, H]: the embedded tokens, updated in place into the residual stream; out
 * [M, H]: final_norm of it. cos, sin: [M, D / 2] rows cs_row apart; slots [M];
 * block_table [M, max_blocks]; ctx_lens [M]. Returns 0, or the first kernel's non-zero
 * status (-2: out of memory), in which case the caches may hold this step's keys. */
int decode_stack_bf16(const decode_layer *layers, int64_t num_layers, const decode_dims *d,
                      const bf16_t *final_norm, bf16_t *hidden, bf16_t *out, int64_t M,
                      const bf16_t *cos, const bf16_t *sin, int64_t cs_row,
                      const int64_t *slots, const int64_t *block_table, int64_t max_blocks,
                      const int64_t *ctx_lens, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, I = d->intermediate;
    const int64_t q_size = d->heads * D, qkv_n = (d->heads + 2 * d->kv_heads) * D;
    const int64_t slots_per_head = d->num_blocks * d->block_size;
    bf16_t *buf = malloc(sizeof(bf16_t) * M * (H + qkv_n + 2 * q_size + H + 3 * I));
    if (!buf) return -2;
    bf16_t *x = buf, *qkv = x + M * H, *q = qkv + M * qkv_n, *attn = q + M * q_size;
    bf16_t *delta = attn + M * q_size, *gate_up = delta + M * H, *act = gate_up + 2 * M * I;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const decode_layer *L = &layers[l];
        status = add_rms_norm_bf16(hidden, l ? delta : 0, L->input_norm, x, M, H, d->eps);
        if (!status)
            status = linear(d, x, H, &L->qkv, qkv, M, qkv_n, H, threads);
        if (!status)
            status = rope_kv_bf16(qkv, qkv_n, qkv + q_size + d->kv_heads * D, qkv_n, cos, sin,
                                  cs_row, slots, q, L->k_cache, L->v_cache, M, d->heads,
                                  d->kv_heads, D, slots_per_head);
        if (!status)
            status = paged_decode_bf16_fixed(q, L->k_cache, L->v_cache, block_table, ctx_lens,
                                             attn, M, d->heads, d->kv_heads, D, d->num_blocks,
                                             d->block_size, max_blocks, d->scale,
                                             d->decode_split);
        if (!status)
            status = linear(d, attn, q_size, &L->o, delta, M, H, q_size, threads);
        if (!status)
            status = add_rms_norm_bf16(hidden, delta, L->post_norm, x, M, H, d->eps);
        if (!status)
            status = linear(d, x, H, &L->gate_up, gate_up, M, 2 * I, H, threads);
        if (!status) status = silu_mul_bf16(gate_up, act, M, I);
        if (!status)
            status = linear(d, act, I, &L->down, delta, M, H, I, threads);
    }
    if (!status)
        status = add_rms_norm_bf16(hidden, num_layers ? delta : 0, final_norm, out, M, H,
                                   d->eps);
    free(buf);
    return status;
}


/* ---- Gemma 3 (models/gemma3.py) ------------------------------------------------------ */

/* One Gemma 3 layer: four norms around its two sublayers, per-head q/k norms, GeGLU, and
 * its kind's view of the step (kind 0: global layers, the full KV group; 1: local layers,
 * the sliding group with its own tables, slots, pool and RoPE base). */
typedef struct {
    const bf16_t *input_norm, *post_attn_norm, *pre_ffw_norm, *post_ffw_norm;  /* [H] */
    const bf16_t *q_norm, *k_norm;               /* [D] */
    stack_linear qkv, o, gate_up, down;
    bf16_t *k_cache, *v_cache;                   /* [kv_heads, num_blocks, block_size, D] */
    int64_t num_blocks;                          /* this layer's cache blocks */
    int64_t window;                              /* 0: the whole context */
    int64_t kind;
} gemma_layer;

/* What one kind of layer reads of the step. */
typedef struct {
    const bf16_t *cos, *sin;                     /* [M, D / 2], rows cs_row apart */
    const int64_t *slots;                        /* [M] */
    const int64_t *block_table;                  /* [M, max_blocks] */
    int64_t cs_row, max_blocks;
} gemma_step_kind;

/* The Gemma 3 decode step, the order and kernels of Gemma3DecoderLayer.forward with the
 * native ops (so bit-identical to it):
 *
 *   x = gemma_norm_in(h += post_ffw_norm(down_prev))   gemma_add_norm_bf16
 *   qkv = x . Wqkv^T; q, k = head norms (in place)     linear, gemma_head_norms_bf16
 *   q = rope(q); cache <- rope(k), v                   rope_kv_bf16 (its kind's tables)
 *   a = attention(q, cache) within the layer's window  paged_decode_bf16_window
 *   x = pre_ffw_norm(h += post_attn_norm(a . Wo^T))    linear, gemma_add_norm_bf16
 *   down = gelu_tanh_mul(x . Wgu^T) . Wd^T             linear, gelu_tanh_mul_bf16, linear
 *
 * and out = final_norm(h += post_ffw_norm(down)). hidden: the scaled embeddings [M, H],
 * updated into the residual stream. Returns 0 or the first failing kernel's status. */
int decode_stack_gemma_bf16(const gemma_layer *layers, int64_t num_layers,
                            const decode_dims *d, const bf16_t *final_norm, bf16_t *hidden,
                            bf16_t *out, int64_t M, const gemma_step_kind *kinds,
                            const int64_t *ctx_lens, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, I = d->intermediate;
    const int64_t q_size = d->heads * D, qkv_n = (d->heads + 2 * d->kv_heads) * D;
    bf16_t *buf = malloc(sizeof(bf16_t) * M * (H + qkv_n + 2 * q_size + H + 3 * I));
    if (!buf) return -2;
    bf16_t *x = buf, *qkv = x + M * H, *q = qkv + M * qkv_n, *attn = q + M * q_size;
    bf16_t *delta = attn + M * q_size, *gate_up = delta + M * H, *act = gate_up + 2 * M * I;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const gemma_layer *L = &layers[l];
        const gemma_step_kind *K = &kinds[L->kind];
        status = gemma_add_norm_bf16(hidden, l ? delta : 0, l ? layers[l - 1].post_ffw_norm : 0,
                                     L->input_norm, x, M, H, d->eps);
        if (!status)
            status = linear(d, x, H, &L->qkv, qkv, M, qkv_n, H, threads);
        if (!status)
            status = gemma_head_norms_bf16(qkv, qkv_n, L->q_norm, L->k_norm, M, d->heads,
                                           d->kv_heads, D, d->eps);
        if (!status)
            status = rope_kv_bf16(qkv, qkv_n, qkv + q_size + d->kv_heads * D, qkv_n, K->cos,
                                  K->sin, K->cs_row, K->slots, q, L->k_cache, L->v_cache, M,
                                  d->heads, d->kv_heads, D, L->num_blocks * d->block_size);
        if (!status)
            status = paged_decode_bf16_window(q, L->k_cache, L->v_cache, K->block_table,
                                              ctx_lens, attn, M, d->heads, d->kv_heads, D,
                                              L->num_blocks, d->block_size, K->max_blocks,
                                              d->scale, d->decode_split, L->window);
        if (!status)
            status = linear(d, attn, q_size, &L->o, delta, M, H, q_size, threads);
        if (!status)
            status = gemma_add_norm_bf16(hidden, delta, L->post_attn_norm, L->pre_ffw_norm, x,
                                         M, H, d->eps);
        if (!status)
            status = linear(d, x, H, &L->gate_up, gate_up, M, 2 * I, H, threads);
        if (!status) status = gelu_tanh_mul_bf16(gate_up, act, M, I);
        if (!status)
            status = linear(d, act, I, &L->down, delta, M, H, I, threads);
    }
    if (!status)
        status = gemma_add_norm_bf16(hidden, num_layers ? delta : 0,
                                     num_layers ? layers[num_layers - 1].post_ffw_norm : 0,
                                     final_norm, out, M, H, d->eps);
    free(buf);
    return status;
}
