"""Only the compiled reader lives here; everything else about the package is in pyproject.toml.

``stoker._native`` (``src/stoker/csrc``) reads, decodes and places chunks on threads of its own, without
the GIL. It is
optional: where no C compiler is found the install goes on and stoker reads every chunk on its
pure-Python path (``stoker.native.decode_files`` is then ``None``).
"""

import glob
import os

from setuptools import Extension, setup

#: the extension's C files, one per concern (see csrc/stoker_native.h); .ci/asan builds the same ones
SOURCES = sorted(glob.glob("src/stoker/csrc/*.c"))

# -O3: the copy-cast loops of place.c are only vectorised at -O3 by GCC
# -pthread: the engine's worker threads (pool.c) are POSIX threads
flags = [] if os.name == "nt" else ["-O3", "-pthread"]
setup(ext_modules=[Extension("stoker._native", sources=SOURCES, depends=["src/stoker/csrc/stoker_native.h"],
                             extra_compile_args=flags, extra_link_args=flags[1:], optional=True)])
