"""The ``latest`` marker (services/job/checkpoint_marker.py, issue 32.5): written atomically; when it is empty,
missing or names an incomplete step, the newest complete step is used with a warning; a symlink or a name
outside the checkpoint directory is refused, by a resume and by ``inflight export`` alike."""
from __future__ import annotations

import json
import logging
import os

import pytest
from test_checkpoints import SavingLearner, cfg, state

from services.job.checkpoint_marker import CheckpointRefused
from services.job.checkpoints import Checkpoints


def saved(tmp_path, steps=(14, 15, 16)) -> tuple[SavingLearner, Checkpoints]:
    learner, ck = SavingLearner(), Checkpoints(cfg(keep_top_k=5), tmp_path)
    for step in steps:
        ck.save(learner, state(step))
    return learner, ck


def test_a_kill_while_latest_is_written_leaves_the_previous_name(tmp_path, monkeypatch):
    learner, ck = saved(tmp_path)

    def killed(*_):
        raise KeyboardInterrupt("killed between writing and renaming")
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.save(learner, state(17))
    assert (ck.root / "latest").read_text() == "step_000016"  # old code: write_text had emptied and rewritten it


@pytest.mark.parametrize("content", ["", "step_000099", "garbage"])
def test_an_unusable_latest_falls_back_to_the_newest_complete_step_with_a_warning(tmp_path, caplog, content):
    learner, ck = saved(tmp_path)
    (ck.root / "step_000017").mkdir()  # a save killed before its files: not complete, never chosen
    (ck.root / "latest").write_text(content)
    with caplog.at_level(logging.WARNING, logger="inflight.checkpoints"):
        path, loaded = ck.load_latest(learner)
    assert path == ck.root / "step_000016" and loaded.step == 16
    assert "using the newest complete checkpoint, step_000016" in caplog.text


def test_a_missing_latest_with_complete_steps_resumes_from_the_newest(tmp_path):
    learner, ck = saved(tmp_path)
    (ck.root / "latest").unlink()
    assert ck.latest() == ck.root / "step_000016"
    (ck.root / "step_000016" / "rank_00000.pt").unlink()  # a rank file missing: incomplete
    assert ck.latest() == ck.root / "step_000015"


def test_a_step_of_two_ranks_is_complete_only_with_both_rank_files(tmp_path):
    _, ck = saved(tmp_path, steps=(1, 2))
    meta = ck.root / "step_000002" / "meta.json"
    meta.write_text(json.dumps({"step": 2, "world_size": 2}))
    assert ck.latest() == ck.root / "step_000001"
    (ck.root / "step_000002" / "rank_00001.pt").write_bytes(b"")
    assert ck.latest() == ck.root / "step_000002"


def test_latest_pointing_outside_the_checkpoint_directory_is_refused(tmp_path):
    learner, ck = saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("../outside", str(outside), ".."):
        (ck.root / "latest").write_text(name)
        with pytest.raises(CheckpointRefused, match="outside the checkpoint directory"):
            ck.load_latest(learner)
    assert "load_checkpoint" not in learner.calls


def test_a_symlinked_latest_or_step_directory_is_refused(tmp_path):
    learner, ck = saved(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step_000020").mkdir(parents=True)
    (ck.root / "latest").unlink()
    (ck.root / "latest").symlink_to(elsewhere / "marker")
    with pytest.raises(CheckpointRefused, match="is a symlink"):
        ck.load_latest(learner)
    (ck.root / "latest").unlink()
    (ck.root / "step_000020").symlink_to(elsewhere / "step_000020", target_is_directory=True)
    (ck.root / "latest").write_text("step_000020")
    with pytest.raises(CheckpointRefused, match="a symlink: refused"):
        ck.load_latest(learner)
    with pytest.raises(CheckpointRefused, match="is a symlink"):
        ck.step(20)
    (ck.root / "latest").write_text("step_000016")
    assert ck.latest() == ck.root / "step_000016"  # the symlinked step is never chosen by the fallback
    (ck.root / "latest").unlink()
    assert ck.latest() == ck.root / "step_000016"
