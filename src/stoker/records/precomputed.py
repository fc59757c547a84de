"""Per-record arrays computed once and stored next to the data (a k-NN graph, a mesh adjacency...).

    >>> ds = ZarrRecords("/data/crash", fields=["positions"])
    >>> precompute(ds, "knn16", lambda s: knn_graph(s["positions"][0], 16), params={"k": 16})
    PrecomputeResult(name='knn16', written=400, skipped=0, ...)
    >>> precompute(ds, "knn16", ...same...)          # every record already holds it: nothing is written
    >>> ZarrRecords("/data/crash", fields=["positions", "knn16"])[0]["knn16"]   # a new dataset sees it

Each record's group gets an array ``name`` written with zarr-python, in the
group's Zarr format. A dataset in a store (``s3://``, ``https://``, a zip archive) is
never written to: its arrays go to a group per record in the dataset's local cache
folder (:func:`~stoker.storage.artifacts.precomputed_dir`), where ``ZarrRecords``
finds them. Under ``torch.distributed`` every rank computes its strided
share (records ``rank::world_size``), so each record is written exactly once;
the call is collective and returns once every rank is done.

**Idempotent.** The array's attributes hold a fingerprint of ``name`` and
``params`` (``attrs["stoker_precompute"]``); a record whose array carries the
same fingerprint is skipped, any other (or none) is recomputed. Beside it the
attributes record the stored shape, dtype and files (a digest of each file's size and
modification time, :mod:`stoker.records.identity`: one ``stat`` per file, no read) of each
of the dataset's other fields in that record (``inputs``), and a record whose fields
no longer have them (rewritten: a remeshed sample's N nodes against a k-NN table of
N_old rows, or new values at the same shapes) is recomputed too; fields only one of the
two datasets names are not compared (opening it with other ``fields=`` recomputes nothing).
A copy of the dataset that keeps times (``cp -a``, ``rsync -a``) keeps its arrays; one
that does not recomputes them once. Fields in an object store are compared by shape and
dtype only. Nothing can see a changed ``fn``: put a version in ``params``.

**Atomic.** The array is written to a hidden sibling directory
(``.<name>.tmp-<host>-<pid>-<random>``; hidden names are never fields), its files
are fsynced, and the directory is renamed into place with ``os.replace``. An
array found at ``name`` is therefore always complete: a crash leaves either the
old array, no array (between moving an outdated one aside and renaming the new
one in), or the new one, plus a hidden leftover that a later run removes once
its writer process is gone. A fingerprint written last was the alternative, but
readers that do not know about it (``ZarrRecords``) would accept half an array.

**Racing jobs.** Several jobs may precompute the same name into the same records at
once: each record's array is written under a claim (:func:`stoker.storage.fsutil.claim`), so it
is computed and written once; a job skips the records another one is writing, does the
rest, then waits for those and counts them as skipped. Consolidated group metadata, if a
record has any, is not updated; ``ZarrRecords`` reads each array's own metadata.
The module is ``precomputed`` so that ``stoker.records.precompute`` can be the function.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..dist.collectives import all_gather, group_position
from ..errors import DtypeMismatch, InvalidArgument, StokerError, StorageError
from .dataset import Sample, ZarrRecords, rank_part
from .stats import FieldStats, normalize, stats_fingerprint
from ..storage.fsutil import claim, fsync_tree, make_sibling_dir, place_dir, remove_dead_siblings, try_claim
from ..storage import read_regular
from ..storage.artifacts import precomputed_dir

ATTR = "stoker_precompute"
FORMAT = "stoker-precompute"
VERSION = 1


@dataclass(frozen=True)
class PrecomputeResult:
    """What one call did: ``written``/``skipped`` records on this rank, ``total_*`` over all ranks."""

    name: str
    fingerprint: str
    written: int
    skipped: int
    total_written: int
    total_skipped: int


def fingerprint(name: str, params: Any) -> str:
    """Hex digest of what identifies a precomputed array: its name and ``params`` (canonical JSON)."""
    doc = {"format": FORMAT, "version": VERSION, "name": name, "params": params}
    return hashlib.sha256(_canonical(doc).encode()).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


# -- reading what is stored --------------------------------------------------------------------


def _zarr_format(record: str) -> int:
    """2 or 3: the new array follows its group's format, so mixed datasets stay readable by both."""
    if os.path.exists(os.path.join(record, "zarr.json")):
        return 3
    if os.path.exists(os.path.join(record, ".zgroup")):
        return 2
    raise InvalidArgument(f"{record} is not a Zarr group", uri=record)


def _attributes(path: str) -> dict | None:
    """The attributes of the array at ``path``, or None when there is no readable array there."""
    try:  # read as regular files only: a FIFO there would block (a StorageError is an OSError)
        raw = read_regular(os.path.join(path, "zarr.json"))
        if raw is not None:
            doc = json.loads(raw)
            if doc.get("node_type") != "array":
                return None
            attrs = doc.get("attributes")
            return attrs if isinstance(attrs, dict) else {}
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not os.path.exists(os.path.join(path, ".zarray")):
        return None
    try:
        raw = read_regular(os.path.join(path, ".zattrs"))
        if raw is None:
            return {}
        doc = json.loads(raw)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def stored_fingerprint(record: str, name: str) -> str | None:
    """Fingerprint of the array ``name`` in the record group at ``record``; None when absent or foreign."""
    attrs = _attributes(os.path.join(record, name))
    entry = attrs.get(ATTR) if attrs else None
    fp = entry.get("fingerprint") if isinstance(entry, dict) else None
    return fp if isinstance(fp, str) else None


def stored_inputs(record: str, name: str) -> Any:
    """The ``inputs`` the array ``name`` in the record group at ``record`` was computed from (see the module
    docstring); None when absent (an array of an older stoker: recomputed once)."""
    attrs = _attributes(os.path.join(record, name))
    entry = attrs.get(ATTR) if attrs else None
    return entry.get("inputs") if isinstance(entry, dict) else None


def _entries(record: str) -> Callable[[str], tuple[str | None, Any]]:
    """``entry(field)``: the stored ``(fingerprint, inputs)`` of ``field`` in the record group at ``record``
    (``(None, None)`` for a raw field), each field's attributes read once per call of :func:`record_inputs`."""
    got: dict[str, tuple[str | None, Any]] = {}

    def entry(field: str) -> tuple[str | None, Any]:
        if field not in got:
            attrs = _attributes(os.path.join(record, field))
            stored = attrs.get(ATTR) if attrs else None
            fp = stored.get("fingerprint") if isinstance(stored, dict) else None
            inputs = stored.get("inputs") if isinstance(stored, dict) else None
            got[field] = (fp if isinstance(fp, str) else None, inputs if fp is not None else None)
        return got[field]

    return entry


def _derived_digest(entry: Callable[[str], tuple[str | None, Any]], field: str, name: str) -> str:
    """What the precomputed array ``field`` was computed as, seen from a precompute of ``name``: the stored
    fingerprint and stored inputs of every precomputed array it was computed from, directly or through others
    (``field`` first among them), a raw input by its stored shape, dtype and digest, a precomputed one by its
    shape and dtype (its own entry is in the set), so a change of fingerprint or files anywhere up the chain
    reaches ``name``. ``name`` itself is never looked into, so recomputing it never changes what it sees
    (chained precomputes settle); one visited set ends a cycle among the others, and keeps the cost linear in
    the arrays reached (not one walk per path)."""
    reached, stack = {field}, [field]
    while stack:
        _, stored = entry(stack.pop())
        if isinstance(stored, dict):
            for k in stored:
                if k != name and k not in reached and entry(k)[0] is not None:
                    reached.add(k)
                    stack.append(k)
    parts = []
    for k in sorted(reached):
        fp, stored = entry(k)
        source = None
        if isinstance(stored, dict):
            source = {j: (v if entry(j)[0] is None else (v[:2] if isinstance(v, list) else []))
                      for j, v in stored.items() if j != name}
        parts.append([k, fp, source])
    return hashlib.sha256(_canonical(parts).encode()).hexdigest()[:32]


def record_inputs(ds: ZarrRecords, i: int, name: str) -> dict[str, list]:
    """``{field: [stored shape, dtype, files]}`` of record ``i``'s fields but ``name``, as JSON data: what an
    array precomputed from them was computed from. ``files`` digests the size and modification time of each
    file of the field (:func:`stoker.records.identity.fields_digest`; None for a field in an object store).
    An array precompute wrote is digested by what it was computed as instead (:func:`_derived_digest`): its
    fingerprint and its stored ``inputs`` less ``name``, the precomputed ones among them digested the same
    way, so a change anywhere up a chain ``c = f(pos)``, ``a = g(c)``, ``b = h(a)`` reaches ``b`` (``c``
    computed over a dataset holding ``b`` too); ``name`` is left out at every step, as chained precomputes,
    each on a dataset holding the other's array, would otherwise each see the other rewritten at every run
    and recompute for ever."""
    info = ds.metadata(i)
    others = [f for f in sorted(info.fields) if f != name]
    entry = _entries(record_folder(ds, i))
    derived = [f for f in others if entry(f)[0] is not None]
    files: dict[str, str | None] = ds.files_digest(i, [f for f in others if f not in derived])
    for f in derived:
        files[f] = _derived_digest(entry, f, name)
    return {f: [list(info.fields[f].stored_shape), np.dtype(info.fields[f].dtype).str, files[f]] for f in others}


def inputs_agree(stored: Any, inputs: dict[str, list]) -> bool:
    """Whether the fields of ``inputs`` (a record's now) that ``stored`` (its array's, None for an array of an
    older stoker) also names have the stored shapes and dtypes. Only fields both name are compared: a dataset
    opened with other ``fields=`` (a derived array added, a field left out) recomputes nothing, as ``fn`` read
    no field the dataset it ran on did not have."""
    if not isinstance(stored, dict):
        return False
    return all(stored[f] == v for f, v in inputs.items() if f in stored)


def _check_replaceable(record: str, sample: str, name: str) -> None:
    """Refuse to replace anything at ``name`` that precompute did not write (user data stays untouched)."""
    path = os.path.join(record, name)
    if os.path.lexists(path) and stored_fingerprint(record, name) is None:
        raise InvalidArgument(
            f"record {sample!r} already holds {path!r}, which precompute did not write; pick another name "
            "or delete it", uri=path, sample=sample, field=name)


# -- writing one array ---------------------------------------------------------------------------


def _as_numpy(value: Any, record: str, name: str) -> np.ndarray:
    """``fn``'s result as a C-ordered array of its own shape (a 0-d result stays 0-d, which
    ``np.ascontiguousarray`` alone would make 1-d)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            raise DtypeMismatch(f"{name}: bfloat16 has no Zarr dtype; convert it (e.g. .float())",
                                field=name, sample=record)
        if value.is_complex() or value.is_quantized:
            raise DtypeMismatch(f"{name}: fn returned {value.dtype}, which stoker does not store",
                                field=name, sample=record)
        value = value.cpu().numpy()
        return np.ascontiguousarray(value).reshape(value.shape)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return np.ascontiguousarray(value).reshape(value.shape)
    raise InvalidArgument(f"fn must return a torch.Tensor; for record {record!r} it returned "
                          f"{type(value).__name__}", field=name, sample=record)






def _write_temp(tmp: str, data: np.ndarray, fmt: int, attrs: dict) -> None:
    """Write the complete array (metadata, attributes, chunks) at the temporary path."""
    import zarr  # only writers pay for importing zarr-python

    zarr.create_array(store=tmp, data=data, zarr_format=fmt, attributes=attrs)


def write_array(record: str, name: str, data: np.ndarray, attrs: dict) -> str:
    """Store ``data`` as array ``name`` of the record group at ``record``, atomically; returns its path."""
    final = os.path.join(record, name)
    try:
        tmp = str(make_sibling_dir(final))  # a new empty directory: nothing planted there is written into
    except OSError as exc:
        raise StorageError(f"could not write {final}: {exc}", uri=final) from exc
    try:
        _write_temp(tmp, data, _zarr_format(record), attrs)
        fsync_tree(tmp)
        if _attributes(tmp) != attrs:  # never rename in what is not the complete array just written
            raise StorageError(f"the temporary array {tmp} changed while it was written (removed by another "
                               "process?); nothing was put in place", uri=tmp)
        # The array there is replaced; the same one that another process puts there meanwhile is kept.
        place_dir(tmp, final, lambda path: _attributes(str(path)) == attrs, replace=True)
    except OSError as exc:
        raise StorageError(f"could not write {final}: {exc}", uri=final) from exc
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- the entry point ---------------------------------------------------------------------------


def _local_view(ds: ZarrRecords, rank: int, world: int) -> ZarrRecords:
    """The records this rank computes: its strided share, or any view when no other rank takes part."""
    if world == 1:
        return ds  # a single process does what it is given (e.g. a rank's part chosen by hand)
    return rank_part(ds, rank, world)


def _check_args(ds: Any, name: Any, fn: Any, params: Any) -> str:
    if not isinstance(ds, ZarrRecords):
        raise InvalidArgument(f"ds must be a ZarrRecords (or this rank's part), got {type(ds).__name__}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", name) or name.startswith("__"):
        raise InvalidArgument(
            f"name must be a plain array name (letters, digits, '_', '-', '.'; not starting with '.' or '__'), "
            f"got {name!r}")
    if name in ds.fields:
        raise InvalidArgument(
            f"{name!r} is a field of ds, so fn would see its old value; open the dataset without it", field=name)
    if not callable(fn):
        raise InvalidArgument(f"fn must be a function of the sample dict, got {type(fn).__name__}")
    try:
        return fingerprint(name, params)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"params must be JSON data (numbers, strings, lists, dicts): {exc}") from None


def record_folder(ds: ZarrRecords, i: int) -> str:
    """The local group precompute writes record ``i``'s arrays into: the record itself for a local dataset;
    for a dataset in a store, a group named as the record in its local folder
    (:func:`~stoker.storage.artifacts.precomputed_dir`), made here when missing."""
    info = ds.metadata(i)
    if not ds.in_store:
        return info.path
    folder = os.path.join(str(precomputed_dir(ds.root, ds.storage_options)), info.name)
    if not os.path.exists(os.path.join(folder, "zarr.json")):
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".zarr.json.tmp-{os.getpid()}-{os.urandom(4).hex()}")
            with open(tmp, "w") as f:
                json.dump({"zarr_format": 3, "node_type": "group", "attributes": {}}, f)
            os.replace(tmp, os.path.join(folder, "zarr.json"))  # (racing writers write the same document)
        except OSError as exc:
            raise StorageError(f"could not make {folder} for record {info.name!r}: {exc}", uri=folder) from exc
    return folder


def _store(local: ZarrRecords, i: int, name: str, fn: Callable[[Sample], Any], fp: str, attrs: dict,
           wait: bool) -> bool | None:
    """Store record ``i``'s array under its claim: True when written here, False when it was there (or another
    process wrote it while this one waited), None (``wait=False``) when another process is writing it now."""
    record = record_folder(local, i)
    info = local.metadata(i)
    sample = info.name
    final = os.path.join(record, name)
    remove_dead_siblings(final)
    inputs = record_inputs(local, i, name)  # before fn reads: a write meanwhile shows as a change next time
    attrs = {ATTR: {**attrs[ATTR], "inputs": inputs}}

    def done() -> bool:  # the same name and params, from fields of the same shapes and dtypes
        return stored_fingerprint(record, name) == fp and inputs_agree(stored_inputs(record, name), inputs)

    if done():
        return False
    _check_replaceable(record, sample, name)
    held = claim(final, until=done) if wait else try_claim(final)
    if held is None:
        return False if wait else None
    with held:
        if not wait and done():  # finished by another process between the look above and the claim
            return False
        try:
            value = fn(local[i])
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+: say which record, as the message of fn cannot
                exc.add_note(f"(while precompute({name!r}) computed record {sample!r})")
            raise
        write_array(record, name, _as_numpy(value, sample, name), attrs)
    return True


def _run_local(local: ZarrRecords, name: str, fn: Callable[[Sample], Any], params: Any, fp: str
               ) -> tuple[int, int, BaseException | None]:
    written = skipped = 0
    attrs = {ATTR: {"fingerprint": fp, "params": json.loads(_canonical(params)), "version": VERSION}}
    try:
        # Records another process (another job) is computing right now are left for last: racing jobs
        # share the work instead of queueing behind each other record by record.
        later = []
        for i in range(len(local)):
            got = _store(local, i, name, fn, fp, attrs, wait=False)
            if got is None:
                later.append(i)
            else:
                written, skipped = written + got, skipped + (not got)
        for i in later:
            got = _store(local, i, name, fn, fp, attrs, wait=True)
            written, skipped = written + got, skipped + (not got)
    except Exception as exc:  # reported to every rank below, raised here
        return written, skipped, exc
    return written, skipped, None


def precompute(ds: ZarrRecords, name: str, fn: Callable[[Sample], torch.Tensor], params: Any,
               group: Any = None, normalized_with: Mapping[str, FieldStats] | None = None) -> PrecomputeResult:
    """Store ``fn(ds[i])`` as array ``name`` in every record that lacks it under ``params``.

    ``ds`` is the full dataset (each rank takes records ``rank::world_size``) or this
    rank's ``ds.for_rank(rank, world_size)``; without a process group, any view. For a dataset
    in a store each rank then completes its own machine's cache with the records of ``ds``
    that other machines computed (none, when ``$STOKER_CACHE`` is shared). ``params`` is JSON data describing
    everything ``fn``'s result depends on; records whose array was stored under the
    same ``name`` and ``params`` are skipped. Collective under ``torch.distributed``:
    call it on every rank of ``group``; it returns (or raises, on every rank) once all
    ranks are done. Open a new ``ZarrRecords`` to see the new field.

    ``normalized_with`` (a :func:`compute_stats` result): ``fn`` receives
    ``normalize(ds[i], normalized_with)``, the sample the model sees (a k-NN graph of
    normalised positions), and the statistics' fingerprint joins ``params``', so new
    statistics recompute the array.

        >>> precompute(ds, "knn16", lambda s: knn_graph(s["points"], 16), {"k": 16}, normalized_with=stats)
    """
    fp = _check_args(ds, name, fn, params)
    if normalized_with is not None:
        stats = dict(normalized_with)
        fp = fingerprint(name, {"params": params, "normalized_with": stats_fingerprint(stats)})
        user_fn = fn

        def fn(sample: Sample) -> torch.Tensor:  # the sample the model sees
            return user_fn(normalize(sample, stats))
    rank, world = group_position(group)
    local = _local_view(ds, rank, world)

    # Ranks asked for different arrays would each skip the others' records: refuse together.
    heads = all_gather(torch.tensor([int(fp[:14], 16)], dtype=torch.int64), group)
    if len({int(h[0]) for h in heads}) > 1:
        raise InvalidArgument(f"ranks passed different name or params to precompute({name!r}, ...)", field=name)

    written, skipped, error = _run_local(local, name, fn, params, fp)
    if ds.in_store and world > 1:
        # A dataset in a store keeps its arrays in each machine's cache: once every rank has done its share
        # (all of them, in a cache the ranks share), each completes its own cache, computing the records
        # that other machines wrote to theirs (in a shared cache this only looks, and finds them).
        done = all_gather(torch.tensor([0 if error else 1], dtype=torch.int64), group)
        if all(int(d[0]) for d in done):
            more, _, error = _run_local(ds, name, fn, params, fp)
            written += more
    # This gather doubles as the closing barrier: nobody returns before every record is in place.
    tails = all_gather(torch.tensor([0 if error else 1, written, skipped], dtype=torch.int64), group)
    failed = [r for r, t in enumerate(tails) if int(t[0]) == 0]
    if error is not None:
        raise error
    if failed:
        raise StokerError(f"precompute({name!r}) failed on rank(s) {failed}; the cause is raised there",
                          ranks=failed, field=name)
    return PrecomputeResult(name, fp, written, skipped,
                            sum(int(t[1]) for t in tails), sum(int(t[2]) for t in tails))


__all__ = ["PrecomputeResult", "precompute", "fingerprint", "inputs_agree", "record_folder", "record_inputs",
           "stored_fingerprint", "stored_inputs", "write_array"]
