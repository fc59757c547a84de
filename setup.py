"""Only the compiled reader lives here; everything else about the package is in pyproject.toml.

``stoker._native`` reads and decodes whole zstd chunk files without the GIL. It is optional:
where no C compiler is found the install goes on and stoker reads every chunk on its
pure-Python path (``stoker.native.zstd_files`` is then ``None``).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("stoker._native", sources=["src/stoker/_native.c"], optional=True)])
