"""Fault class: damaged files. Each kind of store file (group file, step file, manifest, IPC
cache) is damaged in each way that happens on disks and in copies (a flipped bit in a column
chunk, in the footer, a truncation, a deletion), and each read path is asked for the data:
``read``, ``replay`` (archive and cache), ``sql``, the ready-made queries, and the CLI's
``query``, ``inspect``, ``report``, ``export`` and ``verify``. With ``on_error="raise"`` the
damaged file is an error naming it; with ``"skip"`` it is left out with a warning naming it and
everything else is served exactly; nothing damaged is ever served.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fault_harness import env, flip, truncate

from maxent_arrow import RolloutBatch, RolloutStore, RunAnalytics, StoreError
from maxent_arrow.cli import EXIT_DATA, EXIT_OK, main
from maxent_arrow.testing import make_batch, unit_path

STEPS = range(4)
VICTIM = 1  # the damaged unit's step


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "store"
    store = RolloutStore.create(root, cache=True)
    for step in STEPS:
        store.append(make_batch(step))
    return root


@pytest.fixture
def store(pristine, tmp_path) -> RolloutStore:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return RolloutStore(root)


def _group(store: RolloutStore) -> Path:
    return unit_path(store, "groups", VICTIM)


def _chunk_offset(path: Path, column: str) -> int:
    """A byte in the middle of ``column``'s column chunk."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.path_in_schema.split(".")[0] == column:
            return chunk.data_page_offset + chunk.total_compressed_size // 2
    raise KeyError(column)


def _damage_group(store: RolloutStore, how: str) -> Path:
    path = _group(store)
    if how == "q chunk":
        flip(path, _chunk_offset(path, "q"))
    elif how == "footer":
        flip(path, path.stat().st_size - 64)
    elif how == "truncated":
        truncate(path)
    elif how == "deleted":
        path.unlink()
    return path


GROUP_DAMAGE = ["q chunk", "footer", "truncated", "deleted"]


def _read(store, on_error):
    return store.read(columns=["step", "q"], on_error=on_error)


def _replay(store, on_error):
    return [b.step for b in store.replay(source="parquet", on_error=on_error)]


def _sql(store, on_error):
    return store.sql("SELECT step, avg(q) AS q FROM samples GROUP BY step", on_error=on_error)


def _analytics(store, on_error):
    with RunAnalytics(store, on_error=on_error) as run:
        return run.entropy_curve()


READERS = {"read": _read, "replay": _replay, "sql": _sql, "ready-made query": _analytics}


@pytest.mark.parametrize("how", GROUP_DAMAGE)
@pytest.mark.parametrize("reader", list(READERS))
def test_damaged_group_file_is_named_by_every_reader(store, how, reader):
    path = _damage_group(store, how)
    with pytest.raises(StoreError, match=path.name):
        READERS[reader](store, "raise")


@pytest.mark.parametrize("how", GROUP_DAMAGE)
def test_skip_serves_every_other_unit_exactly(store, how):
    path = _damage_group(store, how)
    with pytest.warns(UserWarning, match=path.name):
        table = store.read(columns=["step", "q"], on_error="skip")
    assert sorted(set(table.column("step").to_pylist())) == [0, 2, 3]
    expected = [q for s in (0, 2, 3) for q in make_batch(s).column("q").to_pylist()]
    assert table.column("q").to_pylist() == expected
    with pytest.warns(UserWarning, match=path.name):
        assert [b.step for b in store.replay(source="parquet", on_error="skip")] == [0, 2, 3]
    with pytest.warns(UserWarning, match=path.name):
        got = store.sql(
            "SELECT DISTINCT step FROM samples WHERE q >= 0 ORDER BY step", on_error="skip"
        )
    assert got.column("step").to_pylist() == [0, 2, 3]


def test_a_projection_without_the_damaged_chunk_is_served(store):
    """Only the columns a reader reads are checked (and served): a flipped byte in ``q`` does
    not stop a read of ``step`` and ``advantages``, which are intact; verify names the file."""
    path = _damage_group(store, "q chunk")
    table = store.read(columns=["step", "advantages"])
    expected = [a for s in STEPS for a in make_batch(s).column("advantages").to_pylist()]
    assert table.column("advantages").to_pylist() == expected
    assert [p.path for p in store.verify().problems] == [path]


@pytest.mark.parametrize("how", GROUP_DAMAGE)
@pytest.mark.parametrize(
    "command",
    [
        ["query", "SELECT step, avg(q) FROM samples GROUP BY step"],
        ["inspect"],
        ["export", "--to", "ipc", "OUT"],
        ["report", "--out", "OUT"],
        ["verify"],
    ],
    ids=["query", "inspect", "export", "report", "verify"],
)
def test_every_cli_command_names_the_damaged_file(store, capsys, tmp_path, how, command):
    path = _damage_group(store, how)
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    code = main([argv[0], str(store.root), *argv[1:]])
    out, err = capsys.readouterr()
    if command[0] == "inspect" and how in ("q chunk", "footer"):
        # inspect reads the commit log and checks that each group file is there with its
        # recorded size (one listing), not its bytes: verify names a flipped byte (below),
        # and so does every query that reads it.
        assert code == EXIT_OK, err
        return
    assert code == EXIT_DATA, (out, err)
    assert path.name in out + err
    assert "Traceback" not in err


def test_cli_on_error_skip_serves_the_rest(store, capsys):
    path = _damage_group(store, "truncated")
    code = main(
        ["query", str(store.root), "SELECT DISTINCT step FROM samples ORDER BY 1", "--json",
         "--on-error", "skip"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    assert [r["step"] for r in json.loads(out)] == [0, 2, 3]
    assert path.name in err  # the warning names the skipped file


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_damaged_step_file_is_named(store, how):
    """In a store with a commit log the step file is a copy of the log's record (for plain
    readers): damaged, verify names it, readers go on serving every unit exactly (they read
    the record from the log), and repair writes it again from the log."""
    path = unit_path(store, "steps", VICTIM)
    flip(path, path.stat().st_size // 2) if how == "flipped" else truncate(path)
    assert [p.path for p in store.verify().problems] == [path]
    expected = pa.Table.from_batches([make_batch(s).groups for s in STEPS])
    assert store.read(columns=expected.column_names).to_pylist() == expected.to_pylist()
    assert [b.step for b in store.replay(source="parquet")] == list(STEPS)
    assert store.sql(COUNT).to_pylist() == [{"n": expected.num_rows}]
    report = store.repair()
    assert [p.path for p in report.restored] == [path]
    assert store.verify().ok
    assert pq.read_table(path).column("step").to_pylist() == [VICTIM]


@pytest.mark.parametrize("how", ["deleted", "not JSON", "another format", "newer major"])
def test_damaged_manifest_makes_the_directory_not_a_store(store, how):
    manifest = store.root / "manifest.json"
    if how == "deleted":
        manifest.unlink()
    elif how == "not JSON":
        manifest.write_text("{nope")
    else:
        data = json.loads(manifest.read_text())
        if how == "another format":
            data["format"] = "something-else"
        else:
            data["schema_version"] = "9.0"
        manifest.write_text(json.dumps(data))
    with pytest.raises(StoreError):
        RolloutStore(store.root)
    assert not manifest.exists() or how != "deleted"  # a reader never re-creates it


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_damaged_cache_copy_is_never_served(store, how):
    cache = store.root / "cache" / f"step-{VICTIM:010d}.rank-00000.train.arrow"
    flip(cache, cache.stat().st_size // 2) if how == "flipped" else truncate(cache)
    assert [p.path for p in store.verify().problems] == [cache]
    with pytest.raises(StoreError, match=cache.name):
        list(store.replay(steps=[VICTIM], source="cache"))
    # "auto" falls back to the checked archive when a cache copy is damaged.
    (batch,) = store.replay(steps=[VICTIM], source="auto")
    assert batch.groups.equals(make_batch(VICTIM).groups)


def test_a_stale_cache_copy_of_another_commit_is_not_served(store):
    """After a compaction the cache still holds copies of the old files; they are copies of
    other commits (another group file CRC) and replay reads the segment instead."""
    store.compact()
    for batch in store.replay(source="auto"):
        assert batch.groups.equals(make_batch(batch.step).groups)
    assert store.verify().ok


# ---------------------------------------------------------------------------- footers (F01)
def _row_count_offset(path: Path) -> int:
    """A footer byte whose one flipped bit makes a plain DuckDB ``count(*)`` of the file say
    another number of rows without any error (a row count in the footer's metadata)."""
    data = path.read_bytes()
    meta = pq.ParquetFile(path).metadata
    rows, start = meta.num_rows, len(data) - meta.serialized_size - 8
    probe = path.with_name("probe.bin")
    try:
        for at in range(start, len(data) - 8):
            if data[at] != 2 * rows:  # the row count, a zigzag varint in the Thrift footer
                continue
            changed = bytearray(data)
            changed[at] ^= 0x08
            probe.write_bytes(bytes(changed))
            try:
                got = duckdb.sql(f"SELECT count(*) FROM read_parquet('{probe}')").fetchall()
            except duckdb.Error:
                continue
            if got[0][0] != rows:
                return at
    finally:
        probe.unlink(missing_ok=True)
    raise AssertionError("no footer byte changes the row count")


COUNT = "SELECT count(*) AS n FROM groups"


def test_a_flipped_row_count_in_a_footer_is_never_served_as_a_count(store, capsys):
    """``count(*)`` reads no column chunk, but DuckDB answers it from every file's footer:
    the footers are checked whenever a query scans files."""
    path = _group(store)
    flip(path, _row_count_offset(path))
    with pytest.raises(StoreError, match=path.name):
        store.sql(COUNT)
    others = sum(make_batch(s).num_groups for s in STEPS if s != VICTIM)
    with pytest.warns(UserWarning, match=path.name):
        assert store.sql(COUNT, on_error="skip").column("n").to_pylist() == [others]
    code = main(["query", str(store.root), COUNT, "--json"])
    out, err = capsys.readouterr()
    assert code == EXIT_DATA and path.name in err and not out, (out, err)


def test_a_damaged_footer_is_named_and_skipped_by_a_count(store, capsys):
    path = _damage_group(store, "footer")
    with pytest.raises(StoreError, match=path.name):
        store.sql(COUNT)
    code = main(["query", str(store.root), COUNT, "--json", "--on-error", "skip"])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    others = sum(make_batch(s).num_groups for s in STEPS if s != VICTIM)
    assert json.loads(out) == [{"n": others}] and path.name in err


# ---------------------------------------------------------------------------- any column name (F03)
ODD_NAMES = ["my score", "score-2", "ünï", "my.score"]


@pytest.fixture(scope="module")
def odd_pristine(tmp_path_factory) -> Path:
    """A store whose batches carry extra columns with names that are not identifiers,
    uncompressed: a flipped bit in a value is then a wrong number, not a decoding error."""
    root = tmp_path_factory.mktemp("odd") / "store"
    store = RolloutStore.create(root, compression="none")
    for step in STEPS:
        batch = make_batch(step)
        groups = batch.groups
        for i, name in enumerate(ODD_NAMES):
            values = [float(step * 100 + i * 10 + g) for g in range(groups.num_rows)]
            groups = groups.append_column(name, pa.array(values))
        store.append(RolloutBatch(groups, batch.step_row))
    return root


@pytest.mark.parametrize("name", ODD_NAMES)
def test_columns_of_any_name_are_checked_by_every_reader(odd_pristine, tmp_path, name):
    root = tmp_path / "store"
    shutil.copytree(odd_pristine, root)
    store = RolloutStore(root)
    path = _group(store)
    flip(path, _chunk_offset_of(path, name))
    quoted = '"' + name + '"'
    with pytest.raises(StoreError, match=path.name):
        store.sql(f"SELECT step, sum({quoted}) AS s FROM groups GROUP BY step")
    with pytest.raises(StoreError, match=path.name):
        store.sql(f"SELECT step FROM groups WHERE {quoted} > 0")
    with pytest.raises(StoreError, match=path.name):
        store.read(columns=["step", name])
    with pytest.raises(StoreError, match=path.name):
        list(store.replay(columns=["step", name], source="parquet"))
    # The other units' values, exactly, under skip.
    with pytest.warns(UserWarning, match=path.name):
        got = store.read(columns=["step", name], on_error="skip")
    assert sorted(set(got.column("step").to_pylist())) == [s for s in STEPS if s != VICTIM]


def _chunk_offset_of(path: Path, column: str) -> int:
    """The last byte of the chunk of the flat column ``column`` (whose name may hold dots:
    Parquet's path of the chunk is the name itself): the high byte of its last value."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.path_in_schema == column:
            return chunk.data_page_offset + chunk.total_compressed_size - 1
    raise KeyError(column)


# ---------------------------------------------------------------------------- cache files (F04)
def test_an_ipc_file_without_its_record_is_never_served(store):
    """A file in cache/ that this library did not write for the unit (no seal, no record of
    the unit and the committed group file's CRC) is not served: replay reads the archive."""
    cache = store.root / "cache" / f"step-{VICTIM:010d}.rank-00000.train.arrow"
    other = make_batch(VICTIM, seed=99).groups  # rows of the right shape, not the unit's
    with pa.ipc.new_file(cache, other.schema) as writer:
        writer.write_batch(other)
    for source in ("auto", "parquet"):
        (batch,) = store.replay(steps=[VICTIM], source=source)
        assert batch.groups.equals(make_batch(VICTIM).groups), source
    with pytest.raises(StoreError, match="no IPC cache copy"):
        list(store.replay(steps=[VICTIM], source="cache"))
    report = store.verify()
    assert report.ok and any(n.path == cache for n in report.notes), str(report)


# ---------------------------------------------------------------------------- identity (F11)
def _unit(store: RolloutStore, table: str, step: int) -> Path:
    return unit_path(store, table, step)


def test_a_step_file_under_another_units_name_is_refused(store, capsys):
    """A valid pair copied over another unit's names (a copy, rename or sync mistake): the
    step file records the unit it commits, so readers refuse it by name instead of serving
    a unit twice and losing the overwritten one."""
    for table in ("steps", "groups"):
        shutil.copyfile(_unit(store, table, 2), _unit(store, table, VICTIM))
    path = _unit(store, "steps", VICTIM)
    with pytest.raises(StoreError, match=path.name):
        store.read(columns=["step"])
    with pytest.raises(StoreError, match=path.name):
        store.sql(COUNT)
    with pytest.warns(UserWarning, match=path.name):
        steps = [b.step for b in store.replay(source="parquet", on_error="skip")]
    assert steps == [0, 2, 3]  # step 2 once, and nothing served as step 1
    assert path in [p.path for p in store.verify().problems]
    code = main(["query", str(store.root), COUNT])
    assert code == EXIT_DATA and path.name in capsys.readouterr().err


def test_a_step_file_of_another_run_is_refused(store, tmp_path):
    """A pair of the same unit from another run (another store's files synced in over this
    one's): the commit log records each file's size and CRC-32, so every reader refuses the
    group file by name."""
    other = RolloutStore.create(tmp_path / "other")
    other.append(make_batch(VICTIM, seed=7))
    for table in ("steps", "groups"):
        shutil.copyfile(_unit(other, table, VICTIM), _unit(store, table, VICTIM))
    path = _unit(store, "groups", VICTIM)
    readers = (
        lambda: store.read(),
        lambda: list(store.replay(source="parquet")),  # ("auto": the unit's own cache copy)
        lambda: store.sql(COUNT),
    )
    for read in readers:
        with pytest.raises(StoreError, match=path.name):
            read()
    problems = [p.path for p in store.verify().problems]
    assert path in problems and _unit(store, "steps", VICTIM) in problems


def test_a_damaged_seal_marker_is_damage(store):
    """The 13 bytes that mark a step file's sealed CRC, damaged, make a damaged file, not an
    unsealed older one that verify passes (readers read the log's record of it)."""
    path = _unit(store, "steps", VICTIM)
    flip(path, path.read_bytes().rfind(b"maxent-crc32=") + 3)
    assert path in [p.path for p in store.verify().problems]
    assert store.steps() == list(STEPS)


# ---------------------------------------------------------------------------- lost commits (F17)
def test_a_lost_step_file_is_reported_and_repair_writes_it_again(store, capsys):
    """A committed step file deleted: the commit log says it was committed, so verify fails
    naming it and the step (not "an append that did not finish"); readers still serve the
    unit (its record is the log's); repair writes it again from the log."""
    path = _unit(store, "steps", VICTIM)
    path.unlink()
    report = store.verify()
    assert [
        (p.path, "lost" in p.problem, f"step {VICTIM}" in p.problem) for p in report.problems
    ] == [(path, True, True)]
    code = main(["verify", str(store.root)])
    out, _ = capsys.readouterr()
    assert code == EXIT_DATA and f"PROBLEM {path}" in out
    assert store.steps() == list(STEPS)
    repaired = store.repair()
    assert [p.path for p in repaired.restored] == [path] and path.exists()
    assert store.verify().ok


def test_readers_report_a_lost_unit(store):
    """The exact form of F17: every reader, not only verify, says that a committed unit is
    gone. The commit log says what was committed, so a lost group file is an error naming it,
    never a silently shorter history; verify names its step."""
    group = _group(store)
    group.unlink()
    for read in (
        lambda: store.read(),
        lambda: list(store.replay(source="parquet")),
        lambda: store.sql(COUNT),
        lambda: RunAnalytics(store).reward_curve(),
    ):
        with pytest.raises(StoreError, match=group.name):
            read()
    (problem,) = store.verify().problems
    assert problem.path == group and f"lost: the group file of step {VICTIM}" in problem.problem
    # Its IPC cache copy is there: repair commits the unit again from it, by its attempt.
    before = [b.groups for b in RolloutStore(store.root).replay(source="cache")]
    report = store.repair()
    assert len(report.restored) == 1 and store.verify().ok
    after = [b.groups for b in store.replay(source="parquet")]
    assert [a.equals(b) for a, b in zip(after, before)] == [True] * len(STEPS)


def test_deleting_a_leftover_of_an_unfinished_append_changes_nothing(store, tmp_path):
    """A file no log entry names (here: an append killed after publishing its files, before
    its entry) is a note for verify and invisible to readers; deleting it changes nothing."""
    loose = store.root / "groups" / "step-0000000009.rank-00000.train.t0123456789ab.parquet"
    shutil.copyfile(_group(store), loose)
    before = store.read()
    report = store.verify()
    assert report.ok and loose in [n.path for n in report.notes]
    loose.unlink()
    assert store.read().equals(before) and store.verify().ok and store.steps() == list(STEPS)


# ---------------------------------------------------------------------------- signals (F21)
TRUNCATE_UNDER_REPLAY = """
import os, sys
import numpy as np
from maxent_arrow import RolloutStore
store = RolloutStore(sys.argv[1])
(batch,) = store.replay(steps=[int(sys.argv[2])], source="cache")
os.truncate(sys.argv[3], 0)  # another program truncates the cache file
total = sum(float(np.asarray(c.flatten().flatten()).sum()) for c in
            (batch.groups.column(n) for n in ("ref_token_logp", "behavior_token_logp")))
print("READ", total == total)
"""


def test_a_cache_file_truncated_under_a_replayed_batch_kills_no_reader(store):
    cache = store.root / "cache" / f"step-{VICTIM:010d}.rank-00000.train.arrow"
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATE_UNDER_REPLAY, str(store.root), str(VICTIM), str(cache)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "READ True"
