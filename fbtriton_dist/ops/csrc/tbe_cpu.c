/* The fast CPU path's native kernels (fbtriton_dist/ops/cpu_native.py compiles this file with
 * tbe_cpu_backward.c on first use and calls them through ctypes on tensors' data pointers).
 *
 *   tbe_check           one pass over a batch: are the offsets and ids well formed? (bits;
 *                       only for layouts without table rows: the forward checks the rest)
 *   tbe_forward         pooled (SUM / MEAN) or unpooled rows, per-sample weights, mixed D
 *   tbe_psw_grad        the per-sample weights' gradient
 *   tbe_backward_fused  (tbe_cpu_backward.c) each unique row's gradient summed over its ids,
 *                       then one fused optimizer step on the row in place
 *   tbe_plan, tbe_backward  (tbe_cpu_backward.c) the same in two calls, the summed gradients
 *                       written out (no optimizer)
 *
 * Layout (FBGEMM's TBE; T features, B bags per feature, N ids, D a feature's dim):
 *   weights   [sum E_t * D_t] fp32 / fp16 / bf16, feature f's table from element w_offsets[f];
 *   indices   [N] int32 or int64; offsets [T*B+1] int32 or int64, feature-major: bag f*B+b
 *             holds ids offsets[f*B+b] .. offsets[f*B+b+1];
 *   pooled out / grad [B, stride], feature f in columns D_offsets[f] .. + dims[f];
 *   unpooled out / grad [N, stride], id i's row in row i;
 *   a per-row optimizer state at row_offsets[f] + id, a per-element one as the weights.
 *
 * Every kernel checks what it reads (bag bounds, 0 <= id < rows[f]) and reports a bad batch
 * instead of reading out of bounds. The forward given err is the lookup's bounds check
 * (bounds_check "error" / "warn", ops/tbe.py, as the Triton kernel's CHECK): it drops bad ids
 * and counts them, malformed bags (and non-finite weights) in err, in its own pass over the
 * bags; ops/tbe.py then names what it counted. Without err (bounds_check="ignore") a bad
 * batch is refused.
 *
 * Deterministic: a bag sums its ids in order; a row's gradient sums its ids in batch order
 * (the sort is stable) on the one thread that owns the row; reductions over D use fixed lanes.
 * No result depends on the number of threads. Built with -ffp-contract=off, so that the AVX2
 * and baseline clones (GCC's target_clones, picked when the library loads) give the same bits.
 */
#include "tbe_cpu.h"

/* ---------------------------------------------------------------- check */

typedef struct {
    const void *indices, *offsets;
    int idx32, off32;
    int64_t N, T, B, tasks;
    const int64_t *rows;
    const float *psw;
    _Atomic int bad;
} check_args;

/* ids[s..e] >= E (unsigned: negative ids too)? BAD_ID : 0, in one vectorised pass */
#define DEFINE_IDS_BAD(T, NAME)                                                                  \
    INLINE int NAME(const T *ids, int64_t s, int64_t e, uint64_t E) {                            \
        uint64_t over = 0;                                                                       \
        for (int64_t i = s; i < e; ++i) over |= (uint64_t)(int64_t)ids[i] >= E;                  \
        return over ? BAD_ID : 0;                                                                \
    }
DEFINE_IDS_BAD(int64_t, ids64_bad)
DEFINE_IDS_BAD(int32_t, ids32_bad)

/* bags k0 .. k1 (feature-major); a feature's run of well-formed bags is checked as one run of
 * ids */
TBE_TARGETS
static int check_bags(const check_args *a, int64_t k0, int64_t k1) {
    int bad = 0;
    while (k0 < k1) {
        const int64_t f = k0 / a->B, hi = (f + 1) * a->B < k1 ? (f + 1) * a->B : k1;
        const uint64_t E = (uint64_t)a->rows[f];
        int64_t prev = at(a->offsets, a->off32, k0);
        int ordered = prev >= 0;
        for (int64_t k = k0 + 1; k <= hi; ++k) {
            const int64_t o = at(a->offsets, a->off32, k);
            ordered &= o >= prev;
            prev = o;
        }
        if (ordered && prev <= a->N) { /* one run: ids offsets[k0] .. offsets[hi] */
            const int64_t s = at(a->offsets, a->off32, k0);
            bad |= a->idx32 ? ids32_bad(a->indices, s, prev, E) : ids64_bad(a->indices, s, prev, E);
        } else {
            for (int64_t k = k0; k < hi; ++k) {
                const int64_t s = at(a->offsets, a->off32, k), e = at(a->offsets, a->off32, k + 1);
                if (e < s) bad |= BAD_ORDER;
                if (s < 0 || e < s || e > a->N) continue;
                bad |= a->idx32 ? ids32_bad(a->indices, s, e, E) : ids64_bad(a->indices, s, e, E);
            }
        }
        k0 = hi;
    }
    return bad;
}

static void check_task(void *ctx, int64_t task, int executor) {
    (void)executor;
    check_args *a = ctx;
    const int64_t K = a->T * a->B;
    int bad = check_bags(a, K * task / a->tasks, K * (task + 1) / a->tasks);
    if (a->psw) {
        const int64_t i0 = a->N * task / a->tasks, i1 = a->N * (task + 1) / a->tasks;
        for (int64_t i = i0; i < i1; ++i) bad |= isfinite(a->psw[i]) ? 0 : BAD_WEIGHT;
    }
    if (bad) atomic_fetch_or(&a->bad, bad);
}

/* One pass over the batch; returns 0 or the BAD_* bits: offsets[0] != 0, offsets[T*B] != N,
 * a decreasing offset, an id outside [0, rows[f]) (bags read only where well formed), a
 * non-finite per-sample weight (psw given). */
int tbe_check(const void *indices, int idx32, int64_t N, const void *offsets, int off32,
              int64_t T, int64_t B, const int64_t *rows, const float *psw, int nthreads) {
    int bad = 0;
    if (at(offsets, off32, 0) != 0) bad |= BAD_FIRST;
    if (at(offsets, off32, T * B) != N) bad |= BAD_LAST;
    if (B == 0) return bad;
    check_args a = {indices, offsets, idx32, off32, N, T, B, tbe_tasks(N + T * B, nthreads, 4096),
                    rows, psw, 0};
    tbe_parallel(check_task, &a, a.tasks, nthreads);
    return bad | atomic_load(&a.bad);
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    const void *weights;      /* [sum E*D] the flat weights */
    int dtype;                /* F32 / F16 / BF16 */
    const int64_t *w_offsets; /* [T] first element of feature f's table */
    const int64_t *dims;      /* [T] D of feature f */
    const int64_t *D_offsets; /* [T] first output column of feature f (pooled) */
    const int64_t *rows;      /* [T] ids feature f may name (feature_rows) */
    const void *indices;      /* [N] ids */
    const void *offsets;      /* [T*B+1] bag boundaries */
    int idx32, off32;
    int64_t N, T, B;
    const float *psw;         /* [N] per-sample weights, or NULL */
    int pooling;
    float *out;               /* pooled [B, stride]; unpooled [N, stride] (zeros given) */
    int64_t stride;
    int check;                /* count dropped ids and malformed bags (fwd_counts), fail none */
    int check_weights;        /* (check, psw) also count non-finite per-sample weights */
} fwd_args;

/* what a task's bags dropped (check on): ids out of range, the first one's position (N:
 * none), malformed bags (and, check_weights, non-finite per-sample weights of their ids) */
typedef struct {
    int64_t dropped, first, malformed;
} fwd_counts;

/* o[d0 : d0 + 8 NV] = sum over ids s..e of p_i * row_i[d0 : ...] of table `tab` (rows of D
 * elements of dtype DT, ids < E read by ID(i); p_i = psw[i] when W is 1, 1 when W is 0, either
 * when W is 2); `first`: the bag's first pass, which prefetches the rows forward_ahead ids
 * ahead (up to id pf_end), one line next to each line it loads (as FBGEMM's kernel does; 4%
 * faster on Zipf ids than all of a row's prefetches at once). Returns the number of ids
 * skipped (out of range: every pass over a bag skips the same ones). Constants all: the accumulators stay in registers, and an fp32 id of int64 or
 * int32 ids, weighted or not, costs little beyond its loads (fp16 / bf16 rows take one
 * function for every case). fp32 rows are summed 16 floats (one cache line) at a time: one
 * AVX-512 register in the x86-64-v4 clone (5-10% faster on Zipf ids than two AVX2 ones: fewer
 * instructions per id, so more ids in flight), two AVX2 ones in the v3 clone; the same sums. */
/* Passes after a bag's first (rows of more than 64 columns) issue no row prefetches, and the
 * page walks stop while they run (one per row of a large table: a TLB miss each, nested under
 * a VM; most of the forward's stall on an AMD EPYC): such a pass prefetches the first line of
 * the row TOUCH_IDS ids ahead, a row the next bags' first pass prefetches whole (C1, D = 128,
 * bags of 10 ids: 3-6% less CPU on uniform ids, none on Zipf 1.1; 25-40 ids alike) */
#ifndef TOUCH_IDS
#define TOUCH_IDS 30
#endif
/* A run of ids that repeats few rows (few_repeats: at most DEEP_TOUCH_MAX_REPEATS of
 * REUSE_SAMPLE sampled ids) touches the first DEEP_TOUCH_BYTES of that row instead (the lines
 * of the next bags' first pass): its rows are mostly in no cache. C1 (D = 128), 1-2 threads, huge
 * pages, the kernel alone: the 4-line touch is 7-15 % faster than the one line on uniform and
 * Zipf 0.8 ids, even on Zipf 1.0, 3-6 % slower on Zipf 1.1 and 1.4; the sample picks the
 * better one (docs/results/tbe-cpu-forward-adaptive-2026-12-05.md). -1: never, REUSE_SAMPLE:
 * always. */
#ifndef DEEP_TOUCH_MAX_REPEATS
#define DEEP_TOUCH_MAX_REPEATS 6
#endif
#ifndef DEEP_TOUCH_BYTES
#define DEEP_TOUCH_BYTES 256
#endif
#define REUSE_SAMPLE_BITS 6
#define REUSE_SAMPLE (1 << REUSE_SAMPLE_BITS)
#define ID64(i) ((const int64_t *)a->indices)[i]
#define ID32(i) (int64_t)((const int32_t *)a->indices)[i]
#define IDANY(i) at(a->indices, a->idx32, i)
#define DEFINE_POOL(NV, DT, ES, W, ID, LN)                                                       \
    INLINE int64_t pool_##NV##_##DT##_##W##_##ID##_##LN(const fwd_args *a, const char *tab,     \
                                             int64_t D,                                          \
                                             uint64_t E, int64_t s, int64_t e, int64_t d0,       \
                                             float *o, int64_t pf_end, int first, int deep) {    \
        enum { LINES = LN && ES == 4 && NV % 2 == 0 }; /* fp32 rows in 16-float vectors */      \
        const int64_t bytes = D * ES, ahead = forward_ahead(bytes);                              \
        const char *col = tab + d0 * ES;                                                         \
        v8f acc[NV];                                                                             \
        v16f acc16[NV / 2 > 0 ? NV / 2 : 1];                                                     \
        for (int v = 0; v < NV; ++v) acc[v] = (v8f){0};                                          \
        for (int v = 0; v < NV / 2; ++v) acc16[v] = (v16f){0};                                   \
        int64_t bad = 0;                                                                         \
        for (int64_t i = s; i < e; ++i) {                                                        \
            const char *pf = NULL; /* the row `ahead` ids ahead */                               \
            if (first && i + ahead < pf_end) {                                                   \
                const uint64_t q = (uint64_t)ID(i + ahead);                                      \
                if (q < E) pf = tab + q * bytes;                                                 \
            }                                                                                    \
            if (!first && i + TOUCH_IDS < pf_end) { /* a later pass: start a page walk */       \
                const uint64_t r = (uint64_t)ID(i + TOUCH_IDS);                                  \
                if (r < E) {                                                                     \
                    __builtin_prefetch(tab + r * bytes, 0, 3);                                   \
                    if (deep) /* and fetch the first pass's lines */                             \
                        for (int64_t c = 64; c < DEEP_TOUCH_BYTES && c < bytes; c += 64)         \
                            __builtin_prefetch(tab + r * bytes + c, 0, 3);                       \
                }                                                                                \
            }                                                                                    \
            const uint64_t id = (uint64_t)ID(i);                                                 \
            if (id >= E) {                                                                       \
                ++bad;                                                                           \
                if (pf) prefetch_bytes(pf, bytes, 0);                                            \
                continue;                                                                        \
            }                                                                                    \
            const char *row = col + id * bytes;                                                  \
            const float p = W == 0 ? 1.0f : (W == 1 || a->psw ? a->psw[i] : 1.0f);              \
            if (LINES) {                                                                         \
                for (int v = 0; v < NV / 2; ++v) {                                               \
                    v16f x;                                                                      \
                    memcpy(&x, row + 64 * v, sizeof x);                                          \
                    acc16[v] += W == 0 ? x : p * x;                                              \
                    if (pf) __builtin_prefetch(pf + 64 * v, 0, 3);                               \
                }                                                                                \
            } else {                                                                             \
                for (int v = 0; v < NV; ++v) {                                                   \
                    acc[v] += W == 0 ? load8(row, DT, 8 * v) : p * load8(row, DT, 8 * v);        \
                    if (pf && v * 8 * ES % 64 == 0) __builtin_prefetch(pf + v * 8 * ES, 0, 3);   \
                }                                                                                \
            }                                                                                    \
            if (pf) /* the row's lines past this pass's columns */                               \
                for (int64_t c = NV * 8 * ES; c < bytes; c += 64) __builtin_prefetch(pf + c, 0, 3); \
        }                                                                                        \
        if (LINES) memcpy(o + d0, acc16, sizeof(float) * 8 * NV);                                \
        else memcpy(o + d0, acc, sizeof acc);                                                    \
        return bad;                                                                              \
    }
#define DEFINE_POOLS(DT, ES, W, ID, LN)                                                          \
    DEFINE_POOL(8, DT, ES, W, ID, LN) DEFINE_POOL(4, DT, ES, W, ID, LN)                          \
    DEFINE_POOL(2, DT, ES, W, ID, LN) DEFINE_POOL(1, DT, ES, W, ID, LN)
DEFINE_POOLS(F32, 4, 0, ID64, 0)
DEFINE_POOLS(F32, 4, 0, ID64, 1)
DEFINE_POOLS(F32, 4, 1, ID64, 0)
DEFINE_POOLS(F32, 4, 0, ID32, 0)
DEFINE_POOLS(F32, 4, 0, ID32, 1)
DEFINE_POOLS(F32, 4, 1, ID32, 0)
DEFINE_POOLS(F16, 2, 2, IDANY, 0)
DEFINE_POOLS(BF16, 2, 2, IDANY, 0)

/* the last D - d0 < 8 columns */
INLINE int64_t pool_tail(const fwd_args *a, const char *tab, int64_t D, uint64_t E, int64_t s,
                         int64_t e, int64_t d0, float *o, int64_t pf_end, int first) {
    const int64_t es = a->dtype == F32 ? 4 : 2, n = D - d0, ahead = forward_ahead(D * es);
    float acc[8] = {0};
    int64_t bad = 0;
    for (int64_t i = s; i < e; ++i) {
        if (first && i + ahead < pf_end) {
            const int64_t q = at(a->indices, a->idx32, i + ahead);
            if ((uint64_t)q < E) prefetch_bytes(tab + q * D * es, D * es, 0);
        }
        const int64_t id = at(a->indices, a->idx32, i);
        if ((uint64_t)id >= E) {
            ++bad;
            continue;
        }
        const float p = a->psw ? a->psw[i] : 1.0f;
        const char *row = tab + id * D * es;
        for (int64_t j = 0; j < n; ++j) acc[j] += p * row_at(row, a->dtype, d0 + j);
    }
    memcpy(o + d0, acc, sizeof(float) * n);
    return bad;
}

/* o[0:D] = the pooled rows of ids s..e of feature f (64 columns per pass over the ids; each
 * pass skips the same ids: `bad` is the last pass's count) */
#define POOL_PASSES(DT, W, ID, LN)                                                                 \
    do {                                                                                         \
        for (; d0 + 64 <= D; d0 += 64, first = 0)                                                \
            bad = pool_8_##DT##_##W##_##ID##_##LN(a, tab, D, E, s, e, d0, o, pf_end, first, deep); \
        if (D - d0 >= 32)                                                                        \
            bad = pool_4_##DT##_##W##_##ID##_##LN(a, tab, D, E, s, e, d0, o, pf_end, first, deep), \
                d0 += 32, first = 0;                                                             \
        if (D - d0 >= 16)                                                                        \
            bad = pool_2_##DT##_##W##_##ID##_##LN(a, tab, D, E, s, e, d0, o, pf_end, first, deep), \
                d0 += 16, first = 0;                                                             \
        if (D - d0 >= 8)                                                                         \
            bad = pool_1_##DT##_##W##_##ID##_##LN(a, tab, D, E, s, e, d0, o, pf_end, first, deep), \
                d0 += 8, first = 0;                                                              \
    } while (0)

/* PLAIN: fp32 rows, no per-sample weights (the other cases are not built in); D: a->dims[f].
 * Returns the ids skipped (out of range). */
INLINE int64_t pool_bag_dim(const fwd_args *a, int64_t f, int64_t s, int64_t e, float *o,
                            int64_t pf_end, int deep, int PLAIN, const int64_t D) {
    const uint64_t E = (uint64_t)a->rows[f];
    const char *tab = (const char *)a->weights + a->w_offsets[f] * (a->dtype == F32 ? 4 : 2);
    int64_t bad = 0;
    int first = 1;
    int64_t d0 = 0;
    if (PLAIN == 2 && !a->idx32) POOL_PASSES(F32, 0, ID64, 1);
    else if (PLAIN == 2) POOL_PASSES(F32, 0, ID32, 1);
    else if (PLAIN && !a->idx32) POOL_PASSES(F32, 0, ID64, 0);
    else if (PLAIN) POOL_PASSES(F32, 0, ID32, 0);
    else if (a->dtype == F32 && !a->idx32) POOL_PASSES(F32, 1, ID64, 0);
    else if (a->dtype == F32) POOL_PASSES(F32, 1, ID32, 0);
    else if (a->dtype == F16) POOL_PASSES(F16, 2, IDANY, 0);
    else POOL_PASSES(BF16, 2, IDANY, 0);
    if (D > d0) bad = pool_tail(a, tab, D, E, s, e, d0, o, pf_end, first);
    if (D <= 0) /* no pass read the ids */
        for (int64_t i = s; i < e; ++i) bad += (uint64_t)at(a->indices, a->idx32, i) >= E;
    return bad;
}

/* fp32 rows of D = 64 or 128 without weights get their own copy, D a constant: the passes
 * unrolled, each id's prefetches and row address without a loop or a multiply (C1, D = 128:
 * ~10% less CPU time per forward on an AMD EPYC; the same sums) */
INLINE int64_t pool_bag(const fwd_args *a, int64_t f, int64_t s, int64_t e, float *o,
                        int64_t pf_end, int deep, int PLAIN) {
    const int64_t D = a->dims[f];
    if (PLAIN && D == 128) return pool_bag_dim(a, f, s, e, o, pf_end, deep, PLAIN, 128);
    if (PLAIN && D == 64) return pool_bag_dim(a, f, s, e, o, pf_end, deep, PLAIN, 64);
    return pool_bag_dim(a, f, s, e, o, pf_end, deep, PLAIN, D);
}

/* Does the run of ids s..e repeat few rows (at most DEEP_TOUCH_MAX_REPEATS in its first
 * REUSE_SAMPLE ids)? Counted in a small open-addressing set on the stack, on the run's first ids
 * (the pass reads them next; a strided sample over the run cost 1-2 % more on C1 Zipf 1.1, one
 * of 256 ids ~1 % of its module forward). Repeats in the first 64 ids of a C1 table's run (E =
 * 2e5; 1 or 2 runs a table): uniform 0, Zipf 0.8 0-3, Zipf 0.9 2-10, Zipf 1.0 7-17, Zipf 1.1
 * 13-23, Zipf 1.4 31-41. */
static int few_repeats(const fwd_args *a, int64_t s, int64_t e) {
    if (DEEP_TOUCH_MAX_REPEATS < 0 || s < 0 || e <= s) return 0;
    if (DEEP_TOUCH_MAX_REPEATS >= REUSE_SAMPLE) return 1;
    const int64_t m = e - s < REUSE_SAMPLE ? e - s : REUSE_SAMPLE;
    uint64_t seen[2 * REUSE_SAMPLE]; /* id + 1; 0: empty */
    memset(seen, 0, sizeof seen);
    int64_t repeats = 0;
    for (int64_t j = 0; j < m; ++j) {
        const uint64_t key = (uint64_t)at(a->indices, a->idx32, s + j) + 1;
        uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> (63 - REUSE_SAMPLE_BITS); /* a slot */
        while (seen[h] && seen[h] != key) h = (h + 1) & (2 * REUSE_SAMPLE - 1);
        if (seen[h]) ++repeats;
        else seen[h] = key;
    }
    return repeats * REUSE_SAMPLE <= (int64_t)DEEP_TOUCH_MAX_REPEATS * m;
}

/* the first id of s..e that feature f's table does not hold (a bag that dropped some) */
static int64_t first_dropped(const fwd_args *a, int64_t f, int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i)
        if ((uint64_t)at(a->indices, a->idx32, i) >= (uint64_t)a->rows[f]) return i;
    return e;
}

/* fwd_bags' bags k0 .. hi of feature f (end: where prefetching stops; deep: as few_repeats
 * says, a constant where the caller can make it one) */
INLINE int fwd_run(const fwd_args *a, int64_t f, int64_t k0, int64_t hi, int64_t end, int deep,
                   int PLAIN, fwd_counts *c) {
    int bad = 0;
    const int64_t last = a->T * a->B - 1, D = a->dims[f];
    for (int64_t k = k0; k < hi; ++k) {
        const int64_t s = at(a->offsets, a->off32, k), e = at(a->offsets, a->off32, k + 1);
        float *o = a->out + (k - f * a->B) * a->stride + a->D_offsets[f];
        if (s < 0 || e < s || e > a->N ||
            (a->check && ((k == 0 && s != 0) || (k == last && e != a->N)))) {
            if (a->pooling != POOL_NONE) memset(o, 0, sizeof(float) * D);
            bad |= BAD_ORDER;
            c->malformed++;
            continue;
        }
        if (a->check_weights) { /* the bag's weights, in cache: read again below */
            int64_t nonfinite = 0;
            for (int64_t i = s; i < e; ++i) nonfinite += !isfinite(a->psw[i]);
            if (nonfinite) bad |= BAD_WEIGHT, c->malformed += nonfinite;
        }
        if (a->pooling == POOL_NONE) {
            for (int64_t i = s; i < e; ++i)
                if (pool_bag(a, f, i, i + 1, a->out + i * a->stride, end, deep, PLAIN)) {
                    bad |= BAD_ID;
                    c->dropped++;
                    if (i < c->first) c->first = i;
                }
            continue;
        }
        const int64_t dropped = pool_bag(a, f, s, e, o, end, deep, PLAIN);
        if (dropped) {
            bad |= BAD_ID;
            c->dropped += dropped;
            if (s < c->first) {
                const int64_t i = first_dropped(a, f, s, e);
                if (i < c->first) c->first = i;
            }
        }
        if (a->pooling == POOL_MEAN && e - s > dropped) {
            const float n = (float)(e - s - dropped);
            for (int64_t d = 0; d < D; ++d) o[d] /= n;
        }
    }
    return bad;
}

/* Bags k0 .. k1 (feature-major: bag k of feature k / B); returns BAD_* bits (bad bags and ids
 * skipped, non-finite weights), and with a->check counts them in c (a bag is also malformed if it is the first
 * and does not start at 0, or the last and does not end at N, as the Triton kernel's check).
 * Skipped ids are dropped: a mean divides by the ids kept. PLAIN: as pool_bag's. */
INLINE int fwd_bags(const fwd_args *a, int64_t k0, int64_t k1, int PLAIN, fwd_counts *c) {
    int bad = 0;
    while (k0 < k1) {
        const int64_t f = k0 / a->B, hi = (f + 1) * a->B < k1 ? (f + 1) * a->B : k1;
        int64_t end = at(a->offsets, a->off32, hi); /* prefetching stops here */
        if (end > a->N) end = a->N;
        const int deep = a->dims[f] > 64 && few_repeats(a, at(a->offsets, a->off32, k0), end);
        /* the common case's two depths built apart: a run-time flag in its inner loop cost */
        if (PLAIN && deep) bad |= fwd_run(a, f, k0, hi, end, 1, PLAIN, c);
        else bad |= fwd_run(a, f, k0, hi, end, PLAIN ? 0 : deep, PLAIN, c);
        k0 = hi;
    }
    return bad;
}

/* The common case, fp32 rows without weights. With AVX-512 its rows are summed a cache line
 * (one 16-float register) at a time; without, 8 floats at a time: the 16-float vectors built
 * for AVX2 spilled to the stack (an AMD EPYC without AVX-512: 2x slower than FBGEMM's kernel;
 * 8-float ones: the same sums, element-wise in id order). */
TBE_TARGETS
static int fwd_bags_plain(const fwd_args *a, int64_t k0, int64_t k1, fwd_counts *c) {
    return fwd_bags(a, k0, k1, 1, c);
}

#ifdef TBE_WIDE
TBE_WIDE
static int fwd_bags_lines(const fwd_args *a, int64_t k0, int64_t k1, fwd_counts *c) {
    return fwd_bags(a, k0, k1, 2, c);
}

static int have_wide(void) {
    static _Atomic int known = -1;
    int k = atomic_load(&known);
    if (k < 0) {
        __builtin_cpu_init();
        k = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512cd"); /* x86-64-v4's AVX-512 */
        atomic_store(&known, k);
    }
    return k;
}
#define FWD_PLAIN(a, k0, k1, c)                                                                \
    (have_wide() ? fwd_bags_lines(a, k0, k1, c) : fwd_bags_plain(a, k0, k1, c))
#else
#define FWD_PLAIN(a, k0, k1, c) fwd_bags_plain(a, k0, k1, c)
#endif

TBE_TARGETS
static int fwd_bags_any(const fwd_args *a, int64_t k0, int64_t k1, fwd_counts *c) {
    return fwd_bags(a, k0, k1, 0, c);
}

typedef struct {
    const fwd_args *a;
    int64_t tasks;
    const float *grad; /* tbe_psw_grad's */
    _Atomic int bad;
    _Atomic int64_t dropped, first, malformed; /* the tasks' fwd_counts: sums, min */
} fwd_task_args;

static void fwd_task(void *ctx, int64_t task, int executor) {
    (void)executor;
    fwd_task_args *t = ctx;
    const int64_t K = t->a->T * t->a->B;
    const int64_t k0 = K * task / t->tasks, k1 = K * (task + 1) / t->tasks;
    fwd_counts c = {0, t->a->N, 0};
    const int bad = t->a->dtype == F32 && !t->a->psw ? FWD_PLAIN(t->a, k0, k1, &c)
                                                     : fwd_bags_any(t->a, k0, k1, &c);
    if (!bad) return;
    atomic_fetch_or(&t->bad, bad);
    if (c.dropped) atomic_fetch_add(&t->dropped, c.dropped);
    if (c.malformed) atomic_fetch_add(&t->malformed, c.malformed);
    int64_t seen = atomic_load(&t->first);
    while (c.first < seen && !atomic_compare_exchange_weak(&t->first, &seen, c.first)) {
    }
}

/* Pooled: out[b, D_offsets[f] : + dims[f]] = the sum (mean) of bag f*B+b's rows times their
 * per-sample weights (an empty bag: zeros). Unpooled: out[i, :dims[f]] = row of id i (times
 * its weight), for the ids of the bags (the rest of out is left as given). rows: [T] E of each
 * feature's table, or NULL (then only the weights' size bounds the ids).
 * Returns 0 or minus the BAD_* bits of what was skipped. With err ([3], as the Triton forward
 * kernel's): ids out of range are dropped (a mean divides by the ids kept) and counted in
 * err[0], err[1] = max(err[1], N - the first one's position), malformed bags (as fwd_bags
 * says; with B = 0, offsets other than [0] with N = 0) added to err[2], and, check_weights
 * (bounds_check="error"), the non-finite per-sample weights of the bags' ids; returns 0 then (but
 * -NO_MEMORY): the caller reads err, as bounds_check does on the Triton path, instead of a
 * separate pass over the batch before the lookup. */
int tbe_forward(const void *weights, int dtype, int64_t numel, const int64_t *w_offsets,
                const int64_t *dims, const int64_t *D_offsets, const int64_t *rows,
                const void *indices, int idx32, int64_t N, const void *offsets, int off32,
                const float *psw, int64_t T, int64_t B, int pooling, float *out, int64_t stride,
                int64_t *err, int check_weights, int nthreads) {
    int64_t *E = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!E) return -NO_MEMORY;
    feature_rows(T, rows, w_offsets, dims, NULL, numel, -1, E);
    fwd_args a = {weights, dtype, w_offsets, dims, D_offsets, E, indices, offsets, idx32,
                  off32, N, T, B, psw, pooling, out, stride, err != NULL,
                  err != NULL && psw != NULL && check_weights};
    /* a few tasks per thread, each a range of bags in feature-major order: a feature's bags of
     * a task are one run of ids, prefetched as one stream, and a thread works on one table at
     * a time (its rows that repeat stay in the core's L2; with tasks of whole samples every
     * thread swept all the tables, 1.1-1.6x slower, the most when another process shares a
     * core) */
    const int64_t tasks = tbe_tasks(T * B, nthreads, 16);
    fwd_task_args t = {&a, tasks, NULL, 0, 0, N, 0};
    tbe_parallel(fwd_task, &t, tasks, nthreads);
    free(E);
    if (!err) return -atomic_load(&t.bad);
    const int64_t dropped = atomic_load(&t.dropped), first = atomic_load(&t.first);
    err[0] += dropped;
    if (dropped && N - first > err[1]) err[1] = N - first;
    err[2] += atomic_load(&t.malformed);
    if (T * B == 0 && (at(offsets, off32, 0) != 0 || N != 0)) err[2] += 1;
    return 0;
}

/* ---------------------------------------------------------------- per-sample weights */

/* <row, g> over D in fixed lanes */
INLINE float dot_row(const void *row, int dtype, const float *restrict g, int64_t D) {
    float lane[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] += row_at(row, dtype, d + j) * g[d + j];
    for (int j = 0; d < D; ++d, ++j) lane[j] += row_at(row, dtype, d) * g[d];
    float s = 0.0f;
    for (int j = 0; j < LANES; ++j) s += lane[j];
    return s;
}

TBE_TARGETS
static void psw_grad_samples(const fwd_args *a, const float *grad, int64_t b0, int64_t b1,
                             float *out) {
    const int64_t esize = a->dtype == F32 ? 4 : 2;
    const char *w8 = a->weights;
    for (int64_t f = 0; f < a->T; ++f) {
        const int64_t D = a->dims[f], base = a->w_offsets[f];
        for (int64_t k = f * a->B + b0; k < f * a->B + b1; ++k) {
            const int64_t s = at(a->offsets, a->off32, k), e = at(a->offsets, a->off32, k + 1);
            if (s < 0 || e < s || e > a->N) continue;
            const float *go = grad + (k - f * a->B) * a->stride + a->D_offsets[f];
            for (int64_t i = s; i < e; ++i) {
                const int64_t id = at(a->indices, a->idx32, i);
                if ((uint64_t)id >= (uint64_t)a->rows[f]) continue;
                const char *row = w8 + (base + id * D) * esize;
                const float *gi = a->pooling == POOL_NONE ? grad + i * a->stride : go;
                const float dot = dot_row(row, a->dtype, gi, D);
                out[i] = a->pooling == POOL_MEAN ? dot / (float)(e - s) : dot;
            }
        }
    }
}

static void psw_grad_task(void *ctx, int64_t task, int executor) {
    (void)executor;
    fwd_task_args *t = ctx;
    const int64_t B = t->a->B;
    psw_grad_samples(t->a, t->grad, B * task / t->tasks, B * (task + 1) / t->tasks, t->a->out);
}

/* out[i] = <gradient row of id i's bag (unpooled: of id i), row of id i> (/ the bag's length
 * under MEAN), for the ids of the bags (the rest of out is left as given). Returns 0. */
int tbe_psw_grad(const float *grad, int64_t stride, int pooling, const void *weights, int dtype,
                 int64_t numel, const int64_t *w_offsets, const int64_t *dims,
                 const int64_t *D_offsets, const int64_t *rows, const void *indices, int idx32,
                 int64_t N, const void *offsets, int off32, int64_t T, int64_t B, float *out,
                 int nthreads) {
    int64_t *E = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!E) return -NO_MEMORY;
    feature_rows(T, rows, w_offsets, dims, NULL, numel, -1, E);
    fwd_args a = {weights, dtype, w_offsets, dims, D_offsets, E, indices, offsets, idx32,
                  off32, N, T, B, NULL, pooling, NULL, stride, 0, 0};
    a.out = out;
    const int64_t tasks = tbe_tasks(B, nthreads, 16);
    fwd_task_args t = {&a, tasks, grad, 0, 0, N, 0};
    tbe_parallel(psw_grad_task, &t, tasks, nthreads);
    free(E);
    return 0;
}
