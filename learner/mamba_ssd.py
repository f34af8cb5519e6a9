"""Mamba2 in plain torch, with sequence boundaries: the learner's reference path (CPU, and GPU without kernels).

A packed row holds several sequences end to end; Mamba must not carry its convolution window or its
SSM state from one into the next. ``seq_start`` (``[b, l]`` bool, True at the first token of every
sequence) marks where they begin:

- :func:`causal_conv1d`: depthwise causal convolution whose window never reaches back past a start
  (each sequence sees zero left padding, as when run alone);
- :func:`ssd_chunk_scan`: the chunked state-space-duality scan of Mamba2 (the same algorithm as
  transformers' torch path and mamba_ssm's ``mamba_chunk_scan_combined``); at a start the step's
  log-decay ``dt·A`` is replaced by :data:`RESET_LOG_DECAY`, so ``exp`` of any sum crossing it is 0
  and the state restarts from zero. Every decay is a masked cumulative sum (prefix, suffix or
  within-segment), never a difference of two cumulative sums, so the large reset term costs no
  precision inside a sequence;
- :func:`gated_rms_norm`: ``RMSNorm(y · silu(z))`` per group (``norm_before_gate=False``).

No ``dt`` clamp: vLLM and Megatron do not clamp it (transformers clamps it to ``time_step_min`` in prefill).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

RESET_LOG_DECAY = -1.0e4
"""The log-decay put at a sequence's first token: ``exp`` of it (and of any sum containing it) is 0 in
float32 and bfloat16, so no state crosses the boundary."""


def seq_starts_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, total]`` bool, True at ``cu_seqlens[:-1]`` (and at 0): the first token of every sequence."""
    starts = torch.zeros(1, total, dtype=torch.bool, device=cu_seqlens.device)
    at = cu_seqlens[:-1].long()
    starts[0, at[at < total]] = True
    starts[0, 0] = True
    return starts


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  seq_start: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[b, l, c]`` with ``weight`` ``[c, k]``; the window of a token
    holds only tokens of its own sequence (``seq_start``: ``[b, l]`` bool, or None for one sequence per row)."""
    b, length, _ = x.shape
    k = weight.shape[1]
    if seq_start is None:
        out = F.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=k - 1, groups=x.shape[2])
        return out[..., :length].transpose(1, 2)
    # segment id per token; token t may read t - j when both lie in the same segment
    seg = torch.cumsum(seq_start.long(), dim=1)
    out = x * weight[:, k - 1]
    for j in range(1, k):
        shifted = F.pad(x, (0, 0, j, 0))[:, :length]
        same = F.pad(seg, (j, 0), value=-1)[:, :length] == seg
        out = out + shifted * same[..., None] * weight[:, k - 1 - j]
    return out + bias if bias is not None else out


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` → ``[..., T, T]``: ``out[i, j] = Σ_{j < m ≤ i} a[m]`` for i ≥ j, −inf above the diagonal
    (a masked cumulative sum, no differences)."""
    t = a.size(-1)
    a = a[..., None].expand(*a.shape, t)
    below = torch.tril(torch.ones(t, t, device=a.device, dtype=torch.bool), diagonal=-1)
    out = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, device=a.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """``[b, l, ...]`` → ``[b, c, chunk, ...]`` (zero-padded at the end)."""
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, chunk_size: int, seq_start: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's selective scan, chunked: ``y_t = C_t·h_t + D·x_t`` with ``h_t = exp(dt_t·A)·h_{t-1} + dt_t·B_t·x_t``.

    ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]`` (after bias and softplus), ``a`` ``[h]`` (negative),
    ``b``/``c`` ``[b, l, g, n]``, ``d`` ``[h]``; ``seq_start`` ``[b, l]`` resets the state (see the module
    docstring). Computed in float32; returns ``[b, l, h, p]`` float32."""
    batch, length, heads, _ = x.shape
    rep = heads // b.shape[2]
    x, dt = x.float(), dt.float()
    b = b.float().repeat_interleave(rep, dim=2)
    c = c.float().repeat_interleave(rep, dim=2)
    log_decay = dt * a.float()  # [b, l, h]
    if seq_start is not None:
        log_decay = torch.where(seq_start[..., None], torch.full_like(log_decay, RESET_LOG_DECAY), log_decay)
    pad = (chunk_size - length % chunk_size) % chunk_size
    xdt = x * dt[..., None]
    xs, bs, cs = (_chunks(t, pad, chunk_size) for t in (xdt, b, c))  # [b, c, l, h, ·]
    ld = _chunks(log_decay, pad, chunk_size).permute(0, 3, 1, 2)  # [b, h, c, l]

    # 1. within each chunk: attention-like form with decay L[i, j] = exp(Σ_{j<m≤i} ld_m)
    decay_in = torch.exp(_segsum(ld))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", cs, bs) * decay_in.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xs)

    # 2. each chunk's final state from its own tokens: decay from token s to the chunk's end (suffix sum)
    inclusive = torch.flip(torch.cumsum(torch.flip(ld, [-1]), dim=-1), [-1])  # Σ_{s≤m≤end} ld_m
    suffix = F.pad(inclusive[..., 1:], (0, 1))  # Σ_{s<m≤end} ld_m (shifted, not subtracted)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", bs, torch.exp(suffix), xs)

    # 3. pass the states from chunk to chunk: decay over whole chunks (masked cumulative sum of totals)
    totals = F.pad(ld.sum(-1), (1, 0))  # [b, h, c + 1]
    decay_chunk = torch.exp(_segsum(totals)).transpose(1, 3)  # [b, c+1 (to), c+1 (from), h] after transpose
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, :-1]

    # 4. the state entering each chunk, read at every token: decay from the chunk's start (prefix sum)
    prefix = torch.cumsum(ld, dim=-1)  # Σ_{start≤m≤l} ld_m
    y_off = torch.einsum("bclhn,bchpn->bclhp", cs, new_states) * torch.exp(prefix).permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])[:, :length]
    return y + x * d.float()[:, None]


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """``weight · RMSNorm_group(y · silu(z))`` over groups of ``group_size`` channels (in float32)."""
    h = y.float() * F.silu(z.float())
    shape = h.shape
    h = h.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.reshape(shape).to(y.dtype)
