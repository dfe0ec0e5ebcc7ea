"""The catalog of a store with a commit log: what its log says.

No listing of ``steps/`` and no read of a step file: the committed units, their commit
records and step rows are the log's (:mod:`~maxent_arrow.store.history.log`), and within
:meth:`~maxent_arrow.store.history.catalog.Catalog.snapshot` one version of it (a reader's
pin). The log is the authority on what is committed, so a file no entry names is a leftover
of a write that did not finish, and an entry missing before later ones is a lost commit.
"""

from __future__ import annotations

from maxent_arrow.store.history.catalog import Audit, Catalog, History
from maxent_arrow.store.history.log import CommitLog, entry_name
from maxent_arrow.store.history.operations import Operation
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.storage.backend import Backend, is_temp_name
from maxent_arrow.store.storage.names import CACHE, GROUPS, LOG, RECORDS, STEPS

__all__ = ["LogCatalog"]


class LogCatalog(Catalog):
    """The commit record of a store with a commit log (store format 3)."""

    def __init__(
        self, backend: Backend, run_id: str | None, log: CommitLog, history: History = "effective"
    ):
        super().__init__(backend, run_id, history)
        self.log = log

    def newest(self) -> LogState:
        return self.log.state()

    def pinned(self) -> LogState:
        return self.log.pin()

    @property
    def version(self) -> int | None:
        return self.state().version

    def with_history(self, history: History) -> LogCatalog:
        other = LogCatalog(self.backend, self.run_id, self.log, history)
        self.share_pin(other)
        return other

    def writable(self, what: str) -> CommitLog:
        return self.log

    def log_plan(self) -> list[Operation] | None:
        return None

    def tail_log(self) -> CommitLog:
        return CommitLog(self.log.backend, self.log.run)

    def audit(self, live: set[str]) -> Audit:
        """The log's own files (an entry past a gap: a lost entry hides every later commit
        from readers) and the files no entry names: leftovers of writes that did not finish
        (notes; ``repair`` moves them aside), as are temp files."""
        backend = self.backend
        problems: list[tuple[str, str]] = []
        notes: list[tuple[str, str]] = []
        state = self.state()
        for directory in (GROUPS, STEPS):
            for name in backend.list(directory):
                rel = f"{directory}/{name}"
                if is_temp_name(name):
                    notes.append((rel, "temp file of an unfinished write"))
                elif rel in state.retiring:
                    notes.append(
                        (
                            rel,
                            "replaced or retired (commit log); readers pinned to an older "
                            "version may still read it",
                        )
                    )
                elif rel not in live:
                    notes.append(
                        (
                            rel,
                            "uncommitted: no commit log entry names it (a write that did not "
                            "finish); invisible to readers; `repair` moves it aside",
                        )
                    )
        for name in backend.list(CACHE):
            if is_temp_name(name):
                notes.append((f"{CACHE}/{name}", "temp file of an unfinished write"))
        later = sorted(
            int(name[:20])
            for name in backend.list(LOG)
            if len(name) == 25 and name.endswith(".json") and name[:20].isdigit()
        )
        later = [v for v in later if v > state.version]
        if later:
            problems.append(
                (
                    entry_name(state.version + 1),
                    f"lost: commit log entry {state.version + 1}; readers stop before it, so "
                    f"the {len(later)} later entries ({later[0]}..{later[-1]}) are hidden "
                    "from them",
                )
            )
        records = {str(i["path"]) for items in state.records.values() for i in items}
        directories = [LOG, *(f"{RECORDS}/{n}" for n in backend.subdirectories(RECORDS))]
        for directory in directories:
            for name in backend.list(directory):
                rel = f"{directory}/{name}"
                if is_temp_name(name):
                    notes.append((rel, "temp file of an unfinished write"))
                elif directory != LOG and rel not in records:
                    notes.append(
                        (
                            rel,
                            "uncommitted: no commit log entry names it (a write that did not "
                            "finish); invisible to readers; `repair` moves it aside",
                        )
                    )
        return Audit(problems, notes)
