"""Nano-Omni in the learner (learner/omni_model.py through the Learner): the Nemotron-H hybrid model with the RADIO
tower and projector, loaded from the tiny checkpoint's published names. Its log-probs on packed image prompts (three
image sizes, two images in one prompt) and a text prompt equal float32 transformers' ``NemotronH_Omni_Reasoning_V3``
(prefill dt clamp lifted, as for Nemotron-H); other pixels move them far; packing does not change them. HF → Megatron
→ HF is exact (RADIO's int64 ``summary_idxs`` included). A step trains the language model only (tower frozen, the
default) or both, and what it saves transformers loads and scores the same."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_batches import make_learner
from safetensors.torch import load_file
from tower_steps import step_and_check

ATOL = 2e-4
"""Learner (Megatron-Core, fp32) vs transformers (fp32) response log-probs, max abs difference."""
SIZES = [[(64, 96)], [(128, 64), (64, 64)], []]
"""(height, width) of each prompt's images: 6, 8 + 4 image tokens, and a text prompt."""
VIDEO = "video_patch_projection"
"""The tower's video embedder: no image reaches it."""


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return str(make_tiny_omni(tmp_path_factory.mktemp("omni-learner"), seed=0))


@pytest.fixture(scope="module")
def omni_learner(omni_dir):
    learner = make_learner(omni_dir)  # float32, tower frozen (the default)
    yield learner
    learner.shutdown()


def image_inputs(pixels: list[np.ndarray], spec):
    """The learner's inputs of a prompt's images: RADIO's packed patches and ``(1, rows, cols)`` grids."""
    from learner.mrope_positions import ImageInputs
    from learner.radio_tower import radio_patches

    parts = [radio_patches(p, spec) for p in pixels]
    return ImageInputs(torch.cat([x for x, _ in parts]).numpy(),
                       np.array([[1, *g[0].tolist()] for _, g in parts], dtype=np.int64))


def prompts(omni_dir: str, learner, seed: int = 0, sizes=SIZES):
    """Token ids with each image's run as the processor writes it, responses, the learner's image inputs and the
    raw (patches, grids) transformers takes."""
    from transformers import AutoTokenizer

    spec = learner.arch.radio
    tok = AutoTokenizer.from_pretrained(omni_dir)
    rng = np.random.default_rng(seed)
    out_p, out_r, out_i = [], [], []
    for sizes_k in sizes:
        pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes_k]
        runs = "".join("<img>" + "<image>" * spec.tokens((h // 16, w // 16)) + "</img>" for h, w in sizes_k)
        ids = tok(f"<|im_start|>user\n{runs}what is it?<|im_end|>\n<|im_start|>assistant\n").input_ids
        out_p.append(np.asarray(ids, dtype=np.int32))
        out_r.append(rng.integers(3, 400, 12).astype(np.int32))
        out_i.append(image_inputs(pixels, spec) if pixels else None)
    return out_p, out_r, out_i


def hf_model(omni_dir: str):
    from transformers import NemotronH_Omni_Reasoning_V3

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(omni_dir, dtype=torch.float32).eval()
    for mixer in [m for m in model.modules() if hasattr(m, "time_step_limit")]:
        mixer.time_step_limit = (0.0, float("inf"))
    return model


@torch.no_grad()
def hf_logprobs(model, prompt_ids, responses, images) -> list[np.ndarray]:
    out = []
    for ids, response, img in zip(prompt_ids, responses, images, strict=True):
        tokens = torch.tensor(np.concatenate([ids, response]), dtype=torch.long)[None]
        kw = {} if img is None else dict(pixel_values=torch.from_numpy(img.pixel_values),
                                          image_grid_hw=torch.from_numpy(img.image_grid_thw[:, 1:]))
        logits = model(input_ids=tokens, **kw).logits[0, :-1].float()
        lps = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        out.append(lps[len(ids) - 1:].numpy())
    return out


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_logprobs_of_image_prompts_match_transformers(omni_learner, omni_dir):
    p, r, images = prompts(omni_dir, omni_learner)
    ours = omni_learner.logprobs(p, r, images)
    hf = hf_model(omni_dir)
    ref = hf_logprobs(hf, p, r, images)
    others = prompts(omni_dir, omni_learner, seed=5)[2]
    moved = hf_logprobs(hf, p, r, others)
    print(f"\nnano-omni learner vs transformers: max |Δ logprob| {max_diff(ours, ref):.2e}; with other pixels "
          f"{max_diff(moved, ref):.2e}")
    assert max_diff(ours, ref) <= ATOL and max_diff(moved, ref) > 100 * ATOL


def test_packed_image_prompts_equal_unpacked(omni_learner, omni_dir):
    p, r, images = prompts(omni_dir, omni_learner, seed=1)
    packed = omni_learner.logprobs(p, r, images)
    alone = [omni_learner.logprobs([a], [b], [c])[0] for a, b, c in zip(p, r, images, strict=True)]
    assert max_diff(packed, alone) < 1e-5


def test_hf_round_trip_with_the_tower_is_exact(omni_learner, omni_dir):
    from learner.hf_export import export_hf_state_dict

    source = load_file(f"{omni_dir}/model.safetensors")
    assert source["vision_model.radio_model.summary_idxs"].dtype == torch.int64
    exported = export_hf_state_dict(omni_learner.gpt, omni_learner.arch, omni_learner.hf_metas)
    assert exported is not None and list(exported) == [m.name for m in omni_learner.hf_metas]
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_a_step_with_the_tower_frozen_trains_only_the_language_model(omni_dir):
    learner = make_learner(omni_dir)
    try:
        step_and_check(learner, lambda seed, sizes: prompts(omni_dir, learner, seed, [[x] for x in sizes]), (64, 64),
                       frozen=True, unused=VIDEO)
    finally:
        learner.shutdown()


def test_a_step_with_the_tower_trained_changes_it_and_saves_it(omni_dir, tmp_path):
    learner = make_learner(omni_dir, freeze_vision_tower=False)
    try:
        step_and_check(learner, lambda seed, sizes: prompts(omni_dir, learner, seed, [[x] for x in sizes]), (64, 64),
                       frozen=False, unused=VIDEO)
        p, r, imgs = prompts(omni_dir, learner, seed=2)
        ours = learner.logprobs(p, r, imgs)
        learner.save_hf(str(tmp_path / "hf"))
    finally:
        learner.shutdown()
    assert max_diff(ours, hf_logprobs(hf_model(str(tmp_path / "hf")), p, r, imgs)) <= ATOL
