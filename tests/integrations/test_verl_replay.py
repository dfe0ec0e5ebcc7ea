"""The verl feeder: stored verl steps come back through the replay sampler as the DataProto
verl held, and verl's own ``core_algos`` policy loss on a fed batch equals the loss on the
original batch (the log-probs of a real tiny model re-scoring the fed tokens)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
warnings.filterwarnings("ignore", module="verl")

from omegaconf import OmegaConf  # noqa: E402
from test_verl import R, assert_same, rollout_batch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402

from maxent_arrow import ArgumentError, RolloutStore  # noqa: E402
from maxent_arrow.integrations.verl import LAYOUT_KEY, from_dataproto  # noqa: E402
from maxent_arrow.integrations.verl_replay import FedStep, VerlFeeder  # noqa: E402
from maxent_arrow.store import SamplerOptions  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    store = RolloutStore.create(tmp_path_factory.mktemp("verl") / "store")
    originals = {}
    for step in range(STEPS):
        data = rollout_batch(seed=step)
        batch = from_dataproto(data, step=step, rank=0)
        store.append(batch)
        originals[step] = (data, batch.run_config.extra[LAYOUT_KEY])
    return store, originals


def _policy_loss(data, model) -> torch.Tensor:
    """verl's vanilla PPO policy loss (its own function) with the current policy's log-probs of
    the batch's responses, as verl's actor computes them."""
    with torch.no_grad():
        logits = model(
            input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"]
        ).logits
        log_prob = logprobs_from_logits(logits[:, -R - 1 : -1], data.batch["responses"])
    config = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
         "global_batch_info": {}}
    )  # fmt: skip
    # verl's registry is typed loosely (a callable of 8 positionals); its vanilla loss by name.
    policy_loss: Any = core_algos.get_policy_loss_fn("vanilla")
    loss, _ = policy_loss(
        old_log_prob=data.batch["old_log_probs"],
        log_prob=log_prob,
        advantages=data.batch["advantages"],
        response_mask=data.batch["response_mask"],
        loss_agg_mode="token-mean",
        config=config,
    )
    return loss


def test_fed_batches_are_the_stored_dataprotos_and_verls_loss_runs_on_them(recorded):
    store, originals = recorded
    feeder = VerlFeeder(store, sampling="uniform", seed=5, record=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=384, n_layer=1, n_embd=32, n_head=2, eos_token_id=1, pad_token_id=0)
    ).eval()
    fed = []
    while (data := feeder.next(step=len(fed))) is not None:
        fed.append((data, feeder.source))
    steps = [source.step for _, source in fed]
    assert sorted(steps) == list(range(STEPS)) and steps != list(range(STEPS))
    for trainer_step, (data, source) in enumerate(fed):
        assert source == FedStep(step=source.step, policy_version=source.step,
                                 trainer_step=trainer_step)  # fmt: skip
        original, layout = originals[source.step]
        assert_same(data, original, layout)  # meta_info included: the feeder adds no key
        assert data.meta_info == original.meta_info
        got, want = _policy_loss(data, model), _policy_loss(original, model)
        assert torch.isfinite(got) and float(got) != 0.0
        assert float(got) == pytest.approx(float(want), abs=1e-7)


def test_the_feeder_resumes_and_records_what_it_fed(recorded, tmp_path):
    store, _ = recorded
    def stream(feeder: VerlFeeder) -> list[int]:
        return [feeder.source.step for _ in feeder if feeder.source is not None]

    whole = stream(VerlFeeder(store, seed=1, record=False))
    first = VerlFeeder(store, seed=1, record=False)
    assert first.next() is not None and first.source is not None
    rest = VerlFeeder(store, seed=1, record=False)
    rest.load_state_dict(first.state_dict())
    assert [first.source.step, *stream(rest)] == whole and len(whole) == STEPS
    writer = RolloutStore(store.root, role="verl-feeder")
    feeder = VerlFeeder(writer, sampling="sequential", max_staleness=0)
    assert feeder.next(current_version=2, step=7) is not None
    assert feeder.source == FedStep(step=2, policy_version=2, trainer_step=7)
    events = [(e["event"], e["reason"], e["rollout_step"]) for e in writer.lifecycle().to_pylist()]
    groups = 3  # QUESTIONS
    assert sorted(events) == sorted(
        [("dropped", "stale", s) for s in (0, 1) for _ in range(groups)]
        + [("trained", None, 2)] * groups
    )
    with pytest.raises(ArgumentError, match="whole stored step"):
        VerlFeeder(store, batch_groups=2)
    with pytest.raises(ArgumentError, match=r"VerlFeeder: .*unexpected keyword .*'batch'"):
        VerlFeeder(store, batch=2)
    with pytest.raises(ArgumentError, match="VerlFeeder: pass a SamplerOptions or keywords"):
        VerlFeeder(store, SamplerOptions(), seed=1)
