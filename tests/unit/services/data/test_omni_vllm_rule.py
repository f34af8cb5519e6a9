"""Nano-Omni's resize rule (services/data/omni_images.py) against vLLM 0.32's own ``DynamicResolutionImageTiler``
(vllm/transformers_utils/processors/nano_nemotron_vl.py), the engine's processor in dynamic-resolution mode: for
many sizes (tiny, huge, odd, extreme aspect ratios within the limits) and several patch budgets, the first pass of
our rule is vLLM's grid for the original image, vLLM keeps the image we resize to (the same grid again), vLLM fails
where we refuse, and vLLM's pixel values of our resized image equal ours bit for bit."""
from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from services.data.images import MAX_ASPECT_RATIO
from services.data.omni_images import OmniImageRules, vllm_patch_grid

vllm_processors = pytest.importorskip("vllm.transformers_utils.processors.nano_nemotron_vl")

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
LARGE = 10 ** 7
"""A prompt budget (tokens) far over any image's: the per-image ``max_num_patches`` is what limits."""
BUDGETS = [(16, 64), (4, 256), (64, 64), (1024, 13312)]
"""``(min_num_patches, max_num_patches)``: the tiny Omni's, a wider one, min = max, a large one."""


def tiler(min_patches: int, max_patches: int):
    return vllm_processors.DynamicResolutionImageTiler(
        max_model_len=LARGE, patch_size=16, min_num_patches=min_patches, max_num_patches=max_patches,
        downsample_ratio=0.5, norm_mean=MEAN, norm_std=STD)


def vllm_grid(t, width: int, height: int) -> tuple[int, int]:
    """vLLM's ``(rows, cols)`` for one image of that size in a prompt of a large budget."""
    cols, rows = t.compute_params([Image.new("RGB", (width, height))], LARGE)[0].patch_size
    return rows, cols


def sizes() -> list[tuple[int, int]]:
    """Edge sizes around patch multiples, huge and extreme ones, and random ones, all within the aspect limit."""
    edges = (1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 80, 100, 333, 1000, 4000)
    out = [(w, h) for w in edges for h in (1, 16, 33, 48, 80, 99, 640, 3001)]
    out += [(8000, 8000), (8000, 40), (40, 8000), (200, 1), (1, 200), (3200, 16), (16, 3200)]
    rng = random.Random(0)
    out += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(60)]
    out += [(rng.randint(1, 120), rng.randint(1, 120)) for _ in range(60)]
    return [(w, h) for w, h in out if max(w, h) / min(w, h) <= MAX_ASPECT_RATIO]


@pytest.mark.parametrize("min_patches,max_patches", BUDGETS)
def test_our_grid_is_vllms_and_vllm_keeps_the_resized_image(min_patches, max_patches):
    t = tiler(min_patches, max_patches)
    rules = OmniImageRules(min_patches, max_patches, MEAN, STD)
    refused = resized_again = 0
    for width, height in sizes():
        try:
            first = vllm_patch_grid(width, height, rules.budget, min_patches)
        except ValueError:  # a side scaled to 0 patches: vLLM cannot size it either
            refused += 1
            if rules.budget > min_patches:
                with pytest.raises(ZeroDivisionError):
                    vllm_grid(t, width, height)
            else:  # no scaling up to min_num_patches: a grid of no patches
                assert 0 in vllm_grid(t, width, height), (width, height)
            continue
        assert vllm_grid(t, width, height) == first, (width, height)
        w, h = rules.target_size(width, height)
        resized_again += (h // 16, w // 16) != first
        assert vllm_grid(t, w, h) == (h // 16, w // 16), ((width, height), (w, h))
        assert w % 32 == 0 and h % 32 == 0 and (h // 16) * (w // 16) <= max(max_patches, min_patches)
    if (min_patches, max_patches) == (16, 64):  # the tiny Omni's budget meets both cases
        assert refused > 0 and resized_again > 0, (refused, resized_again)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # vLLM's np.asarray of a PIL image
@pytest.mark.parametrize("size", [(77, 300), (500, 20), (64, 64), (1000, 1000), (33, 3001)])
def test_vllms_pixel_values_of_the_resized_image_equal_ours(size):
    t = tiler(16, 64)
    rules = OmniImageRules(16, 64, MEAN, STD)
    img = Image.fromarray(np.random.default_rng(size[0]).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    resized = img.resize(rules.target_size(*size), resample=Image.Resampling.BICUBIC)
    params = t.compute_params([resized], LARGE)[0]
    pixels = t.apply_params(params)  # vLLM's same-size bicubic interpolation and normalisation
    theirs = vllm_processors.DynamicResolutionImageTiler.stack(pixels, 16)[0].numpy()
    ours, grid = rules.process(np.asarray(resized))
    assert theirs.dtype == ours.dtype == np.float32
    np.testing.assert_array_equal(theirs, ours)
    assert params.num_embeddings == rules.tokens(grid)
