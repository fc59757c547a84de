"""Room in the open-file limit for a pipeline's remote requests.

Every request in flight to an object store holds a socket, and the HTTP client keeps about as many idle
ones for reuse; a pipeline at ``Config.requests_in_flight=512`` wants about a thousand file descriptors
beside its arrays' files, more than the 1,024 many systems set as the soft ``ulimit -n``. Past the limit
every open fails with ``EMFILE`` ("Too many open files"), in a socket or in a cache entry alike. So the soft
limit is raised toward what the requests of every pipeline of the process need together (each counted from
:func:`requests_that_fit` until :func:`release`; never above the hard limit, which only an administrator
raises, nor further than needed: a soft limit past 1,024 breaks programs that still use ``select``, and
child processes inherit it); where even the hard limit is too low, the requests are capped to fit, with one
warning that says what to change.

>>> requests_that_fit(512)   # 512 where the limit allows about 1,300 files (or could be raised to it)
512
"""

from __future__ import annotations

import threading
import warnings

#: files and sockets a training process keeps open besides its pipelines' requests: arrays and shards, the
#: disk cache's entries, the interpreter's and torch's own
SPARE_FILES = 256
#: file descriptors one request in flight may take: its socket, and an idle one the client's pool keeps
FILES_PER_REQUEST = 2
#: fewest requests a pipeline is capped to, whatever the limit (below this, remote reads crawl)
LEAST_REQUESTS = 16

_lock = threading.Lock()
_warned = False
_granted = 0  # requests granted by requests_that_fit and not released: every live pipeline's together


def files_for(requests: int) -> int:
    """File descriptors pipelines with ``requests`` in flight together want room for."""
    return FILES_PER_REQUEST * requests + SPARE_FILES


def requests_that_fit(requests: int) -> int:
    """``requests`` for one more pipeline, or fewer where the process's open-file limit cannot hold them beside
    those granted before and not released (see the module docstring): the soft limit is raised first, up to the
    hard one; a cap is warned of once a process. What it returns counts as granted until :func:`release`."""
    global _warned, _granted
    try:
        import resource
    except ImportError:  # not a POSIX system: no limit to read
        return requests
    with _lock:
        wanted = files_for(_granted + requests)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = resource.RLIM_INFINITY
        if soft != unlimited and soft < wanted:
            target = wanted if hard == unlimited else min(hard, wanted)
            if target > soft:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                    soft = target
                except (ValueError, OSError):  # a sandbox that forbids it: keep the limit as it is
                    pass
        if soft == unlimited or soft >= wanted:
            fit = requests
        else:
            fit = min(requests, max(LEAST_REQUESTS, (soft - SPARE_FILES) // FILES_PER_REQUEST - _granted))
            if fit < requests and not _warned:
                _warned = True
                warnings.warn(f"the open-file limit (ulimit -n) is {soft} and cannot be raised past {hard}: the "
                              f"remote requests of this process's pipelines (requests_in_flight={requests}, "
                              f"{_granted} granted before) want about {wanted} file descriptors, so this "
                              f"pipeline's stores get {fit} requests at once. Raise the limit (ulimit -n "
                              f"{wanted}, or nofile in limits.conf or the container's ulimits) to read at full "
                              "depth.", RuntimeWarning, stacklevel=2)
        _granted += fit
        return fit


def release(requests: int) -> None:
    """Give back ``requests`` that :func:`requests_that_fit` granted (their pipeline closed)."""
    global _granted
    with _lock:
        _granted = max(0, _granted - requests)


__all__ = ["requests_that_fit", "release", "files_for", "SPARE_FILES"]
