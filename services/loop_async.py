"""Asynchronous lag-1 ("1-off") GRPO.

Generation of step k+1 overlaps training of step k:

    push v0; schedule prompts of step 1
    for k = 1..N:
        schedule prompts of step k+1       (the pool generates them with v(k-1) ...)
        wait for the groups of step k      (generated with v(k-2); age 1 in steady state)
        train step k                       -> v(k)
        push v(k) in flight                (... and finishes them with v(k): tokens carry versions)

The learner only waits for generation when the pool is slower than training
("generation exposed"). Groups older than ``max_trajectory_age_steps`` are
dropped by the buffer and replaced, never trained on.
"""
from __future__ import annotations

from services.job import LearnerJob, StepTimer


def run_async(job: LearnerJob) -> None:
    job.start(prefetch=True)                        # weights v(step) on every engine; prompts of the next step
    for step in job.steps():
        timer = StepTimer()
        job.schedule(step + 1)                      # overlaps with everything below
        with timer.phase("generation_exposed"):
            groups = job.collect(step)              # exactly num_prompts_per_step fresh-enough groups
        with timer.phase("policy_training"):
            metrics = job.train(groups)
        with timer.phase("refit"):
            job.push_weights()                      # in flight: engines pause(keep), load, resume
        job.finish_step(step, metrics, timer)       # parity probe, metrics, checkpoint
