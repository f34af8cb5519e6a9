"""Nano-Omni's vision side in the learner (learner/radio_tower.py, learner/radio_weights.py), on the tiny checkpoint:
the spec read from config.json, the published names loaded and exported back exactly, the tower's image embeddings
equal transformers' ``get_image_features`` (float32, CPU) for images of different sizes in one call, frozen by
default and trainable (gradients reach every tower tensor)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from learner.radio_spec import RadioSpec
from learner.radio_tower import RadioVision, radio_patches
from learner.radio_weights import PUBLISHED_PREFIXES, export_radio_weights, load_radio_weights, published_name

SIZES = [(64, 96), (128, 64), (64, 64)]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return make_tiny_omni(tmp_path_factory.mktemp("tiny-omni"), seed=0)


@pytest.fixture(scope="module")
def spec(omni_dir):
    return RadioSpec.of(json.loads((omni_dir / "config.json").read_text()))


def tower(omni_dir, spec, frozen: bool = True) -> RadioVision:
    source = load_file(str(omni_dir / "model.safetensors"))
    module = RadioVision(spec, frozen=frozen)
    load_radio_weights(module, source.__getitem__)
    return module


def images(spec, seed: int = 0):
    rng = np.random.default_rng(seed)
    parts = [radio_patches(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), spec) for h, w in SIZES]
    return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def test_spec_of_the_tiny_config(spec):
    assert (spec.vision_hidden_size, spec.text_hidden_size, spec.merge, spec.patch_size) == (64, 128, 2, 16)
    assert spec.tokens((4, 6)) == 6 and "args" not in spec.vision_config
    with pytest.raises(ValueError, match="model_type: expected 'nemotron_h_omni'"):
        RadioSpec.of({"model_type": "qwen2_5_vl"})


def test_published_names_load_and_export_back_exactly(omni_dir, spec):
    source = load_file(str(omni_dir / "model.safetensors"))
    vision = {k: v for k, v in source.items() if k.startswith(PUBLISHED_PREFIXES)}
    assert published_name("vision_model.encoder.layer.1.attention.k_proj.bias") == (
        "vision_model.radio_model.model.blocks.1.attn.qkv.bias", 1)
    exported = export_radio_weights(tower(omni_dir, spec))
    assert exported.keys() == vision.keys()
    for name, tensor in vision.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_image_embeddings_equal_transformers(omni_dir, spec):
    from transformers import NemotronH_Omni_Reasoning_V3

    hf = NemotronH_Omni_Reasoning_V3.from_pretrained(str(omni_dir), dtype=torch.float32).eval()
    ours = tower(omni_dir, spec)
    pixels, grid = images(spec)
    with torch.no_grad():
        want = torch.cat(hf.get_image_features(pixels, grid).pooler_output)
        got = ours(pixels, grid)
    assert got.shape == (sum(spec.tokens((h // 16, w // 16)) for h, w in SIZES), 128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    other = ours(*images(spec, seed=1))
    assert (other - want).abs().max() > 1e-2  # the pixels matter


def test_frozen_by_default_and_trainable_when_asked(omni_dir, spec):
    frozen = tower(omni_dir, spec)
    frozen.train()
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert not frozen(*images(spec)).requires_grad
    trained = tower(omni_dir, spec, frozen=False)
    trained.train()
    trained(*images(spec)).square().sum().backward()
    used = [(n, p) for n, p in trained.named_parameters() if "video_patch_projection" not in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in used), \
        [n for n, p in used if p.grad is None or p.grad.abs().sum() == 0]


def test_a_bf16_tower_takes_float32_pixels(omni_dir, spec):
    """Under bf16 (Megatron's Float16Module casts the tower's weights) the pixels arrive as float32 from the batch."""
    pixels, grid = images(spec)
    want = tower(omni_dir, spec)(pixels, grid)
    got = tower(omni_dir, spec).to(torch.bfloat16)(pixels, grid)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 0.03  # bf16 rounding through 2 blocks, not garbage
