"""A prompt's images as vLLM takes them (rollout/vllm_images.py): runs collapsed, pixels as PIL images, names salted
by the weight version; the model's image token read from config.json."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from protocol.images import PromptImage
from rollout.vllm_images import collapse_runs, image_token_id, image_uuid, vllm_prompt

IMG = 9
SHA_A = hashlib.sha256(b"a").hexdigest()
SHA_B = hashlib.sha256(b"b").hexdigest()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from services.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


def _image(sha: str, seed: int, h: int = 4, w: int = 6) -> PromptImage:
    return PromptImage(sha, np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("ids,want", [
    ([], []),
    ([1, 2, 3], [1, 2, 3]),
    ([IMG], [IMG]),
    ([IMG, IMG, IMG], [IMG]),
    ([1, IMG, IMG, 2, IMG, 3, IMG, IMG, IMG], [1, IMG, 2, IMG, 3, IMG]),
    ([IMG, IMG, 1, 1, 1, IMG], [IMG, 1, 1, 1, IMG]),  # only the given token's runs collapse
])
def test_collapse_runs(ids, want):
    assert collapse_runs(ids, IMG) == want


def test_text_prompt_is_the_ids_and_the_version_salt():
    for token in (None, IMG):
        prompt = vllm_prompt([1, 2, 3], [], 7, token)
        assert prompt == {"prompt_token_ids": [1, 2, 3], "cache_salt": "inflight-weights-v7"}
    assert vllm_prompt([1], [], 8, None)["cache_salt"] != vllm_prompt([1], [], 7, None)["cache_salt"]


def test_image_prompt_collapses_runs_and_names_images_by_sha_and_version():
    from PIL import Image

    images = [_image(SHA_A, 0), _image(SHA_B, 1, 8, 2)]
    ids = [1, 2, IMG, IMG, IMG, IMG, 3, IMG, IMG, 4]
    prompt = vllm_prompt(ids, images, 3, IMG)
    assert prompt["prompt_token_ids"] == [1, 2, IMG, 3, IMG, 4]
    assert prompt["cache_salt"] == "inflight-weights-v3"
    assert ids == [1, 2, IMG, IMG, IMG, IMG, 3, IMG, IMG, 4]  # the caller's list is left alone
    pil = prompt["multi_modal_data"]["image"]
    assert len(pil) == 2
    for got, want in zip(pil, images, strict=True):
        assert isinstance(got, Image.Image) and got.mode == "RGB" and got.size == (want.width, want.height)
        np.testing.assert_array_equal(np.asarray(got), want.pixels)
    names = prompt["multi_modal_uuids"]["image"]
    assert names == [image_uuid(SHA_A, 3), image_uuid(SHA_B, 3)]
    assert vllm_prompt(ids, images, 4, IMG)["multi_modal_uuids"]["image"] != names


def test_image_uuid_differs_by_version_and_by_image():
    assert image_uuid(SHA_A, 1) != image_uuid(SHA_A, 2)
    assert image_uuid(SHA_A, 1) != image_uuid(SHA_B, 1)
    assert image_uuid(SHA_A, 1).startswith(SHA_A)


def test_the_same_image_twice_is_two_items_with_one_name():
    images = [_image(SHA_A, 0), _image(SHA_A, 0)]
    prompt = vllm_prompt([IMG, IMG, 1, IMG, IMG], images, 0, IMG)
    assert prompt["prompt_token_ids"] == [IMG, 1, IMG]
    assert prompt["multi_modal_uuids"]["image"] == [image_uuid(SHA_A, 0)] * 2


@pytest.mark.parametrize("ids,count", [([1, IMG, IMG, 2], 2), ([1, IMG, 2, IMG], 1), ([1, 2, 3], 1)])
def test_runs_that_do_not_match_the_images_are_an_error(ids, count):
    images = [_image(SHA_A, k) for k in range(count)]
    with pytest.raises(ValueError, match=f"{count} images has"):
        vllm_prompt(ids, images, 0, IMG)


def test_images_for_a_text_model_are_an_error():
    with pytest.raises(ValueError, match="not a vision-language model"):
        vllm_prompt([1, IMG], [_image(SHA_A, 0)], 0, None)


def test_image_token_id_of_a_text_model_is_none(tmp_path):
    assert image_token_id(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    assert image_token_id(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "image_token_id": 5}))
    assert image_token_id(str(tmp_path)) is None  # no vision tower
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}, "text_config": {"image_token_id": 12}}))
    assert image_token_id(str(tmp_path)) == 12
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}, "image_token_id": "12"}))
    assert image_token_id(str(tmp_path)) is None


def test_image_token_id_of_the_tiny_vlm(vlm_dir):
    from transformers import AutoTokenizer

    token = image_token_id(str(vlm_dir))
    assert isinstance(token, int)
    assert token == AutoTokenizer.from_pretrained(str(vlm_dir)).convert_tokens_to_ids("<|image_pad|>")
