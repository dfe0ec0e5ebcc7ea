"""Machinery behind the seed classes: normalise-on-assignment records, the grouped/samples pair,
the field converters of tensor fields, and the ``prompt_entries`` view of ``ScoreBatch``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import ArrowSequence, GroupedSequence
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.types import fields as F
from maxent_arrow.types.columns import tensor_equal

_MISSING = object()


class _Record:
    """Base of the seed classes: normalises every field on assignment and converts to Arrow."""

    _convert: ClassVar[dict[str, Any]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        convert = type(self)._convert.get(name)
        if convert is not None:
            value = convert(f"{type(self).__name__}.{name}", value)
        previous = self.__dict__.get(name, _MISSING)
        object.__setattr__(self, name, value)
        check = getattr(self, f"_after_{name}", None)
        if check is not None:
            try:
                check()
            except BaseException:
                # A refused assignment leaves the record as it was (nothing half-built).
                if previous is _MISSING:
                    object.__delattr__(self, name)
                else:
                    object.__setattr__(self, name, previous)
                raise

    def __eq__(self, other: object) -> bool:
        # Field by field, NaN equal to NaN and tensors by value: the generated ``==`` compares
        # field tuples, where a NaN that went through Arrow is a new float and never equal, so
        # ``C.from_arrow(x.to_arrow()) == x`` would fail for any NaN scalar.
        if type(other) is not type(self):
            return NotImplemented
        return all(
            tensor_equal(getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
        )

    __hash__ = None  # mutable records are unhashable, like the seed's dataclasses

    def to_arrow(self) -> pa.RecordBatch:
        """This record as an Arrow record batch (tensors via ``.detach().cpu()``)."""
        from maxent_arrow.types import records

        return records.encode(self)

    @classmethod
    def from_arrow(cls, data: pa.RecordBatch | pa.Table):
        """Rebuild from ``to_arrow()`` output (also after a Parquet or IPC round trip)."""
        from maxent_arrow.types import records

        return records.decode(cls, data)


class _TensorRecord(_Record):
    """Records holding tensors (compared by value through :meth:`_Record.__eq__`)."""


class _GroupedPair(_Record):
    """``grouped`` and ``samples``: one Arrow list array and its flattened child, never two copies.

    Assigning either field checks it against the other; ``samples`` always ends up as the view
    of ``grouped``'s child buffer.
    """

    _convert: ClassVar[dict] = {
        "grouped": F.ensure_grouped_floats,
        "samples": F.ensure_float_list,
    }

    def _after_grouped(self) -> None:
        if "samples" in self.__dict__:
            self._reconcile()

    def _after_samples(self) -> None:
        if "grouped" in self.__dict__:
            self._reconcile()

    def _reconcile(self) -> None:
        name = type(self).__name__
        grouped: GroupedSequence = self.__dict__["grouped"]
        samples: ArrowSequence = self.__dict__["samples"]
        flat = grouped.arrow.flatten()
        if len(samples) != len(flat):
            raise LayoutError(
                f"{name}.samples: expected {len(flat)} values (sum of group sizes), "
                f"got {len(samples)}"
            )
        if samples.arrow is not flat:
            a = flat.to_numpy(zero_copy_only=False)
            b = samples.arrow.to_numpy(zero_copy_only=False)
            differ = np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))))
            if differ.size:
                i = int(differ[0])
                g = int(np.searchsorted(grouped.offsets, i, side="right") - 1)
                raise LayoutError(
                    f"{name}.samples: value {i} is {float(b[i])!r} but "
                    f"grouped[{g}][{i - int(grouped.offsets[g])}] is {float(a[i])!r}; samples "
                    "must be grouped flattened"
                )
        object.__setattr__(self, "samples", ArrowSequence(flat))


def _opt_float(field, value):
    return F.ensure_float(field, value, optional=True)


def _typed(kind):
    def check(field: str, value: Any):
        if not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise SchemaError(
                f"{field}: expected {article} {kind.__name__}, got {type(value).__name__}"
            )
        return value

    return check


def _ids_matrix(field, value):
    tensor = F.ensure_tensor(field, value, ndim=2, kind="int")
    if tensor.numel() and bool((tensor < 0).any()):
        row, col = (int(x) for x in (tensor < 0).nonzero()[0])
        raise LayoutError(
            f"{field}: expected token ids >= 0, got {int(tensor[row, col])} at row {row}, "
            f"position {col}"
        )
    return tensor


def _vector(field, value):
    return F.ensure_tensor(field, value, ndim=1, kind="any")


def _opt(convert):
    return lambda field, value: None if value is None else convert(field, value)


def _matrix(field, value):
    return F.ensure_tensor(field, value, ndim=2, kind="any")


def _float_vector(field, value):
    return F.ensure_tensor(field, value, ndim=1, kind="float")


class PromptEntries(Sequence):
    """``ScoreBatch.prompt_entries`` over two Arrow list arrays (ids and masks), one per sample.

    Items are :class:`PromptCacheEntry` records viewing slices of the arrays; equal to a list of
    entries with the same ids and masks.
    """

    __slots__ = ("ids", "masks")

    def __init__(self, ids: pa.Array, masks: pa.Array):
        self.ids = ids
        self.masks = masks

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                n = max(stop - start, 0)
                return PromptEntries(self.ids.slice(start, n), self.masks.slice(start, n))
            return [self[i] for i in range(start, stop, step)]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"prompt entry {index} out of range for {n}")
        index %= n
        from maxent_arrow.types.rewards import PromptCacheEntry

        return PromptCacheEntry(
            ArrowSequence(self.ids[index].values), ArrowSequence(self.masks[index].values)
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptEntries):
            return self.ids.equals(other.ids) and self.masks.equals(other.masks)
        if not isinstance(other, list | tuple):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"PromptEntries({len(self)} entries, {self.ids.type})"


def _ensure_prompt_entries(field: str, value: Any) -> PromptEntries:
    if isinstance(value, PromptEntries):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(
            f"{field}: expected a list of PromptCacheEntry, got {type(value).__name__}"
        )
    from maxent_arrow.types.rewards import PromptCacheEntry

    ids, masks = [], []
    for i, entry in enumerate(value):
        if not isinstance(entry, PromptCacheEntry):
            raise SchemaError(
                f"{field}: expected a PromptCacheEntry at sample {i}, got {type(entry).__name__}"
            )
        ids.append(entry.input_ids.arrow)
        masks.append(entry.attention_mask.arrow)
    sizes = [len(a) for a in ids]
    id_values = pa.concat_arrays(ids) if ids else pa.array([], pa.int32())
    mask_values = pa.concat_arrays(masks) if masks else pa.array([], pa.int8())
    return PromptEntries(F._list_array(id_values, sizes), F._list_array(mask_values, sizes))
