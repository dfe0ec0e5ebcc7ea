"""Ray Data over a rollout store: read a run as a ``Dataset`` of Arrow group rows, recompute
its group math on a cluster, write the result back as a new store, and collate ragged rows
into training tensors (``pip install 'maxent-arrow[ray]'``).

- :func:`read_store` plans the read from the store's committed step files (the same rule as
  :meth:`RolloutStore.read`: no temp files, no uncommitted groups, no files replaced by
  ``compact``) and reads each group file in a Ray task: the size and CRC-32 recorded at
  commit are checked, and every block is conformed to the store's unified schema, so blocks
  from files written before a column existed carry it as nulls. Blocks are Arrow tables; no
  row is turned into Python objects. Local directories and ``pyarrow.fs`` URIs (``s3://``)
  both work (:mod:`maxent_arrow.object_store`).
- :func:`recompute` runs :func:`recompute_group_math` (advantages, q and MaxEnt weights from
  the stored utilities and reference log-probs, :mod:`maxent_arrow.compute`) as
  ``map_batches(batch_format="pyarrow")``; :func:`write_store` groups the rows back into one
  append per (step, rank, kind) and commits them to a new store; :func:`recompute_store` chains
  the three.
- :func:`ray_collate_fn` wraps :class:`~maxent_arrow.collate.GroupCollator` as Ray's
  ``ArrowBatchCollateFn`` for ``iter_torch_batches(collate_fn=...)``.

Why a datasource and not ``ray.data.read_parquet``: the commit rule, the checksums, the
explicit unified schema and the slicing of compacted files need the store's step files, and
``read_parquet`` (Ray 2.60) fails outright when ``fsspec`` is installed without ``aiohttp``
(its HTTP-filesystem probe catches ``ModuleNotFoundError`` only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from maxent_arrow import compute as C
from maxent_arrow.batch import RolloutBatch, step_row_from_json, step_row_to_json
from maxent_arrow.collate import GroupCollator
from maxent_arrow.errors import ComputeError, MissingExtraError, SchemaError, StoreError
from maxent_arrow.object_store import ObjectStore, open_store, read_group_object
from maxent_arrow.ragged import Ragged, torch_to_arrow
from maxent_arrow.store import RolloutStore, conform
from maxent_arrow.store_files import unit_name

__all__ = [
    "UNIT_COLUMN",
    "GroupMathSettings",
    "read_store",
    "recompute_group_math",
    "recompute",
    "write_store",
    "recompute_store",
    "ray_collate_fn",
]

# Hidden column naming each row's unit (its file name), carried from read to write.
UNIT_COLUMN = "_unit"


def _ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise MissingExtraError("ray", "ray") from None
    return ray


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _FileRead:
    """One group file to read and the row ranges (one per unit) to take from it."""

    path: str
    size: int | None
    meta: dict
    units: tuple[tuple[str, int, int], ...]  # (unit name, first row, rows)

    @property
    def num_rows(self) -> int:
        return sum(count for _, _, count in self.units)


def _store_files(store: RolloutStore | ObjectStore) -> tuple[pafs.FileSystem, str]:
    if isinstance(store, ObjectStore):
        return store.filesystem, store._groups_dir
    return pafs.LocalFileSystem(), str(store._groups_dir)


def _plan(store, *, steps, kind, ranks) -> list[_FileRead]:
    _, groups_dir = _store_files(store)
    by_file: dict[str, list] = {}
    for unit in store._units(kind=kind, steps=steps, ranks=ranks, on_error=store.on_error):
        by_file.setdefault(unit.step_file, []).append(unit)
    reads = []
    for step_file, units in by_file.items():
        _, meta = store._step_table(step_file)
        path = f"{groups_dir}/{meta['group_file']}"
        reads.append(
            _FileRead(
                path,
                meta.get("group_size"),
                dict(meta),
                tuple((u.name, u.start, u.num_groups) for u in units),
            )
        )
    return reads


def _read_blocks(
    reads: list[_FileRead],
    filesystem: pafs.FileSystem,
    schema: pa.Schema,
    crc: bool,
    with_unit: bool,
) -> Iterator[pa.Table]:
    """Runs in a Ray worker: one Arrow block per unit, in the store's unified schema."""
    for read in reads:
        table = read_group_object(filesystem, read.path, read.meta, schema.names, crc=crc)
        for name, start, count in read.units:
            part = table if (start, count) == (0, table.num_rows) else table.slice(start, count)
            part = conform(part, schema)
            if with_unit:
                part = part.append_column(UNIT_COLUMN, pa.array([name] * count, pa.string()))
            yield part


def _datasource(reads, filesystem, schema, crc, with_unit):
    _ray()
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    out_schema = schema
    if with_unit:
        out_schema = schema.append(pa.field(UNIT_COLUMN, pa.string()))

    class StoreDatasource(Datasource):
        def get_name(self) -> str:
            return "MaxentArrowStore"

        def estimate_inmemory_data_size(self) -> int | None:
            return sum(r.size or 0 for r in reads) or None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            count = max(1, min(parallelism if parallelism > 0 else len(reads), len(reads)))
            # Contiguous runs of files (balanced by row count) keep the store's order when
            # the dataset preserves order.
            rows = np.cumsum([r.num_rows for r in reads])
            cuts = np.searchsorted(rows, np.linspace(0, rows[-1], count + 1)[1:-1], side="right")
            tasks = []
            for part in np.split(np.arange(len(reads)), cuts):
                chunk = [reads[i] for i in part]
                if not chunk:
                    continue
                meta = BlockMetadata(
                    num_rows=sum(r.num_rows for r in chunk),
                    size_bytes=sum(r.size or 0 for r in chunk) or None,
                    input_files=[r.path for r in chunk],
                    exec_stats=None,
                )
                tasks.append(
                    ReadTask(
                        lambda chunk=chunk: _read_blocks(chunk, filesystem, schema, crc, with_unit),
                        meta,
                        schema=out_schema,
                    )
                )
            return tasks

    return StoreDatasource()


def read_store(
    root: str | os.PathLike[str] | RolloutStore | ObjectStore,
    *,
    steps: Iterable[int] | int | None = None,
    columns: list[str] | None = None,
    kind: str | None = None,
    ranks: Iterable[int] | None = None,
    filesystem: pafs.FileSystem | None = None,
    check_crc: bool = True,
    include_unit: bool = False,
    override_num_blocks: int | None = None,
) -> Any:
    """A ``ray.data.Dataset`` of the committed group rows of a store, as Arrow blocks.

    Parameters
    ----------
    root:
        A local store directory, a URI (``s3://bucket/run?endpoint_override=...``), or an
        open store.
    steps, kind, ranks:
        Which units to read (as :meth:`RolloutStore.read`); planned from the step files, so
        nothing else is opened.
    columns:
        Group columns to read (projection at the Parquet reader); default all.
    check_crc:
        Check each group file's CRC-32 recorded at commit (one more pass over its bytes).
    include_unit:
        Add a string column ``_unit`` (the unit's file name), which :func:`write_store`
        needs to write each unit back as one append.
    override_num_blocks:
        Number of read tasks (default: Ray's choice); each reads whole files.

    The rows, their values and the schema are those of :meth:`RolloutStore.read` with the
    same arguments; their order is the store's (step, kind, rank) when the dataset preserves
    order (``DataContext.execution_options.preserve_order``).
    """
    ray = _ray()
    store = open_store(root, filesystem=filesystem)
    unified = store.schema("groups")
    if columns is not None:
        unknown = [c for c in columns if c not in unified.names]
        if unknown:
            raise SchemaError(
                f"read_store: unknown column(s) {unknown}; the store has {unified.names}"
            )
        unified = pa.schema([unified.field(c) for c in columns], metadata=unified.metadata)
    reads = _plan(store, steps=steps, kind=kind, ranks=ranks)
    if not reads:
        empty = unified.empty_table()
        if include_unit:
            empty = empty.append_column(UNIT_COLUMN, pa.array([], pa.string()))
        return ray.data.from_arrow(empty)
    fs, _ = _store_files(store)
    source = _datasource(reads, fs, unified, bool(check_crc), bool(include_unit))
    return ray.data.read_datasource(source, override_num_blocks=override_num_blocks)


# ---------------------------------------------------------------------------- group math
@dataclass(frozen=True)
class GroupMathSettings:
    """The settings of the group math (semantics §3.2-§3.6), from a run config.

    ``reward_weights`` (name -> λ) recomputes ``total_utils`` from the ``rewards`` struct;
    ``None`` keeps the stored utilities.
    """

    tau: float
    beta: float
    q_temperature: float = 1.0
    q_epsilon: float = 1e-6
    weight_denominator: str = "tau"
    len_norm_ref: bool = True
    scale_rewards: bool = True
    advantage_eps: float = 1e-4
    reward_weights: Mapping[str, float] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> GroupMathSettings:
        """Settings from a run config (manifest or step-row ``config``), then ``overrides``."""
        # The config's own reward_weights made the stored utilities; only an explicit
        # override recomputes them from the raw rewards.
        merged = {k: v for k, v in dict(config).items() if k != "reward_weights"}
        merged.update(overrides)
        names = {f for f in cls.__dataclass_fields__}
        missing = [n for n in ("tau", "beta") if merged.get(n) is None]
        if missing:
            raise ComputeError(
                f"GroupMathSettings: {missing} not in the run config; pass them as keywords"
            )
        return cls(**{k: v for k, v in merged.items() if k in names})


def _grouped(table: pa.Table, name: str) -> Ragged:
    column = table.column(name)
    if column.null_count:
        chunked = column.combine_chunks()
        row = int(np.flatnonzero(~chunked.is_valid().to_numpy(zero_copy_only=False))[0])
        raise ComputeError(f"recompute_group_math: {name}: null at group {row}")
    return Ragged.from_arrow(column)


def _utilities(table: pa.Table, settings: GroupMathSettings) -> Ragged:
    if settings.reward_weights is None:
        return _grouped(table, "total_utils")
    if "rewards" not in table.column_names:
        raise ComputeError("recompute_group_math: reward_weights given but no 'rewards' column")
    rewards = table.column("rewards").combine_chunks()
    names = [f.name for f in rewards.type]
    per_reward = {}
    for name in settings.reward_weights:
        if name not in names:
            raise ComputeError(
                f"recompute_group_math: reward_weights: no reward {name!r} in the rows "
                f"(they have {names})"
            )
        field = rewards.field(names.index(name))
        if field.null_count:
            row = int(np.flatnonzero(~field.is_valid().to_numpy(zero_copy_only=False))[0])
            raise ComputeError(
                f"recompute_group_math: rewards.{name}: null at group {row} (a reward added "
                "after this step was written); leave it out of reward_weights"
            )
        per_reward[name] = Ragged.from_arrow(field)
    return C.total_utils(per_reward, dict(settings.reward_weights))


def recompute_group_math(
    table: pa.Table | pa.RecordBatch,
    settings: GroupMathSettings | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> pa.Table:
    """Group rows with ``advantages``, ``q`` and ``weights`` recomputed (and ``total_utils``
    when ``reward_weights`` is set), every other column untouched. Arrow in, Arrow out: the
    function ``map_batches(batch_format="pyarrow")`` runs; batches may cut anywhere between
    rows, since a row is a whole group.

    Inputs: ``total_utils`` (or ``rewards``), ``ref_logp_sum_raw`` and ``ref_tok_counts``; with
    ``len_norm_ref`` the reference term is the per-token mean ``ref_logp_sum_raw /
    max(ref_tok_counts, 1)``, else the sum. A non-null ``seed_advantage_scale`` scales its
    group's advantages (SEED-GRPO). Without ``settings``, they come from a run ``config``
    (``tau``, ``beta``, ``q_temperature``, ... as the manifest records them) and ``overrides``.
    """
    if settings is None:
        settings = GroupMathSettings.from_config(config or {}, **overrides)
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if table.num_rows == 0:
        return table
    utils = _utilities(table, settings)
    adv = C.group_advantages(
        utils, scale_rewards=settings.scale_rewards, eps=settings.advantage_eps
    )
    if "seed_advantage_scale" in table.column_names:
        scales = table.column("seed_advantage_scale").combine_chunks()
        if scales.null_count < len(scales):
            values = np.asarray(scales.fill_null(1.0).to_numpy(zero_copy_only=False))
            adv = C.apply_group_scales(adv, values)
    q = C.q_distribution(utils, temperature=settings.q_temperature, epsilon=settings.q_epsilon)
    raw = _grouped(table, "ref_logp_sum_raw")
    counts = _grouped(table, "ref_tok_counts")
    weights = C.maxent_weights(
        q,
        raw.values,
        tau=settings.tau,
        beta=settings.beta,
        denominator=settings.weight_denominator,
        token_counts=counts.values,
        length_normalize=settings.len_norm_ref,
    )
    out = table
    replaced = {"advantages": adv, "q": q, "weights": weights}
    if settings.reward_weights is not None:
        replaced["total_utils"] = utils
    for name, ragged in replaced.items():
        values = torch_to_arrow(ragged.values.to(torch.float64))
        offsets = pa.array(ragged.offsets.numpy().astype(np.int32))
        array = pa.ListArray.from_arrays(offsets, values)
        kind = pa.list_(pa.field("item", pa.float64(), nullable=False))
        array = array.cast(kind)
        index = out.schema.get_field_index(name)
        if index < 0:
            out = out.append_column(pa.field(name, kind), array)
        else:
            out = out.set_column(index, out.schema.field(name).with_type(kind), array)
    return out


def recompute(
    dataset: Any,
    settings: GroupMathSettings | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    batch_size: int | None = 1024,
    **overrides: Any,
) -> Any:
    """``dataset.map_batches(recompute_group_math, batch_format="pyarrow")``: the group math
    of a whole run on the cluster. Settings come from ``settings``, else ``config`` (e.g. the
    store's ``manifest["config"]``) with ``overrides``."""
    if settings is None:
        settings = GroupMathSettings.from_config(config or {}, **overrides)
    return dataset.map_batches(
        recompute_group_math,
        batch_format="pyarrow",
        batch_size=batch_size,
        zero_copy_batch=True,
        fn_kwargs={"settings": settings},
    )


# ---------------------------------------------------------------------------- writing back
def _write_unit(
    rows: pa.Table,
    *,
    target: str,
    filesystem: pafs.FileSystem | None,
    step_rows: Mapping[str, str],
    config_update: str | None,
) -> pa.Table:
    """Runs in a Ray worker: commit one unit's rows to the target store as one append."""
    names = rows.column(UNIT_COLUMN).unique().to_pylist()
    if len(names) != 1:
        raise StoreError(f"write_store: expected the rows of one unit, got units {names}")
    name = names[0]
    rows = rows.drop_columns([UNIT_COLUMN]).sort_by("group_index")
    step_row = step_row_from_json(step_rows[name])
    if config_update is not None:
        merged = {
            **json.loads(step_row.column("config")[0].as_py() or "{}"),
            **json.loads(config_update),
        }
        index = step_row.schema.get_field_index("config")
        step_row = step_row.set_column(
            index, "config", pa.array([json.dumps(merged, sort_keys=True)])
        )
    store = open_store(target, filesystem=filesystem)
    path = store.append(RolloutBatch(rows, step_row))
    return pa.table({"unit": [name], "groups": [rows.num_rows], "path": [str(path)]})


def write_store(
    dataset: Any,
    root: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | RolloutStore | ObjectStore,
    filesystem: pafs.FileSystem | None = None,
    source_filesystem: pafs.FileSystem | None = None,
    config: Mapping[str, Any] | None = None,
) -> RolloutStore | ObjectStore:
    """Commit a dataset of group rows (read with ``include_unit=True``) to a new store at
    ``root``: one append per unit, with the unit's step row from ``source`` (its ``config``
    updated with ``config`` when given), written by Ray tasks in parallel. Returns the new
    store once every unit is committed.
    """
    ray = _ray()
    if UNIT_COLUMN not in dataset.schema().names:
        raise SchemaError(
            f"write_store: the dataset has no {UNIT_COLUMN!r} column; read it "
            "with read_store(..., include_unit=True)"
        )
    src = open_store(source, filesystem=source_filesystem)
    steps = src.read_steps()
    keys = steps.select(["step", "rank", "kind"]).to_pydict()
    step_rows = {
        unit_name(step, rank, kind): step_row_to_json(steps.slice(i, 1).to_batches()[0])
        for i, (step, rank, kind) in enumerate(zip(keys["step"], keys["rank"], keys["kind"]))
    }
    base = {**src.config, **dict(config or {})}
    created = open_store(root, filesystem=filesystem, config=base)
    target = created.uri if isinstance(created, ObjectStore) else str(created.root)
    # Few partitions: a unit is small, and Ray's default (200) costs seconds of empty tasks.
    partitions = max(1, min(len(step_rows), int(ray.cluster_resources().get("CPU", 1)) * 2))
    written = dataset.groupby(UNIT_COLUMN, num_partitions=partitions).map_groups(
        _write_unit,
        batch_format="pyarrow",
        fn_kwargs={
            "target": target,
            "filesystem": filesystem,
            "step_rows": step_rows,
            "config_update": None if config is None else json.dumps(dict(config)),
        },
    )
    done = pa.concat_tables(ray.get(written.to_arrow_refs())) if step_rows else None
    if done is not None and done.num_rows != len(set(done.column("unit").to_pylist())):
        raise StoreError("write_store: a unit was written more than once")
    return open_store(root, filesystem=filesystem)


def recompute_store(
    source: str | os.PathLike[str] | RolloutStore | ObjectStore,
    target: str | os.PathLike[str],
    *,
    filesystem: pafs.FileSystem | None = None,
    target_filesystem: pafs.FileSystem | None = None,
    **overrides: Any,
) -> RolloutStore | ObjectStore:
    """Recompute advantages, q and weights of a whole run on the cluster and write them as a
    new store: :func:`read_store` -> :func:`recompute` -> :func:`write_store`. Settings are the
    source's run config with ``overrides`` (e.g. ``tau=0.3``), which also go into the new
    store's manifest and step-row configs."""
    src = open_store(source, filesystem=filesystem)
    settings = GroupMathSettings.from_config(src.config, **overrides)
    ds = read_store(src, include_unit=True)
    return write_store(
        recompute(ds, settings),
        target,
        source=src,
        filesystem=target_filesystem,
        config=overrides or None,
    )


# ---------------------------------------------------------------------------- collate
def ray_collate_fn(**options: Any) -> Any:
    """A :class:`~maxent_arrow.collate.GroupCollator` (``options`` are its fields) as Ray's
    ``ArrowBatchCollateFn``, so ``iter_torch_batches`` hands it Arrow tables, not numpy
    object arrays."""
    _ray()
    from ray.data.collate_fn import ArrowBatchCollateFn

    class GroupCollateFn(ArrowBatchCollateFn):
        def __init__(self, collator: GroupCollator):
            self.collator = collator

        def __call__(self, batch: pa.Table) -> dict:
            return self.collator(batch)

    return GroupCollateFn(GroupCollator(**options))
