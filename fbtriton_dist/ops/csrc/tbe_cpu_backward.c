/* The backward: each unique row of a batch gets its gradient (the sum over its ids, in batch
 * order, of the id's gradient row times its scale) and one fused optimizer step in place.
 *
 * The plan cuts the ids' keys (a table's first row + id) into buckets by their top bits (about
 * 4 ids a bucket, 2^11 .. 2^17 buckets over all tasks):
 * (1) each task of bags writes its ids' keys and counts them per bucket, (2) the counts are
 * summed in (bucket, task) order, (3) each task moves its ids to their buckets, keeping their
 * order, (4) each task of buckets (about an equal share of the ids) sorts its buckets by the
 * remaining bits in cache and, in tbe_backward_fused, sums and updates the rows of their runs
 * at once: no two tasks touch one row. tbe_plan stops after (4), its runs numbered for the
 * whole batch (the caller then sizes the gradients), and tbe_backward takes it from there.
 *
 * A sorted id is packed as key << pos_bits | position, so that sorting the values sorts by key
 * and, within a key, by position (batch order). */
#include "tbe_cpu.h"
#include "tbe_cpu_counter.c" /* counter_row, inlined into bwd_runs' clones */

/* The optimizers' codes and the hyper-parameters' slots are fbtriton_dist's Python tables
 * (tests/ops/test_native_tables.py parses this file and checks them): OPT_* the kernel codes
 * of optim.REGISTRY, one OPT_<NAME> per optimizer implemented here (ops/cpu_native.py reads the
 * list from this file), HYPER_* the slots of optim.NATIVE_HYPER_FIELDS (double
 * hyper[HYPER_COUNT]). */
enum { OPT_NONE = 0, OPT_SGD = 1, OPT_ROWWISE_ADAGRAD = 2, OPT_ADAM = 3, OPT_ADAGRAD = 4,
       OPT_EMAINPLACE_ROWWISE_ADAGRAD = 10, OPT_ROWWISE_ADAGRAD_WITH_COUNTER = 12,
       OPT_ENSEMBLE_ROWWISE_ADAGRAD = 13, OPT_ROWWISE_ADAGRAD_GLOBAL_DECAY = 14 };
enum { HYPER_LR = 0, HYPER_EPS = 1, HYPER_BETA1 = 2, HYPER_BETA2 = 3, HYPER_WEIGHT_DECAY = 4,
       HYPER_DECOUPLED = 5, HYPER_STEP = 6, HYPER_COUNT = 7 };

#define BUCKET_BITS 11
#define HIST_MAX ((int64_t)1 << 17)

typedef struct bwd_args bwd_args;

typedef struct {
    const void *indices, *offsets; /* [N], [T*B+1] */
    int idx32, off32;
    int64_t N, T, B;
    int64_t *E;                /* [T] ids feature f may name (feature_rows) */
    const int64_t *row_offsets, *D_offsets; /* [T] each */
    int pooling;
    int64_t stride;            /* of the gradient rows */
    const float *psw;          /* [N] or NULL */
    uint64_t *packed, *tmp;    /* [N] each: the sorted ids land in packed[0 : M] */
    int32_t *feat;             /* [N] feature of each id */
    int64_t *gofs;             /* [N] first element of its gradient row */
    float *scale;              /* [N] its per-sample weight (/ bag length under MEAN), or NULL */
    int64_t *runs;             /* [N + tasks + 1]: task t's run starts from bstart[tcut[t]] + t */
    int pos_bits, low_bits;    /* a key's bucket is key >> low_bits */
    int64_t first, M, nb;      /* the bags' first id, their ids, buckets */
    int64_t tasks;
    int64_t *hist, *bstart, *tcut, *nruns; /* [tasks * nb], [nb + 1], [tasks + 1] each */
    _Atomic int bad;
    const bwd_args *update;    /* (4) also sums and updates the runs' rows (or NULL) */
    float *scratch;            /* 2 * width floats per executor */
    int64_t width;
} plan_args;

static void bwd_runs(const bwd_args *a, const int64_t *starts, int64_t n, int64_t row_base,
                     float *restrict g, float *restrict wbuf);

static int plan_setup(plan_args *p, const void *indices, int idx32, int64_t N,
                      const void *offsets, int off32, int64_t T, int64_t B, const int64_t *rows,
                      const int64_t *w_offsets, const int64_t *dims, const int64_t *row_offsets,
                      int64_t elem_limit, int64_t row_limit, int pooling, int64_t stride,
                      const int64_t *D_offsets, const float *psw, uint64_t *packed,
                      uint64_t *tmp, int32_t *feat, int64_t *gofs, float *scale, int64_t *runs,
                      int nthreads) {
    const int64_t first = at(offsets, off32, 0), last = at(offsets, off32, T * B);
    memset(p, 0, sizeof *p);
    *p = (plan_args){.indices = indices, .offsets = offsets, .idx32 = idx32, .off32 = off32,
                     .N = N, .T = T, .B = B, .row_offsets = row_offsets, .D_offsets = D_offsets,
                     .pooling = pooling, .stride = stride, .psw = psw, .packed = packed,
                     .tmp = tmp, .feat = feat, .gofs = gofs, .scale = scale, .runs = runs,
                     .first = first, .M = last - first};
    if (first < 0 || last < first || last > N || T >= ((int64_t)1 << 31)) return BAD_ORDER;
    p->E = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!p->E) return NO_MEMORY;
    feature_rows(T, rows, w_offsets, dims, row_offsets, elem_limit, row_limit, p->E);
    int64_t max_key = 1;
    for (int64_t f = 0; f < T; ++f)
        if (row_offsets[f] + p->E[f] > max_key) max_key = row_offsets[f] + p->E[f];
    int key_bits = 1;
    p->pos_bits = 1;
    while ((N >> p->pos_bits) > 0) ++p->pos_bits;
    while (key_bits < 63 && ((max_key - 1) >> key_bits) > 0) ++key_bits;
    if (p->pos_bits + key_bits > 64) return TOO_BIG;
    p->tasks = tbe_tasks(p->M + T * B, nthreads, 1024);
    /* buckets of ~4 ids (insertion-sorted in cache; 2^11 buckets of ~40 ids took two 8-bit
     * counting passes each, half the plan's time), at least 2^BUCKET_BITS, and at most
     * HIST_MAX counts over all tasks (their prefix sum is one thread's) */
    int bucket_bits = BUCKET_BITS;
    while (bucket_bits < key_bits && ((p->M / 4) >> bucket_bits) > 0 &&
           (p->tasks << (bucket_bits + 1)) <= HIST_MAX)
        ++bucket_bits;
    p->low_bits = key_bits > bucket_bits ? key_bits - bucket_bits : 0;
    p->nb = (int64_t)1 << (key_bits - p->low_bits);
    p->hist = malloc(sizeof(int64_t) * (p->tasks * p->nb + p->nb + 1 + 2 * (p->tasks + 1)));
    if (!p->hist) return NO_MEMORY;
    p->bstart = p->hist + p->tasks * p->nb;
    p->tcut = p->bstart + p->nb + 1;
    p->nruns = p->tcut + p->tasks + 1;
    return 0;
}

static void plan_free(plan_args *p) {
    free(p->E);
    free(p->hist);
    free(p->scratch);
}

/* Stable sort of n packed values by their key's low `bits` (the bucket fixes the rest), from
 * src to dst (src is scratch): insertion for a few, else 8-bit counting passes. */
static void sort_bucket(uint64_t *src, uint64_t *dst, int64_t n, int pos_bits, int bits) {
    if (n <= 32 || bits == 0) {
        memcpy(dst, src, sizeof(uint64_t) * n);
        for (int64_t i = 1; i < n && bits; ++i) { /* values compare as (key, position) */
            const uint64_t v = dst[i];
            int64_t j = i;
            for (; j > 0 && dst[j - 1] > v; --j) dst[j] = dst[j - 1];
            dst[j] = v;
        }
        return;
    }
    int64_t count[256];
    uint64_t *a = src, *b = dst;
    for (int shift = pos_bits; shift < pos_bits + bits; shift += 8) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < n; ++i) count[(a[i] >> shift) & 255]++;
        for (int64_t d = 0, sum = 0; d < 256; ++d) {
            const int64_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; ++i) b[count[(a[i] >> shift) & 255]++] = a[i];
        uint64_t *swap = a;
        a = b;
        b = swap;
    }
    if (a != dst) memcpy(dst, a, sizeof(uint64_t) * n);
}

/* (1) task's bags: keys, features, gradient rows, scales; its bucket counts */
static void plan_keys(void *ctx, int64_t task, int executor) {
    (void)executor;
    plan_args *p = ctx;
    int64_t *h = p->hist + task * p->nb;
    memset(h, 0, sizeof(int64_t) * p->nb);
    const int64_t B = p->B, k0 = p->T * B * task / p->tasks, k1 = p->T * B * (task + 1) / p->tasks;
    int64_t f = B ? k0 / B : 0, b = k0 - f * B;
    int bad = 0;
    for (int64_t k = k0; k < k1; ++k, ++b) {
        if (b == B) b = 0, ++f;
        const int64_t s = at(p->offsets, p->off32, k), e = at(p->offsets, p->off32, k + 1);
        if (s < p->first || e < s || e > p->first + p->M) {
            bad |= BAD_ORDER;
            continue;
        }
        const int64_t rows_f = p->E[f], kb = p->row_offsets[f];
        const int64_t go = b * p->stride + (p->pooling == POOL_NONE ? 0 : p->D_offsets[f]);
        const float len = (float)(e - s);
        for (int64_t i = s; i < e; ++i) {
            int64_t id = at(p->indices, p->idx32, i);
            if ((uint64_t)id >= (uint64_t)rows_f) {
                bad |= BAD_ID;
                id = 0; /* keeps the key in range; the plan is refused anyway */
            }
            p->packed[i - p->first] = ((uint64_t)(kb + id) << p->pos_bits) | (uint64_t)i;
            h[(uint64_t)(kb + id) >> p->low_bits]++;
            p->feat[i] = (int32_t)f;
            p->gofs[i] = p->pooling == POOL_NONE ? i * p->stride : go;
            if (p->scale) {
                const float w = p->psw ? p->psw[i] : 1.0f;
                p->scale[i] = p->pooling == POOL_MEAN ? w / len : w;
            }
        }
    }
    if (bad) atomic_fetch_or(&p->bad, bad);
}

/* (3) task's ids (those of its bags, in order) to their buckets */
static void plan_scatter(void *ctx, int64_t task, int executor) {
    (void)executor;
    plan_args *p = ctx;
    int64_t *h = p->hist + task * p->nb;
    const int64_t k0 = p->T * p->B * task / p->tasks, k1 = p->T * p->B * (task + 1) / p->tasks;
    const int64_t j0 = at(p->offsets, p->off32, k0) - p->first;
    const int64_t j1 = at(p->offsets, p->off32, k1) - p->first;
    for (int64_t j = j0; j < j1; ++j) {
        const uint64_t v = p->packed[j];
        p->tmp[h[(v >> p->pos_bits) >> p->low_bits]++] = v;
    }
}

/* (4) task's buckets sorted into packed, their runs found (and summed and updated) */
static void plan_sort(void *ctx, int64_t task, int executor) {
    plan_args *p = ctx;
    const int64_t c0 = p->bstart[p->tcut[task]], c1 = p->bstart[p->tcut[task + 1]];
    int64_t *runs = p->runs + c0 + task, nr = 0;
    for (int64_t d = p->tcut[task]; d < p->tcut[task + 1]; ++d) {
        const int64_t s = p->bstart[d], e = p->bstart[d + 1];
        sort_bucket(p->tmp + s, p->packed + s, e - s, p->pos_bits, p->low_bits);
        for (int64_t j = s; j < e; ++j)
            if (j == s || (p->packed[j] >> p->pos_bits) != (p->packed[j - 1] >> p->pos_bits))
                runs[nr++] = j;
    }
    runs[nr] = c1;
    p->nruns[task] = nr;
    if (p->update)
        bwd_runs(p->update, runs, nr, 0, p->scratch + 2 * p->width * executor,
                 p->scratch + (2 * executor + 1) * p->width);
}

/* (1) .. (4); returns 0 or the batch's BAD_* bits */
static int plan_run(plan_args *p, int nthreads) {
    tbe_parallel(plan_keys, p, p->tasks, nthreads);
    const int bad = atomic_load(&p->bad);
    if (bad) return bad;
    int64_t sum = 0; /* (2) */
    for (int64_t d = 0; d < p->nb; ++d) {
        p->bstart[d] = sum;
        for (int64_t t = 0; t < p->tasks; ++t) {
            const int64_t c = p->hist[t * p->nb + d];
            p->hist[t * p->nb + d] = sum;
            sum += c;
        }
    }
    p->bstart[p->nb] = sum;
    for (int64_t t = 0, d = 0; t <= p->tasks; ++t) { /* tasks of buckets: ~M / tasks ids each */
        while (d < p->nb && p->bstart[d] < p->M * t / p->tasks) ++d;
        p->tcut[t] = t == p->tasks ? p->nb : d;
    }
    tbe_parallel(plan_scatter, p, p->tasks, nthreads);
    tbe_parallel(plan_sort, p, p->tasks, nthreads);
    return 0;
}

/* ---------------------------------------------------------------- backward */

struct bwd_args {
    const float *grad;        /* the gradient rows (gofs) */
    const uint64_t *sorted;   /* [M] the plan's packed keys */
    uint64_t pmask;           /* position bits of a packed key */
    int pos_bits;
    const int32_t *feat;      /* [N] feature of each id */
    const int64_t *gofs;      /* [N] its gradient row */
    const float *scale;       /* [N] its scale, or NULL (all 1) */
    const int64_t *w_offsets, *dims, *row_offsets; /* [T] each */
    void *weights;            /* updated in place */
    int dtype;
    float *m1, *m2, *m3;      /* optimizer states (NULL where it has none; the counter's:
                               * momentum1, prev_iter, row_counter) */
    int opt, decoupled;
    float lr, eps, b1, b2, wd, bc1, bc2; /* bc1, bc2: 1 - beta^t (Adam) */
    int sr;                   /* stochastic rounding of fp16 / bf16 rows */
    uint64_t seed;
    float *row_grads;         /* OPT_NONE: [U, max_D] summed gradients, else NULL */
    int64_t *row_elems, *row_dims; /* OPT_NONE: [U] first element and D of each row */
    int64_t max_D;
    counter_args counter;     /* OPT_ROWWISE_ADAGRAD_WITH_COUNTER's parameters */
};

/* g[d0 : d0 + 8 NV] = sum over the sorted ids s..e of scale * gradient row (scale 1 unless
 * S); `first`: the run's first pass, which prefetches the gradient rows PREFETCH_IDS ids
 * ahead (to j_end). */
#define DEFINE_GRAD(NV, S)                                                                       \
    INLINE void grad_##NV##_##S(const bwd_args *a, int64_t s, int64_t e, int64_t d0, float *g,   \
                                int64_t D, int64_t j_end, int first) {                           \
        v8f acc[NV];                                                                             \
        for (int v = 0; v < NV; ++v) acc[v] = (v8f){0};                                          \
        for (int64_t j = s; j < e; ++j) {                                                        \
            if (first && j + PREFETCH_IDS < j_end)                                               \
                prefetch_bytes(a->grad + a->gofs[a->sorted[j + PREFETCH_IDS] & a->pmask], D * 4, \
                               0);                                                               \
            const int64_t p = (int64_t)(a->sorted[j] & a->pmask);                                \
            const float *go = a->grad + a->gofs[p];                                              \
            if (S) {                                                                             \
                const float sc = a->scale[p];                                                    \
                for (int v = 0; v < NV; ++v) acc[v] += sc * load8(go, F32, d0 + 8 * v);          \
            } else {                                                                             \
                for (int v = 0; v < NV; ++v) acc[v] += load8(go, F32, d0 + 8 * v);              \
            }                                                                                    \
        }                                                                                        \
        memcpy(g + d0, acc, sizeof acc);                                                         \
    }
DEFINE_GRAD(8, 0)
DEFINE_GRAD(4, 0)
DEFINE_GRAD(2, 0)
DEFINE_GRAD(1, 0)
DEFINE_GRAD(8, 1)
DEFINE_GRAD(4, 1)
DEFINE_GRAD(2, 1)
DEFINE_GRAD(1, 1)

INLINE void grad_tail(const bwd_args *a, int64_t s, int64_t e, int64_t d0, float *g,
                             int64_t D, int64_t j_end, int first) {
    float acc[8] = {0};
    for (int64_t j = s; j < e; ++j) {
        if (first && j + PREFETCH_IDS < j_end)
            prefetch_bytes(a->grad + a->gofs[a->sorted[j + PREFETCH_IDS] & a->pmask], D * 4, 0);
        const int64_t p = (int64_t)(a->sorted[j] & a->pmask);
        const float *go = a->grad + a->gofs[p];
        const float sc = a->scale ? a->scale[p] : 1.0f;
        for (int64_t d = d0; d < D; ++d) acc[d - d0] += sc * go[d];
    }
    memcpy(g + d0, acc, sizeof(float) * (D - d0));
}

/* g[0:D] = the gradient of the row of sorted ids s..e (in batch order) */
#define SUM_GRAD(S)                                                                              \
    do {                                                                                         \
        for (; d0 + 64 <= D; d0 += 64, first = 0) grad_8_##S(a, s, e, d0, g, D, j_end, first);  \
        if (D - d0 >= 32) grad_4_##S(a, s, e, d0, g, D, j_end, first), d0 += 32, first = 0;      \
        if (D - d0 >= 16) grad_2_##S(a, s, e, d0, g, D, j_end, first), d0 += 16, first = 0;      \
        if (D - d0 >= 8) grad_1_##S(a, s, e, d0, g, D, j_end, first), d0 += 8, first = 0;        \
    } while (0)

INLINE void sum_grad(const bwd_args *a, int64_t s, int64_t e, int64_t D, float *g,
                     int64_t j_end) {
    int first = 1;
    int64_t d0 = 0;
    if (a->scale) SUM_GRAD(1);
    else SUM_GRAD(0);
    if (D > d0) grad_tail(a, s, e, d0, g, D, j_end, first);
}

INLINE float sum_squares(const float *restrict x, const float *restrict w, float l2,
                                int64_t D) {
    float lane[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        for (int j = 0; j < LANES; ++j) {
            const float v = x[d + j] + l2 * w[d + j];
            lane[j] += v * v;
        }
    }
    for (int j = 0; d < D; ++d, ++j) {
        const float v = x[d] + l2 * w[d];
        lane[j] += v * v;
    }
    float s = 0.0f;
    for (int j = 0; j < LANES; ++j) s += lane[j];
    return s;
}

/* One optimizer step of row w [D] (fp32) with gradient g; states in place. */
INLINE void update_row(const bwd_args *a, float *restrict w, const float *restrict g,
                              int64_t D, int64_t elem, int64_t state_row) {
    switch (a->opt) {
    case OPT_SGD:
        for (int64_t d = 0; d < D; ++d) w[d] = w[d] - a->lr * g[d];
        break;
    case OPT_ADAGRAD: {
        float *restrict m = a->m1 + elem;
        for (int64_t d = 0; d < D; ++d) {
            m[d] = m[d] + g[d] * g[d];
            w[d] = w[d] - a->lr * g[d] / (sqrtf(m[d]) + a->eps);
        }
        break;
    }
    case OPT_ROWWISE_ADAGRAD:
    case OPT_EMAINPLACE_ROWWISE_ADAGRAD: /* the same row step; their moving average (and */
    case OPT_ENSEMBLE_ROWWISE_ADAGRAD:   /* swap) over whole tables is the module's, */
    case OPT_ROWWISE_ADAGRAD_GLOBAL_DECAY: { /* as global decay's catch-up (decoupled:
                                              * hyper DECOUPLED = 1), before the lookup */
        float *m = a->m1 + state_row;
        const float l2 = a->decoupled ? 0.0f : a->wd;
        const float mv = *m + sum_squares(g, w, l2, D) / (float)D;
        *m = mv;
        const float mult = a->lr / (sqrtf(mv) + a->eps);
        const float corr = a->decoupled ? (float)(1.0 - (double)a->lr * a->wd) : 1.0f - mult * a->wd;
        for (int64_t d = 0; d < D; ++d) w[d] = corr * w[d] - mult * g[d];
        break;
    }
    case OPT_ROWWISE_ADAGRAD_WITH_COUNTER: /* tbe_cpu_counter.c */
        counter_row(&a->counter, w, g, D, a->m1 + state_row, a->m2 + state_row,
                    a->m3 + state_row);
        break;
    case OPT_ADAM: {
        float *restrict m = a->m1 + elem, *restrict v = a->m2 + elem;
        for (int64_t d = 0; d < D; ++d) {
            m[d] = a->b1 * m[d] + (1.0f - a->b1) * g[d];
            v[d] = a->b2 * v[d] + (1.0f - a->b2) * g[d] * g[d];
            const float step = (m[d] / a->bc1) / (sqrtf(v[d] / a->bc2) + a->eps);
            w[d] = w[d] - a->lr * (step + a->wd * w[d]);
        }
        break;
    }
    }
}

/* Runs starts[0 .. n] (run r is sorted ids starts[r] .. starts[r + 1]): sum each row's
 * gradient in g, then update the row, or write g out as row row_base + r (OPT_NONE). */
TBE_TARGETS
static void bwd_runs(const bwd_args *a, const int64_t *starts, int64_t n, int64_t row_base,
                     float *restrict g, float *restrict wbuf) {
    const int64_t esize = a->dtype == F32 ? 4 : 2;
    char *w8 = a->weights;
    const int64_t j_end = starts[n];
    for (int64_t r = 0; r < n; ++r) {
        if (r + PREFETCH_RUNS < n) { /* the row (and state) of a run ahead */
            const uint64_t q = a->sorted[starts[r + PREFETCH_RUNS]];
            const int64_t fq = a->feat[q & a->pmask];
            const int64_t idq = (int64_t)(q >> a->pos_bits) - a->row_offsets[fq];
            const int64_t Dq = a->dims[fq], eq = a->w_offsets[fq] + idq * Dq;
            if (a->opt != OPT_NONE) prefetch_bytes(w8 + eq * esize, Dq * esize, 1);
            if (a->opt == OPT_ROWWISE_ADAGRAD || a->opt == OPT_EMAINPLACE_ROWWISE_ADAGRAD
                || a->opt == OPT_ENSEMBLE_ROWWISE_ADAGRAD
                || a->opt == OPT_ROWWISE_ADAGRAD_GLOBAL_DECAY
                || a->opt == OPT_ROWWISE_ADAGRAD_WITH_COUNTER)
                __builtin_prefetch(a->m1 + (q >> a->pos_bits), 1, 3);
            else if (a->opt == OPT_ADAGRAD || a->opt == OPT_ADAM)
                prefetch_bytes(a->m1 + eq, Dq * 4, 1);
            if (a->opt == OPT_ROWWISE_ADAGRAD_WITH_COUNTER) { /* prev_iter, row_counter */
                __builtin_prefetch(a->m2 + (q >> a->pos_bits), 1, 3);
                __builtin_prefetch(a->m3 + (q >> a->pos_bits), 1, 3);
            }
            if (a->opt == OPT_ADAM) prefetch_bytes(a->m2 + eq, Dq * 4, 1);
        }
        const int64_t s = starts[r], e = starts[r + 1];
        const uint64_t q = a->sorted[s];
        const int64_t f = a->feat[q & a->pmask], key = (int64_t)(q >> a->pos_bits);
        const int64_t D = a->dims[f], elem = a->w_offsets[f] + (key - a->row_offsets[f]) * D;
        sum_grad(a, s, e, D, g, j_end);
        if (a->opt == OPT_NONE) {
            float *out = a->row_grads + (row_base + r) * a->max_D;
            memcpy(out, g, sizeof(float) * D);
            memset(out + D, 0, sizeof(float) * (a->max_D - D));
            a->row_elems[row_base + r] = elem;
            a->row_dims[row_base + r] = D;
            continue;
        }
        if (a->dtype == F32) {
            update_row(a, (float *)w8 + elem, g, D, elem, key);
            continue;
        }
        uint16_t *h = (uint16_t *)w8 + elem;
        for (int64_t d = 0; d < D; ++d) wbuf[d] = half_to_f32(h[d], a->dtype);
        update_row(a, wbuf, g, D, elem, key);
        if (a->sr) {
            for (int64_t d = 0; d < D; ++d)
                h[d] = f32_to_half_stochastic(wbuf[d], a->dtype, a->seed, elem + d);
        } else {
            for (int64_t d = 0; d < D; ++d) h[d] = f32_to_half(wbuf[d], a->dtype);
        }
    }
}

static void bwd_setup(bwd_args *a, const float *grad, const uint64_t *sorted, int pos_bits,
                      const int32_t *feat, const int64_t *gofs, const float *scale,
                      const int64_t *w_offsets, const int64_t *dims, const int64_t *row_offsets,
                      void *weights, int dtype, float *m1, float *m2, int opt,
                      const double *hyper, int sr, uint64_t sr_seed, int64_t max_D) {
    *a = (bwd_args){grad, sorted, ((uint64_t)1 << pos_bits) - 1, pos_bits, feat, gofs, scale,
                    w_offsets, dims, row_offsets, weights, dtype, m1, m2, NULL, opt,
                    (int)hyper[HYPER_DECOUPLED], (float)hyper[HYPER_LR], (float)hyper[HYPER_EPS],
                    (float)hyper[HYPER_BETA1], (float)hyper[HYPER_BETA2],
                    (float)hyper[HYPER_WEIGHT_DECAY], 1.0f, 1.0f, sr, sr_seed, NULL, NULL, NULL,
                    max_D, {0}};
    if (opt == OPT_ADAM) {
        a->bc1 = (float)(1.0 - pow(hyper[HYPER_BETA1], hyper[HYPER_STEP]));
        a->bc2 = (float)(1.0 - pow(hyper[HYPER_BETA2], hyper[HYPER_STEP]));
    }
}

/* The plan's arguments, as tbe_backward_fused and tbe_plan take them: the batch, the rows'
 * bounds (rows: [T] E or NULL; elem_limit: elements of the weights and per-element states;
 * row_limit: rows of a per-row state or -1), the gradient rows' layout, and the buffers
 * packed, tmp, feat, gofs [N], scale [N] (given when psw is or under MEAN), runs [N + nt + 1]. */
#define PLAN_ARGS                                                                               \
    const void *indices, int idx32, int64_t N, const void *offsets, int off32, int64_t T,       \
        int64_t B, const int64_t *rows, const int64_t *w_offsets, const int64_t *dims,          \
        const int64_t *row_offsets, int64_t elem_limit, int64_t row_limit, int pooling,         \
        int64_t stride, const int64_t *D_offsets, const float *psw, uint64_t *packed,           \
        uint64_t *tmp, int32_t *feat, int64_t *gofs, float *scale, int64_t *runs
#define PLAN_SETUP(p, nthreads)                                                                 \
    plan_setup(p, indices, idx32, N, offsets, off32, T, B, rows, w_offsets, dims, row_offsets,  \
               elem_limit, row_limit, pooling, stride, D_offsets, psw, packed, tmp, feat, gofs, \
               scale, runs, nthreads)

/* Plan and update: every row an id of the batch names gets one optimizer step in place with
 * its gradient (grad: the gradient rows, fp32). hyper: HYPER_COUNT values (HYPER_* above:
 * lr, eps, beta1, beta2, weight_decay, decoupled 0/1, t >= 1); sr: stochastic rounding (fp16 / bf16 rows) seeded sr_seed.
 * Returns 0, or minus BAD_* (nothing updated), NO_MEMORY or TOO_BIG. */
static int backward_fused(PLAN_ARGS, const float *grad, void *weights, int dtype, float *m1,
                          float *m2, float *m3, int opt, const double *hyper,
                          const double *counter, int sr, uint64_t sr_seed, int64_t max_D,
                          int nthreads) {
    if (nthreads < 1) nthreads = 1;
    plan_args p;
    int err = PLAN_SETUP(&p, nthreads);
    bwd_args a;
    if (!err) {
        bwd_setup(&a, grad, packed, p.pos_bits, feat, gofs, scale, w_offsets, dims, row_offsets,
                  weights, dtype, m1, m2, opt, hyper, sr, sr_seed, max_D);
        a.m3 = m3;
        if (counter)
            counter_setup(&a.counter, counter, hyper[HYPER_LR], hyper[HYPER_EPS],
                          hyper[HYPER_WEIGHT_DECAY], hyper[HYPER_STEP]);
        p.update = &a;
        p.width = (max_D > 0 ? max_D : 1) + 8;
        p.scratch = malloc(sizeof(float) * 2 * p.width * nthreads);
        err = p.scratch ? plan_run(&p, nthreads) : NO_MEMORY;
    }
    plan_free(&p);
    return -err;
}

int tbe_backward_fused(PLAN_ARGS, const float *grad, void *weights, int dtype, float *m1,
                       float *m2, int opt, const double *hyper, int sr, uint64_t sr_seed,
                       int64_t max_D, int nthreads) {
    if (opt == OPT_ROWWISE_ADAGRAD_WITH_COUNTER) /* its states: tbe_backward_fused_counter */
        return -TOO_BIG;
    return backward_fused(indices, idx32, N, offsets, off32, T, B, rows, w_offsets, dims,
                          row_offsets, elem_limit, row_limit, pooling, stride, D_offsets, psw,
                          packed, tmp, feat, gofs, scale, runs, grad, weights, dtype, m1, m2,
                          NULL, opt, hyper, NULL, sr, sr_seed, max_D, nthreads);
}

/* tbe_backward_fused with rowwise Adagrad with counter: its per-row states m1 (momentum1),
 * prev_iter, row_counter ([rows] fp32 each, in place), its parameters counter[CTR_COUNT]
 * (tbe_cpu_counter.c's CTR_* slots: the module's max_counter already refreshed). */
int tbe_backward_fused_counter(PLAN_ARGS, const float *grad, void *weights, int dtype,
                               float *m1, float *prev_iter, float *row_counter,
                               const double *hyper, const double *counter, int sr,
                               uint64_t sr_seed, int64_t max_D, int nthreads) {
    return backward_fused(indices, idx32, N, offsets, off32, T, B, rows, w_offsets, dims,
                          row_offsets, elem_limit, row_limit, pooling, stride, D_offsets, psw,
                          packed, tmp, feat, gofs, scale, runs, grad, weights, dtype, m1,
                          prev_iter, row_counter, OPT_ROWWISE_ADAGRAD_WITH_COUNTER, hyper,
                          counter, sr, sr_seed, max_D, nthreads);
}

/* The plan alone, its runs numbered for the batch: sorted ids in packed[0 : M], run_start[r]
 * the first of run r, run_start[U] = M (the rows for tbe_backward). Returns U, or minus BAD_*,
 * NO_MEMORY or TOO_BIG. */
int64_t tbe_plan(PLAN_ARGS, int64_t *run_start, int *pos_bits, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    plan_args p;
    int err = PLAN_SETUP(&p, nthreads);
    int64_t U = 0;
    if (!err) err = plan_run(&p, nthreads);
    if (!err) {
        for (int64_t t = 0; t < p.tasks; ++t) {
            memcpy(run_start + U, p.runs + p.bstart[p.tcut[t]] + t, sizeof(int64_t) * p.nruns[t]);
            U += p.nruns[t];
        }
        run_start[U] = p.M;
        *pos_bits = p.pos_bits;
    }
    plan_free(&p);
    return err ? -err : U;
}

typedef struct {
    const bwd_args *a;
    const int64_t *run_start;
    int64_t U, tasks, width;
    float *scratch;
} runs_args;

/* a contiguous block of runs with about 1 / tasks of the ids: from the first run at or after
 * the task's share of ids (a binary search) */
static void runs_task(void *ctx, int64_t task, int executor) {
    runs_args *r = ctx;
    const int64_t M = r->run_start[r->U];
    int64_t cut[2];
    for (int side = 0; side < 2; ++side) {
        const int64_t want = M * (task + side) / r->tasks;
        int64_t lo = 0, hi = r->U;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (r->run_start[mid] < want) lo = mid + 1; else hi = mid;
        }
        cut[side] = task + side == r->tasks ? r->U : lo;
    }
    bwd_runs(r->a, r->run_start + cut[0], cut[1] - cut[0], cut[0],
             r->scratch + 2 * r->width * executor, r->scratch + (2 * executor + 1) * r->width);
}

/* Every unique row of a tbe_plan gets its gradient and, with an optimizer, one step in place
 * (tbe_backward_fused's); with OPT_NONE, row_grads [U, max_D] / row_elems / row_dims [U] get
 * the gradients, their first elements and D. Returns 0, or -NO_MEMORY (nothing done). */
int tbe_backward(const float *grad, const uint64_t *sorted, int pos_bits, const int32_t *feat,
                 const int64_t *gofs, const float *scale, const int64_t *run_start, int64_t U,
                 const int64_t *w_offsets, const int64_t *dims, const int64_t *row_offsets,
                 void *weights, int dtype, float *m1, float *m2, int opt, const double *hyper,
                 int sr, uint64_t sr_seed, float *row_grads, int64_t *row_elems,
                 int64_t *row_dims, int64_t max_D, int nthreads) {
    if (U == 0) return 0;
    bwd_args a;
    bwd_setup(&a, grad, sorted, pos_bits, feat, gofs, scale, w_offsets, dims, row_offsets,
              weights, dtype, m1, m2, opt, hyper, sr, sr_seed, max_D);
    a.row_grads = row_grads, a.row_elems = row_elems, a.row_dims = row_dims;
    if (nthreads < 1) nthreads = 1;
    runs_args r = {&a, run_start, U, tbe_tasks(run_start[U], nthreads, 1024),
                   (max_D > 0 ? max_D : 1) + 8, NULL};
    r.scratch = malloc(sizeof(float) * 2 * r.width * nthreads);
    if (!r.scratch) return -NO_MEMORY;
    tbe_parallel(runs_task, &r, r.tasks, nthreads);
    free(r.scratch);
    return 0;
}
