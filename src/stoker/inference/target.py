"""Where a TileWriter writes: its array through zarr-python, and its completion record, on a local disk or an
object store.

A local path goes to zarr-python as it is, and a ``file://`` URI as the path it names (zarr-python would open
``file://`` through fsspec, whose files a TileWriter cannot fsync before marking them written). An ``s3://``, ``gs://`` or ``az://`` URI is opened
through obstore with the ``storage_options`` stoker reads with (obstore's keys: ``endpoint``, ``region``,
credentials...; stoker's request settings ``timeout_s``, ``retries``...; the disk cache's keys are for
reads and left out here): zarr-python writes through ``zarr.storage.ObjectStore``, obstore retrying what
may pass, and the record through stoker's :class:`~stoker.storage.objectstore.ObjectStore`.

>>> store = array_store("s3://bucket/out.zarr", {"endpoint": "http://127.0.0.1:9000", "allow_http": True})
>>> zarr.create_array(store, shape=(64, 64), chunks=(32, 32), dtype="f4")
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator
from urllib.parse import urlparse

from ..errors import InvalidArgument, StokerError, StorageError, UnsupportedFormat
from ..runtime import zarrloop
from ..storage.locate import CACHE_KEYS, SETTING_KEYS
from ..storage.objectstore import ObjectStore
from ..storage.uri import REMOTE_SCHEMES
from ..storage.urls import resolve_local_path


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store (not a local path or ``file://``)."""
    return "://" in uri and urlparse(uri).scheme.lower() in REMOTE_SCHEMES


def remote_store(uri: str, storage_options: dict | None) -> ObjectStore:
    """Stoker's store rooted at ``uri`` (an object store URI), with the settings among ``storage_options``
    split from obstore's keys as :class:`~stoker.storage.locate.Stores` splits them for reads."""
    options = dict(storage_options or {})
    settings = {k: options.pop(k) for k in list(options) if k in SETTING_KEYS}
    for k in CACHE_KEYS:
        options.pop(k, None)
    store = ObjectStore(uri, options, **settings)
    if not store.supports_list:
        store.close()
        raise InvalidArgument(f"{uri}: a TileWriter writes to a local path or an object store (s3://, gs://, az://); "
                              "a plain HTTP server cannot take writes nor list the completion record", uri=uri)
    return store


def refuse_zip(uri: str) -> None:
    """UnsupportedFormat for a zip archive (``zip://``, or a path through an existing ``.zip`` file): stoker reads
    zip archives but writes none; InvalidArgument for a path through a ``.zip`` that is not there, which would be
    made a folder of that name, not an archive (a folder already there is written as one)."""
    how = ("zip archives are read-only for TileWriter: write the array to a folder (or an object store) and zip "
           "the folder afterwards, its hierarchy at the archive's root (cd out && zip -r -0 ../x.zip pred.zarr)")
    if "://" in uri and urlparse(uri).scheme.lower() == "zip":
        raise UnsupportedFormat(f"TileWriter({uri!r}): {how}", uri=uri)
    if is_remote(uri) or ".zip" not in uri.lower():
        return
    parts = local_path(uri).split(os.sep)
    for i in range(1, len(parts) + 1):  # the array's own name too: TileWriter("x.zip") meant an archive
        head = os.sep.join(parts[:i]) or os.sep
        if not head.lower().endswith(".zip") or os.path.isdir(head):
            continue
        if os.path.exists(head):
            raise UnsupportedFormat(f"TileWriter({uri!r}): {head} is a zip archive; {how}", uri=uri)
        raise InvalidArgument(f"TileWriter({uri!r}): {head} does not exist, and would be made a folder of that name, "
                              f"not a zip archive; {how}. To write to a folder named {os.path.basename(head)}, "
                              "make it first", uri=uri)


def local_path(uri: str) -> str:
    """The path a local ``uri`` names: ``file://`` resolved (:func:`~stoker.storage.urls.resolve_local_path`),
    a plain path as it is.

    >>> local_path("file:///out/a%20b.zarr")
    '/out/a b.zarr'
    """
    if "://" in uri and urlparse(uri).scheme.lower() == "file":
        return resolve_local_path(uri)
    return uri


def array_store(uri: str, storage_options: dict | None) -> Any:
    """What zarr-python opens for the array at ``uri``: its local path (:func:`local_path`: a LocalStore, whose
    files a TileWriter fsyncs), or a writable ``zarr.storage.ObjectStore`` rooted at it."""
    refuse_zip(uri)
    if not is_remote(uri):
        if storage_options:
            raise InvalidArgument(f"{uri}: storage_options ({', '.join(sorted(storage_options))}) apply to object "
                                  "stores only (s3://, gs://, az://); drop them for a local path", uri=uri,
                                  knob="storage_options")
        return local_path(uri)
    import zarr.storage

    zarrloop.hook()  # requests zarr-python leaves in flight end before finalisation (runtime/zarrloop.py)
    store = remote_store(uri, storage_options)
    try:
        return zarr.storage.ObjectStore(store.writable_obstore(), read_only=False)
    finally:
        store.close()


@contextlib.contextmanager
def writing(uri: str, what: str) -> Iterator[None]:
    """A failed write through zarr-python (an OSError, or obstore's own error) as a
    :class:`~stoker.errors.StorageError` naming ``uri`` and ``what`` was being written."""
    try:
        yield
    except StokerError:
        raise
    except Exception as exc:
        if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] != "obstore":
            raise  # zarr-python refusing its arguments (ValueError, TypeError...): not the storage
        text = str(exc).split("\n")[0][:300]
        raise StorageError(f"{uri}: writing {what} through zarr-python failed ({type(exc).__name__}: {text}); check "
                           "the URI, the bucket, credentials and endpoint (storage_options or the environment). "
                           "Regions written before are recorded: a restarted job resumes after them", uri=uri,
                           key=None, status=None, attempts=None) from exc
