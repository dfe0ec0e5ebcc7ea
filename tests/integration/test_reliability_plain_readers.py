"""Fault class: readers that are not this library. A run that evolves (a reward function added
mid-run, train and eval steps mixed, an older writer without a column, the leftovers of a crashed
append) is read by DuckDB, Polars, pyarrow datasets, pandas and Hugging Face ``datasets``
straight from ``groups/*.parquet`` and ``steps/*.parquet``, in a subprocess that does not import
maxent_arrow. Every one of them sees what the store sees: every committed row once, the new
reward, the kind of each row, no leftover.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from fault_harness import env

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.testing import make_batch, unit_path

READERS = textwrap.dedent(
    """
    import json, sys
    root = sys.argv[1]
    groups, steps = root + "/groups/*.parquet", root + "/steps/*.parquet"
    out = {}
    import duckdb
    out["duckdb"] = duckdb.sql(
        "SELECT kind, count(*) AS n, count(DISTINCT step) AS steps "
        f"FROM read_parquet('{groups}') GROUP BY kind ORDER BY kind"
    ).fetchall()
    out["duckdb_format"] = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{groups}') WHERE list_contains(reward_names, 'format')"
    ).fetchall()[0][0]
    out["duckdb_steps"] = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{steps}')"
    ).fetchall()[0][0]
    import polars as pl
    frame = pl.scan_parquet(groups).group_by("kind").agg(pl.len()).sort("kind").collect()
    out["polars"] = [list(r) for r in frame.rows()]
    out["polars_format"] = pl.scan_parquet(groups).filter(
        pl.col("reward_names").list.contains("format")).select(pl.len()).collect().item()
    import pyarrow.dataset as ds
    d = ds.dataset(root + "/groups", format="parquet")
    out["pyarrow"] = d.count_rows()
    out["pyarrow_kinds"] = sorted(set(d.to_table(columns=["kind"]).column("kind").to_pylist()))
    import pandas as pd
    df = pd.read_parquet(root + "/groups", columns=["step", "kind", "reward_names", "weights"])
    out["pandas"] = len(df)
    out["pandas_format"] = int(df["reward_names"].map(lambda n: "format" in list(n)).sum())
    out["pandas_no_weights"] = int(df["weights"].isna().sum())
    import datasets
    hf = datasets.load_dataset("parquet", data_files=groups, split="train")
    hf_steps = datasets.load_dataset("parquet", data_files=steps, split="train")
    out["hf"] = hf.num_rows
    out["hf_steps"] = hf_steps.num_rows
    out["hf_buckets"] = hf_steps[0]["kl_length_buckets"]
    out["maxent_loaded"] = "maxent_arrow" in sys.modules
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def evolving(tmp_path_factory):
    root = tmp_path_factory.mktemp("evolving") / "store"
    store = RolloutStore.create(root)
    rows = {"train": 0, "eval": 0}
    for step in range(4):
        names = ("accuracy",) if step < 2 else ("accuracy", "format")
        batch = make_batch(step, reward_names=names)
        if step == 0:  # an older writer without the weights column
            batch = RolloutBatch(batch.groups.drop_columns(["weights"]), batch.step_row)
        store.append(batch)
        rows["train"] += batch.num_groups
        if step % 2:
            evaluation = make_batch(step, kind="eval", reward_names=names)
            store.append(evaluation)
            rows["eval"] += evaluation.num_groups
    # A crashed append's temp files are left where a writer would leave them.
    source = unit_path(store, "groups", 1)
    (root / "groups" / ".step-0000000009.rank-00000.train.parquet.tmp-x.1.abc").write_bytes(
        source.read_bytes()
    )
    (root / "steps" / ".step-0000000009.rank-00000.train.parquet.tmp-x.1.abc").write_bytes(b"PAR1")
    return store, rows


@pytest.mark.slow
def test_plain_readers_see_what_the_store_sees(evolving, tmp_path):
    store, rows = evolving
    environ = {**env(), "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH")  # the readers must not even find maxent_arrow
    done = subprocess.run(
        [sys.executable, "-c", READERS, str(store.root)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environ,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["maxent_loaded"] is False
    total = rows["train"] + rows["eval"]
    assert total == store.read().num_rows
    assert out["duckdb"] == [["eval", rows["eval"], 2], ["train", rows["train"], 4]]
    assert out["polars"] == [["eval", rows["eval"]], ["train", rows["train"]]]
    assert out["pyarrow"] == out["pandas"] == out["hf"] == total
    assert out["pyarrow_kinds"] == ["eval", "train"]
    with_format = (
        store.sql("SELECT count(*) AS n FROM groups WHERE list_contains(reward_names, 'format')")
        .column("n")[0]
        .as_py()
    )
    assert with_format > 0
    assert out["duckdb_format"] == out["polars_format"] == out["pandas_format"] == with_format
    assert out["pandas_no_weights"] == make_batch(0).num_groups
    assert out["duckdb_steps"] == out["hf_steps"] == len(store.units(kind=None))
    assert out["hf_buckets"] is None or isinstance(out["hf_buckets"], list)


def test_the_store_and_its_schema_agree_with_pyarrow_on_every_file(evolving):
    store, _ = evolving
    import pyarrow.parquet as pq

    schemas = [pq.read_schema(p).remove_metadata() for p in store.committed_files()]
    # Every file of the run has the one schema of the layout, also the step that was given
    # without weights and the steps with another set of reward functions: a plain reader that
    # takes the first file's schema drops nothing later files hold.
    assert all(s.equals(schemas[0]) for s in schemas)
    assert schemas[0].names == store.schema().names
    steps = [pq.read_schema(p).remove_metadata() for p in store.committed_files("steps")]
    assert all(s.equals(steps[0]) for s in steps)
