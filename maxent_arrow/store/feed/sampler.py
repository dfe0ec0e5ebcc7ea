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
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from maxent_arrow.arguments import check_int, int_set
from maxent_arrow.arrow import Ragged, list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store.history.catalog import Selection, Unit
from maxent_arrow.store.history.records import lifecycle_rows
from maxent_arrow.store.io.replay import (
    Source,
    check_shard,
    check_source,
    load_unit_groups,
    partial_step_row,
)
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


@dataclass(frozen=True)
class _Index:
    """One row per committed group, in store order: where it is and what the plan needs."""

    units: list[Unit]
    unit: np.ndarray  # index into units
    row: np.ndarray  # row inside its unit
    step: np.ndarray
    version: np.ndarray  # the group's policy version (oldest completion's)
    zero_std: np.ndarray  # bool
    priority: np.ndarray  # mean |advantage| * reward std
    keys: pa.Table  # ROW_KEY columns (and stream_index), for lifecycle records


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


def _build_index(store: ReadOnlyStore, options: SamplerOptions) -> _Index:
    units = store.catalog.units(replace(options.selection, on_error=store.on_error))
    units.sort(key=lambda u: (u.step, u.rank, u.kind))  # ROW_KEY order, as the index
    if not units:
        raise StoreError(f"{store.uri}: no committed {options.kind!r} groups to sample")
    schema = store.schema("groups")
    wanted = [*R.ROW_KEY, "total_utils", "advantages", "stream_index", COMPLETION_VERSION]
    table = store.read(
        kind=options.kind,
        steps=sorted({u.step for u in units}),
        columns=[c for c in wanted if c in schema.names],
    )
    table = table.sort_by([(c, "ascending") for c in R.ROW_KEY])
    position = {(u.step, u.rank, u.kind): i for i, u in enumerate(units)}
    steps = table.column("step").to_numpy().astype(np.int64)
    ranks = table.column("rank").to_numpy().astype(np.int64)
    unit = _unit_of_rows(units, steps, ranks, where=store.uri)
    row = table.column("group_index").to_numpy().astype(np.int64)
    # The step-level policy version of each unit (the step where none was stored).
    step_table = store.read_steps(
        kind=options.kind,
        steps=sorted({u.step for u in units}),
        columns=[c for c in (*R.UNIT_KEY, "policy_version") if c in store.schema("steps").names],
    )
    unit_version = np.array([u.step for u in units], dtype=np.int64)
    if "policy_version" in step_table.column_names:
        for s, r, k, v in zip(
            step_table.column("step").to_pylist(),
            step_table.column("rank").to_pylist(),
            step_table.column("kind").to_pylist(),
            step_table.column("policy_version").to_pylist(),
            strict=True,
        ):
            if v is not None and (s, r, k) in position:
                unit_version[position[(s, r, k)]] = v
    version = unit_version[unit]
    if COMPLETION_VERSION in table.column_names:
        column = table.column(COMPLETION_VERSION).combine_chunks()
        offsets = list_offsets(column)
        values = column.flatten().to_numpy(zero_copy_only=False)
        counts = np.diff(offsets)
        stored = (counts > 0) & column.is_valid().to_numpy(zero_copy_only=False)
        if stored.any() and len(values):
            oldest = np.minimum.reduceat(values, offsets[:-1][counts > 0])
            version = version.copy()
            full = np.zeros(len(version), dtype=np.int64)
            full[counts > 0] = oldest
            version[stored] = full[stored]
    zero, priority = _group_stats(table)
    keys = table.select([c for c in (*R.ROW_KEY, "stream_index") if c in table.column_names])
    return _Index(units, unit, row, steps.astype(np.int64), version, zero, priority, keys)


def _unit_of_rows(
    units: list[Unit], steps: np.ndarray, ranks: np.ndarray, *, where: Any
) -> np.ndarray:
    """The index in ``units`` (one kind, sorted by step and rank) of each group row: one
    search over ``(step, rank)`` keys, no loop over groups."""
    unit_steps = np.array([u.step for u in units], dtype=np.int64)
    unit_ranks = np.array([u.rank for u in units], dtype=np.int64)
    width = int(max(unit_ranks.max(initial=0), ranks.max(initial=0))) + 1
    keys = unit_steps * width + unit_ranks  # ascending: units are sorted by (step, rank)
    wanted = steps * width + ranks
    unit = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    missing = np.flatnonzero(keys[unit] != wanted)
    if missing.size:
        i = int(missing[0])
        raise StoreError(
            f"{where}: group row {i} (step {int(steps[i])}, rank {int(ranks[i])}) is in no "
            "committed unit the sampler listed"
        )
    return unit.astype(np.int64)


class ReplaySampler:
    """Committed groups of ``store`` as a stream of :class:`SampledBatch` (module docstring).

    ``sample(current_version=, step=)`` gives the next batch (``None`` at the end of the last
    epoch); iterating calls it with no version (no staleness check) and consecutive steps.
    ``state_dict()`` / ``load_state_dict()`` carry the stream's position: a consumer that
    saves it with its checkpoint and loads it on resume continues the same stream. A batch's
    lifecycle records are written when it is drawn: a consumer killed before its checkpoint
    draws that batch again on resume (at-least-once); resumed as an attempt at that step, the
    earlier records are superseded (``docs/commit-protocol.md``, "Lifecycle").
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

    # ------------------------------------------------------------------ the plan
    def _items(self) -> list[np.ndarray]:
        """What is sampled: one group each, or (``batch_groups=None``) one step's groups."""
        n = len(self.index.unit)
        if self.options.batch_groups is not None:
            return [np.array([i]) for i in range(n)]
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
        return np.array([p[item].mean() for item in self.items])

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
        """The stream's position: JSON-able (epoch, position, batches, fingerprint)."""
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
        if o.record:
            self._record(dropped, taken, at)
        batch = self._load(np.array(sorted(taken), dtype=np.int64), at)
        batch.dropped = {k: len(v) for k, v in dropped.items() if v}
        batch.dropped_groups = {k: self._keys(v) for k, v in dropped.items() if v}
        batch.state = self.state_dict()
        return batch

    def _record(self, dropped: dict[str, list[int]], taken: list[int], step: int) -> None:
        """The batch's drops and consumption as ``lifecycle`` records, in one commit."""
        parts = [
            lifecycle_rows(self._keys(rows), step=step, event="dropped", reason=reason)
            for reason, rows in dropped.items()
            if rows
        ]
        if taken:
            parts.append(lifecycle_rows(self._keys(taken), step=step, event="trained"))
        if parts:
            store: Any = self.store
            store.append_records(R.LIFECYCLE, pa.concat_tables(parts))

    def _keys(self, rows: list[int]) -> pa.Table:
        return self.index.keys.take(pa.array(sorted(rows), pa.int64()))

    # ------------------------------------------------------------------ loading
    def _unit(self, u: int) -> tuple[pa.RecordBatch, pa.RecordBatch]:
        if u in self._loaded:
            self._loaded.move_to_end(u)
            return self._loaded[u]
        store = self.store
        loaded = load_unit_groups(
            store.catalog,
            self.index.units[u],
            columns=self.options.columns,
            source=self.options.source,
            crc=store.check_crc,
        )
        self._loaded[u] = loaded
        while len(self._loaded) > self.options.cache_units:
            self._loaded.popitem(last=False)
        return loaded

    def _load(self, taken: np.ndarray, step: int) -> SampledBatch:
        """The rows of the ``taken`` groups (index positions, ascending: store order)."""
        index = self.index
        units = index.unit[taken]
        parts: list[pa.RecordBatch] = []
        step_row: pa.RecordBatch | None = None
        cuts = np.flatnonzero(np.diff(units)) + 1
        for chunk in np.split(taken, cuts) if len(taken) else []:
            groups, row = self._unit(int(index.unit[chunk[0]]))
            step_row = row if step_row is None else step_row
            rows = index.row[chunk]
            if rows[-1] >= groups.num_rows:
                raise StoreError(
                    f"{self.store.uri}: {index.units[int(index.unit[chunk[0]])].name} has "
                    f"{groups.num_rows} groups, the index names group {int(rows[-1])}"
                )
            if len(rows) == rows[-1] - rows[0] + 1:  # contiguous: a zero-copy slice
                parts.append(groups.slice(int(rows[0]), len(rows)))
            else:
                parts.append(groups.take(pa.array(rows)))
        if step_row is None:
            step_row = self._unit(int(index.unit[0]))[1]
            rows_batch = self._unit(int(index.unit[0]))[0].slice(0, 0)
        elif len(parts) == 1:
            rows_batch = parts[0]
        else:
            table = pa.concat_tables(
                [pa.Table.from_batches([p]) for p in parts], promote_options="default"
            )
            rows_batch = table.combine_chunks().to_batches()[0]
        step_row = partial_step_row(step_row, rows_batch)
        versions = index.version[taken]
        completion_versions = _completion_versions(rows_batch, versions)
        return SampledBatch(rows_batch, step_row, versions, completion_versions, step)


def _completion_versions(groups: pa.RecordBatch, versions: np.ndarray) -> np.ndarray:
    """Per completion: ``completion_policy_version`` where stored, else its group's version."""
    offsets = list_offsets(groups.column("completions")) if groups.num_rows else np.zeros(1, int)
    out = np.repeat(versions, np.diff(offsets)).astype(np.int64)
    if COMPLETION_VERSION in groups.schema.names:
        column = groups.column(COMPLETION_VERSION)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        if valid.any():
            counts = np.diff(offsets)
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
