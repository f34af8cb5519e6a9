"""The run log (services/job/run_log.py): metrics.jsonl, the seed's tables, the reward plot, a resume's rewrite."""
from __future__ import annotations

import json

from services.job.run_log import RunLog, StepTimer


def test_rows_tables_and_plot(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.write({"step": step, "reward_mean": 0.1 * step, "step_s": 10.0 * step, "policy_training_s": 2.0,
                   "generation_exposed_s": 1.0, "refit_s": 0.5, "other_s": 0.5, "gen_kl_error": 1e-4 * step,
                   "policy_kl_error": 0.0, "probs_ratio_mean": 1.0, "trajectory_age_mean": 1.0})
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    timing = log.timing_table("async")
    assert "| async | 25.00s | 2.00s | 1.00s | 0.50s | 0.50s |" in timing  # step 1 dropped as warm-up
    val = log.validation_table("async")
    assert "| async | 3 | 0.2000 | 2.00e-04 | 3.00e-04 |" in val
    png = log.plot_rewards()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(RunLog(tmp_path, tensorboard=False).rows) == 3  # a resumed run keeps the history


def test_a_resume_forgets_the_rows_after_its_checkpoint(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3, 4):
        log.write({"step": step, "reward_mean": 0.1 * step})
    resumed = RunLog(tmp_path, tensorboard=False)
    resumed.truncate_after(2)
    resumed.write({"step": 3, "reward_mean": 0.9})
    assert [r["step"] for r in resumed.rows] == [1, 2, 3]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["reward_mean"] for l in lines] == [0.1, 0.2, 0.9]
    assert len(RunLog(tmp_path, tensorboard=False).rows) == 3
    RunLog(tmp_path / "fresh", tensorboard=False).truncate_after(5)  # nothing written yet: nothing to rewrite


def test_step_timer_splits_phases():
    t = StepTimer()
    with t.phase("policy_training"):
        sum(range(10000))
    s = t.summary()
    assert s["generation_exposed_s"] == 0.0 and s["refit_s"] == 0.0
    assert abs(s["step_s"] - (s["policy_training_s"] + s["other_s"])) < 1e-9


class _Writer:
    """A stand-in for TensorBoard's SummaryWriter; ``fail`` names the method that raises."""

    fail = ""

    def __init__(self, logdir: str):
        if self.fail == "init":
            raise OSError("no space left on device")
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.fail == "add_scalar":
            raise OSError("no space left on device")
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fake_tensorboard(monkeypatch, fail: str) -> None:
    import sys
    import types

    import torch.utils  # the real parents; only the tensorboard module is replaced

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = type("Writer", (_Writer,), {"fail": fail})
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)


def _tb_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "TensorBoard" in r.getMessage()]


def test_a_tensorboard_that_cannot_start_is_reported_once_and_metrics_jsonl_still_written(tmp_path, monkeypatch,
                                                                                         caplog):
    _fake_tensorboard(monkeypatch, fail="init")
    with caplog.at_level("WARNING"):
        log = RunLog(tmp_path, tensorboard=True)
        log.write({"step": 1, "reward_mean": 0.5})
        log.write({"step": 2, "reward_mean": 0.6})
    warnings = _tb_warnings(caplog)
    assert len(warnings) == 1 and "no space left on device" in warnings[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_tensorboard_write_that_fails_is_reported_once_and_the_other_sinks_go_on(tmp_path, monkeypatch, caplog):
    _fake_tensorboard(monkeypatch, fail="add_scalar")
    with caplog.at_level("WARNING"):
        log = RunLog(tmp_path, tensorboard=True)
        for step in (1, 2, 3):
            log.write({"step": step, "reward_mean": 0.1 * step})  # used to raise out of the training loop
    warnings = _tb_warnings(caplog)
    assert len(warnings) == 1 and "OSError: no space left on device" in warnings[0]
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [r["step"] for r in log.rows] == [1, 2, 3]
    log.close()
