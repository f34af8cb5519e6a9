"""Build a tiny random-init Nemotron-3-Nano-Omni (RADIO vision tower + projector + Nemotron-H) with a local tokenizer.

No hub access. The model is transformers' own ``nemotron_h_omni`` class (``NemotronH_Omni_Reasoning_V3``: a RADIO
ViT, a 0.5 pixel shuffle, an RMSNorm + squared-ReLU MLP projector, a Nemotron-H language model) at reduced sizes,
without the Parakeet audio tower (the class builds none when ``audio_config`` is null). ``save_pretrained`` writes
the tensors under the published checkpoint's names (``language_model.backbone.*``, ``vision_model.radio_model.*``,
``mlp1.*``): transformers' conversion mapping reverses its renames on save.

The tokenizer is :func:`services.models.tiny_model.build_tokenizer`'s byte-level BPE plus the family's media tokens
(:data:`MEDIA_TOKENS`, added in that order after the text vocabulary). Its chat template renders an image part as
``<image>``; the model's processor (transformers' and vLLM's ``nano_nemotron_vl``) expands it to
``<img>`` + ``<image>`` x n + ``</img>`` with n = grid_h * grid_w / 4 (a patch grid of 16-pixel patches, pixel
shuffled 2 x 2).

``config.json`` carries both readers' keys, as the published one does: transformers reads ``text_config``,
``vision_config`` (its ``RadioConfig`` fields) and the token ids; vLLM's ``nano_nemotron_vl`` reads
``vision_config.args`` (a timm model name whose dimensions the tiny ones override, the CPE table size, the
teachers that give the class-token count, the register multiple, ``min_num_patches`` / ``max_num_patches`` that
turn on dynamic resolution), ``force_image_size``, ``patch_size``, ``norm_mean`` / ``norm_std``, ``vit_hidden_size``
and the pixel-shuffle version. The text config is written as NVIDIA publishes Nemotron-H
(``hybrid_override_pattern``), as :mod:`services.models.tiny_model` does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.models.tiny_model import (
    CHAT_TEMPLATE,
    SIZES,
    _CommonConfig,
    _nemotron_h_config,
    _perturb_hybrid,
    media_tokenizer,
    nudge,
)

ARCH = "nemotron_h_omni"
MEDIA_TOKENS = ("<img>", "</img>", "<image>", "<video>", "<so_start>", "<so_end>", "<so_embedding>")
"""The family's media tokens (image start / end / context, video, audio start / end / context)."""
PATCH = 16
"""RADIO's patch side in pixels; one image token is a 2 x 2 pixel shuffle of patches (32 x 32 pixels)."""


@dataclass(frozen=True)
class OmniSize:
    """One size of the tiny Nano-Omni: the vision tower's and projector's dimensions and the image patch budget
    (the language model is :data:`services.models.tiny_model.SIZES`' of the same name, a dense Nemotron-H, or
    with ``make_tiny_omni(moe=True)`` one with MoE layers as Nemotron 3 Nano's)."""

    vision_hidden_size: int
    vision_layers: int
    vision_heads: int
    projector_hidden_size: int
    min_num_patches: int
    max_num_patches: int
    cpe_max_size: int
    """Pixels per side of the position-embedding table (``cpe_max_size / 16`` patches a side)."""


OMNI_SIZES = {
    "tiny": OmniSize(vision_hidden_size=64, vision_layers=2, vision_heads=2, projector_hidden_size=256,
                     min_num_patches=16, max_num_patches=64, cpe_max_size=256),
}
"""``tiny`` is what CPU tests use: <= 64 patches (16 image tokens) an image, vision head_dim 32."""
NUM_CLS_TOKENS = 2
"""Class tokens (one per teacher in vLLM's reading); with :data:`NUM_REGISTERS`, a multiple of 8 (C-RADIO's
``register_multiple``)."""
NUM_REGISTERS = 6

_CONTENT_MACRO = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<image>"
    "{% elif part['type'] == 'audio' or 'audio' in part %}<so_embedding>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}")
OMNI_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ render(m['content']) }}")
"""The tiny model's ChatML template; an image part renders as ``<image>`` (the processor's placeholder)."""


def _config(dims: OmniSize, tok, ids: dict[str, int], vocab: int, max_positions: int, init_std: float,
            moe: bool = False):
    import transformers as tf

    text_dims = SIZES["tiny"]
    common = _CommonConfig(
        vocab_size=vocab, hidden_size=text_dims["hidden_size"], num_hidden_layers=text_dims["num_hidden_layers"],
        num_attention_heads=text_dims["num_attention_heads"], num_key_value_heads=text_dims["num_key_value_heads"],
        max_position_embeddings=max_positions, rope_parameters={}, tie_word_embeddings=False,
        initializer_range=init_std, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        rms_norm_eps=1e-6)
    text = _nemotron_h_config("nemotron_h_moe" if moe else "nemotron_h", text_dims, common)
    vision = tf.RadioConfig(
        hidden_size=dims.vision_hidden_size, num_hidden_layers=dims.vision_layers,
        num_attention_heads=dims.vision_heads, mlp_ratio=4.0, patch_size=PATCH, max_img_size=dims.cpe_max_size,
        num_cls_tokens=NUM_CLS_TOKENS, num_registers=NUM_REGISTERS, video_temporal_patch_size=2,
        initializer_range=init_std)
    cfg = tf.NemotronH_Omni_Reasoning_V3_Config(
        vision_config=vision, text_config=text, audio_config=None, projector_hidden_size=dims.projector_hidden_size,
        vision_hidden_size=dims.vision_hidden_size, downsample_ratio=0.5, image_token_id=ids["<image>"],
        video_token_id=ids["<video>"], audio_token_id=ids["<so_embedding>"])
    cfg.architectures = ["NemotronH_Omni_Reasoning_V3"]
    return cfg


def make_tiny_omni(out_dir: str | os.PathLike, seed: int = 0, size: str = "tiny", dtype: str = "float32",
                   max_positions: int = 2048, init_std: float = 0.2, moe: bool = False) -> Path:
    """Write a random-init Nano-Omni (no audio tower) + tokenizer to ``out_dir`` and return it; ``moe``: its
    language model has MoE layers (``tiny_model.HYBRID_PATTERNS['nemotron_h_moe']``), as the seed's has.

    Deterministic for a seed (the tokenizer is always the seed-0 one). The norms, Mamba ``A_log`` / ``D`` move
    off their init constants (as :func:`services.models.tiny_model.make_tiny_model` does) so a loader that drops
    one changes the outputs; RADIO's layer scales stay 1 (C-RADIO has none: vLLM does not load them)."""
    import torch
    from transformers import NemotronH_Omni_Reasoning_V3

    if size not in OMNI_SIZES:
        raise ValueError(f"size: expected one of {tuple(OMNI_SIZES)} for arch {ARCH}, got {size!r}")
    dims = OMNI_SIZES[size]
    out = Path(out_dir)
    tok, ids, vocab = media_tokenizer(out, MEDIA_TOKENS, OMNI_CHAT_TEMPLATE, dtype, init_std)
    cfg = _config(dims, tok, ids, vocab, max_positions, init_std, moe)
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(cfg)
    _perturb_hybrid(model.language_model, torch.Generator().manual_seed(seed))
    _perturb_vision(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    _publish_config(out / "config.json", dims)
    (out / "inflight_tiny.json").write_text(json.dumps({"seed": seed, "arch": ARCH, "size": size, "dtype": dtype}))
    return out


def _perturb_vision(model, generator) -> None:
    """Move the vision LayerNorms' and the projector RMSNorm's weights off 1 (the layer scales stay 1)."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.vision_model.named_parameters(prefix="vision_model"),
                             *model.multi_modal_projector.named_parameters(prefix="multi_modal_projector")]:
            if "norm" in name and name.endswith(".weight"):
                nudge(tensor, generator)


def _publish_config(path: Path, dims: OmniSize) -> None:
    """Rewrite ``config.json`` with the keys vLLM's ``nano_nemotron_vl`` reads beside transformers' ones (its
    language model's dtype is ``text_config.dtype``: an assertion fails where it is absent), and the text config
    in Nemotron-H's published form."""
    from transformers import NemotronHConfig

    cfg = json.loads(path.read_text())
    text = cfg["text_config"]
    layers = text.pop("layers_block_type")
    text.pop("mtp_layers_block_type", None)
    text["hybrid_override_pattern"] = NemotronHConfig._list_to_pattern(layers)
    text["num_hidden_layers"] = len(layers)
    text["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v for v in text["time_step_limit"]]
    text["dtype"] = cfg["vision_config"]["dtype"] = cfg["dtype"]  # vLLM builds the language model in text_config's
    vision = cfg["vision_config"]
    heads, hidden = vision["num_attention_heads"], vision["hidden_size"]
    vision["args"] = {
        "model": "vit_small_patch16_224", "hidden_size": hidden, "num_hidden_layers": vision["num_hidden_layers"],
        "num_attention_heads": heads, "intermediate_size": int(hidden * vision["mlp_ratio"]),
        "cpe_max_size": dims.cpe_max_size, "teachers": [{"name": f"teacher{i}"} for i in range(NUM_CLS_TOKENS)],
        "cls_token_per_teacher": True, "register_multiple": NUM_CLS_TOKENS + NUM_REGISTERS,
        "min_num_patches": dims.min_num_patches, "max_num_patches": dims.max_num_patches}
    # below the position table's size, as the published one (C-RADIO's CPE: vLLM interpolates the table to the
    # image's longer side only when the two differ; transformers always does)
    vision["preferred_resolution"] = [dims.cpe_max_size // 2, dims.cpe_max_size // 2]
    vision["separate_video_embedder"] = True
    cfg.update(force_image_size=dims.cpe_max_size // 2, patch_size=PATCH, vit_hidden_size=hidden,
               norm_mean=vision["norm_mean"], norm_std=vision["norm_std"], ps_version="v2", use_thumbnail=True,
               template="nemotron_h_omni", image_tag_type="internvl")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

