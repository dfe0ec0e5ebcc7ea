"""Arrow encoding helpers shared by the seed classes' ``to_arrow`` / ``from_arrow``.

Conventions:

- per-row data become columns; a record's scalars travel as JSON in the schema metadata under
  the key ``maxent_arrow`` (``{"class": ..., "schema_version": ..., "scalars": {...}}``), which
  survives Parquet and IPC round trips;
- ``[N]`` tensors become primitive columns of the same dtype (bfloat16 widens to float32 and is
  narrowed back), and come back as zero-copy tensors (DLPack);
- ``[N, L]`` per-token tensors are stored ragged: each row keeps the entries its mask marks
  (ones then zeros), and comes back padded to the original width with the mask rebuilt from the
  lengths. Entries outside the mask are not stored and come back as the pad value.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import Ragged, arrow_to_torch, torch_to_arrow
from maxent_arrow.errors import LayoutError, SchemaError

META_KEY = b"maxent_arrow"
RECORD_VERSION = 1

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(field: str, name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemaError(f"{field}: unknown tensor dtype {name!r} in metadata") from None


# ---------------------------------------------------------------------------- record batches
def make_batch(
    cls_name: str, columns: dict[str, pa.Array], scalars: dict, rows: int
) -> pa.RecordBatch:
    """A record batch of ``columns`` (``None`` entries left out), the scalars as metadata."""
    names = [k for k, v in columns.items() if v is not None]
    arrays = [columns[k] for k in names]
    meta = {"class": cls_name, "schema_version": RECORD_VERSION, "scalars": scalars}
    schema = pa.schema(
        [pa.field(n, a.type) for n, a in zip(names, arrays)],
        metadata={META_KEY: json.dumps(meta, allow_nan=True).encode()},
    )
    if not arrays:
        return pa.RecordBatch.from_pylist([{} for _ in range(rows)], schema=schema)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "AEIOU" else f"a {name}"


class RecordReader:
    """Checked access to the columns and scalars of a batch given to ``from_arrow``."""

    def __init__(self, cls_name: str, data: pa.RecordBatch | pa.Table):
        if not isinstance(data, pa.RecordBatch | pa.Table):
            raise SchemaError(
                f"{cls_name}.from_arrow: expected a pyarrow RecordBatch or Table, got "
                f"{type(data).__name__}"
            )
        self.owner = f"{cls_name}.from_arrow"
        self.data = data
        raw = (data.schema.metadata or {}).get(META_KEY)
        meta = json.loads(raw) if raw else {}
        found = meta.get("class")
        if found is not None and found != cls_name:
            raise SchemaError(f"{self.owner}: the batch holds {_a(found)}, not {_a(cls_name)}")
        self.scalars: dict[str, Any] = meta.get("scalars", {})

    @property
    def num_rows(self) -> int:
        return self.data.num_rows

    def has(self, name: str) -> bool:
        return name in self.data.schema.names

    def column(self, name: str, check=None, expected: str = "", *, optional: bool = False):
        """The column as one Arrow array (chunks combined), type-checked by ``check``."""
        if name not in self.data.schema.names:
            if optional:
                return None
            raise SchemaError(f"{self.owner}: missing column {name!r}")
        array = self.data.column(name)
        if isinstance(array, pa.ChunkedArray):
            array = array.chunk(0) if array.num_chunks == 1 else array.combine_chunks()
        if check is not None and not check(array.type):
            raise SchemaError(
                f"{self.owner}: column {name!r} expected {expected}, got {array.type}"
            )
        return array

    def scalar(self, name: str, default: Any = None) -> Any:
        return self.scalars.get(name, default)


def is_list_of(check):
    def test(kind: pa.DataType) -> bool:
        return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and check(kind.value_type)

    return test


def is_float(kind: pa.DataType) -> bool:
    return pa.types.is_floating(kind)


def is_int(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind)


def is_number(kind: pa.DataType) -> bool:
    return pa.types.is_floating(kind) or pa.types.is_integer(kind)


def is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def is_struct(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind)


def grouped(flat: pa.Array, offsets: np.ndarray) -> pa.Array:
    """A list array over ``flat`` with the given int64 offsets (no copy of ``flat``)."""
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)
    return pa.LargeListArray.from_arrays(pa.array(offsets), flat)


# ---------------------------------------------------------------------------- tensors
def tensor_column(tensor: torch.Tensor | None) -> pa.Array | None:
    """A ``[N]`` tensor as a primitive column (``.detach().cpu()``; zero-copy on CPU)."""
    if tensor is None:
        return None
    return torch_to_arrow(tensor)


def matrix_column(tensor: torch.Tensor | None) -> pa.Array | None:
    """A ``[N, H]`` tensor as a ``fixed_size_list<H>`` column."""
    if tensor is None:
        return None
    flat = torch_to_arrow(tensor.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(tensor.shape[1]))


def column_tensor(reader: RecordReader, name: str, dtype: str | None, *, optional=False):
    """A primitive column back as a zero-copy tensor, narrowed to ``dtype`` when it was widened."""
    array = reader.column(name, is_number, "a numeric column", optional=optional)
    if array is None:
        return None
    tensor = arrow_to_torch(array, field=f"{reader.owner}: column {name!r}")
    if dtype is not None and dtype_name(tensor.dtype) != dtype:
        tensor = tensor.to(dtype_from_name(reader.owner, dtype))
    return tensor


def column_matrix(reader: RecordReader, name: str, dtype: str | None, *, optional=False):
    array = reader.column(
        name, pa.types.is_fixed_size_list, "fixed_size_list<float>", optional=optional
    )
    if array is None:
        return None
    width = array.type.list_size
    flat = arrow_to_torch(array.flatten(), field=f"{reader.owner}: column {name!r}")
    if dtype is not None and dtype_name(flat.dtype) != dtype:
        flat = flat.to(dtype_from_name(reader.owner, dtype))
    return flat.reshape(len(array), width)


def prefix_lengths(field: str, mask: torch.Tensor) -> torch.Tensor:
    """Row lengths of a mask that is ones then zeros in every row; anything else is refused."""
    valid = mask.detach().cpu() != 0
    lengths = valid.sum(dim=1)
    width = valid.shape[1]
    expected = torch.arange(width) < lengths[:, None]
    bad = (valid != expected).any(dim=1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise LayoutError(
            f"{field}: row {row} is not a prefix mask (a 0 before a 1); per-token data are "
            "stored ragged, which needs ones then zeros in every row"
        )
    return lengths


def padded_to_list(field: str, tensor: torch.Tensor, lengths: torch.Tensor) -> pa.Array:
    """Keep the first ``lengths[i]`` entries of each row: a ragged ``list`` column."""
    data = tensor.detach().cpu()
    if data.dim() != 2 or data.shape[0] != lengths.shape[0]:
        raise LayoutError(
            f"{field}: expected shape [{lengths.shape[0]}, L], got {tuple(data.shape)}"
        )
    keep = torch.arange(data.shape[1]) < lengths[:, None]
    ragged = Ragged.from_lengths(data[keep], lengths)
    return ragged.to_arrow()


def list_to_padded(
    reader: RecordReader,
    name: str,
    width: int,
    dtype: str | None,
    pad: float | int,
    *,
    optional=False,
):
    """A ragged column back as ``(padded [N, width], lengths)``."""
    array = reader.column(name, is_list_of(is_number), "list<number>", optional=optional)
    if array is None:
        return None, None
    ragged = Ragged.from_arrow(array)
    out_dtype = dtype_from_name(reader.owner, dtype) if dtype else None
    padded, _ = ragged.to_padded(pad, max_len=width, dtype=out_dtype)
    return padded, ragged.lengths()


def mask_from_lengths(lengths: torch.Tensor, width: int, dtype: str) -> torch.Tensor:
    mask = torch.arange(width) < lengths[:, None]
    return mask.to(dtype_from_name("mask", dtype))


def tensor_equal(a: Any, b: Any) -> bool:
    """Tensor-aware equality (same dtype, shape and values; NaN equals NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        # Bucket dicts (BatchDiagnostics) may hold NaN; dict == compares floats with ==.
        return a.keys() == b.keys() and all(tensor_equal(a[k], b[k]) for k in a)
    return bool(a == b)
