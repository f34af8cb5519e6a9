"""A data row's images in its prompt: prepared in the image pool, shown in the user turn, their tokens expanded.

For a vision-language model (``data.image_key`` set) each drawn row's images are prepared by
:class:`services.data.image_pool.ImagePool` (``data.image_workers`` processes). The first user turn's content becomes a
list of parts, one ``{"type": "image"}`` per image and then the text, which the model's chat template renders as
``<|vision_start|><|image_pad|><|vision_end|>``; each ``<|image_pad|>`` is then repeated to the image's token
count, so the prompt's token ids are the ones the engine and the learner both see. The prompt carries the
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

if TYPE_CHECKING:
    from learner.mrope_positions import ImageInputs
    from services.data.image_pool import ImagePool
    from services.data.images import ImageRef, ImageRules, PreparedImage

IMAGE_PAD = "<|image_pad|>"
"""The Qwen2-VL family's image placeholder token."""


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
                         f"image_token_id: the model is not a vision-language model of the Qwen2-VL family")
    return token


def vision_token_ids(model_dir: str) -> frozenset[int]:
    """The model's vision special tokens (start, end, image and video placeholders) from its ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return frozenset(int(cfg[k]) for k in keys if isinstance(cfg.get(k), int))


@dataclass
class ImagePrompts:
    """Turns a row's image references into prepared images, image parts of the chat turn and expanded tokens."""

    pool: ImagePool
    refs_of: Callable[[dict], list[ImageRef]]
    """A row's image references (``DataConfig.row_images``)."""
    token_id: int
    """The ``<|image_pad|>`` token id."""

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
        """:func:`expand_image_tokens` with this model's placeholder."""
        return expand_image_tokens(ids, images, self.token_id)

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


def expand_image_tokens(ids: Sequence[int], images: Sequence[PreparedImage], token_id: int) -> list[int]:
    """``ids`` with the ``i``-th placeholder ``token_id`` repeated ``images[i].num_tokens`` times; a template that did
    not render one placeholder per image is an error naming the counts."""
    at = [j for j, t in enumerate(ids) if t == token_id]
    if len(at) != len(images):
        raise ValueError(f"data.image_key: the chat template rendered {len(at)} {IMAGE_PAD} for {len(images)} "
                         f"images; it must render one per {{'type': 'image'}} part")
    out: list[int] = []
    start = 0
    for j, image in zip(at, images, strict=True):
        out.extend(ids[start:j])
        out.extend([token_id] * image.num_tokens)
        start = j + 1
    out.extend(ids[start:])
    return out


def image_inputs(images: Sequence[PromptImage], rules: ImageRules) -> ImageInputs:
    """The learner's inputs for a prompt's images, made from the pixels the engine was given."""
    from learner.mrope_positions import ImageInputs
    from services.data.images import process_pixels

    processed = [process_pixels(i.pixels, rules) for i in images]
    return ImageInputs(np.concatenate([p for p, _ in processed]), np.stack([g for _, g in processed]))
