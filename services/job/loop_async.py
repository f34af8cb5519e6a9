"""Asynchronous GRPO with lag A = ``grpo.async_grpo.max_trajectory_age_steps`` (A = 1: "1-off").

Generation runs up to A steps ahead of training:

    push v0; schedule prompts of steps 1..A
    for k = 1..N:
        schedule prompts of step k+A       (the pool generates them with v(k-1) ...)
        wait for the groups of step k      (generated with v(k-1-A); age A in steady state)
        train step k                       -> v(k)
        push v(k) in flight                (... and finishes them with v(k): tokens carry versions)

The learner only waits for generation when the pool is slower than training
("generation exposed"). Groups with a token more than A versions old are
dropped by the buffer and replaced, never trained on.
"""
from __future__ import annotations

from services.job.learner_job import LearnerJob
from services.job.run_log import StepTimer


def run_async(job: LearnerJob) -> None:
    ahead = job.recipe.grpo.async_grpo.max_trajectory_age_steps
    job.start(prefetch=ahead)                       # weights v(step) on every engine; prompts of the next A steps
    for step in job.steps(ahead):                   # schedules step+A first: overlaps with everything below
        timer = StepTimer()
        with timer.phase("generation_exposed"):
            groups = job.collect(step)              # exactly num_prompts_per_step fresh-enough groups
        with timer.phase("policy_training"):
            metrics = job.train(groups)
        with timer.phase("refit"):
            job.push_weights()                      # in flight: engines pause(keep), load, resume
        job.finish_step(step, metrics, timer)       # parity probe, metrics, checkpoint
