"""Arrow-backed read-only sequences: the values of the seed dataclasses' list fields.

A view wraps one Arrow array and copies nothing: ``len``, indexing, iteration, ``==`` against
plain lists (NaN equals NaN), a readable repr, ``to_pylist()``, ``.arrow`` and, for numeric
data, zero-copy ``to_torch()``.

- :class:`ArrowSequence` views a flat array: ``[N]`` floats, ints or strings.
- :class:`JsonSequence` views a string array whose entries are JSON text (free-form metadata).
- :class:`InfoSequence` views a struct array of completion info and gives dicts back.
- :class:`GroupedSequence` views a list array: one item per group, each item a flat view;
  ``.samples`` is the flattened child (the same buffer, not a copy).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow.lists import list_offsets
from maxent_arrow.arrow.ragged import Ragged, arrow_to_torch

__all__ = ["INFO_FIELDS", "ArrowSequence", "JsonSequence", "InfoSequence", "GroupedSequence"]

_REPR_ITEMS = 6


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b


class ArrowSequence(Sequence):
    """Read-only sequence over a flat Arrow array."""

    __slots__ = ("_array",)

    def __init__(self, array: pa.Array | pa.ChunkedArray):
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        self._array = array

    @property
    def arrow(self) -> pa.Array:
        """The Arrow array behind this view (no copy)."""
        return self._array

    def __len__(self) -> int:
        return len(self._array)

    def _decode(self, value: Any) -> Any:
        return value

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return type(self)._wrap(self, self._array.slice(start, max(stop - start, 0)))
            return self.to_pylist()[index]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} items")
        return self._decode(self._array[index % n].as_py())

    @classmethod
    def _wrap(cls, like: ArrowSequence, array: pa.Array) -> ArrowSequence:
        return cls(array)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.to_pylist())

    def to_pylist(self) -> list:
        """The values as a plain Python list."""
        return [self._decode(v) for v in self._array.to_pylist()]

    def to_torch(self) -> torch.Tensor:
        """Zero-copy tensor view (numeric, null-free data only)."""
        return arrow_to_torch(self._array, field=type(self).__name__)

    def numpy(self) -> np.ndarray:
        """Read-only numpy view (numeric, null-free data; no copy)."""
        return self._array.to_numpy(zero_copy_only=False)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ArrowSequence):
            if len(other) != len(self):
                return False
            if type(other) is type(self) and _arrow_equal(self._array, other._array):
                return True
            other = other.to_pylist()
        if isinstance(other, np.ndarray | torch.Tensor):
            other = other.tolist()
        if not isinstance(other, list | tuple):
            return NotImplemented
        return len(other) == len(self) and _values_equal(self.to_pylist(), list(other))

    __hash__ = None  # mutable-looking containers are unhashable, like list

    def __repr__(self) -> str:
        items = self[:_REPR_ITEMS].to_pylist() if len(self) > _REPR_ITEMS else self.to_pylist()
        more = f", ... ({len(self)} items)" if len(self) > _REPR_ITEMS else ""
        return "[" + ", ".join(repr(v) for v in items) + more + "]"


class JsonSequence(ArrowSequence):
    """Sequence over a string array of JSON texts; items are decoded on access."""

    __slots__ = ()

    def _decode(self, value: Any) -> Any:
        return None if value is None else json.loads(value)


# Keys of a completion-info dict that have their own typed struct field; everything else (and
# any of these holding a value of another type) travels in the JSON `extra` field.
INFO_FIELDS: dict[str, pa.DataType] = {
    "finish_reason": pa.string(),
    "stop_reason": pa.string(),
    "truncated": pa.bool_(),
    "token_count": pa.int32(),
    "token_ids": pa.list_(pa.field("item", pa.int32(), nullable=False)),
}


class InfoSequence(ArrowSequence):
    """Sequence over a struct array of completion info; items come back as dicts.

    Typed keys (``finish_reason``, ``stop_reason``, ``truncated``, ``token_count``,
    ``token_ids``) are struct
    fields; other keys ride in the JSON ``extra`` field. A key absent from the original dict is
    null here and absent from the dict that comes back.
    """

    __slots__ = ()

    def _decode(self, value: Any) -> Any:
        if value is None:
            return None
        out = {k: v for k, v in value.items() if k in INFO_FIELDS and v is not None}
        extra = value.get("extra")
        if extra:
            out.update(json.loads(extra))
        return out


def _arrow_equal(a: pa.Array, b: pa.Array) -> bool:
    if a.type != b.type or len(a) != len(b):
        return False
    if a.equals(b):
        return True
    if pa.types.is_floating(a.type) and not a.null_count and not b.null_count:
        return bool(np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True))
    return False


class GroupedSequence(Sequence):
    """Read-only sequence of groups over an Arrow list array.

    ``view[g]`` is group ``g`` as a flat view (a slice of the child, no copy); ``.samples`` is
    all groups' values flattened (the same buffer); ``.offsets`` the group boundaries.
    """

    __slots__ = ("_array", "_item")

    def __init__(
        self, array: pa.Array | pa.ChunkedArray, item: type[ArrowSequence] = ArrowSequence
    ):
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        self._array = array
        self._item = item

    @property
    def arrow(self) -> pa.Array:
        """The Arrow list array behind this view (no copy)."""
        return self._array

    @property
    def samples(self) -> ArrowSequence:
        """All groups' values, flattened (a view of the child array, not a copy)."""
        return self._item(self._array.flatten())

    @property
    def offsets(self) -> np.ndarray:
        """Group boundaries, int64, starting at 0."""
        return list_offsets(self._array)

    def group_sizes(self) -> np.ndarray:
        """Number of items in each group."""
        return np.diff(self.offsets)

    def to_ragged(self) -> Ragged:
        """The groups as a :class:`Ragged` over a zero-copy values view."""
        return Ragged.from_arrow(self._array)

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return GroupedSequence(self._array.slice(start, max(stop - start, 0)), self._item)
            return [self[i] for i in range(start, stop, step)]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"group {index} out of range for {n} groups")
        index %= n
        bounds = self._array.offsets
        lo, hi = bounds[index].as_py(), bounds[index + 1].as_py()
        return self._item(self._array.values.slice(lo, hi - lo))

    def __iter__(self) -> Iterator[ArrowSequence]:
        flat = self._array.flatten()
        bounds = self.offsets.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield self._item(flat.slice(lo, hi - lo))

    def to_pylist(self) -> list[list]:
        """The groups as plain nested Python lists."""
        flat = self.samples.to_pylist()
        bounds = self.offsets.tolist()
        return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GroupedSequence):
            if len(other) != len(self):
                return False
            if _arrow_equal(self._array, other._array):
                return True
            other = other.to_pylist()
        if not isinstance(other, list | tuple):
            return NotImplemented
        return len(other) == len(self) and _values_equal(
            self.to_pylist(), [list(g) if isinstance(g, Sequence) else g for g in other]
        )

    __hash__ = None

    def __repr__(self) -> str:
        shown = [repr(g) for g in self[:_REPR_ITEMS]] if len(self) else []
        more = f", ... ({len(self)} groups)" if len(self) > _REPR_ITEMS else ""
        return "[" + ", ".join(shown) + more + "]"
