"""Finish a weight install on vLLM's CPU backend: two kernels vLLM 0.32 leaves stale after a reload.

Run in the worker, once after each install (``reload_weights``, plain ``load_weights`` or the copy plan).
Measured on tiny models (float32): pushing other weights left log-probs off by ~7 nats until repaired,
then within 1e-5 of transformers.

1. Tied embeddings (``tie_word_embeddings``: ``lm_head`` shares the embedding's weight). On CPU the
   lm_head GEMM (``dispatch_cpu_unquantized_gemm``) packs its own copy of the weight when it is
   processed. The checkpoint has no ``lm_head.weight``, so the layerwise reload never reprocesses
   ``lm_head``: the embedding takes the new weights, the logits still come from the old copy. The repair
   re-dispatches it (``remove_weight=False``: only the packed copy is rebuilt).
2. Mixture-of-experts layers. The CPU experts (``CPUUnquantizedExperts``) prepack ``w13``/``w2`` into their
   grouped-GEMM layout in ``process_weights_after_loading``, which ``UnquantizedFusedMoEMethod._setup_kernel``
   calls only on the first load; a weight update copies checkpoint-layout values into the packed storage
   (a permutation of it: every checksum agrees, the outputs do not). The repair prepacks them again, in
   place, as the first load did. Layers whose intermediate size the CPU kernel pads are refused.

A no-op on GPU. The vLLM classes and fields named here are checked when used: another vLLM that no
longer has them raises rather than silently serving stale weights.
"""
from __future__ import annotations

import torch


def repair_after_reload(model: torch.nn.Module) -> list[str]:
    """Rebuild the CPU kernels an install leaves stale in ``model``; returns what was repaired (names)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    return _repack_moe_experts(model) + _redispatch_tied_lm_heads(model)


def _redispatch_tied_lm_heads(model: torch.nn.Module) -> list[str]:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {_tensor(m, "weight").data_ptr() for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    done = []
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead) and _tensor(module, "weight").data_ptr() in embeddings:
            module.quant_method.process_weights_after_loading(module)
            done.append(name)
    return done


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name}: expected a tensor, got {type(value).__name__}")
    return value


@torch.no_grad()
def _repack_moe_experts(model: torch.nn.Module) -> list[str]:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        moe = experts.moe_config
        if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
            raise RuntimeError(f"{name}: the CPU MoE kernel pads the intermediate size "
                               f"{moe.intermediate_size_per_partition}; weight updates of such layers are not "
                               f"supported on CPU")
        for weight in (_tensor(module, "w13_weight"), _tensor(module, "w2_weight")):
            weight.data.copy_(ops.cpu_prepack_moe_weight(weight.data, experts.isa))
        done.append(name)
    return done
