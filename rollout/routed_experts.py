"""The experts vLLM routed each position to, as a trajectory carries them (routing replay, R3).

With ``policy.generation.vllm_cfg.enable_return_routed_experts`` the engine starts with vLLM's
``enable_return_routed_experts`` in the model runner that returns them (:func:`runner_env`: V2 in vLLM 0.32 on GPU,
V1 in 0.25.1; on CPU vLLM 0.32's V1 runner with the capture rollout/cpu_routed_experts.py gives it), and every
finished request's ``CompletionOutput.routed_experts`` is ``[positions, decoder layers, top_k]``: the prompt's
positions, then the sampled ones but the last (never fed back).
:func:`trajectory_routing` cuts it to the model's MoE layers (:func:`protocol.routing.moe_layers` of the engine's HF
config: dense and Mamba layers hold nothing) in the narrowest dtype, for ``Trajectory.routed_experts``; the learner
replays it (:mod:`learner.router_replay`). A multi-turn episode carries its last turn's (rollout/episodes/episode.py):
that request was the whole episode so far, environment tokens included, so it covers every position but the last.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from protocol.routing import compact, moe_layers

V2_ONLY_ARG = "aux_output_config"
"""The engine argument of vLLM's AuxOutput connector (0.32), which returns routed experts from Model Runner V2 only
("AuxOutput Connector requires Model Runner V2"); vLLM 0.25.1 has no such argument and captures them in the V1
runner, whose V2 lists "routed experts capture" as unsupported."""


def runner_env(engine_arg_names: frozenset[str], on_cpu: bool = False) -> dict[str, str]:
    """The model runner the installed vLLM returns routed experts from, as the variable that selects it: on CPU
    always V1 (V2 needs Triton; rollout/cpu_routed_experts.py drives vLLM's capture from the V1 runner)."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if V2_ONLY_ARG in engine_arg_names and not on_cpu else "0"}

NEEDS_PREFIX_CACHING = ("vLLM's AuxOutput connector keeps the routed experts of cached prompt blocks by their "
                        "prefix-cache hashes, so it needs enable_prefix_caching=True")
HYBRID_ON_CPU = (NEEDS_PREFIX_CACHING + ", which a hybrid Mamba model cannot have on CPU (vLLM's Mamba prefix "
                 "caching needs chunked prefill, off on CPU); routing replay of a hybrid model needs GPU engines")


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
