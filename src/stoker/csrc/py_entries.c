/* write_entries: the disk cache's writer (storage/diskcache.py) hands a batch of entries to entries.c, which
 * makes their files with the GIL released once for the whole batch. Released per system call (as Python's os
 * functions do, a dozen a file), a writer on a busy pipeline waited for the GIL after each and fell behind
 * the fetches, and what its queue could not hold was never cached. */
#include "py_glue.h"

/* write_entries(items, tag, seed) -> (results, allocated, grown): see the method's doc below */
static PyObject *write_entries_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *seq;
    const char *tag;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OsK", &seq, &tag, &seed))
        return NULL;
    if (strlen(tag) > 64 || strchr(tag, '/') != NULL) {
        PyErr_SetString(PyExc_ValueError, "write_entries: tag is a temporary name's part: at most 64 bytes, no '/'");
        return NULL;
    }
    /* a tuple of our own, not PySequence_Fast (which hands a list back as it is): the paths and idents are
     * borrowed from its items while the GIL is released, and another thread may clear or change a list then */
    if (!PySequence_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "write_entries takes a sequence of (path, ident, payload or None)");
        return NULL;
    }
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    entry_write *e = PyMem_Calloc((size_t)(n ? n : 1), sizeof *e);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof *views);
    PyObject *out = NULL;
    Py_ssize_t held = 0; /* views taken, to release */
    if (e == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++, held++) {
        PyObject *item = PyTuple_GET_ITEM(items, i), *payload;
        Py_ssize_t path_len, ident_len;
        char *path, *ident;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(item, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(item, 1))) {
            PyErr_Format(PyExc_ValueError, "write_entries: item %zd is not (path bytes, ident bytes, payload)", i);
            goto done;
        }
        if (PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 0), &path, &path_len) < 0 ||
            (Py_ssize_t)strlen(path) != path_len) {
            PyErr_Format(PyExc_ValueError, "write_entries: item %zd's path holds a NUL byte", i);
            goto done;
        }
        PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 1), &ident, &ident_len);
        payload = PyTuple_GET_ITEM(item, 2);
        e[i].path = path; /* items holds the tuples, they their bytes, until the end */
        e[i].ident = ident;
        e[i].ident_len = (size_t)ident_len;
        if (payload != Py_None) {
            if (PyObject_GetBuffer(payload, &views[i], PyBUF_SIMPLE) < 0)
                goto done;
            e[i].payload = views[i].buf != NULL ? views[i].buf : (const void *)""; /* empty: still an entry */
            e[i].payload_len = (size_t)views[i].len;
        }
    }
    long long grown = 0;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = write_entries(e, (size_t)n, tag, (uint64_t)seed, &grown);
    Py_END_ALLOW_THREADS
    (void)bad; /* each item's result says it */
    PyObject *results = PyList_New(n), *allocated = PyList_New(n);
    if (results == NULL || allocated == NULL) {
        Py_XDECREF(results);
        Py_XDECREF(allocated);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(results, i, PyLong_FromLong(e[i].result));
        PyList_SET_ITEM(allocated, i, PyLong_FromLongLong(e[i].allocated));
    }
    out = Py_BuildValue("(NNL)", results, allocated, grown);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(e);
    Py_DECREF(items);
    return out;
}

PyMethodDef entry_methods[] = {
    {"write_entries", write_entries_py, METH_VARARGS,
     "write_entries(items, tag, seed) -> (results, allocated, grown): make disk-cache entry files, the GIL "
     "released once for all. items: (path, ident, payload) each, path <root>/<subfolder>/<name> (bytes), ident "
     "bytes, payload a contiguous buffer (None: a marker, an empty file). Each is written to a temporary sibling "
     "'.<name>.tmp-<tag>-<8 hex>' (hex drawn from seed), created exclusively and never through a link, and "
     "renamed onto its name; missing subfolders are made. The caller holds the folder's lock. Stops at the first "
     "failure. results: 1 written, 0 already there, -errno failed (the rest 0, not tried); allocated: each "
     "file's disk; grown: what the disk gave the batch (files, subfolders, the root)."},
    {NULL, NULL, 0, NULL},
};
