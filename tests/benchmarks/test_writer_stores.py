"""The benchmarks' stores (``benchmarks/writer_stores.py``) have the layout the writer writes.

A store the bench builder makes (fsync off, built in parts: created, interrupted, resumed,
and extended from a copy of a shorter store, as its cache does) is compared with one written
by a plain loop of durable ``append`` calls of the same steps: the same live files, row
groups per file, rows per row group, codecs, encodings, statistics, dictionary pages and
page indexes of every column chunk, and the same rows.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import writer_stores as W  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.store import ReadOnlyStore  # noqa: E402

# Past the writer's compaction of every 100 one-step files: one segment and loose files.
SHAPE = W.Shape(103, groups=2, k=2, tokens=(3, 6), prompt_tokens=3)
KEY = ["step", "rank", "kind", "group_index"]


def _by_unit(layout: dict) -> dict:
    """File layouts keyed by the file's name without its random commit token."""
    return {re.sub(r"\.[0-9a-z]+\.(parquet|arrow)$", "", name): doc for name, doc in layout.items()}


def _plain_loop(root: Path) -> Path:
    """What a run writes: create, one durable append per step, close."""
    lo, hi = SHAPE.tokens
    with RolloutStore.create(root, config={"max_completion_len": hi}, if_exists="error") as store:
        for step in range(SHAPE.steps):
            store.append(W.step_batch(SHAPE, step))
    return root


def _rows(root: Path):
    return ReadOnlyStore(root).read().sort_by([(k, "ascending") for k in KEY])


def test_the_bench_builder_writes_the_layout_of_a_plain_loop_of_appends(tmp_path, monkeypatch):
    reference = _plain_loop(tmp_path / "plain")
    monkeypatch.setenv(W.ENV_CACHE, str(tmp_path / "cache"))
    # A build in parts: 40 steps, stopped; resumed to 60 (the store says where it was);
    # complete at 60; then the 103-step store starts from a copy of it.
    partial = W.store_path(SHAPE.with_steps(60))
    W.build(partial, SHAPE.with_steps(40))
    assert W.committed_steps(partial) == 40
    assert isinstance(W.cached(SHAPE.with_steps(60), build_missing=False), str)  # not complete
    short = W.cached(SHAPE.with_steps(60), build_missing=True)
    assert isinstance(short, W.Built) and short.appends == 20  # (the first 40: not by cached)
    built = W.cached(SHAPE, build_missing=True)
    assert isinstance(built, W.Built) and built.appends == 20 + SHAPE.steps - 60
    assert built.group_files == 4  # a segment of 100 steps, 3 one-step files
    assert W.committed_steps(built.path) == SHAPE.steps

    straight = tmp_path / "straight"  # and in one go
    assert W.build(straight, SHAPE)[0] == SHAPE.steps

    theirs = _by_unit(W.store_layout(reference))
    segments = [name for name in theirs if name.startswith("groups/compact-")]
    takes = [name for name in theirs if name.startswith("take/")]
    # a take file per unit, written at its append, and the segment's, by its compaction
    assert len(takes) == SHAPE.steps + 1
    # a segment, 3 loose; their step files; the take files
    assert len(segments) == 1 and len(theirs) == 2 * (1 + 3) + len(takes)
    for root in (built.path, straight):
        ours = _by_unit(W.store_layout(root))
        assert sorted(ours) == sorted(theirs)
        for name, doc in theirs.items():
            mine = ours[name]
            if "row_groups" in doc:  # (a Parquet file; a take file has batches)
                rows = [g["rows"] for g in doc["row_groups"]]
                assert [g["rows"] for g in mine["row_groups"]] == rows, name
            assert mine == doc, name
        assert _rows(root).equals(_rows(reference))
    # The shorter store it started from is untouched (its files were linked, not changed).
    assert W.committed_steps(short.path) == 60
    assert ReadOnlyStore(short.path).verify().ok


def test_file_layout_reads_row_groups_codecs_and_page_indexes(tmp_path):
    """The comparison above sees what it compares: a file written with other settings has
    another layout."""
    table = pa.Table.from_batches([W.step_batch(SHAPE, 0).groups])
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=1, compression="zstd",
                   write_page_index=True)  # fmt: skip
    pq.write_table(table, tmp_path / "b.parquet", compression="snappy")
    a, b = W.file_layout(tmp_path / "a.parquet"), W.file_layout(tmp_path / "b.parquet")
    assert [g["rows"] for g in a["row_groups"]] == [1, 1]
    assert [g["rows"] for g in b["row_groups"]] == [2]
    codec, _, column_index, offset_index, _, _ = a["row_groups"][0]["chunks"]["step"]
    assert (codec, column_index, offset_index) == ("ZSTD", True, True)
    codec, _, column_index, offset_index, _, _ = b["row_groups"][0]["chunks"]["step"]
    assert (codec, column_index, offset_index) == ("SNAPPY", False, False)
