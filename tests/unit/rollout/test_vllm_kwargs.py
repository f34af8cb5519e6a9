"""``policy.generation.vllm_kwargs`` -> vLLM's engine arguments, checked against the installed vLLM without starting
an engine: unknown names with close matches, Inflight's own arguments refused, GPU-only ones ignored on CPU, the
seed recipe's tuned stack accepted, and the merged arguments read back from vLLM's ``AsyncEngineArgs``."""
from __future__ import annotations

import dataclasses

import pytest

from rollout.config import VllmConfig, VllmKwargs
from rollout.options import build_engine_options, probe_vllm
from rollout.vllm_kwargs import VllmKwargError, engine_args_object

SEED_STACK = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "all2all_backend": "flashinfer_nvlink_one_sided",
              "kernel_config": {"moe_backend": "flashinfer_cutlass", "enable_flashinfer_autotune": True},
              "mamba_ssm_cache_dtype": "float32", "limit_mm_per_prompt": {"image": 1}, "skip_mm_profiling": True}
"""The vLLM stack the seed recipes (NeMo-RL's Nemotron-3-Nano-Omni GRPO) tune in vllm_kwargs."""


@pytest.fixture(scope="module")
def caps():
    installed = probe_vllm()
    return {p: dataclasses.replace(installed, platform=p) for p in ("cpu", "cuda")}


def build(kwargs: dict, caps, max_model_len: int = 512):
    return build_engine_options(VllmConfig(), "/m", max_model_len, caps, kwargs=VllmKwargs.model_validate(kwargs))


@pytest.mark.parametrize("kwargs,key,hint", [
    ({"max_num_seq": 8}, "max_num_seq", "did you mean 'max_num_seqs'"),
    ({"kernel_config": {"moe_backnd": "triton"}}, "kernel_config.moe_backnd", "did you mean 'moe_backend'"),
    ({"compilation_config": {"cudagraph_mod": "NONE"}}, "compilation_config.cudagraph_mod",
     "did you mean 'cudagraph_mode'"),
])
def test_an_unknown_argument_is_named_with_its_close_matches(caps, kwargs, key, hint):
    for platform in ("cpu", "cuda"):
        with pytest.raises(VllmKwargError) as err:
            build(kwargs, caps[platform])
        assert err.value.key == key and hint in str(err.value)
        assert str(err.value).startswith(f"policy.generation.vllm_kwargs.{key}=")


@pytest.mark.parametrize("name,instead", [("seed", "policy.generation.vllm_cfg.seed"),
                                          ("model", "policy.model_name"),
                                          ("dtype", "policy.generation.vllm_cfg.precision"),
                                          ("enable_prefix_caching",
                                           "policy.generation.vllm_cfg.enable_prefix_caching")])
def test_an_argument_inflight_sets_itself_is_an_error_naming_the_recipe_key(caps, name, instead):
    with pytest.raises(VllmKwargError, match=f"Inflight sets '{name}' itself; set {instead}"):
        build({name: 1}, caps["cpu"])


def test_the_seed_stack_reaches_the_engine_arguments_on_gpu(caps):
    opts = build({**SEED_STACK, "compilation_config": {"backend": "eager"}}, caps["cuda"], 4096)
    args = engine_args_object(opts.engine_args)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (64, 8192)
    assert args.all2all_backend == "flashinfer_nvlink_one_sided" and args.mamba_ssm_cache_dtype == "float32"
    assert args.kernel_config.moe_backend == "flashinfer_cutlass" and args.kernel_config.enable_flashinfer_autotune
    assert args.limit_mm_per_prompt == {"image": 1} and args.skip_mm_profiling is True
    # a dict merges into Inflight's own: the CUDA-graph mode stays, the backend is added
    assert args.compilation_config.backend == "eager"
    assert args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert "policy.generation.vllm_kwargs.max_num_seqs -> max_num_seqs=64 (replaces " \
           "policy.generation.vllm_cfg.max_num_seqs: 256)" in opts.describe()


def test_gpu_only_arguments_are_reported_ignored_on_cpu_and_the_rest_apply(caps):
    opts = build(SEED_STACK, caps["cpu"], 4096)
    assert "all2all_backend" not in opts.engine_args and "kernel_config" not in opts.engine_args
    messages = opts.describe()
    for key in ("all2all_backend='flashinfer_nvlink_one_sided'", "kernel_config.moe_backend='flashinfer_cutlass'",
                "kernel_config.enable_flashinfer_autotune=True"):
        assert any(m.startswith(f"policy.generation.vllm_kwargs.{key} ignored on cpu: ") for m in messages), key
    args = engine_args_object(opts.engine_args)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.skip_mm_profiling) == (64, 8192, True)
    assert args.mamba_ssm_cache_dtype == "float32" and args.limit_mm_per_prompt == {"image": 1}


def test_batched_tokens_below_the_context_length_are_refused_on_cpu_only(caps):
    with pytest.raises(VllmKwargError, match=r"max_num_batched_tokens=1024: must be >= the context length \(4096\)"):
        build({"max_num_batched_tokens": 1024}, caps["cpu"], 4096)
    assert build({"max_num_batched_tokens": 1024}, caps["cuda"], 4096).engine_args["max_num_batched_tokens"] == 1024
    with pytest.raises(VllmKwargError, match=r"must be >= max_num_seqs \(256\)"):
        build({"max_num_batched_tokens": 128}, caps["cuda"], 64)


def test_a_value_vllm_refuses_is_named(caps):
    opts = build({"kernel_config": {"moe_backend": "no_such_backend"}}, caps["cuda"])
    with pytest.raises(VllmKwargError, match=r"vllm_kwargs.kernel_config=.*vLLM.s KernelConfig refuses it: .*moe_b"):
        engine_args_object(opts.engine_args)


def test_a_value_outside_a_literal_argument_is_named_with_its_close_match(caps):
    """vLLM does not check ``Literal`` engine arguments itself (the engine would fail later, on the GPU)."""
    with pytest.raises(VllmKwargError, match=r"vllm_kwargs.all2all_backend='flashinfer_nvlink_one_sidd': not "
                                             r"supported by the installed vLLM .*did you mean "
                                             r"'flashinfer_nvlink_one_sided'"):
        build({"all2all_backend": "flashinfer_nvlink_one_sidd"}, caps["cuda"])
