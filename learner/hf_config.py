"""Read a Hugging Face ``config.json`` into an :class:`HFArchitecture` (no torch, no Megatron).

Supported families (``model_type``): ``qwen2`` (q/k/v biases; Qwen2 and Qwen2.5, tied or untied
embeddings), ``qwen3`` (per-head q/k RMSNorm, explicit ``head_dim``), ``qwen3_moe`` (Qwen3 with
every layer a mixture of experts), ``llama`` (Llama 2/3.x, RoPE unscaled or ``llama3``-scaled) and
``mistral`` (Llama's layout, no sliding window). All are pre-norm RMSNorm decoders with SwiGLU MLPs
and grouped-query attention, so they share one Megatron layer spec.

Anything the learner would compute differently from transformers and vLLM — another activation,
RoPE type, a sliding window, o_proj/MLP biases, partial rotary — is refused with a ``ValueError``
that names the ``config.json`` field, its value and what is supported. Both spellings of the RoPE
settings are read: ``rope_scaling`` (+ top-level ``rope_theta``) in older published files,
``rope_parameters`` in what transformers ≥ 5 writes. The mapping onto Megatron: docs/learner.md,
"Model families".
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE frequency scaling (``rope_type: llama3``), as transformers and vLLM apply it."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class HFArchitecture:
    """The fields of an HF ``config.json`` this learner needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int | None = None
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rope_scaling: Llama3RopeScaling | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def experts_per_rank(self, ep_size: int) -> int:
        """Experts held whole by one of ``ep_size`` expert-parallel ranks (MoE architectures only)."""
        if self.num_experts is None:
            raise ValueError(f"model_type {self.model_type!r} is dense: it has no experts to place")
        return self.num_experts // ep_size

    def describe(self) -> str:
        """One line: family, sizes and the features that differ between families."""
        parts = [f"{self.num_layers} layers", f"hidden {self.hidden_size}",
                 f"{self.num_attention_heads} heads / {self.num_key_value_heads} KV × head_dim {self.head_dim}"]
        if self.is_moe:
            parts.append(f"{self.num_experts} experts top-{self.moe_top_k}")
        parts += (["q/k/v bias"] if self.qkv_bias else []) + (["q/k norm"] if self.qk_norm else [])
        parts.append("tied embeddings" if self.tie_word_embeddings else "untied embeddings")
        rope = f"RoPE θ={self.rope_theta:g}"
        if self.rope_scaling:
            s = self.rope_scaling
            rope += (f" llama3 ×{s.factor:g} (low {s.low_freq_factor:g}, high {s.high_freq_factor:g}, "
                     f"original {s.original_max_position_embeddings})")
        return f"{self.model_type}: " + ", ".join(parts + [rope])


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config.json {field}: {value!r} is not supported (supported: {supported})")


def _rope(cfg: dict) -> tuple[float, Llama3RopeScaling | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` or the older ``rope_scaling``."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(field) or {}
    if not isinstance(rope, dict):
        raise _refuse(field, rope, "a mapping or null")
    key = "rope_type" if "rope_type" in rope else "type"
    rope_type = rope.get(key, "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse(f"{field}.{key}", rope_type, ", ".join(SUPPORTED_ROPE_TYPES))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise _refuse("rope_theta", theta, "an integer base (Megatron's rotary_base is an int)")
    for where, mapping in ((field, rope), ("", cfg)):
        partial = mapping.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise _refuse(f"{where}.partial_rotary_factor".lstrip("."), partial, "1.0 (full rotary)")
    if rope_type == "default":
        return theta, None
    missing = [f for f in LLAMA3_ROPE_FIELDS if rope.get(f) is None]
    if missing:
        raise ValueError(f"config.json {field}: rope_type 'llama3' needs {', '.join(missing)}")
    scaling = Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        raise _refuse(f"{field}.high_freq_factor", scaling.high_freq_factor, "> low_freq_factor")
    return theta, scaling


def _check_full_attention(cfg: dict, mtype: str) -> None:
    """Refuse sliding-window attention: transformers and vLLM would apply a window the learner does not."""
    if "use_sliding_window" in cfg:  # Qwen families: sliding_window only counts when this is true
        if cfg["use_sliding_window"]:
            raise _refuse("use_sliding_window", cfg["use_sliding_window"], "false (full attention)")
    elif cfg.get("sliding_window") is not None:  # Llama, Mistral: a window whenever it is set
        raise _refuse("sliding_window", cfg["sliding_window"], f"null for {mtype} (full attention)")
    kinds = sorted(set(cfg.get("layer_types") or ["full_attention"]))
    if kinds != ["full_attention"]:
        raise _refuse("layer_types", kinds, "only 'full_attention' layers")


def _check_biases(cfg: dict, mtype: str) -> bool:
    """Whether the q/k/v projections have biases (Qwen2 always; no family here has o_proj/MLP biases)."""
    if cfg.get("mlp_bias"):
        raise _refuse("mlp_bias", cfg["mlp_bias"], "false")
    if mtype == "qwen2":
        return True
    if cfg.get("attention_bias"):  # q, k, v and o_proj biases in Llama/Mistral/Qwen3: Megatron has no o_proj bias
        raise _refuse("attention_bias", cfg["attention_bias"], f"false for {mtype}")
    return False


def _moe_fields(cfg: dict) -> dict:
    if cfg.get("mlp_only_layers"):
        raise _refuse("mlp_only_layers", cfg["mlp_only_layers"], "[] (every layer MoE)")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise _refuse("decoder_sparse_step", cfg["decoder_sparse_step"], "1 (every layer MoE)")
    return dict(num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
                moe_top_k=int(cfg["num_experts_per_tok"]), moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))


def parse_hf_config(cfg: dict) -> HFArchitecture:
    """An :class:`HFArchitecture` from a parsed ``config.json``; ``ValueError`` naming the field otherwise."""
    try:
        return _parse(cfg)
    except KeyError as err:
        raise ValueError(f"config.json: required field {err} is missing") from None


def _parse(cfg: dict) -> HFArchitecture:
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", mtype, ", ".join(SUPPORTED_MODEL_TYPES))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "silu")
    _check_full_attention(cfg, mtype)
    qkv_bias = _check_biases(cfg, mtype)
    rope_theta, rope_scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
    return HFArchitecture(
        model_type=mtype, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=mtype in QK_NORM_TYPES, rope_scaling=rope_scaling,
        **(_moe_fields(cfg) if mtype == "qwen3_moe" else {}))


def read_hf_architecture(model_path: str | os.PathLike) -> HFArchitecture:
    """Parse ``<model_path>/config.json`` into an :class:`HFArchitecture`."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path: expected an HF model directory with config.json, got {model_path}")
    return parse_hf_config(json.loads(path.read_text()))
