"""The checksum ledger of a SQL session: which parts of which group files have been checked.

DuckDB and Polars ignore Parquet page CRCs, so before DuckDB reads a group file the store
checks it against what its step file recorded at commit (``docs/commit-protocol.md``):

- when the views are built, every file's size (from the directory listing), and the footer
  of the first file of each schema set (DuckDB binds a view to that footer);
- before each query, the footer and the chunks of the columns the query reads, in every
  file (each (file, column) once per ledger);
- a file written before chunk CRCs were recorded, whole, once.

What a ledger checked is also remembered for the process
(:mod:`~maxent_arrow.store.storage.verified`, keyed by the file's path, size, modification time and
recorded CRC-32), so a new session over the same files checks nothing again: each file's footer and
chunks are checked once per process.

A damaged file raises a :class:`StoreError` naming it, or is reported back to the caller
(``on_error="skip"``) so the views can be rebuilt without it.
"""

from __future__ import annotations

from collections.abc import Iterable

from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import OnError, StepFile, fail, is_missing, locate
from maxent_arrow.store.io.reader import check_group_size
from maxent_arrow.store.storage import verified
from maxent_arrow.store.storage.backend import Backend, FileInfo
from maxent_arrow.store.storage.checksums import check_chunks, crc32_of

__all__ = ["ChecksumLedger", "FOOTER", "WHOLE"]

# Ledger entries besides column names: a file's footer, and a file checked whole.
FOOTER = "(footer)"
WHOLE = "*"


class ChecksumLedger:
    """What has been checked of each group file (by relative path), and the checks.

    Parameters
    ----------
    backend:
        The store's file-system seam.
    on_error:
        ``"raise"`` a damaged file, or ``"skip"`` it with a warning.
    crc:
        Check CRCs at all (``False``: sizes only).
    """

    def __init__(self, backend: Backend, *, on_error: OnError, crc: bool):
        self.backend = backend
        self.on_error: OnError = on_error
        self.crc = crc
        self.checked: set[tuple[str, str]] = set()
        # Each admitted file's key in the process-wide cache of verified bytes.
        self.keys: dict[str, verified.FileKey] = {}
        # Committed files a compaction moved to retired/ since they were listed: where they
        # are now (the same bytes, so what was checked stays checked).
        self.moved: dict[str, str] = {}

    def clear(self) -> None:
        self.checked.clear()
        self.moved.clear()
        self.keys.clear()

    def _done(self, rel: str) -> frozenset[str]:
        """What this process has checked of ``rel`` as it is now (any ledger)."""
        return verified.checked(self.keys.get(rel))

    def stamps(self) -> list[tuple[str, int, int]]:
        """``(fs_path, size, mtime_ns)`` of every file admitted (group files, and step files
        read by path) as it was when admitted: what a held session compares before a query
        (:meth:`~maxent_arrow.store.storage.backend.Backend.unchanged`)."""
        return [(path, size, mtime) for path, size, mtime, _ in self.keys.values()]

    def where(self, rel: str) -> str:
        """Where the committed file ``rel`` is read from now."""
        return self.moved.get(rel, rel)

    def relocate(self, rel: str) -> bool:
        """Look for ``rel`` again (a compaction may have moved it to retired/ since it was
        listed); whether it is somewhere else than where it was read from."""
        found = locate(self.backend, rel)
        if found is None or found[0] == self.where(rel):
            return False
        if found[0] == rel:
            self.moved.pop(rel, None)
        else:
            self.moved[rel] = found[0]
        return True

    def admit(self, rel: str, step: StepFile, info: FileInfo | None) -> None:
        """Check the group file ``rel`` before a view may read it: there, of the size its
        step file recorded (``info``: from the directory listing; a file missing from it is
        looked for in retired/), and, when it was written before chunk CRCs were recorded,
        its whole-file CRC-32 (once). Raises :class:`StoreError`."""
        path = self.backend.fs_path(rel)
        if info is None and self.relocate(rel):
            info = self.backend.stat(self.where(rel))
        check_group_size(path, step, info)
        recorded = step.meta.get("group_crc32")
        assert info is not None  # check_group_size raised otherwise
        where = self.where(rel)
        key_path = path if where == rel else self.backend.fs_path(where)
        self.keys[rel] = (key_path, info.size, info.mtime_ns, recorded)
        if self.crc and step.meta.get("chunks") is None and recorded is not None:
            if WHOLE not in self._done(rel):
                if crc32_of(self.backend.read(self.where(rel))) != recorded:
                    raise StoreError(f"{path}: CRC-32 differs from the recorded one (corrupt)")
                verified.add(self.keys[rel], (WHOLE,))
            self.checked.add((rel, WHOLE))

    def admit_step(self, rel: str, size: int | None, crc: int | None) -> bool:
        """Whether DuckDB may read the step file ``rel`` of a store with a commit log by
        itself: it is there (in place or retired), of the size and CRC-32 the log recorded
        (its whole bytes, once per process: :mod:`~maxent_arrow.store.storage.verified`). ``False``
        (missing, damaged, or nothing recorded to check it against): the reader uses the log's copy
        of its rows, as every reader of such a store may (a lost step file costs readers
        nothing)."""
        if size is None or crc is None:
            return False
        found = locate(self.backend, rel)
        if found is None or found[1].size != size:
            return False
        where, info = found
        if where != rel:
            self.moved[rel] = where
        key = (str(self.backend.fs_path(where)), info.size, info.mtime_ns, crc)
        self.keys[rel] = key
        if WHOLE in verified.checked(key) or not self.crc:
            return True
        try:
            sound = crc32_of(self.backend.read(where)) == crc
        except StoreError:
            return False
        if sound:
            verified.add(key, (WHOLE,))
        return sound

    def first_sound(self, members: list[tuple[str, StepFile]]) -> list[tuple[str, StepFile]]:
        """``members`` from the first whose footer is sound (DuckDB binds a view over a set
        of files to its first file's footer); each damaged one before it is raised, or
        skipped with a warning."""
        for at, (rel, step) in enumerate(members):
            if not self.crc or step.meta.get("chunks") is None or (rel, FOOTER) in self.checked:
                return members[at:]
            if FOOTER not in self._done(rel):
                try:
                    self._check(rel, step, ())
                except StoreError as exc:
                    fail(self.on_error, exc)
                    continue
                verified.add(self.keys.get(rel), (FOOTER,))
            self.checked.add((rel, FOOTER))
            return members[at:]
        return []

    def check(
        self,
        files: Iterable[tuple[str, StepFile]],
        columns: Iterable[str] | None,
        *,
        all_columns: Iterable[str],
        footers: bool = False,
    ) -> set[str]:
        """Check the footer and the chunks of ``columns`` (``None``: ``all_columns``) of each
        of ``files`` not checked yet (``footers``: the footer even where no column is asked
        for). Returns the damaged files (``on_error="skip"``; ``"raise"`` raises the first)."""
        if not self.crc:
            return set()
        wanted = set(all_columns) if columns is None else set(columns)
        damaged: set[str] = set()
        for rel, step in files:
            if (rel, WHOLE) in self.checked or step.meta.get("chunks") is None:
                continue
            todo = {c for c in wanted if (rel, c) not in self.checked}
            if not todo and not (footers and (rel, FOOTER) not in self.checked):
                continue
            done = self._done(rel)
            if FOOTER in done and todo <= done:
                # Checked by an earlier session of this process, and unchanged since.
                self.checked.update((rel, c) for c in todo | {FOOTER})
                continue
            todo -= done
            try:
                self._check(rel, step, todo)
            except StoreError as exc:
                fail(self.on_error, exc)
                damaged.add(rel)
                continue
            verified.add(self.keys.get(rel), todo | {FOOTER})
            self.checked.update((rel, c) for c in todo | {FOOTER})
        return damaged

    def _check(self, rel: str, step: StepFile, columns: Iterable[str] | None) -> None:
        backend = self.backend

        def read_ranges(ranges: list[tuple[int, int]]) -> list[bytes]:
            try:
                return backend.read_ranges(self.where(rel), ranges)
            except StoreError as exc:
                if is_missing(exc) and self.relocate(rel):
                    return backend.read_ranges(self.where(rel), ranges)
                raise

        check_chunks(backend.fs_path(rel), step.meta["chunks"], read_ranges, columns)
