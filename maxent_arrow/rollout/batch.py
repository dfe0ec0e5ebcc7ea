"""``RolloutBatch``: one step of one rank, as a group record batch plus its step row.

The group batch has one row per prompt group in the group layout of
:mod:`maxent_arrow.arrow.schema` (per-completion values as ``list<T>``, per-token values as
``list<list<T>>``); the step row is a one-row batch in the step layout (reward moments, length
stats, reference summaries, loss scalars, diagnostics and the run config as JSON).

``from_parts`` assembles a batch from the seed objects of one training step without copying
the per-token bytes (flat ``[N]`` columns are regrouped by the group offsets, which only adds
an offsets buffer); the properties give the seed objects back Arrow-born over the same buffers
(:mod:`maxent_arrow.rollout.seeds`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from maxent_arrow import arrow as A
from maxent_arrow import ingest
from maxent_arrow import types as T
from maxent_arrow.arrow import list_offsets, single_array
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.rollout import seeds
from maxent_arrow.rollout.assembly import GroupColumns, check_parts, step_values
from maxent_arrow.rollout.checks import (  # BATCH_META_KEY: imported from here by store/
    BATCH_META_KEY,  # noqa: F401
    STEP_META_KEY,
    batch_families,
    config_json,
    int_arg,
    normalise,
    step_row_from_json,
    step_row_to_json,
)
from maxent_arrow.rollout.config import RunConfig

if TYPE_CHECKING:
    from maxent_arrow.arrow import Ragged

__all__ = ["RolloutBatch"]


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
    def unit(self) -> tuple[int, int, str]:
        """``(step, rank, kind)``: the unit of the store this batch is (one read of each)."""
        row = self.step_row
        return (
            int(row.column("step")[0].as_py()),
            int(row.column("rank")[0].as_py()),
            str(row.column("kind")[0].as_py()),
        )

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
    def families(self) -> tuple[str, ...]:
        """The run layout families of this batch (``core`` plus its trainer's: ``maxent``,
        ``trl``, ``verl``); a store's first append fixes its run's."""
        return batch_families(self.groups, self.step_row)

    @property
    def num_samples(self) -> int:
        return int(self._scalar("num_samples"))

    @property
    def config(self) -> dict[str, Any]:
        """The run config snapshot of this step (parsed from the JSON ``config`` column)."""
        text = self._scalar("config")
        return json.loads(text) if text else {}

    @property
    def run_config(self) -> RunConfig:
        """The config snapshot as a :class:`~maxent_arrow.rollout.RunConfig` (the replay
        contract)."""
        return RunConfig.from_dict(self._scalar("config"))

    @property
    def group_offsets(self) -> np.ndarray:
        """Where each group's completions start and end in the flat ``[N]`` order (int64)."""
        return list_offsets(single_array(self.groups.column("completions")))

    def column(self, name: str) -> pa.Array | None:
        """Column ``name`` of the groups, or ``None`` when absent or null in every group (a
        column that only other steps of a merged file have)."""
        if name not in self.groups.schema.names:
            return None
        column = single_array(self.groups.column(name))
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
    # Arrow-born (rollout/seeds.py): fields are decoded on first access, column()/ragged()/
    # tensor() on them view these group rows, and an untouched one's to_arrow() is O(1).
    @property
    def generation_batch(self) -> T.GenerationBatch:
        """Prompts, answers, grouped completions, ref meta and completion info."""
        return seeds.generation_batch(self)

    @property
    def reward_computation(self) -> T.RewardComputation | None:
        """Utilities, per-reward values, advantages, q and moments; ``None`` if not stored.

        ``completion_metadata`` is ``pairs.metadata`` (the completion info, token ids
        included), as in the seed.
        """
        return seeds.reward_computation(self)

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
        return A.Ragged.from_arrow(column)

    @property
    def reference_logprobs(self) -> T.ReferenceLogprobs | None:
        """Reference statistics rebuilt from R_i and T_i (``ref_logp_sum`` = R / max(T, 1)).

        Per-token values come back right-padded with 0 to their stored width, with the mask.
        Tensor dtypes (and kinds) are the ones given to ``from_parts``.
        """
        return seeds.reference_logprobs(self)

    @property
    def length_stats(self) -> T.LengthStats | None:
        return seeds.length_stats(self)

    @property
    def loss_scalars(self) -> T.LossScalarBundle | None:
        return seeds.loss_scalars(self)

    @property
    def diagnostics(self) -> T.BatchDiagnostics | None:
        return seeds.diagnostics(self)

    def score_batch(
        self,
        *,
        pad_token_id: int | None = None,
        max_prompt_len: int | None = None,
        slice_size: int | None = None,
        score_tail_tokens: int | None = None,
    ) -> T.ScoreBatch:
        """The scoring inputs of the stored samples, through :func:`~maxent_arrow.ingest.
        build_score_batch` (the one ScoreBatch builder): prompt ids per sample and right-padded
        completion ids in one vectorised pass. Defaults come from the config (``pad_token_id``,
        ``max_prompt_len``); ``slice_size`` defaults to N.
        """
        if self.column("prompt_ids") is None or self.column("completion_ids") is None:
            raise LayoutError(
                "RolloutBatch.score_batch: the batch has no prompt_ids/completion_ids columns"
            )
        config = self.config
        if pad_token_id is None:
            pad_token_id = config.get("pad_token_id", 0)
        sizes = np.diff(list_offsets(self.column("prompt_ids")))
        if max_prompt_len is None:
            max_prompt_len = int(config.get("max_prompt_len", int(sizes.max(initial=1))))
        # The stored completion ids are exactly the scored tokens, so no EOS cut is redone.
        return ingest.build_score_batch(
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
        generation: T.GenerationBatch,
        rewards: T.RewardComputation | None = None,
        score_batch: T.ScoreBatch | None = None,
        reference: T.ReferenceLogprobs | None = None,
        scores: T.SequenceScores | None = None,
        length_stats: T.LengthStats | None = None,
        loss: T.LossOutputs | T.LossScalarBundle | None = None,
        diagnostics: T.BatchDiagnostics | None = None,
        weights: Any = None,
        rank: int = 0,
        kind: str = "train",
        config: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
        behavior_token_logp: Any = None,
        policy_versions: Any = None,
        version_runs: Any = None,
        logp_semantics: Any = None,
        sampling: Mapping[str, Any] | None = None,
        kept_token_ids: Any = None,
        topk: Any = None,
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
        policy_versions:
            The off-policy contract (``docs/arrow-layout.md``, "Off-policy data"): the policy
            version of each completion (one int for all, or ``[N]``; default
            ``policy_version`` when that is given).
        version_runs:
            Partial rollouts: ``(starts, versions)``, per completion the token index where
            each run of one policy version starts and its version (empty lists for a
            completion made by one version).
        logp_semantics:
            ``"raw"`` or ``"processed"`` (one for all, or ``[N]``): what the behaviour
            log-probs are.
        sampling:
            ``{"temperature", "top_p", "top_k", "min_p"}``: each one value for all or ``[N]``.
        kept_token_ids:
            Per token, the ids the sampler kept (any order; stored ascending, gap-coded): a
            ``Ragged`` with one row per completion token (completions in group order), or one
            ``list<list<int>>`` row per completion. Each must hold its sampled token.
        topk:
            ``(ids, logps)``: per token, the generator's top-k ids and their log-probs, in the
            same forms as ``kept_token_ids``.

        Bad shapes or values are refused with a :class:`~maxent_arrow.errors.LayoutError` or
        :class:`~maxent_arrow.errors.SchemaError` naming the argument and the group, sample
        and token.
        """
        parts = {
            "generation": generation,
            "rewards": rewards,
            "score_batch": score_batch,
            "reference": reference,
            "scores": scores,
            "length_stats": length_stats,
            "loss": loss,
            "diagnostics": diagnostics,
        }
        check_parts(parts)
        kind = S.check_kind(kind, where="RolloutBatch.kind")
        step, rank = int_arg("step", step), int_arg("rank", rank)
        config_json(config)  # refused before any conversion when it is not JSON
        # Each part is checked by its own to_arrow() (the Arrow boundary), then regrouped.
        columns = GroupColumns(generation, step=step, rank=rank, kind=kind)
        columns.add_token_ids(score_batch)
        if rewards is not None:
            columns.add_rewards(rewards)
        if weights is not None:
            columns.add_weights(weights)
        if reference is not None:
            columns.add_reference(reference)
        if scores is not None:
            columns.add_scores(scores)
        if behavior_token_logp is not None:
            columns.add_behavior_tokens(behavior_token_logp)
        if policy_versions is None and policy_version is not None:
            policy_versions = int_arg("policy_version", policy_version)
        columns.add_offpolicy(
            policy_versions=policy_versions,
            version_runs=version_runs,
            logp_semantics=logp_semantics,
            sampling=sampling,
            kept_token_ids=kept_token_ids,
            topk=topk,
        )
        step_row = step_values(
            columns,
            step=step,
            rank=rank,
            kind=kind,
            config=config,
            policy_version=policy_version,
            parts=parts,
        )
        return cls(columns.to_batch(), step_row)
