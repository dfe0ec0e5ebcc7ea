"""A checkpoint of the commit log: the state at one version as a Parquet file, so that a
reader applies at most :data:`~maxent_arrow.store.history.log.CHECKPOINT_EVERY` entries after
it, and a plain reader (DuckDB, Polars) finds the live files of every table in one place
(``docs/commit-protocol.md``, "Plain readers").

One row per live item: a unit's step file and its group file, a record table's file, an
attempt, a file retiring. Typed columns for plain readers (``kind``, ``path``, ``effective``,
``cutoff``), the item itself as JSON; a unit's step rows and counts (``rows``, ``summary``) in
columns of their own, read when first asked for (:class:`LazyRecord`, :class:`LazyRows`), so
opening a long run's checkpoint parses no unit.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.store.history.operations import LOG_FORMAT
from maxent_arrow.store.history.state import (
    Attempt,
    LogState,
    UnitEntry,
    summary_text,
    unit_from_item,
    unit_item,
    unit_kind,
)
from maxent_arrow.store.storage.names import GROUPS

__all__ = [
    "CHECKPOINT_ROW_GROUP",
    "LazyRecord",
    "LazyRows",
    "checkpoint_bytes",
    "checkpoint_table",
    "state_from_checkpoint",
    "state_from_table",
]

_UNIT_ROWS = ("step_file", "group_file")  # a checkpoint's rows of a unit
# A checkpoint's row groups of units (two rows each: the step file and the group file).
CHECKPOINT_ROW_GROUP = 1024


class ParsedOnUse(dict):
    """A ``dict`` whose contents are parsed from text when first used (:meth:`_load`): the
    lookups, views, equality and pickling of its subclasses go through here."""

    __slots__ = ()
    _load: Callable[[], None]  # each subclass parses its own text

    def __getitem__(self, key: str) -> Any:
        self._load()
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._load()
        return super().get(key, default)

    def values(self) -> Any:
        self._load()
        return super().values()

    def items(self) -> Any:
        self._load()
        return super().items()

    def __eq__(self, other: object) -> bool:
        self._load()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (dict, (dict(self.items()),))


class LazyRows(ParsedOnUse):
    """A unit's step rows (column name -> values) as a checkpoint holds them: JSON text,
    parsed when a value is first asked for. The column names are known without parsing, so
    a reader that needs only a file's schema or record (SQL views over a long run's
    checkpoint) never parses its rows. Behaves as the parsed ``dict`` in every other way
    (``json.dumps`` and ``dict()`` go through :meth:`items` and :meth:`keys`)."""

    __slots__ = ("_names", "_text")

    def __init__(self, text: str | Callable[[], str], names: list[str]):
        super().__init__()
        # The JSON text, or how to get it (the checkpoint's ``rows`` column is read only
        # when some unit's rows are first asked for); ``None`` once parsed.
        self._text: str | Callable[[], str] | None = text
        self._names = list(names)

    def _load(self) -> None:
        if self._text is not None:
            text, self._text = self._text, None
            super().update(json.loads(text if isinstance(text, str) else text()))

    def text(self) -> str:
        """The rows as JSON text (as read, when not parsed yet)."""
        text = self._text
        if text is None:
            return json.dumps(dict(super().items()))
        return text if isinstance(text, str) else text()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names) if self._text is not None else super().__iter__()

    def keys(self) -> Any:
        return dict.fromkeys(self._names).keys() if self._text is not None else super().keys()

    def __len__(self) -> int:
        return len(self._names) if self._text is not None else super().__len__()

    def __contains__(self, key: object) -> bool:
        return key in self._names if self._text is not None else super().__contains__(key)

    def __repr__(self) -> str:
        return f"LazyRows({self._names})" if self._text is not None else super().__repr__()


class LazyRecord(ParsedOnUse):
    """A unit's commit record as a checkpoint holds it: the row's ``item`` JSON, parsed when
    the record is first used (opening a long run's log parses no record; a reader parses
    those of the files it reads). Behaves as the parsed ``dict`` in every other way."""

    __slots__ = ("_item", "_rows", "stamp")

    def __init__(
        self, item: str | Callable[[], str], rows: Callable[[], str] | str | None, stamp: tuple
    ):
        super().__init__()
        # The item JSON, or how to read it (its row group of the checkpoint, when first
        # used); ``None`` once parsed.
        self._item: str | Callable[[], str] | None = item
        self._rows = rows
        # (step_size, step_crc32, version) of the entry it was read with: a checkpoint of
        # an unchanged entry writes the item text again without parsing it.
        self.stamp = stamp

    def text_of_rows(self) -> str | None:
        """The step rows' JSON text (read from the checkpoint; ``None``: none)."""
        rows = self._rows
        return rows if rows is None or isinstance(rows, str) else rows()

    @property
    def item_text(self) -> str | None:
        """The item JSON as read (``None`` once parsed)."""
        item = self._item
        return item() if callable(item) else item

    @property
    def parsed(self) -> bool:
        """Whether the item was parsed (a reader used the record)."""
        return self._item is None

    def _load(self) -> None:
        if self._item is not None:
            text = self._item
            item, self._item = json.loads(text() if callable(text) else text), None
            record = item["record"]
            if "row_names" in item and self._rows is not None:
                record["rows"] = LazyRows(self._rows, item["row_names"])
            super().update(record)

    def __iter__(self) -> Iterator[str]:
        self._load()
        return super().__iter__()

    def keys(self) -> Any:
        self._load()
        return super().keys()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def __contains__(self, key: object) -> bool:
        self._load()
        return super().__contains__(key)

    def __repr__(self) -> str:
        self._load()
        return super().__repr__()


def checkpoint_table(state: LogState) -> pa.Table:
    """``state`` as a checkpoint table: one row per live item, typed columns for plain
    readers (``kind``, ``path``, ``effective``) and the item itself as JSON."""
    rows: list[dict[str, Any]] = []
    effective = state.effective()
    resumed = state.resumed
    for rel, e in list(state.units.items()):
        # (a unit's group file has its step file's name: the commit rule)
        group = f"{GROUPS}/{rel.rpartition('/')[2]}"
        item, rows_text = unit_item_text(e)
        summary = summary_text(e)
        if e.summary is None:  # (read from an older checkpoint: computed once, kept)
            state.units[rel] = dataclasses.replace(e, summary=summary)
        for kind, path in (("step_file", rel), ("group_file", group)):
            rows.append(
                {
                    "kind": kind,
                    "path": path,
                    "effective": rel in effective,
                    "cutoff": state.cutoff(e.attempt, unit_kind(e)) if resumed else None,
                    "attempt": e.attempt,
                    "version": e.version,
                    "step_size": e.step_size,
                    "step_crc32": e.step_crc32,
                    # The unit's record once, on its step file's row; its step rows
                    # beside it (parsed by a reader only when it needs them).
                    "item": item if kind == "step_file" else "{}",
                    "rows": rows_text if kind == "step_file" else None,
                    # Its counts (inspect reads these, never the rows).
                    "summary": summary if kind == "step_file" else None,
                }
            )
    for name, files in state.records.items():
        for f in files:
            rows.append(
                {
                    "kind": f"records:{name}",
                    "path": f["path"],
                    "effective": True,
                    # Rows of steps at or after it are superseded (records with a step).
                    "cutoff": state.cutoff(f["attempt"]),
                    "attempt": f["attempt"],
                    "version": f["version"],
                    "item": json.dumps(f),
                }
            )
    for a in state.attempts:
        rows.append(
            {
                "kind": "attempt",
                "path": None,
                "effective": True,
                "cutoff": None,
                "attempt": a.id,
                "version": a.version,
                "item": json.dumps(a.to_json()),
            }
        )
    for version, why in state.notes.items():
        rows.append(
            {
                "kind": "note",
                "path": None,
                "effective": False,
                "cutoff": None,
                "attempt": None,
                "version": version,
                "item": json.dumps({"why": why}),
            }
        )
    for path, version in state.retiring.items():
        gone = state.replaced.get(path)
        raw = state.replaced_raw.get(path)
        if gone is not None:
            attempt, item = gone.attempt, json.dumps(unit_item(gone))
        elif raw is not None:
            attempt, item = raw[1], raw[0]
        else:
            attempt, item = None, "{}"
        rows.append(
            {
                "kind": "retiring",
                "path": path,
                "effective": False,
                "cutoff": None,
                "attempt": attempt,
                "version": version,
                "item": item,
            }
        )
    schema = pa.schema(
        [
            ("kind", pa.string()),
            ("path", pa.string()),
            ("effective", pa.bool_()),
            # Rows of the file at or after this step are superseded (a resume).
            ("cutoff", pa.int64()),
            ("attempt", pa.string()),
            ("version", pa.int64()),
            ("item", pa.string()),
            # A unit's step rows (JSON, column name -> values); its item records their
            # names (``row_names``). Older checkpoints hold them inside the item.
            ("rows", pa.string()),
            # A step file's size and CRC-32 (also in its item): read without the item.
            ("step_size", pa.int64()),
            ("step_crc32", pa.int64()),
            # A step file's counts (:func:`unit_summary`, JSON): what ``inspect`` reads.
            # Older checkpoints lack it; they are computed from the rows.
            ("summary", pa.string()),
        ],
        metadata={
            b"maxent_arrow.log": json.dumps(
                {"format": LOG_FORMAT, "version": state.version, "run": state.run}
            ).encode()
        },
    )
    # The units last (:func:`checkpoint_bytes` gives the other rows a row group of their
    # own: a reader reads their items at once and a unit's item when first used).
    rows = [r for r in rows if r["kind"] not in _UNIT_ROWS] + [
        r for r in rows if r["kind"] in _UNIT_ROWS
    ]
    return pa.Table.from_pylist(rows, schema=schema)


def state_from_checkpoint(data: bytes) -> LogState:
    """The state of a checkpoint file's bytes. The units' records (``item``), step rows
    (``rows``: most of a long run's checkpoint) and summaries are read when first asked
    for, one row group at a time (a checkpoint written as one row group: the column)."""
    source = pq.ParquetFile(pa.BufferReader(data))
    names = source.schema_arrow.names
    if "rows" not in names:
        return state_from_table(source.read(use_threads=False))
    lazy = {"rows", "summary", "item"}
    table = source.read([n for n in names if n not in lazy], use_threads=False)
    groups = [source.metadata.row_group(i).num_rows for i in range(source.num_row_groups)]
    starts = [sum(groups[:i]) for i in range(len(groups))]
    columns: dict[tuple[str, int], list[str | None]] = {}

    def read(name: str, index: int) -> str | None:
        group = bisect.bisect_right(starts, index) - 1
        key = (name, group)
        if key not in columns:
            part = pq.ParquetFile(pa.BufferReader(data)).read_row_group(
                group, [name], use_threads=False
            )
            columns[key] = part.column(0).to_pylist()
        return columns[key][index - starts[group]]

    def text_of(name: str) -> Callable[[int], Callable[[], str]]:
        """How to get row ``index``'s ``name`` (a column every row holds)."""

        def at(index: int) -> Callable[[], str]:
            def fetch() -> str:
                text = read(name, index)
                assert text is not None
                return text

            return fetch

        return at

    def summary_of(index: int) -> Callable[[], str | None] | None:
        return (lambda: read("summary", index)) if "summary" in names else None

    return state_from_table(table, text_of("rows"), summary_of, text_of("item"))


def state_from_table(
    table: pa.Table,
    rows_of: Callable[[int], Callable[[], str]] | None = None,
    summary_of: Callable[[int], Callable[[], str | None] | None] | None = None,
    item_of: Callable[[int], Callable[[], str]] | None = None,
) -> LogState:
    """The state of a checkpoint table (``rows_of(i)``, ``summary_of(i)``,
    ``item_of(i)``: how to get row ``i``'s step rows, summary and item when the table
    was read without those columns)."""
    meta = json.loads((table.schema.metadata or {})[b"maxent_arrow.log"])
    state = LogState(version=int(meta["version"]), run=meta.get("run"))
    for index, row in enumerate(table.to_pylist()):
        kind = row["kind"]
        if kind == "group_file":
            continue  # its unit is the step file's row
        lazy = kind == "step_file" and rows_of is not None and "step_size" in row
        if item_of is not None and not lazy:
            row["item"] = item_of(index)()
        if kind == "retiring":
            state.retiring[row["path"]] = row["version"]
            if row["item"] != "{}":
                state.replaced_raw[row["path"]] = (row["item"], row["attempt"], row["version"])
            continue
        if lazy and rows_of is not None:
            # This format: the record parsed when first used.
            stamp = (row["step_size"], row["step_crc32"], row["version"])
            item = row["item"] if item_of is None else item_of(index)
            record = LazyRecord(item, rows_of(index), stamp)
            summary = row.get("summary") if summary_of is None else summary_of(index)
            entry = UnitEntry(row["path"], record, row["attempt"], *stamp[2:], *stamp[:2], summary)
            state.add_unit(row["path"], entry)
            continue
        item = json.loads(row["item"])
        if kind == "step_file":
            if "row_names" in item:
                text = row.get("rows") if rows_of is None else rows_of(index)
                item["record"]["rows"] = LazyRows(text, item.pop("row_names"))
            state.add_unit(item["step_file"], unit_from_item(item, row))
        elif kind == "attempt":
            state.attempts.append(Attempt.from_json(item))
        elif kind == "note":
            state.notes[int(row["version"])] = str(item.get("why") or "")
        elif kind.startswith("records:"):
            state.records.setdefault(kind.partition(":")[2], []).append(item)
    state.attempts.sort(key=lambda a: a.version)
    return state


def unit_item_text(e: UnitEntry) -> tuple[str, str | None]:
    """A unit entry as a checkpoint row's ``item`` JSON without its step rows, and the rows
    as JSON text of their own (passed through unparsed when read from a checkpoint)."""
    record = e.record
    if isinstance(record, LazyRecord) and record.item_text is not None:
        if record.stamp == (e.step_size, e.step_crc32, e.version):
            return record.item_text, record.text_of_rows()
    rows = e.record.get("rows") if isinstance(e.record, Mapping) else None
    if not isinstance(rows, dict):
        return json.dumps(unit_item(e)), None
    record = {k: v for k, v in e.record.items() if k != "rows"}
    item = {**unit_item(e), "record": record, "row_names": list(rows)}
    text = rows.text() if isinstance(rows, LazyRows) else json.dumps(rows)
    return json.dumps(item), text


def checkpoint_bytes(state: LogState) -> bytes:
    """A checkpoint file's bytes (Parquet, zstd): the attempts, record files and retiring
    files in a row group of their own (read whole when a reader opens it), then the units
    in row groups of :data:`CHECKPOINT_ROW_GROUP` rows (their records read when used)."""
    table = checkpoint_table(state)
    kinds = table.column("kind").to_pylist()
    head = next((i for i, k in enumerate(kinds) if k in _UNIT_ROWS), len(kinds))
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, compression="zstd") as writer:
        if head or not len(kinds):
            writer.write_table(table.slice(0, head))
        if head < len(kinds):
            writer.write_table(table.slice(head), row_group_size=CHECKPOINT_ROW_GROUP)
    return sink.getvalue().to_pybytes()
