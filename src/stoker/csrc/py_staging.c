/* staging.c as Python functions: stage_read (a wave's reads into a staging buffer, the GIL released once for
 * them all) and blosc_streams (a batch of blosc1 frames parsed, the GIL released). */
#include "py_glue.h"
#include "staging.h"

#include <stdlib.h>
#include <string.h>

/* an int64 buffer of whole ``cols``-value rows (C-contiguous, aligned); *rows its rows. 0, or -1 with an exception */
static int int64_rows(PyObject *obj, Py_buffer *b, long long cols, long long *rows, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) != 0)
        return -1;
    if (!native_words(b) || (uintptr_t)b->buf % _Alignof(int64_t) || (b->len / 8) % cols != 0) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous rows of %lld int64", what, cols);
        return -1;
    }
    *rows = (long long)(b->len / 8 / cols);
    return 0;
}

/* a C-contiguous buffer ``obj`` and two int64 row tables ``a`` and ``b`` (``b`` writable when asked), all taken,
 * or none and -1 with an exception */
static int buffer_and_rows(PyObject *obj, Py_buffer *buf, PyObject *a_obj, Py_buffer *a, long long a_cols,
                           long long *a_rows, const char *a_what, PyObject *b_obj, Py_buffer *b, long long b_cols,
                           long long *b_rows, int b_writable, const char *b_what) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    if (int64_rows(a_obj, a, a_cols, a_rows, 0, a_what) < 0) {
        PyBuffer_Release(buf);
        return -1;
    }
    if (int64_rows(b_obj, b, b_cols, b_rows, b_writable, b_what) < 0) {
        PyBuffer_Release(a);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

/* chunk_paths(blob, prefixes, names, ndim) -> bytes: each file's path (chunk_path), NUL-terminated, back to back */
static PyObject *chunk_paths_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *blob_obj, *prefixes_obj, *names_obj;
    int ndim;
    if (!PyArg_ParseTuple(args, "OOOi", &blob_obj, &prefixes_obj, &names_obj, &ndim))
        return NULL;
    if (ndim < 0 || ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "chunk_paths: ndim out of range");
        return NULL;
    }
    Py_buffer blob, prefixes, names;
    long long n_sources, n_files;
    if (buffer_and_rows(blob_obj, &blob, prefixes_obj, &prefixes, 3, &n_sources, "prefixes", names_obj, &names,
                        1 + ndim, &n_files, 0, "names") < 0)
        return NULL;
    PyObject *result = NULL;
    char *out = NULL;
    const int64_t *pre = prefixes.buf, *rows = names.buf;
    long long total = 0, end;
    for (long long s = 0; s < n_sources; s++) { /* each prefix inside the blob, each separator one byte */
        const int64_t *r = pre + s * 3;
        if (r[0] < 0 || r[1] < 0 || __builtin_add_overflow(r[0], r[1], &end) || end > (long long)blob.len ||
            (r[2] != '/' && r[2] != '.')) {
            PyErr_SetString(PyExc_ValueError, "chunk_paths: a prefix lies outside the blob, or a separator is not '/' or '.'");
            goto done;
        }
        if (r[1] > 0 && memchr((const char *)blob.buf + r[0], 0, (size_t)r[1]) != NULL) { /* as the engine refuses */
            PyErr_SetString(PyExc_ValueError, "chunk_paths: a prefix holds a NUL byte");
            goto done;
        }
    }
    for (long long f = 0; f < n_files; f++) { /* each file's source in range, its coordinates not negative */
        const int64_t *r = rows + f * (1 + ndim);
        int bad = r[0] < 0 || r[0] >= n_sources;
        for (int k = 0; k < ndim && !bad; k++)
            bad = r[1 + k] < 0;
        if (bad || __builtin_add_overflow(total, pre[r[0] * 3 + 1] + 21LL * ndim + 1, &total)) {
            PyErr_SetString(PyExc_ValueError, "chunk_paths: a file names no source, or a negative coordinate");
            goto done;
        }
    }
    out = malloc((size_t)(total ? total : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t at = 0;
    for (long long f = 0; f < n_files; f++) {
        const int64_t *r = rows + f * (1 + ndim), *pr = pre + r[0] * 3;
        at += chunk_path(out + at, (const char *)blob.buf + pr[0], (size_t)pr[1], (char)pr[2], r + 1, ndim) + 1;
    }
    result = PyBytes_FromStringAndSize(out, (Py_ssize_t)at);
done:
    free(out);
    PyBuffer_Release(&names);
    PyBuffer_Release(&prefixes);
    PyBuffer_Release(&blob);
    return result;
}

/* ``paths`` as n C strings: a sequence of str (each through the file system's encoding, held in ``names``) or
 * bytes of n NUL-terminated paths back to back (chunk_paths'; ``names`` then holds that object). 0, or -1 with an
 * exception; the caller frees *cpaths and releases *names' entries. */
static int path_list(PyObject *paths_obj, Py_ssize_t n, const char ***cpaths, PyObject ***names) {
    *cpaths = calloc((size_t)n + 1, sizeof(char *));
    *names = calloc((size_t)n + 1, sizeof(PyObject *));
    if (*cpaths == NULL || *names == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyBytes_Check(paths_obj)) {
        const char *p = PyBytes_AS_STRING(paths_obj), *stop = p + PyBytes_GET_SIZE(paths_obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            const char *nul = memchr(p, 0, (size_t)(stop - p));
            if (nul == NULL) {
                PyErr_SetString(PyExc_ValueError, "stage_read: fewer NUL-terminated paths than files rows");
                return -1;
            }
            (*cpaths)[i] = p;
            p = nul + 1;
        }
        if (p != stop) {
            PyErr_SetString(PyExc_ValueError, "stage_read: more NUL-terminated paths than files rows");
            return -1;
        }
        Py_INCREF(paths_obj);
        (*names)[0] = paths_obj;
        return 0;
    }
    PyObject *paths = tuple_of(paths_obj, "paths");
    if (paths == NULL)
        return -1;
    int rc = 0;
    if (PyTuple_GET_SIZE(paths) != n) {
        PyErr_SetString(PyExc_ValueError, "stage_read: one files row per path, one out row per read");
        rc = -1;
    }
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(paths, i), &(*names)[i]))
            rc = -1;
        else
            (*cpaths)[i] = PyBytes_AS_STRING((*names)[i]);
    }
    Py_DECREF(paths);
    return rc;
}

/* ---- persistent readers: a stage_pool in a capsule ---- */

#define POOL_CAPSULE "stoker.stage_pool"

static void pool_capsule_free(PyObject *capsule) {
    stage_pool *q = PyCapsule_GetPointer(capsule, POOL_CAPSULE);
    if (q != NULL) /* its helpers told to end (not waited for: they hold their own references) */
        stage_pool_release(q);
}

/* the pool in a capsule, or NULL with an exception (a ValueError when it is another capsule) */
static stage_pool *pool_of(PyObject *obj) { return PyCapsule_GetPointer(obj, POOL_CAPSULE); }

/* stage_pool(threads) -> capsule */
static PyObject *stage_pool_py(PyObject *Py_UNUSED(self), PyObject *args) {
    int threads;
    if (!PyArg_ParseTuple(args, "i", &threads))
        return NULL;
    stage_pool *q = stage_pool_new(threads);
    if (q == NULL)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(q, POOL_CAPSULE, pool_capsule_free);
    if (capsule == NULL)
        stage_pool_release(q);
    return capsule;
}

/* stage_pool_close(pool, timeout_s) -> bool: every helper ended within the timeout */
static PyObject *stage_pool_close_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Od", &obj, &timeout_s))
        return NULL;
    stage_pool *q = pool_of(obj);
    if (q == NULL)
        return NULL;
    int all;
    Py_BEGIN_ALLOW_THREADS
    all = stage_pool_close(q, timeout_s);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(all);
}

/* stage_pool_info(pool) -> (wanted, started, alive, closing) */
static PyObject *stage_pool_info_py(PyObject *Py_UNUSED(self), PyObject *obj) {
    stage_pool *q = pool_of(obj);
    if (q == NULL)
        return NULL;
    long long out[4];
    Py_BEGIN_ALLOW_THREADS
    stage_pool_info(q, out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LLLL)", out[0], out[1], out[2], out[3]);
}

/* ---- a round's cancel flag: an int in a capsule ---- */

#define CANCEL_CAPSULE "stoker.stage_cancel"

static void cancel_capsule_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, CANCEL_CAPSULE)); }

/* stage_cancel_flag() -> capsule: a cancel flag, not set */
static PyObject *stage_cancel_flag_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    int *flag = calloc(1, sizeof(int));
    if (flag == NULL)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(flag, CANCEL_CAPSULE, cancel_capsule_free);
    if (capsule == NULL)
        free(flag);
    return capsule;
}

/* stage_cancel(flag): set it (the rounds reading with it stop at their next read; later ones read nothing) */
static PyObject *stage_cancel_py(PyObject *Py_UNUSED(self), PyObject *obj) {
    int *flag = PyCapsule_GetPointer(obj, CANCEL_CAPSULE);
    if (flag == NULL)
        return NULL;
    stage_cancel(flag);
    Py_RETURN_NONE;
}

static PyObject *stage_threads_started_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong(stage_threads_started());
}

/* stage_read(buf, paths, files, reads, out, whole_base, threads[, ident_blob, idents], cancel=None) -> (opens,
 * reads); threads: a count, or a stage_pool capsule; idents: (start, length) in ident_blob per read (its
 * entries'); cancel: a stage_cancel_flag capsule (held by the call's arguments while the round reads it) */
static PyObject *stage_read_py(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buf", "paths", "files", "reads", "out", "whole_base", "threads", "ident_blob",
                             "idents", "cancel", NULL};
    PyObject *buf_obj, *paths_obj, *files_obj, *reads_obj, *out_obj, *threads_obj, *blob_obj = NULL,
             *idents_obj = NULL, *cancel_obj = Py_None;
    long long whole_base;
    int threads = 1;
    stage_pool *pool = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOLO|OO$O", kwlist, &buf_obj, &paths_obj, &files_obj,
                                     &reads_obj, &out_obj, &whole_base, &threads_obj, &blob_obj, &idents_obj,
                                     &cancel_obj))
        return NULL;
    const int *cancel = NULL;
    if (cancel_obj != Py_None && (cancel = PyCapsule_GetPointer(cancel_obj, CANCEL_CAPSULE)) == NULL)
        return NULL;
    if ((blob_obj == NULL) != (idents_obj == NULL) || (blob_obj != NULL && !PyBytes_Check(blob_obj))) {
        PyErr_SetString(PyExc_TypeError, "stage_read: the entries' idents as bytes and an int64 table, or neither");
        return NULL;
    }
    if (PyCapsule_CheckExact(threads_obj)) {
        if ((pool = pool_of(threads_obj)) == NULL)
            return NULL;
    } else {
        long v = PyLong_AsLong(threads_obj);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        threads = v < 1 ? 1 : v > 64 ? 64 : (int)v;
    }
    PyObject *result = NULL;
    PyObject **names = NULL;
    const char **cpaths = NULL;
    Py_ssize_t n_paths = 0;
    Py_buffer buf, files, reads, out, idents;
    int have = 0, have_idents = 0; /* buffers taken so far */
    stage_plan p = {0};
    int64_t *own = NULL; /* the tables' copies (see below) */
    long long n_out, n_idents = 0;
    if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        goto done;
    have = 1;
    if (int64_rows(files_obj, &files, STAGE_FILE_COLS, &p.n_files, 0, "files") < 0)
        goto done;
    have = 2;
    if (int64_rows(reads_obj, &reads, STAGE_READ_COLS, &p.n_reads, 0, "reads") < 0)
        goto done;
    have = 3;
    if (int64_rows(out_obj, &out, STAGE_OUT_COLS, &n_out, 1, "out") < 0)
        goto done;
    have = 4;
    n_paths = (Py_ssize_t)p.n_files;
    if (path_list(paths_obj, n_paths, &cpaths, &names) < 0)
        goto done;
    if (n_out != p.n_reads) {
        PyErr_SetString(PyExc_ValueError, "stage_read: one files row per path, one out row per read");
        goto done;
    }
    if (idents_obj != NULL) {
        if (int64_rows(idents_obj, &idents, 2, &n_idents, 0, "idents") < 0)
            goto done;
        have_idents = 1;
        if (n_idents != p.n_reads) {
            PyErr_SetString(PyExc_ValueError, "stage_read: one idents row per read");
            goto done;
        }
        p.ident_blob = PyBytes_AS_STRING(blob_obj); /* (immutable, held by args for the call) */
        p.ident_blob_len = (long long)PyBytes_GET_SIZE(blob_obj);
    }
    /* The tables are the call's own copies, made with the GIL held, checked, and read while it is released;
     * ``out`` is written into a copy of its own too, handed back at the end. The caller's arrays may share memory
     * (``out`` over ``reads`` or ``idents``: the reads would read back the rows they write, a length or an ident
     * length never checked) or change meanwhile (another thread): what is read is what was checked. */
    size_t n_reads = (size_t)p.n_reads, n_files = (size_t)p.n_files;
    own = PyMem_Malloc(sizeof(int64_t) * (n_files * STAGE_FILE_COLS + n_reads * (STAGE_READ_COLS + STAGE_OUT_COLS +
                                                                                 (idents_obj != NULL ? 2 : 0)) + 1));
    if (own == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *own_files = own, *own_reads = own_files + n_files * STAGE_FILE_COLS;
    int64_t *own_out = own_reads + n_reads * STAGE_READ_COLS, *own_idents = own_out + n_reads * STAGE_OUT_COLS;
    if (n_files)
        memcpy(own_files, files.buf, sizeof(int64_t) * n_files * STAGE_FILE_COLS);
    if (n_reads)
        memcpy(own_reads, reads.buf, sizeof(int64_t) * n_reads * STAGE_READ_COLS);
    if (idents_obj != NULL) {
        if (n_reads)
            memcpy(own_idents, idents.buf, sizeof(int64_t) * n_reads * 2);
        p.idents = own_idents;
    }
    p.paths = cpaths;
    p.files = own_files;
    p.reads = own_reads;
    p.buf = buf.buf;
    p.buf_len = (long long)buf.len;
    p.whole_base = whole_base;
    p.out = own_out;
    p.cancel = cancel;
    const char *error = NULL;
    if (stage_check(&p, &error) < 0) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    stage_read_on(&p, threads, pool); /* (the capsule, held by args, outlives the call) */
    Py_END_ALLOW_THREADS
    if (n_reads)
        memcpy(out.buf, own_out, sizeof(int64_t) * n_reads * STAGE_OUT_COLS);
    result = Py_BuildValue("(LL)", p.opens, p.preads);
done:
    PyMem_Free(own);
    if (have_idents)
        PyBuffer_Release(&idents);
    if (have >= 4)
        PyBuffer_Release(&out);
    if (have >= 3)
        PyBuffer_Release(&reads);
    if (have >= 2)
        PyBuffer_Release(&files);
    if (have >= 1)
        PyBuffer_Release(&buf);
    for (Py_ssize_t i = 0; names != NULL && i <= n_paths; i++) /* (n + 1 entries: chunk_paths' bytes in [0]) */
        Py_XDECREF(names[i]);
    free(names);
    free(cpaths);
    return result;
}

/* blosc_streams(buf, chunks, fault) -> (streams bytes, blocks bytes); chunks: rows of (in, in_len, nbytes, out),
 * fault: one writable int64 per chunk */
static PyObject *blosc_streams_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *buf_obj, *chunks_obj, *fault_obj;
    if (!PyArg_ParseTuple(args, "OOO", &buf_obj, &chunks_obj, &fault_obj))
        return NULL;
    Py_buffer buf, chunks, fault;
    long long k, n_fault;
    if (buffer_and_rows(buf_obj, &buf, chunks_obj, &chunks, 4, &k, "chunks", fault_obj, &fault, 1, &n_fault, 1,
                        "fault") < 0)
        return NULL;
    PyObject *result = NULL;
    int64_t *cols = NULL, *streams = NULL, *blocks = NULL;
    long long ns = 0, nb = 0;
    const char *error = NULL;
    int rc = -1;
    if (n_fault != k) {
        PyErr_SetString(PyExc_ValueError, "blosc_streams: one fault entry per chunk");
        goto done;
    }
    cols = malloc(sizeof(int64_t) * 4 * (size_t)(k + 1));
    if (cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *rows = chunks.buf;
    for (long long c = 0; c < k; c++)
        for (int j = 0; j < 4; j++)
            cols[j * k + c] = rows[c * 4 + j];
    Py_BEGIN_ALLOW_THREADS
    rc = blosc_streams(buf.buf, (long long)buf.len, k, cols, cols + k, cols + 2 * k, cols + 3 * k, &streams, &ns,
                       &blocks, &nb, fault.buf, &error);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetString(error_type(error), error);
        goto done;
    }
    result = Py_BuildValue("(y#y#)", (const char *)streams, (Py_ssize_t)(ns * BLOSC_STREAM_COLS * 8),
                           (const char *)blocks, (Py_ssize_t)(nb * BLOSC_BLOCK_COLS * 8));
done:
    free(cols);
    free(streams);
    free(blocks);
    PyBuffer_Release(&fault);
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&buf);
    return result;
}

PyMethodDef staging_methods[] = {
    {"stage_read", (PyCFunction)(void (*)(void))stage_read_py, METH_VARARGS | METH_KEYWORDS,
     "stage_read(buf, paths, files, reads, out, whole_base, threads[, ident_blob, idents], cancel=None) -> "
     "(opens, reads): the rows of ``reads`` "
     "(file, offset or -1 for a whole file, length or the most bytes it may take, where in buf) read into the "
     "writable buffer ``buf`` on up to ``threads`` threads, the GIL released once; ``paths`` a sequence of str "
     "or chunk_paths' bytes; ``files`` one identity row per path (has_ident, dev, ino, size, mtime_ns, ctime_ns); ``out`` (status, detail, at, bytes read) per "
     "read. Whole files go end to end from whole_base. ``threads``: a count (threads of the call's own), or a "
     "stage_pool (its persistent threads). Offset -2: a disk-cache entry file, whose payload alone is placed "
     "(with the whole files), read and checked; its ident is row (start, length) of ``idents`` in the bytes "
     "``ident_blob`` (both given, or neither). ``cancel``: a stage_cancel_flag; once it is set no read starts "
     "and those not run are status ST_CANCELLED (at -1, nothing read)."},
    {"stage_cancel_flag", stage_cancel_flag_py, METH_NOARGS,
     "stage_cancel_flag() -> flag: a cancel flag for stage_read, not set."},
    {"stage_cancel", stage_cancel_py, METH_O,
     "stage_cancel(flag): set the flag; the stage_read calls reading with it stop before their next read (those "
     "under way end first), and later ones read nothing."},
    {"stage_pool", stage_pool_py, METH_VARARGS,
     "stage_pool(threads) -> pool: persistent readers for stage_read (the caller and threads - 1 helpers, "
     "started at its first round with work for them and kept until stage_pool_close or the pool's end)."},
    {"stage_pool_close", stage_pool_close_py, METH_VARARGS,
     "stage_pool_close(pool, timeout_s) -> bool: the pool's helpers stopped (those in a round after the read "
     "they hold), waited for at most timeout_s with the GIL released; True when none is left."},
    {"stage_pool_info", stage_pool_info_py, METH_O,
     "stage_pool_info(pool) -> (wanted, started, alive, closing): the pool's helper threads."},
    {"stage_threads_started", stage_threads_started_py, METH_NOARGS,
     "stage_threads_started() -> int: reader threads stage_read started in this process, pooled or not."},
    {"chunk_paths", chunk_paths_py, METH_VARARGS,
     "chunk_paths(blob, prefixes, names, ndim) -> bytes: the path of each file row of ``names`` (source, then "
     "``ndim`` grid coordinates), NUL-terminated, back to back: its source's prefix (row (start, length, "
     "separator) of ``prefixes``: bytes of ``blob``), then its coordinates joined by the separator, as the "
     "engine builds them. stage_read takes them as its ``paths``."},
    {"blosc_streams", blosc_streams_py, METH_VARARGS,
     "blosc_streams(buf, chunks, fault) -> (streams, blocks): the blosc1 frames at rows (in, in_len, nbytes, "
     "out) of ``chunks`` parsed, the GIL released: their streams (src, csize, dst, dsize, codec, chunk) and "
     "blocks to unshuffle (dst, size, typesize, shuffle) as int64 bytes; ``fault`` each chunk's first fault "
     "(0: none), which leaves it out."},
    {NULL, NULL, 0, NULL},
};
