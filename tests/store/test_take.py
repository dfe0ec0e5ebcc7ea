"""Take files (``take/{unit}.arrow``): a random group read by the replay sampler costs its own
bytes, checked by their own XXH3-64, and equals the archive's row; a damaged, torn, missing
or stale take file is never served (the archive serves, with a warning where it is damaged);
a plain reader opens one as an Arrow IPC file of one batch per group."""

from __future__ import annotations

import warnings

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from maxent_arrow.errors import StoreError
from maxent_arrow.store import ReadOnlyStore, RolloutStore, process_caches
from maxent_arrow.store.feed.sampler import ReplaySampler, SamplerOptions
from maxent_arrow.store.history.catalog import Selection
from maxent_arrow.store.io.take import take_rows
from maxent_arrow.testing import compacted_run, loose_store, make_batch, resume_run

KEY = ["step", "rank", "kind", "group_index"]
TOKENS = ["completion_ids", "behavior_token_logp", "ref_token_logp", "advantages", "prompt_ids"]


def _take_path(store: RolloutStore, step: int, kind: str = "train"):
    return store.root / "take" / f"step-{step:010d}.rank-00000.{kind}.arrow"


def _sampled(store, **options) -> pa.Table:
    """Every group of one epoch, in batches of 2, as one table sorted by its key."""
    sampler = ReplaySampler(store, SamplerOptions(batch_groups=2, record=False, **options))
    parts = [pa.Table.from_batches([b.groups.replace_schema_metadata(None)]) for b in sampler]
    return pa.concat_tables(parts, promote_options="default").sort_by(
        [(k, "ascending") for k in KEY]
    )


def _unit(store, step: int, kind: str = "train"):
    unit = next(u for u in store.catalog.units(Selection([step], kind)) if u.step == step)
    return unit, store.catalog.step_file(unit.step_file)


def test_an_append_writes_a_take_file_that_a_plain_reader_opens_one_batch_per_group(tmp_path):
    store = loose_store(tmp_path / "s", 2, groups=4)
    path = _take_path(store, 1)
    reader = ipc.open_file(pa.memory_map(str(path)))
    assert reader.num_record_batches == 4
    table = reader.read_all()
    archive = store.read(steps=[1])
    assert table.column("group_index").to_pylist() == archive.column("group_index").to_pylist()
    assert table.column("completion_ids").equals(archive.column("completion_ids"))
    assert pl.read_ipc(path).height == 4  # polars reads it too
    assert not RolloutStore.create(tmp_path / "off", take=False).root.joinpath("take").exists()


def test_sampled_groups_from_take_files_equal_the_archive_also_after_compaction(tmp_path):
    store = compacted_run(tmp_path / "s", steps=6, eval_every=3, merged=4, segment=2)
    from_takes = _sampled(store, sampling="uniform", seed=3)
    from_archive = _sampled(store, sampling="uniform", seed=3, source="parquet")
    assert from_takes.num_rows == sum(
        u.num_groups for u in store.catalog.units(Selection(None, "train"))
    )
    assert from_takes.equals(from_archive)
    # the rows came from the take files: the archive's group files are gone and they still serve
    process_caches().clear()
    unit, step = _unit(store, 0)
    rows = take_rows(store.backend, step, unit.name, [1, 0])
    assert [r.column("group_index")[0].as_py() for r in rows] == [1, 0]


def test_a_sampled_group_reads_only_its_own_bytes_of_the_take_file(tmp_path):
    store = loose_store(tmp_path / "s", 1, groups=6)
    store.append(make_batch(1, groups=6))
    unit, step = _unit(store, 0)
    take_rows(store.backend, step, unit.name, [0])  # the frame, checked once per process
    read: list[tuple[str, list[tuple[int, int]]]] = []
    real = store.backend.read_ranges

    def recording(rel, ranges):
        read.append((rel, list(ranges)))
        return real(rel, ranges)

    store.backend.read_ranges = recording  # (the real reads still happen: a recording)
    [row] = take_rows(store.backend, step, unit.name, [4])
    size = _take_path(store, 0).stat().st_size
    assert [rel for rel, _ in read] == [f"take/{unit.name.removesuffix('.parquet')}.arrow"]
    [(offset, length)] = read[0][1]
    assert row.serialize().size == length  # exactly that group's message
    assert length < size / 6  # (one of six groups: not the step, not the file)
    assert row.column("group_index").to_pylist() == [4]


def test_damage_in_one_group_is_an_error_naming_the_file_and_the_group(tmp_path):
    store = loose_store(tmp_path / "s", 1, groups=4)
    unit, step = _unit(store, 0)
    path = _take_path(store, 0)
    rows = take_rows(store.backend, step, unit.name, [2])
    data = bytearray(path.read_bytes())
    # a byte inside group 2's token ids (its batch message holds the ids' values)
    ids = rows[0].column("completion_ids").flatten().flatten()
    needle = np.asarray(ids).tobytes()[:16]
    at = data.find(needle)
    assert at > 0
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"take file: group 2: its bytes differ.*corrupt"):
        take_rows(store.backend, step, unit.name, [2])
    assert take_rows(store.backend, step, unit.name, [1])  # the other groups still serve
    # the sampler serves every group from the archive instead, saying so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _sampled(store, sampling="sequential")
    assert any("group 2" in str(w.message) for w in caught)
    assert got.equals(_sampled(store, sampling="sequential", source="parquet"))
    assert not store.verify().ok  # verify names it
    assert any("take" in str(p) for p in store.verify().problems)


def test_a_damaged_frame_or_a_torn_file_is_refused(tmp_path):
    store = loose_store(tmp_path / "s", 1, groups=3)
    unit, step = _unit(store, 0)
    path = _take_path(store, 0)
    data = bytearray(path.read_bytes())
    at = data.find(b"completion_ids")  # the schema message, in the frame
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    process_caches().clear()
    with pytest.raises(StoreError, match=r"frame \(schema, footer\) XXH3-64.*corrupt"):
        take_rows(store.backend, step, unit.name, [0])
    path.write_bytes(path.read_bytes()[: len(data) // 2])  # a crash's torn derived file
    process_caches().clear()
    with pytest.raises(StoreError, match="take file"):
        take_rows(store.backend, step, unit.name, [0])
    path.unlink()
    process_caches().clear()
    assert take_rows(store.backend, step, unit.name, [0]) is None  # none: the archive serves


def test_a_take_file_of_another_commit_of_the_unit_is_never_served(tmp_path):
    first = loose_store(tmp_path / "s", 3, groups=3, take=False)
    first.build_takes()
    old = _take_path(first, 2).read_bytes()
    second = resume_run(tmp_path / "s", resume_from=2, steps=[2], seed=50)
    assert _take_path(second, 2).read_bytes() != old  # the new commit's, written again
    _take_path(second, 2).write_bytes(old)  # the old commit's copy put back
    unit, step = _unit(second, 2)
    assert take_rows(second.backend, step, unit.name, [0]) is None
    sampled = _sampled(ReadOnlyStore(second.root), sampling="uniform")
    assert (
        sampled.filter(pa.compute.equal(sampled.column("step"), 2))
        .column("completion_ids")
        .equals(second.read(steps=[2]).column("completion_ids"))
    )
    assert any("another commit" in str(n) for n in second.verify().notes)


def test_build_takes_writes_what_a_store_without_them_lacks(tmp_path):
    store = loose_store(tmp_path / "s", 3, groups=2, take=False)
    assert not (store.root / "take").exists()
    assert store.build_takes() == 3
    assert store.build_takes() == 0  # each once
    unit, step = _unit(store, 1)
    rows = take_rows(store.backend, step, unit.name, [0, 1])
    assert (
        pa.Table.from_batches(rows)
        .column("completion_ids")
        .equals(store.read(steps=[1]).column("completion_ids"))
    )
    assert store.verify().ok


def test_chosen_columns_without_completions_sample_with_the_right_counts(tmp_path):
    store = loose_store(tmp_path / "s", 3, groups=4)
    sampler = ReplaySampler(store, SamplerOptions(batch_groups=3, record=False, columns=TOKENS))
    batch = sampler.sample()
    assert batch.groups.schema.names == TOKENS
    counts = [len(x) for x in batch.groups.column("completion_ids").to_pylist()]
    assert batch.num_samples == sum(counts) == batch.step_row.column("num_samples")[0].as_py()
    assert set(batch.tensors()) >= {"completion_ids", "behavior_token_logp"}


def test_verify_holds_a_nan_reward_equal_to_itself_and_other_values_are_damage(tmp_path):
    """A NaN reward (a reward function that failed) is stored as it came: verify compares the
    take file with the archive NaN for NaN (Arrow's ``equals`` says a NaN differs from
    itself); a take file of valid frame and checksums holding other values is a problem."""
    from maxent_arrow.rollout import RolloutBatch
    from maxent_arrow.store.io.take import write_take
    from maxent_arrow.testing.batches import make_parts

    parts = make_parts(seed=7, groups=3, k=(4, 4), max_tokens=16)
    parts["rewards"].total_utils[1] = float("nan")
    store = RolloutStore.create(tmp_path / "s")
    store.append(RolloutBatch.from_parts(0, **parts))
    unit, step = _unit(store, 0)
    rows = store.read(steps=[0])
    assert np.isnan(rows.column("total_utils").combine_chunks().flatten().to_numpy()).sum() == 1
    report = store.verify()
    assert report.ok and not report.notes, str(report)
    # The same frame and checksums over other rows (a writer's bug, not a torn file).
    other = rows.set_column(
        rows.schema.get_field_index("total_utils"),
        rows.schema.field("total_utils"),
        pa.array([[0.5] * 4] * 3, rows.schema.field("total_utils").type),
    )
    write_take(store.backend, other.combine_chunks().to_batches()[0], unit.name,
               step.meta.get("group_crc32"))  # fmt: skip
    process_caches().clear()
    (problem,) = store.verify().problems
    assert "take" in str(problem.path) and "total_utils" in problem.problem


def test_a_compaction_writes_one_take_file_for_its_segment_and_the_sampler_reads_it(tmp_path):
    """A compacted unit is served from its segment's take file (a file per segment, not per
    unit): with the units' own take files and the archive's group files gone, sampled groups
    still equal what the archive served; a segment take file of other bytes is refused."""
    store = compacted_run(tmp_path / "s", steps=6, eval_every=3, merged=4, segment=2)
    from_archive = _sampled(store, sampling="uniform", seed=3, source="parquet")
    segments = sorted((store.root / "take").glob("compact-*.arrow"))
    assert len(segments) == 2
    reader = ipc.open_file(pa.memory_map(str(segments[0])))
    assert reader.num_record_batches == sum(  # one batch per group of its two steps
        u.num_groups for u in store.catalog.units(Selection([0, 1], "train"))
    )
    for step in range(4):
        _take_path(store, step).unlink()
    for path in (store.root / "groups").glob("compact-*.parquet"):
        path.unlink()
    process_caches().clear()
    from_takes = _sampled(ReadOnlyStore(store.root), sampling="uniform", seed=3)
    assert from_takes.equals(from_archive)
    # a unit's rows sit at its first row in the segment
    unit, step = _unit(store, 1)
    rows = take_rows(store.backend, step, unit.name, [0, 2])
    expected = from_archive.filter(pa.compute.equal(from_archive.column("step"), 1))
    assert [r.column("group_index")[0].as_py() for r in rows] == [0, 2]
    assert (
        rows[1]
        .column("completion_ids")
        .equals(expected.slice(2, 1).column("completion_ids").combine_chunks())
    )
    # another segment's take file put in its place: not of this commit, never served
    segments[1].replace(segments[0])
    process_caches().clear()
    assert take_rows(store.backend, step, unit.name, [0]) is None


def test_build_takes_writes_a_compacted_segment_one_take_file(tmp_path):
    store = compacted_run(tmp_path / "s", steps=6, eval_every=3, merged=4, segment=2)
    expected = _sampled(store, sampling="uniform", seed=3, source="parquet")
    for path in (store.root / "take").iterdir():
        path.unlink()
    process_caches().clear()
    # the two segments' (4 units) and the 2 loose train and 2 eval units' own
    assert store.build_takes() == 2 + 2 + 2
    assert len(list((store.root / "take").glob("compact-*.arrow"))) == 2
    assert not _take_path(store, 0).exists()  # (its segment's serves it)
    assert store.build_takes() == 0
    assert _sampled(store, sampling="uniform", seed=3).equals(expected)
    assert store.verify().ok
