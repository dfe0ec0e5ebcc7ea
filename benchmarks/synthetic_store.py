"""Synthetic stores for the scale benchmarks: many steps and ranks, built in seconds.

:func:`build` writes a store of format 3 (a commit log) that this library's readers,
``verify`` and plain readers accept, without going through one fsync'd ``append`` per unit:

- ``layout="compacted"``: each commit is a segment of ``segment_steps`` steps and every rank
  of one kind (what ``compact`` writes), built vectorised from numpy, committed by the
  store's own commit function (:func:`maxent_arrow.store.io.commit.commit_unit`, ``op:
  "compact"`` with nothing to replace): the same group file settings, chunk CRCs, sealed
  step file, log entry and checkpoints as a real compaction;
- ``layout="loose"``: one commit per (step, rank, kind), as ``append`` writes them (one
  group file and one step file each), through the same commit function.

Each unit holds ``groups`` groups of ``k`` completions of ``tokens`` tokens (token ids,
text, rewards, advantages, the maxent family's ``q``/``weights``/reference log-probs), the
columns declared in the column registry (padded to the run's layout by the store's own
``pad_to_layout``). Durability is what is skipped (a benchmark fixture, not a run; nothing
else differs): ``os.fsync`` is a no-op while it writes (one ``sync`` of the file system at
the end), and the log's checkpoint every 100 commits is not written (each rewrites the whole
state, so they cost O(commits^2): ~100 s of the old 10^5 build); one checkpoint is written at
the end, so a reader reads one checkpoint and no entries.

How it is fast: the columns that are the same in every segment of a build (indices, sizes,
the token id pattern, texts) are built once per process and sliced; the rest is numpy from
one generator per commit (seeded by ``seed`` and the commit's index, so the data do not
depend on how the commits are split); and the commits are shared among one process per core
(spawned; each commits through the store's lock, so log versions follow commit order). What
is left is the store's own work per segment, measured at ~55 ms of CPU (~40 ms of it the
Parquet encoding of ``completion_ids``' nested lists, then the chunk CRCs, the step file
and the log entry; zstd level 1 costs no more than no compression here).

File counts (group files; each has a step file beside it): compacted ``ceil(steps /
segment_steps)`` per kind (train every step, eval every ``eval_every`` steps); loose
``steps x ranks`` per kind. Log entries: one per group file plus the attempt. With the
defaults (``segment_steps=100``, ``eval_every=10``), compacted: 10^3 steps = 20 group files
(140,800 group rows, 29 MiB), 10^4 = 200 (1.4 M rows, 290 MiB), 10^5 = 2,000 (14 M rows,
2.9 GiB); loose: 100 steps x 8 ranks = 880 files (one commit each). Each has as many step
files and one log entry per file plus the attempt's. Measured builds on the 2 shared cores
(CPU: user + system of all processes): 10^3 steps 1.3 s; 10^4 18 s (14 s CPU); 10^5 475 s
wall for 176 s of CPU while other sessions kept the load average at 8 (the build got 36 % of
one core per process; the old builder: 416 s, ~240 s of CPU, 100 s of it the checkpoints).

Run ``python benchmarks/synthetic_store.py PATH --steps N --ranks R [--layout loose]`` to
build one and print its counts and build time. ``MAXENT_ARROW_BENCH_CACHE`` (see
:func:`cached`) keeps built stores between benchmark runs, keyed by their parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maxent_arrow.arrow import schema as S  # noqa: E402
from maxent_arrow.store import RolloutStore  # noqa: E402
from maxent_arrow.store.history import log as store_log  # noqa: E402
from maxent_arrow.store.history.operations import (  # noqa: E402
    AppendUnit,
    CompactUnits,
    UnitOperation,
)
from maxent_arrow.store.io.commit import CommitRequest, UnitFiles, commit_unit  # noqa: E402
from maxent_arrow.store.storage.names import compact_name, unit_name  # noqa: E402
from maxent_arrow.store.storage.padding import pad_to_layout  # noqa: E402
from maxent_arrow.store.upkeep.compaction import ROW_GROUP_GROUPS  # noqa: E402

__all__ = ["Built", "build", "cached"]

FAMILIES = ("core", "maxent")
REWARD = "accuracy"
LAYOUTS = ("compacted", "loose")
# Part of the cache key: a store built by an older builder (or an older store format) is
# built again rather than reused (4: checkpoints that hold each step file's summary, what
# `inspect` reads, and the builder's per-commit seeds).
FORMAT = 4


@dataclasses.dataclass(frozen=True)
class Built:
    """What :func:`build` made: the store, its file and entry counts, and the build time."""

    path: Path
    steps: int
    ranks: int
    kinds: tuple[str, ...]
    layout: str
    group_files: int
    log_entries: int
    group_rows: int
    bytes: int
    seconds: float
    cpu_seconds: float = 0.0  # user + system, of the builder and its worker processes

    def describe(self) -> str:
        return (
            f"{self.steps:,} steps x {self.ranks} ranks ({'+'.join(self.kinds)}, {self.layout}): "
            f"{self.group_files:,} group files (+ as many step files), {self.log_entries:,} log "
            f"entries, {self.group_rows:,} group rows, {self.bytes / 2**20:,.0f} MiB, built in "
            f"{self.seconds:.1f} s"
            + (f" ({self.cpu_seconds:.0f} s of CPU)" if self.cpu_seconds else "")
        )


def _lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    item = pa.field("item", values.type, nullable=False)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(item))


# The columns that are the same in every table of one shape (units, groups, k, tokens,
# kind): built once per process (a build's segments share one shape).
_SHAPES: dict[tuple[int, int, int, int, str], dict[str, pa.Array]] = {}


def _constant(u: int, groups: int, k: int, tokens: int, kind: str) -> dict[str, pa.Array]:
    key = (u, groups, k, tokens, kind)
    if key not in _SHAPES:
        p = u * groups
        n = p * k
        goff = np.arange(0, n + 1, k)
        _SHAPES.clear()  # one shape at a time (the loose and compacted shapes differ)
        _SHAPES[key] = {
            "kind": pa.array(np.full(p, kind, object), pa.string()),
            "group_index": pa.array(np.tile(np.arange(groups, dtype=np.int32), u)),
            "group_size": pa.array(np.full(p, k, np.int32)),
            "num_completions": pa.array(np.full(p, k, np.int32)),
            "completion_index": _lists(goff, pa.array(np.tile(np.arange(k, dtype=np.int32), p))),
            "round": pa.array(np.zeros(p, np.int32)),
            "answer": pa.array(np.full(p, "42", object), pa.string()),
            "prompt_ids": _lists(
                np.arange(0, 8 * p + 1, 8), pa.array((np.arange(8 * p) % 97).astype(np.int32))
            ),
            "reward_names": _lists(
                np.arange(p + 1), pa.array(np.full(p, REWARD, object), pa.string())
            ),
            # Token ids: a low-entropy pattern (the benchmarks time reads of the catalog and
            # of a few columns, not the compression of random ids), sliced to each table's
            # token count.
            "token_ids": pa.array((np.arange(n * tokens, dtype=np.int64) % 251).astype(np.int32)),
            "texts": pa.array([f"completion of {t} tokens " * 2 for t in range(tokens + 1)]),
            "finish": pa.array(["stop", "length"]),
            "no_text": pa.nulls(n, pa.string()),
            "one_reward": pa.array(np.arange(n + 1, dtype=np.int32)),
        }
    return _SHAPES[key]


def _tables(
    units: Sequence[tuple[int, int]],
    kind: str,
    total_steps: int,
    *,
    groups: int,
    k: int,
    tokens: int,
    rng: np.random.Generator,
) -> tuple[pa.Table, pa.Table, list[int]]:
    """Group rows and step rows of ``units`` ((step, rank) each, in order), vectorised, and
    the first group row of each unit."""
    u = len(units)
    fixed = _constant(u, groups, k, tokens, kind)
    unit_steps = np.array([s for s, _ in units], np.int64)
    unit_ranks = np.array([r for _, r in units], np.int32)
    steps = np.repeat(unit_steps, groups)
    ranks = np.repeat(unit_ranks, groups)
    p = u * groups  # group rows
    n = p * k  # completions
    goff = np.arange(0, n + 1, k)
    lens = rng.integers(tokens // 2, tokens + 1, n).astype(np.int32)
    toff = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int32)
    progress = np.repeat(steps, k) / max(total_steps, 1)
    acc = (rng.random(n) < 0.2 + 0.6 * progress).astype(np.float64)
    util = acc + rng.normal(0, 0.05, n)
    grid = util.reshape(p, k)
    adv = ((grid - grid.mean(1, keepdims=True)) / (grid.std(1, keepdims=True) + 1e-4)).ravel()
    q = np.exp(grid - grid.max(1, keepdims=True))
    q = (q / q.sum(1, keepdims=True)).ravel()
    ids = pc.binary_join_element_wise(
        pc.cast(pa.array(steps), pa.string()),
        pc.cast(pa.array(ranks), pa.string()),
        pc.cast(fixed["group_index"], pa.string()),
        ".",
    )
    truncated = lens >= tokens
    lengths = pa.array(lens)
    info = pa.StructArray.from_arrays(
        [
            fixed["finish"].take(pa.array(truncated.view(np.int8))),
            fixed["no_text"],
            pa.array(truncated),
            lengths,
            fixed["no_text"],
        ],
        fields=list(S.COMPLETION_INFO_TYPE),
    )
    token_ids = fixed["token_ids"].slice(0, int(toff[-1]))
    q_array = pa.array(q)
    cols = {
        "step": pa.array(steps),
        "rank": pa.array(ranks),
        "kind": fixed["kind"],
        "group_index": fixed["group_index"],
        "group_id": ids,
        "group_size": fixed["group_size"],
        "num_completions": fixed["num_completions"],
        "completion_index": fixed["completion_index"],
        "round": fixed["round"],
        "prompt": pc.binary_join_element_wise(pa.scalar("prompt "), ids, ""),
        "answer": fixed["answer"],
        "prompt_ids": fixed["prompt_ids"],
        "completions": _lists(goff, fixed["texts"].take(lengths)),
        "completion_ids": _lists(goff, _lists(toff, token_ids)),
        "completion_info": _lists(goff, info),
        "total_utils": _lists(goff, pa.array(util)),
        "reward_names": fixed["reward_names"],
        "reward_values": _lists(
            goff,
            pa.ListArray.from_arrays(
                fixed["one_reward"],
                pa.array(acc),
                type=pa.list_(pa.field("item", pa.float64(), nullable=False)),
            ),
        ),
        "advantages": _lists(goff, pa.array(adv)),
        "q": _lists(goff, q_array),
        "weights": _lists(goff, q_array),
        "ref_logp_sum_raw": _lists(goff, pa.array(-0.7 * lens.astype(np.float64))),
        "ref_tok_counts": _lists(goff, lengths),
    }
    layout = S.group_schema(families=FAMILIES)
    fields = [layout.field(name) for name in cols]
    table = pa.Table.from_arrays(list(cols.values()), schema=pa.schema(fields))
    group_table = pad_to_layout(table, layout)
    step_layout = S.step_schema(families=FAMILIES)
    step_cols = {
        "step": pa.array(unit_steps),
        "rank": pa.array(unit_ranks),
        "kind": pa.array(np.full(u, kind, object), pa.string()),
        "num_groups": pa.array(np.full(u, groups, np.int32)),
        "num_samples": pa.array(np.full(u, groups * k, np.int32)),
        "config": pa.array(np.full(u, json.dumps({"max_completion_len": tokens}), object)),
    }
    step_table = pa.table(
        {
            f.name: (step_cols[f.name].cast(f.type) if f.name in step_cols else pa.nulls(u, f.type))
            for f in step_layout
        },
        schema=step_layout,
    )
    return group_table, step_table, list(range(0, p, groups))


@dataclasses.dataclass(frozen=True)
class _Job:
    """One commit of a build: a segment (compacted) or one unit (loose)."""

    index: int  # its place in the build (the seed of its random values)
    kind: str
    units: tuple[tuple[int, int], ...]  # (step, rank) each, in order
    name: str
    compacted: bool


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What every job of one build shares: the store, the attempt and the table shape."""

    root: str
    attempt: str
    steps: int
    groups: int
    k: int
    tokens: int
    seed: int
    step_row_groups: bool


def _jobs(
    *, steps: int, ranks: int, kinds: Sequence[str], layout: str, segment_steps: int,
    eval_every: int,
) -> list[_Job]:  # fmt: skip
    jobs: list[_Job] = []
    for kind in kinds:
        every = 1 if kind == "train" else eval_every
        kind_steps = list(range(0, steps, every))
        if layout == "compacted":
            per = max(1, segment_steps // every)
            for i in range(0, len(kind_steps), per):
                chunk = kind_steps[i : i + per]
                units = tuple((s, r) for s in chunk for r in range(ranks))
                name = compact_name(kind, (chunk[0], chunk[-1]), (0, ranks - 1), list(units))
                jobs.append(_Job(len(jobs), kind, units, name, True))
        else:
            for s in kind_steps:
                for r in range(ranks):
                    jobs.append(_Job(len(jobs), kind, ((s, r),), unit_name(s, r, kind), False))
    return jobs


def _skip_durability() -> Callable[[], None]:
    """Durability skipped, as a benchmark fixture may: ``os.fsync`` a no-op (the build
    syncs the file system once at its end) and no checkpoint of the commit log every
    :data:`~maxent_arrow.store.history.log.CHECKPOINT_EVERY` commits (each rewrites the whole state:
    quadratic in the commits; the build writes one checkpoint at its end). Returns the undo."""
    fsync, every = os.fsync, store_log.CHECKPOINT_EVERY
    os.fsync = lambda fd: None  # type: ignore[assignment]
    store_log.CHECKPOINT_EVERY = 1 << 62

    def undo() -> None:
        os.fsync, store_log.CHECKPOINT_EVERY = fsync, every

    return undo


@contextlib.contextmanager
def _fixture_writes() -> Iterator[None]:
    """:func:`_skip_durability` for the ``with`` block."""
    undo = _skip_durability()
    try:
        yield
    finally:
        undo()


class _Writer:
    """Commits jobs of one build into its store (in the building process or a worker)."""

    def __init__(self, shape: _Shape):
        self.shape = shape
        self.log = RolloutStore(shape.root, compact_every=None).catalog.writable("a build")

    def commit(self, job: _Job) -> int:
        """Build ``job``'s tables and commit them; returns its group rows."""
        sh = self.shape
        rng = np.random.default_rng([sh.seed, job.index])
        group_table, step_table, starts = _tables(
            job.units, job.kind, sh.steps, groups=sh.groups, k=sh.k, tokens=sh.tokens, rng=rng
        )
        if job.compacted:
            record = {"group_rows": starts, "replaces": [], "unit_crc32": {}}
            operation: type[UnitOperation] = CompactUnits
        else:
            record, operation = {}, AppendUnit
        row_groups = None
        if sh.step_row_groups and job.compacted:
            # As compact splits a unit: row groups of at most ROW_GROUP_GROUPS.
            whole, rest = divmod(sh.groups, ROW_GROUP_GROUPS)
            row_groups = ([ROW_GROUP_GROUPS] * whole + ([rest] if rest else [])) * len(job.units)
        unit = UnitFiles(
            job.name,
            group_table,
            {S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
            step_table,
            {
                **record,
                "reward_names": [REWARD],
                "columns": list(group_table.column_names),
                "families": list(FAMILIES),
            },
            row_groups=row_groups,
        )
        commit_unit(self.log, unit, CommitRequest(operation, sh.attempt, lambda state: None))
        return group_table.num_rows


_WORKER: _Writer | None = None  # a worker process's writer


def _start_worker(shape: _Shape) -> None:
    global _WORKER
    _skip_durability()  # for the worker's life
    # Waits for the other workers' commits are the build's own, not a stopped writer's.
    logging.getLogger("maxent_arrow.store").addFilter(
        lambda record: "waiting for the store lock" not in str(record.msg)
    )
    _WORKER = _Writer(shape)


def _run_jobs(jobs: list[_Job]) -> int:
    assert _WORKER is not None
    return sum(_WORKER.commit(job) for job in jobs)


def _default_workers(jobs: int) -> int:
    """One process per core, where the build is large enough to pay for their start (each
    imports pyarrow and the store: ~1 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, jobs // 32))


def build(
    path: str | os.PathLike[str],
    *,
    steps: int,
    ranks: int,
    kinds: Sequence[str] = ("train", "eval"),
    layout: str = "compacted",
    groups: int = 16,
    k: int = 4,
    tokens: int = 64,
    seed: int = 0,
    segment_steps: int = 100,
    eval_every: int = 10,
    step_row_groups: bool = False,
    workers: int | None = None,
) -> Built:
    """Build a store at ``path`` (which must not exist) and return its counts.

    ``steps`` x ``ranks`` units of kind ``"train"``, and of ``"eval"`` every ``eval_every``
    steps, when in ``kinds``; each unit ``groups`` groups of ``k`` completions of up to
    ``tokens`` tokens. ``layout``: ``"compacted"`` (segments of ``segment_steps`` steps and
    every rank, each one commit, as ``compact`` writes) or ``"loose"`` (one commit per unit,
    as ``append`` writes). Everything is written and committed by the store's own functions
    (the commit log, the registry's layout, sealed step files, chunk CRCs); fsync and the
    log's periodic checkpoints are skipped (one sync of the file system and one checkpoint
    at the end). ``step_row_groups``: a compacted segment keeps one row group per unit, as
    ``compact`` writes it (a reader of one step decodes only its rows); default one row
    group per file, as the scale stores were built.

    ``workers`` processes (default one per core for builds of 64 commits or more) each
    build and commit their share of the commits, serialised only by the store's commit
    lock, so log versions follow commit order rather than step order; each commit's values
    come from its own seed (``seed``, its index), so the data do not depend on ``workers``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    root = Path(path)
    t0, cpu0 = time.perf_counter(), os.times()
    jobs = _jobs(
        steps=steps, ranks=ranks, kinds=kinds, layout=layout, segment_steps=segment_steps,
        eval_every=eval_every,
    )  # fmt: skip
    workers = _default_workers(len(jobs)) if workers is None else max(1, workers)
    with _fixture_writes():
        store = RolloutStore.create(root, config={"max_completion_len": tokens}, compact_every=None)
        attempt = store.begin_attempt(config={"synthetic": True}) or ""
        shape = _Shape(str(root), attempt, steps, groups, k, tokens, seed, step_row_groups)
        if workers == 1:
            writer = _Writer(shape)
            rows = sum(writer.commit(job) for job in jobs)
        else:
            # Spawned, not forked: the parent's pyarrow thread pools do not survive a fork.
            context = multiprocessing.get_context("spawn")
            size = max(1, min(16, len(jobs) // (4 * workers)))
            batches = [jobs[i : i + size] for i in range(0, len(jobs), size)]
            with ProcessPoolExecutor(
                workers, mp_context=context, initializer=_start_worker, initargs=(shape,)
            ) as pool:
                rows = sum(pool.map(_run_jobs, batches))
        version = store.checkpoint()
    os.sync()  # the one sync of the build
    seconds, cpu1 = time.perf_counter() - t0, os.times()
    cpu = sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("user", "system"))
    cpu += sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("children_user", "children_system"))
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return Built(
        root,
        steps,
        ranks,
        tuple(kinds),
        layout,
        len(jobs),
        version,
        rows,
        size,
        seconds,
        cpu,
    )


def cache_dir() -> Path:
    base = os.environ.get("MAXENT_ARROW_BENCH_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maxent-arrow-bench"


def cached(**params: object) -> Built:
    """:func:`build` with ``params`` under :func:`cache_dir`, reused when a store of the same
    parameters was built before (its counts are kept beside it)."""
    key = f"syn{FORMAT}-" + "-".join(
        f"{k}{'+'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
        for k, v in sorted(params.items())
    )
    root = cache_dir() / key
    done = root.with_name(root.name + ".json")
    if done.exists() and root.exists():
        saved = json.loads(done.read_text())
        return Built(**{**saved, "path": Path(saved["path"]), "kinds": tuple(saved["kinds"])})
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    built = build(root, **params)  # type: ignore[arg-type]
    done.write_text(json.dumps({**dataclasses.asdict(built), "path": str(built.path)}))
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layout", choices=LAYOUTS, default="compacted")
    parser.add_argument("--kinds", default="train,eval")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-row-groups", action="store_true")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    args = parser.parse_args(argv)
    built = build(
        args.path,
        steps=args.steps,
        ranks=args.ranks,
        kinds=tuple(args.kinds.split(",")),
        layout=args.layout,
        groups=args.groups,
        k=args.k,
        tokens=args.tokens,
        step_row_groups=args.step_row_groups,
        workers=args.workers,
    )
    print(built.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
