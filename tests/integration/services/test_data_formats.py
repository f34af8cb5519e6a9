"""Each data format (JSONL, Parquet, CSV, ``save_to_disk``) through the real sync loop for 2 steps on the session's
data pool: the steps run and every trained prompt is a row of the file (its id names the row, its answer is the
row's). One learner serves the four jobs one after the other."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_pool import data_recipe, write_problems

ROWS, START = 24, 500
"""Rows written per file; the first row's number (so the answers are not those of another test's file)."""


def _write(fmt: str, tmp_path: Path) -> Path:
    import datasets

    jsonl = write_problems(tmp_path / "rows.jsonl", ROWS, start=START)
    if fmt == "jsonl":
        return jsonl
    ds = datasets.Dataset.from_json(str(jsonl), cache_dir=str(tmp_path / "cache"))
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "rows.parquet"))
        return tmp_path / "rows.parquet"
    if fmt == "csv":
        ds.to_csv(str(tmp_path / "rows.csv"), index=False)
        return tmp_path / "rows.csv"
    ds.save_to_disk(str(tmp_path / "disk"))
    return tmp_path / "disk"


@pytest.fixture(scope="module")
def learner(data_pool, fresh_learner):
    """The session's learner, fresh for this module; its tests train it on, one job after another."""
    from services.models.source import resolve_model

    model_path = resolve_model(data_pool.policy.model_name)
    return fresh_learner(data_pool, model_path), model_path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "save_to_disk"])
def test_each_format_trains_two_steps_on_its_rows(data_pool, learner, tmp_path: Path, fmt: str):
    from services import pool as pool_api
    from services.job.learner_job import LearnerJob
    from services.job.loop_sync import run_sync

    group, model_path = learner
    path = _write(fmt, tmp_path)
    recipe = data_recipe("grpo.max_num_steps=2", "data.dataset_name=null", f"data.train_data_path={path}",
                         "checkpointing.enabled=false")
    job = LearnerJob(recipe, model_path, pool_api.connect(data_pool.rollout_pool.name), group, tmp_path / "run",
                     resume=False)
    try:
        run_sync(job, colocated=False)
        trained = dict(job.book.ledger.trained)
    finally:
        job.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert len(trained) == 2 * recipe.grpo.num_prompts_per_step
    for pid in trained:  # "row-<i>@<epoch>": row i of the file, written from START + i
        i = int(pid.removeprefix("row-").split("@")[0])
        assert pid.startswith("row-") and 0 <= i < ROWS, pid
    source = job.book.source
    assert source.counts()["data_dropped_too_long"] == 0 and len(source) == ROWS
    first = source.set.get(0)
    assert first.task["answer"] == str(START % 50 + (7 * START) % 50) and first.task["level"] == START % 3


def test_the_last_epoch_ends_a_sync_run_early_with_a_checkpoint_of_its_last_step(data_pool, learner, tmp_path: Path):
    """10 rows, 4 prompts a step, one epoch: two steps run (not max_num_steps=5) and step 2 is checkpointed although
    it is not a multiple of save_period."""
    from services import pool as pool_api
    from services.job.learner_job import LearnerJob
    from services.job.loop_sync import run_sync

    group, model_path = learner
    path = write_problems(tmp_path / "rows.jsonl", 10, start=START)
    recipe = data_recipe("grpo.max_num_steps=5", "grpo.max_num_epochs=1", "data.dataset_name=null",
                         f"data.train_data_path={path}", "checkpointing.save_period=4")
    job = LearnerJob(recipe, model_path, pool_api.connect(data_pool.rollout_pool.name), group, tmp_path / "run",
                     resume=False)
    try:
        run_sync(job, colocated=False)
    finally:
        job.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["data_epoch"] == 0
    assert (tmp_path / "run" / "results" / "checkpoints" / "latest").read_text().strip() == "step_000002"
