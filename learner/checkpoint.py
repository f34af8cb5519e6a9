"""Learner checkpoints: one file per rank, restored onto the same parallel layout.

Layout of a checkpoint directory::

    <path>/meta.json            step, policy_version, world size, TP, EP (written by rank 0)
    <path>/rank_00000.pt        this rank's model shard (Megatron state dict), the
                                optimizer's exact inner state (master weights,
                                Adam moments, step counts), the LR scheduler,
                                the RNG states (python, numpy, torch CPU/CUDA,
                                Megatron's model-parallel RNG tracker), and
                                ``extra`` (the services layer's data position and
                                buffered groups; JSON-able values and bytes)

Everything needed for the next step to be bit-identical to not stopping is
in there; resuming needs the same world size, TP and EP (checked).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

META_FILE = "meta.json"


def rank_file(path: str | Path, rank: int) -> Path:
    return Path(path) / f"rank_{rank:05d}.pt"


def _rng_tracker():
    """Megatron's model-parallel RNG tracker (set up by :func:`learner.model.init_distributed`)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker is None:
        raise RuntimeError("Megatron's RNG tracker is not initialised: call learner.model.init_distributed first")
    return tracker


def capture_rng() -> dict:
    """RNG states of python, numpy, torch and Megatron's model-parallel tracker."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": _rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    _rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def layout() -> dict:
    from megatron.core import parallel_state as ps
    return {"world_size": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size()}


def save(path: str | Path, payload: dict, meta: dict) -> None:
    """Write this rank's ``payload``; rank 0 also writes ``meta`` (+ the parallel layout). Collective."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    tmp = rank_file(out, rank).with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(rank_file(out, rank))
    if rank == 0:
        (out / META_FILE).write_text(json.dumps({**meta, **layout()}, indent=2))
    dist.barrier()


def load(path: str | Path) -> tuple[dict, dict]:
    """This rank's payload and the checkpoint's meta; the layout must match the running one."""
    src = Path(path)
    meta_path = src / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"learner checkpoint: no {META_FILE} in {src}")
    meta = json.loads(meta_path.read_text())
    now = layout()
    saved = {k: meta.get(k) for k in now}
    if saved != now:
        raise ValueError(f"learner checkpoint {src}: saved with layout {saved}, running with {now}")
    f = rank_file(src, dist.get_rank())
    if not f.is_file():
        raise FileNotFoundError(f"learner checkpoint: missing {f}")
    return torch.load(f, map_location="cpu", weights_only=False), meta
