"""A Mamba2 mixer for Megatron-Core's ``MambaLayer`` that needs neither ``mamba_ssm`` nor ``causal_conv1d``.

Megatron-Core 0.16.1's ``MambaMixer`` refuses to build without ``mamba_ssm`` (Triton kernels; the registry
has sdists only). :class:`TorchMambaMixer` has the same parameters, names, shapes and tensor-parallel
layout (``in_proj`` column-parallel with per-rank ``[z, x, B, C, dt]``, ``conv1d`` over per-rank
``[x, B, C]`` channels, per-rank heads in ``dt_bias``/``A_log``/``D``, the gated norm's ``norm.weight``,
``out_proj`` row-parallel), so a checkpoint and the HF mapping serve both, and the same call:
``forward(hidden_states [s, b, h], inference_context=None, packed_seq_params=None) -> (out, bias)``.
The packed sequences' boundaries come as ``packed_seq_params.cu_seqlens_q`` (Megatron's convention);
the math is :mod:`learner.mamba_ssd`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from learner.mamba_ssd import causal_conv1d, gated_rms_norm, seq_starts_from_cu_seqlens, ssd_chunk_scan

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig


def _tensor_parallel(p: torch.Tensor) -> torch.Tensor:
    """Mark ``p`` as split over TP along dim 0 (what Megatron's mixer marks; DDP and export read it)."""
    p.tensor_model_parallel = True  # pyright: ignore[reportAttributeAccessIssue]
    p.partition_dim = 0  # pyright: ignore[reportAttributeAccessIssue]
    p.partition_stride = 1  # pyright: ignore[reportAttributeAccessIssue]
    return p


class GatedRMSNorm(nn.Module):
    """``weight · RMSNorm(y · silu(z))`` per group of channels (Mamba2's ``norm_before_gate=False``)."""

    def __init__(self, channels: int, group_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, dtype=dtype))
        _tensor_parallel(self.weight)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class TorchMambaMixer(nn.Module):
    """Mamba2 mixer in plain torch (see the module docstring). Sizes come from the ``TransformerConfig``
    (``mamba_num_heads``, ``mamba_head_dim``, ``mamba_num_groups``, ``mamba_state_dim``); the rest from the
    layer spec's params."""

    def __init__(self, config: TransformerConfig, submodules: MambaMixerSubmodules, d_model: int,
                 d_conv: int = 4, conv_bias: bool = True, chunk_size: int = 128, norm_eps: float = 1e-5,
                 layer_number: int | None = None, pg_collection: ProcessGroupCollection | None = None,
                 pp_layer_offset: int = 0):
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        if pg_collection is None:
            raise ValueError("TorchMambaMixer needs pg_collection (MambaLayer passes it)")
        heads, self.headdim = config.mamba_num_heads, config.mamba_head_dim
        groups, self.d_state = config.mamba_num_groups, config.mamba_state_dim
        if heads is None:
            raise ValueError("TransformerConfig.mamba_num_heads must be set for TorchMambaMixer")
        tp = pg_collection.tp.size()
        if heads % tp or groups % tp or heads % groups:
            raise ValueError(f"mamba_num_heads={heads} and n_groups={groups}: both must be divisible by "
                             f"tensor_model_parallel_size={tp}, and heads by groups")
        self.config, self.layer_number, self.chunk_size = config, layer_number, chunk_size
        self.heads, self.groups = heads // tp, groups // tp  # this TP rank's
        self.d_inner = self.heads * self.headdim
        d_inner_total = heads * self.headdim
        self.in_proj = build_module(
            submodules.in_proj, d_model, 2 * d_inner_total + 2 * groups * self.d_state + heads, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_group=pg_collection.tp)
        conv_dim = self.d_inner + 2 * self.groups * self.d_state
        dtype = config.params_dtype
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, bias=conv_bias,
                                padding=d_conv - 1, dtype=dtype)
        _tensor_parallel(self.conv1d.weight)
        if self.conv1d.bias is not None:
            _tensor_parallel(self.conv1d.bias)
        dt = torch.exp(torch.rand(self.heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(dtype))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.heads).uniform_(1, 16)))  # fp32, as Megatron's
        self.D = nn.Parameter(torch.ones(self.heads))  # fp32
        for p in (self.dt_bias, self.A_log, self.D):
            _tensor_parallel(p)
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.groups, norm_eps, dtype)
        self.out_proj = build_module(
            submodules.out_proj, d_inner_total, d_model, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=pg_collection.tp)

    def forward(self, hidden_states: torch.Tensor, inference_context=None, *,
                packed_seq_params: PackedSeqParams | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` ``[s, b, h]`` → ``(out [s, b, h], bias)``; with ``packed_seq_params`` (one row,
        ``b == 1``) no state crosses ``cu_seqlens_q``."""
        if inference_context is not None:
            raise NotImplementedError("TorchMambaMixer is for training and scoring; it keeps no inference cache")
        zxbcdt, _ = self.in_proj(hidden_states)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, ·]
        batch, length, _ = zxbcdt.shape
        gn = self.groups * self.d_state
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * gn, self.heads], dim=-1)
        starts = None
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None:
            if batch != 1:
                raise ValueError(f"packed sequences must be one row, got a batch of {batch}")
            starts = seq_starts_from_cu_seqlens(packed_seq_params.cu_seqlens_q, length)
        xbc = torch.nn.functional.silu(causal_conv1d(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, starts))
        x, b, c = torch.split(xbc, [self.d_inner, gn, gn], dim=-1)
        dt = torch.nn.functional.softplus(dt.float() + self.dt_bias.float())
        y = ssd_chunk_scan(x.reshape(batch, length, self.heads, self.headdim), dt, -torch.exp(self.A_log.float()),
                           b.reshape(batch, length, self.groups, self.d_state),
                           c.reshape(batch, length, self.groups, self.d_state), self.D, self.chunk_size, starts)
        y = self.norm(y.reshape(batch, length, self.d_inner).to(z.dtype), z)
        out, bias = self.out_proj(y.transpose(0, 1).contiguous())
        return out, bias
