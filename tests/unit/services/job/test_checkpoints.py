"""A learner job's checkpoints (services/job/checkpoints.py): where they go, the job's state round trip, keep_top_k,
and a job that resumes from one (its book, parity set and run log)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from job_fakes import FakeLearner, FakePool, ListChannel, group, make_job

from protocol import encode
from services.job.checkpoints import Checkpoints, JobState
from services.job.prompt_book import BookState


class SavingLearner(FakeLearner):
    """Makes each checkpoint's directory with the files a one-rank save leaves (``meta.json``, ``rank_00000.pt``,
    here empty) and keeps its ``extra`` (the learner's ranks write all of it)."""

    def __init__(self, version: int = 0):
        super().__init__(version)
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.saved[path] = extra
        Path(path).mkdir()
        (Path(path) / "meta.json").write_text(json.dumps({"step": extra["step"], "world_size": 1}))
        (Path(path) / "rank_00000.pt").write_bytes(b"")

    def save_hf(self, path: str) -> None:
        self.calls.append(("save_hf", path))

    def load_checkpoint(self, path: str) -> dict:
        self.calls.append("load_checkpoint")
        return self.saved[path]


def cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"enabled": True, "checkpoint_dir": "ckpt", "save_period": 2, "keep_top_k": 2,
                              "metric_name": None, "higher_is_better": True, "save_hf": False, **kw})


def state(step: int) -> JobState:
    book = BookState({"epoch": 0, "index": step}, {"scheduled": {}, "trained": {}, "dropped": {}}, [], [], {})
    return JobState(step, book, [([1, 2], [3])])


def test_saves_are_due_every_period_and_after_the_last_step(tmp_path):
    ck = Checkpoints(cfg(), tmp_path)
    assert [s for s in range(1, 8) if ck.due(s, last_step=7)] == [2, 4, 6, 7]
    assert not Checkpoints(cfg(enabled=False), tmp_path).due(2, 7)
    assert Checkpoints(cfg(checkpoint_dir=str(tmp_path / "abs")), tmp_path / "run").root == tmp_path / "abs"


def test_the_latest_is_loaded_and_only_keep_top_k_are_kept(tmp_path):
    learner, ck = SavingLearner(), Checkpoints(cfg(), tmp_path)
    assert ck.load_latest(learner) is None
    for step in (2, 4, 6):
        ck.save(learner, state(step))
    assert sorted(p.name for p in ck.root.glob("step_*")) == ["step_000004", "step_000006"]
    path, loaded = ck.load_latest(learner)
    assert path == tmp_path / "ckpt" / "step_000006" and loaded == state(6)
    assert json.dumps(state(6).extra(), sort_keys=True) == json.dumps(learner.saved[str(path)], sort_keys=True)


def test_save_hf_writes_a_hugging_face_directory_in_each_checkpoint(tmp_path):
    learner = SavingLearner()
    path = Checkpoints(cfg(save_hf=True), tmp_path).save(learner, state(2))
    assert learner.calls == [("save_hf", str(path / "hf"))]
    Checkpoints(cfg(), tmp_path).save(learner, state(4))
    assert len(learner.calls) == 1  # off by default


def test_a_job_resumes_its_book_parity_set_and_run_log_from_its_checkpoint(monkeypatch, tmp_path):
    learner = SavingLearner(version=2)
    job = make_job(monkeypatch, tmp_path, pool=FakePool(ListChannel()), learner=learner)
    job.schedule(1)
    job.schedule(2)
    first, second = job.book.ledger.scheduled
    job.book.receive(encode(group(first, 1)))
    job.parity.sequences = [([1, 2], [3, 4])]
    job.step = 1
    for step in (1, 2):
        job.log.write({"step": step})
    job.save_checkpoint()
    job.close()

    pool = FakePool(ListChannel())
    resumed = make_job(monkeypatch, tmp_path, pool=pool, learner=learner)
    assert resumed.step == 0  # make_job builds a fresh job ...
    resumed._resume()         # ... and this is what resume=True does in the constructor
    assert resumed.step == 1 and resumed.version == 2 and resumed.parity.sequences == [([1, 2], [3, 4])]
    assert resumed.book.ledger.pending() == {first: 1, second: 2} and resumed.book.buffer.holds(first)
    assert [r["step"] for r in resumed.log.rows] == [1]
    resumed.start(prefetch=1)
    assert [pid for _, pid in pool.submitted] == [second]  # the outstanding prompt, nothing new
