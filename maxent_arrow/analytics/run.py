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

from maxent_arrow.analytics.queries import DEFAULT_QUANTILES, ReadyMadeQueries
from maxent_arrow.analytics.relations import RunRelations
from maxent_arrow.analytics.sqlerrors import check_sql, explain_failure
from maxent_arrow.errors import QueryError, StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.catalog import LogCatalog, OnError
from maxent_arrow.store.names import GROUPS, STEPS

__all__ = ["DEFAULT_QUANTILES", "RunAnalytics", "open_run"]


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
        """What ``maxent-arrow inspect`` prints: schema version, steps, ranks (``ranks``: the
        rank ids), rows, sizes, the manifest's ``config`` (as the store was created) and the
        ``run_config`` the steps recorded (:meth:`run_config`: the tokenizer, the model...).
        Reads the step files, file sizes and group file footers (all checked)."""
        manifest = self.store.manifest
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
        versions = sorted({step.version for step in step_files})
        backend = self.store.backend

        def size(table: str) -> int:
            listing = catalog.listing(table)
            names = {s.group_file if table == GROUPS else s.name for s in step_files}
            return sum(info.size for name, info in listing.items() if name in names)

        return {
            "root": str(self.root),
            "format": manifest.get("format"),
            # The table layout's version (what readers of the columns care about); the
            # store format's (its commit protocol) is `store_version`.
            "schema_version": manifest.get("table_schema_version", manifest.get("schema_version")),
            "store_version": manifest.get("schema_version"),
            "file_schema_versions": versions,
            "created_at": manifest.get("created_at"),
            "kinds": {row.pop("kind"): row for row in steps},
            "ranks": ranks,
            "group_rows": sum(r["groups"] or 0 for r in steps),
            "reward_functions": self.reward_names,
            "files": {"groups": len(step_files), "steps": len(step_files)},
            "bytes": {"groups": size(GROUPS), "steps": size(STEPS)},
            "config": manifest.get("config"),
            "run_config": self._config_of(configs, "train"),
            "uri": backend.uri,
            "history": self._history(),
        }

    def _history(self) -> dict[str, Any] | None:
        """The commit log's account of the run: its version, the attempts (resumes,
        re-runs), the steps later attempts superseded and the record tables (``None``: a
        store without a log)."""
        catalog = self.store.catalog
        if not isinstance(catalog, LogCatalog):
            return None
        state = catalog.state()
        return {
            "log_version": state.version,
            "attempts": [
                {
                    "id": a.id,
                    "role": a.role,
                    "mode": a.mode,
                    "resume_from": a.resume_from,
                    "started_at": a.started_at,
                }
                for a in state.attempts
            ],
            "superseded_steps": state.superseded_steps(),
            "records": {
                n: sum(int(i["rows"]) for i in items) for n, items in state.records.items()
            },
        }


def open_run(
    root: str | os.PathLike[str] | ReadOnlyStore, *, materialize: bool = False
) -> RunAnalytics:
    """Open a store for analytics (see :class:`RunAnalytics`)."""
    return RunAnalytics(root, materialize=materialize)
