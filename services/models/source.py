"""Resolving ``policy.model_name`` to a model directory.

A path is used as is (it must hold ``config.json``). ``tiny://ARCH`` with
optional ``?seed=N&size=S&tie=1`` builds a random tiny model locally (no hub) into a
cache directory the first time and reuses it afterwards. :func:`check_model`
says, without building or loading anything, whether the learner supports the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

CACHE = Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))
NOT_A_DIRECTORY = "is not a model directory (no config.json); use a local HF checkpoint directory or tiny://qwen2"


@dataclass(frozen=True)
class TinyModelName:
    """A parsed ``tiny://ARCH[?seed=N&size=S&tie=0|1]``."""

    arch: str
    seed: int
    size: str
    tie_word_embeddings: bool

    @property
    def cache_dir(self) -> Path:
        return CACHE / "tiny" / f"{self.arch}{'-tied' if self.tie_word_embeddings else ''}-{self.size}-s{self.seed}"


def parse_tiny(model_name: str) -> TinyModelName:
    """Parse a ``tiny://`` name; ``ValueError`` naming the accepted archs and sizes otherwise."""
    from services.models.tiny_model import ARCHS as TEXT_ARCHS
    from services.models.tiny_model import SIZES
    from services.models.tiny_vlm import ARCH as VLM_ARCH

    ARCHS = (*TEXT_ARCHS, VLM_ARCH)
    url = urlparse(model_name)
    arch = url.netloc or url.path.strip("/")
    q = {k: v[-1] for k, v in parse_qs(url.query).items()}
    usage = f"expected tiny://<{'|'.join(ARCHS)}>[?seed=N&size=<{'|'.join(SIZES)}>&tie=<0|1>]"
    if arch not in ARCHS or q.get("size", "tiny") not in SIZES or q.get("tie", "0") not in ("0", "1") \
            or not q.get("seed", "0").isdigit():
        raise ValueError(f"policy.model_name: {model_name!r}: {usage}")
    return TinyModelName(arch, int(q.get("seed", 0)), q.get("size", "tiny"), q.get("tie", "0") == "1")


def resolve_model(model_name: str) -> str:
    if model_name.startswith("tiny://"):
        from services.models.tiny_model import make_tiny_model
        from services.models.tiny_vlm import ARCH as VLM_ARCH
        from services.models.tiny_vlm import make_tiny_vlm

        tiny = parse_tiny(model_name)
        out = tiny.cache_dir
        if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
            if tiny.arch == VLM_ARCH:
                make_tiny_vlm(out, seed=tiny.seed, size=tiny.size)
            else:
                make_tiny_model(out, seed=tiny.seed, arch=tiny.arch, size=tiny.size,
                                tie_word_embeddings=tiny.tie_word_embeddings)
        if tiny.arch != VLM_ARCH:  # the VLM's template renders image parts: its own
            refresh_chat_template(out)
        return str(out)
    path = Path(model_name).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"policy.model_name: {model_name!r} {NOT_A_DIRECTORY}")
    return str(path.resolve())


def refresh_chat_template(model_dir: Path) -> None:
    """A tiny model cached by an older version keeps its weights and vocabulary but gets today's chat template
    (the tools of ``env.<name>.tools`` need it); written atomically, nothing else changes."""
    from services.models.tiny_model import CHAT_TEMPLATE

    path = model_dir / "chat_template.jinja"
    if path.is_file() and path.read_text() != CHAT_TEMPLATE:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(CHAT_TEMPLATE)
        os.replace(tmp, path)


def check_model(model_name: str) -> str:
    """One line on ``policy.model_name`` for ``inflight validate``; ``ValueError`` when the learner cannot train it.

    A ``tiny://`` name is parsed (nothing is built); a local directory's ``config.json`` goes through
    :func:`learner.hf_config.read_hf_architecture`, which names an unsupported field. A name that is no
    local directory here (a hub id, a path on another machine) cannot be checked: the line says that a run
    needs a local HF directory."""
    from learner.hf_config import read_hf_architecture

    if model_name.startswith("tiny://"):
        tiny = parse_tiny(model_name)
        tied = ", tied embeddings" if tiny.tie_word_embeddings else ""
        return f"tiny random {tiny.arch} ({tiny.size}, seed {tiny.seed}{tied}), built on first use"
    path = Path(model_name).expanduser()
    if not (path / "config.json").is_file():
        return (f"not checked: {model_name!r} is not a model directory on this machine (no config.json); a run "
                f"needs a local HF checkpoint directory (hub ids are not downloaded) or tiny://ARCH")
    try:
        return read_hf_architecture(path).describe()
    except ValueError as err:
        raise ValueError(f"policy.model_name: {model_name!r}: {err}") from None
