/* stoker._testing: built for the tests only (setup.py builds it beside stoker._native from the same sources;
 * no wheel ships it). It holds the codec setters (this module's own copies of the codec state: each extension
 * module has its own) and decode_files, which reads, decodes and places chunks on the calling thread with
 * the engine's readers and decoders, for direct tests and fuzzing of them.
 *
 * decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> list of
 *     (status, nread, decoded, read_ns, decode_ns, place_ns, placed)
 *   codec    CODEC_ZSTD (the chunk is one zstd frame) or CODEC_BLOSC (one blosc1 frame)
 *   paths    sequence of str or bytes (file system paths), one per chunk
 *   regions  sequence of (offset, length, byte_start, byte_stop[, dev, ino, size, mtime_ns, ctime_ns]),
 *            one per chunk: where the stored chunk is in its file (offset -1: the whole file, as long as
 *            the file is; else an inner chunk of a shard), the decoded bytes the chunk's copies read and,
 *            for an inner chunk, optionally the identity of the shard file its index was read from (a
 *            file with another identity is not read: ST_CHANGED); blosc decodes only
 *            the blocks holding those when that is at most the partial share of the chunk
 *            (set_codecs; stoker/zarr/codecs/blosc.py's PARTIAL_MAX_SHARE); zstd reads and
 *            decodes only up to the block that holds byte_stop - 1, when the frame states the
 *            chunk's size and has no checksum (set_zstd_streaming; see zstd_prefix in codecs.c)
 *   scratch  writable buffer for the encoded bytes of one file at a time
 *   outs     sequence of writable buffers of at least nbytes, one per path (decoded chunks)
 *   nbytes   the decoded size every chunk must have
 *   places   None, or per path None or a copy plan (int64 buffer, see check_place): after
 *            decoding, the chunk's copies are cast into dst right here
 *   dst      None, or (address, size in bytes, kind[, stream]) of the batch the places write into
 *            (stream: write whole cache lines with streaming stores, see write_run in place.c)
 * status: an ST_* of stoker_native.h, and ``decoded`` its detail: ST_OK (bytes decompressed, fewer than nbytes
 * when decoding stopped early), ST_MISSING, ST_TOO_BIG (the file is larger than scratch: its size), ST_OS_ERROR
 * (errno), ST_SHORT (the file is shorter than its size: it changed while read), ST_CODEC_ERROR (zstd's error
 * code, or blosc's negative result), ST_SIZE (decoded to a size other than nbytes: the size), ST_FRAME (a blosc
 * frame whose header does not fit this chunk or the stored size: left to the Python path), ST_NOT_REGULAR (its
 * st_mode & S_IFMT), ST_CHANGED (the shard file is not the one its index was read from), ST_RANGE (placed, but
 * a value did not fit the integer batch: zero written in its place).
 */
#include "py_glue.h"
#include "staging.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

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
    if (check_copies((int)p[0], (int)ndim, p + 3, p + 3 + ndim, p + 3 + 2 * ndim, ncopies, COPY_COLS(ndim), chunk_bytes,
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

/* 1 when a value did not fit the integer batch (see place_copies) */
static int place_plan(const int64_t *p, const char *chunk, const batch_dst *dst) {
    int ndim = (int)p[1];
    int bad = place_copies((int)p[0], 0, ndim, p + 3, p + 3 + ndim, p + 3 + 2 * ndim, p[2], COPY_COLS(ndim), chunk,
                           dst);
    place_fence(dst);
    return bad;
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
            if (place_plan(job->place, job->io.out, &dst))
                job->io.status = ST_RANGE;
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

/* blosc_rows(buf, chunks, cap_streams, cap_blocks) -> (faults, streams, blocks): blosc_streams' second pass
 * (staging.c) alone into rooms of exactly the capacities given, as if its count had found that many rows */
static PyObject *blosc_rows_py(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer buf;
    PyObject *chunks_obj, *result = NULL;
    long long cap_s, cap_b;
    if (!PyArg_ParseTuple(args, "y*OLL", &buf, &chunks_obj, &cap_s, &cap_b))
        return NULL;
    PyObject *chunks = PySequence_Tuple(chunks_obj);
    Py_ssize_t k = chunks == NULL ? 0 : PyTuple_GET_SIZE(chunks);
    int64_t *cols = PyMem_Calloc((size_t)(5 * k + 1), sizeof(int64_t)), *fault = cols + 4 * k;
    int64_t *streams = PyMem_Malloc(sizeof(int64_t) * BLOSC_STREAM_COLS * (size_t)(cap_s > 0 ? cap_s : 1));
    int64_t *blocks = PyMem_Malloc(sizeof(int64_t) * BLOSC_BLOCK_COLS * (size_t)(cap_b > 0 ? cap_b : 1));
    if (chunks == NULL || cols == NULL || streams == NULL || blocks == NULL || cap_s < 0 || cap_b < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "blosc_rows: capacities >= 0, or no memory");
        goto done;
    }
    for (Py_ssize_t c = 0; c < k; c++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(chunks, c), "LLLL", &cols[c], &cols[k + c], &cols[2 * k + c],
                              &cols[3 * k + c]))
            goto done;
    for (Py_ssize_t c = 0; c < k; c++)
        if (cols[c] < 0 || cols[k + c] < 0 || cols[c] > buf.len || cols[k + c] > buf.len - cols[c]) {
            PyErr_SetString(PyExc_ValueError, "blosc_rows: a chunk lies outside buf");
            goto done;
        }
    long long ns = 0, nb = 0;
    blosc_rows(buf.buf, k, cols, cols + k, cols + 2 * k, cols + 3 * k, streams, cap_s, &ns, blocks, cap_b, &nb,
               fault);
    PyObject *faults = PyTuple_New(k);
    for (Py_ssize_t c = 0; faults != NULL && c < k; c++)
        PyTuple_SET_ITEM(faults, c, PyLong_FromLongLong(fault[c]));
    if (faults != NULL)
        result = Py_BuildValue("(Ny#y#)", faults, (const char *)streams, (Py_ssize_t)(ns * BLOSC_STREAM_COLS * 8),
                               (const char *)blocks, (Py_ssize_t)(nb * BLOSC_BLOCK_COLS * 8));
done:
    PyMem_Free(cols);
    PyMem_Free(streams);
    PyMem_Free(blocks);
    Py_XDECREF(chunks);
    PyBuffer_Release(&buf);
    return result;
}

/* entry_read(path, ident, max_payload) -> (why, payload_len): entries.c's entry_read of one disk-cache entry
 * (read whole into a buffer of its own, without the GIL), its ENTRY_* why (0: sound) */
static PyObject *entry_read_py(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *path, *ident;
    Py_ssize_t ident_len;
    unsigned long long max_payload;
    if (!PyArg_ParseTuple(args, "yy#K", &path, &ident, &ident_len, &max_payload))
        return NULL;
    if (max_payload > ((size_t)1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "max_payload: at most 1 GiB here");
        return NULL;
    }
    size_t room = ENTRY_HEADER_BYTES + (size_t)ident_len + (size_t)max_payload;
    char *buf = PyMem_RawMalloc(room ? room : 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    entry_reading r = {.ident = ident, .ident_len = (size_t)ident_len, .max_payload = (size_t)max_payload,
                       .expect_payload = -1, .head = (unsigned char *)buf,
                       .payload = buf + ENTRY_HEADER_BYTES + ident_len, .whole = 1};
    int why;
    Py_BEGIN_ALLOW_THREADS
    why = entry_read(path, &r);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buf);
    return Py_BuildValue("(in)", why, (Py_ssize_t)r.payload_len);
}

static PyObject *entry_checks_skipped_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong(entry_checks_skipped());
}

static PyMethodDef testing_methods[] = {
    {"entry_read", entry_read_py, METH_VARARGS,
     "entry_read(path, ident, max_payload) -> (why, payload_len): one disk-cache entry read and judged as the "
     "engine reads one (csrc/entries.c); why 0: sound."},
    {"entry_checks_skipped", entry_checks_skipped_py, METH_NOARGS,
     "entry_checks_skipped() -> int: this module's entry reads that skipped the payload's crc32c."},
    {"blosc_rows", blosc_rows_py, METH_VARARGS,
     "blosc_rows(buf, chunks, cap_streams, cap_blocks) -> (faults, streams, blocks): blosc_streams' writing "
     "pass alone into rooms of the given rows; chunks: (in, in_len, nbytes, out) per chunk."},
    {"decode_files", decode_files, METH_VARARGS,
     "decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> "
     "[(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]: read, decompress and place chunk "
     "files without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef testing_module = {PyModuleDef_HEAD_INIT, "_testing", NULL, -1, testing_methods, NULL, NULL,
                                            NULL, NULL};

PyMODINIT_FUNC PyInit__testing(void) {
    crc32c_init(); /* STOKER_NO_CRC_FOLD and STOKER_CHECK_EVERY_READ read here, as stoker._native does */
    PyObject *m = PyModule_Create(&testing_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, codec_methods) < 0 || add_interface(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
