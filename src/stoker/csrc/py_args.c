/* The glue's argument helpers: sequences walked as tuples, buffers of int64, error types. */
#include "py_glue.h"

#include <stdint.h>
#include <string.h>

/* A new reference to a tuple of ``obj``'s items (``obj`` itself when it is a tuple; any iterable), or NULL
 * with TypeError naming ``what`` when it is not iterable. Arguments are walked as tuples: converting an
 * item can run Python code (a path's __fspath__, an index's __index__, on 3.12 a buffer's __buffer__)
 * that could change a list under the walk. */
PyObject *tuple_of(PyObject *obj, const char *what) {
    PyObject *it = PyObject_GetIter(obj); /* any iterable, as PySequence_Fast took */
    if (it == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence", what);
        return NULL;
    }
    Py_DECREF(it);
    return PySequence_Tuple(obj);
}

/* The exception for a C function's error message: MemoryError for "out of memory", else ValueError. */
PyObject *error_type(const char *error) {
    return error && strcmp(error, "out of memory") == 0 ? PyExc_MemoryError : PyExc_ValueError;
}

/* The type character of a buffer of single items in native byte order ('f', 'd', 'q', ...), or 0 when it has no
 * format, another byte order or more than one character (a struct, a repeat count). */
char native_type(const Py_buffer *b) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const char order = '<';
#else
    const char order = '>';
#endif
    const char *f = b->format;
    if (f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || *f == order)
        f++;
    return f[0] != '\0' && f[1] == '\0' ? f[0] : 0; /* f[1] read only past a character that is not the end */
}

/* Whether b holds 8-byte integers in native byte order (numpy's int64 and uint64, array('q')): the functions
 * below read their buffers as such, so bytes or an int32 array of the right length are refused, not read. */
int native_words(const Py_buffer *b) {
    const char t = native_type(b);
    return b->itemsize == 8 && (t == 'q' || t == 'Q' || t == 'l' || t == 'L');
}

/* Take aligned buffers of 8-byte integers of objs[0..n): 0, or -1 with an exception set and none held. */
int int64_buffers(PyObject *const *objs, Py_buffer *b, int n, const char *who) {
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

/* b's strides into out (b->ndim of them): its own, or a C-contiguous array's of its shape where it gives none.
 * An exporter may give strides NULL whatever the flags asked (ctypes arrays do: C order, as PEP 3118 reads a
 * NULL), so a consumer that reads strides takes them from here, never from b->strides. A product past
 * Py_ssize_t (only an array of no element can claim one: a zero extent) leaves 0 (no element is read). */
void buffer_strides(const Py_buffer *b, Py_ssize_t *out) {
    Py_ssize_t s = b->itemsize;
    for (int a = b->ndim - 1; a >= 0; a--) {
        out[a] = b->strides != NULL ? b->strides[a] : s;
        if (b->shape != NULL && __builtin_mul_overflow(s, b->shape[a], &s))
            s = 0;
    }
}

/* Whether no two of b's elements share a byte (strides: buffer_strides'): its axes of more than one element,
 * by increasing stride magnitude, each step at least the span of the axes before it (the item's size, first).
 * Then b's logical size (b.len) is memory it holds. A zero stride (np.broadcast_to) or overlapping rows
 * (sliding_window_view) fail: there a few bytes can claim any size, and a copy or walk by the logical size
 * would allocate, write or visit it all. Magnitudes are unsigned (a stride of -2**63 has one); a span past
 * PY_SSIZE_T_MAX bytes fails (no buffer holds it: such strides point outside any). Some layouts that
 * interleave without sharing (strides (3, 2) over bytes, shape (2, 3)) fail too: stoker makes none. */
int buffer_apart(const Py_buffer *b, const Py_ssize_t *strides) {
    int64_t len[STRIDES_MAX_AXES];
    uint64_t step[STRIDES_MAX_AXES];
    if (b->ndim > STRIDES_MAX_AXES)
        return 0;
    for (int i = 0; i < b->ndim; i++) {
        len[i] = b->shape[i];
        step[i] = strides[i] < 0 ? 0ULL - (uint64_t)strides[i] : (uint64_t)strides[i];
    }
    return strides_apart(b->ndim, len, step, (uint64_t)b->itemsize);
}

/* obj's 8-byte integers, a 1-d buffer (cols 0) or an n x cols one, with any strides (numpy's column views of
 * a table) whose elements do not share memory (buffer_apart), copied in C order into *out (free it); *n its rows.
 * 0, or -1 with an exception set. */
int int64_matrix(PyObject *obj, long long cols, long long *n, int64_t **out, const char *what) {
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
    Py_ssize_t strides[2] = {0, 0}; /* (ndim 1 or 2, checked above) */
    buffer_strides(&b, strides);
    if (!buffer_apart(&b, strides)) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "%s repeats values in memory (its elements share memory: a zero stride, as "
                     "np.broadcast_to makes, or rows that overlap): pass np.ascontiguousarray(...) of it", what);
        return -1;
    }
    long long rows = b.shape[0], w = cols ? cols : 1;
    /* rows * w * 8 == b.len, bytes the buffer holds (buffer_apart): bounded by the caller's memory */
    int64_t *o = malloc(sizeof(int64_t) * (size_t)(rows * w + 1));
    if (o == NULL) {
        PyBuffer_Release(&b);
        PyErr_NoMemory();
        return -1;
    }
    for (long long r = 0; r < rows; r++)
        for (long long c = 0; c < w; c++)
            memcpy(&o[r * w + c], (const char *)b.buf + r * strides[0] + (cols ? c * strides[1] : 0), 8);
    PyBuffer_Release(&b);
    *n = rows;
    *out = o;
    return 0;
}
