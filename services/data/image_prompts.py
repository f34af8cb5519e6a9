"""A data row's images in its prompt: prepared in the image pool, shown in the user turn, their tokens expanded.

For a vision-language model (``data.image_key`` set) each drawn row's images are prepared by
:class:`services.data.image_pool.ImagePool` (``data.image_workers`` processes). The first user turn's content becomes a
list of parts, one ``{"type": "image"}`` per image and then the text, which the model's chat template renders as
its image placeholder, expanded by the model's rules (:mod:`services.data.vision_rules`) to the image's token count:
Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>`` has its ``<|image_pad|>`` repeated, Nano-Omni's
``<image>`` becomes ``<img>`` + ``<image>`` x n + ``</img>`` (what vLLM's processor writes), so the prompt's
token ids are the ones the engine and the learner both see. The prompt carries the
resized pixels (:class:`protocol.images.PromptImage`); the learner's pixel values are made from them again
(:func:`image_inputs`). An image that cannot be used fails its row with :class:`BadImage`, which the prompt source
counts by kind and skips (docs/multimodal.md).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protocol.images import PromptImage
from services.data.images import IMAGE_PAD, ImageRules
from services.data.vision_rules import OMNI_MODEL_TYPE, VisionRules, expand_placeholders

if TYPE_CHECKING:
    from learner.mrope_positions import ImageInputs
    from services.data.image_pool import ImagePool
    from services.data.images import ImageRef, PreparedImage

__all__ = ["IMAGE_PAD", "BadImage", "ImagePrompts", "expand_image_tokens", "image_inputs", "image_token_id",
           "vision_token_ids"]


class BadImage(Exception):
    """A row's image cannot be used (:class:`services.data.images.ImageFailure`): the row is skipped and counted."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"image {kind}: {reason}")
        self.kind, self.reason = kind, reason


def image_token_id(model_dir: str) -> int:
    """``image_token_id`` of the model's ``config.json`` (:func:`rollout.vllm_images.image_token_id`, which the
    engine reads too); a model without one is an error naming the file."""
    from rollout.vllm_images import image_token_id as engine_image_token

    token = engine_image_token(model_dir)
    if token is None:
        raise ValueError(f"data.image_key is set, but {Path(model_dir) / 'config.json'} has no integer "
                         f"image_token_id: the model is not a vision-language model (Qwen2-VL family or "
                         f"Nano-Omni)")
    return token


def vision_token_ids(model_dir: str) -> frozenset[int]:
    """The model's vision special tokens from its ``config.json``: Qwen2-VL's start, end, image and video
    placeholders; Nano-Omni's ``<img>``, ``</img>`` (its tokenizer), image, video and audio placeholders."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") == OMNI_MODEL_TYPE:
        from rollout.vllm_images import image_tokens

        tokens = image_tokens(model_dir)
        if tokens is None:
            raise ValueError(f"{Path(model_dir) / 'config.json'}: a {OMNI_MODEL_TYPE} config without an integer "
                             f"image_token_id or a vision_config")
        video = cfg.get("video_token_id")
        return frozenset(t for t in (tokens.start, tokens.end, tokens.image, tokens.audio, video)
                         if isinstance(t, int))
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return frozenset(int(cfg[k]) for k in keys if isinstance(cfg.get(k), int))


@dataclass
class ImagePrompts:
    """Turns a row's image references into prepared images, image parts of the chat turn and expanded tokens."""

    pool: ImagePool
    refs_of: Callable[[dict], list[ImageRef]]
    """A row's image references (``DataConfig.row_images``)."""
    token_id: int
    """The image placeholder's token id (``<|image_pad|>``, ``<image>``)."""
    rules: VisionRules = ImageRules()
    """The model's image rules, whose ``expansion`` a placeholder becomes (the pool's; Qwen2-VL's by default)."""

    def prepare(self, row: dict, base_dir: str | None) -> list[PreparedImage]:
        """The row's images, prepared; :class:`BadImage` for the first that cannot be used (the prompt source counts
        it)."""
        from services.data.images import ImageFailure

        refs = self.refs_of(row)
        if not refs:
            raise BadImage("missing", "the row has no image (data.image_key is empty)")
        out = self.pool.prepare(refs, base_dir)
        for result in out:
            if isinstance(result, ImageFailure):
                raise BadImage(result.kind, result.reason)
        return [r for r in out if not isinstance(r, ImageFailure)]

    def expand(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> list[int]:
        """:func:`expand_image_tokens` with this model's placeholder and rules."""
        return expand_image_tokens(ids, images, self.token_id, self.rules)

    @staticmethod
    def with_image_parts(turns: list[dict], count: int) -> list[dict]:
        """``turns`` with the first user turn's text preceded by ``count`` image parts."""
        out = [dict(t) for t in turns]
        for t in out:
            if t["role"] == "user":
                t["content"] = [*({"type": "image"} for _ in range(count)), {"type": "text", "text": t["content"]}]
                return out
        raise ValueError("data.image_key: the prompt has no user turn to show the images in")

    @staticmethod
    def wire(images: Sequence[PreparedImage]) -> list[PromptImage]:
        return [PromptImage(i.sha256, i.rgb) for i in images]

    def close(self) -> None:
        self.pool.close()


def expand_image_tokens(ids: Sequence[int], images: Sequence[PreparedImage], token_id: int,
                        rules: VisionRules | None = None) -> list[int]:
    """``ids`` with the ``i``-th placeholder ``token_id`` expanded by ``rules`` (default: Qwen2-VL's, repeated) to
    ``images[i].num_tokens`` image tokens; a template that did not render one placeholder per image is an error
    naming the placeholder and the counts."""
    return expand_placeholders(ids, [i.num_tokens for i in images], token_id, rules or ImageRules())


def image_inputs(images: Sequence[PromptImage], rules: VisionRules) -> ImageInputs:
    """The learner's inputs for a prompt's images, made from the pixels the engine was given by the model's
    rules (``pixel_values`` concatenated, one ``image_grid_thw`` row per image)."""
    from learner.mrope_positions import ImageInputs

    processed = [rules.process(i.pixels) for i in images]
    return ImageInputs(np.concatenate([p for p, _ in processed]), np.stack([g for _, g in processed]))
