"""A ``trl.GRPOTrainer`` that takes its generation batches from a rollout store.

:class:`StoreFedGRPOTrainer` replaces what ``GRPOTrainer._generate_and_score_completions``
returns in training with stored groups drawn by the replay sampler
(:class:`~maxent_arrow.store.ReplaySampler`): all of the batch (``replay_ratio=1``, no
generation), or a share of it beside freshly generated groups (``0 < replay_ratio < 1``: TRL
generates and scores the first prompts of its batch as usual, the rest are replayed). TRL's own
loss then runs on it unchanged (``_compute_loss``: its ``loss_type``, clipping, β-KL to the
stored reference log-probs, its importance ratio against ``old_per_token_logps``).

What a stored group gives TRL (the columns the TRL recorder writes, :mod:`.trl`): the exact
prompt and completion tokens, re-padded as TRL pads them (prompts on the left, completions on
the right with the pad token, masks from the lengths), TRL's advantages, the reference
log-probs (``ref_token_logp``) when β > 0, and the behaviour log-probs
(``behavior_token_logp``, TRL's ``old_per_token_logps``) as the old policy's when stored: the
denominator of TRL's ratio for a replayed, older group. A stored step at staleness 0, given to
the trainer restored from that step's checkpoint, gives back the loss TRL logged for it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from maxent_arrow.errors import ArgumentError, MissingExtraError, StoreError
from maxent_arrow.integrations.trl_contract import TOKEN_COLUMNS, TrlOutput, concat_outputs
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

__all__ = ["StoreFedGRPOTrainer", "trl_inputs"]


def trl_inputs(
    sampled: SampledBatch,
    *,
    pad_token_id: int,
    device: torch.device | str = "cpu",
    ref: bool = True,
    old: bool = True,
) -> dict[str, Any]:
    """The dict ``GRPOTrainer._generate_and_score_completions`` returns, from stored groups
    (written by :meth:`~.trl_contract.TrlOutput.to_dict`): ``prompt_ids``/``prompt_mask``
    (left-padded, one row per completion), ``completion_ids``/``completion_mask``
    (right-padded with ``pad_token_id``), ``advantages``, ``num_items_in_batch`` and, when
    stored and asked, ``old_per_token_logps`` and ``ref_per_token_logps`` (right-padded with
    0, TRL's widths)."""
    return _stored_output(sampled, pad_token_id=pad_token_id, ref=ref, old=old).to(device).to_dict()


def _stored_output(sampled: SampledBatch, *, pad_token_id: int, ref: bool, old: bool) -> TrlOutput:
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
    per_group = torch.from_numpy(batch.group_offsets).diff()
    rows = torch.repeat_interleave(torch.arange(len(per_group)), per_group)
    prompt_ids, prompt_mask = prompts.to_padded(pad_token_id, side="left")
    completion_ids, completion_mask = completions.to_padded(pad_token_id)
    width = completion_ids.shape[1]

    def logps(key: str, asked: bool) -> torch.Tensor | None:
        """TRL's ``key`` from its stored column (right-padded with 0), when asked and stored."""
        stored = batch.ragged(TOKEN_COLUMNS[key]) if asked else None
        return None if stored is None else stored.to_padded(0.0, max_len=width)[0].float()

    return TrlOutput(
        prompt_ids=prompt_ids[rows].long(),
        prompt_mask=prompt_mask[rows].long(),
        completion_ids=completion_ids.long(),
        completion_mask=completion_mask.long(),
        advantages=advantages.values.float(),
        num_items_in_batch=completion_mask.sum(),
        old_per_token_logps=logps("old_per_token_logps", old),
        ref_per_token_logps=logps("ref_per_token_logps", ref),
    )


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


class StoreFedGRPOTrainer(GRPOTrainer):
    """A ``GRPOTrainer`` whose training generation batches come from ``replay_store``.

    Parameters
    ----------
    replay_store:
        The store of a recorded TRL run (a writable ``RolloutStore`` with ``record=True`` in
        the options: consumption and drops go to its ``lifecycle``).
    replay_options:
        The sampler's options (default: stored steps whole, in order, not recorded);
        ``batch_groups`` defaults to the groups of TRL's generation batch times the replayed
        share.
    replay_ratio:
        The replayed share of each generation batch (1: all replayed).
    use_behavior_logps:
        Give TRL the stored behaviour log-probs as ``old_per_token_logps`` (its ratio's
        denominator); without them TRL's ratio is 1 (on-policy). In a mixed batch
        (``replay_ratio < 1``) the fresh groups' own are computed as TRL computes them when it
        needs them (``num_iterations > 1``), so that every row has its denominator.
    **kwargs:
        ``GRPOTrainer``'s.
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
                batch_groups=None if self.fresh_groups == 0 else replayed,
                sampling="sequential",
                record=False,
            )
        self.replay_sampler = ReplaySampler(replay_store, replay_options)
        self.use_behavior_logps = use_behavior_logps
        self.last_replayed: SampledBatch | None = None

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        model: Any = self.model
        if not model.training:  # evaluation generates, as TRL does
            return super()._generate_and_score_completions(inputs)
        step = int(self.state.global_step)
        sampled = self.replay_sampler.sample(current_version=step, step=step)
        if sampled is None:
            raise StoreError("StoreFedGRPOTrainer: the replay sampler has no more groups")
        self.last_replayed = sampled
        processor: Any = self.processing_class
        pad = int(getattr(processor, "tokenizer", processor).pad_token_id)
        stored = _stored_output(
            sampled, pad_token_id=pad, ref=self.beta != 0.0, old=self.use_behavior_logps
        ).to(self.accelerator.device)
        if self.fresh_groups == 0:
            return stored.to_dict()
        fresh = TrlOutput.read(
            super()._generate_and_score_completions(inputs[: self.fresh_groups * self.group_size])
        )
        if stored.old_per_token_logps is not None and fresh.old_per_token_logps is None:
            fresh = dataclasses.replace(fresh, old_per_token_logps=self._old_logps(fresh))
        return _concat(fresh, stored, pad).to_dict()

    def _old_logps(self, fresh: TrlOutput) -> torch.Tensor:
        """The fresh groups' ``old_per_token_logps``, which TRL leaves out when generation and
        optimisation steps line up (its ratio is then 1): computed as TRL computes them when it
        needs them (``num_iterations > 1``), with the model that generated them, so that the
        stored groups of a mixed batch keep their behaviour log-probs (their ratio's
        denominator) and the fresh ones stay on-policy."""
        ids = torch.cat([fresh.prompt_ids, fresh.completion_ids], dim=1)
        mask = torch.cat([fresh.prompt_mask, fresh.completion_mask], dim=1)
        trl_args: Any = self.args
        model: Any = self.model
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(model, trl_args.gradient_checkpointing_kwargs),
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model,
                ids,
                mask,
                fresh.completion_ids.size(1),
                batch_size=trl_args.per_device_train_batch_size,
            )
        return logps
