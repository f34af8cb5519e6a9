"""``inflight run`` on an existing run directory (services/run_resume.py, issue 33.1): it resumes from the latest
complete checkpoint and says so in one line; a run with rows but no checkpoint is refused; ``--fresh`` moves the
earlier run's files to ``RUN_DIR/previous/<time>`` and starts at step 1. No Ray: ``run_embedded`` is replaced."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import app

from services.console import output as console
from services.run_resume import PREVIOUS, RunDirError, RunStart, run, start_or_resume


@pytest.fixture(scope="module")
def recipe():
    from services.recipe.config import load_recipe

    return load_recipe(None, ["grpo.max_num_steps=4"])


def checkpoint(run_dir: Path, step: int, root: Path | None = None) -> Path:
    """A complete one-rank checkpoint of ``step`` named by ``latest``."""
    root = root or run_dir / "results" / "checkpoints"
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 1}))
    (path / "rank_00000.pt").write_bytes(b"")
    (root / "latest").write_text(path.name)
    return path


def rows(run_dir: Path, *steps: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))


@pytest.fixture
def started(monkeypatch):
    """What ``run`` hands to ``run_embedded`` (nothing starts)."""
    calls: list[tuple[Path, bool]] = []
    monkeypatch.setattr(console, "setup", lambda run_dir, verbose=False: None)
    monkeypatch.setattr(app, "run_embedded", lambda recipe, run_dir, resume=False: calls.append((run_dir, resume)))
    return calls


def test_a_new_or_empty_directory_starts_at_step_1(recipe, tmp_path):
    assert start_or_resume(recipe, tmp_path / "new", fresh=False) == RunStart(None, 0)
    assert start_or_resume(recipe, tmp_path, fresh=False) == RunStart(None, 0)


def test_a_directory_with_a_checkpoint_resumes_from_it_in_one_line(recipe, tmp_path, started, capsys):
    rows(tmp_path, 1, 2, 3)  # step 3 ran after the step-2 checkpoint: the job truncates it on resume
    ckpt = checkpoint(tmp_path, 2)
    assert start_or_resume(recipe, tmp_path, fresh=False) == RunStart(ckpt, 2)
    assert run(recipe, tmp_path) == 0
    assert started == [(tmp_path, True)]  # before: resume=False, steps 1.. again, appended to metrics.jsonl
    assert capsys.readouterr().err == (f"inflight: resuming {tmp_path} from step_000002 (step 2): steps 3..4 "
                                       "follow; --fresh starts over\n")


def test_a_run_already_at_its_last_step_starts_nothing(recipe, tmp_path, started, capsys):
    checkpoint(tmp_path, 4)
    assert run(recipe, tmp_path) == 0 and started == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is at step 4 already" in err and "raise --steps" in err, err


def test_rows_without_a_checkpoint_are_refused_in_one_line(recipe, tmp_path, started, capsys):
    rows(tmp_path, 1, 2, 3)
    with pytest.raises(RunDirError, match=r"metrics.jsonl: steps 1..3\) but no complete checkpoint"):
        start_or_resume(recipe, tmp_path, fresh=False)
    assert run(recipe, tmp_path) == 2 and started == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --fresh to start over" in err, err


def test_fresh_moves_the_earlier_run_aside_and_starts_at_step_1(recipe, tmp_path, started, capsys):
    rows(tmp_path, 1, 2)
    checkpoint(tmp_path, 2)
    (tmp_path / "logs").mkdir()
    assert run(recipe, tmp_path, fresh=True) == 0 and started == [(tmp_path, False)]
    [moved] = (tmp_path / PREVIOUS).iterdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [PREVIOUS]
    assert sorted(p.name for p in moved.iterdir()) == ["logs", "metrics.jsonl", "results"]
    assert (moved / "results" / "checkpoints" / "latest").read_text() == "step_000002"
    assert f"moved to {moved}" in capsys.readouterr().err
    assert start_or_resume(recipe, tmp_path, fresh=False) == RunStart(None, 0)  # previous/ is not resumed from


def test_fresh_moves_a_checkpoint_directory_outside_the_run_aside_in_place(recipe, tmp_path):
    outside = tmp_path / "ckpts"
    moved = recipe.model_copy(update={"checkpointing": recipe.checkpointing.model_copy(
        update={"checkpoint_dir": str(outside)})})
    checkpoint(tmp_path / "run", 3, root=outside)
    (outside / "unrelated.txt").write_text("kept")
    assert start_or_resume(moved, tmp_path / "run", fresh=False).step == 3
    start_or_resume(moved, tmp_path / "run", fresh=True)
    [aside] = outside.glob(f"{PREVIOUS}-*")
    assert sorted(p.name for p in aside.iterdir()) == ["latest", "step_000003"]
    assert sorted(p.name for p in outside.iterdir()) == sorted([aside.name, "unrelated.txt"])


def test_a_symlinked_latest_is_refused_with_the_way_out(recipe, tmp_path):
    checkpoint(tmp_path, 2)
    latest = tmp_path / "results" / "checkpoints" / "latest"
    latest.unlink()
    latest.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match="is a symlink.*or pass --fresh"):
        start_or_resume(recipe, tmp_path, fresh=False)



@pytest.fixture
def attach(monkeypatch):
    """``learner attach --run-dir DIR [more]`` in this process, and what it handed on: ("ray", address) when it
    connected, (run_dir, resume) when it called ``run_learner``. No Ray, no checks of the recipe's files."""
    import signal
    from types import SimpleNamespace

    from services import cli
    from services.cluster import ray_runtime

    calls: list[tuple] = []
    monkeypatch.setattr(cli, "check_recipe", lambda recipe, here: SimpleNamespace(raise_problems=lambda: None))
    monkeypatch.setattr(console, "setup", lambda run_dir, verbose=False: None)
    monkeypatch.setattr(cli, "_require_cluster", lambda cluster: "127.0.0.1:1")
    monkeypatch.setattr(ray_runtime, "connect", lambda address: calls.append(("ray", address)))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(app, "run_learner", lambda recipe, pool, run_dir, resume=True: calls.append((run_dir, resume)))

    def attach(run_dir: Path, *more: str) -> tuple[int, list[tuple]]:
        calls.clear()
        code = cli.main(["learner", "attach", "--pool", "p", "--run-dir", str(run_dir), *more, "grpo.max_num_steps=4"])
        return code, list(calls)
    return attach


def test_learner_attach_starts_resumes_refuses_and_starts_over_as_run_does(tmp_path, attach, capsys):
    ray = ("ray", "127.0.0.1:1")
    assert attach(tmp_path / "new") == (0, [ray, (tmp_path / "new", False)])
    rows(tmp_path / "old", 1, 2, 3)
    assert attach(tmp_path / "old") == (2, [])  # before: steps 1.. were appended to metrics.jsonl a second time
    assert "pass --fresh to start over" in capsys.readouterr().err
    checkpoint(tmp_path / "old", 2)
    assert attach(tmp_path / "old") == (0, [ray, (tmp_path / "old", True)])
    assert "from step_000002 (step 2): steps 3..4 follow" in capsys.readouterr().err
    checkpoint(tmp_path / "done", 4)
    assert attach(tmp_path / "done") == (0, [])  # at its last step: nothing connects
    assert attach(tmp_path / "old", "--fresh") == (0, [ray, (tmp_path / "old", False)])
    assert [p.name for p in (tmp_path / "old").iterdir()] == [PREVIOUS]
