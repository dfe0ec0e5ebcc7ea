"""Arrow layout of ``RewardComputation``: one row per prompt group.

The ``[N]`` fields are ``list`` columns grouped like ``advantage.grouped`` (``rewards`` is a
struct with one such column per reward function; the pairs' columns keep the group table's
names, ``prompts``, ``completions``, ``pairs_metadata``), the ``[P]`` SEED fields plain
columns, the scalars (moments and the optional floats) metadata. The nested records decode as
Arrow-born records over the same columns. :func:`rewards_batch` builds such a batch from
Arrow columns, for code that makes a ``RewardComputation`` without Python values (the reward
step, the rollout batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.types import fields as F
from maxent_arrow.types.base import SOURCE, Source, born, layout_of, lazy, peek, untouched_from
from maxent_arrow.types.columns import (
    is_float,
    is_list_of,
    is_struct,
    is_text,
    make_batch,
    plain_text,
    require,
    scalar,
)
from maxent_arrow.types.records import BoundLayout, GroupedPairLayout, PairsLayout, same_groups

__all__ = ["RewardsLayout", "SampleColumns", "SeedColumns", "rewards_batch"]

_FLOAT_LIST = is_list_of(is_float)
_PAIR_COLUMNS = ("prompts", "prompt_messages", "completions", "completion_messages")
# Fields that are records of their own (AdvantageStats, QDistribution, ...).
_NESTED = ("advantage", "pairs", "q_distribution", "moments")
# Group-table columns that feed it, as they are: {column: field}.
_STORED = {c: f for c, f in R.fed_fields("RewardComputation").items() if f != "per_reward_values"}
# The per-completion fields among them, flat [N] values.
_FLAT = tuple(c for c in _STORED if R.column(c).level == "completion" and _STORED[c] not in _NESTED)
_SCALARS = ("entropy_bonus_scale", "seed_alpha_effective", "seed_max_possible_entropy")
_SEED_COLUMNS = {
    "seed_semantic_entropies": "seed_semantic_entropy",
    "seed_advantage_scales": "seed_advantage_scale",
}


class RewardsLayout(BoundLayout):
    """One row per group: the ``[N]`` fields as ``list`` columns grouped like
    ``advantage.grouped`` (``rewards`` a struct with one such column per reward), the ``[P]``
    SEED fields as plain columns, the scalars (moments and the optional floats) in metadata.
    ``completion_metadata`` is stored once when it is ``pairs.metadata`` (the seed's aliasing,
    kept by ``from_arrow``)."""

    # The group table's columns that feed it (the column registry's `feeds`), but for the
    # raw rewards, a struct here (names and values there); then its own: the pairs, the
    # completion metadata.
    columns = {
        **{c: ("pairs",) for c in (*_PAIR_COLUMNS, "pairs_metadata")},
        **{c: (f,) for c, f in _STORED.items()},
        "rewards": ("per_reward_values",),
        "completion_metadata": ("completion_metadata", "pairs"),
    }
    # Fields read straight from one column: flattened when per completion.
    field_columns = {
        f: (c, R.column(c).level == "completion") for c, f in _STORED.items() if f not in _NESTED
    }

    shared_on_replace = frozenset({"advantage", "pairs", "q_distribution", "moments"})

    def __init__(self, advantage: type, pairs: type, q: type, moments: type):
        self.nested = {
            "advantage": advantage,
            "pairs": pairs,
            "q_distribution": q,
            "moments": moments,
        }

    def check(self, cls, batch, meta, given=()):
        name = self.name
        require(name, batch, "advantages", _FLOAT_LIST, "list<double>")
        require(name, batch, "q", _FLOAT_LIST, "list<double>")
        require(name, batch, "total_utils", _FLOAT_LIST, "list<double>")
        require(name, batch, "prompts", is_list_of(is_text), "list<string>")
        require(name, batch, "completions", is_list_of(is_text), "list<string>")
        rewards = require(name, batch, "rewards", is_struct, "struct<list<double>>", optional=True)
        for key in meta.get("reward_keys", []):
            if rewards is None or rewards.type.get_field_index(key) < 0:
                raise SchemaError(f"{name}.from_arrow: missing reward {key!r} in column 'rewards'")
        for column in ("pairs_metadata", "completion_metadata"):
            require(name, batch, column, is_list_of(is_struct), "list<struct>", optional=True)
        require(name, batch, "ref_meta", is_list_of(is_text), "list<string>", optional=True)
        for column in ("seed_semantic_entropy", "seed_advantage_scale"):
            require(name, batch, column, is_float, "double", optional=True)

    def field(self, obj, source, name, *, cache=True):
        column, meta = source.column, source.meta
        if name in ("advantage", "q_distribution"):
            array = column("advantages" if name == "advantage" else "q")
            assert array is not None  # check() required it
            cls = self.nested[name]
            grouped = cast(GroupedPairLayout, layout_of(cls))
            batch = make_batch(cls.__name__, {grouped.column: array}, {}, len(array))
            return born(cls, Source(batch, {}, source))
        if name == "pairs":
            return self._pairs(source)
        if name == "moments":
            mean, std = meta.get("moments", [None, None])
            return self.nested["moments"](mean=mean, std=std)
        if name == "total_utils":
            total_utils = column("total_utils")
            assert total_utils is not None  # check() required it
            return total_utils.flatten().to_pylist()
        if name == "per_reward_values":
            rewards = cast(pa.Array, column("rewards"))  # absent only without reward keys
            return {k: rewards.field(k).flatten().to_pylist() for k in meta.get("reward_keys", [])}
        if name == "ref_logprob_meta":
            ref = column("ref_meta")
            return None if ref is None else F.decode_json(ref.flatten())
        if name == "completion_metadata":
            if meta.get("completion_metadata_is_pairs_metadata"):
                if cache:
                    return obj.pairs.metadata
                return peek(peek(obj, "pairs"), "metadata")
            info = column("completion_metadata")
            return None if info is None else F.decode_info(info.flatten())
        if name in _SEED_COLUMNS:
            array = column(_SEED_COLUMNS[name])
            return None if array is None else array.to_pylist()
        return meta.get(name)

    def _pairs(self, source: Source):
        cls = self.nested["pairs"]
        columns = {}
        for own, theirs in zip(
            (*_PAIR_COLUMNS, "pairs_metadata"),
            ("prompt", "prompt_messages", "completion", "completion_messages", "metadata"),
        ):
            array = source.column(own)
            columns[theirs] = None if array is None else array.flatten()
        n = len(columns["prompt"])
        return born(cls, Source(make_batch(cls.__name__, columns, {}, n), {}, source))

    # ------------------------------------------------------------------ encode
    def _nested(self, obj, name: str) -> Any:
        value = obj.__dict__[name]
        kind = self.nested[name]
        if not isinstance(value, kind):
            raise SchemaError(
                f"{self.name}.{name}: expected {_article(kind.__name__)}, got "
                f"{type(value).__name__}"
            )
        return value

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name, state = self.name, obj.__dict__
        source = state.get(SOURCE)
        flat: dict[str, pa.Array | None] = {}

        # Groups: the advantages' list array gives the offsets of every [N] column.
        if lazy(obj, "advantage") is not None:
            advantages = source.column("advantages")
        else:
            advantage = self._nested(obj, "advantage")
            advantages = cast(GroupedPairLayout, layout_of(advantage)).grouped(advantage)
        if lazy(obj, "q_distribution") is not None:
            q = source.column("q")
        else:
            q_record = self._nested(obj, "q_distribution")
            q = cast(GroupedPairLayout, layout_of(q_record)).grouped(q_record)
        offsets = list_offsets(advantages)

        # Per-sample values, flat.
        if lazy(obj, "pairs") is not None:
            pairs = {c: _flat_or_none(source.column(c)) for c in _PAIR_COLUMNS}
            pairs_meta = _flat_or_none(source.column("pairs_metadata"))
        else:
            record = self._nested(obj, "pairs")
            own = cast(PairsLayout, layout_of(record)).flat_columns(record)
            pairs = dict(zip(_PAIR_COLUMNS, (plain_text(own["prompt"]), own["prompt_messages"])))
            pairs["completions"] = own["completion"]
            pairs["completion_messages"] = own["completion_messages"]
            pairs_meta = own["metadata"]
        flat["total_utils"] = self._flat_field(obj, "total_utils", "total_utils", F.float_array)
        flat["ref_meta"] = self._flat_field(obj, "ref_logprob_meta", "ref_meta", F.json_array)
        shared, completion_meta = self._completion_meta(obj, source)
        rewards, keys = self._rewards(obj, source)
        total_utils = flat["total_utils"]
        assert total_utils is not None  # a required field
        n = len(total_utils)
        per_sample = {
            "advantage.samples": advantages.flatten(),
            "q_distribution.samples": q.flatten(),
            "pairs.prompts": pairs["prompts"],
            "ref_logprob_meta": flat["ref_meta"],
            "completion_metadata": completion_meta,
            **{f"per_reward_values[{k!r}]": v for k, v in rewards.items()},
        }
        for field, value in per_sample.items():
            if value is not None and len(value) != n:
                raise LayoutError(
                    f"{name}.{field}: expected {n} values (one per sample, as total_utils), got "
                    f"{len(value)}"
                )
        same_groups(name, "advantage.grouped", advantages, {"q_distribution.grouped": q})
        groups = len(advantages)
        seeds = {}
        for field, column in _SEED_COLUMNS.items():
            if lazy(obj, field) is not None:
                seeds[column] = source.column(column)
            else:
                value = state[field]
                seeds[column] = None if value is None else F.float_array(f"{name}.{field}", value)
            if seeds[column] is not None and len(seeds[column]) != groups:
                raise LayoutError(
                    f"{name}.{field}: expected {groups} values (one per group), got "
                    f"{len(seeds[column])}"
                )

        def by_group(array):
            return None if array is None else F.grouped(array, offsets)

        columns = {
            **{c: by_group(pairs[c]) for c in _PAIR_COLUMNS},
            "pairs_metadata": by_group(pairs_meta),
            **{c: by_group(flat[c]) for c in _FLAT},
            "rewards": (
                pa.StructArray.from_arrays([by_group(v) for v in rewards.values()], names=keys)
                if keys
                else None
            ),
            "advantages": advantages,
            "q": q,
            "completion_metadata": None if shared else by_group(completion_meta),
            **seeds,
        }
        if source is not None and np.array_equal(
            offsets, list_offsets(source.column("advantages"))
        ):
            # Same groups as the source: the untouched fields' grouped columns as they are.
            for column, fields in self.columns.items():
                kept = all(f not in state or untouched_from(state[f], source) for f in fields)
                if columns.get(column) is not None and kept:
                    columns[column] = source.column(column)
        scalars = {
            "moments": self._moments(obj, source),
            "reward_keys": keys,
            "completion_metadata_is_pairs_metadata": shared,
        }
        for field in _SCALARS:
            if (field_source := lazy(obj, field)) is not None:
                scalars[field] = field_source.meta.get(field)
            else:
                scalars[field] = scalar(f"{name}.{field}", state[field], optional=True)
        return make_batch(name, columns, scalars, groups)

    def _flat_field(self, obj, field: str, column: str, encode) -> pa.Array | None:
        source = lazy(obj, field)
        if source is not None:
            return _flat_or_none(source.column(column))
        value = obj.__dict__[field]
        return None if value is None else encode(f"{self.name}.{field}", value)

    def _completion_meta(self, obj, source: Source | None) -> tuple[bool, pa.Array | None]:
        """(whether it is ``pairs.metadata``, its values when stored on their own)."""
        if (lazy_source := lazy(obj, "completion_metadata")) is not None and lazy_source.meta.get(
            "completion_metadata_is_pairs_metadata"
        ):
            return True, None  # read, it would be pairs.metadata, whatever pairs holds now
        if lazy_source is not None:
            return False, _flat_or_none(lazy_source.column("completion_metadata"))
        value = obj.__dict__["completion_metadata"]
        if value is None:
            return False, None
        pairs = obj.__dict__.get("pairs")
        if pairs is not None and pairs.__dict__.get("metadata", None) is value:
            return True, None
        return False, F.info_array(f"{self.name}.completion_metadata", value)

    def _rewards(self, obj, source: Source | None) -> tuple[dict[str, pa.Array], list[str]]:
        if (lazy_source := lazy(obj, "per_reward_values")) is not None:
            keys = list(lazy_source.meta.get("reward_keys", []))
            column = cast(pa.Array, lazy_source.column("rewards"))  # absent only without keys
            return {k: column.field(k).flatten() for k in keys}, keys
        value = obj.__dict__["per_reward_values"]
        field = f"{self.name}.per_reward_values"
        if not isinstance(value, dict):
            raise SchemaError(f"{field}: expected a dict of lists, got {type(value).__name__}")
        out = {}
        for key, column in value.items():
            if not isinstance(key, str):
                raise SchemaError(f"{field}: expected str keys, got {key!r}")
            out[key] = F.float_array(f"{field}[{key!r}]", column)
        return out, list(out)

    def _moments(self, obj, source: Source | None) -> list:
        if (lazy_source := lazy(obj, "moments")) is not None:
            return lazy_source.meta.get("moments", [None, None])
        moments = self._nested(obj, "moments")
        owner = f"{self.name}.moments"
        return [scalar(f"{owner}.{n}", peek(moments, n)) for n in ("mean", "std")]


def _flat_or_none(array: pa.Array | None) -> pa.Array | None:
    return None if array is None else array.flatten()


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "AEIOU" else f"a {name}"


# ---------------------------------------------------------------------------- builders
@dataclass(frozen=True, kw_only=True)
class SampleColumns:
    """The per-completion columns of a ``RewardComputation`` batch, each flat ``[N]`` in group
    order (:func:`rewards_batch` regroups them by the advantages' offsets, without copying
    their values).

    ``prompts`` / ``completions`` (with ``prompt_messages`` / ``completion_messages`` where
    the pairs are chats, and ``pairs_metadata``) are ``pairs``; ``rewards`` maps each reward's
    name to its values; ``completion_metadata_is_pairs_metadata`` stores the seed's aliasing
    (``completion_metadata`` is ``pairs.metadata``) once instead of a second column.
    """

    total_utils: pa.Array
    prompts: pa.Array
    completions: pa.Array
    rewards: Mapping[str, pa.Array] = dataclasses.field(default_factory=dict)
    prompt_messages: pa.Array | None = None
    completion_messages: pa.Array | None = None
    pairs_metadata: pa.Array | None = None
    ref_meta: pa.Array | None = None
    completion_metadata: pa.Array | None = None
    completion_metadata_is_pairs_metadata: bool = False


@dataclass(frozen=True, kw_only=True)
class SeedColumns:
    """SEED-GRPO's results in a ``RewardComputation`` batch: the ``[P]`` group columns
    ``seed_semantic_entropies`` / ``seed_advantage_scales`` (one value per group, not
    regrouped) and the two scalars."""

    semantic_entropy: pa.Array | None = None
    advantage_scale: pa.Array | None = None
    alpha_effective: float | None = None
    max_possible_entropy: float | None = None


def rewards_batch(
    *,
    advantages: pa.Array,
    q: pa.Array,
    samples: SampleColumns,
    moments: tuple[float | None, float | None] = (None, None),
    entropy_bonus_scale: float | None = None,
    seed: SeedColumns | None = None,
) -> pa.RecordBatch:
    """A ``RewardComputation`` record batch from Arrow columns (no Python values made), for
    ``RewardComputation.from_arrow``: how the reward step and the rollout batch give their
    results back lazily.

    ``advantages`` and ``q`` are ``list<double>`` by group; ``samples`` the flat ``[N]``
    columns (:class:`SampleColumns`), regrouped by the advantages' offsets; ``seed`` the
    SEED-GRPO results, if any (:class:`SeedColumns`).
    """
    offsets = list_offsets(advantages)

    def by_group(array: pa.Array | None) -> pa.Array | None:
        return None if array is None else F.grouped(array, offsets)

    s, seed = samples, seed or SeedColumns()
    rewards = dict(s.rewards)
    pairs = (s.prompts, s.prompt_messages, s.completions, s.completion_messages)
    columns = {c: by_group(v) for c, v in zip(_PAIR_COLUMNS, pairs)}
    columns["pairs_metadata"] = by_group(s.pairs_metadata)
    columns["total_utils"] = by_group(s.total_utils)
    columns["rewards"] = (
        pa.StructArray.from_arrays([by_group(v) for v in rewards.values()], names=list(rewards))
        if rewards
        else None
    )
    columns["advantages"], columns["q"] = advantages, q
    columns["ref_meta"] = by_group(s.ref_meta)
    shared = s.completion_metadata_is_pairs_metadata
    columns["completion_metadata"] = None if shared else by_group(s.completion_metadata)
    # The SEED-GRPO group columns ([P] values, not regrouped).
    columns["seed_semantic_entropy"] = seed.semantic_entropy
    columns["seed_advantage_scale"] = seed.advantage_scale
    scalars = {
        "moments": list(moments),
        "reward_keys": list(rewards),
        "completion_metadata_is_pairs_metadata": shared,
        "entropy_bonus_scale": entropy_bonus_scale,
        "seed_alpha_effective": seed.alpha_effective,
        "seed_max_possible_entropy": seed.max_possible_entropy,
    }
    return make_batch("RewardComputation", columns, scalars, len(advantages))
