"""Helpers shared by the rollout integration tests: weight pushes built from a model directory."""
from __future__ import annotations

import numpy as np

from protocol import pack_buckets
from rollout.weight_receiver import PROTOCOL_DTYPES, read_safetensors_header

GROUP_SIZE = 4


def model_tensors(model_dir: str):
    """``(name, dtype, shape, raw bytes)`` of every tensor in a model directory's safetensors file."""
    path = f"{model_dir}/model.safetensors"
    header = read_safetensors_header(path)
    data = np.fromfile(path, dtype=np.uint8)
    start = 8 + int(np.frombuffer(data[:8].tobytes(), "<u8")[0])
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        lo, hi = entry["data_offsets"]
        yield name, PROTOCOL_DTYPES[entry["dtype"]], tuple(entry["shape"]), data[start + lo:start + hi]


def push_model(harness, model_dir: str, bucket_bytes: int = 1 << 20) -> int:
    """Push ``model_dir``'s weights as the next version; returns it."""
    manifest, buckets = pack_buckets(model_tensors(model_dir), harness.engine.version + 1, bucket_bytes)
    return harness.run(harness.engine.apply_weights(manifest, buckets))
