"""Ray Data over a rollout store: read a run as a ``Dataset`` of Arrow group rows, recompute
its group math on a cluster, write the result back as a new store, and collate ragged rows
into training tensors (``pip install 'maxent-arrow[ray]'``).

- :func:`read_store` plans the read from the store's committed step files (the same rule as
  :meth:`RolloutStore.read`: no temp files, no uncommitted groups, no files replaced by
  ``compact``) and reads each group file in a Ray task: the size and CRC-32 recorded at
  commit are checked, and every block is conformed to the store's unified schema, so blocks
  from files written before a column existed carry it as nulls. Blocks are Arrow tables; no
  row is turned into Python objects. Local directories and ``pyarrow.fs`` URIs (``s3://``)
  both work (:mod:`maxent_arrow.store.storage.backend`).
- :func:`recompute_dataset` runs :func:`recompute_group_math` (advantages, q and MaxEnt weights from
  the stored utilities and reference log-probs, :mod:`maxent_arrow.compute.group_math`) as
  ``map_batches(batch_format="pyarrow")``; :func:`write_store` groups the rows back into one
  append per (step, rank, kind) and commits them to a new store; :func:`recompute_store` chains
  the three.
- :func:`ray_collate_fn` wraps :class:`~maxent_arrow.ingest.GroupCollator` as Ray's
  ``ArrowBatchCollateFn`` for ``iter_torch_batches(collate_fn=...)``.

Why a datasource and not ``ray.data.read_parquet``: the commit rule, the checksums, the
explicit unified schema and the slicing of compacted files need the store's step files, and
``read_parquet`` (Ray 2.60) fails at random when ``fsspec`` is installed without
``aiohttp``: its HTTP-filesystem probe imports ``fsspec.implementations.http`` from several
threads, and a thread that sees the module half-imported gets an ``ImportError`` the probe does
not catch (it catches ``ModuleNotFoundError`` only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import torch

from maxent_arrow import compute as C
from maxent_arrow.arrow import Ragged, list_offsets, torch_to_arrow
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.registry import UNIT_KEY
from maxent_arrow.errors import ComputeError, MissingExtraError, SchemaError, StoreError
from maxent_arrow.ingest import GroupCollator
from maxent_arrow.rollout import RolloutBatch, recompute, step_row_from_json, step_row_to_json
from maxent_arrow.rollout.checks import rewards_by_name
from maxent_arrow.store import GroupFileRead, RolloutStore
from maxent_arrow.store.storage.names import unit_name

__all__ = [
    "UNIT_COLUMN",
    "read_store",
    "recompute_group_math",
    "recompute_dataset",
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
def _open(
    root: str | os.PathLike[str] | RolloutStore, filesystem: pafs.FileSystem | None = None
) -> RolloutStore:
    return root if isinstance(root, RolloutStore) else RolloutStore(root, filesystem=filesystem)


def _read_blocks(
    reads: list[GroupFileRead],
    schema: pa.Schema,
    crc: bool,
    with_unit: bool,
    row_filter: pc.Expression | None,
    keep: list[str],
) -> Iterator[pa.Table]:
    """Runs in a Ray worker: one Arrow block per unit, in the store's unified schema."""
    for read in reads:
        for name, part in read.read_units(schema.names, crc=crc):  # their row groups only
            part = S.conform(part, schema)
            if row_filter is not None:
                part = part.filter(row_filter).select(keep)
            if with_unit:
                unit = pa.array([name] * part.num_rows, pa.string())
                part = part.append_column(UNIT_COLUMN, unit)
            yield part


def _datasource(reads, schema, crc, with_unit, row_filter, keep):
    _ray()
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    out_schema = schema if row_filter is None else pa.schema([schema.field(c) for c in keep])
    if with_unit:
        out_schema = out_schema.append(pa.field(UNIT_COLUMN, pa.string()))

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
                    num_rows=None if row_filter is not None else sum(r.num_rows for r in chunk),
                    size_bytes=sum(r.size or 0 for r in chunk) or None,
                    # A list, as written so far (Ray annotates a tuple).
                    input_files=[r.path for r in chunk],  # pyright: ignore[reportArgumentType]
                    exec_stats=None,
                )
                tasks.append(
                    ReadTask(
                        lambda chunk=chunk: _read_blocks(
                            chunk, schema, crc, with_unit, row_filter, keep
                        ),
                        meta,
                        schema=out_schema,
                    )
                )
            return tasks

    return StoreDatasource()


def read_store(
    root: str | os.PathLike[str] | RolloutStore,
    *,
    steps: Iterable[int] | int | None = None,
    columns: list[str] | None = None,
    filter: pc.Expression | None = None,
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
    filter:
        A ``pyarrow.compute`` expression over the flat columns (``step``, ``rank``,
        ``group_index``, ``prompt``, ...) or any column in ``columns``, applied in the read
        tasks (as :meth:`RolloutStore.read`'s ``filter``).
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
    store = _open(root, filesystem)
    unified = store.schema("groups")
    if columns is not None:
        unknown = [c for c in columns if c not in unified.names]
        if unknown:
            raise SchemaError(
                f"read_store: unknown column(s) {unknown}; the store has {unified.names}"
            )
    keep = unified.names if columns is None else list(columns)
    needed = keep
    if filter is not None:
        # The filter may use the flat columns: read them too (token columns only when asked).
        flat = [
            f.name for f in unified if not (pa.types.is_list(f.type) or pa.types.is_struct(f.type))
        ]
        needed = list(dict.fromkeys(keep + flat))
    unified = pa.schema([unified.field(c) for c in needed], metadata=unified.metadata)
    reads = store.file_reads(steps=steps, kind=kind, ranks=ranks)
    if not reads:
        empty = unified.empty_table().select(keep)
        if include_unit:
            empty = empty.append_column(UNIT_COLUMN, pa.array([], pa.string()))
        return ray.data.from_arrow(empty)
    source = _datasource(reads, unified, bool(check_crc), bool(include_unit), filter, keep)
    return ray.data.read_datasource(source, override_num_blocks=override_num_blocks)


# ---------------------------------------------------------------------------- group math
def _utilities(table: pa.Table, reward_weights: Mapping[str, float]) -> Ragged:
    """``total_utils`` recomputed from the raw rewards with new weights
    (``docs/formulas.md`` §3.1)."""
    if "reward_names" not in table.column_names:
        raise ComputeError("recompute_group_math: reward_weights given but no raw rewards stored")
    batch = table.combine_chunks().to_batches()[0]
    by_name = rewards_by_name(batch)
    offsets = torch.from_numpy(list_offsets(batch.column("reward_values")))
    per_reward = {}
    for name in reward_weights:
        if name not in by_name:
            raise ComputeError(
                f"recompute_group_math: reward_weights: no reward {name!r} in the rows "
                f"(they have {list(by_name)})"
            )
        values = by_name[name]
        if np.isnan(values).any():
            sample = int(np.flatnonzero(np.isnan(values))[0])
            group = int(np.searchsorted(offsets.numpy(), sample, side="right") - 1)
            raise ComputeError(
                f"recompute_group_math: rewards {name!r}: missing at group {group} (a reward "
                "added after this step was written); leave it out of reward_weights"
            )
        # A copy: one function's column of the [N, R] reward matrix is a strided view of
        # Arrow's read-only memory, which torch.from_numpy would wrap with a "NumPy array is
        # not writable" warning (DESIGN.md §5); DLPack cannot share a strided view either.
        per_reward[name] = Ragged(torch.from_numpy(np.array(values, dtype=np.float64)), offsets)
    return cast(Ragged, C.total_utils(per_reward, dict(reward_weights)))  # Ragged inputs


def _list_column(ragged: Ragged) -> pa.Array:
    kind = pa.list_(pa.field("item", pa.float64(), nullable=False))
    values = torch_to_arrow(ragged.values.to(torch.float64))
    offsets = pa.array(ragged.offsets.numpy().astype(np.int32))
    return pa.ListArray.from_arrays(offsets, values).cast(kind)


def _replace(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    field = pa.field(name, array.type)
    index = table.schema.get_field_index(name)
    if index < 0:
        return table.append_column(field, array)
    return table.set_column(index, field, array)


def recompute_group_math(
    table: pa.Table | pa.RecordBatch,
    *,
    config: Mapping[str, Any] | str | None = None,
    reward_weights: Mapping[str, float] | None = None,
    **overrides: Any,
) -> pa.Table:
    """Group rows with ``advantages``, ``q`` and ``weights`` recomputed, every other column
    untouched: Arrow in, Arrow out, the function ``map_batches(batch_format="pyarrow")`` runs.

    The math is :func:`maxent_arrow.rollout.recompute`, the single-process recomputation of a
    replayed step (stored utilities, SEED-GRPO scales and reference sums; ``docs/formulas.md``
    §3.2-3.6),
    run on these rows with ``config`` (a run config snapshot: ``tau``, ``beta``,
    ``q_temperature``, ... as a dict or its JSON) and ``overrides`` (e.g. ``tau=0.3``).
    Batches may cut anywhere between rows, since a row is a whole group. ``weights`` is left
    as stored when the config has no ``tau``. With ``reward_weights`` (name -> λ),
    ``total_utils`` is first recomputed from the raw ``rewards``.
    """
    if isinstance(table, pa.Table):
        table = table.combine_chunks()
        batches = table.to_batches()
        table = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
    out = pa.Table.from_batches([table])
    if table.num_rows == 0:
        return out
    if reward_weights is not None:
        out = _replace(out, "total_utils", _list_column(_utilities(out, reward_weights)))
        table = out.combine_chunks().to_batches()[0]
    text = config if isinstance(config, str) else json.dumps(dict(config or {}))
    step_row = pa.RecordBatch.from_pydict({"config": [text]})
    try:
        derived = recompute(RolloutBatch(table, step_row, validate=False), **overrides)
    except StoreError as exc:
        raise ComputeError(f"recompute_group_math: {exc}") from None
    for name, ragged in derived.items():
        out = _replace(out, name, _list_column(ragged))
    return out


def _unit_configs(store: RolloutStore) -> dict[str, str]:
    """The config snapshot of every committed unit, keyed by the unit's file name."""
    steps = store.read_steps(columns=[*UNIT_KEY, "config"]).to_pydict()
    return {
        unit_name(step, rank, kind): config or "{}"
        for step, rank, kind, config in zip(
            steps["step"], steps["rank"], steps["kind"], steps["config"]
        )
    }


def _recompute_by_unit(
    table: pa.Table,
    *,
    configs: Mapping[str, str],
    reward_weights: Mapping[str, float] | None,
    overrides: Mapping[str, Any],
) -> pa.Table:
    """Runs in a Ray worker: each unit's rows with that unit's own config snapshot."""
    if table.num_rows == 0:
        return table
    units = table.column(UNIT_COLUMN).combine_chunks().dictionary_encode()
    codes = units.indices.to_numpy(zero_copy_only=False)
    names = units.dictionary.to_pylist()
    # Rows sharing a config are computed together: a loop over configs, not over groups.
    by_config: dict[str, list[int]] = {}
    for code, name in enumerate(names):
        if name not in configs:
            raise ComputeError(f"recompute: no step row for unit {name!r} in the source store")
        by_config.setdefault(configs[name], []).append(code)
    if len(by_config) == 1:
        (text,) = by_config
        return recompute_group_math(table, config=text, reward_weights=reward_weights, **overrides)
    parts, order = [], []
    for text, members in by_config.items():
        rows = np.flatnonzero(np.isin(codes, members))
        part = table.take(pa.array(rows))
        parts.append(
            recompute_group_math(part, config=text, reward_weights=reward_weights, **overrides)
        )
        order.append(rows)
    merged = pa.concat_tables(parts)
    return merged.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))


def recompute_dataset(
    dataset: Any,
    *,
    source: str | os.PathLike[str] | RolloutStore | None = None,
    config: Mapping[str, Any] | None = None,
    reward_weights: Mapping[str, float] | None = None,
    batch_size: int | None = 1024,
    **overrides: Any,
) -> Any:
    """The group math of a whole run on the cluster: ``map_batches`` over Arrow batches.

    With ``source`` (the store the dataset was read from, with ``include_unit=True``), each
    unit is recomputed with its own step's config snapshot, exactly as
    :func:`maxent_arrow.rollout.recompute` does for a replayed step; otherwise every row uses
    ``config``. ``overrides`` (e.g. ``tau=0.3``) replace config values in both cases.
    """
    if source is not None:
        if UNIT_COLUMN not in dataset.schema().names:
            raise SchemaError(
                f"recompute: source= needs the {UNIT_COLUMN!r} column; read the dataset with "
                "read_store(..., include_unit=True)"
            )
        return dataset.map_batches(
            _recompute_by_unit,
            batch_format="pyarrow",
            batch_size=batch_size,
            fn_kwargs={
                "configs": _unit_configs(_open(source)),
                "reward_weights": reward_weights,
                "overrides": overrides,
            },
        )
    return dataset.map_batches(
        recompute_group_math,
        batch_format="pyarrow",
        batch_size=batch_size,
        fn_kwargs={"config": dict(config or {}), "reward_weights": reward_weights, **overrides},
    )


# ---------------------------------------------------------------------------- writing back
def _write_unit(
    rows: pa.Table,
    *,
    target: str,
    filesystem: pafs.FileSystem | None,
    step_rows: Mapping[str, str],
    config_update: str | None,
    attempt: str,
) -> pa.Table:
    """Runs in a Ray worker: commit one unit's rows to the target store as one append, in
    the driver's attempt (the workers of one write are one attempt)."""
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
    store = RolloutStore(target, filesystem=filesystem, attempt=attempt)
    path = store.append(RolloutBatch(rows, step_row))
    return pa.table({"unit": [name], "groups": [rows.num_rows], "path": [str(path)]})


def write_store(
    dataset: Any,
    root: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | RolloutStore,
    filesystem: pafs.FileSystem | None = None,
    source_filesystem: pafs.FileSystem | None = None,
    config: Mapping[str, Any] | None = None,
) -> RolloutStore:
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
    src = _open(source, source_filesystem)
    steps = src.read_steps()
    keys = steps.select(["step", "rank", "kind"]).to_pydict()
    step_rows = {
        unit_name(step, rank, kind): step_row_to_json(steps.slice(i, 1).to_batches()[0])
        for i, (step, rank, kind) in enumerate(zip(keys["step"], keys["rank"], keys["kind"]))
    }
    base = {**src.config, **dict(config or {})}
    created = RolloutStore.create(root, filesystem=filesystem, config=base)
    target = created.uri
    attempt = created.begin_attempt()
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
            "attempt": attempt,
        },
    )
    done = pa.concat_tables(ray.get(written.to_arrow_refs())) if step_rows else None
    if done is not None and done.num_rows != len(set(done.column("unit").to_pylist())):
        raise StoreError("write_store: a unit was written more than once")
    return RolloutStore(root, filesystem=filesystem)


def recompute_store(
    source: str | os.PathLike[str] | RolloutStore,
    target: str | os.PathLike[str],
    *,
    filesystem: pafs.FileSystem | None = None,
    target_filesystem: pafs.FileSystem | None = None,
    reward_weights: Mapping[str, float] | None = None,
    **overrides: Any,
) -> RolloutStore:
    """Recompute advantages, q and weights of a whole run on the cluster and commit them as a
    new store: :func:`read_store` -> :func:`recompute_dataset` (each step with its own config
    snapshot) -> :func:`write_store`. ``overrides`` (e.g. ``tau=0.3``) also go into the new
    store's manifest and step-row configs."""
    src = _open(source, filesystem)
    dataset = recompute_dataset(
        read_store(src, include_unit=True),
        source=src,
        reward_weights=reward_weights,
        **overrides,
    )
    update = dict(overrides)
    if reward_weights is not None:
        update["reward_weights"] = dict(reward_weights)
    return write_store(
        dataset, target, source=src, filesystem=target_filesystem, config=update or None
    )


# ---------------------------------------------------------------------------- collate
def ray_collate_fn(**options: Any) -> Any:
    """A :class:`~maxent_arrow.ingest.GroupCollator` (``options`` are its fields) as Ray's
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
