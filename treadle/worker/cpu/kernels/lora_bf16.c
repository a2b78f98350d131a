/* LoRA terms of a linear layer for every adapter segment of a flat batch in one call (in
 * the spirit of Punica's SGMV), bf16 in memory, fp32 in registers:
 *
 *     t = x[rows] . A^T                                   (shrink: A [R, K], the parts'
 *                                                          A matrices stacked)
 *     y[rows, part columns] = bf16(y + t[:, part ranks] . Bt_part)   for each part (expand)
 *
 * in place on y, the output of the layer's base matmul. A fused layer (q/k/v, gate/up)
 * has up to LORA_MAX_PARTS parts sharing one shrink. t stays in fp32 and each output is
 * rounded to bf16 once, after its whole term is added (torch's path does the same in
 * fp32: worker/lora/layers.py).
 *
 * A segment is LORA_SEG_FIELDS int64: row0, nrows, A (address), R, nparts, then per part
 * col0, ncols, r0, rank, Bt (address of B_part transposed: [rank, ncols], dense rows).
 * Work is split in tasks of up to LORA_ROWS rows of one segment (OpenMP, dynamic): the
 * shrink reads each row of A once for the task's rows, the expand each row of Bt once.
 *
 * Written on the vectors of simd.h (AVX-512 or AVX2 + FMA); elsewhere lora_bf16 returns
 * -1 and the LoRA layers use torch.
 */

#include <stdint.h>
#include <stdlib.h>

#include "omp_team.h"
#include "simd.h"

#define LORA_MAX_PARTS 3
#define LORA_SEG_FIELDS (5 + 5 * LORA_MAX_PARTS)
#define LORA_ROWS 4
#define LORA_MAX_R 1536 /* stacked rank of one segment: 3 parts of rank <= 512 */

int lora_seg_fields(void) { return LORA_SEG_FIELDS; }
int lora_max_stacked_rank(void) { return LORA_MAX_R; }

#if SIMD_WIDTH
#define W SIMD_WIDTH

typedef uint16_t bf16_t;

static inline vf load_bf16(const bf16_t *p, int64_t remaining) {
    return remaining >= W ? vf_bf16_load(p) : vf_bf16_load_n(p, remaining);
}

/* t[m * LORA_MAX_R + r] = x[m] . A[r] for m < mt, r < R, in fp32. Two ranks at a time
 * for all rows: 2 x LORA_ROWS accumulators, each row of x loaded once per pair. */
static void shrink(const bf16_t *x, int64_t ldx, int mt, const bf16_t *a, int64_t R,
                   int64_t K, float *t) {
    for (int64_t r = 0; r < R; r += 2) {
        const int two = r + 1 < R;
        const bf16_t *a0 = a + r * K, *a1 = a + (r + two) * K;
        vf acc0[LORA_ROWS], acc1[LORA_ROWS];
        for (int m = 0; m < LORA_ROWS; m++) acc0[m] = acc1[m] = vf_zero();
        for (int64_t k = 0; k < K; k += W) {
            vf w0 = load_bf16(a0 + k, K - k), w1 = load_bf16(a1 + k, K - k);
            for (int m = 0; m < mt; m++) {
                vf xv = load_bf16(x + m * ldx + k, K - k);
                acc0[m] = vf_fmadd(xv, w0, acc0[m]);
                acc1[m] = vf_fmadd(xv, w1, acc1[m]);
            }
        }
        for (int m = 0; m < mt; m++) {
            t[m * LORA_MAX_R + r] = vf_reduce_add(acc0[m]);
            if (two) t[m * LORA_MAX_R + r + 1] = vf_reduce_add(acc1[m]);
        }
    }
}

/* y[m, col0 + j] = bf16(y + sum_r t[m][r0 + r] * Bt[r, j]) for m < mt, j < ncols: two
 * column vectors at a time for all rows, each vector of Bt loaded once for the rows. */
static void expand(const float *t, int mt, int64_t r0, int64_t rank, const bf16_t *bt,
                   int64_t ncols, bf16_t *y, int64_t ldy, int64_t col0) {
    y += col0;
    for (int64_t j = 0; j < ncols; j += 2 * W) {
        const int64_t left0 = ncols - j, left1 = left0 - W;
        vf acc0[LORA_ROWS], acc1[LORA_ROWS];
        for (int m = 0; m < LORA_ROWS; m++) acc0[m] = acc1[m] = vf_zero();
        for (int64_t r = 0; r < rank; r++) {
            const bf16_t *row = bt + r * ncols + j;
            vf b0 = load_bf16(row, left0);
            vf b1 = left1 > 0 ? load_bf16(row + W, left1) : vf_zero();
            for (int m = 0; m < mt; m++) {
                vf tv = vf_set1(t[m * LORA_MAX_R + r0 + r]);
                acc0[m] = vf_fmadd(tv, b0, acc0[m]);
                acc1[m] = vf_fmadd(tv, b1, acc1[m]);
            }
        }
        for (int m = 0; m < mt; m++) {
            bf16_t *out = y + m * ldy + j;
            vf v0 = vf_add(load_bf16(out, left0), acc0[m]);
            if (left0 >= W) vf_bf16_store(out, v0);
            else vf_bf16_store_n(out, v0, left0);
            if (left1 > 0) {
                vf v1 = vf_add(load_bf16(out + W, left1), acc1[m]);
                if (left1 >= W) vf_bf16_store(out + W, v1);
                else vf_bf16_store_n(out + W, v1, left1);
            }
        }
    }
}

/* Apply every segment's LoRA term to y in place. threads <= 0: OpenMP's default.
 * Returns 0, or -1 when a segment's stacked rank exceeds LORA_MAX_R, it has too many
 * parts, or the task list cannot be allocated. */
int lora_bf16(const bf16_t *x, int64_t ldx, int64_t K, bf16_t *y, int64_t ldy,
              const int64_t *segs, int64_t num_segs, int threads) {
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t *seg = segs + s * LORA_SEG_FIELDS;
        if (seg[3] > LORA_MAX_R || seg[4] > LORA_MAX_PARTS) return -1;
        if (seg[4] > 0 && seg[1] > 0) num_tasks += (seg[1] + LORA_ROWS - 1) / LORA_ROWS;
    }
    if (num_tasks == 0) return 0;
    int64_t *task = malloc(sizeof(int64_t) * 2 * num_tasks);
    if (!task) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t *seg = segs + s * LORA_SEG_FIELDS;
        if (seg[4] <= 0 || seg[1] <= 0) continue;
        for (int64_t r = 0; r < seg[1]; r += LORA_ROWS) {
            task[2 * n] = s;
            task[2 * n + 1] = r;
            n++;
        }
    }
    threads = team_size(threads, num_tasks);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if(threads > 1)
    for (int64_t i = 0; i < num_tasks; i++) {
        const int64_t *seg = segs + task[2 * i] * LORA_SEG_FIELDS;
        const int64_t first = seg[0] + task[2 * i + 1];
        const int64_t left = seg[1] - task[2 * i + 1];
        const int mt = left < LORA_ROWS ? (int)left : LORA_ROWS;
        float t[LORA_ROWS * LORA_MAX_R];
        shrink(x + first * ldx, ldx, mt, (const bf16_t *)(intptr_t)seg[2], seg[3], K, t);
        for (int64_t p = 0; p < seg[4]; p++) {
            const int64_t *part = seg + 5 + 5 * p;
            expand(t, mt, part[2], part[3], (const bf16_t *)(intptr_t)part[4], part[1],
                   y + first * ldy, ldy, part[0]);
        }
    }
    free(task);
    return 0;
}

#else

int lora_bf16(const void *x, int64_t ldx, int64_t K, void *y, int64_t ldy,
              const int64_t *segs, int64_t num_segs, int threads) {
    (void)x; (void)ldx; (void)K; (void)y; (void)ldy; (void)segs; (void)num_segs;
    (void)threads;
    return -1;
}

#endif
