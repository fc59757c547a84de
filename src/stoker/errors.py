"""The one exception hierarchy used across stoker.

Every error stoker raises on purpose derives from :class:`StokerError`, and each
also derives from the closest built-in exception so existing ``except`` clauses
keep working (``InvalidArgument`` is a ``ValueError``, ``NotFound`` a
``FileNotFoundError``, ``PoolStarved`` a ``TimeoutError``...).

Errors carry the context that explains them as attributes (``uri``, ``key``,
``knob``...) as well as in the message, so code can react without parsing text::

    try:
        stoker.open_array("/data/missing.zarr")
    except stoker.NotFound as e:
        print(e.uri)
"""

from __future__ import annotations

from typing import Any, TypeVar


class StokerError(Exception):
    """Base class of every error stoker raises deliberately.

    Keyword arguments become attributes, e.g. ``DecodeError(msg, uri=u, key=k).key``.
    """

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = dict(context)
        for name, value in context.items():
            setattr(self, name, value)

    def __str__(self) -> str:  # OSError subclasses would otherwise format their own way
        return self.message

    def __reduce__(self):  # keep errors picklable across processes, context included
        return (_rebuild_error, (type(self), self.message, self.context))


def _rebuild_error(cls: type, message: str, context: dict) -> "StokerError":
    return cls(message, **context)


_E = TypeVar("_E", bound=BaseException)


def as_value(exc: _E) -> _E:
    """``exc`` made fit to be kept as a value (returned in place of a result): without its traceback, nor those
    of the exceptions it was raised from (``__cause__``), and cut from the one being handled when it was
    raised (``__context__``, which may be another caller's, still in flight). A traceback holds the frames
    it passed through, and a frame its caller's; the list the error is put in is one of their locals, so
    error, frames and everything they hold (a batch's buffers among them) would form a cycle that only a
    garbage collection frees.

    >>> try:
    ...     {}["k"]
    ... except KeyError as e:
    ...     got = as_value(e)
    >>> got.__traceback__ is None
    True
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e.__context__ = None
        e = e.__cause__
    return exc


class InvalidArgument(StokerError, ValueError):
    """A value passed by the caller is not acceptable (the message names it and the allowed range)."""


class OutOfBounds(InvalidArgument, IndexError):
    """A box reaches outside the array it addresses."""


class RankMismatch(InvalidArgument):
    """A box or sample has a different number of dimensions than the array or the batch."""


class BudgetExceeded(InvalidArgument):
    """The configured memory budget cannot hold what the configuration asks for."""


class OutOfMemory(StokerError, MemoryError):
    """The system refused memory stoker asked for (a batch slot, a staging or read buffer): ``knob`` names the
    budget it counts against (``host_buffer_bytes``, ``device_buffer_bytes``) and ``nbytes`` the request. The
    budget is a cap, not a reservation: lower it, or batch_size or lookahead_batches, or free memory."""


class ThreadStartError(StokerError, RuntimeError):
    """The system gave no thread (a limit on processes or threads, ``ulimit -u``, or on memory for their
    stacks): ``knob`` names the Config thread count to lower (``n_compute_threads``, ``n_io_threads``)."""


class IncompleteSource(StokerError, NotImplementedError):
    """A :class:`~stoker.SampleSource` subclass lacks a method stoker needs: ``method`` names it (``__len__``,
    ``sample``, or ``identity`` when its attributes are not plain data)."""


class NotYetSupported(StokerError, NotImplementedError):
    """An option stoker names but does not do yet: ``knob`` names it, and the message the workaround."""


class NotFound(StokerError, FileNotFoundError):
    """An array, group or store does not exist where the URI points."""


class UnsupportedFormat(StokerError):
    """The data uses a codec, data type, grid or layout stoker does not read.

    stoker never guesses: an unknown layout is an error, never silent fill values.
    """


class DtypeMismatch(StokerError, TypeError):
    """A source data type cannot be converted to the requested one, or sources disagree."""


class StorageError(StokerError, OSError):
    """The storage layer failed to deliver bytes that should exist (permissions, I/O errors)."""


class DecodeError(StokerError):
    """Stored bytes are corrupt, truncated or inconsistent with the array metadata."""


class DeviceError(StokerError, RuntimeError):
    """The GPU failed at work stoker queued on it: nvCOMP refused a decode, reported damage in chunks
    that decode on the CPU, or did not finish a decode within a minute (a hung device). The message names
    the call or the chunks; ``Config(decode_on="cpu")`` reads them without the GPU decode."""


class MetadataError(DecodeError):
    """An array's metadata document is not valid JSON or contradicts itself."""


class NonFiniteData(StokerError, ValueError):
    """Stored values are NaN or infinite where finite numbers are needed (statistics); ``sample``, ``field``
    and ``count`` say where and how many."""


class PoolStarved(StokerError, TimeoutError):
    """No buffer became free in time, usually because the consumer holds every batch."""


class ShutdownError(StokerError, RuntimeError):
    """The object was closed, or is closing, and cannot do the requested work."""


class InternalError(StokerError, RuntimeError):
    """A bug of stoker's own: an exception escaped one of its service threads (named in ``thread``), whose
    work the pipeline cannot go on without. Raised, chained to that exception, by every later ``pop`` and
    ``push`` of the pipeline; please report it. Close the pipeline (that still works) and start another."""


class ForkedPipeline(StokerError, RuntimeError):
    """A pipeline (or another object with threads of its own) was used in a process forked from the one that
    made it, where its threads do not exist: make a new one in this process. ``close()`` works there and
    frees nothing of the parent's."""


class BatchReleased(StokerError, RuntimeError):
    """A batch was exported after it was released (by ``release()``, the end of its ``with`` block, or a
    pipeline's iteration, which releases each batch when the next is asked for): its slot may hold another
    batch by now. Export it before, and ``.clone()`` what you keep."""


def pipeline_closed() -> ShutdownError:
    """The error of a batch whose work stopped because its pipeline was closed (one wording for every path).

    >>> raise pipeline_closed()
    Traceback (most recent call last):
    stoker.errors.ShutdownError: the pipeline was closed while this batch was being made
    """
    return ShutdownError("the pipeline was closed while this batch was being made")


class RankFailed(StokerError, RuntimeError):
    """A rank of a launched job raised; the others were stopped. ``rank`` and ``traceback`` say where."""


class UnusedParameters(StokerError, RuntimeError):
    """Parameters received no gradient in the first backward (DDP would fail or hang on them later)."""


class NonFiniteLoss(StokerError, FloatingPointError):
    """Training went non-finite: the loss was NaN or infinite ``count`` optimizer steps in a row (each was
    skipped), or the weights hold such values at a checkpoint (never written); ``step`` says when."""


class MissingDependency(StokerError, ImportError):
    """An optional package this feature needs is not installed; ``package`` and ``extra`` (the ``stoker[...]``
    extra that installs it) say which."""


class CheckpointError(StokerError, OSError):
    """A checkpoint cannot be written, or none of the stored ones can be read back."""


class ClaimTimeout(StokerError, TimeoutError):
    """Another process still writes a write-once artifact after the wait bound: ``path`` (the artifact),
    ``claimant`` (``host:pid`` of the writer), ``claim`` (its claim file) and ``waited_s`` say which."""


__all__ = [
    "StokerError",
    "InvalidArgument",
    "OutOfBounds",
    "RankMismatch",
    "BudgetExceeded",
    "OutOfMemory",
    "ThreadStartError",
    "IncompleteSource",
    "NotYetSupported",
    "NotFound",
    "UnsupportedFormat",
    "DtypeMismatch",
    "StorageError",
    "DecodeError",
    "MetadataError",
    "NonFiniteData",
    "PoolStarved",
    "ShutdownError",
    "ForkedPipeline",
    "InternalError",
    "DeviceError",
    "BatchReleased",
    "RankFailed",
    "UnusedParameters",
    "NonFiniteLoss",
    "MissingDependency",
    "CheckpointError",
    "ClaimTimeout",
]
