"""``reassemble``: parts of a group written by different ranks merge into one row in
``completion_index`` order; whole groups pass through; doubled parts are refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from maxent_arrow.errors import LayoutError
from maxent_arrow.rollout import reassemble


def part(step, rank, group_id, indices, *, kind="train", size=4, extra=True, group_index=0):
    k = len(indices)
    row = {
        "step": step,
        "rank": rank,
        "kind": kind,
        "group_index": group_index,
        "group_id": group_id,
        "group_size": size,
        "num_completions": k,
        "prompt": f"p{group_id}",
        "prompt_ids": [len(group_id), 7],
        "completions": [f"{group_id}/{i}" for i in indices],
        "completion_index": list(indices),
        "completion_ids": [[i] * (i + 1) for i in indices],
        "advantages": [float(i) for i in indices],
        "reward_names": ["a", "b"],
        "reward_values": [[float(i), -float(i)] for i in indices],
    }
    if extra:  # an extra per-token column, like the TRL recorder's sampling_token_logp
        row["sampling_token_logp"] = [[0.5 * i] * (i + 1) for i in indices]
    return row


def table(rows):
    schema = pa.Table.from_pylist([part(0, 0, "x", [0])]).schema
    return pa.Table.from_pylist(rows, schema=schema)


def test_parts_of_a_group_merge_in_completion_index_order():
    rows = [
        part(3, 0, "a", [2, 3]),
        part(3, 0, "b", [0, 1], size=2, group_index=1),
        part(3, 1, "a", [0, 1]),
        part(3, 1, "c", [0, 1, 2, 3], group_index=1),
    ]
    got = reassemble(table(rows)).to_pylist()
    assert [r["group_id"] for r in got] == ["a", "b", "c"]  # order of each group's first row
    a = got[0]
    assert a["num_completions"] == 4 and a["rank"] == 0
    assert a["completion_index"] == [0, 1, 2, 3]
    assert a["completions"] == ["a/0", "a/1", "a/2", "a/3"]
    assert a["completion_ids"] == [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
    assert a["reward_values"] == [[0.0, -0.0], [1.0, -1.0], [2.0, -2.0], [3.0, -3.0]]
    assert a["sampling_token_logp"] == [[0.0], [0.5, 0.5], [1.0] * 3, [1.5] * 4]
    assert a["reward_names"] == ["a", "b"] and a["prompt_ids"] == [1, 7]
    assert got[1] == table([rows[1]]).to_pylist()[0]  # whole groups as stored
    assert got[2] == table([rows[3]]).to_pylist()[0]


def test_same_group_id_in_other_steps_or_kinds_is_another_group():
    rows = [
        part(0, 0, "a", [0, 1], size=2),
        part(1, 0, "a", [0, 1], size=2),
        part(0, 0, "a", [0, 1], size=2, kind="eval"),
    ]
    t = table(rows)
    assert reassemble(t) is t  # nothing in parts: returned unchanged


def test_a_column_null_in_one_part_is_null_for_the_merged_group():
    rows = [part(0, 0, "a", [0, 1]), part(0, 1, "a", [2, 3], extra=False)]
    got = reassemble(table(rows))
    assert got.column("sampling_token_logp").to_pylist() == [None]
    assert got.column("advantages").to_pylist() == [[0.0, 1.0, 2.0, 3.0]]


def test_a_missing_part_leaves_the_group_short_and_chunked_input_works():
    t = pa.concat_tables([table([part(5, 0, "g", [3])]), table([part(5, 2, "g", [0, 1])])])
    assert t.column("completions").num_chunks == 2
    got = reassemble(t).to_pylist()
    assert got[0]["completion_index"] == [0, 1, 3] and got[0]["num_completions"] == 3
    assert got[0]["group_size"] == 4


def test_a_part_written_twice_is_refused_naming_the_group():
    rows = [part(2, 0, "a", [0, 1]), part(2, 1, "a", [1, 2])]
    with pytest.raises(LayoutError, match=r"step 2, kind 'train', group_id 'a'.*index 1"):
        reassemble(table(rows))
    rows = [part(2, 0, "a", [0, 1, 2], size=3), part(2, 1, "a", [3], size=3)]
    with pytest.raises(LayoutError, match="4 completions in its parts, more than its group_size"):
        reassemble(table(rows))


def test_many_groups_split_over_ranks_reassemble_like_trl_spreads_them():
    # Global rows 0..23 in groups of 6, dealt to 3 ranks 8 rows each, as TRL's sampler does.
    k, per_rank = 6, 8
    rows = []
    for rank in range(3):
        g = rank * per_rank + np.arange(per_rank)
        for group in np.unique(g // k):
            idx = (g[g // k == group] % k).tolist()
            rows.append(part(0, rank, f"0.0.{group}", idx, size=k))
    assert len(rows) == 6  # two groups are split
    got = reassemble(table(rows))
    assert got.column("group_id").to_pylist() == ["0.0.0", "0.0.1", "0.0.2", "0.0.3"]
    assert got.column("completion_index").to_pylist() == [list(range(k))] * 4
    assert got.column("completions").to_pylist()[1] == [f"0.0.1/{i}" for i in range(k)]
