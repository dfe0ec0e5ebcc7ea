"""Arrow layouts of the seed classes that hold tensors (one row per sample):
``ScoreBatch``, ``SequenceScores``, ``ReferenceLogprobs`` and ``LossOutputs``.

A tensor field comes back as the kind it was given (:func:`~.columns.as_tensor`): tensors of
their dtype, numpy arrays, lists or numbers. ``[N]`` values are primitive columns viewed
without copying; a field read back as such a view and left in place (same memory) is not
converted again by ``to_arrow``. Per-token ``[N, L]`` values are stored ragged by their
prefix mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import first_null
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.types import fields as F
from maxent_arrow.types.base import SOURCE, Source, layout_of, lazy
from maxent_arrow.types.columns import (
    as_tensor,
    column_matrix,
    column_tensor,
    give_back,
    is_int,
    is_list_of,
    is_number,
    list_to_padded,
    make_batch,
    mask_from_lengths,
    matrix_column,
    padded_to_list,
    prefix_lengths,
    require,
    same_memory,
    scalar,
    tensor_column,
)
from maxent_arrow.types.records import BoundLayout, EntryLayout

__all__ = [
    "ScoreBatchLayout",
    "ScoresLayout",
    "ReferenceLayout",
    "LossLayout",
    "GivenForm",
    "reference_batch",
]


def _how(meta: dict, name: str) -> dict:
    """How tensor field ``name`` was given: ``{"kind", "dtype"}`` from the metadata."""
    return {
        "kind": meta.get("kinds", {}).get(name, "tensor"),
        "dtype": meta.get("dtypes", {}).get(name),
    }


def _record_how(scalars: dict, name: str, how: dict | None) -> None:
    if how is None:
        scalars.setdefault("dtypes", {})[name] = None
        return
    scalars.setdefault("dtypes", {})[name] = how["dtype"]
    if how["kind"] != "tensor":
        scalars.setdefault("kinds", {})[name] = how["kind"]


class _TensorLayout(BoundLayout):
    """Shared steps: vectors reused when untouched or still viewing their column."""

    def vector(self, obj, name: str, *, kind: str, optional: bool = False, ndim: int = 1):
        """``(column, how)`` of a vector field: the source's column if the field is untouched
        or still its zero-copy view, else the value checked and converted."""
        source = obj.__dict__.get(SOURCE)
        column = None if source is None else source.column(name)
        if column is not None and (
            name not in obj.__dict__ or same_memory(obj.__dict__[name], column)
        ):
            assert source is not None  # the column came from it
            return column, _how(source.meta, name), len(column)
        if source is not None and name not in obj.__dict__:
            return None, None, None  # an optional field absent from the source
        tensor, how = as_tensor(
            f"{self.name}.{name}", obj.__dict__[name], ndim=ndim, kind=kind, optional=optional
        )
        if tensor is None:
            return None, None, None
        if ndim == 2:
            return matrix_column(tensor), how, tensor.shape[0]
        return tensor_column(tensor), how, tensor.shape[0]

    def encode_vectors(
        self, obj, kinds: dict[str, str], *, optional=(), **scalars: Any
    ) -> tuple[dict[str, pa.Array | None], dict[str, Any], dict[str, int | None]]:
        """The vector fields ``kinds`` (name -> kind) as ``(columns, scalars, rows)``: each
        column reused or converted (:meth:`vector`) and its dtype recorded in ``scalars``,
        which starts with ``scalars`` given."""
        columns: dict[str, pa.Array | None] = {}
        meta: dict[str, Any] = {"dtypes": {}, **scalars}
        rows: dict[str, int | None] = {}
        for field, kind in kinds.items():
            columns[field], how, rows[field] = self.vector(
                obj, field, kind=kind, optional=field in optional
            )
            _record_how(meta, field, how)
        return columns, meta, rows

    def decode_vector(self, source: Source, name: str, *, matrix: bool = False):
        how = _how(source.meta, name)
        array = source.column(name)
        if matrix:
            tensor = column_matrix(f"{self.name}.from_arrow: column {name!r}", array, how["dtype"])
        else:
            tensor = column_tensor(f"{self.name}.from_arrow: column {name!r}", array, how["dtype"])
        return give_back(tensor, how)

    def check_vectors(self, batch, names, optional=(), given=()):
        for name in names:
            if name in given:
                continue
            array = require(
                self.name, batch, name, is_number, "a numeric column", optional=name in optional
            )
            if array is not None and array.null_count:
                i = first_null(array)
                raise LayoutError(
                    f"{self.name}.from_arrow: column {name!r}: expected no nulls, got a null "
                    f"at position {i}"
                )


# ---------------------------------------------------------------------------- ScoreBatch
_SCORE_SCALARS = ("pad_token_id", "max_prompt_len", "slice_size", "total_sequences")


class ScoreBatchLayout(_TensorLayout):
    """``prompt_ids`` / ``prompt_attention_mask`` (list<int32> / list<int8>, one entry per
    sample) and ``completion_ids`` stored ragged by the attention mask (which must be ones then
    zeros); the ints in metadata. Where padding positions hold something other than
    ``pad_token_id``, every row is stored whole with the mask lengths beside it."""

    columns = {
        "prompt_ids": ("prompt_entries",),
        "prompt_attention_mask": ("prompt_entries",),
        "completion_ids": ("completion_ids", "completion_attention_mask", "pad_token_id"),
        "completion_length": ("completion_ids", "completion_attention_mask", "pad_token_id"),
    }

    def __init__(self, entry: type):
        self.entry = entry

    def check(self, cls, batch, meta, given=()):
        if "prompt_entries" not in given:
            for name in ("prompt_ids", "prompt_attention_mask"):
                require(self.name, batch, name, is_list_of(is_int), "list<int>")
        if "completion_ids" not in given:
            require(self.name, batch, "completion_ids", is_list_of(is_int), "list<int>")

    def field(self, obj, source, name, *, cache=True):
        meta = source.meta
        if name == "prompt_entries":
            ids, masks = source.column("prompt_ids"), source.column("prompt_attention_mask")
            assert ids is not None and masks is not None  # check() required both
            ids, masks = ids.to_pylist(), masks.to_pylist()
            return [self.entry(i, m) for i, m in zip(ids, masks)]
        if name in ("completion_ids", "completion_attention_mask"):
            owner = f"{self.name}.from_arrow: column 'completion_ids'"
            width, pad = meta.get("width"), meta.get("pad_token_id")
            how = _how(meta, name)
            ids, lengths = list_to_padded(
                owner,
                source.column("completion_ids"),
                width,
                _how(meta, "completion_ids")["dtype"] or "int64",
                pad,
            )
            stored = source.column("completion_length")
            if stored is not None:
                lengths = column_tensor(owner, stored, "int64")
            if name == "completion_ids":
                return give_back(ids, how)
            # check() required completion_ids; to_arrow() always stores the width.
            assert lengths is not None and width is not None
            return give_back(mask_from_lengths(lengths, width, how["dtype"] or "int64"), how)
        return meta.get(name)

    def encode_column(self, obj, name: str) -> pa.Array | None:
        if name in ("prompt_ids", "prompt_attention_mask"):
            ids, masks = self._entries(obj.prompt_entries)
            return ids if name == "prompt_ids" else masks
        return None

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name, state = self.name, obj.__dict__
        source = state.get(SOURCE)
        columns: dict[str, pa.Array | None] = {}
        scalars: dict[str, Any] = {}
        if lazy(obj, "prompt_entries") is not None:
            columns["prompt_ids"] = source.column("prompt_ids")
            columns["prompt_attention_mask"] = source.column("prompt_attention_mask")
        else:
            ids, masks = self._entries(state["prompt_entries"])
            columns["prompt_ids"], columns["prompt_attention_mask"] = ids, masks
        for field in (*_SCORE_SCALARS, "score_tail_tokens"):
            if lazy(obj, field) is not None:
                scalars[field] = source.meta.get(field)
            else:
                scalars[field] = scalar(
                    f"{name}.{field}",
                    state[field],
                    kind="int",
                    optional=field == "score_tail_tokens",
                )
        completion = ("completion_ids", "completion_attention_mask", "pad_token_id")
        if lazy(obj, *completion) is not None:
            rows = len(source.column("completion_ids"))
            for key in ("completion_ids", "completion_length"):
                columns[key] = source.column(key)
            scalars["width"] = source.meta.get("width")
            for field in completion[:2]:
                _record_how(scalars, field, _how(source.meta, field))
        else:
            rows = self._completions(obj, columns, scalars)
        if len(columns["prompt_ids"]) != rows:
            raise LayoutError(
                f"{name}.prompt_entries: expected {rows} entries (one per row of "
                f"completion_ids), got {len(columns['prompt_ids'])}"
            )
        if scalars["total_sequences"] != rows:
            raise LayoutError(
                f"{name}.total_sequences: expected {rows} (rows of completion_ids), got "
                f"{scalars['total_sequences']}"
            )
        return make_batch(name, columns, scalars, rows)

    def _completions(self, obj, columns: dict, scalars: dict) -> int:
        name = self.name
        ids, how = as_tensor(
            f"{name}.completion_ids", _get(obj, "completion_ids"), ndim=2, kind="int"
        )
        mask, mask_how = as_tensor(
            f"{name}.completion_attention_mask",
            _get(obj, "completion_attention_mask"),
            ndim=2,
            kind="int",
        )
        if tuple(mask.shape) != tuple(ids.shape):
            raise LayoutError(
                f"{name}.completion_attention_mask: expected shape {tuple(ids.shape)} (as "
                f"completion_ids), got {tuple(mask.shape)}"
            )
        lengths = prefix_lengths(f"{name}.completion_attention_mask", mask)
        pad = scalar(f"{name}.pad_token_id", _get(obj, "pad_token_id"), kind="int")
        keep = mask_from_lengths(lengths, int(ids.shape[1]), "bool")
        if bool((ids[~keep] != pad).any()):
            # Padding positions that hold other ids: stored whole, the mask lengths beside.
            full = torch.full_like(lengths, ids.shape[1])
            columns["completion_ids"] = padded_to_list(f"{name}.completion_ids", ids, full)
            columns["completion_length"] = pa.array(lengths.numpy().astype(np.int32))
        else:
            columns["completion_ids"] = padded_to_list(f"{name}.completion_ids", ids, lengths)
        scalars["width"] = int(ids.shape[1])
        _record_how(scalars, "completion_ids", how)
        _record_how(scalars, "completion_attention_mask", mask_how)
        return int(ids.shape[0])

    def _entries(self, value: Any) -> tuple[pa.Array, pa.Array]:
        """Prompt entries as two list columns; an entry repeated (the same object, as the
        seed's builder repeats it K times) is converted once."""
        field = f"{self.name}.prompt_entries"
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise SchemaError(
                f"{field}: expected a list of PromptCacheEntry, got {type(value).__name__}"
            )
        first: dict[int, int] = {}
        unique: list[Any] = []
        index = np.empty(len(value), dtype=np.int64)
        for i, entry in enumerate(value):
            if not isinstance(entry, self.entry):
                raise SchemaError(
                    f"{field}: expected a PromptCacheEntry at sample {i}, got "
                    f"{type(entry).__name__}"
                )
            j = first.setdefault(id(entry), len(unique))
            if j == len(unique):
                unique.append(entry)
            index[i] = j
        layout = cast(EntryLayout, layout_of(self.entry))
        ids, masks, sizes = [], [], np.empty(len(unique), dtype=np.int64)
        for j, entry in enumerate(unique):
            entry_ids = layout.flat(entry, "input_ids")
            entry_mask = layout.flat(entry, "attention_mask")
            if len(entry_mask) != len(entry_ids):
                raise LayoutError(
                    f"{field}: sample {int(np.flatnonzero(index == j)[0])}: attention_mask has "
                    f"{len(entry_mask)} entries, expected {len(entry_ids)} (as input_ids)"
                )
            ids.append(entry_ids)
            masks.append(entry_mask)
            sizes[j] = len(entry_ids)
        offsets = np.zeros(len(unique) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        id_values = pa.concat_arrays(ids) if ids else pa.array([], pa.int32())
        mask_values = pa.concat_arrays(masks) if masks else pa.array([], pa.int8())
        take = pa.array(index)
        return (
            F.grouped(id_values, offsets).take(take),
            F.grouped(mask_values, offsets).take(take),
        )


def _get(obj, name: str) -> Any:
    """A field's value through the attribute (decoding it if it is still lazy)."""
    return getattr(obj, name)


# ---------------------------------------------------------------------------- SequenceScores
_SCORE_VECTORS = ("cur_logp_sum", "behavior_logp_sum", "log_ratio_train", "denom_tok_tensor")
_SCORE_KINDS = {
    "cur_logp_sum": "float",
    "behavior_logp_sum": "float",
    "log_ratio_train": "float",
    "denom_tok_tensor": "any",  # token counts; the original also passes int64 here
    "policy_entropy_sum": "float",
}


def _token_lengths(field: str, values, mask) -> torch.Tensor | None:
    """Row lengths of per-token ``values`` (by ``mask`` when given); None only without values."""
    if values is None:
        return None
    if mask is not None:
        return prefix_lengths(field, mask)
    return torch.full((values.shape[0],), values.shape[1], dtype=torch.int64)


class ScoresLayout(_TensorLayout):
    """The ``[N]`` vectors as primitive columns, ``pooled_hidden`` as ``fixed_size_list<H>``,
    ``token_logp`` / ``old_token_logp`` ragged by ``token_mask`` (its lengths in
    ``token_count``)."""

    columns = {
        **{name: (name,) for name in _SCORE_KINDS},
        "pooled_hidden": ("pooled_hidden",),
        "token_logp": ("token_logp", "token_mask"),
        "old_token_logp": ("old_token_logp", "token_mask", "token_logp"),
        "token_count": ("token_mask",),
    }
    field_columns = {name: (name, False) for name in _SCORE_KINDS}
    _TOKENS = ("token_logp", "token_mask", "old_token_logp")

    def check(self, cls, batch, meta, given=()):
        self.check_vectors(batch, _SCORE_KINDS, optional=("policy_entropy_sum",), given=given)

    def field(self, obj, source, name, *, cache=True):
        meta = source.meta
        if name in _SCORE_KINDS:
            return self.decode_vector(source, name)
        if name == "pooled_hidden":
            return self.decode_vector(source, name, matrix=True)
        owner = f"{self.name}.from_arrow: column {name!r}"
        widths, how = meta.get("widths", {}), _how(meta, name)
        if name == "token_mask":
            counts = source.column("token_count")
            if counts is None:
                return None
            lengths = column_tensor(owner, counts, "int64")
            assert lengths is not None  # counts is not None
            return give_back(mask_from_lengths(lengths, widths["token_mask"], how["dtype"]), how)
        values, _ = list_to_padded(owner, source.column(name), widths.get(name), how["dtype"], 0.0)
        return give_back(values, how)

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name = self.name
        columns, scalars, rows = self.encode_vectors(
            obj, _SCORE_KINDS, optional=("policy_entropy_sum",), widths={}
        )
        columns["pooled_hidden"], how, rows["pooled_hidden"] = self.vector(
            obj, "pooled_hidden", kind="float", optional=True, ndim=2
        )
        _record_how(scalars, "pooled_hidden", how)
        self._tokens(obj, columns, scalars, rows)
        n = cast(int, rows["cur_logp_sum"])  # a required vector
        for field in (*_SCORE_KINDS, "pooled_hidden", *self._TOKENS):
            if rows.get(field) is not None and rows[field] != n:
                raise LayoutError(
                    f"{name}.{field}: expected {n} rows (as cur_logp_sum), got {rows[field]}"
                )
        return make_batch(name, columns, scalars, n)

    def _tokens(self, obj, columns: dict, scalars: dict, rows: dict) -> None:
        name = self.name
        source = lazy(obj, *self._TOKENS)
        if source is not None:
            for key in ("token_logp", "old_token_logp", "token_count"):
                columns[key] = source.column(key)
            scalars["widths"] = dict(source.meta.get("widths", {}))
            for field in self._TOKENS:
                _record_how(scalars, field, _how(source.meta, field))
                array = source.column("token_count" if field == "token_mask" else field)
                rows[field] = None if array is None else len(array)
            return
        values = {}
        for field in self._TOKENS:
            kind = "any" if field == "token_mask" else "float"
            tensor, how = as_tensor(
                f"{name}.{field}", _get(obj, field), ndim=2, kind=kind, optional=True
            )
            values[field] = tensor
            _record_how(scalars, field, how)
            rows[field] = None if tensor is None else int(tensor.shape[0])
        shape = None if values["token_logp"] is None else tuple(values["token_logp"].shape)
        for field in ("token_mask", "old_token_logp"):
            value = values[field]
            if value is not None and shape is not None and tuple(value.shape) != shape:
                raise LayoutError(
                    f"{name}.{field}: expected shape {shape} (as token_logp), got "
                    f"{tuple(value.shape)}"
                )
        mask = values["token_mask"]
        lengths = _token_lengths(f"{name}.token_mask", values["token_logp"], mask)
        old_lengths = lengths
        if values["old_token_logp"] is not None and lengths is None:
            old_lengths = _token_lengths(f"{name}.token_mask", values["old_token_logp"], mask)
        for field, lens in (("token_logp", lengths), ("old_token_logp", old_lengths)):
            value = values[field]
            columns[field] = (
                None
                if value is None
                else padded_to_list(f"{name}.{field}", value, cast(torch.Tensor, lens))
            )
            scalars["widths"][field] = None if value is None else int(value.shape[1])
        if mask is not None:
            # The mask alone (no per-token values) still needs its lengths stored.
            counts = prefix_lengths(f"{name}.token_mask", mask)
            columns["token_count"] = pa.array(counts.numpy().astype(np.int32))
            scalars["widths"]["token_mask"] = int(mask.shape[1])


# ---------------------------------------------------------------------------- ReferenceLogprobs
_REF_KINDS = {"ref_logp_sum": "float", "ref_tok_counts": "any", "ref_logp_sum_raw": "float"}


class ReferenceLayout(_TensorLayout):
    """``ref_logp_sum``, ``ref_tok_counts``, ``ref_logp_sum_raw`` as primitive columns,
    ``ref_token_logp`` ragged by ``ref_token_mask``; the two floats in metadata."""

    columns = {
        **{name: (name,) for name in _REF_KINDS},
        "ref_token_logp": ("ref_token_logp", "ref_token_mask"),
    }
    field_columns = {name: (name, False) for name in _REF_KINDS}

    def check(self, cls, batch, meta, given=()):
        self.check_vectors(batch, _REF_KINDS, given=given)

    def field(self, obj, source, name, *, cache=True):
        meta = source.meta
        if name in _REF_KINDS:
            return self.decode_vector(source, name)
        if name in ("ref_logp_mean", "avg_completion_tokens"):
            return meta.get(name)
        owner = f"{self.name}.from_arrow: column 'ref_token_logp'"
        width = meta.get("width")
        values, lengths = list_to_padded(
            owner,
            source.column("ref_token_logp"),
            width,
            _how(meta, "ref_token_logp")["dtype"],
            0.0,
        )
        if name == "ref_token_logp":
            return give_back(values, _how(meta, name))
        if values is None or not meta.get("has_mask"):
            return None
        how = _how(meta, name)
        # Without a stored width (older batches) the values are padded to the longest row.
        width = values.shape[1] if width is None else width
        assert lengths is not None  # values is not None
        return give_back(mask_from_lengths(lengths, width, how["dtype"] or "int64"), how)

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name, state = self.name, obj.__dict__
        source = state.get(SOURCE)
        columns, scalars, rows = self.encode_vectors(obj, _REF_KINDS)
        for field in ("ref_logp_mean", "avg_completion_tokens"):
            if lazy(obj, field) is not None:
                scalars[field] = source.meta.get(field)
            else:
                scalars[field] = scalar(f"{name}.{field}", state[field])
        per_token = ("ref_token_logp", "ref_token_mask")
        if lazy(obj, *per_token) is not None:
            columns["ref_token_logp"] = source.column("ref_token_logp")
            for key in ("width", "has_mask"):
                scalars[key] = source.meta.get(key)
            for field in per_token:
                _record_how(scalars, field, _how(source.meta, field))
            rows["ref_token_logp"] = (
                None if columns["ref_token_logp"] is None else len(columns["ref_token_logp"])
            )
        else:
            self._per_token(obj, columns, scalars, rows)
        n = cast(int, rows["ref_logp_sum"])  # a required vector
        for field in ("ref_tok_counts", "ref_logp_sum_raw", "ref_token_logp", "ref_token_mask"):
            if rows.get(field) is not None and rows[field] != n:
                raise LayoutError(
                    f"{name}.{field}: expected {n} rows (as ref_logp_sum), got {rows[field]}"
                )
        return make_batch(name, columns, scalars, n)

    def _per_token(self, obj, columns: dict, scalars: dict, rows: dict) -> None:
        name = self.name
        values, how = as_tensor(
            f"{name}.ref_token_logp", _get(obj, "ref_token_logp"), ndim=2, kind="float",
            optional=True,
        )  # fmt: skip
        mask, mask_how = as_tensor(
            f"{name}.ref_token_mask", _get(obj, "ref_token_mask"), ndim=2, kind="any",
            optional=True,
        )  # fmt: skip
        _record_how(scalars, "ref_token_logp", how)
        _record_how(scalars, "ref_token_mask", mask_how)
        rows["ref_token_logp"] = None if values is None else int(values.shape[0])
        rows["ref_token_mask"] = None if mask is None else int(mask.shape[0])
        if values is not None and mask is not None and mask.shape != values.shape:
            raise LayoutError(
                f"{name}.ref_token_mask: expected shape {tuple(values.shape)} (as "
                f"ref_token_logp), got {tuple(mask.shape)}"
            )
        if mask is not None and values is None:
            raise SchemaError(
                f"{name}.ref_token_mask: a mask without ref_token_logp cannot be stored"
            )
        lengths = _token_lengths(f"{name}.ref_token_mask", values, mask)
        columns["ref_token_logp"] = (
            None
            if values is None
            else padded_to_list(f"{name}.ref_token_logp", values, cast(torch.Tensor, lengths))
        )
        scalars["width"] = None if values is None else int(values.shape[1])
        scalars["has_mask"] = mask is not None


# ---------------------------------------------------------------------------- LossOutputs
class LossLayout(_TensorLayout):
    """``log_ratio_train`` and ``denom_tok_tensor`` as primitive columns; the loss value (its
    graph is not stored) and the scalar bundle in metadata."""

    columns = {"log_ratio_train": ("log_ratio_train",), "denom_tok_tensor": ("denom_tok_tensor",)}
    field_columns = {"log_ratio_train": ("log_ratio_train", False)}
    _KINDS = {"log_ratio_train": "float", "denom_tok_tensor": "any"}
    shared_on_replace = frozenset({"scalars"})

    def __init__(self, bundle: type):
        self.bundle = bundle

    def check(self, cls, batch, meta, given=()):
        self.check_vectors(batch, self._KINDS, given=given)

    def field(self, obj, source, name, *, cache=True):
        meta = source.meta
        if name in self._KINDS:
            return self.decode_vector(source, name)
        if name == "scalars":
            return self.bundle(**meta.get("scalars", {}))
        how = _how(meta, "loss")
        loss = torch.tensor(meta.get("loss"), dtype=torch.float64)
        return give_back(loss.to(getattr(torch, how["dtype"] or "float32")), how)

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name, state = self.name, obj.__dict__
        source = state.get(SOURCE)
        columns, scalars, rows = self.encode_vectors(obj, self._KINDS)
        if lazy(obj, "loss") is not None:
            scalars["loss"] = source.meta.get("loss")
            _record_how(scalars, "loss", _how(source.meta, "loss"))
        else:
            loss, how = as_tensor(f"{name}.loss", state["loss"], ndim=0, kind="float")
            scalars["loss"] = float(loss.item())
            _record_how(scalars, "loss", how)
        if lazy(obj, "scalars") is not None:
            scalars["scalars"] = source.meta.get("scalars")
        else:
            bundle = state["scalars"]
            if not isinstance(bundle, self.bundle):
                raise SchemaError(
                    f"{name}.scalars: expected a {self.bundle.__name__}, got "
                    f"{type(bundle).__name__}"
                )
            owner = f"{name}.scalars"
            scalars["scalars"] = {
                f.name: scalar(
                    f"{owner}.{f.name}", getattr(bundle, f.name), optional=f.name == "clip_loss"
                )
                for f in dataclasses.fields(bundle)
            }
        return make_batch(name, columns, scalars, cast(int, rows["log_ratio_train"]))


# ---------------------------------------------------------------------------- builders
@dataclasses.dataclass(frozen=True, kw_only=True)
class GivenForm:
    """How a ``ReferenceLogprobs``' tensors were given, so that ``from_arrow`` gives them back
    the same way: ``dtypes`` (field -> tensor dtype name, ``None``: the default), ``kinds``
    (field -> ``"tensor"``, ``"numpy"``, ``"list"``), and the per-token matrix's ``width``
    (``ref_token_logp`` is padded back to it) and whether it had a mask (``has_mask``)."""

    dtypes: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
    width: int | None = None
    has_mask: bool = False


def reference_batch(
    *,
    ref_logp_sum: pa.Array,
    ref_tok_counts: pa.Array,
    ref_logp_sum_raw: pa.Array,
    ref_logp_mean: float | None,
    avg_completion_tokens: float | None,
    ref_token_logp: pa.Array | None = None,
    given: GivenForm | None = None,
) -> pa.RecordBatch:
    """A ``ReferenceLogprobs`` record batch from Arrow columns, for ``from_arrow``.

    The ``[N]`` columns are primitive (zero-copy tensors when their type is the dtype to give
    back); ``ref_token_logp`` is ragged ``list<float>``, padded back to ``given.width`` with a
    mask when ``given.has_mask``. ``given`` says how each field was given
    (:class:`GivenForm`; default: tensors of the default dtypes, no per-token mask).
    """
    given = given or GivenForm()
    columns = {
        "ref_logp_sum": ref_logp_sum,
        "ref_tok_counts": ref_tok_counts,
        "ref_logp_sum_raw": ref_logp_sum_raw,
        "ref_token_logp": ref_token_logp,
    }
    scalars = {
        "ref_logp_mean": ref_logp_mean,
        "avg_completion_tokens": avg_completion_tokens,
        "dtypes": dict(given.dtypes),
        "kinds": dict(given.kinds),
        "width": given.width,
        "has_mask": given.has_mask,
    }
    return make_batch("ReferenceLogprobs", columns, scalars, len(ref_logp_sum))
