"""Segment reductions over group offsets: the one place the group math touches the layout.

Every per-group quantity (means, maxima, softmax denominators, entropies) is a reduction over
contiguous segments of one flat tensor, described by int64 offsets. :class:`Segments` wraps the
offsets of a :class:`~maxent_arrow.ragged.Ragged`, validates them once (naming the first bad
group), and offers ``sum`` / ``max`` (``torch.segment_reduce``, one kernel on CPU and CUDA) and
``expand`` (per-group values back to per-sample, ``index_select`` on the row ids, or a
broadcast view when every group has the same size). No Python loop over groups or samples.

Measured on 2 CPU cores at 1M float64 values, K=16: ``segment_reduce`` sum 1.7 ms, where
``index_add_`` takes 8 ms, ``scatter_reduce(amax)`` 14 ms and ``view(P, K).sum(1)`` 16 ms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from maxent_arrow.errors import ComputeError, LayoutError
from maxent_arrow.ragged import Ragged

__all__ = ["Segments", "work_dtype", "check_finite"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype group math runs in: float64 stays float64, every other dtype becomes float32.

    Integer and boolean inputs (0/1 rewards) become float64 so no precision is lost; half
    precision becomes float32 because sums must never accumulate below float32 (the original
    accumulated log-prob sums in bf16, semantics §6.6).
    """
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    return torch.float64


class Segments:
    """The group structure of ragged values: offsets, lengths, row ids, uniform width.

    Parameters
    ----------
    offsets:
        int64 group boundaries, ``P + 1`` entries from 0.
    where:
        Prefix of error messages, e.g. ``"group_advantages: utils"``.
    allow_empty:
        Whether groups of size 0 are allowed (token rows of empty completions are; prompt
        groups are not: a group of 0 completions has no mean, no softmax).
    """

    __slots__ = ("offsets", "lengths", "num_values", "width", "_row_ids")

    def __init__(
        self, offsets: torch.Tensor, *, num_values: int, where: str, allow_empty: bool = False
    ):
        if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() == 0:
            raise LayoutError(
                f"{where}: expected int64 offsets of groups + 1 entries, got dtype "
                f"{offsets.dtype} and shape {tuple(offsets.shape)}"
            )
        lengths = offsets[1:] - offsets[:-1]
        groups = lengths.numel()
        # One host sync for all the layout checks (on CUDA each `bool()` would be one).
        first, last = offsets[0], offsets[-1]
        low = lengths.min() if groups else offsets.new_zeros(())
        checks = torch.stack([first, last, low]).tolist()
        if checks[0] != 0:
            raise LayoutError(f"{where}: offsets must start at 0, got {checks[0]}")
        if groups and checks[2] < 0:
            g = int(torch.nonzero(lengths < 0)[0, 0])
            raise LayoutError(
                f"{where}: offsets must be non-decreasing, got {int(offsets[g])} then "
                f"{int(offsets[g + 1])} at group {g}"
            )
        if checks[1] != num_values:
            raise LayoutError(
                f"{where}: offsets end at {checks[1]} but there are {num_values} values"
            )
        if groups and not allow_empty and checks[2] == 0:
            g = int(torch.nonzero(lengths == 0)[0, 0])
            raise ComputeError(
                f"{where}: group {g} is empty (size 0); every group needs >= 1 value"
            )
        self.offsets = offsets
        self.lengths = lengths
        self.num_values = num_values
        # Uniform groups (the common fixed-K case) expand by a broadcast view, no row ids.
        width = num_values // groups if groups else 0
        uniform = groups > 0 and width * groups == num_values and bool((lengths == width).all())
        self.width = width if uniform else None
        self._row_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, ragged: Ragged, *, where: str, allow_empty: bool = False) -> Segments:
        """Segments of a ``Ragged``'s offsets (checked: a ``Ragged`` built with
        ``validate=False`` may carry any offsets)."""
        values = ragged.values
        return cls(
            ragged.offsets.to(values.device),
            num_values=int(values.shape[0]),
            where=where,
            allow_empty=allow_empty,
        )

    def __len__(self) -> int:
        return self.lengths.numel()

    @property
    def row_ids(self) -> torch.Tensor:
        """Group index of every value, int64 ``[N]`` (computed once, on first use)."""
        if self._row_ids is None:
            groups = torch.arange(len(self), device=self.offsets.device)
            if self.width is not None:
                self._row_ids = groups.repeat_interleave(self.width)
            else:
                self._row_ids = torch.repeat_interleave(
                    groups, self.lengths, output_size=self.num_values
                )
        return self._row_ids

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group sums ``[P]`` (0 for an empty group); differentiable."""
        return torch.segment_reduce(values, "sum", offsets=self.offsets, unsafe=True, initial=0)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group maxima ``[P]`` (``-inf`` for an empty group)."""
        return torch.segment_reduce(values, "max", offsets=self.offsets, unsafe=True)

    def min(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group minima ``[P]`` (``+inf`` for an empty group)."""
        return torch.segment_reduce(values, "min", offsets=self.offsets, unsafe=True)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group means ``[P]``."""
        return self.sum(values) / self.lengths.to(values.dtype)

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """Per-group values ``[P]`` repeated to every value of the group ``[N]``."""
        if self.width is not None:
            return per_group[:, None].expand(len(self), self.width).reshape(self.num_values)
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
        ragged ones gather by row id. ``out`` may be ``values`` itself for an in-place update
        of a temporary (never of a caller's tensor).
        """
        if self.width is not None:
            shape = (len(self), self.width)
            view_out = None if out is None else out.view(shape)
            result = op(values.view(shape), per_group[:, None], out=view_out)
            return result.view(self.num_values) if out is None else out
        return op(values, per_group.index_select(0, self.row_ids), out=out)

    def locate(self, index: int) -> tuple[int, int]:
        """``(group, position in group)`` of flat value ``index``."""
        probe = torch.tensor(index, device=self.offsets.device)
        group = int(torch.searchsorted(self.offsets, probe, right=True)) - 1
        return group, index - int(self.offsets[group])


def check_finite(values: torch.Tensor, segments: Segments | None, where: str) -> None:
    """Raise :class:`ComputeError` naming the group and sample of the first NaN or inf."""
    # Fast path: one read pass, no [N] temporary; the sum is finite iff every value is (short
    # of an overflow of the sum, which the slow path below then clears).
    if bool(torch.isfinite(values.sum())):
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
