/* The row cache of the storage tiers (modules/tiers.py) on the host: the slot map's pass over a
 * batch's ids and row copies between the cache and its backing store. Called through ctypes
 * (ops/tier_native.py); one thread, no allocation. */
#include <stdint.h>
#include <string.h>

#define AHEAD 16 /* ids ahead whose map entries are prefetched (the map's reads are random) */

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

/* LRU victims: the first `need` slots in ascending (last_seen, slot) order among those with
 * 0 <= last_seen < clock, into out; returns how many (fewer when fewer are candidates), or -1
 * when the candidates' last_seen span more than scratch_len values (the caller sorts then).
 * A counting sort over the span: O(slots + span). */
int64_t tier_lru_victims(const int64_t *last_seen, int64_t slots, int64_t clock, int64_t need,
                         int64_t *out, int64_t *scratch, int64_t scratch_len) {
    int64_t lo = clock, n = 0;
    for (int64_t s = 0; s < slots; s++) {
        const int64_t ls = last_seen[s];
        if (ls >= 0 && ls < clock) {
            if (ls < lo) lo = ls;
            n++;
        }
    }
    if (n == 0 || need <= 0) return 0;
    const int64_t span = clock - lo;
    if (span > scratch_len) return -1;
    if (need > n) need = n;
    memset(scratch, 0, (size_t)span * sizeof(int64_t));
    for (int64_t s = 0; s < slots; s++) {
        const int64_t ls = last_seen[s];
        if (ls >= 0 && ls < clock) scratch[ls - lo]++;
    }
    int64_t at = 0;
    for (int64_t b = 0; b < span; b++) {
        const int64_t c = scratch[b];
        scratch[b] = at;
        at += c;
    }
    for (int64_t s = 0; s < slots; s++) {
        const int64_t ls = last_seen[s];
        if (ls >= 0 && ls < clock) {
            const int64_t pos = scratch[ls - lo]++;
            if (pos < need) out[pos] = s;
        }
    }
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
        if (i + 2 < t) __builtin_prefetch(src + got[i + 2] * row_bytes);
        char *slot = cache + s * row_bytes;
        if (dirty[s] && row_of_slot[s] >= 0) {
            memcpy(back + row_of_slot[s] * row_bytes, slot, (size_t)row_bytes);
            written++;
        }
        memcpy(slot, src + got[i] * row_bytes, (size_t)row_bytes);
    }
    return written;
}
