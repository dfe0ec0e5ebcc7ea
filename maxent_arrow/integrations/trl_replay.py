"""A ``trl.GRPOTrainer`` that takes its generation batches from a rollout store.

:class:`StoreFedGRPOTrainer` replaces what ``GRPOTrainer._generate_and_score_completions``
returns in training with stored groups drawn by the replay sampler
(:class:`~maxent_arrow.store.ReplaySampler`): all of the batch (``replay_ratio=1``, no
generation), or a share of it beside freshly generated groups (``0 < replay_ratio < 1``: TRL
generates and scores the first prompts of its batch as usual, the rest are replayed). TRL's own
loss then runs on it unchanged (``_compute_loss``: its ``loss_type``, clipping, β-KL to the
stored reference log-probs, its importance ratio against ``old_per_token_logps``).

A stored batch gets what TRL's own generation gives its batch under the trainer's options
(:class:`StoredInputs`, ``docs/integrations.md``, "What the store-fed trainer reproduces"):
the exact prompt and completion tokens, re-padded as TRL pads them (prompts on the left,
completions on the right with the pad token, masks from the lengths); with
``mask_truncated_completions`` the mask rows of truncated completions zeroed (TRL's rule: the
last token is neither an EOS nor the pad); the stored ``tool_mask`` (padded with 1, as TRL
pads it); TRL's advantages; ``num_items_in_batch`` counted on that mask over every process;
the reference log-probs (``ref_token_logp``) when β ≠ 0; the behaviour log-probs
(``behavior_token_logp``, TRL's ``old_per_token_logps``) as the old policy's when stored, the
denominator of TRL's ratio for a replayed, older group; the generator's own
(``sampling_token_logp``) when stored; the vLLM importance ratio under vLLM's correction.
Log-probs TRL would have computed and the store lacks are computed as TRL computes them. A
stored round fed whole is given TRL's recorded micro-batch split (:mod:`.trl_split`). So a
run fed its own store in order, from the same initial weights and settings, trains as TRL
trained: ``tests/integrations/test_trl_fed_matrix.py`` checks losses and gradients against
TRL's, option by option. The values of the options it reproduces are
:data:`~.trl_contract.FED_OPTION_VALUES`; it refuses others.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.errors import ArgumentError, MissingExtraError, StoreError
from maxent_arrow.integrations.adapters import truncation_flags
from maxent_arrow.integrations.trl_contract import (
    FED_OPTION_VALUES,
    TOKEN_COLUMNS,
    TrlOutput,
    concat_outputs,
    next_shuffle,
)
from maxent_arrow.integrations.trl_split import ROUND_KEY, SplitKey, presplit, recorded_splits
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store import (
    ReadOnlyStore,
    ReplaySampler,
    SampledBatch,
    SamplerOptions,
    mix_counts,
)

try:
    from trl import GRPOTrainer  # pyright: ignore[reportPrivateImportUsage] - trl's lazy module
    from trl.models.utils import disable_gradient_checkpointing
except ImportError:  # pragma: no cover - the extra is installed where this module is used
    raise MissingExtraError("trl", "trl") from None

__all__ = ["StoreFedGRPOTrainer", "StoredInputs", "trl_inputs"]

# The run config's record of TRL's vLLM importance-sampling settings (trl_config): a stored
# ratio is given back only to a trainer whose settings are these.
_IS_SETTINGS = (
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)


@dataclass(frozen=True, kw_only=True)
class StoredInputs:
    """How stored groups become TRL's generation output: what of TRL's options decides what
    its own generation puts there.

    Parameters
    ----------
    pad_token_id:
        The tokenizer's pad id: token ids are padded with it.
    eos_token_ids:
        TRL's EOS ids (``GRPOTrainer.eos_token_ids``): a completion whose last token is none of
        them nor the pad token is truncated (TRL's rule).
    ref:
        Give ``ref_per_token_logps`` (the stored ``ref_token_logp``; TRL's with β ≠ 0).
    old:
        Give ``old_per_token_logps`` (the stored ``behavior_token_logp``).
    mask_truncated_completions:
        Zero the ``completion_mask`` and ``tool_mask`` rows of truncated completions, as TRL's
        ``mask_truncated_completions=True`` does.
    importance_sampling:
        The trainer's vLLM importance-sampling settings (``vllm_importance_sampling_mode``,
        ``vllm_importance_sampling_clip_min``, ``vllm_importance_sampling_clip_max``) when TRL
        applies its correction (``use_vllm`` and ``vllm_importance_sampling_correction``):
        the stored ratio is given as ``importance_sampling_ratio`` (``[B, C]`` per token,
        padded with 1, or ``[B, 1]`` per sequence), and must have been recorded under the
        same settings. ``None``: not given (TRL gives it only then).
    """

    pad_token_id: int
    eos_token_ids: Sequence[int] = ()
    ref: bool = True
    old: bool = True
    mask_truncated_completions: bool = False
    importance_sampling: Mapping[str, Any] | None = None


def trl_inputs(
    sampled: SampledBatch,
    options: StoredInputs | None = None,
    *,
    device: torch.device | str = "cpu",
    **fields: Any,
) -> dict[str, Any]:
    """The dict ``GRPOTrainer._generate_and_score_completions`` returns, from stored groups
    (written by :meth:`~.trl_contract.TrlOutput.to_dict`), under ``options`` (a
    :class:`StoredInputs`, or its fields as keywords, not both): ``prompt_ids``/``prompt_mask``
    (left-padded, one row per completion), ``completion_ids``/``completion_mask``
    (right-padded with the pad token), ``advantages``, ``num_items_in_batch`` (this
    process's tokens) and, when stored and asked, ``old_per_token_logps``,
    ``sampling_per_token_logps`` and ``ref_per_token_logps`` (right-padded with 0, TRL's
    widths), ``importance_sampling_ratio`` and ``tool_mask``."""
    if options is None:
        try:
            options = StoredInputs(**fields)
        except TypeError as exc:
            raise ArgumentError(f"trl_inputs: {exc}") from None
    elif fields:
        raise ArgumentError("trl_inputs: pass a StoredInputs or keywords, not both")
    return _stored_output(sampled, options).to(device).to_dict()


def _stored_output(sampled: SampledBatch, options: StoredInputs) -> TrlOutput:
    """:func:`trl_inputs` as a :class:`~.trl_contract.TrlOutput` (on the host)."""
    batch = sampled.rollout_batch()
    completions = batch.ragged("completion_ids")
    prompts = batch.ragged("prompt_ids")
    advantages = batch.ragged("advantages")
    if completions is None or prompts is None or advantages is None:
        raise StoreError(
            f"trl_inputs: stored groups of step {sampled.step} lack prompt_ids, "
            "completion_ids or advantages (not a TRL run's store?)"
        )
    pad = options.pad_token_id
    per_group = torch.from_numpy(batch.group_offsets).diff()
    rows = torch.repeat_interleave(torch.arange(len(per_group)), per_group)
    prompt_ids, prompt_mask = prompts.to_padded(pad, side="left")
    completion_ids, real = completions.to_padded(pad)
    width = completion_ids.shape[1]

    def tokens(column: str, fill: float) -> torch.Tensor | None:
        """A stored per-token column, right-padded with ``fill`` to TRL's width."""
        stored = batch.ragged(column)
        return None if stored is None else stored.to_padded(fill, max_len=width)[0]

    def logps(key: str, asked: bool = True) -> torch.Tensor | None:
        """TRL's ``key`` from its stored column (right-padded with 0), when asked and stored."""
        values = tokens(TOKEN_COLUMNS[key], 0.0) if asked else None
        return None if values is None else values.float()

    completion_mask = real.long()
    tool_mask = tokens("tool_mask", 1)  # TRL pads it with 1
    tool_mask = None if tool_mask is None else tool_mask.long()
    if options.mask_truncated_completions:  # TRL's: the rows of truncated completions zeroed
        kept = ~torch.from_numpy(
            truncation_flags(
                completion_ids,
                completions.lengths(),
                eos_token_ids=options.eos_token_ids,
                pad_token_id=pad,
            )
        )
        completion_mask = completion_mask * kept.unsqueeze(1).int()
        tool_mask = None if tool_mask is None else tool_mask * kept.unsqueeze(1).int()
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    return TrlOutput(
        prompt_ids=prompt_ids[rows].long(),
        prompt_mask=prompt_mask[rows].long(),
        completion_ids=completion_ids.long(),
        completion_mask=completion_mask,
        advantages=advantages.values.float(),
        num_items_in_batch=loss_mask.sum(),
        old_per_token_logps=logps("old_per_token_logps", options.old),
        importance_sampling_ratio=_importance_ratio(batch, options, tokens),
        sampling_per_token_logps=logps("sampling_per_token_logps"),
        ref_per_token_logps=logps("ref_per_token_logps", options.ref),
        tool_mask=tool_mask,
    )


def _importance_ratio(batch: RolloutBatch, options: StoredInputs, tokens: Any) -> Any:
    """TRL's ``importance_sampling_ratio`` from the stored one (``tokens``: a per-token
    column padded to TRL's width), when ``options`` asks for it; a store recorded without
    it, or under other settings, is a :class:`~maxent_arrow.errors.StoreError`."""
    settings = options.importance_sampling
    if settings is None:
        return None
    where = f"trl_inputs (step {batch.step})"
    recorded = batch.run_config.extra.get("trl", {})
    differ = {k: (recorded.get(k), settings.get(k)) for k in _IS_SETTINGS}
    differ = {k: v for k, v in differ.items() if v[0] != v[1]}
    if differ:
        raise StoreError(
            f"{where}: the stored importance sampling ratio was recorded under other settings "
            f"(recorded, this trainer's): {differ}"
        )
    per_token = tokens("importance_sampling_ratio", 1.0)  # TRL's: exp(0) = 1 on padding
    if per_token is not None:
        return per_token.float()
    per_sequence = batch.ragged("sequence_importance_sampling_ratio")
    if per_sequence is None:
        raise StoreError(
            f"{where}: vLLM's importance sampling correction is on, and the stored groups have "
            "no importance_sampling_ratio (recorded without vLLM?)"
        )
    return per_sequence.values.float().unsqueeze(1)


def _concat(fresh: TrlOutput, stored: TrlOutput, pad_token_id: int) -> TrlOutput:
    """TRL's generation output of fresh groups and of stored ones, as one batch
    (:func:`~.trl_contract.concat_outputs`). A key only one part has is left out, with a
    warning that names it: TRL then computes without it (no ``old_per_token_logps``: the
    whole batch on-policy, the stored log-probs unused)."""
    batch, only = concat_outputs(fresh, stored, pad_token_id=pad_token_id)
    if only:
        warnings.warn(
            f"StoreFedGRPOTrainer: {only} only in the fresh or only in the stored groups of a "
            "mixed batch: left out (TRL computes without them)",
            stacklevel=3,
        )
    return batch


def _round_of(groups: pa.RecordBatch) -> SplitKey | None:
    """The stored round (step, rank, kind, round) all of ``groups`` belong to, or ``None``
    (groups of several rounds, or a store without rounds)."""
    if not set(ROUND_KEY) <= set(groups.schema.names):
        return None
    values = [pc.unique(groups.column(n)).to_pylist() for n in ROUND_KEY]
    if any(len(v) != 1 or v[0] is None for v in values):
        return None
    step, rank, kind, round_index = (v[0] for v in values)
    return int(step), int(rank), str(kind), int(round_index)


class StoreFedGRPOTrainer(GRPOTrainer):
    """A ``GRPOTrainer`` whose training generation batches come from ``replay_store``.

    Parameters
    ----------
    replay_store:
        The store of a recorded TRL run (a writable ``RolloutStore`` with ``record=True`` in
        the options: consumption and drops go to its ``lifecycle``).
    replay_options:
        The sampler's options (default: the stored rounds in store order, one generation
        batch each, not recorded); ``batch_groups`` defaults to the groups of TRL's
        generation batch times the replayed share.
    replay_ratio:
        The replayed share of each generation batch (1: all replayed).
    use_behavior_logps:
        Give TRL the stored behaviour log-probs as ``old_per_token_logps`` (its ratio's
        denominator); without them TRL's ratio is 1 (on-policy), or, where TRL computes
        ``old_per_token_logps`` itself (a round that serves several optimizer steps), they
        are computed as TRL computes them, with the model as it is. In a mixed batch
        (``replay_ratio < 1``) the fresh groups' own are computed as TRL computes them when
        it needs them (``num_iterations > 1``), so that every row has its denominator.
    **kwargs:
        ``GRPOTrainer``'s. Its options apply to the stored groups as to TRL's own
        (module doc); a value of an option the trainer does not reproduce
        (:data:`~.trl_contract.FED_OPTION_VALUES`) is an
        :class:`~maxent_arrow.errors.ArgumentError`.
    """

    def __init__(
        self,
        *args: Any,
        replay_store: ReadOnlyStore,
        replay_options: SamplerOptions | None = None,
        replay_ratio: float = 1.0,
        use_behavior_logps: bool = True,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._check_options()
        trl_args: Any = self.args
        per_batch = trl_args.per_device_train_batch_size * trl_args.steps_per_generation
        self.group_size = int(trl_args.num_generations)
        groups, rest = divmod(per_batch, self.group_size)
        if rest:
            raise ArgumentError(
                "StoreFedGRPOTrainer: a generation batch must hold whole groups "
                f"({per_batch} completions, num_generations={self.group_size})"
            )
        self.fresh_groups, replayed = mix_counts(groups, replay_ratio)
        if replayed == 0:
            raise ArgumentError(f"StoreFedGRPOTrainer: replay_ratio {replay_ratio} replays nothing")
        if replay_options is None:
            replay_options = SamplerOptions(
                batch_groups=replayed, sampling="sequential", record=False
            )
        self.replay_sampler = ReplaySampler(replay_store, replay_options)
        self.use_behavior_logps = use_behavior_logps
        vllm_is = bool(trl_args.use_vllm and trl_args.vllm_importance_sampling_correction)
        self.stored_inputs = StoredInputs(
            pad_token_id=int(cast(int, self._tokenizer.pad_token_id)),
            eos_token_ids=tuple(self.eos_token_ids),
            ref=self.beta != 0.0,
            old=use_behavior_logps,
            mask_truncated_completions=bool(self.mask_truncated_completions),
            importance_sampling=(
                {
                    "vllm_importance_sampling_mode": trl_args.vllm_importance_sampling_mode,
                    "vllm_importance_sampling_clip_min": trl_args.vllm_importance_sampling_clip_min,
                    "vllm_importance_sampling_clip_max": trl_args.vllm_importance_sampling_clip_max,
                }
                if vllm_is
                else None
            ),
        )
        # Where TRL computes old_per_token_logps itself (its own condition): a round that
        # serves several optimizer steps, or vLLM's correction.
        generate_every = trl_args.steps_per_generation * self.num_iterations
        self.computes_old = trl_args.gradient_accumulation_steps % generate_every != 0 or vllm_is
        # TRL's recorded micro-batch splits (trl_split), read once.
        self.replay_splits = recorded_splits(replay_store)
        self.split_warned = False
        self.last_replayed: SampledBatch | None = None

    def _check_options(self) -> None:
        """Refuse an option value the trainer does not reproduce (FED_OPTION_VALUES)."""
        chosen = {
            "loss_type": self.loss_type,
            "importance_sampling_level": self.importance_sampling_level,
            "scale_rewards": self.scale_rewards,
            "multi_objective_aggregation": self.multi_objective_aggregation,
            "vllm_importance_sampling_mode": self.vllm_importance_sampling_mode,
        }
        for option, value in chosen.items():
            handled = FED_OPTION_VALUES[option]
            if value not in handled:
                raise ArgumentError(
                    f"StoreFedGRPOTrainer: {option}={value!r} is not a value whose inputs the "
                    f"store-fed trainer reproduces (it does {sorted(handled)}; "
                    "trl_contract.FED_OPTION_VALUES)"
                )

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        model: Any = self.model
        if not model.training:  # evaluation generates, as TRL does
            return super()._generate_and_score_completions(inputs)
        step = int(self.state.global_step)
        sampled = self.replay_sampler.sample(current_version=step, step=step)
        if sampled is None:
            raise StoreError("StoreFedGRPOTrainer: the replay sampler has no more groups")
        self.last_replayed = sampled
        stored = self._stored(sampled)
        if self.fresh_groups == 0:
            return self._in_recorded_split(sampled, stored).to_dict()
        fresh = TrlOutput.read(
            super()._generate_and_score_completions(inputs[: self.fresh_groups * self.group_size])
        )
        if stored.old_per_token_logps is not None and fresh.old_per_token_logps is None:
            fresh = dataclasses.replace(fresh, old_per_token_logps=self._logps(model, fresh))
        return _concat(fresh, stored, self.stored_inputs.pad_token_id).to_dict()

    def _stored(self, sampled: SampledBatch) -> TrlOutput:
        """The stored groups as TRL's output on this process's device, with the log-probs TRL
        would have computed and the store lacks computed as TRL computes them (the reference
        model's with β ≠ 0; the model's where TRL computes ``old_per_token_logps``), and
        ``num_items_in_batch`` summed over the processes, as TRL sums it."""
        out = _stored_output(sampled, self.stored_inputs).to(self.accelerator.device)
        computed: dict[str, torch.Tensor] = {}
        if self.beta != 0.0 and out.ref_per_token_logps is None:
            if self.ref_model is None:
                raise StoreError(
                    f"StoreFedGRPOTrainer: beta={self.beta} and the stored groups of step "
                    f"{sampled.step} have no reference log-probs (recorded with beta=0?), "
                    "and this trainer has no reference model to compute them with (a PEFT "
                    "adapter's reference is not supported)"
                )
            computed["ref_per_token_logps"] = self._logps(self.ref_model, out)
        if self.computes_old and out.old_per_token_logps is None:
            computed["old_per_token_logps"] = self._logps(self.model, out)
        items: Any = self.accelerator.gather(out.num_items_in_batch)
        items = items.sum()
        return dataclasses.replace(out, num_items_in_batch=items, **computed)

    def _in_recorded_split(self, sampled: SampledBatch, out: TrlOutput) -> TrlOutput:
        """``out`` in the row order under which TRL's shuffle draws the split it recorded for
        the round (:mod:`.trl_split`): a batch that is one stored round, whole. Any other
        batch (or a round recorded without its split, said once) TRL splits as it splits
        its own generation, by a fresh draw."""
        key = _round_of(sampled.groups)
        order = None if key is None else self.replay_splits.get(key)
        if order is None or len(order) != out.rows:
            if key is not None and not self.split_warned:
                self.split_warned = True
                warnings.warn(
                    f"StoreFedGRPOTrainer: no recorded micro-batch split for the {out.rows} "
                    f"rows of step {key[0]}, rank {key[1]}, round {key[3]} (a store recorded "
                    "without splits, or not the round whole): TRL's shuffle draws a new "
                    "one, so a loss that depends on the split (bnpo, gradient accumulation) "
                    "differs from the one TRL logged",
                    stacklevel=3,
                )
            return out
        index = presplit(order, next_shuffle(out.rows).numpy())
        return out.take(torch.from_numpy(index))

    def _logps(self, model: Any, out: TrlOutput) -> torch.Tensor:
        """Per-token log-probs of ``out``'s completions under ``model``, computed as TRL
        computes its old and reference log-probs at generation (no gradient, gradient
        checkpointing off, in chunks of ``per_device_train_batch_size``)."""
        ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
        trl_args: Any = self.args
        trained: Any = self.model
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(trained, trl_args.gradient_checkpointing_kwargs),
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model,
                ids,
                mask,
                out.completion_ids.size(1),
                batch_size=trl_args.per_device_train_batch_size,
            )
        return logps
