/* Paged attention for decode tokens (one query token per request), on CPU.
 *
 * For each (request, KV head) pair, in parallel: walk the request's blocks once,
 * score the GQA group's query heads against each block's keys, and fold the block
 * into an online softmax (running max, running sum, running weighted values).
 * Every K/V byte is read exactly once, with no gathered copy and no padding.
 *
 * Layouts (contiguous):
 *   q, out        [num_reqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim]
 *   block_table   [num_reqs, max_blocks] (int64), ctx_lens [num_reqs] (int64)
 * Built at run time by treadle/worker/native.py; T is float or bfloat16 (uint16_t).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                          \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_table,      \
         const int64_t *ctx_lens, T *out, int64_t num_reqs, int64_t num_heads,             \
         int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,   \
         int64_t max_blocks, float scale) {                                                \
    const int64_t group = num_heads / num_kv_heads;                                        \
    if (group > MAX_GROUP || group * head_dim > MAX_GROUP_DIM                              \
        || group * block_size > MAX_GROUP_TOKENS)                                          \
        return 1;                                                                          \
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
            for (int64_t start = 0; start < ctx; start += block_size) {                    \
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;     \
                const int64_t block = block_table[r * max_blocks + start / block_size];    \
                const int64_t base = ((h * num_blocks + block) * block_size) * head_dim;   \
                const T *kb = k_cache + base, *vb = v_cache + base;                        \
                for (int64_t t = 0; t < n; t++) {                                          \
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
                    float block_max = sg[0];                                               \
                    for (int64_t t = 1; t < n; t++) block_max = sg[t] > block_max ? sg[t] : block_max; \
                    const float new_max = block_max > run_max[g] ? block_max : run_max[g]; \
                    const float correction = expf(run_max[g] - new_max);                   \
                    float block_sum = 0.f;                                                 \
                    for (int64_t t = 0; t < n; t++) {                                      \
                        sg[t] = expf(sg[t] - new_max);                                     \
                        block_sum += sg[t];                                                \
                    }                                                                      \
                    run_sum[g] = run_sum[g] * correction + block_sum;                      \
                    run_max[g] = new_max;                                                  \
                    float *ag = acc + g * head_dim;                                        \
                    for (int64_t d = 0; d < head_dim; d++) ag[d] *= correction;            \
                }                                                                          \
                for (int64_t t = 0; t < n; t++) {                                          \
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

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_PAGED_DECODE(paged_decode_f32, float, f32_load, f32_store)
