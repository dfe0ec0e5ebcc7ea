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
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fault_harness import flip, truncate
from store_fixtures import make_batch

from maxent_arrow import RolloutStore, RunAnalytics, StoreError
from maxent_arrow.cli import EXIT_DATA, EXIT_OK, main

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
    return store.root / "groups" / f"step-{VICTIM:010d}.rank-00000.train.parquet"


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
    if command[0] == "inspect" and how == "q chunk":
        # inspect reads the step files and the footers, not the column chunks.
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
    path = store.root / "steps" / f"step-{VICTIM:010d}.rank-00000.train.parquet"
    flip(path, path.stat().st_size // 2) if how == "flipped" else truncate(path)
    assert path in [p.path for p in store.verify().problems]
    for reader in (_read, _replay, _sql):
        with pytest.raises(StoreError, match=path.name):
            reader(store, "raise")
    with pytest.warns(UserWarning, match=path.name):
        assert store.steps(on_error="skip") == [0, 2, 3]


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
