"""Arrow list arrays without torch: offsets rebased to 0, one chunk, a list over flat values;
and arrays built from their buffers.

The traps these exist for (``docs/arrow-layout.md``, "Traps"): ``ListArray.values`` ignores a
slice's offset (use ``.flatten()``), and a slice's offsets are not rebased to 0. And
``pa.array``/``pa.scalar`` of Python or numpy values import pandas (about 0.4 s), as does a
compute function given a Python value: the read side of the command line builds its arrays
and scalars here instead.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = [
    "first_null",
    "float_values",
    "int64_array",
    "int64_scalar",
    "list_offsets",
    "regroup",
    "single_array",
    "text_array",
    "text_scalar",
    "text_values",
]


def list_offsets(array: pa.Array) -> np.ndarray:
    """The int64 offsets of a ``list`` / ``large_list`` array, rebased to 0 (a slice's offsets
    start where the slice does)."""
    offsets = array.offsets  # the slice's, unrebased; read from its buffer (no pandas)
    kind = np.int64 if offsets.type == pa.int64() else np.int32
    n, at = len(offsets), offsets.offset
    raw = np.frombuffer(offsets.buffers()[1], kind, count=at + n)[at:].astype(np.int64)
    return raw - raw[0]


def single_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``column`` as one array: a one-chunk column's chunk (no copy), else the chunks
    concatenated (one copy)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return column.chunk(0)
        if column.num_chunks == 0:
            return pa.array([], type=column.type)
        return pa.concat_arrays(column.chunks)
    return column


def regroup(flat: pa.Array | pa.ChunkedArray, offsets: np.ndarray) -> pa.Array:
    """A ``list`` array over ``flat`` with the given offsets (``flat`` is not copied)."""
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), single_array(flat))


def first_null(array: pa.Array) -> int:
    """The position of the first null in ``array`` (which has at least one)."""
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False))
    return int(np.flatnonzero(~valid)[0])


_NUMPY = {
    pa.float64(): np.float64, pa.float32(): np.float32, pa.int64(): np.int64,
    pa.int32(): np.int32, pa.int16(): np.int16, pa.int8(): np.int8,
}  # fmt: skip


def float_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric or boolean Arrow array as float64 numpy (nulls as NaN), from its buffers:
    ``Array.to_numpy`` imports pandas, which no command of the read side loads."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    n, offset = len(array), array.offset
    if n == 0:
        return np.zeros(0)
    buffers = array.buffers()
    if pa.types.is_boolean(array.type):
        bits = np.unpackbits(np.frombuffer(buffers[1], np.uint8), bitorder="little")
        values = bits[offset : offset + n].astype(np.float64)
    elif array.type in _NUMPY:
        kind = _NUMPY[array.type]
        values = np.frombuffer(buffers[1], kind, count=offset + n)[offset:].astype(np.float64)
    else:
        raise TypeError(f"float_values: {array.type} is not a number column")
    if array.null_count and buffers[0] is not None:
        valid = np.unpackbits(np.frombuffer(buffers[0], np.uint8), bitorder="little")
        values[~valid[offset : offset + n].astype(bool)] = np.nan
    return values


def int64_array(values: object) -> pa.Array:
    """``values`` (ints, a numpy array) as an int64 array, from its buffer: no pandas."""
    data = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(data), [None, pa.py_buffer(data)])


def int64_scalar(value: int) -> pa.Scalar:
    """``value`` as an int64 scalar, for a compute function: no pandas."""
    return int64_array([value])[0]


def text_array(value: str, n: int) -> pa.Array:
    """``value`` ``n`` times as a string array, from its buffers: no pandas."""
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data * n)]
    )


def text_values(values: list[str]) -> pa.Array:
    """``values`` as a string array, from its buffers: no pandas."""
    data = [v.encode() for v in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(),
        len(data),
        [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(data))],
    )


def text_scalar(value: str) -> pa.Scalar:
    """``value`` as a string scalar, for a compute function: no pandas."""
    return text_array(value, 1)[0]
