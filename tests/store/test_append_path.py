"""What an append touches: a ``sys.setprofile`` trace of one append of a two-group step (the
store's writer built, its attempt begun) calls at most 78 distinct functions of the package
across at most 89 module switches (the format issue's measure: half of the 157 and 178 it
found). The writer knows the store as its last commit left it; a commit of another writer
between two appends is seen, and checked against, before the next one."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest

from maxent_arrow import RolloutBatch, RolloutStore, SchemaError
from maxent_arrow.testing import make_batch


def _trace(store: RolloutStore, batch: RolloutBatch) -> tuple[set[tuple[str, str]], int]:
    seen: set[tuple[str, str]] = set()
    switches, last = 0, None

    def profile(frame, event, arg):
        nonlocal switches, last
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("maxent_arrow"):
            seen.add((module, frame.f_code.co_qualname))
            if module != last:
                switches, last = switches + 1, module

    sys.setprofile(profile)
    try:
        store.append(batch)
    finally:
        sys.setprofile(None)
    return seen, switches


def test_an_append_touches_at_most_half_the_functions_it_did(tmp_path):
    store = RolloutStore.create(tmp_path / "s", compact_every=None)
    store.append(make_batch(0, groups=2))
    functions, switches = _trace(store, make_batch(1, groups=2))
    assert store.steps() == [0, 1]  # the traced append is committed
    assert len(functions) <= 78, sorted(functions)
    assert switches <= 89


def _with_column(batch: RolloutBatch, name: str, values: pa.Array) -> RolloutBatch:
    return RolloutBatch(batch.groups.append_column(name, values), batch.step_row)


def test_a_commit_of_another_writer_between_two_appends_is_checked_against(tmp_path):
    """Writer A's view of the store is its own last commit's; writer B commits a column of
    its own between two appends of A, so A's next append, whose column of that name has
    another type, is refused as if A had read every file (and nothing is written)."""
    root = tmp_path / "s"
    a = RolloutStore.create(root, compact_every=None)
    a.append(make_batch(0, groups=2))
    b = RolloutStore(root, compact_every=None)
    b.append(_with_column(make_batch(1, groups=2), "note", pa.array([1, 2], pa.int64())))
    before = sorted(p.name for p in (root / "groups").iterdir())
    with pytest.raises(SchemaError, match="note"):
        a.append(_with_column(make_batch(2, groups=2), "note", pa.array(["x", "y"])))
    assert sorted(p.name for p in (root / "groups").iterdir()) == before
    a.append(_with_column(make_batch(2, groups=2), "note", pa.array([3, 4], pa.int64())))
    assert RolloutStore(root).steps() == [0, 1, 2]

