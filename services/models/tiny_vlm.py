"""Build a tiny random-init Qwen2.5-VL (vision tower + language model) with a local tokenizer and image processor.

No hub access. The tokenizer is :func:`services.models.tiny_model.build_tokenizer`'s byte-level BPE plus the four vision
tokens of the Qwen2.5-VL family, added in this order right after the text vocabulary: ``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` (so every id below ``vision_start_token_id`` is text). Its
chat template is the tiny model's ChatML one, with content parts rendered as Qwen2.5-VL's template does: an image
part becomes ``<|vision_start|><|image_pad|><|vision_end|>``, a text part its text. The single ``<|image_pad|>`` is
what a processor expands to the image's token count (``grid_t * grid_h * grid_w / merge_size**2``).

The directory holds what the published Qwen2.5-VL checkpoints hold: ``config.json`` (``model_type: qwen2_5_vl``,
``text_config`` + ``vision_config`` with the family's keys, the vision token ids), ``model.safetensors``,
``generation_config.json``, the tokenizer files, ``chat_template.jinja`` and ``preprocessor_config.json`` (the
Qwen2-VL image processor's, with ``min_pixels`` / ``max_pixels``). It is written from the PIL image processor
(``Qwen2VLImageProcessorPil``): the torchvision one and a whole ``Qwen2_5_VLProcessor`` (its video processor) need
torchvision, which has no build for this machine's CPU torch. ``Qwen2VLImageProcessorPil.from_pretrained(dir)``
reads it back.

Shapes: the text model keeps a head_dim vLLM's CPU attention supports (32 or 64); the multimodal rotary sections
(``mrope_section``: temporal, height, width) sum to head_dim / 2, as the family's do ([16, 24, 24] for head_dim 128).
``tiny`` images give at most 16 image tokens (``max_pixels`` = 16 merged 28 x 28 patches).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.models.tiny_model import CHAT_TEMPLATE, media_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The family's vision tokens, in the order they are added (ids ``len(text vocab)`` onwards)."""
ARCH = "qwen2_5_vl"


@dataclass(frozen=True)
class VlmSize:
    """One size of the tiny VLM: the language model's and the vision tower's dimensions, and the image budget."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_num_heads: int
    fullatt_block_indexes: tuple[int, ...]
    min_pixels: int
    max_pixels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


MERGED_PATCH = 28 * 28
"""Pixels of one image token: a 2 x 2 merge of 14 x 14 patches (``patch_size`` 14, ``spatial_merge_size`` 2)."""
VLM_SIZES = {
    "tiny": VlmSize(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, mrope_section=(4, 6, 6), vision_depth=2, vision_hidden_size=64,
                    vision_intermediate_size=128, vision_num_heads=2, fullatt_block_indexes=(1,),
                    min_pixels=4 * MERGED_PATCH, max_pixels=16 * MERGED_PATCH),
    "small": VlmSize(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, mrope_section=(8, 12, 12), vision_depth=4, vision_hidden_size=256,
                     vision_intermediate_size=512, vision_num_heads=4, fullatt_block_indexes=(1, 3),
                     min_pixels=4 * MERGED_PATCH, max_pixels=256 * MERGED_PATCH),
}
"""``tiny`` is what CPU tests use (head_dim 32, <= 16 image tokens); ``small`` has head_dim 64, <= 256 tokens."""

_CONTENT_MACRO = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}")
VLM_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ render(m['content']) }}")
"""The tiny model's ChatML template; a message's content may be a list of parts (``{"type": "image"}``,
``{"type": "text", "text": ...}``), rendered as Qwen2.5-VL's template renders them. String content renders as
before."""


def _check(size: str) -> VlmSize:
    if size not in VLM_SIZES:
        raise ValueError(f"size: expected one of {tuple(VLM_SIZES)} for arch {ARCH}, got {size!r}")
    dims = VLM_SIZES[size]
    if sum(dims.mrope_section) * 2 != dims.head_dim:  # a guard on the table above
        raise ValueError(f"mrope_section {dims.mrope_section} must sum to head_dim / 2 = {dims.head_dim // 2}")
    return dims


def _config(dims: VlmSize, tok, ids: dict[str, int], vocab: int, max_positions: int, init_std: float):
    import transformers as tf

    text = dict(
        vocab_size=vocab, hidden_size=dims.hidden_size, intermediate_size=dims.intermediate_size,
        num_hidden_layers=dims.num_hidden_layers, num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="silu", initializer_range=init_std, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(dims.mrope_section)},
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = dict(
        depth=dims.vision_depth, hidden_size=dims.vision_hidden_size, intermediate_size=dims.vision_intermediate_size,
        num_heads=dims.vision_num_heads, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        tokens_per_second=2, window_size=112, out_hidden_size=dims.hidden_size,
        fullatt_block_indexes=list(dims.fullatt_block_indexes), initializer_range=init_std, hidden_act="silu")
    cfg = tf.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def make_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0, size: str = "tiny", dtype: str = "float32",
                  max_positions: int = 2048, init_std: float = 0.2) -> Path:
    """Write a random-init Qwen2.5-VL + tokenizer + image processor to ``out_dir`` and return it.

    Deterministic for a seed (weights; the tokenizer is always the seed-0 one, so models of different seeds share
    token ids). ``init_std`` is the init scale of both the tower and the language model (0.2 gives peaked outputs,
    like a trained model's; 0.02 near-uniform ones)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    dims = _check(size)
    out = Path(out_dir)
    tok, ids, vocab = media_tokenizer(out, VISION_TOKENS, VLM_CHAT_TEMPLATE, dtype, init_std)
    cfg = _config(dims, tok, ids, vocab, max_positions, init_std)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    processor = Qwen2VLImageProcessorPil(min_pixels=dims.min_pixels, max_pixels=dims.max_pixels, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    processor.save_pretrained(str(out))
    _publish_pixel_bounds(out / "preprocessor_config.json", dims)
    (out / "inflight_tiny.json").write_text(json.dumps({"seed": seed, "arch": ARCH, "size": size, "dtype": dtype}))
    return out


def _publish_pixel_bounds(path: Path, dims: VlmSize) -> None:
    """Write ``min_pixels`` / ``max_pixels`` and ``processor_class`` beside ``size`` as the published checkpoints'
    ``preprocessor_config.json`` do (readers that look for the old keys find them)."""
    cfg = json.loads(path.read_text())
    cfg.update(min_pixels=dims.min_pixels, max_pixels=dims.max_pixels, processor_class="Qwen2_5_VLProcessor")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
