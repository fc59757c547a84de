"""What the bytes mean: Zarr metadata (v2, v3), chunk grid and keys, codecs, shard index.

Everything here is pure: data in, data out, no I/O and no threads.
"""

from .codecs.chain import ChunkCodec
from .grid import ChunkIntersection, ChunkKeyEncoding, chunk_intersections, chunks_touched, grid_shape
from .metadata import ArrayMetadata, parse_v2, parse_v3
from .sharding import ShardingSpec

__all__ = [
    "ArrayMetadata",
    "ChunkCodec",
    "ChunkIntersection",
    "ChunkKeyEncoding",
    "ShardingSpec",
    "chunk_intersections",
    "chunks_touched",
    "grid_shape",
    "parse_v2",
    "parse_v3",
]
