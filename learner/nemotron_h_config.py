"""Read a Nemotron-H ``config.json`` (``model_type: nemotron_h``): the hybrid layer pattern and its Mamba2,
attention, MLP and MoE fields (no torch, no Megatron).

The pattern has one symbol per layer: ``M`` Mamba2, ``*`` attention (no RoPE), ``-`` squared-ReLU MLP,
``E`` mixture of experts (squared-ReLU experts, sigmoid router with a score-correction bias, one shared
expert, a routed scaling factor). Both spellings are read: the published ``hybrid_override_pattern``
string and the ``layers_block_type`` list that transformers ≥ 5 writes (``mamba``/``linear_attention``,
``attention``/``full_attention``, ``mlp``, ``moe``). Whatever the learner would compute differently from
transformers and vLLM is refused with a ``ValueError`` naming the field, its value and what is supported.
:mod:`learner.hf_config` turns the result into an ``HFArchitecture``; docs/learner.md, "Hybrid models".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PATTERN_SYMBOLS = {"M": "Mamba2", "*": "attention", "-": "MLP", "E": "MoE"}
BLOCK_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
               "mlp": "-", "moe": "E"}
"""``layers_block_type`` names (transformers ≥ 5 and the older ones) → pattern symbols."""
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
            "use_conv_bias": "mamba_conv_bias"}
"""Field → the older name transformers still accepts for it."""


@dataclass(frozen=True)
class HybridSpec:
    """The Nemotron-H fields beyond what every family has (``HFArchitecture.hybrid``)."""

    pattern: str
    """One symbol per layer: M (Mamba2), * (attention), - (MLP), E (MoE)."""
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    """N: the state size per head of the SSM."""
    n_groups: int
    """Groups of the B/C projections (and of the gated RMSNorm); divides ``mamba_num_heads``."""
    conv_kernel: int
    """Width of the causal depthwise convolution over x, B, C."""
    chunk_size: int
    """Chunk length of the SSD scan (the result does not depend on it)."""
    use_conv_bias: bool
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert's MLP (MoE layers; 0 without them)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the normalised top-k router weights."""

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    def count(self, symbol: str) -> int:
        return self.pattern.count(symbol)

    def describe(self) -> str:
        parts = [f"layers {self.pattern!r}"] + [f"{self.count(s)} {name}" for s, name in PATTERN_SYMBOLS.items()
                                                if self.count(s)]
        parts.append(f"Mamba2 {self.mamba_num_heads} heads × {self.mamba_head_dim}, state {self.ssm_state_size}, "
                     f"{self.n_groups} groups, conv {self.conv_kernel}")
        return ", ".join(parts)


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config.json {field}: {value!r} is not supported (supported: {supported})")


def _get(cfg: dict, name: str, default: Any = None) -> Any:
    if name in cfg:
        return cfg[name]
    alias = _ALIASES.get(name)
    if alias and alias in cfg:
        return cfg[alias]
    if default is None:
        raise KeyError(name)
    return default


def layer_pattern(cfg: dict) -> str:
    """The layer pattern from ``hybrid_override_pattern`` or ``layers_block_type`` (they must agree when both
    are given); ``ValueError`` naming the field otherwise."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN_SYMBOLS):
            raise _refuse("hybrid_override_pattern", pattern,
                          "a non-empty string of " + ", ".join(f"{s} ({n})" for s, n in PATTERN_SYMBOLS.items()))
    blocks = cfg.get("layers_block_type")
    if blocks is not None:
        if not isinstance(blocks, list) or not blocks or any(b not in BLOCK_TYPES for b in blocks):
            raise _refuse("layers_block_type", blocks, "a non-empty list of " + ", ".join(BLOCK_TYPES))
        from_blocks = "".join(BLOCK_TYPES[b] for b in blocks)
        if pattern is not None and pattern != from_blocks:
            raise _refuse("hybrid_override_pattern", pattern, f"the pattern layers_block_type gives ({from_blocks!r})")
        pattern = from_blocks
    if pattern is None:
        raise ValueError("config.json: nemotron_h needs hybrid_override_pattern or layers_block_type")
    layers = cfg.get("num_hidden_layers")
    if layers is not None and int(layers) != len(pattern):
        raise _refuse("num_hidden_layers", layers, f"the pattern's length ({len(pattern)})")
    return pattern


def _check_unsupported(cfg: dict) -> None:
    """Refuse the Nemotron-H options the learner does not compute as transformers and vLLM do."""
    wanted = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu"}
    for name, want in wanted.items():
        if cfg.get(name, want) != want:
            raise _refuse(name, cfg[name], want)
    for name in ("use_bias", "mamba_proj_bias", "attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise _refuse(name, cfg[name], "false")
    if cfg.get("sliding_window") is not None:
        raise _refuse("sliding_window", cfg["sliding_window"], "null (full attention)")
    if cfg.get("moe_latent_size") is not None:
        raise _refuse("moe_latent_size", cfg["moe_latent_size"], "null (experts on the hidden size)")
    if int(cfg.get("num_nextn_predict_layers") or 0):
        raise _refuse("num_nextn_predict_layers", cfg["num_nextn_predict_layers"], "0 (no multi-token prediction)")


def _moe(cfg: dict) -> dict:
    """The MoE fields of an ``E``-layer model (names as ``HFArchitecture``'s, plus the ``HybridSpec`` ones)."""
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if n_group != 1 and topk_group != n_group:
        # Megatron's group-limited routing scores a group differently (top-k/group sum vs HF's top-2 sum)
        raise _refuse("topk_group", topk_group, f"n_group ({n_group}): every group kept, or n_group 1")
    norm = bool(cfg.get("norm_topk_prob", True))
    if not norm and top_k > 1:
        raise _refuse("norm_topk_prob", norm, "true (Megatron's sigmoid router renormalises the top-k weights)")
    if not 0 < top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"1 … n_routed_experts ({experts})")
    return dict(num_experts=experts, moe_top_k=top_k, moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=norm)


def parse_nemotron_h(cfg: dict) -> tuple[HybridSpec, dict]:
    """``(HybridSpec, the MoE fields of HFArchitecture or {})`` of a ``nemotron_h`` config."""
    pattern = layer_pattern(cfg)
    _check_unsupported(cfg)
    heads, groups = int(cfg["mamba_num_heads"]), int(_get(cfg, "n_groups", 8))
    if groups <= 0 or heads % groups:
        raise _refuse("n_groups", groups, f"a divisor of mamba_num_heads={heads}")
    moe = _moe(cfg) if "E" in pattern else {}
    spec = HybridSpec(
        pattern=pattern, mamba_num_heads=heads, mamba_head_dim=int(cfg["mamba_head_dim"]),
        ssm_state_size=int(cfg["ssm_state_size"]), n_groups=groups, conv_kernel=int(_get(cfg, "conv_kernel", 4)),
        chunk_size=int(_get(cfg, "chunk_size", 128)), use_conv_bias=bool(_get(cfg, "use_conv_bias", True)),
        shared_expert_intermediate_size=int(cfg["moe_shared_expert_intermediate_size"]) if moe else 0,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)) if moe else 1.0)
    if spec.conv_kernel < 1 or spec.chunk_size < 1:
        raise _refuse("conv_kernel" if spec.conv_kernel < 1 else "chunk_size",
                      min(spec.conv_kernel, spec.chunk_size), "≥ 1")
    return spec, moe
