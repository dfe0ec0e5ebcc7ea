"""Synthetic stores for the scale benchmarks: many steps and ranks, built in seconds.

:func:`build` writes a store of format 3 (a commit log) that this library's readers,
``verify`` and plain readers accept, without going through one fsync'd ``append`` per unit:

- ``layout="compacted"``: each commit is a segment of ``segment_steps`` steps and every rank
  of one kind (what ``compact`` writes), built vectorised from numpy, committed by the
  store's own commit function (:func:`maxent_arrow.store.commit.commit_unit`, ``op:
  "compact"`` with nothing to replace): the same group file settings, chunk CRCs, sealed
  step file, log entry and checkpoints as a real compaction;
- ``layout="loose"``: one commit per (step, rank, kind), as ``append`` writes them (one
  group file and one step file each), through the same commit function.

Each unit holds ``groups`` groups of ``k`` completions of ``tokens`` tokens (token ids,
text, rewards, advantages, the maxent family's ``q``/``weights``/reference log-probs), the
columns declared in the column registry (padded to the run's layout by the store's own
``pad_to_layout``). Durability is what is skipped: the builder turns ``os.fsync`` into a
no-op while it writes (a benchmark fixture, not a run; nothing else differs), and it writes a
checkpoint at the end so a reader reads one checkpoint and no entries.

File counts (group files; each has a step file beside it): compacted ``ceil(steps /
segment_steps)`` per kind (train every step, eval every ``eval_every`` steps); loose
``steps x ranks`` per kind. Log entries: one per group file plus the attempt. With the
defaults (``segment_steps=100``, ``eval_every=10``), compacted: 10^3 steps = 20 group files
(140,800 group rows, 29 MiB), 10^4 = 200 (1.4 M rows, 289 MiB), 10^5 = 2,000 (14 M rows,
~2.9 GiB); loose: 100 steps x 8 ranks = 880 files (one commit each, ~25 ms per commit on 2
shared cores: 10^3 x 8 = 8,800 files takes minutes). Measured builds on the 2 shared cores:
10^3 steps 4.7 s, 10^4 21 s, 10^5 416 s (while a test suite ran beside it: over the 5
minutes the issue allows; ~10x the 10^4 build when the cores are free), 10^3 x 64 ranks
39 s, the loose 100 x 8 store 35 s.

Run ``python benchmarks/synthetic_store.py PATH --steps N --ranks R [--layout loose]`` to
build one and print its counts and build time. ``MAXENT_ARROW_BENCH_CACHE`` (see
:func:`cached`) keeps built stores between benchmark runs, keyed by their parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maxent_arrow.arrow import schema as S  # noqa: E402
from maxent_arrow.store import RolloutStore  # noqa: E402
from maxent_arrow.store.catalog import LogCatalog  # noqa: E402
from maxent_arrow.store.commit import commit_unit  # noqa: E402
from maxent_arrow.store.compaction import ROW_GROUP_GROUPS  # noqa: E402
from maxent_arrow.store.names import compact_name, unit_name  # noqa: E402
from maxent_arrow.store.padding import pad_to_layout  # noqa: E402

__all__ = ["Built", "build", "cached"]

FAMILIES = ("core", "maxent")
REWARD = "accuracy"
LAYOUTS = ("compacted", "loose")
# Part of the cache key: a store built by an older builder (or an older store format) is
# built again rather than reused (3: checkpoints that hold each step file's summary, what
# `inspect` reads).
FORMAT = 3


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

    def describe(self) -> str:
        return (
            f"{self.steps:,} steps x {self.ranks} ranks ({'+'.join(self.kinds)}, {self.layout}): "
            f"{self.group_files:,} group files (+ as many step files), {self.log_entries:,} log "
            f"entries, {self.group_rows:,} group rows, {self.bytes / 2**20:,.0f} MiB, built in "
            f"{self.seconds:.1f} s"
        )


@contextlib.contextmanager
def _no_fsync() -> Iterator[None]:
    """``os.fsync`` as a no-op: a fixture need not survive a power cut."""
    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def _lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    item = pa.field("item", values.type, nullable=False)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(item))


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
    steps = np.repeat(np.array([s for s, _ in units], np.int64), groups)
    ranks = np.repeat(np.array([r for _, r in units], np.int32), groups)
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
    group_index = np.tile(np.arange(groups, dtype=np.int32), u)
    ids = pc.binary_join_element_wise(
        pc.cast(pa.array(steps), pa.string()),
        pc.cast(pa.array(ranks), pa.string()),
        pc.cast(pa.array(group_index), pa.string()),
        ".",
    )
    info = pa.StructArray.from_arrays(
        [
            pa.array(np.where(lens >= tokens, "length", "stop")),
            pa.nulls(n, pa.string()),
            pa.array(lens >= tokens),
            pa.array(lens),
            pa.nulls(n, pa.string()),
        ],
        fields=list(S.COMPLETION_INFO_TYPE),
    )
    pool = pa.array([f"completion of {t} tokens " * 2 for t in range(tokens + 1)])
    # Token ids: a low-entropy pattern (the benchmarks time reads of the catalog and of a few
    # columns, not the compression of random ids).
    token_ids = pa.array((np.arange(toff[-1], dtype=np.int64) % 251).astype(np.int32))
    cols = {
        "step": pa.array(steps),
        "rank": pa.array(ranks),
        "kind": pa.array(np.full(p, kind, object), pa.string()),
        "group_index": pa.array(group_index),
        "group_id": ids,
        "group_size": pa.array(np.full(p, k, np.int32)),
        "num_completions": pa.array(np.full(p, k, np.int32)),
        "completion_index": _lists(goff, pa.array(np.tile(np.arange(k, dtype=np.int32), p))),
        "round": pa.array(np.zeros(p, np.int32)),
        "prompt": pc.binary_join_element_wise(pa.scalar("prompt "), ids, ""),
        "answer": pa.array(np.full(p, "42", object), pa.string()),
        "prompt_ids": _lists(
            np.arange(0, 8 * p + 1, 8), pa.array((np.arange(8 * p) % 97).astype(np.int32))
        ),
        "completions": _lists(goff, pool.take(pa.array(lens))),
        "completion_ids": _lists(goff, _lists(toff, token_ids)),
        "completion_info": _lists(goff, info),
        "total_utils": _lists(goff, pa.array(util)),
        "reward_names": _lists(np.arange(p + 1), pa.array(np.full(p, REWARD, object), pa.string())),
        "reward_values": _lists(goff, _lists(np.arange(n + 1), pa.array(acc))),
        "advantages": _lists(goff, pa.array(adv)),
        "q": _lists(goff, pa.array(q)),
        "weights": _lists(goff, pa.array(q)),
        "ref_logp_sum_raw": _lists(goff, pa.array(-0.7 * lens.astype(np.float64))),
        "ref_tok_counts": _lists(goff, pa.array(lens)),
    }
    layout = S.group_schema(families=FAMILIES)
    fields = [layout.field(name) for name in cols]
    table = pa.Table.from_arrays(list(cols.values()), schema=pa.schema(fields))
    group_table = pad_to_layout(table, layout)
    step_layout = S.step_schema(families=FAMILIES)
    unit_steps = np.array([s for s, _ in units], np.int64)
    step_cols = {
        "step": pa.array(unit_steps),
        "rank": pa.array(np.array([r for _, r in units], np.int32)),
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
) -> Built:
    """Build a store at ``path`` (which must not exist) and return its counts.

    ``steps`` x ``ranks`` units of kind ``"train"``, and of ``"eval"`` every ``eval_every``
    steps, when in ``kinds``; each unit ``groups`` groups of ``k`` completions of up to
    ``tokens`` tokens. ``layout``: ``"compacted"`` (segments of ``segment_steps`` steps and
    every rank, each one commit, as ``compact`` writes) or ``"loose"`` (one commit per unit,
    as ``append`` writes). Everything is written and committed by the store's own functions
    (the commit log, the registry's layout, sealed step files, chunk CRCs); only fsync is
    skipped. A checkpoint is written at the end. ``step_row_groups``: a compacted segment
    keeps one row group per unit, as ``compact`` writes it (a reader of one step decodes
    only its rows); default one row group per file, as the scale stores were built."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    root = Path(path)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    files = rows = 0
    with _no_fsync():
        store = RolloutStore.create(root, config={"max_completion_len": tokens}, compact_every=None)
        attempt = store.begin_attempt(config={"synthetic": True}) or ""
        catalog = store.catalog
        assert isinstance(catalog, LogCatalog)
        backend = catalog.backend
        for kind in kinds:
            every = 1 if kind == "train" else eval_every
            kind_steps = list(range(0, steps, every))
            if layout == "compacted":
                per = max(1, segment_steps // every)
                chunks = [kind_steps[i : i + per] for i in range(0, len(kind_steps), per)]
            else:
                chunks = [[s] for s in kind_steps]
            for chunk in chunks:
                rank_sets = (
                    [list(range(ranks))] if layout == "compacted" else [[r] for r in range(ranks)]
                )
                for rank_set in rank_sets:
                    units = [(s, r) for s in chunk for r in rank_set]
                    group_table, step_table, starts = _tables(
                        units, kind, steps, groups=groups, k=k, tokens=tokens, rng=rng
                    )
                    if layout == "compacted":
                        name = compact_name(
                            kind, (chunk[0], chunk[-1]), (rank_set[0], rank_set[-1]), units
                        )
                        record = {"group_rows": starts, "replaces": [], "unit_crc32": {}}
                        operation = "compact"
                    else:
                        name = unit_name(chunk[0], rank_set[0], kind)
                        record, operation = {}, "append"
                    row_groups = None
                    if step_row_groups and layout == "compacted":
                        # As compact splits a unit: row groups of at most ROW_GROUP_GROUPS.
                        whole, rest = divmod(groups, ROW_GROUP_GROUPS)
                        per_unit = [ROW_GROUP_GROUPS] * whole + ([rest] if rest else [])
                        row_groups = per_unit * len(units)
                    commit_unit(
                        backend,
                        name,
                        group_table,
                        {S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
                        step_table,
                        {
                            **record,
                            "reward_names": [REWARD],
                            "columns": [c for c in group_table.column_names],
                            "families": list(FAMILIES),
                        },
                        check=lambda state: None,
                        operation=operation,
                        compression="zstd",
                        compression_level=None,
                        run=catalog.run_id,
                        log=catalog.log,
                        attempt=attempt,
                        row_groups=row_groups,
                    )
                    files += 1
                    rows += group_table.num_rows
        version = catalog.log.write_checkpoint()
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return Built(
        root,
        steps,
        ranks,
        tuple(kinds),
        layout,
        files,
        version,
        rows,
        size,
        time.perf_counter() - t0,
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
    )
    print(built.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
