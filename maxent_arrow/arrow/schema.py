"""Arrow schemas of the rollout store: the group table and the step table, as the column
registry (:mod:`.registry`) declares them, and the rules that read them across versions.

Group table: one row per prompt group of one step of one rank. Per-completion values are
``list<T>`` columns (K_i items in row i, the same K_i in every such column of the row);
per-token values are ``list<list<T>>``. List children are non-nullable (nulls defeat DLPack);
optional columns may be absent or null as a whole. A run's files carry the columns of its
families (``core`` plus its trainer's: ``maxent``, ``trl``, ``verl``).

Step table: one row per (step, rank, kind): reward moments, length stats, reference summaries,
loss scalars, diagnostics and the run config snapshot (JSON).

Versions are ``"MAJOR.MINOR"``: a reader accepts any minor version of its major (minor versions
only add optional columns) and refuses a newer major with :class:`SchemaVersionError`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow.registry import COMPLETION_INFO_TYPE, MESSAGE_TYPE, MESSAGES_TYPE
from maxent_arrow.errors import SchemaError, SchemaVersionError

__all__ = [
    "empty",
    "COMPLETION_INFO_TYPE",
    "MESSAGES_TYPE",
    "MESSAGE_TYPE",
    "SCHEMA_VERSION",
    "SCHEMA_MAJOR",
    "METADATA_KEY",
    "BUCKET_COLUMNS",
    "GROUP_FIELDS",
    "STEP_FIELDS",
    "GROUP_REQUIRED",
    "STEP_REQUIRED",
    "PER_COMPLETION_COLUMNS",
    "PER_TOKEN_COLUMNS",
    "KIND_PATTERN",
    "KL_LENGTH_BUCKETS",
    "check_kind",
    "conform",
    "group_schema",
    "step_schema",
    "check_version",
    "unify_schemas",
    "visible",
]

SCHEMA_VERSION = "2.2"
SCHEMA_MAJOR = 2
METADATA_KEY = b"maxent_arrow.schema_version"

# The rule for a step's kind ("train", "eval", ...): a lowercase name. It is part of the store's
# file names and is inlined into SQL, which this pattern makes safe.
KIND_PATTERN = r"[a-z][a-z0-9_]{0,31}"
_KIND_RE = re.compile(KIND_PATTERN)


def check_kind(kind: object, *, where: str) -> str:
    """``kind`` if it follows :data:`KIND_PATTERN`, else a :class:`SchemaError` naming ``where``."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise SchemaError(
            f"{where}: expected a lowercase name matching {KIND_PATTERN} (e.g. 'train', "
            f"'eval'), got {kind!r}"
        )
    return kind


# The length buckets of BatchDiagnostics (docs/formulas.md §2.14): label -> inclusive upper bound.
KL_LENGTH_BUCKETS: dict[str, int | None] = {
    "0-32": 32,
    "33-64": 64,
    "65-128": 128,
    "129-256": 256,
    "257+": None,
}


# The layout is declared column by column in the registry; these are derived from it.
GROUP_FIELDS: list[pa.Field] = [c.field for c in R.columns(R.GROUP)]
STEP_FIELDS: list[pa.Field] = [c.field for c in R.columns(R.STEP)]
GROUP_REQUIRED = R.names(R.GROUP, where=lambda c: c.required)
STEP_REQUIRED = R.names(R.STEP, where=lambda c: c.required)
# List columns with one item per completion of the row (per-completion and per-token values).
PER_COMPLETION_COLUMNS = R.names(R.GROUP, level=("completion", "token"))
PER_TOKEN_COLUMNS = R.names(R.GROUP, level="token")
BUCKET_COLUMNS = ("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket")


def _metadata(extra: dict[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    return {METADATA_KEY: SCHEMA_VERSION.encode(), **(extra or {})}


def group_schema(
    *, families: Iterable[str] | None = None, metadata: dict[bytes, bytes] | None = None
) -> pa.Schema:
    """The group table of :data:`SCHEMA_VERSION`: of a run of ``families`` (default: every
    registered column)."""
    return pa.schema(_fields(R.GROUP, _tuple(families)), metadata=_metadata(metadata))


def step_schema(
    *, families: Iterable[str] | None = None, metadata: dict[bytes, bytes] | None = None
) -> pa.Schema:
    """The step table of :data:`SCHEMA_VERSION`: of a run of ``families`` (default: every
    registered column)."""
    return pa.schema(_fields(R.STEP, _tuple(families)), metadata=_metadata(metadata))


def _tuple(families: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if families is None else tuple(families)


@functools.lru_cache(maxsize=64)
def _fields(level: str, families: tuple[str, ...] | None) -> tuple[pa.Field, ...]:
    """The registered fields of ``level`` in a run of ``families`` (one tuple per set: the
    registry never changes, and an append asks for them twice)."""
    return tuple(c.field for c in R.columns(level, families=families))


def visible(schema: pa.Schema, families: Iterable[str], table: str) -> pa.Schema:
    """``schema`` without the registered columns outside ``families`` (null padding that
    stores written before families existed carry); columns outside the registry stay."""
    wanted = tuple(families)
    layout = set(R.names(table))
    keep = set(R.names(table, families=wanted))
    fields = [f for f in schema if f.name not in layout or f.name in keep]
    return pa.schema(fields, metadata=schema.metadata)


def check_version(version: str | bytes | None, *, where: str, newest: str = SCHEMA_VERSION) -> str:
    """Accept any minor version of our major; refuse a newer major (and a malformed one).
    ``newest``: the newest version this library reads (files: :data:`SCHEMA_VERSION`; a
    store's manifest has a version of its own, ``store/history/manifest.py``)."""
    if version is None:
        raise SchemaVersionError(f"{where}: no schema version in the metadata")
    if isinstance(version, bytes):
        version = version.decode()
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise SchemaVersionError(f"{where}: malformed schema version {version!r}") from None
    if major > int(newest.split(".")[0]):
        raise SchemaVersionError(
            f"{where}: written with schema version {version}, newer than this maxent-arrow "
            f"reads ({newest}); upgrade maxent-arrow"
        )
    return str(version)


def unify_schemas(schemas: list[pa.Schema], *, where: str = "store") -> pa.Schema:
    """One schema over files written at different times, by column name.

    Columns missing from some files read as nulls; new struct fields (a reward function added
    mid-run) are merged. A column that changed type is refused with :class:`SchemaError`
    naming it (pyarrow and DuckDB would otherwise take the first file's schema and silently
    drop or misread later columns).
    """
    if not schemas:
        raise SchemaError(f"{where}: no schemas to unify")
    # Our per-column check first, so the error names the column in our words.
    first: dict[str, pa.DataType] = {}
    for schema in schemas:
        for field in schema:
            seen = first.setdefault(field.name, field.type)
            if _incompatible(seen, field.type):
                raise SchemaError(
                    f"{where}: column {field.name!r} changed type from {seen} to {field.type}"
                )
    try:
        unified = pa.unify_schemas(
            [s.remove_metadata() for s in schemas], promote_options="permissive"
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(f"{where}: files disagree on a column's type: {exc}") from None
    return unified.with_metadata(_metadata())


def _incompatible(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether two column types hold different kinds of data.

    Differences that pyarrow's permissive unification resolves without loss are not changes:
    child nullability and child names of lists (DuckDB and Polars write nullable ``element``
    children where we write non-null ``item``), ``list`` vs ``large_list`` and ``string`` vs
    ``large_string``, and a struct gaining fields (a reward function added mid-run).
    """
    if a == b or pa.types.is_null(a) or pa.types.is_null(b):
        return False
    if _is_var_list(a) and _is_var_list(b):
        return _incompatible(a.value_type, b.value_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fa = {f.name: f.type for f in a}
        return any(_incompatible(fa[f.name], f.type) for f in b if f.name in fa)
    if pa.types.is_map(a) and pa.types.is_map(b):
        return _incompatible(a.key_type, b.key_type) or _incompatible(a.item_type, b.item_type)
    if _is_text(a) and _is_text(b):
        return False
    return True


def _is_var_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def empty(schema: pa.Schema) -> pa.Table:
    """A table of ``schema`` with no rows (``Schema.empty_table`` imports pandas, 0.4 s,
    which the commands that only read never need)."""
    return pa.Table.from_batches([], schema=schema)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: cast where types widened, nulls where a
    column is missing (a file written before the column existed)."""
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            column = table.column(f.name)
            arrays.append(column if column.type == f.type else column.cast(f.type))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    fields = [pa.field(f.name, f.type, nullable=True) for f in schema]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))
