"""Images on the wire: a prompt's pictures, named by content, their pixels sent once per prompt.

A :class:`~protocol.messages.PromptRequest` of a vision-language prompt carries its images as
:class:`PromptImage` s: the RGB pixels *as the model's image processor resizes them* (so the engine and the
learner start from the same pixels) and the sha256 of the image's encoded bytes. A
:class:`~protocol.messages.TrajectoryGroup` carries only the names (``image_ids``): the pixels cross from the
learner job to the pool once, with the prompt, and never come back. Pixels travel as a uint8 ndarray through
the codec's array references (no pickle).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol import fields as F
from protocol.errors import ProtocolError

MAX_IMAGES_PER_PROMPT = 64
MAX_IMAGE_SIDE = 16384
"""Largest height or width of a wire image (the model's resize keeps images far smaller)."""


def _sha256(v: object, path: str) -> str:
    s = F.as_str(v, path, allow_empty=False)
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        raise ProtocolError(path, "a sha256 as 64 lowercase hex digits", s[:80])
    return s


@dataclass
class PromptImage:
    """One image of a prompt: its name and its pixels after the model's resize."""

    sha256: str
    """The sha256 of the image's encoded bytes (the same image from a path, bytes or a data URI has one name)."""
    pixels: np.ndarray
    """uint8 ``[height, width, 3]`` RGB, resized by the model's image-processor rules."""

    def __post_init__(self):
        self.pixels = np.ascontiguousarray(self.pixels, dtype=np.uint8)

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    def to_wire(self) -> dict:
        return {"sha256": self.sha256, "pixels": self.pixels}

    @classmethod
    def from_wire(cls, d: object, path: str) -> PromptImage:
        d = F.as_dict(d, path)
        sha = _sha256(F.req(d, "sha256", path), F._join(path, "sha256"))
        pixels = F.as_array(F.req(d, "pixels", path), F._join(path, "pixels"), "uint8", ndim=3)
        h, w, c = pixels.shape
        if c != 3 or not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
            raise ProtocolError(F._join(path, "pixels"), f"[height, width, 3] with sides in [1, {MAX_IMAGE_SIDE}]",
                                list(pixels.shape))
        return cls(sha, pixels)


def images_from_wire(d: dict, path: str) -> list[PromptImage]:
    """The ``images`` of a prompt message (absent: none)."""
    raw = F.as_list(d.get("images", []), F._join(path, "images"), MAX_IMAGES_PER_PROMPT)
    return [PromptImage.from_wire(x, f"{F._join(path, 'images')}[{i}]") for i, x in enumerate(raw)]


def image_ids_from_wire(d: dict, path: str) -> tuple[str, ...]:
    """The ``image_ids`` of a group message (absent: none)."""
    raw = F.as_list(d.get("image_ids", []), F._join(path, "image_ids"), MAX_IMAGES_PER_PROMPT)
    return tuple(_sha256(x, f"{F._join(path, 'image_ids')}[{i}]") for i, x in enumerate(raw))
