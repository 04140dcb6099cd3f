/* The row cache of the storage tiers (modules/tiers.py) on the host: the slot map's pass over a
 * batch's ids and row copies between the cache and its backing store. Called through ctypes
 * (ops/tier_native.py); one thread, no allocation. */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define AHEAD 32 /* ids ahead whose map entries are prefetched (the map's reads are random) */
#define AHEAD_ROWS 8 /* rows ahead whose lines are prefetched while rows are moved */

/* Every cache line of a row of `bytes` bytes at p, for reading / for writing. */
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}
static inline void prefetch_row_w(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 1);
}

/* A row written back to its backing store, which is not read again soon: streaming stores
 * (the destination's lines are not read first, nor kept in the cache) where it is 16-byte
 * aligned, else memcpy. Callers end with store_fence(). */
static inline void store_row(char *dst, const char *src, int64_t bytes) {
#if defined(__SSE2__)
    if ((((uintptr_t)dst | (uintptr_t)bytes) & 15) == 0) {
        for (int64_t o = 0; o < bytes; o += 16)
            _mm_stream_si128((__m128i *)(dst + o), _mm_loadu_si128((const __m128i *)(src + o)));
        return;
    }
#endif
    memcpy(dst, src, (size_t)bytes);
}
static inline void store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* One pass of a batch's ids [n] (each in [0, rows)) through slot_of_row [rows] (int32; slots:
 * not cached). A cached id stamps its slot with `batch` (stamp [slots]); the first occurrence
 * of an id not cached is appended to new_rows (first-occurrence order; slot_of_row is marked
 * meanwhile and put back before returning). Returns the distinct misses, -1 on an id out of
 * range (nothing changed then but stamps); *hits: the distinct cached ids. */
int64_t tier_map(const int64_t *ids, int64_t n, int32_t *slot_of_row, int64_t rows,
                 int64_t slots, int64_t *stamp, int64_t batch, int64_t *new_rows,
                 int64_t *hits) {
    const int32_t C = (int32_t)slots, MARK = (int32_t)slots + 1;
    int64_t m = 0, h = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (i + AHEAD < n && ids[i + AHEAD] >= 0 && ids[i + AHEAD] < rows)
            __builtin_prefetch(&slot_of_row[ids[i + AHEAD]], 1);
        if (id < 0 || id >= rows) {
            for (int64_t j = 0; j < m; j++) slot_of_row[new_rows[j]] = C;
            return -1;
        }
        const int32_t s = slot_of_row[id];
        if (s < C) {
            if (stamp[s] != batch) {
                stamp[s] = batch;
                h++;
            }
        } else if (s == C) {
            slot_of_row[id] = MARK;
            new_rows[m++] = id;
        }
    }
    for (int64_t j = 0; j < m; j++) slot_of_row[new_rows[j]] = C;
    *hits = h;
    return m;
}

/* The slots stamped with `batch`: last_seen = clock, counts += 1. */
void tier_touch(const int64_t *stamp, int64_t slots, int64_t batch, int64_t *last_seen,
                int64_t *counts, int64_t clock) {
    for (int64_t s = 0; s < slots; s++) {
        if (stamp[s] == batch) {
            last_seen[s] = clock;
            counts[s] += 1;
        }
    }
}

/* out [n] = slot_of_row[ids]; dirty (bool [slots]) of each set when `train`. */
void tier_slots(const int64_t *ids, int64_t n, const int32_t *slot_of_row, int64_t *out,
                uint8_t *dirty, int32_t train) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&slot_of_row[ids[i + AHEAD]]);
        const int64_t s = slot_of_row[ids[i]];
        out[i] = s;
        if (train) dirty[s] = 1;
    }
}

/* dst row dst_at[i] = src row src_at[i] (src_at NULL: row i), rows of row_bytes bytes; dst has
 * dst_rows rows, src src_rows. Returns -1 (before copying anything) on an index out of range. */
int32_t tier_copy_rows(char *dst, const int64_t *dst_at, int64_t dst_rows, const char *src,
                       const int64_t *src_at, int64_t src_rows, int64_t n, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t from = src_at ? src_at[i] : i;
        if (dst_at[i] < 0 || dst_at[i] >= dst_rows || from < 0 || from >= src_rows) return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t from = src_at ? src_at[i] : i;
        if (i + 4 < n) {
            __builtin_prefetch(src + (src_at ? src_at[i + 4] : i + 4) * row_bytes);
            __builtin_prefetch(dst + dst_at[i + 4] * row_bytes, 1);
        }
        memcpy(dst + dst_at[i] * row_bytes, src + from * row_bytes, (size_t)row_bytes);
    }
    return 0;
}

#define RADIX_BITS 8
#define RADIX (1 << RADIX_BITS)
#define WAYS 4 /* a radix pass runs over 4 quarters of its input at once: 4 chains of counts */

/* Sort the slots in[n] stably by key[slot] - lo (each in [0, top]): LSD radix passes of
 * RADIX_BITS bits (none when top is 0), tmp[n] as the other buffer; the last pass places only
 * the first `limit` (the rest of the result is undefined). Returns the buffer that holds the
 * result (in or tmp). hist: [WAYS * RADIX]. */
static int64_t *radix_by(const int64_t *key, int64_t lo, uint64_t top, int64_t *in,
                         int64_t *tmp, int64_t n, int64_t *hist, int64_t limit) {
    const int64_t q = (n + WAYS - 1) / WAYS;
    int64_t from[WAYS], to[WAYS];
    for (int w = 0; w < WAYS; w++) {
        from[w] = w * q < n ? w * q : n;
        to[w] = (w + 1) * q < n ? (w + 1) * q : n;
    }
    for (int shift = 0; shift < 64 && (top >> shift); shift += RADIX_BITS) {
        const int last = shift + RADIX_BITS >= 64 || !(top >> (shift + RADIX_BITS));
        const int64_t keep = last ? limit : n;
#define DIGIT(x) (((uint64_t)(key[x] - lo) >> shift) & (RADIX - 1))
        memset(hist, 0, WAYS * RADIX * sizeof(int64_t));
        for (int64_t i = 0; i < q; i++)
            for (int w = 0; w < WAYS; w++)
                if (from[w] + i < to[w]) hist[w * RADIX + DIGIT(in[from[w] + i])]++;
        int64_t at = 0;
        for (int64_t d = 0; d < RADIX; d++)
            for (int w = 0; w < WAYS; w++) {
                const int64_t c = hist[w * RADIX + d];
                hist[w * RADIX + d] = at;
                at += c;
            }
        for (int64_t i = 0; i < q; i++)
            for (int w = 0; w < WAYS; w++)
                if (from[w] + i < to[w]) {
                    const int64_t x = in[from[w] + i], pos = hist[w * RADIX + DIGIT(x)]++;
                    if (pos < keep) tmp[pos] = x;
                }
#undef DIGIT
        int64_t *t = in;
        in = tmp;
        tmp = t;
    }
    return in;
}

/* Victims: the first `need` slots among those with 0 <= last_seen < clock in ascending
 * (last_seen, slot) order (LRU: counts NULL) or (counts, last_seen, slot) order (LFU), into
 * out; returns how many (fewer when fewer are candidates). The order of
 * ops.id_remap.pick_victims, by stable LSD radix passes: O(slots) per RADIX_BITS bits of the
 * candidates' spans of last_seen and counts. buf [2 * slots], hist [WAYS * RADIX]: scratch. */
int64_t tier_victims(const int64_t *last_seen, const int64_t *counts, int64_t slots,
                     int64_t clock, int64_t need, int64_t *out, int64_t *buf, int64_t *hist) {
    if (need <= 0) return 0;
    int64_t n = 0, lo = clock, hi = 0, clo = INT64_MAX, chi = INT64_MIN;
    for (int64_t s = 0; s < slots; s++) {
        const int64_t ls = last_seen[s];
        if (ls >= 0 && ls < clock) {
            buf[n++] = s;
            if (ls < lo) lo = ls;
            if (ls > hi) hi = ls;
            if (counts) {
                if (counts[s] < clo) clo = counts[s];
                if (counts[s] > chi) chi = counts[s];
            }
        }
    }
    if (n == 0) return 0;
    if (need > n) need = n;
    const uint64_t ctop = counts ? (uint64_t)chi - (uint64_t)clo : 0;
    int64_t *sorted = radix_by(last_seen, lo, (uint64_t)(hi - lo), buf, buf + slots, n, hist,
                               ctop ? n : need);
    if (ctop) {
        int64_t *other = sorted == buf ? buf + slots : buf;
        sorted = radix_by(counts, clo, ctop, sorted, other, n, hist, need);
    }
    memcpy(out, sorted, (size_t)need * sizeof(int64_t));
    return need;
}

/* Unmap the rows of the victims [v], then put rows got [t] in slots targets [t]: the row of
 * each slot, the slot of each row, last_seen = clock, counts = 1, clean. */
void tier_install(const int64_t *victims, int64_t v, const int64_t *targets, const int64_t *got,
                  int64_t t, int64_t *row_of_slot, int32_t *slot_of_row, int64_t *last_seen,
                  int64_t *counts, uint8_t *dirty, int64_t clock, int64_t slots) {
    for (int64_t i = 0; i < v; i++) slot_of_row[row_of_slot[victims[i]]] = (int32_t)slots;
    for (int64_t i = 0; i < t; i++) {
        const int64_t s = targets[i];
        row_of_slot[s] = got[i];
        slot_of_row[got[i]] = (int32_t)s;
        last_seen[s] = clock;
        counts[s] = 1;
        dirty[s] = 0;
    }
}

/* One tensor of a table (rows of row_bytes bytes): for each target slot targets[i], first its
 * row back to the backing store `back` when the slot is dirty and holds one (row_of_slot,
 * dirty: as before the slots are taken), then row got[i] of `src` (the backing store, or
 * copies read ahead) into it. Returns the rows written back, or -1 (nothing copied) on an
 * index out of range. */
int64_t tier_swap_rows(char *cache, int64_t cache_rows, char *back, int64_t back_rows,
                       const char *src, int64_t src_rows, const int64_t *targets,
                       const int64_t *got, int64_t t, const int64_t *row_of_slot,
                       const uint8_t *dirty, int64_t row_bytes) {
    for (int64_t i = 0; i < t; i++) {
        const int64_t s = targets[i];
        if (s < 0 || s >= cache_rows || got[i] < 0 || got[i] >= src_rows) return -1;
        if (dirty[s] && (row_of_slot[s] < -1 || row_of_slot[s] >= back_rows)) return -1;
    }
    int64_t written = 0;
    for (int64_t i = 0; i < t; i++) {
        const int64_t s = targets[i];
        if (i + AHEAD_ROWS < t) {
            prefetch_row(src + got[i + AHEAD_ROWS] * row_bytes, row_bytes);
            prefetch_row_w(cache + targets[i + AHEAD_ROWS] * row_bytes, row_bytes);
        }
        char *slot = cache + s * row_bytes;
        if (dirty[s] && row_of_slot[s] >= 0) {
            store_row(back + row_of_slot[s] * row_bytes, slot, row_bytes);
            written++;
        }
        memcpy(slot, src + got[i] * row_bytes, (size_t)row_bytes);
    }
    store_fence();
    return written;
}

/* The slot map of one table for one batch, in one call: the pass over its ids [n] (each must
 * be in [0, rows)), the hits' use (last_seen = clock, counts += 1), slots for the distinct
 * misses in first-occurrence order (free slots ascending, then tier_victims' order among
 * the slots not used at `clock`; lfu: by counts first), each dirty victim's row written back
 * and the miss's row loaded, for every tensor k of the table (caches[k]: its slots, backs[k]:
 * its backing store, rows of row_bytes[k] bytes), the map updated (tier_install), and out [n]
 * = the ids' slots (marked dirty when `train`). As tier_map + tier_touch + tier_victims +
 * tier_swap_rows + tier_install + tier_slots, without their passes over every slot and id in
 * between: the pass records where the misses are and what they are, then only those places
 * of `out` are filled. Needs slots + 1 + n < 2^31. work: [2 * n + 4 * slots + WAYS * RADIX]
 * int64 scratch. info [5]: distinct hits, distinct misses, victims, slots taken, rows written
 * back. Returns 0; -1: an id out of range (nothing changed); -2: more distinct rows than
 * slots (only stamps changed: nothing to undo); -3: some misses found no slot (those that
 * did are loaded and mapped, out unfinished). */
int64_t tier_assign(const int64_t *ids, int64_t n, int32_t *slot_of_row, int64_t rows,
                    int64_t slots, int64_t *row_of_slot, int64_t *stamp, int64_t batch,
                    int64_t *last_seen, int64_t *counts, uint8_t *dirty, int64_t clock,
                    int32_t lfu, int32_t train, int64_t ntensors, char *const *caches,
                    char *const *backs, const int64_t *row_bytes, int64_t *work, int64_t *out,
                    int64_t *info) {
    int64_t *new_rows = work, *miss_at = work + n, *hit = miss_at + n, *targets = hit + slots;
    int64_t *buf = targets + slots;
    int64_t *hist = buf + 2 * slots;
    const int32_t C = (int32_t)slots;
    int64_t m = 0, h = 0, q = 0;
    for (int k = 0; k < 5; k++) info[k] = 0;
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)rows) return -1;
    /* a miss's entry holds C + 1 + its position among the misses while the pass runs; a hit
     * stamps its slot without a branch (most ids are hits: the rows are skewed) */
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&slot_of_row[ids[i + AHEAD]], 1);
        const int64_t id = ids[i];
        const int32_t s = slot_of_row[id];
        if (__builtin_expect(s < C, 1)) {
            out[i] = s;
            const int64_t fresh = stamp[s] != batch;
            stamp[s] = batch;
            hit[h] = s; /* h <= slots: at h == slots this writes targets[0], unused yet */
            h += fresh;
        } else if (s == C) {
            slot_of_row[id] = C + 1 + (int32_t)m;
            out[i] = m;
            miss_at[q++] = i;
            new_rows[m++] = id;
        } else {
            out[i] = s - C - 1;
            miss_at[q++] = i;
        }
    }
    for (int64_t j = 0; j < m; j++) slot_of_row[new_rows[j]] = C;
    info[0] = h;
    info[1] = m;
    if (h + m > slots) return -2;
    for (int64_t j = 0; j < h; j++) {
        last_seen[hit[j]] = clock;
        counts[hit[j]] += 1;
    }
    int64_t t = 0, v = 0;
    if (m) {
        for (int64_t s = 0; s < slots && t < m; s++)
            if (last_seen[s] < 0) targets[t++] = s;
        if (t < m) {
            v = tier_victims(last_seen, lfu ? counts : 0, slots, clock, m - t, targets + t, buf,
                             hist);
            t += v;
        }
        int64_t written = 0;
        for (int64_t i = 0; i < t; i++) {
            const int64_t s = targets[i], got = new_rows[i], r = row_of_slot[s];
            if (i + AHEAD_ROWS < t) {
                const int64_t s2 = targets[i + AHEAD_ROWS], r2 = row_of_slot[s2];
                for (int64_t k = 0; k < ntensors; k++) {
                    const int64_t rb = row_bytes[k];
                    prefetch_row(backs[k] + new_rows[i + AHEAD_ROWS] * rb, rb);
                    prefetch_row_w(caches[k] + s2 * rb, rb);
                    if (r2 >= 0 && (rb & 15)) /* written back without streaming stores */
                        prefetch_row_w(backs[k] + r2 * rb, rb);
                }
            }
            const int back = dirty[s] && r >= 0;
            for (int64_t k = 0; k < ntensors; k++) {
                const int64_t rb = row_bytes[k];
                char *slot = caches[k] + s * rb;
                const char *from = backs[k] + got * rb;
                if (rb == 4) { /* a per-row state of 4 bytes: no call to memcpy */
                    if (back) memcpy(backs[k] + r * 4, slot, 4);
                    memcpy(slot, from, 4);
                    continue;
                }
                if (back) store_row(backs[k] + r * rb, slot, rb);
                memcpy(slot, from, (size_t)rb);
            }
            written += back;
        }
        store_fence();
        for (int64_t i = t - v; i < t; i++) slot_of_row[row_of_slot[targets[i]]] = C;
        for (int64_t i = 0; i < t; i++) {
            const int64_t s = targets[i];
            row_of_slot[s] = new_rows[i];
            slot_of_row[new_rows[i]] = (int32_t)s;
            last_seen[s] = clock;
            counts[s] = 1;
            dirty[s] = 0;
        }
        info[2] = v;
        info[3] = t;
        info[4] = written;
        if (t < m) return -3;
    }
    if (train) {
        for (int64_t j = 0; j < h; j++) dirty[hit[j]] = 1;
        for (int64_t i = 0; i < t; i++) dirty[targets[i]] = 1;
    }
    for (int64_t j = 0; j < q; j++) out[miss_at[j]] = targets[out[miss_at[j]]];
    return 0;
}

/* tier_assign for several tables in a row, each one's arguments ASSIGN_ARGS int64 of args
 * (in tier_assign's order; pointers as integers) and its info at info + 5 k. Stops at the
 * first table whose code is not 0 (info[5 * ntables] = its index) and returns that code. */
#define ASSIGN_ARGS 20
int64_t tier_assign_tables(int64_t ntables, const int64_t *args, int64_t *info) {
    for (int64_t k = 0; k < ntables; k++) {
        const int64_t *a = args + k * ASSIGN_ARGS;
        const int64_t code = tier_assign(
            (const int64_t *)(intptr_t)a[0], a[1], (int32_t *)(intptr_t)a[2], a[3], a[4],
            (int64_t *)(intptr_t)a[5], (int64_t *)(intptr_t)a[6], a[7],
            (int64_t *)(intptr_t)a[8], (int64_t *)(intptr_t)a[9], (uint8_t *)(intptr_t)a[10],
            a[11], (int32_t)a[12], (int32_t)a[13], a[14], (char *const *)(intptr_t)a[15],
            (char *const *)(intptr_t)a[16], (const int64_t *)(intptr_t)a[17],
            (int64_t *)(intptr_t)a[18], (int64_t *)(intptr_t)a[19], info + 5 * k);
        if (code) {
            info[5 * ntables] = k;
            return code;
        }
    }
    return 0;
}
