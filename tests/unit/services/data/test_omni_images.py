"""Nano-Omni's image rules (services/data/omni_images.py) and the one way in (services/data/vision_rules.py) on a
tiny Nano-Omni: the rules read from its config.json and tokenizer, bad configs refused by key, vLLM's resize rule
(hand-checked sizes; vLLM's own code: test_omni_vllm_rule.py), the learner's pixel values equal to
learner.radio_tower.radio_patches, the <img> <image> x n </img> expansion, the vision tokens, and end to end: a real
image worker preparing PNGs, a data row's prompt through the chat template, and the learner's inputs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from image_samples import RULES, encoded, noise
from PIL import Image

from services.data.image_pool import ImagePool
from services.data.image_prompts import ImagePrompts, image_inputs, image_token_id, vision_token_ids
from services.data.images import ImageFailure, ImageRules, PreparedImage, prepare_image
from services.data.learner_images import LearnerImages
from services.data.omni_images import OmniImageRules, target_grid, vllm_patch_grid
from services.data.vision_rules import VisionRules, image_rules
from services.recipe.data import DataConfig

ROOT = Path(__file__).resolve().parents[4]
HALF = (0.5, 0.5, 0.5)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    from services.models.tiny_omni import make_tiny_omni

    return make_tiny_omni(tmp_path_factory.mktemp("tiny-omni"), seed=0)


@pytest.fixture(scope="module")
def rules(omni_dir) -> OmniImageRules:
    got = image_rules(omni_dir)
    assert isinstance(got, OmniImageRules)
    return got


@pytest.fixture(scope="module")
def tok(omni_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(omni_dir))


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<image>", "<video>", "<so_embedding>")}


def _edited(omni_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the tiny Omni's config.json and tokenizer with ``edit(cfg)`` applied to the config."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((omni_dir / name).read_bytes())
    cfg = json.loads((omni_dir / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# ----------------------------------------------------------------------------- the rules and the way in

def test_rules_are_read_from_the_config_and_the_tokenizer(rules, ids):
    assert rules == OmniImageRules(min_num_patches=16, max_num_patches=64,
                                   norm_mean=(0.48145466, 0.4578275, 0.40821073),
                                   norm_std=(0.26862954, 0.26130258, 0.27577711), img_start_id=ids["<img>"],
                                   img_end_id=ids["</img>"], patch_size=16)
    assert rules.placeholder == "<image>" and rules.budget == 64


def test_the_factory_picks_the_family_by_model_type(omni_dir, tmp_path):
    from services.models.tiny_vlm import make_tiny_vlm

    vlm = make_tiny_vlm(tmp_path / "vlm", seed=0)
    assert isinstance(image_rules(vlm), ImageRules) and image_rules(vlm) == ImageRules.from_pretrained(vlm)
    proc = tmp_path / "proc"  # an image processor saved alone: the Qwen2-VL family, as before
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    assert image_rules(proc) == ImageRules()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'llava' has no image rules; data.image_key is "
                                         r"supported for model_type qwen2_vl, qwen2_5_vl, nemotron_h_omni"):
        image_rules(other)
    both: list[VisionRules] = [image_rules(vlm), image_rules(omni_dir)]  # one interface, no isinstance needed
    assert [r.placeholder for r in both] == ["<|image_pad|>", "<image>"]


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["vision_config"]["args"].pop("min_num_patches"),
     r"vision_config.args has no min_num_patches: the model's images are tiled"),
    (lambda c: c["vision_config"]["args"].update(max_num_patches=0), r"vision_config.args.max_num_patches 0"),
    (lambda c: c["vision_config"]["args"].update(max_num_patches="64"),
     r"vision_config.args.max_num_patches '64', expected an integer >= 0"),
    (lambda c: c.update(downsample_ratio=0.25), r"downsample_ratio 0.25, expected 0.5"),
    (lambda c: c.update(norm_std=[0.5, 0.5]), r"norm_std \[0.5, 0.5\], expected three numbers"),
], ids=["tiled", "no-budget", "not-int", "ratio", "norm"])
def test_configs_outside_dynamic_resolution_are_refused_by_key(omni_dir, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        image_rules(_edited(omni_dir, tmp_path, edit))


def test_rules_made_by_hand_are_checked():
    with pytest.raises(ValueError, match="min_num_patches <= max_num_patches"):
        OmniImageRules(65, 64, HALF, HALF)
    with pytest.raises(ValueError, match="without img_start_id / img_end_id"):
        OmniImageRules(16, 64, HALF, HALF).expansion(450, 2)


# ----------------------------------------------------------------------------- vLLM's resize rule

@pytest.mark.parametrize("size,first,final", [
    ((10, 10), (4, 4), (4, 4)),  # 1 x 1 patch, scaled up to min_num_patches
    ((48, 48), (4, 4), (4, 4)),  # round(3 + 0.5) is 4 (half to even)
    ((80, 80), (6, 6), (6, 6)),  # round(5 + 0.5) is 6: an odd number of tokens a side (3 x 3)
    ((640, 480), (6, 10), (6, 10)),  # scaled down to the budget, the 9 columns rounded up to 10
    ((1000, 20), (2, 44), (2, 32)),  # 1 row rounded up to 2: 88 patches, over the budget; vLLM would shrink it again
    ((20, 1000), (44, 2), (32, 2)),
])
def test_the_resize_rule_on_sizes_checked_by_hand(rules, size, first, final):
    width, height = size
    assert vllm_patch_grid(width, height, rules.budget, rules.min_num_patches) == first
    assert target_grid(width, height, rules.budget, rules.min_num_patches) == final
    assert rules.target_size(width, height) == (final[1] * 16, final[0] * 16)
    prepared = prepare_image(encoded(noise(width, height)), rules)
    assert isinstance(prepared, PreparedImage)
    assert prepared.resized == rules.target_size(width, height) and prepared.size == size
    assert prepared.num_tokens == final[0] * final[1] // 4
    assert prepared.image_grid_thw.tolist() == [1, *final] and prepared.image_grid_thw.dtype == np.int64


def test_a_side_scaled_to_no_patch_is_a_bad_aspect(rules):
    with pytest.raises(ValueError, match=r"4000 x 20 pixels scales to 89 x 0 patches .* aspect ratio too extreme"):
        rules.target_size(4000, 20)
    failed = prepare_image(encoded(Image.new("RGB", (4000, 20))), rules)
    assert isinstance(failed, ImageFailure) and failed.kind == "bad_aspect" and "divides by zero" in failed.reason


def test_the_resized_pixels_are_pillows_bicubic_resize(rules):
    img = noise(301, 177, seed=3)
    prepared = prepare_image(encoded(img), rules)
    assert isinstance(prepared, PreparedImage)
    want = np.asarray(img.resize(prepared.resized, resample=Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(prepared.rgb, want)


# ----------------------------------------------------------------------------- the learner's pixel values

@pytest.mark.parametrize("size", [(10, 10), (640, 480), (1000, 20), (77, 300), (333, 333)])
def test_pixel_values_equal_the_learners_radio_patches(rules, omni_dir, size):
    from learner.radio_tower import RadioSpec, radio_patches

    spec = RadioSpec.of(json.loads((omni_dir / "config.json").read_text()))
    prepared = prepare_image(encoded(noise(*size, seed=size[0])), rules)
    assert isinstance(prepared, PreparedImage)
    patches, grid_hw = radio_patches(prepared.rgb.copy(), spec)  # a writable copy for torch
    assert prepared.pixel_values.dtype == np.float32 and prepared.pixel_values.shape == (patches.shape[0], 768)
    assert torch.equal(torch.from_numpy(prepared.pixel_values), patches)  # bit for bit
    assert prepared.image_grid_thw[1:].tolist() == grid_hw[0].tolist()
    assert prepared.num_tokens == spec.tokens(tuple(grid_hw[0].tolist()))


def test_process_refuses_a_size_off_the_grid(rules):
    with pytest.raises(ValueError, match=r"expected uint8 \[h, w, 3\] with h and w multiples of 32, got shape "
                                         r"\[48, 64, 3\]"):
        rules.process(np.zeros((48, 64, 3), np.uint8))


# ----------------------------------------------------------------------------- the prompt's tokens

class _Img:
    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


def test_each_image_placeholder_becomes_img_image_run_end(rules, ids):
    ip = ImagePrompts(pool=None, refs_of=lambda row: [], token_id=ids["<image>"], rules=rules)  # type: ignore
    s, e, im = ids["<img>"], ids["</img>"], ids["<image>"]
    assert ip.expand([1, im, 2, im, 3], [_Img(2), _Img(1)]) == [1, s, im, im, e, 2, s, im, e, 3]  # type: ignore
    with pytest.raises(ValueError, match=r"rendered 1 <image> for 2 images"):
        ip.expand([1, im], [_Img(2), _Img(1)])  # type: ignore
    qwen = ImagePrompts(pool=None, refs_of=lambda row: [], token_id=7)  # type: ignore  # Qwen2-VL's by default
    assert qwen.expand([1, 7, 2], [_Img(3)]) == [1, 7, 7, 7, 2]  # type: ignore
    with pytest.raises(ValueError, match=r"rendered 0 <\|image_pad\|> for 1 images"):
        qwen.expand([1, 2], [_Img(3)])  # type: ignore


def test_vision_tokens_and_image_token(omni_dir, ids, tmp_path):
    assert image_token_id(str(omni_dir)) == ids["<image>"] == 450
    assert vision_token_ids(str(omni_dir)) == frozenset(ids.values())
    no_audio = _edited(omni_dir, tmp_path, lambda c: c.pop("audio_token_id"))
    assert vision_token_ids(str(no_audio)) == frozenset(ids.values()) - {ids["<so_embedding>"]}


def test_learner_images_of_an_omni_run(omni_dir, rules, ids):
    images = LearnerImages.of(DataConfig(image_key="image"), str(omni_dir))
    assert images.rules == rules and images.vision_tokens == frozenset(ids.values())
    qwen = LearnerImages(RULES, frozenset())
    assert qwen.in_use and images.in_use


# ----------------------------------------------------------------------------- end to end

def test_a_worker_prepares_pngs_and_the_prompt_and_learner_inputs_follow(omni_dir, rules, tok, ids, tmp_path):
    from rollout.vllm_images import image_tokens, vllm_prompt
    from services.data.prompt_source import image_prompts, row_prompts
    from services.recipe.config import load_recipe

    (tmp_path / "images").mkdir()
    sizes = [(640, 480), (1000, 20), (10, 10)]
    for k, size in enumerate(sizes):
        (tmp_path / "images" / f"{k}.png").write_bytes(encoded(noise(*size, seed=k)))
    (tmp_path / "images" / "thin.png").write_bytes(encoded(Image.new("RGB", (4000, 20))))
    refs = [f"images/{k}.png" for k in range(len(sizes))]
    with ImagePool.for_data(DataConfig(image_key="image", image_workers=1), str(omni_dir)) as pool:
        assert pool.rules == rules
        out = pool.prepare([*refs, "images/thin.png"], str(tmp_path))
    assert isinstance(out[-1], ImageFailure) and out[-1].kind == "bad_aspect"
    for ref, got in zip(refs, out, strict=False):
        want = prepare_image(ref, rules, base_dir=str(tmp_path))
        assert isinstance(got, PreparedImage) and isinstance(want, PreparedImage)
        np.testing.assert_array_equal(got.pixel_values, want.pixel_values)
        np.testing.assert_array_equal(got.rgb, want.rgb)
        assert got.num_tokens == want.num_tokens and got.resized == want.resized

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input": "What is shown?", "output": "noise", "image": refs}) + "\n")
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={data}", "data.image_key=image",
                                "data.image_workers=1", "data.input_key=input", "data.output_key=output"])
    prompts = image_prompts(recipe, str(omni_dir))
    assert prompts is not None and prompts.rules == rules and prompts.token_id == ids["<image>"]
    try:
        req = row_prompts(recipe, tok, str(data), "data.train_data_path", "row-", images=prompts).get(0)
    finally:
        prompts.close()
    prepared = [o for o in out[:len(refs)] if isinstance(o, PreparedImage)]
    seq = req.prompt_ids.tolist()
    s, e, im = ids["<img>"], ids["</img>"], ids["<image>"]
    starts = [k for k, t in enumerate(seq) if t == s]
    assert [seq[k + 1:seq.index(e, k)] for k in starts] == [[im] * p.num_tokens for p in prepared]
    assert seq.count(im) == sum(p.num_tokens for p in prepared) == 15 + 16 + 4
    # the rest is the template's rendering of the image parts before the text
    turns = ImagePrompts.with_image_parts([{"role": "user", "content": "What is shown?"}], len(refs))
    rendered = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert rendered.count(im) == len(refs) and s not in rendered
    for img, p in zip(req.images, prepared, strict=True):
        assert img.sha256 == p.sha256
        np.testing.assert_array_equal(img.pixels, p.rgb)
    # the learner's inputs from the wire pixels are the worker's pixel values
    inputs = image_inputs(req.images, rules)
    np.testing.assert_array_equal(inputs.pixel_values, np.concatenate([p.pixel_values for p in prepared]))
    assert inputs.image_grid_thw.tolist() == [[1, 6, 10], [1, 2, 32], [1, 4, 4]]
    # the engine's prompt: each <img> <image> x n </img> goes to vLLM as one <image>, with the resized pixels
    sent = vllm_prompt(seq, req.images, 0, image_tokens(str(omni_dir)))
    assert sent["prompt_token_ids"].count(im) == len(refs) and s not in sent["prompt_token_ids"]
    assert [i.size for i in sent["multi_modal_data"]["image"]] == [p.resized for p in prepared]


def test_an_image_worker_does_not_import_torch(omni_dir, tmp_path):
    import pickle

    (tmp_path / "a.png").write_bytes(encoded(noise(90, 60)))
    code = ("import pickle, sys; import services.data.image_pool; from services.data.images import prepare_image; "
            "rules = pickle.loads(sys.stdin.buffer.read()); "
            f"out = prepare_image('a.png', rules, base_dir={str(tmp_path)!r}); "
            "print(type(rules).__name__, getattr(out, 'num_tokens', out), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(image_rules(omni_dir)), cwd=ROOT,
                          capture_output=True, timeout=60)
    assert done.stdout.decode().split() == ["OmniImageRules", "6", "False"], done.stderr.decode()[-2000:]
