"""The crop pipeline, whatever the executor: :mod:`.facade` (``Pipeline``, the public face), :mod:`.intake`
(what was pushed, pulled lazily into batches) and :mod:`.coordinator` (the thread that plans and submits)."""
