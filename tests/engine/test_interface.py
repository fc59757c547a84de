"""The compiled engine's interface has one source, csrc/stoker_native.h: stoker.engine.cpu.interface and
csrc/interface_names.h are what .ci/interface.py writes from it, the extension modules export its constants
with the values they were compiled with (and a build from another header is refused), and every chunk
status it defines becomes a typed error or a retry on the Python path."""

from __future__ import annotations

import errno
import importlib.util
import stat
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import native_testing
import stoker
from stoker.engine.cpu import interface
from stoker.engine.cpu import native

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("ci_interface", REPO / ".ci" / "interface.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_written_files_are_what_the_header_says():
    gen = _generator()
    header = gen.HEADER.read_text()
    assert gen.MODULE.read_text() == gen.render(header), "run make interface (.ci/interface.py)"
    assert gen.NAMES.read_text() == gen.render_names(header), "run make interface (.ci/interface.py)"


def test_the_header_parser_counts_enums_as_c_does_and_reads_column_functions():
    constants, functions = _generator().parse("""
        #define STOKER_NATIVE_H
        #define WIDE 0x10 /* sixteen */
        enum { A = 0, B, /* a comment, B's */ C = WIDE + 1, D, N_X };
        enum {
            E = -1, // trailing
            F,
        };
        #define COLS(D) (2 + 3 * (D))
    """)
    assert constants == {"WIDE": 16, "A": 0, "B": 1, "C": 17, "D": 18, "N_X": 19, "E": -1, "F": 0}
    assert functions == {"COLS": ("D", "(2 + 3 * (D))")}


def test_statuses_codecs_and_columns_are_the_headers_by_name():
    assert native.ST_OK == interface.ST_OK == 0 and native.CODEC_FILL == -1
    statuses = [n for n in interface.CONSTANTS if n.startswith("ST_")]
    assert [interface.CONSTANTS[n] for n in statuses] == list(range(interface.N_STATUSES))
    assert native.N_CHUNK_COLS == interface.C_BUFFER + 1
    assert interface.COPY_COLS(3) == interface.CP_EXTENT + 3
    assert native.SOURCE_KINDS[np.dtype("float32")] == interface.K_F32
    assert native.SOURCE_KINDS[np.dtype("uint16")] == interface.K_U16
    assert len(native.SOURCE_KINDS) == interface.N_SRC_KINDS


@pytest.mark.skipif(native.Engine is None, reason="the compiled engine is not built (or STOKER_NATIVE=0)")
def test_the_extensions_export_the_constants_they_were_compiled_with():
    from stoker import _native

    assert _native.interface == interface.CONSTANTS
    if native_testing.module is not None:
        assert native_testing.module.interface == interface.CONSTANTS
        assert not hasattr(_native, "decode_files")  # the tests' entry point is not in the shipped module


@pytest.mark.skipif(native_testing.module is None, reason="stoker._testing is not built")
def test_a_module_built_from_another_header_is_refused(monkeypatch):
    stale = dict(native_testing.module.interface, ST_CHANGED=99)
    monkeypatch.setattr(native_testing.module, "interface", stale)
    with pytest.warns(RuntimeWarning, match=r"another csrc/stoker_native\.h.*ST_CHANGED.*rebuild it"):
        assert native.configure(native_testing.module) is None
    monkeypatch.undo()
    assert native.configure(native_testing.module)["zstd"] == native.zstd


@pytest.mark.skipif(native.Engine is None, reason="the compiled engine is not built (or STOKER_NATIVE=0)")
@pytest.mark.parametrize("fetched", [False, True], ids=["file", "fetched"])
def test_every_status_the_header_defines_is_a_typed_error_or_a_retry(tmp_path, fetched):
    """NativeDecoder._outcome for each ST_* but ST_OK on a whole zstd chunk file (the case with the most
    typed errors): never the fallback for a status it does not know, which a status past the header gets."""
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(64, dtype="uint16").reshape(8, 8)
    cfg = stoker.Config(batch_size=1, sample_shape=(4, 4), dtype="f32", device="cpu", n_compute_threads=1,
                        pop_timeout_s=20.0)
    details = {"ST_OS_ERROR": errno.EIO, "ST_NOT_REGULAR": stat.S_IFIFO, "ST_SIZE": 1, "ST_CODEC_ERROR": 10,
               "ST_TOO_BIG": 1 << 40}
    with stoker.Pipeline(cfg) as p:
        sample = stoker.Sample(uri, [(0, 4), (0, 4)])
        p.push([sample])  # a first batch: the decoders up
        with p.pop():
            pass
        decoders = p._executor.decoders
        # out: the batch, whose dtype an ST_RANGE error names (reported for integer batches only)
        job = types.SimpleNamespace(plan=decoders.plan(1, [sample], p._open), out=torch.empty(0, dtype=torch.int32))
        statuses = [n for n in interface.CONSTANTS if n.startswith("ST_") and n != "ST_OK"]
        assert len(statuses) == interface.N_STATUSES - 1
        for name in statuses:
            error, retry = decoders.native._outcome(job, 0, getattr(native, name), details.get(name, 0), fetched)
            assert (error is None) != (retry is None), name
            if error is not None:
                assert isinstance(error, stoker.StokerError), (name, error)
                assert "unknown reader status" not in str(error), name
        if not fetched:
            error, _ = decoders.native._outcome(job, 0, interface.N_STATUSES, 0)
            assert isinstance(error, stoker.DecodeError) and "unknown reader status" in str(error)
