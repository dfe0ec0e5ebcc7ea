"""Arrow schemas of the rollout store, version 1: the group table and the step table.

Group table: one row per prompt group of one step of one rank. Per-completion values are
``list<T>`` columns (K_i items in row i, the same K_i in every such column of the row);
per-token values are ``list<list<T>>``. List children are non-nullable (nulls defeat DLPack);
optional columns may be absent or null as a whole.

Step table: one row per (step, rank): reward moments, length stats, reference summaries, loss
scalars, diagnostics and the run config snapshot (JSON).

Versions are ``"MAJOR.MINOR"``: a reader accepts any minor version of its major (minor versions
only add optional columns) and refuses a newer major with :class:`SchemaVersionError`.
"""

from __future__ import annotations

import re

import pyarrow as pa

from maxent_arrow.errors import SchemaError, SchemaVersionError

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_MAJOR",
    "METADATA_KEY",
    "BUCKET_COLUMNS",
    "COMPLETION_INFO_TYPE",
    "MESSAGE_TYPE",
    "MESSAGES_TYPE",
    "GROUP_FIELDS",
    "STEP_FIELDS",
    "GROUP_REQUIRED",
    "STEP_REQUIRED",
    "PER_COMPLETION_COLUMNS",
    "PER_TOKEN_COLUMNS",
    "NO_DICTIONARY_COLUMNS",
    "KIND_PATTERN",
    "KL_LENGTH_BUCKETS",
    "check_kind",
    "conform",
    "group_schema",
    "step_schema",
    "check_version",
    "unify_schemas",
]

SCHEMA_VERSION = "2.0"
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


def _list(kind: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", kind, nullable=False))


# Completion info in the group table: token ids live in `completion_ids`, not here.
COMPLETION_INFO_TYPE = pa.struct(
    [
        pa.field("finish_reason", pa.string()),
        pa.field("stop_reason", pa.string()),
        pa.field("truncated", pa.bool_()),
        pa.field("token_count", pa.int32()),
        pa.field("extra", pa.string()),
    ]
)

# A chat message: role and text content; any other key of the message (a name, tool calls,
# non-text content) as a JSON object in `extra`.
MESSAGE_TYPE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("extra", pa.string()),
    ]
)
MESSAGES_TYPE = _list(MESSAGE_TYPE)

GROUP_FIELDS: list[pa.Field] = [
    pa.field("step", pa.int64(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("group_index", pa.int32(), nullable=False),
    # Run-wide identity of the prompt group: the rows of one step and kind with the same
    # group_id are parts of one group (a trainer that spreads a prompt's K completions over
    # ranks writes one part per rank); group_size is the whole group's K, num_completions
    # this row's, and completion_index each completion's place in the whole group.
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("group_size", pa.int32(), nullable=False),
    pa.field("num_completions", pa.int32(), nullable=False),
    # Exactly one of prompt / prompt_messages is set (a plain or a chat prompt).
    pa.field("prompt", pa.string()),
    pa.field("prompt_messages", MESSAGES_TYPE),
    pa.field("answer", pa.string()),
    pa.field("prompt_ids", _list(pa.int32())),
    pa.field("completions", _list(pa.string())),
    pa.field("completion_messages", _list(MESSAGES_TYPE)),
    pa.field("completion_index", _list(pa.int32())),
    pa.field("completion_ids", _list(_list(pa.int32()))),
    pa.field("completion_info", _list(COMPLETION_INFO_TYPE)),
    pa.field("ref_meta", _list(pa.string())),
    pa.field("total_utils", _list(pa.float64())),
    # Raw rewards: the reward functions' names and, per completion, one value per name (NaN
    # where a function gave none). Names are data, not columns, so adding a reward function
    # mid-run changes no file's schema.
    pa.field("reward_names", _list(pa.string())),
    pa.field("reward_values", _list(_list(pa.float64()))),
    pa.field("advantages", _list(pa.float64())),
    pa.field("q", _list(pa.float64())),
    pa.field("weights", _list(pa.float64())),
    pa.field("ref_logp_sum_raw", _list(pa.float64())),
    pa.field("ref_tok_counts", _list(pa.int32())),
    pa.field("ref_token_logp", _list(_list(pa.float32()))),
    pa.field("behavior_logp_sum", _list(pa.float64())),
    pa.field("behavior_token_logp", _list(_list(pa.float32()))),
    pa.field("policy_entropy_sum", _list(pa.float64())),
    pa.field("seed_semantic_entropy", pa.float64()),
    pa.field("seed_advantage_scale", pa.float64()),
]

GROUP_REQUIRED = (
    "step",
    "rank",
    "kind",
    "group_index",
    "group_id",
    "group_size",
    "num_completions",
    "completions",
)

PER_COMPLETION_COLUMNS = (
    "completions",
    "completion_messages",
    "completion_index",
    "completion_ids",
    "completion_info",
    "ref_meta",
    "total_utils",
    "reward_values",
    "advantages",
    "q",
    "weights",
    "ref_logp_sum_raw",
    "ref_tok_counts",
    "ref_token_logp",
    "behavior_logp_sum",
    "behavior_token_logp",
    "policy_entropy_sum",
)

PER_TOKEN_COLUMNS = ("completion_ids", "ref_token_logp", "behavior_token_logp")

# Dictionary encoding makes token-id writes ~4x slower for little gain
# (``docs/arrow-layout.md``, "Parquet settings").
NO_DICTIONARY_COLUMNS = (
    "prompt_ids",
    "completion_ids",
    "completion_index",
    "ref_token_logp",
    "behavior_token_logp",
    "total_utils",
    "reward_values",
    "advantages",
    "q",
    "weights",
    "ref_logp_sum_raw",
    "behavior_logp_sum",
    "policy_entropy_sum",
)

STEP_FIELDS: list[pa.Field] = [
    pa.field("step", pa.int64(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),  # "train", "eval", ...
    pa.field("num_groups", pa.int32(), nullable=False),
    pa.field("num_samples", pa.int32(), nullable=False),
    pa.field("created_at", pa.timestamp("us", tz="UTC")),
    pa.field("policy_version", pa.int64()),
    # RewardMoments
    pa.field("reward_mean", pa.float64()),
    pa.field("reward_std", pa.float64()),
    # LengthStats
    pa.field("min_length", pa.float64()),
    pa.field("mean_length", pa.float64()),
    pa.field("max_length", pa.float64()),
    pa.field("clipped_ratio", pa.float64()),
    pa.field("min_terminated", pa.float64()),
    pa.field("mean_terminated", pa.float64()),
    pa.field("max_terminated", pa.float64()),
    # ReferenceLogprobs scalars
    pa.field("ref_logp_mean", pa.float64()),
    pa.field("avg_completion_tokens", pa.float64()),
    # LossScalarBundle
    pa.field("total_loss", pa.float64()),
    pa.field("policy_loss", pa.float64()),
    pa.field("clip_loss", pa.float64()),
    pa.field("kl_loss", pa.float64()),
    pa.field("weighted_kl_loss", pa.float64()),
    # BatchDiagnostics; the two bucket dicts as lists parallel to kl_length_buckets (no map
    # columns: Hugging Face `datasets` cannot read them)
    pa.field("kl_value", pa.float64()),
    pa.field("clip_ratio", pa.float64()),
    pa.field("clip_ratio_low_mean", pa.float64()),
    pa.field("clip_ratio_low_min", pa.float64()),
    pa.field("clip_ratio_high_mean", pa.float64()),
    pa.field("clip_ratio_high_max", pa.float64()),
    pa.field("clip_ratio_region_mean", pa.float64()),
    pa.field("kl_length_buckets", _list(pa.string())),
    pa.field("kl_per_token_by_len_bucket", _list(pa.float64())),
    pa.field("kl_token_count_by_len_bucket", _list(pa.float64())),
    # RewardComputation scalars
    pa.field("entropy_bonus_scale", pa.float64()),
    pa.field("seed_alpha_effective", pa.float64()),
    pa.field("seed_max_possible_entropy", pa.float64()),
    # The replay contract (maxent_arrow.rollout.RunConfig) as JSON text.
    pa.field("config", pa.string()),
]

STEP_REQUIRED = ("step", "rank", "kind", "num_groups", "num_samples")
BUCKET_COLUMNS = ("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket")


def _metadata(extra: dict[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    return {METADATA_KEY: SCHEMA_VERSION.encode(), **(extra or {})}


def group_schema(*, metadata: dict[bytes, bytes] | None = None) -> pa.Schema:
    """The group table of :data:`SCHEMA_VERSION`."""
    return pa.schema(GROUP_FIELDS, metadata=_metadata(metadata))


def step_schema(*, metadata: dict[bytes, bytes] | None = None) -> pa.Schema:
    """The step table of :data:`SCHEMA_VERSION`."""
    return pa.schema(STEP_FIELDS, metadata=_metadata(metadata))


def check_version(version: str | bytes | None, *, where: str) -> str:
    """Accept any minor version of our major; refuse a newer major (and a malformed one)."""
    if version is None:
        raise SchemaVersionError(f"{where}: no schema version in the metadata")
    if isinstance(version, bytes):
        version = version.decode()
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise SchemaVersionError(f"{where}: malformed schema version {version!r}") from None
    if major > SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"{where}: written with schema version {version}, newer than this maxent-arrow "
            f"reads ({SCHEMA_VERSION}); upgrade maxent-arrow"
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
