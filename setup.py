"""Only the compiled reader lives here; everything else about the package is in pyproject.toml.

``stoker._native`` (``src/stoker/csrc``) reads, decodes and places chunks on threads of its own, without
the GIL. It is optional: where no C compiler is found the install goes on and stoker reads every chunk on
its pure-Python path (``stoker.engine.cpu.native.Engine`` is then ``None``).

``stoker._testing`` is the same sources plus ``csrc/testing.c`` (``decode_files``: the readers and decoders
on the calling thread, for the tests and fuzzing). It is built only in place (``setup.py build_ext
--inplace``, or the editable install ``make venv`` makes), or with ``STOKER_TESTING=1``: a wheel or an
install never holds it.
"""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: the extension's C files, one per concern (see csrc/stoker_native.h); .ci/asan builds the same ones
CSRC = "src/stoker/csrc"
SOURCES = sorted(glob.glob(f"{CSRC}/*.c"))
TESTING = f"{CSRC}/testing.c"  # stoker._testing's own glue: never part of stoker._native
HEADERS = sorted(glob.glob(f"{CSRC}/*.h"))


class BuildExt(build_ext):
    """build_ext that builds stoker._testing only for a checkout's tests: in place or editable (or when
    STOKER_TESTING=1 asks for it), never into a wheel."""

    def run(self):
        asked = os.environ.get("STOKER_TESTING", "").strip().lower() in ("1", "true", "yes", "on")
        if not (asked or self.inplace or getattr(self, "editable_mode", False)):
            self.extensions = [e for e in self.extensions if e.name != "stoker._testing"]
        super().run()


# -O3: the copy-cast loops of place.c are only vectorised at -O3 by GCC
# -pthread: the engine's worker threads (pool.c) are POSIX threads
# -fvisibility=hidden: only PyInit_* (PyMODINIT_FUNC marks it default) is exported; the C files' shared
# functions stay inside their module (no clash with another library's names, calls not made through the PLT)
# -ffp-contract=off: no fused multiply-adds, so blend.c's sums round as numpy's do, bit for bit (its pragmas are
# ignored by clang under -ffp-contract=fast, and GCC contracts by default where the target has FMA, as aarch64)
flags = [] if os.name == "nt" else ["-O3", "-pthread", "-fvisibility=hidden", "-ffp-contract=off"]
setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[Extension(name, sources=sources, depends=HEADERS, extra_compile_args=flags,
                           extra_link_args=flags[1:2], optional=True)
                 for name, sources in (("stoker._native", [s for s in SOURCES if s != TESTING]),
                                       ("stoker._testing", SOURCES))],
)
