"""The benchmarks' stores, built by the writer: real ``append`` calls and its own compaction.

Every store a benchmark reads is one a user's run would write: :func:`build` creates it with
``RolloutStore.create`` (the default options: ``compact_every=100``, zstd level 1, the
writer's row groups, pages, statistics and checksums) and appends one seeded
:class:`~maxent_arrow.rollout.RolloutBatch` per step, so its bytes, its compacted segments
and its commit log are the writer's, not a fixture's. ``tests/benchmarks/
test_writer_stores.py`` checks that a store built here has the layout a plain loop of
durable appends writes for the same steps (files, row groups, rows per row group, codecs,
encodings, page indexes).

What is skipped: durability. ``os.fsync`` is a no-op while a store is built (one
``os.sync`` at the end), since an fsync decides when bytes reach the disk, not which bytes
are written; everything else (the log's checkpoints every 100 commits included) runs as in
a run. A benchmark that measures appends appends to a copy with fsync on.

Each step (one rank, kind ``train``) holds ``groups`` groups of ``k`` completions of
``tokens`` (low, high) tokens, drawn per completion: the prompt ids, completion ids, text,
behaviour and reference per-token log-probs (and their sums), the token counts, the
rewards (``accuracy``), utilities and group-standardised advantages. The values of step
``s`` come from ``numpy.random.default_rng([seed, s])``, so a store does not depend on how
its build was split: a build interrupted at step 40,000 resumes from the store's last
committed step (``store.steps()``), and a store of more steps of the same shape starts from
a copy of the largest complete one of fewer steps (its files hard-linked, its log and
manifest copied), as a resumed run continues.

The stores (``SHAPES``; issue 35): ``take`` 1,000 steps x 16 groups x 16 completions x 32-256
tokens (16,000 groups, for random takes); ``million`` 62,500 steps x 16 groups x 4
completions x 32-64 tokens (1,000,000 groups); ``analytics`` at 1,000, 10,000 and 100,000
steps of 16 groups x 4 completions x 32-64 tokens. ``--quick`` benchmarks use
:func:`quick` sizes.

Stores are kept under ``$MAXENT_ARROW_BENCH_CACHE`` (default
``~/.cache/maxent-arrow-bench``) in a directory named by the store format and the shape:
the format is read from the store (its manifest's ``schema_version`` and the group files'
schema version, from a probe store the writer makes) together with a fingerprint of the
layout the writer writes for a few steps (codecs, encodings, page indexes, row-group
sizes, after a compaction), so a change of the writer's layout builds the stores again.
A complete store has a ``.json`` beside it with its build time and rate.

Measured builds (the 2 shared cores, fsync off, store format 3.0 as the writer of December
2026 writes it): ``take`` 1,000 steps in 21 s (21 ms an append); ``analytics`` 1,000 steps
in 19 s, 10,000 in 286 s (28.6 ms an append on average); ``million`` 62,500 steps in 4,434
s (70.9 ms on average, ~100 ms an append near its end: append grows with the history).
That store holds 2.4 GB of live group files and 30.5 GB of log: 1,253 checkpoints (one
every 100 versions and one after each compaction), each the whole state (41 MB at the
end), all kept, so the log grows with the square of the steps; 100,000 steps would need
~78 GB of log and were not built on this machine's disk.

Run ``python benchmarks/writer_stores.py [take|million|analytics-1000|...] [--quick]`` to
build (or resume) a store and print its counts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maxent_arrow.arrow import GroupIdentity  # noqa: E402
from maxent_arrow.arrow import schema as S  # noqa: E402
from maxent_arrow.rollout import RolloutBatch  # noqa: E402
from maxent_arrow.store import ReadOnlyStore, RolloutStore  # noqa: E402
from maxent_arrow.store.storage.names import TAKE  # noqa: E402

__all__ = [
    "ENV_CACHE",
    "SHAPES",
    "Built",
    "Shape",
    "build",
    "cache_dir",
    "cached",
    "file_layout",
    "format_key",
    "linked_copy",
    "quick",
    "store_layout",
]

ENV_CACHE = "MAXENT_ARROW_BENCH_CACHE"
FAMILIES = ("core",)
REWARD = "accuracy"
VOCAB = 32_000
# Text per completion: the pool's strings, one per token count (realistic sizes, built once).
CHARS_PER_TOKEN = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """What each step of a store holds: ``groups`` groups of ``k`` completions of
    ``tokens`` = (low, high) tokens (both included), prompts of ``prompt_tokens``; ``steps``
    steps; the values seeded by ``seed`` and the step."""

    steps: int
    groups: int = 16
    k: int = 4
    tokens: tuple[int, int] = (32, 64)
    prompt_tokens: int = 32
    seed: int = 0

    @property
    def num_groups(self) -> int:
        return self.steps * self.groups

    def key(self) -> str:
        """The shape's part of a cache directory's name."""
        lo, hi = self.tokens
        return (
            f"s{self.steps}-g{self.groups}-k{self.k}-t{lo}_{hi}-p{self.prompt_tokens}-"
            f"seed{self.seed}"
        )

    def with_steps(self, steps: int) -> Shape:
        return dataclasses.replace(self, steps=steps)

    def describe(self) -> str:
        lo, hi = self.tokens
        return (
            f"{self.steps:,} steps x {self.groups} groups x {self.k} completions x "
            f"{lo}-{hi} tokens ({self.num_groups:,} groups)"
        )


SHAPES: dict[str, Shape] = {
    "take": Shape(1000, groups=16, k=16, tokens=(32, 256)),
    "million": Shape(62_500, groups=16, k=4, tokens=(32, 64)),
    "analytics-1000": Shape(1000),
    "analytics-10000": Shape(10_000),
    "analytics-100000": Shape(100_000),
}


def quick(shape: Shape) -> Shape:
    """The ``--quick`` size of a shape: a tenth of the steps, at most 300 (a smoke run: still
    past the writer's compaction of every 100 steps)."""
    return shape.with_steps(min(300, max(120, shape.steps // 10)))


# ---------------------------------------------------------------------------- one step
def _lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    item = pa.field("item", values.type, nullable=False)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(item))


@functools.lru_cache(maxsize=4)
def _text_pool(high: int) -> pa.Array:
    """One completion text per token count ``0..high`` (about 4 characters a token)."""
    words = "the answer is forty two because six times seven ".split()
    texts = []
    for n in range(high + 1):
        texts.append(" ".join(words[i % len(words)] for i in range(n))[: n * CHARS_PER_TOKEN])
    return pa.array(texts, pa.string())


def step_batch(shape: Shape, step: int) -> RolloutBatch:
    """Step ``step`` of ``shape`` (rank 0, ``train``), built vectorised from its own seed."""
    rng = np.random.default_rng([shape.seed, step])
    p, k = shape.groups, shape.k
    n = p * k
    lo, hi = shape.tokens
    goff = np.arange(0, n + 1, k)
    lens = rng.integers(lo, hi + 1, n).astype(np.int32)
    toff = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    tokens = int(toff[-1])
    # Accuracy rises with the step, on a curve that does not depend on the store's length
    # (a store of more steps starts as a copy of one of fewer).
    acc = (rng.random(n) < 0.2 + 0.6 * step / (step + 1000)).astype(np.float64)
    utils = acc + rng.normal(0, 0.05, n)
    u = utils.reshape(p, k)
    adv = ((u - u.mean(1, keepdims=True)) / (u.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()
    behaviour = (-rng.exponential(1.0, tokens)).astype(np.float32)
    reference = (behaviour + rng.normal(0, 0.1, tokens)).astype(np.float32)
    starts = toff[:-1]
    truncated = lens >= hi
    info = pa.StructArray.from_arrays(
        [
            pa.array(np.where(truncated, "length", "stop")),
            pa.nulls(n, pa.string()),
            pa.array(truncated),
            pa.array(lens),
            pa.nulls(n, pa.string()),
        ],
        fields=list(S.COMPLETION_INFO_TYPE),
    )
    prompt_len = shape.prompt_tokens
    offsets = np.arange(0, n + 1, k)
    cols = {
        **GroupIdentity.of(step=step, rank=0, kind="train", group_offsets=offsets).columns(),
        "prompt": pa.array([f"prompt {step}-{g}: what is 6 x 7?" for g in range(p)]),
        "answer": pa.array(["42"] * p),
        "prompt_ids": _lists(
            np.arange(0, prompt_len * p + 1, prompt_len),
            pa.array(rng.integers(0, VOCAB, prompt_len * p, dtype=np.int32)),
        ),
        "completions": _lists(goff, _text_pool(hi).take(pa.array(lens))),
        "completion_ids": _lists(
            goff, _lists(toff, pa.array(rng.integers(0, VOCAB, tokens, dtype=np.int32)))
        ),
        "completion_info": _lists(goff, info),
        "total_utils": _lists(goff, pa.array(utils)),
        "reward_names": _lists(np.arange(p + 1), pa.array([REWARD] * p)),
        "reward_values": _lists(goff, _lists(np.arange(n + 1), pa.array(acc))),
        "advantages": _lists(goff, pa.array(adv)),
        "ref_logp_sum_raw": _lists(
            goff, pa.array(np.add.reduceat(reference, starts, dtype=np.float64))
        ),
        "ref_tok_counts": _lists(goff, pa.array(lens)),
        "ref_token_logp": _lists(goff, _lists(toff, pa.array(reference))),
        "behavior_logp_sum": _lists(
            goff, pa.array(np.add.reduceat(behaviour, starts, dtype=np.float64))
        ),
        "behavior_token_logp": _lists(goff, _lists(toff, pa.array(behaviour))),
    }
    schema = S.group_schema(families=FAMILIES)
    fields = [schema.field(name) for name in cols]
    table = pa.Table.from_arrays(
        list(cols.values()), schema=pa.schema(fields, metadata=schema.metadata)
    )
    step_schema = S.step_schema(families=FAMILIES)
    row: dict[str, Any] = {f.name: None for f in step_schema}
    row.update(
        step=step,
        rank=0,
        kind="train",
        num_groups=p,
        num_samples=n,
        policy_version=step,
        reward_mean=float(utils.mean()),
        reward_std=float(utils.std()),
        config=json.dumps({"max_completion_len": hi}),
    )
    return RolloutBatch(table, pa.Table.from_pylist([row], schema=step_schema))


# ---------------------------------------------------------------------------- building
@contextlib.contextmanager
def no_fsync() -> Iterator[None]:
    """``os.fsync`` a no-op for the ``with`` block (durability, not layout: see the module
    docstring), then one ``os.sync``."""
    fsync = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = fsync
        os.sync()


@dataclasses.dataclass(frozen=True)
class Built:
    """A complete store: where, its shape, its size and how it was built."""

    path: Path
    shape: Shape
    bytes: int  # of the live group files
    group_files: int  # live
    seconds: float  # wall time of the appends of this store's build (resumed parts added)
    appends: int  # appends those seconds are of (a store started from a copy: its own)

    @property
    def rate(self) -> float:
        """Appends per second of the build."""
        return self.appends / self.seconds if self.seconds > 0 else float("nan")

    def describe(self) -> str:
        return (
            f"{self.shape.describe()}: {self.group_files:,} live group files, "
            f"{self.bytes / 2**20:,.0f} MiB; built by {self.appends:,} appends in "
            f"{self.seconds:,.0f} s ({self.rate:.1f} appends/s, "
            f"{1e3 / self.rate if self.rate else float('nan'):.1f} ms each)"
        )

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "path": str(self.path)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Built:
        shape = doc["shape"]
        shape = Shape(**{**shape, "tokens": tuple(shape["tokens"])})
        return cls(**{**doc, "path": Path(doc["path"]), "shape": shape})


def _size(root: Path) -> tuple[int, int]:
    """The bytes and the count of the store's live group files (the files a compaction
    replaced stay on disk until a repair, and are not counted)."""
    files = ReadOnlyStore(root).committed_files("groups")
    return sum(Path(f).stat().st_size for f in files), len(files)


def committed_steps(root: Path) -> int:
    """How many steps the store at ``root`` has committed (0 for none, or no store)."""
    if not (root / "manifest.json").exists():
        return 0
    return len(ReadOnlyStore(root).steps())


def build(
    root: str | os.PathLike[str],
    shape: Shape,
    *,
    durable: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[int, float]:
    """Append the steps of ``shape`` that the store at ``root`` lacks (creating it when
    there is none) and return ``(appends, seconds)``. ``durable=False``: ``os.fsync`` is a
    no-op meanwhile. Resumes after the store's last committed step; ``progress(appends,
    seconds)`` is told how far it got every 30 s (and a line printed)."""
    root = Path(root)
    first = committed_steps(root)
    if first:
        steps = ReadOnlyStore(root).steps()
        if steps != list(range(first)):
            raise RuntimeError(f"{root}: expected steps 0..{first - 1}, got another set")
    t0 = last = time.perf_counter()
    guard = contextlib.nullcontext() if durable else no_fsync()
    with guard:
        if first:
            store = RolloutStore(root, if_exists="resume")
        else:
            lo, hi = shape.tokens
            store = RolloutStore.create(root, config={"max_completion_len": hi}, if_exists="error")
        with store:
            for step in range(first, shape.steps):
                store.append(step_batch(shape, step))
                now = time.perf_counter()
                if progress is not None and now - last >= 30:
                    done = step + 1 - first
                    print(
                        f"  {root.name}: step {step + 1:,} of {shape.steps:,}, "
                        f"{done / (now - t0):.1f} appends/s",
                        flush=True,
                    )
                    progress(done, now - t0)
                    last = now
    return shape.steps - first, time.perf_counter() - t0


# ---------------------------------------------------------------------------- the layout
def file_layout(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What the writer chose for one Parquet file: row groups and their rows, and per column
    chunk its codec, encodings and whether it has a column and an offset index."""
    meta = pq.ParquetFile(path).metadata
    groups = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        chunks = {}
        for j in range(rg.num_columns):
            c = rg.column(j)
            chunks[c.path_in_schema] = (
                c.compression,
                tuple(sorted(c.encodings)),
                c.has_column_index,
                c.has_offset_index,
                c.is_stats_set,
                c.has_dictionary_page,
            )
        groups.append({"rows": rg.num_rows, "chunks": chunks})
    return {
        "rows": meta.num_rows,
        "row_groups": groups,
        "created_by": meta.created_by,
        "metadata_keys": sorted(k.decode() for k in (meta.metadata or {})),
    }


def take_layout(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What the writer chose for one take file (``store/io/take.py``): its batches (one per
    group) and their rows, its columns and its metadata keys."""
    with pa.memory_map(str(path)) as source:
        reader = ipc.open_file(source)
        return {
            "batches": [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)],
            "columns": reader.schema.names,
            "metadata_keys": sorted(k.decode() for k in (reader.schema.metadata or {})),
        }


def store_layout(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The layout of every live file of a store (group and step files, by name, from the
    store's own list of committed files; and the take files the writer wrote beside them)."""
    store = ReadOnlyStore(root)
    out: dict[str, Any] = {}
    for table in ("groups", "steps"):
        for path in store.committed_files(table):  # type: ignore[arg-type]
            out[f"{table}/{Path(path).name}"] = file_layout(path)
    for path in sorted((Path(root) / TAKE).glob("*.arrow")):
        out[f"{TAKE}/{path.name}"] = take_layout(path)
    return out


@functools.lru_cache(maxsize=1)
def format_key() -> str:
    """The store format a build writes, read from a probe store the writer makes: its
    manifest's ``schema_version``, the group files' schema version, and a digest of their
    layout after 104 appends of a small shape (one compacted segment and loose files)."""
    probe = Shape(104, groups=2, k=2, tokens=(4, 8), prompt_tokens=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "probe"
        build(root, probe)
        store = ReadOnlyStore(root)
        version = str(store.manifest.get("schema_version"))
        files = store.committed_files("groups")
        meta = pq.ParquetFile(files[0]).metadata.metadata or {}
        schema = meta.get(S.METADATA_KEY, b"?").decode()
        layout = store_layout(root)
    for doc in layout.values():
        doc.pop("created_by", None)  # (a take file has none)
    digest = hashlib.sha256(json.dumps(sorted(layout.values(), key=str)).encode()).hexdigest()
    return f"store{version}-schema{schema}-layout{digest[:10]}"


# ---------------------------------------------------------------------------- the cache
def cache_dir() -> Path:
    base = os.environ.get(ENV_CACHE)
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maxent-arrow-bench"


def store_path(shape: Shape) -> Path:
    return cache_dir() / f"writer-{format_key()}" / shape.key()


def _marker(root: Path) -> Path:
    return root.with_name(root.name + ".json")


def _complete(shape: Shape) -> Built | None:
    root = store_path(shape)
    done = _marker(root)
    if done.exists() and root.exists():
        built = Built.from_json(json.loads(done.read_text()))
        size, files = _size(root)  # as the store is now (what its marker said may be older)
        return dataclasses.replace(built, bytes=size, group_files=files)
    return None


# A committed file is never written again (its name is new, or a version never reused), so a
# copy may share it; the log's head, its latest checkpoint's alias, the manifest and the lock
# are rewritten or replaced by the writer and are copied.
_IMMUTABLE_DIRS = ("groups", "steps", "records", "cache", "retired")
_LOG_ENTRY = re.compile(r"^(\d{20}\.json|checkpoint-\d{20}\.parquet)$")


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of the store at ``src`` at ``dst`` that a writer may commit to without
    changing ``src``: committed files hard-linked, the files the writer replaces copied."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        top = rel.parts[0]
        if top in _IMMUTABLE_DIRS or (top == "log" and _LOG_ENTRY.match(path.name)):
            os.link(path, target)
        else:
            shutil.copy2(path, target)
    return dst


def _start_from_prefix(shape: Shape, root: Path) -> tuple[int, float]:
    """Copy the largest complete store of ``shape`` with fewer steps to ``root`` (group,
    step and record files hard-linked: the writer never changes a committed file; the log,
    manifest and lock copied); returns that store's build (appends, seconds), or zeros."""
    base = root.parent
    best: Built | None = None
    for done in base.glob("*.json"):
        try:
            b = Built.from_json(json.loads(done.read_text()))
        except (ValueError, TypeError, KeyError):
            continue
        if b.shape.with_steps(shape.steps) == shape and b.shape.steps < shape.steps:
            if best is None or b.shape.steps > best.shape.steps:
                best = b
    if best is None or not best.path.exists():
        return 0, 0.0
    print(f"  starting from a copy of {best.path.name} ({best.shape.steps:,} steps)", flush=True)
    linked_copy(best.path, root)
    return best.appends, best.seconds


def cached(shape: Shape, *, build_missing: bool) -> Built | str:
    """The complete store of ``shape`` under :func:`cache_dir`, or (``build_missing=False``
    and not built yet) a sentence saying why there is none. ``build_missing``: build it, or
    resume a build that was interrupted (from the largest complete store of the same shape
    with fewer steps, when there is one)."""
    done = _complete(shape)
    if done is not None:
        return done
    root = store_path(shape)
    have = committed_steps(root)
    if not build_missing:
        state = f"{have:,} of {shape.steps:,} steps built" if have else "not built"
        return (
            f"the store ({shape.describe()}) is {state} under {root.parent}; run with --build "
            f"(or python benchmarks/writer_stores.py) to build it"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    prior = (0, 0.0)
    if not have:
        if root.exists():
            shutil.rmtree(root)
        prior = _start_from_prefix(shape, root)
    print(f"building {root} ({shape.describe()}) from step {committed_steps(root):,}", flush=True)
    # The appends and time of earlier, interrupted parts of this build, kept as it goes.
    partial = root.with_name(root.name + ".partial.json")
    if partial.exists():
        part = json.loads(partial.read_text())
        prior = (prior[0] + part["appends"], prior[1] + part["seconds"])

    def keep(appends: int, seconds: float) -> None:
        doc = {"appends": prior[0] + appends, "seconds": prior[1] + seconds}
        partial.write_text(json.dumps(doc) + "\n")

    appends, seconds = build(root, shape, progress=keep)
    size, files = _size(root)
    built = Built(root, shape, size, files, seconds + prior[1], appends + prior[0])
    _marker(root).write_text(json.dumps(built.as_json()) + "\n")
    partial.unlink(missing_ok=True)
    print(f"built: {built.describe()}", flush=True)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(SHAPES), help="shapes to build")
    parser.add_argument("--quick", action="store_true", help="the --quick sizes")
    args = parser.parse_args(argv)
    print(f"format: {format_key()}; cache: {cache_dir()}")
    for name in args.names:
        shape = SHAPES[name]
        built = cached(quick(shape) if args.quick else shape, build_missing=True)
        assert isinstance(built, Built)
        print(f"{name}: {built.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
