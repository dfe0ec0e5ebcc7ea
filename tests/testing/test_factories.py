"""The shared factories of ``maxent_arrow.testing``: what they make validates, the same seed
makes the same data (and another seed other data), and a store built of them reads back what
was appended."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.testing import (
    CONFIG,
    compacted_run,
    expected_group_math,
    loose_store,
    make_batch,
    make_parts,
    resume_run,
    streamed_batch,
    unit_path,
    write_store,
)


def _same_groups(read: pa.Table | pa.RecordBatch, batch: RolloutBatch) -> bool:
    """Every group column of ``batch`` has the same values in ``read`` (which may hold more
    columns: the unified schema's others, as nulls)."""
    return all(
        read.column(name).to_pylist() == batch.groups.column(name).to_pylist()
        for name in batch.groups.schema.names
    )


def _step_row(batch: RolloutBatch) -> pa.RecordBatch:
    """The step row less its creation time (which is the clock's, not the seed's)."""
    return batch.step_row.drop_columns(["created_at"])


# ---------------------------------------------------------------------------- batches
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"groups": 1, "k": (1, 1), "max_tokens": 1},
        {"groups": 6, "k": (8, 8), "max_tokens": 64},
        {"reward_names": ("accuracy", "format", "length"), "k": (1, 5)},
        {"kind": "eval", "rank": 3},
        {"config": {**CONFIG, "tau": 0.2, "beta": 0.1}},
    ],
    ids=["default", "one-of-one", "wide", "three-rewards", "eval-rank-3", "other-config"],
)
def test_a_batch_validates_and_has_the_shape_asked_for(options):
    batch = make_batch(4, **options)
    # The checks of the constructor and of an Arrow round trip pass.
    again = RolloutBatch(batch.groups, batch.step_row)
    assert again.equals(batch)
    assert RolloutBatch.from_arrow(batch.to_arrow()).equals(batch)
    low, high = options.get("k", (2, 4))
    sizes = np.diff(batch.group_offsets)
    assert (batch.step, batch.rank, batch.kind) == (
        4,
        options.get("rank", 0),
        options.get("kind", "train"),
    )
    assert batch.num_groups == options.get("groups", 3) == len(sizes)
    assert ((sizes >= low) & (sizes <= high)).all() and batch.num_samples == sizes.sum()
    counts = batch.column("ref_tok_counts").flatten().to_numpy()
    assert 1 <= counts.min() and counts.max() <= options.get("max_tokens", 12)
    names = batch.column("reward_names").to_pylist()
    assert {tuple(n) for n in names} == {tuple(options.get("reward_names", ("accuracy", "format")))}
    assert batch.config == options.get("config", CONFIG)


def test_the_same_seed_makes_the_same_batch_and_another_seed_another():
    first, again = make_batch(3, seed=5), make_batch(3, seed=5)
    assert first.groups.equals(again.groups) and _step_row(first).equals(_step_row(again))
    assert not first.groups.equals(make_batch(3, seed=6).groups)
    # By default the seed is the step's and rank's, whatever the kind.
    assert make_batch(2, rank=1).groups.equals(make_batch(2, rank=1, seed=2001).groups)
    assert not make_batch(2, rank=1).groups.equals(make_batch(2, rank=0).groups)
    train, evaluated = make_batch(2, seed=9), make_batch(2, seed=9, kind="eval")
    assert train.column("completions").equals(evaluated.column("completions"))
    # The parts are the batch's: the same seed gives the same parts.
    built = RolloutBatch.from_parts(3, **make_parts(seed=5))
    assert built.groups.equals(first.groups)


def test_the_derived_values_of_a_batch_are_the_formulas():
    batch = make_batch(1, groups=5, k=(1, 6))
    offsets = batch.group_offsets
    utils = batch.column("total_utils").flatten().to_numpy()
    raw = batch.column("ref_logp_sum_raw").flatten().to_numpy()
    counts = batch.column("ref_tok_counts").flatten().to_numpy()
    adv, q, w = expected_group_math(utils, raw / np.maximum(counts, 1), offsets)
    assert np.allclose(batch.column("advantages").flatten().to_numpy(), adv)
    assert np.allclose(batch.column("q").flatten().to_numpy(), q)
    assert np.allclose(batch.column("weights").flatten().to_numpy(), w, rtol=1e-6)
    # q and the weights are distributions over each group.
    for values in (q, w):
        assert np.allclose(np.add.reduceat(values, offsets[:-1]), 1.0)


def test_a_streamed_batch_validates_and_holds_its_stream_positions():
    utils = [[0.5, 1.0, 0.0], [1.0, 1.0, 1.0]]
    batch = streamed_batch(7, 40, 2, k=3, utils=utils)
    assert RolloutBatch(batch.groups, batch.step_row).equals(batch)
    assert (batch.step, batch.num_groups, batch.num_samples) == (7, 2, 6)
    assert batch.column("stream_index").to_pylist() == [40, 41]
    assert batch.column("total_utils").to_pylist() == utils
    assert batch.column("completions").to_pylist()[1] == [f"completion 41.{i}" for i in range(3)]
    assert streamed_batch(0, 0, 4).column("total_utils") is None
    assert streamed_batch(7, 40, 2, k=3, utils=utils).equals(batch)


def test_the_streamed_batch_and_the_written_run_import_no_torch():
    """A torch-free worker (the resume-kill test's) builds its batches with them."""
    code = (
        "import sys\n"
        "from maxent_arrow.testing import streamed_batch, write_store\n"
        "streamed_batch(0, 0, 2)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------- stores
def test_a_loose_store_reads_back_what_was_appended(tmp_path):
    store = loose_store(tmp_path / "run", 3, groups=2, cache=True)
    assert store.options.compact_every is None and store.options.cache
    assert len(store.committed_files("groups")) == 3  # one file a step, none merged
    replayed = list(RolloutStore(tmp_path / "run").replay())
    assert [b.step for b in replayed] == [0, 1, 2]
    for batch in replayed:
        assert _same_groups(batch.groups, make_batch(batch.step, groups=2))
    path = unit_path(store, "groups", 1)
    assert set(pq.read_table(path).column("step").to_pylist()) == {1}
    assert _same_groups(pq.read_table(path), make_batch(1, groups=2))


def test_a_compacted_run_holds_its_segments_its_loose_steps_and_its_evals(tmp_path):
    store = compacted_run(tmp_path / "run", steps=7, eval_every=3, merged=4, segment=2)
    names = sorted(p.name for p in store.committed_files("groups"))
    assert sum(n.startswith("compact-") for n in names) == 2  # steps 0-1 and 2-3
    assert sum(".eval." in n for n in names) == 3  # steps 0, 3 and 6
    read = ReadOnlyStore(tmp_path / "run")
    for step in range(7):
        train = read.read(steps=step, kind="train")
        assert _same_groups(train, make_batch(step, seed=step))
    assert _same_groups(read.read(steps=3, kind="eval"), make_batch(3, kind="eval", seed=103))
    assert read.read(steps=4, kind="eval").num_rows == 0


def test_a_resumed_run_supersedes_the_first_attempt_from_its_step(tmp_path):
    root = tmp_path / "run"
    loose_store(root, 4, attempt="first")
    resumed = resume_run(root, resume_from=2, steps=(2,), seed=50)
    assert [a["id"] for a in resumed.attempts()] == ["first", "second"]
    read = ReadOnlyStore(root)
    assert sorted(set(read.read(columns=["step"]).column("step").to_pylist())) == [0, 1, 2]
    assert _same_groups(read.read(steps=2), make_batch(2, seed=52))
    assert _same_groups(read.read(steps=1), make_batch(1))
    superseded = ReadOnlyStore(root, attempts="superseded").read(columns=["step"])
    assert sorted(set(superseded.column("step").to_pylist())) == [2, 3]


def test_a_written_run_reads_back_its_known_values(tmp_path):
    written = write_store(tmp_path / "run", steps=range(2), ranks=2, eval_steps=(1,), seed=4)
    assert len(written.groups) == 3 * 2 * 3 and len(written.step_rows) == 3 * 2
    assert [g.kind for g in written.train()] == ["train"] * 12
    assert sorted(written.by_step()) == [0, 1] and sorted(written.by_step("eval")) == [1]
    rows = ReadOnlyStore(written.root).read().to_pylist()
    stored = {(r["step"], r["rank"], r["kind"], r["group_index"]): r for r in rows}
    assert len(stored) == len(written.groups)
    for group in written.groups:
        row = stored[(group.step, group.rank, group.kind, group.index)]
        assert row["total_utils"] == group.utils.tolist()
        assert row["completions"] == group.completions
        assert row["group_size"] == len(group.utils)
    again = write_store(tmp_path / "again", steps=range(2), ranks=2, eval_steps=(1,), seed=4)
    assert [g.completions for g in again.groups] == [g.completions for g in written.groups]
