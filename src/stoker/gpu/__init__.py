"""Decoding chunks on the GPU: the host side, testable without one.

- :mod:`.frames`: a blosc1 frame (or a plain zstd frame) parsed into flat arrays of independent
  compressed streams, one row per stream, batched across chunks;
- :mod:`.ops`: the torch operations the device runs after decompression (byte and bit unshuffle,
  segment copies), written for any device, CPU tensors included;
- :mod:`.reference`: the CPU reference decode of those streams (c-blosc's own LZ4 and zstd, through
  numcodecs' extensions), which the tests hold to numcodecs bit for bit;
- :mod:`.nvcomp`: the device decode over NVIDIA's nvCOMP (an optional dependency, imported lazily).

Nothing here is wired into :class:`~stoker.Pipeline` yet (``Config.decode_on="gpu"`` is refused).
"""
