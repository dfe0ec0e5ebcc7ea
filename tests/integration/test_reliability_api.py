"""Fault class: bad input through the API. What reaches Arrow (``to_arrow``, ``from_parts``,
``RolloutBatch(...)``, an append) and cannot be stored faithfully is refused with a typed error
(:class:`SchemaError` for a wrong type, :class:`LayoutError` for a wrong shape or value) that
names the field and the position, and nothing is written: the store is byte for byte as it was.
"""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from fault_harness import snapshot

from maxent_arrow import (
    ArgumentError,
    GenerationBatch,
    LayoutError,
    RolloutBatch,
    RolloutStore,
    RunAnalytics,
    SchemaError,
    StoreError,
)
from maxent_arrow.testing import make_batch, make_parts


@pytest.fixture
def store(tmp_path):
    store = RolloutStore.create(tmp_path / "store")
    store.append(make_batch(0))
    return store


def _replace_column(batch: RolloutBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    groups = batch.groups
    return groups.set_column(groups.schema.get_field_index(name), name, array)


def _bad_parts():
    """(label, from_parts kwargs, error type, message pattern)."""
    parts = make_parts()
    cases = []
    sb = parts["score_batch"]
    ids = sb.completion_ids.clone()
    ids[5, 0] = 2**40
    cases.append(
        (
            "token id beyond int32",
            {**parts, "score_batch": dataclasses.replace(sb, completion_ids=ids)},
            LayoutError,
            r"score_batch\.completion_ids: value 1099511627776 at group 1, sample 1, token 0",
        )
    )
    cases.append(
        (
            "float tensor as token ids",
            {**parts, "score_batch": dataclasses.replace(sb, completion_ids=ids.float())},
            SchemaError,
            r"completion_ids.*integer",
        )
    )
    n = sum(len(g) for g in parts["generation"].grouped_completions)
    cases.append(
        (
            "weights of another count",
            {**parts, "weights": np.ones(n - 1)},
            LayoutError,
            rf"weights.* expected {n} rows",
        )
    )
    cases.append(("a kind that is not a name", {**parts, "kind": "../x"}, SchemaError, r"kind"))
    cases.append(
        (
            "a config that is not JSON",
            {**parts, "config": {"tokenizer": object()}},
            SchemaError,
            r"config.*JSON",
        )
    )
    gen = parts["generation"]
    cases.append(
        (
            "a stand-in where a prompt belongs",
            {
                **parts,
                "generation": dataclasses.replace(
                    gen, prompts=[SimpleNamespace(text="x")] * len(gen.prompts)
                ),
            },
            SchemaError,
            r"prompts",
        )
    )
    grouped = [list(g) for g in gen.grouped_completions]
    grouped[2][1] = None
    cases.append(
        (
            "None inside a group of completions",
            {**parts, "generation": dataclasses.replace(gen, grouped_completions=grouped)},
            (SchemaError, LayoutError),
            r"grouped_completions.*group 2",
        )
    )
    return cases


@pytest.mark.parametrize(
    ("label", "kwargs", "error", "pattern"), _bad_parts(), ids=[c[0] for c in _bad_parts()]
)
def test_from_parts_refuses_with_field_and_position(label, kwargs, error, pattern):
    step = kwargs.pop("step", 3)
    with pytest.raises(error, match=pattern):
        RolloutBatch.from_parts(step, **kwargs)


def test_negative_step_and_rank_are_refused():
    parts = make_parts()
    with pytest.raises(LayoutError, match=r"RolloutBatch\.step: expected >= 0, got -1"):
        RolloutBatch.from_parts(-1, **parts)
    with pytest.raises(LayoutError, match=r"RolloutBatch\.rank: expected >= 0, got -2"):
        RolloutBatch.from_parts(0, rank=-2, **parts)


def test_generation_to_arrow_names_the_group_of_a_bad_completion():
    gen = GenerationBatch(["a", "b"], ["1", "2"], [["x", "y"], ["z", 7]], None)
    with pytest.raises(SchemaError, match=r"grouped_completions.*group 1"):
        gen.to_arrow()


def _bad_batches():
    good = make_batch(1)
    k = good.groups.column("num_completions").to_pylist()
    wrong_k = pa.array([k[0] + 1, *k[1:]], pa.int32())
    values = good.groups.column("reward_values").to_pylist()
    values[1][2] = values[1][2][:1]  # one reward value where two names are
    wrong_rewards = pa.array(values, good.groups.schema.field("reward_values").type)
    other_rank = pa.array([0, 5, 0], pa.int32())
    return [
        ("num_completions disagrees", _replace_column(good, "num_completions", wrong_k),
         r"num_completions.*group 0"),
        ("a reward value missing", _replace_column(good, "reward_values", wrong_rewards),
         r"reward_values.*group 1, sample 2"),
        ("a step of another rank", _replace_column(good, "rank", other_rank), r"'rank'.*group 1"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "groups", "pattern"), _bad_batches(), ids=[c[0] for c in _bad_batches()]
)
def test_a_batch_that_breaks_the_layout_is_refused_by_name(label, groups, pattern):
    with pytest.raises(LayoutError, match=pattern):
        RolloutBatch(groups, make_batch(1).step_row)


def test_appends_that_fail_write_nothing(store):
    good, later = make_batch(1), make_batch(2)
    ints = good.groups.append_column("extra", pa.array([1] * good.num_groups))
    store.append(RolloutBatch(ints, good.step_row))
    strings = later.groups.append_column("extra", pa.array(["x"] * later.num_groups))
    before = snapshot(store.root)
    failures = [
        (lambda: store.append(RolloutBatch(strings, later.step_row)), SchemaError, "extra"),
        (lambda: store.append(make_batch(0)), StoreError, "already in the store"),
        (lambda: store.append({"step": 3}), SchemaError, "RolloutBatch"),
        (lambda: store.append(make_batch(10**11)), StoreError, "out of range"),
    ]
    for call, error, pattern in failures:
        with pytest.raises(error, match=re.escape(pattern)):
            call()
        assert snapshot(store.root) == before


# ---------------------------------------------------------------------- replay and read arguments
@pytest.fixture
def three(tmp_path):
    store = RolloutStore.create(tmp_path / "three")
    for step in range(3):
        store.append(make_batch(step))
    return store


def test_a_negative_start_is_refused_not_replayed_twice(three):
    """A cursor position counts the batches already yielded: -1 (a Python index from the
    end) or a position past the plan is refused, never a replay of the last batches."""
    cursor = next(iter(three.replay())).cursor
    for bad in (-1, {**cursor, "position": -1}, json.dumps({**cursor, "position": -2}), 4):
        with pytest.raises(ArgumentError, match="start"):
            list(three.replay(start=bad))
    assert [b.step for b in three.replay(start=cursor)] == [1, 2]
    assert [b.step for b in three.replay(start=3)] == []


BAD_ARGUMENTS = {
    "replay steps='12'": (lambda s: s.replay(steps="12"), ArgumentError, "steps"),
    "read steps='12'": (lambda s: s.read(steps="12"), ArgumentError, "steps"),
    "read steps=[1.5]": (lambda s: s.read(steps=[1.5]), ArgumentError, "steps"),
    "read ranks='0'": (lambda s: s.read(ranks="0"), ArgumentError, "ranks"),
    "start not JSON": (lambda s: s.replay(start="not a cursor"), ArgumentError, "start"),
    "start a list": (lambda s: s.replay(start=[1]), ArgumentError, "start"),
    "read columns='step'": (lambda s: s.read(columns="step"), ArgumentError, "columns"),
    "filter on no field": (lambda s: s.read(filter=pc.field("nope") > 1), ArgumentError, "filter"),
    "replay unknown column": (lambda s: s.replay(columns=["nope"]), SchemaError, "nope"),
    "replay columns='q'": (lambda s: s.replay(columns="q"), ArgumentError, "columns"),
    "replay source=None": (lambda s: s.replay(source=None), ArgumentError, "source"),
    "batch_groups=0": (lambda s: s.replay(batch_groups=0), ArgumentError, "batch_groups"),
    "unknown option": (lambda s: s.replay(no_such_option=1), ArgumentError, "no_such_option"),
    "on_error='maybe'": (lambda s: s.read(on_error="maybe"), ArgumentError, "on_error"),
    "sql timeout=-1": (lambda s: s.sql("SELECT 1", timeout=-1), ArgumentError, "timeout"),
    "lock_timeout='soon'": (
        lambda s: RolloutStore(s.root, lock_timeout="soon"),
        ArgumentError,
        "timeout",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "pattern"), list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS)
)
def test_bad_arguments_are_typed_errors_naming_the_argument(three, call, error, pattern):
    """``steps="12"`` is not steps {1, 2}; a cursor that is not JSON, a filter on an unknown
    field, an unknown replay column: each a typed error naming the argument (an
    :class:`ArgumentError` is a usage error, exit 2, on the command line)."""
    before = snapshot(three.root)
    with pytest.raises(error, match=pattern):
        out = call(three)
        if hasattr(out, "__next__"):
            list(out)
    assert snapshot(three.root) == before


def test_rewards_named_alike_but_for_case_keep_their_own_values(tmp_path):
    """DuckDB's identifiers ignore case: two reward functions ``Acc`` and ``acc`` get two
    columns of samples (``reward_Acc``, ``reward_acc_1``) and two curves, each its own."""
    store = RolloutStore.create(tmp_path / "s")
    batch = make_batch(0, reward_names=("Acc", "acc"))
    store.append(batch)
    row = batch.groups.to_pylist()[0]
    own = {
        n: [v[row["reward_names"].index(n)] for v in row["reward_values"]] for n in ("Acc", "acc")
    }
    assert own["Acc"] != own["acc"]
    got = store.sql(
        "SELECT reward_Acc, reward_acc_1 FROM samples WHERE group_index = 0 ORDER BY sample_index"
    )
    assert got.column("reward_Acc").to_pylist() == own["Acc"]
    assert got.column("reward_acc_1").to_pylist() == own["acc"]
    values = {
        n: [x for r in batch.groups.to_pylist() for v in r["reward_values"]
            for x in [v[r["reward_names"].index(n)]]]
        for n in ("Acc", "acc")
    }  # fmt: skip
    with RunAnalytics(store) as run:
        curve = {r["reward"]: r["mean"] for r in run.reward_curve().to_pylist()}
        assert curve["Acc"] == pytest.approx(np.mean(values["Acc"]))
        assert curve["acc"] == pytest.approx(np.mean(values["acc"]))
