"""SQL and ready-made queries over a saved run, by embedded DuckDB (no server).

:class:`RunAnalytics` opens a store directory and defines views over its *committed* Parquet
files, unified across files and schema versions by column name (a reward function added
mid-run, a column an older writer lacked: nulls where absent):

``groups``
    One row per prompt group (the group table as written), plus ``kind`` (``"train"`` or
    ``"eval"``, from the file name).
``samples``
    One row per completion: every per-completion list of a group row indexed at the same
    position, so values stay aligned (``sample_index`` is 0-based within the group; reward
    functions in a ``rewards`` struct of doubles; ``completion_info`` spread into
    ``finish_reason, stop_reason, truncated, token_count, extra``). It indexes lists by
    subscript instead of ``UNNEST``-ing each one, because DuckDB does not push projections
    through a multi-column ``UNNEST`` (measured): a query that selects only scalars reads only
    those columns (and ``completions``, whose length gives K) from Parquet.
``steps``
    One row per (step, rank, kind): the step table.
``sample_scalars`` (after :meth:`RunAnalytics.materialize`)
    An in-memory table of every per-completion scalar (no text, no tokens), one row per
    completion: the flat columns that landscape §4 item 10 asks for beside the token lists.

The ready-made queries (:meth:`RunAnalytics.reward_curve` and the rest) return
``pyarrow.Table`` objects. Each reads only the list columns it needs (one ``UNNEST`` per
needed column, or the materialized table) and never a token column.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from maxent_arrow import schema as _schema
from maxent_arrow.errors import LayoutError, MissingExtraError, SchemaError, StoreError
from maxent_arrow.run_views import (
    ViewBuilder,
    committed_files,
    flat_columns,
    quote,
    read_schemas,
    sql_string,
)

__all__ = ["KINDS", "DEFAULT_QUANTILES", "RunAnalytics", "committed_files", "open_run"]

KINDS = ("train", "eval")
DEFAULT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# Config keys that hold the completion-length cap (semantics §4.2 and the recipes' spelling).
_MAX_LEN_KEYS = ("max_completion_len", "max_completion_length")
# User-facing score names (group-table column names) -> flat aliases.
_SCORE_ALIASES = {
    "total_utils": "total_util",
    "advantages": "advantage",
    "q": "q",
    "weights": "weight",
    "policy_entropy_sum": "policy_entropy_sum",
}
_GROUP_KEY = "step, rank, kind, group_index"
_MATERIALIZED = ("total_util", "advantage", "q", "weight", "length")


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise MissingExtraError("duckdb", "analytics") from None
    return duckdb


class RunAnalytics:
    """Embedded DuckDB over one store directory: views and ready-made queries.

    Parameters
    ----------
    root
        The store directory (``manifest.json``, ``groups/``, ``steps/``). Nothing is written
        to it.
    progress
        Show tqdm progress bars while reading file footers and materializing.
    threads
        DuckDB worker threads; ``None`` keeps DuckDB's default (all cores).
    materialize
        Build ``sample_scalars`` right away (one scan of the scalar list columns), so every
        ready-made query afterwards runs from memory. Worth it when running several queries
        (the report does); costs about 12 bytes x scalar columns x completions of memory.

    The file list is taken when the object is built: files committed later are seen after
    :meth:`refresh`. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        progress: bool = False,
        threads: int | None = None,
        materialize: bool = False,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise StoreError(f"{self.root}: no such store directory")
        self._progress = progress
        self.con = _duckdb().connect(database=":memory:")
        self.con.execute("SET parquet_metadata_cache = true")
        if threads is not None:
            self.con.execute(f"SET threads = {int(threads)}")
        self.materialized = False
        self.refresh()
        if materialize:
            self.materialize()

    # ------------------------------------------------------------------ setup

    def refresh(self) -> None:
        """List the committed files again and rebuild the views over them."""
        self.group_files = committed_files(self.root, "groups")
        self.step_files = committed_files(self.root, "steps")
        group_schemas = read_schemas(self.group_files, progress=self._progress, what="group")
        self.group_schema = (
            _schema.unify_schemas(group_schemas, where=f"{self.root}/groups")
            if group_schemas
            else _schema.group_schema()
        )
        self._group_columns = set(self.group_schema.names)
        rewards = (
            self.group_schema.field("rewards").type if "rewards" in self._group_columns else None
        )
        self.reward_names: list[str] = [f.name for f in rewards] if rewards is not None else []
        self._flat = flat_columns(self._group_columns, self.reward_names)
        groups = ViewBuilder(
            self.con, "groups", self.group_files, group_schemas, self.group_schema
        ).source(with_kind=True)
        self._load_steps()
        self.con.execute(f"CREATE OR REPLACE VIEW groups AS SELECT * FROM {groups}")
        self.con.execute("CREATE OR REPLACE VIEW steps AS SELECT * FROM _step_rows")
        self.con.execute(f"CREATE OR REPLACE VIEW samples AS {self._samples_sql()}")
        if self.materialized:
            self.materialized = False
            self.materialize()

    def _load_steps(self) -> None:
        """Read every step row into memory once (they are small, one per file, and each query
        that opened the files again would pay the per-file cost)."""
        if self.step_files:
            listing = "[" + ", ".join(sql_string(str(p)) for p in self.step_files) + "]"
            # union_by_name reads each footer once, here, in DuckDB's threads.
            source = f"read_parquet({listing}, union_by_name=true)"
        else:
            empty = _schema.step_schema().remove_metadata()
            self.con.register("_no_steps", pa.table({f.name: pa.array([], f.type) for f in empty}))
            source = "_no_steps"
        try:
            self.con.execute(f"CREATE OR REPLACE TABLE _step_rows AS SELECT * FROM {source}")
        except _duckdb().Error as exc:
            raise StoreError(f"{self.root}/steps: cannot read the step files ({exc})") from None
        self.step_schema = self.con.sql("SELECT * FROM _step_rows LIMIT 0").to_arrow_table().schema

    def _samples_sql(self) -> str:
        cols = self._group_columns
        keep = ["step", "rank", "group_index", "kind"] + [
            c
            for c in ("prompt", "answer", "seed_semantic_entropy", "seed_advantage_scale")
            if c in cols
        ]
        out = [f"g.{quote(c)}" for c in keep] + ["g._i - 1 AS sample_index"]
        singular = {
            "completions": "completion",
            "total_utils": "total_util",
            "advantages": "advantage",
            "weights": "weight",
            "ref_tok_counts": "ref_tok_count",
        }
        for column in _schema.PER_COMPLETION_COLUMNS:
            if column not in cols:
                continue
            if column == "completion_info":
                for sub in _schema.COMPLETION_INFO_TYPE:
                    out.append(f"g.completion_info[g._i].{quote(sub.name)} AS {quote(sub.name)}")
                continue
            out.append(f"g.{quote(column)}[g._i] AS {quote(singular.get(column, column))}")
        if self.reward_names:
            fields = ", ".join(
                f"{quote(n)} := g.rewards.{quote(n)}[g._i]" for n in self.reward_names
            )
            out.append(f"struct_pack({fields}) AS rewards")
        # Subscripts from generate_series, then `list[i]` per column: aligned by construction,
        # and projection pushdown still reaches the Parquet scan.
        return (
            f"SELECT {', '.join(out)} FROM (SELECT *, unnest(generate_series(1, "
            f"len(completions))) AS _i FROM groups) g"
        )

    def materialize(self) -> None:
        """Build the in-memory ``sample_scalars`` table (one scan) and answer the ready-made
        queries from it from now on."""
        if self.materialized:
            return
        # The scalars the ready-made queries use; `truncated` (a fallback that reads the whole
        # completion_info struct) and the log-prob sums stay in Parquet until asked for.
        exprs = [
            (a, e) for a, e in self._flat.items() if a in _MATERIALIZED or a.startswith("reward_")
        ]
        if exprs:
            # K from the first present scalar list; all of a row's lists have K items.
            anchor = "coalesce(" + ", ".join(f"len({e})" for _, e in exprs) + ")"
        else:
            anchor = "len(completions)"
        unnests = "".join(f", unnest({e}) AS {quote(a)}" for a, e in exprs)
        self.con.execute(
            f"CREATE OR REPLACE TABLE sample_scalars AS SELECT {_GROUP_KEY}, "
            f"unnest(range({anchor})) AS sample_index{unnests} FROM groups"
        )
        self.materialized = True
        self._materialized_cols = {a for a, _ in exprs}

    # ------------------------------------------------------------------ generic

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run ``query`` (any DuckDB SQL over the views) and return the result as Arrow."""
        duckdb = _duckdb()
        try:
            relation = self.con.sql(query, params=params)
            if relation is None:  # a statement without a result (CREATE, SET, ...)
                return pa.table({})
            return relation.to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (shows which columns each scan reads)."""
        return "\n".join(row[1] for row in self.con.execute(f"EXPLAIN {query}").fetchall())

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> RunAnalytics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _where(self, *, kind: str | None, steps: int | Iterable[int] | None = None) -> str:
        parts = []
        if kind is not None:
            if kind not in KINDS:
                raise LayoutError(f"kind: expected one of {KINDS} or None, got {kind!r}")
            parts.append(f"kind = '{kind}'")
        if steps is not None:
            wanted = [steps] if isinstance(steps, int | np.integer) else list(steps)
            try:
                ints = [int(s) for s in wanted]
            except (TypeError, ValueError):
                raise LayoutError(f"steps: expected integers, got {wanted!r}") from None
            parts.append(f"step IN ({', '.join(map(str, ints))})" if ints else "FALSE")
        return ("WHERE " + " AND ".join(parts)) if parts else ""

    def _alias(self, name: str, *, what: str) -> str:
        """The flat alias of a per-completion score: a group column or a reward function."""
        alias = _SCORE_ALIASES.get(name, name)
        if alias in self._flat:
            return alias
        if f"reward_{name}" in self._flat:
            return f"reward_{name}"
        known = [c for c, a in _SCORE_ALIASES.items() if a in self._flat] + self.reward_names
        raise LayoutError(f"{what}: unknown score {name!r}; expected one of {known}")

    def flat(
        self, aliases: Sequence[str], *, kind: str | None, steps: int | Iterable[int] | None = None
    ) -> str:
        """A SQL relation with ``step, rank, kind, group_index`` and the given per-completion
        scalars (aliases of ``sample_scalars``), one row per completion: the materialized
        table when there is one, else one ``UNNEST`` per needed list column (in lockstep)."""
        where = self._where(kind=kind, steps=steps)
        if self.materialized and set(aliases) <= self._materialized_cols:
            cols = ", ".join(quote(a) for a in aliases)
            return f"(SELECT {_GROUP_KEY}, {cols} FROM sample_scalars {where})"
        cols = ", ".join(f"unnest({self._flat[a]}) AS {quote(a)}" for a in aliases)
        return f"(SELECT {_GROUP_KEY}, {cols} FROM groups {where})"

    @staticmethod
    def _qname(q: float) -> str:
        return "p" + f"{q * 100:g}".replace(".", "_").zfill(2)

    # ------------------------------------------------------------------ ready-made queries

    def reward_curve(
        self, *, kind: str | None = "train", quantiles: Sequence[float] = DEFAULT_QUANTILES
    ) -> pa.Table:
        """Reward statistics per step: one row per (step, reward).

        ``reward`` is ``"total_utils"`` (the combined utility U_i) or the name of a reward
        function (its raw, unweighted value). Columns: ``step, reward, n, mean, std, min,
        p05 … p95, max``. ``std`` is the population std (divide by n), as
        ``RewardMoments.std``; quantiles interpolate linearly (numpy's default). Null values
        (a reward function added mid-run, absent from older files) are not counted; a
        (step, reward) without any value has no row.
        """
        qs = [float(q) for q in quantiles]
        if any(not 0.0 <= q <= 1.0 for q in qs):
            raise LayoutError(f"quantiles: expected values in [0, 1], got {qs}")
        sources = [("total_utils", "total_util")] if "total_util" in self._flat else []
        sources += [(n, f"reward_{n}") for n in self.reward_names]
        if not sources:
            raise SchemaError("reward_curve: the store has neither 'total_utils' nor 'rewards'")
        aggs = []
        for i, (_, alias) in enumerate(sources):
            x = quote(alias)
            aggs.append(
                f"count({x}) AS n{i}, avg({x}) AS mean{i}, stddev_pop({x}) AS std{i}, "
                f"min({x}) AS min{i}, max({x}) AS max{i}"
                + (f", quantile_cont({x}, {qs}) AS q{i}" if qs else "")
            )
        # One scan for every source; reshaped to long form below (cheap: one row per step).
        wide = self.sql(
            f"SELECT step, {', '.join(aggs)} FROM "
            f"{self.flat([a for _, a in sources], kind=kind)} GROUP BY step ORDER BY step"
        )
        parts = []
        for i, (name, _) in enumerate(sources):
            cols = {
                "step": wide.column("step"),
                "reward": pa.array([name] * wide.num_rows, pa.string()),
                "n": wide.column(f"n{i}"),
                "mean": wide.column(f"mean{i}"),
                "std": wide.column(f"std{i}"),
                "min": wide.column(f"min{i}"),
            }
            for j, q in enumerate(qs):
                cols[self._qname(q)] = pc.list_element(wide.column(f"q{i}"), j)
            cols["max"] = wide.column(f"max{i}")
            part = pa.table(cols)
            part = part.append_column("_order", pa.array(np.full(part.num_rows, i, np.int32)))
            parts.append(part.filter(pc.greater(part.column("n"), 0)))
        table = pa.concat_tables(parts).sort_by([("step", "ascending"), ("_order", "ascending")])
        return table.drop_columns(["_order"])

    def success_rate(
        self,
        *,
        threshold: float = 0.0,
        k: Sequence[int] = (1,),
        reward: str = "total_utils",
        kind: str | None = "train",
    ) -> pa.Table:
        """Success per step, where a completion succeeds when its ``reward`` > ``threshold``.

        Columns: ``step, num_groups, num_samples, success_rate`` (fraction of successful
        completions), ``group_success_rate`` (fraction of groups with at least one success),
        and ``pass_at_{k}`` for each k: the unbiased estimator of Chen et al. (2021),
        ``1 - C(n-c, k) / C(n, k)`` per group of n completions with c successes, averaged over
        the groups with n >= k (null when there are none).
        """
        ks = [int(x) for x in k]
        if any(x < 1 for x in ks):
            raise LayoutError(f"k: expected integers >= 1, got {ks}")
        v = quote(self._alias(reward, what="success_rate"))
        passes = []
        for x in ks:
            # C(n-c,k)/C(n,k) through lgamma: exact to ~1e-13, no overflow for large n.
            ratio = (
                f"exp(lgamma(n - c + 1) - lgamma(n - c - {x} + 1) + lgamma(n - {x} + 1) "
                f"- lgamma(n + 1))"
            )
            passes.append(
                f"avg(CASE WHEN n < {x} THEN NULL WHEN n - c < {x} THEN 1.0 "
                f"ELSE 1.0 - {ratio} END) AS pass_at_{x}"
            )
        per_group = (
            f"SELECT step, count({v}) AS n, count(*) FILTER (WHERE {v} > {float(threshold)!r}) "
            f"AS c FROM {self.flat([v.strip(chr(34))], kind=kind)} GROUP BY {_GROUP_KEY}"
        )
        return self.sql(
            f"SELECT step, count(*) AS num_groups, sum(n)::BIGINT AS num_samples, "
            f"sum(c) / sum(n) AS success_rate, avg((c > 0)::DOUBLE) AS group_success_rate, "
            f"{', '.join(passes)} FROM ({per_group}) WHERE n > 0 GROUP BY step ORDER BY step"
        )

    def zero_variance_groups(
        self, *, atol: float = 1e-8, reward: str = "total_utils", kind: str | None = "train"
    ) -> pa.Table:
        """Groups whose completions all score the same (max - min <= ``atol``), per step.

        Such groups have all-zero advantages and give no learning signal (the seed's
        ``frac_reward_zero_std``). Columns: ``step, num_groups, zero_variance_groups,
        frac_zero_variance``. A group of one completion counts as zero-variance.
        """
        alias = self._alias(reward, what="zero_variance_groups")
        v = quote(alias)
        return self.sql(
            f"SELECT step, count(*) AS num_groups, "
            f"count(*) FILTER (WHERE spread <= {float(atol)!r}) AS zero_variance_groups, "
            f"zero_variance_groups / count(*) AS frac_zero_variance FROM ("
            f"SELECT step, max({v}) - min({v}) AS spread FROM {self.flat([alias], kind=kind)} "
            f"WHERE {v} IS NOT NULL GROUP BY {_GROUP_KEY}) GROUP BY step ORDER BY step"
        )

    def _max_len_by_step(self, kind: str | None) -> str | None:
        """The length cap from the step rows' config: one number (as text) when every step has
        the same, else SQL of (step, kind, max_len); None when no step row has one."""
        if "config" not in self.step_schema.names:
            return None
        keys = ", ".join(f"json_extract(config, '$.{k}')::BIGINT" for k in _MAX_LEN_KEYS)
        sql = (
            f"SELECT step, kind, max(coalesce({keys})) AS max_len FROM steps "
            f"{self._where(kind=kind)} GROUP BY step, kind"
        )
        caps = self.sql(f"SELECT DISTINCT max_len FROM ({sql})").column("max_len").to_pylist()
        if caps == [None] or not caps:
            return None
        # One cap for the whole run (the usual case): a constant, no join.
        return str(int(caps[0])) if len(caps) == 1 else sql

    def length_stats(
        self, *, max_completion_len: int | None = None, kind: str | None = "train"
    ) -> pa.Table:
        """Completion length statistics per step (``LengthStats`` over all ranks of a step).

        Lengths are T_i = ``ref_tok_counts`` (semantics §2.13), or the generator's
        ``completion_info.token_count`` when the run stored no reference counts. A completion
        is *clipped* when T_i >= the cap: the argument, else the step's config
        (``max_completion_len``), else the generator's ``truncated`` flag. Columns: ``step,
        n, min_length, mean_length, max_length, p50_length, p95_length, clipped_frac,
        min_terminated, mean_terminated, max_terminated`` (terminated = not clipped; null when
        every completion was clipped).
        """
        if "length" not in self._flat:
            raise SchemaError("length_stats: the store has no 'ref_tok_counts' nor token counts")
        if max_completion_len is not None:
            cap = int(max_completion_len)
            inner = f"SELECT step, length AS t, length >= {cap} AS clipped FROM " + self.flat(
                ["length"], kind=kind
            )
        elif (by_step := self._max_len_by_step(kind)) is not None and by_step.isdigit():
            inner = f"SELECT step, length AS t, length >= {by_step} AS clipped FROM " + self.flat(
                ["length"], kind=kind
            )
        elif by_step is not None:
            inner = (
                f"SELECT g.step, g.length AS t, g.length >= m.max_len AS clipped FROM "
                f"{self.flat(['length'], kind=kind)} g "
                f"LEFT JOIN ({by_step}) m ON g.step = m.step AND g.kind = m.kind"
            )
        else:
            if "truncated" not in self._flat:
                raise SchemaError("length_stats: no length cap and no 'completion_info' flags")
            inner = "SELECT step, length AS t, truncated AS clipped FROM " + self.flat(
                ["length", "truncated"], kind=kind
            )
        return _split_quantiles(
            self.sql(
                "SELECT step, count(t) AS n, min(t)::DOUBLE AS min_length, "
                "avg(t) AS mean_length, max(t)::DOUBLE AS max_length, "
                "quantile_cont(t, [0.5, 0.95]) AS _q, avg(clipped::DOUBLE) AS clipped_frac, "
                "min(t) FILTER (WHERE NOT clipped)::DOUBLE AS min_terminated, "
                "avg(t) FILTER (WHERE NOT clipped) AS mean_terminated, "
                "max(t) FILTER (WHERE NOT clipped)::DOUBLE AS max_terminated "
                f"FROM ({inner}) WHERE t IS NOT NULL GROUP BY step ORDER BY step"
            )
        )

    def entropy_curve(self, *, kind: str | None = "train") -> pa.Table:
        """Entropy of the per-group q-distribution and MaxEnt weights, per step.

        Per group g: H(q_g) = -Σ q ln q and H(w_g) = -Σ w ln w (natural log; zero entries
        contribute 0). Per step: mean, population std, min and max over groups
        (``q_entropy_*``, ``weight_entropy_*``; semantics §2.5, §3.6). A group whose weights
        have a negative entry (GRPO mode stores advantages as weights) is not a distribution
        and gets no weight entropy; nor does a group without stored weights.
        """
        parts = [
            (a, p) for a, p in (("q", "q_entropy"), ("weight", "weight_entropy")) if a in self._flat
        ]
        if not parts:
            raise SchemaError("entropy_curve: the store has neither 'q' nor 'weights'")
        per_group = ", ".join(
            f"CASE WHEN min({quote(a)}) < 0 THEN NULL ELSE -sum({quote(a)} * ln({quote(a)})) "
            f"FILTER (WHERE {quote(a)} > 0) END AS {p}"
            for a, p in parts
        )
        aggs = ", ".join(
            f"avg({p}) AS {p}_mean, stddev_pop({p}) AS {p}_std, min({p}) AS {p}_min, "
            f"max({p}) AS {p}_max"
            for _, p in parts
        )
        return self.sql(
            f"SELECT step, count(*) AS num_groups, {aggs} FROM (SELECT step, {per_group} FROM "
            f"{self.flat([a for a, _ in parts], kind=kind)} GROUP BY {_GROUP_KEY}) "
            f"GROUP BY step ORDER BY step"
        )

    def kl_by_length_bucket(self, *, kind: str | None = "train") -> pa.Table:
        """Per-token KL per completion-length bucket, per step (``BatchDiagnostics``).

        From the step rows' ``kl_per_token_by_len_bucket`` and ``kl_token_count_by_len_bucket``
        maps (semantics §2.14). Ranks of one step are combined token-weighted,
        Σ_r kl_r·t_r / Σ_r t_r (a plain mean when no counts were stored). Columns: ``step,
        bucket, bucket_order, kl_per_token, tokens``; buckets in ``KL_LENGTH_BUCKETS`` order.
        """
        labels = list(_schema.KL_LENGTH_BUCKETS)
        order = (
            "CASE e.key "
            + " ".join(f"WHEN {sql_string(b)} THEN {i}" for i, b in enumerate(labels))
            + f" ELSE {len(labels)} END"
        )
        return self.sql(
            f"SELECT step, e.key AS bucket, min({order}) AS bucket_order, "
            "CASE WHEN sum(c) > 0 THEN sum(e.value * c) / sum(c) ELSE avg(e.value) END "
            "AS kl_per_token, sum(c) AS tokens FROM (SELECT step, "
            "unnest(map_entries(kl_per_token_by_len_bucket)) AS e, kl_token_count_by_len_bucket "
            f"AS counts FROM steps {self._where(kind=kind)}) s, "
            "LATERAL (SELECT map_extract_value(s.counts, e.key) AS c) "
            "GROUP BY step, e.key ORDER BY step, bucket_order, bucket"
        )

    def advantage_histogram(
        self,
        *,
        bins: int = 50,
        steps: int | Iterable[int] | None = None,
        kind: str | None = "train",
        column: str = "advantages",
    ) -> pa.Table:
        """Histogram of a per-completion value (advantages by default) over ``steps``.

        ``bins`` equal-width bins between the min and max finite value, the last one closed,
        as ``numpy.histogram`` builds them (a single value v gets the range v ± 0.5).
        Columns: ``bin_left, bin_right, count`` (all ``bins`` rows, empty bins included).
        """
        if int(bins) < 1:
            raise LayoutError(f"bins: expected an integer >= 1, got {bins!r}")
        bins = int(bins)
        alias = self._alias(column, what="advantage_histogram")
        values = (
            f"SELECT {quote(alias)} AS x FROM {self.flat([alias], kind=kind, steps=steps)} "
            f"WHERE isfinite({quote(alias)})"
        )
        bounds = self.sql(f"SELECT min(x) AS lo, max(x) AS hi FROM ({values})")
        lo, hi = bounds.column("lo")[0].as_py(), bounds.column("hi")[0].as_py()
        if lo is None:
            lo, hi = 0.0, 1.0
        elif lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        counts = self.sql(
            f"SELECT least(floor((x - {lo!r}) * ({bins} / ({hi!r} - {lo!r})))::BIGINT, "
            f"{bins - 1}) AS b, count(*) AS n FROM ({values}) GROUP BY b"
        )
        full = np.zeros(bins, dtype=np.int64)
        full[counts.column("b").to_numpy()] = counts.column("n").to_numpy()
        edges = np.linspace(lo, hi, bins + 1)
        return pa.table({"bin_left": edges[:-1], "bin_right": edges[1:], "count": full})

    def extreme_completions(
        self,
        step: int,
        *,
        n: int = 5,
        by: str = "total_utils",
        kind: str | None = "train",
    ) -> pa.Table:
        """The ``n`` best and ``n`` worst completions of one step, ranked by ``by``.

        Columns: ``which`` (``"best"``/``"worst"``), ``position`` (1 = most extreme),
        ``step, rank, group_index, sample_index, prompt, completion, score`` and whichever of
        ``total_util, advantage, length`` the store has. Ties break by (rank, group,
        sample). Token columns are not read.
        """
        expr = self._list_expr(by, what="extreme_completions")
        n = int(n)
        if n < 1:
            raise LayoutError(f"n: expected an integer >= 1, got {n}")
        cols = self._group_columns
        extra = [
            (c, alias)
            for c, alias in (
                ("total_utils", "total_util"),
                ("advantages", "advantage"),
                ("ref_tok_counts", "length"),
            )
            if c in cols
        ]
        prompt = "prompt" if "prompt" in cols else "NULL::VARCHAR AS prompt"
        unnested = ", ".join(f"unnest({quote(c)}) AS {a}" for c, a in extra)
        base = (
            f"SELECT step, rank, group_index, {prompt}, "
            f"unnest(generate_series(0, len(completions) - 1)) AS sample_index, "
            f"unnest(completions) AS completion, unnest({expr}) AS score"
            f"{', ' + unnested if unnested else ''} FROM groups "
            f"{self._where(kind=kind, steps=int(step))}"
        )
        order = "rank, group_index, sample_index"
        return self.sql(
            f"WITH s AS ({base}) "
            f"SELECT * FROM (SELECT 'best' AS which, row_number() OVER (ORDER BY score DESC, "
            f"{order}) AS position, * FROM s WHERE score IS NOT NULL) WHERE position <= {n} "
            f"UNION ALL "
            f"SELECT * FROM (SELECT 'worst' AS which, row_number() OVER (ORDER BY score ASC, "
            f"{order}) AS position, * FROM s WHERE score IS NOT NULL) WHERE position <= {n} "
            f"ORDER BY which, position"
        )

    def eval_rows(self) -> pa.Table:
        """The step rows of evaluation passes (``kind = 'eval'``), by step and rank."""
        return self.sql("SELECT * FROM steps WHERE kind = 'eval' ORDER BY step, rank")

    # ------------------------------------------------------------------ summaries

    def manifest(self) -> dict[str, Any]:
        """The store's ``manifest.json`` (empty when there is none)."""
        path = self.root / "manifest.json"
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path}: not a readable JSON manifest ({exc})") from None

    def describe(self) -> dict[str, Any]:
        """What ``maxent-arrow inspect`` prints: schema version, steps, ranks, rows, sizes,
        config. Reads only Parquet footers and the step table."""
        manifest = self.manifest()
        steps = self.sql(
            "SELECT kind, count(DISTINCT step) AS steps, min(step) AS first, max(step) AS last, "
            "count(*) AS step_rows, sum(num_groups)::BIGINT AS groups, "
            "sum(num_samples)::BIGINT AS samples FROM steps GROUP BY kind ORDER BY kind"
        ).to_pylist()
        ranks = self.sql("SELECT DISTINCT rank FROM steps ORDER BY rank").column("rank")
        group_rows = sum(pq.read_metadata(p).num_rows for p in self.group_files)
        versions = sorted(
            {
                (pq.read_schema(p).metadata or {}).get(_schema.METADATA_KEY, b"?").decode()
                for p in self.group_files[:1] + self.group_files[-1:]
            }
        )

        def size(files: list[Path]) -> int:
            return sum(p.stat().st_size for p in files)

        return {
            "root": str(self.root),
            "format": manifest.get("format"),
            "schema_version": manifest.get("schema_version"),
            "file_schema_versions": versions,
            "created_at": manifest.get("created_at"),
            "kinds": {row.pop("kind"): row for row in steps},
            "ranks": ranks.to_pylist(),
            "group_rows": group_rows,
            "reward_functions": self.reward_names,
            "files": {"groups": len(self.group_files), "steps": len(self.step_files)},
            "bytes": {
                "groups": size(self.group_files),
                "steps": size(self.step_files),
            },
            "config": manifest.get("config", manifest.get("run_config")),
        }

    def _list_expr(self, name: str, *, what: str) -> str:
        return self._flat[self._alias(name, what=what)]


def _split_quantiles(table: pa.Table) -> pa.Table:
    """``_q`` = [p50, p95] lists -> ``p50_length``, ``p95_length`` columns after max_length."""
    at = table.column_names.index("_q")
    q = table.column("_q")
    table = table.remove_column(at)
    table = table.add_column(at, "p95_length", pc.list_element(q, 1))
    return table.add_column(at, "p50_length", pc.list_element(q, 0))


def open_run(
    root: str | Path, *, progress: bool = False, materialize: bool = False
) -> RunAnalytics:
    """Open a store directory for analytics (see :class:`RunAnalytics`)."""
    return RunAnalytics(root, progress=progress, materialize=materialize)
