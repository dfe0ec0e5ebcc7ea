"""Two things the report said wrong (issue 39): its reward band flickered for a reward of two
values, and it said "not plotted: losses" for a trainer whose losses are in its own log
(``trainer_metrics``, TRL's) rather than in the step rows. Real stores written through the
append API, the report built for real, its numbers read back from what it wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "explorer"))

import stores  # noqa: E402

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.analytics import RunAnalytics, build_report  # noqa: E402
from maxent_arrow.analytics.figures import reward_band  # noqa: E402
from maxent_arrow.analytics.report import DISCRETE_VALUES  # noqa: E402
from maxent_arrow.rollout import trainer_metrics_table  # noqa: E402

GROUPS = 25  # 100 completions a step


def _correct(step: int, failures: int) -> RolloutBatch:
    """A step whose ``accuracy`` is 1 for all but ``failures`` of its completions (and
    ``format`` 1 for all): the share correct near 95 %, on either side of it."""
    made = stores.batch(step, groups=GROUPS)
    table = pa.Table.from_batches([made.groups])
    flat = [0.0 if i < failures else 1.0 for i in range(GROUPS * stores.K)]
    values = [[[flat[g * stores.K + i], 1.0] for i in range(stores.K)] for g in range(GROUPS)]
    totals = [[a + b for a, b in group] for group in values]
    for name, column in (("reward_values", values), ("total_utils", totals)):
        index = table.schema.get_field_index(name)
        table = table.set_column(index, name, pa.array(column, table.schema.field(name).type))
    return RolloutBatch(table, pa.Table.from_batches([made.step_row]))


def test_the_band_of_a_two_valued_reward_does_not_flicker(tmp_path):
    root = tmp_path / "store"
    RolloutStore.create(root, if_exists="error")
    store = RolloutStore(root)
    failures = [6, 4] * 5  # 94 % and 96 % correct, step after step
    for step, n in enumerate(failures):
        store.append(_correct(step, n))
    report = build_report(root, tmp_path / "report", progress=False)
    assert "reward curve" in report.plots
    with RunAnalytics(root, materialize=True) as run:
        curve = run.reward_curve()
        counts = run.distinct_rewards()
    part = curve.filter(pc.equal(curve.column("reward"), "accuracy"))
    # What the band was: the 5 % quantile of a 0/1 reward is 0 at 94 %, 1 at 96 %.
    p05 = part.column("p05").to_pylist()
    assert p05 == [0.0, 1.0] * 5
    assert counts["accuracy"] == 2 <= DISCRETE_VALUES
    low, high, what = reward_band(part, discrete=counts["accuracy"] <= DISCRETE_VALUES)
    assert what == "95 % interval of the mean"
    mean = np.array([1 - n / 100 for n in failures])
    half = 1.96 * np.sqrt(mean * (1 - mean) / 100)  # the population std of a 0/1 value
    assert low == pytest.approx(np.maximum(mean - half, 0.0))
    assert high == pytest.approx(np.minimum(mean + half, 1.0))
    assert np.abs(np.diff(low)).max() < 0.05 and np.abs(np.diff(high)).max() < 0.05
    # A reward of many values keeps its quantiles: the spread of the completions.
    total = curve.filter(pc.equal(curve.column("reward"), "total_utils"))
    _, _, kept = reward_band(total, discrete=False)
    assert kept == "5-95 % of the completions"
    assert "for one of few values (0/1 correctness) the 95 % interval" in report.html.read_text()


def _logged_run(root: Path) -> list[dict]:
    """Train steps whose step rows hold no loss (as TRL's recorder writes them) and the
    trainer's log of two optimizer steps per stored step (TRL's ``num_iterations=2``)."""
    RolloutStore.create(root, if_exists="error")
    store = RolloutStore(root)
    logged = []
    for step in range(4):
        made = stores.batch(step)
        row = pa.Table.from_batches([made.step_row])
        for name in ("total_loss", "kl_value"):
            row = row.set_column(row.schema.get_field_index(name), name, pa.nulls(1, pa.float64()))
        store.append(RolloutBatch(pa.Table.from_batches([made.groups]), row))
        for update in range(2):
            logged.append({"optimizer_step": 2 * step + update + 1, "kind": "train",
                           "step": step, "loss": stores.update_loss(step, update),
                           "kl": 0.001 * (2 * step + update + 1)})  # fmt: skip
    store.append_records("trainer_metrics", trainer_metrics_table(logged))
    return logged


def test_losses_in_the_trainers_own_log_are_plotted_not_said_absent(tmp_path):
    logged = _logged_run(tmp_path / "store")
    report = build_report(tmp_path / "store", tmp_path / "report", progress=False)
    assert "losses" in report.plots and "losses" not in report.skipped
    assert "loss components" not in report.run_summary.absent
    assert "kl" in report.plots
    page = report.html.read_text()
    assert "<li><b>losses</b>" not in page and 'id="plot-losses"' in page
    # The summary's loss: the mean of each stored step's updates, as logged.
    trend = report.run_summary.trend("loss.trainer")
    means = [np.mean([r["loss"] for r in logged if r["step"] == s]) for s in range(4)]
    assert (trend.start, trend.end) == pytest.approx((means[0], means[-1]))
    assert report.run_summary.trend("kl.trainer").end == pytest.approx(np.mean([0.007, 0.008]))
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert "loss.trainer" in summary["trends"]
    with RunAnalytics(tmp_path / "store") as run:
        curve = run.trainer_curve().to_pylist()
    assert [(r["step"], r["update"], r["updates"]) for r in curve] == [
        (s, u, 2) for s in range(4) for u in (1, 2)
    ]
