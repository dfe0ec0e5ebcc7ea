"""The report's summary: facts about the run, its config, and the start, peak and end of each
per-step figure, with human labels and units.

Every number comes from a ready-made query's table (:mod:`~maxent_arrow.analytics.queries`,
whose statistics are defined in ``docs/formulas.md`` §5): a figure's *start* is its value at
the first step that has one, its *peak* the highest value (the first step that reaches it,
within a relative 1e-9: :data:`PEAK_RTOL`), its *end* the value at the last step that has
one. Steps where a figure has no value (NULL, NaN: nothing scored, a column not recorded) are
left out, never read as 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arguments import is_int

__all__ = [
    "PEAK_RTOL",
    "Fact",
    "Summary",
    "Trend",
    "loss_label",
    "summarize",
    "tokenizer_text",
    "trend",
]

# Values within this (relative, at least absolute for |x| < 1) of the highest are the peak.
PEAK_RTOL = 1e-9


@dataclass(frozen=True)
class Fact:
    """One fact about the run: ``value`` a number or text, ``unit`` how to read it."""

    key: str
    label: str
    value: Any
    unit: str = ""


@dataclass(frozen=True)
class Trend:
    """A per-step figure's start, peak (its highest value) and end, each with its step."""

    key: str
    label: str
    unit: str
    start: float
    start_step: int
    peak: float
    peak_step: int
    end: float
    end_step: int
    points: int


@dataclass
class Summary:
    """What the report's summary says (``summary.json`` is :meth:`to_json`)."""

    facts: list[Fact] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    config_step: int | None = None
    config_changed: list[str] = field(default_factory=list)
    trends: list[Trend] = field(default_factory=list)
    # Damaged files left out of every figure (``on_error="skip"``), one message each.
    left_out: list[str] = field(default_factory=list)
    # What the run did not record, and so what the report cannot show: part -> why.
    absent: dict[str, str] = field(default_factory=dict)

    def fact(self, key: str) -> Fact:
        return next(f for f in self.facts if f.key == key)

    def trend(self, key: str) -> Trend:
        return next(t for t in self.trends if t.key == key)

    def to_json(self) -> dict[str, Any]:
        return {
            "facts": {
                f.key: {"label": f.label, "value": f.value, "unit": f.unit} for f in self.facts
            },
            "config": self.config,
            "config_step": self.config_step,
            "config_changed": self.config_changed,
            "trends": {
                t.key: {k: v for k, v in asdict(t).items() if k != "key"} for t in self.trends
            },
            "left_out": self.left_out,
            "absent": self.absent,
        }


def trend(key: str, label: str, unit: str, steps: Any, values: Any) -> Trend | None:
    """The :class:`Trend` of ``values`` over ``steps`` (NULL and NaN left out); ``None``
    when no step has a value."""
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(v) & np.isfinite(s)
    if not keep.any():
        return None
    s, v = s[keep], v[keep]
    # The first step that reaches the peak, within PEAK_RTOL: a figure that stays level
    # (a ratio of sums computed per step) differs in its last bits from step to step, and the
    # peak is then where it starts, not where rounding put the largest value.
    top = float(v.max())
    at = int(np.argmax(v >= top - PEAK_RTOL * max(1.0, abs(top))))
    return Trend(
        key, label, unit,
        float(v[0]), int(s[0]), float(v[at]), int(s[at]), float(v[-1]), int(s[-1]), int(v.size),
    )  # fmt: skip


def _column(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _from(table: pa.Table | None, column: str, key: str, label: str, unit: str) -> Trend | None:
    if table is None or table.num_rows == 0 or column not in table.column_names:
        return None
    return trend(key, label, unit, _column(table, "step"), _column(table, column))


def loss_label(column: str) -> str:
    """A loss component's name for a reader: ``kl_loss`` -> ``KL (unweighted)``."""
    part = column.removesuffix("_loss")
    return {"kl": "KL (unweighted)", "weighted_kl": "KL × β"}.get(part, part.replace("_", " "))


def _reward_label(reward: str) -> str:
    return "Reward U (weighted total)" if reward == "total_utils" else f"Reward “{reward}”"


def _reward_trends(curve: pa.Table | None, prefix: str, what: str) -> list[Trend]:
    if curve is None or curve.num_rows == 0:
        return []
    out = []
    for reward in dict.fromkeys(curve.column("reward").to_pylist()):
        part = curve.filter(pc.equal(curve.column("reward"), reward))
        made = trend(
            f"{prefix}.{reward}",
            f"{what}{_reward_label(reward)}, mean",
            "reward",
            _column(part, "step"),
            _column(part, "mean"),
        )
        if made is not None:
            out.append(made)
    return out


def tokenizer_text(value: Any) -> str | None:
    """A recorded tokenizer identity (``RunConfig.tokenizer``: class, name or path, vocabulary
    size) as one phrase, ``"ByT5Tokenizer google/byt5-small (vocabulary 384)"``; ``None`` when
    nothing was recorded (the report and ``inspect`` both say it this way)."""
    if isinstance(value, Mapping) and value:
        kind = value.get("class")
        name = value.get("name_or_path") or value.get("name")
        words = [str(w) for w in dict.fromkeys((kind, name)) if w]
        size = value.get("vocab_size")
        if is_int(size) and int(size) > 0:
            words.append(f"(vocabulary {size:,})")
        return " ".join(words) or None
    if isinstance(value, str) and value:
        return value
    return None


def _rewards(config: Mapping[str, Any], names: Sequence[str]) -> str:
    listed = [str(n) for n in (config.get("reward_names") or names)]
    given = config.get("reward_weights")
    # A RunConfig lists the weights in the names' order; older configs map name -> weight.
    if isinstance(given, Mapping):
        weights = [given.get(n) for n in listed]
    elif isinstance(given, list | tuple) and len(given) == len(listed):
        weights = list(given)
    else:
        weights = [None] * len(listed)
    if not listed:
        return "none"
    return ", ".join(
        f"{n} (weight {w:g})" if isinstance(w, int | float) and not isinstance(w, bool) else n
        for n, w in zip(listed, weights)
    )


def _trainer_trends(trainer: pa.Table | None, made: Sequence[Trend]) -> list[Trend | None]:
    """The loss and KL the trainer logged (``trainer_curve``: trainer_metrics, the mean over
    a stored step's updates), for a run whose step rows hold none (TRL's)."""
    if trainer is None or trainer.num_rows == 0:
        return []
    steps = _column(trainer, "step")
    out: list[Trend | None] = []
    for column, key, label, unit, own in (
        ("loss", "loss.trainer", "Loss (the trainer's log, mean over a step's updates)",
         "loss", "loss."),
        ("kl", "kl.trainer", "KL to the reference (the trainer's log)", "nats/token",
         "kl_value"),
    ):  # fmt: skip
        if any(t.key.startswith(own) for t in made):
            continue  # the step rows hold it
        values = _column(trainer, column)
        keep = np.isfinite(values)
        at, where = np.unique(steps[keep], return_inverse=True)
        if not len(at):
            continue
        means = np.bincount(where, weights=values[keep]) / np.bincount(where)
        out.append(trend(key, label, unit, at, means))
    return out


def summarize(
    info: Mapping[str, Any],
    config: Mapping[str, Any],
    tables: Mapping[str, pa.Table],
    *,
    threshold: float,
    ks: Sequence[int],
    left_out: Sequence[str] = (),
    absent: Mapping[str, str] | None = None,
) -> Summary:
    """The summary of a run from ``describe()`` (``info``), ``run_config()`` (``config``) and
    the report's tables (by name: ``reward``, ``eval_reward``, ``success``, ``zero_variance``,
    ``lengths``, ``losses``, ``policy_entropy``, ``distinct``, ``group_entropy``,
    ``unscored``, ``counts``; a missing one is a part the run did not record)."""
    kinds = info.get("kinds", {})
    train, evals = kinds.get("train", {}), kinds.get("eval", {})
    cfg: Mapping[str, Any] = config.get("config") or {}
    unscored = tables.get("unscored")
    n_unscored = 0
    if unscored is not None and unscored.num_rows:
        mine = unscored.filter(pc.equal(unscored.column("reward"), "total_utils"))
        n_unscored = int(pc.sum(mine.column("unscored")).as_py() or 0)
    # Groups and completions as read (a damaged file skipped is not counted); the step rows'
    # counts when the group rows could not be counted.
    counts = tables.get("counts")
    if counts is not None:
        read = {r["kind"]: r for r in counts.to_pylist()}.get("train", {})
        train = {**train, "groups": read.get("groups"), "samples": read.get("completions")}
    first, last = train.get("first"), train.get("last")
    facts = [
        Fact("run", "Run", str(info.get("root"))),
        Fact("created", "Created", info.get("created_at") or "not recorded"),
        Fact("trainer", "Trainer", cfg.get("trainer") or "not recorded"),
        Fact("model", "Model", cfg.get("model") or "not recorded"),
        Fact("tokenizer", "Tokenizer", tokenizer_text(cfg.get("tokenizer")) or "not recorded"),
        Fact("ranks", "Ranks (processes)", len(info.get("ranks") or []), "ranks"),
        Fact(
            "train_steps",
            "Train steps" + (f" ({first} to {last})" if first is not None else ""),
            int(train.get("steps") or 0),
            "steps",
        ),
        Fact("eval_steps", "Eval steps", int(evals.get("steps") or 0), "steps"),
        Fact("train_groups", "Prompt groups trained on", int(train.get("groups") or 0), "groups"),
        Fact(
            "train_completions",
            "Completions trained on",
            int(train.get("samples") or 0),
            "completions",
        ),
        Fact("unscored", "Completions no reward function scored", n_unscored, "completions"),
        Fact(
            "reward_functions",
            "Reward functions",
            _rewards(cfg, info.get("reward_functions") or []),
        ),
        Fact("bytes", "Size on disk", int(sum((info.get("bytes") or {}).values())), "bytes"),
    ]
    trends: list[Trend | None] = []
    trends += _reward_trends(tables.get("reward"), "reward", "")
    trends += _reward_trends(tables.get("eval_reward"), "eval", "Eval: ")
    success = tables.get("success")
    trends.append(_from(success, "success_rate", "success_rate",
                        f"Completions that succeed (U > {threshold:g})", "%"))  # fmt: skip
    trends.append(_from(success, "group_success_rate", "group_success_rate",
                        "Groups with a success", "%"))  # fmt: skip
    trends += [_from(success, f"pass_at_{k}", f"pass_at_{k}", f"pass@{k}", "%") for k in ks]
    trends.append(_from(tables.get("zero_variance"), "frac_zero_variance", "zero_variance",
                        "Groups with no reward spread (no learning signal)", "%"))  # fmt: skip
    lengths = tables.get("lengths")
    trends.append(_from(lengths, "mean_length", "mean_length", "Completion length, mean", "tokens"))
    trends.append(_from(lengths, "clipped_frac", "clipped_frac",
                        "Completions cut at the length cap", "%"))  # fmt: skip
    losses = tables.get("losses")
    for column in losses.column_names if losses is not None else []:
        if column.endswith("_loss"):
            trends.append(
                _from(losses, column, f"loss.{column}", f"Loss: {loss_label(column)}", "loss")
            )
    trends.append(_from(losses, "kl_value", "kl_value", "KL to the reference, per token",
                        "nats/token"))  # fmt: skip
    trends += _trainer_trends(tables.get("trainer"), [t for t in trends if t is not None])
    trends.append(_from(tables.get("policy_entropy"), "entropy_per_token", "policy_entropy",
                        "Policy entropy, per token", "nats/token"))  # fmt: skip
    trends.append(_from(tables.get("distinct"), "distinct_frac", "distinct_completions",
                        "Distinct completions in a group (share of K)", "%"))  # fmt: skip
    group_entropy = tables.get("group_entropy")
    trends.append(_from(group_entropy, "q_entropy_mean", "q_entropy",
                        "Entropy of q within a group (ln K: uniform)", "nats"))  # fmt: skip
    trends.append(_from(group_entropy, "weight_entropy_mean", "weight_entropy",
                        "Entropy of the MaxEnt weights within a group", "nats"))  # fmt: skip
    return Summary(
        facts=facts,
        config=dict(cfg),
        config_step=config.get("step"),
        config_changed=list(config.get("changed") or []),
        trends=[t for t in trends if t is not None],
        left_out=list(left_out),
        absent=dict(absent or {}),
    )
