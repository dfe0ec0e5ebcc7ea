"""The catalog of a store with a commit log: what its log says.

No listing of ``steps/`` and no read of a step file: the committed units, their commit
records and step rows are the log's (:mod:`~maxent_arrow.store.history.log`), and within
:meth:`~maxent_arrow.store.history.catalog.Catalog.snapshot` one version of it (a reader's
pin). The log is the authority on what is committed, so a file no entry names is a leftover
of a write that did not finish, and an entry missing before later ones is a lost commit.
"""

from __future__ import annotations

from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import Audit, Catalog, History
from maxent_arrow.store.history.log import CommitLog, entry_name
from maxent_arrow.store.history.operations import AppendRecords, Entry, Operation, UnitOperation
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

    def losses(self) -> list[StoreError]:
        self.state()  # (the gap, if any, of the version read)
        error = self.log.lost_error()
        return [] if error is None else [error]

    def log_plan(self) -> list[Operation] | None:
        return None

    def tail_log(self) -> CommitLog:
        return CommitLog(self.log.backend, self.log.run)

    def audit(self, live: set[str]) -> Audit:
        """The log's own files and the files no entry names. A lost entry (missing or
        damaged while later entries, the head or a checkpoint say it was committed) is a
        problem; so is each file a surviving later entry commits, hidden by it. A file no
        entry names is a leftover of a write that did not finish (a note; ``repair`` moves it
        aside), or, when an entry is lost, possibly that entry's (a note ``repair`` keeps: it
        rebuilds the entry from it). Temp files are notes."""
        backend = self.backend
        problems: list[tuple[str, str]] = []
        notes: list[tuple[str, str]] = []
        state = self.state()
        listed = sorted(
            int(name[:20])
            for name in backend.list(LOG)
            if len(name) == 25 and name.endswith(".json") and name[:20].isdigit()
        )
        lost = self.log.lost
        last = max([*listed, lost.evidence if lost is not None else 0, state.version])
        hidden: dict[str, int] = {}
        if last > state.version:
            missing = state.version + 1
            later = [v for v in listed if v > state.version]
            what = "damaged" if lost is not None and lost.damage else "lost"
            problems.append(
                (
                    entry_name(missing),
                    f"{what}: commit log entry {missing}; readers stop before it, so the "
                    + (f"{len(later)} later entries ({later[0]}..{later[-1]})" if later
                       else f"commits up to version {last} (the log's head)")
                    + " are hidden from them; `repair` rebuilds it from what survives",
                )
            )  # fmt: skip
            for entry in self.log.surviving_after(state.version, last):
                for rel in _files_of(entry):
                    hidden[rel] = entry.version
        orphan = (
            f"no surviving commit log entry names it: a file of the lost entry "
            f"{state.version + 1} (`repair` rebuilds the entry from it, and keeps it) or of a "
            "write that did not finish"
            if hidden or last > state.version
            else "uncommitted: no commit log entry names it (a write that did not finish); "
            "invisible to readers; `repair` moves it aside"
        )
        for version, why in sorted(state.notes.items()):
            if why.startswith("lost entry"):
                problems.append((entry_name(version), f"lost, and not rebuilt ({why})"))
        records = {str(i["path"]) for items in state.records.values() for i in items}
        directories = [GROUPS, STEPS, CACHE, LOG]
        directories += [f"{RECORDS}/{n}" for n in backend.subdirectories(RECORDS)]
        for directory in directories:
            for name in backend.list(directory):
                rel = f"{directory}/{name}"
                if is_temp_name(name):
                    notes.append((rel, "temp file of an unfinished write"))
                elif directory in (CACHE, LOG):
                    continue
                elif rel in hidden:
                    problems.append(
                        (rel, f"committed at log version {hidden[rel]}, hidden from readers by "
                              f"the lost entry {state.version + 1}")
                    )  # fmt: skip
                elif rel in state.retiring:
                    notes.append(
                        (
                            rel,
                            "replaced or retired (commit log); readers pinned to an older "
                            "version may still read it",
                        )
                    )
                elif rel not in live and rel not in records:
                    notes.append((rel, orphan))
        return Audit(problems, notes)


def _files_of(entry: Entry) -> list[str]:
    """The files ``entry`` commits (relative paths)."""
    operation = entry.operation
    if isinstance(operation, UnitOperation):
        return [operation.step_file, f"{GROUPS}/{operation.record['group_file']}"]
    if isinstance(operation, AppendRecords):
        return [str(operation.file["path"])]
    return []
