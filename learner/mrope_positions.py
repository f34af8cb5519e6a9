"""Multimodal rotary positions (Qwen2.5-VL's rule) and the image inputs of a packed micro-batch.

:func:`mrope_positions` gives the ``[3, T]`` (temporal, height, width) positions of one sequence, by
the rule of transformers' ``Qwen2_5_VLModel.get_rope_index`` (and vLLM's): a text token has the
same position on all three axes, one more than the token before it; the ``t·h·w / merge²`` image tokens of
an image of grid ``(t, h, w)`` patches start where the text stopped, at ``start + (i_t, i_h, i_w)`` over
the merged grid, and the text after the image resumes at ``start + max(h, w) / merge``. Only the prompt
holds images: an image token the model sampled in its response is text (the engine treats it so).
Videos are refused (a prompt with video tokens is an error).

:func:`attach_images` turns a packed :class:`~learner.packing.MicroBatch` into an
:class:`ImageMicroBatch`: the ``[3, 1, T]`` positions of its segments end to end (each restarts at 0, so
packing is exact: each sequence attends only to itself), the ``pixel_values`` and ``image_grid_thw`` of its
images in segment order, and the mask of the positions that receive the vision tower's embeddings. A model
without mrope (Nano-Omni, ``VisionSpec.mrope`` false) keeps the packed batch's plain positions; its prompts are
checked the same way (:func:`image_runs`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.hf_config import VisionSpec
from learner.packing import MicroBatch


@dataclass
class ImageInputs:
    """The images of one prompt as the image processor gives them (``Qwen2VLImageProcessor``'s outputs)."""

    pixel_values: np.ndarray
    """``[patches, channels × temporal_patch × patch²]`` float32, the patches of every image in order."""
    image_grid_thw: np.ndarray
    """``[images, 3]`` int64: each image's grid of (temporal, height, width) patches."""

    def __post_init__(self):
        self.pixel_values = np.asarray(self.pixel_values, dtype=np.float32)
        self.image_grid_thw = np.asarray(self.image_grid_thw, dtype=np.int64).reshape(-1, 3)

    def tokens_per_image(self, spec: VisionSpec) -> list[int]:
        """The image tokens each image fills in the prompt (``t·h·w / merge²``)."""
        return [int(g.prod()) // spec.patches_per_token for g in self.image_grid_thw]

    def check(self, spec: VisionSpec, where: str) -> None:
        """``ValueError`` naming ``where`` unless the patches agree with the grids and the tower's geometry."""
        grids = self.image_grid_thw
        if grids.shape[0] == 0 or (grids < 1).any():
            raise ValueError(f"{where}: image_grid_thw must hold at least one image of positive sizes, got "
                             f"{grids.tolist()}")
        merge = spec.spatial_merge_size
        if (grids[:, 1:] % merge).any():
            raise ValueError(f"{where}: image_grid_thw heights and widths must be multiples of "
                             f"spatial_merge_size={merge}, got {grids.tolist()}")
        want = (int(grids.prod(axis=1).sum()), spec.patch_dim)
        if self.pixel_values.shape != want:
            raise ValueError(f"{where}: pixel_values has shape {self.pixel_values.shape}, the grids "
                             f"{grids.tolist()} need {want}")


def image_token_mask(tokens: np.ndarray, prompt_len: int, spec: VisionSpec) -> np.ndarray:
    """bool ``[len(tokens)]``: the prompt's image-placeholder tokens (never a response token)."""
    mask = np.asarray(tokens) == spec.image_token_id
    mask[prompt_len:] = False
    return mask


def image_runs(tokens: np.ndarray, prompt_len: int, images: ImageInputs | None, spec: VisionSpec) -> list[int]:
    """Where each image's run of placeholder tokens starts in one sequence. ``ValueError`` for a prompt with video
    tokens, or unless the prompt's image tokens are exactly the ones ``images`` fill, image after image."""
    tokens = np.asarray(tokens)
    if spec.video_token_id is not None and (tokens[:prompt_len] == spec.video_token_id).any():
        raise ValueError(f"the prompt holds video tokens (id {spec.video_token_id}): videos are not supported, "
                         f"only images")
    is_image = image_token_mask(tokens, prompt_len, spec)
    counts = images.tokens_per_image(spec) if images is not None else []
    if int(is_image.sum()) != sum(counts):
        raise ValueError(f"the prompt has {int(is_image.sum())} image tokens (id {spec.image_token_id}), its "
                         f"images fill {sum(counts)} ({counts} per image)")
    starts, i = [], 0
    for k, count in enumerate(counts):
        start = i + int(np.argmax(is_image[i:]))  # the first image token from i on
        if not is_image[start:start + count].all():
            raise ValueError(f"image {k} fills {count} tokens, but the prompt's run of image tokens at "
                             f"{start} is shorter")
        starts.append(start)
        i = start + count
    return starts


def mrope_positions(tokens: np.ndarray, prompt_len: int, images: ImageInputs | None,
                    spec: VisionSpec) -> np.ndarray:
    """``[3, len(tokens)]`` int64 positions of one sequence (module docstring); the checks of :func:`image_runs`."""
    n = int(np.asarray(tokens).size)
    starts = image_runs(tokens, prompt_len, images, spec)
    counts = images.tokens_per_image(spec) if images is not None else []
    out = np.empty((3, n), dtype=np.int64)
    merge = spec.spatial_merge_size
    grids = images.image_grid_thw.tolist() if images is not None else []
    pos = i = 0  # next position; next token
    for start, count, (t, h, w) in zip(starts, counts, grids, strict=True):
        out[:, i:start] = pos + np.arange(start - i)
        pos += start - i
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij"))
        out[:, start:start + count] = grid.reshape(3, -1) + pos
        pos += max(h, w) // merge
        i = start + count
    out[:, i:] = pos + np.arange(n - i)
    return out


@dataclass
class PackedImages:
    """The images of a micro-batch, in the order their tokens appear in it."""

    pixel_values: torch.Tensor
    """``[patches, patch_dim]`` float32."""
    image_grid_thw: torch.Tensor
    """``[images, 3]`` int64."""
    token_mask: torch.Tensor
    """``[1, T]`` bool: the positions that receive the vision tower's embeddings."""

    def to(self, device: torch.device) -> PackedImages:
        return PackedImages(self.pixel_values.to(device), self.image_grid_thw.to(device), self.token_mask.to(device))


@dataclass
class ImageMicroBatch(MicroBatch):
    """A :class:`MicroBatch` of a vision-language model: ``position_ids`` are ``[3, 1, T]`` (mrope; ``[1, T]``, the
    packed batch's own, for a model with plain positions) and ``images`` is None when none of its sequences has
    one."""

    images: PackedImages | None = None

    def to(self, device: torch.device) -> ImageMicroBatch:
        return ImageMicroBatch(self.tokens.to(device), self.position_ids.to(device), self.targets.to(device),
                               self.blocks, self.segments,
                               self.routing.to(device) if self.routing is not None else None,
                               self.images.to(device) if self.images is not None else None)


def attach_images(mb: MicroBatch, prompt_lens: list[int], images: list[ImageInputs | None],
                  spec: VisionSpec) -> ImageMicroBatch:
    """``mb`` with the images of its segments and, for an mrope model, mrope positions (both lists indexed by sequence
    index). Positions outside every segment (padding) keep ``mb``'s own, on all three axes."""
    tokens = mb.tokens[0].cpu().numpy()
    positions = mb.position_ids.cpu().expand(3, -1).clone().numpy() if spec.mrope else None
    mask = np.zeros(tokens.size, dtype=bool)
    pixels, grids = [], []
    for seg in mb.segments:
        sl = slice(seg.start, seg.start + seg.length)
        mine = images[seg.index]
        if mine is not None:
            mine.check(spec, f"sequence {seg.index}")
            pixels.append(mine.pixel_values)
            grids.append(mine.image_grid_thw)
        if positions is not None:
            positions[:, sl] = mrope_positions(tokens[sl], prompt_lens[seg.index], mine, spec)
        else:
            image_runs(tokens[sl], prompt_lens[seg.index], mine, spec)
        mask[sl] = image_token_mask(tokens[sl], prompt_lens[seg.index], spec)
    packed = (PackedImages(torch.from_numpy(np.concatenate(pixels)), torch.from_numpy(np.concatenate(grids)),
                           torch.from_numpy(mask)[None]) if pixels else None)
    position_ids = mb.position_ids if positions is None else torch.from_numpy(positions)[:, None]
    return ImageMicroBatch(mb.tokens, position_ids, mb.targets, mb.blocks,
                           mb.segments, mb.routing, packed)


def with_images(mbs: list[MicroBatch], prompt_lens: list[int], images: list[ImageInputs | None],
                vision: VisionSpec | None) -> list[MicroBatch]:
    """``mbs`` through :func:`attach_images` for a vision-language policy (``vision``); as they are for a text-only
    one, which must be given no images."""
    if vision is None:
        if any(i is not None for i in images):
            raise ValueError("images given, but the model has no vision tower (its config.json has no vision_config)")
        return mbs
    return [attach_images(mb, prompt_lens, images, vision) for mb in mbs]
