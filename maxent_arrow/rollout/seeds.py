"""The seed objects of a :class:`~maxent_arrow.rollout.RolloutBatch`, Arrow-born.

Each function builds the record batch of one seed class (its ``to_arrow()`` layout) from the
group rows and the step row, mostly by taking columns as they are, and returns
``Class.from_arrow(batch)``: nothing is decoded into Python until a field is read, the
record's ``column()`` / ``ragged()`` / ``tensor()`` view the group rows' buffers, and an
untouched record's ``to_arrow()`` is that batch (O(1)).

No torch at import: the seed classes are reached through :mod:`maxent_arrow.types` at call
time; the reference statistics import torch when they are asked for (they are tensors).
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol, cast

import numpy as np
import pyarrow as pa

from maxent_arrow import arrow as A
from maxent_arrow import types as T
from maxent_arrow.arrow import list_offsets, regroup, single_array
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.rollout.checks import BATCH_META_KEY, rewards_by_name


class RolloutBatch(Protocol):
    """What the builders here read of a :class:`~maxent_arrow.rollout.RolloutBatch` (a
    protocol, so that this module does not import the batch module that uses it)."""

    groups: pa.RecordBatch
    step_row: pa.RecordBatch

    @property
    def num_groups(self) -> int: ...

    @property
    def group_offsets(self) -> np.ndarray: ...

    def column(self, name: str) -> pa.Array | None: ...

    def ragged(self, name: str) -> Any: ...


__all__ = [
    "diagnostics",
    "generation_batch",
    "length_stats",
    "loss_scalars",
    "reference_logprobs",
    "reward_computation",
]

# The step-row scalars each seed record is read back from (the column registry's `feeds`).
LENGTH_FIELDS = R.feeding("LengthStats", R.STEP)
LOSS_FIELDS = R.feeding("LossScalarBundle", R.STEP)
DIAGNOSTIC_FIELDS = tuple(
    n for n in R.feeding("BatchDiagnostics", R.STEP) if n not in S.BUCKET_COLUMNS
)
# Generation columns whose nulls are values (a chat row has no text prompt); the others are
# absent when null in every row.
_NULLS_KEPT = ("prompt", "answer", "completions")


def batch_meta(batch: RolloutBatch) -> dict[str, Any]:
    raw = (batch.groups.schema.metadata or {}).get(BATCH_META_KEY)
    return json.loads(raw) if raw else {}


def _raw(batch: RolloutBatch, name: str) -> pa.Array | None:
    """A group column as stored (nulls kept), or ``None`` when absent."""
    if name not in batch.groups.schema.names:
        return None
    return single_array(batch.groups.column(name))


def _scalar(batch: RolloutBatch, name: str) -> Any:
    row = batch.step_row
    if name not in row.schema.names:
        return None
    return row.column(name)[0].as_py()


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def completion_info(batch: RolloutBatch) -> pa.Array | None:
    """The ``completion_info`` column, with the ``token_ids`` put back from
    ``completion_ids`` when they came from the completion info (as given)."""
    info = batch.column("completion_info")
    if info is None or not batch_meta(batch).get("info_token_ids"):
        return info
    ids = batch.column("completion_ids")
    if ids is None:
        return info
    flat = info.flatten()
    names = [f.name for f in flat.type]
    arrays = [flat.field(i) for i in range(len(names))]
    at = names.index("extra") if "extra" in names else len(names)
    names.insert(at, "token_ids")
    arrays.insert(at, ids.flatten())
    struct = pa.StructArray.from_arrays(arrays, names=names, mask=flat.is_null())
    return regroup(struct, list_offsets(info))


def _flat(column: pa.Array | None) -> pa.Array | None:
    return None if column is None else column.flatten()


def _record_batch(columns: dict[str, pa.Array | None]) -> pa.RecordBatch:
    present = {k: v for k, v in columns.items() if v is not None}
    return pa.RecordBatch.from_arrays(list(present.values()), names=list(present))


# ---------------------------------------------------------------------------- generation
def generation_batch(batch: RolloutBatch):
    """Prompts, answers, grouped completions, ref meta and completion info."""
    columns = {
        name: _raw(batch, name) if name in _NULLS_KEPT else batch.column(name)
        for name in R.feeding("GenerationBatch")
    }
    columns["completion_info"] = completion_info(batch)
    if columns["answer"] is None:
        columns["answer"] = pa.nulls(batch.num_groups, pa.string())
    return T.GenerationBatch.from_arrow(_record_batch(columns))


# ---------------------------------------------------------------------------- rewards
def reward_computation(batch: RolloutBatch):
    """Utilities, per-reward values, advantages, q and moments; ``None`` if not stored.

    ``pairs.prompts`` is a dictionary over the group prompts (no string copies);
    ``pairs.metadata`` and ``completion_metadata`` are the flattened completion info (one
    object, as in the seed).
    """
    advantages, q = batch.column("advantages"), batch.column("q")
    if advantages is None or q is None:
        return None
    offsets = batch.group_offsets
    sizes = np.diff(offsets)
    group_of = pa.array(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    prompt_messages = batch.column("prompt_messages")
    info = completion_info(batch)
    rewards = {name: pa.array(values) for name, values in rewards_by_name(batch.groups).items()}
    samples = T.SampleColumns(
        total_utils=_flat(batch.column("total_utils")),
        prompts=pa.DictionaryArray.from_arrays(group_of, _raw(batch, "prompt")),
        completions=cast(pa.Array, _raw(batch, "completions")).flatten(),  # a required column
        rewards=rewards,
        prompt_messages=None if prompt_messages is None else prompt_messages.take(group_of),
        completion_messages=T.sample_messages(batch.column("completion_messages"), offsets),
        pairs_metadata=_flat(info),
        ref_meta=_flat(batch.column("ref_meta")),
        completion_metadata_is_pairs_metadata=info is not None,
    )
    seed = T.SeedColumns(
        semantic_entropy=batch.column("seed_semantic_entropy"),
        advantage_scale=batch.column("seed_advantage_scale"),
        alpha_effective=_scalar(batch, "seed_alpha_effective"),
        max_possible_entropy=_scalar(batch, "seed_max_possible_entropy"),
    )
    source = T.rewards_batch(
        advantages=advantages,
        q=q,
        samples=samples,
        moments=(
            _nan_if_none(_scalar(batch, "reward_mean")),
            _nan_if_none(_scalar(batch, "reward_std")),
        ),
        entropy_bonus_scale=_scalar(batch, "entropy_bonus_scale"),
        seed=seed,
    )
    return T.RewardComputation.from_arrow(source)


# ---------------------------------------------------------------------------- reference
def reference_logprobs(batch: RolloutBatch):
    """Reference statistics from R_i and T_i (``ref_logp_sum`` = R / max(T, 1)), in the dtypes
    and kinds given to ``from_parts``; per-token values padded back with their mask."""
    raw_col = batch.column("ref_logp_sum_raw")
    counts_col = batch.column("ref_tok_counts")
    if raw_col is None or counts_col is None:
        return None
    import torch  # deferred: the batch is Arrow; torch only for the values computed here

    meta = batch_meta(batch)
    dtypes = meta.get("dtypes", {})

    def torch_dtype(name: str | None):
        return None if name is None else getattr(torch, name)

    def to(tensor, name):
        target = torch_dtype(name)
        return tensor if target is None or tensor.dtype == target else tensor.to(target)

    raw = to(A.arrow_to_torch(raw_col.flatten()), dtypes.get("ref_logp_sum_raw"))
    counts = to(A.arrow_to_torch(counts_col.flatten()), dtypes.get("ref_tok_counts", "float32"))
    mean = (raw.double() / counts.double().clamp(min=1)).to(
        torch_dtype(dtypes.get("ref_logp_sum", "float32"))
    )
    per_token = batch.column("ref_token_logp")
    source = T.reference_batch(
        ref_logp_sum=A.torch_to_arrow(mean),
        ref_tok_counts=A.torch_to_arrow(counts),
        ref_logp_sum_raw=A.torch_to_arrow(raw),
        ref_logp_mean=_nan_if_none(_scalar(batch, "ref_logp_mean")),
        avg_completion_tokens=_nan_if_none(_scalar(batch, "avg_completion_tokens")),
        ref_token_logp=None if per_token is None else per_token.flatten(),
        given=T.GivenForm(
            dtypes={
                "ref_logp_sum": str(mean.dtype).removeprefix("torch."),
                "ref_tok_counts": str(counts.dtype).removeprefix("torch."),
                "ref_logp_sum_raw": str(raw.dtype).removeprefix("torch."),
                "ref_token_logp": dtypes.get("ref_token_logp"),
                "ref_token_mask": dtypes.get("ref_token_mask", "int64"),
            },
            kinds=meta.get("kinds", {}),
            width=meta.get("widths", {}).get("ref_token_logp"),
            has_mask=per_token is not None and meta.get("has_ref_mask", True),
        ),
    )
    return T.ReferenceLogprobs.from_arrow(source)


# ---------------------------------------------------------------------------- step scalars
def _one_row(values: dict[str, Any], types: dict[str, pa.DataType] | None = None):
    types = types or {}
    return pa.RecordBatch.from_arrays(
        [pa.array([v], types.get(k, pa.float64())) for k, v in values.items()],
        names=list(values),
    )


def length_stats(batch: RolloutBatch):
    values = {name: _scalar(batch, name) for name in LENGTH_FIELDS}
    if any(values[name] is None for name in LENGTH_FIELDS[:4]):
        return None
    # Stored NULL (no completion terminated) is the seed record's 0.0 (the original's).
    return T.LengthStats.from_arrow(_one_row({k: v or 0.0 for k, v in values.items()}))


def loss_scalars(batch: RolloutBatch):
    values = {name: _scalar(batch, name) for name in LOSS_FIELDS}
    if any(values[n] is None for n in LOSS_FIELDS if n != "clip_loss"):
        return None
    return T.LossScalarBundle.from_arrow(_one_row(values))


def diagnostics(batch: RolloutBatch):
    values = {name: _scalar(batch, name) for name in (*DIAGNOSTIC_FIELDS, *S.BUCKET_COLUMNS)}
    if any(values[n] is None for n in values if n != "kl_value"):
        return None
    labels = _scalar(batch, "kl_length_buckets") or []
    bucket = pa.map_(pa.string(), pa.float64())
    for name in S.BUCKET_COLUMNS:
        values[name] = list(zip(labels, values[name]))
    return T.BatchDiagnostics.from_arrow(
        _one_row(values, {name: bucket for name in S.BUCKET_COLUMNS})
    )
