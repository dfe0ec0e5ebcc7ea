"""``Ragged``: the torch twin of an Arrow list array, as (values, int64 offsets).

Ragged data (K completions per prompt, T tokens per completion) stays ragged until a model needs
it. ``Ragged.from_arrow`` views the Arrow child buffer without copying; ``to_padded`` then builds
the padded tensor and its mask in one vectorised pass (a run-length mask and one masked scatter,
never a Python loop over rows), on whichever device the values live, so padding can be created
on the GPU after one copy of the ragged bytes. ``benchmarks/bench_ragged.py`` measures it against
the seed's ``pad_sequence`` and a memcpy of the output.

The way back is :meth:`Ragged.from_padded`, the one un-padding routine of the package (records'
per-token fields, the TRL and verl adapters): a padded tensor and its mask or lengths to ragged
rows, in one masked select, with :func:`prefix_lengths` for masks that must be ones then zeros.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Literal, cast, overload

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow.lists import first_null, list_offsets, single_array
from maxent_arrow.errors import LayoutError, SchemaError

__all__ = ["Ragged", "arrow_to_torch", "prefix_lengths", "torch_to_arrow"]

_INT32_MAX = 2**31 - 1
_DLPACK_TYPE_IDS = frozenset(
    t.id
    for t in (
        pa.int8(), pa.int16(), pa.int32(), pa.int64(),
        pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
        pa.float32(), pa.float64(),
    )
)  # fmt: skip


def arrow_to_torch(array: pa.Array | pa.ChunkedArray, *, field: str = "values") -> torch.Tensor:
    """Zero-copy torch view of a primitive, null-free Arrow array (DLPack).

    Chunked arrays with one chunk are viewed; several chunks are concatenated (one copy).
    Boolean arrays are bit-packed in Arrow and come back as a ``torch.bool`` copy.
    """
    if isinstance(array, pa.ChunkedArray):
        array = single_array(array)
    # The common case first (a null-free integer or float array): within ~0.1 us of a bare
    # ``torch.from_dlpack`` (benchmarks/bench_ragged.py (a)).
    if array.type.id in _DLPACK_TYPE_IDS and not array.null_count:
        return torch.from_dlpack(array)
    if array.null_count:
        where = first_null(array)
        raise LayoutError(f"{field}: expected no nulls, got a null at position {where}")
    kind = array.type
    if pa.types.is_boolean(kind):
        return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
    if pa.types.is_dictionary(kind):
        raise SchemaError(f"{field}: expected a primitive array, got {kind}")
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise SchemaError(f"{field}: expected an integer or floating array, got {kind}")
    if pa.types.is_float16(kind):
        return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
    return torch.from_dlpack(array)


def torch_to_arrow(tensor: torch.Tensor) -> pa.Array:
    """Arrow view of a 1-D CPU tensor (zero-copy through numpy; bfloat16 is widened to float32)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return pa.array(tensor.contiguous().reshape(-1).numpy())


class Ragged:
    """Ragged rows as a torch ``values`` tensor and int64 ``offsets`` (``len(rows) + 1``, from 0).

    Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``. Values may carry trailing dimensions
    (e.g. ``[total, H]``); the ragged dimension is always the first.

    Parameters
    ----------
    values:
        Flat values of all rows, concatenated.
    offsets:
        Row boundaries, int64, non-decreasing, starting at 0 and ending at ``len(values)``.
    validate:
        Check the offsets (one pass; on a GPU it synchronises). Internal constructions whose
        offsets are correct by construction pass ``False``.
    """

    __slots__ = ("values", "offsets")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, *, validate: bool = True):
        if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
            raise SchemaError(
                f"Ragged: expected torch tensors for values and offsets, got "
                f"{type(values).__name__} and {type(offsets).__name__}"
            )
        if validate:
            _check_offsets(offsets, values)
        self.values = values
        self.offsets = offsets

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrow(cls, array: pa.Array | pa.ChunkedArray) -> Ragged:
        """View an Arrow ``list`` or ``large_list`` array of primitives without copying values.

        Sliced arrays are handled (the offsets are rebased to 0; the values are a view of the
        slice's part of the child buffer). A chunked array of several chunks is concatenated
        first (one copy). Nulls, at either level, raise :class:`LayoutError`.
        """
        if isinstance(array, pa.ChunkedArray):
            array = single_array(array)
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            raise SchemaError(f"Ragged.from_arrow: expected a list array, got {array.type}")
        if pa.types.is_list(array.type.value_type) or pa.types.is_large_list(array.type.value_type):
            raise SchemaError(
                f"Ragged.from_arrow: expected a list of primitives, got {array.type}; "
                "flatten one level first (array.flatten())"
            )
        if array.null_count:
            raise LayoutError(
                f"Ragged.from_arrow: expected no null rows, got a null at row {first_null(array)}"
            )
        # `.values` would ignore the slice offset; `.flatten()` respects it (docs/arrow-layout.md,
        # "Traps").
        flat = array.flatten()
        if flat.null_count:
            raise LayoutError(
                "Ragged.from_arrow: expected no nulls inside lists, got a null at value "
                f"{first_null(flat)}"
            )
        values = arrow_to_torch(flat, field="Ragged.from_arrow")
        offsets = torch.from_numpy(list_offsets(array))
        return cls(values, offsets, validate=False)

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor | list[int]) -> Ragged:
        """Rows of the given lengths over ``values``."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=values.device)
        if lengths.numel() and bool((lengths < 0).any()):
            raise LayoutError("Ragged.from_lengths: lengths must be >= 0")
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(values, offsets)

    @classmethod
    def from_padded(
        cls,
        values: torch.Tensor,
        mask: torch.Tensor | np.ndarray | None = None,
        *,
        lengths: torch.Tensor | np.ndarray | Sequence[int] | None = None,
        side: Literal["right", "left"] | None = None,
        rows: torch.Tensor | np.ndarray | Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Ragged:
        """Un-pad ``values`` ``[rows, width, *trailing]`` into ragged rows (the inverse of
        :meth:`to_padded`): exactly one of ``mask`` and ``lengths`` says what each row keeps.

        - ``lengths``: row ``i`` keeps its first ``lengths[i]`` entries, right padding (valid
          entries first, as completions are padded); with ``side="left"`` its last ones (left
          padding, as prompts are).
        - ``mask`` (``[rows, width]``, bool or numbers, non-zero = kept): row ``i`` keeps the
          entries its mask marks, in column order, whatever the pattern (``values[mask]``,
          row-major). With ``side="right"`` the mask must be ones then zeros in every row
          (``"left"``: zeros then ones), i.e. implied by its lengths, so that
          ``to_padded(side=side)`` rebuilds it; :func:`prefix_lengths` checks it.

        One vectorised masked select, never a Python loop over rows. The result's values are a
        copy (never a view of ``values``), on the device of ``values``, with int64 offsets; a
        row of length 0 is an empty row. On the CPU the select runs in numpy (no torch operator
        runs, so none wakes torch's intra-op threads on a training loop's thread: see
        :func:`_pad_numpy`); on an accelerator, for bfloat16 and for values that require grad,
        it runs in torch on the values' device (gradients flow). The same call serves both.

        Parameters
        ----------
        values:
            The padded tensor, ``[rows, width]`` or ``[rows, width, *trailing]`` (trailing
            dimensions travel with each entry: the result's values are ``[total, *trailing]``).
        mask:
            What each row keeps (on any device: moved to the values' device).
        lengths:
            How many entries each row keeps (``side`` says from which end), ``0 <= lengths[i]
            <= width``.
        side:
            ``"right"`` or ``"left"``: where the padding is. Default: right for ``lengths``;
            any pattern, unchecked, for ``mask``.
        rows:
            The rows to take, in this order (a subset or a reordering, e.g. each group's first
            row), before un-padding; ``mask`` and ``lengths`` describe all rows of
            ``values``. Default: every row.
        dtype:
            Dtype of the result's values (converted before any copy off the device).

        Raises
        ------
        SchemaError
            ``values`` is not a tensor; both or neither of ``mask`` and ``lengths``.
        LayoutError
            A shape that does not match ``values`` (naming the argument), a negative length or
            one over the width, a mask that is not right (left) padding under ``side``, a row
            index out of range: each naming the argument and the row of ``values``.
        """
        owner = _OWNER
        if not isinstance(values, torch.Tensor):
            raise SchemaError(
                f"{owner}: values: expected a torch tensor, got {type(values).__name__}"
            )
        if values.dim() < 2:
            raise LayoutError(
                f"{owner}: values: expected shape [rows, width, ...], got {tuple(values.shape)}"
            )
        if (mask is None) == (lengths is None):
            given = "both" if mask is not None else "neither"
            raise SchemaError(f"{owner}: give exactly one of mask and lengths, got {given}")
        if side not in (None, "right", "left"):
            raise LayoutError(f"{owner}: side must be 'right', 'left' or None, got {side!r}")
        n, width = int(values.shape[0]), int(values.shape[1])
        out_dtype = dtype or values.dtype
        if _numpy_can_pad(values, out_dtype) and _on_host(mask) and _on_host(lengths):
            data = values.detach().numpy()
            picked = None if rows is None else _row_index(rows, n)
            if picked is not None:
                data = data[picked]
            if mask is not None:
                keep = _host_mask(mask, n, width, picked)
                counts = keep.sum(axis=1, dtype=np.int64)
                if side is not None:
                    _check_prefix(keep, counts, width, side, f"{owner}: mask", picked)
            else:
                counts = _host_lengths(lengths, n, width, picked)
                keep = prefix_mask(counts, width, side=side or "right")
            flat = data[keep]
            numpy_dtype = torch.empty(0, dtype=out_dtype).numpy().dtype
            flat = flat.astype(numpy_dtype, copy=False)
            offsets = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            return cls(torch.from_numpy(flat), torch.from_numpy(offsets), validate=False)
        device = values.device
        picked = None if rows is None else _row_index(rows, n, device=device)
        if picked is not None:
            values = values.index_select(0, picked)
        if mask is not None:
            keep = torch.as_tensor(mask, device=device)
            if tuple(keep.shape) != (n, width):
                raise LayoutError(
                    f"{owner}: mask: expected shape {(n, width)} (the rows and width of "
                    f"values), got {tuple(keep.shape)}"
                )
            if picked is not None:
                keep = keep.index_select(0, picked)
            keep = keep if keep.dtype == torch.bool else keep != 0
            counts = keep.sum(dim=1)
            if side is not None:
                _check_prefix(keep, counts, width, side, f"{owner}: mask", picked)
        else:
            counts = torch.as_tensor(lengths, device=device)
            if counts.dim() != 1 or counts.shape[0] != n:
                raise LayoutError(
                    f"{owner}: lengths: expected {n} entries (the rows of values), got shape "
                    f"{tuple(counts.shape)}"
                )
            if counts.dtype.is_floating_point or counts.dtype == torch.bool:
                kind = str(counts.dtype).removeprefix("torch.")
                raise SchemaError(f"{owner}: lengths: expected integers, got {kind}")
            counts = counts.to(torch.int64)
            if picked is not None:
                counts = counts.index_select(0, picked)
            _check_lengths(counts, width, picked)
            columns = torch.arange(width, device=device)
            if side == "left":
                keep = columns >= (width - counts)[:, None]
            else:
                keep = columns < counts[:, None]
        flat = values[keep]
        if dtype is not None:
            flat = flat.to(dtype)
        offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls(flat, offsets, validate=False)

    @classmethod
    def from_lists(cls, rows: list, *, dtype: torch.dtype | None = None) -> Ragged:
        """Build from Python lists (a convenience for tests and small inputs; copies)."""
        lengths = [len(r) for r in rows]
        flat = [x for r in rows for x in r]
        values = torch.tensor(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)
        return cls.from_lengths(values, lengths)

    def with_values(self, values: torch.Tensor) -> Ragged:
        """Same rows, new values (e.g. the result of an elementwise op on ``self.values``)."""
        if values.shape[0] != self.values.shape[0]:
            raise LayoutError(
                f"Ragged.with_values: expected {self.values.shape[0]} values, got {values.shape[0]}"
            )
        return Ragged(values, self.offsets.to(values.device), validate=False)

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_values(self) -> int:
        return int(self.values.shape[0])

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def lengths(self) -> torch.Tensor:
        """Row lengths, int64."""
        return self.offsets[1:] - self.offsets[:-1]

    def row_ids(self) -> torch.Tensor:
        """The row index of every value (segment ids), int64, ``[num_values]``."""
        rows = torch.arange(len(self), device=self.offsets.device)
        return torch.repeat_interleave(rows, self.lengths(), output_size=self.num_values)

    def positions(self) -> torch.Tensor:
        """The position of every value inside its row, int64, ``[num_values]``."""
        starts = torch.repeat_interleave(
            self.offsets[:-1], self.lengths(), output_size=self.num_values
        )
        return torch.arange(self.num_values, device=self.offsets.device) - starts

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Ragged: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Ragged:
        """Row ``i`` as a tensor view, or rows ``a:b`` as a ``Ragged`` over a values view."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise LayoutError("Ragged: only contiguous slices (step 1) are views")
            stop = max(stop, start)
            window = self.offsets[start : stop + 1]
            lo = int(window[0]) if window.numel() else 0
            hi = int(window[-1]) if window.numel() else 0
            offsets = window - lo if window.numel() else self.offsets.new_zeros(1)
            return Ragged(self.values[lo:hi], offsets, validate=False)
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"Ragged: row {index} out of range for {n} rows")
        index %= n
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.values[lo:hi]

    def __iter__(self):
        bounds = self.offsets.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield self.values[lo:hi]

    def tolist(self) -> list[list]:
        """Rows as Python lists."""
        flat = self.values.tolist()
        bounds = self.offsets.tolist()
        return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def equal(self, other: Ragged) -> bool:
        """Same rows and same values (NaN equal to NaN)."""
        if not torch.equal(self.offsets.cpu(), other.offsets.cpu()):
            return False
        a, b = self.values.cpu(), other.values.cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)

    def __repr__(self) -> str:
        preview = self.tolist()[:4] if len(self) <= 64 else self[:4].tolist()
        more = ", ..." if len(self) > 4 else ""
        body = ", ".join(repr(r) for r in preview)
        return (
            f"Ragged(rows={len(self)}, values={self.num_values}, dtype={self.dtype}, "
            f"device={self.device}, [{body}{more}])"
        )

    # ------------------------------------------------------------------ conversion
    def to_arrow(self, *, large: bool | None = None) -> pa.Array:
        """A ``list`` (or ``large_list`` when the values exceed int32 offsets) array.

        CPU values are shared with the result (no copy); values on another device are copied
        to the host first.
        """
        if self.values.dim() != 1:
            raise SchemaError(
                f"Ragged.to_arrow: expected 1-D values, got shape {tuple(self.values.shape)}"
            )
        values = torch_to_arrow(self.values)
        offsets = self.offsets.detach().cpu().numpy()
        use_large = large if large is not None else self.num_values > _INT32_MAX
        if use_large:
            return pa.LargeListArray.from_arrays(pa.array(offsets), values)
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)

    def to_padded(
        self,
        pad_value: float | int = 0,
        *,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        side: Literal["right", "left"] = "right",
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad the rows into ``[rows, width, *trailing]`` and return ``(padded, mask)``.

        One vectorised pass, never a loop over rows: the mask is built from the lengths (rows
        of a small prefix table copied, see :func:`prefix_mask`), the output is filled with
        ``pad_value`` and the values are scattered through the mask (converted to ``dtype`` on
        the way). ``mask`` is ``torch.bool``, True on real entries. On CPU the scatter runs in
        numpy (``Tensor.masked_scatter_`` makes a prefix-sum pass first, and torch's parallel
        kernels wait for a free core on a busy machine); on other devices, for bfloat16, and for
        values that require grad, it runs in torch on the values' device.

        Parameters
        ----------
        pad_value:
            Fill value of the padding.
        max_len:
            Width of the result. Rows longer than ``max_len`` keep their first ``max_len``
            values (head truncation); without it the width is the longest row.
        dtype:
            Dtype of ``padded`` (default: the values' dtype), e.g. ``torch.int64`` for token ids.
        side:
            ``"right"`` puts the values first (completions); ``"left"`` right-aligns them (prompts).
        out:
            ``(padded, mask)`` tensors to write into instead of allocating (a training loop
            reuses them step after step; fresh pages cost about as much as the writes): exactly
            ``[rows, width, *trailing]`` of ``dtype`` and ``[rows, width]`` bool, contiguous,
            on the values' device. They are returned.
        """
        if side not in ("right", "left"):
            raise LayoutError(f"Ragged.to_padded: side must be 'right' or 'left', got {side!r}")
        lengths = self.lengths()
        rows = len(self)
        lens = None
        if self.device.type == "cpu":
            lens = lengths.numpy()
            longest = int(lens.max()) if rows else 0
        else:
            longest = int(lengths.max()) if rows else 0
        width = longest if max_len is None else int(max_len)
        if width < 0:
            raise LayoutError(f"Ragged.to_padded: max_len must be >= 0, got {max_len}")
        out_dtype = dtype or self.values.dtype
        shape = (rows, width, *self.values.shape[1:])
        if out is not None:
            _check_out(out, shape, out_dtype, self.values.device)
        if _numpy_can_pad(self.values, out_dtype):
            assert lens is not None  # numpy pads only on the CPU
            return _pad_numpy(self.values, lens, width, longest, pad_value, out_dtype, side, out)
        values = self.values
        if width < longest:
            keep = self.positions() < width
            values = values[keep]
            lengths = lengths.clamp(max=width)
        if out is None:
            padded = torch.full(shape, pad_value, dtype=out_dtype, device=values.device)
            mask = torch.empty((rows, width), dtype=torch.bool, device=values.device)
        else:
            padded, mask = out
            padded.fill_(pad_value)
        columns = torch.arange(width, device=values.device)
        if side == "right":
            torch.lt(columns, lengths[:, None], out=mask)
        else:
            torch.ge(columns, (width - lengths)[:, None], out=mask)
        if values.numel():
            source = values.to(out_dtype)
            if len(shape) > 2:
                padded[mask] = source
            else:
                padded.masked_scatter_(mask, source)
        return padded, mask

    def to_nested(self) -> torch.Tensor:
        """A jagged-layout nested tensor that views ``values`` (no copy).

        Its ``min_seqlen`` / ``max_seqlen`` are the shortest and longest rows, so
        ``to_padded_tensor`` pads to the longest row. Without them torch takes the total value
        count as the longest row: a 3-row toy padded to ``[3, 6]`` instead of ``[3, 3]``, a
        4096-row batch asked for 43 GB (docs/arrow-layout.md, "Traps"). Reading the two
        lengths synchronises once on a GPU. For padding on a hot path prefer
        :meth:`to_padded` (one vectorised pass, and a mask).
        """
        if len(self):
            lengths = self.lengths()
            shortest, longest = (int(x) for x in torch.aminmax(lengths))
        else:
            shortest = longest = 0
        return torch.nested.nested_tensor_from_jagged(
            self.values, self.offsets, min_seqlen=shortest, max_seqlen=longest
        )

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Ragged:
        """Move values and offsets (two copies of the ragged bytes, no padding crosses)."""
        return Ragged(
            self.values.to(device, non_blocking=non_blocking),
            self.offsets.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> Ragged:
        """Page-locked copies of values and offsets, for non-blocking host-to-device copies.

        Pinning needs CUDA: on a machine without it this returns ``self`` unchanged, like a
        ``DataLoader(pin_memory=True)`` there (``Tensor.pin_memory`` itself would raise).
        """
        if not torch.cuda.is_available() or self.device.type != "cpu":
            return self
        return Ragged(self.values.pin_memory(), self.offsets.pin_memory(), validate=False)

    def is_pinned(self) -> bool:
        return bool(self.values.is_pinned())


_NO_NUMPY = (torch.bfloat16, torch.complex32)
_OWNER = "Ragged.from_padded"


def prefix_lengths(
    mask: torch.Tensor,
    *,
    side: Literal["right", "left"] = "right",
    field: str = "mask",
) -> torch.Tensor:
    """Row lengths (int64) of a ``[rows, width]`` mask that is ones then zeros in every row
    (``side="left"``: zeros then ones), on the mask's device; non-zero counts as one.

    Raises
    ------
    LayoutError
        A row that is not of that form, named with ``field``: ``"{field}: row 3 is not a
        prefix mask (a 0 before a 1); ..."``.
    """
    if mask.dim() != 2:
        raise LayoutError(
            f"{field}: expected a mask of shape [rows, width], got {tuple(mask.shape)}"
        )
    keep = mask.detach()
    keep = keep if keep.dtype == torch.bool else keep != 0
    counts = keep.sum(dim=1)
    _check_prefix(keep, counts, int(keep.shape[1]), side, field, None)
    return counts


def _check_prefix(
    keep: torch.Tensor | np.ndarray,
    counts: torch.Tensor | np.ndarray,
    width: int,
    side: str,
    field: str,
    picked: torch.Tensor | np.ndarray | None,
) -> None:
    """Every row of ``keep`` is the right- (left-) padding mask of its count, or LayoutError."""
    if isinstance(keep, np.ndarray):
        padding = cast(Literal["right", "left"], side)
        bad = np.not_equal(keep, prefix_mask(np.asarray(counts), width, side=padding)).any(axis=1)
        rows = np.flatnonzero(bad)
        row = int(rows[0]) if len(rows) else None
    else:
        columns = torch.arange(width, device=keep.device)
        on = torch.as_tensor(counts, device=keep.device)
        if side == "left":
            expected = columns >= (width - on)[:, None]
        else:
            expected = columns < on[:, None]
        bad = torch.ne(keep, expected).any(dim=1)
        row = int(torch.nonzero(bad)[0, 0]) if bool(bad.any()) else None
    if row is None:
        return
    row = row if picked is None else int(picked[row])
    if side == "left":
        raise LayoutError(
            f"{field}: row {row} is not a suffix mask (a 1 before a 0); left-padded rows need "
            "zeros then ones"
        )
    raise LayoutError(
        f"{field}: row {row} is not a prefix mask (a 0 before a 1); right-padded rows need ones "
        "then zeros"
    )


def _check_lengths(
    counts: torch.Tensor | np.ndarray, width: int, picked: torch.Tensor | np.ndarray | None
) -> None:
    """``0 <= counts <= width`` (one pass; one synchronisation on an accelerator)."""
    if isinstance(counts, np.ndarray):
        bad = np.flatnonzero((counts < 0) | (counts > width))
        row = int(bad[0]) if len(bad) else None
    else:
        wrong = (counts < 0) | (counts > width)
        row = int(torch.nonzero(wrong)[0, 0]) if bool(wrong.any()) else None
    if row is None:
        return
    value = int(counts[row])
    where = row if picked is None else int(picked[row])
    if value < 0:
        raise LayoutError(f"{_OWNER}: lengths row {where}: expected >= 0, got {value}")
    raise LayoutError(
        f"{_OWNER}: lengths row {where}: {value} is more than the width {width} of values"
    )


def _on_host(data: object) -> bool:
    """Whether a mask or lengths argument is host data (numpy, a list, a CPU tensor)."""
    return not isinstance(data, torch.Tensor) or data.device.type == "cpu"


def _row_index(rows: Any, n: int, *, device: torch.device | None = None) -> Any:
    """``rows`` as an int64 index in ``[0, n)``: numpy for the host path (``device`` None),
    else a tensor on ``device``."""
    index: Any
    if device is None:
        index = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if index.size == 0:
            index = index.astype(np.int64)
        kind_ok = index.ndim == 1 and index.dtype.kind in "iu"
    else:
        index = torch.as_tensor(rows, device=device)
        if index.numel() == 0:
            index = index.to(torch.int64)
        kind_ok = index.dim() == 1 and not (index.is_floating_point() or index.dtype == torch.bool)
    if not kind_ok:
        raise LayoutError(
            f"{_OWNER}: rows: expected a 1-D integer index, got {index.dtype} {tuple(index.shape)}"
        )
    if device is None:
        index = index.astype(np.int64, copy=False)
        wrong = np.flatnonzero((index < 0) | (index >= n))
        found = int(wrong[0]) if len(wrong) else None
    else:
        index = index.to(torch.int64)
        bad = (index < 0) | (index >= n)
        found = int(torch.nonzero(bad)[0, 0]) if bool(bad.any()) else None
    if found is not None:
        raise LayoutError(
            f"{_OWNER}: rows: entry {found} is {int(index[found])}, out of range for {n} rows"
        )
    return index


def _host_mask(mask, n: int, width: int, picked: np.ndarray | None) -> np.ndarray:
    """A host mask as a bool ``[rows, width]`` numpy array (of the picked rows)."""
    data = mask.detach().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if data.shape != (n, width):
        raise LayoutError(
            f"{_OWNER}: mask: expected shape {(n, width)} (the rows and width of values), got "
            f"{tuple(data.shape)}"
        )
    if picked is not None:
        data = data[picked]
    return data if data.dtype == np.bool_ else data != 0


def _host_lengths(lengths, n: int, width: int, picked: np.ndarray | None) -> np.ndarray:
    """Host lengths as checked int64 numpy (of the picked rows)."""
    data = lengths.detach().numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
    if data.ndim != 1 or data.shape[0] != n:
        raise LayoutError(
            f"{_OWNER}: lengths: expected {n} entries (the rows of values), got shape "
            f"{tuple(data.shape)}"
        )
    if data.size and data.dtype.kind not in "iu":
        raise SchemaError(f"{_OWNER}: lengths: expected integers, got {data.dtype}")
    data = data.astype(np.int64, copy=False)
    if picked is not None:
        data = data[picked]
    _check_lengths(data, width, picked)
    return data


def _numpy_can_pad(values: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return (
        values.device.type == "cpu"
        and not values.requires_grad
        and values.dtype not in _NO_NUMPY
        and out_dtype not in _NO_NUMPY
    )


def prefix_mask(
    lengths: np.ndarray,
    width: int,
    *,
    side: Literal["right", "left"] = "right",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``bool [rows, width]``, True in the first ``lengths[i]`` columns of row ``i`` (the last
    ones for ``side="left"``); ``lengths`` must lie in ``[0, width]``.

    With more rows than columns (the usual shape of a batch) row ``i`` is a copy of row
    ``lengths[i]`` of a ``[width + 1, width]`` table of prefixes (``np.take`` copies whole
    rows: ~0.2 ms for 8192 x 512, where comparing an ``arange`` against the lengths takes
    ~0.8 ms and a run-length ``np.repeat`` ~3 ms on this project's CPU); otherwise the
    comparison. Written into ``out`` when given (C-contiguous bool of that shape).
    """
    rows = int(lengths.shape[0])
    if out is None:
        out = np.empty((rows, width), dtype=bool)
    if rows == 0 or width == 0:
        return out
    small = np.int32 if width < _INT32_MAX else np.int64
    columns = np.arange(width, dtype=small)
    if rows > width:
        table = np.arange(width + 1, dtype=small)[:, None]
        if side == "right":
            table = np.less(columns, table)
        else:
            table = np.greater_equal(columns, width - table)
        # mode="clip": with out= and the default mode="raise", numpy buffers the whole output.
        np.take(table, lengths, axis=0, out=out, mode="clip")
    elif side == "right":
        np.less(columns, lengths.astype(small)[:, None], out=out)
    else:
        np.greater_equal(columns, (width - lengths).astype(small)[:, None], out=out)
    return out


def _runs(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """``first[i]`` times True then ``second[i]`` times False, for every i, flat (a run-length
    decode over the ragged values, for head truncation)."""
    counts = np.empty(2 * first.size, dtype=np.int64)
    counts[0::2] = first
    counts[1::2] = second
    return np.repeat(np.tile(np.array([True, False]), first.size), counts)


def _fill(array: np.ndarray, value: float | int) -> None:
    """``array.fill(value)``, by ``memset`` when every byte of ``value`` is the same (0, -1):
    glibc's memset writes a large buffer 2x faster than numpy's fill loop (0.35 vs 0.79 ms
    for 32 MiB on this project's CPU)."""
    pattern = np.array(value, dtype=array.dtype).tobytes()
    if array.flags.c_contiguous and pattern.count(pattern[:1]) == len(pattern):
        ctypes.memset(array.ctypes.data, pattern[0], array.nbytes)
    else:
        array.fill(value)


def _check_out(
    out: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    padded, mask = out
    for name, tensor, want_shape, want_dtype in (
        ("padded", padded, shape, dtype),
        ("mask", mask, shape[:2], torch.bool),
    ):
        if (
            tuple(tensor.shape) != tuple(want_shape)
            or tensor.dtype != want_dtype
            or tensor.device != device
            or not tensor.is_contiguous()
        ):
            raise LayoutError(
                f"Ragged.to_padded: out {name} must be a contiguous {want_dtype} tensor of shape "
                f"{tuple(want_shape)} on {device}, got {tensor.dtype} {tuple(tensor.shape)} on "
                f"{tensor.device}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
            )


def _pad_numpy(
    values: torch.Tensor,
    lens: np.ndarray,
    width: int,
    longest: int,
    pad_value: float | int,
    out_dtype: torch.dtype,
    side: Literal["right", "left"],
    out: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU padding: numpy boolean-mask assignment walks mask and values once, in order."""
    rows = lens.shape[0]
    source = values.detach().numpy()
    if width < longest:
        kept = np.minimum(lens, width)
        # Head truncation: keep the first `width` values of each row (one compaction pass).
        source = source[_runs(kept, lens - kept)]
    else:
        kept = lens
    shape = (rows, width, *values.shape[1:])
    if out is None:
        mask = prefix_mask(kept, width, side=side)
        # numpy's single-threaded fill, not torch.full: on a busy machine torch's parallel fill
        # waits for a worker thread to be scheduled (measured 15 ms instead of 0.1 ms for
        # 1 MiB). A zero pad needs no fill pass: calloc'd pages arrive zeroed from the kernel.
        numpy_dtype = torch.empty(0, dtype=out_dtype).numpy().dtype
        if not np.array(pad_value, dtype=numpy_dtype).tobytes().strip(b"\0"):  # 0, not -0.0
            padded = np.zeros(shape, numpy_dtype)
        else:
            padded = np.full(shape, pad_value, numpy_dtype)
    else:
        padded, mask = out[0].numpy(), out[1].numpy()
        prefix_mask(kept, width, side=side, out=mask)
        _fill(padded, pad_value)
    if source.shape[0]:
        padded[mask] = source
    return torch.from_numpy(padded) if out is None else out[0], (
        torch.from_numpy(mask) if out is None else out[1]
    )


def _check_offsets(offsets: torch.Tensor, values: torch.Tensor) -> None:
    if offsets.dtype != torch.int64:
        raise SchemaError(f"Ragged.offsets: expected dtype torch.int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise LayoutError(
            f"Ragged.offsets: expected a 1-D tensor of rows + 1 entries, got shape "
            f"{tuple(offsets.shape)}"
        )
    if values.dim() == 0:
        raise LayoutError("Ragged.values: expected at least 1 dimension, got a scalar")
    if int(offsets[0]) != 0:
        raise LayoutError(f"Ragged.offsets: expected to start at 0, got {int(offsets[0])}")
    steps = offsets[1:] - offsets[:-1]
    if steps.numel() and bool((steps < 0).any()):
        row = int(torch.nonzero(steps < 0)[0, 0])
        raise LayoutError(
            f"Ragged.offsets: expected non-decreasing offsets, got {int(offsets[row])} then "
            f"{int(offsets[row + 1])} at row {row}"
        )
    if int(offsets[-1]) != values.shape[0]:
        raise LayoutError(
            f"Ragged.offsets: expected to end at len(values) = {values.shape[0]}, "
            f"got {int(offsets[-1])}"
        )
