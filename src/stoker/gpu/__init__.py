"""Decoding chunks on the GPU: the host side, testable without one.

- :mod:`.frames`: a blosc1 frame (or a plain zstd frame) parsed into flat arrays of independent
  compressed streams, one row per stream, batched across chunks;
- :mod:`.ops`: the torch operations the device runs after decompression (byte and bit unshuffle,
  segment copies), written for any device, CPU tensors included;
- :mod:`.reference`: the CPU reference decode of those streams (c-blosc's own LZ4 and zstd, through
  numcodecs' extensions), which the tests hold to numcodecs bit for bit, and ``HostDecoder``, the device
  decoder's interface over it (the GPU-decode executor's tests run on it);
- :mod:`.nvcomp`: the device decode over NVIDIA's nvCOMP (an optional dependency, imported lazily).

The executor that uses them is :mod:`stoker.engine.gpu_decode` (``Config.decode_on="gpu"``), with its parts
in ``stoker.engine.gpu_*`` (sources, staging, layout, placement, CPU fallback).
"""
