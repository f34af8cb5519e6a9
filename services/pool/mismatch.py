"""The learner's per-sequence log-prob mismatch as the pool reads it from a step report.

The learner (``learner.mismatch_stats``) writes flat keys into the step's row: ``logprob_mismatch_<stat>`` over all
trained sequences, ``..._<stat>_engine_<id>`` per engine and ``..._<stat>_age_<k>`` per policy-version age, the
threshold, and the histogram of the sequences' mean ``|Δ log-prob|`` (``logprob_mismatch_hist_le_<bound>``, a
count per bucket, not cumulative). :class:`Mismatch` parses them into one typed value for the pool's Prometheus
gauges (:mod:`services.pool.metrics`) and the status page (:func:`mismatch_section`). The pool imports nothing of
the learner: the key names are the contract (docs/operations.md, "Metrics").
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from html import escape

from services.pool.svg_plots import HEIGHT, LEFT, WIDTH

STATS = ("mean", "max", "token_max", "over_threshold_share", "sequences")
KEY = re.compile(r"^logprob_mismatch_(?P<stat>token_max|max|mean|over_threshold_share|sequences)"
                 r"(?:_engine_(?P<engine>.+)|_age_(?P<age>\d+))?$")
HIST_KEY = re.compile(r"^logprob_mismatch_hist_le_(?P<le>.+)$")
ALL = "all"
"""The label value (engine or age) of the statistics over every sequence."""


def _finite_or_inf(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


@dataclass
class Mismatch:
    """One step's mismatch statistics: by (engine, age) label pair, ``all`` standing for every engine or age."""

    cells: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    """``(engine, age)`` -> stat -> value: ``(all, all)``, ``(<engine>, all)``, ``(all, <age>)``."""
    hist: list[tuple[float, int]] = field(default_factory=list)
    """(upper bound, sequences in (previous bound, bound]) in increasing bound order."""
    threshold: float | None = None

    @classmethod
    def of(cls, report: dict) -> Mismatch | None:
        """The report's statistics, or None when it has none (the learner measured nothing, or an older learner)."""
        out = cls()
        for key, value in report.items():
            v = _finite_or_inf(value)
            if v is None or not key.startswith("logprob_mismatch_"):
                continue
            if (m := KEY.match(key)) is not None:
                cell = (m["engine"] or ALL, m["age"] or ALL)
                out.cells.setdefault(cell, {})[m["stat"]] = v
            elif (h := HIST_KEY.match(key)) is not None:
                try:
                    out.hist.append((float(h["le"]), int(v)))
                except (ValueError, OverflowError):
                    continue
            elif key == "logprob_mismatch_threshold":
                out.threshold = v
        out.hist.sort()
        return out if (ALL, ALL) in out.cells else None

    def rows(self, kind: str) -> list[tuple[str, dict[str, float]]]:
        """The per-``engine`` or per-``age`` cells, by label (ages in numeric order)."""
        if kind == "engine":
            return sorted((e, s) for (e, a), s in self.cells.items() if e != ALL and a == ALL)
        return sorted(((a, s) for (e, a), s in self.cells.items() if e == ALL and a != ALL), key=lambda r: int(r[0]))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else escape("inf" if math.isinf(v) else format(v, spec))


def _bucket_label(lo: float | None, hi: float) -> str:
    return f"≤ {hi:g}" if lo is None else (f"> {lo:g}" if math.isinf(hi) else f"{lo:g}–{hi:g}")


def _tick(lo: float | None, hi: float) -> str:
    """A bucket's short axis label: its upper bound as a power of ten (``≤1e-4``), the last one ``>1e0``."""
    def power(v: float) -> str:
        return f"1e{round(math.log10(v))}" if v > 0 and math.log10(v).is_integer() else f"{v:g}"
    if math.isinf(hi):
        return f">{power(lo)}" if lo is not None else "all"
    return f"≤{power(hi)}"


def histogram_svg(hist: list[tuple[float, int]], title: str) -> str:
    """Bars of sequences per bucket of mean ``|Δ log-prob|`` (``<rect class="bar">`` with a ``<title>``)."""
    top, bottom = 44, 34
    inner_h, n = HEIGHT - top - bottom, max(len(hist), 1)
    peak = max((c for _, c in hist), default=0) or 1
    slot = (WIDTH - LEFT - 12) / n
    body = [f'<text class="title" x="{LEFT}" y="16">{escape(title)}</text>',
            f'<line class="axis" x1="{LEFT}" y1="{HEIGHT - bottom}" x2="{WIDTH - 12}" y2="{HEIGHT - bottom}"/>',
            f'<text class="tick" x="{LEFT - 4}" y="{top + 3}" text-anchor="end">{peak}</text>']
    lo: float | None = None
    for i, (hi, count) in enumerate(hist):
        label = _bucket_label(lo, hi)
        h = inner_h * count / peak
        x = LEFT + i * slot + slot * 0.1
        body.append(f'<rect class="bar" x="{x:.1f}" y="{HEIGHT - bottom - h:.1f}" width="{slot * 0.8:.1f}" '
                    f'height="{max(h, 0.3):.1f}" fill="#8172b3"><title>{escape(label)}: {count} sequences</title>'
                    f'</rect>'
                    f'<text class="tick" x="{x + slot * 0.4:.1f}" y="{HEIGHT - bottom + 13}" '
                    f'text-anchor="middle">{escape(_tick(lo, hi))}</text>')
        lo = hi
    if not hist:
        body.append(f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no sequences</text>')
    return (f'<svg id="plot-mismatch" class="plot" role="img" aria-label="{escape(title)}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg">{"".join(body)}</svg>')


def mismatch_section(report: dict | None) -> str:
    """The status page's card: the last step's histogram, then its statistics in total, per engine and per age."""
    mm = Mismatch.of(report or {})
    if mm is None:
        return ('<section id="mismatch"><h2>log-prob mismatch (engine vs learner)</h2>'
                '<p class="muted">no mismatch statistics in the last step report</p></section>')
    step = escape(str((report or {}).get("step", "?")))
    head = "".join(f"<th{' class=num' if i else ''}>{escape(h)}</th>" for i, h in enumerate(
        ("engine / age", "seqs", "mean |Δ|", "worst seq", "worst token", "> thr.")))
    rows = [("all", mm.cells[(ALL, ALL)])] + [(e, s) for e, s in mm.rows("engine")] + \
        [(f"age {a}", s) for a, s in mm.rows("age")]
    body = "".join(
        f"<tr><td>{escape(name)}</td><td class=num>{_fmt(s.get('sequences'), '.0f')}</td>"
        f"<td class=num>{_fmt(s.get('mean'), '.1e')}</td><td class=num>{_fmt(s.get('max'), '.1e')}</td>"
        f"<td class=num>{_fmt(s.get('token_max'), '.1e')}</td>"
        f"<td class=num>{_fmt(s.get('over_threshold_share'), '.1%')}</td></tr>" for name, s in rows)
    note = (f'<p class="muted">step {step}; |Δ| = |learner π_prev − engine| log-prob of a sampled token, mean per '
            f'sequence (worst token: of one token); &gt; thr.: share of sequences with mean exp|Δ| &gt; '
            f'{_fmt(mm.threshold, "g")}</p>')
    return (f'<section id="mismatch" class="wide"><h2>log-prob mismatch (engine vs learner)</h2><div class="grid">'
            f'<div>{histogram_svg(mm.hist, f"sequences by mean |Δ log-prob|, step {step}")}</div>'
            f'<div><table><tr>{head}</tr>{body}</table>{note}</div></div></section>')
