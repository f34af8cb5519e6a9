"""Nemotron-H weights: HF names ⇄ the :class:`~learner.hybrid_model.HybridModel`'s, per tensor-parallel rank.

:mod:`learner.hf_weights` walks the model and asks :func:`hybrid_shard_from_hf` for each Megatron tensor's value
on this rank, and :func:`hybrid_tensors_from_shards` for the HF tensors of gathered shards. The walk covers
:func:`weight_tensors`: the parameters and the routers' ``expert_bias`` — a **buffer** in Megatron (sigmoid routing
with ``moe_router_enable_expert_bias``) that is HF's ``e_score_correction_bias``; walking parameters alone would
leave it at zero and route every token differently. Layer ``i`` of the HF checkpoint (``backbone.layers.i.``: one
pre-norm ``norm`` and one ``mixer``) maps by its pattern symbol:

- ``M``: ``norm`` → ``norm``; ``mixer.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}`` keep their names;
  TP rank r holds ``in_proj`` rows ``[z_r; x_r; B_r; C_r; dt_r]``, ``conv1d`` channels ``[x_r; B_r; C_r]``, its
  heads of ``dt_bias``/``A_log``/``D``, its channels of the gated norm and its columns of ``out_proj``;
- ``*``: ``norm`` → ``input_layernorm``; ``q/k/v_proj`` → ``self_attention.linear_qkv`` (per KV group, as the
  GPT families); ``o_proj`` → ``self_attention.linear_proj``;
- ``-``: ``norm`` → ``pre_mlp_layernorm``; ``up_proj``/``down_proj`` → ``mlp.linear_fc1``/``linear_fc2``;
- ``E``: ``norm`` → ``pre_mlp_layernorm``; ``gate.weight`` → ``mlp.router.weight``; ``gate.e_score_correction_bias``
  → ``mlp.router.expert_bias``; ``experts.e.{up,down}_proj`` → ``mlp.experts.local_experts.j.linear_fc{1,2}``
  (e = ep_rank·E/EP + j), or with ``moe_grouped_gemm`` → the rank's ``mlp.experts.weight{1,2}`` stacks
  (:mod:`learner.grouped_experts`); ``shared_experts.{up,down}_proj`` → ``mlp.shared_experts.linear_fc{1,2}``.

Embedding ``backbone.embeddings``, final norm ``backbone.norm_f``, ``lm_head``. The table: docs/learner.md.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from learner.hf_config import HFArchitecture
from learner.nemotron_h_config import HybridSpec

PREFIX = "backbone."
"""The published checkpoints' (and ``save_pretrained``'s) prefix of the language model."""
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_BUFFERS = ("mlp.router.expert_bias",)
"""Megatron buffers that are weights of the HF checkpoint."""
_MAMBA_SAME = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias", "mixer.A_log",
               "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight")
_NORM = {"M": "norm.weight", "*": "input_layernorm.weight", "-": "pre_mlp_layernorm.weight",
         "E": "pre_mlp_layernorm.weight"}
_SIMPLE = {  # Megatron suffix → HF suffix (after "mixer."), replicated or split by the caller
    "self_attention.linear_proj.weight": "o_proj.weight", "mlp.linear_fc1.weight": "up_proj.weight",
    "mlp.linear_fc2.weight": "down_proj.weight", "mlp.router.weight": "gate.weight",
    "mlp.router.expert_bias": "gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc1.weight": "shared_experts.up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "shared_experts.down_proj.weight"}
_SPLIT_ROWS = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")
_SPLIT_COLS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight",
               "mixer.out_proj.weight")


def weight_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, then its buffers that are checkpoint weights (the routers' ``expert_bias``)."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name.endswith(_BUFFERS):
            yield name, buf


def _spec(arch: HFArchitecture) -> HybridSpec:
    if arch.hybrid is None:
        raise ValueError(f"model_type {arch.model_type!r} has no hybrid layer pattern")
    return arch.hybrid


def _mamba_pieces(arch: HFArchitecture, rest: str) -> list[int] | None:
    """Sizes of the pieces of a Mamba tensor's dim 0 that TP splits separately (None: one piece)."""
    h = _spec(arch)
    bc = h.n_groups * h.ssm_state_size
    if rest == "mixer.in_proj.weight":
        return [h.mamba_inner_size, h.mamba_inner_size, bc, bc, h.mamba_num_heads]
    if rest.startswith("mixer.conv1d."):
        return [h.mamba_inner_size, bc, bc]
    return None


def _take(t: torch.Tensor, pieces: list[int], parts: int, index: int) -> torch.Tensor:
    """Rank ``index``'s shard of ``t``: the ``index``-th of ``parts`` chunks of every piece, concatenated."""
    out = []
    for piece in torch.split(t, pieces, dim=0):
        if piece.shape[0] % parts:
            raise ValueError(f"cannot split {piece.shape[0]} rows into {parts} tensor-parallel shards")
        out.append(piece.chunk(parts, dim=0)[index])
    return torch.cat(out)


def _join(shards: list[torch.Tensor], pieces: list[int]) -> torch.Tensor:
    """Invert :func:`_take`: per piece, the ranks' chunks in rank order."""
    local = [p // len(shards) for p in pieces]
    split = [torch.split(s, local, dim=0) for s in shards]
    return torch.cat([torch.cat([s[k] for s in split]) for k in range(len(pieces))])


def _chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split a dimension of {t.shape[dim]} into {parts} tensor-parallel shards")
    return t.chunk(parts, dim=dim)[index]


def hybrid_shard_from_hf(name: str, arch: HFArchitecture, hf: Callable[[str], torch.Tensor],
                         tp_size: int, tp_rank: int, ep_rank: int, ep_size: int) -> torch.Tensor:
    """The value of Megatron tensor ``name`` (parameter or weight buffer) on the given TP/EP rank."""
    from learner.grouped_experts import GROUPED, HFExperts, shard_from_hf
    from learner.hf_weights import _qkv_full

    if name == "embedding.word_embeddings.weight":
        return _chunk(hf(PREFIX + "embeddings.weight"), tp_size, tp_rank, 0)
    if name == "output_layer.weight":
        return _chunk(hf("lm_head.weight"), tp_size, tp_rank, 0)
    if name == "decoder.final_norm.weight":
        return hf(PREFIX + "norm_f.weight")
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF mapping for Megatron tensor {name}")
    i, rest = int(m.group(1)), m.group(2)
    symbol, p = _spec(arch).pattern[i], f"{PREFIX}layers.{i}."
    if rest == _NORM[symbol]:
        return hf(p + "norm.weight")
    if symbol == "M" and rest in _MAMBA_SAME:
        t = hf(p + rest)
        pieces = _mamba_pieces(arch, rest)
        if pieces is not None:
            return _take(t, pieces, tp_size, tp_rank)
        return _chunk(t, tp_size, tp_rank, 1 if rest in _SPLIT_COLS else 0)
    if symbol == "*" and rest == "self_attention.linear_qkv.weight":
        full = _qkv_full(arch, *(hf(f"{p}mixer.{x}_proj.weight") for x in "qkv"))
        return _chunk(full, tp_size, tp_rank, 0).reshape(-1, full.shape[2])
    if rest in _SIMPLE:
        t = hf(p + "mixer." + _SIMPLE[rest])
        if rest in _SPLIT_ROWS:
            return _chunk(t, tp_size, tp_rank, 0)
        return _chunk(t, tp_size, tp_rank, 1) if rest in _SPLIT_COLS else t
    if symbol == "E" and GROUPED.match(rest):  # policy.megatron_cfg.moe_grouped_gemm: the rank's experts stacked
        per_rank = arch.experts_per_rank(ep_size)
        return shard_from_hf(rest, HFExperts.of(arch, i), hf, ep_rank * per_rank, per_rank)
    em = _EXPERT.match(rest)
    if symbol == "E" and em:
        expert = ep_rank * arch.experts_per_rank(ep_size) + int(em.group(1))
        return hf(f"{p}mixer.experts.{expert}.{'up' if em.group(2) == '1' else 'down'}_proj.weight")
    raise KeyError(f"no HF mapping for Megatron tensor {name} (layer {i} is {symbol!r})")


def hybrid_tensors_from_shards(name: str, arch: HFArchitecture, shards: list[torch.Tensor],
                               expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Invert :func:`hybrid_shard_from_hf`: the TP shards of ``name`` (rank order; one whole tensor for a
    replicated one or an expert, ``expert`` its global index) → HF ``(name, tensor)`` pairs."""
    from learner.hf_export import _split_qkv

    if name == "embedding.word_embeddings.weight":
        return [(PREFIX + "embeddings.weight", torch.cat(shards))]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards))]
    if name == "decoder.final_norm.weight":
        return [(PREFIX + "norm_f.weight", shards[0])]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF mapping for Megatron tensor {name}")
    i, rest = int(m.group(1)), m.group(2)
    symbol, p = _spec(arch).pattern[i], f"{PREFIX}layers.{i}."
    if rest == _NORM[symbol]:
        return [(p + "norm.weight", shards[0])]
    if symbol == "M" and rest in _MAMBA_SAME:
        pieces = _mamba_pieces(arch, rest)
        if pieces is not None:
            return [(p + rest, _join(shards, pieces))]
        return [(p + rest, torch.cat(shards, dim=1 if rest in _SPLIT_COLS else 0))]
    if symbol == "*" and rest == "self_attention.linear_qkv.weight":
        q, k, v = _split_qkv(arch, torch.cat(shards))
        return [(f"{p}mixer.q_proj.weight", q), (f"{p}mixer.k_proj.weight", k), (f"{p}mixer.v_proj.weight", v)]
    if rest in _SIMPLE:
        dim = 1 if rest in _SPLIT_COLS else 0
        return [(p + "mixer." + _SIMPLE[rest], torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0])]
    em = _EXPERT.match(rest)
    if em and expert is not None:
        return [(f"{p}mixer.experts.{expert}.{'up' if em.group(2) == '1' else 'down'}_proj.weight", shards[0])]
    raise KeyError(f"no HF mapping for Megatron tensor {name} (layer {i} is {symbol!r})")
