"""A rollout pool that scores math answers (``env.math``), shared by the data, validation and reward tests,
and the recipes of the jobs attached to it. The ``data_pool`` fixture (conftest.py) deploys it once per session."""
from __future__ import annotations

import json
from pathlib import Path

from services.recipe.config import Recipe, load_recipe

POOL_NAME = "inflight-data-pool"
POOL_OVERRIDES = (
    f"rollout_pool.name={POOL_NAME}", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
    "env.math.reward_functions=[{name: math_verify, weight: 1.0}]", "env.math.num_workers=2",
    "logger.tensorboard_enabled=false", "checkpointing.save_period=1",
)


def data_recipe(*overrides: str) -> Recipe:
    """A job recipe for the data pool (its ``env`` and pool name), with ``overrides`` applied last."""
    return load_recipe(None, [*POOL_OVERRIDES, *overrides])


def write_problems(path: Path, n: int, start: int = 0) -> Path:
    """``n`` rows ``{"input": "What is a plus b?", "output": "<sum>", "level": i % 3}`` as JSONL."""
    with path.open("w") as f:
        for i in range(start, start + n):
            a, b = i % 50, (7 * i) % 50
            f.write(json.dumps({"input": f"What is {a} plus {b}?", "output": str(a + b), "level": i % 3}) + "\n")
    return path


class RecordingLearner:
    """A learner group that keeps each batch it is asked to train on (decoded groups, one list per step)."""

    def __init__(self, learner):
        self.learner = learner
        self.batches: list[list] = []

    def train_step(self, group_refs: list, images: dict | None = None) -> dict:
        import ray

        from protocol import TrajectoryGroup, decode

        self.batches.append([decode(ray.get(ref), expect=TrajectoryGroup) for ref in group_refs])
        return self.learner.train_step(group_refs, images)

    def __getattr__(self, name: str):
        return getattr(self.learner, name)


def run_recorded_async(fresh_learner, recipe: Recipe, run_dir: Path):
    """Run ``recipe`` as an async job on its pool (``rollout_pool.name``: the data pool for :func:`data_recipe`) with
    a fresh learner (the session's, built again: the ``fresh_learner`` fixture); returns the closed job and the
    recording of what it trained on."""
    from services import pool as pool_api
    from services.job.learner_job import LearnerJob
    from services.job.loop_async import run_async
    from services.models.source import resolve_model

    model_path = resolve_model(recipe.policy.model_name)
    learner = fresh_learner(recipe, model_path)
    recording = RecordingLearner(learner)
    job = LearnerJob(recipe, model_path, pool_api.connect(recipe.rollout_pool.name), recording,  # type: ignore[arg-type]
                     run_dir, resume=False)
    try:
        run_async(job)
    finally:
        job.close()
        learner.shutdown()
    return job, recording
