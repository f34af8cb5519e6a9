"""Helpers shared by the rollout integration tests: weight pushes built from a model directory."""
from __future__ import annotations

from model_weights import model_tensors
from protocol import pack_buckets

GROUP_SIZE = 4


def push_model(harness, model_dir: str, bucket_bytes: int = 1 << 20) -> int:
    """Push ``model_dir``'s weights as the next version; returns it."""
    manifest, buckets = pack_buckets(model_tensors(model_dir), harness.engine.version + 1, bucket_bytes)
    return harness.run(harness.engine.install(manifest, buckets))
