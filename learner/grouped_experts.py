"""MoE experts as grouped GEMMs (``policy.megatron_cfg.moe_grouped_gemm``): one ``torch._grouped_mm`` per projection
for all of a rank's experts instead of Megatron's ``SequentialMLP`` loop of two GEMMs per expert.

:class:`GroupedExperts` takes the place of ``SequentialMLP`` in the local layer spec (same call: the tokens
permuted by expert, ``tokens_per_expert``, their router probabilities) and computes the same expert with the
rank's experts stacked: Qwen3-MoE's SwiGLU ``fc2(silu(gate) · up · prob)`` with ``weight1`` ``[E_local, 2F, H]``
(each expert's ``[gate; up]``, as ``local_experts.j.linear_fc1.weight``), or Nemotron-H's squared ReLU
``fc2(relu(up)² · prob)`` with ``weight1`` ``[E_local, F, H]``; ``weight2`` ``[E_local, H, F]`` (as
``linear_fc2.weight``). ``torch._grouped_mm`` runs on the GPU (Hopper's grouped kernel, bf16) and on the CPU
(torch's fallback, any float dtype), so the tests run the kernel the GPU runs. Megatron's own ``GroupedMLP`` needs
the ``grouped_gemm`` package and bf16, ``TEGroupedMLP`` Transformer Engine: neither is on these machines.

The HF mapping (:class:`HFExperts`, :func:`shard_from_hf`, :func:`hf_from_whole`) stacks / unstacks the
checkpoint's per-expert projections; export all-gathers the stacks over EP (:mod:`learner.hf_export`).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from learner.hf_config import HFArchitecture

GROUPED = re.compile(r"^mlp\.experts\.(weight1|weight2)$")
"""A layer-relative parameter name of :class:`GroupedExperts`."""


class GroupedExperts(MegatronModule):
    """A rank's ``num_local_experts`` SwiGLU or squared-ReLU experts as two grouped GEMMs (module docstring)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None, pg_collection=None):
        super().__init__(config=config)
        swiglu = config.gated_linear_unit and config.activation_func is F.silu
        relu2 = not config.gated_linear_unit and config.activation_func is squared_relu
        if not (swiglu or relu2) or config.add_bias_linear:
            raise ValueError("moe_grouped_gemm: the grouped experts are SwiGLU (Qwen3-MoE's) or squared ReLU "
                             "(Nemotron-H's) without biases; this model's experts are neither")
        if config.expert_tensor_parallel_size != 1:
            raise ValueError(f"moe_grouped_gemm: expert_tensor_parallel_size must be 1, got "
                             f"{config.expert_tensor_parallel_size}")
        self.num_local_experts = num_local_experts
        self.gated = swiglu
        f, h = config.moe_ffn_hidden_size, config.hidden_size
        if f is None:
            raise ValueError("moe_grouped_gemm: the config has no moe_ffn_hidden_size")
        expert_parallel = config.expert_model_parallel_size > 1
        init = config.init_method
        if init is None:
            raise ValueError("moe_grouped_gemm: the config has no init_method")
        fc1_rows = 2 * f if swiglu else f
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_rows, h, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, h, f, dtype=config.params_dtype))
        for weight, dim in ((self.weight1, 0), (self.weight2, 1)):
            with torch.no_grad():
                for e in range(num_local_experts):
                    init(weight[e])
            # as Megatron's expert linears mark theirs (DDP's expert buffers, the grad norm's TP rule)
            marks = {"allreduce": not expert_parallel, "tensor_model_parallel": True, "partition_dim": dim + 1,
                     "partition_stride": 1}
            for key, value in marks.items():
                setattr(weight, key, value)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``tokens`` ``[N, H]`` sorted by local expert, ``tokens_per_expert`` ``[E_local]``, ``probs`` ``[N]``:
        each token's expert output times its probability, ``[N, H]`` (and no bias)."""
        offs = torch.cumsum(tokens_per_expert.to(device=tokens.device, dtype=torch.int64), 0).to(torch.int32)
        fc1 = grouped_mm(tokens, self.weight1.transpose(1, 2), offs)  # [N, 2F] or [N, F]
        if self.gated:
            gate, up = torch.chunk(fc1, 2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = squared_relu(fc1)
        act = (act * probs.unsqueeze(-1)).to(tokens.dtype)
        return grouped_mm(act, self.weight2.transpose(1, 2), offs), None  # [N, H]

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing is delayed here."""


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for consecutive row groups ending at ``offs``; ``[N, K] x [G, K, M] -> [N, M]``."""
    return torch._grouped_mm(x, w, offs=offs)  # pyright: ignore[reportPrivateImportUsage]  (no public name yet)


@dataclass(frozen=True)
class HFExperts:
    """Where one MoE layer's experts lie in an HF checkpoint's language model (a Nano-Omni's lies under
    ``language_model.``, which its callers add), and which of their projections ``weight1`` stacks."""

    prefix: str
    """The experts' common prefix, e.g. ``model.layers.3.mlp.experts.`` (expert ``e``: ``{prefix}{e}.``)."""
    fc1: tuple[str, ...]
    """The projections ``weight1`` holds, stacked in this order: ``gate_proj, up_proj`` (SwiGLU) or ``up_proj``."""

    @classmethod
    def of(cls, arch: HFArchitecture, layer: int) -> HFExperts:
        """Layer ``layer``'s experts: Nemotron-H's ``backbone.layers.i.mixer.experts`` (squared ReLU, one ``up_proj``)
        or the GPT families' ``model.layers.i.mlp.experts`` (SwiGLU)."""
        if arch.hybrid is not None:
            from learner.hybrid_weights import PREFIX

            return cls(f"{PREFIX}layers.{layer}.mixer.experts.", ("up_proj",))
        return cls(f"model.layers.{layer}.mlp.experts.", ("gate_proj", "up_proj"))


def shard_from_hf(rest: str, experts: HFExperts, hf: Callable[[str], torch.Tensor], first_expert: int,
                  num_local: int) -> torch.Tensor:
    """The stacked ``weight1`` / ``weight2`` of a rank whose experts start at ``first_expert``."""
    which = GROUPED.match(rest)
    if which is None:
        raise KeyError(f"{rest} is not a grouped-experts parameter")
    parts = []
    for e in range(first_expert, first_expert + num_local):
        p = f"{experts.prefix}{e}."
        if which.group(1) == "weight1":
            parts.append(torch.cat([hf(f"{p}{proj}.weight") for proj in experts.fc1]))
        else:
            parts.append(hf(p + "down_proj.weight"))
    return torch.stack(parts)


def hf_from_whole(rest: str, experts: HFExperts, stacks: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of a stacked parameter, from every EP rank's stack in rank order (all the layer's experts)."""
    which = GROUPED.match(rest)
    if which is None:
        raise KeyError(f"{rest} is not a grouped-experts parameter")
    out = []
    for e, w in enumerate(torch.cat(stacks)):
        p = f"{experts.prefix}{e}."
        if which.group(1) == "weight1":
            out += [(f"{p}{proj}.weight", part) for proj, part in zip(experts.fc1, w.chunk(len(experts.fc1)),
                                                                       strict=True)]
        else:
            out.append((p + "down_proj.weight", w))
    return out
