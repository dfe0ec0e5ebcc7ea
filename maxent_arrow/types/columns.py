"""Record batches of the seed classes, and their tensor fields in Arrow.

Conventions:

- per-row data become columns; a record's scalars travel as JSON in the schema metadata under
  the key ``maxent_arrow`` (``{"class": ..., "schema_version": ..., "scalars": {...}}``), which
  survives Parquet and IPC round trips;
- a tensor field (the seed's ``Any`` fields) keeps its kind: a tensor comes back as a tensor of
  its dtype, a numpy array as a numpy array, a Python list as a list, a number as a number;
- ``[N]`` values become primitive columns of the same dtype (bfloat16 widens to float32 and is
  narrowed back), and come back as zero-copy tensors (DLPack);
- ``[N, L]`` per-token tensors are stored ragged: each row keeps the entries its mask marks
  (ones then zeros), and comes back padded to the original width with the mask rebuilt from the
  lengths.
"""

from __future__ import annotations

import json
import numbers
from typing import Any, Literal, overload

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import Ragged, arrow_to_torch, single_array, torch_to_arrow
from maxent_arrow.arrow import prefix_lengths as ragged_prefix_lengths
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
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(field: str, name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemaError(f"{field}: unknown tensor dtype {name!r} in metadata") from None


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "AEIOU" else f"a {name}"


# ---------------------------------------------------------------------------- record batches
def make_batch(
    cls_name: str, columns: dict[str, pa.Array | None], scalars: dict, rows: int
) -> pa.RecordBatch:
    """A record batch of ``columns`` (``None`` entries left out), the scalars as metadata."""
    names = [k for k, v in columns.items() if v is not None]
    arrays = [a for a in columns.values() if a is not None]
    meta = {"class": cls_name, "schema_version": RECORD_VERSION, "scalars": scalars}
    try:
        text = json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"{cls_name}: a scalar field is not a plain number ({exc})") from None
    schema = pa.schema(
        [pa.field(n, a.type) for n, a in zip(names, arrays)], metadata={META_KEY: text.encode()}
    )
    if not arrays:
        return pa.RecordBatch.from_pylist([{} for _ in range(rows)], schema=schema)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def read_batch(cls_name: str, data: Any) -> tuple[pa.RecordBatch, dict[str, Any]]:
    """One record batch (a table's chunks combined) and its scalars, checked for the class."""
    owner = f"{cls_name}.from_arrow"
    if isinstance(data, pa.Table):
        # One chunk per column is viewed as it is (zero-copy); several are concatenated.
        data = pa.RecordBatch.from_arrays(
            [single_array(c) for c in data.columns], schema=data.schema
        )
    if not isinstance(data, pa.RecordBatch):
        raise SchemaError(
            f"{owner}: expected a pyarrow RecordBatch or Table, got {type(data).__name__}"
        )
    raw = (data.schema.metadata or {}).get(META_KEY)
    meta = json.loads(raw) if raw else {}
    found = meta.get("class")
    if found is not None and found != cls_name:
        raise SchemaError(f"{owner}: the batch holds {_a(found)}, not {_a(cls_name)}")
    return data, meta.get("scalars", {})


def record_scalars(batch: pa.RecordBatch | pa.Table) -> dict[str, Any]:
    """The scalars a record's ``to_arrow()`` keeps in the schema metadata (tensor dtypes and
    kinds, widths, scalar fields), as a dict."""
    raw = (batch.schema.metadata or {}).get(META_KEY)
    return json.loads(raw).get("scalars", {}) if raw else {}


def require(
    cls_name: str,
    batch: pa.RecordBatch,
    name: str,
    check=None,
    expected: str = "",
    *,
    optional: bool = False,
) -> pa.Array | None:
    """Column ``name`` of a batch given to ``from_arrow``, type-checked by ``check``."""
    index = batch.schema.get_field_index(name)
    if index < 0:
        if optional:
            return None
        raise SchemaError(f"{cls_name}.from_arrow: missing column {name!r}")
    array = batch.column(index)
    if check is not None and not check(array.type):
        raise SchemaError(
            f"{cls_name}.from_arrow: column {name!r} expected {expected}, got {array.type}"
        )
    return array


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


def plain_text(array: pa.Array) -> pa.Array:
    """A string column without its dictionary encoding (the ``pairs`` prompts have one)."""
    if pa.types.is_dictionary(array.type):
        return array.cast(array.type.value_type)
    return array


# ---------------------------------------------------------------------------- scalars
def scalar(field: str, value: Any, *, optional: bool = False, kind: str = "float") -> Any:
    """A scalar field as a plain number for the metadata (0-d tensors and numpy scalars
    included); ``None`` only where ``optional``."""
    if value is None:
        if optional:
            return None
        raise SchemaError(f"{field}: expected {_a(kind)}, got None")
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        size = value.numel() if isinstance(value, torch.Tensor) else np.size(value)
        if size != 1:
            raise SchemaError(
                f"{field}: expected a scalar, got an array of shape {tuple(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SchemaError(f"{field}: expected {_a(kind)}, got {type(value).__name__} {value!r}")
    if kind == "int":
        if not isinstance(value, numbers.Integral):
            raise SchemaError(f"{field}: expected an int, got {type(value).__name__} {value!r}")
        return int(value)
    return float(value)


# ---------------------------------------------------------------------------- tensor fields
@overload
def as_tensor(
    field: str, value: Any, *, ndim: int, kind: str, optional: Literal[False] = False
) -> tuple[torch.Tensor, dict]: ...
@overload
def as_tensor(
    field: str, value: Any, *, ndim: int, kind: str, optional: bool
) -> tuple[torch.Tensor, dict] | tuple[None, None]: ...
def as_tensor(
    field: str, value: Any, *, ndim: int, kind: str, optional: bool = False
) -> tuple[torch.Tensor, dict] | tuple[None, None]:
    """A tensor field's value as ``(tensor, how)`` for storage, ``how`` its kind and dtype.

    Tensors are used as they are (detached on the CPU); numpy arrays, lists and numbers are
    viewed or converted. ``kind`` is the dtype family: ``"float"``, ``"int"`` or ``"any"``.
    """
    if value is None:
        if optional:
            return None, None
        raise SchemaError(f"{field}: expected a tensor, got None")
    given = "tensor"
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray | list | tuple | numbers.Real) and not isinstance(
        value, bool
    ):
        given = "numpy" if isinstance(value, np.ndarray) else "number"
        if isinstance(value, list | tuple):
            given = "list"
        try:
            array = np.asarray(value)
        except ValueError as exc:
            raise LayoutError(f"{field}: expected a rectangular array ({exc})") from None
        if array.dtype.kind not in "iufb":
            raise SchemaError(f"{field}: expected numbers, got an array of {array.dtype}")
        if given != "numpy" and kind == "float" and array.dtype.kind in "iub":
            array = array.astype(np.float64)  # ints given where floats belong: same values
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    else:
        raise SchemaError(f"{field}: expected a tensor, got {type(value).__name__}")
    if tensor.dim() != ndim:
        raise LayoutError(
            f"{field}: expected a tensor of rank {ndim}, got shape {tuple(tensor.shape)}"
        )
    if kind == "float" and tensor.dtype not in _FLOAT_DTYPES:
        raise SchemaError(f"{field}: expected a floating tensor, got dtype {tensor.dtype}")
    if kind == "int" and (tensor.dtype in _FLOAT_DTYPES or tensor.is_complex()):
        raise SchemaError(f"{field}: expected an integer tensor, got dtype {tensor.dtype}")
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor, {"kind": given, "dtype": dtype_name(tensor.dtype)}


def give_back(tensor: torch.Tensor | None, how: dict | None) -> Any:
    """A decoded tensor in the kind it was given (tensor, numpy array, list or number)."""
    if tensor is None or how is None:
        return tensor
    kind = how.get("kind", "tensor")
    if kind == "numpy":
        return tensor.numpy()
    if kind == "list":
        return tensor.tolist()
    if kind == "number":
        return tensor.item()
    return tensor


def same_memory(tensor: Any, array: pa.Array | None) -> bool:
    """Whether ``tensor`` is still the zero-copy view of the primitive column ``array`` (so
    ``to_arrow`` may keep the column; in-place writes went to the same bytes)."""
    if array is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or len(array) != len(tensor):
        return False
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        return False
    if pa.types.is_float16(array.type) or not len(array):
        return False
    width = array.type.bit_width // 8
    if tensor.element_size() != width:
        return False
    return tensor.data_ptr() == array.buffers()[1].address + array.offset * width


def tensor_column(tensor: torch.Tensor | None) -> pa.Array | None:
    """A ``[N]`` tensor as a primitive column (zero-copy on CPU)."""
    if tensor is None:
        return None
    return torch_to_arrow(tensor)


def matrix_column(tensor: torch.Tensor | None) -> pa.Array | None:
    """A ``[N, H]`` tensor as a ``fixed_size_list<H>`` column."""
    if tensor is None:
        return None
    flat = torch_to_arrow(tensor.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(tensor.shape[1]))


def column_tensor(owner: str, array: pa.Array | None, dtype: str | None) -> torch.Tensor | None:
    """A primitive column back as a zero-copy tensor, narrowed to ``dtype`` when widened."""
    if array is None:
        return None
    tensor = arrow_to_torch(array, field=owner)
    if dtype is not None and dtype_name(tensor.dtype) != dtype:
        tensor = tensor.to(dtype_from_name(owner, dtype))
    return tensor


def column_matrix(owner: str, array: pa.Array | None, dtype: str | None):
    if array is None:
        return None
    width = array.type.list_size
    flat = arrow_to_torch(array.flatten(), field=owner)
    if dtype is not None and dtype_name(flat.dtype) != dtype:
        flat = flat.to(dtype_from_name(owner, dtype))
    return flat.reshape(len(array), width)


def prefix_lengths(field: str, mask: torch.Tensor) -> torch.Tensor:
    """Row lengths of a mask that is ones then zeros in every row; anything else is refused
    (per-token data are stored ragged: :func:`maxent_arrow.arrow.prefix_lengths`)."""
    return ragged_prefix_lengths(mask.detach().cpu(), field=field)


def padded_to_list(field: str, tensor: torch.Tensor, lengths: torch.Tensor) -> pa.Array:
    """Keep the first ``lengths[i]`` entries of each row: a ragged ``list`` column."""
    data = tensor.detach().cpu()
    if data.dim() != 2 or data.shape[0] != lengths.shape[0]:
        raise LayoutError(
            f"{field}: expected shape [{lengths.shape[0]}, L], got {tuple(data.shape)}"
        )
    return Ragged.from_padded(data, lengths=lengths).to_arrow()


def list_to_padded(
    owner: str, array: pa.Array | None, width: int | None, dtype: str | None, pad
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """A ragged column back as ``(padded [N, width], lengths)``."""
    if array is None:
        return None, None
    ragged = Ragged.from_arrow(array)
    out_dtype = dtype_from_name(owner, dtype) if dtype else None
    padded, _ = ragged.to_padded(pad, max_len=width, dtype=out_dtype)
    return padded, ragged.lengths()


def mask_from_lengths(lengths: torch.Tensor, width: int, dtype: str) -> torch.Tensor:
    mask = torch.arange(width) < lengths[:, None]
    return mask.to(dtype_from_name("mask", dtype))
