"""Arrow-backed read-only sequences, and the zero-copy promises the records make through them."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import (
    AdvantageStats,
    GenerationBatch,
    LossOutputs,
    LossScalarBundle,
    PromptCacheEntry,
    QDistribution,
    Ragged,
    ReferenceLogprobs,
    ScoreBatch,
    SequenceScores,
)
from maxent_arrow.arrow import ArrowSequence, GroupedSequence, InfoSequence, JsonSequence

NAN = float("nan")


def value_address(array: pa.Array) -> int:
    """Address of the first value of a primitive (possibly sliced) Arrow array."""
    return array.buffers()[1].address + array.offset * (array.type.bit_width // 8)


def child_address(array: pa.Array) -> int:
    """Address of the first value of a (possibly sliced) list array."""
    child = array.values
    width = child.type.bit_width // 8
    return child.buffers()[1].address + (child.offset + array.offsets[0].as_py()) * width


# ---------------------------------------------------------------------------- ArrowSequence
def test_flat_view_behaves_like_a_list():
    view = ArrowSequence(pa.array([1.5, -2.0, NAN, 4.0]))
    assert len(view) == 4
    assert view == [1.5, -2.0, NAN, 4.0]  # NaN equals NaN, as stored data should
    assert view == (1.5, -2.0, NAN, 4.0)
    assert view != [1.5, -2.0, NAN]
    assert view != [1.5, -2.0, 0.0, 4.0]
    assert [1.5, -2.0, NAN, 4.0] == view  # reflected comparison from the list side
    assert view[0] == 1.5 and view[-1] == 4.0 and view[-4] == 1.5
    assert math.isnan(view[2])
    assert list(view)[:2] == [1.5, -2.0]
    assert view.to_pylist()[3] == 4.0 and isinstance(view.to_pylist(), list)
    with pytest.raises(IndexError, match="index 4 out of range for 4 items"):
        view[4]
    with pytest.raises(IndexError, match="index -5 out of range"):
        view[-5]
    with pytest.raises(TypeError):
        view[0] = 1.0  # read-only
    with pytest.raises(TypeError):
        hash(view)


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@given(st.lists(st.floats(allow_nan=True), max_size=10), st.integers(-12, 12) | st.slices(12))
def test_flat_view_indexing_matches_the_list(values, index):
    view = ArrowSequence(pa.array(values, type=pa.float64()))
    if isinstance(index, slice):
        assert view[index] == values[index]
        assert len(view[index]) == len(values[index])
    elif -len(values) <= index < len(values):
        assert same(view[index], values[index])
    else:
        with pytest.raises(IndexError):
            view[index]


@given(
    st.lists(st.lists(st.integers(-5, 5), max_size=4), max_size=6),
    st.integers(0, 6),
    st.integers(-8, 8) | st.slices(8),
)
def test_grouped_view_indexing_matches_the_nested_list(groups, start, index):
    full = pa.array(groups, type=pa.list_(pa.int64())).slice(min(start, len(groups)))
    groups = groups[min(start, len(groups)) :]
    view = GroupedSequence(full)
    assert view == groups and view.samples == [x for g in groups for x in g]
    if isinstance(index, slice):
        assert view[index] == groups[index]
    elif -len(groups) <= index < len(groups):
        assert view[index] == groups[index]
    else:
        with pytest.raises(IndexError):
            view[index]


def test_flat_view_slices_are_views_of_the_same_buffer():
    array = pa.array(np.arange(10, dtype=np.float64))
    view = ArrowSequence(array)
    part = view[2:5]
    assert isinstance(part, ArrowSequence) and part == [2.0, 3.0, 4.0]
    assert value_address(part.arrow) == value_address(array) + 2 * 8
    assert part.to_torch().data_ptr() == value_address(array) + 2 * 8
    assert view[-2:] == [8.0, 9.0]
    assert view[::3] == [0.0, 3.0, 6.0, 9.0]  # a strided slice is a plain list
    assert len(view[7:3]) == 0


def test_flat_view_compares_with_arrays_tensors_and_other_views():
    view = ArrowSequence(pa.array([1, 2, 3], type=pa.int32()))
    assert view == np.array([1, 2, 3])
    assert view == torch.tensor([1, 2, 3])
    assert view == ArrowSequence(pa.array([1, 2, 3], type=pa.int64()))
    assert view != ArrowSequence(pa.array([1, 2]))
    assert view.__eq__("123") is NotImplemented


def test_flat_view_repr_is_the_list_and_shortens_long_data():
    assert repr(ArrowSequence(pa.array(["a", "ü"]))) == "['a', 'ü']"
    assert repr(ArrowSequence(pa.array(range(10)))) == "[0, 1, 2, 3, 4, 5, ... (10 items)]"
    assert repr(ArrowSequence(pa.array([], type=pa.float64()))) == "[]"


def test_flat_view_to_torch_and_numpy_are_zero_copy_sliced_included():
    array = pa.array(np.arange(8, dtype=np.int32)).slice(3)
    view = ArrowSequence(array)
    assert view.arrow is array
    assert view.to_torch().data_ptr() == value_address(array)
    assert view.to_torch().tolist() == [3, 4, 5, 6, 7]
    assert view.numpy().ctypes.data == value_address(array)


def test_chunked_input_is_combined_once():
    view = ArrowSequence(pa.chunked_array([pa.array([1.0]), pa.array([2.0, 3.0])]))
    assert isinstance(view.arrow, pa.Array) and view == [1.0, 2.0, 3.0]


def test_json_view_decodes_entries_on_access():
    view = JsonSequence(pa.array(['{"a": [1, 2]}', None, "3.5", '"ü"']))
    assert view[0] == {"a": [1, 2]} and view[1] is None and view[-1] == "ü"
    assert view == [{"a": [1, 2]}, None, 3.5, "ü"]
    assert isinstance(view[1:], JsonSequence) and view[1:] == [None, 3.5, "ü"]


def test_info_view_gives_dicts_back_with_extra_keys_merged():
    struct = pa.array(
        [
            {"finish_reason": "stop", "token_count": 3, "extra": '{"seed": 7}'},
            {"finish_reason": None, "token_count": None, "extra": None},
            None,
        ],
        type=pa.struct(
            [
                pa.field("finish_reason", pa.string()),
                pa.field("token_count", pa.int32()),
                pa.field("extra", pa.string()),
            ]
        ),
    )
    view = InfoSequence(struct)
    assert view[0] == {"finish_reason": "stop", "token_count": 3, "seed": 7}
    assert view[1] == {}  # absent keys stay absent
    assert view[2] is None
    assert view == [{"finish_reason": "stop", "token_count": 3, "seed": 7}, {}, None]


# ---------------------------------------------------------------------------- GroupedSequence
def test_grouped_view_behaves_like_a_list_of_lists():
    grouped = GroupedSequence(pa.array([[1.0, 2.0], [], [3.0, NAN, 5.0]]))
    assert len(grouped) == 3
    assert grouped == [[1.0, 2.0], [], [3.0, NAN, 5.0]]
    assert grouped == [(1.0, 2.0), (), (3.0, NAN, 5.0)]
    assert grouped != [[1.0, 2.0], [3.0, NAN, 5.0]]
    assert grouped != [[1.0, 2.0], [], [3.0, NAN, 6.0]]
    assert grouped[0] == [1.0, 2.0] and grouped[1] == [] and grouped[-1][0] == 3.0
    assert isinstance(grouped[0], ArrowSequence)
    assert [list(g) for g in grouped][0] == [1.0, 2.0]
    assert grouped.to_pylist()[2][2] == 5.0
    assert grouped.group_sizes().tolist() == [2, 0, 3]
    assert repr(grouped) == "[[1.0, 2.0], [], [3.0, nan, 5.0]]"
    with pytest.raises(IndexError, match="group 3 out of range for 3 groups"):
        grouped[3]
    with pytest.raises(IndexError, match="group -4 out of range"):
        grouped[-4]


def test_grouped_view_of_a_slice_rebases_and_shares_buffers():
    full = pa.array([[9.0], [1.0, 2.0], [], [3.0, 4.0, 5.0]])
    grouped = GroupedSequence(full.slice(1))
    assert grouped == [[1.0, 2.0], [], [3.0, 4.0, 5.0]]
    assert grouped.offsets.tolist() == [0, 2, 2, 5]
    assert grouped.samples == [1.0, 2.0, 3.0, 4.0, 5.0]
    base = child_address(full)
    assert value_address(grouped.samples.arrow) == base + 8
    assert value_address(grouped[-1].arrow) == base + 3 * 8
    assert grouped.to_ragged().values.data_ptr() == base + 8
    tail = grouped[1:]
    assert isinstance(tail, GroupedSequence) and tail == [[], [3.0, 4.0, 5.0]]
    assert grouped[::2] == [[1.0, 2.0], [3.0, 4.0, 5.0]]
    assert repr(GroupedSequence(pa.array([[1]] * 8))).endswith("... (8 groups)]")


def test_grouped_view_to_ragged_is_zero_copy_and_equal():
    array = pa.array([[1, 2], [3]], type=pa.large_list(pa.int64()))
    ragged = GroupedSequence(array).to_ragged()
    assert isinstance(ragged, Ragged) and ragged.tolist() == [[1, 2], [3]]
    assert ragged.values.data_ptr() == child_address(array)


# ---------------------------------------------------------------------------- records
@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples_are_one_buffer(cls):
    record = cls(grouped=[[0.25, 0.75], [], [1.0]], samples=[0.25, 0.75, 1.0])
    grouped_values = record.grouped.arrow.values
    assert value_address(record.samples.arrow) == value_address(grouped_values)
    assert record.samples.to_torch().data_ptr() == child_address(record.grouped.arrow)
    assert record.samples.to_torch().data_ptr() == record.grouped.to_ragged().values.data_ptr()
    assert record.grouped == [[0.25, 0.75], [], [1.0]]
    assert record.samples == [0.25, 0.75, 1.0]


@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples_stay_one_buffer_after_from_arrow(cls, parquet_roundtrip):
    record = cls(grouped=[[1.0, 2.0], [3.0]], samples=[1.0, 2.0, 3.0])
    for table in (record.to_arrow(), parquet_roundtrip(record.to_arrow())):
        back = cls.from_arrow(table)
        assert back == record
        assert back.samples.to_torch().data_ptr() == child_address(back.grouped.arrow)


def test_samples_built_from_grouped_view_reuses_it():
    grouped = GroupedSequence(pa.array([[1.0], [2.0, 3.0]]))
    record = AdvantageStats(grouped=grouped, samples=grouped.samples)
    assert record.grouped.arrow is grouped.arrow
    assert value_address(record.samples.arrow) == value_address(grouped.samples.arrow)


def test_records_hold_views_of_their_list_fields():
    batch = GenerationBatch(
        prompts=["p0", "p1"],
        answers=["a0", "a1"],
        grouped_completions=[["c00", "c01"], ["c10"]],
        grouped_ref_meta=[[{"logprob_sum": -1.5}, None], [[1, 2]]],
        grouped_completion_info=[[{"finish_reason": "length", "token_ids": [1, 2]}, {}], [{}]],
    )
    assert isinstance(batch.prompts, ArrowSequence) and batch.prompts == ["p0", "p1"]
    assert isinstance(batch.grouped_completions, GroupedSequence)
    assert batch.grouped_completions[0] == ["c00", "c01"]
    assert batch.grouped_ref_meta[0][0] == {"logprob_sum": -1.5}
    assert batch.grouped_ref_meta[0][1] is None and batch.grouped_ref_meta[1][0] == [1, 2]
    info = batch.grouped_completion_info[0][0]
    assert info == {"finish_reason": "length", "token_ids": [1, 2]}
    assert "GenerationBatch(prompts=['p0', 'p1']" in repr(batch)
    entry = PromptCacheEntry(input_ids=[5, 6, 7], attention_mask=[1, 1, 1])
    assert entry.input_ids == [5, 6, 7] and entry.input_ids.to_torch().dtype == torch.int32


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
        column = data.column(name)
        column = column.chunk(0) if isinstance(column, pa.ChunkedArray) else column
        assert getattr(back, name).data_ptr() == value_address(column), name
    hidden = data.column("pooled_hidden")
    hidden = hidden.chunk(0) if isinstance(hidden, pa.ChunkedArray) else hidden
    assert back.pooled_hidden.data_ptr() == value_address(hidden.values)


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
    loss = LossOutputs(
        loss=torch.tensor(1.0),
        scalars=LossScalarBundle(1.0, 0.5, None, 0.25, 0.025),
        log_ratio_train=torch.tensor([0.1, 0.2]),
        denom_tok_tensor=torch.tensor([1.0, 2.0]),
    )
    batch = loss.to_arrow()
    back = LossOutputs.from_arrow(batch)
    assert back.denom_tok_tensor.data_ptr() == value_address(batch.column("denom_tok_tensor"))


def test_score_batch_prompt_entries_view_the_prompt_columns(ipc_roundtrip):
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
    assert back == record
    prompt_ids = table.column("prompt_ids").chunk(0)
    entry = back.prompt_entries[1]
    assert entry.input_ids == [3]
    assert entry.input_ids.to_torch().data_ptr() == child_address(prompt_ids) + 2 * 4
