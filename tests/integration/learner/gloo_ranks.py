"""Learner ranks as gloo processes on this machine, for the tests that compare several ranks with one process.

A worker is a module-level function ``worker(rank, port, *args)`` that calls :func:`become_rank` first;
:func:`run_ranks` runs it in ``world`` rank processes on a free port and waits for them, bounded. The rank
processes are kept between calls (:class:`RankPool`: each call's worker joins a process group of its own and
leaves it at the end, but torch's, Megatron-Core's and the test modules' imports stay) and exit after
:data:`POOL_IDLE_S` without a call. Inside a worker, :func:`check_checkpoint_round_trip` checks save, step,
restore, step again on that rank.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import time
import traceback
import warnings
from collections.abc import Callable

import torch

from services.cluster.head import free_port

POOL_IDLE_S = 120.0
"""A rank process exits after this long without a call (the pool's memory goes back once the learner tests end)."""


def become_rank(rank: int, world: int, port: int) -> None:
    """This process is rank ``rank`` of ``world`` (torch.distributed's environment, one thread, quiet warnings)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")


def run_ranks(worker: Callable[..., None], *args, world: int = 2, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, port, *args)`` on each of ``world`` rank processes (a kept :class:`RankPool`); a rank's
    exception is raised here with its traceback, and past ``timeout_s`` the pool is killed and a TimeoutError names
    ``what``."""
    pool = _POOLS.get(world)
    if pool is None or not pool.usable():
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = RankPool(world)
    try:
        pool.run(worker, (free_port(), *args), timeout_s, what)
    except BaseException:
        _POOLS.pop(world).close()  # a rank may be anywhere in the worker: never reuse it
        raise


class RankPool:
    """``world`` spawned rank processes that run workers one call after another."""

    def __init__(self, world: int):
        ctx = multiprocessing.get_context("spawn")
        self.world, self.last_call = world, time.monotonic()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(rank, self.inboxes[rank], self.results),
                                  name=f"gloo-rank-{rank}") for rank in range(world)]
        for proc in self.procs:
            proc.start()

    def usable(self) -> bool:
        """Every rank alive and well inside its idle time (a rank about to exit must not be given a call)."""
        return all(p.is_alive() for p in self.procs) and time.monotonic() - self.last_call < POOL_IDLE_S / 2

    def run(self, worker: Callable[..., None], args: tuple, timeout_s: float, what: str) -> None:
        for inbox in self.inboxes:
            inbox.put((worker, args))
        deadline, answered = time.monotonic() + timeout_s, 0
        while answered < self.world:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                if dead := [p for p in self.procs if not p.is_alive()]:
                    raise RuntimeError(f"{what}: rank process {dead[0].name} exited ({dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish within {timeout_s} s") from None
                continue
            answered += 1
            if error:  # the other ranks may wait for this one in a collective: do not wait for them
                raise RuntimeError(f"{what}: rank {rank} raised:\n{error}")
        self.last_call = time.monotonic()

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


_POOLS: dict[int, RankPool] = {}
"""The kept pool of each world size."""


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def _serve(rank: int, inbox, results) -> None:
    """A rank process: run each call's worker, answer with its traceback ('' when it returned), leave its process
    group whatever happened; exit on None or after :data:`POOL_IDLE_S` without a call."""
    while True:
        try:
            call = inbox.get(timeout=POOL_IDLE_S)
        except queue.Empty:
            return
        if call is None:
            return
        worker, args = call
        error = ""
        try:
            worker(rank, *args)
        except BaseException:  # noqa: BLE001 - sent to the caller, which raises it
            error = traceback.format_exc()
        finally:
            _leave_process_group()
        results.put((rank, error))


def _leave_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


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
