"""A verl feeder: stored verl steps handed back to verl as ``DataProto`` batches, through the
replay sampler.

Each stored step a verl run recorded (:func:`~maxent_arrow.integrations.verl.from_dataproto`)
comes back through :func:`~maxent_arrow.integrations.verl.to_dataproto` as the ``DataProto``
verl held (token ids, masks, position ids, old, reference and rollout log-probs, rewards,
advantages, every non-tensor column), in the sampler's order: sequential, uniform or
prioritised over whole steps, within a staleness window, deterministic for a seed, resumable
(``state_dict()``), sharded across consumers, with every consumption and drop in the store's
``lifecycle``. verl's own loss functions (``verl.trainer.ppo.core_algos``) then run on it as on
a fresh rollout. The ``DataProto`` holds exactly the keys verl held, ``meta_info`` included;
which stored step a fed batch is, and the policy version that generated it, are the feeder's
:attr:`VerlFeeder.source` (a :class:`FedStep`) until the next one.

Whole steps only: a verl batch is the ``DataProto`` of one step, whose layout (its row order,
its padded widths) the store keeps per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from maxent_arrow.errors import ArgumentError
from maxent_arrow.integrations.verl import to_dataproto
from maxent_arrow.store import ReadOnlyStore, ReplaySampler, SampledBatch, SamplerOptions

__all__ = ["FedStep", "VerlFeeder"]


@dataclass(frozen=True, slots=True)
class FedStep:
    """Where a fed ``DataProto`` came from: the stored ``step``, the ``policy_version`` that
    generated it (the oldest of its completions') and the ``trainer_step`` it was fed at
    (``None`` when the caller gave none)."""

    step: int
    policy_version: int
    trainer_step: int | None


class VerlFeeder:
    """Stored verl steps of ``store`` as ``DataProto`` batches (module docstring).

    ``options`` (or keywords) are the :class:`~maxent_arrow.store.SamplerOptions` of the
    sampler underneath, with ``batch_groups=None`` (whole steps).
    """

    def __init__(self, store: ReadOnlyStore, options: SamplerOptions | None = None, **kwargs: Any):
        options = SamplerOptions.given(options, kwargs, where="VerlFeeder")
        if options.batch_groups is not None:
            raise ArgumentError(
                "VerlFeeder: a verl batch is one whole stored step (batch_groups=None), got "
                f"batch_groups={options.batch_groups}"
            )
        if options.drop_zero_std:
            raise ArgumentError(
                "VerlFeeder: drop_zero_std would cut groups out of a step's DataProto; verl "
                "filters groups itself (algorithm.filter_groups)"
            )
        self.sampler = ReplaySampler(store, options)
        self.last: SampledBatch | None = None

    def next(self, *, current_version: int | None = None, step: int | None = None) -> Any:
        """The next stored step as a ``DataProto`` (``None`` at the end of the stream);
        ``current_version`` and ``step`` as for :meth:`ReplaySampler.sample`."""
        sample = self.sampler.sample
        while (sampled := sample(current_version=current_version, step=step)) is not None:
            if sampled.num_groups:  # not a draw whose step was dropped as stale
                break
        if sampled is None:
            return None
        self.last = sampled
        return to_dataproto(sampled.rollout_batch())

    @property
    def source(self) -> FedStep | None:
        """Where the last fed batch came from (``None`` before the first)."""
        if self.last is None:
            return None
        return FedStep(
            step=self.last.stored_steps[0],
            policy_version=int(self.last.versions.min()),
            trainer_step=self.last.step,
        )

    def __iter__(self) -> Iterator[Any]:
        while (data := self.next()) is not None:
            yield data

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | str) -> None:
        self.sampler.load_state_dict(state)
