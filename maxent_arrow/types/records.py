"""Arrow layouts of the seed classes without tensors: what ``to_arrow`` writes, how a field is
read back, and the checks at that boundary.

==========================  =========================================================
class                        one row per
==========================  =========================================================
GenerationBatch,             prompt group (``P`` rows; per-completion data in list columns)
AdvantageStats,
QDistribution
PromptCompletionBatch        sample (``N`` rows)
PromptCacheEntry, scalar     one row
classes
==========================  =========================================================

Column names follow the group table of :mod:`maxent_arrow.arrow.schema` where the same data
appear there (``prompt``, ``prompt_messages``, ``completions``, ``completion_messages``,
``advantages``, ``q``, ``total_utils`` ...), so a rollout batch is assembled from these batches
by column and gives them back by column. The tensor classes are in :mod:`.tensors`.

``RewardComputation``'s layout is in :mod:`.computation`. Every ``encode`` takes the columns
of untouched fields from the source as they are and checks and converts the others; an
untouched record gives its source batch back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.types import fields as F
from maxent_arrow.types.base import (
    SOURCE,
    Layout,
    Source,
    lazy,
)
from maxent_arrow.types.columns import (
    is_float,
    is_int,
    is_list_of,
    is_struct,
    is_text,
    make_batch,
    require,
    scalar,
)

__all__ = [
    "BoundLayout",
    "ScalarLayout",
    "EntryLayout",
    "GenerationLayout",
    "PairsLayout",
    "GroupedPairLayout",
    "grouped_floats",
    "same_groups",
    "sample_messages",
]

_FLOAT_LIST = is_list_of(is_float)
_MESSAGES = is_list_of(is_struct)


class BoundLayout(Layout):
    """A layout that knows its class (set by :func:`maxent_arrow.types.base.record`)."""

    name = ""
    fields: tuple[str, ...] = ()

    def bind(self, cls: type) -> None:
        self.name = cls.__name__
        self.fields = tuple(f.name for f in dataclasses.fields(cls))

    def untouched(self, obj: Any) -> Source | None:
        return lazy(obj, *self.fields)


def _one_row(owner: str, batch: pa.RecordBatch) -> None:
    if batch.num_rows != 1:
        raise SchemaError(f"{owner}.from_arrow: expected one row, got {batch.num_rows}")


# ---------------------------------------------------------------------------- scalar classes
class ScalarLayout(BoundLayout):
    """One row of float64 columns (bucket dicts as ``map<string, double>``)."""

    def __init__(self, *, optional: tuple[str, ...] = (), buckets: tuple[str, ...] = ()):
        self.optional = optional
        self.buckets = buckets

    def bind(self, cls: type) -> None:
        super().bind(cls)
        self.columns = {name: (name,) for name in self.fields}

    def check(self, cls, batch, meta, given=()):
        _one_row(self.name, batch)
        for name in self.fields:
            if name in given:
                continue
            if name in self.buckets:
                require(self.name, batch, name, pa.types.is_map, "map<string, double>")
            else:
                require(self.name, batch, name, is_float, "double")

    def field(self, obj, source, name, *, cache=True):
        column = source.column(name)
        assert column is not None  # check() required it
        value = column[0].as_py()
        return dict(value) if name in self.buckets else value

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        source = obj.__dict__.get(SOURCE)
        state = obj.__dict__
        columns = {}
        for name in self.fields:
            if source is not None and name not in state:
                columns[name] = source.column(name)
            elif name in self.buckets:
                columns[name] = _bucket_column(f"{self.name}.{name}", state[name])
            else:
                value = scalar(f"{self.name}.{name}", state[name], optional=name in self.optional)
                columns[name] = pa.array([value], pa.float64())
        return make_batch(self.name, columns, {}, 1)


def _bucket_column(field: str, value: Any) -> pa.Array:
    if not isinstance(value, dict):
        raise SchemaError(f"{field}: expected a dict of floats, got {type(value).__name__}")
    items = []
    for key, item in value.items():
        if not isinstance(key, str):
            raise SchemaError(f"{field}: expected str keys, got {key!r}")
        items.append((key, scalar(f"{field}[{key!r}]", item)))
    return pa.array([items], pa.map_(pa.string(), pa.float64()))


# ---------------------------------------------------------------------------- PromptCacheEntry
class EntryLayout(BoundLayout):
    """One row: ``input_ids`` list<int32> and ``attention_mask`` list<int8>."""

    columns = {"input_ids": ("input_ids",), "attention_mask": ("attention_mask",)}
    field_columns = {"input_ids": ("input_ids", True), "attention_mask": ("attention_mask", True)}
    kinds = {"input_ids": pa.int32(), "attention_mask": pa.int8()}

    def check(self, cls, batch, meta, given=()):
        _one_row(self.name, batch)
        for name in self.kinds:
            if name not in given:
                require(self.name, batch, name, is_list_of(is_int), "list<int>")

    def field(self, obj, source, name, *, cache=True):
        column = source.column(name)
        assert column is not None  # check() required it
        return column.flatten().to_pylist()

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        flat = {name: self.flat(obj, name) for name in self.kinds}
        ids, mask = flat["input_ids"], flat["attention_mask"]
        if len(mask) != len(ids):
            raise LayoutError(
                f"{self.name}.attention_mask: expected {len(ids)} entries (as input_ids), got "
                f"{len(mask)}"
            )
        bounds = np.array([0, len(ids)], dtype=np.int64)
        columns = {name: F.grouped(values, bounds) for name, values in flat.items()}
        return make_batch(self.name, columns, {}, 1)

    def flat(self, obj, name: str) -> pa.Array:
        """One field's values, from the source if untouched (a view), else converted."""
        source = lazy(obj, name)
        if source is not None:
            column = source.column(name)
            assert column is not None  # check() required it
            return column.flatten()
        return F.int_array(f"{self.name}.{name}", obj.__dict__[name], self.kinds[name])


# ---------------------------------------------------------------------------- text columns
def _texts(owner: str, batch: pa.RecordBatch, text: str, messages: str) -> None:
    require(owner, batch, text, is_text, "string")
    require(owner, batch, messages, _MESSAGES, "list<struct<role, content, extra>>", optional=True)


def _grouped_texts(field: str, value: Any) -> tuple[pa.Array, pa.Array | None]:
    """Groups of strings or message lists: ``completions`` and ``completion_messages``
    (a group is one or the other; mixing them in a group is refused)."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        array = F.arrow_groups(field, value)
        F.str_array(field, array.flatten(), where=F.Where(list_offsets(array)))
        return array, None
    flat, offsets = F.group_flat(field, value)
    where = F.Where(offsets)
    texts, messages = F.text_arrays(field, flat, text_of_messages=True, where=where)
    completions = F.grouped(texts, offsets)
    if messages is None:
        return completions, None
    is_message = np.asarray(messages.is_valid().to_numpy(zero_copy_only=False))
    sizes = np.diff(offsets)
    per_group = np.add.reduceat(is_message, offsets[:-1]) if len(flat) else np.zeros(0)
    per_group = np.where(sizes == 0, 0, per_group)
    mixed = np.flatnonzero((per_group != 0) & (per_group != sizes))
    if mixed.size:
        g = int(mixed[0])
        k = int(np.flatnonzero(~is_message[offsets[g] : offsets[g + 1]])[0])
        raise SchemaError(
            f"{field}: group {g} mixes message lists and plain strings (a string at sample "
            f"{k}); store a group's completions as one or the other"
        )
    rows = per_group == sizes
    child = messages.filter(pa.array(is_message))
    kept = np.where(rows, sizes, 0)
    child_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(kept, out=child_offsets[1:])
    completion_messages = pa.ListArray.from_arrays(
        pa.array(child_offsets.astype(np.int32)), child, mask=pa.array(~rows)
    )
    return completions, completion_messages


def _decode_grouped_texts(completions: pa.Array, messages: pa.Array | None) -> list[list]:
    groups = completions.to_pylist()
    if messages is None or messages.null_count == len(messages):
        return groups
    for g, rows in enumerate(messages.to_pylist()):
        if rows is not None:
            groups[g] = [F.decode_messages(m) for m in rows]
    return groups


def _grouped_flat(field: str, value: Any, encode) -> pa.Array:
    """Groups of items as a list array, ``encode(field, flat, where=...)`` converting the
    items (Arrow list arrays given as the value are checked and kept)."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        array = F.arrow_groups(field, value, check_items=False)
        offsets = list_offsets(array)
        return F.grouped(encode(field, array.flatten(), where=F.Where(offsets)), offsets)
    flat, offsets = F.group_flat(field, value)
    return F.grouped(encode(field, flat, where=F.Where(offsets)), offsets)


def _regrouped(flat: list, array: pa.Array) -> list[list]:
    return F.regroup_list(flat, list_offsets(array))


# ---------------------------------------------------------------------------- GenerationBatch
class GenerationLayout(BoundLayout):
    """One row per prompt group: ``prompt`` / ``prompt_messages``, ``answer``,
    ``completions`` / ``completion_messages``, ``ref_meta`` (JSON), ``completion_info``."""

    # Its columns are the group table's that feed it (the column registry's `feeds`); a
    # field stored in two (text or chat messages) reads back from the first when it is set.
    columns = {c: (f,) for c, f in R.fed_fields("GenerationBatch").items()}
    parts = {
        f: tuple(c for c, g in R.fed_fields("GenerationBatch").items() if g == f)
        for f in dict.fromkeys(R.fed_fields("GenerationBatch").values())
    }
    field_columns = {f: (cols[0], False) for f, cols in parts.items()}

    def check(self, cls, batch, meta, given=()):
        if "prompts" not in given:
            _texts(self.name, batch, "prompt", "prompt_messages")
        if "answers" not in given:
            require(self.name, batch, "answer", is_text, "string")
        if "grouped_completions" not in given:
            require(self.name, batch, "completions", is_list_of(is_text), "list<string>")
            require(
                self.name, batch, "completion_messages", is_list_of(_MESSAGES),
                "list<list<struct>>", optional=True,
            )  # fmt: skip
        require(self.name, batch, "ref_meta", is_list_of(is_text), "list<string>", optional=True)
        require(
            self.name, batch, "completion_info", is_list_of(is_struct), "list<struct>",
            optional=True,
        )  # fmt: skip

    def field(self, obj, source, name, *, cache=True):
        column = source.column
        if name == "prompts":
            return F.decode_texts(column("prompt"), column("prompt_messages"))
        if name == "answers":
            answer = column("answer")
            assert answer is not None  # check() required it
            return answer.to_pylist()
        if name == "grouped_completions":
            return _decode_grouped_texts(column("completions"), column("completion_messages"))
        if name == "grouped_ref_meta":
            meta = column("ref_meta")
            return None if meta is None else _regrouped(F.decode_json(meta.flatten()), meta)
        info = column("completion_info")
        return None if info is None else _regrouped(F.decode_info(info.flatten()), info)

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        name = self.name
        columns: dict[str, pa.Array | None] = {}
        for field, names in self.parts.items():
            source = lazy(obj, field)
            if source is not None:
                columns.update({n: source.column(n) for n in names})
                continue
            value = obj.__dict__[field]
            owner = f"{name}.{field}"
            if field == "prompts":
                columns["prompt"], columns["prompt_messages"] = F.text_arrays(
                    owner, value, text_of_messages=False
                )
            elif field == "answers":
                columns["answer"] = F.str_array(owner, value, nullable=True)
            elif field == "grouped_completions":
                columns["completions"], columns["completion_messages"] = _grouped_texts(
                    owner, value
                )
            elif value is not None:
                encode = F.json_array if field == "grouped_ref_meta" else F.info_array
                columns[names[0]] = _grouped_flat(owner, value, encode)
        self._check(columns)
        prompt = columns["prompt"]
        assert prompt is not None  # prompts are required
        return make_batch(name, columns, {}, len(prompt))

    def _check(self, columns: dict[str, pa.Array | None]) -> None:
        prompt, answer, completions = columns["prompt"], columns["answer"], columns["completions"]
        assert prompt is not None and answer is not None and completions is not None  # required
        name, p = self.name, len(prompt)
        if len(answer) != p:
            raise LayoutError(
                f"{name}.answers: expected {p} answers (one per prompt), got {len(answer)}"
            )
        if len(completions) != p:
            raise LayoutError(
                f"{name}.grouped_completions: expected {p} groups (one per prompt), got "
                f"{len(completions)}"
            )
        same_groups(
            name,
            "grouped_completions",
            completions,
            {
                "grouped_ref_meta": columns.get("ref_meta"),
                "grouped_completion_info": columns.get("completion_info"),
            },
        )


def same_groups(owner: str, base_name: str, base: pa.Array, others: dict) -> None:
    """Every grouped column of one record has the group sizes of ``base``."""
    sizes = np.diff(list_offsets(base))
    for name, other in others.items():
        if other is None:
            continue
        other_sizes = np.diff(list_offsets(other))
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


# ---------------------------------------------------------------------------- pairs
class PairsLayout(BoundLayout):
    """One row per sample: ``prompt`` (dictionary-encoded) / ``prompt_messages``,
    ``completion`` / ``completion_messages``, ``metadata`` (completion info)."""

    columns = {
        "prompt": ("prompts",),
        "prompt_messages": ("prompts",),
        "completion": ("completions",),
        "completion_messages": ("completions",),
        "metadata": ("metadata",),
    }
    field_columns = {
        "prompts": ("prompt", False),
        "completions": ("completion", False),
        "metadata": ("metadata", False),
    }
    parts = {
        "prompts": ("prompt", "prompt_messages"),
        "completions": ("completion", "completion_messages"),
        "metadata": ("metadata",),
    }

    def check(self, cls, batch, meta, given=()):
        if "prompts" not in given:
            _texts(self.name, batch, "prompt", "prompt_messages")
        if "completions" not in given:
            _texts(self.name, batch, "completion", "completion_messages")
        require(self.name, batch, "metadata", is_struct, "struct", optional=True)

    def field(self, obj, source, name, *, cache=True):
        column = source.column
        if name == "prompts":
            return F.decode_texts(column("prompt"), column("prompt_messages"))
        if name == "completions":
            return F.decode_texts(column("completion"), column("completion_messages"))
        meta = column("metadata")
        return None if meta is None else F.decode_info(meta)

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        columns = self.flat_columns(obj)
        prompt = columns["prompt"]
        assert prompt is not None  # prompts are required
        if not pa.types.is_dictionary(prompt.type):
            # The prompt repeats K times per group: a dictionary keeps one copy of each.
            columns["prompt"] = prompt = prompt.dictionary_encode()
        return make_batch(self.name, columns, {}, len(prompt))

    def flat_columns(self, obj) -> dict[str, pa.Array | None]:
        """The columns, checked (prompts as plain strings, not dictionary-encoded)."""
        columns: dict[str, pa.Array | None] = {}
        for field, names in self.parts.items():
            source = lazy(obj, field)
            if source is not None:
                columns.update({n: source.column(n) for n in names})
                continue
            value = obj.__dict__[field]
            owner = f"{self.name}.{field}"
            if field == "metadata":
                columns["metadata"] = None if value is None else F.info_array(owner, value)
            else:
                text, messages = F.text_arrays(owner, value, text_of_messages=field != "prompts")
                columns[names[0]], columns[names[1]] = text, messages
        prompt = columns["prompt"]
        assert prompt is not None  # prompts are required
        n = len(prompt)
        for field, column in (("completions", "completion"), ("metadata", "metadata")):
            value = columns[column]
            if value is not None and len(value) != n:
                raise LayoutError(
                    f"{self.name}.{field}: expected {n} entries (one per prompt), got {len(value)}"
                )
        return columns


# ---------------------------------------------------------------------------- grouped pairs
def grouped_floats(field: str, value: Any) -> pa.Array:
    """Groups of floats as ``list<double>``."""
    return _grouped_flat(field, value, F.float_array)


class GroupedPairLayout(BoundLayout):
    """``grouped`` and ``samples`` in one ``list<double>`` column (``samples`` is its child)."""

    def __init__(self, column: str):
        self.column = column
        self.columns = {column: ("grouped", "samples")}
        self.field_columns = {"grouped": (column, False), "samples": (column, True)}

    def check(self, cls, batch, meta, given=()):
        require(self.name, batch, self.column, _FLOAT_LIST, "list<double>")

    def field(self, obj, source, name, *, cache=True):
        array = source.column(self.column)
        assert array is not None  # check() required it
        return array.to_pylist() if name == "grouped" else array.flatten().to_pylist()

    def encode(self, obj) -> pa.RecordBatch:
        source = self.untouched(obj)
        if source is not None:
            return source.batch
        grouped = self.grouped(obj)
        return make_batch(self.name, {self.column: grouped}, {}, len(grouped))

    def grouped(self, obj) -> pa.Array:
        """The checked column: ``grouped`` converted, ``samples`` compared with it."""
        name, state = self.name, obj.__dict__
        source = state.get(SOURCE)
        if "grouped" in state or source is None:
            array = grouped_floats(f"{name}.grouped", state["grouped"])
        else:
            array = source.column(self.column)
        flat = array.flatten()
        if "samples" not in state and source is not None:
            samples = source.column(self.column).flatten()
        else:
            samples = F.float_array(f"{name}.samples", state["samples"])
        if samples is flat:
            return array
        if len(samples) != len(flat):
            raise LayoutError(
                f"{name}.samples: expected {len(flat)} values (sum of group sizes), "
                f"got {len(samples)}"
            )
        a = np.asarray(flat.to_numpy(zero_copy_only=False))
        b = np.asarray(samples.to_numpy(zero_copy_only=False))
        differ = np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))))
        if differ.size:
            i = int(differ[0])
            offsets = list_offsets(array)
            g = int(np.searchsorted(offsets, i, side="right") - 1)
            raise LayoutError(
                f"{name}.samples: value {i} is {float(b[i])!r} but grouped[{g}]"
                f"[{i - int(offsets[g])}] is {float(a[i])!r}; samples must be grouped flattened"
            )
        return array


def sample_messages(completion_messages: pa.Array | None, offsets: np.ndarray) -> pa.Array | None:
    """``GenerationBatch``'s ``completion_messages`` (per group, null for string groups) as one
    message list per sample (null where the completion is a string), in flat order."""
    if completion_messages is None or completion_messages.null_count == len(completion_messages):
        return None
    sizes = np.diff(offsets)
    is_group = np.asarray(completion_messages.is_valid().to_numpy(zero_copy_only=False))
    is_sample = np.repeat(is_group, sizes)
    index = np.cumsum(is_sample) - 1
    return completion_messages.flatten().take(pa.array(index, mask=~is_sample))
