/* blend_mean: the weighted mean of tile predictions where they overlap (stoker/inference/weighted.py), in one
 * pass over the voxels with the GIL released.
 *
 * numpy spent, per voxel of an overlap, a product array, a sum array and a sum-of-weights array in float64 (each
 * zeroed, written and read again: ~150 bytes of memory traffic a voxel, a third of a "hann" TileWriter's own
 * CPU). Here the sums of one row live in a few scratch arrays of the row's length, and the weights are made from
 * the windows of each axis (blend.weights is their outer product), so a voxel costs the parts' values read and
 * the output written. The arithmetic is numpy's, operation for operation, so the result is the same bit for
 * bit: w = ((1 * w_1) * w_2) ... * w_d (the outer product's order), sums of w * v and of w from 0.0 in the
 * order the parts are given, their float64 quotient rounded once to the output's type; a voxel one part
 * covers is that part's value, cast as numpy's astype casts it (no w * v / w); a voxel no part covers is left
 * as it is (the caller fills it). Products are never fused into the sums (fp-contract off: numpy's ufuncs
 * round each one).
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "py_glue.h"

#include <stdint.h>
#include <string.h>

#define BLEND_MAXD 8 /* lanes + 7 spatial axes */

typedef struct {
    Py_buffer values;         /* (lanes, e_1, ..., e_d), float32 or float64, any strides */
    int f64;                  /* values are float64 (else float32) */
    Py_ssize_t off[BLEND_MAXD]; /* where it lies in the output (axis 0, the lanes: 0) */
    Py_ssize_t strides[BLEND_MAXD]; /* the values' strides (buffer_strides: a buffer may give none) */
    Py_buffer win[BLEND_MAXD];  /* the window of spatial axis a (1..d), e_a float64, contiguous */
    int held;                 /* buffers taken: values, then windows 1..held-1 */
} blend_part;

/* The float kind of a buffer's format: 1 float32, 2 float64, 0 another (native byte order only). */
static int float_kind(const Py_buffer *b) {
    const char t = native_type(b);
    return t == 'f' && b->itemsize == 4 ? 1 : t == 'd' && b->itemsize == 8 ? 2 : 0;
}

/* Whether every element of b lies on its type's alignment (its start and every stride, ``strides``: b's from
 * buffer_strides, a multiple of the item size): they are read and written in place as float and double. numpy
 * makes arrays that are not (an offset into a buffer, a field of a packed record); those are left to numpy
 * (weighted.mean_into) or refused here. */
static int aligned_items(const Py_buffer *b, const Py_ssize_t *strides) {
    if ((uintptr_t)b->buf % (uintptr_t)b->itemsize)
        return 0;
    for (int a = 0; a < b->ndim; a++)
        if (strides[a] % b->itemsize)
            return 0;
    return 1;
}

static void release_parts(blend_part *parts, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int k = 0; k < parts[i].held; k++)
            PyBuffer_Release(k == 0 ? &parts[i].values : &parts[i].win[k]);
    }
}

/* One part's row added to the row's sums (m values, step bytes apart from row): acc += w * v, ws += w,
 * cnt += 1, last = v, with w = pre * win[k] (pre: the product of the other axes' windows, in their order: the
 * outer product's). Contiguous float32 rows (the usual) get their own loop, which the compiler vectorises. */
#define ADD_ROW(LOAD)                                                                                               \
    for (Py_ssize_t k = 0; k < m; k++) {                                                                            \
        double w = pre * win[k];                                                                                    \
        double v = (double)(LOAD);                                                                                  \
        double p = w * v;                                                                                           \
        acc[k] += p;                                                                                                \
        ws[k] += w;                                                                                                 \
        last[k] = v;                                                                                                \
        cnt[k] += 1.0;                                                                                              \
    }

static void add_row(double *restrict acc, double *restrict ws, double *restrict last, double *restrict cnt,
                    const double *restrict win, double pre, const char *row, Py_ssize_t step, Py_ssize_t m,
                    int f64) {
    if (!f64 && step == (Py_ssize_t)sizeof(float)) {
        const float *restrict vf = (const float *)row;
        ADD_ROW(vf[k])
    } else if (f64) {
        ADD_ROW(*(const double *)(row + k * step))
    } else {
        ADD_ROW(*(const float *)(row + k * step))
    }
}

/* The row's voxels into the output: none, untouched; one part, its value; more, the quotient. */
#define OUT_ROW(T)                                                                                                  \
    for (Py_ssize_t k = 0; k < n; k++) {                                                                            \
        if (cnt[k] == 0.0)                                                                                          \
            continue;                                                                                               \
        *(T *)(orow + k * ostep) = (T)(cnt[k] == 1.0 ? last[k] : acc[k] / ws[k]);                                   \
    }

static void blend_rows(const Py_buffer *out, const Py_ssize_t *ostrides, int o64, blend_part *parts,
                       Py_ssize_t nparts, double *scratch) {
    const int nd = out->ndim;
    /* the rows: along the last axis (contiguous, so its loop is vectorised; rows along a longer strided axis
     * cost more than short rows: measured) */
    const int ax = nd - 1;
    const Py_ssize_t n = out->shape[ax], ostep = ostrides[ax];
    double *acc = scratch, *ws = scratch + n, *last = scratch + 2 * n, *cnt = scratch + 3 * n;
    Py_ssize_t idx[BLEND_MAXD] = {0}, rows = 1;
    for (int a = 0; a < ax; a++)
        rows *= out->shape[a];
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (r > 0) { /* the next row: idx counts over the axes before ax, in C order */
            for (int a = ax - 1; a >= 0; a--) {
                if (++idx[a] < out->shape[a])
                    break;
                idx[a] = 0;
            }
        }
        memset(scratch, 0, (size_t)n * 4 * sizeof *scratch);
        int any = 0;
        for (Py_ssize_t i = 0; i < nparts; i++) {
            const blend_part *p = &parts[i];
            const char *row = (const char *)p->values.buf + idx[0] * p->strides[0];
            double pre = 1.0;
            int inside = 1;
            for (int a = 1; a < ax; a++) {
                Py_ssize_t at = idx[a] - p->off[a];
                if (at < 0 || at >= p->values.shape[a]) {
                    inside = 0;
                    break;
                }
                pre *= ((const double *)p->win[a].buf)[at];
                row += at * p->strides[a];
            }
            if (!inside)
                continue;
            any = 1;
            const Py_ssize_t o = p->off[ax];
            add_row(acc + o, ws + o, last + o, cnt + o, p->win[ax].buf, pre, row, p->strides[ax],
                    p->values.shape[ax], p->f64);
        }
        if (!any)
            continue;
        char *orow = out->buf;
        for (int a = 0; a < ax; a++)
            orow += idx[a] * ostrides[a];
        if (o64) {
            OUT_ROW(double)
        } else {
            OUT_ROW(float)
        }
    }
}

/* blend_mean(out, parts): see the docstring below */
static PyObject *blend_mean_py(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *out_obj, *parts_obj;
    if (!PyArg_ParseTuple(args, "OO", &out_obj, &parts_obj))
        return NULL;
    Py_buffer out;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *seq = NULL;
    blend_part *parts = NULL;
    Py_ssize_t nparts = 0;
    double *scratch = NULL;
    const int kind = float_kind(&out);
    Py_ssize_t ostrides[BLEND_MAXD];
    if (out.ndim >= 2 && out.ndim <= BLEND_MAXD)
        buffer_strides(&out, ostrides);
    if (kind == 0 || out.ndim < 2 || out.ndim > BLEND_MAXD || !aligned_items(&out, ostrides)) {
        PyErr_Format(PyExc_ValueError, "blend_mean: the output must be float32 or float64 with 2 to %d axes, "
                     "its elements aligned", BLEND_MAXD);
        goto done;
    }
    if ((seq = tuple_of(parts_obj, "blend_mean's parts")) == NULL)
        goto done;
    nparts = PyTuple_GET_SIZE(seq);
    parts = PyMem_Calloc((size_t)(nparts ? nparts : 1), sizeof *parts);
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int nd = out.ndim;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i), *values, *offsets, *windows;
        blend_part *p = &parts[i];
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OOO", &values, &offsets, &windows)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "blend_mean: each part is (values, offsets, windows)");
            goto done;
        }
        if (PyObject_GetBuffer(values, &p->values, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
            goto done;
        p->held = 1;
        int vk = float_kind(&p->values);
        if (p->values.ndim == nd)
            buffer_strides(&p->values, p->strides);
        if (vk == 0 || p->values.ndim != nd || p->values.shape[0] != out.shape[0] ||
            !aligned_items(&p->values, p->strides)) {
            PyErr_SetString(PyExc_ValueError, "blend_mean: a part's values must be float32 or float64 with the "
                                              "output's axes and lanes, their elements aligned");
            goto done;
        }
        p->f64 = vk == 2;
        if (!PyTuple_Check(offsets) || !PyTuple_Check(windows) || PyTuple_GET_SIZE(offsets) != nd - 1 ||
            PyTuple_GET_SIZE(windows) != nd - 1) {
            PyErr_SetString(PyExc_ValueError, "blend_mean: a part's offsets and windows are tuples, one per "
                                              "spatial axis");
            goto done;
        }
        for (int a = 1; a < nd; a++) {
            Py_ssize_t off = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, a - 1));
            if (off == -1 && PyErr_Occurred())
                goto done;
            if (off < 0 || p->values.shape[a] > out.shape[a] - off) {
                PyErr_SetString(PyExc_ValueError, "blend_mean: a part lies outside the output");
                goto done;
            }
            p->off[a] = off;
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(windows, a - 1), &p->win[a], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) <
                0)
                goto done;
            p->held = a + 1;
            Py_ssize_t wstride[1] = {8};
            if (p->win[a].ndim == 1)
                buffer_strides(&p->win[a], wstride);
            if (float_kind(&p->win[a]) != 2 || p->win[a].ndim != 1 || p->win[a].shape[0] != p->values.shape[a] ||
                !aligned_items(&p->win[a], wstride)) {
                PyErr_SetString(PyExc_ValueError, "blend_mean: a window is float64, aligned, as long as the part's "
                                                  "axis");
                goto done;
            }
        }
    }
    /* An output of no voxel (an extent 0) has nothing to write, whatever its other extents claim: an empty
     * buffer may claim any (ctypes' (c_float * 0) * 2**31 * 2**31), and blend_rows would walk 2**62 rows of
     * nothing, or multiply extents past Py_ssize_t before meeting the 0. Else its elements must not share
     * memory (buffer_apart): a zero-stride output also claims any extents over a few bytes (its rows' scratch
     * wrapped size_t; 2**41 rows walked). Then the product of its extents is the voxels of a buffer that exists. */
    for (int a = 0; a < nd; a++)
        if (out.shape[a] == 0)
            goto done;
    if (!buffer_apart(&out, ostrides)) {
        PyErr_SetString(PyExc_ValueError, "blend_mean: the output's elements share memory (a zero stride, or axes "
                                          "that overlap): pass an array that holds each of its voxels");
        goto done;
    }
    Py_ssize_t voxels = 1;
    for (int a = 0; a < nd; a++)
        if (out.shape[a] < 0 || __builtin_mul_overflow(voxels, out.shape[a], &voxels)) {
            PyErr_SetString(PyExc_ValueError, "blend_mean: the output's extents are negative or too many voxels");
            goto done;
        }
    const Py_ssize_t n = out.shape[nd - 1]; /* a row's voxels (blend_rows) */
    if ((size_t)n > PY_SSIZE_T_MAX / (4 * sizeof *scratch)) { /* (held: n elements exist; kept for the product) */
        PyErr_NoMemory();
        goto done;
    }
    scratch = PyMem_RawMalloc((size_t)n * 4 * sizeof *scratch);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    blend_rows(&out, ostrides, kind == 2, parts, nparts, scratch);
    Py_END_ALLOW_THREADS

done:
    PyMem_RawFree(scratch);
    if (parts != NULL) {
        release_parts(parts, nparts); /* those not reached hold nothing (held 0) */
        PyMem_Free(parts);
    }
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

PyMethodDef blend_methods[] = {
    {"blend_mean", blend_mean_py, METH_VARARGS,
     "blend_mean(out, parts): the weighted mean of overlapping parts into out (float32 or float64, (lanes, "
     "*spatial), any strides), the GIL released. parts: (values, offsets, windows) in the order they are to be "
     "summed: values (lanes, *extent) float32 or float64, offsets its start in out per spatial axis, windows a "
     "float64 vector per spatial axis (the part's weights are their outer product). A voxel several parts cover "
     "gets sum(w * v) / sum(w) in float64 rounded once to out's type; one part, its value cast; none, untouched."},
    {NULL, NULL, 0, NULL},
};
