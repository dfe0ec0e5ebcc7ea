"""The replay sampler: committed groups of a store, sampled as trainer-ready batches.

It grows out of :func:`~maxent_arrow.store.io.replay.replay` (the same catalog, the same unit
loader, the same IPC cache and checksums) but samples *groups*, not steps: uniformly or by
priority, with a staleness window, deterministic for a seed, resumable from ``state_dict()``,
sharded across consumers without overlap, and every consumption and every drop written to the
store's ``lifecycle`` records.

The plan is computed from a small index read once (each group's key, its policy version, its
reward spread and mean absolute advantage), so sampling, dropping and resuming never read the
token data; only the groups a batch takes are loaded, a unit (one step of one rank) at a time,
and the rows of a batch come back in store order so that a batch holding a whole unit is a
zero-copy slice of it.

Sampling (``SamplerOptions.sampling``):

- ``"sequential"``: store order (step, kind, rank, group index);
- ``"uniform"``: a seeded permutation per epoch;
- ``"prioritized"``: weighted by the group's mean ``|advantage|`` times its reward standard
  deviation, TRL's replay-buffer score (``GRPOWithReplayBufferTrainer``: groups with no
  spread carry no signal); without replacement an epoch is a weighted permutation
  (Efraimidis-Spirakis keys ``log(u) / p``), with ``replacement=True`` each batch is drawn
  independently.

``batch_groups=None`` samples whole stored steps (every rank's groups of one step) instead of
single groups: the unit of the exact replay of a logged step.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from maxent_arrow.arguments import check_int, int_set
from maxent_arrow.arrow import Ragged, list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store.feed.lifecycle import LifecycleWriter
from maxent_arrow.store.history.catalog import Selection, StepFile, Unit
from maxent_arrow.store.history.records import lifecycle_rows
from maxent_arrow.store.io.replay import (
    Source,
    as_batch,
    check_shard,
    check_source,
    completion_counts,
    load_unit_groups,
    partial_step_row,
    sample_count,
    unit_step_row,
)
from maxent_arrow.store.io.take import take_rows
from maxent_arrow.store.readonly import ReadOnlyStore

__all__ = ["ReplaySampler", "SampledBatch", "SamplerOptions", "mix_counts"]

Sampling = Literal["sequential", "uniform", "prioritized"]
# The per-completion policy version, where the store has it (the off-policy data contract);
# the step-level ``policy_version`` otherwise.
COMPLETION_VERSION = "completion_policy_version"


def mix_counts(batch_groups: int, replay_ratio: float) -> tuple[int, int]:
    """``(fresh, replayed)`` groups of a batch of ``batch_groups`` at ``replay_ratio`` (the
    replayed share, rounded half up): ``mix_counts(48, 0.5) == (24, 24)``."""
    if isinstance(batch_groups, bool) or not isinstance(batch_groups, int) or batch_groups < 1:
        raise ArgumentError(
            f"mix_counts: batch_groups must be a positive int, got {batch_groups!r}"
        )
    ratio = float(replay_ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ArgumentError(f"mix_counts: replay_ratio must be in [0, 1], got {replay_ratio!r}")
    replayed = int(np.floor(batch_groups * ratio + 0.5))
    return batch_groups - replayed, replayed


@dataclass(frozen=True, kw_only=True)
class SamplerOptions:
    """What a :class:`ReplaySampler` samples, and how.

    Parameters
    ----------
    batch_groups:
        Groups per batch; ``None`` yields whole stored steps (all ranks' groups of a step).
    kind, steps:
        Which committed groups (default: every ``"train"`` step).
    sampling:
        ``"sequential"``, ``"uniform"`` or ``"prioritized"`` (module docstring).
    replacement:
        Draw each batch independently (a group may come twice in an epoch); by default an
        epoch yields every kept group exactly once.
    epochs:
        How many passes (``None``: without end).
    seed:
        The stream's seed: the same seed, store and options give the same stream.
    max_staleness:
        Keep a group only while ``current_version - version <= max_staleness`` (the version
        given to :meth:`ReplaySampler.sample`); older ones are dropped (``stale``). ``None``
        keeps every group.
    drop_zero_std:
        Drop groups whose rewards are all equal (``zero_std``: no advantage, no signal): for
        good, recorded once (in the first epoch) and passed over in later ones.
    shard:
        ``(index, count)``: this consumer's share of every epoch's order, disjoint across the
        ``count`` consumers (with ``replacement``: disjoint slices of one common draw, in
        which a group may still come twice).
    columns, source:
        Group columns to load (default all) and where from (``"auto"``, ``"cache"``,
        ``"mapped"``, ``"parquet"``), as for :meth:`RolloutStore.replay`.
    record:
        Write each consumption (``trained``) and drop to the store's ``lifecycle`` records
        (a writable store with a commit log).
    cache_units:
        Loaded units (one step of one rank, checked once) kept for the next batches; 0 reads
        each batch's units afresh.
    """

    batch_groups: int | None = None
    kind: str = "train"
    steps: Iterable[int] | int | None = None
    sampling: Sampling = "uniform"
    replacement: bool = False
    epochs: int | None = 1
    seed: int = 0
    max_staleness: int | None = None
    drop_zero_std: bool = False
    shard: tuple[int, int] | None = None
    columns: list[str] | None = None
    source: Source = "auto"
    record: bool = True
    cache_units: int = 4

    @property
    def selection(self) -> Selection:
        """The committed groups this sampler draws from (its kind and steps)."""
        return Selection(self.steps, self.kind, columns=self.columns)

    @classmethod
    def given(
        cls, options: SamplerOptions | None, kwargs: dict[str, Any], *, where: str = "sampler"
    ) -> SamplerOptions:
        """The options of a call that takes a ``SamplerOptions`` or its fields as keywords
        (not both); an unknown keyword is an :class:`ArgumentError` naming ``where``."""
        if options is None:
            try:
                return cls(**kwargs)
            except TypeError as exc:
                raise ArgumentError(f"{where}: {exc}") from None
        if kwargs:
            raise ArgumentError(f"{where}: pass a SamplerOptions or keywords, not both")
        return options

    def __post_init__(self) -> None:
        b = self.batch_groups
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ArgumentError(f"sampler: batch_groups must be a positive int, got {b!r}")
        if self.sampling not in ("sequential", "uniform", "prioritized"):
            raise ArgumentError(
                "sampler: sampling must be 'sequential', 'uniform' or 'prioritized', got "
                f"{self.sampling!r}"
            )
        if self.replacement and self.sampling == "sequential":
            raise ArgumentError("sampler: replacement needs 'uniform' or 'prioritized' sampling")
        e = self.epochs
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
            raise ArgumentError(f"sampler: epochs must be a positive int or None, got {e!r}")
        # (numpy seeds its generators with ints >= 0 only)
        check_int(self.seed, "sampler: seed", low=0)
        w = self.max_staleness
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ArgumentError(f"sampler: max_staleness must be an int >= 0 or None, got {w!r}")
        if self.steps is not None:
            int_set(self.steps, what="sampler: steps")
        if self.shard is not None:
            object.__setattr__(self, "shard", check_shard(self.shard, where="sampler"))
        c = self.cache_units
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ArgumentError(f"sampler: cache_units must be an int >= 0, got {c!r}")
        check_source(self.source, where="sampler")


@dataclass
class SampledBatch:
    """One batch of whole groups, trainer-ready.

    ``groups``: the group rows (every stored column asked for; their ``step``, ``rank``,
    ``kind``, ``group_index`` say where each came from), in store order. ``step_row``: the step
    row of the first unit (its config is the replay contract), with this batch's group and
    sample counts. ``versions``: the policy version of each group (its step's
    ``policy_version``, the step where none was stored); ``completion_versions``: per
    completion (``completion_policy_version`` where stored, else the group's). ``step``: the
    trainer step that consumed it. ``dropped``: ``{reason: count}`` of the groups the sampler
    dropped on the way to this batch; ``dropped_groups``: their keys by reason (the
    ``step``, ``rank``, ``kind``, ``group_index`` and, where stored, ``stream_index``
    columns), for a consumer that records them elsewhere than in the sampled store.
    ``state``: the sampler's ``state_dict()`` after it.
    """

    groups: pa.RecordBatch
    step_row: pa.RecordBatch
    versions: np.ndarray
    completion_versions: np.ndarray
    step: int
    dropped: dict[str, int] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    dropped_groups: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.groups.num_rows

    @property
    def num_samples(self) -> int:
        return len(self.completion_versions)

    @property
    def stored_steps(self) -> tuple[int, ...]:
        """The stored steps its groups come from, ascending."""
        return tuple(int(s) for s in np.unique(self.groups.column("step").to_numpy()))

    def staleness(self, current_version: int) -> float:
        """The mean over its groups of ``current_version`` minus the group's policy version
        (NaN for a batch whose groups were all dropped)."""
        if not len(self.versions):
            return math.nan
        return float((current_version - self.versions).mean())

    def rollout_batch(self) -> RolloutBatch:
        """The batch as a :class:`RolloutBatch` (not validated: the rows were checked when they
        were stored), for everything that takes one (``build_score_batch``, ``recompute``)."""
        return RolloutBatch(self.groups, self.step_row, validate=False)

    def ragged(self, name: str) -> Ragged | None:
        """A per-completion or per-token column as :class:`Ragged` (zero-copy from Arrow)."""
        return self.rollout_batch().ragged(name)

    def tensors(self) -> dict[str, Any]:
        """The trainer's inputs as ragged tensors (values + offsets, no padding): the prompt
        and completion token ids, behaviour and reference per-token log-probs, advantages and
        utilities (per group), and the per-completion policy versions. Pad with
        ``Ragged.to_padded`` (which gives the mask) at the model."""
        import torch

        batch = self.rollout_batch()
        out: dict[str, Any] = {}
        for name, kind in zip(self.groups.schema.names, self.groups.schema.types, strict=True):
            inner = kind
            while pa.types.is_list(inner) or pa.types.is_large_list(inner):
                inner = inner.value_type
            numeric = pa.types.is_integer(inner) or pa.types.is_floating(inner)
            if inner is not kind and numeric and (ragged := batch.ragged(name)) is not None:
                out[name] = ragged
        out["completion_policy_version"] = torch.from_numpy(self.completion_versions)
        return out


@dataclass
class _Index:
    """One row per committed group, in store order (units by step, rank and kind; each
    unit's groups in the order they were appended): where it is and what the plan needs.

    Built from the catalog's units alone (their step files' records: no group data is
    read), so a sampler over a million groups starts in the time it takes to list their
    units. What only some options need is read once, when first asked for: the reward
    spread and priority of every group (``drop_zero_std``, ``"prioritized"``) and the keys
    of groups dropped unseen (``stale``); a completion's own policy version where the store
    has the column (asynchronous producers) is read at once, as every batch needs it."""

    store: ReadOnlyStore
    selection: Selection
    units: list[Unit]
    unit: np.ndarray  # index into units
    row: np.ndarray  # position inside its unit
    step: np.ndarray
    version: np.ndarray  # the group's policy version (oldest completion's)
    stats: tuple[np.ndarray, np.ndarray] | None = None
    keys: pa.Table | None = None

    @property
    def zero_std(self) -> np.ndarray:
        """Per group: its rewards are all equal (or it has one completion)."""
        return self._stats()[0]

    @property
    def priority(self) -> np.ndarray:
        """Per group: its mean ``|advantage|`` times its reward standard deviation."""
        return self._stats()[1]

    def _stats(self) -> tuple[np.ndarray, np.ndarray]:
        if self.stats is None:
            table = self.read(["total_utils", "advantages"])
            self.stats = _group_stats(table)
        return self.stats

    def key_rows(self, rows: np.ndarray) -> pa.Table:
        """The lifecycle keys (:data:`~maxent_arrow.arrow.registry.ROW_KEY` and, where
        stored, ``stream_index``) of index rows ``rows``."""
        keys = self.keys
        if keys is None:
            table = self.read([*R.ROW_KEY, "stream_index"])
            keys = self.keys = table.select(
                [c for c in (*R.ROW_KEY, "stream_index") if c in table.column_names]
            )
        return keys.take(pa.array(rows, pa.int64()))

    def read(self, columns: list[str]) -> pa.Table:
        """``columns`` (those the store has) of every indexed group, in index order."""
        store = self.store
        schema = store.schema("groups")
        wanted = [c for c in dict.fromkeys([*R.UNIT_KEY, *columns]) if c in schema.names]
        steps = sorted({u.step for u in self.units})
        table = store.read(kind=self.selection.kind, steps=steps, columns=wanted)
        # (a stable sort: each unit's rows stay in the order they were appended)
        table = table.sort_by([("step", "ascending"), ("rank", "ascending")])
        steps_read = table.column("step").to_numpy().astype(np.int64)
        ranks_read = table.column("rank").to_numpy().astype(np.int64)
        expected = np.array([(u.step, u.rank) for u in self.units], dtype=np.int64)
        got = np.stack([steps_read, ranks_read], axis=1) if len(steps_read) else expected[:0]
        if len(got) != len(self.unit) or not np.array_equal(got, expected[self.unit]):
            raise StoreError(
                f"{store.uri}: the groups read ({len(got)}) are not those the catalog lists "
                f"({len(self.unit)} in {len(self.units)} units)"
            )
        return table


def _group_stats(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per group: reward std is zero (or one completion), and mean |A| times reward std."""
    n = table.num_rows
    zero = np.ones(n, dtype=bool)
    priority = np.zeros(n)
    if n == 0 or "total_utils" not in table.column_names:
        return zero, priority
    utils = table.column("total_utils").combine_chunks()
    offsets = list_offsets(utils)
    values = np.asarray(utils.flatten().fill_null(0.0).to_numpy(zero_copy_only=False), float)
    counts = np.diff(offsets)
    nonempty = counts > 0
    starts = offsets[:-1][nonempty]
    sums = np.zeros(n)
    squares = np.zeros(n)
    if len(values):
        sums[nonempty] = np.add.reduceat(values, starts)
        squares[nonempty] = np.add.reduceat(values * values, starts)
    safe = np.maximum(counts, 1)
    mean = sums / safe
    var = np.maximum(squares / safe - mean * mean, 0.0)
    # std of equal floats can come out as a rounding residue: compare max and min instead.
    spread = np.zeros(n)
    if len(values):
        hi = np.maximum.reduceat(values, starts)
        lo = np.minimum.reduceat(values, starts)
        spread[nonempty] = hi - lo
    zero = (spread == 0) | (counts < 2)
    std = np.where(zero, 0.0, np.sqrt(var * safe / np.maximum(safe - 1, 1)))
    if "advantages" in table.column_names:
        adv = table.column("advantages").combine_chunks()
        a_off = list_offsets(adv)
        a_val = np.abs(np.asarray(adv.flatten().fill_null(0.0).to_numpy(zero_copy_only=False)))
        a_counts = np.diff(a_off)
        a_sum = np.zeros(n)
        if len(a_val):
            a_sum[a_counts > 0] = np.add.reduceat(a_val, a_off[:-1][a_counts > 0])
        priority = a_sum / np.maximum(a_counts, 1) * std
    else:
        priority = std
    return zero, priority


def _unit_versions(store: ReadOnlyStore, units: list[Unit]) -> np.ndarray:
    """Each unit's step-level ``policy_version`` (its step where none was stored), from its
    step file's record."""
    versions = np.array([u.step for u in units], dtype=np.int64)
    by_file: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        by_file.setdefault(u.step_file, []).append(i)
    for name, members in by_file.items():
        step = store.catalog.step_file(name)
        if "policy_version" not in step.schema.names:
            continue
        column = step.column("policy_version")
        for i in members:
            value = column[units[i].row]
            if value is not None:
                versions[i] = value
    return versions


def _written(store: ReadOnlyStore, units: list[Unit], column: str) -> bool:
    """Whether some unit was appended with ``column`` (its step file's record lists the
    columns appended; one that does not say counts as having it)."""
    if column not in store.schema("groups").names:
        return False
    for name in dict.fromkeys(u.step_file for u in units):
        appended = store.catalog.step_file(name).meta.get("columns")
        if appended is None or column in appended:
            return True
    return False


def _build_index(store: ReadOnlyStore, options: SamplerOptions) -> _Index:
    selection = replace(options.selection, columns=None, on_error=store.on_error)
    units = store.catalog.units(selection)
    units.sort(key=lambda u: (u.step, u.rank, u.kind))  # ROW_KEY order, as the index
    if not units:
        raise StoreError(f"{store.uri}: no committed {options.kind!r} groups to sample")
    counts = np.array([u.num_groups for u in units], dtype=np.int64)
    unit = np.repeat(np.arange(len(units), dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    row = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    step = np.array([u.step for u in units], dtype=np.int64)[unit]
    version = _unit_versions(store, units)[unit]
    index = _Index(store, selection, units, unit, row, step, version)
    if _written(store, units, COMPLETION_VERSION):
        column = index.read([COMPLETION_VERSION]).column(COMPLETION_VERSION).combine_chunks()
        offsets = list_offsets(column)
        values = column.flatten().to_numpy(zero_copy_only=False)
        counts = np.diff(offsets)
        stored = (counts > 0) & column.is_valid().to_numpy(zero_copy_only=False)
        if stored.any() and len(values):
            oldest = np.minimum.reduceat(values, offsets[:-1][counts > 0])
            full = np.zeros(len(version), dtype=np.int64)
            full[counts > 0] = oldest
            index.version = np.where(stored, full, version)
    return index


class _Singles(Sequence[np.ndarray]):
    """Items of one group each (``[i]`` for group ``i``), made when asked for: a million
    groups are not a million arrays."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, slice):
            return [np.array([i]) for i in range(self.n)[item]]
        if not -self.n <= item < self.n:
            raise IndexError(item)
        return np.array([item % self.n])


class ReplaySampler:
    """Committed groups of ``store`` as a stream of :class:`SampledBatch` (module docstring).

    ``sample(current_version=, step=)`` gives the next batch (``None`` at the end of the last
    epoch); iterating calls it with no version (no staleness check) and consecutive steps.
    ``state_dict()`` / ``load_state_dict()`` carry the stream's position: a consumer that
    saves it with its checkpoint and loads it on resume continues the same stream. A batch's
    lifecycle records are handed over when it is drawn and committed in the background
    (:mod:`~maxent_arrow.store.feed.lifecycle`); ``state_dict()`` and :meth:`flush` return
    once they are. A consumer killed before its checkpoint draws that batch again on resume
    (at-least-once); resumed as an attempt at that step, the earlier records are superseded
    (``docs/commit-protocol.md``, "Lifecycle").
    """

    def __init__(self, store: ReadOnlyStore, options: SamplerOptions | None = None, **kwargs: Any):
        options = SamplerOptions.given(options, kwargs)
        self.store = store
        self.options = options
        if options.record and not hasattr(store, "record_lifecycle"):
            raise ArgumentError(
                "sampler: record=True needs a writable RolloutStore (or pass record=False)"
            )
        self.index = _build_index(store, options)
        self.items = self._items()
        self.fingerprint = self._fingerprint()
        self.epoch = 0
        self.position = 0  # in this consumer's order of the epoch
        self.batches = 0  # batches yielded so far (the default trainer step)
        self._order: np.ndarray | None = None
        self._idle = 0  # groups dropped since the last one kept
        self._loaded: OrderedDict[int, tuple[pa.RecordBatch, pa.RecordBatch]] = OrderedDict()
        self._steps: dict[str, StepFile] = {}
        self._records: LifecycleWriter | None = None  # (made by the first batch recorded)

    # ------------------------------------------------------------------ the plan
    def _items(self) -> Sequence[np.ndarray]:
        """What is sampled: one group each, or (``batch_groups=None``) one step's groups."""
        n = len(self.index.unit)
        if self.options.batch_groups is not None:
            return _Singles(n)
        steps = self.index.step
        cuts = np.flatnonzero(np.diff(steps)) + 1
        return np.split(np.arange(n), cuts)

    def _fingerprint(self) -> str:
        o = self.options
        text = json.dumps(
            {
                "units": [u.name for u in self.index.units],
                "groups": len(self.index.unit),
                "batch_groups": o.batch_groups,
                "sampling": o.sampling,
                "replacement": o.replacement,
                "seed": int(o.seed),
                "shard": o.shard,
                "max_staleness": o.max_staleness,
                "drop_zero_std": o.drop_zero_std,
            },
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _item_priority(self) -> np.ndarray:
        p = self.index.priority
        if self.options.batch_groups is not None:
            return p.copy()
        return np.array([p[item].mean() for item in self.items])  # (one per stored step)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """This consumer's share of the items in epoch ``epoch``'s order."""
        o = self.options
        n = len(self.items)
        rng = np.random.default_rng([int(o.seed), epoch])
        if o.sampling == "sequential":
            order = np.arange(n)
        elif o.sampling == "uniform":
            order = rng.permutation(n)
        else:
            p = self._item_priority()
            u = rng.random(n)
            with np.errstate(divide="ignore"):
                keys = np.where(p > 0, np.log(np.maximum(u, 1e-300)) / np.where(p > 0, p, 1.0),
                                -np.inf)  # fmt: skip
            # Zero-priority items last, in a seeded order of their own.
            tie = rng.permutation(n)
            order = np.lexsort((tie, -keys))
        if o.shard is not None:
            order = order[o.shard[0] :: o.shard[1]]
        return order

    def _draw(self, count: int) -> np.ndarray:
        """``count`` items drawn with replacement for batch number ``self.batches``."""
        o = self.options
        rng = np.random.default_rng([int(o.seed), self.epoch, self.batches, 1])
        n = len(self.items)
        consumers = 1 if o.shard is None else o.shard[1]
        if o.sampling == "prioritized":
            p = self._item_priority()
            p = p / p.sum() if p.sum() > 0 else None
        else:
            p = None
        drawn = rng.choice(n, size=count * consumers, replace=True, p=p)
        return drawn if o.shard is None else drawn[o.shard[0] :: o.shard[1]]

    def _order_now(self) -> np.ndarray:
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        return self._order

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The stream's position: JSON-able (epoch, position, batches, fingerprint), once
        every lifecycle record of the batches drawn so far is committed (:meth:`flush`): a
        consumer that saves it with its checkpoint has those records durable first."""
        self.flush()
        return self._position()

    def flush(self) -> None:
        """Return once the lifecycle records of every batch drawn so far are committed
        (they commit in the background, several batches per commit:
        :mod:`~maxent_arrow.store.feed.lifecycle`); a commit that failed is raised here."""
        if self._records is not None:
            self._records.flush()

    def close(self) -> None:
        """:meth:`flush`, then stop the thread that commits the records."""
        if self._records is not None:
            self._records.close()
            self._records = None

    def _position(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches": self.batches,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any] | str) -> None:
        """Continue the stream after the batch whose ``state`` this is (made by a sampler
        over the same store contents and options)."""
        if isinstance(state, str):
            try:
                state = json.loads(state)
            except ValueError:
                raise ArgumentError(
                    f"sampler: state: expected a state_dict or its JSON, got {state[:80]!r}"
                ) from None
        if not isinstance(state, dict) or not {"epoch", "position", "batches"} <= state.keys():
            raise ArgumentError(f"sampler: not a sampler state_dict: {state!r}")
        if state.get("fingerprint") not in (None, self.fingerprint):
            raise StoreError(
                "sampler: the state was made by a different sampler (other store contents or "
                "options); give the same options to resume"
            )
        for name in ("epoch", "position", "batches"):
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ArgumentError(f"sampler: state {name} must be an int >= 0, got {value!r}")
        self.epoch, self.position, self.batches = (
            state["epoch"],
            state["position"],
            state["batches"],
        )
        self._order = None

    # ------------------------------------------------------------------ sampling
    def __iter__(self) -> Iterator[SampledBatch]:
        while (batch := self.sample()) is not None:
            yield batch

    def _finished(self) -> bool:
        return self.options.epochs is not None and self.epoch >= self.options.epochs

    def _candidates(self) -> Iterator[int]:
        """Items in stream order from the current position to the end of the epoch (a batch
        never spans two epochs), advancing the position; the epoch turns over first when the
        current one is done."""
        o = self.options
        while not self._finished():
            if o.replacement:
                per_epoch = max(1, -(-len(self.items) // (o.batch_groups or 1)))
                if o.shard is not None:
                    per_epoch = -(-per_epoch // o.shard[1])
                if self.position >= per_epoch:
                    self.epoch, self.position, self._order = self.epoch + 1, 0, None
                    continue
                drawn = self._draw(o.batch_groups or 1)
                self.position += 1
                yield from drawn.tolist()
                return
            order = self._order_now()
            if self.position >= len(order):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
                continue
            while self.position < len(order):
                self.position += 1
                yield int(order[self.position - 1])
            return

    def sample(self, *, current_version: int | None = None, step: int | None = None):
        """The next batch (``None`` once the last epoch is done).

        ``current_version``: the consumer's policy version, for the staleness window.
        ``step``: the trainer step the batch is consumed at (lifecycle records; default: the
        number of batches yielded before it).
        """
        o = self.options
        want = 1 if o.batch_groups is None else o.batch_groups
        at = self.batches if step is None else int(step)
        taken: list[int] = []
        dropped: dict[str, list[int]] = {"stale": [], "zero_std": []}
        items_taken = 0
        idle = 0  # groups passed over without being kept
        for item in self._candidates():
            groups = self.items[item]
            if o.drop_zero_std:
                zero = self.index.zero_std[groups]
                if zero.any():
                    # Dropped for good: recorded once, in the first epoch; skipped after.
                    if self.epoch == 0:
                        dropped["zero_std"].extend(groups[zero].tolist())
                    idle += int(zero.sum())
                    groups = groups[~zero]
            if o.max_staleness is not None and current_version is not None:
                stale = current_version - self.index.version[groups] > o.max_staleness
                dropped["stale"].extend(groups[stale].tolist())
                idle += int(stale.sum())
                groups = groups[~stale]
            if len(groups):
                taken.extend(groups.tolist())
                items_taken += 1
            if items_taken >= want:
                break
        if not taken and not idle:
            return None
        # A whole epoch's worth of groups passed over with nothing kept: nothing ever will be
        # (every group dropped); end the stream rather than yield empty batches forever.
        self._idle = 0 if taken else self._idle + idle
        if self._idle > len(self.index.unit):
            return None
        self.batches += 1
        batch, keys = self._load(np.array(sorted(taken), dtype=np.int64), at)
        if o.record:  # (what was served: a batch that failed to load is not recorded)
            self._record(dropped, keys, at)
        batch.dropped = {k: len(v) for k, v in dropped.items() if v}
        batch.dropped_groups = {k: self._keys(v) for k, v in dropped.items() if v}
        batch.state = self._position()
        return batch

    def _record(self, dropped: dict[str, list[int]], taken: pa.Table, step: int) -> None:
        """The batch's drops and consumption (``taken``: the keys of the groups served) as
        ``lifecycle`` records, in one commit."""
        parts = [
            lifecycle_rows(self._keys(rows), step=step, event="dropped", reason=reason)
            for reason, rows in dropped.items()
            if rows
        ]
        if taken.num_rows:
            parts.append(lifecycle_rows(taken, step=step, event="trained"))
        if parts:
            if self._records is None:
                self._records = LifecycleWriter(self.store)
            self._records.put(pa.concat_tables(parts))

    def _keys(self, rows: list[int]) -> pa.Table:
        return self.index.key_rows(np.array(sorted(rows), dtype=np.int64))

    # ------------------------------------------------------------------ loading
    def _read_columns(self) -> list[str] | None:
        """The columns a unit is read with: those asked for and those the sampler needs
        itself (the lifecycle keys, the completion counts and versions)."""
        columns = self.options.columns
        if columns is None:
            return None
        own = [*R.ROW_KEY, "stream_index", "num_completions", COMPLETION_VERSION]
        return list(dict.fromkeys([*columns, *own]))

    def _unit(self, u: int) -> pa.RecordBatch:
        if u in self._loaded:
            self._loaded.move_to_end(u)
            return self._loaded[u][0]
        store = self.store
        loaded = load_unit_groups(
            store.catalog,
            self.index.units[u],
            columns=self._read_columns(),
            source=self.options.source,
            crc=store.check_crc,
        )
        self._loaded[u] = loaded
        while len(self._loaded) > self.options.cache_units:
            self._loaded.popitem(last=False)
        return loaded[0]

    def _taken(self, u: int, rows: np.ndarray) -> list[pa.RecordBatch] | None:
        """Rows ``rows`` of unit ``u`` from its take file (each group's bytes only), or
        ``None``: the whole unit is asked for, the source is not ``"auto"``, or the unit has
        no take file of its commit (a damaged one is a warning: the archive serves)."""
        unit = self.index.units[u]
        if self.options.source != "auto" or len(rows) >= unit.num_groups or u in self._loaded:
            return None
        store = self.store
        catalog = store.catalog
        try:
            # (a unit's step file record as the plan found it: what ties the take file to
            # the commit, the same through any later compaction)
            step = self._steps.get(unit.step_file)
            if step is None:
                step = self._steps[unit.step_file] = catalog.step_file(unit.step_file)
            return take_rows(catalog.backend, step, unit.name, rows.tolist(), check=store.check_crc)
        except StoreError as exc:
            warnings.warn(f"{exc}; reading {unit.name} from the archive", stacklevel=4)
            return None

    def _rows(self, u: int, rows: np.ndarray) -> list[pa.RecordBatch]:
        """The group rows ``rows`` (positions, ascending) of unit ``u``."""
        taken = self._taken(u, rows)
        if taken is not None:
            return taken
        groups = self._unit(u)
        if rows[-1] >= groups.num_rows:
            raise StoreError(
                f"{self.store.uri}: {self.index.units[u].name} has {groups.num_rows} groups, "
                f"the index names group {int(rows[-1])}"
            )
        if len(rows) == rows[-1] - rows[0] + 1:  # contiguous: a zero-copy slice
            return [groups.slice(int(rows[0]), len(rows))]
        return [groups.take(pa.array(rows))]

    def _load(self, taken: np.ndarray, step: int) -> tuple[SampledBatch, pa.Table]:
        """The rows of the ``taken`` groups (index positions, ascending: store order), and
        their lifecycle keys."""
        index = self.index
        parts: list[pa.RecordBatch] = []
        cuts = np.flatnonzero(np.diff(index.unit[taken])) + 1
        for chunk in np.split(taken, cuts) if len(taken) else []:
            parts += self._rows(int(index.unit[chunk[0]]), index.row[chunk])
        first = index.units[int(index.unit[taken[0] if len(taken) else 0])]
        step_row = unit_step_row(self.store.catalog, first)
        if not parts:
            rows = self._unit(int(index.unit[0])).slice(0, 0)
        elif len(parts) == 1:
            rows = parts[0]
        else:
            try:  # (one schema, as a rule: a run appends the same columns step after step)
                table = pa.Table.from_batches(parts)
            except pa.ArrowInvalid:  # columns added or missing between steps
                tables = [pa.Table.from_batches([p]) for p in parts]
                table = pa.concat_tables(tables, promote_options="default")
            rows = as_batch(table)
        step_row = partial_step_row(step_row, rows, sample_count(rows))
        versions = index.version[taken]
        completion_versions = _completion_versions(rows, versions)
        keys = rows.select([c for c in (*R.ROW_KEY, "stream_index") if c in rows.schema.names])
        if self.options.columns is not None:
            rows = rows.select([c for c in self.options.columns if c in rows.schema.names])
        batch = SampledBatch(rows, step_row, versions, completion_versions, step)
        return batch, pa.Table.from_batches([keys])


def _completion_versions(groups: pa.RecordBatch, versions: np.ndarray) -> np.ndarray:
    """Per completion: ``completion_policy_version`` where stored, else its group's version."""
    counts = completion_counts(groups)
    out = np.repeat(versions, counts).astype(np.int64)
    if COMPLETION_VERSION in groups.schema.names:
        column = groups.column(COMPLETION_VERSION)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        if valid.any():
            stored = np.diff(list_offsets(column))
            bad = np.flatnonzero(valid & (stored != counts))
            if bad.size:  # the batch checks refuse this on write: a damaged file
                g = int(bad[0])
                raise StoreError(
                    f"sampler: {COMPLETION_VERSION}: expected {int(counts[g])} versions (one "
                    f"per completion) at group row {g} of the batch, got {int(stored[g])}"
                )
            values = column.flatten().to_numpy(zero_copy_only=False)
            out[np.repeat(valid, counts)] = values
    return out
