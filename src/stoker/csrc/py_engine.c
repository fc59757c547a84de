/* The engine (pool.c) as Python types: Engine, whose threads make whole batches from plan tables, and BatchJob,
 * one batch on it; local_file_system, whether the engine keeps shard files open there; and read_files, whole
 * files in one call (the disk cache's hits). */
#include "py_glue.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>

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

/* an int64 table: a C-contiguous buffer of a whole number of ``width``-value rows; *rows its row count. Typed as
 * 8-byte integers (numpy's int64, array('q')) or untyped bytes (format 'B': bytes, bytearray, what chunk_rows and
 * copy_rows return): a float64 or int32 array of the right length was read as int64, and refused, if at all, for
 * values it never held. The format is a few characters compared, nothing per value: the per-batch cost stays. */
static int table_buffer(PyObject *obj, Py_buffer *view, long long width, long long *rows, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
        return -1;
    if (!native_words(view) && !(view->itemsize == 1 && native_type(view) == 'B')) {
        PyErr_Format(PyExc_ValueError, "%s must be int64 (numpy int64, array('q')) or bytes of int64 rows, not "
                                       "items of format '%s'", name, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len % (Py_ssize_t)(sizeof(int64_t) * width)) {
        PyErr_Format(PyExc_ValueError, "%s must hold rows of %lld int64 values", name, width);
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->len / (Py_ssize_t)(sizeof(int64_t) * width);
    return 0;
}

/* A writable buffer's view replaced by a view of a copy (bytes) of it: the threads read a job's buffers without
 * the GIL until it is done, and a caller that changed a writable one meanwhile had its chunk decoded from bytes
 * that changed under the decode (c-blosc reads a frame's sizes again after decode_blosc checked them: a size
 * grown between the two was read past the buffer's end). A read-only one (bytes, a read-only view) is read in
 * place, and so is every one where the caller says ``in_place`` (stoker: its fetched values, which nothing
 * changes before the job is done; a copy of a batch's 2,000 values of 16 KiB took 50 ms under the GIL). 0, or
 * -1 with an exception set and the view released (obj NULL). */
static int writable_copy(Py_buffer *view) {
    PyObject *copy = PyBytes_FromStringAndSize(view->buf, view->len);
    PyBuffer_Release(view);
    view->obj = NULL;
    if (copy == NULL)
        return -1;
    int bad = PyObject_GetBuffer(copy, view, PyBUF_C_CONTIGUOUS); /* the view holds the copy */
    Py_DECREF(copy);
    if (bad)
        view->obj = NULL;
    return bad;
}

/* views of ``obj``'s items (a sequence of buffers or None; writable ones copied unless ``in_place``) into
 * result->bufs, their addresses and lengths into the tables; -1 with an exception set */
static int hold_buffers(BatchJobObject *result, PyObject *obj, int in_place, plan_tables *t, const char ***bases,
                        long long **lens) {
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
        if (!in_place && !result->bufs[i].readonly && writable_copy(&result->bufs[i]) != 0) {
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
    PyObject *buffers_obj = Py_None, *entries_obj = Py_None, *entry_blob_obj = Py_None;
    int kind, stream, in_place = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOipO|OOOp", &chunks_obj, &copies_obj, &sources_obj, &files_obj, &blob_obj,
                          &dst_obj, &kind, &stream, &strides_obj, &buffers_obj, &entries_obj, &entry_blob_obj,
                          &in_place))
        return NULL;
    const char **bases = NULL;
    long long *lens = NULL;
    if (self->e == NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the engine is closed");
        return NULL;
    }
    Py_buffer b[8] = {{0}};
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
    if (table_buffer(copies_obj, &b[2], COPY_COLS(ndim), &t.n_copies, "copies"))
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
    if ((entries_obj == Py_None) != (entry_blob_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "entries and entry_blob come together");
        goto done;
    }
    long long n_entries = 0;
    if (entries_obj != Py_None) { /* disk-cache entries: a row per buffer (checked against n_buffers below) */
        if (table_buffer(entries_obj, &b[6], N_ENTRY_COLS, &n_entries, "entries"))
            goto done;
        held++;
        if (PyObject_GetBuffer(entry_blob_obj, &b[7], PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        held++;
        t.entries = b[6].buf, t.entry_blob = b[7].buf, t.entry_blob_len = b[7].len;
    }
    result = PyObject_New(BatchJobObject, &BatchJobType);
    if (result == NULL)
        goto done;
    result->j = NULL, result->has_view = 0, result->bufs = NULL, result->n_bufs = 0;
    Py_INCREF(self);
    result->owner = self;
    if (buffers_obj != Py_None && hold_buffers(result, buffers_obj, in_place, &t, &bases, &lens)) {
        Py_CLEAR(result);
        goto done;
    }
    if (t.entries != NULL && n_entries != t.n_buffers) {
        PyErr_SetString(PyExc_ValueError, "entries must hold a row per buffer");
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

static PyObject *engine_reuse_py(EngineObject *self, PyObject *args) {
    long long max_bytes, generation;
    if (!PyArg_ParseTuple(args, "LL", &max_bytes, &generation))
        return NULL;
    if (max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "reuse(max_bytes, generation): max_bytes must be >= 0");
        return NULL;
    }
    if (self->e != NULL) {
        Py_BEGIN_ALLOW_THREADS /* may free entries, and waits for the engine's lock */
        engine_reuse(self->e, max_bytes, generation);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *engine_reuse_info_py(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    long long v[8] = {0};
    if (self->e != NULL)
        engine_reuse_info(self->e, v);
    return Py_BuildValue("{sLsLsLsLsLsLsLsL}", "max_bytes", v[0], "held", v[1], "peak", v[2], "entries", v[3],
                         "hits", v[4], "inserted", v[5], "evicted", v[6], "generation", v[7]);
}

static PyObject *engine_worker_clocks_py(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    long long v[6] = {0};
    if (self->e == NULL)
        return PyBytes_FromStringAndSize(NULL, 0);
    engine_info(self->e, v);
    int rows = (int)v[0];
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rows * N_WORKER_COLS * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    /* memory reads only (no lock): the GIL stays held */
    int n = engine_worker_clocks(self->e, (int64_t *)PyBytes_AS_STRING(out), rows);
    if (n < rows)
        _PyBytes_Resize(&out, (Py_ssize_t)n * N_WORKER_COLS * (Py_ssize_t)sizeof(int64_t));
    return out;
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

/* crc32c(data, value=0) -> int: the crc32c of data continuing value, as the crc32c package's (entries.c) */
static PyObject *crc32c_py(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &value))
        return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c_of(value, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* crc32c_path() -> str: the way crc32c goes in this process (a debug hook for the tests) */
static PyObject *crc32c_path_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyUnicode_FromString(crc32c_path());
}

/* entry_checks_skipped() -> int: entry reads that skipped the payload's crc (a test hook, see entries.c) */
static PyObject *entry_checks_skipped_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong(entry_checks_skipped());
}

/* read_files(paths, max_bytes[, idents]) -> list: a read-only memoryview of each regular file's whole bytes (None:
 * missing, not a regular file, a link, larger than max_bytes or than the memory one allocation gets beside the
 * others of its group, or a read error), read as entries.c's entry_pread
 * reads (blocking once on EAGAIN). With idents (bytes, one a path): each file judged as the entry of its ident
 * (entry_judge: header, ident, crc32c), a view of a sound one's payload, False for one that is not (a file there,
 * unsound: the caller removes it), and only a sound one touched (entry_touch: the disk cache's LRU clock, at most
 * once a minute): a corrupt or collided entry judged after its touch had its mtime refreshed, a use it was not.
 * Without idents nothing is touched. Per READ_GROUP files the GIL is released twice, not per system call (open
 * and fstat; then read, judge, touch and close), and their bytes share one allocation: forty separate 100 KB
 * ones cost a page fault per page each time (the allocator returns such memory at once), one of 4 MB is reused.
 * A view keeps its group's bytes alive. */
#define READ_GROUP 64

static PyObject *read_files_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *seq, *idents_obj = Py_None;
    long long max_bytes;
    if (!PyArg_ParseTuple(args, "OL|O", &seq, &max_bytes, &idents_obj))
        return NULL;
    /* tuples of our own (not PySequence_Fast, which hands a list back as it is): the GIL is released between
     * groups, and another thread may shorten a list meanwhile; the idents' bytes are read without it */
    if (!PySequence_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "read_files takes a sequence of paths");
        return NULL;
    }
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *idents = idents_obj == Py_None ? NULL : PySequence_Tuple(idents_obj);
    if (idents_obj != Py_None && idents == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    if (idents != NULL) {
        int fit = PyTuple_GET_SIZE(idents) == n;
        for (Py_ssize_t i = 0; fit && i < n; i++)
            fit = PyBytes_Check(PyTuple_GET_ITEM(idents, i));
        if (!fit) {
            PyErr_SetString(PyExc_ValueError, "read_files: idents are bytes, one a path");
            Py_DECREF(idents);
            Py_DECREF(items);
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_XDECREF(idents);
        Py_DECREF(items);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
    PyObject *names[READ_GROUP];
    int fds[READ_GROUP];
    long long sizes[READ_GROUP], starts[READ_GROUP], skip[READ_GROUP]; /* skip: the payload's offset, judged */
    struct stat sts[READ_GROUP];
    for (Py_ssize_t base = 0; base < n; base += READ_GROUP) {
        int k = (int)(n - base < READ_GROUP ? n - base : READ_GROUP);
        for (int i = 0; i < k; i++) {
            if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(items, base + i), &names[i])) {
                for (int j = 0; j < i; j++)
                    Py_DECREF(names[j]);
                goto fail;
            }
        }
        long long total = 0;
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < k; i++) {
            /* O_NONBLOCK: a FIFO planted at an entry's name must not hang the open (it is no regular file) */
            fds[i] = open(PyBytes_AS_STRING(names[i]), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
            struct stat *st = &sts[i];
            /* each size is at most max_bytes, which a caller may set as high as it likes: one that would take the
             * group's sum past what one allocation can hold (it overflowed a long long: sparse files claim any size)
             * is left unread, None, as one larger than max_bytes is, never a wrapped total */
            if (fds[i] >= 0 && (fstat(fds[i], st) != 0 || !S_ISREG(st->st_mode) || st->st_size > max_bytes ||
                                (long long)st->st_size > (long long)PY_SSIZE_T_MAX - total)) {
                close(fds[i]);
                fds[i] = -1;
            }
            sizes[i] = fds[i] >= 0 ? (long long)st->st_size : 0;
            starts[i] = total;
            total += sizes[i];
        }
        Py_END_ALLOW_THREADS
        for (int i = 0; i < k; i++)
            Py_DECREF(names[i]);
        /* the bytes are this call's alone until it returns: filled without the GIL */
        PyObject *arena = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        /* no memory for them all (sparse files claim any size up to max_bytes): the largest left unread, None, as
         * one larger than max_bytes is, until the rest fit (none left: an empty allocation) */
        while (arena == NULL && total > 0 &&
               (PyErr_ExceptionMatches(PyExc_MemoryError) || PyErr_ExceptionMatches(PyExc_OverflowError))) {
            PyErr_Clear();
            int largest = -1;
            for (int i = 0; i < k; i++)
                if (fds[i] >= 0 && (largest < 0 || sizes[i] > sizes[largest]))
                    largest = i;
            close(fds[largest]);
            fds[largest] = -1;
            sizes[largest] = 0;
            total = 0;
            for (int i = 0; i < k; i++) {
                starts[i] = total;
                total += sizes[i];
            }
            arena = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        }
        char *p = arena != NULL ? PyBytes_AS_STRING(arena) : NULL;
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < k; i++) {
            skip[i] = 0;
            if (fds[i] < 0)
                continue;
            /* as entries.c reads, judges and touches entries: made blocking once on EAGAIN (O_NONBLOCK honoured);
             * touched, at most once a minute, only once judged sound */
            int blocking = 0;
            long long got = 0;
            if (p == NULL || entry_pread(fds[i], p + starts[i], (size_t)sizes[i], 0, &blocking, &got) != 0) {
                sizes[i] = -1; /* shorter than its size said, or unreadable: none */
            } else if (idents != NULL) {
                PyObject *id = PyTuple_GET_ITEM(idents, base + i); /* bytes, immutable: read without the GIL */
                size_t id_len = (size_t)PyBytes_GET_SIZE(id);
                if (entry_judge((const unsigned char *)p + starts[i], (size_t)sizes[i], PyBytes_AS_STRING(id),
                                id_len) == 0) {
                    entry_touch(fds[i], &sts[i]);
                    skip[i] = (long long)(ENTRY_HEADER_BYTES + id_len);
                } else {
                    skip[i] = -1; /* there, not sound: False, untouched */
                }
            }
            close(fds[i]);
        }
        Py_END_ALLOW_THREADS
        if (arena == NULL)
            goto fail;
        PyObject *whole = PyMemoryView_FromObject(arena);
        Py_DECREF(arena); /* the views hold it */
        if (whole == NULL)
            goto fail;
        for (int i = 0; i < k; i++) {
            if (fds[i] < 0 || sizes[i] < 0)
                continue;
            if (skip[i] < 0) {
                PyObject *old = PyList_GET_ITEM(out, base + i);
                PyList_SET_ITEM(out, base + i, Py_NewRef(Py_False));
                Py_DECREF(old);
                continue;
            }
            PyObject *lo = PyLong_FromLongLong(starts[i] + skip[i]), *hi = PyLong_FromLongLong(starts[i] + sizes[i]);
            PyObject *slice = lo != NULL && hi != NULL ? PySlice_New(lo, hi, NULL) : NULL;
            Py_XDECREF(lo);
            Py_XDECREF(hi);
            PyObject *view = slice != NULL ? PyObject_GetItem(whole, slice) : NULL;
            Py_XDECREF(slice);
            if (view == NULL) {
                Py_DECREF(whole);
                goto fail;
            }
            PyObject *old = PyList_GET_ITEM(out, base + i);
            PyList_SET_ITEM(out, base + i, view);
            Py_DECREF(old);
        }
        Py_DECREF(whole);
    }
    Py_XDECREF(idents);
    Py_DECREF(items);
    return out;
fail:
    Py_XDECREF(idents);
    Py_DECREF(items);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef engine_methods[] = {
    {"submit", (PyCFunction)engine_submit_py, METH_VARARGS,
     "submit(chunks, copies, sources, files, blob, dst, kind, stream, dst_strides[, buffers[, entries, entry_blob[, "
     "in_place]]]) "
     "-> BatchJob: make a batch from its plan tables (int64; see csrc/stoker_native.h) into dst (a writable "
     "buffer), on the engine's threads. The tables, blob, dst_strides, entries and entry_blob: C-contiguous "
     "buffers (tables: int64 arrays, array('q'), or bytes-like of int64 rows), copied before they are checked. "
     "buffers: a sequence of C-contiguous buffers (or None: a missing value) that chunks with a C_BUFFER are "
     "read from, held by the BatchJob and read until it is done or cancelled: read-only ones (bytes, a "
     "read-only memoryview or array) in place, whose bytes the caller must not change meanwhile; writable ones "
     "(bytearray, a writable array) copied first, unless in_place (True: the caller promises not to change them "
     "either). entries (a row of "
     "E_* columns per buffer) and entry_blob: buffers (None) that are disk-cache entry files the threads read "
     "and check themselves (ST_ENTRY when one is not sound; an OK chunk's detail: its payload bytes). The "
     "tables are copied and checked first: ValueError when they are not a sound plan."},
    {"close", (PyCFunction)(void (*)(void))engine_close_py, METH_VARARGS | METH_KEYWORDS,
     "close(timeout=1.0) -> bool: cancel every job and stop the threads; True when all left within timeout "
     "(a thread stuck in a system call is left behind, and writes into no batch)."},
    {"info", (PyCFunction)engine_info_py, METH_NOARGS,
     "info() -> {threads, alive, budget, used, peak, closing}: threads started and alive, the scratch budget, "
     "the bytes of it reserved now, and the most allocated at once."},
    {"reuse", (PyCFunction)engine_reuse_py, METH_VARARGS,
     "reuse(max_bytes, generation): the jobs submitted from now on keep the chunks they decode from files, at most "
     "max_bytes of them (0: none, the default), least recently used first out, and are placed from those kept "
     "for the same generation; a new generation drops every chunk kept (csrc/pool.c, \"Reused\")."},
    {"reuse_info", (PyCFunction)engine_reuse_info_py, METH_NOARGS,
     "reuse_info() -> {max_bytes, held, peak, entries, hits, inserted, evicted, generation}: the chunks kept "
     "(see reuse): bytes held now and at most, entries now, chunks placed from them, kept, and evicted."},
    {"worker_clocks", (PyCFunction)engine_worker_clocks_py, METH_NOARGS,
     "worker_clocks() -> bytes: per started thread a row of N_WORKER_COLS int64 values (W_* in "
     "csrc/stoker_native.h): nanoseconds reading, decoding, placing, filling, waiting for a lock, for work, "
     "for the budget, the rest, and its wall time since it started (the first eight sum to it), then its "
     "chunks and thread id; summed since the engine started."},
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
    return Py_BuildValue("(NN{sLsLsLsLsLsLsLsLsLsLsLsLsL})", status, detail, "bytes_read", c.bytes_read,
                         "bytes_decoded", c.bytes_decoded, "chunks_decoded", c.chunks_decoded, "chunks_filled",
                         c.chunks_filled, "read_ns", c.read_ns, "decode_ns", c.decode_ns, "place_ns", c.place_ns,
                         "fill_ns", c.fill_ns, "max_threads", c.max_threads, "files_opened", c.files_opened,
                         "chunks_shared", c.chunks_shared, "chunks_reused", c.chunks_reused, "not_placed", not_placed);
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

PyMethodDef engine_functions[] = {
    {"crc32c", crc32c_py, METH_VARARGS,
     "crc32c(data, value=0) -> int: the crc32c (Castagnoli) of data continuing value, as the crc32c package's: "
     "how the engine checks disk-cache entries."},
    {"crc32c_path", crc32c_path_py, METH_NOARGS,
     "crc32c_path() -> str: the way crc32c goes in this process: 'fold' (AVX-512 VPCLMULQDQ), 'fold256' (AVX2 VPCLMULQDQ), 'sse42' (the crc32 "
     "instruction; also where STOKER_NO_CRC_FOLD=1, true or yes at import) or 'table'."},
    {"entry_checks_skipped", entry_checks_skipped_py, METH_NOARGS,
     "entry_checks_skipped() -> int: how many disk-cache entry reads of the engine skipped the payload's crc32c: "
     "the same file (device, inode, size, mtime, ctime, header crc), unchanged since this process checked it, "
     "its ctime then settled (0.1 s old; 3 s on a file system of whole seconds), stat'ed the same before and after the read, on a local file system (ext4, XFS, Btrfs, tmpfs, overlayfs, ZFS, F2FS, bcachefs); never where STOKER_CHECK_EVERY_READ=1, true or yes at import."},
    {"read_files", read_files_py, METH_VARARGS,
     "read_files(paths, max_bytes[, idents]) -> list: a read-only memoryview of each regular file's whole bytes, "
     "or None (missing, not a regular file, a symbolic link, larger than max_bytes, or unreadable). idents (bytes, "
     "one a path): each file judged as a disk-cache entry of its ident (header, ident, crc32c): a view of a sound "
     "one's payload, touched (mtime now, at most once a minute) where allowed, or False (there, not sound; not "
     "touched); without idents nothing is touched. The GIL is released twice per 64 files, not per system call; "
     "the views of 64 files share one bytes object."},
    {"local_file_system", local_file_system_py, METH_VARARGS,
     "local_file_system(path) -> bool: whether the file is on a file system the engine keeps shard files open "
     "on between inner chunks (a local one: ext4, xfs, btrfs, tmpfs, overlayfs, zfs, f2fs; apfs and hfs on "
     "macOS). OSError when it cannot be opened."},
    {NULL, NULL, 0, NULL},
};

int add_engine_types(PyObject *m) {
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&BatchJobType) < 0)
        return -1;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        return -1;
    }
    return 0;
}
