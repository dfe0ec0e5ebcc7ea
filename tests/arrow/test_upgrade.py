"""Schema 1.x files read in the 2.0 layout: the golden v1 store's own files, upgraded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.identity import completion_index_of
from maxent_arrow.arrow.upgrade import (
    needs_upgrade,
    reward_lists,
    upgrade_groups,
    upgrade_steps,
)

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "golden_v1"


def test_versions_that_need_upgrading():
    assert needs_upgrade("1.0") and needs_upgrade(b"1.3")
    assert not needs_upgrade("2.0") and not needs_upgrade("2.1")


def test_completion_index_counts_within_each_row():
    assert completion_index_of(np.array([2, 0, 3])).to_pylist() == [[0, 1], [], [0, 1, 2]]


def test_reward_lists_are_per_completion_and_aligned_with_the_names():
    names, values = reward_lists(
        ["acc", "fmt"], [np.array([1.0, 0.0, 1.0]), np.array([0.5, 0.25, 0.0])], np.array([0, 2, 3])
    )
    assert names.to_pylist() == [["acc", "fmt"], ["acc", "fmt"]]
    assert values.to_pylist() == [[[1.0, 0.5], [0.0, 0.25]], [[1.0, 0.0]]]


@pytest.mark.parametrize(
    "path", sorted((GOLDEN / "groups").glob("*.parquet")), ids=lambda p: p.name
)
def test_golden_v1_group_files_upgrade_without_losing_a_value(path):
    old = pq.read_table(path)
    assert old.schema.metadata[S.METADATA_KEY] == b"1.0"
    kind = path.name.split(".")[-2]
    new = upgrade_groups(old, kind=kind)
    assert new.schema.metadata[S.METADATA_KEY] == S.SCHEMA_VERSION.encode()
    current = S.group_schema()
    for field in new.schema:
        assert field.type == current.field(field.name).type, field.name
    assert set(new.column("kind").to_pylist()) == {kind}
    k = [len(c) for c in old.column("completions").to_pylist()]
    assert new.column("num_completions").to_pylist() == k == new.column("group_size").to_pylist()
    assert new.column("completion_index").to_pylist() == [list(range(n)) for n in k]
    ids = new.column("group_id").to_pylist()
    assert len(set(zip(new.column("step").to_pylist(), ids))) == new.num_rows
    # Every raw reward value is where it was, by name; a function added later is absent
    # from the rows written before it.
    old_rewards = old.column("rewards").to_pylist()
    names = new.column("reward_names").to_pylist()
    values = new.column("reward_values").to_pylist()
    for g, row in enumerate(old_rewards):
        present = [n for n, v in row.items() if v is not None]
        assert names[g] == present
        for j, name in enumerate(present):
            assert [v[j] for v in values[g]] == row[name]
    for name in set(old.column_names) - {"rewards"}:
        assert new.column(name).equals(old.column(name).cast(new.schema.field(name).type)), name


def test_golden_v1_step_files_get_bucket_lists():
    for path in sorted((GOLDEN / "steps").glob("*.parquet")):
        old = pq.read_table(path)
        new = upgrade_steps(old)
        assert not any(pa.types.is_map(f.type) for f in new.schema)
        for before, labels, after in zip(
            old.column("kl_per_token_by_len_bucket").to_pylist(),
            new.column("kl_length_buckets").to_pylist(),
            new.column("kl_per_token_by_len_bucket").to_pylist(),
        ):
            if before is None:
                assert labels is None and after is None
                continue
            assert labels == [k for k, _ in before]
            assert list(zip(labels, after)) == before
