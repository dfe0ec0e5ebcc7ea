"""The commit of a unit's two files (``store/io/commit.py``), on a real store directory: what
each file holds (rows, row groups, codec, identity, the group file's size, CRC-32, chunk
CRC32Cs and schema key in the sealed step file), the log entry that names them, and each way
a commit is refused or fails leaving the store as it was (no published file, no temp file).

Written for the mutation run of issue 37 (``make mutate``, ``docs/mutation.md``): each test
names the behaviour the survivors of that run showed untested."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import step_rows_json
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import AppendUnit, CompactUnits, RestoreUnit
from maxent_arrow.store.history.schemas import schema_key
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.io import commit as C
from maxent_arrow.store.storage import checksums
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.store.storage.names import STORE_META_KEY, UNIT_META_KEY

NAME = "step-0000000003.rank-00001.train.parquet"


def _log(tmp_path: Path, run: str | None = "run-7") -> CommitLog:
    root = tmp_path / "store"
    for directory in ("log", "groups", "steps"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    return CommitLog(LocalBackend(root), run=run)


def _unit(rows: int = 6, row_groups=None, name: str = NAME) -> C.UnitFiles:
    groups = pa.table(
        {
            "step": pa.array([3] * rows, pa.int64()),
            "group_index": pa.array(range(rows), pa.int64()),
            "prompt": pa.array([f"prompt {i}" for i in range(rows)]),
            "advantages": pa.array([[0.5 * i, -0.5 * i] for i in range(rows)]),
        }
    )
    step_rows = pa.table({"step": [3], "rank": [1], "kind": ["train"], "loss": [0.25]})
    return C.UnitFiles(
        name, groups, {b"mine": b"kept"}, step_rows, {"reward_names": ["r"]}, row_groups
    )


def _request(check=None, **kw) -> C.CommitRequest:
    kw.setdefault("operation", AppendUnit)
    return C.CommitRequest(attempt="att-1", check=check or (lambda state: None), **kw)


def _files(log: CommitLog) -> dict[str, list[str]]:
    root = log.backend.root
    return {d: sorted(p.name for p in (root / d).iterdir()) for d in ("groups", "steps", "log")}


def test_a_committed_unit_is_two_files_of_its_own_name_and_the_next_log_entry(tmp_path):
    log = _log(tmp_path)
    committed = C.commit_unit(log, _unit(), _request())
    assert committed.version == 1
    assert committed.name.startswith("step-0000000003.rank-00001.train.t")
    assert committed.name != NAME and committed.name.endswith(".parquet")
    files = _files(log)
    assert files["groups"] == [committed.name] and files["steps"] == [committed.name]
    assert files["log"] == ["00000000000000000001.json", "_head.json"]
    group = log.backend.root / "groups" / committed.name
    assert committed.group.size == group.stat().st_size
    assert committed.group.crc == zlib.crc32(group.read_bytes())
    # a second unit of the same name: files of a name of its own again
    again = C.commit_unit(log, _unit(), _request())
    assert again.version == 2 and again.name != committed.name
    assert len(_files(log)["groups"]) == 2


def test_the_group_file_holds_the_rows_its_identity_and_its_metadata(tmp_path):
    log = _log(tmp_path)
    unit = _unit()
    committed = C.commit_unit(log, unit, _request())
    path = log.backend.root / "groups" / committed.name
    table = pq.read_table(path)
    assert table.select(unit.groups.column_names).equals(unit.groups)
    meta = pq.read_metadata(path).metadata
    assert meta[b"mine"] == b"kept"
    assert json.loads(meta[UNIT_META_KEY]) == {"unit": committed.name, "run": "run-7"}
    assert pq.read_metadata(path).num_row_groups == 1
    column = pq.read_metadata(path).row_group(0).column(0)
    assert column.compression == "ZSTD"


def test_a_store_without_a_run_records_only_the_unit(tmp_path):
    log = _log(tmp_path, run=None)
    committed = C.commit_unit(log, _unit(), _request())
    path = log.backend.root / "groups" / committed.name
    assert json.loads(pq.read_metadata(path).metadata[UNIT_META_KEY]) == {"unit": committed.name}
    step = log.backend.root / "steps" / committed.name
    meta = json.loads(pq.read_metadata(step).metadata[STORE_META_KEY])
    assert "run" not in meta and meta["unit"] == committed.name


def test_the_settings_choose_the_codec_and_the_row_groups(tmp_path):
    log = _log(tmp_path)
    settings = C.WriteSettings(compression="gzip", compression_level=9, lock_timeout=5.0)
    committed = C.commit_unit(log, _unit(row_groups=[2, 4]), _request(settings=settings))
    metadata = pq.read_metadata(log.backend.root / "groups" / committed.name)
    assert metadata.num_row_groups == 2
    assert [metadata.row_group(i).num_rows for i in range(2)] == [2, 4]
    assert metadata.row_group(0).column(0).compression == "GZIP"
    step = log.backend.root / "steps" / committed.name
    chunks = json.loads(pq.read_metadata(step).metadata[STORE_META_KEY])["chunks"]
    assert chunks["row_group_rows"] == [2, 4] and len(chunks["row_groups"]) == 2
    plain = C.commit_unit(log, _unit(), _request(settings=C.WriteSettings("none", None)))
    metadata = pq.read_metadata(log.backend.root / "groups" / plain.name)
    assert metadata.row_group(0).column(0).compression == "UNCOMPRESSED"


def test_the_sealed_step_file_records_the_group_files_size_crc_chunks_and_schema(tmp_path):
    log = _log(tmp_path)
    unit = _unit()
    committed = C.commit_unit(log, unit, _request())
    group_path = log.backend.root / "groups" / committed.name
    step_path = log.backend.root / "steps" / committed.name
    group, step = group_path.read_bytes(), step_path.read_bytes()
    assert checksums.check_seal(step) is True
    metadata = pq.read_metadata(step_path)
    assert metadata.metadata[S.METADATA_KEY] == S.SCHEMA_VERSION.encode()
    meta = json.loads(metadata.metadata[STORE_META_KEY])
    assert meta["group_file"] == committed.name
    assert meta["group_size"] == len(group)
    assert meta["group_crc32"] == zlib.crc32(group)
    assert meta["schema_key"] == schema_key(pq.read_schema(group_path))
    assert meta["unit"] == committed.name and meta["run"] == "run-7"
    assert meta["reward_names"] == ["r"]
    assert meta["rows"] == step_rows_json(unit.step_rows)
    chunks = meta["chunks"]
    assert chunks["algorithm"] == "crc32c"
    f_offset, f_length, f_crc = chunks["footer"]
    assert f_offset + f_length == len(group)
    assert f_crc == checksums.crc32c_of(group[f_offset:])
    (row_group,) = chunks["row_groups"]
    assert set(row_group) == {"step", "group_index", "prompt", "advantages.list.element"}
    for offset, length, crc in row_group.values():
        assert crc == checksums.crc32c_of(group[offset : offset + length])
    assert pq.read_table(step_path).equals(unit.step_rows)
    # the step rows carry statistics on the unit's key
    columns = {metadata.row_group(0).column(i).path_in_schema: metadata.row_group(0).column(i)
               for i in range(metadata.num_columns)}  # fmt: skip
    assert columns["step"].is_stats_set and columns["rank"].is_stats_set
    assert not columns["loss"].is_stats_set


def test_the_log_entry_records_the_step_file_and_its_commit_record(tmp_path):
    log = _log(tmp_path)
    committed = C.commit_unit(log, _unit(), _request())
    step_path = log.backend.root / "steps" / committed.name
    data = step_path.read_bytes()
    entry = log.entry(1)
    assert entry is not None and entry.op == "append" and entry.attempt == "att-1"
    op = entry.operation
    assert isinstance(op, AppendUnit)
    assert op.step_file == f"steps/{committed.name}"
    assert op.step_size == len(data) and op.step_crc32 == zlib.crc32(data)
    assert op.replaces == ()
    meta = json.loads(pq.read_metadata(step_path).metadata[STORE_META_KEY])
    assert dict(op.record) == {**meta, "schema_version": S.SCHEMA_VERSION}
    state = log.state()
    assert set(state.units) == {f"steps/{committed.name}"}


def test_a_compaction_commits_a_segment_in_place_of_the_units_it_replaces(tmp_path):
    log = _log(tmp_path)
    first = C.commit_unit(log, _unit(), _request())
    second = C.commit_unit(log, _unit(name="step-0000000004.rank-00001.train.parquet"), _request())
    segment = C.commit_unit(
        log,
        _unit(name="steps-0000000003-0000000004.rank-00001.train.abc.parquet"),
        _request(operation=CompactUnits, replaces=(first.name, second.name)),
    )
    entry = log.entry(3)
    assert entry is not None and entry.op == "compact"
    assert entry.operation.replaces == (f"steps/{first.name}", f"steps/{second.name}")
    assert set(log.state().units) == {f"steps/{segment.name}"}
    restored = C.commit_unit(
        log, _unit(), _request(operation=RestoreUnit, replaces=(segment.name,))
    )
    entry = log.entry(4)
    assert entry is not None and entry.op == "restore"
    assert set(log.state().units) == {f"steps/{restored.name}"}


def test_the_check_runs_before_anything_is_written_and_again_on_the_newest_state(tmp_path):
    log = _log(tmp_path)
    C.commit_unit(log, _unit(), _request())
    seen: list[int] = []

    def check(state: LogState) -> None:
        seen.append(state.version)

    C.commit_unit(log, _unit(), _request(check))
    assert seen == [1, 1]
    refused: list[int] = []

    def refuse_first(state: LogState) -> None:
        refused.append(state.version)
        raise StoreError("duplicate step 3")

    before = _files(log)
    with pytest.raises(StoreError, match="duplicate step 3"):
        C.commit_unit(log, _unit(), _request(refuse_first))
    assert refused == [2]  # refused before encoding: nothing written, not even a temp file
    assert _files(log) == before


def test_a_commit_refused_at_the_lock_leaves_no_file(tmp_path):
    log = _log(tmp_path)
    calls: list[int] = []

    def refuse_at_commit(state: LogState) -> None:
        calls.append(state.version)
        if len(calls) == 2:
            raise StoreError("committed meanwhile")

    with pytest.raises(StoreError, match="committed meanwhile"):
        C.commit_unit(log, _unit(), _request(refuse_at_commit))
    assert _files(log) == {"groups": [], "steps": [], "log": []}
    assert log.state().version == 0


def test_a_commit_that_loses_its_version_and_is_then_refused_removes_its_published_files(
    tmp_path,
):
    """Without the lock (an object store's case: ``locked``): the files are published at the
    first try of the commit; another writer takes that version; on the retry the check
    refuses (the other writer committed the same step), and the two published files go."""
    log = _log(tmp_path)
    other = CommitLog(LocalBackend(log.backend.root), run="run-7")
    calls: list[int] = []

    def check(state: LogState) -> None:
        calls.append(state.version)
        if len(calls) == 2:  # at the commit, first try: another writer commits meanwhile
            C.commit_unit(other, _unit(), _request(locked=True))
        if len(calls) == 3:
            raise StoreError("step 3 committed by another writer")

    with pytest.raises(StoreError, match="committed by another writer"):
        C.commit_unit(log, _unit(), _request(check, locked=True))
    assert calls == [0, 0, 1]
    files = _files(log)
    winner = other.state().units
    assert len(winner) == 1 and log.state().version == 1
    (rel,) = winner
    assert files["groups"] == [rel.removeprefix("steps/")] == files["steps"]


def test_a_commit_that_loses_its_version_commits_at_the_next(tmp_path):
    log = _log(tmp_path)
    other = CommitLog(LocalBackend(log.backend.root), run="run-7")
    calls: list[int] = []

    def check(state: LogState) -> None:
        calls.append(state.version)
        if len(calls) == 2:
            C.commit_unit(other, _unit(), _request(locked=True))

    committed = C.commit_unit(log, _unit(), _request(check, locked=True))
    assert committed.version == 2 and calls == [0, 0, 1]
    assert len(log.state().units) == 2
    assert _files(log)["groups"] == sorted(p.removeprefix("steps/") for p in log.state().units)


def test_a_step_file_that_cannot_be_written_leaves_no_group_file(tmp_path):
    log = _log(tmp_path)
    unit = C.UnitFiles(NAME, _unit().groups, {}, _unit().step_rows, {"bad": {1, 2}})
    with pytest.raises(TypeError):
        C.commit_unit(log, unit, _request())
    assert _files(log) == {"groups": [], "steps": [], "log": []}


def test_a_log_with_a_lost_entry_takes_no_unit_and_keeps_no_file(tmp_path):
    log = _log(tmp_path)
    for _ in range(3):
        C.commit_unit(log, _unit(), _request())
    (log.backend.root / "log" / "00000000000000000002.json").unlink()
    fresh = CommitLog(LocalBackend(log.backend.root), run="run-7")
    before = _files(log)
    with pytest.raises(StoreError, match="entry 2 is missing"):
        C.commit_unit(fresh, _unit(), _request())
    assert _files(log) == before


def test_step_file_bytes_seal_the_rows_given_or_made_from_the_step_rows():
    unit = _unit()
    data = C.step_file_bytes(unit.step_rows, {"group_file": "g"})
    assert checksums.check_seal(data) is True
    meta = json.loads(pq.read_metadata(pa.py_buffer(data)).metadata[STORE_META_KEY])
    assert meta == {"group_file": "g", "rows": step_rows_json(unit.step_rows)}
    given = C.step_file_bytes(unit.step_rows, {"group_file": "g"}, {"step": [9]})
    meta = json.loads(pq.read_metadata(pa.py_buffer(given)).metadata[STORE_META_KEY])
    assert meta["rows"] == {"step": [9]}


def test_group_file_meta_names_its_algorithm_by_how_the_file_was_written(tmp_path):
    """A file streamed by the writer thread has CRC32C boundaries (chunks in CRC32C); one
    written whole from bytes has none, and its chunks are CRC-32, read back."""
    log = _log(tmp_path)
    unit = _unit()
    streamed = C.write_group_file(
        log.backend, "groups/a.parquet", unit.groups, {}, compression="zstd", compression_level=1
    )
    meta = C.group_file_meta(log.backend, streamed, extra=1)
    assert meta["chunks"]["algorithm"] == "crc32c" and meta["extra"] == 1
    assert meta["group_file"] == "a.parquet" and meta["group_size"] == streamed.size
    data = (log.backend.root / streamed.temp).read_bytes()
    whole = log.backend.write_temp("groups/b.parquet", data)
    assert whole.boundaries_c == []
    meta_b = C.group_file_meta(log.backend, whole)
    assert "algorithm" not in meta_b["chunks"]
    for offset, length, crc in meta_b["chunks"]["row_groups"][0].values():
        assert crc == zlib.crc32(data[offset : offset + length])
    assert meta_b["group_crc32"] == zlib.crc32(data) == meta["group_crc32"]
    assert meta_b["schema_key"] == meta["schema_key"]
    log.backend.discard(streamed)
    log.backend.discard(whole)
    assert _files(log)["groups"] == []
