"""Reads at step grain, checked at that grain (issue 23, parts 2 and 5).

- A compacted segment keeps one row group per unit (step, rank, kind), and its step file
  records a checksum per column chunk per row group, so a reader of one step decodes and
  checks only that step's row group: damage anywhere else does not stop it, damage in it is
  found naming the step, and ``verify`` finds damage anywhere.
- New files record CRC32C (named in the record) for column chunks; IPC cache copies carry a
  CRC32C per column and one of their frame, and a read checks the columns it serves.

Every damage here is a real byte flipped in a real file on disk; the row groups are counted by
pyarrow's and DuckDB's own readers of the footer.
"""

from __future__ import annotations

import json

import duckdb
import google_crc32c
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.testing import make_batch

STEPS = 4


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _compacted(tmp_path, *, cache: bool = False):
    store = RolloutStore.create(tmp_path / "s", compact_every=None, cache=cache)
    batches = [make_batch(s, groups=6 + s, k=(4, 4), max_tokens=48) for s in range(STEPS)]
    for batch in batches:
        store.append(batch)
    store.compact()
    (group_file,) = store.committed_files()
    return store, batches, group_file


def _same_rows(table: pa.Table, batches) -> bool:
    """``table`` holds the rows of ``batches`` (compared as values: reads come back in the
    store's unified, nullable schema)."""
    expected = pa.Table.from_batches([b.groups for b in batches])
    return table.select(expected.column_names).to_pylist() == expected.to_pylist()


def _record(store) -> dict:
    catalog = store.catalog
    (unit,) = {u.step_file for u in catalog.units()}
    return catalog.step_file(unit).meta


def _chunk(record: dict, row_group: int, column: str) -> list[int]:
    """(offset, length, crc) of ``column``'s chunk in ``row_group``, from the step record."""
    return next(v for p, v in record["chunks"]["row_groups"][row_group].items() if p == column)


def test_a_segment_keeps_one_row_group_per_step_as_plain_readers_see(tmp_path):
    store, batches, group_file = _compacted(tmp_path)
    meta = pq.ParquetFile(group_file).metadata
    assert meta.num_row_groups == STEPS
    assert [meta.row_group(i).num_rows for i in range(STEPS)] == [b.num_groups for b in batches]
    for i in range(STEPS):
        steps = pq.ParquetFile(group_file).read_row_group(i, columns=["step"])
        assert steps.column("step").unique().to_pylist() == [i]
    # DuckDB reads the same footer: one row group per step, of that step's rows.
    con = duckdb.connect()
    got = con.execute(
        "SELECT row_group_id, any_value(row_group_num_rows) FROM parquet_metadata(?) "
        "GROUP BY ALL ORDER BY 1",
        [str(group_file)],
    ).fetchall()
    assert got == [(i, b.num_groups) for i, b in enumerate(batches)]
    per_step = con.execute(
        "SELECT step, count(*) FROM read_parquet(?) GROUP BY 1 ORDER BY 1", [str(group_file)]
    ).fetchall()
    assert per_step == [(i, b.num_groups) for i, b in enumerate(batches)]
    # The checksums are kept at that grain, and read back equal to what was appended.
    record = _record(store)
    assert len(record["chunks"]["row_groups"]) == STEPS
    assert record["chunks"]["row_group_rows"] == [b.num_groups for b in batches]
    assert _same_rows(store.read(), batches)


def test_the_writers_merge_of_small_files_keeps_step_row_groups(tmp_path):
    store = RolloutStore.create(tmp_path / "s", compact_every=3)
    for step in range(3):
        store.append(make_batch(step, groups=5, k=(2, 3), max_tokens=16))
    (group_file,) = store.committed_files()
    assert "compact-" in group_file.name
    assert pq.ParquetFile(group_file).metadata.num_row_groups == 3


def test_one_step_of_a_segment_is_decoded_and_checked_alone(tmp_path):
    store, batches, group_file = _compacted(tmp_path)
    record = _record(store)
    # Damage every column chunk of every row group but step 1's, on disk.
    for row_group, chunks in enumerate(record["chunks"]["row_groups"]):
        if row_group != 1:
            for offset, length, _ in chunks.values():
                _flip(group_file, offset + length // 2)
    reopened = RolloutStore(store.root)
    (batch,) = reopened.replay(steps=[1], source="parquet")
    assert batch.groups.equals(batches[1].groups)
    assert _same_rows(reopened.read(steps=[1]), [batches[1]])
    projected = reopened.read(steps=[1], columns=["completion_ids"])
    assert projected.column("completion_ids").to_pylist() == (
        batches[1].groups.column("completion_ids").to_pylist()
    )
    # The Ray reader's file reads take the same path (units of step 1 only).
    (read,) = reopened.file_reads(steps=[1])
    ((name, rows),) = read.read_units(None)
    assert name == "step-0000000001.rank-00000.train.parquet"
    assert _same_rows(rows, [batches[1]])
    # Another step's row group: its damage is found, naming the step.
    with pytest.raises(StoreError, match=r"row group 2 \(step 2 rank 0 train\)"):
        list(reopened.replay(steps=[2], source="parquet"))
    with pytest.raises(StoreError, match=r"row group 3 \(step 3 rank 0 train\).*CRC32C"):
        reopened.read(steps=[3], columns=["completion_ids"])
    report = reopened.verify()
    assert not report.ok
    assert "row group 0 (step 0 rank 0 train)" in str(report)


def test_damage_in_the_step_read_is_found_and_verify_finds_it_anywhere(tmp_path):
    store, _, group_file = _compacted(tmp_path)
    record = _record(store)
    offset, length, _ = _chunk(record, 2, "completion_ids.list.element.list.element")
    _flip(group_file, offset + length // 3)
    reopened = RolloutStore(store.root)
    for steps in ([0], [1], [3]):
        assert reopened.read(steps=steps).num_rows
    with pytest.raises(StoreError, match=r"row group 2 \(step 2 rank 0 train\), completion_ids"):
        reopened.read(steps=[2])
    report = reopened.verify()
    assert len(report.problems) == 1 and "step 2 rank 0 train" in str(report.problems[0])


def test_new_chunk_checksums_are_crc32c_named_and_match_an_outside_crc32c(tmp_path):
    store, _, group_file = _compacted(tmp_path)
    chunks = _record(store)["chunks"]
    assert chunks["algorithm"] == "crc32c"
    data = group_file.read_bytes()
    for row_group in chunks["row_groups"]:
        for offset, length, crc in row_group.values():
            assert google_crc32c.value(data[offset : offset + length]) == crc
    offset, length, crc = chunks["footer"]
    assert offset + length == len(data) and google_crc32c.value(data[offset:]) == crc
    # The commit log carries the same record (what readers read).
    entries = sorted((store.root / "log").glob("0*.json"))
    last = json.loads(entries[-1].read_text())
    assert last["op"] == "compact" and last["record"]["chunks"]["algorithm"] == "crc32c"


def test_the_ipc_cache_checks_the_columns_it_serves(tmp_path):
    store = RolloutStore.create(tmp_path / "s", cache=True, compact_every=None)
    batch = make_batch(0, groups=8, k=(4, 4), max_tokens=64)
    store.append(batch)
    (path,) = (store.root / "cache").glob("*.arrow")
    # The buffers of one column, as a plain Arrow reader maps them.
    mapped = pa.memory_map(str(path)).read_buffer()
    column = ipc.open_file(mapped).get_batch(0).column("ref_token_logp")
    values = column.flatten().flatten()
    at = values.buffers()[1].address - mapped.address + 4 * values.offset
    del column, values, mapped
    _flip(path, at + 8)
    reopened = RolloutStore(store.root)
    # A read of other columns does not touch the damaged one, and is served from the copy.
    (other,) = reopened.replay(source="cache", columns=["completion_ids", "advantages"])
    assert other.groups.column("completion_ids").equals(batch.groups.column("completion_ids"))
    # The read that touches it finds it, naming the column.
    with pytest.raises(StoreError, match="IPC cache column 'ref_token_logp': XXH3-64"):
        list(reopened.replay(source="cache", columns=["ref_token_logp"]))
    with pytest.raises(StoreError, match="ref_token_logp"):
        list(reopened.replay(source="cache"))
    # "auto" falls back to the archive, unharmed.
    (auto,) = reopened.replay(source="auto")
    assert auto.groups.equals(batch.groups)
    assert any("ref_token_logp" in str(p) for p in reopened.verify().problems)


def test_damage_in_the_cache_frame_is_found_by_any_read(tmp_path):
    store = RolloutStore.create(tmp_path / "s", cache=True, compact_every=None)
    batch = make_batch(0, groups=4, k=(2, 2), max_tokens=16)
    store.append(batch)
    (path,) = (store.root / "cache").glob("*.arrow")
    data = path.read_bytes()
    # A byte of the footer's JSON record of the unit (not a column buffer).
    at = data.rfind(b'"unit"') + 2
    _flip(path, at)
    reopened = RolloutStore(store.root)
    with pytest.raises(StoreError, match="frame"):
        list(reopened.replay(source="cache", columns=["advantages"]))
    assert not reopened.verify().ok


def test_a_cache_copy_sealed_whole_with_crc32_still_reads_checked(tmp_path):
    """Copies written before per-column checksums (one CRC-32 sealed over the file) are
    served checked, and their damage found."""
    from maxent_arrow.rollout import STEP_META_KEY, step_row_to_json
    from maxent_arrow.store.io.cache import CACHE_META_KEY, unit_group_crc32
    from maxent_arrow.store.storage.checksums import SEAL_KEY, SEAL_PLACEHOLDER, seal

    store = RolloutStore.create(tmp_path / "s", cache=True, compact_every=None)
    batch = make_batch(0, groups=4, k=(2, 2), max_tokens=16)
    store.append(batch)
    (path,) = (store.root / "cache").glob("*.arrow")
    catalog = store.catalog
    (unit,) = catalog.units()
    step = catalog.step_file(unit.step_file)
    # The old writer's bytes: the record, the CRC-32 placeholder, sealed whole.
    meta = dict(batch.groups.schema.metadata or {})
    meta[STEP_META_KEY] = step_row_to_json(batch.step_row).encode()
    meta[CACHE_META_KEY] = json.dumps(
        {"unit": unit.name, "group_crc32": unit_group_crc32(step, unit.name)}
    ).encode()
    meta[SEAL_KEY] = SEAL_PLACEHOLDER
    sink = pa.BufferOutputStream()
    groups = batch.groups.replace_schema_metadata(meta)
    with ipc.new_file(sink, groups.schema) as writer:
        writer.write_batch(groups)
    path.write_bytes(seal(sink.getvalue().to_pybytes()))
    reopened = RolloutStore(store.root)
    (got,) = reopened.replay(source="cache", columns=["completion_ids"])
    assert got.groups.column("completion_ids").equals(batch.groups.column("completion_ids"))
    assert reopened.verify().ok
    _flip(path, len(path.read_bytes()) // 2)
    with pytest.raises(StoreError, match="CRC-32 differs"):
        list(reopened.replay(source="cache", columns=["completion_ids"]))


def test_repair_restores_a_lost_segment_at_step_grain(tmp_path):
    """A segment whose group file is lost is rebuilt from the units' IPC cache copies with
    one row group per step again, and reads one step at a time as before."""
    store, batches, group_file = _compacted(tmp_path, cache=True)
    group_file.unlink()
    report = store.repair()
    assert len(report.restored) == 1, str(report)
    (restored,) = RolloutStore(store.root).committed_files()
    meta = pq.ParquetFile(restored).metadata
    assert meta.num_row_groups == STEPS
    assert [meta.row_group(i).num_rows for i in range(STEPS)] == [b.num_groups for b in batches]
    reopened = RolloutStore(store.root)
    assert reopened.verify().ok
    (batch,) = reopened.replay(steps=[2], source="parquet")
    assert _same_rows(pa.Table.from_batches([batch.groups]), [batches[2]])


def test_a_footer_damaged_after_it_was_parsed_is_still_found(tmp_path):
    """The reader keeps a segment's parsed footer between reads (it is ~0.5 MB for 100
    steps); the footer's bytes on disk are still checked on every read."""
    store, batches, group_file = _compacted(tmp_path)
    first = store.read(steps=2)
    assert _same_rows(first, batches[2:3])
    again = store.read(steps=1)  # the kept footer: the same rows as a plain reader's
    plain = pq.read_table(group_file, filters=[("step", "=", 1)])
    assert again.select(["step", "group_index"]).to_pylist() == (
        plain.select(["step", "group_index"]).to_pylist()
    )
    offset, length, _ = _record(store)["chunks"]["footer"]
    _flip(group_file, offset + length // 2)
    with pytest.raises(StoreError, match="footer"):
        store.read(steps=2)
