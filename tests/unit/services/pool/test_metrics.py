"""The pool's Prometheus metrics (services/pool/metrics.py): a learner step report folded into the gauges."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.pool.metrics import PoolMetrics


def samples(metrics: PoolMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_step_statistics_reach_their_gauges():
    m = PoolMetrics()
    m.record_step({"step": 3, "reward_mean": 0.5, "reward_format_mean": 0.75, "reward_math_verify_mean": 0.25,
                   "response_length_mean": 12.5, "truncation_rate": 0.125, "token_entropy_mean": 1.5,
                   "dynamic_sampling_dropped": 3.0, "dynamic_sampling_attempts": 1.75,
                   "dynamic_sampling_exhausted": 2.0, "val_accuracy": 0.4})
    m.record_step({"step": 4, "dynamic_sampling_exhausted": 1.0})
    got = samples(m)
    assert got[("inflight_reward_function_mean", (("function", "format"),))] == 0.75
    assert got[("inflight_reward_function_mean", (("function", "math_verify"),))] == 0.25
    assert not any(k[0] == "inflight_reward_function_mean" and k[1] == (("function", ""),) for k in got)
    assert got[("inflight_response_length_mean", ())] == 12.5 and got[("inflight_truncation_rate", ())] == 0.125
    assert got[("inflight_token_entropy_mean", ())] == 1.5 and got[("inflight_val_accuracy", ())] == 0.4
    assert got[("inflight_dynamic_sampling_dropped", ())] == 3.0
    assert got[("inflight_dynamic_sampling_attempts", ())] == 1.75
    assert got[("inflight_dynamic_sampling_exhausted_groups_total", ())] == 3.0
    assert got[("inflight_reward_mean", ())] == 0.5 and got[("inflight_learner_step", ())] == 4


def test_an_engines_environment_counters_reach_metrics_by_environment_as_deltas():
    from dataclasses import replace

    from pool_fakes import FakeEngine, engine_stats, pool_of
    from rollout.counters import EnvCounters

    p = pool_of({"e0": FakeEngine(ok=True)})
    env = EnvCounters("judge", episodes=4, turns=9, env_tokens=120, env_failures=1, episodes_truncated=2,
                      env_wait_seconds=0.5, calls={"ok": 12, "timeout": 1, "http_5xx": 2}, retries=3)
    p.watcher._count("e0", engine_stats(50, 2, incarnation="1.1", env=env))
    p.watcher._count("e0", engine_stats(60, 3, incarnation="1.1", env=replace(
        env, episodes=6, calls={"ok": 15, "timeout": 1, "http_5xx": 2})))
    p.watcher._count("e0", engine_stats(5, 1, incarnation="1.2",  # vLLM restarted: from 0
                                        env=EnvCounters("judge", episodes=1, env_failures=0, env_wait_seconds=0.0,
                                                        calls={"malformed": 1})))
    got = samples(p.fleet.metrics)
    judge = (("env", "judge"),)
    assert got[("inflight_env_episodes_total", judge)] == 7
    assert got[("inflight_env_turns_total", judge)] == 9 and got[("inflight_env_tokens_total", judge)] == 120
    assert got[("inflight_env_failed_samples_total", judge)] == 1
    assert got[("inflight_env_truncated_episodes_total", judge)] == 2
    assert got[("inflight_env_wait_seconds_total", judge)] == 0.5
    assert got[("inflight_env_calls_total", (("env", "judge"), ("outcome", "ok")))] == 15
    assert got[("inflight_env_calls_total", (("env", "judge"), ("outcome", "http_5xx")))] == 2
    assert got[("inflight_env_calls_total", (("env", "judge"), ("outcome", "malformed")))] == 1
    assert got[("inflight_env_retries_total", judge)] == 3
    assert got[("inflight_generation_tokens_total", ())] == 65


def test_mismatch_gauges_hold_the_last_step_only_and_odd_values_are_skipped():
    m = PoolMetrics()
    m.record_step({"step": 1, "logprob_mismatch_mean": 0.5, "logprob_mismatch_mean_engine_e0": 0.25,
                   "logprob_mismatch_mean_engine_e1": 0.75, "logprob_mismatch_sequences_age_2": 3.0,
                   "logprob_mismatch_hist_le_0.1": 4.0, "logprob_mismatch_hist_le_oops": 1.0,
                   "logprob_mismatch_max": float("nan"), "logprob_mismatch_token_max": True,
                   "logprob_mismatch_threshold": 1.5})
    got = samples(m)
    assert got[("inflight_logprob_mismatch_mean", (("age", "all"), ("engine", "all")))] == 0.5
    assert got[("inflight_logprob_mismatch_mean", (("age", "all"), ("engine", "e1")))] == 0.75
    assert got[("inflight_logprob_mismatch_sequences", (("age", "2"), ("engine", "all")))] == 3.0
    assert got[("inflight_logprob_mismatch_hist", (("le", "0.1"),))] == 4.0
    assert got[("inflight_logprob_mismatch_threshold", ())] == 1.5
    assert not any(k[0] in ("inflight_logprob_mismatch_max", "inflight_logprob_mismatch_token_max") for k in got)
    m.record_step({"step": 2, "logprob_mismatch_mean": 0.125, "logprob_mismatch_mean_engine_e0": 0.125})
    got = samples(m)
    assert got[("inflight_logprob_mismatch_mean", (("age", "all"), ("engine", "e0")))] == 0.125
    assert ("inflight_logprob_mismatch_mean", (("age", "all"), ("engine", "e1"))) not in got  # engine e1 left
    assert not any(k[0] == "inflight_logprob_mismatch_hist" for k in got)
    m.record_step({"step": 3, "reward_mean": 0.5})  # a row without the keys (validation) keeps the last step's
    assert samples(m)[("inflight_logprob_mismatch_mean", (("age", "all"), ("engine", "all")))] == 0.125
