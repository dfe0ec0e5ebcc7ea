"""The main job end to end at a tiny size: train through the store, evaluate, replay, report."""

from __future__ import annotations

import json

import pytest

from maxent_arrow.demo.job import load_prompts, main
from maxent_arrow.store.store import RolloutStore


def test_shipped_prompts_have_integer_answers_and_disjoint_splits():
    rows = load_prompts("train")
    assert len(rows) == 256
    assert len(load_prompts("eval")) == 64
    for row in rows:
        assert row["prompt"].startswith("Q: ") and row["prompt"].endswith(" A:")
        int(row["answer"])
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in load_prompts("eval")}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    argv = ["--out", str(out), "--steps", "2", "--prompts", "4", "--k", "3"]
    argv += ["--eval-every", "1", "--eval-prompts", "4", "--quiet"]
    return out, main(argv)


def test_demo_exits_zero_and_replay_equals_the_logged_losses(demo_run, capsys):
    out, code = demo_run
    assert code == 0
    store = RolloutStore(out / "store")
    assert store.steps(kind="train") == [0, 1]
    # Eval after steps 0 and 1, and once at the end.
    assert store.steps(kind="eval") == [0, 1, 2]
    from maxent_arrow.demo import tiny_model
    from maxent_arrow.train import replay_losses, snapshot_loader

    replayed = list(replay_losses(store, snapshot_loader(out, lambda: tiny_model(0))))
    assert [r.step for r in replayed] == [0, 1]
    for r in replayed:
        assert r.num_samples == 12
        assert r.replayed_loss == pytest.approx(r.logged_loss, rel=1e-6, abs=1e-9)
        assert r.max_weight_error < 1e-9


def test_demo_stores_every_step_with_config_losses_and_tokens(demo_run):
    out, _ = demo_run
    store = RolloutStore(out / "store")
    steps = store.read_steps(kind="train").to_pylist()
    assert [row["step"] for row in steps] == [0, 1]
    for row in steps:
        config = json.loads(row["config"])
        assert config["tau"] > 0 and config["num_generations"] == 3
        assert row["total_loss"] == row["total_loss"]  # not NaN
        assert row["num_groups"] == 4 and row["num_samples"] == 12
    groups = store.read(kind="train", columns=["completion_ids", "weights", "q"]).to_pylist()
    for group in groups:
        assert len(group["completion_ids"]) == 3
        assert sum(group["weights"]) == pytest.approx(1.0)
        assert sum(group["q"]) == pytest.approx(1.0)


def test_demo_writes_a_report_and_snapshots(demo_run):
    out, _ = demo_run
    assert (out / "report" / "index.html").exists()
    assert (out / "report" / "summary.md").exists()
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == [
        "step-0000000000.safetensors",
        "step-0000000001.safetensors",
    ]


def test_demo_refuses_to_overwrite_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a maxent-arrow demo run"):
        main(["--out", str(tmp_path), "--steps", "1", "--quiet"])
    assert (tmp_path / "precious.txt").read_text() == "keep me"
