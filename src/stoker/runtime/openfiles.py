"""Room in the open-file limit for a pipeline's remote requests.

Every request in flight to an object store holds a socket, and the HTTP client keeps about as many idle
ones for reuse; a pipeline at ``Config.requests_in_flight=512`` wants about a thousand file descriptors
beside its arrays' files, more than the 1,024 many systems set as the soft ``ulimit -n``. Past the limit
every open fails with ``EMFILE`` ("Too many open files"), in a socket or in a cache entry alike. So, as Go's
runtime does at start, the soft limit is raised toward what the requests need (never above the hard limit,
which only an administrator raises); where even the hard limit is too low, the requests are capped to fit,
with one warning that says what to change.

>>> requests_that_fit(512)   # 512 where the limit allows about 1,300 files (or could be raised to it)
512
"""

from __future__ import annotations

import threading
import warnings

#: files and sockets a training process keeps open besides a pipeline's requests: arrays and shards, the
#: disk cache's entries, the interpreter's and torch's own, a second pipeline's
SPARE_FILES = 256
#: file descriptors one request in flight may take: its socket, and an idle one the client's pool keeps
FILES_PER_REQUEST = 2
#: fewest requests a pipeline is capped to, whatever the limit (below this, remote reads crawl)
LEAST_REQUESTS = 16

_lock = threading.Lock()
_warned = False


def files_for(requests: int) -> int:
    """File descriptors a pipeline with ``requests`` in flight wants room for."""
    return FILES_PER_REQUEST * requests + SPARE_FILES


def requests_that_fit(requests: int) -> int:
    """``requests``, or fewer where the process's open-file limit cannot hold them (see the module
    docstring): the soft limit is raised first, up to the hard one; a cap is warned of once a process."""
    global _warned
    try:
        import resource
    except ImportError:  # not a POSIX system: no limit to read
        return requests
    wanted = files_for(requests)
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = resource.RLIM_INFINITY
        if soft == unlimited or soft >= wanted:
            return requests
        target = wanted if hard == unlimited else min(hard, wanted)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):  # a sandbox that forbids it: keep the limit as it is
                pass
        if soft >= wanted:
            return requests
        fit = max(LEAST_REQUESTS, (soft - SPARE_FILES) // FILES_PER_REQUEST)
        if fit >= requests:
            return requests
        if not _warned:
            _warned = True
            warnings.warn(f"the open-file limit (ulimit -n) is {soft} and cannot be raised past {hard}: "
                          f"requests_in_flight={requests} wants about {wanted} file descriptors, so remote "
                          f"stores get {fit} requests at once. Raise the limit (ulimit -n {wanted}, or nofile "
                          f"in limits.conf or the container's ulimits) to read at full depth.",
                          RuntimeWarning, stacklevel=3)
        return fit


__all__ = ["requests_that_fit", "files_for", "SPARE_FILES"]
