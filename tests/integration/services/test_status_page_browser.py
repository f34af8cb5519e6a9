"""The pool's status page (``GET /``) in a real browser during a real CPU run.

Headless Chromium from Debian's ``chromium`` package, driven by playwright (never a downloaded browser), opens the
page of the session's data pool once; a learner job then trains 24 async steps in a thread. Without reloading, the
page must come to show that job's steps as plot points while it runs, then the pool's final version; it makes no
request outside the pool and logs no error (a script or style blocked by its Content-Security-Policy would). A
screenshot is kept as ``test-artifacts/status_page.png``; the assertions read the DOM.
"""
from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from data_pool import POOL_NAME, data_recipe, write_problems

from services.pool.status_page import RECENT_REFITS

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""Without the networking flags Chromium keeps trying to reach Google's services on a closed network."""
STEPS = 24
"""Enough for the page to update a few times while the job runs (a step of the data pool's tiny model takes
0.3-1 s here)."""

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: install Debian's chromium "
                                "package (`apt-get install -y chromium`; `make setup` does when apt-get is there)")

POINTS_OF = """([learner, n]) => document.getElementById("run")?.textContent.includes(learner)
    && document.querySelectorAll("#plot-reward circle.pt").length >= n"""
SNAPSHOT = """() => ({points: document.querySelectorAll("#plot-reward circle.pt").length,
    version: Number(document.getElementById("version").textContent)})"""
SHOWS_VERSION = """([version, n]) => document.getElementById("version")?.textContent === String(version)
    && document.querySelectorAll("#plot-reward circle.pt").length === n"""


@pytest.mark.timeout(300)
def test_status_page_shows_a_live_run_in_chromium(data_pool, fresh_learner, tmp_path: Path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    from services import pool as pool_api
    from services.job.learner_job import LearnerJob
    from services.job.loop_async import run_async
    from services.models.source import resolve_model

    url = f"http://{data_pool.rollout_pool.http_host}:{pool_api.http_port()}"
    data = write_problems(tmp_path / "train.jsonl", 4 * STEPS)
    recipe = data_recipe(f"grpo.max_num_steps={STEPS}", "data.dataset_name=null", f"data.train_data_path={data}",
                         "checkpointing.enabled=false")
    model_path = resolve_model(recipe.policy.model_name)
    learner = fresh_learner(recipe, model_path)
    job = LearnerJob(recipe, model_path, pool_api.connect(POOL_NAME), learner, tmp_path / "run", resume=False)
    failure: list[BaseException] = []

    def train():
        try:
            run_async(job)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            failure.append(exc)

    runner = threading.Thread(target=train, name="status-page-job", daemon=True)
    requests: list[str] = []
    problems: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True,
                args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
            try:
                page = browser.new_page()
                page.on("request", lambda r: requests.append(r.url))
                page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: problems.append(str(e)))
                page.goto(f"{url}/", wait_until="load")
                assert page.title() == f"{POOL_NAME} - Inflight pool"
                runner.start()
                page.wait_for_function(POINTS_OF, arg=[job.id, 2], timeout=180_000, polling=500)
                during = page.evaluate(SNAPSHOT) | {"alive": runner.is_alive()}
                runner.join(timeout=120)
                assert not runner.is_alive() and not failure, failure
                final = httpx.get(f"{url}/v1/status", timeout=10).json()["version"]
                try:
                    page.wait_for_function(SHOWS_VERSION, arg=[final, STEPS], timeout=30_000, polling=500)
                except PlaywrightTimeout:
                    raise AssertionError(f"after the run the page shows {page.evaluate(SNAPSHOT)}, not version "
                                         f"{final} and {STEPS} points; run: "
                                         f"{page.locator('#run').inner_text()[:300]!r}") from None
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "status_page.png"), full_page=True)
                learner_text = page.locator("#learner").inner_text()
                refits = page.locator("#refits tr").count()
                engines = page.locator("#engines").inner_text()
                phases = page.locator("#plot-phases rect.bar").count()
                kl_points = page.locator("#plot-kl circle.pt").count()
                mismatch = page.locator("#mismatch").inner_text()
                mismatch_bars = page.locator("#plot-mismatch rect.bar").count()
                mismatch_points = page.locator("#plot-mismatch-steps circle.pt").count()
                scrape = httpx.get(f"{url}/metrics", timeout=10).text
            finally:
                browser.close()
    finally:
        if runner.is_alive():
            runner.join(timeout=120)
        job.close()
        learner.shutdown()
    print(f"status page: during the run {during}; final version {final}; {len(requests)} requests")
    assert during["alive"] and 2 <= during["points"] < STEPS                # seen while the job trained
    assert during["version"] >= during["points"]                          # a step is reported after its push
    assert final == STEPS
    assert job.id in learner_text and f"step\t{STEPS}" in learner_text
    assert refits == 1 + RECENT_REFITS                                    # header + the last pushes
    assert "up" in engines and f"{POOL_NAME}-engine-0" in engines
    assert phases >= 2 * STEPS and kl_points >= STEPS                    # training + refit at least, probe KL
    assert len(requests) > 2 and all(r.startswith(url + "/") for r in requests), requests  # fetched again; no CDN
    assert not problems, problems
    assert mismatch_points > 0                                            # the mismatch over the steps
    _check_mismatch(mismatch, mismatch_bars, scrape, tmp_path / "run" / "metrics.jsonl")


def _check_mismatch(card: str, bars: int, scrape: str, metrics_jsonl: Path) -> None:
    """Issue 37 item 3 on the same run: the learner's per-sequence mismatch of the last step in metrics.jsonl (in
    total = over its one engine; lag 1: ages 0 and 1 only), on the status page (histogram and rows) and in the
    pool's /metrics."""
    import json

    row = json.loads(metrics_jsonl.read_text().splitlines()[-1])
    engine = f"{POOL_NAME}-engine-0"
    n = row["logprob_mismatch_sequences"]
    assert n > 0 and row[f"logprob_mismatch_sequences_engine_{engine}"] == n
    assert sum(row.get(f"logprob_mismatch_sequences_age_{a}", 0) for a in (0, 1)) == n
    assert sum(v for k, v in row.items() if k.startswith("logprob_mismatch_hist_le_")) == n
    assert 0 <= row["logprob_mismatch_mean"] <= row["logprob_mismatch_max"] <= row["logprob_mismatch_token_max"]
    assert row["logprob_mismatch_threshold"] == 2.0 and row["token_mult_prob_error"] >= 1.0
    assert bars == 7 and engine in card and f"step {STEPS}" in card, card
    assert f'inflight_logprob_mismatch_sequences{{age="all",engine="{engine}"}} {float(n)}' in scrape
