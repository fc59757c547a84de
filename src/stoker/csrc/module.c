/* stoker._native: the Python glue. Every call parses and checks its arguments holding the GIL, then
 * releases it for all reading, decoding and placing.
 *
 * decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> list of
 *     (status, nread, decoded, read_ns, decode_ns, place_ns, placed)
 *   codec    CODEC_ZSTD (the chunk is one zstd frame) or CODEC_BLOSC (one blosc1 frame)
 *   paths    sequence of str or bytes (file system paths), one per chunk
 *   regions  sequence of (offset, length, byte_start, byte_stop[, dev, ino, size, mtime_ns, ctime_ns]),
 *            one per chunk: where the stored chunk is in its file (offset -1: the whole file, as long as
 *            the file is; else an inner chunk of a shard), the decoded bytes the chunk's copies read and,
 *            for an inner chunk, optionally the identity of the shard file its index was read from (a
 *            file with another identity is not read: status 9); blosc decodes only
 *            the blocks holding those when that is at most the partial share of the chunk
 *            (set_codecs; stoker/zarr/codecs/blosc.py's PARTIAL_MAX_SHARE); zstd reads and
 *            decodes only up to the block that holds byte_stop - 1, when the frame states the
 *            chunk's size and has no checksum (set_zstd_streaming; see zstd_prefix in codecs.c)
 *   scratch  writable buffer for the encoded bytes of one file at a time
 *   outs     sequence of writable buffers of at least nbytes, one per path (decoded chunks)
 *   nbytes   the decoded size every chunk must have
 *   places   None, or per path None or a copy plan (int64 buffer, see parse_place): after
 *            decoding, the chunk's copies are cast into dst right here
 *   dst      None, or (address, size in bytes, kind[, stream]) of the batch the places write into
 *            (stream: write whole cache lines with streaming stores, see write_run in place.c)
 * status: 0 ok (decoded: bytes decompressed, fewer than nbytes when decoding stopped early), 1 missing
 * file, 2 file larger than scratch (decoded: its size), 3 OS error (decoded: errno), 4 file shorter than its size (it
 * changed while read), 5 codec error (decoded: zstd's error code, or blosc's negative
 * result), 6 decoded to a size other than nbytes (decoded: the size), 7 a blosc frame
 * whose header does not fit this chunk or the stored size (left to the Python path), 8 not a regular
 * file (decoded: its st_mode & S_IFMT), 9 the shard file is not the one its index was read from.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "stoker_native.h"

/* set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]):
 * the functions to call, by address; 0 for a codec that is not available (its pair must be both set or
 * both 0); and the largest share of a blosc chunk decoded block by block. */
static double current_share = 0.9;

static PyObject *set_codecs(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long zd, ze, bd, bg;
    double share = current_share;
    if (!PyArg_ParseTuple(args, "KKKK|d", &zd, &ze, &bd, &bg, &share))
        return NULL;
    if (!zd != !ze || !bd != !bg) {
        PyErr_SetString(PyExc_ValueError, "each codec needs both of its function addresses, or neither");
        return NULL;
    }
    if (!(share >= 0.0 && share <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "partial_max_share must be between 0 and 1");
        return NULL;
    }
    current_share = share;
    set_codec_functions((uintptr_t)zd, (uintptr_t)ze, (uintptr_t)bd, (uintptr_t)bg, share);
    Py_RETURN_NONE;
}

/* set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue,
 * next_src_size, frame_content_size): zstd's context and buffer-less streaming
 * functions, by address; all 0 turns them off (each chunk is then one ZSTD_decompress call, decoded in full). */
static PyObject *set_zstd_streaming(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a[7];
    if (!PyArg_ParseTuple(args, "KKKKKKK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6]))
        return NULL;
    int set = 0;
    for (int i = 0; i < 7; i++)
        set += a[i] != 0;
    if (set != 0 && set != 7) {
        PyErr_SetString(PyExc_ValueError, "zstd's streaming functions must all be given, or none");
        return NULL;
    }
    uintptr_t fns[7];
    for (int i = 0; i < 7; i++)
        fns[i] = (uintptr_t)a[i];
    set_zstd_functions(fns);
    Py_RETURN_NONE;
}

/* set_lz4(LZ4_decompress_safe): the address of lz4's block decoder (0: lz4 chunks take the Python path). */
static PyObject *set_lz4(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a;
    if (!PyArg_ParseTuple(args, "K", &a))
        return NULL;
    set_lz4_function((uintptr_t)a);
    Py_RETURN_NONE;
}

/* set_zlib(inflateInit2_, inflate, inflateEnd, inflateReset) -> bool: zlib's functions, by address (all 0:
 * off); False when this build has no zlib.h, so zlib and gzip chunks take the Python path. */
static PyObject *set_zlib(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a[4];
    if (!PyArg_ParseTuple(args, "KKKK", &a[0], &a[1], &a[2], &a[3]))
        return NULL;
    int set = (a[0] != 0) + (a[1] != 0) + (a[2] != 0) + (a[3] != 0);
    if (set != 0 && set != 4) {
        PyErr_SetString(PyExc_ValueError, "zlib's functions must all be given, or none");
        return NULL;
    }
    return PyBool_FromLong(set_zlib_functions((uintptr_t)a[0], (uintptr_t)a[1], (uintptr_t)a[2], (uintptr_t)a[3]) &&
                           a[0] != 0);
}

/* A new reference to a tuple of ``obj``'s items (``obj`` itself when it is a tuple; any iterable), or NULL
 * with TypeError naming ``what`` when it is not iterable. Arguments are walked as tuples: converting an
 * item can run Python code (a path's __fspath__, an index's __index__, on 3.12 a buffer's __buffer__)
 * that could change a list under the walk. */
static PyObject *tuple_of(PyObject *obj, const char *what) {
    PyObject *it = PyObject_GetIter(obj); /* any iterable, as PySequence_Fast took */
    if (it == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence", what);
        return NULL;
    }
    Py_DECREF(it);
    return PySequence_Tuple(obj);
}

/* The exception for a C function's error message: MemoryError for "out of memory", else ValueError. */
static PyObject *error_type(const char *error) {
    return error && strcmp(error, "out of memory") == 0 ? PyExc_MemoryError : PyExc_ValueError;
}

/* plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes) -> (copies, chunks): see grid.c; the
 * arguments are int64 buffers (starts: crops x ndim; shape: ndim; chunk_shapes, strides: arrays x ndim;
 * itemsizes: arrays), the results bytes of int64 rows (copies: 2 + 3 ndim values, chunks: 5 + ndim). */
static PyObject *plan_grid_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5]))
        return NULL;
    Py_buffer b[6] = {{0}};
    int held = 0;
    PyObject *result = NULL;
    for (; held < 6; held++) {
        if (PyObject_GetBuffer(objs[held], &b[held], PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        if (b[held].len % (Py_ssize_t)sizeof(int64_t) || (uintptr_t)b[held].buf % _Alignof(int64_t)) {
            PyBuffer_Release(&b[held]);
            PyErr_SetString(PyExc_ValueError, "plan_grid takes aligned int64 buffers");
            goto done;
        }
    }
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
    result = Py_BuildValue("(y#y#)", (const char *)g.copies, (Py_ssize_t)(g.n_copies * (2 + 3 * ndim) * 8),
                           (const char *)g.chunks, (Py_ssize_t)(g.n_chunks * (GRID_CHUNK_COLS + ndim) * 8));
    grid_plan_free(&g);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* Whether b holds 8-byte integers in native byte order (numpy's int64 and uint64, array('q')): the functions
 * below read their buffers as such, so bytes or an int32 array of the right length are refused, not read. */
static int native_words(const Py_buffer *b) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const char order = '<';
#else
    const char order = '>';
#endif
    const char *f = b->format;
    if (f == NULL || b->itemsize != 8)
        return 0;
    if (*f == '@' || *f == '=' || *f == order)
        f++;
    return (f[0] == 'q' || f[0] == 'Q' || f[0] == 'l' || f[0] == 'L') && f[1] == '\0';
}

/* Take aligned buffers of 8-byte integers of objs[0..n): 0, or -1 with an exception set and none held. */
static int int64_buffers(PyObject *const *objs, Py_buffer *b, int n, const char *who) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(objs[i], &b[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0 &&
            (!native_words(&b[i]) || (uintptr_t)b[i].buf % _Alignof(int64_t))) {
            PyBuffer_Release(&b[i]);
            PyErr_Format(PyExc_ValueError, "%s takes aligned int64 buffers", who);
        }
        if (PyErr_Occurred()) {
            while (i-- > 0)
                PyBuffer_Release(&b[i]);
            return -1;
        }
    }
    return 0;
}

/* plan_crops(boxes, sids, shape, rows) -> (copies, chunks, first_outside, bytes_needed, any_sharded): see
 * tables.c; int64 buffers: boxes crops x ndim x 2, sids one per crop, shape ndim, rows an array's 3 ndim + 2
 * values each. copies and chunks as plan_grid returns them (None when a crop ends outside its array). */
static PyObject *plan_crops_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    Py_buffer b[4] = {{0}};
    if (int64_buffers(objs, b, 4, "plan_crops"))
        return NULL;
    PyObject *result = NULL;
    long long ndim = b[2].len / 8, n_crops = b[1].len / 8, w = 3 * ndim + 2, n_sources = b[3].len / 8 / w;
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
        result = Py_BuildValue("(y#y#LLO)", (const char *)g.copies, (Py_ssize_t)(g.n_copies * (2 + 3 * ndim) * 8),
                               (const char *)g.chunks, (Py_ssize_t)(g.n_chunks * (GRID_CHUNK_COLS + ndim) * 8),
                               -1LL, bytes_needed, any_sharded ? Py_True : Py_False);
    grid_plan_free(&g);
done:
    for (int i = 0; i < 4; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* obj's 8-byte integers, a 1-d buffer (cols 0) or an n x cols one, with any strides (numpy's column views of
 * a table), copied in C order into *out (free it); *n its rows. 0, or -1 with an exception set. */
static int int64_matrix(PyObject *obj, long long cols, long long *n, int64_t **out, const char *what) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_STRIDED_RO | PyBUF_FORMAT) != 0)
        return -1;
    if (!native_words(&b) || (cols == 0 ? b.ndim != 1 : (b.ndim != 2 || b.shape[1] != cols))) {
        PyBuffer_Release(&b);
        if (cols == 0)
            PyErr_Format(PyExc_ValueError, "%s must be a 1-d buffer of int64", what);
        else
            PyErr_Format(PyExc_ValueError, "%s must be rows of %lld int64", what, cols);
        return -1;
    }
    long long rows = b.shape[0], w = cols ? cols : 1;
    int64_t *o = malloc(sizeof(int64_t) * (size_t)(rows * w + 1)); /* rows * w * 8 == b.len: bounded */
    if (o == NULL) {
        PyBuffer_Release(&b);
        PyErr_NoMemory();
        return -1;
    }
    for (long long r = 0; r < rows; r++)
        for (long long c = 0; c < w; c++)
            memcpy(&o[r * w + c], (const char *)b.buf + r * b.strides[0] + (cols ? c * b.strides[1] : 0), 8);
    PyBuffer_Release(&b);
    *n = rows;
    *out = o;
    return 0;
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
            memcpy(taken + c * n_rows + k, (const char *)views[c].buf + i * views[c].strides[0], 8);
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
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(m * (2 + ndim) * 8));
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

/* A copy plan (int64 values, aligned: array('q') always is):
 *   src_kind, ndim, ncopies, src_strides[ndim], dst_strides[ndim],
 *   then per copy: src_offset, dst_offset, extent[ndim]
 * strides and offsets count elements; the innermost stride of both must be 1. */
#define BAD_PLAN "places[%zd] is not a valid copy plan for this chunk, its span and the batch"

static int check_place(const void *plan, Py_ssize_t len, const chunk_io *job, long long chunk_bytes,
                       const batch_dst *dst, Py_ssize_t index) {
    const int64_t *p = plan;
    Py_ssize_t n = len / (Py_ssize_t)sizeof(int64_t);
    if (len % (Py_ssize_t)sizeof(int64_t) || (uintptr_t)plan % _Alignof(int64_t))
        goto bad;
    if (n < 3 || p[0] < 0 || p[0] >= N_SRC_KINDS || p[1] < 1 || p[1] > MAX_NDIM || p[2] < 0)
        goto bad;
    long long ndim = p[1], ncopies = p[2];
    /* divide before multiplying: a huge ncopies must not wrap around to the right length */
    if (n < 3 + 2 * ndim || ncopies > (n - 3 - 2 * ndim) / (2 + ndim) || n != 3 + 2 * ndim + ncopies * (2 + ndim))
        goto bad;
    if (check_copies((int)p[0], (int)ndim, p + 3, p + 3 + ndim, p + 3 + 2 * ndim, ncopies, 2 + ndim, chunk_bytes,
                     job->span_start, job->span_stop, job->out, dst, 0) == 0)
        return 0;
bad:
    PyErr_Format(PyExc_ValueError, BAD_PLAN, index);
    return -1;
}

/* Our own copy of copy plan ``place`` (aligned, PyMem_Malloc'd) and its length in bytes, or NULL with an
 * exception set. The caller's array is not read again: Python code run for a later item (or another thread
 * while the GIL is released) could rewrite it after its check. A misaligned array is refused, as
 * check_place refuses one. */
static int64_t *own_plan(PyObject *place, Py_ssize_t *len, Py_ssize_t index) {
    Py_buffer pv;
    if (PyObject_GetBuffer(place, &pv, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    int64_t *copy = NULL;
    if ((uintptr_t)pv.buf % _Alignof(int64_t))
        PyErr_Format(PyExc_ValueError, BAD_PLAN, index);
    else if ((copy = PyMem_Malloc(pv.len > 0 ? (size_t)pv.len : 1)) == NULL)
        PyErr_NoMemory();
    else if (pv.len > 0)
        memcpy(copy, pv.buf, (size_t)pv.len);
    *len = pv.len;
    PyBuffer_Release(&pv);
    return copy;
}

static void place_plan(const int64_t *p, const char *chunk, const batch_dst *dst) {
    int ndim = (int)p[1];
    place_copies((int)p[0], 0, ndim, p + 3, p + 3 + ndim, p + 3 + 2 * ndim, p[2], 2 + ndim, chunk, dst);
    place_fence(dst);
}

static int parse_dst(PyObject *obj, batch_dst *dst) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(obj, "KLi|p", &addr, &dst->nbytes, &dst->kind, &dst->stream))
        return -1;
    if (!addr || dst->nbytes < 0 || dst->kind < 0 || dst->kind >= N_DST_KINDS) {
        PyErr_SetString(PyExc_ValueError, "dst must be (address, size in bytes, kind[, stream]) of a batch");
        return -1;
    }
    dst->base = (char *)(uintptr_t)addr;
    return 0;
}

typedef struct {
    chunk_io io;
    const int64_t *place; /* copy plan, or NULL */
    int placed;
    long long place_ns; /* copy-cast into the batch */
} file_job;

static PyObject *decode_files(PyObject *Py_UNUSED(self), PyObject *args) {
    int codec;
    PyObject *paths_obj, *regions_obj, *scratch_obj, *outs_obj, *places_obj, *dst_obj;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "iOOOOnOO", &codec, &paths_obj, &regions_obj, &scratch_obj, &outs_obj, &nbytes,
                          &places_obj, &dst_obj))
        return NULL;
    if ((codec != CODEC_ZSTD && codec != CODEC_BLOSC) || !codec_ready(codec)) {
        PyErr_Format(PyExc_RuntimeError, "stoker._native: codec %d is not set up", codec);
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        return NULL;
    }
    batch_dst dst = {0};
    if (dst_obj != Py_None && parse_dst(dst_obj, &dst))
        return NULL;
    PyObject *paths = tuple_of(paths_obj, "paths");
    PyObject *regions = paths ? tuple_of(regions_obj, "regions") : NULL;
    PyObject *outs = regions ? tuple_of(outs_obj, "outs") : NULL;
    PyObject *places = (outs && places_obj != Py_None) ? tuple_of(places_obj, "places") : NULL;
    Py_ssize_t n = paths ? PyTuple_GET_SIZE(paths) : 0;
    PyObject *result = NULL;
    Py_buffer scratch = {0};
    Py_buffer *out_views = NULL;
    int64_t **place_plans = NULL; /* our copies of the copy plans */
    PyObject **encoded_paths = NULL;
    file_job *jobs = NULL;
    Py_ssize_t views_held = 0, paths_held = 0;

    if (outs == NULL || (places_obj != Py_None && places == NULL))
        goto done;
    if (PyTuple_GET_SIZE(outs) != n || PyTuple_GET_SIZE(regions) != n || (places && PyTuple_GET_SIZE(places) != n)) {
        PyErr_SetString(PyExc_ValueError, "paths, regions, outs and places must have the same length");
        goto done;
    }
    if (places && dst_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "places need a dst");
        goto done;
    }
    if (PyObject_GetBuffer(scratch_obj, &scratch, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        goto done;
    out_views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    place_plans = PyMem_Calloc((size_t)n + 1, sizeof(int64_t *));
    encoded_paths = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(file_job));
    if (out_views == NULL || place_plans == NULL || encoded_paths == NULL || jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(paths, i), &encoded_paths[i]))
            goto done;
        paths_held++;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, i), &out_views[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        views_held++;
        if (out_views[i].len < nbytes) {
            PyErr_Format(PyExc_ValueError, "outs[%zd] holds %zd bytes, fewer than nbytes (%zd)", i,
                         out_views[i].len, nbytes);
            goto done;
        }
        chunk_io *job = &jobs[i].io;
        PyObject *region = PyTuple_GET_ITEM(regions, i);
        job->has_ident = PyTuple_Check(region) && PyTuple_GET_SIZE(region) == 9;
        if (job->has_ident ? !PyArg_ParseTuple(region, "LLLLKKLLL", &job->offset, &job->length, &job->span_start,
                                               &job->span_stop, &job->dev, &job->ino, &job->size, &job->mtime_ns,
                                               &job->ctime_ns)
                           : !PyArg_ParseTuple(region, "LLLL", &job->offset, &job->length, &job->span_start,
                                               &job->span_stop))
            goto done;
        if (job->has_ident && job->offset < 0) {
            PyErr_Format(PyExc_ValueError, "regions[%zd]: a file identity is for inner chunks only", i);
            goto done;
        }
        if (job->span_start < 0 || job->span_stop > nbytes || job->span_start > job->span_stop ||
            job->offset < -1 || job->length < 0 || job->offset > LLONG_MAX - job->length) {
            PyErr_Format(PyExc_ValueError, "regions[%zd] is outside its file or its chunk", i);
            goto done;
        }
        job->out = out_views[i].buf;
        PyObject *place = places ? PyTuple_GET_ITEM(places, i) : Py_None;
        if (place != Py_None) {
            Py_ssize_t len = 0;
            if ((place_plans[i] = own_plan(place, &len, i)) == NULL ||
                check_place(place_plans[i], len, job, nbytes, &dst, i))
                goto done;
            jobs[i].place = place_plans[i];
        }
        job->path = PyBytes_AS_STRING(encoded_paths[i]);
    }

    Py_BEGIN_ALLOW_THREADS
    codec_ctx ctx = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        file_job *job = &jobs[i];
        read_decode(&job->io, codec, scratch.buf, (size_t)scratch.len, (size_t)nbytes, &ctx);
        if (job->io.status == ST_OK && job->place != NULL) {
            long long t = now_ns();
            place_plan(job->place, job->io.out, &dst);
            job->place_ns = now_ns() - t;
            job->placed = 1;
        }
    }
    codec_ctx_free(&ctx);
    Py_END_ALLOW_THREADS

    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        file_job *j = &jobs[i];
        PyObject *item = Py_BuildValue("(iLLLLLi)", j->io.status, j->io.nread, j->io.detail, j->io.read_ns,
                                       j->io.decode_ns, j->place_ns, j->placed);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }

done:
    for (Py_ssize_t i = 0; i < views_held; i++)
        PyBuffer_Release(&out_views[i]);
    for (Py_ssize_t i = 0; place_plans != NULL && i < n; i++)
        PyMem_Free(place_plans[i]);
    for (Py_ssize_t i = 0; i < paths_held; i++)
        Py_DECREF(encoded_paths[i]);
    if (scratch.obj != NULL)
        PyBuffer_Release(&scratch);
    PyMem_Free(out_views);
    PyMem_Free(place_plans);
    PyMem_Free(encoded_paths);
    PyMem_Free(jobs);
    Py_XDECREF(paths);
    Py_XDECREF(regions);
    Py_XDECREF(outs);
    Py_XDECREF(places);
    return result;
}


/* ---- the engine ----------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    engine *e;
    int closed;
} EngineObject;

typedef struct {
    PyObject_HEAD
    EngineObject *owner;
    job *j;
    Py_buffer view; /* the batch: alive as long as this object, and written only until cancel() */
    int has_view;
    /* the buffers chunks are read from (a view each; obj NULL: None, a missing value), alive as long as this
     * object, and read only until cancel() */
    Py_buffer *bufs;
    Py_ssize_t n_bufs;
} BatchJobObject;

static PyTypeObject BatchJobType;

static int engine_init(EngineObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"n_threads", "budget_bytes", NULL};
    int n;
    long long budget;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iL", names, &n, &budget))
        return -1;
    if (self->e != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is initialised once");
        return -1;
    }
    if (n < 1 || n > 4096 || budget < 0) {
        PyErr_SetString(PyExc_ValueError, "Engine needs 1 to 4096 threads and a budget of at least 0 bytes");
        return -1;
    }
    int started = 0;
    engine *e = engine_new(n, budget, &started);
    if (e == NULL)
        return PyErr_NoMemory(), -1;
    if (started == 0) {
        engine_release(e);
        PyErr_SetString(PyExc_OSError, "the system gives no thread to the engine");
        return -1;
    }
    self->e = e;
    return 0;
}

static void engine_dealloc(EngineObject *self) {
    if (self->e != NULL) {
        if (!self->closed) {
            Py_BEGIN_ALLOW_THREADS
            engine_close(self->e, 0);
            Py_END_ALLOW_THREADS
        }
        engine_release(self->e);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* an int64 table: a C-contiguous buffer of a whole number of ``width``-value rows; *rows its row count */
static int table_buffer(PyObject *obj, Py_buffer *view, long long width, long long *rows, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    if (view->len % (Py_ssize_t)(sizeof(int64_t) * width)) {
        PyErr_Format(PyExc_ValueError, "%s must hold rows of %lld int64 values", name, width);
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->len / (Py_ssize_t)(sizeof(int64_t) * width);
    return 0;
}

/* views of ``obj``'s items (a sequence of buffers or None) into result->bufs, their addresses and lengths into
 * the tables; -1 with an exception set */
static int hold_buffers(BatchJobObject *result, PyObject *obj, plan_tables *t, const char ***bases, long long **lens) {
    PyObject *seq = tuple_of(obj, "buffers (each a buffer, or None: a missing value)");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    result->bufs = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    *bases = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    *lens = PyMem_Calloc((size_t)n + 1, sizeof(long long));
    if (result->bufs == NULL || *bases == NULL || *lens == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    result->n_bufs = n; /* views not taken (None, or after a failure) have obj NULL: nothing to release */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (item == Py_None)
            continue; /* obj NULL, address NULL: a missing value */
        if (PyObject_GetBuffer(item, &result->bufs[i], PyBUF_C_CONTIGUOUS) != 0) {
            result->bufs[i].obj = NULL;
            Py_DECREF(seq);
            return -1;
        }
        (*bases)[i] = result->bufs[i].buf;
        (*lens)[i] = (long long)result->bufs[i].len;
    }
    t->n_buffers = n;
    t->buffers = *bases;
    t->buffer_lens = *lens;
    Py_DECREF(seq);
    return 0;
}

static PyObject *engine_submit_py(EngineObject *self, PyObject *args) {
    PyObject *chunks_obj, *copies_obj, *sources_obj, *files_obj, *blob_obj, *dst_obj, *strides_obj;
    PyObject *buffers_obj = Py_None;
    int kind, stream;
    if (!PyArg_ParseTuple(args, "OOOOOOipO|O", &chunks_obj, &copies_obj, &sources_obj, &files_obj, &blob_obj,
                          &dst_obj, &kind, &stream, &strides_obj, &buffers_obj))
        return NULL;
    const char **bases = NULL;
    long long *lens = NULL;
    if (self->e == NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the engine is closed");
        return NULL;
    }
    Py_buffer b[6] = {{0}};
    int held = 0;
    BatchJobObject *result = NULL;
    plan_tables t = {0};
    long long ndim;
    if (table_buffer(strides_obj, &b[0], 1, &ndim, "dst_strides"))
        goto done;
    held++;
    if (ndim < 1 || ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "dst_strides must hold the batch's strides: 1 to 32 of them");
        goto done;
    }
    t.ndim = (int)ndim;
    memcpy(t.dst_strides, b[0].buf, sizeof(int64_t) * (size_t)ndim);
    if (table_buffer(chunks_obj, &b[1], N_CHUNK_COLS, &t.n_chunks, "chunks"))
        goto done;
    held++;
    if (table_buffer(copies_obj, &b[2], 2 + ndim, &t.n_copies, "copies"))
        goto done;
    held++;
    if (table_buffer(sources_obj, &b[3], S_STRIDES + ndim, &t.n_sources, "sources"))
        goto done;
    held++;
    if (table_buffer(files_obj, &b[4], F_COORDS + ndim, &t.n_files, "files"))
        goto done;
    held++;
    if (PyObject_GetBuffer(blob_obj, &b[5], PyBUF_C_CONTIGUOUS) != 0)
        goto done;
    held++;
    t.chunks = b[1].buf, t.copies = b[2].buf, t.sources = b[3].buf, t.files = b[4].buf;
    t.blob = b[5].buf, t.blob_len = b[5].len;
    result = PyObject_New(BatchJobObject, &BatchJobType);
    if (result == NULL)
        goto done;
    result->j = NULL, result->has_view = 0, result->bufs = NULL, result->n_bufs = 0;
    Py_INCREF(self);
    result->owner = self;
    if (buffers_obj != Py_None && hold_buffers(result, buffers_obj, &t, &bases, &lens)) {
        Py_CLEAR(result);
        goto done;
    }
    if (PyObject_GetBuffer(dst_obj, &result->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        Py_CLEAR(result);
        goto done;
    }
    result->has_view = 1;
    t.dst.base = result->view.buf;
    t.dst.nbytes = result->view.len;
    t.dst.kind = kind;
    t.dst.stream = stream;
    const char *error = NULL;
    job *j;
    /* Checking and copying the tables, then the engine's lock and waking its threads: no Python in either
     * (the buffers stay held), and the lock may be contended and the wake-up costs a system call, so not
     * under the GIL. */
    Py_BEGIN_ALLOW_THREADS
    j = job_new(self->e, &t, &error);
    if (j != NULL)
        engine_submit(self->e, j);
    Py_END_ALLOW_THREADS
    result->j = j;
    if (j == NULL) {
        PyErr_Format(error_type(error), "not a plan this engine can run: %s", error ? error : "?");
        Py_CLEAR(result);
        goto done;
    }
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&b[i]);
    PyMem_Free(bases); /* job_new copied them */
    PyMem_Free(lens);
    return (PyObject *)result;
}

static PyObject *engine_close_py(EngineObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"timeout", NULL};
    double timeout = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", names, &timeout))
        return NULL;
    if (self->e == NULL)
        Py_RETURN_TRUE;
    int all;
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS
    all = engine_close(self->e, timeout);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(all);
}

static PyObject *engine_info_py(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    long long v[6] = {0};
    if (self->e != NULL)
        engine_info(self->e, v);
    return Py_BuildValue("{sLsLsLsLsLsO}", "threads", v[0], "alive", v[1], "budget", v[2], "used", v[3], "peak",
                         v[4], "closing", v[5] ? Py_True : Py_False);
}

static PyObject *local_file_system_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *path;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path))
        return NULL;
    int fd, local = 0;
    Py_BEGIN_ALLOW_THREADS
    fd = open(PyBytes_AS_STRING(path), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
        local = on_local_fs(fd);
        close(fd);
    }
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    return PyBool_FromLong(local);
}

static PyMethodDef engine_methods[] = {
    {"submit", (PyCFunction)engine_submit_py, METH_VARARGS,
     "submit(chunks, copies, sources, files, blob, dst, kind, stream, dst_strides[, buffers]) -> BatchJob: make a "
     "batch from its plan tables (int64; see csrc/stoker_native.h) into dst (a writable buffer), on the engine's "
     "threads. buffers: the buffers (or None: a missing value) that chunks with a C_BUFFER are read from, held "
     "by the BatchJob and read until it is done or cancelled. The tables are copied and checked first: "
     "ValueError when they are not a sound plan."},
    {"close", (PyCFunction)(void (*)(void))engine_close_py, METH_VARARGS | METH_KEYWORDS,
     "close(timeout=1.0) -> bool: cancel every job and stop the threads; True when all left within timeout "
     "(a thread stuck in a system call is left behind, and writes into no batch)."},
    {"info", (PyCFunction)engine_info_py, METH_NOARGS,
     "info() -> {threads, alive, budget, used, peak, closing}: threads started and alive, the scratch budget, "
     "the bytes of it reserved now, and the most allocated at once."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stoker._native.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(n_threads, budget_bytes): worker threads that make whole batches from plan tables, "
              "without the GIL; each thread's read and decode scratch comes out of budget_bytes.",
    .tp_methods = engine_methods,
    .tp_init = (initproc)engine_init,
    .tp_new = PyType_GenericNew,
};

static void batch_job_dealloc(BatchJobObject *self) {
    if (self->j != NULL) {
        if ((self->has_view || self->n_bufs) && !job_done(self->owner->e, self->j)) {
            Py_BEGIN_ALLOW_THREADS
            job_cancel(self->owner->e, self->j); /* then nothing writes into or reads the views released below */
            Py_END_ALLOW_THREADS
        }
        job_release(self->owner->e, self->j);
    }
    if (self->has_view)
        PyBuffer_Release(&self->view);
    for (Py_ssize_t i = 0; i < self->n_bufs; i++)
        if (self->bufs[i].obj != NULL)
            PyBuffer_Release(&self->bufs[i]);
    PyMem_Free(self->bufs);
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *batch_job_wait(BatchJobObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", names, &timeout_obj))
        return NULL;
    double timeout = -1;
    if (timeout_obj != Py_None) {
        timeout = PyFloat_AsDouble(timeout_obj);
        if (timeout == -1 && PyErr_Occurred())
            return NULL;
        if (!(timeout >= 0)) {
            PyErr_SetString(PyExc_ValueError, "timeout must be None or at least 0");
            return NULL;
        }
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    done = job_wait(self->owner->e, self->j, timeout);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *batch_job_cancel(BatchJobObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    job_cancel(self->owner->e, self->j);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *batch_job_results(BatchJobObject *self, PyObject *Py_UNUSED(ignored)) {
    long long n = job_chunks(self->j);
    PyObject *status = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (long long)sizeof(int32_t)));
    PyObject *detail = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (long long)sizeof(int64_t)));
    if (status == NULL || detail == NULL) {
        Py_XDECREF(status);
        Py_XDECREF(detail);
        return NULL;
    }
    job_counters c;
    job_results(self->owner->e, self->j, (int32_t *)PyBytes_AS_STRING(status), (int64_t *)PyBytes_AS_STRING(detail),
                &c);
    long long not_placed = 0; /* counted here: a batch whose chunks were all placed needs no look at them */
    for (long long i = 0; i < n; i++)
        not_placed += ((const int32_t *)PyBytes_AS_STRING(status))[i] != ST_OK;
    return Py_BuildValue("(NN{sLsLsLsLsLsLsLsLsLsLsL})", status, detail, "bytes_read", c.bytes_read,
                         "bytes_decoded", c.bytes_decoded, "chunks_decoded", c.chunks_decoded, "chunks_filled",
                         c.chunks_filled, "read_ns", c.read_ns, "decode_ns", c.decode_ns, "place_ns", c.place_ns,
                         "fill_ns", c.fill_ns, "max_threads", c.max_threads, "files_opened", c.files_opened,
                         "not_placed", not_placed);
}

static PyObject *batch_job_done(BatchJobObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(job_done(self->owner->e, self->j));
}

static Py_ssize_t batch_job_len(BatchJobObject *self) { return (Py_ssize_t)job_chunks(self->j); }

static PyMethodDef batch_job_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))batch_job_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> bool: whether every chunk finished (the GIL is released while waiting)."},
    {"cancel", (PyCFunction)batch_job_cancel, METH_NOARGS,
     "cancel(): once it returns no thread writes into the batch; chunks not placed are CANCELLED."},
    {"results", (PyCFunction)batch_job_results, METH_NOARGS,
     "results() -> (status, detail, counters): per chunk an int32 status and an int64 detail (as bytes), and "
     "the job's summed counters, with not_placed: the chunks whose status is not OK. Final once the job is done."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef batch_job_getset[] = {
    {"done", (getter)batch_job_done, NULL, "whether every chunk finished", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods batch_job_sequence = {.sq_length = (lenfunc)batch_job_len};

static PyTypeObject BatchJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stoker._native.BatchJob",
    .tp_basicsize = sizeof(BatchJobObject),
    .tp_dealloc = (destructor)batch_job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One batch on an Engine (from Engine.submit): wait, cancel, results. Dropping it cancels it.",
    .tp_methods = batch_job_methods,
    .tp_getset = batch_job_getset,
    .tp_as_sequence = &batch_job_sequence,
};

static PyMethodDef methods[] = {
    {"local_file_system", local_file_system_py, METH_VARARGS,
     "local_file_system(path) -> bool: whether the file is on a file system the engine keeps shard files open "
     "on between inner chunks (a local one: ext4, xfs, btrfs, tmpfs, overlayfs, zfs, f2fs; apfs and hfs on "
     "macOS). OSError when it cannot be opened."},
    {"set_codecs", set_codecs, METH_VARARGS,
     "set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]): "
     "function addresses (0: that codec is not available) and the largest share of a blosc chunk decoded "
     "block by block."},
    {"set_zstd_streaming", set_zstd_streaming, METH_VARARGS,
     "set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue, "
     "next_src_size, frame_content_size): zstd's context and buffer-less "
     "streaming functions (all 0: off)."},
    {"set_lz4", set_lz4, METH_VARARGS, "set_lz4(LZ4_decompress_safe): lz4's block decoder by address (0: off)."},
    {"set_zlib", set_zlib, METH_VARARGS,
     "set_zlib(inflateInit2_, inflate, inflateEnd, inflateReset) -> bool: zlib's functions by address (all 0: "
     "off); False where this build has no zlib support."},
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
    {"decode_files", decode_files, METH_VARARGS,
     "decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> "
     "[(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]: read, decompress and place chunk "
     "files without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&BatchJobType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
