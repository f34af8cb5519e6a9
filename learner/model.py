"""Build a Megatron-Core ``GPTModel`` from a Hugging Face ``config.json``.

The HF fields are read into :class:`HFArchitecture` by :mod:`learner.hf_config`
(the supported families are listed there), turned into a ``TransformerConfig`` that honours
:class:`~learner.config.MegatronConfig` (TP/EP, recompute, precision; dropout 0
and every fusion off but SwiGLU's on a GPU, so CPU and GPU run the same math), and the model is
built on the current device (local layer spec, no Transformer Engine, core attention from
:mod:`learner.attention`: packed rows by their boundaries, no mask); Llama-3 RoPE
scaling takes all four of the config's values (:func:`_set_llama3_frequencies`). A vision-language
checkpoint gets a :class:`learner.vision.VisionLanguageGPT`: the same language model with multimodal
rotary positions (``position_embedding_type="mrope"``) and the checkpoint's vision tower inside.

:func:`init_distributed` sets up ``torch.distributed`` (gloo on CPU, NCCL on
GPU) and Megatron's parallel state once per process, and caps the rank's CUDA memory when the recipe
gives it a budget (:func:`limit_gpu_memory`). The field-by-field mapping:
docs/learner.md, "Model building".
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import torch
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # pyright: ignore[reportPrivateImportUsage] -- public API

from learner.config import MegatronConfig
from learner.hf_config import HFArchitecture, Llama3RopeScaling
from learner.hf_config import read_hf_architecture as read_hf_architecture  # re-exported for the trainer

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

DIST_INIT_TIMEOUT_S = 300.0


def open_rendezvous_store(world_size: int) -> TCPStore:
    """Rank 0's rendezvous store, listening at once on a port the OS picks (``.port``): held open from the moment
    the port is chosen, so no other process can take it before the ranks meet (a port found free and closed
    again could be: EADDRINUSE under load)."""
    return TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timedelta(seconds=DIST_INIT_TIMEOUT_S),
                    wait_for_workers=False)


def join_process_group(store: Store | None = None) -> None:
    """Join ``torch.distributed`` once per process (gloo on CPU, NCCL on GPU) as rank RANK of WORLD_SIZE (a
    single-process world without them). The ranks meet at ``store`` (rank 0's, from :func:`open_rendezvous_store`),
    else at MASTER_ADDR/MASTER_PORT (the other ranks), else, alone, at a store of its own."""
    from learner.cpu_compat import has_gpu

    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if store is None and "MASTER_PORT" in os.environ:  # every rank then passes a store: torch prefixes only its own
        store = TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0, timeout=timedelta(seconds=DIST_INIT_TIMEOUT_S), wait_for_workers=False)
    elif store is None:
        store = open_rendezvous_store(world)
    if has_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if has_gpu() else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DIST_INIT_TIMEOUT_S), store=store)


def init_distributed(megatron: MegatronConfig, seed: int) -> None:
    """Initialise torch.distributed (:func:`join_process_group`, unless the process has joined already) and
    Megatron's parallel state once per process."""
    from megatron.core import parallel_state, tensor_parallel

    from learner.cpu_compat import apply_if_no_gpu

    apply_if_no_gpu()
    join_process_group()
    limit_gpu_memory(megatron)  # before the first allocation of the model
    tp, ep = megatron.tensor_model_parallel_size, megatron.expert_model_parallel_size
    pp = megatron.pipeline_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"Megatron parallel state already initialised with (TP, PP, EP) = {have}, "
                               f"the learner asks for {(tp, pp, ep)}")
    else:
        world = dist.get_world_size()
        if world % (tp * pp) or (world // pp) % ep:
            raise ValueError(f"world size {world} must be divisible by tensor_model_parallel_size={tp} x "
                             f"pipeline_model_parallel_size={pp}, and world / PP by expert_model_parallel_size={ep}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def limit_gpu_memory(megatron: MegatronConfig) -> None:
    """Cap this rank's CUDA caching allocator at ``megatron.gpu_memory_fraction`` of its current device (the
    learner's memory budget beside an engine on the same GPU, ``rollout_pool.share_gpu``); no-op without a
    cap or a GPU."""
    from learner.cpu_compat import has_gpu

    if megatron.gpu_memory_fraction is None or not has_gpu():
        return
    torch.cuda.set_per_process_memory_fraction(megatron.gpu_memory_fraction, torch.cuda.current_device())


def shutdown_distributed() -> None:
    """Tear down Megatron's parallel state and the process group (end of the learner process)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def any_nonfinite_grad(model: Any, device: torch.device) -> bool:
    """Whether any rank's gradient buffers of the DDP-wrapped ``model`` hold a NaN or inf (collective)."""
    bad = torch.zeros(1, device=device)
    # DDP's `buffers` list shadows nn.Module.buffers()
    for buf in model.buffers + model.expert_parallel_buffers:
        if not torch.isfinite(buf.grad_data).all():
            bad.fill_(1.0)
            break
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


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
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if arch.num_key_value_heads % tp or arch.num_attention_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads="
                         f"{arch.num_attention_heads} and num_key_value_heads={arch.num_key_value_heads}")
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} must divide the model's num_hidden_layers "
                         f"({arch.num_layers}): every stage holds as many layers")
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size, normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=megatron.expert_model_parallel_size, expert_tensor_parallel_size=1,
        sequence_parallel=False, calculate_per_token_loss=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, use_cpu_initialization=True,
        bias_activation_fusion=megatron.bias_activation_fusion and torch.cuda.is_available(),
        bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        mrope_section=list(arch.mrope_section) if arch.mrope_section else None,
        **_recompute_options(megatron), **_moe_options(arch, megatron),
    )
    # PP: stages send each packed row's shape before it (rows differ in length). Set after the checks: Megatron
    # refuses it with the allgather dispatcher (even for a dense model), whose EP ranks must see equal shapes:
    # the learner pads every EP round to equal shapes anyway (learner.packing.deal)
    config.variable_seq_lengths = pp > 1
    return config


def define_missing_te_symbols() -> None:
    """Megatron-Core 0.16.1's router GEMM reads ``moe_utils.te_general_gemm``, which is only
    defined when Transformer Engine imports (a NameError otherwise, CPU or GPU). Define it as
    None — the value Megatron itself tests for — so the plain ``torch.mm`` path runs. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _set_llama3_frequencies(model: GPTModel, arch: HFArchitecture, scaling: Llama3RopeScaling) -> None:
    """Give ``model`` the Llama-3 RoPE frequencies of ``scaling``, all four values of it.

    Megatron-Core 0.16.1's ``GPTModel(rope_scaling=True, rope_scaling_factor=f)`` passes only the factor
    to ``RotaryEmbedding._apply_scaling``, whose ``low_freq_factor=1``, ``high_freq_factor=4`` and
    ``original_max_position_embeddings=8192`` are then fixed (the published Llama 3.1/3.2 values; any other
    checkpoint would silently get them). The same function, called with the config's values on the unscaled frequencies,
    gives transformers' ``_compute_llama3_parameters``. Called before the first forward (RoPE's forward
    caches its output per length); ``inv_freq`` is not a parameter or buffer, so checkpoints do not carry it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = model.rotary_pos_emb
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"llama3 RoPE scaling: expected a RotaryEmbedding, the model has {type(rope).__name__}")
    unscaled = RotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0, rotary_base=int(arch.rope_theta),
                               use_cpu_initialization=True).inv_freq
    apply_scaling: Callable[..., torch.Tensor] = rope._apply_scaling  # annotated int by its defaults; takes floats
    rope.inv_freq = apply_scaling(
        unscaled, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings).to(rope.inv_freq.device)


def build_gpt_model(arch: HFArchitecture, megatron: MegatronConfig,
                    freeze_vision_tower: bool = True) -> tuple[GPTModel, TransformerConfig]:
    """A Megatron ``GPTModel`` (random init) for ``arch``, a :class:`~learner.vision.VisionLanguageGPT` with its
    vision tower for a vision-language ``arch`` (frozen unless ``freeze_vision_tower`` is false); weights come
    from :mod:`learner.hf_weights`.

    Returns ``(model, config)``. In bf16 the caller wraps it in ``Float16Module``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from learner.attention import core_attention_class, resolve_backend

    config = transformer_config(arch, megatron)
    if arch.is_moe:
        define_missing_te_symbols()
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if arch.is_moe and megatron.moe_grouped_gemm and arch.hybrid is None:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from learner.grouped_experts import GroupedExperts
        spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)  # pyright: ignore[reportAttributeAccessIssue]
    attention = spec.submodules.self_attention.submodules  # pyright: ignore[reportAttributeAccessIssue]
    attention.core_attention = core_attention_class(resolve_backend(megatron.attention_backend,
                                                                    on_gpu=torch.cuda.is_available()))
    pp = megatron.pipeline_model_parallel_size
    if pp > 1 and (arch.hybrid is not None or arch.vision is not None):
        kind = "hybrid" if arch.hybrid is not None else "vision-language"
        raise ValueError(f"pipeline_model_parallel_size={pp}: pipeline parallelism is implemented for decoder-only "
                         f"GPT families; model_type {arch.model_type!r} ({kind}) needs pipeline_model_parallel_size 1")
    core = attention.core_attention
    if arch.radio is not None:  # Nano-Omni: Nemotron-H with the RADIO tower inside (learner.omni_model)
        from learner.omni_model import build_omni_model
        return build_omni_model(arch, megatron, core, freeze_vision_tower)  # pyright: ignore[reportReturnType]
    if arch.hybrid is not None:  # Nemotron-H: Mamba2 / attention / MLP / MoE layers (learner.hybrid_model)
        from learner.hybrid_model import build_hybrid_model
        # a MambaModel, not a GPTModel: the learner uses only what both have (forward, output_layer, parameters)
        return build_hybrid_model(arch, megatron, core)  # pyright: ignore[reportReturnType]
    scaling = arch.rope_scaling
    cls: type[GPTModel] = GPTModel
    vision: dict[str, Any] = {}  # VisionLanguageGPT's own arguments
    if arch.vision is not None:
        from learner.vision import VisionLanguageGPT, build_vision_tower
        cls = VisionLanguageGPT
        vision = dict(visual=build_vision_tower(arch.model_type, arch.vision), vision_spec=arch.vision,
                      frozen_tower=freeze_vision_tower)
    from megatron.core import parallel_state as ps

    from learner.cpu_compat import device_redirect

    # with PP each stage builds its slice: the first the embedding, the last the output layer (tied embeddings: a
    # copy that Megatron all-reduces once, on the GPU: hence the redirect, a no-op on GPU)
    with device_redirect() if pp > 1 else contextlib.nullcontext():
        model = cls(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
                    max_sequence_length=arch.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                    position_embedding_type="mrope" if arch.mrope_section else "rope", rotary_base=int(arch.rope_theta),
                    rope_scaling=scaling is not None, rope_scaling_factor=scaling.factor if scaling else 8.0, **vision)
    if scaling is not None:
        _set_llama3_frequencies(model, arch, scaling)
    if torch.cuda.is_available():
        model = model.cuda()
    return model, config
