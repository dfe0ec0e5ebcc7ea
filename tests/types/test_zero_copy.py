"""Zero copy through the records' accessors: an Arrow-born record's ``column()``, ``ragged()``
and ``tensor()`` view its batch, tensor fields come back as views of the column buffers,
``to_arrow()`` of an untouched record gives its own buffers back, and ``evolve`` (the
``dataclasses.replace`` of Arrow-born records) leaves the fields it keeps in Arrow. Proven by
buffer address."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
import torch

from maxent_arrow import (
    AdvantageStats,
    GenerationBatch,
    LossOutputs,
    LossScalarBundle,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    Ragged,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    ScoreBatch,
    SequenceScores,
)
from maxent_arrow.types import evolve, records_equal


def value_address(array: pa.Array) -> int:
    """Address of the first value of a primitive (possibly sliced) Arrow array."""
    return array.buffers()[1].address + array.offset * (array.type.bit_width // 8)


def child_address(array: pa.Array) -> int:
    """Address of the first value of a (possibly sliced) list array."""
    child = array.values
    width = child.type.bit_width // 8
    return child.buffers()[1].address + (child.offset + array.offsets[0].as_py()) * width


def one_chunk(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if isinstance(column, pa.ChunkedArray) else column


# ---------------------------------------------------------------------------- grouped pairs
@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples_are_one_buffer(cls):
    record = cls(grouped=[[0.25, 0.75], [], [1.0]], samples=[0.25, 0.75, 1.0])
    batch = record.to_arrow()
    assert batch.num_columns == 1  # two fields, one list column: each number stored once
    back = cls.from_arrow(batch)
    grouped = back.column("grouped")
    assert value_address(back.column("samples")) == child_address(grouped)
    assert back.tensor("samples").data_ptr() == child_address(grouped)
    assert back.tensor("samples").data_ptr() == back.ragged("grouped").values.data_ptr()
    assert back.grouped == [[0.25, 0.75], [], [1.0]]
    assert back.samples == [0.25, 0.75, 1.0]


@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples_stay_one_buffer_after_from_arrow(cls, parquet_roundtrip):
    record = cls(grouped=[[1.0, 2.0], [3.0]], samples=[1.0, 2.0, 3.0])
    for table in (record.to_arrow(), parquet_roundtrip(record.to_arrow())):
        back = cls.from_arrow(table)
        assert back == record
        column = one_chunk(table.column(0))
        assert back.tensor("samples").data_ptr() == child_address(column)
        assert back.ragged("grouped").values.data_ptr() == child_address(column)


def test_arrow_arrays_given_as_fields_are_stored_without_copy():
    grouped = pa.array([[1.0], [2.0, 3.0]])
    record = AdvantageStats(grouped=grouped, samples=grouped.flatten())
    assert record.grouped is grouped  # kept as given
    stored = record.to_arrow().column("advantages")
    assert child_address(stored) == child_address(grouped)


# ---------------------------------------------------------------------------- untouched records
def reward_computation() -> RewardComputation:
    pairs = PromptCompletionBatch(["p", "p", "q"], ["a", "b", "c"], [{}, {}, {"x": 1}])
    return RewardComputation(
        total_utils=[1.0, 0.0, 0.5],
        per_reward_values={"accuracy": [1.0, 0.0, 0.5]},
        advantage=AdvantageStats([[1.0, -1.0], [0.0]], [1.0, -1.0, 0.0]),
        pairs=pairs,
        q_distribution=QDistribution([[0.7, 0.3], [1.0]], [0.7, 0.3, 1.0]),
        moments=RewardMoments(0.5, 0.4),
        completion_metadata=pairs.metadata,
    )


def addresses(batch: pa.RecordBatch) -> list[int]:
    return [b.address for column in batch.columns for b in column.buffers() if b is not None]


@pytest.mark.parametrize("via", ["batch", "parquet", "ipc"])
def test_to_arrow_of_an_untouched_record_is_its_own_batch(via, parquet_roundtrip, ipc_roundtrip):
    data = reward_computation().to_arrow()
    data = {"batch": lambda b: b, "parquet": parquet_roundtrip, "ipc": ipc_roundtrip}[via](data)
    back = RewardComputation.from_arrow(data)
    batch = back.to_arrow()
    assert batch is back.to_arrow()  # O(1): nothing converted, the same object each time
    assert addresses(batch) == [
        b.address for column in data.columns for b in one_chunk(column).buffers() if b is not None
    ]
    assert back.tensor("total_utils").data_ptr() == child_address(one_chunk(data["total_utils"]))
    assert back == reward_computation()


def test_reading_a_nested_record_keeps_the_columns():
    back = RewardComputation.from_arrow(reward_computation().to_arrow())
    before = back.to_arrow()
    advantage = back.advantage  # an Arrow-born AdvantageStats over the same column
    assert advantage.column("grouped").buffers() == before.column("advantages").buffers()
    after = back.to_arrow()
    assert addresses(after) == addresses(before)
    advantage.samples[0] = 1.0  # read and edited (same value): re-encoded, still equal
    assert back.to_arrow().equals(before)


def test_evolve_converts_only_the_fields_it_changes():
    source = reward_computation().to_arrow()
    back = RewardComputation.from_arrow(source)
    changed = evolve(back, total_utils=[2.0, 2.0, 2.0])
    # The fields evolve kept are still in Arrow, on both objects.
    assert "pairs_metadata" in source.schema.names
    for name in ("per_reward_values", "ref_logprob_meta", "completion_metadata"):
        assert name not in vars(back) and name not in vars(changed), name
    assert "total_utils" not in vars(back) and back.total_utils == [1.0, 0.0, 0.5]
    batch = changed.to_arrow()
    assert batch.column("total_utils").to_pylist() == [[2.0, 2.0], [2.0]]
    for name in ("advantages", "q", "rewards", "completions", "pairs_metadata"):
        assert addresses(pa.record_batch([batch.column(name)], [name])) == addresses(
            pa.record_batch([source.column(name)], [name])
        ), name
    assert changed.completion_metadata is changed.pairs.metadata  # the aliasing, kept
    assert changed.pairs is back.pairs  # nested records are shared, as replace shares
    fresh = RewardComputation.from_arrow(source)
    untouched = evolve(fresh)  # nothing converted: every column is the source's
    assert untouched is not fresh and addresses(untouched.to_arrow()) == addresses(source)


def test_replace_gives_the_same_record_as_evolve_and_reads_what_it_copies():
    source = reward_computation().to_arrow()
    back = RewardComputation.from_arrow(source)
    lazy_copy = evolve(back, total_utils=[2.0, 2.0, 2.0])
    replaced = dataclasses.replace(back, total_utils=[2.0, 2.0, 2.0])
    assert replaced == lazy_copy and type(replaced) is RewardComputation
    assert replaced.to_arrow().equals(lazy_copy.to_arrow())
    # replace read each field it copied (kept on `back`, shared with the copy, as on the seed)
    assert replaced.per_reward_values is back.per_reward_values
    assert replaced.ref_logprob_meta is back.ref_logprob_meta
    assert replaced.completion_metadata is replaced.pairs.metadata


def test_replace_and_evolve_from_any_caller_and_after_a_failed_call():
    back = RewardComputation.from_arrow(reward_computation().to_arrow())

    def through_a_helper(record, **changes):  # no frame of dataclasses' own is involved
        return dataclasses.replace(record, **changes)

    assert through_a_helper(back, entropy_bonus_scale=0.5).entropy_bonus_scale == 0.5
    with pytest.raises(TypeError):
        dataclasses.replace(back, no_such_field=1)
    with pytest.raises(TypeError, match="RewardComputation has no field 'no_such_field'"):
        evolve(back, no_such_field=1)
    fresh = AdvantageStats([[1.0]], [1.0])  # an __init__ after the failed calls
    assert vars(fresh) == {"grouped": [[1.0]], "samples": [1.0]}
    python_born = reward_computation()
    assert evolve(python_born, total_utils=[0.0] * 3).pairs is python_born.pairs


def test_generation_batch_columns_are_views(ipc_roundtrip):
    batch = GenerationBatch(
        ["p0", "p1"],
        ["a0", "a1"],
        [["c00", "c01"], ["c10"]],
        None,
        [[{"token_ids": [5, 6]}, {"token_ids": [7]}], [{"token_ids": [8, 9, 10]}]],
    )
    table = ipc_roundtrip(batch.to_arrow())
    back = GenerationBatch.from_arrow(table)
    completions = back.column("grouped_completions")
    assert completions.buffers() == one_chunk(table.column("completions")).buffers()
    assert back.column("completions").buffers() == completions.buffers()
    ids = pa.StructArray.field(back.column("completion_info").flatten(), "token_ids")
    assert Ragged.from_arrow(ids).values.data_ptr() == child_address(
        one_chunk(table.column("completion_info")).flatten().field("token_ids")
    )
    assert back.to_arrow().num_rows == 2 and back == batch  # no tensor field: plain `==`


# ---------------------------------------------------------------------------- tensors back
def scores() -> SequenceScores:
    return SequenceScores(
        cur_logp_sum=torch.tensor([-1.0, -2.0, -3.0]),
        behavior_logp_sum=torch.tensor([-1.1, -2.1, -3.1], dtype=torch.float64),
        log_ratio_train=torch.tensor([0.1, 0.2, 0.3]),
        denom_tok_tensor=torch.tensor([2.0, 1.0, 3.0]),
        policy_entropy_sum=torch.tensor([0.5, 0.6, 0.7]),
        pooled_hidden=torch.arange(6.0).reshape(3, 2),
        token_logp=torch.tensor([[-0.5, -0.5, 0.0], [-2.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]),
        token_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
    )


@pytest.mark.parametrize("via", ["batch", "parquet", "ipc"])
def test_vectors_from_arrow_are_views_of_the_column_buffers(via, parquet_roundtrip, ipc_roundtrip):
    data = scores().to_arrow()
    if via == "parquet":
        data = parquet_roundtrip(data)
    elif via == "ipc":
        data = ipc_roundtrip(data)
    back = SequenceScores.from_arrow(data)
    for name in ("cur_logp_sum", "behavior_logp_sum", "log_ratio_train", "denom_tok_tensor"):
        column = one_chunk(data.column(name))
        assert getattr(back, name).data_ptr() == value_address(column), name
        assert back.tensor(name).data_ptr() == value_address(column), name
    hidden = one_chunk(data.column("pooled_hidden"))
    assert back.pooled_hidden.data_ptr() == value_address(hidden.values)
    # Fields read back as those views and left in place keep their columns in to_arrow.
    again = back.to_arrow()
    assert value_address(again.column("cur_logp_sum")) == value_address(
        one_chunk(data.column("cur_logp_sum"))
    )


def test_to_arrow_of_cpu_tensors_shares_their_memory():
    record = scores()
    batch = record.to_arrow()
    assert value_address(batch.column("cur_logp_sum")) == record.cur_logp_sum.data_ptr()
    reference = ReferenceLogprobs(
        ref_logp_sum=torch.tensor([-1.0, -0.5]),
        ref_tok_counts=torch.tensor([2.0, 4.0]),
        ref_logp_sum_raw=torch.tensor([-2.0, -2.0]),
        ref_logp_mean=-2.0,
        avg_completion_tokens=3.0,
    )
    back = ReferenceLogprobs.from_arrow(reference.to_arrow())
    assert back.ref_logp_sum_raw.data_ptr() == reference.ref_logp_sum_raw.data_ptr()
    assert back.tensor("ref_logp_sum_raw").data_ptr() == reference.ref_logp_sum_raw.data_ptr()
    loss = LossOutputs(
        loss=torch.tensor(1.0),
        scalars=LossScalarBundle(1.0, 0.5, None, 0.25, 0.025),
        log_ratio_train=torch.tensor([0.1, 0.2]),
        denom_tok_tensor=torch.tensor([1.0, 2.0]),
    )
    batch = loss.to_arrow()
    back = LossOutputs.from_arrow(batch)
    assert back.denom_tok_tensor.data_ptr() == value_address(batch.column("denom_tok_tensor"))


def test_score_batch_prompt_ids_are_viewed_without_building_entries(ipc_roundtrip):
    record = ScoreBatch(
        prompt_entries=[PromptCacheEntry([1, 2], [1, 1]), PromptCacheEntry([3], [1])],
        completion_ids=torch.tensor([[7, 8], [9, 0]]),
        completion_attention_mask=torch.tensor([[1, 1], [1, 0]]),
        pad_token_id=0,
        max_prompt_len=4,
        slice_size=2,
        total_sequences=2,
    )
    table = ipc_roundtrip(record.to_arrow())
    back = ScoreBatch.from_arrow(table)
    prompt_ids = one_chunk(table.column("prompt_ids"))
    ragged = back.ragged("prompt_ids")
    assert ragged.values.data_ptr() == child_address(prompt_ids)
    assert ragged[1].data_ptr() == child_address(prompt_ids) + 2 * 4
    assert "prompt_entries" not in vars(back)  # no entry was built for that
    assert records_equal(back, record)
    assert "prompt_entries" not in vars(back)  # nor for the comparison
    entry = back.prompt_entries[1]
    assert entry.input_ids == [3] and isinstance(entry.input_ids, list)
