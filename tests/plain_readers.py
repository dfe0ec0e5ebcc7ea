"""The plain readers' recipe of ``docs/commit-protocol.md`` ("Plain readers"), written with
DuckDB and with Polars alone (no maxent_arrow): the effective group rows of a store from its
log checkpoint, less the groups its lifecycle records drop. Tests compare them with what the
library serves."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl

KEY = ["step", "rank", "kind", "group_index"]


def duckdb_groups(root: Path) -> list[tuple]:
    """The effective group rows' keys, sorted, as DuckDB reads them through the recipe."""
    con = duckdb.connect()
    checkpoint = str(root / "log" / "_checkpoint.parquet")
    live = con.execute(
        "SELECT path, cutoff FROM read_parquet(?) WHERE kind = 'group_file' AND effective",
        [checkpoint],
    ).fetchall()
    parts = []
    for path, cutoff in live:
        where = "" if cutoff is None else f" WHERE step < {int(cutoff)}"
        parts.append(
            f"SELECT step, rank, kind, group_index FROM read_parquet('{root / path}'){where}"
        )
    if not parts:
        return []
    con.execute("CREATE TEMP VIEW live AS " + " UNION ALL BY NAME ".join(parts))
    records = con.execute(
        "SELECT path, cutoff FROM read_parquet(?) WHERE kind = 'records:lifecycle'",
        [checkpoint],
    ).fetchall()
    dropped = []
    for path, cutoff in records:
        where = "event = 'dropped'" + ("" if cutoff is None else f" AND step < {int(cutoff)}")
        dropped.append(
            "SELECT rollout_step AS step, rollout_rank AS rank, rollout_kind AS kind, "
            f"group_index FROM read_parquet('{root / path}') WHERE {where}"
        )
    query = "SELECT * FROM live"
    if dropped:
        query += " EXCEPT ALL (" + " UNION ALL ".join(dropped) + ")"
    return sorted(con.execute(query).fetchall())


def polars_groups(root: Path) -> list[tuple]:
    """The same through Polars."""
    checkpoint = pl.read_parquet(root / "log" / "_checkpoint.parquet")
    live = checkpoint.filter((pl.col("kind") == "group_file") & pl.col("effective"))
    frames = []
    for path, cutoff in live.select(["path", "cutoff"]).iter_rows():
        frame = pl.read_parquet(root / path, columns=KEY)
        if cutoff is not None:
            frame = frame.filter(pl.col("step") < cutoff)
        frames.append(frame)
    if not frames:
        return []
    groups = pl.concat(frames, how="diagonal_relaxed")
    records = checkpoint.filter(pl.col("kind") == "records:lifecycle")
    drops = []
    for path, cutoff in records.select(["path", "cutoff"]).iter_rows():
        frame = pl.read_parquet(root / path).filter(pl.col("event") == "dropped")
        if cutoff is not None:
            frame = frame.filter(pl.col("step") < cutoff)
        drops.append(
            frame.select(
                pl.col("rollout_step").alias("step"),
                pl.col("rollout_rank").alias("rank"),
                pl.col("rollout_kind").alias("kind"),
                pl.col("group_index"),
            )
        )
    if drops:
        groups = groups.join(pl.concat(drops), on=KEY, how="anti")
    return sorted(groups.iter_rows())
