"""What to read: samples, the samplers that make them, a rank's share of an epoch and its place in it.

>>> from stoker.sampling import RandomCrops, Sample
>>> source = RandomCrops(["/data/vol.zarr"], (32, 64, 64), seed=0).for_rank(rank, world_size)
>>> next(iter(source))
Sample(uri='/data/vol.zarr', aabb=((..., ...), ...))

Modules: :mod:`~.sample` (Sample), :mod:`~.samplers` (RandomCrops, TileGrid, SampleList, RankShare),
:mod:`~.field` (Field: a named part of a sample; the anchors of a volume's fields), :mod:`~.mask` (Mask:
anchors where a field covers a mask),
:mod:`~.partition` (pure arithmetic: an epoch's order over ranks, what a run consumed), :mod:`~.permutation`
(a seeded bijection, one index at a time), :mod:`~.cursor` (EpochCursor and its versioned state).
"""

from .cursor import CursorState, EpochCursor
from .field import Field
from .mask import Mask
from .sample import Sample
from .samplers import RandomCrops, RankShare, SampleList, SampleSource, TileGrid

__all__ = ["CursorState", "EpochCursor", "Field", "Mask", "RandomCrops", "RankShare", "Sample", "SampleList", "SampleSource",
           "TileGrid"]
