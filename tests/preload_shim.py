"""C libraries the tests put before libc (``LD_PRELOAD``) in a child process, to stage what a file system does
rarely and no Python patch can reach in the compiled code (a read held, a call interrupted, a file that
vanishes between two calls): :func:`build` compiles one from its C snippets, once per source per session;
:func:`run` runs a script in a child with it preloaded.

A shim starts from :data:`PRELUDE` (the usual headers and ``REAL(name)``, libc's ``name`` looked up once);
one that acts on ``open`` and ``open64`` adds :data:`OPENS` and defines ``opened(real, path, flags, mode)``,
which both call. Example::

    lib = preload_shim.build(tmp_path_factory, preload_shim.OPENS, r'''
    static long count;
    long opens(void) { return count; }
    static int opened(open_fn real, const char *path, int flags, mode_t mode) {
        count++;
        return real(path, flags, mode);
    }''')
    out = preload_shim.run(lib, "import ctypes; open('/dev/null'); print(ctypes.CDLL(None).opens())")
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: the headers each shim wants and ``REAL(name)``: declares ``real``, the next definition of ``name`` (libc's)
PRELUDE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>
#define REAL(name) static __typeof__(&name) real; if (!real) real = (__typeof__(&name))dlsym(RTLD_NEXT, #name)
"""

#: ``open`` and ``open64`` (Python's os.open, and the compiled engine's) both handed to the shim's ``opened``,
#: with the real one of the name called and the mode read only where O_CREAT says one was passed
OPENS = r"""
typedef int (*open_fn)(const char *, int, ...);
static int opened(open_fn real, const char *path, int flags, mode_t mode);
int open(const char *path, int flags, ...) {
    REAL(open);
    va_list ap; va_start(ap, flags); mode_t mode = (flags & O_CREAT) ? va_arg(ap, mode_t) : 0; va_end(ap);
    return opened(real, path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    REAL(open64);
    va_list ap; va_start(ap, flags); mode_t mode = (flags & O_CREAT) ? va_arg(ap, mode_t) : 0; va_end(ap);
    return opened(real, path, flags, mode);
}
"""

#: the exit status of a child whose script found the shim's functions missing (not preloaded): the test skips
NOT_PRELOADED = 77

_built: dict[str, Path] = {}


def build(tmp_path_factory: pytest.TempPathFactory, *snippets: str, pthread: bool = False) -> Path:
    """The shared library of :data:`PRELUDE` and ``snippets``, compiled with ``$CC`` (or gcc) the first time a
    session asks for this source; the test is skipped where there is no C compiler."""
    source = PRELUDE + "".join(snippets)
    key = hashlib.sha256(f"{source}{pthread}".encode()).hexdigest()[:16]
    if key not in _built:
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler for the library the test preloads")
        folder = tmp_path_factory.mktemp(f"preload_{key}")
        (folder / "shim.c").write_text(source)
        lib = folder / "shim.so"
        made = subprocess.run([cc, "-shared", "-fPIC", "-O1", str(folder / "shim.c"), "-o", str(lib), "-ldl",
                               *(["-pthread"] if pthread else [])], capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        _built[key] = lib
    return _built[key]


def env(lib: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child with ``lib`` preloaded after any library already preloaded (a
    sanitizer's runtime must stay first), this process's ``sys.path`` and ``extra``."""
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(lib)]))
    return {**os.environ, "LD_PRELOAD": preload, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def run(lib: Path, script: str, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    """``python -c script args`` in a child with ``lib`` preloaded (see :func:`env`), its output captured as
    text; the test is skipped where the child exits :data:`NOT_PRELOADED`."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                         env=env(lib, **extra))
    if out.returncode == NOT_PRELOADED:
        pytest.skip(f"the library could not be preloaded: {out.stderr[-300:]}")
    return out
