"""Hugging Face safetensors ⇄ Megatron-Core ``GPTModel`` (local spec) weights.

Import (:func:`load_hf_weights`): every Megatron parameter of this rank is built
from the HF tensors it covers, already sliced for its tensor- and
expert-parallel rank (``linear_qkv`` fused per query group, ``linear_fc1`` as
``[gate_r; up_r]``, experts whole on one EP rank).

Export (:func:`export_hf_state_dict`): a collective over the TP and EP groups
that gathers every parameter, undoes the fusions and, on global rank 0, returns
the source checkpoint's names, dtypes and shapes (:class:`HFTensorMeta`) in its
order (with tied embeddings, ``lm_head.weight`` is the embedding again when
the source had one). A vision-language model's tower (:mod:`learner.vision`) is the Megatron model's
submodule ``visual``: its parameters carry the checkpoint's own names (``visual.*``), whole on every rank,
both ways. :func:`pack_hf_buckets` cuts them into ``protocol`` weight buckets;
:func:`save_hf` writes a loadable HF directory. The name and layout table:
docs/learner.md, "Weight mapping".
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from learner import grouped_experts
from learner.hf_config import HFArchitecture
from learner.hybrid_weights import hybrid_shard_from_hf, hybrid_tensors_from_shards
from learner.pipeline_weights import TIED_OUTPUT, gather_from_stages, is_stage_root, stage_weight_tensors
from protocol.messages import WeightBucket, WeightManifest
from protocol.weights import pack_buckets

_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_VISUAL = "visual."
"""The vision tower's prefix: the same in the published checkpoints and in the Megatron model."""
_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HFTensorMeta:
    """Name, dtype string and shape of one tensor of the source HF checkpoint."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the tensor- and expert-parallel groups."""

    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int

    @classmethod
    def current(cls) -> ParallelLayout:
        from megatron.core import parallel_state as ps
        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def _safetensors_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / s for s in shards]
    single = model_path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"model_path: no model.safetensors(.index.json) in {model_path}")
    return [single]


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded)."""

    def __init__(self, model_path: str | Path):
        from safetensors import safe_open

        self.path = Path(model_path)
        self._handles = [safe_open(str(f), framework="pt") for f in _safetensors_files(self.path)]
        self._where: dict[str, int] = {}
        metas: list[HFTensorMeta] = []
        for i, h in enumerate(self._handles):
            for name in h.keys():
                sl = h.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                self._where[name] = i
                metas.append(HFTensorMeta(name, dtype, tuple(int(s) for s in sl.get_shape())))
        self.metas = metas

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path}: HF checkpoint has no tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)


# ----------------------------------------------------------------------------- import

def _qkv_full(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Interleave q/k/v (weights [out, in] or biases [out]) per query group: [G, (h/G + 2)·d, ...]."""
    g, d = arch.num_key_value_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, arch.num_attention_heads // g * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1)


def _chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split a dimension of {t.shape[dim]} into {parts} tensor-parallel shards")
    return t.chunk(parts, dim=dim)[index]


def _layer_shard(arch: HFArchitecture, layer: int, rest: str, hf: Callable[[str], torch.Tensor],
                 lay: ParallelLayout) -> torch.Tensor:
    p = f"model.layers.{layer}."
    tp, r = lay.tp_size, lay.tp_rank
    if rest in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        return hf(p + ("input_layernorm.weight" if rest.startswith("input") else "post_attention_layernorm.weight"))
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        full = _qkv_full(arch, *(hf(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"))
        return _chunk(full, tp, r, 0).reshape(-1, *full.shape[2:])
    if rest == "self_attention.q_layernorm.weight":
        return hf(p + "self_attn.q_norm.weight")
    if rest == "self_attention.k_layernorm.weight":
        return hf(p + "self_attn.k_norm.weight")
    if rest == "self_attention.linear_proj.weight":
        return _chunk(hf(p + "self_attn.o_proj.weight"), tp, r, 1)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([_chunk(hf(p + "mlp.gate_proj.weight"), tp, r, 0),
                          _chunk(hf(p + "mlp.up_proj.weight"), tp, r, 0)])
    if rest == "mlp.linear_fc2.weight":
        return _chunk(hf(p + "mlp.down_proj.weight"), tp, r, 1)
    if rest == "mlp.router.weight":
        return hf(p + "mlp.gate.weight")
    if grouped_experts.GROUPED.match(rest):  # policy.megatron_cfg.moe_grouped_gemm: the rank's experts stacked
        per_rank = arch.experts_per_rank(lay.ep_size)
        return grouped_experts.shard_from_hf(rest, p, hf, lay.ep_rank * per_rank, per_rank)
    m = _EXPERT.match(rest)
    if m:
        expert = lay.ep_rank * arch.experts_per_rank(lay.ep_size) + int(m.group(1))
        e = f"{p}mlp.experts.{expert}."
        if m.group(2) == "linear_fc1":
            return torch.cat([hf(e + "gate_proj.weight"), hf(e + "up_proj.weight")])
        return hf(e + "down_proj.weight")
    raise KeyError(f"no HF mapping for Megatron parameter decoder.layers.{layer}.{rest}")


def megatron_shard_from_hf(name: str, arch: HFArchitecture, hf: Callable[[str], torch.Tensor],
                           lay: ParallelLayout) -> torch.Tensor:
    """The value of Megatron parameter ``name`` on the rank described by ``lay``."""
    if arch.hybrid is not None:  # Nemotron-H (learner.hybrid_weights)
        return hybrid_shard_from_hf(name, arch, hf, lay.tp_size, lay.tp_rank, lay.ep_rank, lay.ep_size)
    if name.startswith(_VISUAL):
        return hf(name)
    if name == "embedding.word_embeddings.weight":
        return _chunk(hf("model.embed_tokens.weight"), lay.tp_size, lay.tp_rank, 0)
    if name == "output_layer.weight":
        return _chunk(hf("lm_head.weight"), lay.tp_size, lay.tp_rank, 0)
    if name == "decoder.final_layernorm.weight":
        return hf("model.norm.weight")
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF mapping for Megatron parameter {name}")
    return _layer_shard(arch, int(m.group(1)), m.group(2), hf, lay)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, arch: HFArchitecture, model_path: str | Path) -> list[HFTensorMeta]:
    """Copy the HF checkpoint at ``model_path`` into ``model`` (the bare ``GPTModel``) on this rank.

    Returns the source checkpoint's tensor list (names, dtypes, shapes), which
    export reproduces."""
    ckpt = HFCheckpoint(model_path)
    if arch.vision is not None:
        _check_vision_layout(ckpt)
    if arch.tie_word_embeddings:
        _check_tied_output(ckpt)
    lay = ParallelLayout.current()
    for name, param in stage_weight_tensors(model):  # parameters and weight buffers (a router's expert_bias)
        # tied embeddings with PP: the last stage's output layer is a copy of the embedding
        source = "embedding.word_embeddings.weight" if name == TIED_OUTPUT and arch.tie_word_embeddings else name
        value = megatron_shard_from_hf(source, arch, ckpt.get, lay)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: HF tensors give shape {tuple(value.shape)}, "
                             f"Megatron expects {tuple(param.shape)}")
        param.copy_(value.to(param.device))
    return ckpt.metas


def _check_vision_layout(ckpt: HFCheckpoint) -> None:
    """A vision-language checkpoint must be in the published layout (``model.layers.*``, ``visual.*``), which
    ``save_pretrained`` writes; transformers' in-memory names (``model.language_model.*``) are refused."""
    inner = [m.name for m in ckpt.metas if m.name.startswith(("model.language_model.", "model.visual."))]
    if inner:
        raise ValueError(f"{ckpt.path}: tensor {inner[0]!r} is in transformers' in-memory layout; expected the "
                         f"published one (model.layers.*, visual.*, lm_head.weight) that save_pretrained writes")


def _check_tied_output(ckpt: HFCheckpoint) -> None:
    """With ``tie_word_embeddings`` the output layer is the embedding (Megatron has no ``output_layer.weight``):
    a checkpoint may still carry ``lm_head.weight``, and then it must equal the embedding (transformers and vLLM
    ignore it; export writes the embedding back under that name)."""
    names = {m.name for m in ckpt.metas}
    if _LM_HEAD in names and not torch.equal(ckpt.get(_LM_HEAD), ckpt.get(_EMBED)):
        raise ValueError(f"{ckpt.path}: tie_word_embeddings is true but {_LM_HEAD} differs from {_EMBED}; "
                         f"set tie_word_embeddings to false in config.json or drop {_LM_HEAD}")


# ----------------------------------------------------------------------------- export

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
    if arch.hybrid is not None:  # Nemotron-H (learner.hybrid_weights)
        return hybrid_tensors_from_shards(name, arch, shards, expert)
    if name.startswith(_VISUAL):
        return [(name, shards[0])]
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards))]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    m = _LAYER.match(name)
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
    em = _EXPERT.match(rest)
    if em and expert is not None:
        e = f"{p}mlp.experts.{expert}."
        if em.group(2) == "linear_fc1":
            gate, up = shards[0].chunk(2, dim=0)
            return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
        return [(e + "down_proj.weight", shards[0])]
    raise KeyError(f"no HF mapping for Megatron parameter {name}")


@torch.no_grad()
def export_hf_state_dict(model: torch.nn.Module, arch: HFArchitecture,
                         metas: list[HFTensorMeta], on_device: bool = False) -> dict[str, torch.Tensor] | None:
    """Gather ``model`` into HF tensors named, typed and shaped as ``metas`` (in that order).

    Collective: every rank of the TP, EP and PP groups must call it (:mod:`learner.pipeline_weights`). Global rank 0
    gets the state dict, the other ranks get None. By default it is a CPU copy
    (later training does not change it); ``on_device`` leaves the tensors on
    the model's device, where they may be views of the parameters (use them
    before the next optimizer step)."""
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
        em = _LAYER.match(name)
        if em and grouped_experts.GROUPED.match(em.group(2)):  # stacked experts: every EP rank's stack, in order
            stacks = _all_gather(param.detach(), ep_group)
            if is_root:
                out.update((k, keep(v)) for k, v in grouped_experts.hf_from_whole(
                    em.group(2), f"model.layers.{em.group(1)}.", stacks))
            continue
        local_expert = _EXPERT.match(em.group(2)) if em else None
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
    if arch.tie_word_embeddings and any(m.name == _LM_HEAD for m in metas):
        out[_LM_HEAD] = out[_EMBED].clone()  # the source's tied copy; its own storage (safetensors refuses shared)
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
        result[m.name] = t.to(_TORCH_DTYPES[m.dtype]).contiguous()
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
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
