/* write_entries: the disk cache's writer (storage/diskcache.py) hands a batch of entries to entries.c, which
 * makes their files with the GIL released once for the whole batch. Released per system call (as Python's os
 * functions do, a dozen a file), a writer on a busy pipeline waited for the GIL after each and fell behind
 * the fetches, and what its queue could not hold was never cached. */
#include "py_glue.h"

#include <stdint.h>
#include <string.h>

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

/* ---- entry_hits: a batch's chunks found in a decoder's table of entries (engine/cpu/entry_table.py) ---- */

/* the odd constants that combine a key's columns into its hash (entry_table.py's _COMBINE: the two must agree,
 * tests/engine/test_entry_table.py compares their look-ups) and the shift that picks its set (_SET_SHIFT) */
static const uint64_t ET_COMBINE[ET_KEY_COLS] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                                                 0xD6E8FEB86659FD93ULL};
#define ET_SET_SHIFT 32

/* a 1-d buffer of int64 with any strides (a plan's column: a view of a wider table) whose items share no memory;
 * 0, or -1 with an exception set and nothing held */
static int int64_column(PyObject *obj, Py_buffer *b, Py_ssize_t *step, const char *what) {
    if (PyObject_GetBuffer(obj, b, PyBUF_STRIDED_RO | PyBUF_FORMAT) != 0)
        return -1;
    if (!native_words(b) || b->ndim != 1) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "entry_hits: %s must be a 1-d buffer of int64", what);
        return -1;
    }
    buffer_strides(b, step);
    if (!buffer_apart(b, step)) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "entry_hits: %s repeats values in memory", what);
        return -1;
    }
    return 0;
}

static int64_t column_at(const Py_buffer *b, Py_ssize_t step, long long i) {
    int64_t v;
    memcpy(&v, (const char *)b->buf + i * step, 8);
    return v;
}

/* entry_hits(hash, rec, entries, files, chunk_file, chunk_offset, chunk_length, ids, disk, store_of, stamps, settled,
 * now) -> (rows, blob) or None: see the method's doc below. Holding the GIL throughout (microseconds; the caller
 * holds the table's lock too): the slots checked are the slots whose entries are handed on. */
static PyObject *entry_hits_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *entries, *ids_obj, *objs[3], *cols_obj[3], *small_obj[4];
    double now;
    if (!PyArg_ParseTuple(args, "OOO!OOOOOOOOOd", &objs[0], &objs[1], &PyList_Type, &entries, &objs[2],
                          &cols_obj[0], &cols_obj[1], &cols_obj[2], &ids_obj, &small_obj[0], &small_obj[1],
                          &small_obj[2], &small_obj[3], &now))
        return NULL;
    /* hash, rec, files: C-contiguous aligned int64 (the table's arrays, the plan's files) */
    Py_buffer big[3] = {{0}}, cols[3] = {{0}}, ids = {0}, small[4] = {{0}};
    Py_ssize_t col_step[3] = {0, 0, 0}, ids_step = 0, small_step[4] = {0, 0, 0, 0};
    int held_cols = 0, held_small = 0, have_big = 0, have_ids = 0;
    PyObject **found = NULL, *result = NULL;
    long long n_found = 0;
    int64_t *slots = NULL;
    if (int64_buffers(objs, big, 3, "entry_hits"))
        return NULL;
    have_big = 1;
    for (; held_cols < 3; held_cols++)
        if (int64_column(cols_obj[held_cols], &cols[held_cols], &col_step[held_cols], "a plan column"))
            goto done;
    for (; held_small < 4; held_small++) {
        if (held_small == 0) { /* disk: an array's row each, C-contiguous */
            if (PyObject_GetBuffer(small_obj[0], &small[0], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
                goto done;
            if (!native_words(&small[0]) || small[0].ndim != 2 || (uintptr_t)small[0].buf % _Alignof(int64_t)) {
                PyBuffer_Release(&small[0]);
                PyErr_SetString(PyExc_ValueError, "entry_hits: disk must be rows of aligned int64");
                goto done;
            }
        } else if (int64_column(small_obj[held_small], &small[held_small], &small_step[held_small],
                                held_small == 1 ? "store_of" : held_small == 2 ? "stamps" : "settled"))
            goto done;
    }
    if (ids_obj != Py_None) {
        if (int64_column(ids_obj, &ids, &ids_step, "ids"))
            goto done;
        have_ids = 1;
    }
    const uint64_t *hash = big[0].buf;
    const int64_t *rec = big[1].buf, *files = big[2].buf, *disk = small[0].buf;
    long long n_slots = big[0].len / 8, n_plan = cols[0].shape[0];
    long long rank = big[2].ndim == 2 ? big[2].shape[1] - F_COORDS : 0, n_files = rank > 0 ? big[2].shape[0] : 0;
    long long n_sources = small[0].shape[0], n_stores = small[2].shape[0];
    if (n_slots < ET_WAYS || (n_slots & (n_slots - 1)) || big[1].len != n_slots * N_ET_COLS * 8 ||
        PyList_GET_SIZE(entries) != n_slots) {
        PyErr_SetString(PyExc_ValueError, "entry_hits: the table's hashes, rows and entries disagree on its slots "
                                          "(a power of two, at least ET_WAYS)");
        goto done;
    }
    if (rank < 1 || rank > MAX_NDIM || small[0].shape[1] != DISK_GRID + 2 * rank || cols[1].shape[0] != n_plan ||
        cols[2].shape[0] != n_plan || small[1].shape[0] != n_sources || small[3].shape[0] != n_stores) {
        PyErr_SetString(PyExc_ValueError, "entry_hits: the plan's files, columns and the arrays' disk rows disagree "
                                          "on the rank or the counts");
        goto done;
    }
    for (long long s = 0; s < n_sources; s++) {
        int64_t st = column_at(&small[1], small_step[1], s);
        if (st < 0 || st >= n_stores) {
            PyErr_SetString(PyExc_ValueError, "entry_hits: an array's store number is past the stores");
            goto done;
        }
    }
    long long n = have_ids ? ids.shape[0] : n_plan;
    found = PyMem_Calloc((size_t)n + 1, sizeof *found);
    slots = PyMem_Calloc((size_t)n + 1, sizeof *slots);
    if (found == NULL || slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t set_mask = (uint64_t)(n_slots / ET_WAYS - 1);
    long long total = 0;
    int all_hit = 1;
    for (long long k = 0; k < n && all_hit; k++) {
        long long i = have_ids ? column_at(&ids, ids_step, k) : k;
        if (i < 0 || i >= n_plan) {
            PyErr_SetString(PyExc_ValueError, "entry_hits: a chunk number is past the plan's chunks");
            goto done;
        }
        int64_t f = column_at(&cols[0], col_step[0], i);
        if (f < 0) { /* not stored in a file: not the table's */
            all_hit = 0;
            break;
        }
        if (f >= n_files) {
            PyErr_SetString(PyExc_ValueError, "entry_hits: a chunk's file is past the plan's files");
            goto done;
        }
        const int64_t *file = files + f * (F_COORDS + rank);
        int64_t s = file[F_SOURCE];
        if (s < 0 || s >= n_sources) {
            PyErr_SetString(PyExc_ValueError, "entry_hits: a file's array is past the arrays' disk rows");
            goto done;
        }
        const int64_t *drow = disk + s * (DISK_GRID + 2 * rank), *coords = file + F_COORDS;
        int inside = 1;
        uint64_t number = 0; /* its file's number in the grid (C order), wrapping as numpy's product does */
        for (long long j = 0; j < rank; j++) {
            /* unsigned: a coordinate below 0 is past every grid's end, as _entry_keys compares */
            inside &= (uint64_t)coords[j] < (uint64_t)drow[DISK_GRID + j];
            number += (uint64_t)coords[j] * (uint64_t)drow[DISK_GRID + rank + j];
        }
        int64_t key[ET_KEY_COLS] = {inside ? drow[DISK_UID] : 0, (int64_t)number, column_at(&cols[1], col_step[1], i),
                                    column_at(&cols[2], col_step[2], i)};
        if (!drow[DISK_ROOM] || key[ET_UID] == 0) { /* not read from entries, or none of it kept */
            all_hit = 0;
            break;
        }
        uint64_t h = 0;
        for (int c = 0; c < ET_KEY_COLS; c++)
            h += (uint64_t)key[c] * ET_COMBINE[c];
        /* the first slot of its set whose hash is the key's (none: the set's first, whose key then differs) */
        long long base = (long long)((h >> ET_SET_SHIFT) & set_mask) * ET_WAYS, slot = base;
        for (long long w = 0; w < ET_WAYS; w++)
            if (hash[base + w] == h) {
                slot = base + w;
                break;
            }
        const int64_t *row = rec + slot * N_ET_COLS;
        int64_t store = column_at(&small[1], small_step[1], s);
        double until;
        memcpy(&until, &row[ET_UNTIL], sizeof until);
        int ok = memcmp(row, key, sizeof key) == 0 && row[ET_STAMP] == column_at(&small[2], small_step[2], store) &&
                 until > now && row[ET_TICKET] <= column_at(&small[3], small_step[3], store);
        PyObject *entry = PyList_GET_ITEM(entries, slot);
        int64_t plen = row[ET_PATH_LEN], ilen = row[ET_IDENT_LEN];
        /* an entry the engine's tables cannot hold (a deep folder, a long ident), or one not as the row says:
         * the caller's numpy path decides (it fetches those that do not fit) */
        if (!ok || !PyBytes_CheckExact(entry) || plen < 0 || ilen < 0 || plen >= PATH_CAP || ilen > ENTRY_IDENT_CAP ||
            PyBytes_GET_SIZE(entry) != plen + ilen) {
            all_hit = 0;
            break;
        }
        Py_INCREF(entry); /* held: nothing below can take it from under the copy */
        found[n_found++] = entry;
        slots[k] = slot;
        total += plen + ilen;
    }
    if (!all_hit) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    PyObject *rows_obj = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * N_ENTRY_COLS * 8));
    PyObject *blob_obj = rows_obj == NULL ? NULL : PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (blob_obj == NULL) {
        Py_XDECREF(rows_obj);
        goto done;
    }
    int64_t *out = (int64_t *)PyBytes_AS_STRING(rows_obj);
    char *at = PyBytes_AS_STRING(blob_obj);
    long long start = 0;
    for (long long k = 0; k < n; k++) {
        const int64_t *row = rec + slots[k] * N_ET_COLS;
        int64_t plen = row[ET_PATH_LEN], ilen = row[ET_IDENT_LEN]; /* as checked: the table is ours under the lock */
        memcpy(at + start, PyBytes_AS_STRING(found[k]), (size_t)(plen + ilen));
        int64_t cells[N_ENTRY_COLS] = {0};
        cells[E_PATH_START] = start;
        cells[E_PATH_LEN] = plen;
        cells[E_IDENT_START] = start + plen;
        cells[E_IDENT_LEN] = ilen;
        memcpy(out + k * N_ENTRY_COLS, cells, sizeof cells);
        start += plen + ilen;
    }
    result = Py_BuildValue("(NN)", rows_obj, blob_obj);
done:
    for (long long k = 0; k < n_found; k++)
        Py_DECREF(found[k]);
    PyMem_Free(found);
    PyMem_Free(slots);
    if (have_ids)
        PyBuffer_Release(&ids);
    while (held_small-- > 0)
        PyBuffer_Release(&small[held_small]);
    while (held_cols-- > 0)
        PyBuffer_Release(&cols[held_cols]);
    if (have_big)
        for (int i = 0; i < 3; i++)
            PyBuffer_Release(&big[i]);
    return result;
}

PyMethodDef entry_methods[] = {
    {"entry_hits", entry_hits_py, METH_VARARGS,
     "entry_hits(hash, rec, entries, files, chunk_file, chunk_offset, chunk_length, ids, disk, store_of, stamps, "
     "settled, now) -> (rows, blob) or None: the entries of a plan's chunks ids (None: all) in a decoder's table of "
     "disk-cache entries (engine/cpu/entry_table.py: its hashes, N_ET_COLS rows and entries list), as the engine's "
     "entries rows (int64 bytes, N_ENTRY_COLS a chunk) and blob; None where any chunk is not a hit that may be "
     "read now (the same key; its store's stamp, stamps[store_of[array]]; until past now; its ticket at most "
     "settled[...]) or does not fit the engine's tables. disk: an array's DISK_* row each (rank from files)."},
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
