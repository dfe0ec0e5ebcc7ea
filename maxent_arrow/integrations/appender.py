"""``Appender``: durable appends to a rollout store off the training loop.

A recorder inside a trainer should cost the training step as little as possible, but a durable
append (Parquet, fsync, commit) takes milliseconds of mostly waiting on the disk. An
``Appender`` runs the appends of one process on one background thread, in submission order (so
the store still has one writer per rank), with at most ``max_pending`` steps in flight (the
caller waits for the oldest beyond that, so memory stays bounded when the disk is slower than
training). The waiting happens with the GIL released (pyarrow's writer, ``fsync``), so the
training loop runs meanwhile.

An append that fails is re-raised, as it was raised, by the caller's next ``submit`` or
``wait``: nothing is lost silently. What a crash loses is at most the steps in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Appender"]


class Appender:
    """Run store appends on one background thread, in order.

    Parameters
    ----------
    background:
        ``False`` runs each job in ``submit`` itself (synchronous, as a plain ``append``).
    max_pending:
        Jobs in flight at most; ``submit`` waits for the oldest beyond that.
    """

    def __init__(self, *, background: bool = True, max_pending: int = 2) -> None:
        self.background = bool(background)
        self.max_pending = max(1, int(max_pending))
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` (an append) after the ones submitted before it."""
        if not self.background:
            job()
            return
        self._reap()
        while len(self._pending) >= self.max_pending:
            self._pending.popleft().result()  # re-raises the job's error
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maxent-arrow-append")
        self._pending.append(self._pool.submit(job))

    def wait(self) -> None:
        """Wait for every submitted job; re-raise the first that failed."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Wait, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _reap(self) -> None:
        """Collect the jobs that are done (raising the first failure) without waiting."""
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()
