"""The Grafana dashboard (deploy/grafana/inflight-dashboard.json) is importable and queries only metrics the
pool's ``/metrics`` exposes; the Prometheus config scrapes the pool's default HTTP port."""
from __future__ import annotations

import json

import yaml
from grafana_names import DASHBOARD, dashboard_exprs, dashboard_names, metric_names, missing

from services.recipe.config import RolloutPoolConfig
from services.pool.metrics import PoolMetrics

PROMETHEUS = DASHBOARD.parents[1] / "prometheus" / "prometheus.yml"
REPORT = {"step": 3, "step_s": 2.0, "policy_training_s": 1.0, "generation_exposed_s": 0.5, "refit_s": 0.25,
          "other_s": 0.25, "trajectory_ages": [0, 1, 1, 2], "rejected": {"stale": 2}, "buffer_groups": 4,
          "reward_mean": 0.5, "reward_format_mean": 0.75, "gen_kl_error": 1e-4, "tokens_per_s": 900.0,
          "val_accuracy": 0.5, "val_reward_mean": 0.4, "val_pass_at_k": 0.75, "refit_bytes": 1024,
          # the learner's per-sequence mismatch (learner.mismatch_stats): total, one engine, one age, a bucket
          "logprob_mismatch_mean": 1e-3, "logprob_mismatch_max": 0.5, "logprob_mismatch_over_threshold_share": 0.25,
          "logprob_mismatch_mean_engine_engine-0": 1e-3, "logprob_mismatch_max_engine_engine-0": 0.5,
          "logprob_mismatch_mean_age_1": 1e-3, "logprob_mismatch_hist_le_0.001": 3.0, "logprob_mismatch_threshold": 2.0}


def scrape() -> str:
    m = PoolMetrics()
    m.record_step(REPORT)
    m.engine_up.labels(engine="engine-0").set(1)
    m.refit_seconds.observe(0.2)
    return m.render().decode()


def test_every_dashboard_metric_is_in_a_real_scrape():
    names = dashboard_names()
    assert len(names) >= 20, names
    assert missing(names, scrape()) == []


def test_the_check_catches_wrong_names():
    text = scrape()
    assert missing({"inflight_refit_bytes", "inflight_policy_versions", "inflight_refit_bytes_total_bucket",
                    "inflight_buffer_groups_count", "inflight_refit_seconds"}, text) == sorted(
        {"inflight_refit_bytes", "inflight_policy_versions", "inflight_refit_bytes_total_bucket",
         "inflight_buffer_groups_count", "inflight_refit_seconds"})
    assert missing({"inflight_refit_seconds_bucket", "inflight_refit_seconds_sum", "inflight_env_calls_total",
                    "inflight_refit_bytes_total"}, text) == []


def test_metric_names_leave_label_values_out():
    assert metric_names('sum by (le) (rate(inflight_refit_seconds_bucket{job="inflight_pool"}[5m]))') == {
        "inflight_refit_seconds_bucket"}


def test_every_expr_is_balanced():
    pairs = {")": "(", "]": "[", "}": "{"}
    for expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        stack: list[str] = []
        for c in expr:
            if c in "([{":
                stack.append(c)
            elif c in pairs:
                assert stack and stack.pop() == pairs[c], expr
        assert not stack, expr


def test_dashboard_is_importable_with_a_datasource_input():
    d = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p["title"]
    titles = {p["title"] for p in panels}
    for want in ("Policy version", "Reward mean", "Gen KL error", "Step time by phase", "Trajectory age",
                 "Buffer groups", "Generation tokens/s", "Refit seconds and bytes", "Refit pause", "Engine up",
                 "Rejected messages by reason", "Environment calls by outcome", "Failed samples per environment",
                 "Validation", "Learner tokens/s", "Log-prob mismatch", "Log-prob mismatch histogram"):
        assert want in titles, want
    step = next(p for p in panels if p["title"] == "Step time by phase")
    assert step["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_prometheus_scrapes_the_pool_default_port():
    conf = yaml.safe_load(PROMETHEUS.read_text())
    job = conf["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{RolloutPoolConfig().http_port}"]
