"""The threads stoker starts and what they cost: a bounded pool of daemon threads (:mod:`~.workers`) and the
GIL-held time of those threads (:mod:`~.gil`). The lowest layer: it imports nothing else of stoker but errors.

>>> from stoker.runtime import gil
>>> gil.released(numcodecs_decode, data)   # marks a call that releases the GIL
"""
