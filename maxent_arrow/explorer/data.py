"""What each page of the explorer shows, read from the store as it is asked for.

Every read goes through :class:`~maxent_arrow.store.ReadOnlyStore`: ``read`` with ``steps``,
``kind``, ``ranks`` and ``columns`` (checked against the CRCs recorded at commit), ``units``
and the catalog's step rows (from the commit log), ``attempts``, ``lifecycle``, and the
sandboxed SQL views for the compare page's one-column scan. A page reads the step rows, or
the group rows of one step, or one group row, and only the columns it shows: never the whole
run. Nothing here writes, and no path comes from a request: steps, ranks and group indices
are integers, kinds are matched against the store's. Numbers come out of Arrow through their
buffers (:func:`~maxent_arrow.arrow.lists.float_values`): ``Array.to_numpy`` and Python
scalars in ``pyarrow.compute`` import pandas, which the read side never loads.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.analytics import (
    attempt_statuses,
    describe_run,
    finite,
    lifecycle_roles,
    role_lifecycle,
)
from maxent_arrow.analytics.attempts import TRAINER
from maxent_arrow.arrow import float_values
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError
from maxent_arrow.explorer.tokenizer import RunTokenizer
from maxent_arrow.store import ReadOnlyStore

__all__ = [
    "CHARTS",
    "HISTORIES",
    "TOKEN_SERIES",
    "Chart",
    "GroupRow",
    "RunData",
    "Series",
    "StepGroups",
    "completion_stats",
    "dumps",
    "nan_mean",
]

History = Literal["effective", "all", "superseded"]
HISTORIES: tuple[History, ...] = ("effective", "all", "superseded")

# What a step's table needs of each group row (no token columns, no prompt ids).
_SCORES = ("total_utils", "advantages", "reward_values")
_NAMES = ("reward_names", "completion_info", "group_id")
_TEXT = ("prompt", "prompt_messages", "example_id")
# What a group's page adds.
_GROUP_EXTRA = ("completions", "completion_messages", "answer")
_MAXENT = ("q", "weights", "ref_tok_counts")
# The overview's charts, one per metric: (title, its column of the step table, its column of
# the trainer's own log, the trainer_metrics record table; None: the log has none). A chart
# draws the step rows' values and the trainer's where they add something (a run whose step
# rows lack the figure, as TRL's lack the loss; updates the step rows average over).
CHARTS = (
    ("reward (mean U)", "reward_mean", None),
    ("completion length (tokens)", "mean_length", None),
    ("KL", "kl_value", "kl"),
    ("loss", "total_loss", "loss"),
)
_CURVES = tuple(column for _, column, _ in CHARTS)
# Per-token number columns that are not a series to colour by: the ids themselves.
_NOT_SERIES = ("completion_ids", "sample_prompt_ids")
# Per-token series of the tokens page, in this order, with these labels ("kl" is computed).
TOKEN_SERIES: tuple[tuple[str, str], ...] = (
    ("behavior_token_logp", "behaviour log-prob"),
    ("ref_token_logp", "reference log-prob"),
    ("sampling_token_logp", "sampling (rollout) log-prob"),
    ("kl", "KL (k3, behaviour vs reference)"),
    ("importance_sampling_ratio", "importance ratio"),
    ("token_advantages", "advantage"),
    ("tool_mask", "tool mask"),
    ("token_values", "value (critic)"),
    ("token_returns", "return"),
)


def nan_mean(values: Sequence[float | None]) -> float:
    """The mean of the finite values; NaN when there are none."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _rows(column: pa.Array) -> np.ndarray:
    """The row (list) of each flattened item of list array ``column``."""
    return float_values(pc.list_parent_indices(column)).astype(np.int64)


def _flat(table: pa.Table, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The values of list column ``name`` as float64 and the row of each (empty if absent)."""
    if name not in table.column_names or n == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    column = table.column(name).combine_chunks()
    return float_values(pc.list_flatten(column)), _rows(column)


def _moments(values: np.ndarray, rows: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Per row: the mean and population std of the finite values (NaN without any), and
    how many values were NaN."""
    if not len(values):
        nan = np.full(n, np.nan)
        return nan, nan.copy(), np.zeros(n, np.int64)
    finite = np.isfinite(values)
    x = np.where(finite, values, 0.0)
    count = np.bincount(rows, weights=finite, minlength=n)
    total = np.bincount(rows, weights=x, minlength=n)
    squares = np.bincount(rows, weights=x * x, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / count, np.nan)
        var = np.where(count > 0, squares / count - mean * mean, np.nan)
    std = np.sqrt(np.maximum(var, 0.0))
    std[count == 0] = np.nan
    nans = np.bincount(rows, weights=np.isnan(values), minlength=n).astype(np.int64)
    return mean, std, nans


def _spread(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Per row: max - min of the finite values (NaN without any)."""
    hi = np.full(n, -np.inf)
    lo = np.full(n, np.inf)
    finite = np.isfinite(values)
    np.maximum.at(hi, rows[finite], values[finite])
    np.minimum.at(lo, rows[finite], values[finite])
    out = hi - lo
    out[~np.isfinite(out)] = np.nan
    return out


def _function_means(table: pa.Table, n: int) -> tuple[list[str], dict[str, dict[int, float]]]:
    """Each reward function's mean over a row's finite values, per row that scores it."""
    if "reward_values" not in table.column_names or "reward_names" not in table.column_names:
        return [], {}
    names = table.column("reward_names").to_pylist()
    values = table.column("reward_values").combine_chunks()
    per_completion = pc.list_flatten(values)
    flat = float_values(pc.list_flatten(per_completion))
    completion_of = _rows(per_completion)
    row_of = _rows(values)[completion_of]
    starts = float_values(per_completion.offsets).astype(np.int64)[:-1][completion_of]
    position = np.arange(len(flat)) - starts
    functions: list[str] = []
    out: dict[str, dict[int, float]] = {}
    # The rows of a step share their reward functions but for schema evolution: one pass
    # per distinct list of names.
    groups: dict[tuple, list[int]] = {}
    for i, row_names in enumerate(names):
        groups.setdefault(tuple(row_names or ()), []).append(i)
    for row_names, members in groups.items():
        in_rows = np.isin(row_of, members)
        for j, name in enumerate(row_names):
            if name not in functions:
                functions.append(name)
            pick = in_rows & (position == j)
            mean, _, _ = _moments(flat[pick], row_of[pick], n)
            target = out.setdefault(name, {})
            for i in members:
                target[i] = float(mean[i])
    return functions, out


def _step_series(rows: list[dict[str, Any]], column: str, kind: str) -> list[tuple[int, float]]:
    """``column`` per step of ``kind`` from the step rows: the mean over a step's ranks,
    weighted by their groups."""
    by_step: dict[int, list[tuple[float, int]]] = {}
    for r in rows:
        v = r.get(column)
        if r["kind"] == kind and v is not None and math.isfinite(v):
            by_step.setdefault(r["step"], []).append((v, r["num_groups"] or 1))
    return [
        (s, sum(v * w for v, w in vs) / sum(w for _, w in vs)) for s, vs in sorted(by_step.items())
    ]


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Whether two per-step series say the same (the trainer's log of what the step rows
    hold already, as a MaxEnt run's)."""
    if [s for s, _ in a] != [s for s, _ in b]:
        return False
    return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) for (_, x), (_, y) in zip(a, b))


def _updates(metrics: list[dict[str, Any]], column: str, kind: str) -> dict[int, list[float]]:
    """The trainer's logged ``column`` of ``kind``, per stored step, in optimizer order."""
    found = sorted(
        (m["step"], m.get("optimizer_step") or 0, m[column])
        for m in metrics
        if m["kind"] == kind
        and m.get("step") is not None
        and m.get(column) is not None
        and math.isfinite(m[column])
    )
    out: dict[int, list[float]] = {}
    for step, _, value in found:
        out.setdefault(step, []).append(value)
    return out


def _chart(
    title: str,
    column: str,
    logged: str | None,
    rows: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    config: dict[str, Any],
) -> Chart | None:
    """The chart of one metric (``None``: the run recorded it nowhere)."""
    chart = Chart(title)
    kinds = sorted({r["kind"] for r in rows} | {m["kind"] for m in metrics if logged})
    for kind in kinds:
        own = _step_series(rows, column, kind)
        if own:
            chart.series.append(Series(kind, kind, [(s, v, s) for s, v in own]))
        updates = _updates(metrics, logged, kind) if logged else {}
        if not updates:
            continue
        if all(all(math.isclose(v, vs[0], rel_tol=1e-9) for v in vs) for vs in updates.values()):
            updates = {s: vs[:1] for s, vs in updates.items()}  # one value per stored step
        most = max(len(v) for v in updates.values())
        if most == 1:
            logged_series = [(s, vs[0]) for s, vs in sorted(updates.items())]
            if own and _same(own, logged_series):
                continue  # the trainer logged what the step rows hold: one line
            name = f"{kind} (trainer log)" if own else kind
            points = [(s, v, s) for s, v in logged_series]
            chart.series.append(Series(name, kind, points, dashed=bool(own)))
            continue
        chart.series.extend(_update_series(updates, kind, most, dashed=bool(own)))
        chart.note = _updates_note(most, config)
    return chart if chart.series else None


def _update_series(
    updates: dict[int, list[float]], kind: str, most: int, *, dashed: bool
) -> list[Series]:
    """Several optimizer steps per stored step (TRL's ``num_iterations``): one series per
    update of a round, drawn at ``step + k * gap / n`` (``gap``: the stored steps' stride),
    so that no line joins the first update of a round to the second."""
    steps = sorted(updates)
    gap = min((b - a for a, b in zip(steps, steps[1:])), default=1) or 1
    out = []
    for k in range(most):
        points = [
            (s + k * gap / len(vs), vs[k], s) for s, vs in sorted(updates.items()) if k < len(vs)
        ]
        out.append(Series(f"{kind}: update {k + 1} of {most} per round", kind, points, dashed))
    return out


def _updates_note(most: int, config: dict[str, Any]) -> str:
    trl = (config.get("extra") or {}).get("trl") or {}
    why = ", ".join(
        f"{k} = {trl[k]}" for k in ("num_iterations", "steps_per_generation") if trl.get(k)
    )
    said = f" ({why})" if why else ""
    return (
        f"The trainer made {most} optimizer steps per stored step{said}: each round's rollouts "
        f"were trained on "
        f"{most} times, the first by the policy that generated them, the later ones after it "
        "moved. Each update is its own series (update k drawn k/n of the way to the next "
        "stored step), so the alternation between them is what the updates did, not noise."
    )


def completion_stats(
    info: Sequence[dict[str, Any] | None] | None, k: int
) -> tuple[list, list, list]:
    """Per completion: token count (or ``None``), finish reason, truncated flag."""
    items: Sequence[dict[str, Any] | None] = info or [None] * k
    lengths = [None if i is None else i.get("token_count") for i in items]
    reasons = [
        None if i is None else (i.get("finish_reason") or i.get("stop_reason")) for i in items
    ]
    truncated = [
        bool(i and (i.get("truncated") or i.get("finish_reason") == "length")) for i in items
    ]
    return lengths, reasons, truncated


@dataclass
class StepGroups:
    """The groups of one step and kind, one dict per group row, and what the filters offer."""

    step: int
    kind: str
    rows: list[dict[str, Any]]
    reward_functions: list[str]
    has_status: bool
    history: History
    role: str = TRAINER  # whose lifecycle records the statuses are
    roles: list[str] = field(default_factory=list)  # the roles that recorded any


@dataclass
class GroupRow:
    """One group row with its completions, as the group page shows it."""

    key: dict[str, Any]
    prompt: str | None
    prompt_messages: list[dict[str, Any]] | None
    answer: str | None
    example_id: str | None
    attempt: str
    superseded: bool
    status: str | None
    reward_names: list[str]
    completions: list[dict[str, Any]] = field(default_factory=list)
    best: int | None = None
    worst: int | None = None
    # The run's user columns: the dataset columns a recorder kept (``ds_<name>``, one value
    # per group), by name; each completion's ``log_extra`` values are its ``"extra"``.
    dataset: dict[str, Any] = field(default_factory=dict)
    extra_names: list[str] = field(default_factory=list)


@dataclass
class Series:
    """One line of a chart: its legend ``name``, the ``kind`` of steps its points link to,
    the points ``(x, value, step)`` (``x`` where it is drawn: the stored step, or a fraction
    past it for a trainer's several updates of one stored step), dashed or solid."""

    name: str
    kind: str
    points: Sequence[tuple[float, float, int]]
    dashed: bool = False


@dataclass
class Chart:
    """One metric of the overview: its series and what a reader needs to read them."""

    title: str
    series: list[Series] = field(default_factory=list)
    note: str = ""


class RunData:
    """The reads of one run for the explorer; a store object per history, opened on first use."""

    def __init__(self, run: str | Any, *, on_error: str = "raise", query_timeout: float = 30.0):
        self.run = run
        self.on_error = on_error
        self.query_timeout = query_timeout
        self._stores: dict[str, ReadOnlyStore] = {}
        # role -> its lifecycle events by group, for the record files of _lifecycle_files
        self._lifecycle: dict[str, dict[tuple, tuple[str, str | None]]] = {}
        self._lifecycle_files: tuple | None = None
        self._roles: list[str] | None = None
        self.tokenizer = RunTokenizer()
        self._identity: tuple[int | None, Any] | None = None  # (log version, tokenizer)
        # (step file, columns) -> the overview's step rows of it (step files are immutable);
        # holds the committed step files only (the overview drops the others)
        self._step_cache: dict[tuple[str, tuple[str, ...]], dict[str, list]] = {}
        self._kinds: tuple[int | None, list[str]] | None = None  # (log version, kinds)
        self._lock = threading.Lock()
        self.store("effective")  # a store that cannot be opened fails at start, not on a page

    # ------------------------------------------------------------------ stores
    def store(self, history: History = "effective") -> ReadOnlyStore:
        if history not in HISTORIES:
            raise ArgumentError(f"attempts: expected one of {HISTORIES}, got {history!r}")
        with self._lock:
            if history not in self._stores:
                self._stores[history] = ReadOnlyStore(
                    self.run,
                    on_error=self.on_error,  # type: ignore[arg-type]
                    query_timeout=self.query_timeout,
                    attempts=history,
                )
            return self._stores[history]

    @property
    def uri(self) -> str:
        return self.store().uri

    def kinds(self) -> list[str]:
        """The kinds of the run's steps (every page checks its kind), listed again only
        when the commit log has a new version."""
        store = self.store("all")
        catalog = store.catalog
        version = catalog.version
        hit = self._kinds
        if hit is not None and version is not None and hit[0] == version:
            return list(hit[1])
        kinds = sorted({u.kind for u in store.units()})
        self._kinds = (version, kinds)
        return list(kinds)

    def check_kind(self, kind: str) -> str:
        if kind not in self.kinds():
            raise ArgumentError(f"kind: this run has no {kind!r} steps (it has {self.kinds()})")
        return kind

    # ------------------------------------------------------------------ overview
    def overview(self) -> dict[str, Any]:
        """The charts (one per metric: step rows and trainer_metrics), the config of the
        last step, the attempts with their status."""
        store = self.store()
        schema = store.schema("steps")
        wanted = [c for c in _CURVES if c in schema.names]
        # The step rows as the catalog holds them (from the commit log, checked when it was
        # read; no group file, no SQL session, no pandas): one row per committed unit.
        # Read once per step file (a segment holds many units), kept by its name: a
        # committed step file is never rewritten (a compaction writes a new name).
        by_file: dict[str, list[Any]] = {}
        for unit in store.units():
            by_file.setdefault(unit.step_file, []).append(unit)
        rows = []
        for name, units in by_file.items():
            columns = self._step_rows(store, name, wanted)
            for unit in units:
                rows.append({c: values[unit.row] for c, values in columns.items()})
        with self._lock:  # files a compaction replaced (or other columns) leave the cache
            key = tuple(wanted)
            for gone in [k for k in self._step_cache if k[0] not in by_file or k[1] != key]:
                del self._step_cache[gone]
        metrics = []
        if R.TRAINER_METRICS in store.record_names():
            metrics = store.read_records(R.TRAINER_METRICS).to_pylist()
        described = describe_run(store)
        recorded = described["run_config"]
        charts = [
            chart
            for title, column, logged in CHARTS
            if (chart := _chart(title, column, logged, rows, metrics, recorded["config"]))
        ]
        steps_by_kind = {
            kind: sorted({r["step"] for r in rows if r["kind"] == kind})
            for kind in sorted({r["kind"] for r in rows})
        }
        superseded = sorted({u.step for u in self.store("superseded").units()})
        return {
            "uri": store.uri,
            # The config of the last step, as ``inspect`` and the report show it (the
            # manifest's, as the store was created, only when no step recorded one).
            "config": recorded["config"] or store.config,
            "config_step": recorded["step"],
            "config_changed": recorded["changed"],
            "manifest": {k: v for k, v in store.manifest.items() if k != "config"},
            "attempts": attempt_statuses(store),
            "charts": charts,
            "steps": steps_by_kind,
            "superseded_steps": superseded,
            "groups": sum(r["num_groups"] or 0 for r in rows),
        }

    def _step_rows(self, store: ReadOnlyStore, name: str, wanted: list[str]) -> dict[str, list]:
        """The overview's columns of committed step file ``name`` as Python lists (absent
        ones as ``None``s), cached per process by the file's name and the columns."""
        key = (name, tuple(wanted))
        hit = self._step_cache.get(key)
        if hit is None:
            table = store.catalog.step_file(name).table
            n = table.num_rows
            hit = {
                c: table.column(c).to_pylist() if c in table.column_names else [None] * n
                for c in (*R.UNIT_KEY, "num_groups", *wanted)
            }
            with self._lock:
                self._step_cache[key] = hit
        return hit

    def verify(self) -> dict[str, Any]:
        report = self.store().verify()
        return {
            "ok": report.ok,
            "checked": report.checked,
            "problems": [(str(p.path), p.problem) for p in report.problems],
        }

    # ------------------------------------------------------------------ lifecycle
    def status_of(self, role: str = TRAINER) -> dict[tuple, tuple[str, str | None]]:
        """(step, rank, kind, group_index) -> (event, reason) of ``role``'s effective
        lifecycle records (the trainer's by default: what the run trained on; another role's,
        a sampler that trained a second policy from the store, only when asked), read again
        only when the record files change (a live run records more)."""
        store = self.store()
        catalog = store.catalog
        state = catalog.state()  # a resume changes the effective events: attempts count
        files = (len(state.attempts), *(i["path"] for i in state.records.get(R.LIFECYCLE, [])))
        if files != self._lifecycle_files:
            self._lifecycle_files = files
            self._lifecycle = {}
            self._roles = None
        hit = self._lifecycle.get(role)
        if hit is None:
            hit = {}
            table = role_lifecycle(store, role)
            if table is not None:
                cols = [table.column(n).to_pylist() for n in (*R.LIFECYCLE_KEY, "event", "reason")]
                for s, r, k, g, event, reason in zip(*cols):
                    hit[(s, r, k, g)] = (event, reason)
            self._lifecycle[role] = hit
        return hit

    def roles(self) -> list[str]:
        """The roles whose attempts recorded lifecycle events (the trainer's first)."""
        self.status_of()  # (drops the cached roles when the records changed)
        if self._roles is None:
            self._roles = lifecycle_roles(self.store())
        return list(self._roles)

    # ------------------------------------------------------------------ attempts
    def row_attempts(
        self, step: int, kind: str, history: History, ranks: list[int] | None = None
    ) -> list[tuple[str, bool]]:
        """(attempt, superseded) of each group row ``read(steps=step, kind=kind, ranks=ranks)``
        returns, in its order (units grouped by file, as the store's reader reads them)."""
        store = self.store(history)
        effective = {
            (u.rank, u.step_file)
            for u in self.store("effective").units(kind=kind, steps=step, ranks=ranks)
        }
        by_file: dict[str, list] = {}
        for u in store.units(kind=kind, steps=step, ranks=ranks):
            by_file.setdefault(u.step_file, []).append(u)
        out: list[tuple[str, bool]] = []
        for name, members in by_file.items():
            attempt = store.catalog.attempt_of(name)
            for u in members:
                out.extend([(attempt, (u.rank, u.step_file) not in effective)] * u.num_groups)
        return out

    # ------------------------------------------------------------------ step
    def step_groups(
        self, step: int, kind: str, history: History = "effective", role: str = TRAINER
    ) -> StepGroups:
        """Every group row of one step: the figures the step table sorts and filters by,
        computed over the step's flat per-completion values (numpy; no loop over
        completions)."""
        store = self.store(history)
        schema = store.schema()
        wanted = (*R.ROW_KEY, *_NAMES, *_SCORES, *_TEXT, "ref_tok_counts")
        columns = [c for c in wanted if c in schema.names]
        table = store.read(steps=step, kind=kind, columns=columns)
        n = table.num_rows
        present = set(table.column_names)
        attempts = self.row_attempts(step, kind, history)
        status = self.status_of(role)

        utils, u_rows = _flat(table, "total_utils", n)
        adv, a_rows = _flat(table, "advantages", n)
        counts = np.bincount(u_rows, minlength=n) if len(u_rows) else np.zeros(n, np.int64)
        k = np.maximum(counts, np.bincount(a_rows, minlength=n) if len(a_rows) else 0)
        mean, std, unscored = _moments(utils, u_rows, n)
        spread = _spread(adv, a_rows, n)
        # Lengths: the generator's token counts, else the scored token counts, else the ids.
        lengths, l_rows = np.zeros(0), np.zeros(0, np.int64)
        truncated = np.zeros(n, np.int64)
        if "completion_info" in present:
            info = table.column("completion_info").combine_chunks()
            rows_of = _rows(info)
            items = pc.list_flatten(info)
            tokens = pc.struct_field(items, "token_count")
            if tokens.null_count < len(tokens):
                lengths = float_values(tokens)
                l_rows = rows_of
            # No Python scalars into pyarrow.compute (pa.scalar imports pandas).
            cut = pc.struct_field(items, "truncated")
            reasons = pc.struct_field(items, "finish_reason")
            at_cap = pc.match_substring_regex(reasons, pattern="^length$")
            flags = pc.or_(
                pc.and_kleene(cut, pc.is_valid(cut)), pc.and_kleene(at_cap, pc.is_valid(at_cap))
            )
            flags = float_values(flags).astype(np.int64)
            truncated = np.bincount(rows_of, weights=flags, minlength=n).astype(np.int64)
        if not len(lengths) and "ref_tok_counts" in present:
            lengths, l_rows = _flat(table, "ref_tok_counts", n)
        if not len(lengths) and "completion_ids" in schema.names and n:
            ids = store.read(steps=step, kind=kind, columns=[*R.ROW_KEY, "completion_ids"])
            per = pc.list_flatten(ids.column("completion_ids").combine_chunks())
            lengths = float_values(pc.list_value_length(per))
            l_rows = _rows(ids.column("completion_ids").combine_chunks())
        mean_length, _, _ = _moments(lengths, l_rows, n)
        functions, per_function = _function_means(table, n)

        text = {c: table.column(c).to_pylist() for c in (*_TEXT, "group_id") if c in present}
        keys = [table.column(c).to_pylist() for c in R.ROW_KEY]
        # The figures as Python lists once (not a numpy scalar per row and figure).
        figures = {
            "k": k.astype(np.int64).tolist(),
            "mean_reward": mean.tolist(),
            "reward_std": std.tolist(),
            "advantage_spread": spread.tolist(),
            "mean_length": mean_length.tolist(),
            "truncated": truncated.tolist(),
            "unscored": unscored.tolist(),
        }
        none = [None] * n
        columns = {c: text.get(c, none) for c in (*_TEXT, "group_id")}
        messages_of = columns["prompt_messages"]
        attempts = attempts + [("", False)] * (n - len(attempts))
        rows = []
        for i, key in enumerate(zip(*keys)):
            event = status.get(key)
            attempt, superseded = attempts[i]
            messages = messages_of[i]
            prompt = columns["prompt"][i]
            if prompt is None and messages:
                prompt = " / ".join(f"{m['role']}: {m['content']}" for m in messages)
            row: dict[str, Any] = dict(zip(R.ROW_KEY, key))
            for c, values in columns.items():
                row[c] = values[i]
            row["prompt"] = prompt
            for c, values in figures.items():
                row[c] = values[i]
            row["status"] = None if event is None else event[0]
            row["reason"] = None if event is None else event[1]
            row["attempt"] = attempt
            row["superseded"] = superseded
            row["rewards"] = {f: v[i] for f, v in per_function.items() if i in v}
            row["chat"] = bool(messages)
            rows.append(row)
        return StepGroups(step, kind, rows, functions, bool(status), history, role, self.roles())

    # ------------------------------------------------------------------ group
    def find_group(self, step: int, kind: str, group_id: str) -> tuple[int, int]:
        """(rank, group_index) of the first row of group ``group_id`` at ``step``."""
        table = self.store().read(steps=step, kind=kind, columns=[*R.ROW_KEY, "group_id"])
        for rank, index, gid in zip(
            table.column("rank").to_pylist(),
            table.column("group_index").to_pylist(),
            table.column("group_id").to_pylist(),
        ):
            if gid == group_id:
                return rank, index
        raise LookupError(f"no group {group_id!r} at {kind} step {step}")

    def _group_table(
        self,
        step: int,
        rank: int,
        group_index: int,
        kind: str,
        history: History,
        columns,
        attempt: str | None,
    ) -> tuple[pa.Table, str, bool]:
        """The group row (one row table), the attempt that wrote it and whether a later
        attempt superseded it; ``attempt`` picks among the attempts that wrote the step (the
        ``all`` history), else the latest."""
        store = self.store(history)
        schema = store.schema()
        columns = [c for c in dict.fromkeys(columns) if c in schema.names]
        table = store.read(steps=step, kind=kind, ranks=[rank], columns=columns)
        attempts = self.row_attempts(step, kind, history, ranks=[rank])
        found = [
            i
            for i, g in enumerate(table.column("group_index").to_pylist())
            if g == group_index and (attempt is None or attempts[i][0] == attempt)
        ]
        if not found:
            also = f", attempt {attempt}" if attempt else ""
            raise LookupError(
                f"no group {group_index} of rank {rank} at {kind} step {step} "
                f"({history} history{also})"
            )
        i = found[-1]
        who, superseded = attempts[i] if i < len(attempts) else ("", False)
        return table.slice(i, 1), who, superseded

    def group(
        self,
        step: int,
        rank: int,
        group_index: int,
        kind: str,
        history: History = "effective",
        attempt: str | None = None,
        role: str = TRAINER,
    ) -> GroupRow:
        user = [n for n in self.store(history).schema().names if R.prefix_of(n) is not None]
        columns = [*R.ROW_KEY, *_NAMES, *_SCORES, *_TEXT, *_GROUP_EXTRA, *_MAXENT, *user]
        table, attempt, superseded = self._group_table(
            step, rank, group_index, kind, history, columns, attempt
        )
        row = table.to_pylist()[0]
        dataset = {n.removeprefix("ds_"): row.get(n) for n in user if n.startswith("ds_")}
        extras = [n for n in user if n.startswith("extra_")]
        utils = row.get("total_utils") or []
        texts = row.get("completions") or []
        k = max(len(texts), len(utils))
        lengths, reasons, truncated = completion_stats(row.get("completion_info"), k)
        ref_counts = row.get("ref_tok_counts") or []
        names = row.get("reward_names") or []
        values = row.get("reward_values") or []
        messages = row.get("completion_messages") or []
        event = self.status_of(role).get((step, rank, kind, group_index))

        def at(name: str, i: int) -> Any:
            seq = row.get(name) or []
            return seq[i] if i < len(seq) else None

        completions = []
        for i in range(k):
            length = lengths[i] if i < len(lengths) else None
            if length is None and i < len(ref_counts):
                length = ref_counts[i]
            completions.append(
                {
                    "index": i,
                    "text": texts[i] if i < len(texts) else "",
                    "messages": messages[i] if i < len(messages) else None,
                    "rewards": {
                        name: (values[i][j] if i < len(values) and values[i] else None)
                        for j, name in enumerate(names)
                    },
                    "total": at("total_utils", i),
                    "advantage": at("advantages", i),
                    "q": at("q", i),
                    "weight": at("weights", i),
                    "length": length,
                    "finish_reason": reasons[i] if i < len(reasons) else None,
                    "truncated": truncated[i] if i < len(truncated) else False,
                    "extra": {n.removeprefix("extra_"): at(n, i) for n in extras},
                }
            )
        scored = [
            (c["total"], c["index"])
            for c in completions
            if c["total"] is not None and not math.isnan(c["total"])
        ]
        best = worst = None
        if len(scored) > 1 and max(scored)[0] != min(scored)[0]:
            best = max(scored, key=lambda t: (t[0], -t[1]))[1]
            worst = min(scored)[1]
        return GroupRow(
            key=dict(zip(R.ROW_KEY, (step, rank, kind, group_index))),
            prompt=row.get("prompt"),
            prompt_messages=row.get("prompt_messages"),
            answer=row.get("answer"),
            example_id=row.get("example_id"),
            attempt=attempt,
            superseded=superseded,
            status=None if event is None else (event[0] + (f" ({event[1]})" if event[1] else "")),
            reward_names=names,
            completions=completions,
            best=best,
            worst=worst,
            dataset=dataset,
            extra_names=[n.removeprefix("extra_") for n in extras],
        )

    # ------------------------------------------------------------------ tokens
    def tokens(
        self,
        step: int,
        rank: int,
        group_index: int,
        sample: int,
        kind: str,
        history: History = "effective",
        attempt: str | None = None,
    ) -> dict[str, Any]:
        """One completion's token ids and every per-token series the run stored for it."""
        token_columns = R.names(R.GROUP, level="token")
        columns = [*R.ROW_KEY, "completions", *token_columns]
        table, _, _ = self._group_table(step, rank, group_index, kind, history, columns, attempt)
        present = set(table.column_names)
        row = table.to_pylist()[0]
        ids_all = row.get("completion_ids") or []
        if sample < 0 or sample >= max(len(ids_all), len(row.get("completions") or [])):
            raise LookupError(f"no completion {sample} in group {group_index} (rank {rank})")
        ids = ids_all[sample] if sample < len(ids_all) else []
        series: dict[str, list[float | None]] = {}
        # Every per-token number column the run stored (a column the registry gains later,
        # e.g. an off-policy correction, is shown under its own name).
        labels = dict(TOKEN_SERIES)
        for name in R.numbers(level="token"):
            if name not in _NOT_SERIES:
                labels.setdefault(name, name.replace("_", " "))
        for name in labels:
            if name in present and row.get(name) and sample < len(row[name]):
                values = row[name][sample]
                if values is not None:
                    series[name] = [None if v is None else float(v) for v in values]
        behaviour = series.get("behavior_token_logp") or series.get("sampling_token_logp")
        reference = series.get("ref_token_logp")
        if behaviour and reference and len(behaviour) == len(reference):
            kl = []
            for b, r in zip(behaviour, reference):
                if b is None or r is None:
                    kl.append(None)
                else:
                    d = r - b
                    kl.append(math.exp(d) - d - 1.0)
            series["kl"] = kl
        texts = row.get("completions") or []
        pieces, said = self.tokenizer.pieces(self.tokenizer_identity(), ids)
        return {
            "ids": ids,
            "pieces": pieces,  # None: ids only (``tokenizer`` says why)
            "tokenizer": said,
            "text": texts[sample] if sample < len(texts) else "",
            "series": {n: series[n] for n in labels if n in series},
            "labels": labels,
        }

    def tokenizer_identity(self) -> Any:
        """The tokenizer the run recorded (the config of its last step, else the
        manifest's), read again when the log has a new version."""
        store = self.store()
        version = store.catalog.version
        hit = self._identity
        if hit is None or version is None or hit[0] != version:
            config = describe_run(store)["run_config"]["config"] or store.config or {}
            hit = self._identity = (version, config.get("tokenizer"))
        return hit[1]

    # ------------------------------------------------------------------ compare
    def compare(self, example_id: str | None, prompt: str | None, kind: str) -> list[dict]:
        """Every group of ``kind`` with this example id (exact), or this prompt text when the
        run records no example ids: step, rank, group index, mean reward; by step. A SQL
        query over the ``groups`` view reads only the columns it names."""
        store = self.store()
        schema = store.schema()
        if example_id is not None and "example_id" in schema.names:
            where, value = "example_id = ?", example_id
        elif prompt is not None:
            where, value = "prompt = ?", prompt
        else:
            return []
        with store.sql_views() as views:
            table = views.query(
                "SELECT step, rank, kind, group_index, total_utils FROM groups "
                f"WHERE kind = ? AND {where} ORDER BY step, rank, group_index",
                [kind, value],
            )
        out = []
        for r in table.to_pylist():
            out.append({**{k: r[k] for k in R.ROW_KEY}, "mean_reward": nan_mean(r["total_utils"])})
        return out


def dumps(value: Any) -> str:
    """JSON for a page's data attribute: non-finite floats as null."""
    return json.dumps(finite(value), default=str)
