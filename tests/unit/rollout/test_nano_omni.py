"""Nemotron-3-Nano-Omni in the engine without starting vLLM: its engine arguments (hybrid SSM cache, no audio,
vLLM's ``vit_hidden_size`` given back), its image tokens (``<img>`` / ``</img>`` removed around each collapsed run,
as vLLM's processor writes them), audio prompts refused, the dtype fix of vLLM's feature extraction and its image
resize run eagerly."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from protocol.images import PromptImage
from rollout.config import VllmConfig
from rollout.nano_omni import hf_overrides, install_projector, is_nano_omni, patch_vllm
from rollout.options import build_engine_options
from rollout.vllm_images import ImageTokens, image_tokens, unwrap_runs, vllm_prompt

IMG, START, END, AUDIO = 9, 7, 8, 11
TOKENS = ImageTokens(IMG, START, END, AUDIO)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return str(make_tiny_omni(tmp_path_factory.mktemp("tiny-omni"), seed=0))


def test_image_tokens_of_the_tiny_omni_and_of_a_qwen_config(omni_dir, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(omni_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<img>", "</img>", "<so_embedding>")}
    assert image_tokens(omni_dir) == ImageTokens(ids["<image>"], ids["<img>"], ids["</img>"], ids["<so_embedding>"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {},
                                                      "image_token_id": 5}))
    assert image_tokens(str(tmp_path)) == ImageTokens(5)
    assert image_tokens("/not/a/model") is None


@pytest.mark.parametrize("ids,want", [
    ([1, START, IMG, END, 2], [1, IMG, 2]),
    ([START, IMG, END, START, IMG, END], [IMG, IMG]),
    ([START, 1, END, IMG], [START, 1, END, IMG]),  # only around an image token
    ([IMG, END, END], [IMG, END]),
])
def test_unwrap_runs(ids, want):
    assert unwrap_runs(ids, TOKENS) == want
    assert unwrap_runs(ids, ImageTokens(IMG)) == ids


def test_an_image_prompt_goes_to_vllm_as_the_processor_wants_it():
    image = PromptImage(hashlib.sha256(b"a").hexdigest(), np.zeros((32, 64, 3), dtype=np.uint8))
    prompt = vllm_prompt([1, START, IMG, IMG, IMG, END, 2], [image], 3, TOKENS)
    assert prompt["prompt_token_ids"] == [1, IMG, 2]
    assert prompt["multi_modal_uuids"] == {"image": [f"{image.sha256}-v3"]}


def test_audio_prompts_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match=r"audio inputs are not supported: the prompt holds 2 audio placeholder "
                                         r"tokens \(id 11\)"):
        vllm_prompt([1, AUDIO, AUDIO, 2], [], 0, TOKENS)
    assert vllm_prompt([1, AUDIO], [], 0, ImageTokens(IMG))["prompt_token_ids"] == [1, AUDIO]  # Qwen: plain text


def test_engine_arguments(omni_dir):
    from test_options import CPU
    caps = dataclasses.replace(CPU, engine_arg_names=CPU.engine_arg_names | {
        "mamba_ssm_cache_dtype", "limit_mm_per_prompt", "hf_overrides"})
    assert is_nano_omni(omni_dir) and not is_nano_omni("/not/a/model")
    opts = build_engine_options(VllmConfig(), omni_dir, 512, caps)
    args = opts.engine_args
    assert args["limit_mm_per_prompt"] == {"image": 8, "video": 0, "audio": 0}
    assert args["hf_overrides"] == hf_overrides(omni_dir) == {"vit_hidden_size": 64}  # vLLM 0.32 knows the name
    # vLLM 0.25.1 does not know transformers 5.19's name: the class both register is named instead
    old_vllm = {"NemotronH_Nano_VL_V2", "NemotronH_Nano_Omni_Reasoning_V3"}
    assert hf_overrides(omni_dir, old_vllm) == {"vit_hidden_size": 64, "architectures": ["NemotronH_Nano_VL_V2"]}
    assert args["mamba_ssm_cache_dtype"] == "float32" and args["enable_prefix_caching"] is False


class Tower(torch.nn.Module):
    """A float32 stand-in for vLLM's RADIO tower: one linear layer, vLLM's ``(summary, features)`` output."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)

    def forward(self, pixels, imgs_sizes):
        return None, self.embed(pixels)


def test_patched_feature_extraction_keeps_the_model_dtype():
    from vllm.model_executor.models.nano_nemotron_vl import NemotronH_Nano_VL_V2
    patch_vllm()
    patch_vllm()  # idempotent
    fn = NemotronH_Nano_VL_V2.extract_feature_dynamic
    assert getattr(fn, "inflight_dtype_fix", False)
    seen = {}

    def mlp1(x):
        seen["dtype"] = x.dtype
        return x
    fake = SimpleNamespace(vision_model=Tower(), llm_dtype=torch.float32,
                           vision_final_layernorm=None, pixel_shuffle_dynamic_res=lambda x, imgs_sizes: x, mlp1=mlp1)
    fn(fake, torch.ones(1, 4, 8), [(32, 32)])
    assert seen["dtype"] == torch.float32  # vLLM 0.32's own cast gives bfloat16
    # a bfloat16 engine on a float32 checkpoint: the pixels come in bfloat16, the tower is float32 (text_config.dtype)
    fn(fake, torch.ones(1, 4, 8, dtype=torch.bfloat16), [(32, 32)])
    assert seen["dtype"] == torch.float32
    del fake.vision_final_layernorm  # vLLM 0.25.1's model has no such attribute
    fn(fake, torch.ones(1, 4, 8), [(32, 32)])
    assert seen["dtype"] == torch.float32


def test_patched_image_resize_runs_eagerly_with_the_same_result():
    from vllm.transformers_utils.processors import nano_nemotron_vl as processor
    patch_vllm()
    resize = processor._bicubic_resize_and_normalize
    assert not hasattr(resize, "_torchdynamo_orig_callable")  # no torch.compile wrapper left
    patch_vllm()
    assert processor._bicubic_resize_and_normalize is resize
    pixels = torch.randint(0, 256, (1, 12, 20, 3), dtype=torch.uint8)
    mean, std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)
    eager = resize(pixels, size=(16, 16), norm_mean=mean, norm_std=std)
    assert eager.shape == (1, 3, 16, 16)
    compiled = torch.compile(resize, dynamic=True)  # as vLLM's module compiles it
    torch.testing.assert_close(eager, compiled(pixels, size=(16, 16), norm_mean=mean, norm_std=std))


def test_the_engine_patches_vllm_in_its_own_process_before_building_a_nano_omni_engine(omni_dir, tiny_model_dir,
                                                                                       monkeypatch):
    """The GPU hosts run Inflight from the source tree: no entry point, so vLLM loads no plugin of ours there."""
    import asyncio

    import vllm.plugins

    from rollout import engine as engine_module
    from rollout.config import GenerationConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)  # as on a host where Inflight is not installed
    calls = []
    monkeypatch.setattr(engine_module.nano_omni, "patch_vllm", lambda: calls.append("patch_vllm"))

    def build(engine_args, kv):
        calls.append("build")
        raise RuntimeError("stop before vLLM starts")
    monkeypatch.setattr(engine_module, "build_async_llm", build)
    monkeypatch.setattr(engine_module.os, "environ", dict(engine_module.os.environ))  # the options' env stays here
    for model_dir, expected in ((omni_dir, ["patch_vllm", "build"]), (str(tiny_model_dir), ["build"])):
        calls.clear()
        engine = RolloutEngine(model_dir, GenerationConfig(max_new_tokens=8), 64, get_reward_fn("format"))
        with pytest.raises(RuntimeError, match="stop before vLLM starts"):
            asyncio.run(engine.start())
        assert calls == expected, model_dir


class NemotronH_Nano_VL_V2(torch.nn.Module):  # vLLM's class name, which install_projector checks
    """vLLM's Nano-Omni as far as its projector goes: ``mlp1`` (RMSNorm weight, two linear layers), no final norm."""

    def __init__(self):
        super().__init__()
        self.mlp1 = torch.nn.Sequential(torch.nn.LayerNorm(8, bias=False), torch.nn.Linear(8, 4, bias=False),
                                        torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
        self.vision_final_layernorm = None


def test_install_projector_copies_the_pushed_projector_only():
    model = NemotronH_Nano_VL_V2()
    push = [("mlp1.0.weight", torch.full((8,), 2.0)), ("mlp1.1.weight", torch.ones(4, 8, dtype=torch.float64)),
            ("mlp1.3.weight", torch.zeros(2, 4)), ("language_model.backbone.embeddings.weight", torch.ones(3, 2))]
    assert install_projector(model, push) == ["mlp1.0.weight", "mlp1.1.weight", "mlp1.3.weight"]
    assert torch.equal(model.mlp1[0].weight, torch.full((8,), 2.0))
    assert torch.equal(model.mlp1[1].weight, torch.ones(4, 8))
    assert model.mlp1[1].weight.dtype == torch.float32 and not model.mlp1[3].weight.any()
    with pytest.raises(ValueError, match=r"mlp1.1.weight: pushed shape \(8, 4\), the engine's \(4, 8\)"):
        install_projector(model, [("mlp1.1.weight", torch.ones(8, 4))])
    assert install_projector(torch.nn.Linear(2, 2), push) == []  # another model: nothing to do
    del model.vision_final_layernorm  # vLLM 0.25.1's model has no such attribute
    assert install_projector(model, push[:1]) == ["mlp1.0.weight"]
