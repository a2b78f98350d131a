/* Sampling of one token per row of logits, and the logprobs of raw logits, on CPU.
 *
 * sample_rows: each row (rows in parallel, one thread per row at a time) reads its
 * logits from memory once and then works on its own copy in cache:
 *   1. the max by blocks (and the first index of it: a greedy row stops here);
 *   2. weights w = exp((x - max) / T) into a per-thread buffer, so the most likely token
 *      weighs exactly 1;
 *   3. top-k, then top-p, as a cut on the logit: a token is kept when the tokens with a
 *      strictly larger logit number fewer than k (top-k) or weigh less than top_p of the
 *      top-k set's weight (top-p), so equal logits are kept or dropped together. A
 *      histogram of counts or weights over buckets of the logit finds the bucket that
 *      holds the cut; a selection over that bucket's entries alone finds the cut exactly;
 *   4. min-p: tokens weighing less than min_p are dropped;
 *   5. the inverse CDF of the kept weights at the row's uniform number u: block sums
 *      choose a block, a scan of that block the token.
 * The logits are not modified.
 *
 * probs_rows: the same filtering, then each row's whole distribution written out (the
 * probabilities speculative decoding's rejection sampler compares).
 *
 * logprob_rows: per chosen row of raw logits, the log-sum-exp, the rank of a token (how
 * many tokens are at least as likely) and the num_top most likely tokens.
 *
 * This file is compiled WITHOUT -ffast-math: masked tokens are -inf and must weigh
 * exactly 0, which fast-math's no-infinities assumption would not guarantee. Reductions
 * still vectorize through `omp simd reduction`, and exp is a vectorizable polynomial.
 * Built at run time by treadle/worker/native.py.
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define BLOCK 1024        /* entries per block of the max and the inverse CDF */
#define NUM_BUCKETS 1024  /* histogram buckets of the cut search */
#define LANES 4           /* interleaved histograms: repeated buckets do not serialize */
#define LOG_WEIGHT_SPAN 40.0f /* buckets cover at most this much log-weight below the max */
#define DIRECT_SELECT 16384 /* fewer candidates than this: select among them directly */
#define CHUNK 64          /* entries per any-of check when gathering sparse entries */
#define SAMPLE 1024       /* logits sampled to estimate a small top-k's cut */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp), exactly 0 below -87 and for
   -inf. Branch-free, so loops calling it vectorize. */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : y * scale.f;
}

/* Per-thread buffers, kept across calls (the OpenMP threads persist). */
typedef struct {
    int64_t capacity;
    float *w;           /* [V] weights */
    int16_t *bucket;    /* [V] histogram bucket of each entry */
    float *slots;       /* 3 x (keys [V], weights [V]) for the selection */
    double *block_sums; /* [V / BLOCK + 1] */
    int32_t *cand;      /* [V] indices of listed candidates, in order */
} Scratch;

static __thread Scratch tls_scratch;

static Scratch *scratch_for(int64_t vocab) {
    Scratch *s = &tls_scratch;
    if (s->capacity >= vocab) return s;
    free(s->w); free(s->bucket); free(s->slots); free(s->block_sums); free(s->cand);
    s->w = malloc(sizeof(float) * vocab);
    s->bucket = malloc(sizeof(int16_t) * vocab);
    s->slots = malloc(sizeof(float) * 6 * vocab);
    s->block_sums = malloc(sizeof(double) * (vocab / BLOCK + 1));
    s->cand = malloc(sizeof(int32_t) * (vocab + 16));
    if (!s->w || !s->bucket || !s->slots || !s->block_sums || !s->cand) {
        free(s->w); free(s->bucket); free(s->slots); free(s->block_sums); free(s->cand);
        memset(s, 0, sizeof(*s));
        return NULL;
    }
    s->capacity = vocab;
    return s;
}

/* Max of x and the first index holding it; also the smallest finite entry. */
static void row_max(const float *x, int64_t vocab, float *max_out, int64_t *arg_out,
                    float *min_out) {
    float m = -INFINITY, lo = INFINITY;
    int64_t best = 0;
    for (int64_t b0 = 0; b0 < vocab; b0 += BLOCK) {
        const int64_t b1 = min64(b0 + BLOCK, vocab);
        float bm = -INFINITY, bl = INFINITY;
        #pragma omp simd reduction(max:bm) reduction(min:bl)
        for (int64_t i = b0; i < b1; i++) {
            const float v = x[i];
            bm = v > bm ? v : bm;
            const float f = v > -INFINITY ? v : INFINITY;
            bl = f < bl ? f : bl;
        }
        if (bm > m) { m = bm; best = b0; }
        lo = bl < lo ? bl : lo;
    }
    int64_t arg = best;
    for (int64_t i = best; i < min64(best + BLOCK, vocab); i++)
        if (x[i] == m) { arg = i; break; }
    *max_out = m;
    *arg_out = arg;
    *min_out = lo;
}

/* Among n candidates (key, weight; weight NULL: each weighs 1), with `above` the weight
   of the tokens outside them with larger keys, the smallest key v kept under "the keys
   greater than v weigh less than limit"; NAN when none is. The candidates are in slot
   `first` of three. Quickselect by weight with a three-way split (the first pivot is
   `hint` unless NAN); partitions are written out of place, branch-free, into the two
   free slots. */
static float select_kept(float *slots, int64_t capacity, int first, int64_t n,
                         double above, double limit, int unit, float hint) {
    int in = first, g = (first + 1) % 3, l = (first + 2) % 3;
    float best = NAN;
    uint32_t state = 2463534242u ^ (uint32_t)n;
    while (n > 0) {
        float *k = slots + 2 * in * capacity, *w = k + capacity;
        float *gk = slots + 2 * g * capacity, *gw = gk + capacity;
        float *lk = slots + 2 * l * capacity, *lw = lk + capacity;
        float c[3];
        for (int j = 0; j < 3; j++) {
            state ^= state << 13; state ^= state >> 17; state ^= state << 5;
            c[j] = k[state % (uint32_t)n];
        }
        float p = c[0] < c[1] ? (c[1] < c[2] ? c[1] : (c[0] < c[2] ? c[2] : c[0]))
                              : (c[0] < c[2] ? c[0] : (c[1] < c[2] ? c[2] : c[1]));
        if (!isnan(hint)) { p = hint; hint = NAN; }
        int64_t ng = 0, nl = 0;
        for (int64_t i = 0; i < n; i++) {
            const float v = k[i], wt = w[i];
            gk[ng] = v; gw[ng] = wt; ng += v > p;
            lk[nl] = v; lw[nl] = wt; nl += v < p;
        }
        double mg = 0.0, me = 0.0;
        if (unit) {
            mg = (double)ng;
            me = (double)(n - ng - nl);
        } else {
            #pragma omp simd reduction(+:mg)
            for (int64_t i = 0; i < ng; i++) mg += gw[i];
            #pragma omp simd reduction(+:me)
            for (int64_t i = 0; i < n; i++) me += k[i] == p ? (double)w[i] : 0.0;
        }
        if (above + mg >= limit) {       /* p and everything below it are out */
            const int t = in; in = g; g = t;
            n = ng;
        } else {
            best = p;
            if (above + mg + me >= limit) break;
            above += mg + me;
            const int t = in; in = l; l = t;
            n = nl;
        }
    }
    return best;
}

/* The cut c such that keeping {x >= c} among the entries with x >= floor keeps exactly
   the tokens whose larger-logit tokens (from floor) weigh less than limit (w NULL: number
   fewer than limit). m: the row's max; span: the logit distance the buckets cover. */
static float find_cut(const float *x, const float *w, int64_t vocab, float m, float span,
                      float floor_, double limit, Scratch *s) {
    const float scale = span > 0.0f && span < INFINITY ? (NUM_BUCKETS - 1) / span : 0.0f;
    int16_t *bucket = s->bucket;
    static const int16_t skip = NUM_BUCKETS; /* below floor: in no bucket */
    #pragma omp simd
    for (int64_t i = 0; i < vocab; i++) {
        const float d = (m - x[i]) * scale;   /* monotone in x: equal logits, one bucket */
        const int16_t b = d < (float)(NUM_BUCKETS - 1) ? (int16_t)d : NUM_BUCKETS - 1;
        bucket[i] = x[i] >= floor_ ? b : skip;
    }
    double hist[NUM_BUCKETS + 1];
    if (w == NULL) {
        int32_t count[LANES][NUM_BUCKETS + 1];
        memset(count, 0, sizeof(count));
        int64_t i = 0;
        for (; i + LANES <= vocab; i += LANES)
            for (int l = 0; l < LANES; l++) count[l][bucket[i + l]]++;
        for (; i < vocab; i++) count[0][bucket[i]]++;
        for (int b = 0; b < NUM_BUCKETS; b++)
            hist[b] = (double)count[0][b] + count[1][b] + count[2][b] + count[3][b];
    } else {
        double lanes[LANES][NUM_BUCKETS + 1];
        memset(lanes, 0, sizeof(lanes));
        int64_t i = 0;
        for (; i + LANES <= vocab; i += LANES)
            for (int l = 0; l < LANES; l++) lanes[l][bucket[i + l]] += w[i + l];
        for (; i < vocab; i++) lanes[0][bucket[i]] += w[i];
        for (int b = 0; b < NUM_BUCKETS; b++)
            hist[b] = (lanes[0][b] + lanes[1][b]) + (lanes[2][b] + lanes[3][b]);
    }
    double above = 0.0;
    int cut_bucket = -1;
    for (int b = 0; b < NUM_BUCKETS; b++) {
        if (above + hist[b] >= limit) { cut_bucket = b; break; }
        above += hist[b];
    }
    if (cut_bucket < 0) return floor_; /* all kept (the limit is not reached) */

    /* The cut bucket's entries into slot 0. */
    float *keys = s->slots, *wts = keys + s->capacity;
    int64_t n = 0;
    float top = -INFINITY;
    for (int64_t c0 = 0; c0 < vocab; c0 += CHUNK) {
        const int64_t c1 = min64(c0 + CHUNK, vocab);
        int any = 0;
        #pragma omp simd reduction(|:any)
        for (int64_t i = c0; i < c1; i++) any |= bucket[i] == cut_bucket;
        if (!any) continue;
        for (int64_t i = c0; i < c1; i++) {
            if (bucket[i] != cut_bucket) continue;
            keys[n] = x[i];
            wts[n] = w ? w[i] : 1.0f;
            top = x[i] > top ? x[i] : top;
            n++;
        }
    }
    const float kept = select_kept(s->slots, s->capacity, 0, n, above, limit, w == NULL, NAN);
    /* None of the bucket kept: the cut is just above it (every larger bucket is kept). */
    return isnan(kept) ? nextafterf(top, INFINITY) : kept;
}

/* The indices of the entries with a[i] >= t, in order, into cand; returns how many.
   `dense`: many are expected (branch-free); otherwise chunks without one are skipped. */
static int64_t gather_at_least(const float *a, int64_t vocab, float t, int32_t *cand,
                               int dense) {
    int64_t n = 0;
#ifdef __AVX512F__
    /* Compress in a register, then a full store (cand has 16 entries of slack): a
       compressing store to memory is slow on some CPUs. */
    const __m512 vt = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), vt, _CMP_GE_OQ);
        if (k) {
            _mm512_storeu_si512((void *)(cand + n), _mm512_maskz_compress_epi32(k, idx));
            n += __builtin_popcount((unsigned)k);
        }
        idx = _mm512_add_epi32(idx, step);
    }
    for (; i < vocab; i++)
        if (a[i] >= t) cand[n++] = (int32_t)i;
    (void)dense;
    return n;
#endif
    if (dense) {
        for (int64_t i = 0; i < vocab; i++) {
            cand[n] = (int32_t)i;
            n += a[i] >= t;
        }
        return n;
    }
    for (int64_t c0 = 0; c0 < vocab; c0 += CHUNK) {
        const int64_t c1 = min64(c0 + CHUNK, vocab);
        int any = 0;
        #pragma omp simd reduction(|:any)
        for (int64_t i = c0; i < c1; i++) any |= a[i] >= t;
        if (!any) continue;
        for (int64_t i = c0; i < c1; i++)
            if (a[i] >= t) cand[n++] = (int32_t)i;
    }
    return n;
}

/* The listed entries with x >= floor into a slot (keys; weights w, or 1 when w is NULL);
   returns how many, and their weight in *z. */
static int64_t load_listed(const float *x, const float *w, const int32_t *cand, int64_t n,
                           float floor_, Scratch *s, int slot, double *z) {
    float *keys = s->slots + 2 * slot * s->capacity, *wts = keys + s->capacity;
    int64_t count = 0;
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) { /* branch-free */
        const int32_t i = cand[j];
        const float wi = w ? w[i] : 1.0f;
        const int in = x[i] >= floor_;
        keys[count] = x[i];
        wts[count] = wi;
        total += wi * (float)in;
        count += in;
    }
    *z = total;
    return count;
}

/* The entries with x >= floor compacted into slot 1 (keys, weights), for a histogram
   over them alone; returns how many. */
static int64_t compact_at_least(const float *x, const float *w, int64_t vocab, float floor_,
                                Scratch *s) {
    float *keys = s->slots + 2 * s->capacity, *wts = keys + s->capacity;
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; i++) {
        keys[n] = x[i];
        wts[n] = w[i];
        n += x[i] >= floor_;
    }
    return n;
}

/* top-k's cut: the k-th largest logit (ties kept). A small k first tries a bound estimated
   from a strided sample of the row, low enough that it almost surely leaves at least k
   entries above it, lists those (*listed: how many, or -1 when it took the histogram)
   and selects among them; otherwise, a histogram. */
static float top_k_cut(const float *x, int64_t vocab, float m, float span, int64_t k,
                       Scratch *s, int64_t *listed) {
    *listed = -1;
    const double expected = (double)k * SAMPLE / (double)vocab;
    const int64_t rank = (int64_t)(expected + 4.0 * sqrt(expected) + 3.0);
    if (vocab >= 8 * SAMPLE && rank * 16 <= SAMPLE) {
        float *keys = s->slots, *wts = keys + s->capacity;
        const int64_t stride = vocab / SAMPLE;
        for (int64_t j = 0; j < SAMPLE; j++) { keys[j] = x[j * stride]; wts[j] = 1.0f; }
        const float t = select_kept(s->slots, s->capacity, 0, SAMPLE, 0.0, (double)rank, 1, NAN);
        int64_t count = 0;
        #pragma omp simd reduction(+:count)
        for (int64_t i = 0; i < vocab; i++) count += x[i] >= t;
        if (count >= k && count <= DIRECT_SELECT) {
            *listed = gather_at_least(x, vocab, t, s->cand, count * CHUNK > vocab);
            double unused;
            const int64_t n = load_listed(x, NULL, s->cand, *listed, -INFINITY, s, 0, &unused);
            const float cut = select_kept(s->slots, s->capacity, 0, n, 0.0, (double)k, 1, NAN);
            if (!isnan(cut)) return cut;
            *listed = -1;
        }
    }
    return find_cut(x, NULL, vocab, m, span, -INFINITY, (double)k, s);
}

/* top-p's cut over the whole row (weight z). A cut estimated from a strided sample, set
   where the sample's heavier tokens weigh halfway between top_p and all of it, is checked
   on the row: when the tokens at or above it weigh at least top_p * z, no token below it
   can be kept (the tokens above weigh too much), so the search runs over those alone:
   a direct selection when they are few (they are then listed, *listed), a histogram
   otherwise; when the check fails, a histogram over the row. */
static float top_p_cut(const float *x, const float *w, int64_t vocab, float m, float span,
                       double z, double top_p, Scratch *s, int64_t *listed) {
    const double limit = top_p * z;
    *listed = -1;
    if (vocab >= 8 * SAMPLE) {
        float *keys = s->slots, *wts = keys + s->capacity;
        const int64_t stride = vocab / SAMPLE;
        double z_sample = 0.0;
        for (int64_t j = 0; j < SAMPLE; j++) {
            keys[j] = x[j * stride];
            wts[j] = w[j * stride];
            z_sample += wts[j];
        }
        const float t = z_sample > 0.0 ? select_kept(s->slots, s->capacity, 0, SAMPLE, 0.0,
                                                     (1.0 + top_p) / 2.0 * z_sample, 0, NAN)
                                       : NAN;
        /* The sample's own cut as far on the other side: the first pivot of the search. */
        float hint = NAN;
        if (!isnan(t) && 3.0 * top_p > 1.0) {
            for (int64_t j = 0; j < SAMPLE; j++) {
                keys[j] = x[j * stride];
                wts[j] = w[j * stride];
            }
            hint = select_kept(s->slots, s->capacity, 0, SAMPLE, 0.0,
                               (3.0 * top_p - 1.0) / 2.0 * z_sample, 0, NAN);
        }
        int64_t sampled_above = 0;
        for (int64_t j = 0; j < SAMPLE && !isnan(t); j++) sampled_above += x[j * stride] >= t;
        if (!isnan(t) && sampled_above * 2 <= SAMPLE) {
            const int64_t n = gather_at_least(x, vocab, t, s->cand,
                                              sampled_above * CHUNK > SAMPLE);
            double above;
            load_listed(x, w, s->cand, n, -INFINITY, s, 1, &above);
            if (above >= limit) {
                float *k1 = s->slots + 2 * s->capacity;
                if (n > DIRECT_SELECT)
                    return find_cut(k1, k1 + s->capacity, n, m, m - t < span ? m - t : span,
                                    -INFINITY, limit, s);
                *listed = n;
                const float kept = select_kept(s->slots, s->capacity, 1, n, 0.0, limit, 0, hint);
                return isnan(kept) ? m : kept;
            }
        }
    }
    return find_cut(x, w, vocab, m, span, -INFINITY, limit, s);
}

/* The first listed token (index order) whose cumulative kept weight exceeds u times the
   total; kept: x >= cut and w >= min_p. */
static int64_t draw_listed(const float *x, const float *w, const int32_t *cand, int64_t n,
                           float cut, float min_p, double u, int64_t fallback, float *kept) {
    /* Branch-free: kept and dropped tokens interleave unpredictably. */
    for (int64_t j = 0; j < n; j++) {
        const int32_t i = cand[j];
        const float wi = w[i]; /* a product, not a select: gcc would branch on it */
        kept[j] = wi * (float)((x[i] >= cut) & (wi >= min_p));
    }
    double total = 0.0;
    #pragma omp simd reduction(+:total)
    for (int64_t j = 0; j < n; j++) total += kept[j];
    const double target = u * total;
    double acc = 0.0;
    for (int64_t j = 0; j < n; j++) {
        acc += kept[j];
        if (acc > target) return cand[j]; /* the first to pass the target weighs > 0 */
    }
    for (int64_t j = n - 1; j >= 0; j--) /* u * total rounded up to the total */
        if (kept[j] > 0.0f) return cand[j];
    return fallback;
}

/* The same over the whole row, by blocks: `sums` holds each block's kept weight (computed
   here unless `have_sums`); a block is chosen from them, then the token by a scan of it. */
static int64_t draw_blocks(const float *restrict x, const float *restrict w, int64_t vocab,
                           float cut, float min_p, double u, double *sums, int have_sums,
                           int64_t fallback) {
    const int64_t num_blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t j = 0; j < num_blocks; j++) {
        if (!have_sums) {
            const int64_t b0 = j * BLOCK, b1 = min64(b0 + BLOCK, vocab);
            float bs = 0.0f;
            #pragma omp simd reduction(+:bs)
            for (int64_t i = b0; i < b1; i++)
                bs += (x[i] >= cut && w[i] >= min_p) ? w[i] : 0.0f;
            sums[j] = bs;
        }
        total += sums[j];
    }
    if (!(total > 0.0)) return fallback;
    const double target = u * total;
    double before = 0.0;
    int64_t j = 0;
    while (j < num_blocks && before + sums[j] <= target) before += sums[j++];
    if (j == num_blocks) { /* u * total rounded up to the total: the last kept block */
        j = num_blocks - 1;
        while (j > 0 && sums[j] <= 0.0) j--;
        before = 0.0;
        for (int64_t i = 0; i < j; i++) before += sums[i];
    }
    int64_t last = -1;
    double acc = before;
    for (int64_t i = j * BLOCK; i < min64((j + 1) * BLOCK, vocab); i++) {
        if (!(x[i] >= cut && w[i] >= min_p) || w[i] <= 0.0f) continue;
        last = i;
        acc += w[i];
        if (acc > target) return i;
    }
    return last >= 0 ? last : fallback; /* rounding at the end of the block: its last kept */
}

/* What filter_row found for one row: the kept tokens are those with x >= cut and
   w >= min_p among s->cand[:listed] (listed >= 0: only their weights are computed) or
   among all tokens (listed < 0: w holds every weight; `sums` their block sums when
   have_sums). A greedy row (or one without finite logits) keeps only `arg`. */
typedef struct {
    int greedy;
    int64_t arg;
    float cut;
    int64_t listed;
    int have_sums;
} RowFilter;

/* Steps 1-4 of the file comment: the max, the weights, the top-k / top-p cut, min-p. */
static void filter_row(const float *restrict x, int64_t vocab, float inv_t, int64_t top_k,
                       double top_p, float min_p, Scratch *s, RowFilter *f) {
    float m, lo;
    row_max(x, vocab, &m, &f->arg, &lo);
    f->greedy = inv_t <= 0.0f || !(m > -INFINITY) || m == INFINITY;
    f->cut = -INFINITY;
    f->listed = -1;
    f->have_sums = 0;
    if (f->greedy) return;

    const int use_k = top_k > 0 && top_k < vocab, use_p = top_p < 1.0;
    float *restrict w = s->w;
    float span = m - lo;
    if (span * inv_t > LOG_WEIGHT_SPAN) span = LOG_WEIGHT_SPAN / inv_t;
    float cut = -INFINITY;
    int64_t listed = -1; /* >= 0: every kept token is among the s->cand[:listed] */
    if (use_k) {
        cut = top_k_cut(x, vocab, m, span, top_k, s, &listed);
        if (listed >= 0) { /* only the listed tokens need weights */
            for (int64_t j = 0; j < listed; j++) {
                const int32_t i = s->cand[j];
                w[i] = exp_nonpos((x[i] - m) * inv_t);
            }
            if (use_p) { /* top-p is relative to the weight of the top-k set */
                double z_k;
                const int64_t n = load_listed(x, w, s->cand, listed, cut, s, 0, &z_k);
                const float c = select_kept(s->slots, s->capacity, 0, n, 0.0, top_p * z_k, 0, NAN);
                cut = c > cut ? c : cut;
            }
            f->cut = cut;
            f->listed = listed;
            return;
        }
    }

    /* Without top-k and top-p, min-p applies here and the block sums are final. */
    const float w_floor = use_k || use_p ? 0.0f : min_p;
    double *sums = s->block_sums;
    double z = 0.0;
    for (int64_t b0 = 0; b0 < vocab; b0 += BLOCK) {
        const int64_t b1 = min64(b0 + BLOCK, vocab);
        float bs = 0.0f;
        #pragma omp simd reduction(+:bs)
        for (int64_t i = b0; i < b1; i++) {
            const float e = exp_nonpos((x[i] - m) * inv_t);
            const float v = e >= w_floor ? e : 0.0f;
            w[i] = v;
            bs += v;
        }
        sums[b0 / BLOCK] = bs;
        z += bs;
    }
    if (!use_k && !use_p) {
        f->have_sums = 1;
        return;
    }
    if (use_p && use_k) { /* a large k: top-p over the top-k set, by histogram */
        double z_k = 0.0;
        #pragma omp simd reduction(+:z_k)
        for (int64_t i = 0; i < vocab; i++) z_k += x[i] >= cut ? (double)w[i] : 0.0;
        const int64_t n = compact_at_least(x, w, vocab, cut, s);
        const float *keys = s->slots + 2 * s->capacity;
        const float c = find_cut(keys, keys + s->capacity, n, m, span, -INFINITY,
                                 top_p * z_k, s);
        cut = c > cut ? c : cut;
    } else if (use_p) {
        cut = top_p_cut(x, w, vocab, m, span, z, top_p, s, &listed);
    }
    f->cut = cut;
    f->listed = listed;
}

static int64_t sample_row(const float *restrict x, int64_t vocab, float inv_t, int64_t top_k,
                          double top_p, float min_p, double u, Scratch *s) {
    RowFilter f;
    filter_row(x, vocab, inv_t, top_k, top_p, min_p, s, &f);
    if (f.greedy) return f.arg;
    if (f.have_sums) /* min-p is already in the weights */
        return draw_blocks(x, s->w, vocab, -INFINITY, 0.0f, u, s->block_sums, 1, f.arg);
    if (f.listed >= 0)
        return draw_listed(x, s->w, s->cand, f.listed, f.cut, min_p, u, f.arg, s->slots);
    return draw_blocks(x, s->w, vocab, f.cut, min_p, u, s->block_sums, 0, f.arg);
}

/* The distribution sample_row draws from, written densely into out[vocab]: each kept
   token's weight over the kept total (float32), 0 elsewhere; a greedy row is one-hot at
   its first argmax. */
static void probs_row(const float *restrict x, int64_t vocab, float inv_t, int64_t top_k,
                      double top_p, float min_p, Scratch *s, float *restrict out) {
    RowFilter f;
    filter_row(x, vocab, inv_t, top_k, top_p, min_p, s, &f);
    memset(out, 0, sizeof(float) * vocab);
    const float *w = s->w;
    const float floor_ = f.have_sums ? 0.0f : min_p;
    double total = 0.0;
    if (!f.greedy && f.listed >= 0) {
        for (int64_t j = 0; j < f.listed; j++) {
            const int32_t i = s->cand[j];
            const float kept = (x[i] >= f.cut && w[i] >= floor_) ? w[i] : 0.0f;
            out[i] = kept;
            total += kept;
        }
    } else if (!f.greedy) {
        const float cut = f.cut;
        #pragma omp simd reduction(+:total)
        for (int64_t i = 0; i < vocab; i++) {
            const float kept = (x[i] >= cut && w[i] >= floor_) ? w[i] : 0.0f;
            out[i] = kept;
            total += kept;
        }
    }
    if (!(total > 0.0)) {
        if (!f.greedy) memset(out, 0, sizeof(float) * vocab);
        out[f.arg] = 1.0f;
        return;
    }
    const float inv = (float)(1.0 / total);
    #pragma omp simd
    for (int64_t i = 0; i < vocab; i++) out[i] *= inv;
}

/* logits [num_rows, row_stride]; per row: inv_temperature (0: greedy), top_k (0: all),
   top_p (1: all), min_p (0: all), u in [0, 1). Writes tokens. Returns 0, or 1 when the
   buffers could not be allocated. */
int sample_rows(const float *logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                const float *inv_temperature, const int64_t *top_k, const double *top_p,
                const float *min_p, const double *u, int64_t *tokens) {
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) if(num_rows > 1) reduction(|:failed)
    for (int64_t r = 0; r < num_rows; r++) {
        Scratch *s = scratch_for(vocab);
        if (s == NULL) { failed = 1; continue; }
        tokens[r] = sample_row(logits + r * row_stride, vocab, inv_temperature[r], top_k[r],
                               top_p[r], min_p[r], u[r], s);
    }
    return failed;
}

/* probs_row for every row into out [num_rows, out_stride]; the same per-row parameters
   as sample_rows. Returns 0, or 1 when the buffers could not be allocated. */
int probs_rows(const float *logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
               const float *inv_temperature, const int64_t *top_k, const double *top_p,
               const float *min_p, float *out, int64_t out_stride) {
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) if(num_rows > 1) reduction(|:failed)
    for (int64_t r = 0; r < num_rows; r++) {
        Scratch *s = scratch_for(vocab);
        if (s == NULL) { failed = 1; continue; }
        probs_row(logits + r * row_stride, vocab, inv_temperature[r], top_k[r], top_p[r],
                  min_p[r], s, out + r * out_stride);
    }
    return failed;
}

/* For rows[j] of logits: lse[j] = log-sum-exp of the row, rank[j] = how many entries are
   >= the entry of tokens[j], and the num_top largest entries in descending order (ties:
   lower index first) into top_values / top_ids [n, num_top]. */
void logprob_rows(const float *logits, int64_t vocab, int64_t row_stride,
                  const int64_t *rows, int64_t n, const int64_t *tokens, int64_t num_top,
                  double *lse, int64_t *rank, float *top_values, int64_t *top_ids) {
    #pragma omp parallel for schedule(dynamic, 1) if(n > 1)
    for (int64_t j = 0; j < n; j++) {
        const float *x = logits + rows[j] * row_stride;
        const float chosen = x[tokens[j]];
        float m = -INFINITY;
        int64_t at_least = 0;
        #pragma omp simd reduction(max:m) reduction(+:at_least)
        for (int64_t i = 0; i < vocab; i++) {
            m = x[i] > m ? x[i] : m;
            at_least += x[i] >= chosen;
        }
        double total = 0.0;
        for (int64_t b0 = 0; b0 < vocab && m > -INFINITY && m < INFINITY; b0 += BLOCK) {
            const int64_t b1 = min64(b0 + BLOCK, vocab);
            float bs = 0.0f;
            #pragma omp simd reduction(+:bs)
            for (int64_t i = b0; i < b1; i++) bs += exp_nonpos(x[i] - m);
            total += bs;
        }
        lse[j] = m > -INFINITY && m < INFINITY ? (double)m + log(total) : (double)m;
        rank[j] = at_least;

        float *vals = top_values + j * num_top;
        int64_t *ids = top_ids + j * num_top;
        int64_t filled = 0;
        for (int64_t c0 = 0; c0 < vocab && num_top > 0; c0 += CHUNK) {
            const int64_t c1 = min64(c0 + CHUNK, vocab);
            if (filled == num_top) {
                float cm = -INFINITY;
                #pragma omp simd reduction(max:cm)
                for (int64_t i = c0; i < c1; i++) cm = x[i] > cm ? x[i] : cm;
                if (!(cm > vals[num_top - 1])) continue;
            }
            for (int64_t i = c0; i < c1; i++) {
                const float v = x[i];
                if (filled == num_top && !(v > vals[num_top - 1])) continue;
                int64_t pos = filled < num_top ? filled++ : num_top - 1;
                while (pos > 0 && vals[pos - 1] < v) {
                    vals[pos] = vals[pos - 1];
                    ids[pos] = ids[pos - 1];
                    pos--;
                }
                vals[pos] = v;
                ids[pos] = i;
            }
        }
    }
}
