"""Images on the wire (protocol/images.py): PromptRequest.images and TrajectoryGroup.image_ids round-trip, are
optional, and every bad image field is a ProtocolError naming its path."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from wire_maps import reject, wire_map

from protocol import PromptRequest, ProtocolError, Trajectory, TrajectoryGroup, decode, encode
from protocol.codec import pack_frame, unpack_frame
from protocol.images import MAX_IMAGES_PER_PROMPT, PromptImage

SHA_A = hashlib.sha256(b"a").hexdigest()
SHA_B = hashlib.sha256(b"b").hexdigest()


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _request(images=()) -> PromptRequest:
    return PromptRequest("p-1", np.array([1, 2, 3]), {"answer": "4"}, 2, list(images))


def _group(image_ids=()) -> TrajectoryGroup:
    trajs = [Trajectory(np.arange(3), np.full(3, -0.5), np.full(3, 1), 1.0)]
    return TrajectoryGroup("g-1", "p-1", [1, 2, 3], trajs, 1, 100, 4, "engine-0", 1.5, tuple(image_ids))


def test_prompt_images_roundtrip_pixels_exactly():
    a, b = _pixels(28, 56, 0), _pixels(84, 28, 1)
    back = decode(encode(_request([PromptImage(SHA_A, a), PromptImage(SHA_B, b)])), PromptRequest)
    assert [i.sha256 for i in back.images] == [SHA_A, SHA_B]
    for got, want in zip(back.images, (a, b), strict=True):
        assert got.pixels.dtype == np.uint8 and got.pixels.shape == want.shape
        np.testing.assert_array_equal(got.pixels, want)
    assert (back.images[0].height, back.images[0].width) == (28, 56)
    assert back.prompt_ids.tolist() == [1, 2, 3] and back.task == {"answer": "4"} and back.scheduled_step == 2
    assert encode(back) == encode(_request([PromptImage(SHA_A, a), PromptImage(SHA_B, b)]))


def test_prompt_without_images_has_no_images_key_and_decodes_to_an_empty_list():
    wire = encode(_request())
    assert "images" not in unpack_frame(wire)
    assert decode(wire, PromptRequest).images == []


def test_prompt_image_pixels_are_made_contiguous_uint8():
    img = PromptImage(SHA_A, np.asfortranarray(_pixels(4, 6, 2).astype(np.int64)))
    assert img.pixels.dtype == np.uint8 and img.pixels.flags.c_contiguous


def test_group_image_ids_roundtrip_and_default_to_empty():
    back = decode(encode(_group([SHA_A, SHA_B])), TrajectoryGroup)
    assert back.image_ids == (SHA_A, SHA_B)
    assert _group().image_ids == ()
    assert decode(encode(_group()), TrajectoryGroup).image_ids == ()
    m = wire_map(_group())
    del m["image_ids"]  # a group from a pool that predates images
    assert decode(pack_frame(m), TrajectoryGroup).image_ids == ()
    assert isinstance(TrajectoryGroup("g", "p", [1], [], 1, 10, image_ids=[SHA_A]).image_ids, tuple)


def _image_wire(sha=SHA_A, pixels=None) -> dict:
    m = wire_map(_request())
    m["images"] = [{"sha256": SHA_B, "pixels": _pixels(2, 2, 0)},
                   {"sha256": sha, "pixels": _pixels(3, 5, 1) if pixels is None else pixels}]
    return m


@pytest.mark.parametrize("sha", [SHA_A.upper(), SHA_A[:63], SHA_A + "0", "g" * 64, "", " " + SHA_A[1:]])
def test_bad_sha256_names_the_image(sha):
    reject(_image_wire(sha=sha), "images[1].sha256")


def test_sha256_must_be_a_string():
    reject(_image_wire(sha=7), "images[1].sha256", "a string")


def test_missing_sha256_and_pixels_are_named():
    m = _image_wire()
    del m["images"][1]["sha256"]
    with pytest.raises(ProtocolError) as err:
        decode(pack_frame(m))
    assert "sha256" in str(err.value)
    m = _image_wire()
    del m["images"][1]["pixels"]
    with pytest.raises(ProtocolError) as err:
        decode(pack_frame(m))
    assert "pixels" in str(err.value)


def test_float_pixels_are_rejected():
    reject(_image_wire(pixels=_pixels(3, 5, 1).astype(np.float32)), "images[1].pixels", "dtype uint8", "float32")


def test_four_channel_pixels_are_rejected():
    rgba = np.zeros((3, 5, 4), dtype=np.uint8)
    reject(_image_wire(pixels=rgba), "images[1].pixels", "[height, width, 3]", "[3, 5, 4]")


@pytest.mark.parametrize("shape", [(0, 5, 3), (5, 0, 3)])
def test_empty_sides_are_rejected(shape):
    reject(_image_wire(pixels=np.zeros(shape, dtype=np.uint8)), "images[1].pixels", "[height, width, 3]")


def test_two_dimensional_pixels_are_rejected():
    reject(_image_wire(pixels=np.zeros((3, 5), dtype=np.uint8)), "images[1].pixels", "3-d array", "2-d")


def test_pixels_must_be_an_array():
    reject(_image_wire(pixels=[[1, 2, 3]]), "images[1].pixels", "an ndarray of uint8")


def test_image_entry_must_be_a_map():
    m = wire_map(_request())
    m["images"] = ["not a map"]
    reject(m, "images[0]", "a map")


def test_images_must_be_a_list():
    m = wire_map(_request())
    m["images"] = {"sha256": SHA_A}
    reject(m, "images", "a list")


def test_too_many_images_are_rejected():
    m = wire_map(_request())
    one = {"sha256": SHA_A, "pixels": np.zeros((1, 1, 3), dtype=np.uint8)}
    m["images"] = [dict(one) for _ in range(MAX_IMAGES_PER_PROMPT)]
    assert len(decode(pack_frame(m), PromptRequest).images) == MAX_IMAGES_PER_PROMPT
    m["images"].append(dict(one))
    reject(m, "images", f"at most {MAX_IMAGES_PER_PROMPT} items", str(MAX_IMAGES_PER_PROMPT + 1))


def test_from_wire_directly_names_the_nested_path():
    with pytest.raises(ProtocolError) as err:
        PromptImage.from_wire({"sha256": SHA_A, "pixels": np.zeros((2, 2, 4), dtype=np.uint8)}, "x.images[3]")
    assert err.value.path == "x.images[3].pixels"


@pytest.mark.parametrize("value,path", [("ABC", "image_ids[1]"), (SHA_A[:10], "image_ids[1]"), (3, "image_ids[1]")])
def test_bad_group_image_ids_are_named(value, path):
    m = wire_map(_group([SHA_A, SHA_B]))
    m["image_ids"][1] = value
    reject(m, path)


def test_too_many_group_image_ids_are_rejected():
    m = wire_map(_group())
    m["image_ids"] = [SHA_A] * (MAX_IMAGES_PER_PROMPT + 1)
    reject(m, "image_ids", f"at most {MAX_IMAGES_PER_PROMPT} items")
