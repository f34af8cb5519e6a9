"""Where a GPU step's time goes: the CUDA kernels of a few calls of a function under ``torch.profiler``, summed
by kind (GEMM, attention, optimizer, normalisation, elementwise, copies, ...), with the share of the wall time
the GPU ran any kernel at all (a low share says the step waits on the host: launches, Python, syncs).

Used by ``bench/learner_step.py --profile``; on a machine without CUDA it returns ``{"kernels": "no CUDA"}``.
"""
from __future__ import annotations

import time
from collections.abc import Callable

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (  # first match wins; names lower-cased
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_amp_")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "matmul", "splitk")),
    ("norm", ("norm",)),
    ("softmax/log-softmax", ("softmax", "logsumexp")),
    ("reduce", ("reduce",)),
    ("copy/cast", ("memcpy", "memset", "copy", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton")),
    ("nccl", ("nccl",)),
)


def kind_of(kernel: str) -> str:
    """The kind of a CUDA kernel by its name (KINDS), ``other`` when none matches."""
    name = kernel.lower()
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``intervals`` (start, end)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile(fn: Callable[[], object], calls: int = 2, top: int = 15) -> dict:
    """Run ``fn`` ``calls`` times under the profiler; kernel seconds per call by kind, the top kernels, busy share."""
    import torch

    if not torch.cuda.is_available():
        return {"kernels": "no CUDA"}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    # the GPU timeline also holds user annotations (``Optimizer.step#AdamW.step``) that span kernels: not kernels
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and "#" not in e.name]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        us = e.time_range.elapsed_us()
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    per_call = 1e-6 / calls
    return {"calls": calls, "wall_s_per_call": wall / calls, "gpu_busy_s_per_call": busy * per_call,
            "gpu_busy_share": busy * 1e-6 / wall if wall else 0.0, "kernel_launches_per_call": len(kernels) / calls,
            "kernel_s_per_call_by_kind": {k: v * per_call for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_s_per_call": {n[:120]: v * per_call
                                       for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}}
