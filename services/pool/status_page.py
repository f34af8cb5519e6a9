"""The pool's live status page (``GET /``): one HTML document with server-side SVG plots, and what it is made from.

:class:`StepHistory` keeps the scalar fields of the learner's last ``HISTORY_STEPS`` step reports (the plots and
``GET /v1/history``); :class:`TokenRates` turns the engines' token counters into tokens/s; :func:`render_page`
is a pure function of the pool's status dict, the history and the rates, in the vocabulary of ``inflight pool
status`` (:mod:`services.pool.status_table`). Every string is escaped. Nothing is fetched from elsewhere: a
short inline script, allowed by its hash in :func:`security_headers`' Content-Security-Policy, fetches the page
every ``REFRESH_S`` seconds and swaps its ``#live`` part; without JavaScript a ``<meta refresh>`` reloads it.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from html import escape
from typing import Any

from services.pool.engine_replies import EngineStats
from services.pool.mismatch import mismatch_section
from services.pool.status_table import NONE, engine_state, fmt_bytes, fmt_duration, fmt_seconds
from services.pool.svg_plots import Series, line_plot, stacked_bars

HISTORY_STEPS = 500
"""Step reports the pool keeps for the page's plots and ``GET /v1/history`` (the oldest go first)."""
REFRESH_S = 2
"""Seconds between two updates of an open page."""
RATE_WINDOW_S = 30.0
"""An engine's tokens/s is measured over about this many seconds of its token counter."""
MIN_RATE_SPAN_S = 1.0
"""Two counter samples closer than this give no rate yet (``-``)."""
STATS_TIMEOUT_S = 2.0
"""Longest the page waits for an engine's counters (a late engine shows its last rate)."""
STATE_BADGES = {"up": "ok", "down": "bad"}
"""An engine state's badge colour class; the other states (starting, stale, draining) are ``warn``."""
RECENT_REFITS = 5
DROP_WINDOW_STEPS = 50
"""The drops table counts the last this many steps."""
PHASES = (("policy_training_s", "policy training", "#4c72b0"), ("generation_exposed_s", "generation exposed",
          "#dd8452"), ("refit_s", "refit", "#55a868"), ("other_s", "other", "#8c8c8c"))
"""The step-time phases stacked in the step-time plot (they add up to ``step_s``): report key, label, colour."""


def _number(v: Any) -> float | None:
    """A finite int/float as float; None otherwise (absent, NaN, a string, a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


@dataclass(frozen=True)
class StepPoint:
    """The scalar fields of one learner step report (:meth:`services.job.learner_job.LearnerJob.finish_step`)."""

    step: int
    time: float
    """When the pool received the report (seconds since the epoch)."""
    learner_id: str | None = None
    """The learner attached when the report came (a resumed run changes it)."""
    policy_version: float | None = None
    reward_mean: float | None = None
    val_accuracy: float | None = None
    gen_kl_error: float | None = None
    """The parity probe's engine-vs-learner KL on fixed sequences after the step's refit."""
    train_gen_kl_error: float | None = None
    """pi_gen vs pi_prev over the step's batch (includes the lag-1 drift)."""
    step_s: float | None = None
    policy_training_s: float | None = None
    generation_exposed_s: float | None = None
    refit_s: float | None = None
    other_s: float | None = None
    refit_bytes: float | None = None
    refit_pause_s: float | None = None
    tokens_per_s: float | None = None
    trajectory_age_mean: float | None = None
    logprob_mismatch_mean: float | None = None
    """Mean over the step's sequences of their mean |learner - engine| log-prob (``learner.mismatch_stats``)."""
    logprob_mismatch_max: float | None = None
    """The step's worst sequence by that mean."""
    ages: dict[int, int] = field(default_factory=dict)
    """Trained groups of the step by age (policy versions)."""
    drops: dict[str, int] = field(default_factory=dict)
    """Prompts or groups dropped or rejected during the step, by reason."""


SCALARS = tuple(f.name for f in fields(StepPoint) if f.name not in ("step", "time", "learner_id", "ages", "drops"))


class StepHistory:
    """The last ``max_steps`` step reports of the learner run the pool serves, oldest first.

    A report whose step is not after the last one kept (a new run from step 1, or a learner resumed from an
    earlier checkpoint) first removes the points from that step on, so the plots show one run; a new run's first
    step (0 or 1) also removes another learner's step 0 (a validation row of the run before). The reports carry
    the buffer's drops as totals (``dropped_<reason>``); a point keeps the step's increase (a total that went
    down, a new job's counter, counts whole) plus the step's rejections (``rejected``)."""

    def __init__(self, max_steps: int = HISTORY_STEPS):
        if max_steps < 1:
            raise ValueError(f"StepHistory: max_steps={max_steps}; expected >= 1")
        self.points: deque[StepPoint] = deque(maxlen=max_steps)
        self._drop_totals: dict[str, int] = {}

    def record(self, report: dict, learner_id: str | None = None, now: float | None = None) -> StepPoint:
        """Keep ``report``'s scalars as the newest point, sent by ``learner_id``; a report without an integer
        ``step`` is an error."""
        step = report.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step report: 'step' is {step!r}; expected an integer")
        while self.points and (self.points[-1].step >= step  # from ``step`` on, and at a new run's first step
                               or (step <= 1 and self.points[-1].learner_id != learner_id)):  # the run before's 0
            self.points.pop()
        drops: dict[str, int] = {}
        for key, total in report.items():
            if key.startswith("dropped_") and isinstance(total, int) and not isinstance(total, bool):
                reason, before = key.removeprefix("dropped_"), self._drop_totals.get(key, 0)
                self._drop_totals[key] = total
                if (new := total - before if total >= before else total) > 0:
                    drops[reason] = new
        for reason, n in (report.get("rejected") or {}).items():
            if isinstance(n, int) and n > 0:
                drops[str(reason)] = drops.get(str(reason), 0) + n
        ages: dict[int, int] = {}
        for age in report.get("trajectory_ages") or []:
            if isinstance(age, (int, float)) and math.isfinite(age):
                ages[int(age)] = ages.get(int(age), 0) + 1
        point = StepPoint(step=step, time=time.time() if now is None else now, learner_id=learner_id, ages=ages,
                          drops=drops, **{k: _number(report.get(k)) for k in SCALARS})
        self.points.append(point)
        return point

    def as_json(self) -> dict:
        """``GET /v1/history``: ``{"max_steps": n, "steps": [point, ...]}``, oldest first."""
        return {"max_steps": self.points.maxlen, "steps": [asdict(p) for p in self.points]}


class TokenRates:
    """Each engine's tokens/s from successive samples of its ``tokens_generated`` counter.

    The rate is measured between the oldest and the newest sample of about the last ``window_s`` seconds; a
    counter that went down (the engine restarted) starts afresh. Samples are taken when the page is loaded."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, eid: str, tokens: int, now: float) -> None:
        samples = self._samples.setdefault(eid, deque())
        if samples and tokens < samples[-1][1]:
            samples.clear()
        samples.append((now, tokens))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    def rate(self, eid: str) -> float | None:
        """Tokens per second, or None until two samples are ``MIN_RATE_SPAN_S`` apart."""
        samples = self._samples.get(eid)
        if not samples or samples[-1][0] - samples[0][0] < MIN_RATE_SPAN_S:
            return None
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return (n1 - n0) / (t1 - t0)

    def rates(self) -> dict[str, float | None]:
        return {eid: self.rate(eid) for eid in self._samples}

    async def sample(self, handles: dict[str, Any], timeout_s: float = STATS_TIMEOUT_S) -> None:
        """Ask every engine actor in ``handles`` for its counters at once; those that answer within ``timeout_s``
        are observed (the others keep their last samples). Engines no longer in ``handles`` are forgotten."""
        eids = list(handles)
        for gone in set(self._samples) - set(eids):
            del self._samples[gone]
        answers = await asyncio.gather(*(asyncio.wait_for(handles[e].stats.remote(), timeout_s) for e in eids),
                                       return_exceptions=True)
        now = time.time()
        for eid, stats in zip(eids, answers, strict=True):
            if isinstance(stats, EngineStats):
                self.observe(eid, stats.counters.sampling.tokens_generated, now)


# ---------------------------------------------------------------------------------------------- rendering
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:0 0 6px}
.summary{margin:0 0 12px;color:#444} .badge{padding:1px 6px;border-radius:3px;color:#fff}
.ok{background:#2e7d32} .bad{background:#c62828} .warn{background:#ef6c00}
#conn{color:#c62828;font-weight:600}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(380px,1fr));gap:14px} .wide{grid-column:1/-1}
section{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 12px}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:2px 8px 2px 0;white-space:nowrap}
th{border-bottom:1px solid #ccc;font-weight:600} td.key{font-weight:600;width:45%}
.num{text-align:right} .err{white-space:normal;color:#a00}
.muted{color:#888} footer{margin-top:12px;color:#666} #plots{margin-top:14px}
svg.plot{width:100%;height:auto} svg .axis{stroke:#555} svg .gridline{stroke:#e4e4e4}
svg .line{stroke-width:1.6} svg text{font-size:11px;fill:#444} svg .title{font-size:13px;font-weight:600}
svg .empty{fill:#999;font-size:13px}
"""
SCRIPT = f"""
async function refresh() {{
  const conn = document.getElementById("conn");
  try {{
    const r = await fetch(location.pathname, {{cache: "no-store"}});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const live = new DOMParser().parseFromString(await r.text(), "text/html").getElementById("live");
    if (live) document.getElementById("live").replaceWith(live);
    conn.textContent = "";
  }} catch (e) {{
    conn.textContent = "the pool did not answer (" + e.message + "); retrying";
  }}
  setTimeout(refresh, {REFRESH_S * 1000});
}}
setTimeout(refresh, {REFRESH_S * 1000});
"""


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def security_headers() -> dict[str, str]:
    """The page's response headers: a CSP allowing only its own inline script and style (by hash), requests to
    the pool itself and the empty ``data:`` icon (no favicon request), no framing, no caching."""
    csp = (f"default-src 'none'; script-src '{_sha256(SCRIPT)}'; style-src '{_sha256(STYLE)}'; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def _text(v: Any, spec: str = "") -> str:
    """``v`` formatted (``spec`` for numbers) and escaped; ``-`` for None or NaN."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return NONE
    return escape(format(v, spec) if spec and isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))


def _table(header: list[str] | None, rows: list[list[str]], numeric: set[int] | None = None,
           empty: str = "none") -> str:
    """An HTML table (``header`` None: rows of name and value); cells are HTML already (escaped by the caller);
    columns in ``numeric`` align right."""
    numeric = numeric or set()
    head = "".join(f'<th{" class=num" if i in numeric else ""}>{escape(h)}</th>' for i, h in enumerate(header or []))
    if header is None:
        return "<table>" + "".join(f'<tr><td class="key">{escape(k)}</td><td>{v}</td></tr>' for k, v in rows) + \
            "</table>"
    if not rows:
        return f'<table><tr>{head}</tr><tr><td class="muted" colspan="{len(header)}">{escape(empty)}</td></tr></table>'
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(section_id: str, title: str, inner: str, wide: bool = False) -> str:
    return f'<section id="{section_id}"{" class=wide" if wide else ""}><h2>{escape(title)}</h2>{inner}</section>'


def _badge(text: str, kind: str) -> str:
    return f'<span class="badge {kind}">{escape(text)}</span>'


def engines_section(engines: dict[str, dict], pool_version: Any, rates: dict[str, float | None]) -> str:
    """Engine, state (:func:`~services.pool.status_table.engine_state`: green up, red down, orange the others),
    version, pid, tokens/s, last error."""
    rows = []
    for eid, e in sorted(engines.items()):
        state = engine_state(e, pool_version)
        rows.append([_text(eid), _badge(state, STATE_BADGES.get(state, "warn")), _text(e.get("version")),
                     _text(e.get("pid")), _text(rates.get(eid), ",.0f"),
                     f'<span class="err">{_text(e["error"])}</span>' if e.get("error") else NONE])
    return _section("engines", "engines", _table(["engine", "state", "version", "pid", "tokens/s", "last error"],
                                                 rows, numeric={2, 3, 4}, empty="(none)"), wide=True)


def learner_section(learner: dict | None, report: dict | None, points: list[StepPoint], now: float) -> str:
    """Attached or not (and since when), id, the last step's numbers, and the trained groups by age."""
    report = report or {}
    since = (learner or {}).get("since")
    attached = (_badge(f"yes, {fmt_duration(now - since)} ago", "ok") if isinstance(since, (int, float))
                else _badge("yes", "ok") if learner else _badge("no", "bad"))
    rows = [["attached", attached], ["id", _text((learner or {}).get("id"))], ["step", _text(report.get("step"))],
            ["reward mean", _text(report.get("reward_mean"), ".4f")],
            ["gen KL error", _text(report.get("gen_kl_error"), ".2e")],
            ["step time", _text(fmt_seconds(report.get("step_s")))],
            ["tokens/s (training)", _text(report.get("tokens_per_s"), ",.0f")],
            ["trajectory age mean", _text(report.get("trajectory_age_mean"), ".2f")],
            ["buffered groups", _text(report.get("buffer_groups"))]]
    ages: dict[int, int] = {}
    for p in points:
        for age, n in p.ages.items():
            ages[age] = ages.get(age, 0) + n
    total = sum(ages.values())
    age_rows = [[_text(a), _text(n), _text(n / total, ".0%")] for a, n in sorted(ages.items())]
    span = f"steps {points[0].step}-{points[-1].step}" if points else "no steps yet"
    return _section("learner", "learner", _table(None, rows)
                    + f"<h2>trajectory age ({escape(span)})</h2>"
                    + _table(["age (versions)", "groups", "share"], age_rows, numeric={0, 1, 2}))


def refits_section(points: list[StepPoint]) -> str:
    """The last ``RECENT_REFITS`` steps that pushed weights: bytes, seconds (the step's refit phase), GB/s, pause."""
    rows = []
    for p in [p for p in points if p.refit_bytes][-RECENT_REFITS:][::-1]:
        gbps = p.refit_bytes / p.refit_s / 1e9 if p.refit_bytes and p.refit_s else None
        rows.append([_text(p.step), _text(p.policy_version, ".0f"), _text(fmt_bytes(p.refit_bytes)),
                     _text(fmt_seconds(p.refit_s)), _text(gbps, ".3f"), _text(fmt_seconds(p.refit_pause_s))])
    return _section("refits", "last refits", _table(["step", "version", "bytes", "seconds", "GB/s", "pause"], rows,
                                                    numeric={0, 1, 2, 3, 4, 5}, empty="no refit reported yet"))


def drops_section(points: list[StepPoint]) -> str:
    """Drops and rejections of the last ``DROP_WINDOW_STEPS`` steps by reason, with the last step each was seen."""
    recent = points[-DROP_WINDOW_STEPS:]
    counts: dict[str, int] = {}
    last: dict[str, int] = {}
    for p in recent:
        for reason, n in p.drops.items():
            counts[reason] = counts.get(reason, 0) + n
            last[reason] = p.step
    rows = [[_text(r), _text(n), _text(last[r])] for r, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return _section("drops", f"drops (last {DROP_WINDOW_STEPS} steps)",
                    _table(["reason", "dropped / rejected", "last at step"], rows, numeric={1, 2},
                           empty="none in the last steps"))


def _series(points: list[StepPoint], key: str, name: str, color: str) -> Series:
    return Series(name, [(p.step, v) for p in points if (v := getattr(p, key)) is not None], color)


def plots_section(points: list[StepPoint]) -> str:
    """Which run the plots show, then reward, gen KL (log scale), the step-time phases and the log-prob mismatch
    (log scale) over the kept steps."""
    reward = line_plot("plot-reward", "reward", [_series(points, "reward_mean", "reward mean", "#4c72b0"),
                                                 _series(points, "val_accuracy", "val accuracy", "#c44e52")],
                       y_zero=True)
    kl = line_plot("plot-kl", "gen KL error (log)", [_series(points, "gen_kl_error", "parity probe", "#8172b3"),
                                                     _series(points, "train_gen_kl_error", "batch", "#937860")],
                   log_y=True, value_format=".2e")
    phases = stacked_bars("plot-phases", "step time (s) by phase",
                          [_series(points, key, name, color) for key, name, color in PHASES])
    mismatch = line_plot("plot-mismatch-steps", "log-prob mismatch |Δ| (log)",
                         [_series(points, "logprob_mismatch_mean", "mean of sequences", "#8172b3"),
                          _series(points, "logprob_mismatch_max", "worst sequence", "#c44e52")],
                         log_y=True, value_format=".2e")
    run = (f"steps {points[0].step}-{points[-1].step}, last reported by {_text(points[-1].learner_id)} "
           f"(the pool keeps the last {HISTORY_STEPS} steps of the run)" if points else "no steps reported yet")
    plots = "".join(f"<section>{s}</section>" for s in (reward, kl, phases, mismatch))
    return f'<p id="run" class="muted">{run}</p><div class="grid" id="plots">{plots}</div>'


def render_page(status: dict, points: list[StepPoint], rates: dict[str, float | None], now: float,
                route_prefix: str = "/") -> str:
    """The whole page for ``status`` (:meth:`services.pool.deployment.RolloutPool.status`), the kept ``points``
    (oldest first) and the engines' token ``rates``, as of ``now``; its links are absolute under the pool's
    ``route_prefix`` (the page may be opened as ``/<prefix>`` or ``/<prefix>/``; the CSP forbids ``<base>``)."""
    name = _text(status.get("name", "?"))
    flags = [_badge("ready", "ok") if status.get("ready") else _badge("not ready", "bad")]
    flags += [_badge(f, "warn") for f in ("paused", "draining") if status.get(f)]
    summary = (f'version <strong id="version">{_text(status.get("version"))}</strong> {" ".join(flags)} &middot; '
               f'up {_text(fmt_duration(status.get("uptime_s")))} &middot; pid {_text(status.get("pid"))} &middot; '
               f'prompts: {_text(status.get("waiting_prompts"))} waiting, {_text(status.get("requeued_prompts"))} '
               f'requeued, {_text(status.get("undelivered_prompts"))} undelivered &middot; updated '
               f'<span id="updated">{escape(time.strftime("%H:%M:%S", time.localtime(now)))}</span>')
    errors = status.get("errors") or []
    errors_html = _section("errors", "recent errors", "".join(f'<p class="err">{_text(e)}</p>' for e in errors)) \
        if errors else ""
    cards = (engines_section(status.get("engines") or {}, status.get("version"), rates)
             + learner_section(status.get("learner"), status.get("last_report"), points, now)
             + refits_section(points) + drops_section(points) + mismatch_section(status.get("last_report"))
             + errors_html)
    at = escape(route_prefix.rstrip("/"))
    live = (f'<div id="live"><p class="summary">{summary}</p><div class="grid">{cards}</div>'
            f'{plots_section(points)}</div>')
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{name} - Inflight pool</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">'
            f'<noscript><meta http-equiv="refresh" content="{REFRESH_S}"></noscript><style>{STYLE}</style></head>'
            f'<body><h1>Inflight rollout pool {name}</h1><p id="conn"></p>{live}'
            f'<footer>Read-only; updates every {REFRESH_S} s. JSON: <a href="{at}/v1/status">/v1/status</a>, '
            f'<a href="{at}/v1/history">/v1/history</a>; Prometheus: <a href="{at}/metrics">/metrics</a>.</footer>'
            f'<script>{SCRIPT}</script></body></html>')
