"""Only the compiled reader lives here; everything else about the package is in pyproject.toml.

``stoker._native`` reads, decodes and places zstd and blosc chunk files without the GIL. It is
optional: where no C compiler is found the install goes on and stoker reads every chunk on its
pure-Python path (``stoker.native.decode_files`` is then ``None``).
"""

import os

from setuptools import Extension, setup

# -O3: the copy-cast loops of _native.c are only vectorised at -O3 by GCC
flags = [] if os.name == "nt" else ["-O3"]
setup(ext_modules=[Extension("stoker._native", sources=["src/stoker/_native.c"], extra_compile_args=flags,
                             optional=True)])
