"""Read a Hugging Face ``config.json`` into an :class:`HFArchitecture` (no torch, no Megatron).

Supported families (``model_type``): ``qwen2`` (q/k/v biases; Qwen2 and Qwen2.5, tied or untied
embeddings), ``qwen3`` (per-head q/k RMSNorm, explicit ``head_dim``), ``qwen3_moe`` (Qwen3 with
every layer a mixture of experts), ``llama`` (Llama 2/3.x, RoPE unscaled or ``llama3``-scaled) and
``mistral`` (Llama's layout, no sliding window). All are pre-norm RMSNorm decoders with SwiGLU MLPs
and grouped-query attention, so they share one Megatron layer spec. ``qwen2_5_vl`` (Qwen2.5-VL) is a
Qwen2 language model with multimodal RoPE (``mrope_section``) and a vision tower (:class:`VisionSpec`),
read from either layout: the published one (text fields at the top, ``rope_scaling: {type: mrope}``)
and the one transformers ≥ 5 writes (``text_config``, ``rope_parameters.mrope_section``).
``nemotron_h`` (Nemotron-H: Mamba2 / attention / MLP / MoE layers by a pattern) is read by
:mod:`learner.nemotron_h_config` into :attr:`HFArchitecture.hybrid`. ``nemotron_h_omni`` (Nemotron-3-Nano-Omni) is
its ``text_config``, a Nemotron-H, with the RADIO vision side (:class:`~learner.radio_spec.RadioSpec`) and plain
positions for image tokens (no RoPE); audio is not supported.

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from learner.nemotron_h_config import HybridSpec, parse_nemotron_h
from learner.radio_spec import MODEL_TYPE as OMNI_MODEL_TYPE
from learner.radio_spec import RadioSpec

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "qwen2_5_vl", "nemotron_h",
                         OMNI_MODEL_TYPE)
VISION_LANGUAGE_TYPES = ("qwen2_5_vl",)
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
class VisionSpec:
    """The vision side of a vision-language ``config.json``: the special tokens and the tower's patch geometry."""

    image_token_id: int
    """The placeholder token whose positions receive the tower's embeddings (``<|image_pad|>``, ``<image>``)."""
    video_token_id: int | None
    """The video placeholder (videos are refused); None: the model has none."""
    vision_start_token_id: int | None
    """``<|vision_start|>`` (Qwen2.5-VL); None where ``config.json`` names none (Nano-Omni's ``<img>``)."""
    spatial_merge_size: int
    """Patches merged per side into one language-model token (2: four patches per token)."""
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    out_hidden_size: int
    """Width of one merged embedding; equals the language model's ``hidden_size``."""
    depth: int
    hidden_size: int
    config: dict = field(default_factory=dict, compare=False, repr=False)
    """``config.json``'s ``vision_config`` as it is: what transformers builds the tower from."""
    mrope: bool = True
    """Image tokens take multimodal rotary positions (Qwen2.5-VL); false: the sequence's plain positions (Nano-Omni,
    whose language model has no RoPE)."""

    @property
    def patch_dim(self) -> int:
        """Values per row of ``pixel_values`` (channels × temporal patch × patch²)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def patches_per_token(self) -> int:
        return self.spatial_merge_size ** 2


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
    mrope_section: tuple[int, ...] | None = None
    """Rotary channel pairs for the temporal, height and width positions (multimodal RoPE), or None."""
    vision: VisionSpec | None = None
    """The vision tower of a vision-language model, or None (a text-only model)."""
    hybrid: HybridSpec | None = None
    """Nemotron-H's layer pattern and Mamba2/MoE fields, or None (every layer attention + MLP)."""
    radio: RadioSpec | None = None
    """Nano-Omni's RADIO vision tower and projector (``vision`` then holds its patch geometry), or None."""

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
        if self.hybrid is not None:
            return self._describe_hybrid(self.hybrid)
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
        if self.mrope_section:
            rope += f" mrope {list(self.mrope_section)}"
        if self.vision:
            v = self.vision
            parts.append(f"vision tower {v.depth} blocks × {v.hidden_size}, patch {v.patch_size}, "
                         f"merge {v.spatial_merge_size}")
        return f"{self.model_type}: " + ", ".join(parts + [rope])


    def _describe_hybrid(self, h: HybridSpec) -> str:
        parts = [f"{self.num_layers} layers", f"hidden {self.hidden_size}", h.describe()]
        if h.count("*"):
            parts.append(f"attention {self.num_attention_heads} heads / {self.num_key_value_heads} KV × head_dim "
                         f"{self.head_dim}, no RoPE")
        if self.is_moe:
            parts.append(f"{self.num_experts} experts top-{self.moe_top_k} (sigmoid, expert bias, "
                         f"×{h.routed_scaling_factor:g}) + shared {h.shared_expert_intermediate_size}")
        parts.append("tied embeddings" if self.tie_word_embeddings else "untied embeddings")
        if self.radio is not None and self.vision is not None:
            parts.append(f"RADIO tower {self.vision.depth} blocks × {self.vision.hidden_size}, patch "
                         f"{self.vision.patch_size}, pixel shuffle {self.radio.downsample_ratio:g}")
        return f"{self.model_type}: " + ", ".join(parts)


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
        if cfg.get("model_type") == "nemotron_h":
            return _parse_nemotron_h(cfg)
        if cfg.get("model_type") == OMNI_MODEL_TYPE:
            return _parse_omni(cfg)
        return _parse_vision_language(cfg) if cfg.get("model_type") in VISION_LANGUAGE_TYPES else _parse(cfg)
    except KeyError as err:
        raise ValueError(f"config.json: required field {err} is missing") from None


def _mrope_text_config(cfg: dict) -> tuple[dict, tuple[int, ...]]:
    """The language model's fields as a ``qwen2`` config (mrope taken out of its RoPE mapping) and the
    ``mrope_section``; both layouts (see the module docstring)."""
    nested = cfg.get("text_config")
    text = dict(nested) if nested else {k: v for k, v in cfg.items() if k != "vision_config"}
    where = "text_config." if nested else ""
    field = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = dict(text.get(field) or {})
    section = rope.pop("mrope_section", None)
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(x, int) and x > 0 for x in section):
        raise _refuse(f"{where}{field}.mrope_section", section, "three positive integers (temporal, height, width)")
    key = "rope_type" if "rope_type" in rope else "type"
    if rope.get(key) in ("mrope", "default"):
        rope[key] = "default"  # the published files' "mrope" is default RoPE applied per section
    text[field] = rope
    text["model_type"] = "qwen2"
    if "tie_word_embeddings" in cfg:  # a top-level value is what transformers and vLLM read
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text, tuple(section)


def _vision_spec(cfg: dict, hidden_size: int) -> VisionSpec:
    vis = cfg.get("vision_config")
    if not isinstance(vis, dict):
        raise _refuse("vision_config", vis, "a mapping (the vision tower's config)")
    spec = VisionSpec(
        image_token_id=int(cfg["image_token_id"]), video_token_id=int(cfg["video_token_id"]),
        vision_start_token_id=int(cfg["vision_start_token_id"]),
        spatial_merge_size=int(vis.get("spatial_merge_size", 2)), patch_size=int(vis.get("patch_size", 14)),
        temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
        in_channels=int(vis.get("in_channels", vis.get("in_chans", 3))),
        out_hidden_size=int(vis["out_hidden_size"]), depth=int(vis["depth"]), hidden_size=int(vis["hidden_size"]),
        config=dict(vis))
    if spec.out_hidden_size != hidden_size:
        raise _refuse("vision_config.out_hidden_size", spec.out_hidden_size,
                      f"the language model's hidden_size ({hidden_size})")
    return spec


def _parse_vision_language(cfg: dict) -> HFArchitecture:
    text, section = _mrope_text_config(cfg)
    lm = _parse(text)
    if sum(section) * 2 != lm.head_dim:
        raise _refuse("mrope_section", list(section), f"sections summing to head_dim / 2 = {lm.head_dim // 2}")
    return replace(lm, model_type=cfg["model_type"], mrope_section=section,
                   vision=_vision_spec(cfg, lm.hidden_size))


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


def _parse_nemotron_h(cfg: dict) -> HFArchitecture:
    """Nemotron-H: hybrid Mamba2 / attention (no RoPE) / squared-ReLU MLP / MoE layers (learner.nemotron_h_config)."""
    spec, moe = parse_nemotron_h(cfg)
    heads = int(cfg.get("num_attention_heads", 32))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
    return HFArchitecture(
        model_type="nemotron_h", vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=len(spec.pattern), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        intermediate_size=int(cfg["intermediate_size"]) if "-" in spec.pattern else 0,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), rope_theta=0.0,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=False, qk_norm=False,
        hybrid=spec, **moe)


def _parse_omni(cfg: dict) -> HFArchitecture:
    """Nemotron-3-Nano-Omni: the Nemotron-H of ``text_config`` (or the published ``llm_config``) with the RADIO side."""
    radio = RadioSpec.of(cfg)
    lm = _parse_nemotron_h({**(cfg.get("text_config") or cfg["llm_config"]), "model_type": "nemotron_h"})
    video = cfg.get("video_token_id", cfg.get("video_context_token_id"))
    vis = radio.vision_config
    vision = VisionSpec(
        image_token_id=radio.image_token_id, video_token_id=video if isinstance(video, int) else None,
        vision_start_token_id=None, spatial_merge_size=radio.merge, patch_size=radio.patch_size,
        temporal_patch_size=1, in_channels=int(vis.get("num_channels", 3)), out_hidden_size=lm.hidden_size,
        depth=int(vis.get("num_hidden_layers", 0)), hidden_size=radio.vision_hidden_size, config=vis, mrope=False)
    return replace(lm, model_type=OMNI_MODEL_TYPE, vision=vision, radio=radio)


def read_hf_architecture(model_path: str | os.PathLike) -> HFArchitecture:
    """Parse ``<model_path>/config.json`` into an :class:`HFArchitecture`."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path: expected an HF model directory with config.json, got {model_path}")
    return parse_hf_config(json.loads(path.read_text()))
