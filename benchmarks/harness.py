"""The shared harness of the ``bench_*.py`` scripts: timing, one result record, one JSON output.

Every benchmark figure is a :class:`Row`: **ours** beside the **naive baseline** (what trainers
do today), the **best peer** (what a user who knows the field would pick instead) and the
**floor** (a physical limit: a memcpy into reused buffers, the write + fsync of the same bytes,
the decode of only the columns needed), with the ratios from the same run and the targets,
met or missed. A script prints its rows as a table and writes them as JSON; ``make bench``
(``benchmarks/run_all.py``) runs every script and ``benchmarks/readme_table.py`` renders the
README's table from that JSON, so no figure is copied by hand.

A script in five steps::

    import harness
    from harness import Figure, faster_than, within

    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)              # --quick, --repeats N, --json PATH
    args = parser.parse_args(argv)
    bench = harness.Bench("ingest", args)      # JSON to --json or $MAXENT_ARROW_BENCH_OUT

    t = harness.measure({"ours": ours, "peer": peer, "floor": floor}, repeats=bench.repeats(15))
    bench.row(
        "ScoreBatch, 512 x 16, reused buffers",
        ours=Figure(t["ours"], "build_score_batch(workspace=ws)"),
        peer=Figure(t["peer"], "batched tokenisation once per prompt + pad_sequence"),
        floor=Figure(t["floor"], "memcpy of the output into reused buffers"),
        targets=[faster_than("peer", 3), within("floor", 2)],
        reason="why a miss is a miss, when it is known",   # kept in the README with the miss
    )
    return bench.finish()                      # prints the table, writes JSON, exit status

Conventions (the README says them too):

- every figure is a cost, lower is better: seconds (``unit="s"``, the default) or bytes
  (``unit="B"``); a throughput is given as the time of one pass and its rate put in the label;
- ``measure`` runs the functions round-robin (noise on a shared machine hits all alike) after
  one warm-up each and keeps every sample; a :class:`Timing` gives the **median** (the figure
  used) and the minimum;
- ratios: ``vs baseline`` and ``vs peer`` are speed-ups (their time / ours: above 1 means we
  are faster), ``vs floor`` is an overhead (ours / the floor: 1 is the best possible);
- targets: ``faster_than("peer", 3)`` is "peer / ours >= 3", ``within("floor", 2)`` is
  "ours / floor <= 2", ``within("peer", 1.1)`` is "at most 1.1x the peer's time", and
  ``custom(label, value, "<=", bound)`` any other check (e.g. "flat in N");
- a row without targets is context (printed, in the JSON, never a miss); ``detail=True`` keeps
  a row (e.g. the smaller sizes of a sweep) out of the README's table unless it misses;
- ``--quick`` is a smoke run: small sizes, targets evaluated and printed but not gated (exit
  status 0); a full run exits 1 when any target is missed. ``Bench.finish`` returns the status.

The JSON (``SCHEMA``): ``{"schema", "bench", "script", "quick", "started", "wall_s", "machine",
"load_before", "load_after", "ok", "rows": [Row.as_dict(), ...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA",
    "ENV_OUT",
    "Timing",
    "Figure",
    "Target",
    "Row",
    "Bench",
    "add_arguments",
    "measure",
    "faster_than",
    "within",
    "custom",
    "machine",
    "fmt_value",
    "fmt_ratio",
]

SCHEMA = "maxent-arrow-bench/1"
ENV_OUT = "MAXENT_ARROW_BENCH_OUT"
REFS = ("baseline", "peer", "floor")


# ---------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Timing:
    """The samples of one measured function (seconds, or whatever ``clock`` counts)."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def repeats(self) -> int:
        return len(self.samples)

    def scaled(self, factor: float) -> Timing:
        """Every sample times ``factor`` (e.g. per item, or extrapolated from a subset)."""
        return Timing(tuple(s * factor for s in self.samples))


def measure(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """Time each function ``repeats`` times, round-robin, after ``warmup`` runs of each.

    Round-robin: on a shared machine a burst of load hits every function alike, so ratios of
    the same run stay fair. ``clock`` may be ``time.thread_time`` (CPU time of the calling
    thread: waiting for a busy core is not counted). ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs before each stop of the clock.
    """
    if repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            if sync is not None:
                sync()
            samples[name].append(clock() - start)
    return {name: Timing(tuple(s)) for name, s in samples.items()}


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Figure:
    """One measured figure: a :class:`Timing` (its median is used) or a plain number."""

    value: float | Timing
    label: str = ""

    @property
    def number(self) -> float:
        return self.value.median if isinstance(self.value, Timing) else float(self.value)

    @property
    def repeats(self) -> int | None:
        return self.value.repeats if isinstance(self.value, Timing) else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.number, "label": self.label}
        if isinstance(self.value, Timing):
            out |= {"min": self.value.min, "repeats": self.value.repeats}
        return out


@dataclass(frozen=True)
class Target:
    """A check on one ratio of a row (see :func:`faster_than`, :func:`within`, :func:`custom`)."""

    ref: str  # "baseline" | "peer" | "floor" | "custom"
    op: str  # ">=" | "<="
    bound: float
    label: str
    value: float | None = None  # custom targets carry their measured value

    def measured(self, row: Row) -> float | None:
        """The checked number: the custom value, ``ref / ours`` for :func:`faster_than`, and
        ``ours / ref`` for :func:`within`."""
        if self.ref == "custom":
            return self.value
        other = getattr(row, self.ref)
        if other is None:
            return None
        ours, theirs = row.ours.number, other.number
        if self.op == ">=":
            return theirs / ours if ours > 0 else math.inf
        return ours / theirs if theirs > 0 else math.inf

    def met(self, row: Row) -> bool:
        value = self.measured(row)
        if value is None or not math.isfinite(value):
            return False
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def as_dict(self, row: Row) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "op": self.op,
            "bound": self.bound,
            "label": self.label,
            "value": self.measured(row),
            "met": self.met(row),
        }


def faster_than(ref: str, times: float) -> Target:
    """``ref`` / ours >= ``times``: ours at least ``times``x faster than the baseline or peer."""
    _check_ref(ref)
    return Target(ref, ">=", float(times), f">= {times:g}x {ref}")


def within(ref: str, times: float) -> Target:
    """ours / ``ref`` <= ``times``: at most ``times``x the floor's (or the peer's) cost."""
    _check_ref(ref)
    return Target(ref, "<=", float(times), f"<= {times:g}x {ref}")


def custom(label: str, value: float, op: str, bound: float) -> Target:
    """Any other check, e.g. ``custom("ours at 10^7 / at 10^3", 1.2, "<=", 3)``."""
    if op not in (">=", "<="):
        raise ValueError(f"custom target: op must be '>=' or '<=', got {op!r}")
    return Target("custom", op, float(bound), f"{label} {op} {bound:g}", float(value))


def _check_ref(ref: str) -> None:
    if ref not in REFS:
        raise ValueError(f"target: ref must be one of {REFS}, got {ref!r}")


@dataclass
class Row:
    """One benchmark figure with its baseline, peer, floor, ratios and targets."""

    bench: str
    name: str
    ours: Figure
    baseline: Figure | None = None
    peer: Figure | None = None
    floor: Figure | None = None
    targets: list[Target] = field(default_factory=list)
    unit: str = "s"
    reason: str = ""  # why a target is missed (kept beside the miss)
    note: str = ""  # anything else a reader needs (what the figure includes)
    detail: bool = False  # in the JSON and the script's table, not in the README's table

    def ratio(self, ref: str) -> float | None:
        """Speed-up vs baseline / peer (theirs / ours), overhead vs floor (ours / floor)."""
        other = getattr(self, ref)
        if other is None:
            return None
        ours, theirs = self.ours.number, other.number
        if ref == "floor":
            return ours / theirs if theirs > 0 else math.inf
        return theirs / ours if ours > 0 else math.inf

    @property
    def met(self) -> bool | None:
        """True when every target is met, False when one is missed, None without targets."""
        if not self.targets:
            return None
        return all(t.met(self) for t in self.targets)

    def missed(self) -> list[Target]:
        return [t for t in self.targets if not t.met(self)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "name": self.name,
            "unit": self.unit,
            "ours": self.ours.as_dict(),
            **{ref: (getattr(self, ref).as_dict() if getattr(self, ref) else None) for ref in REFS},
            "ratios": {ref: self.ratio(ref) for ref in REFS},
            "targets": [t.as_dict(self) for t in self.targets],
            "met": self.met,
            "reason": self.reason,
            "note": self.note,
            "detail": self.detail,
        }


# ---------------------------------------------------------------------------- formatting
def fmt_value(value: float | None, unit: str = "s") -> str:
    """A figure for people: 2.0 us, 3.41 ms, 1.20 s; 40.1 MB."""
    if value is None:
        return "—"
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {name}"
        return f"{value:.0f} B"
    if unit != "s":
        return f"{value:.3g} {unit}"
    if value < 1e-3:
        return f"{value * 1e6:.1f} µs"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return "inf"
    if value >= 100:
        return f"{value:,.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    return f"{value:.2f}x"


# ---------------------------------------------------------------------------- the machine
def machine() -> dict[str, Any]:
    """What the figures were measured on (the README prints it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")  # never imported here: a torch-free bench stays torch-free
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    pyarrow = sys.modules.get("pyarrow")
    if pyarrow is not None:
        info["pyarrow"] = pyarrow.__version__
    return info


def load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------------------- one script
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every bench script takes: ``--quick``, ``--repeats``, ``--json``."""
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, a smoke run (targets not gated)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (median)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=os.environ.get(ENV_OUT) or None,
        help=f"write the rows as JSON here (default: ${ENV_OUT} when set)",
    )


class Bench:
    """The rows of one script: collects them, prints them, writes the JSON, gives the status."""

    def __init__(self, name: str, args: argparse.Namespace | None = None, **options: Any):
        opts = vars(args).copy() if args is not None else {}
        opts |= options
        self.name = name
        self.quick = bool(opts.get("quick", False))
        self.repeats_override: int | None = opts.get("repeats")
        json_path = opts.get("json", os.environ.get(ENV_OUT))
        self.json_path = Path(json_path) if json_path else None
        self.rows: list[Row] = []
        self.script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else name
        self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self._t0 = time.perf_counter()
        self.load_before = load()

    def repeats(self, full: int, quick: int = 3) -> int:
        """Runs per figure: ``--repeats`` if given, else ``quick`` or ``full``."""
        if self.repeats_override:
            return self.repeats_override
        return quick if self.quick else full

    def row(self, name: str, *, ours: Figure | float | Timing, **fields: Any) -> Row:
        """Add a row (see :class:`Row`); bare numbers and Timings become unlabeled Figures."""
        for key in ("baseline", "peer", "floor"):
            if key in fields and fields[key] is not None and not isinstance(fields[key], Figure):
                fields[key] = Figure(fields[key])
        if not isinstance(ours, Figure):
            ours = Figure(ours)
        row = Row(self.name, name, ours, **fields)
        self.rows.append(row)
        return row

    @property
    def ok(self) -> bool:
        return all(row.met is not False for row in self.rows)

    def table(self) -> str:
        """The rows as a plain-text table (ratios: speed-up vs baseline/peer, ours/floor)."""
        lines = []
        for row in self.rows:
            verdict = {True: "MET", False: "MISSED", None: "(context)"}[row.met]
            lines.append(f"* {row.name}: {verdict}")
            lines.append(
                f"    {'ours':<9}{fmt_value(row.ours.number, row.unit):>12}  {row.ours.label}"
            )
            for ref in REFS:
                fig = getattr(row, ref)
                if fig is None:
                    continue
                word = "overhead" if ref == "floor" else "speed-up"
                lines.append(
                    f"    {ref:<9}{fmt_value(fig.number, row.unit):>12}  {fig.label}  "
                    f"[{word} {fmt_ratio(row.ratio(ref))}]"
                )
            for target in row.targets:
                value = target.measured(row)
                shown = fmt_ratio(value) if target.ref != "custom" else f"{value:.3g}"
                lines.append(
                    f"    target {target.label}: {shown} {'met' if target.met(row) else 'MISSED'}"
                )
            if row.met is False and row.reason:
                lines.append(f"    why: {row.reason}")
            if row.note:
                lines.append(f"    note: {row.note}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "bench": self.name,
            "script": self.script,
            "quick": self.quick,
            "started": self.started,
            "wall_s": round(time.perf_counter() - self._t0, 2),
            "machine": machine(),
            "load_before": self.load_before,
            "load_after": load(),
            "ok": self.ok,
            "rows": [row.as_dict() for row in self.rows],
        }

    def write_json(self, path: Path | None = None) -> Path | None:
        path = path or self.json_path
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1, allow_nan=True) + "\n")
        tmp.replace(path)
        return path

    def finish(self) -> int:
        """Print the table and a verdict, write the JSON; the exit status (1 on a miss,
        unless ``--quick``)."""
        print(f"\n== {self.name}: results (median of each figure's runs) ==")
        print(self.table())
        missed = [row for row in self.rows if row.met is False]
        written = self.write_json()
        if written is not None:
            print(f"rows written to {written}")
        if not missed:
            print("all targets met")
            return 0
        names = "; ".join(row.name for row in missed)
        if self.quick:
            print(f"some target missed ({names}); --quick: not gated")
            return 0
        print(f"some target missed: {names}")
        return 1


def load_results(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The JSON documents of several scripts (a file per script, or ``run_all``'s combined)."""
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        out.extend(doc["runs"] if "runs" in doc else [doc])
    return out
