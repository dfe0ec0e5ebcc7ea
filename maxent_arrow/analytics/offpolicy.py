"""How off-policy a stored run is, per step: ``maxent-arrow offpolicy RUN`` and the report's
"Off-policy" section.

For each step (of one kind), from the stored columns alone:

- **staleness**: a histogram of ``trained_at - completion_policy_version`` over the step's
  completions, ``trained_at`` the step a ``lifecycle`` record of the trainer says the group
  was trained at, else the group's own step (a group the lifecycle only dropped is left out:
  it never trained); without per-completion versions, the step row's ``policy_version``.
  Another role's records (a replay sampler training a second policy from the store) are
  that role's consumption, not the trainer's: read only when asked for (``role=``,
  :func:`~maxent_arrow.analytics.attempts.role_lifecycle`);
- **diagnostics** of the trainer's log-probs π (``behavior_token_logp``: TRL's
  ``old_per_token_logps``, verl's ``old_log_probs``) against the sampler's μ
  (``sampling_token_logp``: vLLM's, verl's ``rollout_log_probs``): verl's KL, k3, χ² per token
  and per sequence, perplexity ratio (:func:`~maxent_arrow.compute.offpolicy_metrics`) and the
  effective sample size of the token IS weights
  (:func:`~maxent_arrow.compute.rollout_is_weights`);
- **corrections**: the share of tokens (token modes) or sequences (sequence modes) each mode
  would clip or mask: TRL's four ``vllm_importance_sampling_mode``\\ s at the run's cap (TRL's
  default 3.0 when it recorded none), verl's truncated IS at token and sequence level (2.0),
  IcePop at token level (``0.5_2.0``) and the ``seq_mean_k1`` rejection (``0.5_2.0``);
- **kept mass** ``E[log S]`` where kept sets were stored with ``raw`` top-k log-probs that
  cover them (:func:`~maxent_arrow.compute.kept_mass_audit`; the share of kept ids the top-k
  covered is reported beside it).

The staleness needs numpy only. The diagnostics, corrections and kept mass reuse
:mod:`maxent_arrow.compute.offpolicy` and so import torch, and only when the run holds
the columns they need: a run without sampler log-probs or kept sets is reported without
loading torch (the report of such a run stays torch-free).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# `compute` is a lazy package: torch loads at the first function called from it, so the CLI's
# argument parsing and the analytics that need no torch run without it.
from maxent_arrow import compute
from maxent_arrow.analytics.attempts import TRAINER, role_lifecycle
from maxent_arrow.analytics.jsonsafe import finite
from maxent_arrow.arguments import int_set
from maxent_arrow.arrow import (
    find_in_sets,
    float_values,
    int64_array,
    int64_scalar,
    list_offsets,
    single_array,
    text_scalar,
    token_sets,
)
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError
from maxent_arrow.store import ReadOnlyStore

__all__ = [
    "CORRECTION_MODES",
    "TRL_DEFAULT_CAP",
    "offpolicy_markdown",
    "offpolicy_html",
    "offpolicy_steps",
    "offpolicy_text",
]

TRL_DEFAULT_CAP = 3.0  # GRPOConfig.vllm_importance_sampling_clip_max (formerly ..._cap)
# verl's defaults for the modes it names, and the unit each mode acts on.
CORRECTION_MODES: dict[str, str] = {
    "trl/token_truncate": "tokens",
    "trl/token_mask": "tokens",
    "trl/sequence_truncate": "sequences",
    "trl/sequence_mask": "sequences",
    "verl/is_token_tis(2.0)": "tokens",
    "verl/is_sequence_tis(2.0)": "sequences",
    "verl/is_token_icepop(0.5_2.0)": "tokens",
    "verl/rs_seq_mean_k1(0.5_2.0)": "sequences",
}
_DIAGNOSTICS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "ppl_ratio", "log_ppl_diff")


def _present(store: ReadOnlyStore) -> set[str]:
    return set(store.schema("groups").names)


def offpolicy_steps(
    root: Any,
    *,
    kind: str = "train",
    steps: Iterable[int] | None = None,
    role: str | None = TRAINER,
) -> list[dict[str, Any]]:
    """One report per step of ``kind`` (see the module): ``{"step", "completions", "tokens",
    "staleness": {k: count} | None, "diagnostics": {...} | None, "ess": float | None,
    "corrections": {mode: {"unit", "fraction", "threshold"}} | None, "kept_mass": {...} |
    None, "notes": [...]}``. ``root``: a store path or URI, or an open store. ``role``: whose
    ``lifecycle`` records say when a group was trained (the trainer's by default; ``None``
    every role's; a role the store has none of is an
    :class:`~maxent_arrow.errors.ArgumentError` naming its roles).

    A ``kind`` the store has no steps of (a store with steps), or ``steps`` it has none of,
    is an :class:`~maxent_arrow.errors.ArgumentError` naming the kinds or the steps there
    are; a store without steps gives none."""
    store = root if isinstance(root, ReadOnlyStore) else ReadOnlyStore(root)
    chosen = None if steps is None else int_set(steps, what="offpolicy: steps")
    present = _present(store)
    # Bulk columns only where they serve: the trainer's log-probs with the sampler's, top-k
    # log-probs with kept sets (a MaxEnt run's behaviour log-probs alone are not read).
    skip = set()
    if "sampling_token_logp" not in present:
        skip |= {"behavior_token_logp", "tool_mask"}
    if "kept_token_ids" not in present:
        skip |= {"topk_token_ids", "topk_token_logp"}
    wanted = [n for n in R.OFFPOLICY_READS if n in present and n not in skip]
    step_rows = store.read_steps(kind=kind)
    all_steps = sorted(set(step_rows.column("step").to_pylist()))
    if not all_steps:
        kinds = sorted({u.kind for u in store.units()})
        if kinds:
            raise ArgumentError(
                f"offpolicy: kind {kind!r}: the store has no steps of it (its kinds: "
                f"{', '.join(kinds)})"
            )
    if chosen is not None:
        missing = sorted(chosen - set(all_steps))
        if missing:
            have = f"{all_steps[0]}..{all_steps[-1]}" if all_steps else "none"
            raise ArgumentError(
                f"offpolicy: steps {missing}: the store has no {kind} steps of them (its "
                f"{len(all_steps)} {kind} steps: {have})"
            )
        all_steps = [s for s in all_steps if s in chosen]
    trained = _trained_at(store, kind, role)
    # One version per (step, rank): the step row's (the larger, were a step row there twice:
    # :func:`_lookup` takes the largest).
    versions_by_rank = _int64_keys(step_rows, ["step", "rank", "policy_version"])
    cap = _trl_cap(step_rows)
    out = []
    for step in all_steps:
        table = store.read(steps=step, kind=kind, columns=wanted)
        out.append(_step_report(step, table, trained, versions_by_rank, cap))
    return out


def _int64_keys(table: pa.Table, names: list[str]) -> pa.Table:
    """``table``'s columns ``names`` as int64 (join keys of one type on both sides)."""
    return pa.table({n: table.column(n).cast(pa.int64()) for n in names})


def _trained_at(store: ReadOnlyStore, kind: str, role: str | None) -> pa.Table | None:
    """Per ``lifecycle`` record of ``role`` of a group (``step, rank, group_index``): ``at``,
    the trainer step it says the group was trained at; -1 for a drop (a group only ever
    dropped was never trained: not counted). :func:`_lookup` takes each group's last
    (largest)."""
    records = role_lifecycle(store, role)
    if records is None or not records.num_rows:
        return None
    # Scalars built from buffers: a Python value given to a compute function imports pandas.
    records = records.filter(pc.equal(records.column("rollout_kind"), text_scalar(kind)))
    trained = pc.equal(records.column("event"), text_scalar("trained"))
    at = pc.if_else(trained, records.column("step").cast(pa.int64()), int64_scalar(-1))
    keys = _int64_keys(records, ["rollout_step", "rollout_rank", "group_index"])
    return keys.append_column("at", at).rename_columns(["step", "rank", "group_index", "at"])


def _trl_cap(step_rows: pa.Table) -> float:
    """The TRL cap a run recorded (``extra.trl.vllm_importance_sampling_cap``), else TRL's
    default."""
    for text in step_rows.column("config").to_pylist():
        if not text:
            continue
        trl = (json.loads(text).get("extra") or {}).get("trl") or {}
        for key in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"):
            if trl.get(key) is not None:
                return float(trl[key])
    return TRL_DEFAULT_CAP


def _column(table: pa.Table, name: str) -> pa.Array | None:
    if name not in table.column_names:
        return None
    column = single_array(table.column(name))
    return None if column.null_count == len(column) else column


def _step_report(step, table, trained, versions_by_rank, cap) -> dict[str, Any]:
    counts = float_values(table.column("num_completions")).astype(np.int64)
    report: dict[str, Any] = {
        "step": int(step),
        "groups": table.num_rows,
        "completions": int(counts.sum()),
        "tokens": None,
        "staleness": _staleness(table, counts, trained, versions_by_rank),
        "diagnostics": None,
        "ess": None,
        "corrections": None,
        "kept_mass": None,
        "notes": [],
    }
    _log_prob_parts(table, report, cap)
    _kept_mass(table, report)
    return finite(report)


def _lookup(rows: pa.Table, table: pa.Table | None, keys: list[str], value: str) -> np.ndarray:
    """At each row of ``rows``: the largest ``value`` (nulls aside) of the rows of ``table``
    that match it on ``keys`` (int64 columns), as float64; NaN where none does. A group-by
    and a left join done in numpy: pyarrow's (Acero) import pandas."""
    if table is None or not table.num_rows:
        return np.full(rows.num_rows, np.nan)
    n = rows.num_rows
    # One code per distinct key, shared by both sides (kept dense: no overflow).
    code = np.zeros(n + table.num_rows, dtype=np.int64)
    for key in keys:
        both = np.concatenate([float_values(rows.column(key)), float_values(table.column(key))])
        _, inverse = np.unique(both, return_inverse=True)
        code = np.unique(code * (int(inverse.max()) + 1) + inverse, return_inverse=True)[1]
    largest = np.full(int(code.max()) + 1, np.nan)
    np.fmax.at(largest, code[n:], float_values(table.column(value)))
    return largest[code[:n]]


def _staleness(table, counts, trained, versions_by_rank) -> dict[int, int] | None:
    rows = _int64_keys(table, ["step", "rank", "group_index"])
    steps = float_values(rows.column("step"))
    at = _lookup(rows, trained, ["step", "rank", "group_index"], "at")
    at = np.where(np.isnan(at), steps, at).astype(np.int64)  # no record: trained at its step
    row_version = _lookup(rows.select(["step", "rank"]), versions_by_rank, ["step", "rank"],
                          "policy_version")  # fmt: skip
    n = int(counts.sum())
    per = np.full(n, -1, dtype=np.int64)
    known = np.zeros(n, dtype=bool)
    versions = _column(table, "completion_policy_version")
    if versions is not None:
        known = np.repeat(float_values(versions.is_valid()).astype(bool), counts)
        per[known] = float_values(versions.flatten()).astype(np.int64)
    fallback = np.repeat(row_version, counts)
    use = ~known & ~np.isnan(fallback)
    per[use] = fallback[use].astype(np.int64)
    known |= use
    known &= np.repeat(at >= 0, counts)  # a group only dropped was never trained
    if not known.any():
        return None
    stale = np.repeat(at, counts)[known] - per[known]
    values, number = np.unique(stale, return_counts=True)
    return {int(v): int(c) for v, c in zip(values, number)}


def _token_rows(column: pa.Array, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat per-token values and per-completion offsets of group ``rows`` of a token column."""
    taken = column.take(int64_array(np.flatnonzero(rows)))
    per_completion = taken.flatten()
    return float_values(per_completion.flatten()), list_offsets(per_completion)


def _log_prob_parts(table: pa.Table, report: dict[str, Any], cap: float) -> None:
    pi_col, mu_col = _column(table, "behavior_token_logp"), _column(table, "sampling_token_logp")
    if pi_col is None or mu_col is None:
        return
    rows = float_values(pc.and_(pi_col.is_valid(), mu_col.is_valid())).astype(bool)
    if not rows.any():
        return
    pi, pi_off = _token_rows(pi_col, rows)
    mu, mu_off = _token_rows(mu_col, rows)
    if not np.array_equal(pi_off, mu_off):
        report["notes"].append("the trainer's and the sampler's log-probs cover other tokens")
        return
    mask = None
    tools = _column(table, "tool_mask")
    if tools is not None and bool(float_values(tools.is_valid()).astype(bool)[rows].all()):
        flags, _ = _token_rows(tools, rows)
        mask = flags != 0
    import torch

    cur = torch.from_numpy(pi.astype(np.float64))
    beh = torch.from_numpy(mu.astype(np.float64))
    offsets = torch.from_numpy(pi_off)
    m = None if mask is None else torch.from_numpy(mask)
    counted = int(m.sum()) if m is not None else len(cur)
    report["tokens"] = counted
    if counted == 0:
        report["notes"].append("no counted token")
        return
    metrics = compute.offpolicy_metrics(cur, beh, offsets=offsets, mask=m)
    report["diagnostics"] = {k: metrics[k] for k in _DIAGNOSTICS}
    tis = compute.rollout_is_weights(
        cur, beh, offsets=offsets, mask=m, level="token", threshold=2.0
    )
    report["ess"] = tis.metrics["rollout_is_eff_sample_size"]
    corrections: dict[str, dict[str, Any]] = {}
    counted_mask = m if m is not None else torch.ones(len(cur), dtype=torch.bool)
    lengths = offsets.diff()
    has_tokens = (
        torch.segment_reduce(counted_mask.to(torch.float64), "sum", offsets=offsets) > 0
        if len(lengths) else torch.zeros(0, dtype=torch.bool)
    )  # fmt: skip
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        whole = "token_mask" if mode.startswith("token") else "sequence_mask"
        raw = compute.trl_importance_ratio(cur, beh, offsets=offsets, mask=m, mode=whole,
                                   clip_max=None)  # fmt: skip
        fixed = compute.trl_importance_ratio(cur, beh, offsets=offsets, mask=m, mode=mode,  # type: ignore[arg-type]
                                     clip_max=cap)  # fmt: skip
        changed = fixed != raw
        if mode.startswith("token"):
            share = float(changed[counted_mask].double().mean())
        else:
            share = float(changed[has_tokens].double().mean()) if has_tokens.any() else 0.0
        corrections[f"trl/{mode}"] = {"unit": CORRECTION_MODES[f"trl/{mode}"], "fraction": share,
                                      "threshold": cap}  # fmt: skip
    levels: tuple[tuple[Literal["token", "sequence"], str], ...] = (
        ("token", "verl/is_token_tis(2.0)"),
        ("sequence", "verl/is_sequence_tis(2.0)"),
    )
    for level, name in levels:
        w = compute.rollout_is_weights(
            cur, beh, offsets=offsets, mask=m, level=level, threshold=2.0
        )
        key = "rollout_is_ratio_fraction_high"
        corrections[name] = {"unit": CORRECTION_MODES[name], "fraction": w.metrics[key],
                             "threshold": 2.0}  # fmt: skip
    ice = compute.rollout_is_weights(
        cur, beh, offsets=offsets, mask=m, level="token", threshold="0.5_2.0"
    )
    corrections["verl/is_token_icepop(0.5_2.0)"] = {
        "unit": "tokens", "fraction": ice.metrics["rollout_is_oob_ratio"], "threshold": "0.5_2.0"
    }  # fmt: skip
    rs = compute.rollout_rejection_mask(cur, beh, offsets=offsets, mask=m, modes="seq_mean_k1",
                                thresholds="0.5_2.0")  # fmt: skip
    corrections["verl/rs_seq_mean_k1(0.5_2.0)"] = {
        "unit": "sequences", "fraction": rs.metrics["rollout_rs_seq_masked_fraction"],
        "threshold": "0.5_2.0",
    }  # fmt: skip
    report["corrections"] = corrections


def _kept_mass(table: pa.Table, report: dict[str, Any]) -> None:
    kept = _column(table, "kept_token_ids")
    if kept is None:
        return
    ids_col, logp_col = _column(table, "topk_token_ids"), _column(table, "topk_token_logp")
    semantics = _column(table, "behavior_logp_semantics")
    if ids_col is None or logp_col is None:
        report["notes"].append("kept sets without top-k log-probs: no kept mass")
        return
    if semantics is not None and "raw" not in set(semantics.flatten().to_pylist()):
        report["notes"].append("top-k log-probs are processed (renormalised): no kept mass")
        return
    rows = float_values(pc.and_(kept.is_valid(), ids_col.is_valid())).astype(bool)
    take = int64_array(np.flatnonzero(rows))
    kept_ids, kept_off = token_sets(kept.take(take))
    top = ids_col.take(take).flatten().flatten()
    top_ids = float_values(top.flatten()).astype(np.int64)
    top_off = list_offsets(top)
    top_logp = float_values(logp_col.take(take).flatten().flatten().flatten())
    per_token = list_offsets(kept.take(take).flatten())
    n_tokens = len(kept_off) - 1
    # Each kept id's top-k entry of its token (no loop over tokens).
    kept_owner = np.repeat(np.arange(n_tokens, dtype=np.int64), np.diff(kept_off))
    at = find_in_sets(top_ids, top_off, kept_ids, kept_owner)
    found = at >= 0
    values = np.where(found, top_logp[np.maximum(at, 0)] if len(top_logp) else 0.0, -math.inf)
    import torch

    log_s = compute.kept_set_log_mass(
        torch.from_numpy(values), None, set_offsets=torch.from_numpy(kept_off)
    )
    covered_tokens = torch.from_numpy(
        np.add.reduceat(found.astype(np.int64), kept_off[:-1]) == np.diff(kept_off)
        if len(found) else np.zeros(n_tokens, dtype=bool)
    )  # fmt: skip
    if not bool(covered_tokens.any()):
        report["notes"].append("no kept set is covered by its top-k log-probs: no kept mass")
        return
    audit = compute.kept_mass_audit(log_s, offsets=torch.from_numpy(per_token), mask=covered_tokens)
    report["kept_mass"] = {
        "mean_log_s": audit.mean_log,
        "mean_s": audit.mean,
        "min_s": audit.min,
        "seq_mean_log_s": audit.seq_mean_log,
        "tokens": audit.tokens,
        "covered": float(found.mean()) if len(found) else 1.0,
    }


# ---------------------------------------------------------------------------- printing
def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _histogram(staleness: Mapping[int, int] | None) -> str:
    if not staleness:
        return "-"
    return " ".join(f"{k}:{v}" for k, v in sorted(staleness.items()))


def _rows(reports: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    modes = list(CORRECTION_MODES)
    head = ["step", "completions", "staleness (age:count)", "kl", "k3", "chi2 tok", "chi2 seq",
            "ESS", "ppl ratio", "E[log S]", *modes]  # fmt: skip
    body = []
    for r in reports:
        d = r["diagnostics"] or {}
        c = r["corrections"] or {}
        k = r["kept_mass"] or {}
        body.append([
            _fmt(r["step"]), _fmt(r["completions"]), _histogram(r["staleness"]),
            _fmt(d.get("kl")), _fmt(d.get("k3_kl")), _fmt(d.get("chi2_token")),
            _fmt(d.get("chi2_seq")), _fmt(r["ess"]), _fmt(d.get("ppl_ratio")),
            _fmt(k.get("mean_log_s")),
            *(f"{100 * c[m]['fraction']:.2f}% {c[m]['unit'][:3]}" if m in c else "-"
              for m in modes),
        ])  # fmt: skip
    return head, body


def offpolicy_text(reports: Sequence[Mapping[str, Any]]) -> str:
    """The per-step reports as a plain-text table (what the command prints)."""
    if not reports:
        return "no steps\n"
    head, body = _rows(reports)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in body]
    notes = sorted({n for r in reports for n in r["notes"]})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


_CAPTION = (
    "Per step: the age of each completion's policy when trained (steps), verl's diagnostics of "
    "the trainer's log-probs against the sampler's, the effective sample size of the token IS "
    "weights, the kept-mass bias E[log S] (0: no top-p/top-k bias), and the share of tokens or "
    "sequences each correction mode would clip or mask."
)


def offpolicy_html(reports: Sequence[Mapping[str, Any]]) -> str:
    """The report's "Off-policy" section (empty when no step has anything to show)."""
    if not _worth_showing(reports):
        return ""
    head, body = _rows(reports)
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    rows = "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row) + "</tr>" for row in body)
    return (
        f'<h2 id="offpolicy">Off-policy</h2><p>{escape(_CAPTION)}</p>'
        f'<table id="offpolicy-table"><thead><tr>{cells}</tr></thead><tbody>{rows}</tbody>'
        "</table>"
    )


def offpolicy_markdown(reports: Sequence[Mapping[str, Any]]) -> str:
    if not _worth_showing(reports):
        return ""
    head, body = _rows(reports)
    md = ["## Off-policy", "", _CAPTION, "", "| " + " | ".join(head) + " |",
          "|" + "---|" * len(head)]  # fmt: skip
    md += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(md) + "\n"


def _worth_showing(reports: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        r["diagnostics"] or r["kept_mass"] or (r["staleness"] and set(r["staleness"]) != {0})
        for r in reports
    )
