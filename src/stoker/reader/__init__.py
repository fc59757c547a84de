"""Reading arrays: ``open_array`` and ``ArrayReader``, the reference read path (one box at a time).

>>> from stoker.reader import open_array
>>> crop = open_array("/data/volume.zarr").read([(0, 32), (0, 128), (0, 128)])

It joins what the bytes mean (:mod:`stoker.zarr`) with where they come from (:mod:`stoker.storage`); the
batch engine (:mod:`stoker.engine`) plans and decodes whole batches of the same arrays.
"""

from .array import ArrayReader, open_array

__all__ = ["ArrayReader", "open_array"]
