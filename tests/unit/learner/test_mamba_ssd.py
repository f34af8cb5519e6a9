"""The torch Mamba2 ops (learner.mamba_ssd) against a token-by-token recurrence: the chunked scan at several chunk
sizes, and sequence starts that reset the state and the convolution window exactly as running each sequence alone.
Plain torch, no Megatron."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from learner.mamba_ssd import causal_conv1d, gated_rms_norm, seq_starts_from_cu_seqlens, ssd_chunk_scan

B, L, H, P, G, N = 1, 37, 4, 3, 2, 5
STARTS = [0, 5, 6, 20, 33]
"""Sequence starts of a packed row of L tokens: lengths 5, 1, 14, 13, 4."""


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, H, P, generator=g)
    dt = torch.rand(B, L, H, generator=g) * 0.5
    a = -torch.rand(H, generator=g) * 2
    b, c = torch.randn(B, L, G, N, generator=g), torch.randn(B, L, G, N, generator=g)
    return x, dt, a, b, c, torch.randn(H, generator=g)


def _recurrence(x, dt, a, b, c, d, starts=()):
    """h_t = exp(dt_t·A)·h_{t-1} + dt_t·B_t·x_t (zero at a start), y_t = C_t·h_t + D·x_t."""
    bb, cc = b.repeat_interleave(H // G, 2), c.repeat_interleave(H // G, 2)
    h, ys = torch.zeros(B, H, P, N), []
    for t in range(x.shape[1]):
        if t in starts:
            h = torch.zeros(B, H, P, N)
        h = h * torch.exp(dt[:, t] * a)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * bb[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, cc[:, t]) + x[:, t] * d[:, None])
    return torch.stack(ys, 1)


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_scan_equals_the_recurrence(chunk):
    args = _inputs()
    torch.testing.assert_close(ssd_chunk_scan(*args, chunk_size=chunk), _recurrence(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_sequence_starts_reset_the_state(chunk):
    """Each packed sequence gets the outputs of running it alone (boundaries inside and at chunk edges)."""
    args = _inputs(1)
    starts = seq_starts_from_cu_seqlens(torch.tensor(STARTS + [L]), L)
    packed = ssd_chunk_scan(*args, chunk_size=chunk, seq_start=starts)
    torch.testing.assert_close(packed, _recurrence(*args, starts=STARTS), atol=1e-5, rtol=1e-5)
    x, dt, a, b, c, d = args
    for s, e in zip(STARTS, STARTS[1:] + [L], strict=True):
        alone = ssd_chunk_scan(x[:, s:e], dt[:, s:e], a, b[:, s:e], c[:, s:e], d, chunk_size=chunk)
        torch.testing.assert_close(packed[:, s:e], alone, atol=1e-5, rtol=1e-5)
    leaky = ssd_chunk_scan(*args, chunk_size=chunk)  # without the starts the state crosses the boundaries
    assert (leaky - packed).abs().max() > 1e-2


def test_convolution_window_stops_at_sequence_starts():
    g = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(1, L, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    starts = seq_starts_from_cu_seqlens(torch.tensor(STARTS + [L]), L)
    packed = causal_conv1d(x, w, bias, starts)
    for s, e in zip(STARTS, STARTS[1:] + [L], strict=True):
        alone = F.conv1d(x[:, s:e].transpose(1, 2), w[:, None], bias, padding=3, groups=6)[..., :e - s]
        torch.testing.assert_close(packed[:, s:e], alone.transpose(1, 2), atol=1e-6, rtol=1e-6)
    whole = causal_conv1d(x, w, bias, None)
    torch.testing.assert_close(causal_conv1d(x, w, bias, seq_starts_from_cu_seqlens(torch.tensor([0, L]), L)), whole)
    assert (whole - packed).abs().max() > 1e-2


def test_gated_rms_norm_is_per_group():
    g = torch.Generator().manual_seed(3)
    y, z, w = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g), torch.randn(8, generator=g)
    h = (y * F.silu(z)).reshape(2, 5, 2, 4)
    ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(2, 5, 8) * w
    torch.testing.assert_close(gated_rms_norm(y, z, w, group_size=4, eps=1e-5), ref)
