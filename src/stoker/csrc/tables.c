/* The engine's chunks and copies tables, made from a batch plan's columns in one pass each.
 *
 * engine/planning/tables.py plans a batch as columns (numpy arrays, one value per chunk or per copy); the engine takes
 * row tables (see the C_* columns). Joining them with numpy costs a dozen calls per batch under the GIL, each
 * a few microseconds: for a batch of small chunks a measurable share of the pipeline's Python time. These do
 * the same in one call each, and check every index they follow (a chunk's array; module.c checks the chunk
 * numbers it gathers) against the counts they were given: the engine checks the tables it is handed again
 * (job_new).
 */
#include "stoker_native.h"

#include <stdlib.h>
#include <string.h>

int plan_chunk_rows(long long n_rows, const int64_t *const cols[N_PLAN_COLS], long long n_sources,
                    const int64_t *info, int fetched, int64_t *out, const char **error) {
    for (long long i = 0; i < n_rows; i++) {
        int64_t src = cols[P_SOURCE][i];
        if (src < 0 || src >= n_sources) {
            *error = "a chunk's array is past the batch's arrays";
            return -1;
        }
        const int64_t *mine = info + src * N_INFO_COLS;
        int64_t *row = out + i * N_CHUNK_COLS;
        row[C_SOURCE] = src;
        row[C_CODEC] = mine[I_CODEC];
        row[C_NBYTES] = mine[I_NBYTES];
        row[C_MAX_STORED] = mine[I_STORED];
        if (fetched) { /* chunk i's stored bytes are the whole of buffer i */
            row[C_FILE] = row[C_OFFSET] = -1;
            row[C_LENGTH] = 0;
            row[C_BUFFER] = i;
        } else {
            row[C_FILE] = cols[P_FILE][i];
            row[C_OFFSET] = cols[P_OFFSET][i];
            row[C_LENGTH] = cols[P_LENGTH][i];
            row[C_BUFFER] = -1;
            if (row[C_FILE] < 0)
                row[C_CODEC] = CODEC_FILL; /* nothing stored: the fill value */
        }
        row[C_SPAN_START] = cols[P_SPAN_START][i];
        row[C_SPAN_STOP] = cols[P_SPAN_STOP][i];
        row[C_FIRST_COPY] = cols[P_FIRST_COPY][i];
        row[C_NCOPIES] = cols[P_NCOPIES][i];
    }
    return 0;
}

/* Whether the strides can place the copies onto each other's elements: -1 (with *error) when a copy's row or
 * start is negative or its extent empty, or when the batch's layout, as far as the copies reach (axis a's
 * length: the largest box_start + extent; the rows: the largest row + 1), is not one where distinct elements
 * have distinct places: each axis of length > 1, taken by increasing stride, must step past all that the
 * axes before it span (as every dense or padded layout, in any axis order, does). Else 0. A row_stride under a
 * crop's span put row 1's copies onto row 0's elements, inside the batch, where the engine's bounds cannot see
 * it (the engine checks each copy against the batch, not against the others). */
static int copies_overlap(int ndim, long long n_copies, const int64_t *row, const int64_t *box_start,
                          const int64_t *extent, int64_t row_stride, const int64_t *dst_strides,
                          const char **error) {
    int64_t len[MAX_NDIM + 1], stride[MAX_NDIM + 1], rows = 1;
    for (int a = 0; a < ndim; a++)
        len[a] = 1, stride[a] = dst_strides[a];
    for (long long k = 0; k < n_copies; k++) {
        if (row[k] < 0) {
            *error = "a copy's row is negative";
            return -1;
        }
        if (row[k] >= rows)
            rows = row[k] == INT64_MAX ? INT64_MAX : row[k] + 1;
        for (int a = 0; a < ndim; a++) {
            int64_t b = box_start[k * ndim + a], e = extent[k * ndim + a], end;
            if (b < 0 || e < 1 || __builtin_add_overflow(b, e, &end)) {
                *error = "a copy's start in its crop is negative, or its extent not positive";
                return -1;
            }
            if (end > len[a])
                len[a] = end;
        }
    }
    len[ndim] = rows, stride[ndim] = row_stride;
    uint64_t step[MAX_NDIM + 1];
    int bad = 0;
    for (int a = 0; a <= ndim; a++) {
        bad |= len[a] > 1 && stride[a] < 1; /* a stride of 0 or less on an axis of several places */
        step[a] = (uint64_t)(stride[a] < 0 ? 0 : stride[a]);
    }
    if (bad || !strides_apart(ndim + 1, len, step, 1)) {
        *error = "the batch's strides place the copies so that they overlap (a row_stride or a stride under "
                 "what the axes within it span, or past int64)";
        return -1;
    }
    return 0;
}

int strides_apart(int n, const int64_t *len, const uint64_t *step, uint64_t item) {
    int order[STRIDES_MAX_AXES], k = 0;
    if (n > STRIDES_MAX_AXES)
        return 0;
    for (int a = 0; a < n; a++) { /* the axes of length > 1 by increasing step (at most 64: insertion) */
        if (len[a] < 2)
            continue; /* one place on it: its stride places nothing */
        int at = k++;
        while (at > 0 && step[order[at - 1]] > step[a]) {
            order[at] = order[at - 1];
            at--;
        }
        order[at] = a;
    }
    uint64_t span = item; /* the end of what the axes so far reach */
    for (int i = 0; i < k; i++) {
        uint64_t reach;
        if (step[order[i]] < span || __builtin_mul_overflow((uint64_t)len[order[i]] - 1, step[order[i]], &reach) ||
            __builtin_add_overflow(span, reach, &span) || span > (uint64_t)INT64_MAX)
            return 0;
    }
    return 1;
}

int plan_copy_rows(int ndim, long long n_copies, const int64_t *src_offset, const int64_t *row,
                   const int64_t *box_start, const int64_t *extent, int64_t row_stride, const int64_t *dst_strides,
                   int64_t *out, const char **error) {
    long long width = COPY_COLS((long long)ndim);
    if (copies_overlap(ndim, n_copies, row, box_start, extent, row_stride, dst_strides, error))
        return -1;
    for (long long k = 0; k < n_copies; k++) {
        int64_t *o = out + k * width, dst;
        if (__builtin_mul_overflow(row[k], row_stride, &dst))
            goto overflow;
        for (int a = 0; a < ndim; a++) {
            int64_t term;
            if (__builtin_mul_overflow(box_start[k * ndim + a], dst_strides[a], &term) ||
                __builtin_add_overflow(dst, term, &dst))
                goto overflow;
        }
        o[CP_SRC_OFFSET] = src_offset[k];
        o[CP_DST_OFFSET] = dst;
        memcpy(o + CP_EXTENT, extent + k * ndim, sizeof(int64_t) * (size_t)ndim);
    }
    return 0;
overflow:
    *error = "a copy's place in the batch is past what an int64 counts";
    return -1;
}

int plan_crops(int ndim, long long n_crops, const int64_t *boxes, const int64_t *sids, const int64_t *shape,
               long long n_sources, const int64_t *rows, grid_plan *out, long long *first_outside,
               long long *bytes_needed, int *any_sharded, const char **error) {
    int D = ndim;
    long long w = ARRAY_ROW_COLS((long long)D); /* a row: A_* columns */
    memset(out, 0, sizeof(*out));
    *first_outside = -1, *bytes_needed = 0, *any_sharded = 0;
    if (D < 1 || D > MAX_NDIM || n_crops < 0 || n_sources < 1) {
        *error = "a grid needs 1 to 32 axes and at least one array";
        return -1;
    }
    for (long long s = 0; s < n_crops; s++) {
        if (sids[s] < 0 || sids[s] >= n_sources) {
            *error = "a crop's array is out of range";
            return -1;
        }
        const int64_t *array_shape = rows + sids[s] * w + A_SHAPE(D);
        for (int a = 0; a < D; a++)
            if (boxes[(s * D + a) * 2 + 1] > array_shape[a]) { /* the caller raises the crop's own error */
                *first_outside = s;
                return 0;
            }
    }
    /* planned below from each box's start and ``shape``, checked above by its stop: a box of another extent
     * (the caller's batch_shape enforces it; a direct call need not) would be planned past its array */
    for (long long s = 0; s < n_crops; s++)
        for (int a = 0; a < D; a++) {
            long long extent;
            if (__builtin_sub_overflow(boxes[(s * D + a) * 2 + 1], boxes[(s * D + a) * 2], &extent) ||
                extent != shape[a]) {
                *error = "a crop's box is not the batch's shape (stop - start must equal it on every axis)";
                return -1;
            }
        }
    long long crop = 1, items = 0;
    for (int a = 0; a < D; a++)
        if (__builtin_mul_overflow(crop, shape[a], &crop))
            goto too_big;
    for (long long s = 0; s < n_crops; s++)
        if (__builtin_add_overflow(items, rows[sids[s] * w + A_ITEMSIZE], &items))
            goto too_big;
    if (__builtin_mul_overflow(crop, items, bytes_needed))
        goto too_big;
    int64_t *work = malloc(sizeof(int64_t) * (size_t)(n_crops * D + n_sources * (2 * (long long)D + 1) + 1));
    if (work == NULL) {
        *error = "out of memory";
        return -1;
    }
    int64_t *starts = work, *chunk_shapes = starts + n_crops * D, *strides = chunk_shapes + n_sources * D;
    int64_t *itemsizes = strides + n_sources * D;
    for (long long s = 0; s < n_crops; s++)
        for (int a = 0; a < D; a++)
            starts[s * D + a] = boxes[(s * D + a) * 2];
    for (long long k = 0; k < n_sources; k++) {
        const int64_t *row = rows + k * w;
        itemsizes[k] = row[A_ITEMSIZE];
        memcpy(chunk_shapes + k * D, row + A_CHUNK_SHAPE, sizeof(int64_t) * (size_t)D);
        memcpy(strides + k * D, row + A_STRIDES(D), sizeof(int64_t) * (size_t)D);
        *any_sharded |= row[A_SHARDED(D)] != 0;
    }
    int bad = plan_grid(D, n_crops, starts, sids, shape, n_sources, chunk_shapes, strides, itemsizes, out, error);
    free(work);
    return bad;
too_big:
    *error = "a batch holds more bytes than an int64 counts";
    return -1;
}
