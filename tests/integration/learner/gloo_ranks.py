"""Learner ranks as gloo processes on this machine, for the tests that compare several ranks with one process.

A worker is a module-level function ``worker(rank, port, *args)`` that calls :func:`become_rank` first;
:func:`run_ranks` starts ``world`` of them on a free port and waits for them, bounded. Inside a worker,
:func:`check_checkpoint_round_trip` checks save, step, restore, step again on that rank.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from services.cluster.head import free_port


def become_rank(rank: int, world: int, port: int) -> None:
    """This process is rank ``rank`` of ``world`` (torch.distributed's environment, one thread, quiet warnings)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")


def run_ranks(worker: Callable[..., None], *args, world: int = 2, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, port, *args)`` in ``world`` spawned processes; killed and a TimeoutError naming ``what``
    if they have not all finished within ``timeout_s`` (a rank's exception is raised by ``join``)."""
    ctx = mp.start_processes(worker, args=(free_port(), *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{what} did not finish within {timeout_s} s")


TIMINGS = ("policy_training_s", "tokens_per_s")
"""Step metrics that are wall-clock times, not results (left out of equality checks)."""


def check_checkpoint_round_trip(learner, batch, ckpt_dir: str, who: str) -> None:
    """Save ``learner``'s checkpoint in ``ckpt_dir``, step on ``batch``, restore, step again: this rank's
    parameters and step metrics (times aside) must be bit-identical; ``who`` names the rank in failures."""
    learner.save_checkpoint(ckpt_dir)
    m_a = learner.train_step(batch)
    params_a = {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}
    learner.load_checkpoint(ckpt_dir)
    m_b = learner.train_step(batch)
    for k, v in learner.gpt.named_parameters():
        assert torch.equal(v, params_a[k]), f"{who}: {k} differs after restore"
    assert {k: v for k, v in m_a.items() if k not in TIMINGS} == {k: v for k, v in m_b.items() if k not in TIMINGS}
