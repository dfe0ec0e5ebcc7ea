"""The report's plots: one full-width PNG each, drawn from the ready-made queries' tables.

Each ``plot_*`` function takes the tables it draws and the output directory and returns the
PNG it wrote, or, when the run holds nothing to draw, the reason as a string (the report
lists it). Figures are 1200 px wide at 100 dpi, sized for a page read at 1280 px, with the
legend outside the axes so that it never hides a curve.

matplotlib's Agg canvas is used directly (no pyplot, no global backend switch): headless, and
a caller's matplotlib state is left alone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.analytics.summary import loss_label
from maxent_arrow.errors import MissingExtraError

__all__ = [
    "plot_compare",
    "reward_band",
    "WIDTH_PX",
    "plot_advantages",
    "plot_eval",
    "plot_exploration",
    "plot_group_entropy",
    "plot_kl",
    "plot_lengths",
    "plot_losses",
    "plot_rewards",
    "plot_success",
]

WIDTH_PX = 1200
_DPI = 100
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 10, "frameon": False}
# One colour per series name across every plot (a reward function keeps its colour).
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip


def _figure(title: str, *, panels: int = 1, height: float = 4.4) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise MissingExtraError("matplotlib", "analytics") from None
    fig = Figure(figsize=(WIDTH_PX / _DPI, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    fig.suptitle(title, fontsize=13)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=10)
    return fig, axes


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _np(table: pa.Table, name: str) -> np.ndarray:
    """A column as float64 with nulls as NaN (matplotlib leaves gaps there)."""
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _has_values(table: pa.Table, name: str) -> bool:
    return name in table.column_names and bool(np.isfinite(_np(table, name)).any())


def _colour(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _marker(n: int) -> str | None:
    return "." if n < 60 else None


def _reward_names(curve: pa.Table) -> list[str]:
    return list(dict.fromkeys(curve.column("reward").to_pylist()))


def _label(reward: str) -> str:
    return "U (weighted total)" if reward == "total_utils" else reward


def reward_band(part: pa.Table, *, discrete: bool) -> tuple[np.ndarray, np.ndarray, str]:
    """The band drawn around one reward's mean per step (``part``: its rows of
    ``reward_curve``): ``(low, high, what it is)``.

    A reward of many values: the 5-95 % quantiles of the step's completions (their spread).
    A reward of few values (``discrete``: 0/1 correctness, a sum of such): the 95 % interval
    of the step's mean, mean ± 1.96 std / √n. The quantiles of a discrete reward are its
    values themselves, and jump: the 5 % quantile of a 0/1 reward is 0 while more than 5 %
    of the completions fail and 1 once fewer do, so a run near 95 % accuracy drew a band
    that flickered between the full height and nothing from one step to the next."""
    if not discrete:
        return _np(part, "p05"), _np(part, "p95"), "5-95 % of the completions"
    mean, std, n = _np(part, "mean"), _np(part, "std"), _np(part, "n")
    with np.errstate(invalid="ignore", divide="ignore"):
        half = 1.96 * std / np.sqrt(n)
    low, high = np.maximum(mean - half, _np(part, "min")), np.minimum(mean + half, _np(part, "max"))
    return low, high, "95 % interval of the mean"


def plot_rewards(curve: pa.Table, out: Path, *, discrete: Collection[str] = ()) -> Path | str:
    """Mean reward per train step, one line per reward function and the total U, with a
    band each (:func:`reward_band`: the spread of a continuous reward, the uncertainty of
    the mean of one of few values, those in ``discrete``)."""
    if curve.num_rows == 0:
        return "no scored train completions"
    fig, (ax,) = _figure("Reward per train step: mean, with its band")
    for i, reward in enumerate(_reward_names(curve)):
        part = curve.filter(pc.equal(curve.column("reward"), reward))
        steps = _np(part, "step")
        ax.plot(steps, _np(part, "mean"), color=_colour(i), marker=_marker(len(steps)),
                label=f"{_label(reward)}: mean")  # fmt: skip
        low, high, what = reward_band(part, discrete=reward in discrete)
        ax.fill_between(steps, low, high, color=_colour(i), alpha=0.12,
                        label=f"{_label(reward)}: {what}")  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("reward", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "reward_curve.png")


def plot_eval(eval_curve: pa.Table, train_curve: pa.Table, out: Path) -> Path | str:
    """Mean reward of each function on the eval steps (solid, markers) beside the same
    function on the train steps (dashed, same colour)."""
    if eval_curve.num_rows == 0:
        return "the run has no eval steps"
    fig, (ax,) = _figure("Eval reward per step (solid) beside the train reward (dashed)")
    names = _reward_names(eval_curve)
    for i, reward in enumerate(names):
        part = eval_curve.filter(pc.equal(eval_curve.column("reward"), reward))
        ax.plot(_np(part, "step"), _np(part, "mean"), color=_colour(i), marker="o",
                label=f"eval {_label(reward)}")  # fmt: skip
        if train_curve.num_rows:
            mine = train_curve.filter(pc.equal(train_curve.column("reward"), reward))
            if mine.num_rows:
                ax.plot(_np(mine, "step"), _np(mine, "mean"), color=_colour(i), linestyle="--",
                        alpha=0.7, label=f"train {_label(reward)}")  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("mean reward", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "eval.png")


def plot_success(
    success: pa.Table, zero: pa.Table, out: Path, *, threshold: float, ks: Sequence[int]
) -> Path | str:
    """Success rate, groups with a success, pass@k and the share of zero-variance groups."""
    if success.num_rows == 0:
        return "no scored train completions"
    fig, (ax,) = _figure(f"Success (U > {threshold:g}) per train step")
    steps = _np(success, "step")
    ax.plot(steps, _np(success, "success_rate"), color=_colour(0), label="completions that succeed")
    ax.plot(steps, _np(success, "group_success_rate"), color=_colour(1),
            label="groups with a success")  # fmt: skip
    for i, k in enumerate(ks):
        ax.plot(steps, _np(success, f"pass_at_{k}"), color=_colour(2 + i), linestyle="--",
                label=f"pass@{k}")  # fmt: skip
    if zero.num_rows:
        ax.plot(_np(zero, "step"), _np(zero, "frac_zero_variance"), color="gray", linestyle=":",
                label="groups with no reward spread\n(no learning signal)")  # fmt: skip
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("fraction", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "success.png")


def _trainer_lines(ax: Any, trainer: pa.Table, column: str, label: str, first: int) -> None:
    """The trainer's logged ``column`` per stored step: one line per update of a round
    (update k of n drawn k/n of the way to the next stored step), never one line joining a
    round's first update to its second."""
    steps, updates, counts = _np(trainer, "step"), _np(trainer, "update"), _np(trainer, "updates")
    values, most = _np(trainer, column), int(np.nanmax(counts)) if trainer.num_rows else 1
    stored = np.unique(steps)
    gap = float(np.min(np.diff(stored))) if len(stored) > 1 else 1.0
    for k in range(1, most + 1):
        pick = updates == k
        x = steps[pick] + (k - 1) * gap / counts[pick]
        name = label if most == 1 else f"{label}, update {k} of {most} per round"
        ax.plot(x, values[pick], color=_colour(first + k - 1), marker=_marker(len(x)), label=name)


def plot_losses(losses: pa.Table, out: Path, trainer: pa.Table | None = None) -> Path | str:
    """The loss components per train step (mean over ranks), each only where recorded; for
    a run whose step rows hold none (TRL's), the loss the trainer logged (``trainer``:
    ``trainer_curve``), one line per update of a round."""
    present = [c for c in losses.column_names if c.endswith("_loss") and _has_values(losses, c)]
    if not present:
        if trainer is None or not _has_values(trainer, "loss"):
            return "the run recorded no loss values"
        fig, (ax,) = _figure("Loss per train step (the trainer's log, trainer_metrics)")
        _trainer_lines(ax, trainer, "loss", "loss (trainer's log)", 0)
        ax.set_xlabel("step", fontsize=11)
        ax.set_ylabel("loss", fontsize=11)
        ax.legend(**_LEGEND)
        return _save(fig, out / "losses.png")
    fig, (ax,) = _figure("Loss components per train step (mean over ranks)")
    steps = _np(losses, "step")
    for i, column in enumerate(present):
        ax.plot(steps, _np(losses, column), color=_colour(i), marker=_marker(len(steps)),
                label=loss_label(column))  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("loss", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "losses.png")


def plot_exploration(policy: pa.Table | None, distinct: pa.Table, out: Path) -> Path | str:
    """Is the policy still exploring? Its entropy per token (left) and the share of distinct
    completions in a group (right): both fall when the policy collapses."""
    has_policy = policy is not None and _has_values(policy, "entropy_per_token")
    if not has_policy and distinct.num_rows == 0:
        return "no policy entropy and no completions"
    fig, (left, right) = _figure(
        "Exploration: policy entropy and distinct completions per train step", panels=2
    )
    if policy is not None and has_policy:
        steps = _np(policy, "step")
        left.plot(steps, _np(policy, "entropy_per_token"), color=_colour(0),
                  marker=_marker(len(steps)), label="policy entropy")  # fmt: skip
        left.set_ylim(bottom=0)
    else:
        left.text(0.5, 0.5, "not recorded by this run\n(no policy_entropy_sum)", ha="center",
                  va="center", transform=left.transAxes, fontsize=12, color="gray")  # fmt: skip
    left.set_title("Policy entropy (nats per token)", fontsize=11)
    left.set_xlabel("step", fontsize=11)
    if distinct.num_rows:
        steps = _np(distinct, "step")
        right.plot(steps, _np(distinct, "distinct_frac"), color=_colour(1),
                   marker=_marker(len(steps)))  # fmt: skip
    right.set_ylim(-0.02, 1.02)
    right.set_title("Distinct completions per group (share of K)", fontsize=11)
    right.set_xlabel("step", fontsize=11)
    return _save(fig, out / "exploration.png")


def plot_group_entropy(ent: pa.Table, out: Path) -> Path | str:
    """Entropy of q and of the MaxEnt weights within a group, against ln K: how evenly each
    group's weight is spread (near ln K by construction), not the policy's entropy."""
    series = [
        (p, label)
        for p, label in (("q_entropy", "q"), ("weight_entropy", "MaxEnt weights"))
        if _has_values(ent, f"{p}_mean")
    ]
    if not series:
        return "the run stored no q-distribution nor MaxEnt weights"
    fig, (ax,) = _figure(
        "Within-group entropy of q and of the MaxEnt weights (nats): near ln K by "
        "construction; not the policy's entropy"
    )
    steps = _np(ent, "step")
    for i, (prefix, label) in enumerate(series):
        ax.plot(steps, _np(ent, f"{prefix}_mean"), color=_colour(i), label=f"{label}: mean")
        ax.fill_between(steps, _np(ent, f"{prefix}_min"), _np(ent, f"{prefix}_max"),
                        color=_colour(i), alpha=0.12, label=f"{label}: min-max")  # fmt: skip
    if "uniform_entropy_mean" in ent.column_names:
        ax.plot(steps, _np(ent, "uniform_entropy_mean"), color="black", linestyle=":",
                label="ln K (uniform)")  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("nats", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "group_entropy.png")


def plot_kl(
    losses: pa.Table, buckets: pa.Table, out: Path, trainer: pa.Table | None = None
) -> Path | str:
    """KL to the reference per token: the step's value and per completion-length bucket; for
    a run whose step rows hold none, the KL the trainer logged (``trainer``)."""
    has_value = _has_values(losses, "kl_value")
    logged = not has_value and trainer is not None and _has_values(trainer, "kl")
    if not has_value and not logged and buckets.num_rows == 0:
        return "the run recorded no KL"
    fig, (ax,) = _figure("KL to the reference model per token, per train step")
    if has_value:
        ax.plot(_np(losses, "step"), _np(losses, "kl_value"), color="black", linewidth=2.2,
                label="all completions")  # fmt: skip
    elif logged and trainer is not None:
        _trainer_lines(ax, trainer, "kl", "KL (trainer's log)", 5)
    order = sorted(
        set(zip(buckets.column("bucket_order").to_pylist(), buckets.column("bucket").to_pylist()))
    )
    for i, (_, bucket) in enumerate(order):
        part = buckets.filter(pc.equal(buckets.column("bucket"), bucket))
        ax.plot(_np(part, "step"), _np(part, "kl_per_token"), color=_colour(i), marker=".",
                alpha=0.8, label=f"length {bucket} tokens")  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("KL per token (nats)", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "kl.png")


def plot_lengths(stats: pa.Table, out: Path) -> Path | str:
    """Completion length (mean, median, p95, max) and the share cut at the length cap."""
    if stats.num_rows == 0:
        return "no completion lengths"
    fig, (ax,) = _figure("Completion length per train step (tokens)")
    steps = _np(stats, "step")
    for i, (column, label, style) in enumerate(
        (
            ("mean_length", "mean", "-"),
            ("p50_length", "median", "--"),
            ("p95_length", "95th percentile", "-."),
            ("max_length", "max", ":"),
        )
    ):
        ax.plot(steps, _np(stats, column), color=_colour(i), linestyle=style, label=label)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("tokens", fontsize=11)
    twin = ax.twinx()
    twin.plot(steps, _np(stats, "clipped_frac"), color=_colour(3), alpha=0.7,
              label="cut at the cap (right axis)")  # fmt: skip
    twin.set_ylabel("fraction cut at the cap", fontsize=11)
    twin.set_ylim(-0.02, 1.02)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels,
              **{**_LEGEND, "bbox_to_anchor": (1.08, 1.0)})  # fmt: skip
    return _save(fig, out / "lengths.png")


def plot_advantages(hist: pa.Table, out: Path) -> Path | str:
    """Histogram of the advantages over every train step."""
    counts = hist.column("count").to_numpy()
    if counts.sum() == 0:
        return "no advantages"
    fig, (ax,) = _figure("Advantage distribution over every train step")
    left, right = hist.column("bin_left").to_numpy(), hist.column("bin_right").to_numpy()
    ax.bar(left, counts, width=right - left, align="edge", color=_colour(0), edgecolor="black",
           linewidth=0.3)  # fmt: skip
    ax.set_xlabel("advantage", fontsize=11)
    ax.set_ylabel("completions", fontsize=11)
    return _save(fig, out / "advantages.png")


def plot_compare(curves: dict[str, pa.Table], out: Path) -> Path | str:
    """The eval reward curves of several runs on one plot, one colour per run, one line style
    per reward function (``curves``: run label -> its ``reward_curve(kind="eval")``)."""
    if not any(curve.num_rows for curve in curves.values()):
        return "no run has eval steps"
    fig, (ax,) = _figure("Eval reward per step of each run")
    styles = ("-", "--", ":", "-.")
    for i, (label, curve) in enumerate(curves.items()):
        for j, reward in enumerate(_reward_names(curve)):
            part = curve.filter(pc.equal(curve.column("reward"), reward))
            ax.plot(_np(part, "step"), _np(part, "mean"), color=_colour(i), marker="o",
                    linestyle=styles[j % len(styles)],
                    label=f"{label}: {_label(reward)}")  # fmt: skip
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("mean eval reward", fontsize=11)
    ax.legend(**_LEGEND)
    return _save(fig, out / "compare.png")
