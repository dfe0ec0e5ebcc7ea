"""``Ragged.from_padded``, the one un-padding routine: round trips with ``to_padded``, any
mask selected row-major, right/left padding by lengths, row selection, trailing dimensions,
sliced inputs, both code paths (numpy on the host, torch elsewhere) and the errors, each
naming its argument and row. ``prefix_lengths`` checks masks that must be ones then zeros."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import LayoutError, Ragged, SchemaError
from maxent_arrow.arrow import prefix_lengths

rows_of_ints = st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6), max_size=8)


def loop_unpad(values: torch.Tensor, keep: torch.Tensor) -> list[list]:
    """The reference: a plain loop over rows and columns."""
    out = []
    for i in range(values.shape[0]):
        out.append([values[i, j].tolist() for j in range(values.shape[1]) if keep[i, j]])
    return out


def as_path(values: torch.Tensor, path: str) -> torch.Tensor:
    """Float values for the numpy path, or the same requiring grad (the torch path on CPU)."""
    values = values.float()
    return values.requires_grad_() if path == "torch" else values


# ---------------------------------------------------------------------------- round trips
@given(rows_of_ints, st.sampled_from(["right", "left"]), st.integers(0, 3), st.integers(-5, 5))
def test_from_padded_inverts_to_padded(rows, side, extra, pad):
    ragged = Ragged.from_lists(rows, dtype=torch.int64)
    width = max((len(r) for r in rows), default=0) + extra
    padded, mask = ragged.to_padded(pad, max_len=width, side=side)
    assert Ragged.from_padded(padded, mask).equal(ragged)  # any mask, row-major
    assert Ragged.from_padded(padded, mask, side=side).equal(ragged)  # checked alignment
    assert Ragged.from_padded(padded, lengths=ragged.lengths(), side=side).equal(ragged)
    assert Ragged.from_padded(padded, mask.to(torch.int8)).equal(ragged)  # 0/1 numbers
    assert Ragged.from_padded(padded, mask.numpy()).equal(ragged)  # a numpy mask
    if side == "right":  # lengths alone mean right padding
        assert Ragged.from_padded(padded, lengths=ragged.lengths().tolist()).equal(ragged)


@given(rows_of_ints, st.sampled_from(["right", "left"]), st.data())
def test_from_padded_of_sliced_and_strided_inputs(rows, side, data):
    ragged = Ragged.from_lists(rows, dtype=torch.int64)
    padded, mask = ragged.to_padded(-1, side=side)
    n, width = padded.shape
    # A wider tensor, a column slice of it and a row slice: none of them contiguous.
    wide = torch.full((n + 2, width + 3), 77, dtype=torch.int64)
    wide[1 : n + 1, 2 : width + 2] = padded
    view = wide[1 : n + 1, 2 : width + 2]
    assert Ragged.from_padded(view, mask).equal(ragged)
    assert Ragged.from_padded(view, lengths=ragged.lengths(), side=side).equal(ragged)
    # A transposed tensor (strides swapped).
    transposed = padded.T.contiguous().T
    assert Ragged.from_padded(transposed, mask.T.contiguous().T).equal(ragged)
    # A row slice of the padded batch is the same row slice of the ragged rows.
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    assert Ragged.from_padded(padded[lo:hi], mask[lo:hi]).equal(ragged[lo:hi])


def test_an_arbitrary_mask_is_selected_row_major(rng):
    values = torch.from_numpy(rng.integers(-99, 99, (9, 7)))
    mask = torch.from_numpy(rng.random((9, 7)) < 0.4)
    mask[2] = False  # an empty row
    ragged = Ragged.from_padded(values, mask)
    assert ragged.tolist() == loop_unpad(values, mask)
    assert ragged.lengths().tolist() == mask.sum(dim=1).tolist()
    assert ragged.values.dtype == torch.int64 and ragged.offsets.dtype == torch.int64


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_both_paths_give_the_same_rows(rng, path):
    values = as_path(torch.from_numpy(rng.normal(size=(6, 5))), path)
    mask = torch.from_numpy(rng.random((6, 5)) < 0.5)
    lengths = torch.from_numpy(rng.integers(0, 6, 6))
    got = Ragged.from_padded(values, mask)
    assert got.tolist() == loop_unpad(values.detach(), mask)
    for side in ("right", "left"):
        by_lengths = Ragged.from_padded(values, lengths=lengths, side=side)
        columns = torch.arange(5)[None, :]
        keep = columns < lengths[:, None] if side == "right" else columns >= 5 - lengths[:, None]
        assert by_lengths.tolist() == loop_unpad(values.detach(), keep)
    assert got.values.requires_grad == (path == "torch")


def test_rows_picks_and_reorders_before_unpadding(rng):
    values = torch.from_numpy(rng.integers(0, 50, (6, 4)))
    mask = torch.from_numpy(rng.random((6, 4)) < 0.6)
    lengths = torch.tensor([4, 0, 2, 3, 1, 4])
    order = [5, 0, 0, 3]
    picked = Ragged.from_padded(values, mask, rows=order)
    assert picked.tolist() == loop_unpad(values[order], mask[order])
    by_lengths = Ragged.from_padded(values, lengths=lengths, rows=np.array(order), side="left")
    assert by_lengths.tolist() == [values[i, 4 - int(lengths[i]) :].tolist() for i in order]
    grad = Ragged.from_padded(as_path(values, "torch"), mask, rows=torch.tensor(order))
    assert grad.tolist() == [[float(x) for x in row] for row in picked.tolist()]
    assert len(Ragged.from_padded(values, mask, rows=[])) == 0


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_trailing_dimensions_travel_with_each_entry(rng, path):
    values = as_path(torch.from_numpy(rng.normal(size=(4, 5, 3))), path)
    lengths = [5, 0, 2, 3]
    ragged = Ragged.from_padded(values, lengths=lengths)
    assert ragged.values.shape == (10, 3)
    for i, n in enumerate(lengths):
        assert torch.equal(ragged[i].detach(), values[i, :n].detach())
    back, mask = ragged.to_padded(0.0, max_len=5)
    assert torch.equal(back.detach()[mask], values.detach()[mask])


def test_dtype_is_converted_and_the_result_is_a_copy():
    padded = torch.tensor([[1, 2, 0], [3, 0, 0]], dtype=torch.int64)
    ragged = Ragged.from_padded(padded, lengths=[2, 1], dtype=torch.int32)
    assert ragged.values.dtype == torch.int32 and ragged.tolist() == [[1, 2], [3]]
    same_dtype = Ragged.from_padded(padded, lengths=[3, 3])
    padded[0, 0] = 99  # the caller reuses its buffer: the rows keep their values
    assert same_dtype.tolist() == [[1, 2, 0], [3, 0, 0]] and ragged.tolist() == [[1, 2], [3]]
    half = Ragged.from_padded(padded.to(torch.bfloat16), lengths=[1, 1], dtype=torch.float32)
    assert half.values.dtype == torch.float32 and half.tolist() == [[99.0], [3.0]]


def test_gradients_flow_through_the_selection():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], requires_grad=True)
    ragged = Ragged.from_padded(values, lengths=[2, 1])
    (ragged.values * torch.tensor([1.0, 10.0, 100.0])).sum().backward()
    assert values.grad.tolist() == [[1.0, 10.0, 0.0], [100.0, 0.0, 0.0]]


def test_empty_batches_and_zero_width():
    assert len(Ragged.from_padded(torch.zeros(0, 4), lengths=[])) == 0
    empty_rows = Ragged.from_padded(torch.zeros(3, 0, dtype=torch.int64), lengths=[0, 0, 0])
    assert empty_rows.tolist() == [[], [], []]
    assert Ragged.from_padded(torch.zeros(2, 3), torch.zeros(2, 3)).tolist() == [[], []]


# ---------------------------------------------------------------------------- errors
def raises(error: type[Exception], message: str):
    return pytest.raises(error, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_errors_name_the_argument_and_the_row(path):
    values = as_path(torch.zeros(3, 4), path)
    owner = "Ragged.from_padded"
    shape = f"{owner}: mask: expected shape (3, 4) (the rows and width of values), got (3, 5)"
    with raises(LayoutError, shape):
        Ragged.from_padded(values, torch.ones(3, 5))
    count = f"{owner}: lengths: expected 3 entries (the rows of values), got shape (2,)"
    with raises(LayoutError, count):
        Ragged.from_padded(values, lengths=[1, 2])
    with raises(LayoutError, f"{owner}: lengths row 1: expected >= 0, got -2"):
        Ragged.from_padded(values, lengths=[1, -2, 0])
    with raises(LayoutError, f"{owner}: lengths row 2: 5 is more than the width 4 of values"):
        Ragged.from_padded(values, lengths=[4, 0, 5])
    with raises(LayoutError, f"{owner}: lengths row 2: 5 is more than the width 4 of values"):
        Ragged.from_padded(values, lengths=[9, 0, 5], rows=[2])  # the row of values, not of rows
    with raises(SchemaError, f"{owner}: lengths: expected integers, got float32"):
        Ragged.from_padded(values, lengths=np.array([1.0, 2.0, 0.0], dtype=np.float32))
    not_prefix = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    with raises(
        LayoutError,
        f"{owner}: mask: row 2 is not a prefix mask (a 0 before a 1); right-padded rows need "
        "ones then zeros",
    ):
        Ragged.from_padded(values, not_prefix, side="right")
    with raises(
        LayoutError,
        f"{owner}: mask: row 0 is not a suffix mask (a 1 before a 0); left-padded rows need "
        "zeros then ones",
    ):
        Ragged.from_padded(values, not_prefix, side="left")
    assert len(Ragged.from_padded(values, not_prefix)) == 3  # no side: any pattern
    with raises(LayoutError, f"{owner}: rows: entry 1 is 3, out of range for 3 rows"):
        Ragged.from_padded(values, not_prefix, rows=[0, 3])
    with raises(LayoutError, f"{owner}: rows: entry 0 is -1, out of range for 3 rows"):
        Ragged.from_padded(values, not_prefix, rows=[-1])
    with raises(SchemaError, f"{owner}: give exactly one of mask and lengths, got both"):
        Ragged.from_padded(values, not_prefix, lengths=[1, 1, 1])
    with raises(SchemaError, f"{owner}: give exactly one of mask and lengths, got neither"):
        Ragged.from_padded(values)
    with raises(LayoutError, f"{owner}: side must be 'right', 'left' or None, got 'up'"):
        Ragged.from_padded(values, lengths=[0, 0, 0], side="up")


def test_values_must_be_a_padded_tensor():
    with raises(SchemaError, "Ragged.from_padded: values: expected a torch tensor, got list"):
        Ragged.from_padded([[1, 2]], lengths=[1])
    rank = "Ragged.from_padded: values: expected shape [rows, width, ...], got (4,)"
    with raises(LayoutError, rank):
        Ragged.from_padded(torch.zeros(4), lengths=[1, 1, 1, 1])


def test_prefix_lengths_checks_and_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert prefix_lengths(mask).tolist() == [2, 0, 3]
    assert prefix_lengths(mask.bool()).dtype == torch.int64
    assert prefix_lengths(torch.tensor([[0, 1, 1], [0, 0, 0]]), side="left").tolist() == [2, 0]
    with raises(
        LayoutError,
        "SequenceScores.token_mask: row 1 is not a prefix mask (a 0 before a 1); right-padded "
        "rows need ones then zeros",
    ):
        prefix_lengths(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), field="SequenceScores.token_mask")
    with raises(LayoutError, "mask: expected a mask of shape [rows, width], got (3,)"):
        prefix_lengths(torch.ones(3))


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_from_padded_on_the_device_matches_the_host(rng):
    values = torch.from_numpy(rng.integers(0, 1000, (64, 40)))
    lengths = torch.from_numpy(rng.integers(0, 41, 64))
    mask = torch.from_numpy(rng.random((64, 40)) < 0.3)
    host = Ragged.from_padded(values, lengths=lengths, dtype=torch.int32)
    device = Ragged.from_padded(values.cuda(), lengths=lengths.cuda(), dtype=torch.int32)
    assert device.values.device.type == "cuda" and device.offsets.device.type == "cuda"
    assert device.to("cpu").equal(host)
    mixed = Ragged.from_padded(values.cuda(), lengths=lengths)  # host lengths, device values
    assert mixed.values.device.type == "cuda" and mixed.to("cpu").tolist() == host.tolist()
    by_mask = Ragged.from_padded(values.cuda(), mask.cuda(), rows=torch.arange(63, -1, -1))
    assert by_mask.to("cpu").equal(Ragged.from_padded(values, mask, rows=list(range(63, -1, -1))))
    padded, pad_mask = device.to_padded(0, max_len=40, side="left")
    again = Ragged.from_padded(padded, pad_mask, side="left")
    assert again.values.device.type == "cuda" and again.to("cpu").equal(host)
    with pytest.raises(LayoutError, match="lengths row 0: 41 is more than the width 40"):
        Ragged.from_padded(values.cuda(), lengths=torch.full((64,), 41).cuda())
    bad = mask.clone()
    bad[5] = torch.arange(40) % 2 == 1
    with pytest.raises(LayoutError, match="mask: row 5 is not a prefix mask"):
        Ragged.from_padded(values.cuda(), bad.cuda(), side="right")
