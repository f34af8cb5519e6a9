"""Image rules of Nemotron-3-Nano-Omni (``model_type: nemotron_h_omni``): the engine's resize, the learner's pixels.

The engine is vLLM's ``nano_nemotron_vl``. With ``vision_config.args.min_num_patches`` in ``config.json`` its
processor runs in dynamic-resolution mode (``DynamicResolutionImageTiler``): each image is resized to a grid of
16-pixel patches chosen by :func:`vllm_patch_grid` (a copy of its ``process_media``) and becomes one image of
``rows * cols / 4`` tokens (a 2 x 2 pixel shuffle). The data side applies that rule
(:meth:`OmniImageRules.target_size`), resizes with Pillow's bicubic filter and hands the engine the resized
pixels, on which vLLM's rule gives the same grid: vLLM keeps the image as it is (its same-size bicubic
interpolation is the identity; a unit test compares its pixel values with :meth:`OmniImageRules.process` bit for
bit) and its token count is the one the prompt was expanded to.

Two places where vLLM's rule is not a fixed point, and what is done about them:

- The rule rounds each side to an even number of patches and never below 2, after scaling the grid down to the
  ``max_num_patches`` budget. An image whose short side scales below one patch (a long thin one) is rounded back
  up to 2 patches, and its grid can end above the budget (1000 x 20 pixels, budget 64: 2 x 44 = 88 patches). Given
  that resized image, vLLM scales it down again (2 x 36). :func:`target_grid` therefore applies the rule to its own
  result until it keeps it (2 x 32 here): that is the grid the engine sees and keeps.
- An image whose short side scales to 0 patches before that rounding makes vLLM divide by zero (or, where
  ``min_num_patches`` is the whole budget, give a grid of no rows). Such an image is refused (``ValueError``,
  which :func:`services.data.images.prepare_image` reports as ``bad_aspect``).

Budget. vLLM's per-image budget is ``max_num_patches`` *and* the prompt's share of ``max_model_len`` (``4 *
(max_model_len - text tokens - 4)`` patches for all of a prompt's images together). The data side ignores the
second: a prompt whose images do not fit it is resized smaller by vLLM, whose token count then differs from the
prompt's expansion, and the engine refuses that prompt loudly.

Pixels for the learner (:meth:`OmniImageRules.process`): ``(x / 255 - mean) / std`` in float32, cut into
channel-major 16 x 16 patches in row-major order, ``[rows * cols, 3 * 16 * 16]``, with ``image_grid_thw`` ``[1, rows,
cols]`` (what :func:`learner.radio_tower.radio_patches` makes). Only numpy here: the image workers import this module.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_TYPE = "nemotron_h_omni"
IMAGE_CONTEXT = "<image>"
"""The placeholder the chat template renders for an image part; each becomes ``<img>`` + ``<image>`` x n +
``</img>``."""
MAX_PASSES = 8
"""Passes of vLLM's rule :func:`target_grid` makes before giving up (five at most in a sweep of sizes and
budgets)."""


def vllm_patch_grid(width: int, height: int, budget: int, min_num_patches: int, patch_size: int = 16
                    ) -> tuple[int, int]:
    """``(rows, cols)`` of patches vLLM's ``DynamicResolutionImageTiler.process_media`` picks for an image of
    ``width`` x ``height`` pixels and a per-image ``budget`` of patches, operation for operation; ``ValueError``
    where vLLM would divide by zero (a side scaled to 0 patches)."""
    closest_h = round(height / patch_size + 0.5)  # Python's round: half to even (3.0 -> 4, 4.0 -> 4)
    closest_w = round(width / patch_size + 0.5)
    factor = min(math.sqrt(budget / (closest_h * closest_w)), 1.0)
    rows, cols = math.floor(factor * closest_h), math.floor(factor * closest_w)
    if rows * cols == 0:
        raise ValueError(f"an image of {width} x {height} pixels scales to {cols} x {rows} patches under a budget of "
                         f"{budget} patches, which vLLM's nano_nemotron_vl cannot size (it divides by zero, or "
                         f"makes an image of no patches): aspect ratio too extreme for this model")
    if budget > min_num_patches and rows * cols < min_num_patches:
        up = math.sqrt(min_num_patches / (rows * cols))
        rows, cols = math.ceil(up * rows), math.ceil(up * cols)
    if rows % 2:
        rows = rows + 1 if (rows + 1) * cols <= budget else max(2, rows - 1)
    if cols % 2:
        cols = cols + 1 if rows * (cols + 1) <= budget else max(2, cols - 1)
    return rows, cols


def target_grid(width: int, height: int, budget: int, min_num_patches: int, patch_size: int = 16
                ) -> tuple[int, int]:
    """``(rows, cols)`` of :func:`vllm_patch_grid`, applied again to the resized size until vLLM's rule keeps it
    (module docstring); ``ValueError`` for an image vLLM cannot size or a rule that does not settle."""
    rows, cols = vllm_patch_grid(width, height, budget, min_num_patches, patch_size)
    for _ in range(MAX_PASSES):
        again = vllm_patch_grid(cols * patch_size, rows * patch_size, budget, min_num_patches, patch_size)
        if again == (rows, cols):
            return rows, cols
        rows, cols = again
    raise ValueError(f"an image of {width} x {height} pixels: vLLM's resize rule did not settle on a patch grid in "
                     f"{MAX_PASSES} passes (last {cols} x {rows}; budget {budget}, min {min_num_patches})")


@dataclass(frozen=True)
class OmniImageRules:
    """Nano-Omni's dynamic-resolution image rules (``config.json``; :meth:`from_pretrained`)."""

    min_num_patches: int
    """``vision_config.args.min_num_patches``: a smaller grid is scaled up to about this many patches."""
    max_num_patches: int
    """``vision_config.args.max_num_patches``: each image's patch budget (> 0)."""
    norm_mean: tuple[float, float, float]
    """``norm_mean``: per-channel mean of the ``x / 255`` values."""
    norm_std: tuple[float, float, float]
    """``norm_std``: per-channel standard deviation."""
    img_start_id: int | None = None
    """The tokenizer's ``<img>`` (written before each image's run); None: rules that cannot expand a prompt."""
    img_end_id: int | None = None
    """The tokenizer's ``</img>`` (written after each image's run)."""
    patch_size: int = 16
    """``patch_size``: a patch's side in pixels."""
    merge: int = 2
    """Patches a side the pixel shuffle merges into one token (``1 / downsample_ratio``)."""
    resample: int = 3
    """Pillow resampling filter (3: bicubic)."""

    def __post_init__(self):
        if self.max_num_patches <= 0 or not 0 <= self.min_num_patches <= self.max_num_patches:
            raise ValueError(f"OmniImageRules: expected 0 <= min_num_patches <= max_num_patches and "
                             f"max_num_patches > 0, got {self.min_num_patches} and {self.max_num_patches}")

    @property
    def placeholder(self) -> str:
        return IMAGE_CONTEXT

    @property
    def budget(self) -> int:
        """vLLM's per-image patch budget when the prompt is not what limits it."""
        return max(self.max_num_patches, self.min_num_patches)

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """Width and height after the resize (:func:`target_grid` times the patch size); ``ValueError`` for an
        image whose aspect ratio vLLM cannot size."""
        rows, cols = target_grid(width, height, self.budget, self.min_num_patches, self.patch_size)
        return cols * self.patch_size, rows * self.patch_size

    def process(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``pixel_values`` float32 ``[rows * cols, 3 * p * p]`` (normalised, channel-major patches, row-major) and
        ``image_grid_thw`` int64 ``[1, rows, cols]`` of a resized uint8 ``[h, w, 3]`` image."""
        p = self.patch_size
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[0] % (p * self.merge) or rgb.shape[1] % (p * self.merge):
            raise ValueError(f"OmniImageRules.process: expected uint8 [h, w, 3] with h and w multiples of "
                             f"{p * self.merge}, got shape {list(rgb.shape)}")
        x = np.asarray(rgb, dtype=np.uint8).astype(np.float32) / np.float32(255)
        x = (x - np.asarray(self.norm_mean, dtype=np.float32)) / np.asarray(self.norm_std, dtype=np.float32)
        rows, cols = x.shape[0] // p, x.shape[1] // p
        x = x.transpose(2, 0, 1).reshape(3, rows, p, cols, p).transpose(1, 3, 0, 2, 4)
        return np.ascontiguousarray(x.reshape(rows * cols, 3 * p * p)), np.array([1, rows, cols], dtype=np.int64)

    def tokens(self, grid_thw: np.ndarray) -> int:
        """Image tokens of a grid: ``rows * cols / merge**2``."""
        return int(np.prod(grid_thw)) // self.merge ** 2

    def expansion(self, token_id: int, num_tokens: int) -> list[int]:
        """``<img>`` + ``token_id`` x ``num_tokens`` + ``</img>``, what vLLM's processor writes for an image."""
        if self.img_start_id is None or self.img_end_id is None:
            raise ValueError("OmniImageRules without img_start_id / img_end_id (the tokenizer's <img> / </img>) "
                             "cannot expand a prompt: make them with OmniImageRules.from_pretrained(model_dir)")
        return [self.img_start_id, *[token_id] * num_tokens, self.img_end_id]

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> OmniImageRules:
        """The rules of a ``nemotron_h_omni`` directory's ``config.json`` and tokenizer; ``ValueError`` naming the
        file and key when one is missing or of a mode vLLM's dynamic resolution does not cover."""
        from rollout.vllm_images import image_tokens

        path = Path(model_dir) / "config.json"
        cfg = json.loads(path.read_text())
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{path}: model_type {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
        args = (cfg.get("vision_config") or {}).get("args") or {}
        if "min_num_patches" not in args:
            raise ValueError(f"{path}: vision_config.args has no min_num_patches: the model's images are tiled "
                             f"(vLLM's nano_nemotron_vl without dynamic resolution), which Inflight does not "
                             f"support; expected vision_config.args.min_num_patches and max_num_patches")
        for key in ("min_num_patches", "max_num_patches"):
            if not isinstance(args.get(key), int) or args[key] < 0:
                raise ValueError(f"{path}: vision_config.args.{key} {args.get(key)!r}, expected an integer >= 0")
        if args["max_num_patches"] == 0:
            raise ValueError(f"{path}: vision_config.args.max_num_patches 0 (no per-image budget: vLLM sizes the "
                             f"images by the prompt's max_model_len alone), expected a positive budget")
        ratio = cfg.get("downsample_ratio", 0.5)
        if ratio != 0.5:
            raise ValueError(f"{path}: downsample_ratio {ratio!r}, expected 0.5 (vLLM's dynamic resolution "
                             f"supports a 2 x 2 pixel shuffle only)")
        tokens = image_tokens(str(model_dir))
        if tokens is None:
            raise ValueError(f"{path}: no integer image_token_id or no vision_config")
        return cls(min_num_patches=args["min_num_patches"], max_num_patches=args["max_num_patches"],
                   norm_mean=_triple(cfg, "norm_mean", path), norm_std=_triple(cfg, "norm_std", path),
                   img_start_id=tokens.start, img_end_id=tokens.end, patch_size=int(cfg.get("patch_size", 16)))


def _triple(cfg: dict, key: str, path: Path) -> tuple[float, float, float]:
    value = cfg.get(key)
    if not isinstance(value, Sequence) or len(value) != 3 or not all(isinstance(v, int | float) for v in value):
        raise ValueError(f"{path}: {key} {value!r}, expected three numbers (one per RGB channel)")
    return float(value[0]), float(value[1]), float(value[2])
