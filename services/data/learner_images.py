"""A run's images on the learner's side: the learner's inputs made again from the pixels a prompt carried.

The engine saw each prompt's resized pixels (:class:`protocol.images.PromptImage`); the learner gets its pixel
values and grids from the same pixels by the model's image rules (:func:`image_inputs`), for the groups
of a step and for the parity probe's fixed sequences, whose continuations never hold a vision token. For text
data (no ``data.image_key``) there is nothing to make: no inputs, no vision tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol import PromptRequest, TrajectoryGroup
from protocol.images import PromptImage
from services.data.image_prompts import image_inputs, vision_token_ids
from services.data.vision_rules import image_rules

if TYPE_CHECKING:
    from learner.mrope_positions import ImageInputs
    from services.data.vision_rules import VisionRules
    from services.recipe.data import DataConfig


@dataclass(frozen=True)
class LearnerImages:
    """The learner job's image bookkeeping (:mod:`services.job.learner_job`): one object, the same calls for
    text data (where each is a no-op) and for images."""

    rules: VisionRules | None = None
    """The model's image rules (:func:`services.data.vision_rules.image_rules`); None: text data."""
    vision_tokens: frozenset[int] = field(default_factory=frozenset)
    """The model's vision special tokens (:func:`services.data.image_prompts.vision_token_ids`); empty for text
    data."""

    @classmethod
    def of(cls, data: DataConfig, model_path: str) -> LearnerImages:
        """The images of a run on ``data`` with the model at ``model_path`` (text data: none)."""
        if data.image_key is None:
            return cls()
        return cls(image_rules(model_path), vision_token_ids(model_path))

    @property
    def in_use(self) -> bool:
        """The run trains on images."""
        return self.rules is not None

    def step_inputs(self, groups: Sequence[tuple[TrajectoryGroup, PromptRequest]]) -> dict[str, ImageInputs] | None:
        """The learner's image inputs of a step's groups' prompts, by prompt id, each group with the request it was
        sampled for (None for text data); a group whose ``image_ids`` are not its prompt's images is a
        ``ValueError``."""
        if self.rules is None:
            return None
        out = {}
        for group, request in groups:
            sent = tuple(i.sha256 for i in request.images)
            if group.image_ids != sent:
                raise ValueError(f"group {group.group_id}: image_ids {list(group.image_ids)} are not its "
                                 f"prompt's images {list(sent)}")
            if request.images:
                out[request.prompt_id] = image_inputs(request.images, self.rules)
        return out

    def probe_images(self, first: Sequence[PromptRequest], n: int
                     ) -> tuple[list[list[PromptImage]], list[ImageInputs | None]]:
        """The images of the parity probe's ``n`` fixed sequences (sequence ``i`` has the images of
        ``first[i % len(first)]``) and their learner inputs (None where a sequence has none); ``([], [])`` for text
        data or no prompts."""
        if self.rules is None or not first:
            return [], []
        images = [first[i % len(first)].images for i in range(n)]
        return images, [image_inputs(im, self.rules) if im else None for im in images]
