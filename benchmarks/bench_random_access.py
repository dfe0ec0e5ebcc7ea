"""Benchmark: random groups as trainer-ready tensors, against Lance on the same rows (issue 35).

Stores built by the writer (``benchmarks/writer_stores.py``: real appends, its default
compaction, kept in the bench cache): **take**, 1,000 steps x 16 groups x 16 completions x
32-256 tokens (16,000 groups, ~370 MB of live group files), and **million**, 62,500 steps x
16 groups x 4 completions x 32-64 tokens (1,000,000 groups). A store not built yet is
skipped as a miss naming the reason, unless ``--build`` builds it (``--quick`` builds its
small sizes). The peers' copies are written from the store's own rows
(``benchmarks/peer_copies.py``: read through our reader, one row per group, list columns).

Every ``sample()`` runs on a writable copy of the cached store (its committed files
hard-linked), opened as the run continued (``if_exists="resume"``: a fresh attempt into a
store of an earlier run's steps is refused), since the sampler's default ``record=True``
commits a lifecycle record per batch.

Rows:

- **random take, 64 groups as tensors, 16,000 groups**: ours,
  ``ReplaySampler(store, SamplerOptions(batch_groups=64, sampling="uniform", columns=...))
  .sample().tensors()``: the completion ids, behaviour and reference per-token log-probs,
  advantages and prompt ids as ragged torch tensors, checked against the store's checksums
  (``check_crc`` on), the lifecycle record written (``record=True``). Peer: Lance ``take`` of
  the same rows (the groups ours just sampled) on an open dataset, then the same tensor
  conversion (``Ragged.from_arrow`` of each column, what ``tensors()`` does); Lance's take
  alone in the note. Target <= 1.2x. Baseline: the same rows in one Parquet file written by
  ``pq.write_table`` with its defaults, read by row group (``read_row_groups`` of the groups'
  row groups, then ``take``): what the Lance paper's ~60x is measured against. Floor: the
  same rows taken from an in-memory Arrow table (no I/O, no decoding, no check), then the
  conversion. Before timing, three batches of ours are compared value for value with
  Lance's rows.
- **the same against a fresh Lance dataset**: ``lance.dataset(uri).take(...)`` on a new
  object per batch, then the conversion. Target <= 1.2x.
- **the lifecycle record's cost**: ours with ``record=True`` over ``record=False``, both
  samplers warm (every take file opened once; target <= 1.1: the durable record costs at
  most 10% of a batch).
- **random take, 256 groups, 1,000,000 groups: p50 and p99** over the batches timed
  (ours, alternated with Lance's take of the same rows on an open dataset, then the
  conversion): targets p50 <= 10 ms, p99 <= 30 ms, and p50 <= 1.2x Lance's.
- **sampler construction at 16,000 and 1,000,000 groups**: ``ReplaySampler(store,
  options)`` (its index of every group: keys, versions, reward spread), against the peer a
  Lance-backed sampler would run for the same index (``lance.dataset(uri)`` and its key,
  utility and advantage columns read). Targets <= 100 ms and <= 1 s.

Run ``python benchmarks/bench_random_access.py [--quick] [--build] [--json PATH]``; exit
status 1 on a miss (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import peer_copies as P  # noqa: E402
import writer_stores as W  # noqa: E402
from harness import Figure, custom, within  # noqa: E402

from maxent_arrow import Ragged  # noqa: E402
from maxent_arrow.store import ReplaySampler, RolloutStore, SamplerOptions  # noqa: E402

TENSORS = ["prompt_ids", "completion_ids", "behavior_token_logp", "ref_token_logp", "advantages"]
KEYS = ["step", "rank", "kind", "group_index"]
INDEX = [*KEYS, "total_utils", "advantages"]
TARGET_VS_LANCE = 1.2
TARGET_RECORD = 1.1
TARGET_P50, TARGET_P99 = 0.010, 0.030
TARGET_BUILD_SMALL, TARGET_BUILD_LARGE = 0.1, 1.0


# ---------------------------------------------------------------------------- the stores
def writable_copy(root: Path, where: Path) -> Path:
    """A copy of the store at ``root`` that a sampler may record into (its committed files
    hard-linked: ``writer_stores.linked_copy``)."""
    return W.linked_copy(root, where / root.name)


def store_or_miss(bench: harness.Bench, shape: W.Shape, build: bool, rows: list[str]):
    """The built store of ``shape``, or None after a missed row per name in ``rows``
    (never a silent skip)."""
    built = W.cached(shape, build_missing=build)
    if isinstance(built, W.Built):
        print(f"store: {built.describe()}", flush=True)
        return built
    for name in rows:
        bench.row(
            name,
            ours=Figure(math.nan, "not measured"),
            targets=[custom("store built", 0, ">=", 1)],
            reason=f"skipped: {built}",
        )
    print(f"skipped: {built}", flush=True)
    return None


# ---------------------------------------------------------------------------- contenders
def tensors_of(table: pa.Table, columns: list[str]) -> dict[str, Ragged]:
    """The conversion ``SampledBatch.tensors()`` does, on another reader's table: each
    numeric list column's innermost values as :class:`Ragged` (per-token columns by
    completion)."""
    out = {}
    for name in columns:
        column = table.column(name)
        if pa.types.is_list(column.type.value_type):
            column = column.combine_chunks().flatten()
        out[name] = Ragged.from_arrow(column)
    return out


def sampler_columns(store: RolloutStore) -> tuple[list[str], str]:
    """The columns ours loads: the tensors' (and the keys), or, while ``columns=`` without
    ``"completions"`` fails (issue 35's KeyError in ``partial_step_row``), with
    ``"completions"`` too; and a note saying which."""
    wanted = [*KEYS, *TENSORS]
    try:
        ReplaySampler(store, SamplerOptions(batch_groups=1, columns=wanted, record=False)).sample()
        return wanted, "only the tensor columns loaded"
    except KeyError as exc:
        return [*wanted, "completions"], (
            f"columns= without 'completions' fails ({exc!r}: issue 35's known bug), so ours "
            "loads 'completions' too (and so do the peers)"
        )


class Takes:
    """Ours and the peers on one store, each taking the rows ours sampled last."""

    def __init__(self, store: RolloutStore, lance_uri: Path, options: SamplerOptions, groups: int):
        import lance

        self.lance = lance
        self.uri = str(lance_uri)
        self.dataset = lance.dataset(self.uri)
        self.groups = groups  # per step: a group's Lance row is step * groups + group_index
        self.options = options
        self.columns = list(options.columns or [])
        self.sampler = ReplaySampler(store, options)
        self.rows = np.arange(options.batch_groups or 1)

    def ours(self) -> dict[str, Ragged]:
        batch = self.sampler.sample()
        assert batch is not None
        steps = batch.groups.column("step").to_numpy()
        index = batch.groups.column("group_index").to_numpy()
        self.rows = steps * self.groups + index
        return batch.tensors()

    def lance_open(self) -> pa.Table:
        return self.dataset.take(self.rows, columns=self.columns)

    def lance_fresh(self) -> pa.Table:
        return self.lance.dataset(self.uri).take(self.rows, columns=self.columns)

    def check(self, batches: int = 3) -> None:
        """Ours against Lance's rows, value for value (a bench that reads something else
        proves nothing)."""
        for _ in range(batches):
            mine = self.ours()
            theirs = tensors_of(self.lance_open(), TENSORS)
            for name in TENSORS:
                a, b = mine[name], theirs[name]
                assert a.values.equal(b.values) and a.offsets.equal(b.offsets), name


def parquet_by_row_group(path: Path, columns: list[str]) -> Callable[[np.ndarray], pa.Table]:
    """pyarrow's default Parquet read as a random take: the row groups that hold the rows,
    then the rows (the file kept open)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    meta = file.metadata
    starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])

    def take(rows: np.ndarray) -> pa.Table:
        groups = np.searchsorted(starts, rows, side="right") - 1
        wanted = sorted(set(groups.tolist()))
        table = file.read_row_groups(wanted, columns=columns)
        base = {g: int(starts[g]) for g in wanted}
        offset = np.cumsum([0] + [meta.row_group(g).num_rows for g in wanted])
        local = [int(offset[wanted.index(g)]) + r - base[g] for g, r in zip(groups, rows)]
        return table.take(pa.array(local))

    return take


# ---------------------------------------------------------------------------- the rows
def take_rows(bench: harness.Bench, built: W.Built, work: Path) -> None:
    """64 random groups from the 16,000-group store: ours, Lance open and fresh, pyarrow's
    default Parquet, the in-memory floor; the lifecycle record's cost."""
    label = f"{built.shape.num_groups:,} groups ({built.shape.steps:,} steps)"
    lance_uri = P.lance_copy(built.path)
    default = P.parquet_default_copy(built.path)
    store = RolloutStore(writable_copy(built.path, work), if_exists="resume")
    columns, why = sampler_columns(store)
    options = SamplerOptions(batch_groups=64, sampling="uniform", epochs=None, columns=columns)
    takes = Takes(store, lance_uri, options, built.shape.groups)
    takes.check()
    unrecorded = ReplaySampler(store, SamplerOptions(**{**vars(options), "record": False}))
    pyarrow_take = parquet_by_row_group(default, columns)
    # One chunk per column: a take across chunks concatenates them first (~45x slower).
    memory = takes.dataset.to_table(columns=columns).combine_chunks()
    t = harness.measure(
        {
            "ours": takes.ours,
            "lance": takes.lance_open,
            "lance_tensors": lambda: tensors_of(takes.lance_open(), TENSORS),
            "lance_fresh": takes.lance_fresh,
            "lance_fresh_tensors": lambda: tensors_of(takes.lance_fresh(), TENSORS),
            "unrecorded": lambda: unrecorded.sample().tensors(),  # type: ignore[union-attr]
            "memory": lambda: tensors_of(memory.take(pa.array(takes.rows)), TENSORS),
            "pyarrow": lambda: tensors_of(pyarrow_take(takes.rows), TENSORS),
        },
        repeats=bench.repeats(15, quick=3),
    )
    ours = Figure(t["ours"], "sample().tensors(): record=True, checksums checked")
    baseline = Figure(t["pyarrow"], "pq.write_table defaults: read_row_groups + take, tensors")
    floor = Figure(t["memory"], "the same rows from an in-memory Arrow table, tensors")
    bench.row(
        f"random take, 64 groups as tensors, {label}",
        ours=ours,
        peer=Figure(t["lance_tensors"], "Lance take of the same rows (open dataset), tensors"),
        baseline=baseline,
        floor=floor,
        targets=[within("peer", TARGET_VS_LANCE)],
        note=f"Lance's take alone (an Arrow table): {t['lance'].median * 1e3:.1f} ms; {why}",
        reason="first opens: each take file (one per segment, one per loose unit) is opened "
        "and its frame checked once per process (~0.16 ms each), then each group's bytes "
        "are read, checked and decoded one pread at a time",
    )
    bench.row(
        f"random take, 64 groups as tensors, {label}, against a fresh Lance dataset",
        ours=ours,
        peer=Figure(
            t["lance_fresh_tensors"], "lance.dataset(uri) + take of the same rows, tensors"
        ),
        baseline=baseline,
        floor=floor,
        targets=[within("peer", TARGET_VS_LANCE)],
        note=f"Lance's fresh take alone: {t['lance_fresh'].median * 1e3:.1f} ms",
        reason="as the row above",
    )
    # The record's cost with both samplers warm: a take file's first open (once per
    # process, shared by every sampler) is paid above by whichever sampler touches it first.
    for _ in range(60):
        takes.ours()
        unrecorded.sample()
    warm = harness.measure(
        {"ours": takes.ours, "unrecorded": lambda: unrecorded.sample().tensors()},  # type: ignore[union-attr]
        repeats=bench.repeats(15, quick=3),
    )
    cost = warm["ours"].median / warm["unrecorded"].median
    bench.row(
        f"the lifecycle record's cost, 64 groups, {label}",
        ours=Figure(warm["ours"], "sample().tensors(): record=True, every take file opened"),
        floor=Figure(warm["unrecorded"], "the same sampler with record=False"),
        targets=[custom("record=True / record=False", cost, "<=", TARGET_RECORD)],
        reason="the record's rows are built on the consumer's thread and committed (one "
        "group commit per few batches) by a background thread that takes the GIL from it",
    )


def million_rows(bench: harness.Bench, built: W.Built, work: Path) -> None:
    """256 random groups from the 1,000,000-group store: p50 and p99, against Lance."""
    label = f"{built.shape.num_groups:,} groups ({built.shape.steps:,} steps)"
    lance_uri = P.lance_copy(built.path)
    store = RolloutStore(writable_copy(built.path, work), if_exists="resume")
    columns, why = sampler_columns(store)
    options = SamplerOptions(batch_groups=256, sampling="uniform", epochs=None, columns=columns)
    takes = Takes(store, lance_uri, options, built.shape.groups)
    takes.check(1)
    t = harness.measure(
        {
            "ours": takes.ours,
            "lance": lambda: tensors_of(takes.lance_open(), TENSORS),
        },
        repeats=bench.repeats(30, quick=5),
    )
    p50, p99 = (float(np.percentile(t["ours"].samples, q)) for q in (50, 99))
    lance50, lance99 = (float(np.percentile(t["lance"].samples, q)) for q in (50, 99))
    n = t["ours"].repeats
    bench.row(
        f"random take, 256 groups as tensors, {label}, p50",
        ours=Figure(p50, f"sample().tensors(), record=True; p50 of {n} batches"),
        peer=Figure(lance50, "Lance take of the same rows (open dataset), tensors; p50"),
        targets=[custom("p50 (s)", p50, "<=", TARGET_P50), within("peer", TARGET_VS_LANCE)],
        note=why,
        reason="256 groups from up to 256 units: each unit decoded and checked whole",
    )
    bench.row(
        f"random take, 256 groups as tensors, {label}, p99",
        ours=Figure(p99, f"p99 of {n} batches (interpolated)"),
        peer=Figure(lance99, "Lance, p99"),
        targets=[custom("p99 (s)", p99, "<=", TARGET_P99)],
        reason="as the p50 row",
    )


def construction_row(bench: harness.Bench, built: W.Built, bound: float) -> None:
    """``ReplaySampler(store, options)`` against reading the same index from Lance."""
    import lance

    uri = str(P.lance_copy(built.path))
    store = RolloutStore(built.path)
    options = SamplerOptions(batch_groups=64, sampling="uniform", record=False)

    def peer() -> Any:
        return lance.dataset(uri).to_table(columns=INDEX)

    t = harness.measure(
        {"ours": lambda: ReplaySampler(store, options), "peer": peer},
        repeats=bench.repeats(5 if built.shape.num_groups < 100_000 else 3, quick=2),
    )
    bench.row(
        f"sampler construction, {built.shape.num_groups:,} groups",
        ours=Figure(t["ours"], "ReplaySampler(store, options): the index of every group"),
        peer=Figure(t["peer"], "lance.dataset(uri) + its keys, utilities and advantages"),
        targets=[custom("seconds", t["ours"].median, "<=", bound)],
        reason="the index is built from the group files (every step's keys, utilities and "
        "advantages decoded and checked), not from the log",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    harness.add_arguments(parser)
    parser.add_argument("--build", action="store_true", help="build the stores not built yet")
    args = parser.parse_args(argv)
    build = bool(vars(args).pop("build"))
    bench = harness.Bench("random_access", args)
    take, million = W.SHAPES["take"], W.SHAPES["million"]
    if bench.quick:
        take, million = W.quick(take), W.quick(million)
    build = build or bench.quick
    with tempfile.TemporaryDirectory(dir=W.cache_dir()) as tmp:
        small = store_or_miss(
            bench, take, build,
            ["random take, 64 groups as tensors", "sampler construction, 16,000 groups"],
        )  # fmt: skip
        if small is not None:
            take_rows(bench, small, Path(tmp) / "take")
            construction_row(bench, small, TARGET_BUILD_SMALL)
        large = store_or_miss(
            bench, million, build,
            ["random take, 256 groups, 1,000,000 groups", "sampler construction, 1,000,000 groups"],
        )  # fmt: skip
        if large is not None:
            million_rows(bench, large, Path(tmp) / "million")
            construction_row(bench, large, TARGET_BUILD_LARGE)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
