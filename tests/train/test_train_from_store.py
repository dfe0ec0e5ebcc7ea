"""The MaxEnt trainer fed from the store: the exact replay of a float64 run (each update's loss
is the loss the online step logged, to 1e-6), offline training that moves the policy, and
fresh generation mixed with replayed groups."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_model
from transformers import ByT5Tokenizer

from maxent_arrow.demo import accuracy_reward, format_reward, tiny_model
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import ReplaySampler, RolloutStore
from maxent_arrow.train import MaxEntTrainer, snapshot_path, train_from_store

ROWS = [
    {"prompt": "12+30=", "answer": "42"},
    {"prompt": "21+17=", "answer": "38"},
    {"prompt": "5+5=", "answer": "10"},
]
STEPS = 3


def _config() -> RunConfig:
    return RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        tau=0.5,
        beta=0.01,
        num_generations=4,
        max_prompt_len=16,
        max_completion_len=5,
        learning_rate=1e-3,
        seed=3,
    )


def _model():
    return tiny_model(3).to(torch.float64)


def _trainer(store, run_dir) -> MaxEntTrainer:
    return MaxEntTrainer(
        _model(),
        ByT5Tokenizer(),
        store,
        config=_config(),
        reward_funcs=[accuracy_reward, format_reward],
        run_dir=run_dir,
    )


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """A float64 CPU run of STEPS steps, with a policy snapshot before each update."""
    run = tmp_path_factory.mktemp("online")
    store = RolloutStore.create(run / "store", config=_config().to_dict())
    trainer = _trainer(store, run)
    for step in range(STEPS):
        trainer.step(step, ROWS)
    return run


def test_train_from_store_reproduces_each_logged_loss(online, tmp_path):
    """Replayed through the sampler (whole steps, in order, staleness window 0) from the stored
    policy snapshots, each update's loss is the loss the online step logged, to 1e-6."""
    source = RolloutStore(online / "store", role="sampler")  # the consumer: a role of its own
    logged = {
        r["step"]: r["total_loss"]
        for r in source.read_steps(kind="train", columns=["step", "total_loss"]).to_pylist()
    }
    sampler = ReplaySampler(source, sampling="sequential", max_staleness=0)
    offline = RolloutStore.create(tmp_path / "offline", config=_config().to_dict())
    trainer = _trainer(offline, tmp_path)

    def load(model, step):
        load_model(model, str(snapshot_path(online, step)))

    done = train_from_store(trainer, sampler, load_policy=load)
    assert [d.stored_steps for d in done] == [(s,) for s in range(STEPS)]
    assert all(d.staleness == 0 and not d.dropped for d in done)
    for d in done:
        assert d.logged_loss == logged[d.step]
        assert abs(d.loss - logged[d.step]) <= 1e-6 * max(1.0, abs(logged[d.step])), d
    # The trainer's own figures went to its store; the consumption to the source's lifecycle.
    metrics = offline.read_records("trainer_metrics").to_pylist()
    assert [m["loss"] for m in metrics] == pytest.approx([d.loss for d in done], abs=1e-12)
    events = source.lifecycle().to_pylist()
    assert sorted({(e["step"], e["rollout_step"]) for e in events}) == [
        (s, s) for s in range(STEPS)
    ]
    assert {e["event"] for e in events} == {"trained"}


def test_a_stale_window_drops_what_it_must(online, tmp_path):
    """Offline from trainer step 2 on, with a window of 1 version: stored step 0 is 2 versions
    old and dropped (stale, in the lifecycle), steps 1 and 2 are trained on."""
    source = RolloutStore(online / "store", role="sampler")  # the consumer: a role of its own
    sampler = ReplaySampler(source, sampling="sequential", max_staleness=1)
    trainer = _trainer(RolloutStore.create(tmp_path / "o", config=_config().to_dict()), None)
    done = train_from_store(trainer, sampler, start=2)
    assert [d.stored_steps for d in done] == [(1,), (2,)]
    assert done[0].dropped == {"stale": len(ROWS)}
    stale = [e for e in source.lifecycle().to_pylist() if e["reason"] == "stale"]
    assert {e["rollout_step"] for e in stale} == {0}


def test_offline_training_moves_the_policy_toward_the_weighted_completions(online, tmp_path):
    """Offline updates on stored groups raise the policy's log-likelihood of the completions
    the MaxEnt weights favour (a real optimizer on a real model; no generation)."""
    source = RolloutStore(online / "store", role="sampler")  # the consumer: a role of its own
    batch = next(iter(ReplaySampler(source, sampling="sequential", record=False)))
    trainer = _trainer(RolloutStore.create(tmp_path / "o", config=_config().to_dict()), None)
    before, _ = trainer.replay_loss(batch)
    sampler = ReplaySampler(source, batch_groups=3, seed=1, epochs=6, record=False)
    done = train_from_store(trainer, sampler)
    assert len(done) == 6 * STEPS
    assert all(math.isnan(d.logged_loss) or d.num_groups == 3 for d in done)
    after, _ = trainer.replay_loss(batch)
    assert float(after.loss.detach()) < float(before.loss.detach()) - 0.05


def test_fresh_generation_mixed_with_replayed_groups(online, tmp_path):
    """A step with half its groups replayed: the fresh groups are appended as the step, the
    update's loss (trainer_metrics) is the group-weighted mean of both parts."""
    source = RolloutStore(online / "store", role="sampler")  # the consumer: a role of its own
    sampler = ReplaySampler(source, batch_groups=2, seed=0, record=False)
    replayed = sampler.sample()
    assert replayed is not None
    store = RolloutStore.create(tmp_path / "m", config=_config().to_dict())
    trainer = _trainer(store, None)
    weights = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    replay_loss = float(trainer.replay_loss(replayed)[0].loss.detach())  # before the update
    fresh = trainer.step(0, ROWS[:2], replayed=replayed)
    assert fresh.num_groups == 2
    logged = fresh.loss_scalars
    assert logged is not None
    mixed = trainer.metrics_records[-1]["loss"]
    assert mixed == pytest.approx((2 * logged.total_loss + 2 * replay_loss) / 4, rel=1e-9)
    moved = any(not torch.equal(weights[n], p) for n, p in trainer.policy.named_parameters())
    assert moved
