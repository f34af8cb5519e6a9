"""Nano-Omni's published checkpoint ⇄ the learner's :class:`~learner.omni_model.OmniHybridModel`, for
:mod:`learner.hf_weights`' import and export.

The language model's tensors are Nemotron-H's under ``language_model.`` (:mod:`learner.hybrid_weights`, split for
tensor and expert parallelism as there); the vision side's are RADIO's published names (:mod:`learner.radio_weights`:
``attn.qkv`` is fused on the checkpoint's side, one third per learner tensor on import), whole on every rank. On
export the tower is taken from the model whole (its q, k, v fused back) rather than per parameter. Tensors the
learner does not hold (the Parakeet audio tower of a published checkpoint, which Inflight does not train or run)
are read back from the source checkpoint unchanged, so that a push still holds every tensor the engine loads.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from learner.hf_config import HFArchitecture
from learner.hybrid_weights import hybrid_shard_from_hf, hybrid_tensors_from_shards
from learner.radio_weights import export_radio_weights, published_name, vision_tensors

LM_PREFIX = "language_model."
"""The published checkpoint's prefix of the language model's tensors."""
VISUAL = "visual."
"""The vision tower's prefix in the learner (the model's submodule ``visual``); Qwen2.5-VL's published checkpoints
use it too."""


def omni_shard_from_hf(name: str, hf: Callable[[str], torch.Tensor], arch: HFArchitecture, tp_size: int,
                       tp_rank: int, ep_rank: int, ep_size: int) -> torch.Tensor:
    """The value of the learner's tensor ``name`` on the given TP/EP rank, from the published tensors ``hf``."""
    if name.startswith(VISUAL):
        source, third = published_name(name.removeprefix(VISUAL))
        value = hf(source)
        return value if third is None else value.chunk(3, dim=0)[third]
    return hybrid_shard_from_hf(name, arch, lambda n: hf(LM_PREFIX + n), tp_size, tp_rank, ep_rank, ep_size)


def omni_tensors_from_shards(name: str, arch: HFArchitecture, shards: list[torch.Tensor],
                             expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """The published language-model tensors of the learner's ``name`` (its TP shards in rank order); the vision
    side is exported whole by :func:`omni_tower_tensors`."""
    if name.startswith(VISUAL):
        raise ValueError(f"{name}: the vision tower is exported whole (omni_tower_tensors), not per parameter")
    return [(LM_PREFIX + n, t) for n, t in hybrid_tensors_from_shards(name, arch, shards, expert)]


@torch.no_grad()
def load_tower_buffers(model: torch.nn.Module, hf: Callable[[str], torch.Tensor]) -> None:
    """Copy the tower's checkpoint buffers (RADIO's ``summary_idxs``), which are not parameters."""
    for name, buf in vision_tensors(model.get_submodule("visual")):
        if name not in dict(model.get_submodule("visual").named_parameters()):
            buf.copy_(hf(published_name(name)[0]))


def omni_tower_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The vision side under its published names, whole (it is replicated on every rank)."""
    return export_radio_weights(model.get_submodule("visual"))


def untrained_tensors(source: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the source checkpoint as they are (tensors the learner does not hold); a missing
    language-model or vision tensor is an error: those the learner must have produced."""
    from learner.hf_weights import HFCheckpoint

    ours = [n for n in names if n.startswith((LM_PREFIX, "vision_model.", "mlp1."))]
    if ours:
        raise ValueError(f"exported tensors differ from the source checkpoint: the learner produced no {ours[:5]}")
    ckpt = HFCheckpoint(source)
    return {n: ckpt.get(n) for n in names}
