"""The group math under TRL's conventions: ``scale_rewards`` as a named option ("group",
"batch", "none"), NaN-aware Bessel-corrected stds with unscorable completions left out
(``missing="exclude"``), reward weights and ``multi_objective_aggregation``, against TRL 1.16's
own formulas (quoted from ``GRPOTrainer._generate_and_score_completions``, with TRL's
``nanstd``)."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_arrow import compute as C
from maxent_arrow.arrow import Ragged
from maxent_arrow.errors import ComputeError

trl_utils = pytest.importorskip("trl.trainer.utils")
nanstd = trl_utils.nanstd


def trl_advantages(rewards_per_func, weights, k, scale_rewards, aggregation):
    """TRL 1.16's advantage computation (float64 here), for groups of ``k`` in row order."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, k), dim=1).repeat_interleave(k, dim=0)
        if scale_rewards in ["group", "none"]:
            std = nanstd(rewards.view(-1, k), dim=1).repeat_interleave(k, dim=0)
        else:
            std = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, k, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def random_rewards(seed: int, groups: int, k: int, funcs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(groups * k, funcs, generator=g, dtype=torch.float64)
    values[torch.rand(groups * k, funcs, generator=g) < 0.3] = math.nan
    values[0] = math.nan  # an unscorable completion
    values[k : 2 * k, 0] = 0.25  # a constant column in group 1
    if groups > 2:
        values[2 * k : 3 * k] = math.nan  # a group nobody scored
        values[2 * k + 1, 1] = 1.0  # ... but one completion: a single value
    return values


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(6))
def test_multi_objective_advantages_equal_trls(seed, scale_rewards, aggregation):
    k, groups = 4, 5
    values = random_rewards(seed, groups, k, 3)
    weights = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64)
    want = trl_advantages(values, weights, k, scale_rewards, aggregation)
    got = C.multi_objective_advantages(
        values,
        weights.tolist(),
        offsets=torch.arange(0, groups * k + 1, k),
        aggregation=aggregation,
        scale_rewards=scale_rewards,
    )
    # TRL's nanstd computes Bessel's factor count / (count - 1) in float32 (a true division
    # of integer tensors), a 1e-8 relative difference from the exact float64 factor.
    torch.testing.assert_close(got.values, want, rtol=1e-7, atol=1e-9)


def test_scale_rewards_is_a_named_option_and_bools_are_the_older_spelling():
    utils = Ragged.from_lists([[0.0, 1.0, 3.0], [2.0, 2.5]], dtype=torch.float64)
    group = C.group_advantages(utils, scale_rewards="group").values
    torch.testing.assert_close(C.group_advantages(utils, scale_rewards=True).values, group)
    none = C.group_advantages(utils, scale_rewards="none").values
    torch.testing.assert_close(C.group_advantages(utils, scale_rewards=False).values, none)
    torch.testing.assert_close(none, torch.tensor([-4 / 3, -1 / 3, 5 / 3, -0.25, 0.25]).double())
    # "batch": the group means, divided by the std of all five about their global mean.
    batch = C.group_advantages(utils, scale_rewards="batch").values
    std = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.5], dtype=torch.float64).std()
    torch.testing.assert_close(batch, none / (std + 1e-4))
    with pytest.raises(ComputeError, match=r"scale_rewards: expected one of .*, got 'global'"):
        C.group_advantages(utils, scale_rewards="global")


def test_missing_utilities_are_left_out_and_get_zero_advantage():
    nan = math.nan
    utils = Ragged.from_lists([[nan, 1.0, 3.0], [nan, 2.0], [nan, nan]], dtype=torch.float64)
    got = C.group_advantages(utils, missing="exclude").values.tolist()
    # Group 0: mean 2, std sqrt(2); the NaN gets 0. Group 1: one value, std undefined: 0.
    s = math.sqrt(2.0) + 1e-4
    assert got == pytest.approx([0.0, -1 / s, 1 / s, 0.0, 0.0, 0.0, 0.0], abs=1e-15)
    batch = C.group_advantages(utils, missing="exclude", scale_rewards="batch").values
    std = float(torch.tensor([1.0, 3.0, 2.0]).double().std())
    assert batch.tolist() == pytest.approx([0.0, -1 / (std + 1e-4), 1 / (std + 1e-4), 0, 0, 0, 0])
    with pytest.raises(ComputeError, match="expected finite values, got nan at group 0"):
        C.group_advantages(utils)  # the default refuses a missing utility, naming the group
    with pytest.raises(ComputeError, match="expected finite values, got inf at group 1"):
        C.group_advantages(Ragged.from_lists([[nan, 1.0], [math.inf, 0.0]]), missing="exclude")


def test_fewer_than_two_values_in_the_whole_batch_give_zero_batch_advantages():
    nan = math.nan
    utils = Ragged.from_lists([[nan, 5.0], [nan, nan]], dtype=torch.float64)
    assert C.group_advantages(utils, missing="exclude", scale_rewards="batch").tolist() == [
        [0.0, 0.0],
        [0.0, 0.0],
    ]
