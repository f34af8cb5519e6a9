"""Shared by integration tests: a model directory's tensors as weight-push input."""
from __future__ import annotations

import numpy as np

from rollout.install.weight_receiver import PROTOCOL_DTYPES, read_safetensors_header


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
