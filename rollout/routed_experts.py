"""The experts vLLM routed each position to, as a trajectory carries them (routing replay, R3).

With ``policy.generation.vllm_cfg.enable_return_routed_experts`` the engine starts with vLLM's
``enable_return_routed_experts`` (its Model Runner V2, ``VLLM_USE_V2_MODEL_RUNNER=1``: GPU only, as V2 needs
Triton), and every finished request's ``CompletionOutput.routed_experts`` is ``[positions, decoder layers, top_k]``:
the prompt's positions, then the sampled ones but the last (never fed back). :func:`trajectory_routing` cuts it to
the model's MoE layers (:func:`protocol.routing.moe_layers` of the engine's HF config: dense and Mamba layers hold
nothing) in the narrowest dtype, for ``Trajectory.routed_experts``; the learner replays it
(:mod:`learner.router_replay`). A multi-turn episode carries its last turn's (rollout/episodes/episode.py): that
request was the whole episode so far, environment tokens included, so it covers every position but the last.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from protocol.routing import compact, moe_layers

ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
"""vLLM 0.32 returns routed experts only from Model Runner V2 (its config check says so)."""
CPU_REASON = ("vLLM returns routed experts only from its Model Runner V2, which needs Triton on a GPU (on CPU: "
              "'Model Runner V2 requires Triton'); routing replay needs GPU engines")


def layers_of(hf_config: Any) -> tuple[int, ...]:
    """The MoE layers of the engine's model, from its HF config object (or map)."""
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return moe_layers(cfg)


def trajectory_routing(output: Any, layers: tuple[int, ...], positions: int) -> np.ndarray | None:
    """``output.routed_experts`` (a vLLM ``CompletionOutput``) cut to the MoE ``layers``; None when the engine
    returned none. At most ``positions`` (prompt + response) positions are kept."""
    routed = getattr(output, "routed_experts", None)
    if routed is None:
        return None
    if not layers:
        raise ValueError("the engine returned routed experts for a model with no MoE layer in its config")
    return compact(np.asarray(routed)[:positions], layers)
