"""Helpers shared by the rollout integration tests: weight pushes built from a model directory."""
from __future__ import annotations

from model_weights import model_tensors
from protocol import pack_buckets

GROUP_SIZE = 4


def push_model(harness, model_dir: str, bucket_bytes: int = 1 << 20) -> int:
    """Push ``model_dir``'s weights as the next version; returns it."""
    manifest, buckets = pack_buckets(model_tensors(model_dir), harness.engine.version + 1, bucket_bytes)
    return harness.run(harness.engine.install(manifest, buckets))


HARNESS_VLLM_KWARGS = {"max_num_seqs": 200, "max_num_batched_tokens": 4096,
                       "kernel_config": {"moe_backend": "flashinfer_cutlass"}}
"""``policy.generation.vllm_kwargs`` of the shared engine (conftest.py), read back by test_engine_vllm_kwargs.py;
harmless to the other tests: the tiny model's batches are far smaller, and the MoE kernel is GPU-only (ignored on
CPU)."""
