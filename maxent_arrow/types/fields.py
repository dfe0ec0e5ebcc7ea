"""Field values between Python and Arrow: encoders that check, decoders that give back.

Encoders take what the seed's callers pass (lists, tuples, numpy arrays, tensors, Arrow arrays)
and return Arrow arrays. ``pa.array(..., type=...)`` (or type inference, where pyarrow would
convert silently: floats into integer columns, bytes into strings) does the checking in C; only
when it fails, or leaves nulls where none are allowed, is the offending position looked for,
to raise a typed error naming the field and the position (group, sample).

Decoders give plain Python back: ``list`` and ``dict`` objects, made in a few bulk calls
(``to_pylist``, one ``json.loads`` per column).

Chat messages (a prompt or completion given as a list of ``{"role", "content", ...}`` dicts)
are stored beside the text column, in ``list<struct<role, content, extra>>`` (other keys, and
non-text content, as a JSON object in ``extra``); completion-info dicts as a struct whose typed
keys are fields and whose other keys ride in ``extra`` the same way.
"""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow.arguments import is_int
from maxent_arrow.arrow import first_null, list_offsets
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError, SchemaError

__all__ = [
    "INFO_FIELDS",
    "INFO_TYPE",
    "Where",
    "arrow_groups",
    "assistant_text",
    "float_array",
    "int_array",
    "str_array",
    "text_arrays",
    "json_array",
    "info_array",
    "grouped",
    "group_flat",
    "decode_texts",
    "decode_messages",
    "decode_json",
    "decode_info",
    "regroup_list",
]

FLOAT = pa.float64()

# Keys of a completion-info dict with their own typed field; other keys (and these holding a
# value of another type, None included) travel in the JSON `extra` field.
INFO_FIELDS: dict[str, pa.DataType] = {
    "finish_reason": pa.string(),
    "stop_reason": pa.string(),
    "truncated": pa.bool_(),
    "token_count": pa.int32(),
    "token_ids": pa.list_(pa.field("item", pa.int32(), nullable=False)),
}
INFO_TYPE = pa.struct(
    [pa.field(name, kind) for name, kind in INFO_FIELDS.items()] + [pa.field("extra", pa.string())]
)
_INFO_SCALARS = pa.struct(
    [pa.field(n, k) for n, k in INFO_FIELDS.items() if n != "token_ids"]
    + [pa.field("extra", pa.string())]
)
_INT32 = (-(2**31), 2**31 - 1)
_INFO_CHECKS = {
    "finish_reason": lambda v: type(v) is str,
    "stop_reason": lambda v: type(v) is str,
    "truncated": lambda v: type(v) is bool,
    "token_count": lambda v: is_int(v) and _INT32[0] <= int(v) <= _INT32[1],
    "token_ids": lambda v: type(v) is list or type(v) is tuple,
}

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError)


def _type_name(value: Any) -> str:
    return type(value).__name__


class Where:
    """Names a flat position: ``position i``, or ``group g, sample k`` given group offsets."""

    __slots__ = ("offsets",)

    def __init__(self, offsets: np.ndarray | None = None):
        self.offsets = offsets

    def __call__(self, i: int) -> str:
        if self.offsets is None:
            return f"position {i}"
        g = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return f"group {g}, sample {i - int(self.offsets[g])}"


_FLAT = Where()


# ---------------------------------------------------------------------------- plain inputs
def _plain(field: str, value: Any, what: str) -> Any:
    """A list-like Python value, or an Arrow/numpy array (tensors become numpy)."""
    if isinstance(value, pa.ChunkedArray):
        return value.combine_chunks()
    if isinstance(value, pa.Array | np.ndarray | list | tuple):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a tensor (torch not imported)
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    if value is None:
        raise LayoutError(f"{field}: expected {what}, got None")
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaError(f"{field}: expected {what}, got {_type_name(value)}")
    return list(value)


def _arrow_nulls(field: str, array: pa.Array, where: Where) -> None:
    if array.null_count:
        raise LayoutError(f"{field}: expected no nulls, got a null at {where(first_null(array))}")


# ---------------------------------------------------------------------------- flat numbers
def float_array(field: str, value: Any, *, where: Where = _FLAT) -> pa.Array:
    """Null-free float64 values."""
    value = _plain(field, value, "a list of floats")
    if isinstance(value, pa.Array):
        if not (pa.types.is_floating(value.type) or pa.types.is_integer(value.type)):
            raise SchemaError(f"{field}: expected numbers, got an Arrow array of {value.type}")
        _arrow_nulls(field, value, where)
        return value.cast(FLOAT)
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise LayoutError(f"{field}: expected a 1-D array, got shape {value.shape}")
    try:
        array = pa.array(value, type=FLOAT)
    except _ARROW_ERRORS as exc:
        raise _locate_number(field, value, where, "a float", exc) from None
    if array.null_count:
        i = first_null(array)
        raise LayoutError(f"{field}: expected a float at {where(i)}, got None (null)")
    return array


def _locate_number(field: str, value: Any, where: Where, what: str, exc: Exception) -> Exception:
    for i, item in enumerate(value):
        if item is None:
            continue
        if not isinstance(item, numbers.Real):
            return SchemaError(
                f"{field}: expected {what} at {where(i)}, got {_type_name(item)} {item!r}"
            )
        if isinstance(item, numbers.Integral) and abs(int(item)) > 2**53:
            return SchemaError(
                f"{field}: expected {what} at {where(i)}, got {item!r} (beyond the integers a "
                "float64 holds exactly)"
            )
    return SchemaError(f"{field}: expected {what}s ({exc})")


def int_array(
    field: str, value: Any, kind: pa.DataType = pa.int32(), *, where: Where = _FLAT
) -> pa.Array:
    """Null-free integers of ``kind`` (negative values such as ``-100`` are kept)."""
    value = _plain(field, value, "a list of ints")
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise LayoutError(f"{field}: expected a 1-D array, got shape {value.shape}")
    array: pa.Array | None
    if isinstance(value, pa.Array):
        array = value
    else:
        try:
            # Inferred, not typed: a typed conversion would truncate 1.5 to 1 without a word.
            array = pa.array(value)
        except _ARROW_ERRORS:
            array = None
    if array is None or not (pa.types.is_integer(array.type) or pa.types.is_null(array.type)):
        if isinstance(value, pa.Array):
            # pyarrow is untyped to a checker, so `isinstance` does not narrow `value` to it.
            got = value.type  # pyright: ignore[reportAttributeAccessIssue]
            raise SchemaError(f"{field}: expected integers, got an Arrow array of {got}")
        for i, item in enumerate(value):
            if item is not None and not is_int(item):
                raise SchemaError(f"{field}: expected an int at {where(i)}, got {item!r}")
        raise SchemaError(f"{field}: expected ints, got {array.type if array else 'other'}")
    if array.null_count:
        i = first_null(array)
        raise LayoutError(f"{field}: expected an int at {where(i)}, got None (null)")
    try:
        return array.cast(kind)  # a safe cast: out-of-range values raise
    except pa.ArrowInvalid:
        info = np.iinfo(kind.to_pandas_dtype())
        values = np.asarray(array.to_numpy(zero_copy_only=False))
        i = int(np.flatnonzero((values < info.min) | (values > info.max))[0])
        raise LayoutError(
            f"{field}: expected values in [{info.min}, {info.max}] ({kind}), got "
            f"{int(values[i])} at {where(i)}"
        ) from None


# ---------------------------------------------------------------------------- strings
def str_array(field: str, value: Any, *, nullable: bool = False, where: Where = _FLAT) -> pa.Array:
    """Strings (``None`` as null where ``nullable``)."""
    value = _plain(field, value, "a list of strings")
    if isinstance(value, pa.Array):
        kind = value.type.value_type if pa.types.is_dictionary(value.type) else value.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SchemaError(f"{field}: expected strings, got an Arrow array of {value.type}")
        array = value
    else:
        try:
            array = pa.array(value)  # inferred: bytes would pass a typed string conversion
        except _ARROW_ERRORS:
            array = None
        if array is not None and pa.types.is_null(array.type):
            array = pa.nulls(len(array), pa.string())
        if array is None or not pa.types.is_string(array.type):
            raise _locate_str(field, value, where)
    if array.null_count and not nullable:
        i = first_null(array)
        raise LayoutError(f"{field}: expected a str at {where(i)}, got None (null)")
    return array


def _locate_str(field: str, value: Sequence, where: Where) -> Exception:
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, str):
            return SchemaError(f"{field}: expected a str at {where(i)}, got {_type_name(item)}")
    return SchemaError(f"{field}: expected strings")


# ---------------------------------------------------------------------------- chat messages
def _is_messages(item: Any) -> bool:
    return isinstance(item, list | tuple) and all(isinstance(m, Mapping) for m in item)


def _message_rows(field: str, messages: Sequence, where: str) -> list[dict]:
    rows = []
    for j, message in enumerate(messages):
        row: dict[str, Any] = {"role": None, "content": None, "extra": None}
        extra = {}
        for key, val in message.items():
            if (key == "role" or key == "content") and type(val) is str:
                row[key] = val
            else:
                extra[key] = val
        if extra:
            row["extra"] = _json_text(field, extra, f"{where}, message {j}")
        rows.append(row)
    return rows


def assistant_text(messages: Sequence[Mapping]) -> str:
    """The text of a message-list completion for the ``completions`` column: the string
    contents of its assistant messages, joined by newlines (``""`` when there are none)."""
    return "\n".join(
        m["content"]
        for m in messages
        if m.get("role") == "assistant" and isinstance(m.get("content"), str)
    )


def text_arrays(
    field: str, value: Any, *, text_of_messages: bool, where: Where = _FLAT
) -> tuple[pa.Array, pa.Array | None]:
    """Strings or chat-message lists: ``(text, messages)`` columns.

    ``messages`` is ``None`` when every item is a string; otherwise it is null where the item
    is a string and ``text`` is null where it is a message list (or, with
    ``text_of_messages``, holds :func:`assistant_text` there).
    """
    value = _plain(field, value, "a list of strings")
    if isinstance(value, pa.Array):
        return str_array(field, value, where=where), None
    try:
        array = pa.array(value)
    except _ARROW_ERRORS:
        array = None
    if array is not None and pa.types.is_string(array.type) and not array.null_count:
        return array, None
    if array is not None and pa.types.is_null(array.type) and not len(array):
        return pa.array([], pa.string()), None
    texts: list[str | None] = []
    messages: list[list[dict] | None] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            texts.append(item)
            messages.append(None)
        elif _is_messages(item):
            texts.append(assistant_text(item) if text_of_messages else None)
            messages.append(_message_rows(field, item, where(i)))
        elif item is None:
            raise LayoutError(f"{field}: expected a str at {where(i)}, got None (null)")
        else:  # (or a list of message dicts)
            raise SchemaError(f"{field}: expected a str at {where(i)}, got {_type_name(item)}")
    return pa.array(texts, pa.string()), pa.array(messages, S.MESSAGES_TYPE)


def decode_messages(rows: list[dict]) -> list[dict]:
    """One chat-message list back from its ``list<struct<role, content, extra>>`` rows."""
    out = []
    for row in rows:
        message = {k: row[k] for k in ("role", "content") if row[k] is not None}
        if row["extra"]:
            message.update(json.loads(row["extra"]))
        out.append(message)
    return out


def decode_texts(text: pa.Array, messages: pa.Array | None) -> list:
    """The items :func:`text_arrays` encoded: strings, and message lists where stored."""
    values = text.to_pylist()
    if messages is None or messages.null_count == len(messages):
        return values
    for i, rows in enumerate(messages.to_pylist()):
        if rows is not None:
            values[i] = decode_messages(rows)
    return values


# ---------------------------------------------------------------------------- JSON metadata
def _payload(item: Any) -> Any:
    """The seed's ``VLLMLogprobResult`` (and anything else with ``to_trl_payload()``)."""
    payload = getattr(item, "to_trl_payload", None)
    if callable(payload):
        return payload()
    raise TypeError(f"Object of type {_type_name(item)} is not JSON serializable")


_ENCODER = json.JSONEncoder(allow_nan=True, default=_payload)
_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)


def _json_text(field: str, item: Any, where: str) -> str:
    try:
        return _ENCODER.encode(item)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"{field}: expected JSON-serialisable metadata at {where}, got {_type_name(item)} "
            f"({exc})"
        ) from None


_encode_many: Callable[[Sequence], list[str]] | None = None
if _C_ENCODER is not None:
    # One C encoder made once: `JSONEncoder.encode` builds a new one per call, most of its
    # cost on small dicts (there is one per completion). It skips the circular-reference
    # check (a cycle ends in RecursionError), so any failure is redone by `_json_text`.
    _make = _C_ENCODER(
        None, _payload, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False,
        True,
    )  # fmt: skip

    def _encode_many_c(items: Sequence) -> list[str]:
        return ["".join(_make(item, 0)) for item in items]

    _encode_many = _encode_many_c


def json_array(field: str, value: Any, *, where: Where = _FLAT) -> pa.Array:
    """One JSON text per item (``None`` is the text ``null``)."""
    value = _plain(field, value, "a list")
    if isinstance(value, pa.Array):
        return str_array(field, value, nullable=True, where=where)
    texts = None
    if _encode_many is not None:
        try:
            texts = _encode_many(value)
        except (TypeError, ValueError, RecursionError):
            texts = None  # redone item by item, to name the one that fails
    if texts is None:
        texts = [_json_text(field, item, where(i)) for i, item in enumerate(value)]
    return pa.array(texts, pa.string())


def decode_json(texts: pa.Array) -> list:
    """The JSON texts of ``texts`` as Python values, in one ``json.loads`` call."""
    if not len(texts):
        return []
    items = texts.to_pylist()
    if texts.null_count:
        items = ["null" if t is None else t for t in items]
    return json.loads("[" + ",".join(items) + "]")


# ---------------------------------------------------------------------------- completion info
def info_array(field: str, value: Any, *, where: Where = _FLAT) -> pa.Array:
    """Completion-info dicts (or ``None``) as a struct array of :data:`INFO_TYPE`."""
    value = _plain(field, value, "a list of dicts")
    if isinstance(value, pa.Array):
        if not pa.types.is_struct(value.type):
            raise SchemaError(f"{field}: expected structs, got an Arrow array of {value.type}")
        return value
    rows: list[Any] = []
    ids: list[Any] = []
    for i, item in enumerate(value):
        if item is None:
            rows.append(None)
            ids.append(None)
            continue
        if not isinstance(item, Mapping):
            raise SchemaError(f"{field}: expected a dict at {where(i)}, got {_type_name(item)}")
        clean = True
        for key, val in item.items():
            check = _INFO_CHECKS.get(key)
            if check is None or not check(val):
                clean = False
                break
        if clean:
            rows.append(item)  # extra keys are ignored by pa.array: there are none here
            ids.append(item.get("token_ids"))
        else:
            row, token_ids = _split_info(field, item, where(i))
            rows.append(row)
            ids.append(token_ids)
    scalars = pa.array(rows, type=_INFO_SCALARS)
    token_ids = _token_id_lists(ids)
    if token_ids is None:  # some token_ids are not int32 lists: they move to `extra`
        for i, item in enumerate(value):
            if ids[i] is not None and not _is_int32_list(ids[i]):
                rows[i], _ = _split_info(field, item, where(i), ids_typed=False)
                ids[i] = None
        scalars = pa.array(rows, type=_INFO_SCALARS)
        token_ids = pa.array(ids, INFO_FIELDS["token_ids"])
    arrays = [scalars.field(i) for i in range(scalars.type.num_fields)]
    arrays.insert(len(INFO_FIELDS) - 1, token_ids)
    mask = scalars.is_null() if scalars.null_count else None
    return pa.StructArray.from_arrays(arrays, fields=list(INFO_TYPE), mask=mask)


def _split_info(field: str, item: Mapping, where: str, *, ids_typed: bool = True):
    row: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    token_ids = None
    for key, val in item.items():
        if not isinstance(key, str):
            raise SchemaError(f"{field}: expected str keys at {where}, got {key!r}")
        check = _INFO_CHECKS.get(key)
        if check is not None and check(val) and (ids_typed or key != "token_ids"):
            if key == "token_ids":
                token_ids = val
            else:
                row[key] = val
        else:
            extra[key] = val
    row["extra"] = _json_text(field, extra, where) if extra else None
    return row, token_ids


def _is_int32_list(value: Any) -> bool:
    return all(
        # typeshed's numbers.Integral declares no `>=` (the reflection of `int <= t`).
        is_int(t) and _INT32[0] <= t <= _INT32[1]  # pyright: ignore[reportOperatorIssue]
        for t in value
    )


def _token_id_lists(ids: list) -> pa.Array | None:
    """``token_ids`` as ``list<int32>``; ``None`` if some are not int32 lists (then those go
    to ``extra``, where JSON keeps them exactly)."""
    if all(i is None for i in ids):
        return pa.nulls(len(ids), INFO_FIELDS["token_ids"])
    try:
        inferred = pa.array(ids)  # inferred: a typed conversion would truncate floats
    except _ARROW_ERRORS:
        return None
    child = inferred.type.value_type if pa.types.is_list(inferred.type) else None
    if child is None or not (pa.types.is_integer(child) or pa.types.is_null(child)):
        return None
    if inferred.flatten().null_count:
        return None
    try:
        return inferred.cast(INFO_FIELDS["token_ids"])
    except pa.ArrowInvalid:
        return None


def decode_info(structs: pa.Array) -> list:
    """Completion-info dicts back: typed fields that hold a value, then the ``extra`` keys.

    Column by column: each field converted once, the ``extra`` JSON of all rows parsed in one
    call, and each dict built with only its keys (no dict built and then pruned).
    """
    n = len(structs)
    if n == 0:
        return []
    children = dict(zip((f.name for f in structs.type), structs.flatten()))
    extra = children.pop("extra", None)
    # Fields null everywhere are left out at once; only partly null ones are tested per row.
    kept = {name: a for name, a in children.items() if a.null_count < n}
    full = [(name, a.to_pylist()) for name, a in kept.items() if not a.null_count]
    partly = [(name, a.to_pylist()) for name, a in kept.items() if a.null_count]
    extras: dict[int, dict] = {}
    if extra is not None and extra.null_count < n:
        texts = extra.to_pylist()
        at = [i for i, text in enumerate(texts) if text]
        if at:
            parsed = json.loads("[" + ",".join(texts[i] for i in at) + "]")
            extras = dict(zip(at, parsed))
    valid = structs.is_valid().to_pylist() if structs.null_count else None
    names = [name for name, _ in full]
    out: list = []
    for i, values in enumerate(zip(*(v for _, v in full)) if full else ([()] * n)):
        if valid is not None and not valid[i]:
            out.append(None)
            continue
        row = dict(zip(names, values))
        for name, column in partly:
            if column[i] is not None:
                row[name] = column[i]
        if i in extras:
            row.update(extras[i])
        out.append(row)
    return out


# ---------------------------------------------------------------------------- grouped values
def group_flat(field: str, value: Any, what: str = "a list") -> tuple[list, np.ndarray]:
    """A list of groups as (flat items, int64 group offsets)."""
    value = _plain(field, value, "a list of lists (one per group)")
    if isinstance(value, np.ndarray):
        value = list(value)
    sizes = np.empty(len(value), dtype=np.int64)
    groups = []
    for g, group in enumerate(value):
        if isinstance(group, list | tuple | np.ndarray):
            pass
        elif hasattr(group, "detach") and hasattr(group, "tolist"):
            group = group.detach().cpu().tolist()
        else:
            raise SchemaError(f"{field}: expected {what} at group {g}, got {_type_name(group)}")
        sizes[g] = len(group)
        groups.append(group)
    offsets = np.zeros(len(value) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return list(itertools.chain.from_iterable(groups)), offsets


def grouped(flat: pa.Array, offsets: np.ndarray) -> pa.Array:
    """A list array over ``flat`` (not copied) with the given int64 offsets."""
    if len(offsets) and offsets[-1] >= 2**31:
        return pa.LargeListArray.from_arrays(pa.array(offsets), flat)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)


def arrow_groups(field: str, value: pa.Array, check_items: bool = True) -> pa.Array:
    """An Arrow list array given as a grouped field: no null groups, no null items."""
    if not (pa.types.is_list(value.type) or pa.types.is_large_list(value.type)):
        raise SchemaError(f"{field}: expected an Arrow list array, got {value.type}")
    if value.null_count:
        raise LayoutError(
            f"{field}: expected no null groups, got a null at group {first_null(value)}"
        )
    if check_items:
        _arrow_nulls(field, value.flatten(), Where(list_offsets(value)))
    return value


def regroup_list(flat: list, offsets: np.ndarray) -> list[list]:
    """``flat`` cut at ``offsets`` into a list of lists."""
    bounds = offsets.tolist()
    return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
