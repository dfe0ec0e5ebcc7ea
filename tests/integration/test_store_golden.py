"""The golden schema-v1 store in ``data/golden_v1`` (written by ``data/make_golden_v1.py``): every
later version must read it and find exactly what ``data/golden_v1_expected.json`` records."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pyarrow.dataset as ds
import pytest

from maxent_arrow import ReadOnlyFormatError, RolloutStore, SchemaError
from maxent_arrow.arrow import registry as R
from maxent_arrow.store import upgrade
from maxent_arrow.types import records_equal

DATA = Path(__file__).resolve().parents[2] / "data"
EXPECTED = json.loads((DATA / "golden_v1_expected.json").read_text())


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


@pytest.fixture
def golden(tmp_path):
    # A copy, so that no test can change the shipped files (and opening must not either).
    shutil.copytree(DATA / "golden_v1", tmp_path / "golden_v1")
    store = RolloutStore(tmp_path / "golden_v1")
    before = sorted(
        (p.relative_to(store.root), p.read_bytes()) for p in store.root.rglob("*") if p.is_file()
    )
    yield store
    after = sorted(
        (p.relative_to(store.root), p.read_bytes()) for p in store.root.rglob("*") if p.is_file()
    )
    assert after == before, "reading the golden store changed it"


def test_golden_store_verifies(golden):
    report = golden.verify()
    assert report.ok, str(report)
    assert golden.manifest["schema_version"] == EXPECTED["schema_version"]
    assert golden.config == {"run": "golden-v1", "model": "tiny-gpt2"}


def test_golden_store_reads_as_recorded(golden):
    units = golden.read_steps(columns=["step", "rank", "kind"]).to_pydict()
    assert [list(u) for u in zip(*units.values())] == EXPECTED["units"]
    table = golden.read()
    assert table.num_rows == EXPECTED["groups"]
    # Read in the current layout: every v1 column is there, plus what 2.0 added.
    assert set(EXPECTED["columns"]) - {"rewards"} <= set(table.column_names)
    assert {"kind", "group_id", "num_completions", "reward_names", "reward_values"} <= set(
        table.column_names
    )
    names = table.column("reward_names").to_pylist()
    assert sorted({n for row in names for n in row}) == sorted(EXPECTED["reward_fields"])
    nulls = sum(
        1 for n, s in zip(names, table.column("step").to_pylist()) if s < 2 and "format" not in n
    )
    assert nulls == EXPECTED["format_nulls_before_step_2"] > 0
    assert _digest(table.column("completion_ids").to_pylist()) == EXPECTED["completion_ids_sha"]
    assert _digest(table.column("q").to_pylist()) == EXPECTED["q_sha"]
    assert _digest(table.column("ref_token_logp").to_pylist()) == EXPECTED["ref_token_logp_sha"]
    assert (
        golden.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py()
        == EXPECTED["samples"]
    )
    means = golden.read_steps(columns=["reward_mean"]).column("reward_mean").to_pylist()
    assert means == EXPECTED["reward_mean"]


def test_golden_replay_from_archive_and_cache(golden):
    parquet = list(golden.replay(source="parquet"))
    auto = list(golden.replay(source="auto"))  # the step-2 copies come from the IPC cache
    assert [(b.step, b.rank) for b in parquet] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    for a, b in zip(parquet, auto):
        assert a.groups.equals(b.groups) and a.step_row.equals(b.step_row)
        assert a.generation_batch == b.generation_batch
        assert a.reward_computation.total_utils == b.reward_computation.total_utils
        assert records_equal(a.reference_logprobs, b.reference_logprobs)  # tensors


def test_golden_files_read_by_other_tools(golden):
    files = [str(p) for p in golden.committed_files()]
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet({files}, union_by_name=true)").fetchall()
    assert rows[0][0] == EXPECTED["groups"]
    dataset = ds.dataset(files, schema=golden.schema())
    assert dataset.count_rows() == EXPECTED["groups"]


# ---------------------------------------------------------------------------- golden v2
EXPECTED_V2 = json.loads((DATA / "golden_v2_expected.json").read_text())


def _digest_v2(values: list) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture
def golden_v2(tmp_path):
    shutil.copytree(DATA / "golden_v2", tmp_path / "golden_v2")
    store = RolloutStore(tmp_path / "golden_v2")
    before = sorted(
        (p.relative_to(store.root), p.read_bytes()) for p in store.root.rglob("*") if p.is_file()
    )
    yield store
    after = sorted(
        (p.relative_to(store.root), p.read_bytes()) for p in store.root.rglob("*") if p.is_file()
    )
    assert after == before, "reading the golden store changed it"


def test_golden_v2_store_verifies_and_reads_as_recorded(golden_v2):
    report = golden_v2.verify()
    assert report.ok, str(report)
    assert golden_v2.manifest["schema_version"] == EXPECTED_V2["schema_version"]
    units = golden_v2.read_steps(columns=["step", "rank", "kind"]).to_pydict()
    assert [list(u) for u in zip(*units.values())] == EXPECTED_V2["units"]
    table = golden_v2.read()
    assert table.num_rows == EXPECTED_V2["groups"]
    assert table.column_names == EXPECTED_V2["columns"]
    names = table.column("reward_names").to_pylist()
    assert sorted({n for row in names for n in row}) == EXPECTED_V2["reward_names"]
    assert sum("format" not in n for n in names) == EXPECTED_V2["rows_without_format"] > 0
    chats = table.column("prompt_messages").to_pylist()
    assert sum(1 for m in chats if m) == EXPECTED_V2["chat_prompts"] > 0
    assert table.column("weights").null_count == EXPECTED_V2["rows_without_weights"] > 0
    for column in ("completion_ids", "reward_values", "q", "ref_token_logp", "prompt_messages"):
        assert _digest_v2(table.column(column).to_pylist()) == EXPECTED_V2[f"{column}_sha"]
    samples = golden_v2.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py()
    assert samples == EXPECTED_V2["samples"]
    means = golden_v2.read_steps(columns=["reward_mean"]).column("reward_mean").to_pylist()
    assert means == EXPECTED_V2["reward_mean"]


def test_golden_v2_replay_from_archive_cache_and_chat_messages(golden_v2):
    parquet = list(golden_v2.replay(source="parquet"))
    auto = list(golden_v2.replay(source="auto"))  # the step-2 copies come from the IPC cache
    assert [(b.step, b.rank) for b in parquet] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    for a, b in zip(parquet, auto):
        assert a.groups.equals(b.groups) and a.step_row.equals(b.step_row)
        assert a.generation_batch == b.generation_batch
    chat = parquet[4].generation_batch
    assert isinstance(chat.prompts[1], list) and chat.prompts[1][1]["name"] == "tester"
    assert chat.grouped_completions[1][0][0]["role"] == "assistant"


def test_golden_v2_files_read_by_other_tools(golden_v2):
    files = [str(p) for p in golden_v2.committed_files()]
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet({files})").fetchall()
    assert rows[0][0] == EXPECTED_V2["groups"]
    assert ds.dataset(files).count_rows() == EXPECTED_V2["groups"]


# ---------------------------------------------------------------------------- TRL, schema 2.0
# A real trl.GRPOTrainer run recorded by schema 2.0 (data/make_golden_trl_v2.py): its files
# carry the MaxEnt columns as null padding and its step files record no layout family.
EXPECTED_TRL = json.loads((DATA / "golden_trl_v2_expected.json").read_text())
MAXENT_ONLY = sorted(c.name for c in R.columns(R.GROUP) if c.families == (R.MAXENT,))
MAXENT_ONLY_STEP = sorted(c.name for c in R.columns(R.STEP) if c.families == (R.MAXENT,))


@pytest.fixture
def golden_trl(tmp_path):
    shutil.copytree(DATA / "golden_trl_v2", tmp_path / "golden_trl_v2")
    return RolloutStore(tmp_path / "golden_trl_v2")


def test_golden_trl_v2_reads_every_value_with_the_maxent_padding_hidden(golden_trl):
    """The 2.0 TRL store verifies and reads as recorded; its MaxEnt columns, physically in
    every file as nulls, are not in its schema, its read() or its SQL views."""
    assert MAXENT_ONLY and {"q", "weights", "seed_semantic_entropy"} <= set(MAXENT_ONLY)
    report = golden_trl.verify()
    assert report.ok, str(report)
    assert golden_trl.manifest["schema_version"] == EXPECTED_TRL["schema_version"] == "2.0"
    files = [str(p) for p in golden_trl.committed_files()]
    physical = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet({files})").fetchall()
    assert [row[0] for row in physical] == EXPECTED_TRL["file_columns"]  # the padding is there
    table = golden_trl.read()
    assert table.num_rows == EXPECTED_TRL["groups"]
    assert not set(MAXENT_ONLY) & set(table.column_names)
    assert set(table.column_names) == set(EXPECTED_TRL["file_columns"]) - set(MAXENT_ONLY)
    assert not set(MAXENT_ONLY_STEP) & set(golden_trl.schema("steps").names)
    for column in ("completion_ids", "advantages"):
        assert _digest_v2(table.column(column).to_pylist()) == EXPECTED_TRL[f"{column}_sha"]
    values = [
        [[None if v != v else v for v in c] for c in row]
        for row in table.column("reward_values").to_pylist()
    ]
    assert _digest_v2(values) == EXPECTED_TRL["reward_values_sha"]
    for view in ("groups", "samples", "steps"):
        described = {r["column_name"] for r in golden_trl.sql(f"DESCRIBE {view}").to_pylist()}
        assert not described & set(MAXENT_ONLY + MAXENT_ONLY_STEP), (view, described)
    described = {r["column_name"] for r in golden_trl.sql("DESCRIBE samples").to_pylist()}
    assert {"completion", "advantage", "reward_correct", "reward_sometimes_none"} <= described
    n = golden_trl.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py()
    assert n == EXPECTED_TRL["samples"]


def test_golden_trl_v2_takes_appends_in_its_own_layout_once_upgraded(golden_trl):
    """A 2.0 TRL store is appended to only once upgraded (before, the append is refused
    naming ``upgrade``); then it keeps one layout: its families are inferred from the columns
    its files carry data in (core and TRL), so a MaxEnt batch is refused and its padding
    stays hidden."""
    from maxent_arrow.testing import make_batch

    assert golden_trl.schemas.families() == ("core",)
    with pytest.raises(ReadOnlyFormatError, match="maxent-arrow upgrade"):
        golden_trl.append(make_batch(7))
    upgrade(golden_trl.root)
    store = RolloutStore(golden_trl.root, if_exists="resume")
    assert store.schemas.families() == ("core",)
    with pytest.raises(SchemaError, match="fixed at its first append"):
        store.append(make_batch(7))
    assert store.steps() == [u[0] for u in EXPECTED_TRL["units"]]
