"""Benchmark: analytics and reads at 1,000 to 100,000 steps, against the engines a user would pick.

Stores built by the writer (``benchmarks/writer_stores.py``: real appends, its default
compaction; 16 groups x 4 completions x 32-64 tokens a step, one rank), at 1,000, 10,000
and 100,000 steps (``--quick``: 150 and 300). A store not built yet is skipped as a miss
naming the reason, unless ``--build`` builds it. The peers read the same rows: our
committed files themselves (Polars ``scan_parquet``, DuckDB ``read_parquet``), a Lance copy
(DuckDB over the dataset object, Polars ``scan_pyarrow_dataset``) and a Delta copy (Polars
``scan_delta``), each written from the store's rows by the peer's own writer
(``benchmarks/peer_copies.py``).

Rows, at each size:

- **analytics, warm and cold**, three queries: the per-step mean reward, the bench's means
  (per-step mean reward and length: ``bench_analytics.MEANS``) and one group's rows by its
  id. Ours: ``store.sql(query)`` over the ``samples`` view (checks on). **Warm**: repeated on
  one store object (each peer on its one connection, dataset or lazy frame). **Cold**: a
  new process, end to end (imports, open, query; the peer returning an Arrow table, as
  ``store.sql()`` does), the time measured inside it. Peer: the best of the five, named;
  every peer's figure in the note. Target <= 1.2x the best peer. Every contender's result
  is compared with ours first.
- **``maxent-arrow query``** of the means (``--csv``), a new process, against a ``python -c``
  DuckDB script printing the same CSV from our files (target <= 1.5x).
- **a fresh ``read(steps=[s])``** of a random step, all columns: ``ReadOnlyStore(root)
  .read(steps=[s])`` against ``lance.dataset(uri).to_table(filter="step = s")`` (target <=
  1x), and its growth from the smallest to the largest size, timed in one round-robin
  across the sizes (target <= 1.3x).
- **full scan** (context, for "nothing given up"): ``ReadOnlyStore(root).read(columns=[step,
  group_index, total_utils, completion_ids])`` of every step, against ``pq.read_table`` of
  the same columns of the same files (the floor) and Polars ``scan_parquet`` (the peer).
  The append row (one step, fsync'd, to a copy of each store) is ``bench_scale.py``'s.

Run ``python benchmarks/bench_analytics_scale.py [--quick] [--build] [--sizes 1000,10000]
[--json PATH]``; exit status 1 on a miss (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import bench_analytics as BA  # noqa: E402
import harness  # noqa: E402
import peer_copies as P  # noqa: E402
import writer_stores as W  # noqa: E402
from harness import Figure, custom, within  # noqa: E402

from maxent_arrow.store import ReadOnlyStore  # noqa: E402

TARGET_VS_PEER = 1.2
TARGET_CLI = 1.5
TARGET_READ = 1.0
TARGET_READ_GROWTH = 1.3
SIZES = (1000, 10_000, 100_000)
QUICK_SIZES = (150, 300)
SCAN_COLUMNS = ["step", "group_index", "total_utils", "completion_ids"]
PEERS = ("duckdb_parquet", "polars_parquet", "duckdb_lance", "polars_lance", "polars_delta")
PEER_LABELS = {
    "duckdb_parquet": "DuckDB read_parquet of our files",
    "polars_parquet": "Polars scan_parquet of our files",
    "duckdb_lance": "DuckDB over the Lance copy",
    "polars_lance": "Polars scan_pyarrow_dataset of the Lance copy",
    "polars_delta": "Polars scan_delta of the Delta copy",
}

# The queries: ours over the samples view; the peers' DuckDB SQL over the group rows
# ({src}) and Polars' plan (in QUERY_CODE). {gid} is the group asked for.
OURS_SQL = {
    "reward": "SELECT step, avg(total_util) AS reward FROM samples GROUP BY step ORDER BY step",
    "means": BA.MEANS,
    "group": "SELECT step, group_index, total_util AS reward, advantage FROM samples "
    "WHERE group_id = '{gid}' ORDER BY completion_index",
}
LABELS = {
    "reward": "per-step mean reward",
    "means": "the bench's means (per-step reward and length)",
    "group": "one group's rows by id",
}

# One script for every contender, run in this process (warm: ``prepare`` once, ``run`` per
# call) or in a new one (cold: the time from before the imports to the Arrow result).
QUERY_CODE = textwrap.dedent(
    """
    DUCK = {
        "reward": "SELECT step, avg(u) AS reward FROM (SELECT step, unnest(total_utils) AS u "
        "FROM {src}) GROUP BY step ORDER BY step",
        "means": "SELECT step, avg(u) AS reward, avg(t) AS length FROM (SELECT step, "
        "unnest(total_utils) AS u, unnest(ref_tok_counts) AS t FROM {src}) GROUP BY step "
        "ORDER BY step",
        "group": "SELECT step, group_index, unnest(total_utils) AS reward, unnest(advantages) "
        "AS advantage FROM {src} WHERE group_id = '{gid}'",
    }

    COLUMNS = {
        "reward": ["step", "total_utils"],
        "means": ["step", "total_utils", "ref_tok_counts"],
        "group": ["step", "group_index", "group_id", "total_utils", "advantages"],
    }

    def polars_plan(pl, lf, query, gid):
        if query == "group":
            return (lf.filter(pl.col("group_id") == gid)
                    .select("step", "group_index", pl.col("total_utils").alias("reward"),
                            pl.col("advantages").alias("advantage"))
                    .explode("reward", "advantage"))
        cols = [pl.col("total_utils").mean().alias("reward")]
        if query == "means":
            cols.append(pl.col("ref_tok_counts").mean().cast(pl.Float64).alias("length"))
        names = ["step", "total_utils"] + (["ref_tok_counts"] if query == "means" else [])
        exploded = names[1:]
        return lf.select(names).explode(exploded).group_by("step").agg(cols).sort("step")

    def prepare(engine, paths, query, gid):
        '''A function that runs ``query`` with ``engine`` and returns an Arrow table.'''
        if engine == "ours":
            import sys
            sys.path.insert(0, paths["tree"])
            from maxent_arrow.store import ReadOnlyStore
            store = ReadOnlyStore(paths["store"])
            sql = paths["ours_sql"]
            return lambda: store.sql(sql)
        if engine.startswith("duckdb"):
            import duckdb
            con = duckdb.connect()
            if engine == "duckdb_parquet":
                src = "read_parquet(" + repr(paths["files"]) + ")"
                sql = DUCK[query].format(src=src, gid=gid)
                return lambda: con.sql(sql).to_arrow_table()
            # DuckDB's scan of the dataset object itself fails on the copy's large_list
            # column (Lance's pushdown: "conversion to substrait::Type from large_list"),
            # so DuckDB reads Lance's scanner of the query's columns, made per query.
            import lance
            ds = lance.dataset(paths["lance"])
            sql = DUCK[query].format(src="lance_groups", gid=gid)
            columns = COLUMNS[query]

            def run():
                con.register("lance_groups", ds.scanner(columns=columns).to_reader())
                return con.sql(sql).to_arrow_table()
            return run
        import polars as pl
        if engine == "polars_parquet":
            lf = pl.scan_parquet(paths["files"])
        elif engine == "polars_lance":
            import lance
            ds = lance.dataset(paths["lance"])
            if query == "group":
                # Polars' predicate pushed into the dataset fails as DuckDB's scan does (the
                # large_list column), so the filter is Lance's own, the rest Polars'.
                where = "group_id = '" + gid + "'"

                def run():
                    rows = ds.to_table(columns=COLUMNS[query], filter=where)
                    return polars_plan(pl, pl.from_arrow(rows).lazy(), query, gid).collect()
                return lambda: run().to_arrow()
            lf = pl.scan_pyarrow_dataset(ds)
        else:
            lf = pl.scan_delta(paths["delta"])
        plan = polars_plan(pl, lf, query, gid)
        return lambda: plan.collect().to_arrow()
    """
)
COLD = (
    "import sys, time, json\nt0 = time.perf_counter()\n"
    + QUERY_CODE
    + "\nengine, query, gid = sys.argv[1:4]\npaths = json.loads(sys.argv[4])\n"
    "prepare(engine, paths, query, gid)()\nprint(time.perf_counter() - t0)\n"
)
_NAMESPACE: dict[str, Any] = {}
exec(QUERY_CODE, _NAMESPACE)  # the warm contenders: the same code, in this process
prepare: Callable[..., Callable[[], pa.Table]] = _NAMESPACE["prepare"]


def _inner(argv: list[str]) -> float:
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _wall(argv: list[str]) -> float:
    import time

    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True)
    return time.perf_counter() - t0


def _exe() -> list[str]:
    exe = Path(sys.executable).with_name("maxent-arrow")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "maxent_arrow.cli"]


# ---------------------------------------------------------------------------- checks
def _same(ours: pa.Table, theirs: pa.Table, query: str, engine: str) -> None:
    """A contender that computes something else proves nothing: its result against ours."""
    if query == "group":
        order = [("step", "ascending"), ("reward", "ascending")]
        ours, theirs = ours.sort_by(order), theirs.sort_by(order)
    assert ours.num_rows == theirs.num_rows, (engine, query, ours.num_rows, theirs.num_rows)
    for name in ours.column_names:
        a = np.asarray(ours.column(name).to_numpy(), dtype=float)
        b = np.asarray(theirs.column(name).to_numpy(), dtype=float)
        np.testing.assert_allclose(a, b, rtol=1e-9, err_msg=f"{engine} {query} {name}")


# ---------------------------------------------------------------------------- one store
class Size:
    """One store and its copies: what every contender is given."""

    def __init__(self, built: W.Built):
        self.built = built
        self.steps = built.shape.steps
        self.root = built.path
        store = ReadOnlyStore(self.root)
        self.files = [str(p) for p in store.committed_files("groups")]
        self.lance = P.lance_copy(self.root)
        self.delta = P.delta_copy(self.root)
        self.gid = f"{self.steps // 2}.0.7"

    def paths(self, query: str) -> dict[str, Any]:
        return {
            "tree": str(ROOT),
            "store": str(self.root),
            "files": self.files,
            "lance": str(self.lance),
            "delta": str(self.delta),
            "ours_sql": OURS_SQL[query].format(gid=self.gid),
        }

    def label(self) -> str:
        return f"{self.steps:,} steps ({self.built.shape.num_groups:,} groups)"


def analytics_rows(bench: harness.Bench, size: Size) -> None:
    """Each query warm (one object each) and cold (a new process each), ours and the five
    peers alternated."""
    for query in OURS_SQL:
        paths = size.paths(query)
        warm = {engine: prepare(engine, paths, query, size.gid) for engine in ("ours", *PEERS)}
        ours = warm["ours"]()
        for engine in PEERS:
            _same(ours, warm[engine](), query, engine)
        t = harness.measure(warm, repeats=bench.repeats(7, quick=3))
        argv = {
            engine: [sys.executable, "-c", COLD, engine, query, size.gid, json.dumps(paths)]
            for engine in ("ours", *PEERS)
        }
        cold = harness.measure(
            {engine: (lambda a=a: _inner(a)) for engine, a in argv.items()},
            repeats=bench.repeats(3, quick=1),
            warmup=1,
        )
        for mode, timing in (("warm", t), ("cold", cold)):
            best = min(PEERS, key=lambda e: timing[e].median)
            every = "; ".join(
                f"{PEER_LABELS[e]} {harness.fmt_value(timing[e].median)}" for e in PEERS
            )
            how = (
                "repeated on one store object"
                if mode == "warm"
                else "a new process: import, open, query (measured inside)"
            )
            bench.row(
                f"{LABELS[query]}, {mode}, {size.label()}",
                ours=Figure(timing["ours"], f"store.sql() over samples, {how}"),
                peer=Figure(timing[best], f"the best peer: {PEER_LABELS[best]}"),
                targets=[within("peer", TARGET_VS_PEER)],
                note=f"every peer, Arrow out: {every}",
                reason="one row group per step in the writer's segments (footers and "
                "chunks per step), and the library's per-file work on the query path: the "
                "log's records, the views and the checks",
                detail=query != "reward",
            )


def cli_row(bench: harness.Bench, size: Size) -> None:
    """``maxent-arrow query --csv`` against a ``python -c`` DuckDB script printing the same
    CSV from our files."""
    sql = BA.CLI_QUERY
    ours = [*_exe(), "query", str(size.root), sql.format(source="groups"), "--csv"]
    # (DuckDB's write_csv('/dev/stdout') into a pipe lost rows once under load: the rows
    # go through Python's csv writer instead)
    script = (
        "import csv, sys, duckdb; r = duckdb.sql(sys.argv[1]); w = csv.writer(sys.stdout); "
        "w.writerow(r.columns); w.writerows(r.fetchall())"
    )
    source = "read_parquet(" + repr(size.files) + ")"
    peer = [sys.executable, "-c", script, sql.format(source=source)]
    mine = subprocess.run(ours, capture_output=True, text=True, check=True).stdout
    theirs = subprocess.run(peer, capture_output=True, text=True, check=True).stdout
    lines = (len(mine.splitlines()), len(theirs.splitlines()))
    assert lines == (size.steps + 1, size.steps + 1), f"CSV lines (ours, peer): {lines}"
    t = harness.measure(
        {"ours": lambda: _wall(ours), "peer": lambda: _wall(peer)},
        repeats=bench.repeats(5, quick=2),
    )
    bench.row(
        f"maxent-arrow query --csv, end to end, {size.label()}",
        ours=Figure(t["ours"], "the CLI: import, open, checks, query, CSV"),
        peer=Figure(t["peer"], "python -c: import duckdb, the query on read_parquet, CSV"),
        targets=[within("peer", TARGET_CLI)],
        reason="the imports (pyarrow, the store) and the per-file work of the views",
    )


def read_rows(bench: harness.Bench, sizes: list[Size]) -> None:
    """A fresh ``read(steps=[s])`` at every size in one round-robin, against Lance's
    filter on a fresh dataset; the growth from the smallest to the largest."""
    import lance

    rng = np.random.default_rng(0)
    fns: dict[str, Callable[[], object]] = {}
    for size in sizes:
        root, uri, steps = size.root, str(size.lance), size.steps
        ours = ReadOnlyStore(root).read(steps=[steps // 3])
        theirs = lance.dataset(uri).to_table(filter=f"step = {steps // 3}")
        assert ours.num_rows == theirs.num_rows == size.built.shape.groups
        fns[f"ours {steps}"] = lambda r=root, n=steps: ReadOnlyStore(r).read(
            steps=[int(rng.integers(n))]
        )
        fns[f"lance {steps}"] = lambda u=uri, n=steps: lance.dataset(u).to_table(
            filter=f"step = {int(rng.integers(n))}"
        )
    t = harness.measure(fns, repeats=bench.repeats(9, quick=3))
    small = sizes[0].steps
    for size in sizes:
        steps = size.steps
        growth = t[f"ours {steps}"].median / t[f"ours {small}"].median
        targets = [within("peer", TARGET_READ)]
        if size is sizes[-1] and len(sizes) > 1:
            label = f"ours at {steps:,} / at {small:,} steps"
            targets.append(custom(label, growth, "<=", TARGET_READ_GROWTH))
        bench.row(
            f"a fresh read(steps=[s]), {size.label()}",
            ours=Figure(t[f"ours {steps}"], "ReadOnlyStore(root).read(steps=[s]), all columns"),
            peer=Figure(t[f"lance {steps}"], 'lance.dataset(uri).to_table(filter="step = s")'),
            targets=targets,
            note=f"ours at {steps:,} steps over ours at {small:,}: {growth:.2f}x",
            reason="the open reads the log's state and unifies every live file's schema",
        )


def scan_row(bench: harness.Bench, size: Size) -> None:
    """A full scan of a few columns, every step (context: nothing given up)."""
    import polars as pl
    import pyarrow.parquet as pq

    def polars_scan() -> Any:
        return pl.scan_parquet(size.files).select(SCAN_COLUMNS).collect().to_arrow()

    t = harness.measure(
        {
            "ours": lambda: ReadOnlyStore(size.root).read(columns=SCAN_COLUMNS),
            "floor": lambda: pq.read_table(size.files, columns=SCAN_COLUMNS),
            "peer": polars_scan,
        },
        repeats=bench.repeats(3, quick=2),
    )
    bench.row(
        f"full scan of {', '.join(SCAN_COLUMNS)}, {size.label()}",
        ours=Figure(t["ours"], "ReadOnlyStore(root).read(columns=...): open, checks, decode"),
        peer=Figure(t["peer"], "Polars scan_parquet of the same files and columns"),
        floor=Figure(t["floor"], "pq.read_table of the same files and columns, no checks"),
        note="context: the figure a change of the layout must not make worse",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    harness.add_arguments(parser)
    parser.add_argument("--build", action="store_true", help="build the stores not built yet")
    parser.add_argument("--sizes", default=None, help="steps, comma-separated")
    args = parser.parse_args(argv)
    build = bool(vars(args).pop("build"))
    chosen = vars(args).pop("sizes")
    bench = harness.Bench("analytics_scale", args)
    steps = QUICK_SIZES if bench.quick else SIZES
    if chosen:
        steps = tuple(int(s) for s in chosen.split(","))
    sizes = []
    for n in steps:
        built = W.cached(W.Shape(n), build_missing=build or bench.quick)
        if isinstance(built, str):
            print(f"skipped {n:,} steps: {built}", flush=True)
            for what in ("analytics", "a fresh read(steps=[s])"):
                bench.row(
                    f"{what}, {n:,} steps",
                    ours=Figure(math.nan, "not measured"),
                    targets=[custom("store built", 0, ">=", 1)],
                    reason=f"skipped: {built}",
                )
            continue
        print(f"store: {built.describe()}", flush=True)
        sizes.append(Size(built))
    for size in sizes:
        analytics_rows(bench, size)
        cli_row(bench, size)
        scan_row(bench, size)
    if sizes:
        read_rows(bench, sizes)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
