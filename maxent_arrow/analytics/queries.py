"""The ready-made queries of a run: reward curves, success and pass@k, zero-variance groups,
length statistics, entropies, KL by length bucket, histograms and extreme completions.

:class:`ReadyMadeQueries` runs them on a :class:`~maxent_arrow.analytics.relations.RunRelations`
(its only dependency); :class:`~maxent_arrow.analytics.RunAnalytics` is one. Each reads only the
list columns it needs and never a token column.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.analytics.relations import GROUP_KEY, RunRelations
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.store.sql.plan import quote, reward_aliases, sql_string

__all__ = ["DEFAULT_QUANTILES", "LOSS_COLUMNS", "ReadyMadeQueries", "config_of"]

DEFAULT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# length_stats' columns: the step statistic's (the column registry's LengthStats fields), with
# the median and p95 after the maximum, and the clipped share named `clipped_frac`.
_STEP_LENGTHS = R.feeding("LengthStats", R.STEP)
_LENGTHS = (
    "n",
    *_STEP_LENGTHS[:3],
    "p50_length",
    "p95_length",
    "clipped_frac",
    *_STEP_LENGTHS[4:],
)
# The step table's loss components and KL, in the order the report plots them.
LOSS_COLUMNS = (*R.feeding("LossScalarBundle", R.STEP), "kl_value")
# The RunConfig field that holds the completion-length cap.
_MAX_LEN_KEY = "max_completion_len"


class ReadyMadeQueries:
    """The ready-made queries over :attr:`rel`, a run's per-completion relations."""

    rel: RunRelations

    @staticmethod
    def _qname(q: float) -> str:
        return "p" + f"{q * 100:g}".replace(".", "_").zfill(2)

    # ------------------------------------------------------------------ ready-made queries

    def reward_curve(
        self, *, kind: str | None = "train", quantiles: Sequence[float] = DEFAULT_QUANTILES
    ) -> pa.Table:
        """Reward statistics per step: one row per (step, reward).

        ``reward`` is ``"total_utils"`` (the combined utility U_i) or the name of a reward
        function (its raw, unweighted value). Columns: ``step, reward, n, unscored, mean,
        std, min, p05 … p95, max``. ``n`` counts the scored completions; ``unscored`` those
        the function gave no value (NaN: TRL's ``None``), left out of every statistic. ``std``
        is the population std (divide by n), as ``RewardMoments.std`` (TRL logs the
        Bessel-corrected one); quantiles interpolate linearly (numpy's default). Null values
        (a reward function added mid-run, absent from older files) are not counted; a
        (step, reward) without any value, scored or not, has no row.
        """
        qs = [float(q) for q in quantiles]
        if any(not 0.0 <= q <= 1.0 for q in qs):
            raise LayoutError(f"quantiles: expected values in [0, 1], got {qs}")
        sources = [("total_utils", "total_util")] if "total_util" in self.rel.flat_exprs else []
        sources += list(reward_aliases(self.rel.reward_names).items())
        if not sources:
            raise SchemaError("reward_curve: the store has neither 'total_utils' nor raw rewards")
        flat = self.rel.flat([a for _, a in sources], kind=kind)
        # In memory, a source with few distinct values (0/1 correctness rewards, and U itself
        # when it is a weighted sum of those) is summarised from a (step, value) histogram:
        # one cheap GROUP BY instead of DuckDB's per-value quantile state (measured 7x faster
        # for 1M binary values). Exact either way; Parquet scans stay one query (one scan).
        discrete = (
            self._discrete_sources([a for _, a in sources], flat)
            if self.rel.materialized
            else set()
        )
        parts = []
        continuous = [(i, a) for i, (_, a) in enumerate(sources) if a not in discrete]
        if continuous:
            aggs = []
            for i, alias in continuous:
                x = quote(alias)
                aggs.append(
                    f"count({x}) AS n{i}, avg({x}) AS mean{i}, stddev_pop({x}) AS std{i}, "
                    f"min({x}) AS min{i}, max({x}) AS max{i}"
                    + (f", quantile_cont({x}, {qs}) AS q{i}" if qs else "")
                )
            wide = self.rel.sql(
                f"SELECT step, {', '.join(aggs)} FROM {flat} GROUP BY step ORDER BY step"
            )
            for i, _ in continuous:
                cols = {
                    "step": wide.column("step"),
                    "n": wide.column(f"n{i}"),
                    "mean": wide.column(f"mean{i}"),
                    "std": wide.column(f"std{i}"),
                    "min": wide.column(f"min{i}"),
                }
                for j, q in enumerate(qs):
                    cols[self._qname(q)] = pc.list_element(wide.column(f"q{i}"), j)
                cols["max"] = wide.column(f"max{i}")
                parts.append((i, pa.table(cols)))
        for i, (_, alias) in enumerate(sources):
            if alias in discrete:
                x = quote(alias)
                hist = self.rel.sql(
                    f"SELECT step, {x} AS x, count(*) AS c FROM {flat} WHERE {x} IS NOT NULL "
                    "GROUP BY ALL ORDER BY step, x"
                )
                parts.append((i, _stats_from_histogram(hist, qs, self._qname)))
        unscored = self.unscored(kind=kind)
        tables = []
        for i, part in parts:
            name = sources[i][0]
            mine = unscored.filter(pc.equal(unscored.column("reward"), name))
            lookup = dict(zip(mine.column("step").to_pylist(), mine.column("unscored").to_pylist()))
            # Steps where every value is unscored have no scored row: add them, empty.
            missing = sorted(set(lookup) - set(part.column("step").to_pylist()))
            if missing:
                empty = {
                    c: pa.nulls(len(missing), part.schema.field(c).type) for c in part.column_names
                }
                empty["step"] = pa.array(missing, part.schema.field("step").type)
                empty["n"] = pa.array([0] * len(missing), part.schema.field("n").type)
                part = pa.concat_tables([part, pa.table(empty, schema=part.schema)])
            counts = [lookup.get(s, 0) for s in part.column("step").to_pylist()]
            part = part.add_column(1, "reward", pa.array([name] * part.num_rows))
            part = part.add_column(3, "unscored", pa.array(counts, pa.int64()))
            part = part.append_column("_order", pa.array(np.full(part.num_rows, i, np.int32)))
            keep = pc.or_(pc.greater(part.column("n"), 0), pc.greater(part.column("unscored"), 0))
            tables.append(part.filter(keep))
        table = pa.concat_tables(tables).sort_by([("step", "ascending"), ("_order", "ascending")])
        return table.drop_columns(["_order"])

    def unscored(self, *, kind: str | None = "train") -> pa.Table:
        """Completions left unscored, per step: ``total_utils`` (no reward function scored
        them: a NaN utility) and each reward function (it returned no value: NaN, TRL's
        ``None``). Columns: ``step, reward, unscored``; only non-zero counts."""
        cols = self.rel.group_columns
        parts = []
        if "total_utils" in cols:
            parts.append(("total_utils", "len(list_filter(total_utils, lambda x: isnan(x)))"))
        if "reward_values" in cols:
            for name in self.rel.reward_names:
                at = f"list_position(reward_names, {sql_string(name)})"
                parts.append((name, f"len(list_filter(reward_values, lambda v: isnan(v[{at}])))"))
        if not parts:
            return pa.table(
                {"step": pa.array([], pa.int64()), "reward": pa.array([], pa.string()),
                 "unscored": pa.array([], pa.int64())}
            )  # fmt: skip
        sums = ", ".join(f"sum({e})::BIGINT AS c{i}" for i, (_, e) in enumerate(parts))
        wide = self.rel.sql(
            f"SELECT step, {sums} FROM groups {self.rel.where(kind=kind)} GROUP BY step "
            "ORDER BY step"
        )
        steps, rewards, counts = [], [], []
        for i, (name, _) in enumerate(parts):
            values = wide.column(f"c{i}").to_pylist()
            for step, count in zip(wide.column("step").to_pylist(), values):
                if count:
                    steps.append(step)
                    rewards.append(name)
                    counts.append(count)
        return pa.table(
            {
                "step": pa.array(steps, pa.int64()),
                "reward": pa.array(rewards, pa.string()),
                "unscored": pa.array(counts, pa.int64()),
            }
        )

    def _discrete_sources(self, aliases: list[str], flat: str, *, limit: int = 64) -> set[str]:
        """Aliases with at most ``limit`` distinct values in a 65536-row sample (a guess that
        only picks the faster exact method, never changes a result)."""
        counts = ", ".join(f"count(DISTINCT {quote(a)}) AS {quote(a)}" for a in aliases)
        row = self.rel.sql(f"SELECT {counts} FROM (SELECT * FROM {flat} LIMIT 65536)").to_pylist()
        return {a for a, v in row[0].items() if v <= limit} if row else set()

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
        the groups with n >= k (null when there are none). Unscored completions (NaN: no
        value, TRL's ``None``) are neither successes nor failures: they are left out of
        ``num_samples`` and every rate, and counted in ``unscored``.
        """
        ks = [int(x) for x in k]
        if any(x < 1 for x in ks):
            raise LayoutError(f"k: expected integers >= 1, got {ks}")
        if not math.isfinite(float(threshold)):
            raise LayoutError(f"threshold: expected a finite number, got {threshold!r}")
        alias = self.rel.alias(reward, what="success_rate")
        v = quote(alias)
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
            f"SELECT step, count({v}) AS n, count(*) - count({v}) AS u, "
            f"count(*) FILTER (WHERE {v} > {float(threshold)!r}) "
            f"AS c FROM {self.rel.flat([alias], kind=kind)} GROUP BY {GROUP_KEY}"
        )
        return self.rel.sql(
            f"SELECT step, count(*) FILTER (WHERE n > 0) AS num_groups, "
            f"sum(n)::BIGINT AS num_samples, sum(u)::BIGINT AS unscored, "
            f"sum(c) / nullif(sum(n), 0) AS success_rate, "
            f"avg((c > 0)::DOUBLE) FILTER (WHERE n > 0) AS group_success_rate, "
            f"{', '.join(p.replace(' AS ', ' FILTER (WHERE n > 0) AS ', 1) for p in passes)} "
            f"FROM ({per_group}) GROUP BY step ORDER BY step"
        )

    def zero_variance_groups(
        self, *, atol: float = 1e-8, reward: str = "total_utils", kind: str | None = "train"
    ) -> pa.Table:
        """Groups whose completions all score the same (max - min <= ``atol``), per step.

        Such groups have all-zero advantages and give no learning signal (the seed's
        ``frac_reward_zero_std``). Columns: ``step, num_groups, zero_variance_groups,
        frac_zero_variance``. A group of one completion counts as zero-variance.
        """
        if not math.isfinite(float(atol)) or float(atol) < 0:
            raise LayoutError(f"atol: expected a finite number >= 0, got {atol!r}")
        alias = self.rel.alias(reward, what="zero_variance_groups")
        v = quote(alias)
        return self.rel.sql(
            f"SELECT step, count(*) AS num_groups, "
            f"count(*) FILTER (WHERE spread <= {float(atol)!r}) AS zero_variance_groups, "
            f"zero_variance_groups / count(*) AS frac_zero_variance FROM ("
            f"SELECT step, max({v}) - min({v}) AS spread FROM {self.rel.flat([alias], kind=kind)} "
            f"WHERE {v} IS NOT NULL GROUP BY {GROUP_KEY}) GROUP BY step ORDER BY step"
        )

    def _max_len_by_step(self, kind: str | None) -> str | None:
        """The length cap from the step rows' config: one number (as text) when every step has
        the same, else SQL of (step, kind, max_len); None when no step row has one."""
        cap = f"json_extract(config, '$.{_MAX_LEN_KEY}')::BIGINT"
        sql = (
            f"SELECT step, kind, max({cap}) AS max_len FROM steps "
            f"{self.rel.where(kind=kind)} GROUP BY step, kind"
        )
        caps = self.rel.sql(f"SELECT DISTINCT max_len FROM ({sql})").column("max_len").to_pylist()
        if caps == [None] or not caps:
            return None
        # One cap for the whole run (the usual case): a constant, no join.
        return str(int(caps[0])) if len(caps) == 1 else sql

    def length_stats(
        self, *, max_completion_len: int | None = None, kind: str | None = "train"
    ) -> pa.Table:
        """Completion length statistics per step (``LengthStats`` over all ranks of a step).

        Lengths are T_i = ``ref_tok_counts`` (``docs/formulas.md`` §2.13), or the generator's
        ``completion_info.token_count`` when the run stored no reference counts. A completion
        is *clipped* when T_i >= the cap: the argument, else the step's config
        (``max_completion_len``), else the generator's ``truncated`` flag. Columns: ``step,
        n, min_length, mean_length, max_length, p50_length, p95_length, clipped_frac,
        min_terminated, mean_terminated, max_terminated`` (terminated = not clipped; null when
        every completion was clipped).
        """
        if "length" not in self.rel.flat_exprs:
            raise SchemaError("length_stats: the store has no 'ref_tok_counts' nor token counts")
        if max_completion_len is not None:
            cap = int(max_completion_len)
            inner = f"SELECT step, length AS t, length >= {cap} AS clipped FROM " + self.rel.flat(
                ["length"], kind=kind
            )
        elif (by_step := self._max_len_by_step(kind)) is not None and by_step.isdigit():
            inner = (
                f"SELECT step, length AS t, length >= {by_step} AS clipped FROM "
                + self.rel.flat(["length"], kind=kind)
            )
        elif by_step is not None:
            inner = (
                f"SELECT g.step, g.length AS t, g.length >= m.max_len AS clipped FROM "
                f"{self.rel.flat(['length'], kind=kind)} g "
                f"LEFT JOIN ({by_step}) m ON g.step = m.step AND g.kind = m.kind"
            )
        else:
            if "truncated" not in self.rel.flat_exprs:
                raise SchemaError("length_stats: no length cap and no 'completion_info' flags")
            inner = "SELECT step, length AS t, truncated AS clipped FROM " + self.rel.flat(
                ["length", "truncated"], kind=kind
            )
        # Lengths are small integers: one GROUP BY (step, length, clipped) gives a histogram of
        # at most steps x max_len rows, and every statistic (quantiles included, exactly) comes
        # from it in numpy; much cheaper than DuckDB's per-value quantile state.
        hist = self.rel.sql(
            f"SELECT step, t::BIGINT AS t, clipped, count(*) AS c FROM ({inner}) "
            "WHERE t IS NOT NULL GROUP BY ALL ORDER BY step, t"
        )
        return _length_stats_from_histogram(hist)

    def entropy_curve(self, *, kind: str | None = "train") -> pa.Table:
        """Entropy of the per-group q-distribution and MaxEnt weights, per step.

        Per group g: H(q_g) = -Σ q ln q and H(w_g) = -Σ w ln w (natural log; zero entries
        contribute 0). Per step: mean, population std, min and max over groups
        (``q_entropy_*``, ``weight_entropy_*``; ``docs/formulas.md`` §3.4, §3.6). A group
        whose weights have a negative entry (GRPO mode stores advantages as weights) is not a
        distribution and gets no weight entropy; nor does a group without stored weights.
        ``uniform_entropy_mean`` is the mean of ln K_g, the entropy of a uniform distribution
        over each group: both entropies sit near it by construction (they measure how evenly a
        group's weight is spread, not the policy's entropy: :meth:`policy_entropy_curve`).
        """
        parts = [
            (a, p)
            for a, p in (("q", "q_entropy"), ("weight", "weight_entropy"))
            if a in self.rel.flat_exprs
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
        return self.rel.sql(
            f"SELECT step, count(*) AS num_groups, {aggs}, avg(log_k) AS uniform_entropy_mean "
            f"FROM (SELECT step, {per_group}, ln(count(*)) AS log_k FROM "
            f"{self.rel.flat([a for a, _ in parts], kind=kind)} GROUP BY {GROUP_KEY}) "
            f"GROUP BY step ORDER BY step"
        )

    def kl_by_length_bucket(self, *, kind: str | None = "train") -> pa.Table:
        """Per-token KL per completion-length bucket, per step (``BatchDiagnostics``).

        From the step rows' ``kl_per_token_by_len_bucket`` and ``kl_token_count_by_len_bucket``
        (lists parallel to ``kl_length_buckets``; ``docs/formulas.md`` §3.10). Ranks of one
        step are combined token-weighted, Σ_r kl_r·t_r / Σ_r t_r (a plain mean when no counts
        were stored). Columns: ``step, bucket, bucket_order, kl_per_token, tokens``; buckets in
        ``KL_LENGTH_BUCKETS`` order.
        """
        labels = list(S.KL_LENGTH_BUCKETS)
        order = (
            "CASE bucket "
            + " ".join(f"WHEN {sql_string(b)} THEN {i}" for i, b in enumerate(labels))
            + f" ELSE {len(labels)} END"
        )
        return self.rel.sql(
            f"SELECT step, bucket, min({order}) AS bucket_order, "
            "CASE WHEN sum(c) > 0 THEN sum(v * c) / sum(c) ELSE avg(v) END AS kl_per_token, "
            "sum(c) AS tokens FROM (SELECT step, unnest(kl_length_buckets) AS bucket, "
            "unnest(kl_per_token_by_len_bucket) AS v, "
            # A rank that stored no counts: NULL counts, so its values average plainly.
            "unnest(coalesce(kl_token_count_by_len_bucket, "
            "list_transform(kl_length_buckets, lambda b: NULL::DOUBLE))) AS c "
            f"FROM steps {self.rel.where(kind=kind)}) "
            "GROUP BY step, bucket ORDER BY step, bucket_order, bucket"
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
        alias = self.rel.alias(column, what="advantage_histogram")
        values = (
            f"SELECT {quote(alias)} AS x FROM {self.rel.flat([alias], kind=kind, steps=steps)} "
            f"WHERE isfinite({quote(alias)})"
        )
        bounds = self.rel.sql(f"SELECT min(x) AS lo, max(x) AS hi FROM ({values})")
        lo, hi = bounds.column("lo")[0].as_py(), bounds.column("hi")[0].as_py()
        if lo is None:
            lo, hi = 0.0, 1.0
        elif lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        counts = self.rel.sql(
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
        cols = self.rel.group_columns
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
            f"unnest(generate_series(0, num_completions - 1)) AS sample_index, "
            f"unnest(completions) AS completion, unnest({expr}) AS score"
            f"{', ' + unnested if unnested else ''} FROM groups "
            f"{self.rel.where(kind=kind, steps=int(step))}"
        )
        order = "rank, group_index, sample_index"
        return self.rel.sql(
            f"WITH s AS ({base}) "
            f"SELECT * FROM (SELECT 'best' AS which, row_number() OVER (ORDER BY score DESC, "
            f"{order}) AS position, * FROM s WHERE score IS NOT NULL) WHERE position <= {n} "
            f"UNION ALL "
            f"SELECT * FROM (SELECT 'worst' AS which, row_number() OVER (ORDER BY score ASC, "
            f"{order}) AS position, * FROM s WHERE score IS NOT NULL) WHERE position <= {n} "
            f"ORDER BY which, position"
        )

    def step_curve(self, columns: Sequence[str], *, kind: str | None = "train") -> pa.Table:
        """Step-table scalars per step: each of ``columns`` (those the run's step table has)
        averaged over the ranks of a step, NULLs left out, as data-parallel training
        averages per-rank losses. Columns: ``step, num_ranks`` and the requested ones the
        store has (a run that never recorded one has all-NULL values for it)."""
        known = set(self.rel.views.step_schema.names)
        wanted = [c for c in dict.fromkeys(columns) if c in known]
        aggs = "".join(f", avg({quote(c)}) AS {quote(c)}" for c in wanted)
        return self.rel.sql(
            f"SELECT step, count(*) AS num_ranks{aggs} FROM steps {self.rel.where(kind=kind)} "
            "GROUP BY step ORDER BY step"
        )

    def loss_curve(self, *, kind: str | None = "train") -> pa.Table:
        """The loss components and the KL per step (:meth:`step_curve` of
        :data:`LOSS_COLUMNS`): ``total_loss, policy_loss, clip_loss, kl_loss,
        weighted_kl_loss`` (``LossScalarBundle``) and ``kl_value`` (``BatchDiagnostics``)."""
        return self.step_curve(LOSS_COLUMNS, kind=kind)

    def trainer_curve(self, *, kind: str | None = "train") -> pa.Table:
        """The trainer's own log (the ``trainer_metrics`` record table) per optimizer step:
        ``step`` (the stored step whose rollouts it trained on), ``optimizer_step``,
        ``update`` (its place among the optimizer steps of that stored step, from 1: TRL's
        ``num_iterations`` train on one round several times), ``updates`` (how many there
        were), and the figures the step rows may lack (TRL's): ``loss``, ``kl``. A
        :class:`SchemaError` when the run logged none."""
        if R.TRAINER_METRICS not in self.rel.views.records:
            raise SchemaError("trainer_curve: the store has no trainer_metrics records")
        where = self.rel.where(kind=kind)
        return self.rel.sql(
            "SELECT step, optimizer_step, "
            "row_number() OVER (PARTITION BY step ORDER BY optimizer_step) AS update, "
            "count(*) OVER (PARTITION BY step) AS updates, loss, kl "
            f"FROM {R.TRAINER_METRICS} {where} ORDER BY optimizer_step"
        )

    def distinct_rewards(self, *, kind: str | None = "train", limit: int = 10) -> dict[str, int]:
        """How many distinct values each reward source (``total_utils`` and each function)
        took over the run's completions of ``kind``, counted up to ``limit + 1`` (more: a
        continuous reward). The report draws a discrete reward's band as the interval of its
        mean: a quantile of a 0/1 reward is 0 or 1, and jumps between them."""
        sources = [("total_utils", "total_util")] if "total_util" in self.rel.flat_exprs else []
        sources += list(reward_aliases(self.rel.reward_names).items())
        if not sources:
            return {}
        flat = self.rel.flat([a for _, a in sources], kind=kind)
        counts = ", ".join(
            f"count(DISTINCT {quote(a)}) FILTER (WHERE NOT isnan({quote(a)})) AS c{i}"
            for i, (_, a) in enumerate(sources)
        )
        row = self.rel.sql(f"SELECT {counts} FROM {flat}").to_pylist()[0]
        return {name: min(int(row[f"c{i}"] or 0), limit + 1) for i, (name, _) in enumerate(sources)}

    def policy_entropy_curve(self, *, kind: str | None = "train") -> pa.Table:
        """The policy's own entropy per step, from ``policy_entropy_sum`` (H_i, the summed
        per-token entropy of completion i under the policy that scored it).

        Columns: ``step, n`` (completions with a value), ``entropy_per_token`` = Σ_i H_i /
        Σ_i T_i over those completions (T_i their token counts, as in :meth:`length_stats`;
        ``docs/formulas.md`` §5.6) and ``entropy_per_completion`` = the mean H_i. A
        :class:`SchemaError` when the run stored no policy entropy.
        """
        if "policy_entropy_sum" not in self.rel.flat_exprs or "length" not in self.rel.flat_exprs:
            raise SchemaError("policy_entropy_curve: the store has no 'policy_entropy_sum'")
        h, t = quote("policy_entropy_sum"), quote("length")
        return self.rel.sql(
            f"SELECT step, count({h}) AS n, "
            f"sum({h}) FILTER (WHERE {t} IS NOT NULL) / "
            f"nullif(sum({t}) FILTER (WHERE {h} IS NOT NULL), 0) AS entropy_per_token, "
            f"avg({h}) AS entropy_per_completion FROM "
            f"(SELECT step, unnest({self.rel.flat_exprs['policy_entropy_sum']}) AS {h}, "
            f"unnest({self.rel.flat_exprs['length']}) AS {t} FROM groups "
            f"{self.rel.where(kind=kind)}) GROUP BY step HAVING count({h}) > 0 ORDER BY step"
        )

    def distinct_completions(self, *, kind: str | None = "train") -> pa.Table:
        """How many different completions each group drew, per step: a policy that
        collapsed samples the same text K times.

        Per group g (its parts on several ranks merged): d_g, the distinct completion texts
        among its K_g completions. Per step: ``num_groups``, ``mean_distinct`` (mean d_g) and
        ``distinct_frac`` (mean d_g / K_g; 1 when every completion differs, 1/K when all are
        the same; ``docs/formulas.md`` §5.6). Reads the completion text column.
        """
        where = self.rel.where(kind=kind)
        return self.rel.sql(
            "SELECT step, count(*) AS num_groups, avg(d) AS mean_distinct, "
            "avg(d / k) AS distinct_frac FROM (SELECT step, count(DISTINCT c) AS d, "
            "count(*) AS k FROM (SELECT step, kind, group_id, unnest(completions) AS c "
            f"FROM groups {where}) GROUP BY {GROUP_KEY}) GROUP BY step ORDER BY step"
        )

    def group_extremes(
        self, *, n: int = 3, by: str = "total_utils", kind: str | None = "train"
    ) -> pa.Table:
        """The ``n`` best and ``n`` worst prompt groups of the whole run, by the mean of their
        scored ``by`` values (unscored completions left out; a group without a scored
        completion is not ranked).

        Columns: ``which`` (``"best"``/``"worst"``), ``position`` (1 = most extreme),
        ``step, kind, group_id, prompt`` (text, or the last message's content for a chat),
        ``answer`` (the gold answer), ``k`` (completions), ``n_scored``, ``mean``, and the
        group's ``best_completion, best_score, worst_completion, worst_score``. Ties break
        towards the later step, then by ``group_id``. A group is listed once: the worst are
        taken from the groups not among the best.
        """
        expr = self._list_expr(by, what="group_extremes")
        n = int(n)
        if n < 1:
            raise LayoutError(f"n: expected an integer >= 1, got {n}")
        cols = self.rel.group_columns
        prompt = _prompt_text(cols)
        answer = "answer" if "answer" in cols else "NULL::VARCHAR"
        base = (
            f"SELECT step, kind, group_id, {prompt} AS prompt, {answer} AS answer, "
            f"unnest(completions) AS completion, unnest({expr}) AS score FROM groups "
            f"{self.rel.where(kind=kind)}"
        )
        per_group = (
            f"SELECT step, kind, group_id, any_value(prompt) AS prompt, "
            "any_value(answer) AS answer, count(*) AS k, count(score) AS n_scored, "
            "avg(score) AS mean, arg_max(completion, score) AS best_completion, "
            "max(score) AS best_score, arg_min(completion, score) AS worst_completion, "
            f"min(score) AS worst_score FROM ({base}) GROUP BY {GROUP_KEY} "
            "HAVING count(score) > 0"
        )
        # Best first by mean; worst first the other way, among the groups not already best
        # (a run of fewer than 2n groups shows each group once).
        order = "step DESC, group_id"
        return self.rel.sql(
            f"WITH g AS ({per_group}), r AS (SELECT *, row_number() OVER (ORDER BY mean DESC, "
            f"{order}) AS b, row_number() OVER (ORDER BY mean ASC, {order}) AS w FROM g) "
            f"SELECT 'best' AS which, b AS position, * EXCLUDE (b, w) FROM r WHERE b <= {n} "
            f"UNION ALL SELECT 'worst' AS which, w AS position, * EXCLUDE (b, w) FROM r "
            f"WHERE w <= {n} AND b > {n} ORDER BY which, position"
        )

    def eval_completions(
        self, step: int | None = None, *, kind: str = "eval", limit: int | None = None
    ) -> pa.Table:
        """The completions of one evaluation step beside their gold answers.

        ``step`` defaults to the last step of ``kind``. Columns: ``step, rank, group_index,
        sample_index, prompt, answer, completion, total_util`` and ``reward_<name>`` for each
        reward function (unscored: NULL), ordered by (rank, group, sample); at most ``limit``
        rows. Empty when the run has no such step.
        """
        if step is None:
            last = (
                self.rel.sql(f"SELECT max(step) AS s FROM steps {self.rel.where(kind=kind)}")
                .column("s")[0]
                .as_py()
            )
            if last is None:
                step = -1
            else:
                step = int(last)
        cols = self.rel.group_columns
        scores = [
            (alias, self.rel.flat_exprs[alias])
            for alias in ("total_util", *reward_aliases(self.rel.reward_names).values())
            if alias in self.rel.flat_exprs
        ]
        unnested = "".join(f", unnest({e}) AS {quote(a)}" for a, e in scores)
        answer = "answer" if "answer" in cols else "NULL::VARCHAR"
        tail = f" LIMIT {int(limit)}" if limit is not None else ""
        return self.rel.sql(
            f"SELECT step, rank, group_index, {_prompt_text(cols)} AS prompt, {answer} AS answer, "
            "unnest(generate_series(0, num_completions - 1)) AS sample_index, "
            f"unnest(completions) AS completion{unnested} FROM groups "
            f"{self.rel.where(kind=kind, steps=int(step))} "
            f"ORDER BY rank, group_index, sample_index{tail}"
        )

    def run_config(self, *, kind: str | None = "train") -> dict[str, Any]:
        """The run config recorded with the step rows (``RunConfig`` as a dict), as of the
        last step of ``kind`` (of any kind when it has none), and the keys whose value
        differed between its steps.

        Returns ``{"step": last step or None, "config": {...}, "changed": [keys]}``; the
        config is empty when no step row recorded one.
        """
        rows = self.rel.sql(
            "SELECT kind, config, max(step) AS last FROM steps WHERE config IS NOT NULL "
            "GROUP BY kind, config ORDER BY last"
        ).to_pylist()
        return self._config_of(rows, kind)

    @staticmethod
    def _config_of(rows: list[dict[str, Any]], kind: str | None) -> dict[str, Any]:
        return config_of(rows, kind)

    def group_counts(self) -> pa.Table:
        """Prompt groups and completions per kind, counted from the group rows read: columns
        ``kind, steps, groups, completions``. Under ``on_error="skip"`` a damaged group file
        left out is not counted here, while the step rows (``describe()``) still list it."""
        k = "num_completions" if "num_completions" in self.rel.group_columns else "len(completions)"
        return self.rel.sql(
            "SELECT kind, count(DISTINCT step) AS steps, count(*) AS groups, "
            f"sum({k})::BIGINT AS completions FROM groups GROUP BY kind ORDER BY kind"
        )

    def eval_rows(self) -> pa.Table:
        """The step rows of evaluation passes (``kind = 'eval'``), by step and rank."""
        return self.rel.sql("SELECT * FROM steps WHERE kind = 'eval' ORDER BY step, rank")

    def _list_expr(self, name: str, *, what: str) -> str:
        return self.rel.flat_exprs[self.rel.alias(name, what=what)]


def config_of(rows: list[dict[str, Any]], kind: str | None) -> dict[str, Any]:
    """:meth:`ReadyMadeQueries.run_config` of the step rows' distinct configs (``kind``,
    ``config``, ``last``: its last step), in the order of ``last``."""
    mine = [r for r in rows if kind is None or r["kind"] == kind] or rows
    if not mine:
        return {"step": None, "config": {}, "changed": []}
    configs = [_json_object(r["config"]) for r in mine]
    latest = configs[-1]
    keys = sorted({k for c in configs for k in c})
    changed = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    return {"step": mine[-1]["last"], "config": latest, "changed": changed}


def _prompt_text(columns: set[str]) -> str:
    """SQL of a group's prompt as text: ``prompt``, or the last message's content of a chat
    prompt."""
    parts = []
    if "prompt" in columns:
        parts.append("prompt")
    if "prompt_messages" in columns:
        parts.append("prompt_messages[len(prompt_messages)].content")
    return f"coalesce({', '.join(parts)})" if len(parts) > 1 else (parts or ["NULL::VARCHAR"])[0]


def _json_object(text: Any) -> dict[str, Any]:
    """A step row's config JSON as a dict (anything else: empty)."""
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _length_stats_from_histogram(hist: pa.Table) -> pa.Table:
    """``length_stats`` from (step, t, clipped, c) rows sorted by (step, t), vectorised.

    Quantiles interpolate linearly between order statistics as ``numpy.quantile`` and
    DuckDB's ``quantile_cont`` do: h = (n - 1) q, value = x[floor h] + (h - floor h)(x[floor h
    + 1] - x[floor h]), with x the step's sorted lengths, located through cumulative counts.
    """
    step = hist.column("step").to_numpy()
    t = hist.column("t").to_numpy().astype(np.float64)
    c = hist.column("c").to_numpy().astype(np.int64)
    clipped = hist.column("clipped")
    is_clipped = pc.fill_null(clipped, False).to_numpy(zero_copy_only=False)
    is_term = pc.fill_null(pc.invert(clipped), False).to_numpy(zero_copy_only=False)
    known = pc.is_valid(clipped).to_numpy(zero_copy_only=False)
    if step.size == 0:
        return pa.table(
            {
                "step": pa.array([], pa.int64()),
                **{n: pa.array([], pa.int64() if n == "n" else pa.float64()) for n in _LENGTHS},
            }
        )
    starts, n, cum, base = _segments(step, c)
    steps = step[starts]

    def seg_sum(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values, starts)

    def seg_ext(values: np.ndarray, mask: np.ndarray, fn: Any, fill: float) -> np.ndarray:
        out = fn.reduceat(np.where(mask, values, fill), starts)
        has = np.add.reduceat(mask.astype(np.int64), starts) > 0
        return np.where(has, out, np.nan)

    everything = np.ones_like(known)

    def quantile(q: float) -> np.ndarray:
        return _segment_quantile(t, cum, base, n, q)

    n_known = seg_sum(c * known)
    n_term = seg_sum(c * is_term)
    with np.errstate(invalid="ignore", divide="ignore"):
        # The step statistic's fields, in LengthStats's order (docs/formulas.md §5.2).
        stats = dict(
            zip(
                _STEP_LENGTHS,
                [
                    seg_ext(t, everything, np.minimum, np.inf),
                    seg_sum(t * c) / n,
                    seg_ext(t, everything, np.maximum, -np.inf),
                    np.where(n_known > 0, seg_sum(c * is_clipped) / n_known, np.nan),
                    seg_ext(t, is_term & (c > 0), np.minimum, np.inf),
                    np.where(n_term > 0, seg_sum(t * c * is_term) / n_term, np.nan),
                    seg_ext(t, is_term & (c > 0), np.maximum, -np.inf),
                ],
                strict=True,
            )
        )
        stats["clipped_frac"] = stats.pop("clipped_ratio")
        stats["p50_length"], stats["p95_length"] = quantile(0.5), quantile(0.95)
        table = {
            "step": pa.array(steps, pa.int64()),
            "n": pa.array(n, pa.int64()),
            **{name: stats[name] for name in _LENGTHS[1:]},
        }
    # NaN marks "no value" above; Arrow gets real nulls, as the SQL version gave.
    return pa.table(
        {
            k: v if isinstance(v, pa.Array) else pa.array(v, pa.float64(), from_pandas=True)
            for k, v in table.items()
        }
    )


def _stats_from_histogram(hist: pa.Table, qs: Sequence[float], qname: Any) -> pa.Table:
    """``step, n, mean, std (population), min, p.., max`` from (step, x, c) rows sorted by
    (step, x): the same numbers as the SQL aggregates, quantiles exact (linear)."""
    step = hist.column("step").to_numpy()
    x = hist.column("x").to_numpy().astype(np.float64)
    c = hist.column("c").to_numpy().astype(np.int64)
    if step.size == 0:
        names = ["n", "mean", "std", "min", *[qname(q) for q in qs], "max"]
        return pa.table(
            {
                "step": pa.array([], pa.int64()),
                **{k: pa.array([], pa.int64() if k == "n" else pa.float64()) for k in names},
            }
        )
    starts, n, cum, base = _segments(step, c)
    mean = np.add.reduceat(x * c, starts) / n
    dev = x - np.repeat(mean, np.diff(np.r_[starts, step.size]))
    cols: dict[str, Any] = {
        "step": pa.array(step[starts], pa.int64()),
        "n": pa.array(n, pa.int64()),
        "mean": mean,
        "std": np.sqrt(np.add.reduceat(dev * dev * c, starts) / n),
        "min": np.minimum.reduceat(x, starts),
    }
    for q in qs:
        cols[qname(q)] = _segment_quantile(x, cum, base, n, q)
    cols["max"] = np.maximum.reduceat(x, starts)
    return pa.table(cols)


def _segments(step: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, ...]:
    """Row starts of each step, its count, global cumulative counts and each step's base."""
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    n = np.add.reduceat(c, starts)
    cum = np.cumsum(c)  # sorted positions: row r covers [cum[r] - c[r], cum[r])
    base = np.r_[0, cum[:-1]][starts]
    return starts, n, cum, base


def _segment_quantile(
    x: np.ndarray, cum: np.ndarray, base: np.ndarray, n: np.ndarray, q: float
) -> np.ndarray:
    """Linear-interpolation quantile per segment (numpy's and DuckDB's quantile_cont):
    h = (n - 1) q, x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h])."""
    h = (n - 1) * q
    lo = np.floor(h)
    at_lo = np.searchsorted(cum, base + lo.astype(np.int64), side="right")
    at_hi = np.searchsorted(cum, base + np.minimum(lo + 1, n - 1).astype(np.int64), "right")
    return x[at_lo] + (h - lo) * (x[at_hi] - x[at_lo])
