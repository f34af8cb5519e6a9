"""The status page's parts: the step history the pool keeps, engine token rates, the SVG plots and the page itself
(rendered through the deployment's own ``GET /`` route on a fleet of fake engines), read back with an HTML parser."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import re
import time
import types
from html.parser import HTMLParser

import pytest
from pool_fakes import FakeEngine, engine_stats, pool_of

from protocol.pool_replies import AttachedLearner
from services.pool.deployment import RolloutPool
from services.pool.status_page import (
    DROP_WINDOW_STEPS,
    STYLE,
    StepHistory,
    TokenRates,
    render_page,
    security_headers,
)
from services.pool.svg_plots import Series, line_plot, nice_ticks, stacked_bars


class Page(HTMLParser):
    """Every element as ``(tag, attrs)``, the text inside each element with an id, and script bodies."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.text: dict[str, str] = {}
        self.scripts: list[str] = []
        self._open: list[tuple[str, str | None]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag not in ("meta", "link"):  # the page's void elements; SVG's <line/> come with their end tag
            self._open.append((tag, a.get("id")))
            if a.get("id"):
                self.text[a["id"]] = ""

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, eid in self._open:
            if eid:
                self.text[eid] += data
        if self._open and self._open[-1][0] == "script":
            self.scripts.append(data)

    def inside(self, parent_id: str, tag: str, cls: str) -> int:
        """How many ``<tag class=cls>`` the element ``parent_id`` holds (the plots are flat: count until the next
        ``<svg>``)."""
        n, seen = 0, False
        for t, a in self.elements:
            if t == "svg":
                seen = a.get("id") == parent_id
            elif seen and t == tag and cls in (a.get("class") or "").split():
                n += 1
        return n


def report(step: int, **extra) -> dict:
    return {"step": step, "policy_version": step, "reward_mean": 0.1 * step, "gen_kl_error": 1e-11 * step,
            "train_gen_kl_error": 1e-3, "step_s": 3.0, "policy_training_s": 2.0, "generation_exposed_s": 0.5,
            "refit_s": 0.25, "other_s": 0.25, "refit_bytes": 10**9, "refit_pause_s": 0.04, "tokens_per_s": 1234.0,
            "trajectory_ages": [1, 1, 0], "rejected": {}, **extra}


# ---------------------------------------------------------------------------------------------- history
def test_history_keeps_scalars_ages_and_the_steps_new_drops():
    h = StepHistory()
    h.record(report(1, dropped_stale=2, tokens_per_s=float("nan"), note="text"), now=10.0)
    p = h.record(report(2, dropped_stale=5, dropped_zero_advantage=1, rejected={"malformed": 3}), "learner-1",
                 now=11.0)
    first = h.points[0]
    assert first.tokens_per_s is None and first.drops == {"stale": 2} and first.ages == {1: 2, 0: 1}
    assert p.drops == {"stale": 3, "zero_advantage": 1, "malformed": 3}    # totals become the step's increase
    assert (p.step, p.time, p.learner_id, p.reward_mean, p.refit_bytes) == (2, 11.0, "learner-1", 0.2, 1e9)
    js = h.as_json()
    assert js["max_steps"] == 500 and [s["step"] for s in js["steps"]] == [1, 2] and "note" not in js["steps"][0]


def test_history_shows_one_run_and_stays_bounded():
    h = StepHistory(max_steps=3)
    for s in range(1, 6):
        h.record(report(s))
    assert [p.step for p in h.points] == [3, 4, 5]                        # the oldest went
    h.record(report(4, dropped_stale=1))                                  # resumed from step 3's checkpoint
    assert [p.step for p in h.points] == [3, 4]
    h.record(report(2, dropped_stale=7))
    h.record(report(1, dropped_stale=0))                                  # a new run: its totals start again
    assert [p.step for p in h.points] == [1] and h.points[0].drops == {}
    h.record(report(0), "learner-a")                                     # a run that validated at its start
    h.record(report(1), "learner-a")
    assert [(p.step, p.learner_id) for p in h.points] == [(0, "learner-a"), (1, "learner-a")]  # its own step 0 kept
    h.record(report(1), "learner-b")                                      # the next run, without a step 0
    assert [(p.step, p.learner_id) for p in h.points] == [(1, "learner-b")]  # the run before's step 0 went too
    with pytest.raises(ValueError, match=r"'step' is '3'; expected an integer"):
        h.record({"step": "3"})
    with pytest.raises(ValueError, match="max_steps=0"):
        StepHistory(0)


# ---------------------------------------------------------------------------------------------- token rates
def test_token_rates_over_a_window_and_after_a_restart():
    r = TokenRates(window_s=10.0)
    r.observe("e", 100, now=0.0)
    assert r.rate("e") is None and r.rate("unknown") is None               # one sample: no rate yet
    r.observe("e", 100 + 500, now=0.5)
    assert r.rate("e") is None                                             # closer than MIN_RATE_SPAN_S
    for t in range(1, 31):
        r.observe("e", 100 + 1000 * t, now=float(t))
    assert r.rate("e") == pytest.approx(1000.0)
    r.observe("e", 1600, now=31.0)                                          # 0 measured: the counter went down
    r.observe("e", 2600, now=33.0)
    assert r.rate("e") == pytest.approx(500.0)


def test_token_rates_sample_engines_that_answer_in_time():
    slow, broken = FakeEngine(True), FakeEngine(True)
    fast = FakeEngine(True)
    counts = iter([0, 4000])

    async def fast_stats():
        return engine_stats(next(counts))

    async def slow_stats():
        await asyncio.sleep(3600)

    async def broken_stats():
        raise RuntimeError("actor died")

    fast.stats.fn, slow.stats.fn, broken.stats.fn = fast_stats, slow_stats, broken_stats
    rates = TokenRates()

    async def twice():
        handles = {"fast": fast, "slow": slow, "broken": broken}
        await rates.sample(handles, timeout_s=0.05)
        await asyncio.sleep(1.05)
        await rates.sample(handles, timeout_s=0.05)

    asyncio.run(twice())
    got = rates.rates()
    assert set(got) == {"fast"} and 3000 < (got["fast"] or 0) < 4000     # 4000 tokens over ~1.1 s
    asyncio.run(rates.sample({"slow": slow}, timeout_s=0.05))             # "fast" was removed (scaled down)
    assert rates.rates() == {}


# ---------------------------------------------------------------------------------------------- plots
def test_nice_ticks_and_plots():
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(3, 97) == [0, 25, 50, 75, 100]
    assert nice_ticks(0.002, 0.0071, 5) == [0.002, 0.004, 0.006, 0.008]
    with pytest.raises(ValueError, match="expected finite"):
        nice_ticks(0, math.inf)
    svg = line_plot("p", "kl <&>", [Series("a<b", [(1, 1e-11), (2, 0.0), (3, float("nan")), (4, 1e-3)], "red")],
                    log_y=True)
    page = Page(svg)
    assert page.inside("p", "circle", "pt") == 2                           # 0 and NaN have no place on a log axis
    assert "kl &lt;&amp;&gt;" in svg and "a&lt;b" in svg and "<b" not in svg
    assert ">1e-11<" in svg and ">1e-3<" in svg                            # decade ticks of the log axis
    assert "a&lt;b (1 &lt;= 0 not shown)" in svg                           # said, not silently dropped
    zeros = line_plot("z", "kl", [Series("batch", [(1, 0.0), (2, 0.0)], "red")], log_y=True)
    assert "no value above 0 for a log axis" in zeros and "batch (2 &lt;= 0 not shown)" in zeros
    flat = line_plot("f", "reward", [Series("r", [(1, 0.0), (2, 0.0)], "blue")], y_zero=True)
    assert ">0<" in flat and ">1<" in flat and ">-" not in flat             # a flat zero: axis 0..1, no negatives
    empty = line_plot("q", "reward", [Series("r", [], "blue")])
    assert "no steps reported yet" in empty and Page(empty).inside("q", "circle", "pt") == 0
    bars = stacked_bars("b", "phases", [Series("x", [(1, 2.0), (2, 1.0)], "red"),
                                        Series("y", [(1, 1.0), (2, -5.0)], "blue")])
    assert Page(bars).inside("b", "rect", "bar") == 3                      # a negative layer is not drawn
    assert re.findall(r"<title>(\w step \d: [\d.]+s)</title>", bars) == ["x step 1: 2s", "y step 1: 1s",
                                                                          "x step 2: 1s"]


# ---------------------------------------------------------------------------------------------- the page
def page_of(pool, reports: list[dict]) -> tuple[str, dict]:
    """``GET /`` of :class:`RolloutPool` itself on the parts of ``pool`` after ``reports`` went through
    ``report_step``: (html, headers)."""
    cls = RolloutPool.func_or_class  # type: ignore[attr-defined]
    me = types.SimpleNamespace(name=pool.fleet.name, fleet=pool.fleet, dispatcher=pool.dispatcher,
                               metrics=pool.fleet.metrics, _last_report=None, _ensure_started=lambda: None,
                               history=StepHistory(), token_rates=TokenRates())
    me.status = lambda: cls.status(me)

    async def run():
        for r in reports:
            await cls.report_step(me, r)
        return await cls.status_page(me)

    response = asyncio.run(run())
    assert response.media_type == "text/html"
    return response.body.decode(), dict(response.headers)


def test_page_shows_pool_engines_learner_refits_drops_and_plots():
    pool = pool_of({"engine-0": FakeEngine(True), "engine-1": FakeEngine(True)})
    pool.fleet.version = 3
    for e in ("engine-0", "engine-1"):
        pool.fleet.table.set_version(e, 3)
    pool.fleet.mark_down("engine-1", RuntimeError("<script>alert(1)</script> & gone"))
    pool.fleet.errors.append("refit v2 timeout: <b>")
    pool.dispatcher.learner = AttachedLearner(id="learner-<7>", since=time.time() - 100)
    reports = [report(1, dropped_stale=1), report(2, rejected={"malformed": 2}), report(3, refit_bytes=2 * 10**9)]
    html, headers = page_of(pool, reports)
    page = Page(html)
    assert page.text["version"] == "3"
    assert "engine-0" in page.text["engines"] and "up" in page.text["engines"]
    assert "RuntimeError: <script>alert(1)</script> & gone" in page.text["engines"]   # shown as text
    assert "<script>alert" not in html and [t for t, _ in page.elements].count("script") == 1
    learner = page.text["learner"]
    assert re.search(r"yes, 1m4\ds ago", learner) and "learner-<7>" in learner
    assert "0.3000" in learner and "3.00e-11" in learner                  # the last report's reward and probe KL
    assert "steps 1-3" in learner and "67%" in learner                     # 6 groups at age 1 of 9
    refits = page.text["refits"]                                           # newest first; GB/s = bytes / refit_s
    assert refits.index("8.000") < refits.index("4.000") and "40ms" in refits and "1.9 GiB" in refits
    drops = page.text["drops"]
    assert f"last {DROP_WINDOW_STEPS} steps" in drops and "malformed" in drops and "stale" in drops
    assert "refit v2 timeout: <b>" in page.text["errors"]
    assert page.text["run"].startswith("steps 1-3, last reported by learner-<7>")
    assert page.inside("plot-reward", "circle", "pt") == 3
    assert page.inside("plot-kl", "circle", "pt") == 6                    # probe and batch KL, three steps each
    assert page.inside("plot-phases", "rect", "bar") == 12                # four phases a step
    csp = headers["content-security-policy"]
    script_hash = base64.b64encode(hashlib.sha256(page.scripts[0].encode()).digest()).decode()
    style_hash = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
    assert f"script-src 'sha256-{script_hash}'" in csp and f"style-src 'sha256-{style_hash}'" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert headers["cache-control"] == "no-store" == security_headers()["Cache-Control"]
    assert not [a for _, a in page.elements for k, v in a.items() if k == "src" or k.startswith("on")]


def test_page_before_any_engine_or_step():
    html = render_page({"name": "p", "version": None, "ready": False}, [], {}, now=0.0)
    page = Page(html)
    assert page.text["version"] == "-" and "not ready" in html
    assert "(none)" in page.text["engines"] and "attachedno" in page.text["learner"]
    assert "no refit reported yet" in page.text["refits"] and "none in the last steps" in page.text["drops"]
    assert html.count("no steps reported yet") == 5 and "errors" not in page.text    # the run line, four plots


def test_engine_states_are_the_pools_own_words():
    engines = {"p-engine-0": {"up": True, "version": 3}, "p-engine-1": {"up": True, "version": 2},
               "p-engine-2": {"up": True, "version": 3, "state": "draining"}, "p-engine-3": {"up": False}}
    html = render_page({"name": "p", "version": 3, "engines": engines}, [], {"p-engine-0": 812.4}, now=0.0)
    badges = re.findall(r'<td>p-engine-\d</td><td><span class="badge (\w+)">([\w, ]+)</span>', html)
    assert badges == [("ok", "up"), ("warn", "stale"), ("warn", "draining"), ("bad", "down")]
    assert "<td class=num>812</td>" in html                                # the measured tokens/s, rounded


def _mismatch_keys() -> dict[str, float]:
    """The learner's own keys (learner.mismatch_stats) for 3 sequences: engine ``e<1>`` ages 0 and 1, engine e2."""
    import numpy as np
    import torch

    from learner.mismatch_stats import MismatchStats
    from protocol.messages import Trajectory, TrajectoryGroup

    def group(engine: str, versions: list[list[int]]) -> TrajectoryGroup:
        trajs = [Trajectory(np.array([5, 6]), np.full(2, -1.0), np.array(v), 1.0) for v in versions]
        return TrajectoryGroup(engine, engine, np.array([1]), trajs, len(trajs), 64, engine_id=engine)

    stats = MismatchStats.of([group("e<1>", [[4, 4], [3, 4]]), group("e2", [[4, 4]])], 4, 1.5)
    for position, gap in enumerate((0.002, 0.3, 2.0)):
        stats.add(position, torch.tensor([-1.0 + gap, -1.0]), torch.tensor([-1.0, -1.0]))
    return stats.metrics()


def test_the_mismatch_card_shows_the_last_steps_histogram_and_its_rows():
    pool = pool_of({"engine-0": FakeEngine(True)})
    html, _ = page_of(pool, [report(1), report(2, **_mismatch_keys())])
    page = Page(html)
    card = page.text["mismatch"]
    assert page.inside("plot-mismatch", "rect", "bar") == 7               # one bar per bucket
    assert page.inside("plot-mismatch-steps", "circle", "pt") == 2        # step 2's mean and worst sequence
    assert "e<1>" in card and "e<1>" not in html.replace("e&lt;1&gt;", "")  # escaped
    assert "age 0" in card and "age 1" in card and "33.3%" in card        # 2.0 nats: mean exp|d| 4.2 > 1.5
    assert "1.0e+00" in card and "step 2" in card and "&gt; 1.5" in html  # max of the sequence means: 2.0 / 2
    got = pool.fleet.metrics.render().decode()
    assert 'inflight_logprob_mismatch_over_threshold_share{age="all",engine="all"} 0.3333333333333333' in got
    assert 'inflight_logprob_mismatch_sequences{age="all",engine="e<1>"} 2.0' in got
    assert 'inflight_logprob_mismatch_max{age="1",engine="all"} 0.15' in got
    assert 'inflight_logprob_mismatch_hist{le="1"} 2.0' in got and 'inflight_logprob_mismatch_threshold 1.5' in got


def test_the_mismatch_card_without_statistics_says_so():
    page = Page(page_of(pool_of({"engine-0": FakeEngine(True)}), [report(1)])[0])
    assert "no mismatch statistics" in page.text["mismatch"]
    assert not any(a.get("id") == "plot-mismatch" for _, a in page.elements)
