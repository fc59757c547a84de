/* The codecs' functions, handed in by address (stoker/engine/cpu/native.py finds them in numcodecs and zlib). */
#include "py_glue.h"

#include <stdint.h>

/* set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]):
 * the functions to call, by address; 0 for a codec that is not available (its pair must be both set or
 * both 0); and the largest share of a blosc chunk decoded block by block. */
static double current_share = 0.9;

static PyObject *set_codecs(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long zd, ze, bd, bg;
    double share = current_share;
    if (!PyArg_ParseTuple(args, "KKKK|d", &zd, &ze, &bd, &bg, &share))
        return NULL;
    if (!zd != !ze || !bd != !bg) {
        PyErr_SetString(PyExc_ValueError, "each codec needs both of its function addresses, or neither");
        return NULL;
    }
    if (!(share >= 0.0 && share <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "partial_max_share must be between 0 and 1");
        return NULL;
    }
    current_share = share;
    set_codec_functions((uintptr_t)zd, (uintptr_t)ze, (uintptr_t)bd, (uintptr_t)bg, share);
    Py_RETURN_NONE;
}

/* set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue,
 * next_src_size, frame_content_size): zstd's context and buffer-less streaming
 * functions, by address; all 0 turns them off (each chunk is then one ZSTD_decompress call, decoded in full). */
static PyObject *set_zstd_streaming(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a[7];
    if (!PyArg_ParseTuple(args, "KKKKKKK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6]))
        return NULL;
    int set = 0;
    for (int i = 0; i < 7; i++)
        set += a[i] != 0;
    if (set != 0 && set != 7) {
        PyErr_SetString(PyExc_ValueError, "zstd's streaming functions must all be given, or none");
        return NULL;
    }
    uintptr_t fns[7];
    for (int i = 0; i < 7; i++)
        fns[i] = (uintptr_t)a[i];
    set_zstd_functions(fns);
    Py_RETURN_NONE;
}

/* set_lz4(LZ4_decompress_safe): the address of lz4's block decoder (0: lz4 chunks take the Python path). */
static PyObject *set_lz4(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a;
    if (!PyArg_ParseTuple(args, "K", &a))
        return NULL;
    set_lz4_function((uintptr_t)a);
    Py_RETURN_NONE;
}

/* set_zlib(inflateInit2_, inflate, inflateEnd, inflateReset) -> bool: zlib's functions, by address (all 0:
 * off); False when this build has no zlib.h, so zlib and gzip chunks take the Python path. */
static PyObject *set_zlib(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a[4];
    if (!PyArg_ParseTuple(args, "KKKK", &a[0], &a[1], &a[2], &a[3]))
        return NULL;
    int set = (a[0] != 0) + (a[1] != 0) + (a[2] != 0) + (a[3] != 0);
    if (set != 0 && set != 4) {
        PyErr_SetString(PyExc_ValueError, "zlib's functions must all be given, or none");
        return NULL;
    }
    return PyBool_FromLong(set_zlib_functions((uintptr_t)a[0], (uintptr_t)a[1], (uintptr_t)a[2], (uintptr_t)a[3]) &&
                           a[0] != 0);
}

PyMethodDef codec_methods[] = {
    {"set_codecs", set_codecs, METH_VARARGS,
     "set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]): "
     "function addresses (0: that codec is not available) and the largest share of a blosc chunk decoded "
     "block by block."},
    {"set_zstd_streaming", set_zstd_streaming, METH_VARARGS,
     "set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue, "
     "next_src_size, frame_content_size): zstd's context and buffer-less "
     "streaming functions (all 0: off)."},
    {"set_lz4", set_lz4, METH_VARARGS, "set_lz4(LZ4_decompress_safe): lz4's block decoder by address (0: off)."},
    {"set_zlib", set_zlib, METH_VARARGS,
     "set_zlib(inflateInit2_, inflate, inflateEnd, inflateReset) -> bool: zlib's functions by address (all 0: "
     "off); False where this build has no zlib support."},
    {NULL, NULL, 0, NULL},
};
