"""Codecs from metadata: a v2 ``.zarray``'s filters and compressor, a v3 codec list's entries, as numcodecs
codecs (and the :class:`~.chain.ChunkCodec` of a v2 array). Unknown codecs and compressors this build lacks
are refused at open (``UnsupportedFormat``), malformed configurations are ``MetadataError``."""

from __future__ import annotations

from typing import Any

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_ndarray

from ...errors import MetadataError, UnsupportedFormat
from ..dtypes import refuse_long_double
from ..fields import boolean, integer, lst, obj, required, show, string
from .blosc import blosc_compressors
from .chain import ChunkCodec

#: v3 codecs that turn an array into bytes other than ``bytes`` and ``sharding_indexed``: none is read.
ARRAY_TO_BYTES = frozenset({"numcodecs.pcodec", "numcodecs.zfpy", "vlen-utf8", "vlen-bytes"})

#: numcodecs array-to-array codecs read in v3 (``numcodecs.<id>`` before the ``bytes`` codec).
ARRAY_TO_ARRAY = ("astype", "bitround", "delta", "fixedscaleoffset", "quantize")


def _available(codec: Codec, uri: str) -> Codec:
    """``codec``, unless it is blosc naming a compressor this build of c-blosc lacks (e.g. snappy): such
    an array opens but no chunk of it can be decoded, so it is refused at open."""
    if codec.codec_id == "blosc":
        cname = codec.cname.decode() if isinstance(codec.cname, bytes) else codec.cname
        if cname not in blosc_compressors():
            raise UnsupportedFormat(
                f"{uri}: blosc compressor {show(cname)} is not available (this numcodecs reads "
                f"{', '.join(blosc_compressors())}); re-encode the array with one of those",
                uri=uri, codec="blosc", cname=cname,
            )
    return codec


def _numcodecs_codec(config: Any, what: str, uri: str) -> Codec:
    """The numcodecs codec of a configuration ``{"id": ..., **parameters}``."""
    config = obj(config, what, uri)
    codec_id = string(required(config, "id", what, uri), f"{what} id", uri)
    try:
        codec = numcodecs.get_codec(dict(config))
    except Exception as exc:  # noqa: BLE001 - a third-party constructor fed a hostile document
        if codec_id not in numcodecs.registry.codec_registry:
            raise UnsupportedFormat(
                f"{uri}: codec {codec_id!r} is not available; install the package that provides it or "
                "re-encode the array",
                uri=uri, codec=codec_id,
            ) from None
        raise MetadataError(
            f"{uri}: {what} {codec_id!r} has a configuration numcodecs rejects "
            f"({type(exc).__name__}: {str(exc)[:200]})",
            uri=uri, codec=codec_id,
        ) from None
    return _available(codec, uri)


def v2_codec(uri: str, meta: dict, shape: tuple[int, ...], stored_dtype: np.dtype) -> ChunkCodec:
    """The codec of a Zarr v2 array from its ``.zarray`` document."""
    order = required(meta, "order", ".zarray", uri)
    if order not in ("C", "F"):
        raise MetadataError(f"{uri}: order {show(order)} is not 'C' or 'F'", uri=uri)
    filters = meta.get("filters")
    filters = () if filters is None else tuple(_v2_filter(f, uri) for f in lst(filters, "filters", uri))
    compressor = meta.get("compressor")
    compressors = () if compressor is None else (_numcodecs_codec(compressor, "compressor", uri),)
    return ChunkCodec(
        uri=uri,
        shape=shape,
        dtype=stored_dtype.newbyteorder("="),
        stored_dtype=stored_dtype,
        order=tuple(reversed(range(len(shape)))) if order == "F" and len(shape) > 1 else None,
        filters=filters,
        compressors=compressors,
    )


_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_ZSTD_LEVELS = (-(1 << 17), 22)  # ZSTD_minCLevel() .. ZSTD_maxCLevel()


def _blosc_shuffle(value: Any, uri: str) -> int:
    if isinstance(value, str) and value in _BLOSC_SHUFFLE:
        return _BLOSC_SHUFFLE[value]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2:
        return value  # numcodecs' own numbering, as some writers store it
    raise MetadataError(f"{uri}: blosc shuffle {show(value)} is not one of {', '.join(_BLOSC_SHUFFLE)}", uri=uri)


def v3_bytes_codec(name: str, config: dict, uri: str) -> Codec:
    """A numcodecs codec for a Zarr v3 bytes-to-bytes codec.

    Parameters that only matter when encoding (levels, blosc's shuffle and block size) are still
    checked for their type and range: a document that gets them wrong is not one to trust.
    """
    if name == "blosc":
        if "typesize" in config:
            integer(config["typesize"], "blosc typesize", uri, lo=1)
        return _available(numcodecs.Blosc(
            cname=string(config.get("cname", "lz4"), "blosc cname", uri),
            clevel=integer(config.get("clevel", 5), "blosc clevel", uri, lo=0, hi=9),
            shuffle=_blosc_shuffle(config.get("shuffle", "noshuffle"), uri),
            blocksize=integer(config.get("blocksize", 0), "blosc blocksize", uri, lo=0, hi=2**31 - 1),
        ), uri)
    if name == "zstd":
        return numcodecs.Zstd(
            level=integer(config.get("level", 0), "zstd level", uri, lo=_ZSTD_LEVELS[0], hi=_ZSTD_LEVELS[1]),
            checksum=boolean(config.get("checksum", False), "zstd checksum", uri),
        )
    if name == "gzip":
        return numcodecs.GZip(level=integer(config.get("level", 5), "gzip level", uri, lo=0, hi=9))
    if name == "crc32c":
        return numcodecs.CRC32C(location="end")
    if name in ARRAY_TO_BYTES or name in ("bytes", "sharding_indexed", "transpose", "numcodecs.packbits") or \
            name.removeprefix("numcodecs.") in ARRAY_TO_ARRAY:
        raise MetadataError(f"{uri}: codec {name!r} takes an array: it cannot follow the array-to-bytes codec",
                            uri=uri, codec=name)
    if name.startswith("numcodecs."):
        return _numcodecs_codec({**config, "id": name.split(".", 1)[1]}, f"codec {name!r}", uri)
    raise UnsupportedFormat(
        f"{uri}: codec {name!r} is not supported; stoker reads blosc, zstd, gzip, crc32c and numcodecs.* "
        "bytes-to-bytes codecs",
        uri=uri, codec=name,
    )


class SerializedArray(Codec):
    """The ``bytes`` codec's side of a v3 chain with numcodecs array-to-array codecs before it.

    The stored bytes hold the last codec's output in the ``bytes`` codec's byte order; numcodecs'
    decoders view what they get in the dtype they declare. When the two differ (a big-endian ``bytes``
    codec, or a declared dtype of the other byte order) this converts the values first. zarr-python 3.1
    views instead, so it reads big-endian arrays written through these codecs wrongly; stoker reads what
    was encoded.
    """

    codec_id = "bytes"

    def __init__(self, stored: np.dtype, expected: np.dtype) -> None:
        self.stored, self.expected = stored, expected

    def decode(self, buf: Any, out: Any = None) -> np.ndarray:
        return ensure_ndarray(buf).reshape(-1).view(np.uint8).view(self.stored).astype(self.expected)

    def encode(self, buf: Any) -> Any:  # stoker only reads
        raise NotImplementedError("stoker does not write Zarr arrays")


def _v2_filter(config: Any, uri: str) -> Codec:
    """A v2 filter's codec, refused where it stores numpy's long double (:func:`_refuse_stored_long_double`)."""
    _refuse_stored_long_double(config, uri)
    return _numcodecs_codec(config, "filter", uri)


def _refuse_stored_long_double(config: Any, uri: str) -> None:
    """UnsupportedFormat where a v2 filter's configuration names numpy's long double (``AsType`` with
    ``encode_dtype="<f16"``, ``FixedScaleOffset`` with ``astype="<c32"``...): it would store bytes that mean
    other values on other machines, as a v2 array of that dtype would (see :func:`refuse_long_double`). A
    type that does not parse is left to numcodecs, which refuses the configuration."""
    if not isinstance(config, dict):
        return
    for key in ("dtype", "astype", "encode_dtype", "decode_dtype"):
        value = config.get(key)
        if not isinstance(value, str):
            continue
        try:
            dt = np.dtype(value)
        except (TypeError, ValueError):
            continue
        refuse_long_double(dt, f"filter {show(config.get('id'))} {key} {show(value)}", uri)


def _numeric_dtype(value: Any, what: str, uri: str) -> np.dtype:
    string(value, what, uri)
    try:
        dt = np.dtype(value)
    except (TypeError, ValueError):
        raise MetadataError(f"{uri}: {what} {show(value)} is not a data type", uri=uri) from None
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise UnsupportedFormat(f"{uri}: {what} {show(value)} is not a numeric data type", uri=uri)
    refuse_long_double(dt, f"{what} {show(value)}", uri)
    return dt


def v3_array_codec(name: str, config: dict, incoming: np.dtype, uri: str) -> tuple[Codec, np.dtype, np.dtype]:
    """A v3 ``numcodecs.*`` array-to-array codec that receives arrays of ``incoming`` when encoding.

    Returns ``(codec, decoded, encoded)``: the dtype its decoder returns and the one it stores. The
    dtypes follow zarr-python's rules (its ``resolve_metadata``): ``astype`` stores ``encode_dtype``,
    ``delta`` and ``fixedscaleoffset`` store ``astype`` when given, the others keep the type.
    """
    codec_id = name.split(".", 1)[1] if name.startswith("numcodecs.") else None
    if codec_id not in ARRAY_TO_ARRAY:
        raise UnsupportedFormat(
            f"{uri}: array-to-array codec {name!r} is not supported (stoker reads 'transpose' and "
            f"{', '.join('numcodecs.' + n for n in ARRAY_TO_ARRAY)})",
            uri=uri, codec=name,
        )
    what = f"codec {name!r}"
    if codec_id == "bitround":
        decoded = encoded = incoming
        if incoming.kind != "f":
            raise MetadataError(f"{uri}: {what} rounds floats, but it receives {incoming}", uri=uri)
    elif codec_id == "astype":
        decoded = _numeric_dtype(config.get("decode_dtype", incoming.str), f"{what} decode_dtype", uri)
        encoded = _numeric_dtype(required(config, "encode_dtype", what, uri), f"{what} encode_dtype", uri)
    else:
        decoded = _numeric_dtype(config.get("dtype", incoming.str), f"{what} dtype", uri)
        encoded = decoded
        if codec_id in ("delta", "fixedscaleoffset") and config.get("astype") is not None:
            encoded = _numeric_dtype(config["astype"], f"{what} astype", uri)
        if codec_id == "quantize" and config.get("astype") is not None and \
                _numeric_dtype(config["astype"], f"{what} astype", uri) != decoded:
            raise UnsupportedFormat(f"{uri}: {what} with an astype other than its dtype is not supported "
                                    "(zarr-python reads such chunks with the wrong type)", uri=uri, codec=name)
    if decoded.newbyteorder("=") != incoming.newbyteorder("="):
        raise MetadataError(f"{uri}: {what} decodes to {decoded}, but it receives {incoming} when encoding",
                            uri=uri, codec=name)
    return _numcodecs_codec({**config, "id": codec_id}, what, uri), decoded, encoded


def bytes_endian(config: dict, itemsize: int, uri: str) -> bool:
    """True when a v3 ``bytes`` codec stores big-endian elements of ``itemsize`` bytes. A missing
    ``endian`` reads as little-endian (as zarr-python does); null is allowed for one-byte types only."""
    endian = config.get("endian", "little")
    if endian is None and itemsize == 1:
        return False
    if endian not in ("little", "big"):
        raise MetadataError(f"{uri}: bytes codec endian {show(endian)} is not 'little' or 'big'", uri=uri)
    return endian == "big"


def codec_name_and_config(entry: Any, uri: str, what: str = "codec") -> tuple[str, dict]:
    """Split a v3 ``{"name", "configuration"}`` entry (a codec, grid or key encoding) or a bare name."""
    if isinstance(entry, str):
        return entry, {}
    entry = obj(entry, what, uri)
    name = string(required(entry, "name", what, uri), f"{what} name", uri)
    if "configuration" not in entry:
        return name, {}
    return name, dict(obj(entry["configuration"], f"{what} {name!r} configuration", uri))
