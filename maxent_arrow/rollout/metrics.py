"""Trainer-figure records: the ``trainer_metrics`` record table (``docs/arrow-layout.md``).

What a trainer logs about its optimizer steps (the loss, KL, entropy, clip ratios, grad norm,
learning rate) arrives after the rollout step it trained on is committed, and is averaged
over the optimizer steps of a logging window and their micro-batches. So it is not a column
of the step table but a record of its own, one row per log, keyed by the optimizer step and
kind, joined to the rollout step whose data it trained on (``step``, ``first_step``) and
saying what it averages (``averaged_steps``, ``loss_batches``, ``rounds``). The columns are
the registry's (:data:`~maxent_arrow.arrow.registry.TRAINER_METRICS`); every writer (the TRL
recorder from TRL's log, this library's trainer from its own step) builds its rows with
:func:`trainer_metrics_table`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError

__all__ = ["METRICS_KEY", "trainer_metrics_schema", "trainer_metrics_table"]

# The key of a record row that holds its other figures, ``{name: value}``: stored as the
# parallel ``metric_names`` / ``metric_values`` lists.
METRICS_KEY = "metrics"
_NAMES, _VALUES = "metric_names", "metric_values"
_REQUIRED = R.names(R.TRAINER_METRICS, where=lambda c: c.required)


def trainer_metrics_schema() -> pa.Schema:
    """The record table's schema, from the registry (with the schema version)."""
    fields = [c.field for c in R.columns(R.TRAINER_METRICS)]
    return pa.schema(fields, metadata={S.METADATA_KEY: S.SCHEMA_VERSION.encode()})


def trainer_metrics_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """The records of ``rows`` as a table of :func:`trainer_metrics_schema`.

    Each row maps registered column names to values (``optimizer_step`` and ``kind``
    required; ``created_at`` defaults to now) and may hold :data:`METRICS_KEY`, the other
    figures ``{name: number or None}`` (None is stored as NaN).

    Raises
    ------
    SchemaError
        An unknown key, a missing required column, a kind that is not a lowercase name, or a
        value of the wrong type, naming the row and the column.
    """
    schema = trainer_metrics_schema()
    known = set(schema.names) - {_NAMES, _VALUES}
    now = dt.datetime.now(dt.UTC)
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for i, row in enumerate(rows):
        where = f"trainer_metrics row {i}"
        unknown = sorted(set(row) - known - {METRICS_KEY})
        if unknown:
            raise SchemaError(
                f"{where}: unknown columns {unknown}; expected some of {sorted(known)}"
            )
        for name in _REQUIRED:
            if row.get(name) is None:
                raise SchemaError(f"{where}: missing {name!r}")
        S.check_kind(row["kind"], where=f"{where} kind")
        metrics = dict(row.get(METRICS_KEY) or {})
        for name in known:
            columns[name].append(row.get(name, now if name == "created_at" else None))
        columns[_NAMES].append(list(metrics))
        columns[_VALUES].append(
            [_number(v, where=f"{where} metric {k!r}") for k, v in metrics.items()]
        )
    arrays = []
    for field in schema:
        try:
            arrays.append(pa.array(columns[field.name], field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise SchemaError(
                f"trainer_metrics column {field.name!r}: expected {field.type} ({exc})"
            ) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _number(value: Any, *, where: str) -> float:
    """A figure as a float (numpy and torch scalars too); None as NaN."""
    if value is None:
        return math.nan
    if not isinstance(value, str | bytes):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
