"""stoker.runtime.callers.user_stacklevel: where a warning raised inside stoker points."""

from __future__ import annotations

import threading
import warnings

import pytest

from stoker.runtime import callers, workers

pytestmark = pytest.mark.timeout(30)

# functions "in" a stoker module (compiled with its file name): a warning deep in stoker, and a thread's loop
_WARNS = "def warn_deep():\n    import warnings\n    warnings.warn('deep', RuntimeWarning, stacklevel=user_stacklevel())\n"
_LOOP = "def loop():\n    warn_deep()\n"


def _stoker_functions():
    space = {"user_stacklevel": callers.user_stacklevel}
    exec(compile(_WARNS, workers.__file__, "exec"), space)
    exec(compile(_LOOP, workers.__file__, "exec"), space)
    return space


def test_a_warning_in_a_thread_of_stokers_points_at_its_outermost_stoker_frame():
    """Regression: on a thread that runs stoker's code only, the warning pointed past it, at threading.py's
    run(), which the docstring said it did not: it points at the outermost stoker frame (the loop's call)."""
    space = _stoker_functions()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=space["loop"])
        thread.start()
        thread.join(10)
    assert [(w.filename, w.lineno) for w in caught] == [(workers.__file__, 2)]


def test_a_warning_from_a_users_call_points_at_the_user():
    space = _stoker_functions()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space["loop"]()
    assert [w.filename for w in caught] == [__file__]
