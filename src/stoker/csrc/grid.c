/* Planning a batch's grid: which chunks its crops touch, once each, and every copy, without a Python step.
 *
 * Per crop and axis, the chunks from start / chunk to (stop - 1) / chunk; every combination of them (C order
 * within a crop, crops in batch order) is a copy. Chunks are (array, grid index) keys, numbered in order of
 * first use through an open-addressing hash table; copies are then grouped by chunk (stably: each chunk's
 * copies in batch order), and each chunk's decoded byte span is the lowest and highest element its copies
 * read, in the array's decoded layout (its element strides). engine/planning/tables.py adds where each chunk is stored.
 */
#include "stoker_native.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* A hash of an (array, grid index) key. */
static uint64_t mix(const int64_t *key, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < n; i++) {
        h ^= (uint64_t)key[i] + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
        h *= 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
    }
    return h;
}

void grid_plan_free(grid_plan *g) {
    free(g->copies);
    free(g->chunks);
    g->copies = g->chunks = NULL;
}

#define GRID_FAIL(msg)                                                                                             \
    do {                                                                                                           \
        *error = msg;                                                                                              \
        goto fail;                                                                                                 \
    } while (0)

int plan_grid(int ndim, long long n_samples, const int64_t *starts, const int64_t *sids, const int64_t *shape,
              long long n_sources, const int64_t *chunk_shapes, const int64_t *strides, const int64_t *itemsizes,
              grid_plan *out, const char **error) {
    int D = ndim;
    int64_t *keys = NULL, *tmp = NULL, *slots = NULL, *chunk_of = NULL;
    long long m = 0, cap = 16, kw = 1 + D, tw = 1 + 3 * (long long)D; /* a key: array, grid index; a copy */
    memset(out, 0, sizeof(*out));
    if (D < 1 || D > MAX_NDIM || n_samples < 0 || n_sources < 1) {
        *error = "a grid needs 1 to 32 axes and at least one array";
        return -1;
    }
    for (int a = 0; a < D; a++)
        if (shape[a] < 1)
            GRID_FAIL("the crops' extents must be positive");
    for (long long s = 0; s < n_sources; s++) {
        for (int a = 0; a < D; a++)
            if (chunk_shapes[s * D + a] < 1 || strides[s * D + a] < 0)
                GRID_FAIL("chunk shapes must be positive and strides not negative");
        if (itemsizes[s] < 1 || itemsizes[s] > 16)
            GRID_FAIL("item sizes must be 1 to 16 bytes");
    }
    /* how many copies: per crop the product of its chunks per axis */
    for (long long s = 0; s < n_samples; s++) {
        if (sids[s] < 0 || sids[s] >= n_sources)
            GRID_FAIL("a crop's array is out of range");
        const int64_t *cs = chunk_shapes + sids[s] * D, *st = starts + s * D;
        long long count = 1, stop;
        for (int a = 0; a < D; a++) {
            if (st[a] < 0 || __builtin_add_overflow(st[a], shape[a], &stop))
                GRID_FAIL("a crop starts before 0 or ends past the largest index");
            long long pieces = (stop - 1) / cs[a] - st[a] / cs[a] + 1;
            if (__builtin_mul_overflow(count, pieces, &count))
                GRID_FAIL("a crop touches too many chunks");
        }
        if (__builtin_add_overflow(m, count, &m) || m > (1LL << 31))
            GRID_FAIL("a batch touches too many chunks");
    }
    keys = malloc(sizeof(int64_t) * (size_t)(m * kw + 1));
    tmp = malloc(sizeof(int64_t) * (size_t)(m * tw + 1)); /* per copy in batch order: row, chunk start, crop
                                                           * start, extent */
    while (cap < 2 * m)
        cap *= 2;
    slots = malloc(sizeof(int64_t) * (size_t)cap); /* chunk number + 1; 0: empty */
    chunk_of = malloc(sizeof(int64_t) * (size_t)(m + 1));
    out->chunks = malloc(sizeof(int64_t) * (size_t)(m * (GRID_CHUNK_COLS + D) + 1));
    out->copies = malloc(sizeof(int64_t) * (size_t)(m * GRID_COPY_COLS((long long)D) + 1));
    if (keys == NULL || tmp == NULL || slots == NULL || chunk_of == NULL || out->chunks == NULL || out->copies == NULL)
        GRID_FAIL("out of memory");
    memset(slots, 0, sizeof(int64_t) * (size_t)cap);
    /* every copy, in batch order; chunks numbered as they are first met */
    long long i = 0, n = 0;
    long long idx[MAX_NDIM];
    for (long long s = 0; s < n_samples; s++) {
        const int64_t *cs = chunk_shapes + sids[s] * D, *st = starts + s * D;
        for (int a = 0; a < D; a++)
            idx[a] = st[a] / cs[a];
        for (;;) {
            int64_t *key = keys + i * kw, *t = tmp + i * tw;
            key[0] = sids[s];
            t[0] = s;
            for (int a = 0; a < D; a++) {
                long long lo = idx[a] * cs[a], hi; /* lo <= the crop's last index: no overflow */
                if (__builtin_add_overflow(lo, cs[a], &hi)) /* a chunk reaching past the largest index */
                    hi = LLONG_MAX;
                long long from = st[a] > lo ? st[a] : lo, to = st[a] + shape[a] < hi ? st[a] + shape[a] : hi;
                key[1 + a] = idx[a];
                t[1 + a] = from - lo;            /* start in the chunk */
                t[1 + D + a] = from - st[a];     /* start in the crop */
                t[1 + 2 * D + a] = to - from;    /* extent */
            }
            uint64_t h = mix(key, (int)kw) & (uint64_t)(cap - 1);
            for (;;) {
                int64_t at = slots[h];
                if (at == 0) {
                    slots[h] = ++n;
                    chunk_of[i] = n - 1;
                    int64_t *c = out->chunks + (n - 1) * (GRID_CHUNK_COLS + D);
                    c[G_SOURCE] = sids[s];
                    c[G_FIRST_COPY] = i; /* for now: its first copy in batch order (its key) */
                    c[G_NCOPIES] = 0;
                    break;
                }
                const int64_t *other = keys + out->chunks[(at - 1) * (GRID_CHUNK_COLS + D) + G_FIRST_COPY] * kw;
                if (memcmp(other, key, sizeof(int64_t) * (size_t)kw) == 0) {
                    chunk_of[i] = at - 1;
                    break;
                }
                h = (h + 1) & (uint64_t)(cap - 1);
            }
            out->chunks[chunk_of[i] * (GRID_CHUNK_COLS + D) + G_NCOPIES]++;
            i++;
            int a = D - 1; /* the next chunk of this crop, C order */
            for (; a >= 0; a--) {
                if (++idx[a] <= (st[a] + shape[a] - 1) / cs[a])
                    break;
                idx[a] = st[a] / cs[a];
            }
            if (a < 0)
                break;
        }
    }
    /* grouped by chunk: each chunk's copies from its first row on, in batch order */
    long long cw = GRID_CHUNK_COLS + D, ow = GRID_COPY_COLS((long long)D), at = 0;
    for (long long c = 0; c < n; c++) {
        int64_t *row = out->chunks + c * cw;
        const int64_t *key = keys + row[G_FIRST_COPY] * kw;
        for (int a = 0; a < D; a++)
            row[GRID_CHUNK_COLS + a] = key[1 + a];
        row[G_FIRST_COPY] = at;
        row[G_SPAN_START] = -1;
        row[G_SPAN_STOP] = -1;
        at += row[G_NCOPIES];
    }
    for (long long c = 0; c < n; c++) /* how many copies each chunk has placed so far */
        out->chunks[c * cw + G_NCOPIES] = 0;
    for (long long k = 0; k < m; k++) {
        int64_t *row = out->chunks + chunk_of[k] * cw;
        const int64_t *t = tmp + k * tw, *sd = strides + row[G_SOURCE] * D;
        int64_t *o = out->copies + (row[G_FIRST_COPY] + row[G_NCOPIES]++) * ow;
        long long first = 0, last = 0;
        o[GC_ROW] = t[0];
        for (int a = 0; a < D; a++) {
            long long f, l;
            o[GC_CHUNK_START + a] = t[1 + a];
            o[GC_BOX_START(D) + a] = t[1 + D + a];
            o[GC_EXTENT(D) + a] = t[1 + 2 * D + a];
            if (__builtin_mul_overflow(t[1 + a], sd[a], &f) || __builtin_add_overflow(first, f, &first) ||
                __builtin_mul_overflow(t[1 + a] + t[1 + 2 * D + a] - 1, sd[a], &l) ||
                __builtin_add_overflow(last, l, &last) || last >= (1LL << 58)) /* x 16 B still fits */
                GRID_FAIL("a chunk's elements are too many to count");
        }
        o[GC_SRC_OFFSET] = first;
        if (row[G_SPAN_START] < 0 || first < row[G_SPAN_START])
            row[G_SPAN_START] = first;
        if (last + 1 > row[G_SPAN_STOP])
            row[G_SPAN_STOP] = last + 1;
    }
    for (long long c = 0; c < n; c++) { /* elements to bytes */
        int64_t *row = out->chunks + c * cw;
        row[G_SPAN_START] *= itemsizes[row[G_SOURCE]];
        row[G_SPAN_STOP] *= itemsizes[row[G_SOURCE]];
    }
    out->n_copies = m;
    out->n_chunks = n;
    free(keys);
    free(tmp);
    free(slots);
    free(chunk_of);
    return 0;
fail:
    free(keys);
    free(tmp);
    free(slots);
    free(chunk_of);
    grid_plan_free(out);
    return -1;
}

/* Where a batch's chunks of one sharded array are stored: per chunk (a grid index, n rows of D) its inner
 * chunk's flat index in its shard (C order over chunks_per_shard) and its shard, numbered in order of first
 * use; per shard its first chunk (a row of index) and its number in C order over the shard grid (the sum of
 * its coordinates times shard_strides: the caller's strides over a grid it knows to fit). */
int shard_positions(int ndim, long long n, const int64_t *index, const int64_t *cps, const int64_t *shard_strides,
                    int64_t *inner, int64_t *shard_of, int64_t *first, int64_t *numbers, long long *n_shards,
                    const char **error) {
    int D = ndim;
    int64_t *slots = NULL;
    long long cap = 16, k = 0;
    if (D < 1 || D > MAX_NDIM || n < 0) {
        *error = "shard positions need 1 to 32 axes";
        return -1;
    }
    for (int a = 0; a < D; a++)
        if (cps[a] < 1 || shard_strides[a] < 0) {
            *error = "chunks per shard must be positive and shard strides not negative";
            return -1;
        }
    while (cap < 2 * n)
        cap *= 2;
    slots = calloc((size_t)cap, sizeof(int64_t)); /* shard number in order of first use + 1; 0: empty */
    if (slots == NULL) {
        *error = "out of memory";
        return -1;
    }
    for (long long i = 0; i < n; i++) {
        const int64_t *idx = index + i * D;
        int64_t flat = 0, number = 0, term;
        for (int a = 0; a < D; a++) {
            if (idx[a] < 0)
                GRID_FAIL("a chunk's grid index is negative");
            if (__builtin_mul_overflow(flat, cps[a], &flat) || __builtin_add_overflow(flat, idx[a] % cps[a], &flat) ||
                __builtin_mul_overflow(idx[a] / cps[a], shard_strides[a], &term) ||
                __builtin_add_overflow(number, term, &number))
                GRID_FAIL("a shard's position is too large to count");
        }
        inner[i] = flat;
        uint64_t h = mix(&number, 1) & (uint64_t)(cap - 1);
        for (;;) {
            int64_t at = slots[h];
            if (at == 0) {
                slots[h] = ++k;
                first[k - 1] = i;
                numbers[k - 1] = number;
                shard_of[i] = k - 1;
                break;
            }
            if (numbers[at - 1] == number) {
                shard_of[i] = at - 1;
                break;
            }
            h = (h + 1) & (uint64_t)(cap - 1);
        }
    }
    free(slots);
    *n_shards = k;
    return 0;
fail:
    free(slots);
    return -1;
}

/* Each chunk's (offset, length) from its shard's index: out[i] = tables[slot[shard_of[i]]][inner[i]], and the
 * empty entry (both all ones: nothing stored) where that slot is -1 (a missing shard). Every table holds
 * n_inner rows of two values. */
int gather_entries(long long n, const int64_t *shard_of, const int64_t *inner, long long n_shards,
                   const int64_t *slot, long long n_tables, const uint64_t *const *tables, long long n_inner,
                   uint64_t *out, const char **error) {
    for (long long k = 0; k < n_shards; k++)
        if (slot[k] < -1 || slot[k] >= n_tables) {
            *error = "a shard's table is out of range";
            return -1;
        }
    for (long long i = 0; i < n; i++) {
        if (shard_of[i] < 0 || shard_of[i] >= n_shards) {
            *error = "a chunk's shard is out of range";
            return -1;
        }
        int64_t s = slot[shard_of[i]];
        if (s >= 0 && (inner[i] < 0 || inner[i] >= n_inner)) {
            *error = "a chunk's inner chunk is out of range";
            return -1;
        }
        if (s < 0) {
            out[2 * i] = out[2 * i + 1] = UINT64_MAX;
        } else {
            out[2 * i] = tables[s][2 * inner[i]];
            out[2 * i + 1] = tables[s][2 * inner[i] + 1];
        }
    }
    return 0;
}
