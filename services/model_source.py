"""Resolving ``policy.model_name`` to a model directory.

A path is used as is (it must hold ``config.json``). ``tiny://ARCH`` with
optional ``?seed=N&size=S`` builds a random tiny model locally (no hub) into a
cache directory the first time and reuses it afterwards.
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, urlparse

CACHE = Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def resolve_model(model_name: str) -> str:
    if model_name.startswith("tiny://"):
        from services.tiny_model import ARCHS, SIZES, make_tiny_model

        url = urlparse(model_name)
        arch = url.netloc or url.path.strip("/")
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        seed, size = int(q.get("seed", 0)), q.get("size", "tiny")
        if arch not in ARCHS or size not in SIZES:
            raise ValueError(f"policy.model_name: {model_name!r}: expected tiny://<{'|'.join(ARCHS)}>"
                             f"[?seed=N&size=<{'|'.join(SIZES)}>]")
        out = CACHE / "tiny" / f"{arch}-{size}-s{seed}"
        if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
            make_tiny_model(out, seed=seed, arch=arch, size=size)
        return str(out)
    path = Path(model_name).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"policy.model_name: {model_name!r} is not a model directory (no config.json); "
                         f"use a local HF checkpoint or tiny://qwen2")
    return str(path.resolve())
