"""The machinery of the seed classes: plain Python fields, Arrow underneath.

A record is a dataclass whose fields hold exactly what they were given (real ``list`` and
``dict`` objects, tensors, placeholders), as the seed's dataclasses do: construction stores and
checks nothing. An object built by ``from_arrow`` keeps its record batch (its *source*) and
fills a field from it on first attribute access: :meth:`Record.__getattr__`, which Python calls
only for attributes the instance lacks, decodes the whole field and stores it in the instance
``__dict__``, so every later read and every write is a plain attribute operation (a lazily
filled ``list`` subclass would not do: ``json``, ``pickle``, ``list()`` and ``+`` read the C
array). The classes keep no attribute named like a field, so construction runs at the speed of
a plain dataclass's.

A field that is still in the source (never read into Python) is *untouched*; ``to_arrow()``
takes its columns as they are, so an untouched object gives back its own record batch (O(1))
and a read field is encoded again from its current value (edits included). Validation happens
there, at the Arrow boundary, never at construction.

``dataclasses.replace`` reads every field it does not change; to keep those in Arrow, the
descriptor recognises the call (by its code object, see :func:`_from_replace`) and hands over
a :class:`_Deferred` marker that the new object's ``__init__`` turns back into a lazy field.
The new object then decodes such a field on its own: unlike the seed's ``replace``, an
unchanged list field of an Arrow-born record is equal in both objects, not the same list
(nested records are decoded and shared, see :attr:`Layout.shared_on_replace`).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import io
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import Ragged, arrow_to_torch
from maxent_arrow.errors import SchemaError
from maxent_arrow.types.columns import read_batch

if TYPE_CHECKING:
    import torch

__all__ = [
    "SOURCE",
    "Layout",
    "Record",
    "Source",
    "born",
    "layout_of",
    "lazy",
    "peek",
    "record",
    "source_of",
    "untouched_from",
    "values_equal",
]

SOURCE = "_arrow"  # the instance-dict key of an Arrow-born object's source

# The code objects whose attribute reads are `dataclasses.replace` copying unchanged fields.
_REPLACE_CODES = frozenset(
    f.__code__ for f in (dataclasses.replace, getattr(dataclasses, "_replace", None)) if f
)
# Deferred fields handed out and not yet adopted by a new object's __init__ (a cheap global
# test there; `+=` on a list cell does not release the GIL midway in CPython).
_PENDING = [0]


class Source:
    """The Arrow side of an Arrow-born record: its record batch and parsed scalar metadata."""

    __slots__ = ("batch", "meta", "origin")

    def __init__(self, batch: pa.RecordBatch, meta: dict[str, Any], origin: Source | None = None):
        self.batch = batch
        self.meta = meta
        # The source a nested record was decoded from (its columns are views of that one's).
        self.origin = origin

    def column(self, name: str) -> pa.Array | None:
        index = self.batch.schema.get_field_index(name)
        return None if index < 0 else self.batch.column(index)


class _Deferred:
    """A field ``dataclasses.replace`` copies without reading: the source and the name."""

    __slots__ = ("source", "name")

    def __init__(self, source: Source, name: str):
        self.source = source
        self.name = name


def _from_replace(fields: frozenset[str]) -> bool:
    """Whether ``dataclasses.replace`` is reading the field, for a call that will succeed."""
    # Frame 1 is Record.__getattr__, called by `getattr` (a builtin, no frame) in frame 2.
    frame = sys._getframe(2)
    if frame.f_code not in _REPLACE_CODES:
        return False
    # A change naming no field makes the constructor call fail: then a deferred field would
    # never be adopted (and every later __init__ would look for one), so it is read instead.
    changes = frame.f_locals.get("changes", {})
    return all(name in fields for name in changes)


def _adopt(obj: Any) -> None:
    """Turn the ``_Deferred`` values ``__init__`` just stored back into lazy fields."""
    state = obj.__dict__
    found = [name for name, value in state.items() if type(value) is _Deferred]
    for name in found:
        state[SOURCE] = state.pop(name).source
    _PENDING[0] = max(_PENDING[0] - len(found), 0)


def born(cls: type[Record], source: Source, **fields: Any) -> Any:
    """An object of ``cls`` over ``source``; ``fields`` are set as given, the rest stay lazy."""
    obj = cls.__new__(cls)
    obj.__dict__[SOURCE] = source
    obj.__dict__.update(fields)
    return obj


def layout_of(record: Any) -> Layout:
    """The :class:`Layout` of a record class or instance."""
    return record._layout


def untouched_from(value: Any, source: Source) -> bool:
    """Whether ``value`` is a record decoded from ``source`` and never read since."""
    state = getattr(value, "__dict__", None)
    if not isinstance(value, Record) or state is None:
        return False
    own = state.get(SOURCE)
    return (
        own is not None and own.origin is source and not (state.keys() & value._layout.field_names)
    )


def source_of(obj: Any) -> Source | None:
    """The source of an Arrow-born record (``None`` for a Python-born one)."""
    return obj.__dict__.get(SOURCE)


def lazy(obj: Any, *names: str) -> Source | None:
    """The source if every named field of ``obj`` is still untouched in it, else ``None``."""
    state = obj.__dict__
    source = state.get(SOURCE)
    if source is None or any(name in state for name in names):
        return None
    return source


def peek(obj: Any, name: str) -> Any:
    """A field's value without materialising it on ``obj`` (for ``==`` and ``repr``)."""
    state = obj.__dict__
    if name in state:
        return state[name]
    source = state.get(SOURCE)
    if source is None:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    return type(obj)._layout.field(obj, source, name, cache=False)


class Layout(abc.ABC):
    """How one seed class lives in Arrow: checks a batch, decodes a field, encodes a record.

    Subclasses implement :meth:`check` (the cheap schema checks of ``from_arrow``),
    :meth:`field` and :meth:`encode` (which validates and reuses untouched columns), and name
    in ``columns`` the fields behind each column, for :meth:`Record.column`.
    """

    field_names: frozenset[str] = frozenset()  # set by `record`
    columns: dict[str, tuple[str, ...]] = {}  # a class default; `bind` may set its own
    # Fields decoded even under ``dataclasses.replace`` (cheap nested records), so that the new
    # object shares them with the old one, as the seed's ``replace`` shares every field.
    shared_on_replace: ClassVar[frozenset[str]] = frozenset()
    # Field name -> (column, flatten): the Arrow array of a list-typed field.
    field_columns: dict[str, tuple[str, bool]] = {}

    def bind(self, cls: type) -> None:  # noqa: B027 - an optional hook, empty by default
        """Called once with the class the layout belongs to."""

    @abc.abstractmethod
    def check(self, cls: type, batch: pa.RecordBatch, meta: dict[str, Any], given=()) -> None:
        """The cheap checks of ``from_arrow`` (columns and types; ``given`` fields skipped)."""

    @abc.abstractmethod
    def field(self, obj: Any, source: Source, name: str, *, cache: bool = True) -> Any:
        """Field ``name`` of ``obj`` decoded from ``source`` (kept on ``obj`` when ``cache``)."""

    @abc.abstractmethod
    def encode(self, obj: Any) -> pa.RecordBatch:
        """``obj`` as one checked record batch (untouched columns reused)."""

    def encode_column(self, obj: Any, name: str) -> pa.Array | None:
        """Column ``name`` alone, checked, when it can be made without the whole record
        (``None``: :meth:`Record.column` encodes the record)."""
        return None


class Record:
    """Base of the 14 Arrow-backed seed classes (see the module docstring)."""

    _layout: ClassVar[Layout]
    # What `dataclass` sets on each subclass (declared for checkers: `dataclasses.fields`).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    # Mutable records are unhashable, like the seed's dataclasses (typeshed declares
    # `object.__hash__` a method; None is the data model's way to remove it).
    __hash__ = None  # pyright: ignore[reportAssignmentType]

    def __post_init__(self) -> None:
        # One cheap test: fields `dataclasses.replace` passed on without reading them.
        if _PENDING[0]:
            _adopt(self)

    # ------------------------------------------------------------------ Arrow
    def to_arrow(self) -> pa.RecordBatch:
        """This record as an Arrow record batch, as it is now (in-place edits included).

        Validates: values Arrow cannot hold faithfully (lengths that disagree, stand-in
        objects, ``None`` where a value is required) raise :class:`~maxent_arrow.SchemaError`
        or :class:`~maxent_arrow.LayoutError` naming the field and position. Tensors are
        converted with ``.detach().cpu()``. An untouched Arrow-born record returns its own
        batch (O(1)); fields never read are taken from it without conversion.
        """
        return type(self)._layout.encode(self)

    def validate(self) -> None:
        """Run the checks of :meth:`to_arrow` now (construction checks nothing)."""
        self.to_arrow()

    @classmethod
    def from_arrow(cls, data: pa.RecordBatch | pa.Table, **fields: Any):
        """Rebuild from ``to_arrow()`` output (also after a Parquet or IPC round trip).

        The batch is kept; fields are decoded into Python on first access, and
        :meth:`column`, :meth:`ragged` and :meth:`tensor` view it without copying. Fields
        given as keywords are set as given instead (their columns may then be absent).
        """
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"{cls.__name__}.from_arrow: unknown fields {sorted(unknown)}")
        batch, meta = read_batch(cls.__name__, data)
        cls._layout.check(cls, batch, meta, set(fields))
        return born(cls, Source(batch, meta), **fields)

    # ------------------------------------------------------------------ zero-copy access
    def column(self, name: str) -> pa.Array:
        """The Arrow array of column ``name`` of :meth:`to_arrow`'s layout, or of list field
        ``name`` (a ``grouped`` field as a list array, a flat one as a flat array).

        Taken from the source without copying while the fields behind it are untouched;
        otherwise encoded (and checked) from their current values.
        """
        layout = type(self)._layout
        flatten = False
        if name in layout.field_columns:
            name, flatten = layout.field_columns[name]
        elif name not in layout.columns:
            known = sorted(set(layout.columns) | set(layout.field_columns))
            raise SchemaError(f"{type(self).__name__}.column: unknown column {name!r} ({known})")
        source = lazy(self, *layout.columns[name])
        array = source.column(name) if source is not None else layout.encode_column(self, name)
        if array is None:
            batch = self.to_arrow()
            index = batch.schema.get_field_index(name)
            if index < 0:
                raise SchemaError(f"{type(self).__name__}.column: {name!r} holds no data")
            array = batch.column(index)
        return array.flatten() if flatten else array

    def ragged(self, name: str) -> Ragged:
        """A list column or grouped field as :class:`~maxent_arrow.Ragged` (zero-copy values)."""
        return Ragged.from_arrow(self.column(name))

    def tensor(self, name: str) -> torch.Tensor:
        """A flat numeric column or field as a zero-copy torch view of its Arrow buffer."""
        return arrow_to_torch(self.column(name), field=f"{type(self).__name__}.{name}")

    # ------------------------------------------------------------------ lazy fields
    def __getattr__(self, name: str) -> Any:
        # Python calls this only for an attribute missing from the instance and the class: a
        # field of an Arrow-born record not read yet (the class keeps no field defaults), or
        # a genuinely missing attribute. Filled fields and every write never come here.
        state = self.__dict__
        source = state.get(SOURCE)
        layout = type(self)._layout
        if source is None or name not in layout.field_names:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name not in layout.shared_on_replace and _from_replace(layout.field_names):
            _PENDING[0] += 1
            return _Deferred(source, name)
        value = layout.field(self, source, name)
        state[name] = value
        return value

    # ------------------------------------------------------------------ Python protocols
    def __eq__(self, other: object) -> bool:
        # Field by field, NaN equal to NaN, tensors by value: a NaN that went through Arrow is
        # a new float, never `==` to the old one.
        if type(other) is not type(self):
            return NotImplemented
        return all(
            values_equal(peek(self, f.name), peek(other, f.name)) for f in dataclasses.fields(self)
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={peek(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__qualname__}({inner})"

    def __copy__(self):
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            # The source batch is immutable: shared, not copied.
            new.__dict__[key] = value if key == SOURCE else copy.deepcopy(value, memo)
        return new

    def __reduce__(self):
        # Python values as pickle writes them; an Arrow-born record's batch as Arrow IPC bytes
        # (compact, not one Python float per value).
        state = {k: v for k, v in self.__dict__.items() if k != SOURCE}
        source = self.__dict__.get(SOURCE)
        ipc = None if source is None else _ipc_bytes(source.batch)
        return (_rebuild, (type(self), ipc, state))


def _ipc_bytes(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _rebuild(cls: type[Record], ipc: bytes | None, state: dict[str, Any]):
    obj = cls.__new__(cls)
    if ipc is not None:
        with pa.ipc.open_stream(io.BytesIO(ipc)) as reader:
            batch = reader.read_next_batch()
        obj.__dict__[SOURCE] = Source(*read_batch(cls.__name__, batch))
    obj.__dict__.update(state)
    return obj


# ---------------------------------------------------------------------------- the decorator
R = TypeVar("R", bound="type[Record]")


def record(layout: Layout) -> Callable[[R], R]:
    """Class decorator (over ``@dataclass(eq=False, repr=False)``): attach the layout and drop
    the class-level field defaults (``fields()`` and the generated ``__init__`` keep them).

    ``__init__`` is the one ``dataclass`` writes: it stores each argument as given; then
    :meth:`Record.__post_init__` adopts fields ``dataclasses.replace`` passed on unread.
    """

    def decorate(cls: R) -> R:
        cls._layout = layout
        layout.bind(cls)
        fields = dataclasses.fields(cls)
        layout.field_names = frozenset(f.name for f in fields)
        for f in fields:
            # No class attribute may shadow a field: a missing field must reach __getattr__
            # (and a class attribute of the same name would slow every instance store).
            if f.name in cls.__dict__:
                delattr(cls, f.name)
        return cls

    return decorate


# ---------------------------------------------------------------------------- equality
def values_equal(a: Any, b: Any) -> bool:
    """Equality of field values: NaN equals NaN; tensors of one dtype and shape by value;
    lists, tuples, numpy arrays and tensors against each other by their values."""
    if a is b:
        return True
    kind_a, kind_b = _array_kind(a), _array_kind(b)
    if kind_a == "tensor" and kind_b == "tensor":
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return bool((a == b).all())
    if kind_a or kind_b:
        a = a.tolist() if kind_a else a
        b = b.tolist() if kind_b else b
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return False
        try:
            if a == b:
                return True
        except (ValueError, RuntimeError):  # items that refuse `==` (arrays): go item by item
            pass
        return all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (ValueError, RuntimeError):
        return False


def _array_kind(value: Any) -> str | None:
    if isinstance(value, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return "tensor"
    return None
