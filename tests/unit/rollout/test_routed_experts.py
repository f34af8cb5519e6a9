"""The engine side of routing replay (rollout/routed_experts.py): the recipe key becomes vLLM's engine argument and
Model Runner V2 on GPU, V1 with Inflight's capture on CPU (rollout/cpu_routed_experts.py), refused where vLLM's
AuxOutput connector would run without prefix caching (a hybrid model on CPU); a finished request's
``routed_experts`` is cut to the MoE layers of each family (Qwen3-MoE: all; Nemotron-H: its ``E``s)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from rollout.config import VllmConfig
from rollout.options import EngineOptionError, VllmCapabilities, build_engine_options
from rollout.routed_experts import layers_of, trajectory_routing

ARGS = frozenset({"model", "tokenizer", "max_model_len", "seed", "dtype", "max_num_seqs", "enable_prefix_caching",
                  "enforce_eager", "worker_extension_cls", "tensor_parallel_size", "pipeline_parallel_size",
                  "gpu_memory_utilization", "enable_chunked_prefill", "compilation_config",
                  "enable_return_routed_experts", "mamba_ssm_cache_dtype"})
GPU = VllmCapabilities("0.32.0", "cuda", ARGS | {"aux_output_config"}, None, None, ("FULL_AND_PIECEWISE",))
GPU_0_25 = VllmCapabilities("0.25.1", "cuda", ARGS, None, None, ("FULL_AND_PIECEWISE",))  # no AuxOutput connector
ON = VllmConfig(enable_return_routed_experts=True, enforce_eager=True)


def test_gpu_engines_are_asked_for_routed_experts_through_the_runner_that_returns_them():
    opts = build_engine_options(ON, "/m", 512, GPU)
    assert opts.engine_args["enable_return_routed_experts"] is True
    assert opts.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # vLLM 0.32: the AuxOutput connector, Model Runner V2 only
    assert build_engine_options(ON, "/m", 512, GPU_0_25).env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # 0.25.1: V1's
    off = build_engine_options(VllmConfig(enforce_eager=True), "/m", 512, GPU)
    assert "enable_return_routed_experts" not in off.engine_args and "VLLM_USE_V2_MODEL_RUNNER" not in off.env


def test_cpu_engines_return_routed_experts_from_the_v1_runner_with_prefix_caching(tmp_path):
    cpu = dataclasses.replace(GPU, platform="cpu")
    opts = build_engine_options(ON, "/m", 512, cpu)
    assert opts.engine_args["enable_return_routed_experts"] is True and opts.engine_args["enable_prefix_caching"]
    assert opts.env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # V2 needs Triton: rollout/cpu_routed_experts.py drives V1
    with pytest.raises(EngineOptionError, match="enable_return_routed_experts=True: .*needs enable_prefix_caching"):
        build_engine_options(ON.model_copy(update={"enable_prefix_caching": False}), "/m", 512, GPU)
    (tmp_path / "config.json").write_text('{"model_type": "nemotron_h", "hybrid_override_pattern": "ME*E"}')
    with pytest.raises(EngineOptionError, match="hybrid Mamba model cannot have on CPU.*needs GPU engines"):
        build_engine_options(ON, str(tmp_path), 512, cpu)
    assert build_engine_options(ON, str(tmp_path), 512, GPU).engine_args["enable_return_routed_experts"] is True


def test_a_finished_requests_routing_is_cut_to_the_moe_layers():
    full = np.zeros((7, 5, 2), np.int32)  # 4 prompt + 4 sampled - 1 positions, 5 decoder layers
    full[:, 1], full[:, 4] = [3, 1], [0, 2]
    nemotron = layers_of({"num_hidden_layers": 5, "hybrid_override_pattern": "ME*ME"})
    assert nemotron == (1, 4)
    out = trajectory_routing(SimpleNamespace(routed_experts=full), nemotron, 8)
    assert out is not None and out.dtype == np.uint8 and out.shape == (7, 2, 2)
    assert out[:, 0].tolist() == [[3, 1]] * 7 and out[:, 1].tolist() == [[0, 2]] * 7
    assert layers_of({"num_hidden_layers": 2, "num_experts": 4}) == (0, 1)
    assert trajectory_routing(SimpleNamespace(routed_experts=None), nemotron, 8) is None
    with pytest.raises(ValueError, match="no MoE layer"):
        trajectory_routing(SimpleNamespace(routed_experts=full), (), 8)
