"""The stages of the demo, in the order :func:`maxent_arrow.demo.job.run` runs them.

1. **Warm start**: a seeded tiny GPT-2 (:mod:`.model`) fine-tuned on the shipped
   demonstrations (``data/arithmetic_sft.jsonl``, a careless teacher's, see
   ``data/make_prompts.py``) by :func:`~maxent_arrow.train.supervised_warm_start`, as RL
   recipes start from an SFT model. The frozen reference is this warm-started model.
2. **Train** with MaxEnt-GRPO on the RL prompts (``data/arithmetic_train.jsonl``): K sampled
   completions per prompt, accuracy and format rewards, one update per step, every step
   appended to the store; **evaluate** every N steps through ``ValidationContext``: greedy
   completions of the held-out prompts (``data/arithmetic_eval.jsonl``), stored as eval steps.
3. **Replay** offline: every saved step re-scored with the policy snapshot of that step, its
   loss recomputed and compared with the logged one.
4. **Report**: plots, an HTML page and a Markdown summary.

Then :func:`run_figures` reads the figures the closing lines print back from the store's SQL
views, as anyone could.

This module imports torch and transformers; :mod:`.job` (argument parsing) imports it only
when a run starts, so ``maxent-arrow demo --help`` stays fast.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import ByT5Tokenizer
from transformers.utils import logging as hf_logging

from maxent_arrow.analytics import build_report
from maxent_arrow.demo.model import tiny_model
from maxent_arrow.demo.offline import (
    OfflineOptions,
    OfflineRun,
    train_offline,
    validation_context,
)
from maxent_arrow.demo.prompts import load_prompts
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.errors import StoreError
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import RolloutStore
from maxent_arrow.train import (
    MaxEntTrainer,
    ReplayedStep,
    WarmStartOptions,
    evaluate,
    replay_losses,
    should_evaluate,
    snapshot_loader,
    supervised_warm_start,
)
from maxent_arrow.types import ValidationContext

__all__ = ["RunFigures", "run_figures", "run_stages"]

# The supervised pass: batch and learning rate of the warm start (AdamW, linear decay to 0).
SFT_BATCH = 64
SFT_LEARNING_RATE = 3e-3


@dataclass(frozen=True)
class RunFigures:
    """What the closing lines print, read back from the store's SQL views.

    ``eval``: per eval step ``(step, accuracy, format, correct, well_formed_wrong,
    malformed)``, greedy completions of the held-out prompts (format is the mean format
    reward; the last three count answers). ``train``: per train step ``(step, accuracy,
    distinct, completions, kl)``: the sampled completions' accuracy, how many distinct
    completion texts the step has, of how many completions (a policy collapsing onto one
    answer shows here: one text for every prompt), and the loss's per-token KL to the
    reference. ``greedy_distinct``: distinct greedy completions at the last eval step.
    """

    eval: list[tuple[int, float, float, int, int, int]]
    train: list[tuple[int, float, int, int, float]]
    greedy_distinct: int


def run_figures(store: RolloutStore) -> RunFigures:
    """The figures of a demo run, by SQL over its store (``samples`` and ``steps`` views)."""
    eval_rows = store.sql(
        "SELECT step, avg(reward_accuracy) AS accuracy, avg(reward_format) AS format, "
        "count(*) FILTER (WHERE reward_accuracy = 1) AS correct, "
        "count(*) FILTER (WHERE reward_accuracy = 0 AND reward_format = 1) AS wrong, "
        "count(*) FILTER (WHERE reward_format < 1) AS malformed "
        "FROM samples WHERE kind = 'eval' GROUP BY step ORDER BY step"
    ).to_pylist()
    train_rows = store.sql(
        "SELECT s.step, s.accuracy, s.distinct_texts, s.completions, t.kl_loss FROM ("
        "  SELECT step, avg(reward_accuracy) AS accuracy, "
        "  count(DISTINCT completion) AS distinct_texts, count(*) AS completions "
        "  FROM samples WHERE kind = 'train' GROUP BY step"
        ") s JOIN (SELECT step, avg(kl_loss) AS kl_loss FROM steps WHERE kind = 'train' "
        "GROUP BY step) t USING (step) ORDER BY s.step"
    ).to_pylist()
    last = eval_rows[-1]["step"] if eval_rows else None
    distinct = 0
    if last is not None:
        distinct = store.sql(
            "SELECT count(DISTINCT completion) AS n FROM samples "
            f"WHERE kind = 'eval' AND step = {int(last)}"
        ).to_pylist()[0]["n"]
    return RunFigures(
        eval=[
            (r["step"], r["accuracy"], r["format"], r["correct"], r["wrong"], r["malformed"])
            for r in eval_rows
        ],
        train=[
            (r["step"], r["accuracy"], r["distinct_texts"], r["completions"], r["kl_loss"])
            for r in train_rows
        ],
        greedy_distinct=int(distinct),
    )


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's settings: MaxEnt weights with τ = 0.5 and β = 0.01 over q at T_q = 0.5, an
    accuracy and a format reward weighted 1 and 0.5, AdamW at 3e-4.

    With these, a correct answer outweighs a well-formed wrong one in its group by
    e^{(1/T_q)(1/τ)} ≈ 55 (w ∝ q^{1/τ}, q ∝ e^{U/T_q}), so each group's update imitates its
    correct samples; the small learning rate keeps the sampled answers diverse (the steps
    must not collapse the policy onto one string). The warm start goes to ``extra``.
    """
    return RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        tau=0.5,
        beta=0.01,
        q_temperature=0.5,
        num_generations=args.k,
        prompts_per_step=args.prompts,
        max_prompt_len=16,
        max_completion_len=args.max_new_tokens,
        learning_rate=3e-4,
        seed=args.seed,
        extra={
            "warm_start": {
                "demonstrations": "data/arithmetic_sft.jsonl",
                "steps": args.sft_steps,
                "batch_size": SFT_BATCH,
                "learning_rate": SFT_LEARNING_RATE,
            }
        },
    )


def _progress(args: argparse.Namespace, stream: Any) -> bool:
    """Progress bars on ``stream`` only where a person watches it: a terminal, without
    ``--quiet`` (into a pipe or a file tqdm would write every redraw)."""
    return not args.quiet and stream.isatty()


def _bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    shown = _progress(args, sys.stdout)
    return tqdm(total=total, desc=desc, unit="step", disable=not shown, file=sys.stdout)


def warm_start(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, Any]:
    """Fine-tune ``model`` on the shipped demonstrations: how many there were, how many of
    them are wrong, and the seconds it took."""
    rows = load_prompts("sft")
    started = time.perf_counter()
    with _bar(args, args.sft_steps, "warm start") as bar:

        def on_step(_step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)

        supervised_warm_start(
            model,
            tokenizer,
            [r["prompt"] for r in rows],
            [r["completion"] for r in rows],
            options=WarmStartOptions(
                steps=args.sft_steps,
                batch_size=SFT_BATCH,
                learning_rate=SFT_LEARNING_RATE,
                max_prompt_len=16,
                seed=args.seed,
            ),
            on_step=on_step,
        )
    return {
        "demonstrations": len(rows),
        "wrong": sum(r["completion"] != r["answer"] for r in rows),
        "seconds": time.perf_counter() - started,
    }


def _validation_context(args, trainer: MaxEntTrainer, store: RolloutStore) -> ValidationContext:
    """The seed's ``ValidationContext`` for greedy evaluation of held-out prompts; the
    results go to the store only (the closing lines read them back from there)."""
    return validation_context(
        trainer,
        store,
        eval_prompts=args.eval_prompts,
        eval_every=args.eval_every,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
    )


def resume_point(out: Path) -> int:
    """Where a run in ``out`` resumes: the last step whose policy snapshot was saved (the
    weights before that step's update; a kill after it lost at most that step)."""
    steps = sorted(
        int(p.name.removeprefix("step-").removesuffix(".safetensors"))
        for p in (out / "snapshots").glob("step-*.safetensors")
    )
    if not steps:
        raise StoreError(f"{out}: no policy snapshot to resume from")
    return steps[-1]


def _train(args, trainer: MaxEntTrainer, ctx: ValidationContext, *, start: int = 0) -> None:
    """Train steps ``start`` to ``args.steps`` on the RL prompts (a seeded shuffle, taken in
    turn: step ``s`` always trains on the same prompts), evaluating before step 0 (the warm
    start), every ``args.eval_every`` steps, and at the end."""
    rows = load_prompts("train")
    random.Random(args.seed).shuffle(rows)
    with _bar(args, args.steps - start, "train") as bar:
        for step in range(start, args.steps):
            if should_evaluate(ctx, step):
                evaluate(ctx, step=step)
            first = step * args.prompts
            batch = trainer.step(step, [rows[(first + i) % len(rows)] for i in range(args.prompts)])
            computation, scalars = batch.reward_computation, batch.loss_scalars
            assert computation is not None and scalars is not None  # a trained step has both
            accuracy = computation.per_reward_values["accuracy"]
            bar.set_postfix(
                accuracy=f"{sum(accuracy) / len(accuracy):.2f}", loss=f"{scalars.total_loss:.3f}"
            )
            bar.update(1)
    if ctx.evaluation.enabled:
        evaluate(ctx, step=args.steps)


def _replay(args, out: Path, store: RolloutStore) -> list[ReplayedStep]:
    """Every saved step re-scored with its snapshot, its loss recomputed."""
    replayed = []
    with _bar(args, args.steps, "replay") as bar:
        for step in replay_losses(store, snapshot_loader(out, lambda: tiny_model(args.seed))):
            replayed.append(step)
            bar.update(1)
    return replayed


def _offline_label(args: argparse.Namespace) -> str:
    ratio = getattr(args, "replay_ratio", 1.0)
    if ratio >= 1:
        return "offline, from the stored rollouts"
    return f"{100 * ratio:.0f}% replayed groups"


def _offline(args: argparse.Namespace, out: Path) -> OfflineRun | None:
    """A second policy trained from this run's stored rollouts (offline, or with a share of
    replayed groups), from the same warm start, evaluated on the same held-out prompts."""
    steps = getattr(args, "offline_steps", None)
    steps = max(1, args.steps // 2) if steps is None else steps
    if not steps:
        return None
    target, n = out / "offline", 1
    while target.exists():  # a resumed run trains its second policy again, beside the first
        n += 1
        target = out / f"offline-{n}"
    with _bar(args, steps, "from the store") as bar:
        options = OfflineOptions(
            steps=steps,
            replay_ratio=getattr(args, "replay_ratio", 1.0),
            seed=args.seed,
            eval_prompts=args.eval_prompts,
            eval_every=args.eval_every,
            threads=args.threads,
        )
        return train_offline(out, target, options, on_step=lambda _: bar.update(1))


def run_stages(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Warm start, train and evaluate, replay, report, into the run directory ``out``
    (which exists and is empty); returns what the closing lines print."""
    hf_logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        torch.manual_seed(args.seed)
        timings: dict[str, float] = {}
        tokenizer = ByT5Tokenizer()
        config = demo_config(args)
        resumed_at = resume_point(out) if args.resume else None
        if resumed_at is None:
            model, reference = tiny_model(args.seed), None
            sft = warm_start(args, model, tokenizer)
            store = RolloutStore.create(out / "store", config=config.to_dict(), if_exists="error")
        else:
            # The policy as it was before step `resumed_at`'s update, the reference as the
            # run's first snapshot (the warm-started model), the store as a resumed attempt.
            load = snapshot_loader(out, lambda: tiny_model(args.seed))
            model = copy.deepcopy(load(resumed_at)).train()
            reference = copy.deepcopy(load(0))
            sft = {"demonstrations": 0, "wrong": 0, "seconds": 0.0}
            store = RolloutStore(out / "store")
        timings["warm start"] = sft.pop("seconds")
        trainer = MaxEntTrainer(
            model,
            tokenizer,
            store,
            config=config,
            reward_funcs=[accuracy_reward, format_reward],
            run_dir=out,
            resume_from=resumed_at,
            reference=reference,
        )
        store = trainer.store  # the run's attempt: evaluations and reads go through it
        ctx = _validation_context(args, trainer, store)
        started = time.perf_counter()
        _train(args, trainer, ctx, start=resumed_at or 0)
        store.checkpoint()  # the log's live files, for plain readers of the run
        timings["train"] = time.perf_counter() - started
        started = time.perf_counter()
        replayed = _replay(args, out, store)
        timings["replay"] = time.perf_counter() - started
        offline = _offline(args, out)
        if offline is not None:
            timings["offline"] = offline.seconds
        report = None
        if not args.no_report:
            started = time.perf_counter()
            compare = None if offline is None else {_offline_label(args): offline.store.root}
            report = build_report(
                out / "store",
                out / "report",
                progress=_progress(args, sys.stderr),
                compare=compare,
            )
            timings["report"] = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return {
        "warm_start": sft,
        "config": config,
        "figures": run_figures(store),
        "replayed": replayed,
        "offline": offline,
        "report": report,
        "timings": timings,
        "store": store,
        "resumed_at": resumed_at,
    }
