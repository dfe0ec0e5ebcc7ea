"""``RunAnalytics``: SQL and the ready-made queries over a saved run, by embedded DuckDB.

It opens a store (read only) and queries the views of
:class:`~maxent_arrow.store.SqlViews` over its committed files (checked against the commit
record, sandboxed):

``groups``
    One row per prompt group, unified across files by column name (a column an older writer
    lacked reads as NULL).
``samples``
    One row per completion (``sample_index`` within the group row), every per-completion list
    indexed at the same position; ``reward_<name>`` per reward function; ``completion_info``
    spread into ``finish_reason, stop_reason, truncated, token_count, extra``.
``steps``
    One row per (step, rank, kind): the step table.
``sample_scalars`` (after :meth:`RunAnalytics.materialize`)
    An in-memory table of every per-completion scalar (no text, no tokens), one row per
    completion.

The ready-made queries (:meth:`~maxent_arrow.analytics.queries.ReadyMadeQueries.reward_curve`
and the rest) return ``pyarrow.Table`` objects.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from maxent_arrow.analytics.attempts import attempt_statuses
from maxent_arrow.analytics.queries import DEFAULT_QUANTILES, ReadyMadeQueries, config_of
from maxent_arrow.analytics.relations import RunRelations
from maxent_arrow.analytics.sqlerrors import check_sql, explain_failure
from maxent_arrow.errors import QueryError, StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.history.catalog import (
    Catalog,
    OnError,
    check_on_error,
    fail,
    locate,
)
from maxent_arrow.store.history.state import count_runs
from maxent_arrow.store.io.reader import check_group_bytes
from maxent_arrow.store.storage.names import GROUPS, STEPS

__all__ = ["DEFAULT_QUANTILES", "RunAnalytics", "describe_run", "open_run"]


class RunAnalytics(ReadyMadeQueries):
    """Embedded DuckDB over one store: views and the ready-made queries.

    Parameters
    ----------
    root
        The store (a directory or URI, or an open :class:`~maxent_arrow.RolloutStore`).
        Nothing is written to it.
    on_error
        ``"raise"``: a damaged or missing committed file is a :class:`StoreError` naming it;
        ``"skip"``: it is left out with a warning. Default: the store's (``"raise"``).
    threads
        DuckDB worker threads; ``None`` keeps DuckDB's default (all cores).
    materialize
        Build ``sample_scalars`` right away (one scan of the scalar list columns), so every
        ready-made query afterwards runs from memory. Worth it when running several queries
        (the report does).
    progress
        Accepted for the command line's ``--progress``; opening reports no progress.

    The file list is taken when the object is built: files committed later are seen after
    :meth:`refresh`. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | ReadOnlyStore,
        *,
        on_error: OnError | None = None,
        threads: int | None = None,
        materialize: bool = False,
        progress: bool = False,
    ) -> None:
        self.store = root if isinstance(root, ReadOnlyStore) else ReadOnlyStore(root)
        self.root = self.store.root
        self.views = self.store.sql_views(on_error=on_error, threads=threads)
        self.rel = RunRelations(self.views)
        if materialize:
            self.materialize()

    def refresh(self) -> None:
        """List the committed files again and rebuild the views over them."""
        self.views.refresh()
        self.rel.rebuild()

    def materialize(self) -> None:
        """Build the in-memory ``sample_scalars`` table (one scan) and answer the ready-made
        queries from it from now on."""
        self.rel.materialize()

    @property
    def materialized(self) -> bool:
        return self.rel.materialized

    @property
    def reward_names(self) -> list[str]:
        return self.rel.reward_names

    @property
    def group_schema(self) -> pa.Schema:
        return self.views.group_schema

    @property
    def step_schema(self) -> pa.Schema:
        return self.views.step_schema

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run one read-only query over the views (checked and sandboxed); Arrow back.

        A mistake in the statement (it does not parse, or names a table, column or function
        the views lack) is a :class:`QueryError` with DuckDB's whole message on one line
        (its "Did you mean" and "Candidate bindings" hints included); a failure while it runs
        is a :class:`StoreError` (:mod:`~maxent_arrow.analytics.sqlerrors`).
        """
        try:
            return self.views.query(query, params)
        except QueryError:
            check_sql(query)  # DuckDB's whole message of a statement that does not parse
            raise
        except StoreError as exc:
            raise explain_failure(self.views.con, query, params, exc) from None

    def view_columns(self) -> dict[str, list[tuple[str, str]]]:
        """Each view :meth:`sql` can name (``groups``, ``samples``, ``steps``, the history's
        and the record tables'), with its columns and their DuckDB types, in order."""
        rows = self.views.query(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_name NOT LIKE '\\_%' ESCAPE '\\' ORDER BY table_name, ordinal_position"
        ).to_pylist()
        out: dict[str, list[tuple[str, str]]] = {}
        for r in rows:
            out.setdefault(r["table_name"], []).append((r["column_name"], r["data_type"]))
        first = [n for n in ("groups", "samples", "steps") if n in out]
        return {n: out[n] for n in [*first, *sorted(set(out) - set(first))]}

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (shows which columns each scan reads)."""
        return self.views.explain(query)

    def close(self) -> None:
        self.views.close()

    def __enter__(self) -> RunAnalytics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ summaries
    def manifest(self) -> dict[str, Any]:
        """The store's ``manifest.json``."""
        return dict(self.store.manifest)

    def describe(self) -> dict[str, Any]:
        """What ``maxent-arrow inspect`` prints (:func:`describe_run`): schema version,
        steps, ranks (``ranks``: the rank ids), rows, sizes, the manifest's ``config`` (as
        the store was created) and the ``run_config`` the steps recorded (:meth:`run_config`:
        the tokenizer, the model...)."""
        return describe_run(self.store, on_error=self.views.on_error)

    def describe_from_views(self) -> dict[str, Any]:
        """:meth:`describe` computed another way: from the views, one scan of the step rows,
        the file sizes of a listing, every group file's footer checked. The same answer as
        the catalog's summaries give (:func:`describe_run`), read from the data itself: a
        check of them (the tests compare the two), at the cost of a scan."""
        self.views.check_footers()
        # One scan of the step rows: the counts of each kind (its ranks beside), and each
        # kind's distinct run configs with their last step (the run_config).
        rows = self.rel.sql(
            "SELECT kind, config, grouping(config) AS per_kind, count(DISTINCT step) AS steps, "
            "min(step) AS first, max(step) AS last, count(*) AS step_rows, "
            "sum(num_groups)::BIGINT AS groups, sum(num_samples)::BIGINT AS samples, "
            "list(DISTINCT rank) AS ranks FROM steps "
            "GROUP BY GROUPING SETS ((kind), (kind, config)) ORDER BY kind"
        ).to_pylist()
        configs = sorted(
            (r for r in rows if not r["per_kind"] and r["config"] is not None),
            key=lambda r: r["last"],
        )
        steps = [r for r in rows if r["per_kind"]]
        ranks = sorted({r for row in steps for r in row["ranks"] or ()})
        keep = ("steps", "first", "last", "step_rows", "groups", "samples")
        steps = [{"kind": r["kind"], **{k: r[k] for k in keep}} for r in steps]
        catalog = self.store.catalog
        step_files = list(catalog.committed_steps(self.views.on_error))
        names = [s.name for s in step_files]
        return _description(
            self.store,
            kinds={row.pop("kind"): row for row in steps},
            ranks=ranks,
            reward_names=self.reward_names,
            versions=[step.version for step in step_files],
            files=len(step_files),
            size=_sizes(catalog, names),
            run_config=config_of(configs, "train"),
        )


def describe_run(store: ReadOnlyStore, *, on_error: OnError | None = None) -> dict[str, Any]:
    """What ``maxent-arrow inspect`` prints: schema version, steps, ranks (``ranks``: the rank
    ids), rows, sizes, the manifest's ``config`` (as the store was created) and the
    ``run_config`` the steps recorded, with the commit log's history.

    A store is described from its catalog alone, at a cost that does not grow with the run's
    step rows: the counts each commit recorded of its step file
    (:func:`~maxent_arrow.store.history.state.unit_summary`), never the step rows
    themselves, the data or a SQL view (a store without a commit log: the counts of its step
    files, as its catalog reads them). What it checks: that every committed group file is
    there, of the size its commit recorded (one listing of ``groups/``); a missing or
    truncated one is a :class:`StoreError` naming it (``on_error="skip"``: a warning);
    ``bytes`` are the group files' as listed and the step files' as the log recorded them. The
    checksums of the footers and the column chunks are checked by ``verify`` (every byte)
    and by every query that reads the files, not here.
    """
    on_error = check_on_error(on_error or store.on_error)
    catalog = store.catalog
    backend = store.backend
    with catalog.snapshot():
        files = catalog.summaries()
        listing = catalog.listing(GROUPS)
        for name, summary in files:
            info = listing.get(name)  # (a unit's group file has its step file's name)
            expected = summary.get("group_size")
            if info is not None and (expected is None or info.size == expected):
                continue  # as recorded (the rule's cheap case, without naming the file)
            rel = f"{GROUPS}/{name}"
            if info is None:  # moved to retired/ by a compaction since the pinned version?
                found = locate(backend, rel)
                info = None if found is None else found[1]
            try:
                check_group_bytes(backend.fs_path(rel), expected, info)
            except StoreError as exc:
                fail(on_error, exc)
        kinds: dict[Any, dict[str, Any]] = {}
        ranks: set[int] = set()
        configs: dict[tuple[Any, str], int] = {}
        rewards: dict[str, None] = {}
        for _, summary in files:
            for name in summary["reward_names"]:
                rewards.setdefault(name)
            for k in summary["kinds"]:
                kind = k["kind"]
                agg = kinds.setdefault(
                    kind, {"runs": [], "step_rows": 0, "groups": None, "samples": None}
                )
                agg["runs"] += k["steps"]
                agg["step_rows"] += k["rows"]
                for key in ("groups", "samples"):
                    if k[key] is not None:
                        agg[key] = (agg[key] or 0) + k[key]
                ranks.update(k["ranks"])
                for config, last in k["configs"]:
                    configs[kind, config] = max(last, configs.get((kind, config), last))
        out = {}
        for kind in sorted(kinds, key=lambda k: (k is None, k or "")):  # (SQL's ORDER BY kind)
            agg = kinds[kind]
            runs = agg.pop("runs")
            out[kind] = {
                "steps": count_runs(runs),
                "first": min(r[0] for r in runs),
                "last": max(r[0] + r[1] * (r[2] - 1) for r in runs),
                **agg,
            }
            out[kind] = {key: out[kind][key] for key in _KIND_KEYS}
        recorded = sorted(
            ({"kind": k, "config": c, "last": last} for (k, c), last in configs.items()),
            key=lambda r: r["last"],
        )
        names = [name for name, _ in files]
        size = {GROUPS: sum(listing[n].size for n in names if n in listing)}
        # The step files' bytes as the log recorded them (no listing of steps/: a step file
        # is a copy of the log's record, read by plain readers only).
        recorded_steps = [catalog.step_seal(n)[0] for n in names]
        if None in recorded_steps:
            size = _sizes(catalog, names)  # (entries that recorded no size)
        else:
            size[STEPS] = sum(s or 0 for s in recorded_steps)
        return _description(
            store,
            kinds=out,
            ranks=sorted(ranks),
            reward_names=list(rewards),
            versions=[str(s["schema_version"]) for _, s in files],
            files=len(files),
            size=size,
            run_config=config_of(recorded, "train"),
        )


_KIND_KEYS = ("steps", "first", "last", "step_rows", "groups", "samples")


def _sizes(catalog: Catalog, names: list[str]) -> dict[str, int]:
    """The bytes of the committed step files ``names`` and of their group files (which have
    their names), as listed (a file not in its directory counts nothing)."""
    wanted = set(names)
    return {
        table: sum(info.size for name, info in catalog.listing(table).items() if name in wanted)
        for table in (GROUPS, STEPS)
    }


def _description(
    store: ReadOnlyStore,
    *,
    kinds: dict[Any, dict[str, Any]],
    ranks: list[int],
    reward_names: list[str],
    versions: list[str],
    files: int,
    size: dict[str, int],
    run_config: dict[str, Any],
) -> dict[str, Any]:
    """:func:`describe_run`'s answer from its counts."""
    manifest = store.manifest
    return {
        "root": str(store.root),
        "format": manifest.get("format"),
        # The table layout's version (what readers of the columns care about); the
        # store format's (its commit protocol) is `store_version`.
        "schema_version": manifest.get("table_schema_version", manifest.get("schema_version")),
        "store_version": manifest.get("schema_version"),
        "file_schema_versions": sorted(set(versions)),
        "created_at": manifest.get("created_at"),
        "kinds": kinds,
        "ranks": ranks,
        "group_rows": sum(k["groups"] or 0 for k in kinds.values()),
        "reward_functions": reward_names,
        "files": {"groups": files, "steps": files},
        "bytes": {"groups": size[GROUPS], "steps": size[STEPS]},
        "config": manifest.get("config"),
        "run_config": run_config,
        "uri": store.backend.uri,
        "history": _history(store),
    }


def _history(store: ReadOnlyStore) -> dict[str, Any] | None:
    """The catalog's account of the history, each attempt with its status
    (:func:`~maxent_arrow.analytics.attempts.attempt_statuses`: how it ended, not the mode
    it began with)."""
    account = store.catalog.account()
    if account is None:
        return None
    statuses = {a["id"]: a for a in attempt_statuses(store)}
    for attempt in account["attempts"]:
        found = statuses.get(attempt["id"], {})
        attempt["status"], attempt["detail"] = found.get("status"), found.get("detail")
    return account


def open_run(
    root: str | os.PathLike[str] | ReadOnlyStore, *, materialize: bool = False
) -> RunAnalytics:
    """Open a store for analytics (see :class:`RunAnalytics`)."""
    return RunAnalytics(root, materialize=materialize)
