"""Server-side SVG plots for the pool's status page: lines over steps and stacked bars, no JavaScript library.

:func:`line_plot` draws one or more series (``<polyline>`` + one ``<circle class="pt">`` per point, each with a
``<title>`` tooltip), on a linear or log10 y axis; :func:`stacked_bars` draws one bar per step made of layers
(``<rect class="bar">``). Both return an ``<svg>`` element as a string, every text in it escaped, sized by a
``viewBox`` so the page can scale it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 460, 236
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 44, 34
"""Margins (pixels) around the plot area: tick labels left and below, the title and (under it) the legend above."""
EMPTY_TEXT = "no steps reported yet"


@dataclass(frozen=True)
class Series:
    """One named series of ``(x, y)`` points, drawn in ``color`` (a CSS colour)."""

    name: str
    points: list[tuple[float, float]]
    color: str


@dataclass(frozen=True)
class _Frame:
    """Maps data coordinates to pixels inside the plot area."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def x(self, v: float) -> float:
        span = self.x_hi - self.x_lo
        return LEFT + (v - self.x_lo) / span * (WIDTH - LEFT - RIGHT) if span else (LEFT + WIDTH - RIGHT) / 2

    def y(self, v: float) -> float:
        span = self.y_hi - self.y_lo
        return HEIGHT - BOTTOM - ((v - self.y_lo) / span * (HEIGHT - TOP - BOTTOM) if span else 0.0)


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About ``count`` round tick values (1, 2, 2.5 or 5 times a power of ten apart) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"nice_ticks: lo={lo!r}, hi={hi!r}; expected finite numbers")
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first, ticks = math.floor(lo / step), []
    while not ticks or ticks[-1] < hi - step * 1e-9:
        ticks.append(round((first + len(ticks)) * step, 12))
    return ticks


def _fmt(v: float, log_y: bool = False) -> str:
    """A tick label: ``1e-5`` for a log axis (``v`` is the exponent), else a short number (``0.25``, ``1.2k``,
    ``3e-06``)."""
    if log_y:
        return f"1e{int(round(v))}"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.0e}"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.4g}"


def _frame(xs: list[float], ys: list[float], log_y: bool, y_zero: bool) -> _Frame:
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if log_y:
        y_lo, y_hi = math.floor(y_lo), math.ceil(y_hi)
        if y_lo == y_hi:
            y_lo, y_hi = y_lo - 1, y_hi + 1
    else:
        if y_zero:
            y_lo = min(y_lo, 0.0)
        if y_lo == y_hi == 0.0:
            y_hi = 1.0  # a flat zero (a reward that never moved) sits on the floor
        elif y_lo == y_hi:
            pad = abs(y_lo) * 0.1
            y_lo, y_hi = y_lo - pad, y_hi + pad
        ticks = nice_ticks(y_lo, y_hi)
        y_lo, y_hi = min(y_lo, ticks[0]), max(y_hi, ticks[-1])
    return _Frame(x_lo, x_hi, y_lo, y_hi)


def _axes(f: _Frame, log_y: bool) -> list[str]:
    out = [f'<line class="axis" x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}"/>',
           f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}"/>']
    decades = int(f.y_hi - f.y_lo)
    y_ticks = [float(v) for v in range(int(f.y_hi), int(f.y_lo) - 1, -(1 + decades // 6))] if log_y \
        else nice_ticks(f.y_lo, f.y_hi)
    for v in y_ticks:
        if f.y_lo <= v <= f.y_hi:
            y = f.y(v)
            out.append(f'<line class="gridline" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}"/>')
            out.append(f'<text class="tick" x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end">'
                       f'{escape(_fmt(v, log_y))}</text>')
    x_ticks = [v for v in nice_ticks(f.x_lo, f.x_hi, 5) if f.x_lo <= v <= f.x_hi and v == int(v)] or [f.x_lo]
    for v in x_ticks:
        x = f.x(v)
        out.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 13}" text-anchor="middle">'
                   f'{escape(_fmt(v))}</text>')
    out.append(f'<text class="tick" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" text-anchor="middle">'
               'step</text>')
    return out


def _legend(names: list[tuple[str, str]]) -> list[str]:
    """One row under the title, left to right."""
    out, x = [], float(LEFT)
    for name, color in names:
        out.append(f'<rect x="{x:.1f}" y="24" width="9" height="9" fill="{escape(color)}"/>'
                   f'<text class="legend" x="{x + 12:.1f}" y="32">{escape(name)}</text>')
        x += 22 + 6.2 * len(name)
    return out


def _svg(plot_id: str, title: str, body: list[str]) -> str:
    return (f'<svg id="{escape(plot_id)}" class="plot" role="img" aria-label="{escape(title)}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg">'
            f'<text class="title" x="{LEFT}" y="16">{escape(title)}</text>{"".join(body)}</svg>')


def _empty(plot_id: str, title: str, text: str = EMPTY_TEXT, legend: list[tuple[str, str]] | None = None) -> str:
    return _svg(plot_id, title, [f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                                 f'{escape(text)}</text>', *_legend(legend or [])])


def line_plot(plot_id: str, title: str, series: list[Series], log_y: bool = False, y_zero: bool = False,
              value_format: str = ".4g") -> str:
    """Lines with a marker per point. ``log_y``: log10 axis (points with y <= 0 are left out, and counted in the
    legend); ``y_zero``: the linear axis includes 0. Points that are not finite are left out. Tooltips show
    ``<series> step <x>: <y>`` with ``value_format``."""
    legend: list[tuple[str, str]] = []
    kept: list[tuple[Series, list[tuple[float, float]]]] = []
    for s in series:
        finite = [(x, y) for x, y in s.points if math.isfinite(y)]
        drawn = [(x, y) for x, y in finite if y > 0 or not log_y]
        if finite:
            hidden = len(finite) - len(drawn)
            legend.append((s.name + (f" ({hidden} <= 0 not shown)" if hidden else ""), s.color))
        if drawn:
            kept.append((s, drawn))
    if not kept:
        return _empty(plot_id, title, "no value above 0 for a log axis" if legend else EMPTY_TEXT, legend)
    ty = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    f = _frame([x for _, pts in kept for x, _ in pts], [ty(y) for _, pts in kept for _, y in pts], log_y, y_zero)
    body = _axes(f, log_y)
    for s, pts in kept:
        color = escape(s.color)
        coords = [(f.x(x), f.y(ty(y))) for x, y in pts]
        if len(coords) > 1:
            path = " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy in coords)
            body.append(f'<polyline class="line" points="{path}" fill="none" stroke="{color}"/>')
        for (x, y), (cx, cy) in zip(pts, coords, strict=True):
            body.append(f'<circle class="pt" cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{color}">'
                        f'<title>{escape(s.name)} step {x:g}: {format(y, value_format)}</title></circle>')
    body += _legend(legend)
    return _svg(plot_id, title, body)


def stacked_bars(plot_id: str, title: str, layers: list[Series], unit: str = "s") -> str:
    """One bar per x, its layers stacked bottom-up in the order given (each layer's ``(x, height)``; heights
    below 0 or not finite count as 0). Tooltips show ``<layer> step <x>: <height><unit>``."""
    heights: dict[float, list[float]] = {}
    for i, layer in enumerate(layers):
        for x, h in layer.points:
            heights.setdefault(x, [0.0] * len(layers))[i] = h if math.isfinite(h) and h > 0 else 0.0
    if not heights:
        return _empty(plot_id, title)
    xs = sorted(heights)
    f = _frame([xs[0] - 0.5, xs[-1] + 0.5], [0.0, max(sum(hs) for hs in heights.values())], False, True)
    body = _axes(f, False)
    width = max(min((WIDTH - LEFT - RIGHT) / len(xs) * 0.8, 24.0), 0.5)
    for x in xs:
        base = 0.0
        for layer, h in zip(layers, heights[x], strict=True):
            if h <= 0:
                continue
            y_top, y_bottom = f.y(base + h), f.y(base)
            body.append(f'<rect class="bar" x="{f.x(x) - width / 2:.1f}" y="{y_top:.1f}" width="{width:.1f}" '
                        f'height="{max(y_bottom - y_top, 0.3):.1f}" fill="{escape(layer.color)}">'
                        f'<title>{escape(layer.name)} step {x:g}: {h:.3g}{escape(unit)}</title></rect>')
            base += h
    body += _legend([(s.name, s.color) for s in layers])
    return _svg(plot_id, title, body)
