"""One way in to a vision-language model's image rules: :class:`VisionRules`, the interface every family's rules
share, and :func:`image_rules`, which reads a model directory's ``config.json`` and returns its family's rules.

Families: the Qwen2-VL family (``qwen2_vl``, ``qwen2_5_vl``: :class:`services.data.images.ImageRules`, read from
``preprocessor_config.json``) and Nemotron-3-Nano-Omni (``nemotron_h_omni``:
:class:`services.data.omni_images.OmniImageRules`, read from ``config.json`` and the tokenizer). A directory with
no ``config.json`` (an image processor saved alone) is read as the Qwen2-VL family's, as before there were two.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

QWEN_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
OMNI_MODEL_TYPE = "nemotron_h_omni"
SUPPORTED_MODEL_TYPES = (*QWEN_MODEL_TYPES, OMNI_MODEL_TYPE)


class VisionRules(Protocol):
    """How a model family's processor turns an image into pixel values and prompt tokens. Implementations are
    frozen dataclasses that pickle to the image workers and import no torch."""

    @property
    def placeholder(self) -> str:
        """The image placeholder the chat template renders for an image part (named in errors)."""
        ...

    @property
    def resample(self) -> int:
        """The Pillow filter of the resize."""
        ...

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """Width and height the processor resizes an image of ``width`` x ``height`` to; ``ValueError`` for one it
        cannot size (reported as ``bad_aspect``)."""
        ...

    def process(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``pixel_values`` (float32, one row per patch) and ``image_grid_thw`` (int64 ``[3]``) of an image already
        resized to :meth:`target_size` (uint8 ``[h, w, 3]``)."""
        ...

    def tokens(self, grid_thw: np.ndarray) -> int:
        """Image tokens the model gives an image of that grid."""
        ...

    def expansion(self, token_id: int, num_tokens: int) -> list[int]:
        """The ids one rendered placeholder (``token_id``) becomes for an image of ``num_tokens`` tokens."""
        ...


def model_type(model_dir: str | os.PathLike) -> object:
    """``model_type`` of the directory's ``config.json`` as it is there (None: no such file or key); ``ValueError``
    naming the file when it is not a JSON object."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg.get("model_type")


def image_rules(model_dir: str | os.PathLike) -> VisionRules:
    """The image rules of a model directory by its ``config.json``'s ``model_type`` (module docstring);
    ``ValueError`` naming ``model_type`` and the supported ones for any other."""
    kind = model_type(model_dir)
    if not (Path(model_dir) / "config.json").is_file() or kind in QWEN_MODEL_TYPES:
        from services.data.images import ImageRules

        return ImageRules.from_pretrained(model_dir)
    if kind == OMNI_MODEL_TYPE:
        from services.data.omni_images import OmniImageRules

        return OmniImageRules.from_pretrained(model_dir)
    raise ValueError(f"{Path(model_dir) / 'config.json'}: model_type {kind!r} has no image rules; data.image_key "
                     f"is supported for model_type {', '.join(SUPPORTED_MODEL_TYPES)}")


def expand_placeholders(ids: Sequence[int], counts: Sequence[int], token_id: int, rules: VisionRules) -> list[int]:
    """``ids`` with the ``i``-th ``token_id`` replaced by ``rules.expansion(token_id, counts[i])``; a template that did
    not render one placeholder per image is an error naming the placeholder and the counts."""
    at = [j for j, t in enumerate(ids) if t == token_id]
    if len(at) != len(counts):
        raise ValueError(f"data.image_key: the chat template rendered {len(at)} {rules.placeholder} for "
                         f"{len(counts)} images; it must render one per {{'type': 'image'}} part")
    out: list[int] = []
    start = 0
    for j, n in zip(at, counts, strict=True):
        out.extend(ids[start:j])
        out.extend(rules.expansion(token_id, n))
        start = j + 1
    out.extend(ids[start:])
    return out
