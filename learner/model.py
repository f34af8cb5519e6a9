"""Build a Megatron-Core ``GPTModel`` from a Hugging Face ``config.json``.

Supported: ``qwen2``, ``llama`` and ``qwen3_moe`` (local layer spec, no
Transformer Engine). The HF fields are read into :class:`HFArchitecture`,
turned into a ``TransformerConfig`` that honours
:class:`~learner.config.MegatronConfig` (TP/EP, recompute, precision; dropout 0
and every fusion off, so CPU and GPU run the same semantics), and the model is
built on the current device.

:func:`init_distributed` sets up ``torch.distributed`` (gloo on CPU, NCCL on
GPU) and Megatron's parallel state once per process. The field-by-field mapping:
docs/learner.md, "Model building".
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import torch
import torch.distributed as dist

from learner.config import MegatronConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3_moe")
DIST_INIT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class HFArchitecture:
    """The fields of an HF ``config.json`` this learner needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int | None = None
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def experts_per_rank(self, ep_size: int) -> int:
        """Experts held whole by one of ``ep_size`` expert-parallel ranks (MoE architectures only)."""
        if self.num_experts is None:
            raise ValueError(f"model_type {self.model_type!r} is dense: it has no experts to place")
        return self.num_experts // ep_size


def read_hf_architecture(model_path: str | os.PathLike) -> HFArchitecture:
    """Parse ``<model_path>/config.json`` into an :class:`HFArchitecture`."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path: expected an HF model directory with config.json, got {model_path}")
    cfg = json.loads(path.read_text())
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {mtype!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act: expected 'silu', got {cfg['hidden_act']!r}")
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ValueError(f"config.json rope: only unscaled RoPE is supported, got {rope or cfg.get('rope_scaling')}")
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window: sliding-window attention is not supported")
    moe: dict = {}
    if mtype == "qwen3_moe":
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ValueError("config.json mlp_only_layers/decoder_sparse_step: only all-MoE layers are supported")
        moe = dict(num_experts=experts, moe_top_k=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    qkv_bias = True if mtype == "qwen2" else bool(cfg.get("attention_bias", False))
    return HFArchitecture(
        model_type=mtype, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=mtype == "qwen3_moe", **moe)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(megatron: MegatronConfig, seed: int) -> None:
    """Initialise torch.distributed and Megatron's parallel state once per process.

    Uses RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment when set
    (one process per rank, e.g. Ray actors); otherwise a single-process world
    on a free local port. gloo on CPU, NCCL on GPU."""
    from megatron.core import parallel_state, tensor_parallel

    from learner.cpu_compat import apply_if_no_gpu, has_gpu

    apply_if_no_gpu()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if has_gpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if has_gpu() else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=DIST_INIT_TIMEOUT_S))
    tp, ep = megatron.tensor_model_parallel_size, megatron.expert_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, ep):
            raise RuntimeError(f"Megatron parallel state already initialised with (TP, EP) = {have}, "
                               f"the learner asks for {(tp, ep)}")
    else:
        world = dist.get_world_size()
        if world % tp or world % ep:
            raise ValueError(f"world size {world} must be divisible by tensor_model_parallel_size={tp} "
                             f"and expert_model_parallel_size={ep}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    """Tear down Megatron's parallel state and the process group (end of the learner process)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class _RecomputeOptions(TypedDict, total=False):
    recompute_granularity: Literal["full", "selective"]
    recompute_method: Literal["uniform", "block"]
    recompute_num_layers: int


class _MoEOptions(TypedDict, total=False):
    num_moe_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_router_pre_softmax: bool
    moe_router_score_function: Literal["softmax", "sigmoid"]
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"]
    moe_grouped_gemm: bool
    moe_permute_fusion: bool
    moe_router_dtype: Literal["fp32", "fp64"]


def _recompute_options(megatron: MegatronConfig) -> _RecomputeOptions:
    """Full-layer activation recompute when ``activation_checkpointing`` is on; Megatron's defaults otherwise."""
    if not megatron.activation_checkpointing:
        return {}
    return _RecomputeOptions(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _moe_options(arch: HFArchitecture, megatron: MegatronConfig) -> _MoEOptions:
    """The mixture-of-experts fields for an MoE ``arch``; nothing (Megatron's dense defaults) otherwise."""
    if arch.num_experts is None:
        return {}
    ep = megatron.expert_model_parallel_size
    if arch.num_experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide num_experts={arch.num_experts}")
    # norm_topk_prob: softmax over the top-k logits == softmax, top-k, renormalise (HF).
    return _MoEOptions(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_pre_softmax=not arch.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        # alltoall (faster at large EP) allocates CUDA streams; allgather runs anywhere.
        moe_token_dispatcher_type="alltoall" if ep > 1 and torch.cuda.is_available() else "allgather",
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_dtype="fp32")


def transformer_config(arch: HFArchitecture, megatron: MegatronConfig) -> TransformerConfig:
    """The ``TransformerConfig`` for ``arch`` under the parallel/precision settings of ``megatron``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = megatron.precision == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    tp = megatron.tensor_model_parallel_size
    if arch.num_key_value_heads % tp or arch.num_attention_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads="
                         f"{arch.num_attention_heads} and num_key_value_heads={arch.num_key_value_heads}")
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size, normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        expert_model_parallel_size=megatron.expert_model_parallel_size, expert_tensor_parallel_size=1,
        sequence_parallel=False, calculate_per_token_loss=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        **_recompute_options(megatron), **_moe_options(arch, megatron),
    )


def define_missing_te_symbols() -> None:
    """Megatron-Core 0.16.1's router GEMM reads ``moe_utils.te_general_gemm``, which is only
    defined when Transformer Engine imports (a NameError otherwise, CPU or GPU). Define it as
    None — the value Megatron itself tests for — so the plain ``torch.mm`` path runs. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(arch: HFArchitecture, megatron: MegatronConfig) -> tuple[GPTModel, TransformerConfig]:
    """A Megatron ``GPTModel`` (random init) for ``arch``; weights come from :mod:`learner.hf_weights`.

    Returns ``(model, config)``. In bf16 the caller wraps it in ``Float16Module``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(arch, megatron)
    if arch.is_moe:
        define_missing_te_symbols()
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
                     max_sequence_length=arch.max_position_embeddings, pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=int(arch.rope_theta))
    if torch.cuda.is_available():
        model = model.cuda()
    return model, config
