"""Nano-Omni in Megatron-Core (learner/omni_model.py): the Nemotron-H hybrid model with the RADIO tower and projector,
loaded from the tiny checkpoint's published names. Its log-probs on image prompts (three image sizes, two images in
one prompt) and on a text prompt equal float32 transformers' ``NemotronH_Omni_Reasoning_V3`` (prefill dt clamp
lifted, as for Nemotron-H); other pixels move them far. The tower is frozen by default (no gradient reaches it) and
trainable when asked (gradients reach every tensor of it a forward uses)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

ATOL = 2e-4
"""Learner (Megatron-Core, fp32) vs transformers (fp32) response log-probs, max abs difference."""
SIZES = [[(64, 96)], [(128, 64), (64, 64)], []]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return str(make_tiny_omni(tmp_path_factory.mktemp("omni-learner"), seed=0))


@pytest.fixture(scope="module")
def megatron():
    from learner.config import MegatronConfig
    from learner.model import init_distributed

    cfg = MegatronConfig(precision="float32")
    init_distributed(cfg, seed=0)
    return cfg


def build(omni_dir: str, megatron, frozen: bool = True):
    from learner.attention import core_attention_class, resolve_backend
    from learner.omni_model import build_omni_model, load_omni_weights, read_omni_architecture

    arch, spec = read_omni_architecture(omni_dir)
    model = build_omni_model(arch, spec, megatron, core_attention_class(resolve_backend(megatron.attention_backend)),
                             freeze_vision_tower=frozen)
    load_omni_weights(model, arch, omni_dir)
    return model, spec


def prompts(omni_dir: str, spec, seed: int = 0):
    """(token ids with each image's run as the processor writes it, response, packed pixels + grids or None)."""
    from transformers import AutoTokenizer

    from learner.radio_tower import radio_patches

    tok = AutoTokenizer.from_pretrained(omni_dir)
    rng = np.random.default_rng(seed)
    out = []
    for sizes in SIZES:
        parts = [radio_patches(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), spec) for h, w in sizes]
        runs = "".join("<img>" + "<image>" * spec.tokens((h // 16, w // 16)) + "</img>" for h, w in sizes)
        ids = tok(f"<|im_start|>user\n{runs}what is it?<|im_end|>\n<|im_start|>assistant\n").input_ids
        pics = (torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])) if parts else None
        out.append((ids, np.random.default_rng(seed + 1).integers(3, 400, 12).tolist(), pics))
    return out


def learner_logprobs(model, spec, ids, response, pics) -> torch.Tensor:
    from learner.attention import packed_row
    from learner.omni_model import OmniImages

    tokens = torch.tensor([ids + response])
    images = None if pics is None else OmniImages(pics[0], pics[1], tokens == spec.image_token_id)
    logits = model(tokens, torch.arange(tokens.shape[1])[None], None, images=images,
                   packed_seq_params=packed_row([tokens.shape[1]], tokens.device))
    lps = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return lps[len(ids) - 1:]


def hf_logprobs(omni_dir: str, cases) -> list[np.ndarray]:
    from transformers import NemotronH_Omni_Reasoning_V3

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(omni_dir, dtype=torch.float32).eval()
    for mixer in [m for m in model.modules() if hasattr(m, "time_step_limit")]:
        mixer.time_step_limit = (0.0, float("inf"))
    out = []
    for ids, response, pics in cases:
        tokens = torch.tensor([ids + response])
        kw = {} if pics is None else dict(pixel_values=pics[0], image_grid_hw=pics[1])
        with torch.no_grad():
            logits = model(input_ids=tokens, **kw).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0][len(ids) - 1:].numpy())
    return out


def test_logprobs_of_image_prompts_match_transformers(omni_dir, megatron):
    model, spec = build(omni_dir, megatron)
    model.eval()
    cases = prompts(omni_dir, spec)
    with torch.no_grad():
        ours = [learner_logprobs(model, spec, *c).numpy() for c in cases]
        other = [learner_logprobs(model, spec, ids, r, p2).numpy()
                 for (ids, r, _), (_, _, p2) in zip(cases, prompts(omni_dir, spec, seed=5), strict=True)]
    ref = hf_logprobs(omni_dir, cases)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref, strict=True))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(other, ref, strict=True))
    print(f"\nnano-omni learner vs transformers: max |Δ logprob| {diff:.2e}; with other pixels {moved:.2e}")
    assert diff <= ATOL and moved > 100 * ATOL


def test_tower_frozen_by_default_and_trainable_when_asked(omni_dir, megatron):
    for frozen in (True, False):
        model, spec = build(omni_dir, megatron, frozen=frozen)
        model.train()
        ids, response, pics = prompts(omni_dir, spec)[1]
        learner_logprobs(model, spec, ids, response, pics).sum().backward()
        tower = [(n, p) for n, p in model.visual.named_parameters() if "video_patch_projection" not in n]
        lm = [p for n, p in model.named_parameters() if not n.startswith("visual.")]
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lm)
        if frozen:
            assert not model.visual.training and all(p.grad is None and not p.requires_grad for _, p in tower)
        else:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in tower), \
                [n for n, p in tower if p.grad is None or p.grad.abs().sum() == 0]
