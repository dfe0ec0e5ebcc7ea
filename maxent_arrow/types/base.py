"""The machinery of the seed classes: plain Python fields, Arrow underneath.

A record is a dataclass whose fields hold exactly what they were given (real ``list`` and
``dict`` objects, tensors, placeholders), as the seed's dataclasses do: construction stores and
checks nothing. An object built by ``from_arrow`` keeps its record batch (its *source*) and
fills a field from it on first attribute access. Each field is a non-data descriptor on the
class (:class:`FieldSlot`), which Python consults only when the instance ``__dict__`` lacks the
name: it decodes the whole field and stores it there, so every later read and every write is a
plain attribute operation (a lazily filled ``list`` subclass would not do: ``json``,
``pickle``, ``list()`` and ``+`` read the C array). Read on the class, the descriptor gives the
seed's class-level default (``GenerationBatch.grouped_completion_info is None``) or raises
``AttributeError`` for a field without one, as a plain dataclass does. The classes define no
``__getattr__``, so a missing attribute costs what it costs on a plain dataclass.

A field that is still in the source (never read into Python) is *untouched*; ``to_arrow()``
takes its columns as they are, so an untouched object gives back its own record batch (O(1))
and a read field is encoded again from its current value (edits included). Validation happens
there, at the Arrow boundary, never at construction.

``==`` is the plain dataclass's: the tuples of the fields compared (so a field holding a
multi-element tensor makes ``==`` raise, as it does on the seed's classes); an untouched field
is compared without being kept in Python. :func:`records_equal` is the comparison of values
that a round trip through Arrow keeps (NaN equal to NaN, tensors and lists by value).

``dataclasses.replace`` reads every field it does not change, which decodes it (and keeps it on
the old object); :func:`evolve` is the same call without that: the fields it does not change
stay undecoded in Arrow on both objects (nested records are decoded and shared, see
:attr:`Layout.shared_on_replace`).
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
    "FieldSlot",
    "Layout",
    "Record",
    "Source",
    "born",
    "evolve",
    "layout_of",
    "lazy",
    "peek",
    "record",
    "records_equal",
    "source_of",
    "untouched_from",
    "values_equal",
]

SOURCE = "_arrow"  # the instance-dict key of an Arrow-born object's source


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


class FieldSlot:
    """A seed field on its class: decodes an Arrow-born object's field on first read.

    A non-data descriptor (no ``__set__``): Python calls :meth:`__get__` only while the
    instance ``__dict__`` lacks the name, so a filled field reads and writes as a plain
    attribute. On the class it gives the field's default, as the seed's dataclass does, or
    raises ``AttributeError`` for a field without one.
    """

    __slots__ = ("name", "default")

    def __init__(self, name: str, default: Any = dataclasses.MISSING):
        self.name = name
        self.default = default

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            if self.default is dataclasses.MISSING:
                kind = owner.__name__ if owner is not None else "?"
                raise AttributeError(f"type object {kind!r} has no attribute {self.name!r}")
            return self.default
        state = obj.__dict__
        source = state.get(SOURCE)
        if source is None:  # a Python-born object whose field was deleted: the class's view
            if self.default is dataclasses.MISSING:
                raise AttributeError(
                    f"{type(obj).__name__!r} object has no attribute {self.name!r}"
                )
            return self.default
        value = type(obj)._layout.field(obj, source, self.name)
        state[self.name] = value
        return value

    def __repr__(self) -> str:
        return f"FieldSlot({self.name!r}, default={self.default!r})"


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
        return getattr(obj, name)  # the class default, or AttributeError, as a dataclass
    return type(obj)._layout.field(obj, source, name, cache=False)


def evolve(record: Any, /, **changes: Any) -> Any:
    """A copy of ``record`` with ``changes``: ``dataclasses.replace`` that keeps Arrow.

    ``dataclasses.replace(record, ...)`` works on every record and gives the same values, but
    it reads each field it copies, which decodes an Arrow-born record's fields into Python
    (and keeps them on ``record``). ``evolve`` copies without reading: a field that is still
    undecoded in ``record``'s record batch stays so in both objects (``to_arrow()`` of the new
    one reuses those columns as they are), a field already in Python is shared, as
    ``replace`` shares it, and the changes are kept as given. Nested records
    (``RewardComputation.advantage``, ``LossOutputs.scalars``, ...) are decoded and shared,
    so an in-place edit of one reaches both objects, as with ``replace``.

    Parameters
    ----------
    record:
        A seed record (any other dataclass instance is handed to ``dataclasses.replace``).
    **changes:
        New values of fields, by name.

    Returns
    -------
    A new object of ``type(record)``. Like ``replace`` on a record (whose ``__init__`` only
    stores its arguments), it holds exactly the given and copied values.

    Raises
    ------
    TypeError
        A change names no field of the class (as ``dataclasses.replace`` raises).
    """
    if not isinstance(record, Record):
        return dataclasses.replace(record, **changes)
    cls = type(record)
    layout = cls._layout
    unknown = [name for name in changes if name not in layout.field_names]
    if unknown:
        raise TypeError(f"evolve: {cls.__name__} has no field {unknown[0]!r}")
    state = record.__dict__
    source = state.get(SOURCE)
    if source is None:
        return dataclasses.replace(record, **changes)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        name = f.name
        if name in changes:
            values[name] = changes[name]
        elif name in state:
            values[name] = state[name]
        elif name in layout.shared_on_replace:
            values[name] = getattr(record, name)
    return born(cls, source, **values)


class Layout(abc.ABC):
    """How one seed class lives in Arrow: checks a batch, decodes a field, encodes a record.

    Subclasses implement :meth:`check` (the cheap schema checks of ``from_arrow``),
    :meth:`field` and :meth:`encode` (which validates and reuses untouched columns), and name
    in ``columns`` the fields behind each column, for :meth:`Record.column`.
    """

    field_names: frozenset[str] = frozenset()  # set by `record`
    columns: dict[str, tuple[str, ...]] = {}  # a class default; `bind` may set its own
    # Fields that :func:`evolve` decodes (cheap nested records), so that the new object shares
    # them with the old one, as the seed's ``replace`` shares every field.
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

    if TYPE_CHECKING:  # set by `record`; not a run-time annotation, so that
        # `typing.get_type_hints` of a record gives its fields only, as on the seed's classes
        _layout: ClassVar[Layout]
        # What `dataclass` sets on each subclass (declared for checkers: `dataclasses.fields`).
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    # Mutable records are unhashable, like the seed's dataclasses (typeshed declares
    # `object.__hash__` a method; None is the data model's way to remove it).
    __hash__ = None  # pyright: ignore[reportAssignmentType]

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

    # ------------------------------------------------------------------ Python protocols
    def __eq__(self, other: object) -> bool:
        # The plain dataclass's `==` (`other.__class__ is self.__class__`, then the tuples of
        # the fields), so values compare as they do on the seed's classes: a multi-element
        # tensor raises, a NaN equals only itself. An untouched field is decoded for the
        # comparison only; one untouched in both objects over the same batch is one value.
        if other.__class__ is not self.__class__:
            return NotImplemented
        mine, theirs = self.__dict__, other.__dict__
        same = mine.get(SOURCE) is not None and mine.get(SOURCE) is theirs.get(SOURCE)
        left, right = [], []
        for f in dataclasses.fields(self):
            name = f.name
            if same and name not in mine and name not in theirs:
                left.append(name)  # the same str object on both sides: `==` by identity
                right.append(name)
            else:
                left.append(peek(self, name))
                right.append(peek(other, name))
        return tuple(left) == tuple(right)

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
    """Class decorator (over ``@dataclass(eq=False, repr=False)``): attach the layout and put a
    :class:`FieldSlot` on the class for each field (its default kept there, as on a dataclass).

    ``__init__`` is the one ``dataclass`` writes: it stores each argument as given.
    """

    def decorate(cls: R) -> R:
        cls._layout = layout
        layout.bind(cls)
        fields = dataclasses.fields(cls)
        layout.field_names = frozenset(f.name for f in fields)
        for f in fields:
            # Each field a FieldSlot (the class default on the class, the lazy decode on an
            # Arrow-born object). A store still goes straight to the instance dict (no
            # __set__); CPython 3.11 does not specialise it, ~10 ns a field at construction.
            setattr(cls, f.name, FieldSlot(f.name, f.default))
        return cls

    return decorate


# ---------------------------------------------------------------------------- equality
def records_equal(a: Any, b: Any) -> bool:
    """Whether two records hold the same values, as a round trip through Arrow keeps them.

    ``==`` on records is the plain dataclass's, as on the seed's classes: a field holding a
    multi-element tensor makes it raise, and a NaN equals only itself, so
    ``C.from_arrow(x.to_arrow()) == x`` cannot hold for such records. This compares field by
    field with :func:`values_equal` instead: NaN equal to NaN, tensors of one dtype and shape
    by value, lists, numpy arrays and tensors against each other by their values, nested
    records recursively. Untouched fields are not kept in Python.

    Parameters
    ----------
    a, b:
        Two records (or any dataclass instances) of the same class.

    Returns
    -------
    ``False`` for objects of different classes.
    """
    if a is b:
        return True
    if type(a) is not type(b) or not dataclasses.is_dataclass(a) or isinstance(a, type):
        return False
    read = peek if isinstance(a, Record) else getattr
    return all(values_equal(read(a, f.name), read(b, f.name)) for f in dataclasses.fields(a))


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
    if isinstance(a, Record) and type(a) is type(b):
        return records_equal(a, b)
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
