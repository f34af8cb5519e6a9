"""The learner sees images: a tiny random Qwen2.5-VL through real Megatron-Core (GPTModel with mrope) and
transformers' vision tower equals transformers fp32 on image prompts; packing does not change it; HF → Megatron →
HF is exact with the tower; a step trains the language model only (tower frozen) or both (tower trained); two
tensor-parallel ranks equal one."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, run_ranks
from learner_batches import make_learner
from safetensors.torch import load_file
from tower_steps import image_groups, step_and_check

ATOL = 1e-4
SIZES = [(96, 72), (56, 120), (140, 60), None, (64, 64)]
"""Image width x height of each test prompt (None: a text-only prompt)."""


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from services.models.tiny_vlm import make_tiny_vlm
    return str(make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0))


@pytest.fixture(scope="module")
def vlm_learner(vlm_dir):
    learner = make_learner(vlm_dir)  # float32, tower frozen (the default)
    yield learner
    learner.shutdown()


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def processed(model_dir: str, width: int, height: int, seed: int):
    """The image processor's outputs for a random-noise image of that size."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from learner.mrope_positions import ImageInputs

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[Image.fromarray(pixels)], return_tensors="np")
    return ImageInputs(out["pixel_values"], out["image_grid_thw"])


def image_prompts(learner, model_dir: str, seed: int = 0, sizes=SIZES):
    """Prompts ``text <|vision_start|> <|image_pad|> x n <|vision_end|> text`` (n from the image's grid) with their
    images, and random responses; a size of None gives a text-only prompt."""
    v, rng = learner.arch.vision, np.random.default_rng(seed)
    end = json.loads((Path(model_dir) / "config.json").read_text())["vision_end_token_id"]
    first_special = min(v.image_token_id, v.video_token_id, v.vision_start_token_id, end)
    text = lambda lo, hi: rng.integers(3, first_special, rng.integers(lo, hi))  # noqa: E731
    prompts, responses, images = [], [], []
    for k, size in enumerate(sizes):
        before, after = text(2, 6), text(2, 5)
        img = processed(model_dir, *size, seed=seed * 100 + k) if size else None
        pads = [v.vision_start_token_id, *[v.image_token_id] * img.tokens_per_image(v)[0], end] if img else []
        prompts.append(np.concatenate([before, pads, after]).astype(np.int32))
        responses.append(text(3, 12).astype(np.int32))
        images.append(img)
    return prompts, responses, images


@torch.no_grad()
def hf_logprobs(hf, image_token_id: int, prompts, responses, images, mrope: bool = True) -> list[np.ndarray]:
    """transformers' response log-probs; ``mrope=False`` leaves out the image-token types, so transformers falls
    back to 1-D positions (the images still fill their tokens)."""
    out = []
    for p, r, img in zip(prompts, responses, images, strict=True):
        ids = torch.tensor(np.concatenate([p, r]), dtype=torch.long)[None]
        kwargs = {}
        if img is not None:
            types = torch.zeros_like(ids)
            types[0, :len(p)] = ids[0, :len(p)] == image_token_id
            kwargs = dict(pixel_values=torch.from_numpy(img.pixel_values),
                          image_grid_thw=torch.from_numpy(img.image_grid_thw), **({"mm_token_type_ids": types}
                                                                                  if mrope else {}))
        logp = hf(ids, **kwargs).logits.float().log_softmax(-1)[0]
        out.append(logp[len(p) - 1:-1].gather(-1, torch.tensor(r, dtype=torch.long)[:, None])[:, 0].numpy())
    return out


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_logprobs_of_image_prompts_match_transformers(vlm_learner, vlm_dir, hf_vlm):
    """Packed image prompts of four image sizes and a text-only one: the learner equals transformers fp32; the same
    tokens with other images, or with 1-D positions, are far from it (the images and mrope positions are used)."""
    prompts, responses, images = image_prompts(vlm_learner, vlm_dir)
    ours = vlm_learner.logprobs(prompts, responses, images)
    image_id = vlm_learner.arch.vision.image_token_id
    ref = hf_logprobs(hf_vlm, image_id, prompts, responses, images)
    for a, b, r in zip(ours, ref, responses, strict=True):
        assert a.shape == (r.size,)
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    others = image_prompts(vlm_learner, vlm_dir, seed=7)[2]
    with_1d = hf_logprobs(hf_vlm, image_id, prompts, responses, images, mrope=False)
    other_images = hf_logprobs(hf_vlm, image_id, prompts, responses,
                               [o if i is not None else None for i, o in zip(images, others, strict=True)])
    print(f"\nqwen2_5_vl: max |Δ logprob| vs transformers {max_diff(ours, ref):.2e}; transformers with 1-D positions "
          f"{max_diff(with_1d, ref):.2e}, with other images {max_diff(other_images, ref):.2e}")
    assert max_diff(with_1d, ref) > 100 * ATOL and max_diff(other_images, ref) > 100 * ATOL


def test_packed_image_prompts_equal_unpacked(vlm_learner, vlm_dir):
    prompts, responses, images = image_prompts(vlm_learner, vlm_dir, seed=1)
    packed = vlm_learner.logprobs(prompts, responses, images)
    alone = [vlm_learner.logprobs([p], [r], [i])[0] for p, r, i in zip(prompts, responses, images, strict=True)]
    for a, b in zip(packed, alone, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)  # float32 GEMMs of other shapes


def test_hf_round_trip_with_the_vision_tower_is_exact(vlm_learner, vlm_dir):
    from learner.hf_export import export_hf_state_dict

    source = load_file(f"{vlm_dir}/model.safetensors")
    assert any(k.startswith("visual.") for k in source)
    exported = export_hf_state_dict(vlm_learner.gpt, vlm_learner.arch, vlm_learner.hf_metas)
    assert exported is not None and list(exported) == [m.name for m in vlm_learner.hf_metas]
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_a_step_with_the_tower_frozen_trains_only_the_language_model(vlm_dir):
    learner = make_learner(vlm_dir)
    try:
        step_and_check(learner, lambda seed, sizes: image_prompts(learner, vlm_dir, seed, sizes), (64, 56), frozen=True)
    finally:
        learner.shutdown()


def test_a_step_with_the_tower_trained_changes_it_and_exports_it(vlm_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    learner = make_learner(vlm_dir, freeze_vision_tower=False)
    try:
        step_and_check(learner, lambda seed, sizes: image_prompts(learner, vlm_dir, seed, sizes), (64, 56),
                       frozen=False)
        prompts, responses, imgs = image_prompts(learner, vlm_dir, seed=2)
        ours = learner.logprobs(prompts, responses, imgs)
        learner.save_hf(str(tmp_path / "hf"))
    finally:
        learner.shutdown()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ref = hf_logprobs(hf, hf.config.image_token_id, prompts, responses, imgs)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def _tp_worker(rank: int, port: int, model_dir: str, batch, out_path: str) -> None:
    become_rank(rank, 2, port)
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.hf_export import export_hf_state_dict
    from learner.model import shutdown_distributed
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", tensor_model_parallel_size=2,
                              optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0))
    learner = Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=256), 128,
                      freeze_vision_tower=False)
    prompts, responses, images = image_prompts(learner, model_dir)
    lps = learner.logprobs(prompts, responses, images)
    metrics = learner.train_step(*batch)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    if rank == 0:
        torch.save({"logprobs": lps, "metrics": metrics, "state": state}, out_path)
    shutdown_distributed()


def test_tensor_parallel_ranks_replicate_the_tower_and_equal_one_rank(vlm_dir, tmp_path):
    """TP=2 in two gloo processes, the tower trained: the same log-probs, loss, gradient norm (the replicated
    tower counted once) and updated weights as one process."""

    from learner.hf_export import export_hf_state_dict

    single = make_learner(vlm_dir, freeze_vision_tower=False)
    lps = single.logprobs(*image_prompts(single, vlm_dir))
    batch = image_groups(single, lambda seed, sizes: image_prompts(single, vlm_dir, seed, sizes), (64, 56))
    metrics = single.train_step(*batch)
    state = export_hf_state_dict(single.gpt, single.arch, single.hf_metas)
    single.shutdown()
    out = str(tmp_path / "rank0.pt")
    run_ranks(_tp_worker, vlm_dir, batch, out, timeout_s=240.0,
              what="the two TP ranks")
    multi = torch.load(out, weights_only=False)
    assert max_diff(lps, multi["logprobs"]) < 1e-5
    for key in ("loss", "grad_norm"):
        assert multi["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
    lr = 1e-3  # Adam's first update is ~lr·sign(g): a ~0 gradient may flip sign between reduction orders
    diffs = torch.cat([(multi["state"][n] - t).abs().reshape(-1) for n, t in state.items()])
    assert diffs.max() <= 2 * lr + 1e-6 and (diffs > 1e-5).float().mean() < 1e-3
