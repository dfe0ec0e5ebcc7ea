"""The demo's reward functions on hand-checked completions."""

from __future__ import annotations

import pytest

from maxent_arrow.demo.rewards import accuracy_reward, final_number, format_reward


def test_final_number_takes_the_last_integer():
    assert final_number(" I think 3 then 12") == "12"
    assert final_number(" -7") == "-7"
    assert final_number("no digits") is None


def test_accuracy_is_exact_match_of_the_final_number():
    completions = [" 12", " 13", "it is 12", " twelve", " -5"]
    answers = ["12", "12", "12", "12", "-5"]
    assert accuracy_reward(completions, answers) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_format_reward_is_one_for_a_bare_number_and_graded_otherwise():
    values = format_reward([" 42", "a 4", "", "abc"], ["0"] * 4)
    assert values[0] == 1.0
    assert values[1] == pytest.approx(0.5 * 2 / 3)
    assert values[2] == 0.0 and values[3] == 0.0


def test_lengths_must_agree():
    with pytest.raises(ValueError):
        accuracy_reward([" 1", " 2"], ["1"])
