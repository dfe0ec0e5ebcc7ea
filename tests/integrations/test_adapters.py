"""The shared pieces of trainer adapters (``maxent_arrow.integrations.adapters``): each against
a plain loop, and a new adapter written from them alone, whose group rows a ``RolloutBatch``
and a store accept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import LayoutError, Ragged, RolloutBatch, RolloutStore
from maxent_arrow.arrow import GroupIdentity, regroup
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.integrations.adapters import (
    completion_info,
    offsets_of,
    reward_columns,
    row_sums,
    token_lists,
    truncation_flags,
)
from maxent_arrow.integrations.steps import step_row

SCHEMA = {f.name: f.type for f in S.GROUP_FIELDS}


def same_type(kind: pa.DataType, name: str) -> bool:
    """``kind`` is the schema's type of column ``name`` (nullability aside: ``RolloutBatch``
    casts list items to non-nullable)."""
    return str(kind).replace(" not null", "") == str(SCHEMA[name]).replace(" not null", "")


EOS, PAD = 2, 0


def padded_ids(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), PAD, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


# ---------------------------------------------------------------------------- truncation
def test_truncation_flags_follow_the_last_token():
    rows = [[5, 6, EOS], [5, 6, 7], [], [9, PAD], [4, 4, 4, 4]]
    ids = padded_ids(rows, 4)
    lengths = [len(r) for r in rows]
    flags = truncation_flags(ids, lengths, eos_token_ids=[EOS], pad_token_id=PAD)
    assert flags.tolist() == [False, True, False, False, True]
    # without a pad id, a pad token ends nothing; several EOS ids each end a completion
    assert truncation_flags(ids, lengths, eos_token_ids=[EOS]).tolist()[3] is True
    assert truncation_flags(ids, lengths, eos_token_ids=[7, 4])[[1, 4]].tolist() == [False] * 2
    assert truncation_flags(ids.numpy(), np.array(lengths), eos_token_ids=[EOS]).dtype == bool
    assert len(truncation_flags(torch.zeros(0, 3, dtype=torch.int64), [])) == 0
    with pytest.raises(LayoutError, match="lengths: expected 5 entries"):
        truncation_flags(ids, [1, 2])


def test_completion_info_has_the_schemas_struct():
    info = completion_info(np.array([3, 4, 0]), np.array([False, True, False]))
    assert info.type == S.COMPLETION_INFO_TYPE
    assert info.to_pylist() == [
        {
            "finish_reason": "stop",
            "stop_reason": None,
            "truncated": False,
            "token_count": 3,
            "extra": None,
        },  # noqa: E501
        {
            "finish_reason": "length",
            "stop_reason": None,
            "truncated": True,
            "token_count": 4,
            "extra": None,
        },  # noqa: E501
        {
            "finish_reason": "stop",
            "stop_reason": None,
            "truncated": False,
            "token_count": 0,
            "extra": None,
        },  # noqa: E501
    ]


# ---------------------------------------------------------------------------- rewards
def test_reward_columns_weighted_nansum_and_unscorable_completions():
    nan = float("nan")
    values = np.array([[1.0, 0.5], [nan, 2.0], [nan, nan]])
    out = reward_columns(values, ["acc", "fmt"], [1.0, 0.5], np.array([0, 2, 3]))
    assert out["reward_names"].to_pylist() == [["acc", "fmt"], ["acc", "fmt"]]
    assert out["reward_values"].type == pa.list_(pa.list_(pa.float64()))
    totals = out["total_utils"].to_pylist()
    assert totals[0] == [1.25, 1.0] and np.isnan(totals[1][0])  # all None: NaN, not 0
    flat = out["reward_values"].to_pylist()
    assert flat[0][0] == [1.0, 0.5] and np.isnan(flat[0][1][0]) and flat[0][1][1] == 2.0
    with pytest.raises(LayoutError, match=r"^my_adapter: rewards: expected 3 columns"):
        reward_columns(values, ["a", "b", "c"], [1, 1, 1], np.array([0, 3]), where="my_adapter")


# ---------------------------------------------------------------------------- identity
def test_group_identity_of_whole_groups_and_of_parts():
    whole = GroupIdentity.of(
        step=7, rank=1, kind="train", group_ids=["a", "b"], group_offsets=np.array([0, 3, 4])
    ).columns()
    identity = [c.name for c in R.columns(R.GROUP) if c.identity]
    assert list(whole) == identity  # the registry's identity columns, in layout order
    assert {k: v.to_pylist() for k, v in whole.items()} == {
        "step": [7, 7],
        "rank": [1, 1],
        "kind": ["train", "train"],
        "group_index": [0, 1],
        "group_id": ["a", "b"],
        "group_size": [3, 1],
        "num_completions": [3, 1],
        "completion_index": [[0, 1, 2], [0]],
        "round": [0, 0],
    }
    for name, column in whole.items():
        assert column.type == SCHEMA[name], name
    parts = GroupIdentity.of(
        step=0,
        rank=0,
        kind="eval",
        group_ids=pa.array(["0.0.1", "0.0.2"]),
        group_offsets=np.array([0, 2, 6]),
        group_size=4,
        completion_index=[2, 3, 0, 1, 2, 3],
        round=1,
    ).columns()
    assert parts["group_size"].to_pylist() == [4, 4]
    assert parts["num_completions"].to_pylist() == [2, 4]
    assert parts["completion_index"].to_pylist() == [[2, 3], [0, 1, 2, 3]]
    assert parts["round"].to_pylist() == [1, 1]
    with pytest.raises(LayoutError, match="group_ids: expected 2 ids"):
        GroupIdentity.of(step=0, rank=0, kind="train", group_ids=["x"], group_offsets=[0, 1, 2])


# ---------------------------------------------------------------------------- per token
@given(st.lists(st.lists(st.floats(-10, 10, width=32), max_size=5), max_size=8))
def test_row_sums_match_a_loop_with_empty_rows_anywhere(rows):
    flat = np.array([x for row in rows for x in row], dtype=np.float32)
    sums = row_sums(flat, offsets_of([len(r) for r in rows]))
    expected = [float(np.sum(np.array(row, dtype=np.float64))) for row in rows]
    assert sums.dtype == np.float64 and np.allclose(sums, expected)


def test_row_sums_of_a_trailing_empty_row_keep_the_row_before_whole():
    # reduceat with a start past the end would cut the last full row short (it did in TRL's)
    assert row_sums(np.array([1.0, 2.0, 3.0]), np.array([0, 3, 3])).tolist() == [6.0, 0.0]


@given(st.lists(st.lists(st.integers(-100, 100), max_size=4), max_size=6), st.data())
def test_token_lists_nest_completions_in_groups(rows, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=3)))
    group_offsets = np.array([0, *cuts, len(rows)])
    flat = np.array([x for row in rows for x in row], dtype=np.int32)
    column = token_lists(flat, offsets_of([len(r) for r in rows]), group_offsets)
    assert same_type(column.type, "completion_ids")
    assert column.type.value_type.value_field.nullable is False  # tokens: never null
    assert column.to_pylist() == [
        rows[lo:hi] for lo, hi in zip(group_offsets[:-1], group_offsets[1:])
    ]


def test_token_lists_of_several_values_per_token():
    per_token = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.int32)), 3)
    column = token_lists(per_token, np.array([0, 1, 4]), np.array([0, 2]), item=per_token.type)
    assert column.to_pylist() == [[[[0, 1, 2]], [[3, 4, 5], [6, 7, 8], [9, 10, 11]]]]


# ---------------------------------------------------------------------------- a new adapter
def another_trainers_batch():
    """What a trainer holds after a round: left-padded prompts, right-padded completions
    (with EOS), per-token log-probs and per-function rewards, two prompts x two samples."""
    prompt_ids = torch.tensor([[0, 0, 11, 12], [0, 0, 11, 12], [0, 13, 14, 15], [0, 13, 14, 15]])
    prompt_mask = (prompt_ids != 0).long()
    completions = [[21, 22, EOS], [23, 24, 25, 26], [27, EOS], [28]]
    ids = padded_ids(completions, 4)
    lengths = torch.tensor([len(c) for c in completions])
    logps = -torch.rand(4, 4, dtype=torch.float64)
    rewards = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [float("nan"), 0.5]])
    return prompt_ids, prompt_mask, ids, lengths, logps, rewards


def test_a_new_adapter_needs_nothing_but_the_shared_pieces(tmp_path):
    prompt_ids, prompt_mask, ids, lengths, logps, rewards = another_trainers_batch()
    group_offsets = np.array([0, 2, 4])
    firsts = group_offsets[:-1]
    prompts = Ragged.from_padded(prompt_ids, prompt_mask, rows=firsts, dtype=torch.int32)
    tokens = Ragged.from_padded(ids, lengths=lengths, dtype=torch.int32)
    logp = Ragged.from_padded(logps, lengths=lengths, dtype=torch.float32)
    token_offsets = tokens.offsets.numpy()
    flags = truncation_flags(ids, lengths, eos_token_ids=[EOS], pad_token_id=PAD)
    columns = GroupIdentity.of(
        step=3, rank=0, kind="train", group_ids=["p0", "p1"], group_offsets=group_offsets
    ).columns()
    columns["prompt_ids"] = regroup(pa.array(prompts.values.numpy()), prompts.offsets.numpy())
    columns["completions"] = regroup(pa.array(["a", "b", "c", "d"]), group_offsets)
    columns["completion_ids"] = token_lists(tokens.values.numpy(), token_offsets, group_offsets)
    columns["completion_info"] = regroup(completion_info(lengths.numpy(), flags), group_offsets)
    columns.update(reward_columns(rewards, ["acc", "fmt"], [1.0, 1.0], group_offsets))
    columns["behavior_token_logp"] = token_lists(
        logp.values.numpy(), token_offsets, group_offsets, item=pa.float32()
    )
    columns["behavior_logp_sum"] = regroup(
        pa.array(row_sums(logp.values.numpy(), token_offsets)), group_offsets
    )
    table = pa.table(columns)
    for name in table.schema.names:
        assert same_type(table.schema.field(name).type, name), name
    batch = RolloutBatch(table, step_row(table, step=3, rank=0, kind="train"))  # validates
    assert batch.num_groups == 2 and batch.num_samples == 4
    assert table.column("prompt_ids").to_pylist() == [[11, 12], [13, 14, 15]]
    assert table.column("completion_ids").to_pylist() == [
        [[21, 22, EOS], [23, 24, 25, 26]],
        [[27, EOS], [28]],
    ]
    info = table.column("completion_info").to_pylist()
    assert [i["finish_reason"] for group in info for i in group] == [
        "stop",
        "length",
        "stop",
        "length",
    ]
    sums = [x for group in table.column("behavior_logp_sum").to_pylist() for x in group]
    expected = [float(logps[i, :n].float().double().sum()) for i, n in enumerate(lengths)]
    assert np.allclose(sums, expected, atol=1e-6)
    store = RolloutStore.create(tmp_path / "store")
    store.append(batch)
    back = next(iter(store.replay()))
    assert back.groups.column("completion_ids").to_pylist() == (
        table.column("completion_ids").to_pylist()
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_truncation_flags_read_device_ids_on_the_device():
    rows = [[5, 6, EOS], [5, 6, 7], [], [9, PAD]]
    ids = padded_ids(rows, 4)
    lengths = torch.tensor([len(r) for r in rows])
    host = truncation_flags(ids, lengths, eos_token_ids=[EOS], pad_token_id=PAD)
    device = truncation_flags(ids.cuda(), lengths.cuda(), eos_token_ids=[EOS], pad_token_id=PAD)
    assert device.tolist() == host.tolist() == [False, True, False, False]
