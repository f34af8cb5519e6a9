"""Prepare one image for a vision-language prompt: read it, validate it, convert it to RGB, resize and patchify it
by the model's image rules (:class:`services.data.vision_rules.VisionRules`: the Qwen2-VL family's
:class:`ImageRules` here, Nano-Omni's :class:`services.data.omni_images.OmniImageRules`), and name it by the sha256
of its encoded bytes.

:func:`prepare_image` never raises for a bad image: it returns an :class:`ImageFailure` whose ``kind`` is one of
:data:`FAILURE_KINDS` and whose ``reason`` says what was wrong (a missing or empty file, a file over
``max_bytes``, bytes that are not an image, a truncated or corrupt file, dimensions over ``max_pixels`` or an aspect
ratio over 200, a pixel mode with no faithful RGB conversion such as 16-bit or float, a path outside the data's
directory tree or not a regular file (:mod:`services.data.image_refs`), a format outside :data:`IMAGE_FORMATS`, or
whatever else a decoder raises; an image the rules cannot size is ``bad_aspect``). A good one becomes a
:class:`PreparedImage` holding exactly what the model's processor returns for it (for Qwen2-VL
``Qwen2VLImageProcessorPil``'s ``pixel_values`` and ``image_grid_thw``; a unit test compares them) plus its
content hash, its sizes and its image-token count.
:mod:`services.data.image_pool` runs this in worker processes.

The Qwen2-VL rules (:class:`ImageRules`, read from the model's ``preprocessor_config.json``): the image is resized to
the nearest height and width that are multiples of ``patch_size * merge_size`` (28) with the aspect ratio kept, then
scaled so its area lies in ``[min_pixels, max_pixels]`` (the processor's ``smart_resize``), bicubic; the values are
rescaled by 1/255 and normalised with the CLIP mean and std; the image is cut into 14 x 14 patches, repeated over
``temporal_patch_size`` (2) frames, ordered in 2 x 2 merge groups. Modes with transparency are composited on
white first (what vLLM's and qwen-vl-utils' image loaders do); other accepted modes convert with Pillow.

Padding. The Qwen2.5-VL path pads no pixels: images of different shapes become different numbers of patches, a
batch is their concatenation along the patch axis (:func:`batch_images`) and ``image_grid_thw`` tells the vision
tower where each image ends (it attends within an image using cumulative lengths). What varies per image is its
image-token count, which lands in the token sequence, and sequences of different lengths are padded or packed by
whoever batches sequences (the engine, the learner's packer). :attr:`ImageBatch.padding_share` says how much a
fixed-shape batch (every image padded to the largest) would have wasted.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.data.image_refs import (
    DEFAULT_LIMITS,
    FAILURE_KINDS,
    IMAGE_FORMATS,
    FailureKind,
    ImageFailure,
    ImageLimits,
    ImageRef,
    read_ref,
)

if TYPE_CHECKING:
    from services.data.vision_rules import VisionRules

__all__ = ["FAILURE_KINDS", "IMAGE_FORMATS", "IMAGE_PAD", "FailureKind", "ImageBatch", "ImageFailure", "ImageLimits",
           "ImageRef", "ImageRules", "PreparedImage", "batch_images", "prepare_image", "process_pixels", "smart_resize"]

CONVERTED_MODES = ("RGB", "L", "P", "1", "CMYK", "YCbCr", "LAB", "RGBX")
"""Pillow modes converted to RGB as they are."""
TRANSPARENT_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
"""Modes with an alpha channel: composited on white, then RGB."""
MAX_ASPECT_RATIO = 200
"""The processor refuses images whose longer side is over 200 times the shorter."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_PAD = "<|image_pad|>"
"""The Qwen2-VL family's image placeholder token."""


@dataclass(frozen=True)
class ImageRules:
    """The Qwen2-VL image processor's settings (``preprocessor_config.json``)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3
    """Pillow resampling filter (3: bicubic)."""

    @property
    def factor(self) -> int:
        """Height and width are multiples of this (one image token's side in pixels)."""
        return self.patch_size * self.merge_size

    @property
    def placeholder(self) -> str:
        return IMAGE_PAD

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """Width and height after :func:`smart_resize`."""
        h, w = smart_resize(height, width, self)
        return w, h

    def process(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`process_pixels` by these rules."""
        return process_pixels(rgb, self)

    def tokens(self, grid_thw: np.ndarray) -> int:
        """Image tokens of a grid: ``t * h * w / merge_size**2``."""
        return int(np.prod(grid_thw)) // self.merge_size ** 2

    def expansion(self, token_id: int, num_tokens: int) -> list[int]:
        """``token_id`` repeated ``num_tokens`` times (the template writes the vision start and end itself)."""
        return [token_id] * num_tokens

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImageRules:
        """The rules of a model directory's ``preprocessor_config.json``; ``ValueError`` naming the file and key
        when it is absent, of another processor or turns a step off."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{path}: no such file (a vision-language model directory has its image processor's "
                             f"preprocessor_config.json)")
        cfg = json.loads(path.read_text())
        kind = str(cfg.get("image_processor_type", ""))
        if not kind.startswith("Qwen2VLImageProcessor"):
            raise ValueError(f"{path}: image_processor_type {kind!r}, expected Qwen2VLImageProcessor (Qwen2-VL, "
                             f"Qwen2.5-VL)")
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(key, True) is not True:
                raise ValueError(f"{path}: {key} {cfg[key]!r}, only true is supported")
        size = cfg.get("size") or {}
        return cls(min_pixels=int(size.get("shortest_edge", cfg.get("min_pixels", cls.min_pixels))),
                   max_pixels=int(size.get("longest_edge", cfg.get("max_pixels", cls.max_pixels))),
                   patch_size=int(cfg.get("patch_size", cls.patch_size)),
                   merge_size=int(cfg.get("merge_size", cls.merge_size)),
                   temporal_patch_size=int(cfg.get("temporal_patch_size", cls.temporal_patch_size)),
                   image_mean=tuple(cfg.get("image_mean", CLIP_MEAN)),  # pyright: ignore[reportArgumentType]
                   image_std=tuple(cfg.get("image_std", CLIP_STD)),  # pyright: ignore[reportArgumentType]
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)), resample=int(cfg.get("resample", 3)))


@dataclass(frozen=True)
class PreparedImage:
    """One image as the model's processor outputs it, named by the sha256 of its encoded bytes."""

    sha256: str
    pixel_values: np.ndarray
    """float32, one row per patch: Qwen2-VL ``[grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]``,
    Nano-Omni ``[rows * cols, 3 * 16 * 16]``."""
    image_grid_thw: np.ndarray
    """int64 ``[3]``: temporal, height and width in patches."""
    size: tuple[int, int]
    """Width and height as read."""
    resized: tuple[int, int]
    """Width and height after the processor's resize."""
    num_tokens: int
    """Image tokens in the prompt (the rules' ``tokens`` of the grid: ``grid_t * grid_h * grid_w / merge**2``)."""
    num_bytes: int
    rgb: np.ndarray
    """uint8 ``[height, width, 3]``: the resized image, from which the rules' ``process`` makes ``pixel_values``
    (what the engine is given, so that engine and learner start from the same pixels)."""


def smart_resize(height: int, width: int, rules: ImageRules) -> tuple[int, int]:
    """Height and width after the processor's resize (multiples of ``rules.factor``, area in
    ``[min_pixels, max_pixels]``, aspect ratio kept as closely as that allows)."""
    f = rules.factor
    h_bar, w_bar = round(height / f) * f, round(width / f) * f
    if h_bar * w_bar > rules.max_pixels:
        beta = math.sqrt(height * width / rules.max_pixels)
        h_bar, w_bar = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < rules.min_pixels:
        beta = math.sqrt(rules.min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h_bar, w_bar


def prepare_image(ref: ImageRef, rules: VisionRules, limits: ImageLimits = DEFAULT_LIMITS,
                  base_dir: str | None = None) -> PreparedImage | ImageFailure:
    """Read, validate, convert, resize and patchify one image (module docstring); never raises for a bad image: an
    exception of a decoder is the image's ``corrupt`` failure, a size the rules refuse its ``bad_aspect``."""
    data = read_ref(ref, base_dir, limits)
    if isinstance(data, ImageFailure):
        return data
    digest = hashlib.sha256(data).hexdigest()
    try:
        img = _decode(data, limits, digest)
        if isinstance(img, ImageFailure):
            return img
        width, height = img.size
        try:
            w, h = rules.target_size(width, height)
        except ValueError as e:
            return ImageFailure("bad_aspect", str(e)[:500], digest)
        rgb = np.asarray(img.resize((w, h), resample=rules.resample), dtype=np.uint8)
        patches, grid = rules.process(rgb)
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises fails this image alone, with the reason
        return ImageFailure("corrupt", f"decoding failed: {type(e).__name__}: {e}"[:500], digest)
    return PreparedImage(digest, patches, grid, (width, height), (w, h), rules.tokens(grid), len(data), rgb)


def process_pixels(rgb: np.ndarray, rules: ImageRules) -> tuple[np.ndarray, np.ndarray]:
    """``pixel_values`` and ``image_grid_thw`` of an image already resized by the rules (uint8 ``[h, w, 3]``, sides
    multiples of ``rules.factor``): rescale, normalise, patchify, as the processor does after its resize."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[0] % rules.factor or rgb.shape[1] % rules.factor:
        raise ValueError(f"process_pixels: expected uint8 [h, w, 3] with h and w multiples of {rules.factor}, got "
                         f"shape {list(rgb.shape)}")
    chw = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    x = (chw.astype(np.float64) * rules.rescale_factor).astype(np.float32)  # the processor's order of operations
    mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in (rules.image_mean, rules.image_std))
    x = (x - mean) / std
    patches, grid_h, grid_w = _patchify(x, rules)
    return patches, np.array([1, grid_h, grid_w], dtype=np.int64)


def _decode(data: bytes, limits: ImageLimits, digest: str):
    """A decoded RGB Pillow image, or why not (checks the header's dimensions before decoding the pixels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        return ImageFailure("not_an_image", f"not an image of an accepted format {'/'.join(IMAGE_FORMATS)} "
                                            f"({len(data)} bytes)", digest)
    except Image.DecompressionBombError as e:
        return ImageFailure("too_large", f"huge dimensions: {e}", digest)
    except (OSError, ValueError, SyntaxError) as e:
        return ImageFailure("corrupt", f"the header cannot be read: {type(e).__name__}: {e}", digest)
    width, height = img.size
    if width == 0 or height == 0:
        return ImageFailure("empty", f"zero size ({width} x {height} pixels)", digest)
    if width * height > limits.max_pixels:
        return ImageFailure("too_large", f"huge dimensions: {width} x {height} = {width * height} pixels, over "
                                         f"max_pixels {limits.max_pixels}", digest)
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        return ImageFailure("bad_aspect", f"aspect ratio of {width} x {height} is over {MAX_ASPECT_RATIO}", digest)
    if img.mode not in CONVERTED_MODES + TRANSPARENT_MODES:
        return ImageFailure("bad_mode", f"pixel mode {img.mode!r} has no faithful RGB conversion; expected one of "
                                        f"{CONVERTED_MODES + TRANSPARENT_MODES}", digest)
    try:
        img.load()
    except (OSError, ValueError, SyntaxError) as e:
        kind: FailureKind = "truncated" if "truncated" in str(e) else "corrupt"
        return ImageFailure(kind, f"the pixels cannot be decoded: {type(e).__name__}: {e}", digest)
    if img.mode in TRANSPARENT_MODES:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _patchify(x: np.ndarray, rules: ImageRules) -> tuple[np.ndarray, int, int]:
    """``[C, H, W]`` -> ``[grid_h * grid_w, C * T * P * P]`` in merge-group order, repeated over T frames."""
    c, height, width = x.shape
    p, m, t = rules.patch_size, rules.merge_size, rules.temporal_patch_size
    gh, gw = height // p, width // p
    patches = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return np.ascontiguousarray(patches.reshape(gh * gw, c * t * p * p)), gh, gw


@dataclass(frozen=True)
class ImageBatch:
    """Several prepared images as the vision tower takes them: patches concatenated, one grid row per image."""

    pixel_values: np.ndarray
    """float32 ``[sum of patches, patch_dim]``."""
    image_grid_thw: np.ndarray
    """int64 ``[images, 3]``."""
    cu_patches: np.ndarray
    """int64 ``[images + 1]``: where each image's patches start (the last entry is the total)."""
    num_tokens: tuple[int, ...]
    """Image tokens of each image (its run of the image placeholder in the prompt)."""

    @property
    def padding_share(self) -> float:
        """Share of a fixed-shape batch (every image padded to the largest's patch count) that would be padding;
        this batch has none."""
        counts = np.diff(self.cu_patches)
        return 0.0 if not len(counts) else float(1 - counts.sum() / (len(counts) * counts.max()))


def batch_images(images: Sequence[PreparedImage]) -> ImageBatch:
    """Concatenate prepared images along the patch axis (no padding: module docstring)."""
    if not images:
        raise ValueError("images: expected at least one prepared image, got none")
    counts = [len(i.pixel_values) for i in images]
    return ImageBatch(np.concatenate([i.pixel_values for i in images]), np.stack([i.image_grid_thw for i in images]),
                      np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), tuple(i.num_tokens for i in images))
