/* stoker._native: the module. Its functions and types come from the glue (py_glue.h): py_codecs.c (the codecs'
 * functions by address), py_tables.c (planning), py_engine.c (Engine, BatchJob, local_file_system); and
 * ``interface``, a dict of the constants of stoker_native.h by name (interface_names.h, written from the
 * header by .ci/interface.py), with the values this build was compiled with: stoker/engine/cpu/native.py checks
 * them against stoker/engine/interface.py (written from the same header) before it uses the extension.
 */
#include "py_glue.h"

static const struct {
    const char *name;
    long long value;
} interface_constants[] = {
#define INTERFACE_CONSTANT(name) {#name, (long long)(name)},
#include "interface_names.h"
#undef INTERFACE_CONSTANT
};

int add_interface(PyObject *m) {
    PyObject *d = PyDict_New();
    if (d == NULL)
        return -1;
    for (size_t i = 0; i < sizeof(interface_constants) / sizeof(interface_constants[0]); i++) {
        PyObject *v = PyLong_FromLongLong(interface_constants[i].value);
        if (v == NULL || PyDict_SetItemString(d, interface_constants[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, "interface", d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    crc32c_init(); /* STOKER_NO_CRC_FOLD read here, the GIL held, not on a worker thread (entries.c) */
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, codec_methods) < 0 || PyModule_AddFunctions(m, table_methods) < 0 ||
        PyModule_AddFunctions(m, engine_functions) < 0 ||
        PyModule_AddFunctions(m, staging_methods) < 0 || PyModule_AddFunctions(m, entry_methods) < 0 ||
        PyModule_AddFunctions(m, evict_methods) < 0 || PyModule_AddFunctions(m, blend_methods) < 0 ||
        add_engine_types(m) < 0 || add_interface(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
