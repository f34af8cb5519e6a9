"""Nemotron-H in Megatron-Core without Transformer Engine: hybrid Mamba2 / attention / MLP / MoE layers.

Megatron-Core 0.16.1's ``MambaModel`` is kept (embedding without position embeddings, output layer,
loss); what it cannot run here is replaced. Its ``mamba_stack_spec`` is Transformer Engine's
(``TELayerNormColumnParallelLinear``, ``TEDotProductAttention``) and ``MambaStack.final_norm`` is a
``TENorm``; its ``MambaMixer`` needs ``mamba_ssm``. So:

- :func:`hybrid_stack_spec`: per layer type, the local spec's modules — attention (``SelfAttention``
  with ``DotProductAttention``, no RoPE), MLP (``MLPLayer``), MoE (``MoELayer``: ``SequentialMLP``
  experts, or :class:`~learner.grouped_experts.GroupedExperts` with ``moe_grouped_gemm``, a shared expert, the
  sigmoid router) — and a ``MambaLayer`` with a local RMSNorm and
  :class:`~learner.mamba_mixer.TorchMambaMixer`;
- :class:`HybridStack` builds one layer per pattern symbol (names as ``MambaStack``'s:
  ``decoder.layers.i.*``, ``decoder.final_norm``) and gives the Mamba layers the packed sequences'
  boundaries, the attention layers theirs: both from the packed row's ``packed_seq_params``
  (:func:`learner.attention.packed_row`, ``cu_seqlens_q``), which the learner passes with every row;
- :class:`HybridModel` is a ``MambaModel`` over that stack.

:func:`hybrid_transformer_config`: squared-ReLU, non-gated MLPs and experts; sigmoid routing with the
expert-score correction bias (a buffer, never updated: bias update rate 0), top-k scaling factor, shared
expert. docs/learner.md, "Hybrid models (Nemotron-H)".
"""
from __future__ import annotations

from dataclasses import is_dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.transformer.module import MegatronModule

from learner.config import MegatronConfig
from learner.hf_config import HFArchitecture
from learner.nemotron_h_config import HybridSpec

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_block import MambaStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


def _hybrid(arch: HFArchitecture) -> HybridSpec:
    if arch.hybrid is None:
        raise ValueError(f"model_type {arch.model_type!r} is not a hybrid model")
    return arch.hybrid


def hybrid_transformer_config(arch: HFArchitecture, megatron: MegatronConfig) -> TransformerConfig:
    """The ``TransformerConfig`` of a Nemotron-H ``arch`` under ``megatron``'s parallel/precision settings."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    h = _hybrid(arch)
    bf16 = megatron.precision == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    tp, ep = megatron.tensor_model_parallel_size, megatron.expert_model_parallel_size
    if arch.num_key_value_heads % tp or arch.num_attention_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads="
                         f"{arch.num_attention_heads} and num_key_value_heads={arch.num_key_value_heads}")
    moe: dict[str, Any] = {}
    if arch.num_experts is not None:
        if tp > 1:  # Megatron's MoELayer refuses to train under TP without sequence parallelism
            raise ValueError(f"tensor_model_parallel_size={tp}: Nemotron-H MoE layers ('E' in the pattern) train "
                             f"only with sequence parallelism, which the learner does not run; use TP=1 "
                             f"(expert_model_parallel_size places the experts)")
        if arch.num_experts % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide n_routed_experts={arch.num_experts}")
        moe = dict(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=h.routed_scaling_factor,
            moe_shared_expert_intermediate_size=h.shared_expert_intermediate_size,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if ep > 1 and torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_dtype="fp32")
    recompute: dict[str, Any] = {}
    if megatron.activation_checkpointing:
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size or arch.hidden_size, normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=False, activation_func=squared_relu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        mamba_num_heads=h.mamba_num_heads, mamba_head_dim=h.mamba_head_dim, mamba_num_groups=h.n_groups,
        mamba_state_dim=h.ssm_state_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1, sequence_parallel=False, calculate_per_token_loss=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        **recompute, **moe)


def hybrid_stack_spec(arch: HFArchitecture, core_attention: type | None = None,
                      grouped_experts: bool = False) -> ModuleSpec:
    """The :class:`HybridStack` spec: local (no TE) modules per layer type (see the module docstring);
    ``core_attention``: the attention layers' core (None: the local spec's ``DotProductAttention``);
    ``grouped_experts``: the MoE layers' experts as :class:`~learner.grouped_experts.GroupedExperts`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_block import MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from learner.mamba_mixer import TorchMambaMixer

    h = _hybrid(arch)
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    if not isinstance(dense, TransformerLayerSubmodules):
        raise TypeError(f"Megatron's local layer spec has submodules {type(dense).__name__}")
    norm = dense.input_layernorm
    self_attention = dense.self_attention
    if core_attention is not None:
        if not isinstance(self_attention, ModuleSpec) or not is_dataclass(self_attention.submodules):
            raise TypeError("Megatron's local layer spec has no self-attention submodules to set core_attention in")
        self_attention = replace(self_attention, submodules=replace(self_attention.submodules,  # pyright: ignore
                                                                    core_attention=core_attention))
    attention = TransformerLayerSubmodules(input_layernorm=norm, self_attention=self_attention,
                                           self_attn_bda=dense.self_attn_bda)
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=norm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)
    moe = mlp
    if arch.num_experts is not None:
        moe_spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                            normalization="RMSNorm").submodules
        if not isinstance(moe_spec, TransformerLayerSubmodules):
            raise TypeError(f"Megatron's local MoE layer spec has submodules {type(moe_spec).__name__}")
        moe_mlp = moe_spec.mlp
        if grouped_experts:
            from learner.grouped_experts import GroupedExperts

            if not isinstance(moe_mlp, ModuleSpec) or not is_dataclass(moe_mlp.submodules):
                raise TypeError("Megatron's local MoE layer spec has no MoE submodules to set the experts in")
            moe_mlp = replace(moe_mlp, submodules=replace(moe_mlp.submodules,  # pyright: ignore[reportArgumentType]
                                                          experts=ModuleSpec(module=GroupedExperts)))
        moe = replace(mlp, mlp=moe_mlp)
    mixer = ModuleSpec(module=TorchMambaMixer,
                       submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                       params=dict(d_conv=h.conv_kernel, conv_bias=h.use_conv_bias, chunk_size=h.chunk_size,
                                   norm_eps=arch.rms_norm_eps))
    return ModuleSpec(module=HybridStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm, mixer=mixer, mamba_bda=get_bias_dropout_add)),  # pyright: ignore[reportArgumentType]
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        moe_layer=ModuleSpec(module=TransformerLayer, submodules=moe)), params=dict(norm=norm))


class HybridStack(MegatronModule):
    """One layer per symbol of ``hybrid_override_pattern`` and a final RMSNorm (``MambaStack``'s names)."""

    def __init__(self, config: TransformerConfig, submodules: MambaStackSubmodules, norm: Any,
                 hybrid_override_pattern: str, pg_collection: ProcessGroupCollection, **_: Any):
        from megatron.core.transformer.spec_utils import build_module

        super().__init__(config=config)
        kinds = {"M": submodules.mamba_layer, "*": submodules.attention_layer, "-": submodules.mlp_layer,
                 "E": submodules.moe_layer}
        self.pattern = hybrid_override_pattern
        self.layers = torch.nn.ModuleList()
        for i, symbol in enumerate(self.pattern):
            extra = {"residual_in_fp32": False} if symbol == "M" else {}
            layer = build_module(kinds[symbol], config=config, layer_number=i + 1, pg_collection=pg_collection,
                                 **extra)
            if not isinstance(layer, torch.nn.Module):
                raise TypeError(f"layer {i} ({symbol!r}): the spec built a {type(layer).__name__}, not a module")
            self.layers.append(layer)
        self.final_norm = build_module(norm, config=config, hidden_size=config.hidden_size,
                                       eps=config.layernorm_epsilon)
        self.recompute = config.recompute_granularity == "full"

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        raise NotImplementedError("HybridStack runs without pipeline parallelism")

    def _layer(self, i: int, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
        layer = self.layers[i]
        if self.pattern[i] == "M":
            return layer(hidden, packed_seq_params=packed_seq_params)
        out, _ = layer(hidden_states=hidden, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """``[s, b, h]`` through every layer and the final norm; ``packed_seq_params.cu_seqlens_q``: the packed
        sequences' starts, for the Mamba and the attention layers alike (None: each row is one sequence)."""
        from torch.utils.checkpoint import checkpoint

        for i in range(len(self.layers)):
            if self.recompute and self.training:
                hidden_states = checkpoint(self._layer, i, hidden_states, attention_mask, packed_seq_params,
                                           use_reentrant=False)
            else:
                hidden_states = self._layer(i, hidden_states, attention_mask, packed_seq_params)
        return self.final_norm(hidden_states)


class HybridModel(MambaModel):
    """``MambaModel`` (embedding, output layer, loss) over a :class:`HybridStack`; the forward the learner
    calls: ``model(input_ids, position_ids, attention_mask, labels=...)`` → per-token loss or logits."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                inference_context: Any = None, runtime_gather_output: bool | None = None, *,
                packed_seq_params: PackedSeqParams | None = None, **_: Any) -> torch.Tensor:
        if inference_context is not None:
            raise NotImplementedError("HybridModel scores and trains; generation runs in the engines")
        if decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        hidden = self.decoder(decoder_input, attention_mask, packed_seq_params=packed_seq_params)
        if not self.post_process:  # the caller runs the output layer (learner.logprobs)
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)


def build_hybrid_model(arch: HFArchitecture, megatron: MegatronConfig,
                       core_attention: type | None = None) -> tuple[HybridModel, TransformerConfig]:
    """A :class:`HybridModel` (random init) for a Nemotron-H ``arch``, its attention layers' core
    ``core_attention`` (the GPT models' own); weights: :mod:`learner.hybrid_weights`."""
    from learner.model import define_missing_te_symbols

    config = hybrid_transformer_config(arch, megatron)
    if arch.is_moe:
        define_missing_te_symbols()
    model = HybridModel(config=config, mamba_stack_spec=hybrid_stack_spec(arch, core_attention,
                                                                        megatron.moe_grouped_gemm),
                        vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                        hybrid_override_pattern=_hybrid(arch).pattern, pre_process=True, post_process=True,
                        parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                        position_embedding_type="none")
    if torch.cuda.is_available():
        model = model.cuda()
    return model, config
