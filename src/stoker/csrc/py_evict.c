/* evict_entries: the disk cache's eviction scan (storage/diskcache.py) done by evict.c with the GIL released once
 * for the whole scan; in Python every one of its system calls (two a file) gave the GIL up and waited to get it
 * back, which beside a thread busy in Python made a scan of 5,000 entries take 0.46 s, the folder locked. */
#include "py_glue.h"

#include "evict.h"

/* a total as a Python int (past 2^63 where sparse files claim that much: see evict_total) */
static PyObject *total_of(evict_total total) {
    if (total >= LLONG_MIN && total <= LLONG_MAX)
        return PyLong_FromLongLong((long long)total);
#if defined(__SIZEOF_INT128__)
    PyObject *high = PyLong_FromLongLong((long long)(total >> 64)), *shift = PyLong_FromLong(64), *low = NULL;
    PyObject *up = high && shift ? PyNumber_Lshift(high, shift) : NULL, *out = NULL;
    if (up != NULL && (low = PyLong_FromUnsignedLongLong((unsigned long long)total)) != NULL)
        out = PyNumber_Add(up, low);
    Py_XDECREF(high);
    Py_XDECREF(shift);
    Py_XDECREF(up);
    Py_XDECREF(low);
    return out;
#else
    return NULL; /* not reached: a long long total fits */
#endif
}

/* evict_entries(root, bound, target, incoming, block) -> (total, evicted, temp): see below */
static PyObject *evict_entries_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *root_obj;
    long long bound, target, incoming, block;
    if (!PyArg_ParseTuple(args, "O&LLLL", PyUnicode_FSConverter, &root_obj, &bound, &target, &incoming, &block))
        return NULL;
    const char *root = PyBytes_AS_STRING(root_obj); /* no NUL inside: PyUnicode_FSConverter refuses one */
    evict_result r;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = evict_entries(root, bound, target, incoming, block, &r);
    Py_END_ALLOW_THREADS
    Py_DECREF(root_obj);
    if (bad != 0) {
        errno = -bad;
        return bad == -ENOMEM ? PyErr_NoMemory() : PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *temp = PyList_New((Py_ssize_t)r.n_temp);
    for (size_t at = 0, i = 0; temp != NULL && at < r.temp_len; i++) {
        PyObject *name = PyBytes_FromString(r.temp + at);
        if (name == NULL) {
            Py_CLEAR(temp);
            break;
        }
        PyList_SET_ITEM(temp, (Py_ssize_t)i, name);
        at += strlen(r.temp + at) + 1;
    }
    free(r.temp);
    PyObject *total = temp == NULL ? NULL : total_of(r.total);
    if (total == NULL) {
        Py_XDECREF(temp);
        return NULL;
    }
    return Py_BuildValue("(NLN)", total, r.evicted, temp);
}

PyMethodDef evict_methods[] = {
    {"evict_entries", evict_entries_py, METH_VARARGS,
     "evict_entries(root, bound, target, incoming, block) -> (total, evicted, temp): the disk "
     "cache's eviction scan, the GIL released once for all. Lists the subfolders of root and measures every file "
     "in them (allocated blocks; .index at least block); where total + incoming > bound, unlinks the entries "
     "(32 lowercase hex names) least recently used first (mtime) until total <= target, and removes the "
     "subfolders that leaves empty. temp: the names (bytes) of the subfolders holding a file named like a "
     "temporary one (counted as any file: the caller removes the dead writers' ones). total: the folder's disk "
     "after. The caller holds the folder's lock."},
    {NULL, NULL, 0, NULL},
};
