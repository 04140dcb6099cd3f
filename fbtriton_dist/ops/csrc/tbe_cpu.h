/* What the native CPU kernel files share (tbe_cpu.c: check, forward, per-sample weights;
 * tbe_cpu_backward.c: plan, backward, with tbe_cpu_counter.c, the counter optimizer's row
 * update, included; tbe_pool.c: threads): the codes, id and offset loads,
 * the rows' bounds, prefetching, fp16 / bf16 conversions, the 8-float vectors and the pool.
 * See tbe_cpu.c for the layout. */
#ifndef TBE_CPU_H
#define TBE_CPU_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

/* tbe_pool.c: fn(ctx, task, executor) for tasks 0 .. ntasks - 1 on up to nthreads threads
 * (executor: 0 .. nthreads - 1, the running thread, for its scratch memory only) */
typedef void (*tbe_task)(void *ctx, int64_t task, int executor);
void tbe_parallel(tbe_task fn, void *ctx, int64_t ntasks, int nthreads);
/* the cores this process may use (affinity mask, cgroup quota): no job runs on more threads;
 * the pool threads started in this process (the caller not counted) */
int tbe_usable_cpus(void);
int tbe_pool_started(void);

/* tasks for n items of work on nthreads threads: a few per thread, so that a thread the OS
 * holds back leaves its share to the others (at most one task per `grain` items) */
static inline int64_t tbe_tasks(int64_t n, int nthreads, int64_t grain) {
    int64_t t = 4 * (int64_t)(nthreads > 1 ? nthreads : 1);
    if (nthreads <= 1) t = 1;
    if (t > n / (grain > 0 ? grain : 1)) t = n / (grain > 0 ? grain : 1);
    return t > 0 ? t : 1;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(TBE_NO_CLONES)
#define TBE_TARGETS __attribute__((target_clones("arch=x86-64-v3", "default")))
/* AVX-512, for the forward's common case only (tbe_cpu.c picks it where the CPU has it; a
 * third clone of every kernel made the library's build 2x slower) */
#define TBE_WIDE __attribute__((target("arch=x86-64-v4")))
#else
#define TBE_TARGETS
#endif
/* every helper is inlined into the cloned workers, so that it is built for their target */
#define INLINE static inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

enum { F32 = 0, F16 = 1, BF16 = 2 };
/* fbtriton_dist.pooling.PoolingMode (tests/ops/test_native_tables.py parses and checks it) */
enum { POOL_SUM = 0, POOL_MEAN = 1, POOL_NONE = 2 };
/* tbe_check's bits; the other kernels return minus one of them */
enum { BAD_FIRST = 1, BAD_LAST = 2, BAD_ORDER = 4, BAD_ID = 8, BAD_WEIGHT = 16, NO_MEMORY = 32,
       TOO_BIG = 64 };

#ifndef PREFETCH_IDS
/* ids ahead whose rows are prefetched: 20 (12 before) is 5-9% faster on an AMD EPYC (Zen 3,
 * under KVM), and was within 1-2% of the best distance on an Intel Xeon (model 167) */
#define PREFETCH_IDS 20
#endif
#ifndef PREFETCH_ROW_BYTES
/* The forward's first pass prefetches PREFETCH_IDS ids ahead for rows of up to this many bytes
 * and about as many bytes ahead for longer ones (forward_ahead): on the AMD EPYC, C1 (fp32
 * D = 128, 512-byte rows) at 1 thread was 5-15 % faster 10-14 ids ahead than 20 (uniform and
 * Zipf 1.1, quiet and with the other core busy; 2 threads alike), while C0 (D = 64, 256 bytes)
 * was 3-6 % slower at 10-14 than at 20-28. */
#define PREFETCH_ROW_BYTES 256
#endif
#ifndef PREFETCH_AHEAD_BYTES
#define PREFETCH_AHEAD_BYTES 7168 /* 14 rows of 512 bytes */
#endif
#define PREFETCH_MIN_IDS 8
/* ids ahead whose rows of `bytes` bytes the forward's first pass prefetches */
static inline int64_t forward_ahead(int64_t bytes) {
    if (bytes <= PREFETCH_ROW_BYTES) return PREFETCH_IDS;
    const int64_t n = PREFETCH_AHEAD_BYTES / bytes;
    return n > PREFETCH_MIN_IDS ? n : PREFETCH_MIN_IDS;
}
#ifndef PREFETCH_RUNS
#define PREFETCH_RUNS 16 /* runs ahead whose rows (and states) are prefetched */
#endif
#define LANES 8         /* fixed lanes of the reductions over D */

INLINE int64_t at(const void *p, int is32, int64_t i) {
    return is32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

/* E[f]: the rows feature f's ids may name: rows[f] (NULL: unknown), capped by what the buffers
 * hold (elements of the weights and per-element states from w_offsets[f], per-row state rows
 * from row_offsets[f]; -1: none), so that no id reads or writes outside them. */
static inline void feature_rows(int64_t T, const int64_t *rows, const int64_t *w_offsets,
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

INLINE void prefetch_bytes(const void *p, int64_t nbytes, int write) {
    for (int64_t c = 0; c < nbytes; c += 64) {
        if (write)
            __builtin_prefetch((const char *)p + c, 1, 3);
        else
            __builtin_prefetch((const char *)p + c, 0, 3);
    }
}

/* ---------------------------------------------------------------- fp16 / bf16 */

typedef union { uint32_t u; float f; } bits32;

INLINE float f16_to_f32(uint16_t h) {
    bits32 v;
    const uint32_t em = h & 0x7fffu;
    v.u = em << 13;
    v.f *= 0x1p112f; /* re-bias the exponent; subnormals come out right */
    if (em >= 0x7c00u) v.u |= 0x7f800000u; /* inf / nan */
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
}

INLINE uint16_t f32_to_f16(float f) { /* round to nearest even */
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

INLINE float bf16_to_f32(uint16_t b) {
    bits32 v = {.u = (uint32_t)b << 16};
    return v.f;
}

INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even */
    bits32 x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

INLINE float half_to_f32(uint16_t h, int dtype) {
    return dtype == F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

INLINE uint16_t f32_to_half(float f, int dtype) {
    return dtype == F16 ? f32_to_f16(f) : f32_to_bf16(f);
}

INLINE uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The reference's stochastic rounding (reference.tbe.stochastic_round): add uniform noise of
 * one ulp of the half type at x, then round toward zero; the noise of element `elem` of update
 * `seed` is a hash of the two, so no draw depends on the thread that makes it. */
INLINE uint16_t f32_to_half_stochastic(float x, int dtype, uint64_t seed, int64_t elem) {
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

/* ---------------------------------------------------------------- vectors */

/* Rows are summed in registers, NV vectors of 8 floats at a time (GCC / clang vector
 * extensions: AVX registers in the x86-64-v3 clone, pairs of SSE ones in the baseline), so
 * that a bag's ids are loads only and many rows are in flight at once. */
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64))); /* fp32 rows: one cache line */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

INLINE v8f load8(const void *row, int dtype, int64_t d) {
    v8f f;
    if (dtype == F32) {
        memcpy(&f, (const float *)row + d, sizeof f);
        return f;
    }
    v8h h;
    memcpy(&h, (const uint16_t *)row + d, sizeof h);
    v8u u = __builtin_convertvector(h, v8u), x;
    if (dtype == BF16) {
        x = u << 16;
    } else { /* f16_to_f32, eight at a time */
        const v8u em = u & 0x7fffu;
        x = em << 13;
        memcpy(&f, &x, sizeof f);
        f *= 0x1p112f;
        memcpy(&x, &f, sizeof x);
        x |= (v8u)(em >= 0x7c00u) & 0x7f800000u;
        x |= (u & 0x8000u) << 16;
    }
    memcpy(&f, &x, sizeof f);
    return f;
}

INLINE float row_at(const void *row, int dtype, int64_t d) {
    return dtype == F32 ? ((const float *)row)[d] : half_to_f32(((const uint16_t *)row)[d], dtype);
}

#endif
