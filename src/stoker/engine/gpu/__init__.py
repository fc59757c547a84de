"""Decoding chunks on the GPU (``Config(decode_on="gpu")``): the executor and its host side, testable without one.

- :mod:`.executor`: ``GpuDecodeExecutor``, the executor contract's methods, slots, reader and submitter;
  its parts: :mod:`.sources` (how an array's chunks are decoded), :mod:`.staging` (stored bytes into pinned
  staging), :mod:`.layout` (a staged group as one ``Layout``), :mod:`.place` (gather, cast, scatter, fills)
  and :mod:`.fallback` (the CPU decode of what the device does not take);
- :mod:`.frames`: a blosc1 frame (or a plain zstd frame) parsed into flat arrays of independent
  compressed streams, one row per stream, batched across chunks;
- :mod:`.ops`: the torch operations the device runs after decompression (byte and bit unshuffle,
  segment copies), written for any device, CPU tensors included;
- :mod:`.reference`: the CPU reference decode of those streams (c-blosc's own LZ4 and zstd, through
  numcodecs' extensions), which the tests hold to numcodecs bit for bit, and ``HostDecoder``, the device
  decoder's interface over it (the GPU-decode executor's tests run on it);
- :mod:`.nvcomp`: the device decode over NVIDIA's nvCOMP (an optional dependency, imported lazily), through
  :mod:`.capi`, its C API bound with ctypes.
"""
