/* The Python glue's shared parts (py_*.c, module.c, testing.c). Every call parses and checks its arguments
 * holding the GIL, then releases it for all reading, decoding and placing (a few microseconds of planning
 * excepted: see plan_grid_py).
 */
#ifndef STOKER_PY_GLUE_H
#define STOKER_PY_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "stoker_native.h"

/* ---- py_args.c: arguments ---- */
PyObject *tuple_of(PyObject *obj, const char *what);
PyObject *error_type(const char *error);
char native_type(const Py_buffer *b);
int native_words(const Py_buffer *b);
void buffer_strides(const Py_buffer *b, Py_ssize_t *out);
int buffer_apart(const Py_buffer *b, const Py_ssize_t *strides);
int int64_buffers(PyObject *const *objs, Py_buffer *b, int n, const char *who);
int int64_matrix(PyObject *obj, long long cols, long long *n, int64_t **out, const char *what);

/* ---- the functions of each part, for the modules (NULL-terminated tables) ---- */
extern PyMethodDef codec_methods[];  /* py_codecs.c: set_codecs, set_zstd_streaming, set_lz4, set_zlib */
extern PyMethodDef table_methods[];  /* py_tables.c: plan_grid, plan_crops, shard_positions, gather_entries,
                                      * chunk_rows, copy_rows */
extern PyMethodDef engine_functions[]; /* py_engine.c: local_file_system, read_files */
extern PyMethodDef staging_methods[]; /* py_staging.c: stage_read, blosc_streams (the GPU decode's reads) */
extern PyMethodDef entry_methods[];   /* py_entries.c: write_entries (the disk cache's writer) */
extern PyMethodDef evict_methods[];   /* py_evict.c: evict_entries (the disk cache's eviction scan) */
extern PyMethodDef blend_methods[];   /* blend.c: blend_mean (a TileWriter's weighted mean of overlaps) */

/* py_engine.c: Engine (and its BatchJob type) into module m; 0, or -1 with an exception set */
int add_engine_types(PyObject *m);
/* module.c: the header's constants into module m as ``interface`` (name -> value); 0, or -1 */
int add_interface(PyObject *m);

#endif
