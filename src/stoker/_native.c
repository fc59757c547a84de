/* stoker._native: read and decode a group of whole zstd chunk files with the GIL released.
 *
 * Why this exists: for small chunks (about 100 KiB) the Python work around each
 * read and decode (open, read, decompress, bookkeeping) holds the GIL for a large
 * share of the chunk's time, so compute threads queue on the GIL instead of
 * decoding. Here a whole group of chunk files is opened, read and decompressed
 * in one call that holds no GIL at all.
 *
 * No codec is implemented here: the decompressor is zstd's own ZSTD_decompress,
 * the copy that numcodecs already carries (its address is handed in by
 * stoker/native.py, read off numcodecs' extension module through ctypes).
 *
 * decode_zstd_files(paths, scratch, outs, nbytes) -> list of (status, nread, detail, read_ns, decode_ns)
 *   paths    sequence of str or bytes (file system paths), one per chunk
 *   scratch  writable buffer for the encoded bytes of one file at a time
 *   outs     sequence of writable buffers of at least nbytes, one per path
 *   nbytes   the decoded size every chunk must have
 * status: 0 ok (detail: decoded bytes), 1 missing file, 2 file larger than scratch
 * (detail: its size), 3 OS error (detail: errno), 4 file shorter than its size
 * (it changed while read), 5 zstd error (detail: zstd's error code), 6 decoded to
 * a size other than nbytes (detail: the size). read_ns and decode_ns time the two steps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef size_t (*zstd_decompress_fn)(void *dst, size_t dst_capacity, const void *src, size_t src_size);
typedef unsigned (*zstd_is_error_fn)(size_t code);

static zstd_decompress_fn zstd_decompress = NULL;
static zstd_is_error_fn zstd_is_error = NULL;

enum { ST_OK = 0, ST_MISSING, ST_TOO_BIG, ST_OS_ERROR, ST_SHORT, ST_CODEC_ERROR, ST_SIZE };

typedef struct {
    const char *path;
    char *out;
    int status;
    long long nread;
    long long detail;
    long long read_ns;   /* open, stat and read */
    long long decode_ns; /* decompress */
} chunk_job;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *set_zstd(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long decompress_addr, is_error_addr;
    if (!PyArg_ParseTuple(args, "KK", &decompress_addr, &is_error_addr))
        return NULL;
    if (!decompress_addr || !is_error_addr) {
        PyErr_SetString(PyExc_ValueError, "zstd function addresses must not be null");
        return NULL;
    }
    zstd_decompress = (zstd_decompress_fn)(uintptr_t)decompress_addr;
    zstd_is_error = (zstd_is_error_fn)(uintptr_t)is_error_addr;
    Py_RETURN_NONE;
}

/* Read the whole file into scratch (job->detail: its size). */
static void read_one(chunk_job *job, char *scratch, size_t scratch_len) {
    int fd = open(job->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        job->status = (errno == ENOENT || errno == ENOTDIR) ? ST_MISSING : ST_OS_ERROR;
        job->detail = errno;
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        job->status = ST_OS_ERROR;
        job->detail = errno;
        close(fd);
        return;
    }
    size_t size = (size_t)st.st_size;
    if (size > scratch_len) {
        job->status = ST_TOO_BIG;
        job->detail = (long long)size;
        close(fd);
        return;
    }
    size_t done = 0;
    while (done < size) {
        ssize_t got = pread(fd, scratch + done, size - done, (off_t)done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            job->status = ST_OS_ERROR;
            job->detail = errno;
            job->nread = (long long)done;
            close(fd);
            return;
        }
        if (got == 0)
            break;
        done += (size_t)got;
    }
    close(fd);
    job->nread = (long long)done;
    if (done != size) {
        job->status = ST_SHORT;
        job->detail = (long long)done;
        return;
    }
    job->status = ST_OK;
    job->detail = (long long)size;
}

/* Read the whole file into scratch and decompress it into job->out; runs without the GIL. */
static void run_one(chunk_job *job, char *scratch, size_t scratch_len, size_t nbytes) {
    long long t0 = now_ns();
    read_one(job, scratch, scratch_len);
    long long t1 = now_ns();
    job->read_ns = t1 - t0;
    if (job->status != ST_OK)
        return;
    size_t size = (size_t)job->detail;
    size_t decoded = zstd_decompress(job->out, nbytes, scratch, size);
    job->decode_ns = now_ns() - t1;
    if (zstd_is_error(decoded)) {
        job->status = ST_CODEC_ERROR;
        job->detail = (long long)(0 - decoded); /* zstd error codes are negated size_t values */
        return;
    }
    job->detail = (long long)decoded;
    job->status = decoded == nbytes ? ST_OK : ST_SIZE;
}

static PyObject *decode_zstd_files(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *paths_obj, *scratch_obj, *outs_obj;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "OOOn", &paths_obj, &scratch_obj, &outs_obj, &nbytes))
        return NULL;
    if (zstd_decompress == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stoker._native: zstd is not set up (call set_zstd first)");
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        return NULL;
    }
    PyObject *paths = PySequence_Fast(paths_obj, "paths must be a sequence");
    if (paths == NULL)
        return NULL;
    PyObject *outs = PySequence_Fast(outs_obj, "outs must be a sequence");
    if (outs == NULL) {
        Py_DECREF(paths);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths);
    PyObject *result = NULL;
    Py_buffer scratch = {0};
    Py_buffer *out_views = NULL;
    PyObject **encoded_paths = NULL;
    chunk_job *jobs = NULL;
    Py_ssize_t views_held = 0, paths_held = 0;

    if (PySequence_Fast_GET_SIZE(outs) != n) {
        PyErr_SetString(PyExc_ValueError, "paths and outs must have the same length");
        goto done;
    }
    if (PyObject_GetBuffer(scratch_obj, &scratch, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        goto done;
    out_views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    encoded_paths = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(chunk_job));
    if (out_views == NULL || encoded_paths == NULL || jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(paths, i), &encoded_paths[i]))
            goto done;
        paths_held++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, i), &out_views[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        views_held++;
        if (out_views[i].len < nbytes) {
            PyErr_Format(PyExc_ValueError, "outs[%zd] holds %zd bytes, fewer than nbytes (%zd)", i,
                         out_views[i].len, nbytes);
            goto done;
        }
        jobs[i].path = PyBytes_AS_STRING(encoded_paths[i]);
        jobs[i].out = out_views[i].buf;
    }

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        run_one(&jobs[i], scratch.buf, (size_t)scratch.len, (size_t)nbytes);
    Py_END_ALLOW_THREADS

    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue("(iLLLL)", jobs[i].status, jobs[i].nread, jobs[i].detail, jobs[i].read_ns,
                                       jobs[i].decode_ns);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }

done:
    for (Py_ssize_t i = 0; i < views_held; i++)
        PyBuffer_Release(&out_views[i]);
    for (Py_ssize_t i = 0; i < paths_held; i++)
        Py_DECREF(encoded_paths[i]);
    if (scratch.obj != NULL)
        PyBuffer_Release(&scratch);
    PyMem_Free(out_views);
    PyMem_Free(encoded_paths);
    PyMem_Free(jobs);
    Py_DECREF(paths);
    Py_DECREF(outs);
    return result;
}

static PyMethodDef methods[] = {
    {"set_zstd", set_zstd, METH_VARARGS,
     "set_zstd(decompress_address, is_error_address): the ZSTD_decompress and ZSTD_isError to call."},
    {"decode_zstd_files", decode_zstd_files, METH_VARARGS,
     "decode_zstd_files(paths, scratch, outs, nbytes) -> [(status, nread, detail, read_ns, decode_ns)]: read "
     "and decompress "
     "whole zstd chunk files without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
