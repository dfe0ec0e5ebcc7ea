"""The file-system seam of the store: list, stat, read, atomic put, lock.

Two implementations, chosen by :func:`open_backend` from the store's root:

- :class:`LocalBackend` (a path, or ``file://``): a file becomes visible in one ``rename`` (or
  ``link``, which refuses an existing name) of a fully written, fsynced temp file in the same
  directory, then the directory is fsynced; ``flock`` on ``root/.lock`` serialises commits
  and is released by the kernel when its holder dies. A crash leaves the old state or the new
  file, never part of one.
- :class:`ArrowFsBackend` (any ``pyarrow.fs`` file system: ``s3://`` and S3-compatible
  servers, GCS, HDFS): a PUT is atomic (an object is visible whole or not at all), but there
  is neither a conditional create nor a lock. Its commit protocol is **one writer per rank**:
  only rank r writes the files named ``….rank-r….``, so "append each (step, rank, kind) once"
  is checked by a listing before the write, and nothing else needs a lock. Operations that
  rewrite other writers' files (``compact``, ``repair``) and the memory-mapped IPC cache exist
  only on local stores (``docs/commit-protocol.md``).

Paths given to a backend are relative to the store root, ``/``-separated (``groups/x``).
Temp files are hidden names that never end in ``.parquet`` (``.{name}.tmp-{host}.{pid}.{id}``),
so plain ``*.parquet`` globs never see a write in flight.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import json
import logging
import os
import queue
import re
import socket
import stat
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import pyarrow as pa

if TYPE_CHECKING:
    import pyarrow.fs as pafs

from maxent_arrow.errors import ArgumentError, MissingExtraError, StoreError
from maxent_arrow.store.storage.checksums import crc32c_of

__all__ = [
    "ArrowFsBackend",
    "Backend",
    "DuckSource",
    "FileInfo",
    "LocalBackend",
    "Pending",
    "TEMP_MARK",
    "is_temp_name",
    "lock_holder",
    "missing_error",
    "open_backend",
    "temp_final",
    "writer_alive",
]

# A temp file's name: ".{final}.tmp-{host}.{pid}.{random}" (hidden, and not "*.parquet").
TEMP_MARK = ".tmp-"
_TEMP_RE = re.compile(r"^\.(?P<final>.+)\.tmp-(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp file of an unfinished write."""
    return name.startswith(".") and TEMP_MARK in name


def temp_final(name: str) -> str | None:
    """The final name a temp file ``name`` was written for (``None``: not a temp file)."""
    match = _TEMP_RE.match(name)
    return None if match is None else match["final"]


# A temp file whose writer cannot be asked (on another host) counts as abandoned after a day.
STALE_SECONDS = 24 * 3600


def writer_alive(name: str, mtime_ns: int) -> bool:
    """Whether the writer of temp file ``name`` may still be running: its process on this
    host exists, or (another host's, or not ours) the file is younger than a day."""
    match = _TEMP_RE.match(name)
    if match is None or match["host"] != _HOST:
        return time.time() - mtime_ns / 1e9 < STALE_SECONDS
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class DuckSource:
    """What :meth:`Backend.duckdb_source` gives: the ``paths`` DuckDB reads itself (and its
    sandbox allows), or a ``dataset`` to register with the connection instead."""

    paths: tuple[str, ...]
    dataset: Any = None


@dataclass(frozen=True)
class FileInfo:
    """A plain file's name (in its directory), size and modification time."""

    name: str
    size: int
    mtime_ns: int


@dataclass
class Pending:
    """A written, durable file not yet visible under its final name (see
    :meth:`Backend.write_temp`): its size, CRC-32, and the running CRC-32 at every write
    boundary (``(offset, crc of bytes[0:offset])``), from which :mod:`.checksums` derives the
    CRC of any byte range between two boundaries without reading the bytes again;
    ``boundaries_c``: the same for CRC32C (streamed writes only)."""

    final: str
    size: int
    crc: int
    boundaries: list[tuple[int, int]] = field(default_factory=list)
    temp: str | None = None  # local: the temp file's relative path
    data: Any = None  # object stores: the bytes to PUT
    boundaries_c: list[tuple[int, int]] = field(default_factory=list)


class _ThreadedSink:
    """A write-only file for the Parquet writer: chunks go to a thread that writes them to
    ``fd`` (or keeps them) and folds them into a running CRC-32, so encoding and the kernel's
    copy overlap."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self.kept: list[bytes] = []
        self.size = 0
        self.crc = 0
        self.boundaries: list[tuple[int, int]] = [(0, 0)]
        self.crc_c = 0
        self.boundaries_c: list[tuple[int, int]] = [(0, 0)]
        self.error: OSError | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="maxent-arrow-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while (chunk := self._queue.get()) is not None:
            if self.error is not None:
                continue  # drain after a failure; the writer sees the error on its next write
            try:
                if self._fd is None:
                    self.kept.append(chunk)
                else:
                    view = memoryview(chunk)
                    written = 0
                    while written < len(view):
                        written += os.write(self._fd, view[written:])
                self.crc = zlib.crc32(chunk, self.crc)
                self.crc_c = crc32c_of(chunk, self.crc_c)
                offset += len(chunk)
                self.boundaries.append((offset, self.crc & 0xFFFFFFFF))
                self.boundaries_c.append((offset, self.crc_c))
            except OSError as exc:
                self.error = exc

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        chunk = bytes(data)  # the caller may reuse its buffer once we return
        self._queue.put(chunk)
        self.size += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def finish(self) -> None:
        """Wait for the writes; raise the first write error."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


def _stream(produce: Callable[[Any], None], fd: int | None) -> _ThreadedSink:
    sink = _ThreadedSink(fd)
    try:
        produce(sink)
    except BaseException:
        with contextlib.suppress(OSError):
            sink.finish()
        if sink.error is not None:
            raise sink.error from None
        raise
    sink.finish()
    return sink


def missing_error(message: str) -> StoreError:
    """A :class:`StoreError` saying a file is not there (``errno`` ENOENT, so that a reader
    can tell it from damage), with ``message`` as its text."""
    error = StoreError(message)
    error.errno = errno.ENOENT
    return error


def os_error(action: str, path: Any, exc: OSError) -> StoreError:
    """A StoreError that says what failed, where, and why in words a user can act on."""
    reason = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file size limit was reached (disk quota or RLIMIT_FSIZE)",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "permission denied (read-only directory?)",
        errno.EPERM: "operation not permitted (read-only directory?)",
        errno.EROFS: "the file system is read-only",
        errno.ENOENT: "no such file or directory",
    }.get(exc.errno or -1, exc.strerror or str(exc))
    error = StoreError(exc.errno or 0, f"{action} {path}: {reason}")
    error.filename = str(path)
    return error


class Backend(abc.ABC):
    """What the store needs of a file system. Paths are relative to the root.

    Callers ask a backend what it can do, never which kind it is:

    - :attr:`can_lock`: :meth:`lock` serialises commits across processes (``flock``);
    - :attr:`exclusive_create`: :meth:`publish` with ``exclusive=True`` is atomic against a
      concurrent writer of the same name (``link``); without it, an exclusive publish is a
      check then a write, safe only under the one-writer-per-rank protocol;
    - :attr:`can_rewrite`: files other writers committed may be replaced and moved aside
      (``compact``, ``repair``): it needs both of the above;
    - :attr:`can_mmap`: files can be memory-mapped (the IPC cache);
    - :attr:`can_watch`: a directory's new names can be watched by the kernel (inotify on
      :meth:`fs_path`: the live tail waits on it instead of polling);
    - :meth:`duckdb_source`: how DuckDB reads a set of Parquet files of the store, and which
      paths its sandbox must allow.
    """

    can_lock: bool = False
    exclusive_create: bool = False
    can_mmap: bool = False
    can_watch: bool = False
    root: Any  # Path (local) or PurePosixPath (object store), for display and for pyarrow
    uri: str

    @property
    def can_rewrite(self) -> bool:
        """Whether files committed by other writers may be replaced (compaction) or moved
        aside (repair): it takes a lock and an atomic exclusive create."""
        return self.can_lock and self.exclusive_create

    def require(self, ability: str, what: str) -> None:
        """Raise a :class:`StoreError` saying that ``what`` needs ``ability`` (an attribute
        such as ``"can_rewrite"``) when this backend lacks it."""
        if not getattr(self, ability):
            needs = {
                "can_rewrite": "atomic renames and a lock",
                "can_lock": "a lock",
                "can_mmap": "memory-mapped files",
                "exclusive_create": "an atomic exclusive create",
            }.get(ability, ability)
            raise StoreError(
                f"{self.uri}: {what} needs a store on a local file system ({needs}); on object "
                "storage each rank is the only writer of its own files"
            )

    def duckdb_source(self, rels: list[str], schema: pa.Schema) -> DuckSource:
        """How DuckDB reads the Parquet files ``rels`` (one schema): on a file system DuckDB
        can open, by path, and the sandbox allows exactly those paths; otherwise through a
        ``pyarrow`` dataset on this backend's file system (projections and filters pushed
        down; no DuckDB extension), registered with the connection."""
        import pyarrow.dataset as pads  # only here: it costs ~0.7 s to import

        paths = [self.fs_path(rel) for rel in rels]
        dataset = pads.dataset(paths, schema=schema, format="parquet", filesystem=self.filesystem)
        return DuckSource(paths=(), dataset=dataset)

    def path(self, rel: str) -> Any:
        """The full path of ``rel`` (a ``Path`` locally, a ``PurePosixPath`` on ``fs``)."""
        return self.root / rel

    @property
    @abc.abstractmethod
    def filesystem(self) -> pafs.FileSystem:
        """The ``pyarrow.fs`` file system the store's paths live on."""

    def fs_path(self, rel: str) -> str:
        """``rel`` as a path on :attr:`filesystem` (for pyarrow readers)."""
        return str(self.path(rel))

    # -- reading ------------------------------------------------------------------------
    @abc.abstractmethod
    def list(self, directory: str) -> dict[str, FileInfo]:
        """The plain files directly in ``directory`` (none if it does not exist)."""

    @abc.abstractmethod
    def subdirectories(self, directory: str) -> list[str]:
        """The names of the directories directly in ``directory`` (none if it does not
        exist; links are not followed)."""

    @abc.abstractmethod
    def stat(self, rel: str) -> FileInfo | None:
        """``rel``'s size and mtime, or ``None`` if it is not a file."""

    def unchanged(self, stamps: Iterable[tuple[str, int, int]]) -> bool:
        """Whether every ``(fs_path, size, mtime_ns)`` still holds: each file is there, of
        that size and modification time (a held SQL session asks before each query).
        ``False`` where that cannot be told cheaply (object stores: a request per file
        would cost what rebuilding the session costs)."""
        return False

    @abc.abstractmethod
    def is_dir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory."""

    @abc.abstractmethod
    def read(self, rel: str) -> pa.Buffer:
        """All bytes of ``rel``."""

    def read_if_present(self, rel: str) -> pa.Buffer | None:
        """All bytes of ``rel``, or ``None`` when there is no such file (one read: the log's
        probe for its next entry, on an object store one GET)."""
        try:
            return self.read(rel)
        except StoreError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)`` range of ``rel``."""
        with self.open(rel) as f:
            out = []
            for offset, length in ranges:
                f.seek(offset)
                out.append(f.read(length))
            return out

    @abc.abstractmethod
    def open(self, rel: str) -> Any:
        """A random-access file for pyarrow (``pq.ParquetFile``, IPC)."""

    # -- writing ------------------------------------------------------------------------
    @abc.abstractmethod
    def write_temp(self, final: str, data: Any = None, *, produce=None) -> Pending:
        """Write ``data`` (or what ``produce(sink)`` writes) durably, not yet visible as
        ``final``; :meth:`publish` makes it visible, :meth:`discard` drops it."""

    @abc.abstractmethod
    def publish(self, pending: Pending, *, exclusive: bool) -> None:
        """Make ``pending`` visible under its final name, atomically. ``exclusive`` refuses
        (:class:`StoreError`) a name that exists."""

    @abc.abstractmethod
    def discard(self, pending: Pending) -> None:
        """Drop a pending write (a no-op once published)."""

    @abc.abstractmethod
    def open_pending(self, pending: Pending) -> Any:
        """A random-access reader of a pending write's bytes (to read its Parquet footer)."""

    def put_if_absent(
        self, rel: str, data: bytes, *, hint: tuple[str, bytes] | None = None
    ) -> bool:
        """Create ``rel`` holding ``data`` only if no file of that name exists; whether it did.
        Atomic against a concurrent writer of the same name where :attr:`exclusive_create`
        holds (a local ``link``, an S3 conditional PUT); elsewhere a check, then a write:
        safe with one writer only (``docs/commit-protocol.md``). ``hint``: ``(name, bytes)``
        written in place of that file once ``rel`` is created, replaced whole but not made
        durable (what it says is a lower bound a crash may leave older: the log's head)."""
        if self.stat(rel) is not None:
            return False
        self.write_file(rel, data)
        if hint is not None:
            self.write_file(*hint)
        return True

    def write_file(self, final: str, data: Any, *, exclusive: bool = False) -> None:
        """:meth:`write_temp` + :meth:`publish` of ``data``."""
        pending = self.write_temp(final, data)
        try:
            self.publish(pending, exclusive=exclusive)
        finally:
            self.discard(pending)

    def write_derived(self, final: str, data: Any) -> None:
        """Replace ``final`` with ``data`` atomically but not durably: derived data (a take
        file), which every reader checks and which the store can write again, so a crash
        may leave it torn or missing, never half-visible to a running reader. Where an
        object store's put is atomic anyway this is :meth:`write_file` (into its directory,
        made first)."""
        self.makedirs(final.rpartition("/")[0])
        self.write_file(final, data)

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Delete ``rel`` (no error if it is gone)."""

    @abc.abstractmethod
    def move(self, rel: str, dest: str) -> None:
        """Move ``rel`` to ``dest`` (quarantine)."""

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` and its parents."""

    def touch(self, rel: str) -> None:
        """Set ``rel``'s modification time to now (where the file system keeps one that can
        be set; compaction dates what it retires by it)."""
        return None

    @contextlib.contextmanager
    def lock(self, timeout: float | None = None) -> Iterator[None]:
        """Serialise commits across processes (none on object stores: one writer per rank).
        ``timeout``: seconds to wait for another holder before a :class:`StoreError`."""
        yield

    def escapes(self) -> list[tuple[str, str]]:
        """``(relative path, target)`` of each symbolic link among the store's own files
        and directories that resolves outside the store (none on object stores): what
        ``verify`` reports, and what every operation here refuses to follow."""
        return []

    def sync(self, directory: str) -> None:
        """Make renames and removals in ``directory`` durable (object stores: each PUT or
        DELETE is durable when it returns)."""
        return None


class LocalBackend(Backend):
    """A store directory on a local (POSIX) file system."""

    can_lock = True
    exclusive_create = True
    can_mmap = True
    can_watch = True

    def duckdb_source(self, rels: list[str], schema: pa.Schema) -> DuckSource:
        return DuckSource(paths=tuple(self.fs_path(rel) for rel in rels))

    def __init__(self, root: str | os.PathLike[str]):
        text = os.fspath(root)
        if not text or "\x00" in text:
            raise StoreError(f"invalid store root {text!r}")
        path = Path(os.path.abspath(text.removeprefix("file://")))
        if path == Path(path.anchor):
            raise StoreError(f"{path}: refusing a file system root as a store")
        self.root = path
        self.uri = str(path)
        self._fs: pafs.FileSystem | None = None
        self._inside: dict[str, bool] = {}  # directory -> resolves inside the store
        self._root = str(path)
        self._real: str | None = None  # the root, symlinks resolved (on first use)

    def __reduce__(self):
        return (LocalBackend, (str(self.root),))

    @property
    def filesystem(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs = _pafs().LocalFileSystem()
        return self._fs

    def path(self, rel: str) -> Path:
        """The absolute path of ``rel``; a name that resolves outside the store (a symlink
        out, of the file or of a directory above it) is refused, never read or written."""
        return Path(self.fs_path(rel))

    def fs_path(self, rel: str) -> str:
        """:meth:`path` as a string (the readers' fast path: no ``pathlib`` objects)."""
        path = os.path.join(self._root, rel)
        directory = rel.rpartition("/")[0]
        inside = self._inside.get(directory)
        if inside is None:
            root = self.root.resolve()
            inside = (self.root / directory).resolve().is_relative_to(root)
            self._inside[directory] = inside
        # The file itself: one lstat; only a symlink is resolved.
        if not inside or os.path.islink(path):
            resolved = Path(path).resolve()
            if not resolved.is_relative_to(self.root.resolve()):
                raise StoreError(f"{path}: resolves to {resolved}, outside the store {self.root}")
        return path

    def subdirectories(self, directory: str) -> list[str]:
        try:
            entries = list(os.scandir(self.root / directory))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise os_error("cannot list", self.root / directory, exc) from exc
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))

    def list(self, directory: str) -> dict[str, FileInfo]:
        try:
            entries = list(os.scandir(self.root / directory))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise os_error("cannot list", self.root / directory, exc) from exc
        out = {}
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    out[entry.name] = FileInfo(entry.name, st.st_size, st.st_mtime_ns)
            except OSError:
                continue  # removed while listing
        return out

    def stat(self, rel: str) -> FileInfo | None:
        path = os.path.join(self._root, rel) if rel else self._root
        try:
            # In a directory known to be inside the store, one lstat: a plain file is its
            # own answer; a link (or a directory not checked yet) takes fs_path's checks.
            st = None
            if self._inside.get(rel.rpartition("/")[0]) is True:
                st = os.lstat(path)
            if st is None or stat.S_ISLNK(st.st_mode):
                path = self.fs_path(rel)
                st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise os_error("cannot stat", Path(path), exc) from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        return FileInfo(os.path.basename(path), st.st_size, st.st_mtime_ns)

    def unchanged(self, stamps: Iterable[tuple[str, int, int]]) -> bool:
        # One lstat per file (a file replaced by a link is a change: its own size and time).
        lstat = os.lstat
        try:
            for path, size, mtime_ns in stamps:
                st = lstat(path)
                if st.st_size != size or st.st_mtime_ns != mtime_ns:
                    return False
        except OSError:
            return False
        return True

    def is_dir(self, rel: str) -> bool:
        return (self.root / rel).is_dir()

    def read(self, rel: str) -> pa.Buffer:
        data = self.read_if_present(rel)
        if data is None:
            path = Path(self.fs_path(rel))
            raise os_error("cannot read", path, FileNotFoundError(errno.ENOENT, "", str(path)))
        return data

    def read_if_present(self, rel: str) -> pa.Buffer | None:
        path = self.fs_path(rel)
        try:
            with open(path, "rb") as f:
                return pa.py_buffer(f.read())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise os_error("cannot read", Path(path), exc) from exc

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        path = self.fs_path(rel)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise os_error("cannot read", path, exc) from exc
        try:
            return [os.pread(fd, length, offset) for offset, length in ranges]
        finally:
            os.close(fd)

    def open(self, rel: str) -> Any:
        path = self.path(rel)
        try:
            return pa.OSFile(str(path), "rb")
        except (OSError, pa.ArrowException) as exc:
            if isinstance(exc, FileNotFoundError):
                raise os_error("cannot read", path, exc) from exc
            raise StoreError(f"cannot read {path}: {exc}") from None

    def _temp_name(self, final: str) -> str:
        directory, _, name = final.rpartition("/")
        temp = f".{name}{TEMP_MARK}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        return f"{directory}/{temp}" if directory else temp

    def _real_root(self) -> str:
        if self._real is None:
            self._real = os.path.realpath(self._root)
        return self._real

    def _within(self, path: str) -> bool:
        real, root = os.path.realpath(path), self._real_root()
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    def _write_dir(self, directory: str) -> str:
        """The absolute path of the store directory ``directory`` to create or move a file
        in; one that resolves outside the store (a symlink out, of it or of a directory
        above it) is refused: nothing is ever written through it."""
        path = os.path.join(self._root, directory) if directory else self._root
        if not self._within(path):
            raise StoreError(
                f"{path}: resolves to {os.path.realpath(path)}, outside the store {self.root}; "
                "nothing is written there"
            )
        return path

    def write_temp(self, final: str, data: Any = None, *, produce=None) -> Pending:
        temp = self._temp_name(final)
        self._write_dir(temp.rpartition("/")[0])
        path = self.root / temp
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise os_error("cannot create a file in", path.parent, exc) from exc
        try:
            if produce is None:
                view = memoryview(data).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written : written + (64 << 20)])
                size, crc = len(view), zlib.crc32(view) & 0xFFFFFFFF
                boundaries, chunk_boundaries = [(0, 0), (size, crc)], []
            else:
                sink = _stream(produce, fd)
                size, crc, boundaries = sink.size, sink.crc & 0xFFFFFFFF, sink.boundaries
                chunk_boundaries = sink.boundaries_c
            os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise os_error("cannot write", self.root / final, exc) from exc
            raise
        os.close(fd)
        return Pending(final, size, crc, boundaries, temp=temp, boundaries_c=chunk_boundaries)

    def publish(self, pending: Pending, *, exclusive: bool) -> None:
        temp, final = self.root / pending.temp, self.path(pending.final)
        try:
            if exclusive:
                try:
                    os.link(temp, final)
                except FileExistsError:
                    raise StoreError(errno.EEXIST, f"{final} already exists") from None
                os.unlink(temp)
            else:
                os.replace(temp, final)
            self.sync(final.parent.relative_to(self.root).as_posix())
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise os_error("cannot write", final, exc) from exc

    def open_pending(self, pending: Pending) -> Any:
        return pa.OSFile(str(self.root / pending.temp), "rb")

    def discard(self, pending: Pending) -> None:
        if pending.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.root / pending.temp)

    def write_derived(self, final: str, data: Any) -> None:
        temp = self._temp_name(final)
        self._write_dir(temp.rpartition("/")[0])  # (refused outside the store)
        path = self.root / temp
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the first file of its directory
                self.makedirs(temp.rpartition("/")[0])
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise os_error("cannot create a file in", path.parent, exc) from exc
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written : written + (64 << 20)])
            os.close(fd)
            fd = -1
            os.replace(path, self.path(final))  # (no fsync: derived data)
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise os_error("cannot write", self.root / final, exc) from exc
            raise

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(rel))

    def move(self, rel: str, dest: str) -> None:
        source = self.path(rel)
        directory, _, name = dest.rpartition("/")
        self.makedirs(directory)
        target = os.path.join(self._write_dir(directory), name)
        if os.path.islink(target):
            raise StoreError(f"{target}: a symbolic link; nothing is moved onto it")
        os.replace(source, target)

    def makedirs(self, rel: str) -> None:
        """Create the store directory ``rel`` and its parents (the store's root and the
        directories above it included, as ``mkdir -p``), each new directory's parent
        fsynced so that the new entry is durable. A directory of the store that resolves
        outside it is refused."""
        missing = []
        above = self.root
        while not os.path.lexists(above) and above != above.parent:
            missing.append(above)
            above = above.parent
        parts = list(filter(None, rel.split("/")))
        try:
            for directory in reversed(missing):
                self._mkdir(str(directory))
            for i in range(len(parts)):
                path = os.path.join(self._root, *parts[: i + 1])
                if os.path.lexists(path):
                    self._write_dir("/".join(parts[: i + 1]))
                else:
                    self._mkdir(path)
        except FileExistsError:  # created meanwhile by another rank
            return self.makedirs(rel)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise os_error("cannot create", self.root / rel, exc) from exc

    def touch(self, rel: str) -> None:
        os.utime(self.path(rel))

    @staticmethod
    def _mkdir(path: str) -> None:
        os.mkdir(path)
        _fsync_dir(os.path.dirname(path) or ".")

    def escapes(self) -> list[tuple[str, str]]:
        out = []
        for directory in ("", "groups", "steps", "cache", "retired", "quarantine"):
            base = os.path.join(self._root, directory) if directory else self._root
            try:
                entries = list(os.scandir(base))
            except OSError:
                continue
            for entry in entries:
                if entry.is_symlink() and not self._within(entry.path):
                    rel = f"{directory}/{entry.name}" if directory else entry.name
                    out.append((rel, os.path.realpath(entry.path)))
        return out

    def put_if_absent(
        self, rel: str, data: bytes, *, hint: tuple[str, bytes] | None = None
    ) -> bool:
        pending = self.write_temp(rel, data)
        try:
            self.publish(pending, exclusive=True)
        except StoreError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise
        finally:
            self.discard(pending)
        if hint is not None:
            # Replaced whole (a rename), not fsynced: a crash may leave the older hint.
            name, content = hint
            final, temp = self.fs_path(name), self.fs_path(self._temp_name(name))
            try:
                with open(temp, "wb") as f:
                    f.write(content)
                os.replace(temp, final)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise os_error("cannot write", Path(final), exc) from exc
        return True

    @contextlib.contextmanager
    def lock(self, timeout: float | None = None) -> Iterator[None]:
        """An exclusive ``flock`` on ``root/.lock`` around a commit (released by the kernel
        if the holder dies, SIGKILL included). The holder writes its pid, host and start
        time into the file (and clears them when done), so that a process waiting for it
        can say whom it waits for: after :data:`LOCK_REPORT_SECONDS` a warning names the
        holder (a stopped process holds its lock forever); after ``timeout`` seconds
        (``None``: no limit) the wait is a :class:`StoreError` naming it."""
        path = os.path.join(self._write_dir(""), ".lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StoreError(f"{path}: a symbolic link; refusing it as the lock") from None
            raise os_error("cannot open the lock file", path, exc) from exc
        try:
            _acquire(fd, path, timeout)
            try:
                holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps(holder).encode(), 0)
                except OSError as exc:  # a full disk, a quota: before anything is committed
                    raise os_error("cannot record the lock's holder in", path, exc) from exc
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def sync(self, directory: str) -> None:
        _fsync_dir(str(self.root / directory))


def _fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a new file's or directory's name)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A process waiting for the store lock says whom it waits for after this long.
LOCK_REPORT_SECONDS = 2.0
_log = logging.getLogger("maxent_arrow.store")


def lock_holder(path: str) -> str:
    """Who holds the lock at ``path``, in words, from what the holder wrote into it."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4096) or b"{}")
        pid, host, since = int(record["pid"]), str(record["host"]), float(record["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that recorded no pid (an older writer?)"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    text = f"pid {pid} on host {host} (holding it since {when})"
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return (
                f"a process that inherited it from pid {pid} on this host, which is gone "
                f"(holding it since {when})"
            )
        except PermissionError:
            pass
    return text


def _acquire(fd: int, path: str, timeout: float | None) -> None:
    """``flock(fd, LOCK_EX)``, saying whom it waits for after a while, and giving up after
    ``timeout`` seconds."""
    start = time.monotonic()
    reported = False
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise StoreError(
                errno.ETIMEDOUT,
                f"{path}: gave up after {timeout:g} s waiting for the store lock, held by "
                f"{lock_holder(path)}",
            )
        if not reported and waited >= LOCK_REPORT_SECONDS:
            reported = True
            _log.warning(
                "%s: waiting for the store lock, held by %s; a stopped process holds it until "
                "it is continued or killed (lock_timeout= / --lock-timeout bound the wait)",
                path,
                lock_holder(path),
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class ArrowFsBackend(Backend):
    """A store on a ``pyarrow.fs`` file system (object storage): one writer per rank."""

    def __init__(self, filesystem: pafs.FileSystem, root: str, uri: str):
        root = root.rstrip("/")
        if not root.strip("/"):
            raise StoreError(f"{uri}: refusing a bucket or file system root as a store")
        self._fs = filesystem
        self.root = PurePosixPath(root)
        self.uri = uri
        # S3 (and S3-compatible servers) create an object exclusively with a conditional PUT
        # (If-None-Match: *), which pyarrow.fs does not expose: through boto3.
        self._s3: Any = None
        self.exclusive_create = filesystem.type_name == "s3" and _has_boto3()

    def _s3_client(self) -> Any:
        """A boto3 client for this store's S3 endpoint (its options from the pyarrow file
        system: endpoint, scheme, region, explicit keys; else boto3's own credential chain)."""
        if self._s3 is None:
            import boto3  # only here: the `s3` extra, for conditional creates

            options = self._fs.__reduce__()[1][0]
            endpoint = options.get("endpoint_override") or None
            if endpoint and "://" not in endpoint:
                endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
            keys = {}
            if options.get("access_key"):
                keys = {
                    "aws_access_key_id": options["access_key"],
                    "aws_secret_access_key": options.get("secret_key") or None,
                    "aws_session_token": options.get("session_token") or None,
                }
            self._s3 = boto3.client(
                "s3", endpoint_url=endpoint, region_name=options.get("region") or None, **keys
            )
        return self._s3

    def _get(self, rel: str) -> pa.Buffer:
        """All bytes of ``rel`` in one GET: one version of an object that commits overwrite
        (the log's head, the checkpoint pointer). pyarrow's stream asks for the size first and
        then GETs that many bytes, so an overwrite in between gives the new bytes cut or padded
        to the old size."""
        bucket, _, key = str(self.root / rel).partition("/")
        client = self._s3_client()
        try:
            return pa.py_buffer(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        except client.exceptions.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                raise missing_error(f"{self.root / rel}: missing") from None
            raise StoreError(f"{self.root / rel}: cannot read ({exc})") from None

    def put_if_absent(
        self, rel: str, data: bytes, *, hint: tuple[str, bytes] | None = None
    ) -> bool:
        if not self.exclusive_create:
            if self._fs.type_name == "s3":
                # Check-then-write would let two ranks both take a log version on S3, and
                # ranks commit at the same instant: never fall back to it silently.
                # (Committing to S3 needs boto3's conditional create: pyarrow.fs has none.)
                raise MissingExtraError("boto3", "s3")
            return super().put_if_absent(rel, data, hint=hint)
        bucket, _, key = str(self.root / rel).partition("/")
        client = self._s3_client()
        try:
            client.put_object(Bucket=bucket, Key=key, Body=bytes(data), IfNoneMatch="*")
        except client.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise StoreError(f"cannot write {self.root / rel}: {exc}") from None
        if hint is not None:
            name, content = hint
            bucket, _, key = str(self.root / name).partition("/")
            try:
                client.put_object(Bucket=bucket, Key=key, Body=bytes(content))
            except client.exceptions.ClientError as exc:
                raise StoreError(f"cannot write {self.root / name}: {exc}") from None
        return True

    def __reduce__(self):
        return (ArrowFsBackend, (self._fs, str(self.root), self.uri))

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._fs

    def subdirectories(self, directory: str) -> list[str]:
        selector = _pafs().FileSelector(str(self.root / directory), allow_not_found=True)
        try:
            infos = self._fs.get_file_info(selector)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot list {self.root / directory}: {exc}") from None
        return sorted(i.base_name for i in infos if i.type == _pafs().FileType.Directory)

    def list(self, directory: str) -> dict[str, FileInfo]:
        selector = _pafs().FileSelector(str(self.root / directory), allow_not_found=True)
        try:
            infos = self._fs.get_file_info(selector)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot list {self.root / directory}: {exc}") from None
        return {
            i.base_name: FileInfo(i.base_name, i.size, i.mtime_ns or 0)
            for i in infos
            if i.type == _pafs().FileType.File
        }

    def _info(self, rel: str) -> pafs.FileInfo:
        try:
            return self._fs.get_file_info(str(self.root / rel))
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{self.root / rel}: cannot stat ({exc})") from None

    def stat(self, rel: str) -> FileInfo | None:
        info = self._info(rel)
        if info.type != _pafs().FileType.File:
            return None
        return FileInfo(info.base_name, info.size, info.mtime_ns or 0)

    def is_dir(self, rel: str) -> bool:
        return self._info(rel).type == _pafs().FileType.Directory

    def read(self, rel: str) -> pa.Buffer:
        if self.exclusive_create:
            return self._get(rel)
        try:
            with self._fs.open_input_stream(str(self.root / rel)) as stream:
                return stream.read_buffer()
        except FileNotFoundError:
            raise missing_error(f"{self.root / rel}: missing") from None
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{self.root / rel}: cannot read ({exc})") from None

    def open(self, rel: str) -> Any:
        try:
            return self._fs.open_input_file(str(self.root / rel))
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{self.root / rel}: cannot read ({exc})") from None

    def write_temp(self, final: str, data: Any = None, *, produce=None) -> Pending:
        # An object store has no rename: the bytes wait in memory and one PUT publishes them.
        if produce is None:
            buffer = pa.py_buffer(data) if not isinstance(data, pa.Buffer) else data
            crc = zlib.crc32(memoryview(buffer)) & 0xFFFFFFFF
            return Pending(final, buffer.size, crc, [(0, 0), (buffer.size, crc)], data=buffer)
        sink = _stream(produce, None)
        return Pending(
            final,
            sink.size,
            sink.crc & 0xFFFFFFFF,
            sink.boundaries,
            data=b"".join(sink.kept),
            boundaries_c=sink.boundaries_c,
        )

    def publish(self, pending: Pending, *, exclusive: bool) -> None:
        path = str(self.root / pending.final)
        if exclusive and self.stat(pending.final) is not None:
            raise StoreError(errno.EEXIST, f"{path} already exists")
        try:
            with self._fs.open_output_stream(path) as out:
                out.write(pending.data)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot write {path}: {exc}") from None

    def open_pending(self, pending: Pending) -> Any:
        return pa.BufferReader(pending.data)

    def discard(self, pending: Pending) -> None:
        pending.data = None

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.delete_file(str(self.root / rel))

    def move(self, rel: str, dest: str) -> None:
        self._fs.move(str(self.root / rel), str(self.root / dest))

    def makedirs(self, rel: str) -> None:
        # Real directories on file systems that have them; a no-op marker on object stores.
        try:
            self._fs.create_dir(str(self.root / rel), recursive=True)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot create {self.root / rel}: {exc}") from None


def _has_boto3() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("boto3") is not None
    except (ImportError, ValueError):
        return False


def _pafs() -> Any:
    """``pyarrow.fs``, imported when first needed: it costs ~0.1 s (TLS for S3), which a
    local store and the command line never pay."""
    import pyarrow.fs

    return pyarrow.fs


def open_backend(
    root: str | os.PathLike[str] | Backend, filesystem: pafs.FileSystem | None = None
) -> Backend:
    """The backend of ``root``: a :class:`LocalBackend` for a path or ``file://`` URI, an
    :class:`ArrowFsBackend` for any other URI pyarrow understands (``s3://bucket/prefix`` with
    options such as ``?endpoint_override=host:port&scheme=http`` in the query) or for a path
    on an explicit ``filesystem``."""
    if isinstance(root, Backend):
        return root
    text = os.fspath(root) if isinstance(root, str | os.PathLike) else None
    if not isinstance(text, str):
        raise ArgumentError(
            f"root: expected a store's path (str or os.PathLike) or URI, got {root!r}"
        )
    if not text or "\x00" in text:
        raise StoreError(f"invalid store root {text!r}")
    if filesystem is not None:
        if isinstance(filesystem, _pafs().LocalFileSystem):
            return LocalBackend(text)
        parsed = urlparse(text)
        path = parsed.netloc + parsed.path if parsed.scheme and len(parsed.scheme) > 1 else text
        return ArrowFsBackend(filesystem, path, text)
    if "://" not in text or text.startswith("file://"):
        return LocalBackend(text)
    try:
        fs, path = _pafs().FileSystem.from_uri(text)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise StoreError(f"{text}: no pyarrow file system for this URI ({exc})") from None
    return ArrowFsBackend(fs, path, text)
