"""``RolloutBatch``: one step of one rank, as a group record batch plus its step row.

The group batch has one row per prompt group in the v1 group layout of
:mod:`maxent_arrow.schema` (per-completion values as ``list<T>``, per-token values as
``list<list<T>>``); the step row is a one-row batch in the step layout (reward moments, length
stats, reference summaries, loss scalars, diagnostics and the run config as JSON).

``from_parts`` assembles a batch from the seed objects of one training step without copying
the per-token bytes (flat ``[N]`` columns are regrouped by the group offsets, which only adds
an offsets buffer); the properties give the seed objects back as views of the same buffers.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow import schema as S
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ragged import Ragged, arrow_to_torch, list_offsets
from maxent_arrow.types import rewards as R
from maxent_arrow.views import ArrowSequence, GroupedSequence, InfoSequence, JsonSequence

__all__ = ["RolloutBatch", "BATCH_META_KEY", "STEP_META_KEY", "KINDS_PATTERN"]

# Groups-batch metadata (JSON): tensor dtypes and flags needed to give the seed objects back
# exactly as they were given; it travels in the Parquet and IPC schema metadata.
BATCH_META_KEY = b"maxent_arrow.batch"
# The step row of a batch, as JSON, in the metadata of ``to_arrow()``'s table.
STEP_META_KEY = b"maxent_arrow.step_row"
KINDS_PATTERN = r"[a-z][a-z0-9_]{0,31}"

_GROUP_TYPES = {f.name: f.type for f in S.group_schema()}
_STEP_TYPES = {f.name: f.type for f in S.step_schema()}
_LENGTH_FIELDS = [f.name for f in dataclasses.fields(R.LengthStats)]
_LOSS_FIELDS = [f.name for f in dataclasses.fields(R.LossScalarBundle)]
_DIAG_FIELDS = [f.name for f in dataclasses.fields(R.BatchDiagnostics)]


def _list_type(kind: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", kind, nullable=False))


def _regroup(flat: pa.Array, offsets: np.ndarray) -> pa.Array:
    """A list array over ``flat`` (no copy of ``flat``) with the given int64 offsets."""
    if isinstance(flat, pa.ChunkedArray):
        flat = flat.combine_chunks()
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)


def _combined(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


def _cast(name: str, array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type == target:
        return array
    try:
        return array.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise SchemaError(
            f"RolloutBatch column {name!r}: expected {target}, got {array.type}"
        ) from (exc)


def _json_config(config: Mapping[str, Any] | None) -> str:
    if config is None:
        return "{}"
    if not isinstance(config, Mapping):
        raise SchemaError(f"RolloutBatch.config: expected a dict, got {type(config).__name__}")
    try:
        return json.dumps(dict(config), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"RolloutBatch.config: expected JSON-serialisable values ({exc})"
        ) from None


def _int_arg(name: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SchemaError(f"RolloutBatch.{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise LayoutError(f"RolloutBatch.{name}: expected >= {minimum}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------- step row JSON
def step_row_to_json(row: pa.RecordBatch) -> str:
    """The one-row step batch as JSON text (maps as objects, timestamps as ISO strings)."""
    item = row.to_pylist()[0]
    for name, value in item.items():
        if isinstance(value, dt.datetime):
            item[name] = value.isoformat()
        elif isinstance(value, list) and value and isinstance(value[0], tuple):
            item[name] = dict(value)
        elif isinstance(value, float) and not math.isfinite(value):
            item[name] = repr(value)  # JSON has no NaN; "nan"/"inf" round-trip via float()
    return json.dumps(item, sort_keys=True)


def step_row_from_json(text: str | bytes) -> pa.RecordBatch:
    item = json.loads(text)
    fields = []
    values = {}
    for name, value in item.items():
        kind = _STEP_TYPES.get(name)
        if kind is None:
            continue
        if pa.types.is_timestamp(kind) and isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        elif pa.types.is_map(kind) and isinstance(value, dict):
            value = list(value.items())
        elif pa.types.is_floating(kind) and isinstance(value, str):
            value = float(value)
        fields.append(pa.field(name, kind, nullable=name not in S.STEP_REQUIRED))
        values[name] = [value]
    order = [f for f in S.step_schema() if f.name in values]
    schema = pa.schema([f for f in order])
    return pa.RecordBatch.from_pydict({f.name: values[f.name] for f in order}, schema=schema)


class RolloutBatch:
    """One step of one rank: a group record batch (``.groups``) and its step row (``.step_row``).

    Parameters
    ----------
    groups:
        One row per prompt group in the v1 group layout (a subset of its columns; unknown
        extra columns are kept). Known columns are cast to their schema types.
    step_row:
        One row in the step layout; ``num_groups`` and ``num_samples`` must match ``groups``.
    validate:
        Check the layout (required columns, one step and rank, every per-completion column
        grouped like ``completions``, no nulls inside lists). Costs O(groups) plus a null count
        per column; the store skips it for data it verified when appending.
    """

    __slots__ = ("groups", "step_row", "cursor")

    def __init__(
        self,
        groups: pa.RecordBatch | pa.Table,
        step_row: pa.RecordBatch | pa.Table,
        *,
        validate: bool = True,
    ):
        if isinstance(groups, pa.Table):
            groups = (
                groups.combine_chunks().to_batches()[0]
                if groups.num_rows
                else (pa.RecordBatch.from_pylist([], schema=groups.schema))
            )
        if isinstance(step_row, pa.Table):
            step_row = step_row.combine_chunks().to_batches()[0]
        if not isinstance(groups, pa.RecordBatch) or not isinstance(step_row, pa.RecordBatch):
            raise SchemaError(
                "RolloutBatch: expected pyarrow RecordBatch or Table for groups and step_row, "
                f"got {type(groups).__name__} and {type(step_row).__name__}"
            )
        if validate:
            from maxent_arrow.batch_assembly import normalise

            groups, step_row = normalise(groups, step_row)
        self.groups = groups
        self.step_row = step_row
        # The replay position after this batch (set by RolloutStore.replay), for resuming.
        self.cursor: Any = None

    # ------------------------------------------------------------------ identity
    def _scalar(self, name: str) -> Any:
        if name not in self.step_row.schema.names:
            return None
        return self.step_row.column(name)[0].as_py()

    @property
    def step(self) -> int:
        return int(self._scalar("step"))

    @property
    def rank(self) -> int:
        return int(self._scalar("rank"))

    @property
    def kind(self) -> str:
        return str(self._scalar("kind"))

    @property
    def num_groups(self) -> int:
        return self.groups.num_rows

    @property
    def num_samples(self) -> int:
        return int(self._scalar("num_samples"))

    @property
    def config(self) -> dict[str, Any]:
        """The run config snapshot of this step (parsed from the JSON ``config`` column)."""
        text = self._scalar("config")
        return json.loads(text) if text else {}

    @property
    def group_offsets(self) -> np.ndarray:
        """Where each group's completions start and end in the flat ``[N]`` order (int64)."""
        return list_offsets(_combined(self.groups.column("completions")))

    def _meta(self) -> dict[str, Any]:
        raw = (self.groups.schema.metadata or {}).get(BATCH_META_KEY)
        return json.loads(raw) if raw else {}

    def column(self, name: str) -> pa.Array | None:
        """Column ``name`` of the groups, or ``None`` when absent or null in every group (a
        column that only other steps of a merged file have)."""
        if name not in self.groups.schema.names:
            return None
        column = _combined(self.groups.column(name))
        if len(column) and column.null_count == len(column):
            return None
        return column

    def __repr__(self) -> str:
        return (
            f"RolloutBatch(step={self.step}, rank={self.rank}, kind={self.kind!r}, "
            f"groups={self.num_groups}, samples={self.num_samples}, "
            f"columns={len(self.groups.schema)})"
        )

    def __len__(self) -> int:
        return self.num_groups

    def equals(self, other: RolloutBatch) -> bool:
        """Same group rows and same step row (``created_at`` included)."""
        return self.groups.equals(other.groups) and self.step_row.equals(other.step_row)

    # ------------------------------------------------------------------ Arrow
    def to_arrow(self) -> pa.Table:
        """The group rows as a table; the step row rides in the schema metadata as JSON."""
        meta = dict(self.groups.schema.metadata or {})
        meta[STEP_META_KEY] = step_row_to_json(self.step_row).encode()
        return pa.Table.from_batches([self.groups]).replace_schema_metadata(meta)

    @classmethod
    def from_arrow(cls, table: pa.Table | pa.RecordBatch) -> RolloutBatch:
        """Rebuild from :meth:`to_arrow` output (also after a Parquet or IPC round trip)."""
        raw = (table.schema.metadata or {}).get(STEP_META_KEY)
        if raw is None:
            raise SchemaError(
                "RolloutBatch.from_arrow: no step row in the schema metadata "
                f"(key {STEP_META_KEY.decode()!r}); was it written by RolloutBatch.to_arrow?"
            )
        meta = {k: v for k, v in table.schema.metadata.items() if k != STEP_META_KEY}
        table = table.replace_schema_metadata(meta)
        return cls(table, step_row_from_json(raw))

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        """The Arrow PyCapsule stream protocol: DuckDB, Polars and pyarrow read the groups."""
        return self.to_arrow().__arrow_c_stream__(requested_schema)

    # ------------------------------------------------------------------ seed objects
    @property
    def generation_batch(self) -> R.GenerationBatch:
        """Prompts, answers, grouped completions, ref meta and completion info (views)."""
        info = self.column("completion_info")
        if info is not None and self._meta().get("info_token_ids"):
            info = _info_with_token_ids(info, self.column("completion_ids"))
        ref_meta = self.column("ref_meta")
        return R.GenerationBatch(
            prompts=ArrowSequence(self.column("prompt")),
            answers=ArrowSequence(self.column("answer")),
            grouped_completions=GroupedSequence(self.column("completions")),
            grouped_ref_meta=None if ref_meta is None else GroupedSequence(ref_meta, JsonSequence),
            grouped_completion_info=None if info is None else GroupedSequence(info, InfoSequence),
        )

    def _flat(self, name: str) -> pa.Array | None:
        column = self.column(name)
        return None if column is None else column.flatten()

    @property
    def reward_computation(self) -> R.RewardComputation | None:
        """Utilities, per-reward values, advantages, q and moments; ``None`` if not stored.

        ``pairs.prompts`` is a dictionary array over the group prompts (no string copies);
        ``pairs.metadata`` and ``completion_metadata`` are the flattened completion info.
        """
        if self.column("advantages") is None or self.column("q") is None:
            return None
        offsets = self.group_offsets
        sizes = np.diff(offsets)
        group_of = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        prompts = pa.DictionaryArray.from_arrays(pa.array(group_of), self.column("prompt"))
        info = self._flat("completion_info")
        metadata = None if info is None else InfoSequence(info)
        rewards = self.column("rewards")
        per_reward = {}
        if rewards is not None:
            for i, field in enumerate(rewards.type):
                values = rewards.field(i)
                if len(values) and values.null_count == len(values):
                    continue  # a reward function added after this step
                per_reward[field.name] = ArrowSequence(values.flatten())
        advantages = GroupedSequence(self.column("advantages"))
        q = GroupedSequence(self.column("q"))
        ref_meta = self._flat("ref_meta")
        entropies = self.column("seed_semantic_entropy")
        scales = self.column("seed_advantage_scale")
        total = self._flat("total_utils")
        return R.RewardComputation(
            total_utils=ArrowSequence(total),
            per_reward_values=per_reward,
            advantage=R.AdvantageStats(grouped=advantages, samples=advantages.samples),
            pairs=R.PromptCompletionBatch(
                prompts=ArrowSequence(prompts),
                completions=ArrowSequence(self._flat("completions")),
                metadata=metadata,
            ),
            q_distribution=R.QDistribution(grouped=q, samples=q.samples),
            moments=R.RewardMoments(
                mean=_nan_if_none(self._scalar("reward_mean")),
                std=_nan_if_none(self._scalar("reward_std")),
            ),
            ref_logprob_meta=None if ref_meta is None else JsonSequence(ref_meta),
            completion_metadata=metadata,
            entropy_bonus_scale=self._scalar("entropy_bonus_scale"),
            seed_semantic_entropies=None if entropies is None else ArrowSequence(entropies),
            seed_advantage_scales=None if scales is None else ArrowSequence(scales),
            seed_alpha_effective=self._scalar("seed_alpha_effective"),
            seed_max_possible_entropy=self._scalar("seed_max_possible_entropy"),
        )

    def ragged(self, name: str) -> Ragged | None:
        """A per-completion (``[N]``) or per-token column's innermost values as :class:`Ragged`.

        For a per-token column the rows are the N completions (one row of tokens each); for a
        per-completion column the rows are the groups.
        """
        column = self.column(name)
        if column is None:
            return None
        if pa.types.is_list(column.type.value_type):
            column = column.flatten()
        return Ragged.from_arrow(column)

    @property
    def reference_logprobs(self) -> R.ReferenceLogprobs | None:
        """Reference statistics rebuilt from R_i and T_i (``ref_logp_sum`` = R / max(T, 1)).

        Per-token values come back right-padded with 0 to the longest completion, with the
        mask. Tensor dtypes are the ones given to ``from_parts``.
        """
        raw = self._flat("ref_logp_sum_raw")
        counts = self._flat("ref_tok_counts")
        if raw is None or counts is None:
            return None
        dtypes = self._meta().get("dtypes", {})
        raw_t = _to_dtype(arrow_to_torch(raw), dtypes.get("ref_logp_sum_raw"))
        counts_t = _to_dtype(arrow_to_torch(counts), dtypes.get("ref_tok_counts", "float32"))
        mean_t = (raw_t.double() / counts_t.double().clamp(min=1)).to(
            getattr(torch, dtypes.get("ref_logp_sum", "float32"))
        )
        token_logp = mask = None
        per_token = self.ragged("ref_token_logp")
        if per_token is not None:
            width = self._meta().get("widths", {}).get("ref_token_logp")
            token_logp, mask = per_token.to_padded(
                0.0, max_len=width, dtype=_torch_dtype(dtypes.get("ref_token_logp"))
            )
            mask = mask.to(_torch_dtype(dtypes.get("ref_token_mask", "int64")))
            if not self._meta().get("has_ref_mask", True):
                mask = None
        return R.ReferenceLogprobs(
            ref_logp_sum=mean_t,
            ref_tok_counts=counts_t,
            ref_logp_sum_raw=raw_t,
            ref_logp_mean=_nan_if_none(self._scalar("ref_logp_mean")),
            avg_completion_tokens=_nan_if_none(self._scalar("avg_completion_tokens")),
            ref_token_logp=token_logp,
            ref_token_mask=mask,
        )

    @property
    def length_stats(self) -> R.LengthStats | None:
        values = {name: self._scalar(name) for name in _LENGTH_FIELDS}
        if any(v is None for v in values.values()):
            return None
        return R.LengthStats(**values)

    @property
    def loss_scalars(self) -> R.LossScalarBundle | None:
        values = {name: self._scalar(name) for name in _LOSS_FIELDS}
        if any(values[n] is None for n in _LOSS_FIELDS if n != "clip_loss"):
            return None
        return R.LossScalarBundle(**values)

    @property
    def diagnostics(self) -> R.BatchDiagnostics | None:
        values = {name: self._scalar(name) for name in _DIAG_FIELDS}
        if any(values[n] is None for n in _DIAG_FIELDS if n != "kl_value"):
            return None
        for name in ("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket"):
            values[name] = dict(values[name])
        return R.BatchDiagnostics(**values)

    def score_batch(
        self,
        *,
        pad_token_id: int | None = None,
        max_prompt_len: int | None = None,
        slice_size: int | None = None,
        score_tail_tokens: int | None = None,
    ) -> R.ScoreBatch:
        """The scoring inputs of the stored samples, through :func:`~maxent_arrow.ingest.
        build_score_batch` (the one ScoreBatch builder): prompt ids per sample and right-padded
        completion ids in one vectorised pass. Defaults come from the config (``pad_token_id``,
        ``max_prompt_len``); ``slice_size`` defaults to N.
        """
        from maxent_arrow.ingest import build_score_batch

        if self.column("prompt_ids") is None or self.column("completion_ids") is None:
            raise LayoutError(
                "RolloutBatch.score_batch: the batch has no prompt_ids/completion_ids columns"
            )
        config = self.config
        if pad_token_id is None:
            pad_token_id = config.get("pad_token_id", 0)
        sizes = np.diff(list_offsets(self.column("prompt_ids")))
        if max_prompt_len is None:
            max_prompt_len = config.get("max_prompt_len", int(sizes.max(initial=1)))
        # The stored completion ids are exactly the scored tokens, so no EOS cut is redone.
        return build_score_batch(
            self,
            pad_token_id=pad_token_id
            if pad_token_id is not None
            else config.get("pad_token_id", 0),
            max_prompt_len=int(max_prompt_len),
            slice_size=int(slice_size or 0),
            score_tail_tokens=score_tail_tokens,
            eos_token_id=None,
        )

    # ------------------------------------------------------------------ assembly
    @classmethod
    def from_parts(
        cls,
        step: int,
        *,
        generation: R.GenerationBatch,
        rewards: R.RewardComputation | None = None,
        score_batch: R.ScoreBatch | None = None,
        reference: R.ReferenceLogprobs | None = None,
        scores: R.SequenceScores | None = None,
        length_stats: R.LengthStats | None = None,
        loss: R.LossOutputs | R.LossScalarBundle | None = None,
        diagnostics: R.BatchDiagnostics | None = None,
        weights: Any = None,
        rank: int = 0,
        kind: str = "train",
        config: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
        behavior_token_logp: Any = None,
    ) -> RolloutBatch:
        """Assemble one step of one rank from the seed objects.

        Parameters
        ----------
        step, rank, kind:
            Where the batch belongs (``kind`` is ``"train"``, ``"eval"`` or another lowercase
            name).
        generation:
            The groups: prompts, answers, completions, ref meta and completion info. Token ids
            found in the completion info (``token_ids``) become ``completion_ids`` unless
            ``score_batch`` gives them.
        rewards, reference, scores, weights:
            Per-sample ``[N]`` values (flat, in group order); each is regrouped by the
            generation's group sizes, which must match (checked, with the group named).
            ``scores`` contributes the behaviour log-probs (``behavior_logp_sum``,
            ``old_token_logp`` as ``behavior_token_logp``) and ``policy_entropy_sum``.
        behavior_token_logp:
            The sampler's per-token log-probs, one row per completion covering every generated
            token (a ``Ragged`` or a ``list<float>`` array, flat in group order); stored instead
            of ``scores.old_token_logp``, which covers only the scored tokens (they differ with
            ``score_tail_tokens`` or an empty prompt).
        score_batch:
            Exact prompt token ids (the first sample's of each group) and completion ids.
        length_stats, loss, diagnostics:
            Step scalars.
        config:
            The run config snapshot (JSON-serialisable dict): tau, beta, T_q, epsilon, weight
            convention, clip settings, lengths, tokenizer identity, reward names and weights.
        """
        from maxent_arrow.batch_assembly import assemble

        return assemble(
            cls,
            step,
            generation=generation,
            rewards=rewards,
            score_batch=score_batch,
            reference=reference,
            scores=scores,
            length_stats=length_stats,
            loss=loss,
            diagnostics=diagnostics,
            weights=weights,
            rank=rank,
            kind=kind,
            config=config,
            policy_version=policy_version,
            behavior_token_logp=behavior_token_logp,
        )


# ---------------------------------------------------------------------------- helpers
def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _torch_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _to_dtype(tensor: torch.Tensor, name: str | None) -> torch.Tensor:
    target = _torch_dtype(name)
    return tensor if target is None or tensor.dtype == target else tensor.to(target)


def _info_with_token_ids(info: pa.Array, ids: pa.Array | None) -> pa.Array:
    """Completion info with the ``token_ids`` field put back from ``completion_ids``."""
    if ids is None:
        return info
    flat = info.flatten()
    token_ids = ids.flatten()
    names = [f.name for f in flat.type]
    arrays = [flat.field(i) for i in range(len(names))]
    at = names.index("extra") if "extra" in names else len(names)
    names.insert(at, "token_ids")
    arrays.insert(at, token_ids)
    struct = pa.StructArray.from_arrays(arrays, names=names, mask=flat.is_null())
    return _regroup(struct, list_offsets(info))
