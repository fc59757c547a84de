"""Where a warning points: the first frame outside stoker, the user's call, however deep inside it is raised.

``warnings.warn(..., stacklevel=2)`` points at the function that called the one warning, which for a warning
raised several calls down (a dataset's constructor scanning its records) is library code: the user is shown
a line of stoker, and a filter on their own module misses it.

>>> warnings.warn("...", RuntimeWarning, stacklevel=user_stacklevel())
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` of the caller point at the nearest frame outside the
    stoker package (its own frame is level 1); on a thread of stoker's own (no frame outside it but the
    :mod:`threading` module's, which runs the thread's target), its outermost stoker frame."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the function that warns
    if frame is None:  # an interpreter without frames: its caller, as stacklevel=2 says
        return 2
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    if level > 1 and _threading_only(frame):  # a thread of stoker's: only threading's frames run its target
        return level - 1
    return level


def _threading_only(frame: Any) -> bool:
    """Whether ``frame`` and every frame outside it are the :mod:`threading` module's (a thread's bootstrap)."""
    while frame is not None:
        if frame.f_code.co_filename != threading.__file__:
            return False
        frame = frame.f_back
    return True
