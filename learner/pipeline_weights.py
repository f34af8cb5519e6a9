"""A pipeline stage's weights under the whole model's names, and an export gathered from every stage.

With ``pipeline_model_parallel_size`` P > 1 stage s builds layers ``s·L/P … (s+1)·L/P − 1`` of the model but
Megatron names them ``decoder.layers.0 …`` on every stage; :func:`stage_weight_tensors` gives them their global
index (``layer_number − 1``), so that :mod:`learner.hf_weights` maps them to the checkpoint's ``model.layers.i``
both ways. With tied embeddings the last stage also holds ``output_layer.weight``, a copy of the first stage's
embedding that Megatron keeps equal (its gradient is summed with the embedding's): it is loaded from the
embedding and never exported. :func:`gather_from_stages` sends each stage's exported HF tensors from the stage's
root (tensor- and data-parallel rank 0: the ranks of global rank 0's pipeline group) to global rank 0, tensor by
tensor on the model's device (NCCL on GPU, gloo on CPU).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.distributed as dist

from learner.hybrid_weights import weight_tensors
from learner.pipeline import pipeline_group

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
"""The last stage's copy of the embedding when embeddings are tied and P > 1."""


def _stages() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_world_size()


def stage_weight_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`learner.hybrid_weights.weight_tensors` of this stage's ``model`` (the bare GPTModel), its layers
    named by their index in the whole model."""
    if _stages() == 1:
        yield from weight_tensors(model)
        return
    layers = cast(torch.nn.ModuleList, model.get_submodule("decoder.layers"))
    numbers = [int(cast(int, layer.layer_number)) - 1 for layer in layers]  # global, 0-based

    def rename(m: re.Match) -> str:
        return f"decoder.layers.{numbers[int(m.group(1))]}."

    for name, tensor in weight_tensors(model):
        yield _LOCAL_LAYER.sub(rename, name), tensor


def is_stage_root() -> bool:
    """Whether this rank collects its stage's export (tensor- and data-parallel rank 0; global rank 0 with P = 1)."""
    from megatron.core import parallel_state as ps
    if _stages() == 1:
        return dist.get_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def gather_from_stages(out: dict[str, torch.Tensor] | None, device: torch.device,
                       keep: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """On global rank 0: its own ``out`` and every other stage root's, received on ``device`` and passed through
    ``keep``; None elsewhere. ``out``: this stage's HF tensors on a stage root, None on the other ranks.
    Collective over global rank 0's pipeline group (the stage roots); the other ranks return at once."""
    if _stages() == 1:
        return out if dist.get_rank() == 0 else None
    if not is_stage_root():
        return None
    from megatron.core import parallel_state as ps

    group = pipeline_group()
    me, stages = ps.get_pipeline_model_parallel_rank(), _stages()
    mine = out if out is not None else {}
    if me == 0:
        merged = dict(mine)
        for stage in range(1, stages):
            src = dist.get_global_rank(group, stage)
            listing: list = [None]
            dist.recv_object_list(listing, src=src, group=group, device=device if device.type == "cuda" else None)
            for name, shape, dtype in listing[0]:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src=src, group=group)
                merged[name] = keep(t)
        return merged
    dst = dist.get_global_rank(group, 0)
    listing = [[(name, tuple(t.shape), t.dtype) for name, t in mine.items()]]
    dist.send_object_list(listing, dst=dst, group=group, device=device if device.type == "cuda" else None)
    for t in mine.values():
        dist.send(t.to(device).contiguous(), dst=dst, group=group)
    return None
