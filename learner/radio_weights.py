"""Nano-Omni's vision weights: the published checkpoint's names ⇄ :class:`learner.radio_tower.RadioVision`'s.

The published checkpoint (and transformers' ``save_pretrained``, which reverses its conversion mapping) stores the
tower as the original RADIO code names it and the projector as an ``nn.Sequential``; the learner's modules are
transformers' own, named as transformers loads them. The map is transformers' conversion rules of ``radio`` and
``NemotronH_Omni_Reasoning_V3``, both ways:

====================================================  =====================================================
learner (``vision_model.`` / ``multi_modal_projector.``)  published
====================================================  =====================================================
``embeddings.patch_projection``                        ``vision_model.radio_model.model.patch_generator.embedder``
``embeddings.video_patch_projection``                  ``...patch_generator.video_embedder``
``embeddings.position_embedding``                      ``...patch_generator.pos_embed``
``embeddings.cls_register_token``                      ``...patch_generator.cls_token.token``
``encoder.layer.i.attention.{q,k,v}_proj``             ``...blocks.i.attn.qkv`` (its rows: q; k; v)
``encoder.layer.i.attention.o_proj``                   ``...blocks.i.attn.proj`` (blocks: ``...radio_model.model``)
``encoder.layer.i.{norm1,norm2,mlp,layer_scale*}``     ``...blocks.i.`` the same
``summary_idxs`` (a buffer)                            ``vision_model.radio_model.summary_idxs``
``multi_modal_projector.{layer_norm,linear_1,linear_2}``  ``mlp1.{0,1,3}``
====================================================  =====================================================

The tower is replicated on every tensor-parallel rank: its tensors are never split.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

_GEN = "vision_model.radio_model.model.patch_generator."
_RENAMES = (
    ("vision_model.embeddings.video_patch_projection.", _GEN + "video_embedder."),
    ("vision_model.embeddings.patch_projection.", _GEN + "embedder."),
    ("vision_model.embeddings.position_embedding", _GEN + "pos_embed"),
    ("vision_model.embeddings.cls_register_token", _GEN + "cls_token.token"),
    ("vision_model.summary_idxs", "vision_model.radio_model.summary_idxs"),
    ("multi_modal_projector.layer_norm.", "mlp1.0."),
    ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
)
_LAYER = re.compile(r"^vision_model\.encoder\.layer\.(\d+)\.(.+)$")
_QKV = re.compile(r"^attention\.([qkv])_proj\.(weight|bias)$")
PUBLISHED_PREFIXES = ("vision_model.", "mlp1.")
"""The published names of the vision side start with these (the language model's with ``language_model.``)."""


def published_name(name: str) -> tuple[str, int | None]:
    """The published tensor holding learner tensor ``name`` (of :class:`RadioVision`), and which third of its rows
    it is (0, 1, 2 for q, k, v of the fused ``attn.qkv``; None: the whole tensor)."""
    m = _LAYER.match(name)
    if m:
        block, rest = f"vision_model.radio_model.model.blocks.{m.group(1)}.", m.group(2)
        q = _QKV.match(rest)
        if q:
            return f"{block}attn.qkv.{q.group(2)}", "qkv".index(q.group(1))
        if rest.startswith("attention.o_proj."):
            return block + "attn.proj." + rest.removeprefix("attention.o_proj."), None
        return block + rest, None
    for ours, theirs in _RENAMES:
        if name.startswith(ours):
            return theirs + name.removeprefix(ours), None
    raise KeyError(f"no published name for the vision tensor {name}")


def vision_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's checkpoint tensors: its parameters, then its persistent buffers (``summary_idxs``)."""
    yield from module.named_parameters()
    for name, buf in module.named_buffers():
        if name.endswith("summary_idxs"):
            yield name, buf


@torch.no_grad()
def load_radio_weights(module: torch.nn.Module, get: Callable[[str], torch.Tensor]) -> None:
    """Copy the published tensors (``get(name)``) into ``module`` (a :class:`RadioVision`); a shape mismatch is a
    ``ValueError`` naming both tensors."""
    for name, tensor in vision_tensors(module):
        source, third = published_name(name)
        value = get(source)
        if third is not None:
            value = value.chunk(3, dim=0)[third]
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}{'' if third is None else f' (third {third})'}: shape {tuple(value.shape)}, "
                             f"the learner's {name} is {tuple(tensor.shape)}")
        tensor.copy_(value.to(tensor.dtype))


@torch.no_grad()
def export_radio_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s tensors under the published names (``attn.qkv`` fused back), detached copies."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in vision_tensors(module):
        target, third = published_name(name)
        if third is None:
            out[target] = tensor.detach().clone()
        else:
            fused.setdefault(target, [None, None, None])[third] = tensor.detach()
    for target, parts in fused.items():
        if any(p is None for p in parts):
            raise ValueError(f"{target}: the learner holds {sum(p is not None for p in parts)} of q, k, v")
        out[target] = torch.cat([p for p in parts if p is not None])
    return out
