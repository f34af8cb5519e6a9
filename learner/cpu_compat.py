"""Run Megatron-Core 0.16.1 (local layer spec, no Transformer Engine) on a CPU-only torch.

:func:`apply_if_no_gpu` patches, once and only when no GPU is present, the four
places Megatron assumes CUDA: ``torch.cuda.current_device`` (the CPU device),
the CUDA RNG and Megatron's RNG tracker (the CPU generator),
``get_default_causal_mask`` (a CPU version) and ``synchronize`` /
``empty_cache`` (no-ops). Importing this module changes nothing.

:func:`device_redirect` is the ``TorchFunctionMode`` that Megatron's optimizer
calls run in: ``device="cuda"`` → CPU, ``Tensor.cuda()`` a no-op, CUDA tensor
types reported; a no-op context on a GPU, so the caller has one code path.
Details: docs/learner.md, "CPU compatibility".
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_LOCK = threading.Lock()
_applied = False

_CUDA_TENSOR_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def has_gpu() -> bool:
    """True when torch sees at least one CUDA device."""
    return torch.cuda.is_available()


def is_applied() -> bool:
    """True once :func:`apply_if_no_gpu` has patched this process."""
    return _applied


def apply_if_no_gpu() -> bool:
    """Patch this process so Megatron-Core runs on the CPU; idempotent.

    Returns True when the patches are (now or already) in effect, False on a
    machine with a GPU, where nothing is changed."""
    global _applied
    if has_gpu():
        return False
    with _LOCK:
        if _applied:
            return True
        _patch_current_device()
        _patch_rng()
        _patch_causal_mask()
        _patch_sync()
        _applied = True
    return True


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: _CPU


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


def _patch_causal_mask() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax

    @functools.lru_cache(maxsize=32)
    def causal_mask_cpu(seq_len: int) -> torch.Tensor:
        return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = causal_mask_cpu


def _patch_sync() -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Redirects ``device="cuda"`` factory calls and ``.to("cuda")`` to the CPU,
    makes ``Tensor.cuda()`` a no-op, and makes ``Tensor.type()`` report the
    ``torch.cuda.*Tensor`` name for CPU float tensors (Megatron's optimizers
    assert it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TENSOR_TYPES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


def device_redirect() -> contextlib.AbstractContextManager:
    """Context for Megatron optimizer calls: :class:`CudaToCpuMode` on CPU, a no-op on GPU."""
    if has_gpu():
        return contextlib.nullcontext()
    return CudaToCpuMode()
