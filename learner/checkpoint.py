"""Learner checkpoints: one file per rank, restored onto the same parallel layout.

Layout of a checkpoint directory::

    <path>/meta.json            step, policy_version, world size, TP, PP, EP (written by rank 0)
    <path>/rank_00000.pt        this rank's model shard (Megatron state dict), the
                                optimizer's exact inner state (master weights,
                                Adam moments, step counts), the LR scheduler,
                                the RNG states (python, numpy, torch CPU/CUDA,
                                Megatron's model-parallel RNG tracker), and
                                ``extra`` (the services layer's data position and
                                buffered groups; JSON-able values and bytes)

Everything needed for the next step to be bit-identical to not stopping is
in there; resuming needs the same world size, TP, PP and EP (checked), and the same
model (every tensor's name and shape, checked: :func:`check_model_state`).

Rank files are read with ``torch.load(weights_only=True)``: tensors, numbers,
strings, bytes, lists, dicts and numpy arrays (numpy's RNG state) only. A file
holding any other pickled object (a ``__reduce__`` payload would run code) is
refused with :class:`CheckpointError`, one line naming the file; nothing in it runs.
"""
from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

META_FILE = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that is not loaded (holds code, unreadable, another layout or model); one line naming it."""


def _numpy_globals() -> list:
    """What unpickling a numpy array needs (numpy's RNG state is one): its reconstructor, type and dtypes."""
    import importlib

    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


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
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size()}


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


def load(path: str | Path, model_state: dict | None = None) -> tuple[dict, dict]:
    """This rank's payload and the checkpoint's meta; the layout must match the running one and, given the
    running ``model_state``, so must the saved model's tensor names and shapes (:func:`check_model_state`)."""
    src = Path(path)
    meta_path = src / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"learner checkpoint: no {META_FILE} in {src}")
    meta = json.loads(meta_path.read_text())
    now = layout()
    saved = {k: meta.get(k, 1 if k == "pp" else None) for k in now}  # checkpoints from before PP: pp 1
    if saved != now:
        raise CheckpointError(f"learner checkpoint {src}: saved with layout {saved}, running with {now}")
    f = rank_file(src, dist.get_rank())
    if not f.is_file():
        raise FileNotFoundError(f"learner checkpoint: missing {f}")
    payload = read_rank_file(f)
    if model_state is not None:
        check_model_state(payload.get("model", {}), model_state, src)
    return payload, meta


def read_rank_file(f: str | Path) -> dict:
    """A rank file's payload, unpickled without running code (``weights_only``); :class:`CheckpointError`
    naming the file for anything else: a pickled object other than plain data, a truncated or foreign file."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))  # torch: "Unsupported global: GLOBAL x" or "... GLOBAL x whose"
        what = f"a pickled reference to {found.group(1)}" if found else "a pickled object that is not plain data"
        raise CheckpointError(f"learner checkpoint {f}: refused, it holds {what} (loading it could run code; a "
                              "checkpoint holds tensors, numbers, strings, lists and dicts only)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"learner checkpoint {f}: unreadable ({str(err).splitlines()[0]})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"learner checkpoint {f}: holds a {type(payload).__name__}, not a rank's payload")
    return payload


def check_model_state(saved: dict, expected: dict, src: str | Path) -> None:
    """``CheckpointError`` (one line) unless ``saved`` (a checkpoint's model state) has the tensors of
    ``expected`` (the running model's), by name and shape: a checkpoint of another architecture or size."""
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    shapes = [(k, tuple(saved[k].shape), tuple(expected[k].shape)) for k in expected.keys() & saved.keys()
              if isinstance(saved[k], torch.Tensor) and isinstance(expected[k], torch.Tensor)
              and saved[k].shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return
    parts = [f"{len(shapes)} tensors differ in shape (first: {min(shapes)[0]} is {list(min(shapes)[1])} in the "
             f"checkpoint, {list(min(shapes)[2])} in this model)"] if shapes else []
    parts += [f"{len(missing)} missing (first: {missing[0]})"] if missing else []
    parts += [f"{len(unexpected)} unexpected (first: {unexpected[0]})"] if unexpected else []
    raise CheckpointError(f"learner checkpoint {src} was saved from another model than policy.model_name's: "
                          f"{'; '.join(parts)}")
