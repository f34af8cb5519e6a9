"""Hugging Face safetensors → Megatron-Core ``GPTModel`` (local spec) weights; the way back: :mod:`learner.hf_export`.

Import (:func:`load_hf_weights`): every Megatron parameter of this rank is built
from the HF tensors it covers, already sliced for its tensor- and
expert-parallel rank (``linear_qkv`` fused per query group, ``linear_fc1`` as
``[gate_r; up_r]``, experts whole on one EP rank).

Export (:func:`learner.hf_export.export_hf_state_dict`): a collective over the TP and EP groups
that gathers every parameter, undoes the fusions and, on global rank 0, returns
the source checkpoint's names, dtypes and shapes (:class:`HFTensorMeta`) in its
order (with tied embeddings, ``lm_head.weight`` is the embedding again when
the source had one). A vision-language model's tower (:mod:`learner.vision`) is the Megatron model's
submodule ``visual``: its parameters carry the checkpoint's own names (``visual.*``), whole on every rank,
both ways. Export's :func:`~learner.hf_export.pack_hf_buckets` cuts them into ``protocol`` weight buckets and
:func:`~learner.hf_export.save_hf` writes a loadable HF directory. The name and layout table:
docs/learner.md, "Weight mapping".
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from learner import grouped_experts
from learner.hf_config import HFArchitecture
from learner.hybrid_weights import hybrid_shard_from_hf
from learner.omni_weights import VISUAL, load_tower_buffers, omni_shard_from_hf
from learner.pipeline_weights import TIED_OUTPUT, stage_weight_tensors

ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64, "int64": torch.int64}
DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
HF_EMBED, HF_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")


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
                dtype = ST_DTYPES.get(sl.get_dtype())
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
        return grouped_experts.shard_from_hf(rest, grouped_experts.HFExperts.of(arch, layer), hf,
                                             lay.ep_rank * per_rank, per_rank)
    m = LOCAL_EXPERT.match(rest)
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
    if arch.radio is not None:  # Nano-Omni (learner.omni_weights)
        return omni_shard_from_hf(name, hf, arch, lay.tp_size, lay.tp_rank, lay.ep_rank, lay.ep_size)
    if arch.hybrid is not None:  # Nemotron-H (learner.hybrid_weights)
        return hybrid_shard_from_hf(name, arch, hf, lay.tp_size, lay.tp_rank, lay.ep_rank, lay.ep_size)
    if name.startswith(VISUAL):
        return hf(name)
    if name == "embedding.word_embeddings.weight":
        return _chunk(hf("model.embed_tokens.weight"), lay.tp_size, lay.tp_rank, 0)
    if name == "output_layer.weight":
        return _chunk(hf("lm_head.weight"), lay.tp_size, lay.tp_rank, 0)
    if name == "decoder.final_layernorm.weight":
        return hf("model.norm.weight")
    m = DECODER_LAYER.match(name)
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
    if arch.radio is not None:
        load_tower_buffers(model, ckpt.get)
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
    if HF_LM_HEAD in names and not torch.equal(ckpt.get(HF_LM_HEAD), ckpt.get(HF_EMBED)):
        raise ValueError(f"{ckpt.path}: tie_word_embeddings is true but {HF_LM_HEAD} differs from {HF_EMBED}; "
                         f"set tie_word_embeddings to false in config.json or drop {HF_LM_HEAD}")
