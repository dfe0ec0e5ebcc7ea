"""Ragged: zero-copy views of Arrow list arrays, segment helpers, padding, device moves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import LayoutError, Ragged, SchemaError
from maxent_arrow.arrow import arrow_to_torch, torch_to_arrow


def child_address(array: pa.Array) -> int:
    """Address of the first value of a (possibly sliced) list array, from its raw buffers."""
    child = array.values  # the whole child: ignores the slice
    width = child.type.bit_width // 8
    return child.buffers()[1].address + (child.offset + array.offsets[0].as_py()) * width


def random_rows(rng: np.random.Generator, n_rows: int, max_len: int) -> list[list[int]]:
    return [rng.integers(-50, 50, rng.integers(0, max_len + 1)).tolist() for _ in range(n_rows)]


# ---------------------------------------------------------------------------- from_arrow
@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
@pytest.mark.parametrize("value_type", [pa.int32(), pa.int64(), pa.float32(), pa.float64()])
def test_from_arrow_views_the_child_buffer_without_copying(list_type, value_type):
    array = pa.array([[1, 2, 3], [], [4, 5], [6]], type=list_type(value_type))
    ragged = Ragged.from_arrow(array)
    assert ragged.values.data_ptr() == child_address(array)
    assert ragged.offsets.dtype == torch.int64
    assert ragged.offsets.tolist() == [0, 3, 3, 5, 6]
    assert ragged.tolist() == array.to_pylist()


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
def test_from_arrow_of_a_slice_rebases_offsets_and_views_the_slice(list_type):
    full = pa.array([[9, 9], [1, 2, 3], [], [4, 5], [6, 7, 8]], type=list_type(pa.int32()))
    sliced = full.slice(1, 3)
    assert sliced.offsets[0].as_py() == 2  # the trap: a slice's offsets are not rebased
    ragged = Ragged.from_arrow(sliced)
    assert ragged.values.data_ptr() == child_address(sliced)
    assert ragged.values.data_ptr() == child_address(full) + 2 * 4
    assert ragged.offsets.tolist() == [0, 3, 3, 5]
    assert ragged.tolist() == [[1, 2, 3], [], [4, 5]]


@given(
    st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5), max_size=8),
    st.integers(0, 8),
    st.integers(0, 8),
    st.sampled_from([pa.list_, pa.large_list]),
)
def test_from_arrow_of_any_slice_matches_the_rows_and_views_the_buffer(
    rows, start, length, list_type
):
    array = pa.array(rows, type=list_type(pa.int32())).slice(start, length)
    ragged = Ragged.from_arrow(array)
    assert ragged.tolist() == array.to_pylist()
    assert ragged.offsets[0] == 0 and len(ragged) == len(array)
    if ragged.num_values:
        assert ragged.values.data_ptr() == child_address(array)


def test_from_arrow_of_a_slice_of_a_sliced_child():
    child = pa.array(np.arange(100, dtype=np.float64)).slice(10)
    offsets = pa.array([0, 2, 5, 9], type=pa.int32())
    array = pa.ListArray.from_arrays(offsets, child).slice(1)
    ragged = Ragged.from_arrow(array)
    assert ragged.values.data_ptr() == child_address(array)
    assert ragged.tolist() == [[12.0, 13.0, 14.0], [15.0, 16.0, 17.0, 18.0]]


def test_from_arrow_of_a_one_chunk_chunked_array_is_zero_copy():
    chunk = pa.array([[1.0, 2.0], [3.0]], type=pa.list_(pa.float32())).slice(1)
    ragged = Ragged.from_arrow(pa.chunked_array([chunk]))
    assert ragged.values.data_ptr() == child_address(chunk)
    assert ragged.tolist() == [[3.0]]


def test_from_arrow_of_several_chunks_concatenates_in_order():
    a = pa.array([[1, 2], [3]], type=pa.list_(pa.int64()))
    b = pa.array([[4], [], [5, 6, 7]], type=pa.list_(pa.int64())).slice(1)
    ragged = Ragged.from_arrow(pa.chunked_array([a, b]))
    assert ragged.tolist() == [[1, 2], [3], [], [5, 6, 7]]
    assert ragged.offsets.tolist() == [0, 2, 3, 3, 6]


@pytest.mark.parametrize(
    "array",
    [
        pa.array([], type=pa.list_(pa.int32())),
        pa.chunked_array([], type=pa.list_(pa.int32())),
        pa.array([[1]], type=pa.list_(pa.int32())).slice(1),
    ],
)
def test_from_arrow_of_zero_rows(array):
    ragged = Ragged.from_arrow(array)
    assert len(ragged) == 0
    assert ragged.offsets.tolist() == [0]
    assert ragged.num_values == 0


def test_from_arrow_refuses_nulls_nested_lists_and_non_lists():
    with pytest.raises(LayoutError, match="expected no null rows, got a null at row 1"):
        Ragged.from_arrow(pa.array([[1], None, [2]], type=pa.list_(pa.int32())))
    with pytest.raises(LayoutError, match="expected no nulls inside lists, got a null at value 2"):
        Ragged.from_arrow(pa.array([[1], [2, None]], type=pa.list_(pa.int32())))
    with pytest.raises(SchemaError, match="expected a list of primitives"):
        Ragged.from_arrow(pa.array([[[1]]], type=pa.list_(pa.list_(pa.int32()))))
    with pytest.raises(SchemaError, match="expected a list array, got int32"):
        Ragged.from_arrow(pa.array([1, 2], type=pa.int32()))
    with pytest.raises(SchemaError, match="expected an integer or floating array, got string"):
        Ragged.from_arrow(pa.array([["a"]]))


# ---------------------------------------------------------------------------- construction
def test_constructor_refuses_bad_offsets_by_message():
    values = torch.arange(3.0)
    with pytest.raises(LayoutError, match="expected to start at 0, got 1"):
        Ragged(values, torch.tensor([1, 2, 3]))
    with pytest.raises(LayoutError, match="non-decreasing offsets, got 2 then 1 at row 1"):
        Ragged(values, torch.tensor([0, 2, 1, 3]))
    with pytest.raises(LayoutError, match=r"expected to end at len\(values\) = 3, got 4"):
        Ragged(values, torch.tensor([0, 2, 4]))
    with pytest.raises(SchemaError, match="expected dtype torch.int64, got torch.int32"):
        Ragged(values, torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(LayoutError, match="expected a 1-D tensor of rows \\+ 1 entries"):
        Ragged(values, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(LayoutError, match="expected at least 1 dimension"):
        Ragged(torch.tensor(1.0), torch.tensor([0]))
    with pytest.raises(SchemaError, match="expected torch tensors"):
        Ragged([1.0], torch.tensor([0, 1]))


def test_from_lengths_from_lists_and_with_values():
    ragged = Ragged.from_lengths(torch.arange(6), [2, 0, 4])
    assert ragged.offsets.tolist() == [0, 2, 2, 6]
    assert ragged.tolist() == [[0, 1], [], [2, 3, 4, 5]]
    assert Ragged.from_lists([[1, 2], [], [3]], dtype=torch.int32).equal(
        Ragged.from_lengths(torch.tensor([1, 2, 3], dtype=torch.int32), [2, 0, 1])
    )
    assert Ragged.from_lists([[], []], dtype=torch.float32).tolist() == [[], []]
    doubled = ragged.with_values(ragged.values * 2)
    assert doubled.tolist() == [[0, 2], [], [4, 6, 8, 10]]
    assert doubled.offsets is ragged.offsets
    with pytest.raises(LayoutError, match="Ragged.from_lengths: lengths must be >= 0"):
        Ragged.from_lengths(torch.arange(2), [3, -1])
    with pytest.raises(LayoutError, match="expected 6 values, got 5"):
        ragged.with_values(torch.arange(5))


# ---------------------------------------------------------------------------- segment helpers
def test_lengths_row_ids_positions_match_a_plain_loop(rng):
    rows = random_rows(rng, 40, 7)
    ragged = Ragged.from_lists(rows, dtype=torch.int64)
    assert ragged.lengths().tolist() == [len(r) for r in rows]
    assert ragged.row_ids().tolist() == [i for i, r in enumerate(rows) for _ in r]
    assert ragged.positions().tolist() == [j for r in rows for j in range(len(r))]
    assert len(ragged) == 40 and ragged.num_values == sum(map(len, rows))


def test_indexing_slicing_iteration_and_repr():
    ragged = Ragged.from_lists([[1, 2], [], [3, 4, 5]], dtype=torch.int64)
    assert ragged[0].tolist() == [1, 2]
    assert ragged[-1].tolist() == [3, 4, 5]
    assert ragged[-2].tolist() == []
    assert ragged[0].data_ptr() == ragged.values.data_ptr()  # rows are views
    middle = ragged[1:]
    assert isinstance(middle, Ragged)
    assert middle.tolist() == [[], [3, 4, 5]]
    assert middle.offsets.tolist() == [0, 0, 3]
    assert middle.values.data_ptr() == ragged.values.data_ptr() + 2 * 8
    assert ragged[5:].tolist() == [] and len(ragged[2:1]) == 0
    assert [r.tolist() for r in ragged] == [[1, 2], [], [3, 4, 5]]
    with pytest.raises(IndexError, match="row 3 out of range for 3 rows"):
        ragged[3]
    with pytest.raises(IndexError, match="row -4 out of range"):
        ragged[-4]
    with pytest.raises(LayoutError, match="only contiguous slices"):
        ragged[::2]
    text = repr(ragged)
    assert "rows=3" in text and "values=5" in text and "[[1, 2], [], [3, 4, 5]]" in text
    long = Ragged.from_lengths(torch.arange(100), [1] * 100)
    assert repr(long).endswith("[[0], [1], [2], [3], ...])")


def test_equal_compares_rows_and_values_nan_included():
    a = Ragged.from_lists([[1.0, float("nan")], []])
    assert a.equal(Ragged.from_lists([[1.0, float("nan")], []]))
    assert not a.equal(Ragged.from_lists([[1.0], [float("nan")]]))
    assert not a.equal(Ragged.from_lists([[1.0, 2.0], []]))
    assert not a.equal(Ragged.from_lists([[1.0, float("nan")], []], dtype=torch.float64))


# ---------------------------------------------------------------------------- to_padded
def padded_reference(rows, pad, width, dtype, side, trailing):
    """Plain-loop padding, the behaviour to_padded must reproduce."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width, *trailing), pad, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        row = row[:width]
        n = len(row)
        if n == 0:
            continue
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        out[i, cols] = row.to(dtype)
        mask[i, cols] = True
    return out, mask


CASES = [
    # rows, max length, max_len, side, dtype, trailing dims
    (12, 9, None, "right", None, ()),
    (12, 9, None, "left", None, ()),
    (12, 9, 4, "right", torch.int64, ()),
    (12, 9, 4, "left", torch.int64, ()),
    (12, 9, 15, "right", torch.float64, ()),
    (12, 9, 15, "left", None, ()),
    (12, 9, 0, "right", None, ()),
    (7, 5, None, "right", None, (3,)),
    (7, 5, 2, "left", torch.float64, (2, 2)),
    (5, 0, None, "right", None, ()),  # every row empty
    (0, 5, None, "right", None, ()),  # zero rows
    (0, 5, 3, "left", torch.int64, ()),
]


@pytest.mark.parametrize("n_rows, longest, max_len, side, dtype, trailing", CASES)
@pytest.mark.parametrize("kind", ["int32", "float32", "bfloat16", "requires_grad"])
def test_to_padded_matches_a_plain_loop(rng, n_rows, longest, max_len, side, dtype, trailing, kind):
    lengths = rng.integers(0, longest + 1, n_rows)
    if n_rows > 2:
        lengths[1] = 0  # always an empty row among others
    total = int(lengths.sum())
    data = torch.from_numpy(rng.normal(size=(total, *trailing)) * 100)
    values = {
        "int32": data.to(torch.int32),
        "float32": data.float(),
        "bfloat16": data.to(torch.bfloat16),
        "requires_grad": data.float().requires_grad_(),
    }[kind]
    ragged = Ragged.from_lengths(values, lengths.tolist())
    rows = [ragged[i] for i in range(n_rows)]
    padded, mask = ragged.to_padded(-7, max_len=max_len, dtype=dtype, side=side)
    out_dtype = dtype or values.dtype
    expected, expected_mask = padded_reference(
        [r.detach() for r in rows], -7, max_len, out_dtype, side, trailing
    )
    assert padded.dtype == out_dtype and mask.dtype == torch.bool
    assert torch.equal(padded.detach(), expected)
    assert torch.equal(mask, expected_mask)


@pytest.mark.parametrize("n_rows, longest, max_len, side, dtype, trailing", CASES)
@pytest.mark.parametrize("kind", ["int32", "bfloat16"])  # the numpy path and the torch path
def test_to_padded_into_out_buffers_equals_fresh_and_reuses_them(
    rng, n_rows, longest, max_len, side, dtype, trailing, kind
):
    lengths = rng.integers(0, longest + 1, n_rows)
    data = torch.from_numpy(rng.normal(size=(int(lengths.sum()), *trailing)) * 100)
    values = data.to(torch.int32) if kind == "int32" else data.to(torch.bfloat16)
    ragged = Ragged.from_lengths(values, lengths.tolist())
    fresh, fresh_mask = ragged.to_padded(-7, max_len=max_len, dtype=dtype, side=side)
    # Buffers holding garbage from an earlier step: everything must be overwritten.
    buffers = (torch.full_like(fresh, 99), torch.ones_like(fresh_mask))
    pointers = [b.data_ptr() for b in buffers]
    padded, mask = ragged.to_padded(-7, max_len=max_len, dtype=dtype, side=side, out=buffers)
    assert padded is buffers[0] and mask is buffers[1]
    assert [padded.data_ptr(), mask.data_ptr()] == pointers
    assert torch.equal(padded, fresh) and torch.equal(mask, fresh_mask)


@pytest.mark.parametrize(
    "pad, dtype", [(0, torch.int64), (-1, torch.int64), (0.0, torch.float32), (-0.0, torch.float64)]
)
def test_to_padded_into_out_buffers_with_a_memset_pad(pad, dtype):
    ragged = Ragged.from_lists([[1, 2, 3], [], [4]], dtype=torch.int32)
    fresh, fresh_mask = ragged.to_padded(pad, dtype=dtype)
    out = (torch.full((3, 3), 99, dtype=dtype), torch.ones(3, 3, dtype=torch.bool))
    padded, mask = ragged.to_padded(pad, dtype=dtype, out=out)
    assert torch.equal(padded, fresh) and torch.equal(mask, fresh_mask)
    # the bytes too: -0.0 is not memset to +0.0
    assert padded.numpy().tobytes() == fresh.numpy().tobytes()


def test_to_padded_refuses_out_buffers_of_another_shape_or_dtype():
    ragged = Ragged.from_lists([[1, 2, 3], [4]], dtype=torch.int32)
    good = (torch.empty(2, 3, dtype=torch.int64), torch.empty(2, 3, dtype=torch.bool))
    ragged.to_padded(dtype=torch.int64, out=good)
    with pytest.raises(LayoutError, match=r"out padded must be a contiguous torch.int64 tensor"):
        ragged.to_padded(dtype=torch.int64, out=(torch.empty(2, 4, dtype=torch.int64), good[1]))
    with pytest.raises(LayoutError, match=r"out mask must be a contiguous torch.bool tensor"):
        ragged.to_padded(dtype=torch.int64, out=(good[0], torch.empty(2, 3, dtype=torch.int64)))
    with pytest.raises(LayoutError, match="not contiguous"):
        ragged.to_padded(dtype=torch.int64, out=(torch.empty(3, 2, dtype=torch.int64).T, good[1]))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rows, width", [(50, 7), (3, 40), (0, 4), (5, 0)])
def test_prefix_mask_by_table_and_by_comparison_agree(rng, side, rows, width):
    from maxent_arrow.arrow.ragged import prefix_mask

    lengths = rng.integers(0, width + 1, rows)
    columns = np.arange(width)[None, :]
    want = columns < lengths[:, None] if side == "right" else columns >= (width - lengths)[:, None]
    assert np.array_equal(prefix_mask(lengths, width, side=side), want)
    out = np.ones((rows, width), dtype=bool)
    assert prefix_mask(lengths, width, side=side, out=out) is out
    assert np.array_equal(out, want)


def test_to_padded_keeps_gradients_flowing():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    padded, mask = Ragged.from_lengths(values, [2, 1]).to_padded(0.0)
    (padded * torch.tensor([[1.0, 10.0], [100.0, 1000.0]])).sum().backward()
    assert values.grad.tolist() == [1.0, 10.0, 100.0]


def test_to_padded_of_arrow_token_ids_to_int64():
    array = pa.array([[5, 6, 7], [8], []], type=pa.list_(pa.int32()))
    ids, mask = Ragged.from_arrow(array).to_padded(0, dtype=torch.int64)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    left, left_mask = Ragged.from_arrow(array).to_padded(1, side="left")
    assert left.tolist() == [[5, 6, 7], [1, 1, 8], [1, 1, 1]]
    assert left_mask.sum(1).tolist() == [3, 1, 0]


def test_to_padded_refuses_bad_options():
    ragged = Ragged.from_lists([[1, 2]])
    with pytest.raises(LayoutError, match="side must be 'right' or 'left', got 'middle'"):
        ragged.to_padded(side="middle")
    with pytest.raises(LayoutError, match="max_len must be >= 0, got -1"):
        ragged.to_padded(max_len=-1)


# ---------------------------------------------------------------------------- other views
def test_to_nested_views_values_and_keeps_rows():
    ragged = Ragged.from_lists([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]])
    nested = ragged.to_nested()
    assert nested.is_nested
    assert nested.values().data_ptr() == ragged.values.data_ptr()
    assert torch.equal(nested.offsets(), ragged.offsets)
    assert [t.tolist() for t in nested.unbind()] == ragged.tolist()


def test_to_nested_pads_to_the_longest_row_not_the_total_value_count():
    # Built without max_seqlen, torch padded this toy to [3, 6] (the value count).
    ragged = Ragged.from_lists([[1, 2, 3], [4, 5], [6]])
    padded = ragged.to_nested().to_padded_tensor(0)
    assert padded.shape == (3, 3)
    assert torch.equal(padded, torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]]))


def test_to_nested_of_a_realistic_batch_pads_like_to_padded():
    # The shape of bench_ragged (b): 4096 completions of 128..512 tokens. Without max_seqlen
    # the padded tensor was [4096, ~1.3M] (43 GB).
    rng = np.random.default_rng(3)
    lengths = torch.from_numpy(rng.integers(128, 513, 4096))
    values = torch.from_numpy(rng.integers(0, 151_936, int(lengths.sum())))
    ragged = Ragged.from_lengths(values, lengths)
    nested = ragged.to_nested()
    assert nested.values().data_ptr() == values.data_ptr()
    padded = nested.to_padded_tensor(-1)
    assert padded.shape == (4096, int(lengths.max()))
    expected, _ = ragged.to_padded(-1)
    assert torch.equal(padded, expected)


def test_to_nested_keeps_trailing_dimensions_and_empty_batches():
    ragged = Ragged(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 1, 3]))
    assert ragged.to_nested().to_padded_tensor(0.0).shape == (3, 2, 2)
    empty = Ragged(torch.zeros(0), torch.zeros(1, dtype=torch.int64))
    assert empty.to_nested().to_padded_tensor(0.0).shape == (0, 0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64])
def test_to_arrow_round_trip_shares_cpu_values(dtype):
    ragged = Ragged.from_lists([[1, 2], [], [3]], dtype=dtype)
    array = ragged.to_arrow()
    assert pa.types.is_list(array.type)
    assert array.to_pylist() == ragged.tolist()
    assert array.values.buffers()[1].address == ragged.values.data_ptr()
    back = Ragged.from_arrow(array)
    assert back.equal(ragged)
    assert back.values.data_ptr() == ragged.values.data_ptr()
    large = ragged.to_arrow(large=True)
    assert pa.types.is_large_list(large.type) and large.to_pylist() == ragged.tolist()


def test_to_arrow_of_a_sliced_ragged_and_of_bfloat16():
    ragged = Ragged.from_lists([[1.0, 2.0], [3.0], [4.0, 5.0]])[1:]
    assert ragged.to_arrow().to_pylist() == [[3.0], [4.0, 5.0]]
    bf = Ragged.from_lists([[1.5], [2.5, 3.0]], dtype=torch.bfloat16).to_arrow()
    assert bf.type.value_type == pa.float32() and bf.to_pylist() == [[1.5], [2.5, 3.0]]
    with pytest.raises(SchemaError, match="expected 1-D values, got shape \\(2, 2\\)"):
        Ragged.from_lengths(torch.zeros(2, 2), [2]).to_arrow()


def test_pin_memory_without_cuda_is_a_no_op_and_to_cpu_keeps_rows():
    ragged = Ragged.from_lists([[1, 2], [3]])
    if not torch.cuda.is_available():
        assert ragged.pin_memory() is ragged
        assert not ragged.is_pinned()
    moved = ragged.to("cpu")
    assert moved.equal(ragged) and moved.device.type == "cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_move_to_cuda_then_pad_on_device(rng):
    rows = random_rows(rng, 64, 40)
    ragged = Ragged.from_arrow(pa.array(rows, type=pa.list_(pa.int32())))
    pinned = ragged.pin_memory()
    assert pinned.is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True)
    assert on_gpu.device.type == "cuda" and on_gpu.offsets.device.type == "cuda"
    for side in ("right", "left"):
        ids, mask = on_gpu.to_padded(3, max_len=30, dtype=torch.int64, side=side)
        assert ids.device.type == "cuda" and mask.device.type == "cuda"
        cpu_ids, cpu_mask = ragged.to_padded(3, max_len=30, dtype=torch.int64, side=side)
        assert torch.equal(ids.cpu(), cpu_ids) and torch.equal(mask.cpu(), cpu_mask)
    assert on_gpu.to("cpu").equal(ragged)
    assert on_gpu.lengths().device.type == "cuda"
    assert on_gpu.row_ids().cpu().tolist() == ragged.row_ids().tolist()


# ---------------------------------------------------------------------------- arrow_to_torch
def test_arrow_to_torch_is_zero_copy_on_sliced_primitives():
    array = pa.array(np.arange(10, dtype=np.float32)).slice(3, 4)
    tensor = arrow_to_torch(array)
    assert tensor.data_ptr() == array.buffers()[1].address + 3 * 4
    assert tensor.tolist() == [3.0, 4.0, 5.0, 6.0]


def test_arrow_to_torch_copies_what_dlpack_cannot_view_and_refuses_the_rest():
    assert arrow_to_torch(pa.array([True, False, True])).tolist() == [True, False, True]
    half = arrow_to_torch(pa.array(np.array([1.5, 2.0], dtype=np.float16)))
    assert half.dtype == torch.float16 and half.tolist() == [1.5, 2.0]
    chunked = pa.chunked_array([pa.array([1, 2]), pa.array([3])])
    assert arrow_to_torch(chunked).tolist() == [1, 2, 3]
    with pytest.raises(LayoutError, match="col: expected no nulls, got a null at position 1"):
        arrow_to_torch(pa.array([1.0, None]), field="col")
    with pytest.raises(SchemaError, match="expected a primitive array, got dictionary"):
        arrow_to_torch(pa.array(["a", "a"]).dictionary_encode())
    with pytest.raises(SchemaError, match="expected an integer or floating array, got string"):
        arrow_to_torch(pa.array(["a"]))


def test_torch_to_arrow_shares_cpu_memory_and_widens_bfloat16():
    tensor = torch.arange(5, dtype=torch.float64)
    array = torch_to_arrow(tensor)
    assert array.buffers()[1].address == tensor.data_ptr()
    grad = torch.ones(3, requires_grad=True)
    assert torch_to_arrow(grad * 2).to_pylist() == [2.0, 2.0, 2.0]
    assert torch_to_arrow(torch.tensor([0.5], dtype=torch.bfloat16)).type == pa.float32()


# ---------------------------------------------------------------------------- benchmark
def test_bench_ragged_quick_run_checks_itself(tmp_path):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ragged.py"
    out = tmp_path / "ragged.json"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "(a) column -> torch" in done.stdout and "(b) Arrow token column -> padded" in done.stdout
    )
    rows = json.loads(out.read_text())["rows"]
    column = [r for r in rows if r["name"].startswith("column → torch")]
    assert [r["detail"] for r in column] == [True, True, False]
    assert any(t["label"].startswith("ours at N=1e+05 / at N=1e+03") for t in column[-1]["targets"])
    padded = [r for r in rows if r["name"].startswith("token column → padded") and r["targets"]]
    assert len(padded) == 2
    for row in padded:
        assert row["baseline"] and row["peer"] and row["floor"]
        assert {t["label"] for t in row["targets"]} == {
            ">= 30x baseline",
            ">= 1x peer",
            "<= 3x floor",
        }
        assert re.search(r"(MET|MISSED)", done.stdout)
