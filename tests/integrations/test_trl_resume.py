"""Resumes and re-runs of a real ``trl.GRPOTrainer`` recording into one store (issue 21): a
resume from a checkpoint supersedes the rounds TRL regenerates, so the store says what the
resumed run trained on, and keeps the abandoned rounds readable as superseded; a second run
into a recorded store is refused before its first step, or, with
``rollout_if_exists="new_attempt"``, recorded in full over the first.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parent))

import trl_runs  # noqa: E402
from test_trl import assert_matches_trl_log, samples, trl_parquet  # noqa: E402
from transformers import TrainerState  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.errors import ArgumentError, StoreError  # noqa: E402
from maxent_arrow.integrations.trl import checkpoint_step  # noqa: E402

REWARDS = ["correct", "length"]
# A round per optimizer step (one iteration, one generation per step), no reference model.
ROUND_PER_STEP = dict(num_iterations=1, beta=0.0)


def trained(probe: trl_runs.Probe, step: int) -> Counter:
    """(prompt, completion) tokens of every sample TRL's loss saw from the round of ``step``."""
    return Counter((prompt, completion) for s, prompt, completion in probe.trained if s == step)


def log_entries(store_dir: Path) -> list[str]:
    """The commit log's entries: a commit is a new entry, nothing else is."""
    return sorted(p.name for p in (store_dir / "log").glob("*.json"))


def unit_attempts(store: RolloutStore, step: int) -> list[str]:
    return [store.catalog.attempt_of(u.step_file) for u in store.units(steps=[step])]


# ---------------------------------------------------------------------------- resume (the repro)
@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory):
    """The issue's repro: ``save_steps=2, max_steps=4``; ``checkpoint-4`` and
    ``checkpoint-2/rng_state.pth`` deleted (a crash after step 3; sampling on a GPU is not
    reproducible anyway); ``train(resume_from_checkpoint=True)`` by a new trainer, as a
    relaunched script would."""
    root = tmp_path_factory.mktemp("trl_resume")
    settings = dict(ROUND_PER_STEP, max_steps=4, save_strategy="steps", save_steps=2)
    first = trl_runs.trainer(root, **settings)
    first.train()
    out = root / "out"
    # TRL's completion logs of the crashed attempt (the resumed run writes its own over them).
    shutil.copytree(out / "completions", root / "first_out" / "completions")
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-2" / "rng_state.pth").unlink()
    resumed = trl_runs.trainer(root, **settings)
    resumed.train(resume_from_checkpoint=True)
    return root, first, resumed


def test_a_resumed_run_stores_what_trl_trained_on(resumed_run):
    root, first, resumed = resumed_run
    # TRL resumed at global_step 2 and generated the rounds of steps 2 and 3 again.
    assert resumed.state.global_step == 4
    assert sorted({step for step, kind, _ in resumed.generated}) == [2, 3]
    store = RolloutStore(root / "store")
    assert store.steps() == [0, 1, 2, 3] and store.verify().problems == []
    for step in (2, 3):
        table = store.read(steps=[step])
        # TRL's own log of the resumed run (completions_00003.parquet holds the round of
        # step 2: TRL logs it under the step its update completes), and the tokens its loss
        # saw, are what the store says.
        assert_matches_trl_log(table, trl_parquet(root / "out", step + 1), REWARDS)
        assert Counter(samples(table)) == trained(resumed, step)
        assert unit_attempts(store, step) == [resumed.rollout_attempt]
    for step in (0, 1):  # before the checkpoint: the first attempt's, as it trained on them
        assert Counter(samples(store.read(steps=[step]))) == trained(first, step)
        assert unit_attempts(store, step) == [first.rollout_attempt]
    assert resumed.rollout_attempt != first.rollout_attempt


def test_the_abandoned_rounds_stay_readable_as_superseded(resumed_run):
    root, first, resumed = resumed_run
    superseded = RolloutStore(root / "store", attempts="superseded")
    assert superseded.steps() == [2, 3]
    for step in (2, 3):
        table = superseded.read(steps=[step])
        assert Counter(samples(table)) == trained(first, step)
        assert_matches_trl_log(table, trl_parquet(root / "first_out", step + 1), REWARDS)
        # Without its RNG state TRL sampled other completions: two different histories.
        assert trained(first, step) != trained(resumed, step)
    everything = RolloutStore(root / "store", attempts="all")
    assert [u.step for u in everything.units()] == [0, 1, 2, 2, 3, 3]
    for step in (2, 3):
        want = trained(first, step) + trained(resumed, step)
        assert Counter(samples(everything.read(steps=[step]))) == want
    # The SQL views: the effective history, what it superseded, and both.
    store = RolloutStore(root / "store")
    counts = store.sql(
        "SELECT (SELECT count(*) FROM groups) AS g, (SELECT count(*) FROM superseded) AS s, "
        "(SELECT count(*) FROM groups_all) AS a, "
        "(SELECT list(DISTINCT step ORDER BY step) FROM superseded) AS steps"
    ).to_pylist()[0]
    assert counts["steps"] == [2, 3] and counts["a"] == counts["g"] + counts["s"]


def test_trainer_figures_of_the_resumed_steps_are_the_resumed_runs(resumed_run):
    """TRL logged optimizer steps 3 and 4 twice (once per attempt); the effective records are
    the resumed run's, each logged step once, with the losses it logged."""
    root, first, resumed = resumed_run
    store = RolloutStore(root / "store")
    records = store.read_records("trainer_metrics").sort_by("optimizer_step").to_pylist()
    assert [r["optimizer_step"] for r in records] == [1, 2, 3, 4]
    logged = {int(e["step"]): e["loss"] for e in resumed.state.log_history if "loss" in e}
    for r in records:
        attempt = resumed.rollout_attempt if r["optimizer_step"] > 2 else first.rollout_attempt
        assert r["attempt"] == attempt
        assert r["step"] == r["optimizer_step"] - 1  # a round per step: trained on step - 1
        assert r["loss"] == logged[r["optimizer_step"]]
    old = store.read_records("trainer_metrics", attempts="superseded").to_pylist()
    first_logged = {int(e["step"]): e["loss"] for e in first.state.log_history if "loss" in e}
    assert sorted((r["optimizer_step"], r["loss"]) for r in old) == [
        (t, first_logged[t]) for t in (3, 4)
    ]


def test_the_resume_step_is_the_checkpoints_global_step(tmp_path):
    """``checkpoint_step`` reads what ``Trainer.train`` reads: the last checkpoint of
    ``output_dir`` for ``True``, a checkpoint's path as given; and fails as it does."""
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        TrainerState(global_step=step).save_to_json(
            str(tmp_path / f"checkpoint-{step}" / "trainer_state.json")
        )
    assert checkpoint_step(True, str(tmp_path)) == 10  # the last by number, not by name
    assert checkpoint_step(str(tmp_path / "checkpoint-2"), str(tmp_path)) == 2
    assert checkpoint_step(tmp_path / "checkpoint-2", None) == 2
    assert checkpoint_step(None, str(tmp_path)) is None
    assert checkpoint_step(False, str(tmp_path)) is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        checkpoint_step(True, str(tmp_path / "empty"))
    (tmp_path / "checkpoint-3").mkdir()  # no trainer_state.json
    with pytest.raises(FileNotFoundError):
        checkpoint_step(str(tmp_path / "checkpoint-3"), str(tmp_path))


# ---------------------------------------------------------------------------- re-run
def test_a_second_run_into_a_recorded_store_is_refused_before_its_first_step(tmp_path):
    settings = dict(ROUND_PER_STEP, max_steps=2)
    first = trl_runs.trainer(tmp_path, **settings)
    first.train()
    store_dir = tmp_path / "store"
    entries = log_entries(store_dir)
    with pytest.raises(ArgumentError, match="rollout_if_exists: expected one of"):
        trl_runs.trainer(tmp_path, **settings, if_exists="overwrite")
    assert log_entries(store_dir) == entries
    again = trl_runs.trainer(tmp_path, **settings, seed=1)  # the same command, a new seed
    weights = [p.detach().clone() for p in again.model.parameters()]
    with pytest.raises(StoreError) as refused:
        again.train()
    message = str(refused.value)
    for choice in ("refused", "resume_from_checkpoint", "new run directory", "new_attempt"):
        assert choice in message
    # Nothing ran and nothing was committed.
    assert again.state.global_step == 0 and again.generated == [] and again.trained == []
    assert all(torch.equal(a, b) for a, b in zip(weights, again.model.parameters()))
    assert log_entries(store_dir) == entries
    assert not (tmp_path / "out" / "checkpoint-1").exists()
    store = RolloutStore(store_dir, attempts="all")
    assert [u.step for u in store.units()] == [0, 1]
    assert set(store.read_records("trainer_metrics").column("attempt").to_pylist()) == {
        first.rollout_attempt
    }

    # With rollout_if_exists="new_attempt" the second run is recorded in full, and it is the
    # run's history; the first stays readable as superseded.
    rerun = trl_runs.trainer(tmp_path, **settings, seed=1, if_exists="new_attempt")
    rerun.train()
    store = RolloutStore(store_dir)
    assert store.steps() == [0, 1] and store.verify().problems == []
    for step in (0, 1):
        table = store.read(steps=[step])
        assert Counter(samples(table)) == trained(rerun, step)
        assert_matches_trl_log(table, trl_parquet(tmp_path / "out", step + 1), REWARDS)
        assert unit_attempts(store, step) == [rerun.rollout_attempt]
    records = store.read_records("trainer_metrics")
    assert records.column("optimizer_step").to_pylist() == [1, 2]
    assert set(records.column("attempt").to_pylist()) == {rerun.rollout_attempt}
    superseded = RolloutStore(store_dir, attempts="superseded")
    assert superseded.steps() == [0, 1]
    for step in (0, 1):
        assert Counter(samples(superseded.read(steps=[step]))) == trained(first, step)
        assert trained(first, step) != trained(rerun, step)


def test_a_second_train_call_of_one_trainer_is_a_run_of_its_own(tmp_path):
    """``train()`` again on the same trainer starts over at step 0: a fresh run, refused
    like any other; resuming from its checkpoint is a resume."""
    settings = dict(ROUND_PER_STEP, max_steps=2, save_strategy="steps", save_steps=1)
    probe = trl_runs.trainer(tmp_path, **settings)
    probe.train()
    first_attempt = probe.rollout_attempt
    entries = log_entries(tmp_path / "store")
    with pytest.raises(StoreError, match="refused"):
        probe.train()
    assert log_entries(tmp_path / "store") == entries
    assert probe.rollout_attempt == first_attempt  # the refused run left the trainer as it was
    probe.trained.clear()
    probe.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    store = RolloutStore(tmp_path / "store")
    assert store.steps() == [0, 1]
    assert unit_attempts(store, 0) == [first_attempt]
    assert unit_attempts(store, 1) == [probe.rollout_attempt] != [first_attempt]
    assert Counter(samples(store.read(steps=[1]))) == trained(probe, 1)
    superseded = RolloutStore(tmp_path / "store", attempts="superseded")
    assert superseded.steps() == [1]


def test_an_evaluation_at_the_checkpoint_step_stays_in_the_history(tmp_path):
    settings = dict(
        ROUND_PER_STEP,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    first = trl_runs.trainer(tmp_path, eval_rows=1, **settings)
    first.train()
    shutil.rmtree(tmp_path / "out" / "checkpoint-2")
    resumed = trl_runs.trainer(tmp_path, eval_rows=1, **settings)
    resumed.train(resume_from_checkpoint=True)  # at step 1: trains step 2, evaluates at 2
    assert sorted(step for step, kind, _ in first.generated if kind == "eval") == [1, 2]
    assert sorted(step for step, kind, _ in resumed.generated if kind == "eval") == [2]
    store = RolloutStore(tmp_path / "store")
    assert store.steps(kind="train") == [0, 1]
    assert store.steps(kind="eval") == [1, 2]  # the evaluation at 1 is of the checkpoint's model
    # The first attempt's evaluation at step 2 is what the resumed one did again.
    assert RolloutStore(tmp_path / "store", attempts="superseded").steps(kind="eval") == [2]
    (resume,) = [a for a in store.attempts() if a["mode"] == "resume"]
    assert (resume["resume_from"], resume["resume_kinds"]) == (1, {"eval": 2})
    files = {p.name: w for p, w in store.live_files("groups")}
    assert all(w is None for w in files.values())  # one unit per file: no row filters
