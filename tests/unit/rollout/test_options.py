"""Recipe -> vLLM engine arguments, for CPU and GPU capability sets, without starting vLLM."""
from __future__ import annotations

import dataclasses

import pytest

from rollout.config import VllmConfig, VllmKwargs
from rollout.options import (CUDA_GRAPH_MODE, OUTPUT_CHUNK_ENV, WORKER_EXTENSION, EngineOptionError, VllmCapabilities,
                             build_engine_options, probe_vllm)

ARGS = frozenset({"model", "tokenizer", "max_model_len", "seed", "dtype", "enforce_eager", "max_num_seqs",
                  "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size",
                  "gpu_memory_utilization", "compilation_config", "enable_expert_parallel", "moe_backend",
                  "all2all_backend", "enable_chunked_prefill", "worker_extension_cls",
                  "enable_sleep_mode"})
GPU = VllmCapabilities("0.25.1", "cuda", ARGS, ("auto", "triton", "flashinfer_cutlass"),
                       ("allgather_reducescatter", "flashinfer_nvlink_one_sided"), ("NONE", CUDA_GRAPH_MODE))
CPU = dataclasses.replace(GPU, version="0.32.0", platform="cpu")
GPU_RECIPE = VllmConfig(tensor_parallel_size=2, expert_parallel_size=2, enforce_eager=False, max_num_seqs=64,
                        gpu_memory_utilization=0.7, moe_backend="flashinfer_cutlass",
                        all2all_backend="flashinfer_nvlink_one_sided", precision="bfloat16", seed=3)


def test_gpu_recipe_maps_every_option():
    opts = build_engine_options(GPU_RECIPE, "/m", 4096, GPU)
    assert opts.engine_args == dict(
        model="/m", tokenizer="/m", max_model_len=4096, seed=3, dtype="bfloat16", enforce_eager=False,
        max_num_seqs=64, enable_prefix_caching=True, tensor_parallel_size=2, pipeline_parallel_size=1,
        gpu_memory_utilization=0.7, compilation_config={"cudagraph_mode": CUDA_GRAPH_MODE},
        enable_expert_parallel=True, moe_backend="flashinfer_cutlass",
        all2all_backend="flashinfer_nvlink_one_sided", worker_extension_cls=WORKER_EXTENSION)
    assert opts.env == {}
    assert [i.key for i in opts.ignored] == ["cpu_kvcache_space_gib"]
    assert "moe_backend='flashinfer_cutlass' (KernelConfig.moe_backend)" in opts.applied["moe_backend"]


def test_vllm_cfg_max_model_len_sets_the_engine_context_length():
    """``policy.generation.vllm_cfg.max_model_len`` reaches vLLM; unset, the caller's sequence length does."""
    for caps in (GPU, CPU):
        opts = build_engine_options(GPU_RECIPE.model_copy(update={"max_model_len": 8192}), "/m", 4096, caps)
        assert opts.engine_args["max_model_len"] == 8192
        assert "policy.generation.vllm_cfg.max_model_len -> max_model_len=8192" in opts.describe()
        assert build_engine_options(GPU_RECIPE, "/m", 4096, caps).engine_args["max_model_len"] == 4096


def test_colocated_engines_get_sleep_mode_on_gpu_only():
    assert build_engine_options(GPU_RECIPE, "/m", 4096, GPU, colocated=True).engine_args["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in build_engine_options(GPU_RECIPE, "/m", 4096, GPU).engine_args
    assert "enable_sleep_mode" not in build_engine_options(GPU_RECIPE, "/m", 512, CPU, colocated=True).engine_args


def test_gpu_only_options_are_ignored_on_cpu_with_a_message():
    opts = build_engine_options(GPU_RECIPE.model_copy(update={"cpu_kvcache_space_gib": 2.0}), "/m", 512, CPU)
    assert opts.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for gpu_arg in ("tensor_parallel_size", "gpu_memory_utilization", "moe_backend", "all2all_backend",
                    "enable_expert_parallel", "compilation_config"):
        assert gpu_arg not in opts.engine_args
    messages = opts.describe()
    for key in ("tensor_parallel_size=2", "expert_parallel_size=2", "moe_backend='flashinfer_cutlass'",
                "all2all_backend='flashinfer_nvlink_one_sided'", "gpu_memory_utilization=0.7"):
        assert any(m.startswith(f"policy.generation.vllm_cfg.{key} ignored on cpu: ") for m in messages), key
    assert "policy.generation.vllm_cfg.cpu_kvcache_space_gib -> env VLLM_CPU_KVCACHE_SPACE=2" in messages
    assert opts.engine_args["enable_chunked_prefill"] is False
    assert any(m.startswith("(cpu) enable_chunked_prefill=False") for m in messages)
    assert any(m.startswith("(cpu) env VLLM_ENABLE_V1_MULTIPROCESSING=0") for m in messages)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_engine_options(GPU_RECIPE, "/m", 4096, GPU).env


def test_cpu_default_recipe_ignores_only_gpu_memory_utilization():
    opts = build_engine_options(VllmConfig(enforce_eager=True), "/m", 512, CPU)
    assert [i.key for i in opts.ignored] == ["gpu_memory_utilization"]
    assert opts.engine_args["enforce_eager"] is True


@pytest.mark.parametrize("caps,recipe,match", [
    (dataclasses.replace(GPU, moe_backends=("auto", "triton")), GPU_RECIPE,
     r"vllm_cfg.moe_backend='flashinfer_cutlass': not supported by the installed vLLM 0.25.1; it accepts"),
    (dataclasses.replace(GPU, all2all_backends=("naive",)), GPU_RECIPE,
     r"vllm_cfg.all2all_backend='flashinfer_nvlink_one_sided': not supported"),
    (dataclasses.replace(GPU, engine_arg_names=ARGS - {"moe_backend"}), GPU_RECIPE,
     r"vllm_cfg.moe_backend='flashinfer_cutlass': the installed vLLM 0.25.1 has no engine argument 'moe_backend'"),
    (dataclasses.replace(GPU, cudagraph_modes=("NONE",)), GPU_RECIPE,
     r"vllm_cfg.enforce_eager='FULL_AND_PIECEWISE'"),
    (GPU, GPU_RECIPE.model_copy(update={"expert_parallel_size": 4}),
     r"vllm_cfg.expert_parallel_size=4: inside one vLLM engine the expert-parallel size equals tensor_parallel_size"),
    (CPU, VllmConfig(cpu_kvcache_space_gib=1.5),
     r"vllm_cfg.cpu_kvcache_space_gib=1.5: a whole number of GiB on CPU"),
])
def test_unsupported_values_name_the_recipe_key(caps, recipe, match):
    with pytest.raises(EngineOptionError, match=match):
        build_engine_options(recipe, "/m", 512, caps)


def test_probe_reads_the_installed_vllm():
    caps = probe_vllm()
    assert caps.platform in ("cpu", "cuda")
    assert {"moe_backend", "all2all_backend", "enable_expert_parallel", "max_num_seqs"} <= caps.engine_arg_names
    assert "flashinfer_cutlass" in caps.moe_backends and "flashinfer_nvlink_one_sided" in caps.all2all_backends
    assert CUDA_GRAPH_MODE in caps.cudagraph_modes
    build_engine_options(GPU_RECIPE, "/m", 512, dataclasses.replace(caps, platform="cuda"))


def hybrid_dir(tmp_path, model_type: str = "nemotron_h"):
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}", "hybrid_override_pattern": "M*"}}')
    return str(tmp_path)


def test_hybrid_models_get_a_float32_ssm_cache_and_no_prefix_caching_on_cpu(tmp_path):
    caps = {name: dataclasses.replace(c, engine_arg_names=c.engine_arg_names | {"mamba_ssm_cache_dtype"})
            for name, c in (("gpu", GPU), ("cpu", CPU))}
    model = hybrid_dir(tmp_path)
    cpu = build_engine_options(VllmConfig(), model, 512, caps["cpu"])
    assert cpu.engine_args["enable_prefix_caching"] is False and cpu.engine_args["mamba_ssm_cache_dtype"] == "float32"
    assert "enable_prefix_caching" not in cpu.applied
    assert any("enable_prefix_caching=True ignored on cpu: a hybrid Mamba model" in m for m in cpu.describe())
    gpu = build_engine_options(VllmConfig(), model, 512, caps["gpu"])
    assert gpu.engine_args["enable_prefix_caching"] is True and gpu.engine_args["mamba_ssm_cache_dtype"] == "float32"
    (tmp_path / "qwen2").mkdir()
    (tmp_path / "qwen2" / "config.json").write_text('{"model_type": "qwen2"}')
    for other in (str(tmp_path / "qwen2"), "/not/a/model"):
        plain = build_engine_options(VllmConfig(), other, 512, caps["cpu"])
        assert plain.engine_args["enable_prefix_caching"] is True and "mamba_ssm_cache_dtype" not in plain.engine_args


def test_tempered_sampling_asks_for_the_log_probs_of_the_sampled_distribution():
    from rollout.config import GenerationConfig

    caps = dataclasses.replace(CPU, engine_arg_names=ARGS | {"logprobs_mode"})
    assert "logprobs_mode" not in build_engine_options(GPU_RECIPE, "/m", 512, caps).engine_args
    for tempered in (GenerationConfig(temperature=0.7), GenerationConfig(top_k=20), GenerationConfig(top_p=0.9)):
        assert tempered.tempered and not GenerationConfig().tempered
        opts = build_engine_options(GPU_RECIPE, "/m", 512, caps, tempered=tempered.tempered)
        assert opts.engine_args["logprobs_mode"] == "processed_logprobs"
        assert any("processed_logprobs" in line for line in opts.describe())


def test_the_front_end_processes_a_whole_step_of_outputs_between_awaits(monkeypatch):
    """Streamed version marks read the front end's backlog at a pause (rollout.streamed.frontend_backlog): vLLM's
    output handler must not stop inside one step's outputs, so its chunk is raised to ``max_num_seqs``."""
    monkeypatch.delenv(OUTPUT_CHUNK_ENV, raising=False)
    for caps in (GPU, CPU):
        opts = build_engine_options(GPU_RECIPE.model_copy(update={"max_num_seqs": 300}), "/m", 4096, caps)
        assert opts.env[OUTPUT_CHUNK_ENV] == "300"
        assert any(m.startswith(f"({caps.platform}) env {OUTPUT_CHUNK_ENV}=300") for m in opts.describe())
        assert OUTPUT_CHUNK_ENV not in build_engine_options(GPU_RECIPE, "/m", 4096, caps).env  # 64 <= vLLM's 128
    kwargs = VllmKwargs.model_validate({"max_num_seqs": 512})
    assert build_engine_options(GPU_RECIPE, "/m", 4096, GPU, kwargs=kwargs).env[OUTPUT_CHUNK_ENV] == "512"
    monkeypatch.setenv(OUTPUT_CHUNK_ENV, "1024")  # already large enough: left alone
    assert OUTPUT_CHUNK_ENV not in build_engine_options(GPU_RECIPE.model_copy(update={"max_num_seqs": 300}), "/m",
                                                        4096, GPU).env
