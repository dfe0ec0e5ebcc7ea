"""Record a verl run: :class:`VerlRolloutRecorder`, a mixin for verl's ``RayPPOTrainer``
(``pip install 'maxent-arrow[verl]'``; written against verl 0.9.1).

verl's trainer has no callback that sees the batch; the nearest hook is
``RayPPOTrainer._log_rollout_data(batch, reward_extra_infos_dict, timing_raw,
rollout_data_dir)``, which ``fit()`` calls once per training step, after the actor update,
with the whole batch of the step (prompts, responses, log-probs, rewards, advantages, the
dataset's non-tensor columns and the reward functions' extra infos) on the driver. verl calls
it only when ``trainer.rollout_data_dir`` is set, to dump JSONL there. The mixin overrides it:
the batch becomes one stored step (:func:`~maxent_arrow.integrations.verl.from_dataproto`),
and verl's JSONL dump is kept only with ``dump_jsonl=True``.

Step numbers: verl counts steps from 1 and logs a step's metrics under ``global_steps``; the
store keys the step by that same number (a verl log joins the store at +0), and
``policy_version`` is ``global_steps - 1``, the updates the generating policy had
(``docs/integrations.md``, "Step numbers").
"""

from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from maxent_arrow.errors import MissingExtraError, SchemaError
from maxent_arrow.integrations.verl import from_dataproto, verl_sampling
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import RolloutStore

try:
    import verl
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
except ImportError:  # pragma: no cover - the extra is installed where this module is used
    raise MissingExtraError("verl", "verl") from None

__all__ = ["RecordingRayPPOTrainer", "VerlRolloutRecorder", "verl_run_config"]

# Where the recorder's time goes in verl's timing metrics (``timing_s/<name>``).
TIMING_KEY = "maxent_arrow_record"


def verl_run_config(config: Any) -> RunConfig:
    """verl's settings (its trainer config, an OmegaConf ``DictConfig``) as the replay
    contract; the rest of the algorithm's settings under ``extra["verl"]``."""

    def get(key: str, default: Any = None) -> Any:
        value = OmegaConf.select(config, key, default=default)
        return default if value is None else value

    actor = "actor_rollout_ref.actor."
    estimator = str(get("algorithm.adv_estimator", "gae"))
    norm = bool(get("algorithm.norm_adv_by_std_in_grpo", True))
    return RunConfig(
        scale_rewards="group" if norm else "none",
        beta=float(get(actor + "kl_loss_coef", 0.0)) if get(actor + "use_kl_loss", False) else 0.0,
        mode="grpo",
        loss_type=str(get(actor + "loss_agg_mode", "token-mean")),
        use_clip_objective=True,
        clip_eps_low=float(get(actor + "clip_ratio_low", get(actor + "clip_ratio", 0.2))),
        clip_eps_high=float(get(actor + "clip_ratio_high", get(actor + "clip_ratio", 0.2))),
        num_generations=int(get("actor_rollout_ref.rollout.n", 1)),
        max_prompt_len=int(get("data.max_prompt_length", 0)),
        max_completion_len=int(get("data.max_response_length", 0)),
        gen_temperature=float(get("actor_rollout_ref.rollout.temperature", 1.0)),
        top_p=float(get("actor_rollout_ref.rollout.top_p", 1.0)),
        model=get("actor_rollout_ref.model.path"),
        prompts_per_step=int(get("data.train_batch_size", 0)),
        learning_rate=float(get(actor + "optim.lr", 0.0)),
        seed=int(get("data.seed", 0) or 0),
        trainer=f"verl.RayPPOTrainer {verl.__version__}",
        extra={
            "verl": {
                "adv_estimator": estimator,
                "norm_adv_by_std_in_grpo": norm,
                "use_kl_in_reward": bool(get("algorithm.use_kl_in_reward", False)),
                "kl_penalty": str(get("algorithm.kl_penalty", "kl")),
                "ppo_epochs": int(get(actor + "ppo_epochs", 1)),
                "ppo_mini_batch_size": int(get(actor + "ppo_mini_batch_size", 0)),
            }
        },
    )


# The mixin is typed over RayPPOTrainer for checkers; at run time its base stays object, so it
# goes before any RayPPOTrainer subclass.
if TYPE_CHECKING:
    _Trainer = RayPPOTrainer
else:
    _Trainer = object


class VerlRolloutRecorder(_Trainer):
    """Mixin that records every training step of a verl ``RayPPOTrainer`` into a rollout
    store (see the module doc). Put it before the trainer class:
    ``class T(VerlRolloutRecorder, RayPPOTrainer)``.

    Parameters
    ----------
    rollout_store:
        A :class:`~maxent_arrow.store.RolloutStore`, or a path or URI where one is created.
    dump_jsonl:
        Also write verl's own JSONL dump to ``trainer.rollout_data_dir``.
    *args, **kwargs:
        Those of the trainer. Its config must set ``trainer.rollout_data_dir`` (verl calls the
        hook only then; with ``dump_jsonl=False`` nothing is written there).

    Raises
    ------
    SchemaError
        ``trainer.rollout_data_dir`` is not set: the hook would never be called.
    """

    def __init__(
        self,
        *args: Any,
        rollout_store: RolloutStore | str | os.PathLike[str],
        dump_jsonl: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not OmegaConf.select(self.config, "trainer.rollout_data_dir"):
            raise SchemaError(
                "VerlRolloutRecorder: trainer.rollout_data_dir is not set, and verl calls "
                "_log_rollout_data (where the recorder records) only when it is: set it "
                "(with dump_jsonl=False nothing is written there)"
            )
        self.rollout_config = verl_run_config(self.config)
        if isinstance(rollout_store, RolloutStore):
            self.rollout_store = rollout_store
        else:
            self.rollout_store = RolloutStore.create(
                rollout_store, config=self.rollout_config.to_dict()
            )
        self.dump_jsonl = dump_jsonl
        self._rollout_written = set(self.rollout_store.steps(kind="train"))

    def _log_rollout_data(self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir):
        start = time.perf_counter()
        self.record_rollouts(batch)
        timing_raw[TIMING_KEY] = timing_raw.get(TIMING_KEY, 0.0) + time.perf_counter() - start
        if self.dump_jsonl:
            super()._log_rollout_data(batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)

    def record_rollouts(self, batch: Any) -> None:
        """Append ``batch`` (a ``DataProto`` as ``fit()`` holds it after the update) as the
        store's step ``global_steps``; a step the store already holds (a run resumed from an
        earlier checkpoint) is not recorded again, with a warning."""
        step = int(self.global_steps)
        if step in self._rollout_written:
            warnings.warn(
                f"VerlRolloutRecorder: step {step} is already stored (a run resumed from an "
                "earlier checkpoint); this one is not recorded",
                stacklevel=2,
            )
            return
        stored = from_dataproto(
            batch,
            step=step,
            config=self.rollout_config,
            tokenizer=self.tokenizer,
            policy_version=step - 1,
            sampling=verl_sampling(self.config),
        )
        self.rollout_store.append(stored)
        self._rollout_written.add(step)


class RecordingRayPPOTrainer(VerlRolloutRecorder, RayPPOTrainer):
    """verl's ``RayPPOTrainer`` that records every training step into a rollout store: the
    trainer's arguments plus ``rollout_store=`` and ``dump_jsonl=``
    (:class:`VerlRolloutRecorder`)."""
