"""Fault class: damage, as a matrix. Every kind of file (a group file: a value of a list
column, a value of a column whose name is not an identifier, its footer, the row count in its
footer, a truncation, a deletion; a step file; the IPC cache copy) × every reader (``read``,
``replay`` from the archive and through the cache, SQL ``count(*)`` and values, the
ready-made queries, the command line) × both backends (local disk, and S3 on a loopback moto
server, where DuckDB reads through pyarrow datasets).

The rule checked is the README's: nothing damaged is served. Each reader gives either the
right answer (the damage lay outside what it read) or a :class:`StoreError` naming the
damaged file; with ``on_error="skip"`` it gives the right answer or the right answer without
the damaged unit, with a warning naming the file; ``verify`` names every damaged file (a step
file too, which readers never read: they read its record from the commit log). The store is
uncompressed, so that a
flipped bit in a value is a wrong number, not a decoding error that gives itself away.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import uuid
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from maxent_arrow import RolloutBatch, RolloutStore, RunAnalytics, StoreError
from maxent_arrow.cli import main
from maxent_arrow.testing import make_batch, unit_path

STEPS = range(4)
VICTIM = 1
UNIT = f"step-{VICTIM:010d}.rank-00000.train"
VALUES = (
    'SELECT step, sum(list_sum(q)) AS q, sum("my score") AS m FROM groups GROUP BY step '
    "ORDER BY step"
)
COUNT = "SELECT count(*) AS n FROM groups"


def _build(root: Path, steps) -> None:
    store = RolloutStore.create(root, cache=True, compression="none", compact_every=None)
    for step in steps:
        batch = make_batch(step)
        extra = pa.array([float(step * 10 + g) for g in range(batch.num_groups)])
        store.append(RolloutBatch(batch.groups.append_column("my score", extra), batch.step_row))


def _cli(root: str) -> object:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["query", root, VALUES, "--json", "--on-error", "raise"])
    if code != 0:
        raise StoreError(err.getvalue())
    return json.loads(out.getvalue())


def _readers(where: str) -> dict:
    """Reader name -> call(store, on_error) giving a comparable answer."""

    def analytics(store, on_error):
        with RunAnalytics(store, on_error=on_error) as run:
            return run.entropy_curve().to_pylist()

    readers = {
        "read": lambda s, e: s.read(columns=["step", "q", "my score"], on_error=e).to_pylist(),
        "replay parquet": lambda s, e: [
            (b.step, b.groups.column("q").to_pylist())
            for b in s.replay(source="parquet", columns=["q", "my score"], on_error=e)
        ],
        "sql count": lambda s, e: s.sql(COUNT, on_error=e).to_pylist(),
        "sql values": lambda s, e: s.sql(VALUES, on_error=e).to_pylist(),
        "ready-made query": analytics,
        "command line": lambda s, e: _cli(s.uri),
    }
    if where == "local":  # the IPC cache: only where files can be memory-mapped
        for source in ("cache", "auto"):
            readers[f"replay {source}"] = lambda s, e, source=source: [
                (b.step, b.groups.column("q").to_pylist())
                for b in s.replay(source=source, on_error=e)
            ]
    return readers


@pytest.fixture(scope="module")
def truth(tmp_path_factory) -> dict:
    """The answers of every reader on the undamaged store, and without the victim unit."""
    base = tmp_path_factory.mktemp("matrix")
    _build(base / "all", STEPS)
    _build(base / "without", [s for s in STEPS if s != VICTIM])
    out = {"root": base / "all"}
    for name, read in _readers("local").items():
        if name == "command line":
            continue
        out[name] = read(RolloutStore(base / "all"), "raise")
        out[name, "skip"] = read(RolloutStore(base / "without"), "raise")
    out["command line"] = _cli(str(base / "all"))
    return out


def _row_count_offset(data: bytes, tmp: Path) -> int:
    """A footer byte whose flipped bit makes a plain DuckDB count another number of rows."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    rows, start = meta.num_rows, len(data) - meta.serialized_size - 8
    probe = tmp / "probe.bin"
    for at in range(start, len(data) - 8):
        if data[at] != 2 * rows:
            continue
        probe.write_bytes(data[:at] + bytes([data[at] ^ 0x08]) + data[at + 1 :])
        try:
            got = duckdb.sql(f"SELECT count(*) FROM read_parquet('{probe}')").fetchall()[0][0]
        except duckdb.Error:
            continue
        if got != rows:
            return at
    raise AssertionError("no footer byte changes the row count")


def _last_byte_of(data: bytes, column_path: str) -> int:
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.path_in_schema == column_path:
            return chunk.data_page_offset + chunk.total_compressed_size - 1
    raise KeyError(column_path)


def _same(a: object, b: object) -> bool:
    """Equal, floats up to their last bits (DuckDB's parallel sums add in any order)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


DAMAGE = {
    # name: (file, how)
    "a value of q": ("groups", lambda d, tmp: _flip(d, _last_byte_of(d, "q.list.element"))),
    "a value of 'my score'": ("groups", lambda d, tmp: _flip(d, _last_byte_of(d, "my score"))),
    "the footer": ("groups", lambda d, tmp: _flip(d, len(d) - 64)),
    "the footer's row count": ("groups", lambda d, tmp: _flip(d, _row_count_offset(d, tmp))),
    "a truncated group file": ("groups", lambda d, tmp: d[: len(d) // 2]),
    "a deleted group file": ("groups", lambda d, tmp: None),
    "a step file": ("steps", lambda d, tmp: _flip(d, len(d) // 2)),
    "the IPC cache copy": ("cache", lambda d, tmp: _flip(d, len(d) // 2)),
}


class _Files:
    """Read and replace the bytes of a store's files, on either backend."""

    def __init__(self, fs: pafs.FileSystem, base: str):
        self.fs, self.base = fs, base

    def read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(f"{self.base}/{rel}") as f:
            return f.read()

    def write(self, rel: str, data: bytes | None) -> None:
        if data is None:
            self.fs.delete_file(f"{self.base}/{rel}")
            return
        with self.fs.open_output_stream(f"{self.base}/{rel}") as f:
            f.write(data)


def _store(where: str, truth: dict, tmp_path: Path, request) -> tuple[RolloutStore, _Files]:
    if where == "local":
        root = tmp_path / "store"
        shutil.copytree(truth["root"], root)
        return RolloutStore(root), _Files(pafs.LocalFileSystem(), str(root))
    endpoint, fs = request.getfixturevalue("s3")
    prefix = f"runs/matrix-{uuid.uuid4().hex[:8]}"
    pafs.copy_files(
        str(truth["root"]), prefix, source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
    )  # fmt: skip
    uri = f"s3://{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    return RolloutStore(uri), _Files(fs, prefix)


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_no_reader_serves_damage_on_any_backend(truth, tmp_path, request, where, damage):
    directory, how = DAMAGE[damage]
    if directory == "cache" and where == "s3":
        pytest.skip("no IPC cache on object storage")
    store, files = _store(where, truth, tmp_path, request)
    name = (
        f"{UNIT}.arrow"
        if directory == "cache"
        # The unit's file, under the name of its commit (the unit's and a token).
        else unit_path(RolloutStore(truth["root"]), directory, VICTIM).name
    )
    files.write(f"{directory}/{name}", how(files.read(f"{directory}/{name}"), tmp_path))
    caught = set()
    for reader, read in _readers(where).items():
        try:
            got = read(store, "raise")
        except StoreError as exc:
            assert name in str(exc), (reader, str(exc))
            caught.add(reader)
        else:
            assert _same(got, truth[reader]), f"{reader} served {damage} as good data"
        if reader == "command line":
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = read(store, "skip")
        skipped = [str(w.message) for w in seen if name in str(w.message)]
        assert _same(got, truth[reader, "skip"] if skipped else truth[reader]), (reader, damage)
    # The damage was real: a reader noticed it. A step file is the exception: in a store
    # with a commit log, readers read its record from the log (checked by its CRC-32), and
    # it is a copy for plain readers that verify checks against the log.
    assert bool(caught) == (directory != "steps"), f"readers and {damage}: {caught}"
    report = store.verify()
    assert not report.ok and name in str(report), str(report)
