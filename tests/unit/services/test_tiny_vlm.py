"""The tiny Qwen2.5-VL factory: the family's config keys, vision tokens and a chat template with image parts, an
image processor read back from the directory, a transformers forward whose output depends on the image,
determinism, and ``inflight make-tiny-model --arch qwen2_5_vl``."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from services.models.tiny_vlm import VISION_TOKENS, VLM_SIZES, make_tiny_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


def test_config_has_the_family_keys_and_vllm_cpu_friendly_shapes(vlm_dir):
    cfg = json.loads((vlm_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    text, vision = cfg["text_config"], cfg["vision_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert head_dim >= 32 and head_dim % 32 == 0
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert vision["out_hidden_size"] == text["hidden_size"]
    for key in ("depth", "hidden_size", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size",
                "window_size", "fullatt_block_indexes", "tokens_per_second"):
        assert key in vision, key
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert key in cfg, key


def test_vision_tokens_follow_the_text_vocabulary_and_the_template_renders_image_parts(vlm_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(vlm_dir))
    cfg = json.loads((vlm_dir / "config.json").read_text())
    ids = [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    assert ids == list(range(ids[0], ids[0] + 4)) and ids[0] == len(tok) - 4
    assert ids == [cfg["vision_start_token_id"], cfg["vision_end_token_id"], cfg["image_token_id"],
                   cfg["video_token_id"]]
    assert cfg["text_config"]["vocab_size"] >= len(tok)
    parts = [{"type": "image"}, {"type": "text", "text": "how many cubes?"}]
    chat = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many cubes?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    encoded = tok(chat).input_ids
    assert encoded.count(cfg["image_token_id"]) == 1 and tok.decode(encoded) == chat


def _inputs(vlm_dir, image: Image.Image):
    """Token ids with the image's ``<|image_pad|>`` run expanded, plus the processor's outputs."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    tok = AutoTokenizer.from_pretrained(str(vlm_dir))
    proc = Qwen2VLImageProcessorPil.from_pretrained(str(vlm_dir))
    out = proc(images=[image], return_tensors="pt")
    n = int(out["image_grid_thw"].prod()) // proc.merge_size ** 2
    text = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>what colour?<|im_end|>\n"
    ids = torch.tensor([tok(text).input_ids])
    return ids, out["pixel_values"], out["image_grid_thw"], n


def test_the_image_processor_reads_back_with_a_small_budget(vlm_dir):
    ids, pixels, grid, n = _inputs(vlm_dir, Image.new("RGB", (640, 480), "red"))
    assert n <= VLM_SIZES["tiny"].max_pixels // (28 * 28)  # a big image is shrunk to the tiny budget
    assert pixels.shape == (int(grid.prod()), 3 * 2 * 14 * 14)


def test_transformers_forward_with_an_image_from_the_saved_directory(vlm_dir):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vlm_dir), dtype=torch.float32).eval()
    red = Image.new("RGB", (96, 72), (200, 30, 30))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (72, 96, 3), dtype=np.uint8))
    logits = []
    for image in (red, noise):
        ids, pixels, grid, n = _inputs(vlm_dir, image)
        with torch.no_grad():
            out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
        assert out.logits.shape == (1, ids.shape[1], model.config.text_config.vocab_size)
        assert torch.isfinite(out.logits).all() and n == 9  # 96 x 72 -> 84 x 84 -> 3 x 3 merged patches
        logits.append(out.logits[0, -1])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)  # the tower's features reach the language model


def test_same_seed_same_weights_other_seed_differs(vlm_dir, tmp_path):
    a = load_file(str(vlm_dir / "model.safetensors"))
    b = load_file(str(make_tiny_vlm(tmp_path / "again", seed=0) / "model.safetensors"))
    c = load_file(str(make_tiny_vlm(tmp_path / "other", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert any(k.startswith("visual.") for k in a) and any(k.startswith("model.layers.") for k in a)  # as published
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="size: expected one of"):
        make_tiny_vlm("/nonexistent", size="0.6b")
    with pytest.raises(ValueError, match="init_std: expected > 0"):
        make_tiny_vlm("/nonexistent", init_std=0.0)


def test_cli_make_tiny_model_qwen2_5_vl(tmp_path):
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "services.cli", "make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2_5_vl",
         *extra], capture_output=True, text=True, timeout=300)
    out = run("--seed", "2")
    assert out.returncode == 0, out.stderr
    assert "qwen2_5_vl/tiny (seed 2" in out.stdout
    assert (tmp_path / "m" / "preprocessor_config.json").exists()
    assert json.loads((tmp_path / "m" / "inflight_tiny.json").read_text())["seed"] == 2
    bad = run("--size", "0.6b")
    assert bad.returncode == 2 and "--size must be one of ('tiny', 'small')" in bad.stderr
