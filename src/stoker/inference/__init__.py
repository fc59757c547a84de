"""Whole-volume inference: predictions of tiles blended and written back to a Zarr array."""
