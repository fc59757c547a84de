"""The CPU executor: batch slots in host memory, the compiled engine's decoder and the Python path."""
