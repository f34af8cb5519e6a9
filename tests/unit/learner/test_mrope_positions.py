"""Multimodal rotary positions equal transformers' ``Qwen2_5_VLModel.get_rope_index`` (the rule vLLM uses too) on
random prompts with images; packed micro-batches carry each sequence's positions and images; image inputs that
do not fit their prompt are refused, naming the group. No model, no Megatron (transformers' config only)."""
from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np
import pytest
import torch

from learner.batch import collect
from learner.config import TrainStepConfig
from learner.hf_config import VisionSpec
from learner.mrope_positions import ImageInputs, attach_images, mrope_positions
from learner.packing import build_micro_batch
from protocol.messages import Trajectory, TrajectoryGroup

IMAGE, VIDEO, START, END = 450, 451, 448, 449
SPEC = VisionSpec(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, spatial_merge_size=2,
                  patch_size=14, temporal_patch_size=2, in_channels=3, out_hidden_size=128, depth=2, hidden_size=64)


def transformers_rope_index(input_ids: np.ndarray, prompt_len: int, grids: np.ndarray | None) -> np.ndarray:
    """transformers' own ``get_rope_index`` (called on a stand-in for the model: it reads only the config and a
    static helper), with the image-token types of the prompt, as the processor makes them."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2, "tokens_per_second": 2},
                              image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)
    model = types.SimpleNamespace(config=config, get_vision_position_ids=functools.partial(
        Qwen2_5_VLModel.get_vision_position_ids, None))
    ids = torch.as_tensor(input_ids, dtype=torch.long)[None]
    types_ = torch.zeros_like(ids)
    types_[0, :prompt_len] = (ids[0, :prompt_len] == IMAGE).long()
    grid = torch.as_tensor(grids) if grids is not None else None
    positions, _ = Qwen2_5_VLModel.get_rope_index(model, ids, types_, image_grid_thw=grid)
    return positions[:, 0].numpy()


def random_prompt(rng: np.random.Generator, num_images: int) -> tuple[np.ndarray, ImageInputs | None]:
    """Text, then per image ``START pads END text``; grids of 1-2 frames and even heights/widths."""
    parts, grids = [rng.integers(3, START, rng.integers(0, 5))], []
    for _ in range(num_images):
        t, h, w = int(rng.integers(1, 3)), 2 * int(rng.integers(1, 7)), 2 * int(rng.integers(1, 7))
        grids.append((t, h, w))
        parts += [[START], [IMAGE] * (t * h * w // 4), [END], rng.integers(3, START, rng.integers(0, 4))]
    tokens = np.concatenate(parts).astype(np.int64)
    if not grids:
        return tokens, None
    grid = np.array(grids)
    return tokens, ImageInputs(np.zeros((int(grid.prod(axis=1).sum()), SPEC.patch_dim)), grid)


@pytest.mark.parametrize("seed", range(12))
def test_positions_equal_transformers_get_rope_index(seed):
    rng = np.random.default_rng(seed)
    prompt, images = random_prompt(rng, num_images=seed % 4)
    response = rng.integers(3, START, rng.integers(1, 8))
    response[0] = IMAGE  # a sampled image token is text: only the prompt holds images
    tokens = np.concatenate([prompt, response])
    ours = mrope_positions(tokens, prompt.size, images, SPEC)
    theirs = transformers_rope_index(tokens, prompt.size, images.image_grid_thw if images else None)
    np.testing.assert_array_equal(ours, theirs)
    if images is None:
        np.testing.assert_array_equal(ours, np.tile(np.arange(tokens.size), (3, 1)))


def test_a_packed_micro_batch_carries_each_sequences_positions_and_images_in_order():
    rng = np.random.default_rng(5)
    (p0, i0), (p1, i1), (p2, i2) = (random_prompt(rng, n) for n in (2, 0, 1))
    assert i0 is not None and i2 is not None
    i0.pixel_values[:] = 0.0
    i2.pixel_values[:] = 2.0
    seqs = [np.concatenate([p, rng.integers(3, START, 4)]) for p in (p0, p1, p2)]
    mb = attach_images(build_micro_batch(seqs, [2, 0, 1]), [p0.size, p1.size, p2.size], [i0, None, i2], SPEC)
    assert mb.position_ids.shape == (3, 1, mb.num_tokens)
    for seg in mb.segments:
        want = mrope_positions(seqs[seg.index], [p0, p1, p2][seg.index].size, [i0, None, i2][seg.index], SPEC)
        np.testing.assert_array_equal(mb.position_ids[:, 0, seg.start:seg.start + seg.length].numpy(), want)
    assert mb.images is not None
    np.testing.assert_array_equal(mb.images.image_grid_thw.numpy(), np.concatenate([i2.image_grid_thw,
                                                                                    i0.image_grid_thw]))
    assert mb.images.pixel_values[0, 0] == 2.0 and mb.images.pixel_values[-1, 0] == 0.0  # segment order
    assert int(mb.images.token_mask.sum()) == sum(i0.tokens_per_image(SPEC)) + sum(i2.tokens_per_image(SPEC))
    assert bool((mb.tokens[mb.images.token_mask] == IMAGE).all())


def test_image_inputs_that_do_not_fit_are_refused():
    tokens, images = random_prompt(np.random.default_rng(1), num_images=1)
    assert images is not None
    with pytest.raises(ValueError, match=r"has \d+ image tokens \(id 450\), its images fill 0"):
        mrope_positions(tokens, tokens.size, None, SPEC)
    with pytest.raises(ValueError, match=r"prompt p: pixel_values has shape \(3, 1176\), the grids"):
        ImageInputs(images.pixel_values[:3], images.image_grid_thw).check(SPEC, "prompt p")
    with pytest.raises(ValueError, match=r"video tokens \(id 451\): videos are not supported"):
        mrope_positions(np.concatenate([tokens, [START, VIDEO, END]]), tokens.size + 3, images, SPEC)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size=2"):
        ImageInputs(np.zeros((3, SPEC.patch_dim)), [[1, 1, 3]]).check(SPEC, "prompt p")


def _group(prompt: np.ndarray) -> TrajectoryGroup:
    trajs = [Trajectory(np.full(4, 7), np.full(4, -1.0), np.zeros(4), float(i)) for i in range(2)]
    return TrajectoryGroup("g0", "p0", prompt, trajs, 2, 512)


def test_collect_gives_each_sample_its_prompts_images_and_names_a_group_that_does_not_fit():
    tokens, images = random_prompt(np.random.default_rng(2), num_images=2)
    assert images is not None
    batch = collect([_group(tokens)], 256, True, TrainStepConfig(), {"p0": images}, SPEC)
    assert [s.images for s in batch.samples] == [images, images]
    with pytest.raises(ValueError, match=r"group g0 \(prompt 'p0'\): the prompt has \d+ image tokens"):
        collect([_group(tokens)], 256, True, TrainStepConfig(), {}, SPEC)
    with pytest.raises(ValueError, match="group g0: prompt 'p0' has images, but the model has no vision tower"):
        collect([_group(tokens)], 256, True, TrainStepConfig(), {"p0": images}, None)


PLAIN = dataclasses.replace(SPEC, mrope=False, temporal_patch_size=1, patch_size=16, video_token_id=None)
"""Nano-Omni's geometry: plain positions, one frame, 16-pixel patches, no video placeholder in config.json."""


def test_a_plain_position_model_keeps_the_packed_positions_and_gets_its_images_in_order():
    rng = np.random.default_rng(8)
    prompts, images = [], []
    for n in (1, 0, 2):
        parts, grids = [rng.integers(3, START, 3)], []
        for _ in range(n):
            h, w = 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))
            grids.append((1, h, w))
            parts += [[START], [IMAGE] * (h * w // 4), [END]]
        prompts.append(np.concatenate(parts).astype(np.int64))
        grid = np.array(grids).reshape(-1, 3)
        images.append(ImageInputs(np.full((int(grid.prod(axis=1).sum()), PLAIN.patch_dim), float(n)), grid)
                      if n else None)
    seqs = [np.concatenate([p, [IMAGE, 5]]) for p in prompts]  # a sampled image token is text
    mb = build_micro_batch(seqs, [0, 1, 2])
    out = attach_images(mb, [p.size for p in prompts], images, PLAIN)
    assert torch.equal(out.position_ids, mb.position_ids)  # [1, T], each segment from 0
    assert out.images is not None and int(out.images.token_mask.sum()) == sum(
        sum(i.tokens_per_image(PLAIN)) for i in images if i is not None)
    assert out.images.pixel_values[0, 0] == 1.0 and out.images.pixel_values[-1, 0] == 2.0
    with pytest.raises(ValueError, match=r"has \d+ image tokens \(id 450\), its images fill 0"):
        attach_images(mb, [p.size for p in prompts], [None, None, images[2]], PLAIN)
