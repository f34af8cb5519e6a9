"""Weight push verification and staging, without an engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from protocol import pack_buckets
from rollout.install.weight_receiver import (ExpectedParams, ParamSpec, WeightUpdateError, remove_staged, stage_push,
                                     verify_push)

EXPECTED = ExpectedParams({"a.weight": ParamSpec((2, 3), "float32"), "b.weight": ParamSpec((4,), "bfloat16")})


def tensors(a=None, b=None):
    a = np.arange(6, dtype=np.float32).reshape(2, 3) if a is None else a
    b_bf16 = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.bfloat16) if b is None else b
    return [("a.weight", "float32", (2, 3), a.view(np.uint8)),
            ("b.weight", "bfloat16", (4,), b_bf16.view(torch.int16).numpy().view(np.uint8))]


def test_verified_push_stages_a_loadable_safetensors_file_and_cleans_up():
    manifest, buckets = pack_buckets(tensors(), version=3, bucket_bytes=16)
    staged = stage_push(verify_push(manifest, buckets, EXPECTED, current_version=2), 3, "t")
    try:
        with safe_open(str(staged / "model.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == ["a.weight", "b.weight"]
            assert torch.equal(f.get_tensor("a.weight"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
            b = f.get_tensor("b.weight")
            assert b.dtype == torch.bfloat16 and b.tolist() == [1.0, -2.0, 0.5, 3.0]
    finally:
        remove_staged(staged)
    assert not staged.exists()


@pytest.mark.parametrize("case,match", [
    ("old_version", r"manifest.version 2 must be greater than the version being served \(2\)"),
    ("bad_checksum", r"weight push v3 rejected: bucket\[0\].checksum"),
    ("missing_bucket", r"weight push v3 rejected: buckets: expected all 2 buckets"),
    ("missing_tensor", r"1 model parameters missing, e.g. \['b.weight'\]"),
    ("wrong_shape", r"'a.weight' has shape \(3, 2\), the model expects \(2, 3\)"),
    ("wrong_dtype", r"'b.weight' has dtype float16, the model expects bfloat16"),
    ("unknown", r"'c.weight' is not a parameter of the model"),
    ("duplicate", r"'a.weight' appears twice"),
])
def test_bad_pushes_are_rejected_with_the_reason(case, match):
    items = tensors()
    version, current = 3, 2
    if case == "old_version":
        version = 2
    elif case == "missing_tensor":
        items = items[:1]
    elif case == "wrong_shape":
        items[0] = ("a.weight", "float32", (3, 2), items[0][3])
    elif case == "wrong_dtype":
        items[1] = ("b.weight", "float16", (4,), items[1][3])
    elif case == "unknown":
        items.append(("c.weight", "float32", (1,), np.zeros(1, np.float32).view(np.uint8)))
    elif case == "duplicate":
        items.append(items[0])
    manifest, buckets = pack_buckets(items, version, bucket_bytes=16)
    if case == "bad_checksum":
        buckets[0].data = buckets[0].data.copy()
        buckets[0].data[0] ^= 1
    elif case == "missing_bucket":
        buckets = buckets[1:]
    with pytest.raises(WeightUpdateError, match=match):
        verify_push(manifest, buckets, EXPECTED, current)


def test_reset_accepts_any_version():
    manifest, buckets = pack_buckets(tensors(), version=0, bucket_bytes=64)
    assert [spec.name for spec, _ in verify_push(manifest, buckets, EXPECTED, None)] == ["a.weight", "b.weight"]


def test_expected_params_from_model_dir(tiny_model_dir):
    expected = ExpectedParams.from_model_dir(tiny_model_dir)
    assert expected.params["lm_head.weight"] == ParamSpec((448, 128), "float32")
    assert expected.total_bytes > 0
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        ExpectedParams.from_model_dir("/nonexistent-model-dir")
