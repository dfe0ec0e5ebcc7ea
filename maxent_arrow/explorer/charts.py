"""The overview's charts as inline SVG: one chart per metric, drawn on the server.

What a reader needs to read a chart without asking:

- **axes whose labels fit**: the left margin is sized from the longest tick label, so a
  negative value keeps its minus sign (``-0.0665``, never a clipped ``0.0665``);
- **a sensible range**: "nice" ticks (1, 2, 2.5 or 5 times a power of ten), and a span of at
  least a tenth of the values' size, so a series that is constant but for rounding (a length
  of 2.99-3.01) is drawn flat, not as full-height spikes;
- **legends with keys**: each series' name beside a swatch of its colour and dash;
- a note under the chart when its series need one (a trainer's several updates per step).

Every point links to its step's page (``analytics.links``).
"""

from __future__ import annotations

import math
from html import escape

from maxent_arrow.analytics.links import step_path
from maxent_arrow.explorer.data import Chart

__all__ = ["PALETTE", "axis_range", "chart_svg", "tick_text"]

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#a16207")
_WIDTH, _HEIGHT = 560, 240
_CHAR_PX = 7.0  # an 11 px tick or legend glyph, at most (the labels are digits and words)
_MIN_SPAN = 0.1  # of the values' magnitude: the least span a y axis shows


def _nice(step: float) -> float:
    """The smallest of 1, 2, 2.5 and 5 times a power of ten that is at least ``step``."""
    power = 10.0 ** math.floor(math.log10(step))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * power >= step * (1 - 1e-9):
            return m * power
    return 10.0 * power


def axis_range(lo: float, hi: float, *, ticks: int = 4) -> tuple[float, float, list[float]]:
    """A y axis for values in ``[lo, hi]``: its bounds and tick values. The span is at
    least :data:`_MIN_SPAN` of the values' magnitude (1 for values of 0), centred on them,
    and never crosses 0 for values that do not."""
    size = max(abs(lo), abs(hi))
    least = _MIN_SPAN * size if size > 0 else 1.0
    if hi - lo < least:
        middle = (lo + hi) / 2
        wider = (middle - least / 2, middle + least / 2)
        if lo >= 0 > wider[0]:  # values that are never negative: the axis starts at 0
            wider = (0.0, max(hi, least))
        lo, hi = wider
    step = _nice((hi - lo) / ticks)
    first, last = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    values = [first + i * step for i in range(int(round((last - first) / step)) + 1)]
    return first, last, [0.0 if abs(v) < step * 1e-9 else v for v in values]


def tick_text(value: float, step: float) -> str:
    """A tick label: as many decimals as the tick step has (``0.25`` at a step of 0.25,
    ``-0.066`` at 0.002), large or tiny values in ``g`` notation."""
    if value == 0:
        return "0"
    if step < 1e-3 or abs(value) >= 1e5:
        return f"{value:.3g}"
    decimals = next(d for d in range(12) if abs(round(step, d) - step) <= step * 1e-9)
    return f"{value:.{decimals}f}"


def _x_ticks(x0: float, x1: float) -> list[float]:
    if x1 - x0 < 1:
        return [x0]
    step = max(1.0, _nice((x1 - x0) / 5))
    first = math.ceil(x0 / step) * step
    return [first + i * step for i in range(int((x1 - first) / step + 1e-9) + 1)]


def _legend(chart: Chart, width: float) -> tuple[list[str], float]:
    """The legend's keys (a swatch and a name each, in rows that fit ``width``) and the
    height they take."""
    parts, x, y = [], 8.0, 14.0
    for i, series in enumerate(chart.series):
        colour = PALETTE[i % len(PALETTE)]
        size = 30 + _CHAR_PX * len(series.name)
        if x > 8 and x + size > width:
            x, y = 8.0, y + 16
        dash = " stroke-dasharray='5 3'" if series.dashed else ""
        parts.append(
            f'<g class=key data-series="{escape(series.name)}" data-colour="{colour}">'
            f"<line class=swatch x1={x:.0f} y1={y - 4:.0f} x2={x + 22:.0f} y2={y - 4:.0f} "
            f'stroke="{colour}" stroke-width=3{dash} />'
            f"<text class=legend x={x + 27:.0f} y={y:.0f}>{escape(series.name)}</text></g>"
        )
        x += size + 12
    return parts, y + 10


def chart_svg(chart: Chart) -> str:
    """One chart (:class:`~maxent_arrow.explorer.data.Chart`) as a ``figure``."""
    xs = [x for s in chart.series for x, _, _ in s.points]
    ys = [v for s in chart.series for _, v, _ in s.points]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1, yticks = axis_range(min(ys), max(ys))
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0
    labels = [tick_text(v, ystep) for v in yticks]
    keys, top = _legend(chart, _WIDTH)
    left = 14 + _CHAR_PX * max(len(t) for t in labels)
    right, bottom = 16, 34
    height = _HEIGHT + top

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (_WIDTH - left - right)

    def py(v: float) -> float:
        return top + (height - bottom - top) * (1 - (v - y0) / (y1 - y0))

    parts = [
        f'<figure class=curve data-curve="{escape(chart.title)}">'
        f"<figcaption>{escape(chart.title)}</figcaption>"
        f'<svg viewBox="0 0 {_WIDTH} {height}" width={_WIDTH} height={height} role=img '
        f'aria-label="{escape(chart.title)} per step">',
        *keys,
    ]
    for value, text in zip(yticks, labels):
        y = py(value)
        parts.append(
            f"<line class=grid x1={left:.1f} y1={y:.1f} x2={_WIDTH - right} y2={y:.1f} />"
            f"<text class='tick ytick' x={left - 6:.1f} y={y + 4:.1f} text-anchor=end>"
            f"{escape(text)}</text>"
        )
    base = height - bottom
    parts.append(f"<line class=axis x1={left:.1f} y1={base} x2={_WIDTH - right} y2={base} />")
    parts.append(f"<line class=axis x1={left:.1f} y1={top} x2={left:.1f} y2={base} />")
    for x in _x_ticks(x0, x1):
        parts.append(
            f"<text class='tick xtick' x={px(x):.1f} y={base + 16} text-anchor=middle>{x:g}</text>"
        )
    parts.append(
        f"<text class=tick x={(left + _WIDTH - right) / 2:.0f} y={height - 4} "
        "text-anchor=middle>step</text>"
    )
    for i, series in enumerate(chart.series):
        colour = PALETTE[i % len(PALETTE)]
        dash = " stroke-dasharray='5 3'" if series.dashed else ""
        line = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v, _ in series.points)
        parts.append(
            f'<polyline class=line data-series="{escape(series.name)}" fill=none '
            f'stroke="{colour}" stroke-width=1.6{dash} points="{line}" />'
        )
        radius = 4 if len(series.points) <= 40 else 2.5  # (a long run: the line, not dots)
        for x, v, step in series.points:
            parts.append(
                f'<a class=point href="{escape(step_path(step, series.kind))}" data-step={step} '
                f'data-kind="{escape(series.kind)}"><circle cx={px(x):.1f} cy={py(v):.1f} '
                f'r={radius} fill="{colour}"><title>{escape(series.name)}, step {step}: '
                f"{v:.6g}</title></circle></a>"
            )
    parts.append("</svg>")
    if chart.note:
        parts.append(f"<p class=chart-note>{escape(chart.note)}</p>")
    parts.append("</figure>")
    return "".join(parts)
