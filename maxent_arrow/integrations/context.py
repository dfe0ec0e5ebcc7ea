"""The context a rollout needs besides itself: which dataset example each group came from
(``example_id``), the dataset columns a user asked to keep (``ds_<name>``), the reference
answer as text, and the columns reward functions logged (``extra_<name>``).

User columns (``ds_`` and ``extra_``; :data:`maxent_arrow.arrow.registry.PREFIXES`) have names
and types only a run knows. :class:`UserColumns` holds a run's: each is declared once, with
its Arrow type (a dataset column's from the dataset's features, a logged column's from the
first values logged), and every append of the run then carries every declared column (null
where a round has no value), so all files of a run keep one schema. A value that does not fit
its column's type is refused with a :class:`~maxent_arrow.errors.SchemaError` naming the
column and the position, before anything is written.

Typing of logged values (``extra_``), as JSON sees them: bools are ``bool``, numbers (ints
and floats alike, numpy scalars included) ``double``, text ``string``; any other JSON value
(a list, a dict) is stored as its JSON text in a ``string`` column. ``None`` is a null item.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import SchemaError
from maxent_arrow.integrations.messages import json_text

__all__ = [
    "DATASET",
    "EXTRA",
    "INDEX_KEY",
    "UserColumns",
    "answer_text",
    "dataset_types",
    "example_id_array",
    "with_index",
]

DATASET, EXTRA = (p.prefix for p in R.PREFIXES)  # "ds_", "extra_"
# The key a recorder adds to each dataset row: the row's index in its dataset (the default
# example id). Reward functions receive it among their keyword arguments.
INDEX_KEY = "maxent_example_index"


# ---------------------------------------------------------------------------- the dataset
def with_index(dataset: Any) -> Any:
    """``dataset`` with :data:`INDEX_KEY` (each row's index) in every row: a Hugging Face
    ``Dataset`` gets a column (``add_column``: one int64 array, the rows are not copied), an
    ``IterableDataset`` a lazy ``map``, a dict of datasets each; ``None`` stays ``None``."""
    if dataset is None:
        return None
    if isinstance(dataset, Mapping):  # a dict of datasets, or a DatasetDict: of its own type
        indexed = {name: with_index(d) for name, d in dataset.items()}
        return indexed if type(dataset) is dict else cast(Any, type(dataset))(indexed)
    names = _column_names(dataset)
    if names is not None and INDEX_KEY in names:
        return dataset
    if hasattr(dataset, "add_column") and hasattr(dataset, "__len__"):
        return dataset.add_column(INDEX_KEY, np.arange(len(dataset), dtype=np.int64))
    if hasattr(dataset, "map"):
        return dataset.map(lambda row, i: {INDEX_KEY: i}, with_indices=True)
    raise SchemaError(
        f"with_index: expected a Hugging Face Dataset or IterableDataset, got "
        f"{type(dataset).__name__}"
    )


def _column_names(dataset: Any) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    return list(names) if names is not None else None


def dataset_types(dataset: Any) -> dict[str, pa.DataType] | None:
    """The Arrow type of each column of a Hugging Face dataset (from its features), or
    ``None`` when it has none (an ``IterableDataset`` without features)."""
    if isinstance(dataset, Mapping):  # several eval datasets: the first one's
        dataset = next(iter(dataset.values()), None)
    features = getattr(dataset, "features", None)
    if features is None:
        return None
    return {f.name: f.type for f in features.arrow_schema}


def answer_text(value: Any, *, where: str) -> str | None:
    """The ``answer`` column's text of a dataset value: a string as given, any other JSON value
    as its JSON text (``42``, ``[1, 2]``); ``None`` stays ``None``. A value JSON cannot hold
    raises :class:`SchemaError`."""
    if value is None or isinstance(value, str):
        return value
    return json_text(value, where=where)


def example_id_array(values: Sequence[Any], *, where: str) -> pa.Array:
    """The ``example_id`` column: text as given, an index or another JSON value as its JSON
    text (an int ``17`` is ``"17"``)."""
    return pa.array([answer_text(v, where=f"{where} row {i}") for i, v in enumerate(values)],
                    pa.string())  # fmt: skip


# ---------------------------------------------------------------------------- user columns
class UserColumns:
    """A run's user columns (``ds_<name>``, ``extra_<name>``), each with its Arrow type, in
    declaration order. Declared once per run; an append carries all of them
    (:meth:`complete`).

    Parameters
    ----------
    declared:
        Columns already declared (``{column: type}``), e.g. those of a store a resumed run
        appends to.
    """

    def __init__(self, declared: Mapping[str, pa.DataType] | None = None) -> None:
        self.types: dict[str, pa.DataType] = {}
        for name, kind in (declared or {}).items():
            self.declare(name, kind)

    @classmethod
    def of_schema(cls, schema: pa.Schema) -> UserColumns:
        """The user columns of a stored group schema (a run being resumed)."""
        return cls({f.name: f.type for f in schema if R.prefix_of(f.name) is not None})

    def __contains__(self, name: object) -> bool:
        return name in self.types

    def declare(self, name: str, kind: pa.DataType) -> None:
        """Declare column ``name`` (with its prefix) of type ``kind``; a second declaration
        must agree."""
        prefix = R.prefix_of(name)
        if prefix is None:
            raise SchemaError(
                f"UserColumns: {name!r}: a user column's name starts with one of "
                f"{[p.prefix for p in R.PREFIXES]}"
            )
        if prefix.level == "completion" and not pa.types.is_list(kind):
            kind = pa.list_(kind)  # the items stay nullable: a function may log None
        kind = _named_alike(kind)
        known = self.types.get(name)
        if known is not None and known != kind:
            raise SchemaError(
                f"UserColumns: column {name!r} is declared {known} in this run, got {kind}"
            )
        self.types[name] = kind

    def dataset_column(self, name: str, values: Sequence[Any], *, where: str) -> pa.Array:
        """The group-level column ``ds_<name>`` of per-group ``values``, in its declared type
        (declared now, from the values, when it is not: an all-null column as ``string``)."""
        column = DATASET + name
        kind = self.types.get(column)
        if kind is None:
            try:
                inferred = pa.array(list(values))
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise SchemaError(
                    f"{where}: dataset column {name!r}: no Arrow type ({exc})"
                ) from None
            self.declare(column, pa.string() if pa.types.is_null(inferred.type) else inferred.type)
            kind = self.types[column]
        return _typed(list(values), kind, where=f"{where}: dataset column {name!r}")

    def extra_values(self, name: str, values: Sequence[Any], *, where: str) -> pa.Array:
        """The flat per-completion values of ``extra_<name>`` (one per completion), in the
        column's type (declared now, from the values, when it is not)."""
        column = EXTRA + name
        if column not in self.types:
            self.declare(column, _json_type(values))
        item = self.types[column].value_type
        where = f"{where}: log_extra column {name!r}"
        if pa.types.is_string(item):
            text = [_text(v, where=f"{where} completion {i}") for i, v in enumerate(values)]
            return pa.array(text, pa.string())
        return _typed([_number(v) if pa.types.is_floating(item) else v for v in values],
                      item, where=where)  # fmt: skip

    def undeclared(self, names: Iterable[str], prefix: str) -> list[str]:
        """Those of ``names`` (without ``prefix``) whose column is not declared."""
        return [n for n in names if prefix + n not in self.types]

    def complete(self, table: pa.Table) -> pa.Table:
        """``table`` with every declared column, after its other columns and in declaration
        order (so every append of a run has one column order): those it lacks as nulls."""
        own = [n for n in table.column_names if n not in self.types]
        out = table.select(own)
        for name, kind in self.types.items():
            if name in table.column_names:
                out = out.append_column(table.schema.field(name), table.column(name))
            else:
                out = out.append_column(pa.field(name, kind), pa.nulls(table.num_rows, kind))
        return out.replace_schema_metadata(table.schema.metadata)


def _named_alike(kind: pa.DataType) -> pa.DataType:
    """``kind`` with Arrow's default child names (``item``) at every list level: Parquet
    readers name them ``element``, and a type read back from a run's files must equal the one
    declared when it started."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        field = kind.value_field
        item = pa.field("item", _named_alike(field.type), nullable=field.nullable)
        return pa.list_(item) if pa.types.is_list(kind) else pa.large_list(item)
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_named_alike(f.type)) for f in kind])
    return kind


def _json_type(values: Sequence[Any]) -> pa.DataType:
    """The item type of logged ``values`` (see the module doc)."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool | np.bool_) for v in present):
        return pa.bool_()
    if present and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_) for v in present
    ):
        return pa.float64()
    return pa.string()


def _number(value: Any) -> Any:
    """A number as a float (ints too); anything else as given (refused by the cast)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
        return float(value)
    return value


def _text(value: Any, *, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json_text(value, where=where)


def _typed(values: list[Any], kind: pa.DataType, *, where: str) -> pa.Array:
    """``values`` as an array of ``kind``; a value that does not fit is named by position."""
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    for i, value in enumerate(values):
        try:
            pa.array([value], kind)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            raise SchemaError(
                f"{where} at position {i}: expected {kind} (the run's type of this column), "
                f"got {type(value).__name__} {json.dumps(value, default=repr)[:80]}"
            ) from None
    raise SchemaError(f"{where}: expected values of {kind}")  # pragma: no cover
