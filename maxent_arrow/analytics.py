"""SQL and ready-made queries over a saved run, by embedded DuckDB (no server).

:class:`RunAnalytics` opens a store directory and defines three views over its *committed*
Parquet files, unified across files and schema versions by column name:

``groups``
    One row per prompt group (the group table as written), plus ``kind`` (``"train"`` or
    ``"eval"``, from the file name).
``samples``
    One row per completion: every per-completion list of a group row indexed at the same
    position, so values stay aligned (``sample_index`` is 0-based within the group). Per-token
    columns (``completion_ids``, ``ref_token_logp``, ``behavior_token_logp``) are list values
    of the row. The view indexes lists by subscript instead of ``UNNEST``-ing each one, so a
    query that selects only scalars reads only those columns from Parquet (DuckDB does not push
    projections through a multi-column ``UNNEST``; measured).
``steps``
    One row per (step, rank, kind): the step table.

The ready-made queries (:meth:`RunAnalytics.reward_curve` and the rest) each return a
``pyarrow.Table``. They read only the columns they need, straight from the ``groups`` view
(list functions on whole groups where possible, one ``UNNEST`` of one scalar column otherwise),
and never touch the token columns: landscape §4 item 10, DuckDB list columns are slow.

A file is *committed* when the store's rule says so (see :func:`committed_files`); files being
written (``.tmp-*``) and group files whose step file (the commit marker) is missing are never
read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow import schema as _schema
from maxent_arrow.errors import LayoutError, MissingExtraError, SchemaError, StoreError

__all__ = [
    "KINDS",
    "RunAnalytics",
    "committed_files",
    "open_run",
]

KINDS = ("train", "eval")
DEFAULT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# Per-completion scalar columns a ranking or a success test may use (besides reward functions).
_SCORE_COLUMNS = ("total_utils", "advantages", "q", "weights", "policy_entropy_sum")
_KIND_RE = re.compile(r"\.([A-Za-z0-9_]+)\.parquet$")
# Config keys that hold the completion-length cap (semantics §4.2 and the recipes' spelling).
_MAX_LEN_KEYS = ("max_completion_len", "max_completion_length")


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise MissingExtraError("duckdb", "analytics") from None
    return duckdb


def _file_kind(path: Path) -> str:
    match = _KIND_RE.search(path.name)
    return match.group(1) if match else "train"


def committed_files(root: str | Path, table: str) -> list[Path]:
    """The committed Parquet files of ``table`` (``"groups"`` or ``"steps"``), sorted by name.

    Uses the store's own rule (``RolloutStore.committed_files``) when the store module provides
    it; otherwise applies the agreed layout rule directly: files named ``.tmp-*`` are in-flight
    writes, and a group file is visible only once the step file of the same name exists.
    """
    if table not in ("groups", "steps"):
        raise LayoutError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
    root = Path(root)
    try:
        from maxent_arrow.store import RolloutStore

        method = getattr(RolloutStore, "committed_files", None)
    except ImportError:
        method = None
    if method is not None:
        return sorted(Path(p) for p in RolloutStore(root).committed_files(table))
    step_dir = root / "steps"
    steps = (
        {p.name for p in step_dir.glob("*.parquet") if not p.name.startswith(".tmp-")}
        if step_dir.is_dir()
        else set()
    )
    if table == "steps":
        return sorted(step_dir / name for name in steps)
    group_dir = root / "groups"
    if not group_dir.is_dir():
        return []
    return sorted(
        p for p in group_dir.glob("*.parquet") if not p.name.startswith(".tmp-") and p.name in steps
    )


def _quote(name: str) -> str:
    """A DuckDB identifier, quoted (column and reward-function names come from user data)."""
    return '"' + name.replace('"', '""') + '"'


def _sql_list(values: Iterable[Any]) -> str:
    return "[" + ", ".join(repr(str(v)) if isinstance(v, str) else repr(v) for v in values) + "]"


def _unified_schema(files: Sequence[Path], *, table: str, progress: bool) -> pa.Schema | None:
    if not files:
        return None
    schemas = []
    iterator: Iterable[Path] = files
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"reading {table} schemas", unit="file", leave=False)
    for path in iterator:
        try:
            file_schema = pq.read_schema(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None
        version = (file_schema.metadata or {}).get(_schema.METADATA_KEY)
        if version is not None:
            _schema.check_version(version, where=str(path))
        schemas.append(file_schema)
    return _schema.unify_schemas(schemas, where=f"{table} files")


class RunAnalytics:
    """Embedded DuckDB over one store directory, with the ``groups``/``samples``/``steps``
    views and the ready-made queries.

    Parameters
    ----------
    root
        The store directory (``manifest.json``, ``groups/``, ``steps/``).
    progress
        Show a tqdm progress bar while reading file schemas (large stores).
    threads
        DuckDB worker threads; ``None`` keeps DuckDB's default (all cores).

    The file list is taken once, when the object is built: files committed later are not seen
    until :meth:`refresh`. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, root: str | Path, *, progress: bool = False, threads: int | None = None
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise StoreError(f"{self.root}: no such store directory")
        self._progress = progress
        self.con = _duckdb().connect(database=":memory:")
        if threads is not None:
            self.con.execute(f"SET threads = {int(threads)}")
        self.refresh()

    # ------------------------------------------------------------------ setup

    def refresh(self) -> None:
        """List the committed files again and rebuild the views over them."""
        self.group_files = committed_files(self.root, "groups")
        self.step_files = committed_files(self.root, "steps")
        self.group_schema = (
            _unified_schema(self.group_files, table="groups", progress=self._progress)
            or _schema.group_schema()
        )
        self.step_schema = (
            _unified_schema(self.step_files, table="steps", progress=self._progress)
            or _schema.step_schema()
        )
        self._group_columns = set(self.group_schema.names)
        rewards = (
            self.group_schema.field("rewards").type if "rewards" in self._group_columns else None
        )
        self.reward_names: list[str] = [f.name for f in rewards] if rewards is not None else []
        self._create_views()

    def _source(self, files: list[Path], schema: pa.Schema, name: str, *, filename: bool) -> str:
        if files:
            paths = _sql_list(str(p) for p in files)
            extra = ", filename=true" if filename else ""
            return f"read_parquet({paths}, union_by_name=true{extra})"
        # An empty store still has typed views, so every query runs and returns no rows.
        self.con.register(
            f"_empty_{name}",
            pa.table(
                {f.name: pa.array([], f.type) for f in schema},
                schema=schema.remove_metadata(),
            ),
        )
        return (
            f"(SELECT *, NULL::VARCHAR AS filename FROM _empty_{name})"
            if filename
            else (f"_empty_{name}")
        )

    def _create_views(self) -> None:
        groups = self._source(self.group_files, self.group_schema, "groups", filename=True)
        # `kind` lives in the file name (`step-….rank-….{kind}.parquet`), not in the group rows.
        self.con.execute(
            "CREATE OR REPLACE VIEW groups AS SELECT * EXCLUDE (filename), "
            f"coalesce(regexp_extract(filename, '\\.([A-Za-z0-9_]+)\\.parquet$', 1), 'train') "
            f"AS kind FROM {groups}"
        )
        steps = self._source(self.step_files, self.step_schema, "steps", filename=False)
        self.con.execute(f"CREATE OR REPLACE VIEW steps AS SELECT * FROM {steps}")
        self.con.execute(f"CREATE OR REPLACE VIEW samples AS {self._samples_sql()}")

    def _samples_sql(self) -> str:
        cols = self._group_columns
        keep = ["step", "rank", "group_index", "kind"] + [
            c
            for c in ("prompt", "answer", "seed_semantic_entropy", "seed_advantage_scale")
            if c in cols
        ]
        out = [f"g.{_quote(c)}" for c in keep] + ["g._i - 1 AS sample_index"]
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
                    out.append(f"g.completion_info[g._i].{_quote(sub.name)} AS {_quote(sub.name)}")
                continue
            out.append(f"g.{_quote(column)}[g._i] AS {_quote(singular.get(column, column))}")
        if self.reward_names:
            fields = ", ".join(
                f"{_quote(n)} := g.rewards.{_quote(n)}[g._i]" for n in self.reward_names
            )
            out.append(f"struct_pack({fields}) AS rewards")
        # Subscripts from generate_series, then `list[i]` for each column: aligned by
        # construction, and projection pushdown still reaches the Parquet scan.
        return (
            f"SELECT {', '.join(out)} FROM (SELECT *, unnest(generate_series(1, "
            f"len(completions))) AS _i FROM groups) g"
        )

    # ------------------------------------------------------------------ generic

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run ``query`` (any DuckDB SQL over the views) and return the result as Arrow."""
        duckdb = _duckdb()
        try:
            return self.con.sql(query, params=params).to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (to check which columns a scan reads)."""
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

    def _score_expr(self, name: str, *, what: str) -> str:
        """The list expression of a per-completion score: a column or a reward function."""
        if name in _SCORE_COLUMNS and name in self._group_columns:
            return _quote(name)
        if name in self.reward_names:
            return f"rewards.{_quote(name)}"
        known = [c for c in _SCORE_COLUMNS if c in self._group_columns] + self.reward_names
        raise LayoutError(f"{what}: unknown score {name!r}; expected one of {known}")

    def _require(self, column: str, *, what: str) -> None:
        if column not in self._group_columns:
            raise SchemaError(f"{what}: the store has no {column!r} column")

    # ------------------------------------------------------------------ ready-made queries

    def reward_curve(
        self, *, kind: str | None = "train", quantiles: Sequence[float] = DEFAULT_QUANTILES
    ) -> pa.Table:
        """Reward statistics per step: one row per (step, reward).

        ``reward`` is ``"total_utils"`` (the combined utility U_i) or the name of a reward
        function (its raw, unweighted value). Columns: ``step, reward, n, mean, std, min,
        p05 … p95, max``. ``std`` is the population std (divide by n), as
        ``RewardMoments.std``; quantiles interpolate linearly (numpy's default). Samples with
        a null value (a reward function added mid-run, absent from older files) are not
        counted, so ``n`` may differ between rewards of one step.
        """
        qs = [float(q) for q in quantiles]
        if any(not 0.0 <= q <= 1.0 for q in qs):
            raise LayoutError(f"quantiles: expected values in [0, 1], got {qs}")
        sources = []
        if "total_utils" in self._group_columns:
            sources.append(("total_utils", "total_utils"))
        sources += [(n, f"rewards.{_quote(n)}") for n in self.reward_names]
        if not sources:
            raise SchemaError("reward_curve: the store has neither 'total_utils' nor 'rewards'")
        where = self._where(kind=kind)
        # One UNNEST per reward source; only `step` and that column are read.
        unions = " UNION ALL ".join(
            f"SELECT step, {i} AS r, unnest({expr}) AS x FROM groups {where}"
            for i, (_, expr) in enumerate(sources)
        )
        qcols = ", ".join(f"quantile_cont(x, {q}) AS {_quote(self._qname(q))}" for q in qs)
        names = (
            "CASE r "
            + " ".join(f"WHEN {i} THEN {_sql_list([n])[1:-1]}" for i, (n, _) in enumerate(sources))
            + " END"
        )
        return self.sql(
            f"SELECT step, {names} AS reward, count(x) AS n, avg(x) AS mean, "
            f"stddev_pop(x) AS std, min(x) AS min{', ' + qcols if qcols else ''}, max(x) AS max "
            f"FROM ({unions}) WHERE x IS NOT NULL GROUP BY step, r ORDER BY step, r"
        )

    @staticmethod
    def _qname(q: float) -> str:
        return "p" + f"{q * 100:g}".replace(".", "_").zfill(2)

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
        the groups with n >= k (null when there are none). Computed on whole groups with list
        functions; nothing is unnested.
        """
        ks = [int(x) for x in k]
        if any(x < 1 for x in ks):
            raise LayoutError(f"k: expected integers >= 1, got {ks}")
        expr = self._score_expr(reward, what="success_rate")
        thr = float(threshold)
        passes = []
        for x in ks:
            # log C(n-c,k) - log C(n,k) by lgamma: exact enough, no overflow for large n.
            ratio = (
                f"exp(lgamma(n - c + 1) - lgamma(n - c - {x} + 1) + lgamma(n - {x} + 1) "
                f"- lgamma(n + 1))"
            )
            passes.append(
                f"avg(CASE WHEN n < {x} THEN NULL WHEN n - c < {x} THEN 1.0 "
                f"ELSE 1.0 - {ratio} END) AS pass_at_{x}"
            )
        return self.sql(
            f"SELECT step, count(*) AS num_groups, sum(n)::BIGINT AS num_samples, "
            f"sum(c) / sum(n) AS success_rate, avg((c > 0)::DOUBLE) AS group_success_rate, "
            f"{', '.join(passes)} FROM (SELECT step, "
            f"len(list_filter({expr}, lambda x: x IS NOT NULL)) AS n, "
            f"len(list_filter({expr}, lambda x: x > {thr!r})) AS c FROM groups "
            f"{self._where(kind=kind)}) WHERE n > 0 GROUP BY step ORDER BY step"
        )

    def zero_variance_groups(
        self, *, atol: float = 1e-8, reward: str = "total_utils", kind: str | None = "train"
    ) -> pa.Table:
        """Groups whose completions all score the same (max - min <= ``atol``), per step.

        Such groups have all-zero advantages and give no learning signal (the seed's
        ``frac_reward_zero_std``). Columns: ``step, num_groups, zero_variance_groups,
        frac_zero_variance``. Groups of one completion count as zero-variance.
        """
        expr = self._score_expr(reward, what="zero_variance_groups")
        return self.sql(
            f"SELECT step, count(*) AS num_groups, "
            f"count(*) FILTER (WHERE list_max({expr}) - list_min({expr}) <= {float(atol)!r}) "
            f"AS zero_variance_groups, zero_variance_groups / count(*) AS frac_zero_variance "
            f"FROM groups {self._where(kind=kind)} GROUP BY step ORDER BY step"
        )

    def _max_len_by_step(self, kind: str | None) -> str | None:
        """SQL of (step, max_len) from each step row's config JSON, or None if none has one."""
        if "config" not in self.step_schema.names:
            return None
        keys = ", ".join(f"json_extract(config, '$.{k}')::BIGINT" for k in _MAX_LEN_KEYS)
        sql = (
            f"SELECT step, kind, max(coalesce({keys})) AS max_len FROM steps "
            f"{self._where(kind=kind)} GROUP BY step, kind"
        )
        present = self.sql(f"SELECT count(max_len) AS n FROM ({sql})").column("n")[0].as_py()
        return sql if present else None

    def length_stats(
        self, *, max_completion_len: int | None = None, kind: str | None = "train"
    ) -> pa.Table:
        """Completion length statistics per step (``LengthStats`` over all ranks of a step).

        Lengths are T_i = ``ref_tok_counts`` (semantics §2.13), or the generator's
        ``completion_info.token_count`` when the run stored no reference counts. A completion
        is *clipped* when T_i >= ``max_completion_len``; the cap is the argument, else the
        step's config (``max_completion_len``), else the generator's ``truncated`` flag.
        Columns: ``step, n, min_length, mean_length, max_length, p50_length, p95_length,
        clipped_frac, min_terminated, mean_terminated, max_terminated`` (terminated = not
        clipped; null when every completion was clipped).
        """
        if "ref_tok_counts" in self._group_columns:
            lengths = "ref_tok_counts"
        elif "completion_info" in self._group_columns:
            lengths = "list_transform(completion_info, lambda x: x.token_count)"
        else:
            raise SchemaError("length_stats: the store has no 'ref_tok_counts' nor token counts")
        where = self._where(kind=kind)
        if max_completion_len is not None:
            cap = int(max_completion_len)
            inner = (
                f"SELECT step, unnest({lengths}) AS t, t >= {cap} AS clipped FROM groups {where}"
            )
        elif (by_step := self._max_len_by_step(kind)) is not None:
            inner = (
                f"SELECT g.step, g.t, g.t >= m.max_len AS clipped FROM (SELECT step, kind, "
                f"unnest({lengths}) AS t FROM groups {where}) g "
                f"LEFT JOIN ({by_step}) m ON g.step = m.step AND g.kind = m.kind"
            )
        else:
            self._require("completion_info", what="length_stats (clipped fraction)")
            inner = (
                f"SELECT step, unnest({lengths}) AS t, unnest(list_transform(completion_info, "
                f"lambda x: coalesce(x.truncated, x.finish_reason = 'length'))) AS clipped "
                f"FROM groups {where}"
            )
        return self.sql(
            "SELECT step, count(t) AS n, min(t)::DOUBLE AS min_length, avg(t) AS mean_length, "
            "max(t)::DOUBLE AS max_length, quantile_cont(t, 0.5) AS p50_length, "
            "quantile_cont(t, 0.95) AS p95_length, avg(clipped::DOUBLE) AS clipped_frac, "
            "min(t) FILTER (WHERE NOT clipped)::DOUBLE AS min_terminated, "
            "avg(t) FILTER (WHERE NOT clipped) AS mean_terminated, "
            "max(t) FILTER (WHERE NOT clipped)::DOUBLE AS max_terminated "
            f"FROM ({inner}) WHERE t IS NOT NULL GROUP BY step ORDER BY step"
        )

    def entropy_curve(self, *, kind: str | None = "train") -> pa.Table:
        """Entropy of the per-group q-distribution and MaxEnt weights, per step.

        Per group g: H(q_g) = -Σ q ln q and H(w_g) = -Σ w ln w (natural log; zero entries
        contribute 0). Per step: mean, population std, min and max over groups
        (``q_entropy_*``, ``weight_entropy_*``; semantics §2.5, §3.6). A group whose weights
        have a negative entry (GRPO mode stores advantages as weights) is not a distribution
        and gets no weight entropy.
        """
        parts = []
        for column, prefix in (("q", "q_entropy"), ("weights", "weight_entropy")):
            if column not in self._group_columns:
                continue
            h = (
                f"CASE WHEN list_min({column}) < 0 THEN NULL ELSE "
                f"-list_sum(list_transform(list_filter({column}, lambda x: x > 0), "
                f"lambda x: x * ln(x))) END"
            )
            parts.append((column, prefix, h))
        if not parts:
            raise SchemaError("entropy_curve: the store has neither 'q' nor 'weights'")
        inner = ", ".join(f"{h} AS {prefix}" for _, prefix, h in parts)
        aggs = ", ".join(
            f"avg({p}) AS {p}_mean, stddev_pop({p}) AS {p}_std, min({p}) AS {p}_min, "
            f"max({p}) AS {p}_max"
            for _, p, _ in parts
        )
        return self.sql(
            f"SELECT step, count(*) AS num_groups, {aggs} FROM (SELECT step, {inner} FROM groups "
            f"{self._where(kind=kind)}) GROUP BY step ORDER BY step"
        )

    def kl_by_length_bucket(self, *, kind: str | None = "train") -> pa.Table:
        """Per-token KL per completion-length bucket, per step (``BatchDiagnostics``).

        From the step rows' ``kl_per_token_by_len_bucket`` and ``kl_token_count_by_len_bucket``
        maps (semantics §2.14). Ranks of one step are combined token-weighted:
        Σ_r kl_r·t_r / Σ_r t_r (a plain mean when no counts were stored). Columns: ``step,
        bucket, bucket_order, kl_per_token, tokens``; buckets in ``KL_LENGTH_BUCKETS`` order.
        """
        order = (
            "CASE e.key "
            + " ".join(
                f"WHEN '{label}' THEN {i}" for i, label in enumerate(_schema.KL_LENGTH_BUCKETS)
            )
            + f" ELSE {len(_schema.KL_LENGTH_BUCKETS)} END"
        )
        return self.sql(
            "SELECT step, e.key AS bucket, min(" + order + ") AS bucket_order, "
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
        as ``numpy.histogram`` builds them (a single value gets the range value ± 0.5).
        Columns: ``bin_left, bin_right, count`` (all ``bins`` rows, empty bins included).
        """
        if int(bins) < 1:
            raise LayoutError(f"bins: expected an integer >= 1, got {bins!r}")
        bins = int(bins)
        expr = self._score_expr(column, what="advantage_histogram")
        values = (
            f"SELECT x FROM (SELECT unnest({expr}) AS x FROM groups "
            f"{self._where(kind=kind, steps=steps)}) WHERE isfinite(x)"
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
        expr = self._score_expr(by, what="extreme_completions")
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
        unnested = ", ".join(f"unnest({_quote(c)}) AS {a}" for c, a in extra)
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
        size = lambda files: sum(p.stat().st_size for p in files)  # noqa: E731
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


def open_run(root: str | Path, *, progress: bool = False) -> RunAnalytics:
    """Open a store directory for analytics (see :class:`RunAnalytics`)."""
    return RunAnalytics(root, progress=progress)
