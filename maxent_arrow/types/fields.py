"""Normalisation of the seed dataclasses' field values at the API boundary.

Each ``ensure_*`` takes what the seed's callers pass (lists, dicts, floats, numpy arrays,
tensors, or our own views) and returns the one internal type the classes hold: an Arrow-backed
view for list fields, a CPU or device tensor for tensor fields. Bad input raises a typed error
that names the field and the position (group, sample, row), before anything is built.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import (
    INFO_FIELDS,
    ArrowSequence,
    GroupedSequence,
    InfoSequence,
    JsonSequence,
    Ragged,
    list_offsets,
)
from maxent_arrow.errors import LayoutError, SchemaError

INFO_TYPE = pa.struct(
    [pa.field(name, kind) for name, kind in INFO_FIELDS.items()] + [pa.field("extra", pa.string())]
)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _where(group: int | None, index: int) -> str:
    return f"group {group}, sample {index}" if group is not None else f"position {index}"


# ---------------------------------------------------------------------------- flat scalars
def ensure_float(field: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None:
        if optional:
            return None
        raise SchemaError(f"{field}: expected a float, got None")
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.size == 1 if isinstance(value, np.ndarray) else value.numel() == 1:
            return float(value.item())
        raise SchemaError(f"{field}: expected a scalar, got an array of shape {tuple(value.shape)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SchemaError(f"{field}: expected a float, got {_type_name(value)} {value!r}")
    return float(value)


def ensure_int(field: str, value: Any, *, optional: bool = False, minimum: int | None = None):
    if value is None and optional:
        return None
    if isinstance(value, torch.Tensor | np.integer):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SchemaError(f"{field}: expected an int, got {_type_name(value)} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise LayoutError(f"{field}: expected an int >= {minimum}, got {value}")
    return value


# ---------------------------------------------------------------------------- flat lists
_FLOAT = pa.float64()


def _check_numbers(field: str, items: Sequence, group: int | None = None) -> None:
    for i, item in enumerate(items):
        if item is None:
            raise LayoutError(f"{field}: expected a float at {_where(group, i)}, got None (null)")
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise SchemaError(
                f"{field}: expected a float at {_where(group, i)}, got {_type_name(item)} {item!r}"
            )


def _numeric_array(field: str, value: Any, kind: pa.DataType, group: int | None = None) -> pa.Array:
    """A null-free Arrow array of ``kind`` from any list-like input."""
    if isinstance(value, ArrowSequence):
        value = value.arrow
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        if value.null_count:
            bad = int(np.flatnonzero(~value.is_valid().to_numpy(zero_copy_only=False))[0])
            raise LayoutError(f"{field}: expected no nulls, got a null at {_where(group, bad)}")
        if not (pa.types.is_integer(value.type) or pa.types.is_floating(value.type)):
            raise SchemaError(f"{field}: expected numbers, got an Arrow array of {value.type}")
        return value if value.type == kind else value.cast(kind)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise LayoutError(f"{field}: expected a 1-D array, got shape {value.shape}")
        if value.dtype.kind not in "iufb":
            _check_numbers(field, value.tolist(), group)
        return _to_arrow(field, value, kind, group)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(f"{field}: expected a list of numbers, got {_type_name(value)}")
    _check_numbers(field, value, group)
    return _to_arrow(field, value, kind, group)


def _to_arrow(field: str, value: Sequence, kind: pa.DataType, group: int | None) -> pa.Array:
    """``pa.array(value, type=kind)``, with an out-of-range value reported by position."""
    try:
        return pa.array(value, type=kind)
    except (pa.ArrowInvalid, OverflowError):
        info = np.iinfo(kind.to_pandas_dtype()) if pa.types.is_integer(kind) else None
        for i, item in enumerate(value):
            if info is not None and not info.min <= item <= info.max:
                raise LayoutError(
                    f"{field}: expected values in [{info.min}, {info.max}] ({kind}), got "
                    f"{item!r} at {_where(group, i)}"
                ) from None
        raise


def ensure_float_list(field: str, value: Any, *, optional: bool = False) -> ArrowSequence | None:
    if value is None and optional:
        return None
    if value is None:
        raise SchemaError(f"{field}: expected a list of floats, got None")
    return ArrowSequence(_numeric_array(field, value, _FLOAT))


def ensure_token_list(field: str, value: Any, *, kind: pa.DataType = pa.int32()) -> ArrowSequence:
    """Token ids (or a 0/1 mask): integers, no nulls, none negative."""
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, numbers.Integral | np.integer):
                raise SchemaError(f"{field}: expected an int at position {i}, got {item!r}")
    array = _numeric_array(field, value, kind)
    if not pa.types.is_integer(array.type):
        raise SchemaError(f"{field}: expected integers, got {array.type}")
    _check_non_negative(field, array)
    return ArrowSequence(array)


def _check_non_negative(field: str, array: pa.Array, offsets: np.ndarray | None = None) -> None:
    values = array.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(values < 0)
    if bad.size:
        i = int(bad[0])
        if offsets is not None:
            row = int(np.searchsorted(offsets, i, side="right") - 1)
            raise LayoutError(
                f"{field}: expected ids >= 0, got {int(values[i])} at row {row}, "
                f"position {i - int(offsets[row])}"
            )
        raise LayoutError(f"{field}: expected ids >= 0, got {int(values[i])} at position {i}")


def ensure_str_list(field: str, value: Any, *, optional: bool = False) -> ArrowSequence | None:
    if value is None and optional:
        return None
    if isinstance(value, ArrowSequence):
        value = value.arrow
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        kind = value.type.value_type if pa.types.is_dictionary(value.type) else value.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SchemaError(f"{field}: expected strings, got an Arrow array of {value.type}")
        if value.null_count:
            bad = int(np.flatnonzero(~value.is_valid().to_numpy(zero_copy_only=False))[0])
            raise LayoutError(f"{field}: expected no nulls, got a null at position {bad}")
        return ArrowSequence(value)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(f"{field}: expected a list of strings, got {_type_name(value)}")
    for i, item in enumerate(value):
        if item is None:
            raise LayoutError(f"{field}: expected a str at position {i}, got None (null)")
        if not isinstance(item, str):
            raise SchemaError(f"{field}: expected a str at position {i}, got {_type_name(item)}")
    return ArrowSequence(pa.array(value, type=pa.string()))


def to_json_text(field: str, item: Any, where: str) -> str:
    """JSON text of one metadata entry; objects with ``to_trl_payload()`` are converted first."""
    payload = getattr(item, "to_trl_payload", None)
    if callable(payload):
        item = payload()
    try:
        return json.dumps(item, allow_nan=True, sort_keys=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"{field}: expected JSON-serialisable metadata at {where}, got {_type_name(item)} "
            f"({exc})"
        ) from None


def ensure_json_list(field: str, value: Any, *, optional: bool = True) -> JsonSequence | None:
    if value is None and optional:
        return None
    if isinstance(value, JsonSequence):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(f"{field}: expected a list, got {_type_name(value)}")
    texts = [to_json_text(field, item, f"position {i}") for i, item in enumerate(value)]
    return JsonSequence(pa.array(texts, type=pa.string()))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < 2**31
        for t in value
    )


def info_record(field: str, item: Any, where: str) -> dict | None:
    """One completion-info dict as a struct row: typed keys as fields, the rest as JSON."""
    if item is None:
        return None
    if not isinstance(item, Mapping):
        raise SchemaError(f"{field}: expected a dict at {where}, got {_type_name(item)}")
    row: dict[str, Any] = {name: None for name in INFO_FIELDS}
    extra: dict[str, Any] = {}
    for key, val in item.items():
        if not isinstance(key, str):
            raise SchemaError(f"{field}: expected str keys at {where}, got {key!r}")
        kind = INFO_FIELDS.get(key)
        if key == "token_ids" and isinstance(val, list | tuple):
            negative = [t for t in val if isinstance(t, numbers.Integral) and t < 0]
            if negative:
                raise LayoutError(
                    f"{field}: expected token ids >= 0 at {where}, got {int(negative[0])} at "
                    f"token {list(val).index(negative[0])}"
                )
        typed = (
            kind is not None
            and val is not None
            and (
                (pa.types.is_string(kind) and isinstance(val, str))
                or (pa.types.is_boolean(kind) and isinstance(val, bool))
                or (
                    pa.types.is_integer(kind)
                    and isinstance(val, numbers.Integral)
                    and not isinstance(val, bool)
                    and -(2**31) <= int(val) < 2**31
                )
                or (pa.types.is_list(kind) and _is_token_ids(val))
            )
        )
        if typed:
            row[key] = val
        else:
            extra[key] = val
    row["extra"] = to_json_text(field, extra, where) if extra else None
    return row


def ensure_info_list(field: str, value: Any, *, optional: bool = True) -> InfoSequence | None:
    if value is None and optional:
        return None
    if isinstance(value, InfoSequence):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(f"{field}: expected a list of dicts, got {_type_name(value)}")
    rows = [info_record(field, item, f"position {i}") for i, item in enumerate(value)]
    return InfoSequence(pa.array(rows, type=INFO_TYPE))


# ---------------------------------------------------------------------------- grouped lists
def _group_lists(field: str, value: Any) -> list[Sequence]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(
            f"{field}: expected a list of lists (one per group), got {_type_name(value)}"
        )
    groups = []
    for g, group in enumerate(value):
        if isinstance(group, ArrowSequence):
            group = group.to_pylist()
        if isinstance(group, np.ndarray | torch.Tensor):
            group = group.tolist()
        if isinstance(group, str | bytes) or not isinstance(group, Sequence):
            raise SchemaError(f"{field}: expected a list at group {g}, got {_type_name(group)}")
        groups.append(group)
    return groups


def _list_array(values: pa.Array, sizes: Sequence[int]) -> pa.Array:
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=offsets[1:])
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


def _existing_list(field: str, value: Any) -> pa.Array | None:
    if isinstance(value, GroupedSequence):
        return value.arrow
    if isinstance(value, Ragged):
        return value.to_arrow()
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        if not (pa.types.is_list(value.type) or pa.types.is_large_list(value.type)):
            raise SchemaError(f"{field}: expected an Arrow list array, got {value.type}")
        if value.null_count:
            bad = int(np.flatnonzero(~value.is_valid().to_numpy(zero_copy_only=False))[0])
            raise LayoutError(f"{field}: expected no null groups, got a null at group {bad}")
        return value
    return None


def ensure_grouped_floats(field: str, value: Any, *, optional: bool = False):
    if value is None and optional:
        return None
    array = _existing_list(field, value)
    if array is not None:
        _check_no_null_items(field, array)
        flat = _numeric_array(f"{field} values", array.flatten(), _FLOAT)
        if flat is not array.flatten() and flat.type != array.type.value_type:
            array = _list_array(flat, np.diff(list_offsets(array)))
        return GroupedSequence(array)
    groups = _group_lists(field, value)
    for g, group in enumerate(groups):
        _check_numbers(field, group, g)
    flat = pa.array([x for group in groups for x in group], type=_FLOAT)
    return GroupedSequence(_list_array(flat, [len(group) for group in groups]))


def _check_no_null_items(field: str, array: pa.Array) -> None:
    """Nulls inside the lists of an Arrow list array, reported by group and sample."""
    flat = array.flatten()
    if flat.null_count:
        i = int(np.flatnonzero(~flat.is_valid().to_numpy(zero_copy_only=False))[0])
        offsets = list_offsets(array)
        g = int(np.searchsorted(offsets, i, side="right") - 1)
        raise LayoutError(
            f"{field}: expected no nulls, got a null at group {g}, sample {i - int(offsets[g])}"
        )


def ensure_grouped_strings(field: str, value: Any) -> GroupedSequence:
    array = _existing_list(field, value)
    if array is not None:
        _check_no_null_items(field, array)
        ensure_str_list(f"{field} values", array.flatten())
        return GroupedSequence(array)
    groups = _group_lists(field, value)
    for g, group in enumerate(groups):
        for k, item in enumerate(group):
            if item is None:
                raise LayoutError(
                    f"{field}: expected a str at group {g}, sample {k}, got None (null)"
                )
            if not isinstance(item, str):
                raise SchemaError(
                    f"{field}: expected a str at group {g}, sample {k}, got {_type_name(item)}"
                )
    flat = pa.array([x for group in groups for x in group], type=pa.string())
    return GroupedSequence(_list_array(flat, [len(group) for group in groups]))


def ensure_grouped_json(field: str, value: Any, *, optional: bool = True):
    if value is None and optional:
        return None
    if isinstance(value, GroupedSequence):
        return value
    groups = _group_lists(field, value)
    texts = [
        to_json_text(field, item, f"group {g}, sample {k}")
        for g, group in enumerate(groups)
        for k, item in enumerate(group)
    ]
    flat = pa.array(texts, type=pa.string())
    return GroupedSequence(_list_array(flat, [len(group) for group in groups]), JsonSequence)


def ensure_grouped_info(field: str, value: Any, *, optional: bool = True):
    if value is None and optional:
        return None
    if isinstance(value, GroupedSequence):
        return value
    groups = _group_lists(field, value)
    rows = [
        info_record(field, item, f"group {g}, sample {k}")
        for g, group in enumerate(groups)
        for k, item in enumerate(group)
    ]
    flat = pa.array(rows, type=INFO_TYPE)
    return GroupedSequence(_list_array(flat, [len(group) for group in groups]), InfoSequence)


def check_same_groups(owner: str, base_name: str, base: GroupedSequence, others: dict) -> None:
    """Every grouped field of one record has the same group sizes as ``base``."""
    sizes = base.group_sizes()
    for name, other in others.items():
        if other is None:
            continue
        other_sizes = other.group_sizes()
        if len(other_sizes) != len(sizes):
            raise LayoutError(
                f"{owner}.{name}: expected {len(sizes)} groups (as {base_name}), "
                f"got {len(other_sizes)}"
            )
        diff = np.flatnonzero(other_sizes != sizes)
        if diff.size:
            g = int(diff[0])
            raise LayoutError(
                f"{owner}.{name}: group {g} has {int(other_sizes[g])} entries, expected "
                f"{int(sizes[g])} (the size of {base_name}[{g}])"
            )


# ---------------------------------------------------------------------------- dict of lists
class ColumnDict(dict):
    """A dict of per-sample float columns; values are normalised to views on assignment.

    The original pipeline adds keys in place (the entropy bonus diagnostics), so this stays a
    mutable dict; each value becomes an :class:`ArrowSequence` of float64.
    """

    def __init__(
        self,
        value: Mapping | Iterable[tuple[str, Any]] | None = None,
        *,
        owner: str = "per_reward_values",
    ):
        # `value` comes first and may be (key, column) pairs, like dict's own constructor:
        # `dataclasses.asdict` and `copy` rebuild a dict subclass as `type(d)(pairs)`.
        super().__init__()
        self._owner = owner
        for key, column in dict(value or {}).items():
            self[key] = column

    def __setitem__(self, key: str, column: Any) -> None:
        if not isinstance(key, str):
            raise SchemaError(f"{self._owner}: expected str keys, got {key!r}")
        super().__setitem__(key, ensure_float_list(f"{self._owner}[{key!r}]", column))

    def update(self, *args, **kwargs) -> None:
        for key, column in dict(*args, **kwargs).items():
            self[key] = column

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


def ensure_column_dict(field: str, value: Any) -> ColumnDict:
    if isinstance(value, ColumnDict):
        return value
    if not isinstance(value, Mapping):
        raise SchemaError(f"{field}: expected a dict of lists, got {_type_name(value)}")
    return ColumnDict(value, owner=field)


def ensure_float_dict(field: str, value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise SchemaError(f"{field}: expected a dict of floats, got {_type_name(value)}")
    return {str(k): ensure_float(f"{field}[{k!r}]", v) for k, v in value.items()}


# ---------------------------------------------------------------------------- tensors
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


def ensure_tensor(
    field: str,
    value: Any,
    *,
    ndim: int | tuple[int, ...],
    kind: str = "float",
    optional: bool = False,
) -> torch.Tensor | None:
    """A tensor of the given rank and dtype family (``"float"``, ``"int"`` or ``"any"``).

    Lists and numpy arrays are converted (float32 for floats, int64 for ints, as the seed's
    producers make them); tensors are kept as they are, gradients included.
    """
    if value is None:
        if optional:
            return None
        raise SchemaError(f"{field}: expected a tensor, got None")
    if not isinstance(value, torch.Tensor):
        if isinstance(value, ArrowSequence):
            value = value.to_torch()
        elif isinstance(value, np.ndarray | list | tuple | numbers.Real):
            try:
                array = np.asarray(value)
            except ValueError as exc:
                raise LayoutError(f"{field}: expected a rectangular array ({exc})") from None
            if array.dtype.kind not in "iufb":
                raise SchemaError(f"{field}: expected numbers, got an array of {array.dtype}")
            target = torch.int64 if kind == "int" else torch.float32
            if kind == "any" and array.dtype.kind in "iub":
                target = torch.int64
            value = torch.as_tensor(array).to(target)
        else:
            raise SchemaError(f"{field}: expected a tensor, got {_type_name(value)}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if value.dim() not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise LayoutError(
            f"{field}: expected a tensor of rank {expected}, got shape {tuple(value.shape)}"
        )
    if kind == "float" and value.dtype not in _FLOAT_DTYPES:
        raise SchemaError(f"{field}: expected a floating tensor, got dtype {value.dtype}")
    if kind == "int" and value.dtype not in _INT_DTYPES:
        raise SchemaError(f"{field}: expected an integer tensor, got dtype {value.dtype}")
    return value


def nan_equal(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))
