"""Megatron-Core weights → Hugging Face tensors: the way back of :mod:`learner.hf_weights`.

:func:`export_hf_state_dict` is a collective over the TP, EP and PP groups that gathers every parameter, undoes the
fusions and, on global rank 0, returns the source checkpoint's tensors under its names, dtypes and shapes, in its
order; :func:`pack_hf_buckets` cuts them into ``protocol`` weight buckets and :func:`save_hf` writes a loadable HF
directory. The name and layout table: docs/learner.md, "Weight mapping".
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from learner import grouped_experts
from learner.hf_config import HFArchitecture
from learner.hf_weights import (
    DECODER_LAYER,
    HF_EMBED,
    HF_LM_HEAD,
    LOCAL_EXPERT,
    TORCH_DTYPES,
    WEIGHT_FILES,
    HFTensorMeta,
    ParallelLayout,
)
from learner.hybrid_weights import hybrid_tensors_from_shards
from learner.omni_weights import LM_PREFIX, VISUAL, omni_tensors_from_shards, omni_tower_tensors, untrained_tensors
from learner.pipeline_weights import TIED_OUTPUT, gather_from_stages, is_stage_root, stage_weight_tensors
from protocol.messages import WeightBucket, WeightManifest
from protocol.weights import pack_buckets


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that never aliases the parameter (``.cpu()`` of a CPU tensor is the tensor itself)."""
    return t.to("cpu", copy=True)


def _split_qkv(arch: HFArchitecture, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_key_value_heads, arch.head_dim
    rest = fused.shape[1:]
    grouped = fused.reshape(g, -1, *rest)
    q, k, v = torch.split(grouped, [arch.num_attention_heads // g * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_tensors_from_shards(name: str, arch: HFArchitecture, shards: list[torch.Tensor],
                           expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Invert :func:`megatron_shard_from_hf`: TP shards (rank order) of ``name`` → HF tensors.

    For an expert parameter ``shards`` is the single whole tensor and
    ``expert`` its global index."""
    if arch.radio is not None:  # Nano-Omni (learner.omni_weights)
        return omni_tensors_from_shards(name, arch, shards, expert)
    if arch.hybrid is not None:  # Nemotron-H (learner.hybrid_weights)
        return hybrid_tensors_from_shards(name, arch, shards, expert)
    if name.startswith(VISUAL):
        return [(name, shards[0])]
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards))]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    m = DECODER_LAYER.match(name)
    if not m:
        raise KeyError(f"no HF mapping for Megatron parameter {name}")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    simple = {"input_layernorm.weight": "input_layernorm.weight",
              "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
              "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
              "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
              "mlp.router.weight": "mlp.gate.weight"}
    if rest in simple:
        return [(p + simple[rest], shards[0])]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = _split_qkv(arch, torch.cat(shards))
        return [(f"{p}self_attn.q_proj.{kind}", q), (f"{p}self_attn.k_proj.{kind}", k),
                (f"{p}self_attn.v_proj.{kind}", v)]
    if rest == "self_attention.linear_proj.weight":
        return [(p + "self_attn.o_proj.weight", torch.cat(shards, dim=1))]
    if rest == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves])),
                (p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves]))]
    if rest == "mlp.linear_fc2.weight":
        return [(p + "mlp.down_proj.weight", torch.cat(shards, dim=1))]
    em = LOCAL_EXPERT.match(rest)
    if em and expert is not None:
        e = f"{p}mlp.experts.{expert}."
        if em.group(2) == "linear_fc1":
            gate, up = shards[0].chunk(2, dim=0)
            return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
        return [(e + "down_proj.weight", shards[0])]
    raise KeyError(f"no HF mapping for Megatron parameter {name}")


@torch.no_grad()
def export_hf_state_dict(model: torch.nn.Module, arch: HFArchitecture, metas: list[HFTensorMeta],
                         on_device: bool = False, source: str | Path | None = None) -> dict[str, torch.Tensor] | None:
    """Gather ``model`` into HF tensors named, typed and shaped as ``metas`` (in that order).

    Collective: every rank of the TP, EP and PP groups must call it (:mod:`learner.pipeline_weights`). Global rank 0
    gets the state dict, the other ranks get None. By default it is a CPU copy
    (later training does not change it); ``on_device`` leaves the tensors on
    the model's device, where they may be views of the parameters (use them
    before the next optimizer step). A Nano-Omni's tower is exported whole and the tensors it does not hold are read
    from ``source``, the checkpoint it was loaded from (:mod:`learner.omni_weights`)."""
    # a stage root other than rank 0 (PP > 1) sends from the device; rank 0 keeps what it receives as asked
    keep = (lambda t: t) if on_device or dist.get_rank() != 0 else _host_copy
    from megatron.core import parallel_state as ps

    lay = ParallelLayout.current()
    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    is_root = is_stage_root()  # global rank 0, or with PP the rank that sends its stage's tensors to it
    out: dict[str, torch.Tensor] = {}
    device = torch.device("cpu")
    for name, param in stage_weight_tensors(model):  # parameters and weight buffers (a router's expert_bias)
        device = param.device
        if name == TIED_OUTPUT and arch.tie_word_embeddings:
            continue  # with PP, the last stage's copy of the embedding (the first stage exports it)
        if arch.radio is not None and name.startswith(VISUAL):
            continue  # exported whole below
        em = DECODER_LAYER.match(name)
        if em and grouped_experts.GROUPED.match(em.group(2)):  # stacked experts: every EP rank's stack, in order
            stacks = _all_gather(param.detach(), ep_group)
            if is_root:
                experts = grouped_experts.HFExperts.of(arch, int(em.group(1)))
                lm = LM_PREFIX if arch.radio is not None else ""  # a Nano-Omni's language model
                out.update((lm + k, keep(v)) for k, v in grouped_experts.hf_from_whole(em.group(2), experts, stacks))
            continue
        local_expert = LOCAL_EXPERT.match(em.group(2)) if em else None
        if local_expert:
            per_rank = arch.experts_per_rank(lay.ep_size)
            for ep_rank, whole in enumerate(_all_gather(param.detach(), ep_group)):
                expert = ep_rank * per_rank + int(local_expert.group(1))
                if is_root:
                    out.update(hf_tensors_from_shards(name, arch, [keep(whole)], expert))
            continue
        split = getattr(param, "tensor_model_parallel", False) and lay.tp_size > 1
        shards = _all_gather(param.detach(), tp_group) if split else [param.detach()]
        if is_root:
            out.update(hf_tensors_from_shards(name, arch, [keep(s) for s in shards]))
    gathered = gather_from_stages(out if is_root else None, device, keep)
    if gathered is None:
        return None
    out = gathered
    if arch.radio is not None:
        out.update((k, keep(v)) for k, v in omni_tower_tensors(model).items())
        missing = [m.name for m in metas if m.name not in out]
        if missing and source is not None:
            out.update(untrained_tensors(source, missing))
    if arch.tie_word_embeddings and any(m.name == HF_LM_HEAD for m in metas):
        out[HF_LM_HEAD] = out[HF_EMBED].clone()  # the source's tied copy; its own storage (safetensors refuses shared)
    return _match_source(out, metas)


def _match_source(tensors: dict[str, torch.Tensor], metas: list[HFTensorMeta]) -> dict[str, torch.Tensor]:
    want = {m.name for m in metas}
    missing, extra = sorted(want - tensors.keys()), sorted(tensors.keys() - want)
    if missing or extra:
        raise ValueError(f"exported tensors differ from the source checkpoint: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    result: dict[str, torch.Tensor] = {}
    for m in metas:
        t = tensors[m.name]
        if tuple(t.shape) != m.shape:
            raise ValueError(f"exported {m.name}: shape {tuple(t.shape)}, source checkpoint has {m.shape}")
        result[m.name] = t.to(TORCH_DTYPES[m.dtype]).contiguous()
    return result


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def pack_hf_buckets(state: dict[str, torch.Tensor], metas: list[HFTensorMeta], version: int,
                    bucket_bytes: int) -> tuple[WeightManifest, list[WeightBucket]]:
    """Cut an exported HF state dict into weight buckets of at most ``bucket_bytes`` (bf16 as raw bytes)."""
    return pack_buckets(((m.name, m.dtype, m.shape, _raw_bytes(state[m.name])) for m in metas),
                        version=version, bucket_bytes=bucket_bytes)


def save_hf(state: dict[str, torch.Tensor], source_dir: str | Path, out_dir: str | Path) -> None:
    """Write ``state`` as ``model.safetensors`` plus every non-weight file of ``source_dir``
    (config, generation config, tokenizer) into ``out_dir``."""
    from safetensors.torch import save_file

    src, out = Path(source_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
