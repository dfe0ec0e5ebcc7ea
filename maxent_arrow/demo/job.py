"""The main job end to end: what ``make demo`` (``maxent-arrow demo``) runs.

1. **Train**: a seeded tiny GPT-2 (built from a config, no download) and the file-free
   ``ByT5Tokenizer`` learn the shipped arithmetic prompts (``data/arithmetic_train.jsonl``) with
   MaxEnt-GRPO: K sampled completions per prompt, accuracy and format rewards, reference
   log-probs from a frozen copy of the initial model, one ``accelerate`` update per step, and
   every step appended to a rollout store with its losses and diagnostics.
2. **Evaluate** every N steps through ``ValidationContext``: greedy completions of held-out
   prompts, stored in the run as eval steps.
3. **Replay** offline: every saved step is read back, re-scored with the policy snapshot of that
   step, and its recomputed loss is checked against the logged one.
4. **Report**: plots, an HTML page and a Markdown summary of the run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import ByT5Tokenizer
from transformers.utils import logging as hf_logging

from maxent_arrow.analytics import build_report
from maxent_arrow.demo.model import tiny_model
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import RolloutStore
from maxent_arrow.train import (
    MaxEntTrainer,
    evaluate,
    greedy_generator,
    replay_losses,
    should_evaluate,
    snapshot_loader,
)
from maxent_arrow.types import (
    EvaluationSettings,
    GenerationSettings,
    LoggingHandles,
    RewardSpec,
    ValidationContext,
)

__all__ = ["demo_config", "load_prompts", "main", "run"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
REPLAY_TOLERANCE = 1e-5


def load_prompts(split: str = "train", *, limit: int | None = None) -> list[dict[str, str]]:
    """Rows ``{"prompt", "answer"}`` of the shipped arithmetic set (``train`` or ``eval``)."""
    path = DATA_DIR / f"arithmetic_{split}.jsonl"
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return rows[:limit] if limit is not None else rows


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maxent-arrow demo",
        description="Train a tiny model with MaxEnt-GRPO through the store, evaluate, replay "
        "offline and report.",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory")
    parser.add_argument("--steps", type=_count(1), default=48, help="training steps")
    parser.add_argument("--prompts", type=_count(1), default=8, help="prompt groups per step")
    parser.add_argument("--k", type=_count(1), default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=_count(1), default=8, help="completion token cap")
    parser.add_argument("--eval-every", type=_count(1), default=12, help="evaluate every N steps")
    parser.add_argument("--eval-prompts", type=_count(0), default=64, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-report", action="store_true", help="skip the plotted report")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _prepare_run_dir(out: Path) -> None:
    """A fresh run directory; an earlier demo run there is replaced, anything else refused."""
    if out.exists() and any(out.iterdir()):
        if not (out / "store" / "manifest.json").exists():
            raise SystemExit(f"error: {out} exists and is not a maxent-arrow demo run; pick --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's settings: MaxEnt weights with τ = 0.5 and β = 0.05, q at T_q = 0.5, an
    accuracy and a format reward weighted 1 and 0.5."""
    return RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        tau=0.5,
        beta=0.05,
        q_temperature=0.5,
        num_generations=args.k,
        prompts_per_step=args.prompts,
        max_prompt_len=32,
        max_completion_len=args.max_new_tokens,
        learning_rate=3e-3,
        seed=args.seed,
    )


def _validation_context(args, trainer: MaxEntTrainer, store: RolloutStore, eval_log: dict):
    """The seed's ``ValidationContext`` for greedy evaluation of held-out prompts."""
    config = trainer.config
    return ValidationContext(
        evaluation=EvaluationSettings(
            enabled=args.eval_prompts > 0,
            rows=load_prompts("eval", limit=args.eval_prompts),
            batch_size=32,
            every_n_steps=args.eval_every,
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
            max_new_tokens=args.max_new_tokens,
            max_prompt_len=config.max_prompt_len,
        ),
        logging=LoggingHandles(log_metrics=lambda m, s: eval_log.__setitem__(s, m), store=store),
        generation=GenerationSettings(
            max_prompt_len=config.max_prompt_len,
            max_completion_len=args.max_new_tokens,
            num_generations=args.k,
        ),
    )


def _train(args, trainer: MaxEntTrainer, ctx: ValidationContext) -> list[float]:
    """Train ``args.steps`` steps, evaluating every ``args.eval_every``; the train rewards."""
    train_rows = load_prompts("train")
    random.Random(args.seed).shuffle(train_rows)
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=args.quiet, file=sys.stdout)
    rewards: list[float] = []
    for step in range(args.steps):
        if should_evaluate(ctx, step):
            evaluate(ctx, step=step)
        first = (step * args.prompts) % len(train_rows)
        rows = (train_rows * 2)[first : first + args.prompts]
        batch = trainer.step(step, rows)
        computation = batch.reward_computation
        assert computation is not None  # a trained step stores its rewards
        rewards.append(computation.train_reward_mean)
        scalars = batch.loss_scalars
        assert scalars is not None  # and its loss
        bar.set_postfix(reward=f"{rewards[-1]:.3f}", loss=f"{scalars.total_loss:.3f}")
        bar.update(1)
    bar.close()
    if ctx.evaluation.enabled:
        evaluate(ctx, step=args.steps)
    return rewards


def _replay(args, store: RolloutStore) -> list:
    """Every saved step re-scored with its snapshot, its loss recomputed."""
    steps = replay_losses(store, snapshot_loader(args.out, lambda: tiny_model(args.seed)))
    bar = tqdm(steps, total=args.steps, desc="replay", unit="step", disable=args.quiet)
    return list(bar)


def run(args: argparse.Namespace) -> dict:
    """Run the four stages; returns the figures the summary prints."""
    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    _prepare_run_dir(args.out)
    config = demo_config(args)
    store = RolloutStore.create(args.out / "store", config=config.to_dict())
    trainer = MaxEntTrainer(
        tiny_model(args.seed),
        ByT5Tokenizer(),
        store,
        config=config,
        reward_funcs=[accuracy_reward, format_reward],
        run_dir=args.out,
    )
    eval_log: dict[int, dict[str, float]] = {}
    ctx = _validation_context(args, trainer, store, eval_log)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    rewards = _train(args, trainer, ctx)
    timings["train"] = time.perf_counter() - started
    started = time.perf_counter()
    replayed = _replay(args, store)
    timings["replay"] = time.perf_counter() - started
    report = None
    if not args.no_report:
        started = time.perf_counter()
        report = build_report(args.out / "store", args.out / "report", progress=not args.quiet)
        timings["report"] = time.perf_counter() - started
    return {
        "rewards": rewards,
        "eval": eval_log,
        "replayed": replayed,
        "report": report,
        "timings": timings,
        "store": store,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = run(args)
    replayed = result["replayed"]
    worst = max((r.loss_error for r in replayed), default=0.0)
    worst_weight = max((r.max_weight_error for r in replayed), default=0.0)
    store_dir = args.out / "store"
    t = result["timings"]
    rewards = result["rewards"]
    print()
    print(
        f"trained {args.steps} steps x {args.prompts} prompts x {args.k} completions "
        f"in {t['train']:.1f}s; train reward {rewards[0]:.3f} (step 0) -> {rewards[-1]:.3f}"
    )
    for step, metrics in sorted(result["eval"].items()):
        print(
            f"  eval at step {step:3d}: reward {metrics['eval/reward_mean']:.3f}  "
            f"accuracy {metrics.get('eval/accuracy', 0.0):.3f}"
        )
    print(
        f"replayed {len(replayed)} steps offline in {t['replay']:.1f}s: recomputed losses "
        f"equal the logged ones (max relative error {worst:.2e}; advantages, q and weights "
        f"recomputed within {worst_weight:.1e})"
    )
    print()
    print(f"run:      {store_dir}")
    print(f"snapshot: {args.out / 'snapshots'}")
    if result["report"] is not None:
        print(f"report:   {result['report'].html}  (summary: {result['report'].markdown})")
    print()
    print("query it:")
    print(f"  maxent-arrow inspect {store_dir}")
    print(
        f'  maxent-arrow query {store_dir} "SELECT step, avg(total_util) AS reward '
        "FROM samples WHERE kind = 'train' GROUP BY step ORDER BY step\""
    )
    print(
        f"  python -c \"import maxent_arrow as ma; print(ma.RolloutStore('{store_dir}')"
        ".sql('SELECT count(*) FROM groups'))\""
    )
    if worst > REPLAY_TOLERANCE or worst_weight > REPLAY_TOLERANCE:
        print(f"error: offline replay differs from the logged run (> {REPLAY_TOLERANCE})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
