/* Planning in C (grid.c, tables.c) for engine/planning/tables.py: a batch's grid, where its inner chunks are, the
 * engine's chunks and copies tables from a plan's columns. */
#include "py_glue.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes) -> (copies, chunks): see grid.c; the
 * arguments are int64 buffers (starts: crops x ndim; shape: ndim; chunk_shapes, strides: arrays x ndim;
 * itemsizes: arrays), the results bytes of int64 rows (copies: GRID_COPY_COLS(ndim) values, chunks:
 * GRID_CHUNK_COLS + ndim). */
static PyObject *plan_grid_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5]))
        return NULL;
    Py_buffer b[6] = {{0}};
    /* int64 by their format (as plan_crops takes them): a float64 or uint8 buffer whose length is a multiple of
     * 8 bytes was read as int64 all the same */
    if (int64_buffers(objs, b, 6, "plan_grid"))
        return NULL;
    int held = 6;
    PyObject *result = NULL;
    long long ndim = b[2].len / 8, n_samples = ndim ? b[0].len / 8 / ndim : 0, n_sources = b[5].len / 8;
    if (ndim < 1 || ndim > MAX_NDIM || b[0].len != n_samples * ndim * 8 || b[1].len != n_samples * 8 ||
        b[3].len != n_sources * ndim * 8 || b[4].len != n_sources * ndim * 8) {
        PyErr_SetString(PyExc_ValueError, "plan_grid's buffers disagree on the rank or the counts");
        goto done;
    }
    grid_plan g;
    const char *error = NULL;
    /* with the GIL held: microseconds of work, and a thread that gives the GIL up waits to get it back as
     * long as the switch interval (5 ms) while another thread runs Python (a training step) */
    int bad = plan_grid((int)ndim, n_samples, b[0].buf, b[1].buf, b[2].buf, n_sources, b[3].buf, b[4].buf,
                        b[5].buf, &g, &error);
    if (bad) {
        PyErr_SetString(error_type(error), error ? error : "plan_grid failed");
        goto done;
    }
    result = Py_BuildValue("(y#y#)", (const char *)g.copies, (Py_ssize_t)(g.n_copies * GRID_COPY_COLS(ndim) * 8),
                           (const char *)g.chunks, (Py_ssize_t)(g.n_chunks * (GRID_CHUNK_COLS + ndim) * 8));
    grid_plan_free(&g);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* plan_crops(boxes, sids, shape, rows) -> (copies, chunks, first_outside, bytes_needed, any_sharded): see
 * tables.c; int64 buffers: boxes crops x ndim x 2, sids one per crop, shape ndim, rows an array's
 * ARRAY_ROW_COLS(ndim) values each (A_*). copies and chunks as plan_grid returns them (None when a crop ends
 * outside its array). */
static PyObject *plan_crops_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    Py_buffer b[4] = {{0}};
    if (int64_buffers(objs, b, 4, "plan_crops"))
        return NULL;
    PyObject *result = NULL;
    long long ndim = b[2].len / 8, n_crops = b[1].len / 8, w = ARRAY_ROW_COLS(ndim), n_sources = b[3].len / 8 / w;
    if (ndim < 1 || ndim > MAX_NDIM || b[0].len != n_crops * ndim * 2 * 8 || b[3].len != n_sources * w * 8) {
        PyErr_SetString(PyExc_ValueError, "plan_crops' buffers disagree on the rank or the counts");
        goto done;
    }
    grid_plan g;
    long long first_outside, bytes_needed;
    int any_sharded;
    const char *error = NULL;
    if (plan_crops((int)ndim, n_crops, b[0].buf, b[1].buf, b[2].buf, n_sources, b[3].buf, &g, &first_outside,
                   &bytes_needed, &any_sharded, &error)) {
        PyErr_SetString(error_type(error), error ? error : "plan_crops failed");
        goto done;
    }
    if (first_outside >= 0)
        result = Py_BuildValue("(OOLLO)", Py_None, Py_None, first_outside, 0LL, Py_False);
    else
        result = Py_BuildValue("(y#y#LLO)", (const char *)g.copies, (Py_ssize_t)(g.n_copies * GRID_COPY_COLS(ndim) * 8),
                               (const char *)g.chunks, (Py_ssize_t)(g.n_chunks * (GRID_CHUNK_COLS + ndim) * 8),
                               -1LL, bytes_needed, any_sharded ? Py_True : Py_False);
    grid_plan_free(&g);
done:
    for (int i = 0; i < 4; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* chunk_rows(info, source, file, offset, length, span_start, span_stop, first_copy, n_copies, eids, fetched)
 * -> bytes: the engine's chunks table (see tables.c); info: an array's I_* row each; then the plan's per-chunk
 * columns; eids: the chunks to take (None: all), fetched: chunk k's stored bytes are buffer k. */
static PyObject *chunk_rows_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *info_obj, *col_objs[N_PLAN_COLS], *eids_obj;
    int fetched;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOp", &info_obj, &col_objs[0], &col_objs[1], &col_objs[2], &col_objs[3],
                          &col_objs[4], &col_objs[5], &col_objs[6], &col_objs[7], &eids_obj, &fetched))
        return NULL;
    Py_buffer views[N_PLAN_COLS];
    Py_ssize_t steps[N_PLAN_COLS]; /* each column's stride (buffer_strides: a buffer may give none) */
    int held = 0;
    int64_t *info = NULL, *eids = NULL, *taken = NULL;
    long long n_sources = 0, n = 0, n_rows = 0;
    PyObject *result = NULL;
    if (int64_matrix(info_obj, N_INFO_COLS, &n_sources, &info, "info"))
        goto done;
    /* the columns as views (read where eids point: a fetch takes a few chunks of a large plan) */
    for (; held < N_PLAN_COLS; held++) {
        Py_buffer *b = &views[held];
        if (PyObject_GetBuffer(col_objs[held], b, PyBUF_STRIDED_RO | PyBUF_FORMAT) != 0)
            goto done;
        if (!native_words(b) || b->ndim != 1 || (held > 0 && b->shape[0] != n)) {
            PyBuffer_Release(b);
            PyErr_SetString(PyExc_ValueError, "the plan's columns must be 1-d int64 buffers of one length each");
            goto done;
        }
        n = b->shape[0];
        buffer_strides(b, &steps[held]);
        if (!buffer_apart(b, &steps[held])) { /* else n rows copied from a few bytes (np.broadcast_to): any size */
            PyBuffer_Release(b);
            PyErr_SetString(PyExc_ValueError, "a plan column's rows share memory (a zero stride, as np.broadcast_to "
                                              "makes, or rows that overlap): pass np.ascontiguousarray(...) of it");
            goto done;
        }
    }
    if (eids_obj == Py_None)
        n_rows = n;
    else if (int64_matrix(eids_obj, 0, &n_rows, &eids, "eids"))
        goto done;
    taken = malloc(sizeof(int64_t) * (size_t)(N_PLAN_COLS * n_rows + 1));
    if (taken == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *cols[N_PLAN_COLS];
    for (int c = 0; c < N_PLAN_COLS; c++)
        cols[c] = taken + c * n_rows;
    for (long long k = 0; k < n_rows; k++) {
        long long i = eids == NULL ? k : eids[k];
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_ValueError, "a chunk number is past the plan's chunks");
            goto done;
        }
        for (int c = 0; c < N_PLAN_COLS; c++)
            memcpy(taken + c * n_rows + k, (const char *)views[c].buf + i * steps[c], 8);
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n_rows * N_CHUNK_COLS * 8));
    if (result == NULL)
        goto done;
    const char *error = NULL;
    if (plan_chunk_rows(n_rows, cols, n_sources, info, fetched, (int64_t *)PyBytes_AS_STRING(result), &error)) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, error ? error : "chunk_rows failed");
    }
done:
    while (held-- > 0)
        PyBuffer_Release(&views[held]);
    free(info);
    free(eids);
    free(taken);
    return result;
}

/* copy_rows(src_offset, row, box_start, extent, row_stride, dst_strides) -> bytes: the engine's copies table
 * (see tables.c); per copy its first element in its chunk, its batch row, its start in the crop and its
 * extent (copies x ndim), into a batch of those strides. */
static PyObject *copy_rows_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[5];
    long long row_stride;
    if (!PyArg_ParseTuple(args, "OOOOLO", &objs[0], &objs[1], &objs[2], &objs[3], &row_stride, &objs[4]))
        return NULL;
    int64_t *src = NULL, *row = NULL, *box = NULL, *extent = NULL, *strides = NULL;
    long long ndim = 0, m = 0, rows;
    PyObject *result = NULL;
    if (int64_matrix(objs[4], 0, &ndim, &strides, "dst_strides"))
        goto done;
    if (ndim < 1 || ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "dst_strides must hold 1 to 32 strides");
        goto done;
    }
    if (int64_matrix(objs[0], 0, &m, &src, "src_offset") || int64_matrix(objs[1], 0, &rows, &row, "row") ||
        rows != m || int64_matrix(objs[2], ndim, &rows, &box, "box_start") || rows != m ||
        int64_matrix(objs[3], ndim, &rows, &extent, "extent") || rows != m) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy_rows' columns disagree on the number of copies");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(m * COPY_COLS(ndim) * 8));
    if (result == NULL)
        goto done;
    const char *error = NULL;
    if (plan_copy_rows((int)ndim, m, src, row, box, extent, (int64_t)row_stride, strides,
                       (int64_t *)PyBytes_AS_STRING(result), &error)) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, error ? error : "copy_rows failed");
    }
done:
    free(src);
    free(row);
    free(box);
    free(extent);
    free(strides);
    return result;
}

/* shard_positions(index, chunks_per_shard, shard_strides) -> (inner, shard_of, first, numbers): see grid.c;
 * index holds a grid index per chunk (chunks x ndim int64); the results are bytes of int64: inner and shard_of
 * one per chunk, first and numbers one per shard. */
static PyObject *shard_positions_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2]))
        return NULL;
    Py_buffer b[3] = {{0}};
    if (int64_buffers(objs, b, 3, "shard_positions"))
        return NULL;
    PyObject *result = NULL;
    int64_t *work = NULL;
    long long ndim = b[1].len / 8, n = ndim ? b[0].len / 8 / ndim : 0, k = 0;
    if (ndim < 1 || ndim > MAX_NDIM || b[2].len != ndim * 8 || b[0].len != n * ndim * 8) {
        PyErr_SetString(PyExc_ValueError, "shard_positions' buffers disagree on the rank or the counts");
        goto done;
    }
    work = malloc(sizeof(int64_t) * (size_t)(4 * n + 1));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *error = NULL;
    if (shard_positions((int)ndim, n, b[0].buf, b[1].buf, b[2].buf, work, work + n, work + 2 * n, work + 3 * n, &k,
                        &error)) {
        PyErr_SetString(error_type(error), error ? error : "shard_positions failed");
        goto done;
    }
    result = Py_BuildValue("(y#y#y#y#)", (const char *)work, (Py_ssize_t)(n * 8), (const char *)(work + n),
                           (Py_ssize_t)(n * 8), (const char *)(work + 2 * n), (Py_ssize_t)(k * 8),
                           (const char *)(work + 3 * n), (Py_ssize_t)(k * 8));
done:
    free(work);
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* gather_entries(tables, slot, shard_of, inner) -> bytes: see grid.c; tables: shard indexes, each n_inner rows
 * of two native uint64 (the same n_inner for all); slot: a table per shard (-1: none); shard_of, inner: per
 * chunk. The result: two uint64 per chunk. */
static PyObject *gather_entries_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *tables, *objs[3];
    if (!PyArg_ParseTuple(args, "OOOO", &tables, &objs[0], &objs[1], &objs[2]))
        return NULL;
    /* a tuple of its own: what a table's buffer export does cannot change the items under the loop */
    PyObject *seq = PySequence_Tuple(tables);
    if (seq == NULL)
        return NULL;
    Py_ssize_t nt = PyTuple_GET_SIZE(seq), held = 0;
    Py_buffer b[3] = {{0}};
    Py_buffer *tb = calloc((size_t)nt + 1, sizeof(Py_buffer));
    const uint64_t **tp = calloc((size_t)nt + 1, sizeof(*tp));
    uint64_t *out = NULL;
    PyObject *result = NULL;
    int have_ints = 0;
    long long n_inner = 0;
    if (tb == NULL || tp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < nt; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, held), &tb[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
            goto done;
        long long rows = tb[held].len / 16;
        if (!native_words(&tb[held]) || tb[held].len % 16 || (uintptr_t)tb[held].buf % _Alignof(uint64_t) ||
            (held && rows != n_inner)) {
            PyBuffer_Release(&tb[held]);
            PyErr_SetString(PyExc_ValueError, "gather_entries takes aligned tables of (offset, length) rows, each "
                                              "as long as the others");
            goto done;
        }
        n_inner = rows;
        tp[held] = tb[held].buf;
    }
    if (int64_buffers(objs, b, 3, "gather_entries"))
        goto done;
    have_ints = 1;
    long long n_shards = b[0].len / 8, n = b[1].len / 8;
    if (b[2].len != b[1].len) {
        PyErr_SetString(PyExc_ValueError, "gather_entries needs an inner index per chunk");
        goto done;
    }
    out = malloc(sizeof(uint64_t) * (size_t)(2 * n + 1));
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *error = NULL;
    if (gather_entries(n, b[1].buf, b[2].buf, n_shards, b[0].buf, (long long)nt, tp, n_inner, out, &error)) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)(n * 16));
done:
    free(out);
    if (have_ints)
        for (int i = 0; i < 3; i++)
            PyBuffer_Release(&b[i]);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&tb[i]);
    free(tb);
    free(tp);
    Py_DECREF(seq);
    return result;
}

PyMethodDef table_methods[] = {
    {"plan_grid", plan_grid_py, METH_VARARGS,
     "plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes) -> (copies, chunks): the chunks a batch's "
     "crops touch, once each in order of first use, and every copy grouped by chunk (int64 rows; see grid.c)."},
    {"shard_positions", shard_positions_py, METH_VARARGS,
     "shard_positions(index, chunks_per_shard, shard_strides) -> (inner, shard_of, first, numbers): a sharded "
     "array's chunks' inner indexes and shards, numbered in order of first use (int64 bytes; see grid.c)."},
    {"gather_entries", gather_entries_py, METH_VARARGS,
     "gather_entries(tables, slot, shard_of, inner) -> bytes: each chunk's (offset, length) from its shard's "
     "index table, the empty entry where its shard has none (uint64 pairs; see grid.c)."},
    {"plan_crops", plan_crops_py, METH_VARARGS,
     "plan_crops(boxes, sids, shape, rows) -> (copies, chunks, first_outside, bytes_needed, any_sharded): "
     "plan_grid from a batch's boxes and its arrays' rows, the boxes checked against the arrays' shapes first "
     "(see tables.c)."},
    {"chunk_rows", chunk_rows_py, METH_VARARGS,
     "chunk_rows(info, source, file, offset, length, span_start, span_stop, first_copy, n_copies, eids, fetched) "
     "-> bytes: the engine's chunks table of a plan's chunks eids (None: all), as int64 rows (see tables.c)."},
    {"copy_rows", copy_rows_py, METH_VARARGS,
     "copy_rows(src_offset, row, box_start, extent, row_stride, dst_strides) -> bytes: the engine's copies table "
     "of a plan's copies into a batch of those strides, as int64 rows (see tables.c)."},
    {NULL, NULL, 0, NULL},
};
