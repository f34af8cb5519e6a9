"""The tiny Nemotron-3-Nano-Omni factory: the keys both readers need (transformers' ``nemotron_h_omni``, vLLM's
``nano_nemotron_vl``), the media tokens and the chat template, the published tensor names, a transformers load with
no missing or unexpected tensor and a forward whose output depends on the image, no audio tower, determinism, and
``inflight make-tiny-model --arch nemotron_h_omni``."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from services.models.tiny_omni import MEDIA_TOKENS, OMNI_SIZES, PATCH, make_tiny_omni


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return make_tiny_omni(tmp_path_factory.mktemp("tiny-omni"), seed=0)


def test_config_has_both_readers_keys(omni_dir):
    cfg = json.loads((omni_dir / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h_omni" and cfg["architectures"] == ["NemotronH_Omni_Reasoning_V3"]
    assert cfg.get("audio_config") is None
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["hybrid_override_pattern"] == "M-M*-" and "layers_block_type" not in text
    args = vision["args"]
    assert (args["hidden_size"], args["num_hidden_layers"]) == (vision["hidden_size"], vision["num_hidden_layers"])
    assert args["min_num_patches"] == OMNI_SIZES["tiny"].min_num_patches  # vLLM: dynamic resolution on
    assert len(args["teachers"]) == vision["num_cls_tokens"] and args["register_multiple"] == \
        vision["num_cls_tokens"] + vision["num_registers"]
    assert args["cpe_max_size"] == vision["max_img_size"]
    assert text["dtype"] == cfg["dtype"] == "float32"  # vLLM builds the language model in text_config's dtype
    for key in ("force_image_size", "patch_size", "norm_mean", "norm_std", "vit_hidden_size", "ps_version",
                "downsample_ratio", "projector_hidden_size", "image_token_id"):
        assert key in cfg, key


def test_media_tokens_and_the_template(omni_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    cfg = json.loads((omni_dir / "config.json").read_text())
    ids = [tok.convert_tokens_to_ids(t) for t in MEDIA_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(MEDIA_TOKENS))) and ids[-1] == len(tok) - 1
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<image>")
    assert cfg["text_config"]["vocab_size"] >= len(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n<image>hi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<img><image><image></img>").input_ids == [ids[0], ids[2], ids[2], ids[1]]


def test_tensors_have_the_published_names(omni_dir):
    names = load_file(str(omni_dir / "model.safetensors")).keys()
    assert any(k.startswith("language_model.backbone.layers.") for k in names)
    assert any(k.startswith("vision_model.radio_model.model.blocks.0.attn.qkv") for k in names)
    assert {"mlp1.0.weight", "mlp1.1.weight", "mlp1.3.weight"} <= set(names)
    assert not any(k.startswith(("sound", "audio")) for k in names)


def patches(image: np.ndarray, mean, std):
    """An (h, w, 3) uint8 image whose sides are multiples of 32 as RADIO's packed input: normalised
    channel-major 16 x 16 patches, row-major, and the patch grid."""
    import torch
    x = (torch.from_numpy(image).float() / 255 - torch.tensor(mean)) / torch.tensor(std)
    rows, cols = image.shape[0] // PATCH, image.shape[1] // PATCH
    x = x.permute(2, 0, 1).reshape(3, rows, PATCH, cols, PATCH).permute(1, 3, 0, 2, 4).reshape(rows * cols, -1)
    return x, torch.tensor([[rows, cols]])


def test_transformers_loads_every_tensor_and_the_image_reaches_the_logits(omni_dir):
    import torch
    from transformers import AutoTokenizer, NemotronH_Omni_Reasoning_V3
    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(str(omni_dir), dtype=torch.float32,
                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.audio_tower is None
    cfg = model.config
    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    logits = []
    for seed in (0, 1):
        image = np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        pixels, grid = patches(image, cfg.norm_mean, cfg.norm_std)
        n = int(grid.prod()) // 4
        ids = torch.tensor([tok("<|im_start|>user\n<img>" + "<image>" * n + "</img>what?<|im_end|>\n").input_ids])
        with torch.no_grad():
            out = model(input_ids=ids, pixel_values=pixels, image_grid_hw=grid)
        assert torch.isfinite(out.logits).all() and n == 6
        logits.append(out.logits[0, -1])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)


def test_same_seed_same_weights_other_seed_differs(omni_dir, tmp_path):
    a = load_file(str(omni_dir / "model.safetensors"))
    b = load_file(str(make_tiny_omni(tmp_path / "again", seed=0) / "model.safetensors"))
    c = load_file(str(make_tiny_omni(tmp_path / "other", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a if k.startswith("vision_model."))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="size: expected one of"):
        make_tiny_omni("/nonexistent", size="0.6b")
    with pytest.raises(ValueError, match="init_std: expected > 0"):
        make_tiny_omni("/nonexistent", init_std=0.0)


def test_cli_make_tiny_model_nemotron_h_omni(tmp_path):
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "services.cli", "make-tiny-model", str(tmp_path / "m"), "--arch", "nemotron_h_omni",
         *extra], capture_output=True, text=True, timeout=300)
    out = run("--seed", "2")
    assert out.returncode == 0, out.stderr
    assert "nemotron_h_omni/tiny (seed 2" in out.stdout
    assert json.loads((tmp_path / "m" / "inflight_tiny.json").read_text())["seed"] == 2
    bad = run("--size", "small")
    assert bad.returncode == 2 and "--size must be one of ('tiny',)" in bad.stderr
