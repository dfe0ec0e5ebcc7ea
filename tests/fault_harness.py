"""What the reliability tests share: writer subprocesses (killed with SIGKILL at a named point
of a commit, or at a random moment), damage to files, and the invariants a store keeps through
every fault: nothing acknowledged is lost, nothing is visible twice, nothing damaged is served.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from maxent_arrow import RolloutStore
from maxent_arrow.store.storage.crashpoints import CRASH_POINTS
from maxent_arrow.testing import make_batch

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def env() -> dict[str, str]:
    """The environment of a subprocess: this checkout first on the path, and whatever the
    test set meanwhile (an S3 server's credentials)."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}


# Appends steps of one rank, saying BEGIN/ACK around each; MAXENT_ARROW_CRASH_AT kills it at a
# named point of a commit. Arguments: store, rank, first step, last step (exclusive), groups.
WRITER = textwrap.dedent(
    """
    import sys
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore
    root = sys.argv[1]
    rank, first, last, groups = (int(a) for a in sys.argv[2:6])
    store = RolloutStore.create(root, cache=True)
    done = set(store.steps(rank=rank))
    todo = [s for s in range(first, last) if s not in done]
    batches = [make_batch(s, rank=rank, groups=groups, k=(4, 8), max_tokens=128) for s in todo]
    print("READY", flush=True)
    for batch in batches:
        print("BEGIN", batch.step, flush=True)
        store.append(batch)
        print("ACK", batch.step, flush=True)
    print("DONE", flush=True)
    """
)

# Compacts a store (optionally of some ranks); MAXENT_ARROW_CRASH_AT kills it at a named point.
COMPACTOR = textwrap.dedent(
    """
    import json, sys
    from maxent_arrow import RolloutStore
    store = RolloutStore(sys.argv[1])
    ranks = json.loads(sys.argv[2])
    made = store.compact(ranks=ranks, max_steps=int(sys.argv[3]) if len(sys.argv) > 3 else None)
    print("COMPACTED", json.dumps([p.name for p in made]), flush=True)
    """
)

# The crash points of an append and of a compaction, from the registry (every declared point).
APPEND_POINTS = sorted(n for n, p in CRASH_POINTS.items() if p.operation == "append")
COMPACT_POINTS = sorted(n for n, p in CRASH_POINTS.items() if p.operation == "compact")


def expected(step: int, rank: int = 0, groups: int = 6):
    """What the WRITER appends for (step, rank)."""
    return make_batch(step, rank=rank, groups=groups, k=(4, 8), max_tokens=128)


def run_script(script: str, *args, crash_at: str | None = None, timeout: int = 300):
    environ = env()
    environ.pop("MAXENT_ARROW_CRASH_AT", None)
    if crash_at is not None:
        environ["MAXENT_ARROW_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )


def acked(stdout: str) -> set[int]:
    return {int(line.split()[1]) for line in stdout.splitlines() if line.startswith("ACK")}


def flip(path: Path, at: int) -> None:
    """Flip one bit of the byte at offset ``at``."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def flip_chunk(path: Path, column: str, *, keep_mtime: bool) -> None:
    """Flip one byte in the middle of ``column``'s chunk (first row group) of Parquet file
    ``path``, in place (its size kept); with ``keep_mtime``, its modification time put back
    as it was: damage a stat of the file cannot see."""
    import pyarrow.parquet as pq

    rg = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(
        rg.column(i)
        for i in range(rg.num_columns)
        if rg.column(i).path_in_schema.split(".")[0] == column
    )
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    offset = start + chunk.total_compressed_size // 2
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert os.stat(path).st_size == before.st_size


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def assert_sound(
    store: RolloutStore, want: dict[tuple[int, int], object], *, exact: bool = True
) -> None:
    """The store's invariants: every unit in ``want`` ((step, rank) -> expected batch) is
    there exactly once with exactly its rows (``exact``: and nothing else), through every
    reader; verify finds no damage."""
    units = [(u.step, u.rank) for u in store.units(kind="train")]
    assert len(units) == len(set(units)), f"a unit is visible twice: {sorted(units)}"
    missing = set(want) - set(units)
    assert not missing, f"acknowledged units lost: {sorted(missing)}"
    if exact:
        assert set(units) == set(want), f"unexpected units: {sorted(set(units) - set(want))}"
    report = store.verify()
    assert report.ok, str(report)
    for source in ("parquet", "auto"):
        for batch in store.replay(source=source):
            key = (batch.step, batch.rank)
            if key in want:
                diff = [
                    n
                    for n in want[key].groups.schema.names
                    if not batch.groups.column(n).equals(want[key].groups.column(n))
                ]
                assert batch.groups.equals(want[key].groups), (
                    key,
                    source,
                    diff,
                    str(batch.groups.schema),
                    str(want[key].groups.schema),
                )
    rows = store.sql("SELECT step, rank, count(*) AS n FROM groups GROUP BY ALL").to_pylist()
    counts = {(r["step"], r["rank"]): r["n"] for r in rows}
    for key, batch in want.items():
        assert counts.get(key) == batch.num_groups, (key, counts.get(key))
