"""Synchronous GRPO, the baseline: generate -> train -> refit, one after the other.

    for k = 1..N:
        schedule prompts of step k and wait for all their groups   (v(k-1), on-policy)
                                                                    (the run ends early when grpo.max_num_epochs
                                                                     of data cannot fill step k)
        train step k                                                -> v(k)
        push v(k)

With colocated generation on GPU the engines sleep while the learner trains
(their memory is freed for Megatron) and wake up for the refit.
"""
from __future__ import annotations

from services.job.learner_job import LearnerJob
from services.job.run_log import StepTimer


def run_sync(job: LearnerJob, colocated: bool) -> None:
    job.start(prefetch=0)
    for step in job.steps(ahead=0):                 # schedules the prompts of step k first
        timer = StepTimer()
        with timer.phase("generation_exposed"):
            groups = job.collect(step)
        with timer.phase("policy_training"):
            if colocated:
                job.sleep_engines()
            metrics = job.train(groups)
        with timer.phase("refit"):
            if colocated:
                job.wake_engines()
            job.push_weights()
        job.finish_step(step, metrics, timer)
