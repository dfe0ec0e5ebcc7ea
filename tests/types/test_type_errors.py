"""Bad input is refused at the Arrow boundary (``to_arrow()``, ``validate()``) with a typed
error whose message names the field and the position; construction accepts anything, as the
seed's dataclasses do.

Each message is pinned in full: what, expected, got, and where (field, group, sample, row).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from maxent_arrow import (
    AdvantageStats,
    BatchDiagnostics,
    GenerationBatch,
    LayoutError,
    LengthStats,
    LossOutputs,
    LossScalarBundle,
    MaxentArrowError,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    SchemaError,
    ScoreBatch,
    SequenceScores,
)
from maxent_arrow.types import records_equal


def raises(kind: type[Exception], message: str):
    """``pytest.raises`` that pins the whole message, not a fragment."""
    return pytest.raises(kind, match="^" + re.escape(message) + "$")


def test_errors_are_typed_under_one_root_and_the_expected_builtins():
    assert issubclass(SchemaError, MaxentArrowError) and issubclass(SchemaError, TypeError)
    assert issubclass(LayoutError, MaxentArrowError) and issubclass(LayoutError, ValueError)
    with pytest.raises(ValueError):
        AdvantageStats([[1.0]], [1.0, 2.0]).to_arrow()
    with pytest.raises(TypeError):
        RewardMoments("0.5", 0.1).validate()


# ---------------------------------------------------------------------------- grouped / samples
@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples_that_disagree(cls):
    name = cls.__name__
    with raises(LayoutError, f"{name}.samples: expected 3 values (sum of group sizes), got 2"):
        cls(grouped=[[0.5, 0.5], [1.0]], samples=[0.5, 0.5]).to_arrow()
    with raises(
        LayoutError,
        f"{name}.samples: value 2 is 0.9 but grouped[1][0] is 1.0; samples must be grouped "
        "flattened",
    ):
        cls(grouped=[[0.5, 0.5], [1.0]], samples=[0.5, 0.5, 0.9]).to_arrow()


def test_an_assignment_is_kept_as_given_and_checked_at_to_arrow():
    record = AdvantageStats(grouped=[[1.0, -1.0]], samples=[1.0, -1.0])
    record.samples = [2.0, -1.0]  # kept, as the seed's dataclass keeps it
    assert record.samples == [2.0, -1.0] and record.grouped == [[1.0, -1.0]]
    with raises(
        LayoutError,
        "AdvantageStats.samples: value 0 is 2.0 but grouped[0][0] is 1.0; samples must be "
        "grouped flattened",
    ):
        record.to_arrow()
    record.samples = [1.0, -1.0]
    record.grouped = [[1.0]]
    with pytest.raises(LayoutError):
        record.validate()
    record.grouped = [[1.0, -1.0]]
    assert AdvantageStats.from_arrow(record.to_arrow()) == record


# ---------------------------------------------------------------------------- group layout
def test_per_completion_fields_of_one_group_with_different_lengths():
    completions = [["a"], ["w", "x", "y", "z"]]
    with raises(
        LayoutError,
        "GenerationBatch.grouped_ref_meta: group 1 has 3 entries, expected 4 (the size of "
        "grouped_completions[1])",
    ):
        GenerationBatch(
            ["p0", "p1"], ["a0", "a1"], completions, [[None], [None, None, None]]
        ).to_arrow()
    with raises(
        LayoutError,
        "GenerationBatch.grouped_completion_info: group 0 has 2 entries, expected 1 (the size "
        "of grouped_completions[0])",
    ):
        GenerationBatch(
            ["p0", "p1"], ["a0", "a1"], completions, None, [[{}, {}], [{}] * 4]
        ).to_arrow()
    with raises(
        LayoutError,
        "GenerationBatch.grouped_ref_meta: expected 2 groups (as grouped_completions), got 1",
    ):
        GenerationBatch(["p0", "p1"], ["a0", "a1"], completions, [[None]]).to_arrow()


def test_prompts_answers_and_groups_of_different_lengths():
    with raises(LayoutError, "GenerationBatch.answers: expected 2 answers (one per prompt), got 1"):
        GenerationBatch(["p0", "p1"], ["a0"], [["c"], ["d"]], None).to_arrow()
    with raises(
        LayoutError,
        "GenerationBatch.grouped_completions: expected 2 groups (one per prompt), got 3",
    ):
        GenerationBatch(["p0", "p1"], ["a0", "a1"], [["c"], ["d"], ["e"]], None).to_arrow()
    with raises(
        LayoutError,
        "PromptCompletionBatch.completions: expected 2 entries (one per prompt), got 1",
    ):
        PromptCompletionBatch(["p", "p"], ["c"]).to_arrow()
    with raises(
        LayoutError, "PromptCompletionBatch.metadata: expected 2 entries (one per prompt), got 3"
    ):
        PromptCompletionBatch(["p", "p"], ["c", "d"], [{}, {}, {}]).to_arrow()


def reward_computation(**overrides) -> RewardComputation:
    fields = dict(
        total_utils=[1.0, 0.0, 0.5],
        per_reward_values={"accuracy": [1.0, 0.0, 0.5]},
        advantage=AdvantageStats([[1.0, -1.0], [0.0]], [1.0, -1.0, 0.0]),
        pairs=PromptCompletionBatch(["p", "p", "q"], ["a", "b", "c"]),
        q_distribution=QDistribution([[0.7, 0.3], [1.0]], [0.7, 0.3, 1.0]),
        moments=RewardMoments(0.5, 0.4),
    )
    fields.update(overrides)
    return RewardComputation(**fields)


def test_reward_computation_fields_that_disagree_in_size():
    with raises(
        LayoutError,
        "RewardComputation.per_reward_values['accuracy']: expected 3 values (one per sample, "
        "as total_utils), got 2",
    ):
        reward_computation(per_reward_values={"accuracy": [1.0, 0.0]}).to_arrow()
    with raises(
        LayoutError,
        "RewardComputation.advantage.samples: expected 4 values (one per sample, as "
        "total_utils), got 3",
    ):
        reward_computation(total_utils=[1.0, 0.0, 0.5, 0.5]).to_arrow()
    with raises(
        LayoutError,
        "RewardComputation.q_distribution.grouped: group 0 has 1 entries, expected 2 (the size "
        "of advantage.grouped[0])",
    ):
        reward_computation(
            q_distribution=QDistribution([[1.0], [0.5, 0.5]], [1.0, 0.5, 0.5])
        ).to_arrow()
    with raises(
        LayoutError,
        "RewardComputation.seed_semantic_entropies: expected 2 values (one per group), got 3",
    ):
        reward_computation(seed_semantic_entropies=[0.1, 0.2, 0.3]).to_arrow()
    with raises(
        LayoutError,
        "RewardComputation.ref_logprob_meta: expected 3 values (one per sample, as "
        "total_utils), got 1",
    ):
        reward_computation(ref_logprob_meta=[None]).to_arrow()
    with raises(SchemaError, "RewardComputation.advantage: expected an AdvantageStats, got dict"):
        reward_computation(advantage={"grouped": [[1.0]], "samples": [1.0]}).to_arrow()


def test_a_reassigned_field_is_checked_again_before_writing():
    record = reward_computation()
    record.total_utils = [1.0]
    with raises(
        LayoutError,
        "RewardComputation.advantage.samples: expected 1 values (one per sample, as "
        "total_utils), got 3",
    ):
        record.to_arrow()


# ---------------------------------------------------------------------------- value types
def test_strings_where_floats_belong_name_the_position():
    with raises(
        SchemaError, "AdvantageStats.grouped: expected a float at group 1, sample 0, got str '0.5'"
    ):
        AdvantageStats([[1.0], ["0.5"]], [1.0, 0.5]).to_arrow()
    with raises(SchemaError, "QDistribution.samples: expected a float at position 1, got str 'x'"):
        QDistribution([[1.0, 0.0]], [1.0, "x"]).to_arrow()
    with raises(
        SchemaError, "RewardComputation.total_utils: expected a float at position 2, got str 'n/a'"
    ):
        reward_computation(total_utils=[1.0, 0.0, "n/a"]).to_arrow()
    with raises(
        SchemaError,
        "RewardComputation.per_reward_values['accuracy']: expected a float at position 0, got "
        "str '1'",
    ):
        reward_computation(per_reward_values={"accuracy": ["1", 0.0, 0.5]}).to_arrow()
    with raises(SchemaError, "RewardMoments.std: expected a float, got str '0.1'"):
        RewardMoments(0.5, "0.1").to_arrow()
    with raises(SchemaError, "LossScalarBundle.kl_loss: expected a float, got str 'nan'"):
        LossScalarBundle(1.0, 1.0, None, "nan", 0.0).to_arrow()
    with raises(SchemaError, "LengthStats.max_length: expected a float, got bool True"):
        LengthStats(1.0, 2.0, True, 0.0, 1.0, 2.0, 3.0).to_arrow()
    with raises(
        SchemaError,
        "BatchDiagnostics.kl_per_token_by_len_bucket['0-32']: expected a float, got str 'x'",
    ):
        BatchDiagnostics(None, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, {"0-32": "x"}, {}).to_arrow()
    with raises(
        SchemaError,
        "ReferenceLogprobs.avg_completion_tokens: expected a scalar, got an array of shape (2,)",
    ):
        ReferenceLogprobs(
            torch.zeros(2), torch.zeros(2), torch.zeros(2), 0.0, torch.tensor([1.0, 2.0])
        ).to_arrow()
    with raises(
        SchemaError,
        "GenerationBatch.grouped_completions: expected a str at group 0, sample 1, got int",
    ):
        GenerationBatch(["p"], ["a"], [["ok", 7]], None).to_arrow()
    with raises(
        SchemaError, "PromptCompletionBatch.prompts: expected a str at position 0, got bytes"
    ):
        PromptCompletionBatch([b"p"], ["c"]).to_arrow()
    with raises(SchemaError, "AdvantageStats.grouped: expected a list at group 0, got str"):
        AdvantageStats(["0.5"], [0.5]).to_arrow()


def test_nulls_inside_lists():
    with raises(
        LayoutError,
        "AdvantageStats.grouped: expected a float at group 0, sample 1, got None (null)",
    ):
        AdvantageStats([[1.0, None]], [1.0, 0.0]).to_arrow()
    with raises(
        LayoutError,
        "RewardComputation.total_utils: expected a float at position 0, got None (null)",
    ):
        reward_computation(total_utils=[None, 0.0, 0.5]).to_arrow()
    with raises(
        LayoutError,
        "GenerationBatch.grouped_completions: expected a str at group 0, sample 0, got None (null)",
    ):
        GenerationBatch(["p"], ["a"], [[None]], None).to_arrow()
    # A missing answer is a null in the (nullable) answer column, stored as given.
    no_answer = GenerationBatch(["p", "q"], ["a", None], [["c"], ["d"]], None)
    assert GenerationBatch.from_arrow(no_answer.to_arrow()).answers == ["a", None]
    with raises(
        LayoutError, "QDistribution.grouped: expected no nulls, got a null at group 1, sample 0"
    ):
        QDistribution(pa.array([[1.0], [None, 1.0]]), [1.0, 0.0, 1.0]).to_arrow()
    with raises(LayoutError, "QDistribution.samples: expected no nulls, got a null at position 1"):
        QDistribution([[1.0, 0.0]], pa.array([1.0, None])).to_arrow()
    with raises(
        LayoutError, "AdvantageStats.grouped: expected no null groups, got a null at group 1"
    ):
        AdvantageStats(pa.array([[1.0], None]), [1.0]).to_arrow()


def test_metadata_that_is_not_json():
    with raises(
        SchemaError,
        "GenerationBatch.grouped_ref_meta: expected JSON-serialisable metadata at group 1, "
        "sample 0, got dict (Object of type bytes is not JSON serializable)",
    ):
        GenerationBatch(
            ["p", "q"], ["a", "b"], [["c"], ["d"]], [[None], [{"raw": b"\x00"}]]
        ).to_arrow()
    with raises(
        SchemaError,
        "RewardComputation.ref_logprob_meta: expected JSON-serialisable metadata at position 1, "
        "got set (Object of type set is not JSON serializable)",
    ):
        reward_computation(ref_logprob_meta=[None, {1, 2}, None]).to_arrow()
    with raises(
        SchemaError,
        "GenerationBatch.grouped_completion_info: expected JSON-serialisable metadata at group "
        "0, sample 0, got dict (Object of type ndarray is not JSON serializable)",
    ):
        GenerationBatch(["p"], ["a"], [["c"]], None, [[{"logits": np.zeros(2)}]]).to_arrow()
    with raises(
        SchemaError,
        "GenerationBatch.grouped_completion_info: expected a dict at group 0, sample 0, got list",
    ):
        GenerationBatch(["p"], ["a"], [["c"]], None, [[["stop"]]]).to_arrow()
    with raises(
        SchemaError,
        "PromptCompletionBatch.metadata: expected str keys at position 0, got 3",
    ):
        PromptCompletionBatch(["p"], ["c"], [{3: "x"}]).to_arrow()


def test_entries_with_a_trl_payload_are_converted_before_json():
    class Result:  # the seed's VLLMLogprobResult exposes to_trl_payload()
        def to_trl_payload(self):
            return {"logprob_sum": -2.5, "token_count": 3}

    batch = GenerationBatch(["p"], ["a"], [["c"]], [[Result()]])
    assert isinstance(batch.grouped_ref_meta[0][0], Result)  # kept as given
    back = GenerationBatch.from_arrow(batch.to_arrow())
    assert back.grouped_ref_meta[0][0] == {"logprob_sum": -2.5, "token_count": 3}


# ---------------------------------------------------------------------------- tensors
def test_tensors_of_the_wrong_rank_or_dtype():
    vector = torch.zeros(3)
    with raises(
        LayoutError, "SequenceScores.cur_logp_sum: expected a tensor of rank 1, got shape (3, 1)"
    ):
        SequenceScores(torch.zeros(3, 1), vector, vector, vector).to_arrow()
    with raises(
        SchemaError,
        "SequenceScores.behavior_logp_sum: expected a floating tensor, got dtype torch.int64",
    ):
        SequenceScores(vector, torch.zeros(3, dtype=torch.int64), vector, vector).to_arrow()
    with raises(
        LayoutError, "SequenceScores.token_logp: expected a tensor of rank 2, got shape (3,)"
    ):
        SequenceScores(vector, vector, vector, vector, token_logp=vector).to_arrow()
    with raises(
        LayoutError, "SequenceScores.policy_entropy_sum: expected 3 rows (as cur_logp_sum), got 2"
    ):
        SequenceScores(vector, vector, vector, vector, policy_entropy_sum=torch.zeros(2)).to_arrow()
    with raises(
        LayoutError,
        "SequenceScores.token_mask: expected shape (3, 4) (as token_logp), got (3, 5)",
    ):
        SequenceScores(
            vector,
            vector,
            vector,
            vector,
            token_logp=torch.zeros(3, 4),
            token_mask=torch.ones(3, 5),
        ).to_arrow()
    with raises(
        SchemaError,
        "ScoreBatch.completion_ids: expected an integer tensor, got dtype torch.float32",
    ):
        score_batch(completion_ids=torch.zeros(1, 2)).to_arrow()
    with raises(
        LayoutError, "ScoreBatch.completion_ids: expected a tensor of rank 2, got shape (2,)"
    ):
        score_batch(completion_ids=torch.tensor([5, 6])).to_arrow()
    with raises(
        LayoutError,
        "ScoreBatch.completion_attention_mask: expected shape (1, 2) (as completion_ids), got "
        "(1, 3)",
    ):
        score_batch(completion_attention_mask=torch.ones(1, 3, dtype=torch.int64)).to_arrow()
    with raises(
        LayoutError, "ScoreBatch.total_sequences: expected 1 (rows of completion_ids), got 2"
    ):
        score_batch(total_sequences=2).to_arrow()
    # slice_size=0 (the seed's "all rows") is stored as given.
    assert ScoreBatch.from_arrow(score_batch(slice_size=0).to_arrow()).slice_size == 0
    with raises(SchemaError, "ScoreBatch.pad_token_id: expected an int, got float 0.0"):
        score_batch(pad_token_id=0.0).to_arrow()
    with raises(
        LayoutError, "ReferenceLogprobs.ref_tok_counts: expected 2 rows (as ref_logp_sum), got 3"
    ):
        ReferenceLogprobs(torch.zeros(2), torch.zeros(3), torch.zeros(2), 0.0, 0.0).to_arrow()
    with raises(LayoutError, "LossOutputs.loss: expected a tensor of rank 0, got shape (1,)"):
        LossOutputs(torch.zeros(1), LossScalarBundle(0, 0, None, 0, 0), vector, vector).to_arrow()
    with raises(SchemaError, "SequenceScores.cur_logp_sum: expected numbers, got an array of <U1"):
        SequenceScores(["a"], [0.0], [0.0], [0.0]).to_arrow()


def score_batch(**overrides) -> ScoreBatch:
    fields = dict(
        prompt_entries=[PromptCacheEntry([1, 2], [1, 1])],
        completion_ids=torch.tensor([[5, 6]]),
        completion_attention_mask=torch.tensor([[1, 1]]),
        pad_token_id=0,
        max_prompt_len=8,
        slice_size=1,
        total_sequences=1,
    )
    fields.update(overrides)
    return ScoreBatch(**fields)


def test_negative_ids_are_stored_and_out_of_range_ones_refused():
    # Negative ids (-100 label padding, say) fit the int32 columns: stored as given.
    padded = score_batch(
        prompt_entries=[PromptCacheEntry([1], [1])] * 2,
        completion_ids=torch.tensor([[5, 6, 7], [8, 9, -1]]),
        completion_attention_mask=torch.ones(2, 3, dtype=torch.int64),
        total_sequences=2,
    )
    assert records_equal(ScoreBatch.from_arrow(padded.to_arrow()), padded)
    entry = PromptCacheEntry([1, 2, -3], [1, 1, 1])
    assert PromptCacheEntry.from_arrow(entry.to_arrow()).input_ids == [1, 2, -3]
    generation = GenerationBatch(
        ["p", "q"], ["a", "b"], [["c"], ["d"]], None, [[{}], [{"token_ids": [3, -7]}]]
    )
    back = GenerationBatch.from_arrow(generation.to_arrow())
    assert back.grouped_completion_info[1][0] == {"token_ids": [3, -7]}
    with raises(
        LayoutError,
        "PromptCacheEntry.input_ids: expected values in [-2147483648, 2147483647] (int32), got "
        "2147483648 at position 1",
    ):
        PromptCacheEntry([0, 2**31], [1, 1]).to_arrow()
    with raises(SchemaError, "PromptCacheEntry.input_ids: expected an int at position 0, got 1.0"):
        PromptCacheEntry([1.0], [1]).to_arrow()
    with raises(
        LayoutError, "PromptCacheEntry.attention_mask: expected 2 entries (as input_ids), got 1"
    ):
        PromptCacheEntry([1, 2], [1]).to_arrow()


def test_masks_that_are_not_prefixes_cannot_be_stored():
    batch = score_batch(completion_attention_mask=torch.tensor([[0, 1]]))
    message = (
        "{}: row {} is not a prefix mask (a 0 before a 1); right-padded rows need ones then zeros"
    )
    with raises(LayoutError, message.format("ScoreBatch.completion_attention_mask", 0)):
        batch.to_arrow()
    scores = SequenceScores(
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.ones(2),
        token_logp=torch.zeros(2, 3),
        token_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]),
    )
    with raises(LayoutError, message.format("SequenceScores.token_mask", 1)):
        scores.to_arrow()
    reference = ReferenceLogprobs(
        torch.zeros(2),
        torch.ones(2),
        torch.zeros(2),
        0.0,
        1.0,
        ref_token_logp=torch.zeros(2, 2),
        ref_token_mask=torch.tensor([[0, 1], [1, 1]]),
    )
    with raises(LayoutError, message.format("ReferenceLogprobs.ref_token_mask", 0)):
        reference.to_arrow()
    mask_only = ReferenceLogprobs(
        torch.zeros(1), torch.ones(1), torch.zeros(1), 0.0, 1.0, ref_token_mask=torch.ones(1, 2)
    )
    with raises(
        SchemaError,
        "ReferenceLogprobs.ref_token_mask: a mask without ref_token_logp cannot be stored",
    ):
        mask_only.to_arrow()


# ---------------------------------------------------------------------------- from_arrow
def test_from_arrow_on_missing_or_mistyped_columns():
    batch = AdvantageStats([[1.0, -1.0]], [1.0, -1.0]).to_arrow()
    with raises(SchemaError, "AdvantageStats.from_arrow: missing column 'advantages'"):
        AdvantageStats.from_arrow(batch.drop_columns(["advantages"]))
    with raises(
        SchemaError,
        "AdvantageStats.from_arrow: column 'advantages' expected list<double>, got "
        "list<item: string>",
    ):
        AdvantageStats.from_arrow(pa.record_batch({"advantages": pa.array([["x"]])}))
    with raises(
        SchemaError,
        "QDistribution.from_arrow: the batch holds an AdvantageStats, not a QDistribution",
    ):
        QDistribution.from_arrow(batch)
    generation = GenerationBatch(["p"], ["a"], [["c"]], None).to_arrow()
    mistyped = generation.set_column(1, "answer", pa.array([1]))
    with raises(
        SchemaError, "GenerationBatch.from_arrow: column 'answer' expected string, got int64"
    ):
        GenerationBatch.from_arrow(mistyped)
    with raises(SchemaError, "RewardMoments.from_arrow: missing column 'std'"):
        RewardMoments.from_arrow(pa.record_batch({"mean": pa.array([0.5])}))
    with raises(SchemaError, "RewardMoments.from_arrow: expected one row, got 2"):
        RewardMoments.from_arrow(pa.record_batch({"mean": [0.5, 0.1], "std": [0.1, 0.1]}))
    with raises(
        SchemaError,
        "SequenceScores.from_arrow: column 'cur_logp_sum' expected a numeric column, got string",
    ):
        SequenceScores.from_arrow(
            pa.record_batch(
                {
                    "cur_logp_sum": pa.array(["x"]),
                    "behavior_logp_sum": [0.0],
                    "log_ratio_train": [0.0],
                    "denom_tok_tensor": [1.0],
                }
            )
        )
    with raises(
        SchemaError,
        "ScoreBatch.from_arrow: expected a pyarrow RecordBatch or Table, got dict",
    ):
        ScoreBatch.from_arrow({"completion_ids": [[1]]})
    rewards = reward_computation().to_arrow()
    without = rewards.drop_columns(["rewards"])
    with raises(
        SchemaError, "RewardComputation.from_arrow: missing reward 'accuracy' in column 'rewards'"
    ):
        RewardComputation.from_arrow(without)
    with raises(
        LayoutError,
        "SequenceScores.from_arrow: column 'log_ratio_train': expected no nulls, "
        "got a null at position 0",
    ):
        SequenceScores.from_arrow(
            pa.record_batch(
                {
                    "cur_logp_sum": [0.0],
                    "behavior_logp_sum": [0.0],
                    "log_ratio_train": pa.array([None], pa.float64()),
                    "denom_tok_tensor": [1.0],
                }
            )
        )
