"""A thread pool that a stop does not wait for.

``with ThreadPoolExecutor()`` joins its threads on the way out, also when a signal or a bad
file stops the work: a thread blocked reading a file that never answers (a hung network
mount, a device) would then hold the command forever. This pool cancels what has not started
and lets the stop through; the command then leaves without joining the blocked thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


@contextmanager
def thread_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool whose threads are joined when the block ends normally, and abandoned (queued work
    cancelled) when it ends by an exception, Ctrl-C or SIGTERM included."""
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
