"""Codecs: from metadata to numcodecs codecs, the chain of a read chunk, and bounded decoders per family.

>>> codec = metadata.codec                 # a ChunkCodec, built by spec.py from .zarray / zarr.json
>>> chunk = codec.decode(encoded, key="c/0/0")

Modules: :mod:`~.chain` (ChunkCodec: stored bytes -> chunk array), :mod:`~.spec` (codecs from metadata),
:mod:`~.bounds` (the bound of each stage, the bounded decoder of each codec), one module per compressor
family (:mod:`~.zstd`, :mod:`~.lz4`, :mod:`~.blosc`, :mod:`~.streams` for gzip, zlib, bz2, lzma) and
:mod:`~.limit` (TooLarge).
"""

from .chain import ChunkCodec

__all__ = ["ChunkCodec"]
