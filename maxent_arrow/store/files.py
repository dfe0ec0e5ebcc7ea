"""Durable, atomic files for the rollout store: names, temp files, fsync, checksums, locks.

A file becomes visible in one ``rename`` (or ``link``) of a fully written, fsynced temp file
in the same directory, followed by an fsync of the directory, so a crash leaves either the old
state or the new file, never part of one. Temp names start with ``.tmp-`` and carry the host
and process id, so ``cleanup_temp`` removes only the leftovers of dead writers (another live
rank's in-flight temp file is left alone).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import queue
import re
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError

__all__ = [
    "UNIT_RE",
    "COMPACT_RE",
    "TEMP_PREFIX",
    "unit_name",
    "compact_name",
    "write_atomic",
    "fsync_dir",
    "crc32_of",
    "cleanup_temp",
    "store_lock",
    "os_error",
    "check_root",
    "parquet_bytes",
    "write_parquet",
    "open_manifest",
    "prepare_temp",
    "commit_temp",
    "discard_temp",
]

TEMP_PREFIX = ".tmp-"
UNIT_RE = re.compile(r"^step-(\d{10})\.rank-(\d{5})\.([a-z][a-z0-9_]{0,31})\.(parquet|arrow)$")
COMPACT_RE = re.compile(r"^compact-(\d{10})-(\d{10})\.([a-z][a-z0-9_]{0,31})\.parquet$")
_TEMP_RE = re.compile(r"^\.tmp-(?P<host>[^.]+)\.(?P<pid>\d+)\.")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"
_STALE_SECONDS = 24 * 3600

MAX_STEP = 10**10 - 1
MAX_RANK = 10**5 - 1


def unit_name(step: int, rank: int, kind: str, ext: str = "parquet") -> str:
    """``step-{step:010d}.rank-{rank:05d}.{kind}.{ext}``; out-of-range numbers are refused."""
    if not 0 <= step <= MAX_STEP:
        raise StoreError(f"step {step} out of range [0, {MAX_STEP}] for the store's file names")
    if not 0 <= rank <= MAX_RANK:
        raise StoreError(f"rank {rank} out of range [0, {MAX_RANK}] for the store's file names")
    name = f"step-{step:010d}.rank-{rank:05d}.{kind}.{ext}"
    if not UNIT_RE.match(name):
        raise StoreError(f"kind {kind!r} does not make a valid store file name")
    return name


def compact_name(first: int, last: int, kind: str) -> str:
    return f"compact-{first:010d}-{last:010d}.{kind}.parquet"


def os_error(action: str, path: Path, exc: OSError) -> StoreError:
    """A StoreError that says what failed, where, and why in words a user can act on."""
    reason = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file size limit was reached (disk quota or RLIMIT_FSIZE)",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "permission denied (read-only directory?)",
        errno.EPERM: "operation not permitted (read-only directory?)",
        errno.EROFS: "the file system is read-only",
    }.get(exc.errno or -1, exc.strerror or str(exc))
    error = StoreError(exc.errno or 0, f"{action} {path}: {reason}")
    error.filename = str(path)
    return error


def _temp_path(final: Path) -> Path:
    return final.with_name(
        f"{TEMP_PREFIX}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{final.name}"
    )


def check_root(root: str | os.PathLike[str]) -> Path:
    text = os.fspath(root)
    if not text or "\x00" in text:
        raise StoreError(f"invalid store root {text!r}")
    path = Path(os.path.abspath(text))
    if path.exists() and not path.is_dir():
        raise StoreError(f"{path}: exists and is not a directory")
    if path == Path(path.anchor):
        raise StoreError(f"{path}: refusing a file system root as a store")
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ThreadedSink:
    """A write-only file for the Parquet writer: chunks go to a thread that writes them to
    ``fd`` and folds them into a CRC-32, so encoding and the kernel's copy overlap."""

    def __init__(self, fd: int):
        self._fd = fd
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self.size = 0
        self.crc = 0
        self.error: OSError | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="maxent-arrow-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self.error is not None:
                continue  # drain after a failure; the writer sees the error on its next write
            try:
                view = memoryview(chunk)
                written = 0
                while written < len(view):
                    written += os.write(self._fd, view[written:])
                self.crc = zlib.crc32(chunk, self.crc)
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


def prepare_temp(final: Path, data=None, *, produce=None) -> tuple[Path, int, int]:
    """Write ``data`` (or what ``produce(sink)`` writes) durably to a temp file beside ``final``.

    Returns ``(temp, size, crc32)``; the temp file is fsynced. On any error it is removed and a
    :class:`StoreError` says why (a full disk, a file size limit, a read-only directory).
    """
    temp = _temp_path(final)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise os_error("cannot create a file in", final.parent, exc) from exc
    try:
        if produce is None:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written : written + (64 << 20)])
            size, crc = len(view), crc32_of(view)
        else:
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
            size, crc = sink.size, sink.crc & 0xFFFFFFFF
        os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError) and not isinstance(exc, StoreError):
            raise os_error("cannot write", final, exc) from exc
        raise
    os.close(fd)
    return temp, size, crc


def commit_temp(temp: Path, final: Path, *, overwrite: bool) -> None:
    """Rename (``overwrite``) or hard-link (refusing an existing ``final``) a prepared temp file
    into place, then fsync the directory. The temp file is gone afterwards either way."""
    try:
        if overwrite:
            os.replace(temp, final)
        else:
            try:
                os.link(temp, final)
            except FileExistsError:
                raise StoreError(errno.EEXIST, f"{final} already exists") from None
            os.unlink(temp)
        fsync_dir(final.parent)
    except OSError as exc:
        discard_temp(temp)
        if isinstance(exc, StoreError):
            raise
        raise os_error("cannot write", final, exc) from exc


def discard_temp(temp: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temp)


def write_atomic(final: Path, data, *, overwrite: bool = True) -> None:
    """Write ``data`` (bytes or a buffer) to ``final`` atomically and durably.

    The bytes go to a temp file in the same directory, which is fsynced, then renamed over
    ``final`` (``overwrite=True``) or hard-linked to it (``overwrite=False``: fails with
    :class:`StoreError` if ``final`` exists, atomically, even against other processes), and the
    directory is fsynced. On any error the temp file is removed and ``final`` is untouched.
    """
    temp, _, _ = prepare_temp(final, data)
    commit_temp(temp, final, overwrite=overwrite)


def crc32_of(data) -> int:
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


# A step file carries the CRC-32 of its own bytes in the footer's key-value metadata: the file
# is written with a placeholder, the CRC is taken with the placeholder zeroed, then patched in
# (same length, so the footer stays valid). The key is added by the Parquet writer only, not
# to the Arrow schema (which would embed a second, base64 copy).
SEAL_KEY = b"maxent_arrow.file_crc32"
_SEAL_MARK = b"maxent-crc32="
SEAL_PLACEHOLDER = _SEAL_MARK + b"00000000"


def seal(data: bytes) -> bytes:
    """Patch the CRC-32 of ``data`` (placeholder zeroed) into its placeholder."""
    at = data.rfind(SEAL_PLACEHOLDER)
    if at < 0:
        raise StoreError("seal: no checksum placeholder in the file")
    crc = crc32_of(data)
    out = bytearray(data)
    start = at + len(_SEAL_MARK)
    out[start : start + 8] = f"{crc:08x}".encode()
    return bytes(out)


def check_seal(data: bytes) -> bool | None:
    """Whether ``data`` matches the CRC-32 sealed into it (``None``: the file has no seal)."""
    at = data.rfind(_SEAL_MARK)
    if at < 0:
        return None
    start = at + len(_SEAL_MARK)
    stored = data[start : start + 8]
    try:
        expected = int(stored, 16)
    except ValueError:
        return False
    zeroed = data[:start] + b"00000000" + data[start + 8 :]
    return crc32_of(zeroed) == expected


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_temp(directory: Path) -> list[Path]:
    """Remove temp files left by dead writers on this host (or older than a day anywhere)."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        match = _TEMP_RE.match(entry.name)
        try:
            stale = now - entry.stat().st_mtime > _STALE_SECONDS
        except OSError:
            continue
        dead = match is not None and match["host"] == _HOST and not _alive(int(match["pid"]))
        if dead or stale:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def store_lock(root: Path) -> Iterator[None]:
    """An exclusive lock on ``root/.lock`` around the short commit section of an append.

    ``flock`` is released by the kernel when the holder dies (SIGKILL included), so a crash
    never leaves the store locked.
    """
    path = root / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise os_error("cannot open the lock file", path, exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ---------------------------------------------------------------------------- Parquet
def _split_columns(schema: pa.Schema) -> list[str]:
    """Parquet paths of the per-token float columns (``name.list.element.list.element``)."""
    paths = []
    for name in S.PER_TOKEN_COLUMNS:
        if name in schema.names:
            kind = schema.field(name).type
            while pa.types.is_list(kind) or pa.types.is_large_list(kind):
                kind = kind.value_type
            if pa.types.is_floating(kind):
                paths.append(f"{name}.list.element.list.element")
    return paths


def write_parquet(
    sink,
    table: pa.Table,
    metadata: dict[bytes, bytes],
    *,
    statistics: list[str],
    dictionary: list[str] | bool = False,
    sealed: bool = False,
    compression: str = "zstd",
    compression_level: int | None = 1,
) -> None:
    """Write ``table`` as one Parquet file to ``sink`` with the store's settings."""
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    if compression in ("none", "uncompressed", None):
        compression, compression_level = "none", None
    # zstd level 1: token ids and log-probs compress little more at higher levels, which cost
    # several times the time; dictionary encoding is off for them (DESIGN §5).
    with pq.ParquetWriter(
        sink,
        table.schema,
        compression=compression,
        compression_level=compression_level,
        use_dictionary=dictionary,
        write_statistics=statistics,
        write_page_checksum=True,
        store_schema=True,
        # Byte-stream split makes float log-probs compress better at no extra cost.
        use_byte_stream_split=_split_columns(table.schema),
    ) as writer:
        # One row group per append: a step is read whole, and one chunk per column means
        # readers get contiguous arrays without a concatenating copy.
        writer.write_table(table, row_group_size=max(table.num_rows, 1))
        if sealed:
            writer.add_key_value_metadata({SEAL_KEY: SEAL_PLACEHOLDER})


def parquet_bytes(table: pa.Table, metadata: dict[bytes, bytes], **options) -> pa.Buffer | bytes:
    """Parquet bytes in memory (so a CRC can be of exactly what is written); sealed files come
    back with their own CRC patched in."""
    sink = pa.BufferOutputStream()
    write_parquet(sink, table, metadata, **options)
    if options.get("sealed"):
        return seal(sink.getvalue().to_pybytes())
    return sink.getvalue()


# ---------------------------------------------------------------------------- manifest
def open_manifest(root: Path, dirs: tuple[Path, ...], fmt: str, config: dict) -> dict:
    """Read ``root/manifest.json``, creating the store (directories, then the manifest) if
    missing. Refuses a non-empty directory that is not a store, another format and a newer
    schema major version."""
    import datetime as dt
    import json

    manifest_path = root / "manifest.json"
    if root.exists() and not manifest_path.exists():
        # Our own directories without a manifest: a store being created by another rank
        # right now, or a creation interrupted before the manifest was written.
        own = {"groups", "steps", "cache", ".lock"}
        if any(p.name not in own and not p.name.startswith(TEMP_PREFIX) for p in root.iterdir()):
            raise StoreError(f"{root}: not a rollout store (no manifest.json) and not empty")
    if not manifest_path.exists():
        manifest = {
            "format": fmt,
            "schema_version": S.SCHEMA_VERSION,
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "config": config,
        }
        try:
            for directory in (root, *dirs):
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error("cannot create the store at", root, exc) from exc
        with contextlib.suppress(StoreError):
            # Another rank may create the manifest first; theirs wins (link refuses ours).
            write_atomic(manifest_path, json.dumps(manifest, indent=2).encode(), overwrite=False)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{manifest_path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise StoreError(f"{manifest_path}: not a {fmt} manifest")
    S.check_version(manifest.get("schema_version"), where=str(manifest_path))
    if os.access(root, os.W_OK):
        for directory in dirs:
            if not directory.exists():
                with contextlib.suppress(OSError):
                    directory.mkdir()
    return manifest


# ---------------------------------------------------------------------------- units
OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class _Unit:
    """One committed (step, rank, kind): where its step row and group rows are."""

    step: int
    rank: int
    kind: str
    step_file: str
    group_file: str
    row: int  # its row in the step file
    start: int  # its first row in the group file
    num_groups: int

    @property
    def name(self) -> str:
        return unit_name(self.step, self.rank, self.kind)


def _json_meta(schema: pa.Schema, key: bytes) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(key)
    return json.loads(raw) if raw else {}


def _check_on_error(value: str) -> OnError:
    if value not in ("raise", "skip"):
        raise StoreError(f"on_error must be 'raise' or 'skip', got {value!r}")
    return value  # type: ignore[return-value]


def _jsonable_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        return json.loads(json.dumps(dict(config)))
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"RolloutStore config: expected JSON-serialisable values ({exc})"
        ) from None


def _step_set(steps: Iterable[int] | int) -> set[int]:
    if isinstance(steps, int):
        return {steps}
    if isinstance(steps, range):
        return set(steps)
    return {int(s) for s in steps}


def _sort_key(name: str) -> tuple:
    match = UNIT_RE.match(name)
    if match:
        return (int(match.group(1)), match.group(3), int(match.group(2)), 1)
    match = COMPACT_RE.match(name)
    return (int(match.group(1)), match.group(3), -1, 0)


def check_compression(compression: str, level: int | None) -> tuple[str, int | None]:
    """The Parquet codec of group files and its level (kept only for codecs that have one)."""
    if compression not in ("zstd", "lz4", "snappy", "gzip", "brotli", "none"):
        raise StoreError(
            f"compression: expected zstd, lz4, snappy, gzip, brotli or none, got {compression!r}"
        )
    return compression, level if compression in ("zstd", "gzip", "brotli") else None
