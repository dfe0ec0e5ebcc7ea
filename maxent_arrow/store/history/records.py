"""Record tables: rows a run keeps beside its rollouts, appended through the commit log.

A record table holds what happens to a run after its rollouts are written: a trainer's logged
figures (``trainer_metrics``), what became of each stored group (``lifecycle``: trained at a
step, or dropped with a reason), or a user's own table. Group files are immutable once
committed, so these are rows of their own: each append is one Parquet file under
``records/{name}/`` and one ``records`` entry of the log (its path, size, CRC-32, rows and
column types), committed like a unit (``docs/commit-protocol.md``).

**Names.** Lowercase identifiers (``[a-z][a-z0-9_]*``), each also a SQL view of that name; the
store's own view names are refused. A table the column registry declares (``trainer_metrics``,
``lifecycle``) is checked against its rows and read back in their layout; any other table
keeps the types of its first append (a column whose type changes is refused, naming it).

**History.** A record with a ``step`` column belongs to that step of the attempt that wrote it:
a resume at step ``s`` supersedes the records of steps ``>= s`` of earlier attempts of the
role, as it does their rollouts. Readers see the effective records by default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import re
import secrets
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from maxent_arrow.arrow import lists as L
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import ArgumentError, SchemaError, ShapeError, StoreError
from maxent_arrow.store.history.catalog import History
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import AppendRecords, crc32
from maxent_arrow.store.history.state import TRAINER, LogState
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.caches import CACHES
from maxent_arrow.store.storage.crashpoints import crash_point
from maxent_arrow.store.storage.names import RECORDS

__all__ = [
    "RESERVED",
    "Frontier",
    "check_lifecycle_groups",
    "check_record_name",
    "check_record_table",
    "commit_records",
    "hold_pending",
    "frontier_of",
    "lifecycle_keys",
    "lifecycle_rows",
    "prepare_records",
    "read_records",
    "record_cutoffs",
    "record_filter",
    "record_names",
    "record_schema",
    "settle_pending",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")

# Writers of this process that hold record rows handed over and not committed yet (the
# replay sampler's lifecycle records commit in a thread of their own): each has ``uri`` (its
# store's), ``thread`` (the one that commits) and ``wait()``. A reader of the same store in
# this process waits for them first (:func:`settle_pending`), so it reads what was written.
_PENDING: weakref.WeakSet[Any] = weakref.WeakSet()


def hold_pending(writer: Any) -> None:
    """Register ``writer`` as one whose handed-over rows a reader waits for."""
    _PENDING.add(writer)


def settle_pending(uri: str) -> None:
    """Wait until every writer of this process writing into the store at ``uri`` committed
    what it was handed (its failures are its own caller's to see, not a reader's)."""
    for writer in list(_PENDING):
        if writer.uri == uri and writer.thread is not threading.current_thread():
            writer.wait()


# The store's own SQL views (a record table is a view of its name).
RESERVED = frozenset(
    {"groups", "samples", "steps", "groups_all", "samples_all", "superseded", "attempts"}
)


def check_record_name(name: object) -> str:
    """``name`` when it can name a record table, else :class:`SchemaError` saying why."""
    if not isinstance(name, str) or _NAME.match(name) is None:
        raise SchemaError(
            f"record table name {name!r}: expected a lowercase identifier ([a-z][a-z0-9_]*, at "
            "most 63 characters)"
        )
    if name in RESERVED:
        raise SchemaError(f"record table name {name!r}: a view of the store has that name")
    return name


def record_schema(name: str) -> pa.Schema | None:
    """The registry's layout of record table ``name`` (``None``: a table it does not
    declare)."""
    fields = [c.field for c in R.columns(name, level="record")]
    return pa.schema(fields) if fields else None


def _as_table(name: str, rows: Any) -> pa.Table:
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if not isinstance(rows, pa.Table):
        raise SchemaError(
            f"records of {name!r}: expected a pyarrow Table or RecordBatch, got "
            f"{type(rows).__name__}"
        )
    if rows.num_rows == 0:
        raise SchemaError(f"records of {name!r}: no rows")
    return rows.replace_schema_metadata(None)


def _check_registered(name: str, table: pa.Table, layout: pa.Schema) -> pa.Table:
    """``table`` in the registry's layout: unknown columns, missing required ones, values
    of another type and NULLs in required columns refused, naming the column and row."""
    unknown = [c for c in table.column_names if c not in layout.names]
    if unknown:
        raise SchemaError(
            f"records of {name!r}: unknown column {unknown[0]!r} (the registry's columns: "
            f"{', '.join(layout.names)})"
        )
    for column in R.columns(name, level="record", where=lambda c: c.required):
        if column.name not in table.column_names:
            raise SchemaError(f"records of {name!r}: required column {column.name!r} missing")
        nulls = table.column(column.name).is_null()
        if pc.any(nulls).as_py():
            row = pc.index(nulls, True).as_py()
            raise SchemaError(f"records of {name!r}, row {row}: {column.name} is null")
    out = []
    for f in layout:
        if f.name not in table.column_names:
            out.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        try:
            out.append(column if column.type == f.type else column.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SchemaError(
                f"records of {name!r}, column {f.name!r}: expected {f.type}, got {column.type} "
                f"({exc})"
            ) from None
    return pa.Table.from_arrays(out, schema=layout)


def _check_types(name: str, table: pa.Table, state: LogState) -> None:
    """A column of an unregistered table keeps the type of its first append."""
    known: dict[str, str] = {}
    for item in state.records.get(name, []):
        for column, kind in (item.get("columns") or {}).items():
            known.setdefault(column, kind)
    for f in table.schema:
        if f.name in known and known[f.name] != str(f.type):
            raise SchemaError(
                f"records of {name!r}, column {f.name!r}: {f.type} now, {known[f.name]} in "
                "earlier appends; a record column keeps its first type"
            )


def _check_rows(name: str, table: pa.Table) -> None:
    if "step" in table.column_names:
        kind = table.column("step").type
        if not pa.types.is_integer(kind):
            raise SchemaError(f"records of {name!r}, column 'step': expected integers, got {kind}")
        nulls = table.column("step").is_null()
        if pc.any(nulls).as_py():
            raise SchemaError(
                f"records of {name!r}, row {pc.index(nulls, True).as_py()}: step is null"
            )
        if pc.any(pc.less(table.column("step"), 0)).as_py():
            row = pc.index(pc.less(table.column("step"), 0), True).as_py()
            raise SchemaError(f"records of {name!r}, row {row}: step is negative")
    if name == R.LIFECYCLE:
        events = table.column("event")
        bad = pc.invert(pc.is_in(events, pa.array(R.EVENTS)))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise SchemaError(
                f"records of 'lifecycle', row {row}: event {events[row].as_py()!r} is not one "
                f"of {R.EVENTS}"
            )
        reasons = table.column("reason")
        dropped = pc.equal(events, "dropped")
        bad = pc.and_(
            dropped, pc.invert(pc.fill_null(pc.is_in(reasons, pa.array(R.DROP_REASONS)), False))
        )
        bad = pc.or_(bad, pc.and_(pc.invert(dropped), reasons.is_valid()))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise SchemaError(
                f"records of 'lifecycle', row {row}: reason {reasons[row].as_py()!r} with event "
                f"{events[row].as_py()!r} (a dropped group has one of {R.DROP_REASONS}; a trained "
                "one none)"
            )


def prepare_records(name: str, rows: Any) -> pa.Table:
    """``rows`` checked as records of ``name`` (in the registry's layout where it declares
    the table). Raises :class:`SchemaError` naming the column and row."""
    check_record_name(name)
    table = _as_table(name, rows)
    layout = record_schema(name)
    if layout is not None:
        table = _check_registered(name, table, layout)
    _check_rows(name, table)
    return table


def commit_records(
    backend: Backend,
    log: CommitLog,
    name: str,
    table: pa.Table,
    *,
    attempt: str,
    lock_timeout: float | None = None,
    compression: str = "zstd",
) -> int:
    """Write ``table`` (from :func:`prepare_records`) as a file of record table ``name`` and
    commit it as the log's next entry; returns its version. A refused commit removes its
    file, so the store is as it was."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=compression)
    data = sink.getvalue()
    token = secrets.token_hex(6)  # racing writers never share a file
    backend.makedirs(f"{RECORDS}/{name}")
    pending = backend.write_temp(f"{RECORDS}/{name}/{name}.t{token}.parquet", data)
    crash_point("records:file-written")
    published = False

    def check(state: LogState) -> None:
        nonlocal published
        _check_types(name, table, state)
        if not published:
            backend.publish(pending, exclusive=True)
            published = True
            crash_point("records:published")

    operation = AppendRecords(
        name,
        {
            "path": pending.final,
            "size": pending.size,
            "crc32": pending.crc,
            "rows": table.num_rows,
            "columns": {f.name: str(f.type) for f in table.schema},
        },
    )
    try:
        version = log.commit(operation, attempt=attempt, check=check, lock_timeout=lock_timeout)
        assert version is not None
        return version
    except BaseException:
        # Our file goes again unless the entry made it (as commit_unit's files): a leftover
        # is harmless (repair moves it), removing a committed file is a loss.
        with contextlib.suppress(Exception):
            if published:
                committed = {i["path"] for i in log.state().records.get(name, [])}
                if pending.final not in committed:
                    backend.remove(pending.final)
        raise
    finally:
        backend.discard(pending)


# Record files read and checked by this process, by path, size and CRC-32 (the process caches'
# ``records``): a committed file is never rewritten (a new commit writes a file of a new name),
# so a consumer that reads the records every step (``frontier()``) parses each file once.
# Damage present when this process first reads a file is never served; a file damaged or lost
# later is ``verify``'s to find.


def _records_file(backend: Backend, name: str, item: Mapping[str, Any]) -> pa.Table:
    """The rows of one committed records file, checked against the log's size and CRC-32."""
    rel = str(item["path"])
    where = backend.path(rel)
    key = (str(where), int(item["size"]), int(item["crc32"]))
    hit = CACHES.records.get(key)
    if hit is not None:
        return hit
    try:
        data = backend.read(rel)
    except StoreError as exc:
        raise StoreError(f"{where}: a committed records file of {name!r} is lost ({exc})") from None
    if data.size != item["size"] or crc32(data.to_pybytes()) != item["crc32"]:
        raise StoreError(
            f"{where}: damaged (size {data.size}, recorded {item['size']}; CRC-32 differs "
            "from the log's)"
        )
    table = pq.ParquetFile(pa.BufferReader(data)).read()  # (read_table imports pandas)
    CACHES.records.put(key, table)
    return table


def read_records(
    backend: Backend, state: LogState, name: str, history: History = "effective"
) -> pa.Table:
    """The rows of record table ``name`` in ``history``, checked against the sizes and
    CRC-32s the log recorded (a damaged or lost file raises :class:`StoreError` naming it).
    An ``attempt`` column says which attempt wrote each row. A table with no rows: the
    registry's layout (empty), or an empty table."""
    parts = []
    for item in state.records.get(name, []):
        table = _records_file(backend, name, item)
        table = table.append_column("attempt", L.text_array(str(item["attempt"]), table.num_rows))
        default, kinds = record_cutoffs(state, item)
        cut = default is not None or any(c is not None for c in kinds.values())
        if history != "all" and cut:
            below = _below(table, default, kinds)
            table = table.filter(below if history == "effective" else pc.invert(below))
        elif history == "superseded":  # nothing of this file is superseded
            table = table.slice(0, 0)
        parts.append(table)
    layout = record_schema(name)
    if layout is not None:
        layout = layout.append(pa.field("attempt", pa.string()))
        return pa.concat_tables([S.conform(p, layout) for p in parts]) if parts else S.empty(layout)
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="permissive")


def record_cutoffs(
    state: LogState, item: Mapping[str, Any]
) -> tuple[int | None, dict[str, int | None]]:
    """Where the rows of a records file leave the history: the cutoff of its attempt (rows of
    steps at or after it are superseded; ``None``: none are), and, for a table with a
    ``kind`` column, the cutoff of each kind a later attempt resumed at a point of its own
    (``resume_kinds``). A table without a ``step`` column is never superseded."""
    columns = item.get("columns") or {}
    if "step" not in columns:
        return None, {}
    attempt = str(item["attempt"])
    kinds: dict[str, int | None] = {}
    if "kind" in columns:
        for a in state.attempts:
            for kind in a.resume_kinds:
                kinds[kind] = state.cutoff(attempt, kind)
    return state.cutoff(attempt), kinds


def _below(table: pa.Table, default: int | None, kinds: Mapping[str, int | None]) -> pa.Array:
    """Rows of ``table`` below their cutoff (:func:`record_cutoffs`)."""
    step = table.column("step")
    out = pc.less(step, L.int64_scalar(default)) if default is not None else pc.is_valid(step)
    for kind, cut in kinds.items():
        keep = pc.less(step, L.int64_scalar(cut)) if cut is not None else pc.is_valid(step)
        out = pc.if_else(pc.equal(table.column("kind"), L.text_scalar(kind)), keep, out)
    return out


def record_filter(state: LogState, item: Mapping[str, Any], history: History) -> str | bool:
    """A records file's rows in ``history`` as a plain reader's filter: ``True`` (all of
    them), ``False`` (none) or a SQL condition over ``step`` (and ``kind``)."""
    default, kinds = record_cutoffs(state, item)
    if history == "all":
        return True
    if default is None and all(c is None for c in kinds.values()):
        return history == "effective"
    base = "TRUE" if default is None else f"step < {int(default)}"
    if kinds:
        cases = " ".join(
            f"WHEN '{kind}' THEN {'TRUE' if cut is None else f'step < {int(cut)}'}"
            for kind, cut in sorted(kinds.items())
        )
        base = f"CASE kind {cases} ELSE {base} END"
    return base if history == "effective" else f"NOT ({base})"


def record_names(state: LogState) -> list[str]:
    """The record tables of the store, by name."""
    return sorted(state.records)


# The record tables the column registry declares: each exists in every store (empty until
# its first append).
REGISTERED = tuple(sorted({c.table for c in R.REGISTRY if c.level == "record"}))


def check_record_table(state: LogState, name: object) -> str:
    """``name`` when it names a record table of the store (one appended to, or one the
    registry declares: :data:`REGISTERED`, empty until its first append), else an
    :class:`ArgumentError` naming the store's tables: an unknown name is a mistake, never
    an empty answer."""
    name = check_record_name(name)
    if name not in state.records and name not in REGISTERED:
        known = sorted({*state.records, *REGISTERED})
        raise ArgumentError(
            f"record table {name!r}: the store has none of that name (its record tables: "
            f"{', '.join(known)})"
        )
    return name


def lifecycle_keys(table: pa.Table, event: str, *, attempts: list[str] | None = None) -> pa.Table:
    """The stored groups (:data:`~maxent_arrow.arrow.registry.ROW_KEY`) of ``lifecycle``
    rows of ``event`` (recorded by one of ``attempts``, when given): a set to test membership
    in (a group recorded twice is listed twice; deduplicating here would take
    ``Table.group_by``, whose Acero import loads pandas)."""
    keep = pc.equal(table.column("event"), L.text_scalar(event))
    if attempts is not None:
        keep = pc.and_(keep, pc.is_in(table.column("attempt"), value_set=L.text_values(attempts)))
    rows = table.filter(keep)
    return pa.table({k: rows.column(c) for c, k in zip(R.LIFECYCLE_KEY, R.ROW_KEY)})


def trainer_attempts(state: LogState) -> list[str]:
    """The attempts of the role that trains (:data:`~.log.TRAINER`): the drops the ``groups``
    view leaves out are theirs. A replay consumer of another role (the sampler of training
    from the store) records its own drops in ``lifecycle``; they do not rewrite what the
    run's trainer trained on."""
    return [a.id for a in state.attempts if a.role == TRAINER]


def lifecycle_rows(
    groups: pa.Table, *, step: int, event: str, reason: str | None = None
) -> pa.Table:
    """``lifecycle`` records of ``event`` at trainer step ``step`` for the stored ``groups``
    (rows as the store reads them: their :data:`~maxent_arrow.arrow.registry.ROW_KEY` and,
    when the producer numbered its prompt stream, ``stream_index``)."""
    for column in R.ROW_KEY:
        if column not in groups.column_names:
            raise SchemaError(f"lifecycle rows: the groups have no {column!r} column")
    n = groups.num_rows
    table = pa.table({c: groups.column(k) for c, k in zip(R.LIFECYCLE_KEY, R.ROW_KEY)})
    stream = "stream_index"
    if stream in groups.column_names:
        table = table.append_column(stream, groups.column(stream))
    table = table.append_column("step", _repeat(step, pa.int64(), n))
    table = table.append_column("event", _repeat(event, pa.string(), n))
    table = table.append_column("reason", _repeat(reason, pa.string(), n))
    now = dt.datetime.now(dt.UTC)
    table = table.append_column("created_at", _repeat(now, pa.timestamp("us", tz="UTC"), n))
    return prepare_records(R.LIFECYCLE, table)


def _key_text(table: pa.Table, columns: tuple[str, ...]) -> pa.Array:
    """One text key per row of a group's key ``columns`` (step, rank, kind, group_index; a
    kind is an identifier, so ``/`` never occurs in one)."""
    parts = [pc.cast(table.column(c), pa.string()) for c in columns]
    # (the separator a scalar from buffers: a Python value given to pyarrow imports pandas)
    return pc.binary_join_element_wise(*parts, L.text_scalar("/")).combine_chunks()


def check_lifecycle_groups(records: pa.Table, stored: pa.Table) -> None:
    """Each ``lifecycle`` record (:func:`prepare_records`' rows) addresses exactly one of the
    ``stored`` groups (their :data:`~maxent_arrow.arrow.registry.ROW_KEY` columns: the
    effective history of the steps the records name): a record of a group never stored, or
    of a key several stored groups share (a store written before ``group_index`` was checked
    unique), is a :class:`ShapeError` naming its row and key; a drop of it would leave out
    none, or all, of them."""
    wanted = _key_text(records, R.LIFECYCLE_KEY)
    have = _key_text(stored, R.ROW_KEY)
    missing = pc.invert(pc.is_in(wanted, value_set=have))
    counts = pc.value_counts(have)
    shared = counts.field("values").filter(pc.greater(counts.field("counts"), L.int64_scalar(1)))
    several = pc.is_in(wanted, value_set=shared)
    for bad, what in ((missing, "matches no stored group"), (several, "matches several")):
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            step, rank, kind, index = (records.column(c)[row].as_py() for c in R.LIFECYCLE_KEY)
            where = f"step {step}, rank {rank}, kind {kind!r}, group_index {index}"
            if what == "matches several":
                n = pc.sum(pc.equal(have, wanted[row])).as_py()
                what = f"matches {n} stored groups (they share one group_index)"
            raise ShapeError(
                f"records of 'lifecycle', row {row}: the group ({where}) {what} of the run's "
                "effective history; a record addresses exactly one stored group"
            )


def _repeat(value: Any, kind: pa.DataType, n: int) -> pa.Array:
    """``value`` ``n`` times (the write side)."""
    return pa.repeat(pa.scalar(value, kind), n)


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Where a run's consumer stands in its prompt stream (``store.frontier()``).

    ``position``: the lowest stream index no effective ``lifecycle`` event consumed (trained
    or dropped): where a resumed consumer starts. ``consumed``: how many positions below it
    were consumed (all of them: a gap is a skipped prompt, which ``gaps`` lists: positions
    above a consumed one that were never consumed). ``in_flight``: the stored groups of the
    effective history not consumed yet (``step``, ``rank``, ``kind``, ``group_index``,
    ``stream_index``), in stream order: what a resumed consumer takes before new prompts.
    ``double``: stream positions consumed more than once (a correct run has none)."""

    position: int
    consumed: int
    gaps: list[int]
    double: list[int]
    in_flight: pa.Table


def frontier_of(groups: pa.Table, lifecycle: pa.Table) -> Frontier:
    """The :class:`Frontier` of the stored ``groups`` (key columns and ``stream_index``) and
    the effective ``lifecycle`` records."""
    if "stream_index" not in groups.column_names:
        raise SchemaError(
            "frontier: the stored groups have no stream_index (the producer did not number its "
            "prompt stream)"
        )
    events = lifecycle.filter(pc.is_valid(lifecycle.column("stream_index")))
    consumed = events.column("stream_index").to_pylist()
    counts: dict[int, int] = {}
    for position in consumed:
        counts[position] = counts.get(position, 0) + 1
    position = 0
    while position in counts:
        position += 1
    top = max(counts, default=-1)
    gaps = [p for p in range(position, top) if p not in counts]
    double = sorted(p for p, n in counts.items() if n > 1)
    keys = groups.select([*R.ROW_KEY, "stream_index"])
    seen = L.int64_array(sorted(counts))
    mask = pc.invert(pc.is_in(keys.column("stream_index"), seen))
    in_flight = keys.filter(pc.and_(mask, pc.is_valid(keys.column("stream_index"))))
    in_flight = in_flight.sort_by([("stream_index", "ascending")])
    return Frontier(position, len(counts), gaps, double, in_flight)
