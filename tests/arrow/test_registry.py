"""The column registry: every stored column declared once, and what is derived from it."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pyarrow as pa
import pytest

from maxent_arrow import types as T
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.store.sql.plan import SAMPLE_ALIASES, samples_view_sql
from maxent_arrow.store.storage.parquet import group_file_layout

ROOT = Path(__file__).resolve().parents[2]


def _depth(kind: pa.DataType) -> int:
    depth = 0
    while pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind, depth = kind.value_type, depth + 1
    return depth


def test_the_docs_column_tables_are_the_registry_s():
    """``docs/arrow-layout.md`` holds exactly the tables ``docs/make_columns.py`` writes."""
    spec = importlib.util.spec_from_file_location("make_columns", ROOT / "docs" / "make_columns.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (ROOT / "docs" / "arrow-layout.md").read_text(encoding="utf-8")
    assert module.with_tables(text) == text, "run: python docs/make_columns.py"
    for c in R.columns(R.GROUP):
        assert f"| `{c.name}` |" in text, c.name


@pytest.mark.parametrize("column", R.REGISTRY, ids=lambda c: f"{c.table}.{c.name}")
def test_every_column_is_declared_consistently(column: R.Column):
    """Level and type agree (completion: one list level, token: two); list children are
    non-nullable at every level; families are known; a column that feeds a seed record names
    a real field of a real seed class; Parquet settings fit the type."""
    # One list level per completion, two per token (an item may itself be a list: a chat's
    # messages, a vector of rewards).
    minimum = {"group": 0, "step": 0, "record": 0, "completion": 1, "token": 2}[column.level]
    assert _depth(column.type) >= minimum, column.name
    kind = column.type
    while pa.types.is_list(kind):
        assert not kind.value_field.nullable, column.name
        kind = kind.value_type
    assert column.families and set(column.families) <= set(R.FAMILIES)
    assert column.field.nullable is not column.required
    for entry in column.fed:
        record, field = entry.split(".")
        cls = getattr(T, record)
        assert field in {f.name for f in dataclasses.fields(cls)}, entry
    if column.dictionary:
        assert pa.types.is_string(kind), column.name
    if column.byte_stream_split:
        assert column.level == "token" and pa.types.is_floating(kind)


def test_names_are_unique_per_table_and_samples_aliases_do_not_collide():
    for table in (R.GROUP, R.STEP, R.TRAINER_METRICS):
        names = R.names(table)
        assert len(names) == len(set(names))
    aliases = list(SAMPLE_ALIASES.values())
    assert len(aliases) == len(set(aliases))
    view = samples_view_sql(S.group_schema().names, ["accuracy"])
    for column, alias in SAMPLE_ALIASES.items():
        if column not in ("completion_info",):
            assert f'AS "{alias}"' in view, alias


def test_parquet_settings_and_layouts_come_from_the_registry():
    layout = group_file_layout(S.group_schema())
    assert list(layout.dictionary) == [c.name for c in R.columns() if c.dictionary]
    assert layout.statistics == ("step", "rank", "kind", "group_index")
    assert "ref_token_logp.list.element.list.element" in layout.byte_stream_split
    assert not [p for p in layout.byte_stream_split if p.startswith("completion_ids")]
    for families in (("core",), ("core", "maxent"), ("core", "trl"), ("core", "verl")):
        layout = S.group_schema(families=families)
        assert layout.names == [c.name for c in R.columns(families=families)]
        assert R.family_of_columns(layout.names) == set(families)


def test_seed_read_back_field_lists_are_the_registry_s():
    length = R.feeding("LengthStats", R.STEP)
    assert length == tuple(f.name for f in dataclasses.fields(T.LengthStats))
    loss = R.feeding("LossScalarBundle", R.STEP)
    assert loss == tuple(f.name for f in dataclasses.fields(T.LossScalarBundle))
    generation = set(R.feeding("GenerationBatch"))
    assert {"prompt", "prompt_messages", "answer", "completions", "completion_info"} <= generation


def test_user_column_prefixes_are_no_registered_column_s():
    """A run's user columns (``ds_<name>``, ``extra_<name>``) cannot shadow a registered
    column, and ``prefix_of`` tells them from registered ones; their prefixes are listed in the
    generated tables."""
    for table in (R.GROUP, R.STEP, R.TRAINER_METRICS):
        assert [n for n in R.names(table) if R.prefix_of(n, table) is not None] == []
    assert R.prefix_of("ds_source").level == "group"
    assert R.prefix_of("extra_verdict").level == "completion"
    assert R.prefix_of("answer") is None and R.prefix_of("ds_x", R.STEP) is None
    assert "| `ds_<name>` | per run | group |" in R.markdown_table(R.GROUP)


def test_trainer_metrics_records_name_what_they_average_and_their_join_keys():
    """The trainer-figure record table: keyed by the optimizer step and kind, joined to the
    rollout step that generated its data, with what it averages; each figure it copies from
    TRL's log names the log key."""
    identity = R.names(R.TRAINER_METRICS, where=lambda c: c.identity)
    assert identity == ("optimizer_step", "kind", "step", "first_step")
    assert {"averaged_steps", "loss_batches", "rounds"} <= set(R.names(R.TRAINER_METRICS))
    logged = {c.logged_as: c.name for c in R.columns(R.TRAINER_METRICS) if c.logged_as}
    assert logged["clip_ratio/low_mean"] == "clip_ratio_low_mean"
    assert {"loss", "kl", "entropy", "grad_norm", "learning_rate"} <= set(logged)
