"""Image preparation (services/data/images.py) on real generated images: the outputs equal transformers' Qwen2-VL PIL
image processor bit for bit, every reference form reads, every bad-image kind fails alone with its reason, and a
batch concatenates without padding."""
from __future__ import annotations

import base64
import hashlib
import io

import numpy as np
import pytest
from image_samples import RULES, bad_images, encoded, forged_png_header, noise
from PIL import Image

from services.data.images import FAILURE_KINDS, ImageFailure, ImageRules, PreparedImage, batch_images, prepare_image


def hf_processor(rules: ImageRules):
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(min_pixels=rules.min_pixels, max_pixels=rules.max_pixels)


@pytest.mark.parametrize("rules", [RULES, ImageRules()], ids=["tiny", "published"])
@pytest.mark.parametrize("size", [(96, 72), (56, 120), (640, 480), (30, 20), (3000, 40), (301, 177)])
def test_outputs_equal_the_transformers_processor(rules, size):
    img = noise(*size, seed=size[0])
    ours = prepare_image(encoded(img), rules)
    assert isinstance(ours, PreparedImage)
    ref = hf_processor(rules)(images=[img], return_tensors="np")
    assert np.array_equal(ours.pixel_values, ref["pixel_values"]) and ours.pixel_values.dtype == np.float32
    assert np.array_equal(ours.image_grid_thw, ref["image_grid_thw"][0])
    assert ours.num_tokens == int(ref["image_grid_thw"].prod()) // 4
    assert ours.size == size and ours.resized == (ours.image_grid_thw[2] * 14, ours.image_grid_thw[1] * 14)


@pytest.mark.parametrize("mode,fmt", [("L", "PNG"), ("P", "PNG"), ("CMYK", "JPEG"), ("RGB", "JPEG"), ("1", "PNG")])
def test_other_modes_convert_to_rgb_as_the_processor_does(mode, fmt):
    img = noise(80, 60, mode)
    data = encoded(img, fmt)
    ours = prepare_image(data, RULES)
    assert isinstance(ours, PreparedImage)
    ref = hf_processor(RULES)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert np.array_equal(ours.pixel_values, ref["pixel_values"])


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (84, 84), (255, 0, 0, 0))  # fully transparent red
    ours = prepare_image(encoded(rgba), RULES)
    white = prepare_image(encoded(Image.new("RGB", (84, 84), "white")), RULES)
    assert isinstance(ours, PreparedImage) and isinstance(white, PreparedImage)
    assert np.array_equal(ours.pixel_values, white.pixel_values)


def test_rules_read_back_from_a_saved_processor(tmp_path):
    hf_processor(RULES).save_pretrained(str(tmp_path))
    assert ImageRules.from_pretrained(tmp_path) == RULES
    with pytest.raises(ValueError, match="preprocessor_config.json: no such file"):
        ImageRules.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "CLIPImageProcessor"}')
    with pytest.raises(ValueError, match="image_processor_type 'CLIPImageProcessor', expected Qwen2VL"):
        ImageRules.from_pretrained(tmp_path)


def test_every_reference_form_gives_the_same_image_and_hash(tmp_path):
    data = encoded(noise(70, 90))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    refs = [data, str(tmp_path / "imgs" / "a.png"), uri, {"bytes": data, "path": None}, {"bytes": None,
                                                                                         "path": "imgs/a.png"}]
    out = [prepare_image(r, RULES, base_dir=str(tmp_path)) for r in refs]
    assert all(isinstance(o, PreparedImage) for o in out), out
    assert {o.sha256 for o in out} == {hashlib.sha256(data).hexdigest()}  # type: ignore[union-attr]
    assert all(np.array_equal(o.pixel_values, out[0].pixel_values) for o in out)  # type: ignore[union-attr]
    assert prepare_image("imgs/a.png", RULES, base_dir=str(tmp_path)).sha256 == out[0].sha256  # type: ignore


def test_every_bad_image_kind_fails_alone_with_a_reason(tmp_path):
    cases = bad_images(tmp_path)
    assert set(cases) | {"timeout", "worker_died"} == set(FAILURE_KINDS)  # the pool's own two: test_image_pool
    for kind, (ref, limits) in cases.items():
        out = prepare_image(ref, RULES, limits)  # type: ignore[arg-type]
        assert isinstance(out, ImageFailure) and out.kind == kind, (kind, out)
        assert out.reason
    reasons = {k: prepare_image(r, RULES, lim).reason for k, (r, lim) in cases.items()}  # type: ignore
    assert "truncated" in reasons["truncated"] and "zero size" in reasons["empty"]
    assert "huge dimensions: 200 x 200" in reasons["too_large"] and "'I;16'" in reasons["bad_mode"]


def test_a_forged_huge_header_fails_before_decoding():
    out = prepare_image(forged_png_header(100_000, 100_000), RULES)
    assert isinstance(out, ImageFailure) and out.kind == "too_large" and "huge dimensions" in out.reason
    out = prepare_image(forged_png_header(9000, 9000), RULES)  # under Pillow's bomb limit, over ours
    assert isinstance(out, ImageFailure) and out.kind == "too_large" and "9000 x 9000" in out.reason


@pytest.mark.parametrize("uri", ["data:text/plain;base64,aGk=", "data:image/png;base64,@@@", "data:image/png,raw"])
def test_bad_data_uris_fail(uri):
    out = prepare_image(uri, RULES)
    assert isinstance(out, ImageFailure) and out.kind == "bad_reference"


def test_a_batch_concatenates_patches_without_padding():
    sizes = [(96, 72), (56, 120), (300, 300)]
    images = [prepare_image(encoded(noise(*s, seed=k)), RULES) for k, s in enumerate(sizes)]
    assert all(isinstance(i, PreparedImage) for i in images)
    batch = batch_images(images)  # type: ignore[arg-type]
    counts = [len(i.pixel_values) for i in images]  # type: ignore[union-attr]
    assert batch.pixel_values.shape == (sum(counts), 1176) and batch.image_grid_thw.shape == (3, 3)
    assert list(batch.cu_patches) == [0, counts[0], counts[0] + counts[1], sum(counts)]
    assert batch.num_tokens == tuple(c // 4 for c in counts)
    assert batch.padding_share == pytest.approx(1 - sum(counts) / (3 * max(counts)))
    with pytest.raises(ValueError, match="at least one"):
        batch_images([])
