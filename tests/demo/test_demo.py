"""The main job end to end at a tiny size: the shipped data, then a run through the store
(warm start, train, evaluate, replay, report) and a rerun with the same seed."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path

import pytest

from maxent_arrow.demo.job import main
from maxent_arrow.demo.prompts import load_prompts
from maxent_arrow.store.store import RolloutStore

TINY = ["--steps", "2", "--prompts", "4", "--k", "3", "--sft-steps", "3"]
TINY += ["--eval-every", "1", "--eval-prompts", "4"]  # (not --quiet: the closing lines are read)


@pytest.fixture
def make_prompts(monkeypatch):
    """``data/make_prompts.py``, the script that wrote the shipped files, imported."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "data"))
    return importlib.import_module("make_prompts")


def test_the_shipped_splits_are_what_the_seeded_script_writes(make_prompts):
    made = make_prompts.make_splits()
    for split in ("sft", "train", "eval"):
        assert load_prompts(split) == made[split], split
    assert [len(made[s]) for s in ("sft", "train", "eval")] == [946, 400, 128]


def test_held_out_prompts_share_no_sum_with_the_demonstrations_or_the_rl_prompts():
    prompts = {s: [r["prompt"] for r in load_prompts(s)] for s in ("sft", "train", "eval")}
    for split, rows in prompts.items():
        assert len(set(rows)) == len(rows), f"{split} repeats a prompt"
    assert not set(prompts["eval"]) & set(prompts["sft"])
    assert not set(prompts["eval"]) & set(prompts["train"])
    assert not set(prompts["sft"]) & set(prompts["train"])
    # Nor the mirror image of a held-out sum (b+a of a held-out a+b) in the other splits.
    mirrors = {"+".join(reversed(p.removesuffix("=").split("+"))) + "=" for p in prompts["eval"]}
    assert not mirrors & (set(prompts["sft"]) | set(prompts["train"]))
    # Together with those mirrors they are every sum a + b with 10 <= a, b <= 49, each once.
    assert len(set().union(*map(set, prompts.values())) | mirrors) == 40 * 40


def test_answers_are_the_sums_and_the_teacher_only_ever_forgets_a_carry(make_prompts):
    module = make_prompts
    carry_sums = forgotten = 0
    for split in ("sft", "train", "eval"):
        for row in load_prompts(split):
            a, b = (int(x) for x in row["prompt"].removesuffix("=").split("+"))
            assert 10 <= a <= 49 and 10 <= b <= 49
            assert row["answer"] == str(a + b)
            if split != "sft":
                continue
            carry = module.needs_carry(a, b)
            carry_sums += carry
            if row["completion"] != row["answer"]:
                assert carry and row["completion"] == str(a + b - 10), row
                forgotten += 1
    # The teacher's rate (FORGET_CARRY = 0.7) within a few standard errors.
    assert abs(forgotten / carry_sums - module.FORGET_CARRY) < 0.06


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--out", str(out), *TINY])
    return out, code, printed.getvalue()


def test_demo_exits_zero_and_replay_equals_the_logged_losses(demo_run):
    out, code, _ = demo_run
    assert code == 0
    store = RolloutStore(out / "store")
    assert store.steps(kind="train") == [0, 1]
    # Eval before steps 0 (the warm start) and 1, and once at the end.
    assert store.steps(kind="eval") == [0, 1, 2]
    from maxent_arrow.demo import tiny_model
    from maxent_arrow.train import replay_losses, snapshot_loader

    replayed = list(replay_losses(store, snapshot_loader(out, lambda: tiny_model(0))))
    assert [r.step for r in replayed] == [0, 1]
    for r in replayed:
        assert r.num_samples == 12
        assert r.replayed_loss == pytest.approx(r.logged_loss, rel=1e-6, abs=1e-9)
        assert r.max_weight_error < 1e-9


def test_demo_stores_every_step_with_config_losses_tokens_and_entropy(demo_run):
    out, _, _ = demo_run
    store = RolloutStore(out / "store")
    steps = store.read_steps(kind="train").to_pylist()
    assert [row["step"] for row in steps] == [0, 1]
    for row in steps:
        config = json.loads(row["config"])
        assert config["tau"] > 0 and config["num_generations"] == 3
        assert config["extra"]["warm_start"]["steps"] == 3
        assert row["total_loss"] == row["total_loss"]  # not NaN
        assert row["num_groups"] == 4 and row["num_samples"] == 12
    groups = store.read(
        kind="train", columns=["completion_ids", "weights", "q", "policy_entropy_sum"]
    ).to_pylist()
    for group in groups:
        assert len(group["completion_ids"]) == 3
        assert sum(group["weights"]) == pytest.approx(1.0)
        assert sum(group["q"]) == pytest.approx(1.0)
        assert len(group["policy_entropy_sum"]) == 3
        assert all(value > 0 for value in group["policy_entropy_sum"])


def test_demo_writes_a_report_and_snapshots(demo_run):
    out, _, _ = demo_run
    assert (out / "report" / "index.html").exists()
    assert (out / "report" / "summary.md").exists()
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == [
        "step-0000000000.safetensors",
        "step-0000000001.safetensors",
    ]


def test_the_closing_lines_print_what_the_store_holds(demo_run):
    out, _, printed = demo_run
    store = RolloutStore(out / "store")
    accuracy = {
        row["step"]: row["accuracy"]
        for row in store.sql(
            "SELECT step, avg(reward_accuracy) AS accuracy FROM samples WHERE kind = 'eval' "
            "GROUP BY step"
        ).to_pylist()
    }
    peak = max(accuracy, key=lambda step: (accuracy[step], -step))
    assert (
        f"accuracy {accuracy[0]:.3f} at the warm start -> {accuracy[2]:.3f} at the end "
        f"({100 * (accuracy[2] - accuracy[0]):+.1f} points); peak {accuracy[peak]:.3f} at "
        f"step {peak}"
    ) in printed
    assert f"run directory: {out}" in printed
    assert "warm start: 3 supervised steps on 946 demonstrations" in printed
    # No `view` subcommand was named by the caller, so none is suggested.
    assert " inspect " in printed and " query " in printed and " view " not in printed


def test_a_rerun_with_the_same_seed_gives_the_same_numbers(demo_run, tmp_path):
    out, _, _ = demo_run
    again = tmp_path / "again"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--out", str(again), *TINY, "--no-report"], commands=("view",)) == 0
    columns = ["step", "kind", "completions", "total_utils", "weights", "policy_entropy_sum"]
    first = RolloutStore(out / "store").read(columns=columns).sort_by([("kind", "ascending")])
    second = RolloutStore(again / "store").read(columns=columns).sort_by([("kind", "ascending")])
    assert first.to_pylist() == second.to_pylist()
    losses = [
        [
            row["total_loss"]
            for row in RolloutStore(p / "store").read_steps(kind="train").to_pylist()
        ]
        for p in (out, again)
    ]
    assert losses[0] == losses[1]
    # The caller (the CLI) says `view` exists: it is suggested, on the run directory.
    assert f" view {again}" in printed.getvalue()


def test_the_suggested_commands_run_as_printed_in_a_fresh_shell(demo_run, fresh_shell):
    out, _, printed = demo_run
    done = fresh_shell(printed, Path.cwd())
    assert [c.args[-1].split()[1] for c in done] == ["inspect", "query", "report"]
    for command in done:
        assert command.returncode == 0, (command.args, command.stderr)
    inspected, queried, _ = (c.stdout for c in done)
    assert "steps" in inspected
    # The query answers with the eval steps the run stored (0, 1 and 2), one row each.
    cells = [[c.strip() for c in line.strip(" │").split("│")] for line in queried.splitlines()]
    assert [row[0] for row in cells if row[0].isdigit()] == ["0", "1", "2"]
    assert (out / "report" / "index.html").exists()
