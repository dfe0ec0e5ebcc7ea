"""Fault class: bad input through the API. What reaches Arrow (``to_arrow``, ``from_parts``,
``RolloutBatch(...)``, an append) and cannot be stored faithfully is refused with a typed error
(:class:`SchemaError` for a wrong type, :class:`LayoutError` for a wrong shape or value) that
names the field and the position, and nothing is written: the store is byte for byte as it was.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from fault_harness import snapshot
from store_fixtures import make_batch, make_parts

from maxent_arrow import (
    GenerationBatch,
    LayoutError,
    RolloutBatch,
    RolloutStore,
    SchemaError,
    StoreError,
)


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
