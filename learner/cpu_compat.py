"""Run Megatron-Core 0.16.1 (local layer spec, no Transformer Engine) on a CPU-only torch.

Megatron-Core assumes CUDA in four places that matter for the local spec
(measured, design.md §6):

1. ``torch.cuda.current_device()`` is used as the device of ~40 buffers
   (RoPE frequencies, tensor-parallel all-gather buffers, ...): it is made to
   return the CPU device, which turns those ``.to(...)`` calls into no-ops.
2. The CUDA RNG: ``model_parallel_cuda_manual_seed`` and the RNG-state tracker
   that attention forks on every forward call ``torch.cuda.manual_seed`` /
   ``get_rng_state``; they are mapped onto the CPU generator.
3. ``get_default_causal_mask`` hard-codes ``device="cuda"``; it is replaced by
   a CPU version with the same semantics (True = masked).
4. ``torch.cuda.synchronize`` / ``empty_cache`` become no-ops.

:func:`apply_if_no_gpu` applies these process-wide patches explicitly, once,
and only when no GPU is present — importing this module changes nothing.

Megatron's optimizers (FP32, Float16, DistributedOptimizer) additionally
allocate with ``device="cuda"``, call ``Tensor.cuda()`` and check
``param.type() == "torch.cuda.FloatTensor"``. :func:`device_redirect` returns a
``TorchFunctionMode`` that rewrites those to the CPU for the duration of an
optimizer call, and a no-op context on a GPU, so the caller has one code path.
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
