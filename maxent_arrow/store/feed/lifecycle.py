"""The replay sampler's lifecycle records, committed off the consumer's thread.

A batch's records (what it trained, what it dropped) are handed to a :class:`LifecycleWriter`
when the batch is drawn and committed by its thread, in order, every record handed over while
the last commit ran in one commit (a group commit: one fsync'd log entry for several
batches), so that recording costs the consumer the time to hand a table over. What is
committed and when is still exact: :meth:`LifecycleWriter.flush` returns once every record
handed over is committed (the sampler's ``state_dict()`` calls it, so a consumer that saves
the sampler's state with its checkpoint has every record of the batches before it durable
first), and a process that exits flushes every writer still open. A commit that fails is
raised by the next call of the consumer's (:meth:`put` or :meth:`flush`), naming the
records; nothing after it is committed. A reader of the same store in this process (its
records, its SQL views) waits for what was handed over first
(:func:`~maxent_arrow.store.history.records.settle_pending`): it reads what was written.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import Any

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.records import hold_pending

__all__ = ["LifecycleWriter"]

_OPEN: weakref.WeakSet[LifecycleWriter] = weakref.WeakSet()


class LifecycleWriter:
    """Commits ``lifecycle`` record tables into ``store`` (a writable store) in order, in a
    thread of its own (module docstring)."""

    def __init__(self, store: Any):
        self.store = store
        self._pending: list[pa.Table] = []
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self.uri = str(store.uri)
        self.thread = threading.Thread(target=self._run, name="lifecycle-records", daemon=True)
        self.thread.start()
        _OPEN.add(self)
        hold_pending(self)  # (a reader of this store in this process waits for them)

    def put(self, table: pa.Table) -> None:
        """Hand ``table`` (lifecycle rows) over to be committed after those before it."""
        with self._cond:
            self._raise()
            if self._closed:
                raise StoreError("sampler: its lifecycle writer is closed")
            self._pending.append(table)
            self._cond.notify_all()

    def flush(self) -> None:
        """Return once every table handed over is committed (or raise what failed)."""
        with self._cond:
            self.wait()
            self._raise()

    def wait(self) -> None:
        """Return once every table handed over is committed or a commit failed."""
        with self._cond:
            while (self._pending or self._busy) and self._error is None:
                self._cond.wait()

    def close(self) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self.thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise StoreError(f"sampler: lifecycle records not committed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                tables, self._pending = self._pending, []
                self._busy = True
            try:
                self.store.append_records(R.LIFECYCLE, pa.concat_tables(tables))
            except BaseException as exc:  # handed to the consumer's next call
                with self._cond:
                    self._error = exc
                    self._pending.clear()  # (nothing after a failed commit is committed)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


@atexit.register
def _flush_open() -> None:
    """At exit, every record handed over is committed (a commit that fails then is said on
    stderr: there is no caller left to raise it to)."""
    for writer in list(_OPEN):
        try:
            writer.close()
        except StoreError as exc:
            print(f"maxent-arrow: {exc}", file=sys.stderr)
