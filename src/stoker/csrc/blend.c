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
 * round each one). A row whose parts each span it whole (a planned overlap's) is summed in one fused pass
 * (fused_row_*: the same operations, without the zeroed sums, counts and last values).
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
    int rowwise;              /* float32 rows of its own, contiguous, apart from the output's memory (fused_row) */
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

/* The bytes [lo, hi) a buffer of ndim axes (strides: buffer_strides') reaches; an empty one none. */
static void buffer_span(const Py_buffer *b, const Py_ssize_t *strides, uintptr_t *lo, uintptr_t *hi) {
    uintptr_t a = (uintptr_t)b->buf, z = (uintptr_t)b->buf + (uintptr_t)b->itemsize;
    for (int k = 0; k < b->ndim; k++) {
        if (b->shape[k] == 0) {
            *lo = *hi = (uintptr_t)b->buf;
            return;
        }
        const Py_ssize_t reach = (b->shape[k] - 1) * strides[k];
        if (reach < 0)
            a -= (uintptr_t)-reach;
        else
            z += (uintptr_t)reach;
    }
    *lo = a;
    *hi = z;
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

/* A row met by two or more parts that each span it whole (float32 values, contiguous, apart from the output),
 * into a contiguous output row of n voxels: the same sums as add_row's and OUT_ROW's, with nothing zeroed,
 * counted or kept aside. acc and ws start as 0.0 + the first part's product and weight (as add_row's zeroed
 * sums do: 0.0 + -0.0 is +0.0), the other parts are added in their order, and the last one's sums are divided
 * straight into the output; two parts (a planned overlap's usual) in one loop, in registers. Most of a "hann"
 * TileWriter's overlap rows are such (each part of a planned overlap covers it whole): 1.7x the general path
 * on the benchmark's overlaps. noinline: inlined, GCC loses the pointers' restrict and leaves the loops scalar. */
#define DEFINE_FUSED(NAME, T)                                                                                       \
    __attribute__((noinline)) static void NAME(double *restrict acc, double *restrict ws, const char *const *vals,  \
                                               const double *const *wins, const double *pres, Py_ssize_t k_parts,   \
                                               Py_ssize_t n, T *restrict o) {                                       \
        const float *restrict v0 = (const float *)vals[0];                                                          \
        const double *restrict w0 = wins[0];                                                                        \
        const double p0 = pres[0];                                                                                  \
        if (k_parts == 2) {                                                                                         \
            const float *restrict v1 = (const float *)vals[1];                                                      \
            const double *restrict w1 = wins[1];                                                                    \
            const double p1 = pres[1];                                                                              \
            for (Py_ssize_t k = 0; k < n; k++) {                                                                    \
                const double wa = p0 * w0[k], wb = p1 * w1[k];                                                      \
                const double a = (0.0 + wa * (double)v0[k]) + wb * (double)v1[k];                                   \
                const double b = (0.0 + wa) + wb;                                                                   \
                o[k] = (T)(a / b);                                                                                  \
            }                                                                                                       \
            return;                                                                                                 \
        }                                                                                                           \
        for (Py_ssize_t k = 0; k < n; k++) {                                                                        \
            const double w = p0 * w0[k];                                                                            \
            acc[k] = 0.0 + w * (double)v0[k];                                                                       \
            ws[k] = 0.0 + w;                                                                                        \
        }                                                                                                           \
        for (Py_ssize_t i = 1; i < k_parts - 1; i++) {                                                              \
            const float *restrict v = (const float *)vals[i];                                                       \
            const double *restrict wi = wins[i];                                                                    \
            const double pi = pres[i];                                                                              \
            for (Py_ssize_t k = 0; k < n; k++) {                                                                    \
                const double w = pi * wi[k];                                                                        \
                acc[k] += w * (double)v[k];                                                                         \
                ws[k] += w;                                                                                         \
            }                                                                                                       \
        }                                                                                                           \
        const float *restrict vl = (const float *)vals[k_parts - 1];                                                \
        const double *restrict wl = wins[k_parts - 1];                                                              \
        const double pl = pres[k_parts - 1];                                                                        \
        for (Py_ssize_t k = 0; k < n; k++) {                                                                        \
            const double w = pl * wl[k];                                                                            \
            o[k] = (T)((acc[k] + w * (double)vl[k]) / (ws[k] + w));                                                 \
        }                                                                                                           \
    }

DEFINE_FUSED(fused_row_f32, float)
DEFINE_FUSED(fused_row_f64, double)

static void blend_rows(const Py_buffer *out, const Py_ssize_t *ostrides, int o64, blend_part *parts,
                       Py_ssize_t nparts, double *scratch, const char **rows_at, const double **wins, double *pres) {
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
        /* the parts this row meets (in their order: rows_at[i] its row, pres[i] the product of the other axes'
         * windows; NULL: not met), and whether each of them is a contiguous float32 row spanning it whole */
        Py_ssize_t met = 0;
        int whole = 1;
        for (Py_ssize_t i = 0; i < nparts; i++) {
            const blend_part *p = &parts[i];
            const char *row = (const char *)p->values.buf + idx[0] * p->strides[0];
            double pre = 1.0;
            rows_at[i] = NULL;
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
            rows_at[i] = row;
            pres[i] = pre;
            met++;
            whole &= p->rowwise && p->off[ax] == 0 && p->values.shape[ax] == n;
        }
        if (met == 0)
            continue;
        char *orow = out->buf;
        for (int a = 0; a < ax; a++)
            orow += idx[a] * ostrides[a];
        if (whole && met >= 2 && ostep == (o64 ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float))) {
            /* the parts met, packed to the front of rows_at and pres, in their order (k_parts <= i) */
            Py_ssize_t k_parts = 0;
            for (Py_ssize_t i = 0; i < nparts; i++) {
                if (rows_at[i] == NULL)
                    continue;
                rows_at[k_parts] = rows_at[i];
                pres[k_parts] = pres[i];
                wins[k_parts++] = parts[i].win[ax].buf;
            }
            if (o64)
                fused_row_f64(acc, ws, rows_at, wins, pres, k_parts, n, (double *)orow);
            else
                fused_row_f32(acc, ws, rows_at, wins, pres, k_parts, n, (float *)orow);
            continue;
        }
        memset(scratch, 0, (size_t)n * 4 * sizeof *scratch);
        for (Py_ssize_t i = 0; i < nparts; i++) {
            if (rows_at[i] == NULL)
                continue;
            const blend_part *p = &parts[i];
            const Py_ssize_t o = p->off[ax];
            add_row(acc + o, ws + o, last + o, cnt + o, p->win[ax].buf, pres[i], rows_at[i], p->strides[ax],
                    p->values.shape[ax], p->f64);
        }
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
    double *scratch = NULL, *pres = NULL;
    const char **rows_at = NULL;
    const double **wins = NULL;
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
    uintptr_t olo, ohi; /* the output's bytes: a part that shares them is not read by fused_row */
    buffer_span(&out, ostrides, &olo, &ohi);
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
        uintptr_t plo, phi;
        buffer_span(&p->values, p->strides, &plo, &phi);
        /* read in place while the output row is written: only where its memory is apart from the output's */
        p->rowwise = !p->f64 && p->strides[nd - 1] == (Py_ssize_t)sizeof(float) && (phi <= olo || ohi <= plo);
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
    /* each part's row, window and product of the other axes' windows for the row at hand (blend_rows) */
    if ((size_t)nparts > PY_SSIZE_T_MAX / (4 * sizeof(double))) {
        PyErr_NoMemory();
        goto done;
    }
    scratch = PyMem_RawMalloc((size_t)n * 4 * sizeof *scratch);
    rows_at = PyMem_RawMalloc((size_t)(nparts ? nparts : 1) * sizeof *rows_at);
    wins = PyMem_RawMalloc((size_t)(nparts ? nparts : 1) * sizeof *wins);
    pres = PyMem_RawMalloc((size_t)(nparts ? nparts : 1) * sizeof *pres);
    if (scratch == NULL || rows_at == NULL || wins == NULL || pres == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    blend_rows(&out, ostrides, kind == 2, parts, nparts, scratch, rows_at, wins, pres);
    Py_END_ALLOW_THREADS

done:
    PyMem_RawFree(scratch);
    PyMem_RawFree((void *)rows_at);
    PyMem_RawFree((void *)wins);
    PyMem_RawFree(pres);
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
