/* The fast CPU path's native kernels (fbtriton_dist/ops/cpu_native.py compiles this file on
 * first use and calls it through ctypes on tensors' data pointers).
 *
 *   tbe_check     one pass over a batch: are the offsets and ids well formed? (a bit mask)
 *   tbe_forward   pooled (SUM / MEAN) or unpooled rows, per-sample weights, mixed D
 *   tbe_plan      the backward's plan: each id's key (its table's first row + id) sorted
 *                 stably (a parallel LSD radix sort), and the start of each unique key's run
 *   tbe_backward  each unique row's gradient summed over its ids, then one fused optimizer
 *                 step on the row in place (or the summed gradients written out)
 *   tbe_psw_grad  the per-sample weights' gradient
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
 * instead of reading out of bounds; the Python side validates batches before (ops/tbe.py), so
 * this is a guard, not the policy.
 *
 * Deterministic: a bag sums its ids in order; a row's gradient sums its ids in batch order
 * (the sort is stable) on the one thread that owns the row; reductions over D use fixed lanes.
 * No result depends on the number of threads. Built with -ffp-contract=off, so that the AVX2
 * and baseline clones (GCC's target_clones, picked when the library loads) give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(TBE_NO_CLONES)
#define TBE_TARGETS __attribute__((target_clones("arch=haswell", "default")))
#else
#define TBE_TARGETS
#endif

enum { F32 = 0, F16 = 1, BF16 = 2 };
enum { POOL_SUM = 0, POOL_MEAN = 1, POOL_NONE = 2 };
enum { OPT_NONE = 0, OPT_SGD = 1, OPT_ROWWISE_ADAGRAD = 2, OPT_ADAM = 3, OPT_ADAGRAD = 4 };
/* tbe_check's bits; the other kernels return minus one of them */
enum { BAD_FIRST = 1, BAD_LAST = 2, BAD_ORDER = 4, BAD_ID = 8, BAD_WEIGHT = 16, NO_MEMORY = 32,
       TOO_BIG = 64 };

#define PREFETCH_IDS 8  /* ids ahead whose rows are prefetched */
#define PREFETCH_RUNS 4 /* runs ahead whose rows (and states) are prefetched */
#define LANES 8         /* fixed lanes of the reductions over D */

static inline int64_t at(const void *p, int is32, int64_t i) {
    return is32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

/* E[f]: the rows feature f's ids may name: rows[f] (NULL: unknown), capped by what the buffers
 * hold (elements of the weights and per-element states from w_offsets[f], per-row state rows
 * from row_offsets[f]; -1: none), so that no id reads or writes outside them. */
static void feature_rows(int64_t T, const int64_t *rows, const int64_t *w_offsets,
                         const int64_t *dims, const int64_t *row_offsets, int64_t elem_limit,
                         int64_t row_limit, int64_t *E) {
    for (int64_t f = 0; f < T; ++f) {
        int64_t e = dims[f] > 0 ? (elem_limit - w_offsets[f]) / dims[f] : 0;
        if (rows && rows[f] < e) e = rows[f];
        if (row_limit >= 0 && row_offsets && row_limit - row_offsets[f] < e)
            e = row_limit - row_offsets[f];
        E[f] = e > 0 ? e : 0;
    }
}

static inline void prefetch_bytes(const void *p, int64_t nbytes, int write) {
    for (int64_t c = 0; c < nbytes; c += 64) {
        if (write)
            __builtin_prefetch((const char *)p + c, 1, 0);
        else
            __builtin_prefetch((const char *)p + c, 0, 0);
    }
}

/* ---------------------------------------------------------------- fp16 / bf16 */

typedef union { uint32_t u; float f; } bits32;

static inline float f16_to_f32(uint16_t h) {
    bits32 v;
    const uint32_t em = h & 0x7fffu;
    v.u = em << 13;
    v.f *= 0x1p112f; /* re-bias the exponent; subnormals come out right */
    if (em >= 0x7c00u) v.u |= 0x7f800000u; /* inf / nan */
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even */
    bits32 x = {.f = f};
    const uint32_t sign = x.u & 0x80000000u;
    uint16_t o;
    x.u ^= sign;
    if (x.u >= (uint32_t)(127 + 16) << 23) { /* overflow to inf, or nan */
        o = x.u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x.u < (uint32_t)113 << 23) { /* a subnormal half (or zero) */
        bits32 magic = {.u = (uint32_t)((127 - 15) + (23 - 10) + 1) << 23};
        x.f += magic.f;
        o = (uint16_t)(x.u - magic.u);
    } else {
        const uint32_t odd = (x.u >> 13) & 1u;
        x.u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(x.u >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float bf16_to_f32(uint16_t b) {
    bits32 v = {.u = (uint32_t)b << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    bits32 x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

static inline float half_to_f32(uint16_t h, int dtype) {
    return dtype == F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

static inline uint16_t f32_to_half(float f, int dtype) {
    return dtype == F16 ? f32_to_f16(f) : f32_to_bf16(f);
}

static inline uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The reference's stochastic rounding (reference.tbe.stochastic_round): add uniform noise of
 * one ulp of the half type at x, then round toward zero; the noise of element `elem` of update
 * `seed` is a hash of the two, so no draw depends on the thread that makes it. */
static inline uint16_t f32_to_half_stochastic(float x, int dtype, uint64_t seed, int64_t elem) {
    const int mantissa = dtype == F16 ? 10 : 7, min_exp = dtype == F16 ? -14 : -126;
    int e;
    frexpf(x, &e);
    int ulp = (e - 1 > min_exp ? e - 1 : min_exp) - mantissa;
    if (ulp < -126) ulp = -126;
    const float u = (float)(mix64(seed * 0x9e3779b97f4a7c15ull + (uint64_t)elem) >> 40) * 0x1p-24f;
    const float sgn = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    const float noisy = x + sgn * (u * ldexpf(1.0f, ulp));
    uint16_t y = f32_to_half(noisy, dtype);
    if (fabsf(half_to_f32(y, dtype)) > fabsf(noisy)) y = (uint16_t)(y - 1); /* one ulp back */
    return y;
}

/* ---------------------------------------------------------------- check */

/* One pass over the batch; returns 0 or the BAD_* bits: offsets[0] != 0, offsets[T*B] != N,
 * a decreasing offset, an id outside [0, rows[f]) (bags read only where well formed), a
 * non-finite per-sample weight (psw given). */
int tbe_check(const void *indices, int idx32, int64_t N, const void *offsets, int off32,
              int64_t T, int64_t B, const int64_t *rows, const float *psw, int nthreads) {
    int bad = 0;
    if (at(offsets, off32, 0) != 0) bad |= BAD_FIRST;
    if (at(offsets, off32, T * B) != N) bad |= BAD_LAST;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(| : bad)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t k0 = T * B * tid / nt, k1 = T * B * (tid + 1) / nt;
        for (int64_t k = k0; k < k1; ++k) {
            const int64_t s = at(offsets, off32, k), e = at(offsets, off32, k + 1);
            if (e < s) bad |= BAD_ORDER;
            if (s < 0 || e < s || e > N) continue;
            const uint64_t E = (uint64_t)rows[k / B];
            int64_t i = s;
            if (idx32) {
                const int32_t *ids = indices;
                for (; i < e; ++i) bad |= (uint64_t)(int64_t)ids[i] >= E ? BAD_ID : 0;
            } else {
                const int64_t *ids = indices;
                for (; i < e; ++i) bad |= (uint64_t)ids[i] >= E ? BAD_ID : 0;
            }
        }
        if (psw) {
            const int64_t i0 = N * tid / nt, i1 = N * (tid + 1) / nt;
            for (int64_t i = i0; i < i1; ++i) bad |= isfinite(psw[i]) ? 0 : BAD_WEIGHT;
        }
    }
    return bad;
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    const void *weights;      /* [sum E*D] the flat weights */
    int dtype;                /* F32 / F16 / BF16 */
    const int64_t *w_offsets; /* [T] first element of feature f's table */
    const int64_t *dims;      /* [T] D of feature f */
    const int64_t *D_offsets; /* [T] first output column of feature f (pooled) */
    const int64_t *rows;      /* [T] E of feature f's table */
    const void *indices;      /* [N] ids */
    const void *offsets;      /* [T*B+1] bag boundaries */
    int idx32, off32;
    int64_t N, T, B;
    const float *psw;         /* [N] per-sample weights, or NULL */
    int pooling;
    float *out;               /* pooled [B, stride]; unpooled [N, stride] (zeros given) */
    int64_t stride;
} fwd_args;

/* o[0:D] += p * row (in fp32) */
static inline void add_row(float *restrict o, const void *row, int dtype, int64_t D, float p) {
    if (dtype == F32) {
        const float *restrict r = row;
        for (int64_t d = 0; d < D; ++d) o[d] += p * r[d];
    } else if (dtype == F16) {
        const uint16_t *restrict r = row;
        for (int64_t d = 0; d < D; ++d) o[d] += p * f16_to_f32(r[d]);
    } else {
        const uint16_t *restrict r = row;
        for (int64_t d = 0; d < D; ++d) o[d] += p * bf16_to_f32(r[d]);
    }
}

/* Bags f*B+b0 .. f*B+b1 of every feature f; returns BAD_* bits (bad bags and ids skipped). */
TBE_TARGETS
static int fwd_samples(const fwd_args *a, int64_t b0, int64_t b1) {
    const int64_t esize = a->dtype == F32 ? 4 : 2;
    const char *w8 = a->weights;
    int bad = 0;
    for (int64_t f = 0; f < a->T; ++f) {
        const int64_t D = a->dims[f], E = a->rows[f], base = a->w_offsets[f];
        const int64_t lo = f * a->B + b0, hi = f * a->B + b1;
        int64_t end = at(a->offsets, a->off32, hi); /* prefetching stops here */
        if (end > a->N) end = a->N;
        for (int64_t k = lo; k < hi; ++k) {
            const int64_t s = at(a->offsets, a->off32, k), e = at(a->offsets, a->off32, k + 1);
            float *o = a->pooling == POOL_NONE ? NULL
                                               : a->out + (k - f * a->B) * a->stride + a->D_offsets[f];
            if (o) memset(o, 0, sizeof(float) * D);
            if (s < 0 || e < s || e > a->N) {
                bad |= BAD_ORDER;
                continue;
            }
            for (int64_t i = s; i < e; ++i) {
                if (i + PREFETCH_IDS < end) {
                    const int64_t q = at(a->indices, a->idx32, i + PREFETCH_IDS);
                    if ((uint64_t)q < (uint64_t)E)
                        prefetch_bytes(w8 + (base + q * D) * esize, D * esize, 0);
                }
                const int64_t id = at(a->indices, a->idx32, i);
                if ((uint64_t)id >= (uint64_t)E) {
                    bad |= BAD_ID;
                    continue;
                }
                const float p = a->psw ? a->psw[i] : 1.0f;
                add_row(o ? o : a->out + i * a->stride, w8 + (base + id * D) * esize, a->dtype, D,
                        p);
            }
            if (o && a->pooling == POOL_MEAN && e > s) {
                const float n = (float)(e - s);
                for (int64_t d = 0; d < D; ++d) o[d] /= n;
            }
        }
    }
    return bad;
}

/* Pooled: out[b, D_offsets[f] : + dims[f]] = the sum (mean) of bag f*B+b's rows times their
 * per-sample weights (an empty bag: zeros). Unpooled: out[i, :dims[f]] = row of id i (times
 * its weight), for the ids of the bags (the rest of out is left as given).
 * Returns 0 or minus the BAD_* bits of what was skipped. */
int tbe_forward(const void *weights, int dtype, int64_t numel, const int64_t *w_offsets,
                const int64_t *dims, const int64_t *D_offsets, const int64_t *rows,
                const void *indices, int idx32, int64_t N, const void *offsets, int off32,
                const float *psw, int64_t T, int64_t B, int pooling, float *out, int64_t stride,
                int nthreads) {
    int64_t *E = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!E) return -NO_MEMORY;
    feature_rows(T, rows, w_offsets, dims, NULL, numel, -1, E);
    fwd_args a = {weights, dtype, w_offsets, dims, D_offsets, E, indices, offsets, idx32,
                  off32, N, T, B, psw, pooling, out, stride};
    const int64_t chunk = 16; /* samples per task: a task reads chunk * T bags */
    const int64_t tasks = (B + chunk - 1) / chunk;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(dynamic, 1) \
    reduction(| : bad)
    for (int64_t j = 0; j < tasks; ++j) {
        const int64_t b0 = j * chunk, b1 = b0 + chunk < B ? b0 + chunk : B;
        bad |= fwd_samples(&a, b0, b1);
    }
    free(E);
    return -bad;
}

/* ---------------------------------------------------------------- plan (sort) */

/* Stable LSD radix sort of N packed (key << pos_bits | pos) values by bits pos_bits ..
 * pos_bits + key_bits, in passes of at most 11 bits, every pass parallel: each thread counts
 * its contiguous block, the counts are summed in (digit, thread) order, each thread scatters
 * its block in order. Called inside a parallel region (every thread of the team); `hist` has
 * room for nt << 11 counts. Returns which buffer holds the result (0: a, 1: b). */
static int radix_sort(uint64_t *a, uint64_t *b, int64_t N, int pos_bits, int key_bits,
                      int64_t *hist) {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int passes = (key_bits + 10) / 11;
    const int width = passes ? (key_bits + passes - 1) / passes : 0;
    const int64_t radix = (int64_t)1 << width, mask = radix - 1;
    const int64_t i0 = N * tid / nt, i1 = N * (tid + 1) / nt;
    int64_t *mine = hist + tid * radix;
    uint64_t *src = a, *dst = b;
    for (int pass = 0; pass < passes; ++pass) {
        const int shift = pos_bits + pass * width;
        memset(mine, 0, sizeof(int64_t) * radix);
        for (int64_t i = i0; i < i1; ++i) mine[(src[i] >> shift) & mask]++;
#pragma omp barrier
#pragma omp single
        {
            int64_t sum = 0;
            for (int64_t d = 0; d < radix; ++d) {
                for (int t = 0; t < nt; ++t) {
                    const int64_t c = hist[t * radix + d];
                    hist[t * radix + d] = sum;
                    sum += c;
                }
            }
        } /* implied barrier */
        for (int64_t i = i0; i < i1; ++i) dst[mine[(src[i] >> shift) & mask]++] = src[i];
#pragma omp barrier
        uint64_t *swap = src;
        src = dst;
        dst = swap;
    }
    return src == b;
}

/* The backward's plan of a batch: packed[j] = key << pos_bits | i for the M ids i of the bags
 * (key = row_offsets[f] + id), sorted stably by key; bag[i] = the bag of id i; run_start[r] =
 * the first j of unique key r, run_start[U] = M. `packed` and `tmp` hold N values each (the
 * result may land in either: *which = 0 or 1), run_start N + 1. Returns U, or minus BAD_*
 * (bad bag or id), NO_MEMORY, or TOO_BIG (key and position bits over 64). */
int64_t tbe_plan(const void *indices, int idx32, int64_t N, const void *offsets, int off32,
                 int64_t T, int64_t B, const int64_t *rows, const int64_t *w_offsets,
                 const int64_t *dims, const int64_t *row_offsets, int64_t elem_limit,
                 int64_t row_limit, uint64_t *packed, uint64_t *tmp, int32_t *bag,
                 int64_t *run_start, int *pos_bits_out, int *which, int nthreads) {
    const int64_t first = at(offsets, off32, 0), last = at(offsets, off32, T * B);
    if (first < 0 || last < first || last > N || T * B >= ((int64_t)1 << 31)) return -BAD_ORDER;
    const int64_t M = last - first;
    if (nthreads < 1) nthreads = 1;
    int64_t *hist = malloc(sizeof(int64_t) * ((int64_t)nthreads << 11));
    int64_t *counts = malloc(sizeof(int64_t) * (nthreads + 1));
    int64_t *E = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!hist || !counts || !E) {
        free(hist);
        free(counts);
        free(E);
        return -NO_MEMORY;
    }
    feature_rows(T, rows, w_offsets, dims, row_offsets, elem_limit, row_limit, E);
    int64_t max_key = 0;
    for (int64_t f = 0; f < T; ++f)
        if (row_offsets[f] + E[f] > max_key) max_key = row_offsets[f] + E[f];
    int pos_bits = 1, key_bits = 1;
    while ((N >> pos_bits) > 0) ++pos_bits;
    while (key_bits < 63 && (max_key >> key_bits) > 0) ++key_bits;
    if (pos_bits + key_bits > 64) {
        free(hist);
        free(counts);
        free(E);
        return -TOO_BIG;
    }
    *pos_bits_out = pos_bits;
    int bad = 0, in_b = 0, team = 1;
#pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        if (tid == 0) team = nt;
        /* 1. keys and bags, over this thread's bags */
        const int64_t k0 = T * B * tid / nt, k1 = T * B * (tid + 1) / nt;
        for (int64_t k = k0; k < k1; ++k) {
            const int64_t s = at(offsets, off32, k), e = at(offsets, off32, k + 1);
            if (s < first || e < s || e > last) {
                bad |= BAD_ORDER;
                continue;
            }
            const int64_t f = k / B, rows_f = E[f], kb = row_offsets[f];
            for (int64_t i = s; i < e; ++i) {
                int64_t id = at(indices, idx32, i);
                if ((uint64_t)id >= (uint64_t)rows_f) {
                    bad |= BAD_ID;
                    id = 0; /* keeps the key in range; the plan is refused anyway */
                }
                packed[i - first] = ((uint64_t)(kb + id) << pos_bits) | (uint64_t)i;
                bag[i] = (int32_t)k;
            }
        }
#pragma omp barrier
        /* 2. sort by key (stable: positions stay in batch order within a key) */
        const int res = radix_sort(packed, tmp, M, pos_bits, key_bits, hist);
        if (tid == 0) in_b = res;
        const uint64_t *sorted = res ? tmp : packed;
        /* 3. run starts: count this thread's, then write them at its offset */
        const int64_t j0 = M * tid / nt, j1 = M * (tid + 1) / nt;
        int64_t c = 0;
        for (int64_t j = j0; j < j1; ++j)
            c += j == 0 || (sorted[j] >> pos_bits) != (sorted[j - 1] >> pos_bits);
        counts[tid + 1] = c;
#pragma omp barrier
#pragma omp single
        {
            counts[0] = 0;
            for (int t = 0; t < nt; ++t) counts[t + 1] += counts[t];
        }
        int64_t r = counts[tid];
        for (int64_t j = j0; j < j1; ++j)
            if (j == 0 || (sorted[j] >> pos_bits) != (sorted[j - 1] >> pos_bits))
                run_start[r++] = j;
    }
    const int64_t U = counts[team]; /* the team may be smaller than asked */
    run_start[U] = M;
    *which = in_b;
    free(hist);
    free(counts);
    free(E);
    return bad ? -bad : U;
}

/* ---------------------------------------------------------------- backward */

typedef struct {
    const float *grad;        /* pooled [B, stride] / unpooled [N, stride] fp32 */
    int64_t stride;
    int pooling;
    const uint64_t *sorted;   /* [M] the plan's packed keys */
    int pos_bits;
    const int32_t *bag;       /* [N] bag of each id */
    const int64_t *run_start; /* [U + 1] */
    int64_t U;
    const void *indices, *offsets;
    int idx32, off32;
    int64_t B;
    const int64_t *w_offsets, *dims, *D_offsets, *row_offsets; /* [T] each */
    const float *psw;         /* [N] or NULL */
    void *weights;            /* updated in place */
    int dtype;
    float *m1, *m2;           /* optimizer states (NULL where it has none) */
    int opt, decoupled;
    float lr, eps, b1, b2, wd, bc1, bc2; /* bc1, bc2: 1 - beta^t (Adam) */
    int sr;                   /* stochastic rounding of fp16 / bf16 rows */
    uint64_t seed;
    float *row_grads;         /* OPT_NONE: [U, max_D] summed gradients, else NULL */
    int64_t *row_elems, *row_dims; /* OPT_NONE: [U] first element and D of each row */
    int64_t max_D;
} bwd_args;

static inline float sum_squares(const float *restrict x, const float *restrict w, float l2,
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
static inline void update_row(const bwd_args *a, float *restrict w, const float *restrict g,
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
    case OPT_ROWWISE_ADAGRAD: {
        float *m = a->m1 + state_row;
        const float l2 = a->decoupled ? 0.0f : a->wd;
        const float mv = *m + sum_squares(g, w, l2, D) / (float)D;
        *m = mv;
        const float mult = a->lr / (sqrtf(mv) + a->eps);
        const float corr = a->decoupled ? (float)(1.0 - (double)a->lr * a->wd) : 1.0f - mult * a->wd;
        for (int64_t d = 0; d < D; ++d) w[d] = corr * w[d] - mult * g[d];
        break;
    }
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

/* The address of the gradient row that id position p of bag k reads, and its scale. */
static inline const float *grad_of(const bwd_args *a, int64_t p, int64_t k, float *scale) {
    float s = a->psw ? a->psw[p] : 1.0f;
    if (a->pooling == POOL_NONE) {
        *scale = s;
        return a->grad + p * a->stride;
    }
    const int64_t f = k / a->B, b = k - f * a->B;
    if (a->pooling == POOL_MEAN)
        s = s / (float)(at(a->offsets, a->off32, k + 1) - at(a->offsets, a->off32, k));
    *scale = s;
    return a->grad + b * a->stride + a->D_offsets[f];
}

/* Runs r0 .. r1: sum each row's gradient in g, then update the row (or write g out). */
TBE_TARGETS
static void bwd_runs(const bwd_args *a, int64_t r0, int64_t r1, float *restrict g,
                     float *restrict wbuf) {
    const uint64_t pmask = ((uint64_t)1 << a->pos_bits) - 1;
    const int64_t esize = a->dtype == F32 ? 4 : 2;
    char *w8 = a->weights;
    const int64_t j_end = a->run_start[r1];
    for (int64_t r = r0; r < r1; ++r) {
        if (r + PREFETCH_RUNS < r1) {
            const int64_t q = (int64_t)(a->sorted[a->run_start[r + PREFETCH_RUNS]] & pmask);
            const int64_t fq = a->bag[q] / a->B, idq = at(a->indices, a->idx32, q);
            const int64_t Dq = a->dims[fq], eq = a->w_offsets[fq] + idq * Dq;
            if (a->opt != OPT_NONE) prefetch_bytes(w8 + eq * esize, Dq * esize, 1);
            if (a->opt == OPT_ROWWISE_ADAGRAD)
                __builtin_prefetch(a->m1 + a->row_offsets[fq] + idq, 1, 0);
            else if (a->opt == OPT_ADAGRAD || a->opt == OPT_ADAM)
                prefetch_bytes(a->m1 + eq, Dq * 4, 1);
            if (a->opt == OPT_ADAM) prefetch_bytes(a->m2 + eq, Dq * 4, 1);
        }
        const int64_t s = a->run_start[r], e = a->run_start[r + 1];
        const int64_t p0 = (int64_t)(a->sorted[s] & pmask), f = a->bag[p0] / a->B;
        const int64_t D = a->dims[f], id = at(a->indices, a->idx32, p0);
        const int64_t elem = a->w_offsets[f] + id * D;
        memset(g, 0, sizeof(float) * D);
        for (int64_t j = s; j < e; ++j) { /* the row's ids in batch order */
            if (j + PREFETCH_IDS < j_end) {
                const int64_t pq = (int64_t)(a->sorted[j + PREFETCH_IDS] & pmask);
                float unused;
                __builtin_prefetch(grad_of(a, pq, a->bag[pq], &unused), 0, 0);
            }
            const int64_t p = (int64_t)(a->sorted[j] & pmask);
            float scale;
            const float *restrict go = grad_of(a, p, a->bag[p], &scale);
            for (int64_t d = 0; d < D; ++d) g[d] += scale * go[d];
        }
        if (a->opt == OPT_NONE) {
            float *out = a->row_grads + r * a->max_D;
            memcpy(out, g, sizeof(float) * D);
            memset(out + D, 0, sizeof(float) * (a->max_D - D));
            a->row_elems[r] = elem;
            a->row_dims[r] = D;
            continue;
        }
        const int64_t state_row = a->row_offsets[f] + id;
        if (a->dtype == F32) {
            update_row(a, (float *)w8 + elem, g, D, elem, state_row);
            continue;
        }
        uint16_t *h = (uint16_t *)w8 + elem;
        for (int64_t d = 0; d < D; ++d) wbuf[d] = half_to_f32(h[d], a->dtype);
        update_row(a, wbuf, g, D, elem, state_row);
        if (a->sr) {
            for (int64_t d = 0; d < D; ++d)
                h[d] = f32_to_half_stochastic(wbuf[d], a->dtype, a->seed, elem + d);
        } else {
            for (int64_t d = 0; d < D; ++d) h[d] = f32_to_half(wbuf[d], a->dtype);
        }
    }
}

/* Every unique row of the plan gets its gradient (the sum over its ids, in batch order, of the
 * gradient row of the id's bag, or of the id itself unpooled, times the id's per-sample weight,
 * divided by the bag's length under MEAN) and, with an optimizer, one step in place; with
 * OPT_NONE, row_grads / row_elems / row_dims get the gradients. hyper: lr, eps, beta1, beta2,
 * weight_decay, decoupled (0/1), t (>= 1). sr_seed: stochastic rounding's seed (sr: 0/1).
 * Returns 0, or -NO_MEMORY (nothing updated). */
int tbe_backward(const float *grad, int64_t stride, int pooling, const uint64_t *sorted,
                 int pos_bits, const int32_t *bag, const int64_t *run_start, int64_t U,
                 const void *indices, int idx32, const void *offsets, int off32, int64_t B,
                 const int64_t *w_offsets, const int64_t *dims, const int64_t *D_offsets,
                 const int64_t *row_offsets, const float *psw, void *weights, int dtype,
                 float *m1, float *m2, int opt, const double *hyper, int sr, uint64_t sr_seed,
                 float *row_grads, int64_t *row_elems, int64_t *row_dims, int64_t max_D,
                 int nthreads) {
    if (U == 0) return 0;
    bwd_args a = {grad, stride, pooling, sorted, pos_bits, bag, run_start, U, indices, offsets,
                  idx32, off32, B, w_offsets, dims, D_offsets, row_offsets, psw, weights,
                  dtype, m1, m2, opt, (int)hyper[5], (float)hyper[0], (float)hyper[1],
                  (float)hyper[2], (float)hyper[3], (float)hyper[4], 1.0f, 1.0f, sr, sr_seed,
                  row_grads, row_elems, row_dims, max_D};
    if (opt == OPT_ADAM) {
        a.bc1 = (float)(1.0 - pow(hyper[2], hyper[6]));
        a.bc2 = (float)(1.0 - pow(hyper[3], hyper[6]));
    }
    if (nthreads < 1) nthreads = 1;
    const int64_t width = max_D > 0 ? max_D : 1;
    float *scratch = malloc(sizeof(float) * 2 * width * nthreads);
    if (!scratch) return -NO_MEMORY;
    const int64_t M = run_start[U];
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        /* a contiguous block of runs with about M / nt ids each: the first run at or after
         * the thread's share of ids (a binary search; every thread finds the same cuts) */
        int64_t cut[2];
        for (int side = 0; side < 2; ++side) {
            const int64_t want = M * (tid + side) / nt;
            int64_t lo = 0, hi = U;
            while (lo < hi) {
                const int64_t mid = lo + (hi - lo) / 2;
                if (run_start[mid] < want) lo = mid + 1; else hi = mid;
            }
            cut[side] = tid + side == nt ? U : lo;
        }
        bwd_runs(&a, cut[0], cut[1], scratch + 2 * width * tid, scratch + (2 * tid + 1) * width);
    }
    free(scratch);
    return 0;
}

/* ---------------------------------------------------------------- per-sample weights */

static inline float row_at(const void *row, int dtype, int64_t d) {
    return dtype == F32 ? ((const float *)row)[d] : half_to_f32(((const uint16_t *)row)[d], dtype);
}

/* <row, g> over D in fixed lanes */
static inline float dot_row(const void *row, int dtype, const float *restrict g, int64_t D) {
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
                  off32, N, T, B, NULL, pooling, NULL, stride};
    const int64_t chunk = 16, tasks = (B + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(dynamic, 1)
    for (int64_t j = 0; j < tasks; ++j)
        psw_grad_samples(&a, grad, j * chunk, j * chunk + chunk < B ? j * chunk + chunk : B, out);
    free(E);
    return 0;
}
