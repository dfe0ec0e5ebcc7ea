"""Segment reductions over group offsets: the one place the group math touches the layout.

Every per-group quantity (means, maxima, softmax denominators, entropies) is a reduction over
contiguous segments of one flat tensor, described by int64 offsets. :class:`Segments` wraps the
offsets of a :class:`~maxent_arrow.arrow.Ragged`, validates them once (naming the first bad
group) and keeps what is derived from them (lengths, row ids, the uniform width), so a pipeline
of group functions over the same offsets computes these once: :meth:`Segments.of` reuses the
``Segments`` of an offsets tensor it has already checked (until that tensor is modified).

Two paths, chosen once from the offsets, with the same results (up to summation order):

- uniform groups (every group has the same size ``K``, the common fixed-K case): the values
  are viewed as ``[P, K]`` and reduced with dense kernels along ``dim=1`` (``sum``, ``amax``),
  and per-group values broadcast as ``[P, 1]`` (no ``[N]`` temporary, no row ids);
- ragged groups: ``torch.segment_reduce`` on the offsets (one kernel on CPU and CUDA) and
  ``index_select`` on the row ids to expand per-group values to the samples.

The module also holds the input boundary of the group math (:func:`as_ragged`,
:func:`as_sample_vector`, argument checks) and the softmax shift rule (:func:`shift_mode`).

No Python loop over groups or samples. The dense path uses plain ``sum`` / ``amax`` along
``dim=1`` rather than ``torch.std_mean(dim=1)`` or ``torch.softmax(dim=1)``, whose inner loops
run along the short K axis (``benchmarks/bench_compute.py`` has the figures).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import Ragged, arrow_to_torch
from maxent_arrow.errors import ComputeError, LayoutError, SchemaError

__all__ = [
    "LOG2E",
    "Segments",
    "log2",
    "as_ragged",
    "as_sample_vector",
    "check_finite",
    "check_out",
    "check_scalar",
    "finite_range",
    "flat_values",
    "grouped_input",
    "shift_",
    "shift_mode",
    "work_dtype",
]

# A softmax is shift-invariant: exp(z - s) / Σ exp(z - s) is the same for any s. The safe
# choice is each group's max (a segment reduction plus an expand per softmax). Bounds of the
# whole batch's logits come free with the finiteness check (its min and max); when they lie
# within this fraction of the exponent range (|z| <= 603 for float64, 75 for float32), every
# exp is a normal number without a shift (no overflow, no underflow, full relative precision),
# and when they span less than it, one batch-wide shift does the same. Either way the groups'
# results are the same up to rounding, and the per-group max is only the fallback.
SHIFT_FRACTION = 0.85
# Softmaxes exponentiate in base 2, exp(x) = 2^(x log2 e), with the log2 e factor folded into a
# scaling the formula already has: float64 `exp2` runs in half the time of `exp` on CPU
# (0.86 vs 1.7 ms per 1M values, 1 thread), and both are within 1 ulp. The folded factor moves
# the exponent by at most ~2 ulp of |x| <= 603 (the bounds above), i.e. a relative change of
# the result below 3e-13, the size of the rounding the reference loops themselves make.
LOG2E = 1.0 / math.log(2.0)


def log2(values: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``log2(values)``, into ``out`` when given.

    On CPU, for float32/float64 values outside autograd, numpy's vectorised log runs on the
    same memory: torch 2.13's CPU float64 ``log2`` is scalar code, 3x slower (1.9 vs 0.65 ms
    per 1M values, 1 thread, ``benchmarks/bench_compute.py``). Elsewhere, ``torch.log2``.
    """
    if (
        values.device.type == "cpu"
        and values.dtype in (torch.float32, torch.float64)
        and not (values.requires_grad and torch.is_grad_enabled())
        and (out is None or (out.dtype == values.dtype and out.is_contiguous()))
        and values.is_contiguous()
    ):
        if out is None:
            out = torch.empty_like(values)
        np.log2(values.detach().numpy(), out=out.detach().numpy())
        return out
    return torch.log2(values, out=out)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype group math runs in: float64 stays float64, every other dtype becomes float32.

    Integer and boolean inputs (0/1 rewards) become float64 so no precision is lost; half
    precision becomes float32 because sums must never accumulate below float32 (the original
    accumulated log-prob sums in bf16, ``docs/seed-bugs.md`` §6).
    """
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    return torch.float64


class _Derived:
    """What a ``Segments`` derives from its offsets; shared by every ``Segments`` of one
    offsets tensor (it holds no reference to that tensor, so the cache keyed by the tensor
    does not keep it alive)."""

    __slots__ = (
        "device_offsets",
        "lengths",
        "width",
        "max_length",
        "has_empty",
        "row_ids",
        "float_lengths",
    )

    def __init__(self, lengths: torch.Tensor, width: int | None, max_length: int, has_empty: bool):
        self.device_offsets: torch.Tensor | None = None
        self.lengths = lengths
        self.width = width
        self.max_length = max_length
        self.has_empty = has_empty
        self.row_ids: torch.Tensor | None = None
        self.float_lengths: dict[torch.dtype, torch.Tensor] = {}


class Segments:
    """The group structure of ragged values: offsets, lengths, row ids, uniform width.

    Parameters
    ----------
    offsets:
        int64 group boundaries, ``P + 1`` entries from 0.
    num_values:
        ``N``, the number of values the offsets describe (checked against the last offset).
    where:
        Prefix of error messages, e.g. ``"group_advantages: utils"``.
    allow_empty:
        Whether groups of size 0 are allowed (token rows of empty completions are; prompt
        groups are not: a group of 0 completions has no mean, no softmax).

    Attributes
    ----------
    width:
        ``K`` when every group has the same ``K >= 1`` values (the dense path), else ``None``.
    max_length:
        The largest group size.
    has_empty:
        Whether some group has 0 values.
    """

    __slots__ = ("offsets", "num_values", "_d")

    def __init__(
        self, offsets: torch.Tensor, *, num_values: int, where: str, allow_empty: bool = False
    ):
        self.offsets = offsets
        self.num_values = num_values
        self._d = _derive(offsets, num_values, where, allow_empty)

    @classmethod
    def of(cls, ragged: Ragged, *, where: str, allow_empty: bool = False) -> Segments:
        """Segments of a ``Ragged``'s offsets, on its values' device.

        The offsets are checked (a ``Ragged`` built with ``validate=False`` may carry any
        offsets) the first time this offsets tensor is seen with this many values on this
        device. What is derived from them (lengths, uniform width, row ids, float lengths) is
        kept for as long as that offsets tensor lives, so ``total_utils -> group_advantages ->
        q_distribution -> maxent_weights`` over one batch (whose results share the offsets)
        checks and derives once. Modifying the offsets in place invalidates it (the tensor's
        version counter is part of the key).
        """
        values = ragged.values
        return cls.cached(
            ragged.offsets,
            num_values=int(values.shape[0]),
            device=values.device,
            where=where,
            allow_empty=allow_empty,
        )

    @classmethod
    def cached(
        cls,
        offsets: torch.Tensor,
        *,
        num_values: int,
        device: torch.device,
        where: str,
        allow_empty: bool = False,
    ) -> Segments:
        """Like the constructor, for ``offsets`` moved to ``device``, with the cache of
        :meth:`of` (for callers that hold offsets and values apart)."""
        key = _cache_key(offsets, num_values, device)
        derived = _lookup(offsets, key)
        if derived is None or (derived.has_empty and not allow_empty):
            local = offsets.to(device)
            derived = _derive(local, num_values, where, allow_empty)
            if local is not offsets:
                derived.device_offsets = local
            _remember(offsets, key, derived)
        self = cls.__new__(cls)
        self.offsets = offsets if derived.device_offsets is None else derived.device_offsets
        self.num_values = num_values
        self._d = derived
        return self

    def __len__(self) -> int:
        return self._d.lengths.numel()

    @property
    def lengths(self) -> torch.Tensor:
        """Group sizes, int64 ``[P]``."""
        return self._d.lengths

    @property
    def width(self) -> int | None:
        return self._d.width

    @property
    def has_empty(self) -> bool:
        return self._d.has_empty

    @property
    def max_length(self) -> int:
        """The largest group size (0 without groups)."""
        return self._d.max_length

    @property
    def row_ids(self) -> torch.Tensor:
        """Group index of every value, int64 ``[N]`` (computed once, on first use)."""
        d = self._d
        if d.row_ids is None:
            groups = torch.arange(len(self), device=self.offsets.device)
            if d.width is not None:
                d.row_ids = groups.repeat_interleave(d.width)
            else:
                d.row_ids = torch.repeat_interleave(groups, d.lengths, output_size=self.num_values)
        return d.row_ids

    def float_lengths(self, dtype: torch.dtype) -> torch.Tensor:
        """Group sizes ``[P]`` in a floating dtype (computed once per dtype)."""
        cached = self._d.float_lengths.get(dtype)
        if cached is None:
            cached = self._d.float_lengths[dtype] = self._d.lengths.to(dtype)
        return cached

    def dense(self, values: torch.Tensor) -> torch.Tensor:
        """The ``[P, K]`` view of uniform groups' values (a copy only if they are strided
        so that no view exists)."""
        if self._d.width is None:
            raise LayoutError("Segments.dense: the groups are not all the same size")
        return values.reshape(len(self), self._d.width)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group sums ``[P]`` (0 for an empty group); differentiable."""
        if self._d.width is not None:
            return self.dense(values).sum(1)
        return torch.segment_reduce(values, "sum", offsets=self.offsets, unsafe=True, initial=0)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group maxima ``[P]`` (``-inf`` for an empty group)."""
        if self._d.width is not None:
            return self.dense(values).amax(1)
        return torch.segment_reduce(values, "max", offsets=self.offsets, unsafe=True)

    def min(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group minima ``[P]`` (``+inf`` for an empty group)."""
        if self._d.width is not None:
            return self.dense(values).amin(1)
        return torch.segment_reduce(values, "min", offsets=self.offsets, unsafe=True)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group means ``[P]``."""
        return self.sum(values) / self.float_lengths(values.dtype)

    def norm(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group Euclidean norms ``sqrt(Σ x²)`` ``[P]`` (0 for an empty group).

        Uniform groups use ``torch.linalg.vector_norm(dim=1)`` (one read pass, no ``[N]``
        temporary of squares); ragged ones square, then segment-sum.
        """
        if self._d.width is not None:
            return torch.linalg.vector_norm(self.dense(values), dim=1)
        return self.sum(values.square()).sqrt_()

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """Per-group values ``[P]`` repeated to every value of the group ``[N]``."""
        if self._d.width is not None:
            return per_group[:, None].expand(len(self), self._d.width).reshape(self.num_values)
        return per_group.index_select(0, self.row_ids)

    def apply(
        self,
        op: Callable[..., torch.Tensor],
        values: torch.Tensor,
        per_group: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``op(values, per_group expanded to the values)`` in one pass, e.g. ``torch.sub``.

        Uniform groups broadcast a ``[P, K]`` view against ``[P, 1]`` (no ``[N]`` temporary);
        ragged ones gather by row id (and, without ``out``, write the result over the
        gathered temporary). ``out`` may be ``values`` itself for an in-place update of a
        temporary (never of a caller's tensor).
        """
        if self._d.width is not None:
            shape = (len(self), self._d.width)
            view_out = None if out is None else out.view(shape)
            result = op(values.view(shape), per_group[:, None], out=view_out)
            return result.view(self.num_values) if out is None else out
        expanded = per_group.index_select(0, self.row_ids)
        if out is None and _reusable(values, expanded):
            out = expanded
        return op(values, expanded, out=out)

    def locate(self, index: int) -> tuple[int, int]:
        """``(group, position in group)`` of flat value ``index``."""
        probe = torch.tensor(index, device=self.offsets.device)
        group = int(torch.searchsorted(self.offsets, probe, right=True)) - 1
        return group, index - int(self.offsets[group])


def _derive(offsets: torch.Tensor, num_values: int, where: str, allow_empty: bool) -> _Derived:
    """Check the offsets (naming the first bad group) and derive lengths and width."""
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() == 0:
        raise LayoutError(
            f"{where}: expected int64 offsets of groups + 1 entries, got dtype "
            f"{offsets.dtype} and shape {tuple(offsets.shape)}"
        )
    lengths = offsets[1:] - offsets[:-1]
    groups = lengths.numel()
    # One host sync for all the layout checks and the width (on CUDA each `bool()` is one).
    zero = offsets.new_zeros(())
    low = lengths.min() if groups else zero
    high = lengths.max() if groups else zero
    first, last, low, high = torch.stack([offsets[0], offsets[-1], low, high]).tolist()
    if first != 0:
        raise LayoutError(f"{where}: offsets must start at 0, got {first}")
    if groups and low < 0:
        g = int(torch.nonzero(lengths < 0)[0, 0])
        raise LayoutError(
            f"{where}: offsets must be non-decreasing, got {int(offsets[g])} then "
            f"{int(offsets[g + 1])} at group {g}"
        )
    if last != num_values:
        raise LayoutError(f"{where}: offsets end at {last} but there are {num_values} values")
    has_empty = bool(groups and low == 0)
    if has_empty and not allow_empty:
        g = int(torch.nonzero(lengths == 0)[0, 0])
        raise ComputeError(f"{where}: group {g} is empty (size 0); every group needs >= 1 value")
    # Uniform groups (the common fixed-K case) take the dense [P, K] path.
    width = int(low) if groups and low == high and low > 0 else None
    return _Derived(lengths, width, int(high), has_empty)


def _reusable(values: torch.Tensor, expanded: torch.Tensor) -> bool:
    # The gathered temporary can hold the result when nothing promotes and no graph is built.
    return (
        values.dtype == expanded.dtype and not values.requires_grad and not expanded.requires_grad
    )


# ---------------------------------------------------------------------------- cache
# id(offsets) -> (weak reference to the offsets, {(num_values, device): (version, _Derived)}).
# Identity, not value equality, decides a hit (comparing offsets by value would cost the pass
# the cache saves), and the tensor's version counter catches in-place changes. The entry holds
# no strong reference to the offsets and goes when they do (the weak reference's callback), so
# the derived tensors live exactly as long as the offsets, and the caller's tensor is never
# touched (no attribute on it that pickling or deepcopy would carry along).
_CACHE: dict[int, tuple[weakref.ref, dict[tuple, tuple[int, _Derived]]]] = {}


def _forget(ref: weakref.ref, key: int) -> None:
    entry = _CACHE.get(key)
    if entry is not None and entry[0] is ref:
        del _CACHE[key]


def _cache_key(offsets: torch.Tensor, num_values: int, device: torch.device) -> tuple | None:
    if offsets.is_inference():
        return None  # inference tensors have no version counter to detect in-place changes
    return (num_values, str(device))


def _lookup(offsets: torch.Tensor, key: tuple | None) -> _Derived | None:
    if key is None:
        return None
    entry = _CACHE.get(id(offsets))
    if entry is None or entry[0]() is not offsets:
        return None
    found = entry[1].get(key)
    if found is None or found[0] != offsets._version:
        return None
    return found[1]


def _remember(offsets: torch.Tensor, key: tuple | None, derived: _Derived) -> None:
    if key is None:
        return
    ident = id(offsets)
    entry = _CACHE.get(ident)
    if entry is None or entry[0]() is not offsets:
        ref = weakref.ref(offsets, lambda r, k=ident: _forget(r, k))
        entry = _CACHE[ident] = (ref, {})
    entry[1][key] = (offsets._version, derived)


# ---------------------------------------------------------------------------- finiteness
def finite_range(
    values: torch.Tensor, segments: Segments | None, where: str
) -> tuple[float, float]:
    """``(min, max)`` of the values in one host sync, raising like :func:`check_finite` when
    one is NaN or infinite (both reductions propagate NaN, so they double as the check)."""
    low, high = torch.stack([values.amin(), values.amax()]).tolist()
    if not (_finite(low) and _finite(high)):
        check_finite(values, segments, where, fast=False)
    return low, high


def _finite(x: float) -> bool:
    return x - x == 0.0


def check_finite(
    values: torch.Tensor, segments: Segments | None, where: str, *, fast: bool = True
) -> None:
    """Raise :class:`ComputeError` naming the group and sample of the first NaN or inf."""
    # Fast path: one read pass, no [N] temporary; the sum is finite iff every value is (short
    # of an overflow of the sum, which the slow path below then clears).
    if fast and bool(torch.isfinite(values.sum())):
        return
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    index = int(torch.nonzero(bad)[0, 0])
    value = float(values[index])
    if segments is None:
        raise ComputeError(f"{where}: expected finite values, got {value} at sample {index}")
    group, k = segments.locate(index)
    raise ComputeError(
        f"{where}: expected finite values, got {value} at group {group}, sample {k} (value {index})"
    )


# ---------------------------------------------------------------------------- softmax shifts
def shift_mode(bottom: float, top: float, dtype: torch.dtype) -> str:
    """How to make logits within ``[bottom, top]`` (natural units, up to rounding) safe to
    exponentiate: ``"none"`` when ``exp`` of both bounds is a normal number, ``"global"`` (one
    batch-wide shift by ``top``) when their span allows it, else ``"group"`` (each group's
    max)."""
    safe = -math.log(torch.finfo(dtype).tiny) * SHIFT_FRACTION
    if -safe <= bottom and top <= safe:
        return "none"
    return "global" if top - bottom <= safe else "group"


def shift_(z: torch.Tensor, seg: Segments, mode: str, top: float) -> None:
    """Apply :func:`shift_mode`'s shift to the temporary ``z`` in place (``top`` in the
    units of ``z``)."""
    if mode == "global":
        z.sub_(top)
    elif mode == "group":
        seg.apply(torch.sub, z, seg.max(z), out=z)


# ---------------------------------------------------------------------------- input boundary
# Grouped inputs (Ragged, grouped views, Arrow lists) become (values, offsets) here, and the
# per-sample and scalar arguments of the group math are checked, naming the argument.
def as_ragged(value: Any, where: str) -> Ragged:
    """Normalise grouped input to a ``Ragged`` of 1-D values (views, no copies).

    Accepts a ``Ragged``, an Arrow list array (``record.column("grouped")``), or a list of
    per-group lists (the ``grouped`` field of the seed classes; converted once).
    """
    if isinstance(value, Ragged):
        ragged = value
    elif isinstance(value, pa.Array | pa.ChunkedArray):
        ragged = Ragged.from_arrow(value)
    elif _is_nested_list(value):
        ragged = Ragged.from_lists([list(group) for group in value], dtype=torch.float64)
    else:
        raise SchemaError(
            f"{where}: expected a Ragged (or an Arrow list array), got {type(value).__name__}"
        )
    if ragged.values.dim() != 1:
        raise LayoutError(f"{where}: expected 1-D values, got shape {tuple(ragged.values.shape)}")
    if not (ragged.values.is_floating_point() or _is_integer(ragged.values)):
        raise SchemaError(f"{where}: expected numeric values, got dtype {ragged.values.dtype}")
    return ragged


def _is_nested_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(
        isinstance(group, list | tuple | np.ndarray) for group in value
    )


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex()


def grouped_input(value: Any, where: str) -> tuple[Ragged, Segments, torch.Tensor]:
    """Ragged, its checked segments, and its values in the working dtype."""
    ragged = as_ragged(value, where)
    if len(ragged) == 0:
        raise ComputeError(f"{where}: expected at least one group, got an empty batch")
    segments = Segments.of(ragged, where=where)
    values = ragged.values
    return ragged, segments, values.to(work_dtype(values.dtype))


def as_sample_vector(
    value: Any,
    *,
    n: int,
    where: str,
    device: torch.device,
    segments: Segments | None = None,
) -> torch.Tensor:
    """A per-sample ``[n]`` tensor on ``device`` from a tensor, ``Ragged``, view or list.

    A ``Ragged`` must have the same group sizes as ``segments`` (the first differing group is
    named); other inputs must have ``n`` values.
    """
    if isinstance(value, pa.ListArray | pa.LargeListArray):
        value = as_ragged(value, where)
    if isinstance(value, Ragged):
        if segments is not None:
            other = value.offsets.to(segments.offsets.device)
            if other.shape != segments.offsets.shape or not torch.equal(other, segments.offsets):
                _raise_group_mismatch(other, segments, where)
        value = value.values
    elif isinstance(value, pa.Array | pa.ChunkedArray):
        value = arrow_to_torch(value, field=where)
    elif isinstance(value, np.ndarray | list | tuple):
        value = torch.as_tensor(np.asarray(value, dtype=np.float64))
    elif not isinstance(value, torch.Tensor):
        raise SchemaError(f"{where}: expected a tensor of {n} values, got {type(value).__name__}")
    if value.dim() != 1 or value.shape[0] != n:
        raise ComputeError(
            f"{where}: expected {n} values (one per sample), got shape {tuple(value.shape)}"
        )
    return value.to(device)


def _raise_group_mismatch(other: torch.Tensor, segments: Segments, where: str) -> None:
    mine = segments.lengths
    theirs = other[1:] - other[:-1]
    if theirs.numel() != mine.numel():
        raise ComputeError(f"{where}: expected {mine.numel()} groups, got {theirs.numel()}")
    g = int(torch.nonzero(theirs != mine)[0, 0])
    raise ComputeError(
        f"{where}: group {g} has {int(theirs[g])} values, expected {int(mine[g])} (as the "
        "grouped input)"
    )


def check_scalar(value: Any, where: str, *, low: float, strict: bool) -> float:
    """``value`` as a finite float ``> low`` (``strict``) or ``>= low``, else ComputeError."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ComputeError(f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(number) or number < low or (strict and number == low):
        sign = ">" if strict else ">="
        raise ComputeError(f"{where}: must be finite and {sign} {low:g}, got {value!r}")
    return number


def check_out(
    out: Any,
    *,
    like: torch.Tensor,
    n: int,
    where: str,
    inputs: Sequence[tuple[str, torch.Tensor | None]],
) -> torch.Tensor | None:
    """A caller's result buffer: ``[n]``, contiguous, ``like``'s dtype and device, no grad, no
    memory shared with an input (results are written before inputs are last read)."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise SchemaError(f"{where}: out: expected a tensor, got {type(out).__name__}")
    same = out.dtype == like.dtype and out.device == like.device
    if out.shape != (n,) or not same or not out.is_contiguous():
        raise ComputeError(
            f"{where}: out: expected a contiguous {like.dtype} tensor of shape ({n},) on "
            f"{like.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.requires_grad:
        raise ComputeError(f"{where}: out: must not require grad")
    mine = out.untyped_storage().data_ptr()
    for name, tensor in inputs:
        if tensor is not None and tensor.untyped_storage().data_ptr() == mine:
            raise ComputeError(f"{where}: out: shares memory with {name}; pass a separate buffer")
    return out


def flat_values(value: Any, where: str) -> torch.Tensor:
    """Non-empty 1-D per-sample values in the working dtype, from any grouped or flat input
    (the group structure, if any, is dropped)."""
    if isinstance(value, pa.ListArray | pa.LargeListArray):
        value = as_ragged(value, where)
    if isinstance(value, Ragged):
        value = value.values
    elif isinstance(value, pa.Array | pa.ChunkedArray):
        value = arrow_to_torch(value, field=where)
    elif not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError):
            raise SchemaError(f"{where}: expected numbers, got {type(value).__name__}") from None
    if value.dim() != 1:
        raise ComputeError(f"{where}: expected 1-D values, got shape {tuple(value.shape)}")
    if value.numel() == 0:
        raise ComputeError(f"{where}: expected at least one sample, got an empty batch")
    return value.to(work_dtype(value.dtype))
