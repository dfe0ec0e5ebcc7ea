"""A second policy trained from a demo run's stored rollouts (``maxent-arrow train
--from-store RUN``, and the demo's offline stage).

The policy starts from the run's first snapshot (the warm-started model the online run began
from), with the same reference and settings (the run's stored config), and takes its groups
from the run's store through the replay sampler (:class:`~maxent_arrow.store.ReplaySampler`):
all of them replayed (offline), or mixed with fresh generation at ``replay_ratio``. It writes a
store of its own (its trainer figures, its eval steps and, when mixed, its fresh steps) and
nothing into the run it reads (opened read-only): each group it consumed or dropped is a row
of its own store's ``source_lifecycle`` records (:data:`SOURCE_LIFECYCLE`: the source's
group key, as in a ``lifecycle`` record, and the source store).

``exact=True`` is the exact replay of the run instead: whole stored steps in order, staleness
window 0, the weights of each step loaded from the run's snapshots before its update; each
update's loss is then the one the run logged.

This module imports torch and transformers (the command line loads it when it runs).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors.torch import load_model
from transformers import ByT5Tokenizer
from transformers.utils import logging as hf_logging

from maxent_arrow.arrow import registry as R
from maxent_arrow.demo.model import tiny_model
from maxent_arrow.demo.prompts import load_prompts
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import (
    ReadOnlyStore,
    ReplaySampler,
    RolloutStore,
    SampledBatch,
    mix_counts,
)
from maxent_arrow.store.history.records import lifecycle_rows
from maxent_arrow.train import (
    MaxEntTrainer,
    StoreStep,
    evaluate,
    greedy_generator,
    should_evaluate,
    snapshot_path,
    train_from_store,
)
from maxent_arrow.types import (
    EvaluationSettings,
    GenerationSettings,
    LoggingHandles,
    RewardSpec,
    ValidationContext,
)

__all__ = [
    "SOURCE_LIFECYCLE",
    "OfflineOptions",
    "OfflineRun",
    "eval_accuracy",
    "train_offline",
    "validation_context",
]


# This run's record table of the source run's groups it consumed or dropped (the source's own
# ``lifecycle`` is its trainer's: a reader of a run writes nothing into it).
SOURCE_LIFECYCLE = "source_lifecycle"


@dataclass(frozen=True, kw_only=True)
class OfflineOptions:
    """How :func:`train_offline` trains its second policy.

    Parameters
    ----------
    steps:
        Updates (default: as many as the run has train steps).
    replay_ratio:
        The replayed share of each update's groups, in (0, 1] (1: offline; below 1 the rest
        is generated fresh from the RL prompts).
    seed:
        Seeds the sampler, the prompts' order and torch.
    eval_prompts, eval_every:
        Held-out prompts evaluated greedily (0: none), every ``eval_every`` updates.
    exact:
        The exact replay of the run (module docstring); not with a ``replay_ratio``.
    threads:
        torch's CPU threads while it trains.
    """

    steps: int | None = None
    replay_ratio: float = 1.0
    seed: int = 0
    eval_prompts: int = 128
    eval_every: int = 10
    exact: bool = False
    threads: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.replay_ratio <= 1.0:
            raise ArgumentError(f"train: --replay-ratio must be in (0, 1], got {self.replay_ratio}")
        if self.exact and self.replay_ratio != 1.0:
            raise ArgumentError("train: --exact replays the stored steps alone (no --replay-ratio)")


@dataclass(frozen=True)
class OfflineRun:
    """What :func:`train_offline` did: its store, the updates fed from the source store, the
    held-out accuracy per eval step ``(step, accuracy)``, and the seconds it took."""

    store: RolloutStore
    steps: list[StoreStep]
    accuracy: list[tuple[int, float]]
    seconds: float


def validation_context(
    trainer: MaxEntTrainer,
    store: RolloutStore,
    *,
    eval_prompts: int,
    eval_every: int,
    max_new_tokens: int,
    k: int,
) -> ValidationContext:
    """The seed's ``ValidationContext`` for greedy evaluation of the held-out prompts; the
    results go to ``store`` only."""
    config = trainer.config
    return ValidationContext(
        evaluation=EvaluationSettings(
            enabled=eval_prompts > 0,
            rows=load_prompts("eval", limit=eval_prompts),
            batch_size=64,
            every_n_steps=eval_every,
        ),
        accelerator=trainer.accelerator,
        model=trainer.policy,
        tokenizer=trainer.tokenizer,
        reward=RewardSpec(
            [accuracy_reward, format_reward],
            list(config.reward_weights),
            list(config.reward_names),
        ),
        generator=greedy_generator(
            trainer.policy,
            trainer.tokenizer,
            max_new_tokens=max_new_tokens,
            max_prompt_len=config.max_prompt_len,
        ),
        logging=LoggingHandles(store=store),
        generation=GenerationSettings(
            max_prompt_len=config.max_prompt_len,
            max_completion_len=max_new_tokens,
            num_generations=k,
        ),
    )


def eval_accuracy(store: RolloutStore) -> list[tuple[int, float]]:
    """Mean held-out accuracy per eval step, by SQL over the store's ``samples`` view."""
    rows = store.sql(
        "SELECT step, avg(reward_accuracy) AS accuracy FROM samples WHERE kind = 'eval' "
        "GROUP BY step ORDER BY step"
    ).to_pylist()
    return [(int(r["step"]), float(r["accuracy"])) for r in rows]


def train_offline(
    run_dir: Path,
    out: Path,
    options: OfflineOptions | None = None,
    *,
    on_step: Callable[[StoreStep], object] | None = None,
    **keywords: Any,
) -> OfflineRun:
    """Train a second policy from the demo run in ``run_dir`` (its ``store/`` and
    ``snapshots/``) into ``out`` (new or empty; its store goes to ``out/store``).

    ``options``: how (:class:`OfflineOptions`), as one object or as its fields' keywords
    (``steps=``, ``replay_ratio=``, ...), not both. ``on_step(step)`` after each update.
    """
    if options is None:
        options = OfflineOptions(**keywords)
    elif keywords:
        raise ArgumentError("train_offline: pass an OfflineOptions or keywords, not both")
    first = snapshot_path(run_dir, 0)
    if not first.is_file():
        raise StoreError(f"{run_dir}: no policy snapshot of step 0 (not a demo run directory?)")
    hf_logging.set_verbosity_error()
    before = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        return _train(run_dir, out, options, on_step)
    finally:
        torch.set_num_threads(before)


def _train(
    run_dir: Path,
    out: Path,
    options: OfflineOptions,
    on_step: Callable[[StoreStep], object] | None,
) -> OfflineRun:
    started = time.perf_counter()
    seed, exact = options.seed, options.exact
    # Read-only: the sampler records nothing in the run it reads (record=False); what it
    # consumed and dropped goes to this run's store (_record_consumption).
    source = ReadOnlyStore(run_dir / "store")
    config = RunConfig.from_dict(source.config)
    stored_steps = source.steps(kind="train")
    if not stored_steps:
        raise StoreError(f"{source.uri}: no train steps to train from")
    total = len(stored_steps) if options.steps is None else options.steps
    torch.manual_seed(seed)
    model = tiny_model(config.seed)
    load_model(model, str(snapshot_path(run_dir, 0)))  # the run's starting checkpoint
    store = RolloutStore.create(out / "store", config=config.to_dict(), if_exists="error")
    trainer = MaxEntTrainer(
        model,
        ByT5Tokenizer(),
        store,
        config=config,
        reward_funcs=[accuracy_reward, format_reward],
        run_dir=out if exact else None,
    )
    store = trainer.store
    ctx = validation_context(
        trainer,
        store,
        eval_prompts=0 if exact else options.eval_prompts,
        eval_every=options.eval_every,
        max_new_tokens=config.max_completion_len,
        k=config.num_generations,
    )
    groups = config.prompts_per_step
    fresh, replayed = mix_counts(groups, options.replay_ratio)
    if exact:
        sampler = ReplaySampler(
            source, sampling="sequential", max_staleness=0, epochs=1, record=False
        )
    else:
        # Groups with no reward spread carry no signal: dropped (and recorded as such).
        sampler = ReplaySampler(
            source, batch_groups=replayed, seed=seed, epochs=None, drop_zero_std=True, record=False
        )

    def record(step: int, sampled: SampledBatch) -> None:
        _record_consumption(store, source.uri, step, sampled)

    rows = load_prompts("train")
    random.Random(seed + 1).shuffle(rows)
    done: list[StoreStep] = []

    def load(policy: Any, step: int) -> None:
        load_model(policy, str(snapshot_path(run_dir, step)))

    for step in range(total):
        if should_evaluate(ctx, step):
            evaluate(ctx, step=step)
        if fresh == 0:
            got = train_from_store(
                trainer,
                sampler,
                steps=1,
                start=step,
                load_policy=load if exact else None,
                on_batch=record,
            )
            if not got:
                break
            done.extend(got)
        else:
            chunk = [rows[(step * fresh + i) % len(rows)] for i in range(fresh)]
            done.append(_mixed_step(trainer, sampler, step, chunk, on_batch=record))
        if on_step is not None:
            on_step(done[-1])
    if ctx.evaluation.enabled:
        evaluate(ctx, step=len(done))
    store.checkpoint()
    accuracy = eval_accuracy(store) if ctx.evaluation.enabled else []
    return OfflineRun(store, done, accuracy, time.perf_counter() - started)


def _mixed_step(
    trainer: MaxEntTrainer,
    sampler: ReplaySampler,
    step: int,
    rows: list[dict[str, str]],
    *,
    on_batch: Callable[[int, SampledBatch], None],
) -> StoreStep:
    """One update of fresh groups (generated from ``rows``) mixed with the sampler's."""
    sampled = sampler.sample(current_version=step, step=step)
    if sampled is not None:
        on_batch(step, sampled)
    batch = trainer.step(step, rows, replayed=sampled)
    return StoreStep(
        step=step,
        loss=float(trainer.metrics_records[-1]["loss"]),
        logged_loss=float("nan"),
        stored_steps=sampled.stored_steps if sampled is not None else (),
        num_groups=batch.num_groups + (sampled.num_groups if sampled else 0),
        num_samples=batch.num_samples + (sampled.num_samples if sampled else 0),
        staleness=sampled.staleness(step) if sampled is not None else 0.0,
        dropped=dict(sampled.dropped) if sampled else {},
    )


def _record_consumption(store: RolloutStore, source: str, step: int, sampled: SampledBatch) -> None:
    """The groups of ``sampled`` the update at ``step`` trained on, and those the sampler
    dropped on the way, as ``source_lifecycle`` records of this run's ``store`` (one commit):
    ``lifecycle`` records of the ``source`` store's groups, with its URI."""
    parts = [
        lifecycle_rows(groups, step=step, event="dropped", reason=reason)
        for reason, groups in sampled.dropped_groups.items()
    ]
    if sampled.num_groups:
        keys = [c for c in (*R.ROW_KEY, "stream_index") if c in sampled.groups.schema.names]
        taken = pa.Table.from_batches([sampled.groups.select(keys)])
        parts.append(lifecycle_rows(taken, step=step, event="trained"))
    if not parts:
        return
    rows = pa.concat_tables(parts, promote_options="default")
    rows = rows.append_column("source", pa.repeat(pa.scalar(source, pa.string()), rows.num_rows))
    store.append_records(SOURCE_LIFECYCLE, rows)
