"""``policy.generation.vllm_kwargs`` (NeMo-RL's key): extra vLLM engine arguments merged into what
:func:`rollout.options.build_engine_options` builds from ``vllm_cfg``, checked against the installed vLLM.

A key ``EngineArgs`` does not have, or a nested key (``kernel_config.moe_backend``) its config class does not have,
is an error naming it and the close matches. A key Inflight sets itself from another recipe key (the model, dtype,
seed, parallel sizes...) is an error naming that key, as NeMo-RL's own duplicate keyword is. The tuning keys
(:data:`OVERRIDES`) replace Inflight's value; a dict (``compilation_config``) is merged key by key. On CPU the
GPU-only ones (:data:`GPU_ONLY`) are dropped and listed as ignored with the reason. docs/rollout.md has the table.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rollout.config import VllmKwargs

if TYPE_CHECKING:
    from rollout.options import IgnoredOption, VllmCapabilities

SECTION = "policy.generation.vllm_kwargs"

SET_BY_INFLIGHT: dict[str, str] = {
    "model": "policy.model_name", "tokenizer": "policy.tokenizer.name", "dtype": "policy.generation.vllm_cfg.precision",
    "seed": "policy.generation.vllm_cfg.seed", "max_model_len": "policy.generation.vllm_cfg.max_model_len",
    "enforce_eager": "policy.generation.vllm_cfg.enforce_eager",
    "tensor_parallel_size": "policy.generation.vllm_cfg.tensor_parallel_size",
    "pipeline_parallel_size": "policy.generation.vllm_cfg.pipeline_parallel_size",
    "enable_expert_parallel": "policy.generation.vllm_cfg.expert_parallel_size",
    "gpu_memory_utilization": "policy.generation.vllm_cfg.gpu_memory_utilization",
    "enable_prefix_caching": "policy.generation.vllm_cfg.enable_prefix_caching",
    "enable_sleep_mode": "policy.generation.colocated.enabled",
    "worker_extension_cls": "nothing: Inflight's weight receiver must be the worker extension",
    "enable_chunked_prefill": "nothing: Inflight sets it per platform (off on CPU: seeded sampling needs whole "
                              "prefills)",
    "skip_tokenizer_init": "nothing: Inflight's engines keep their tokenizer (stop strings, bad words)",
    "logprobs_mode": "policy.generation.temperature / top_k / top_p (processed log-probs when they change the "
                     "sampled distribution, raw otherwise: what the learner scores under)",
    "kv_cache_dtype": "nothing: a quantised KV cache changes the log-probs",
}
"""Engine arguments Inflight sets itself: a ``vllm_kwargs`` entry for one is an error naming what to set instead."""

OVERRIDES: dict[str, str] = {
    "max_num_seqs": "policy.generation.vllm_cfg.max_num_seqs",
    "moe_backend": "policy.generation.vllm_cfg.moe_backend",
    "all2all_backend": "policy.generation.vllm_cfg.all2all_backend",
    "mamba_ssm_cache_dtype": "Inflight's float32 for hybrid Mamba models",
    "limit_mm_per_prompt": "Inflight's {'image': 8, 'video': 0} for vision-language models",
    "compilation_config": "Inflight's cudagraph_mode on GPU (merged key by key)",
}
"""Engine arguments Inflight also sets, which a ``vllm_kwargs`` entry replaces (documented overrides)."""

GPU_ONLY: dict[str, str] = {
    "moe_backend": "fused-MoE kernel backends are GPU kernels; CPU uses its own MoE",
    "kernel_config.moe_backend": "fused-MoE kernel backends are GPU kernels; CPU uses its own MoE",
    "kernel_config.enable_flashinfer_autotune": "FlashInfer kernels are GPU kernels",
    "all2all_backend": "all-to-all backends are GPU collectives",
    "compilation_config.cudagraph_mode": "CUDA graphs need a GPU",
    "compilation_config.cudagraph_capture_sizes": "CUDA graphs need a GPU",
    "compilation_config.max_cudagraph_capture_size": "CUDA graphs need a GPU",
    "cudagraph_capture_sizes": "CUDA graphs need a GPU",
    "max_cudagraph_capture_size": "CUDA graphs need a GPU",
    "enable_eplb": "expert-parallel load balancing needs GPUs",
    "eplb_config": "expert-parallel load balancing needs GPUs",
}
"""``vllm_kwargs`` paths that have no effect on CPU: dropped there and listed as ignored with the reason."""


class VllmKwargError(ValueError):
    """A ``vllm_kwargs`` entry the installed vLLM or Inflight cannot take; ``key`` is its dotted path inside it."""

    def __init__(self, key: str, value: object, expected: str):
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{SECTION}.{key}={value!r}: {expected}")


def _close(name: str, known: frozenset[str] | set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _paths(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value and f"{prefix}{key}" != "limit_mm_per_prompt":
            yield from _paths(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def check_names(kwargs: Mapping[str, Any], caps: VllmCapabilities) -> None:
    """Every key (and nested key of a config-class argument) is one the installed vLLM has, and none is set by
    Inflight from another recipe key; the first that is not raises :class:`VllmKwargError`."""
    for name, value in kwargs.items():
        if name in SET_BY_INFLIGHT:
            raise VllmKwargError(name, value, f"Inflight sets {name!r} itself; set {SET_BY_INFLIGHT[name]}")
        if name not in caps.engine_arg_names:
            raise VllmKwargError(name, value, f"the installed vLLM {caps.version} has no engine argument "
                                              f"{name!r}{_close(name, caps.engine_arg_names)}")
        choices = caps.choices.get(name)
        if choices is not None and isinstance(value, str) and value not in choices:
            raise VllmKwargError(name, value, f"not supported by the installed vLLM {caps.version}; it accepts "
                                              f"{sorted(choices)}{_close(value, set(choices))}")
        inner = caps.nested_arg_names.get(name)
        if inner is not None and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                if sub not in inner:
                    raise VllmKwargError(f"{name}.{sub}", sub_value, f"the installed vLLM {caps.version}'s {name} "
                                                                     f"has no {sub!r}{_close(sub, inner)}")


def _drop(data: dict[str, Any], path: str) -> Any:
    node, *rest = path.split(".")
    if not rest:
        return data.pop(node)
    value = _drop(data[node], ".".join(rest))
    if not data[node]:
        del data[node]
    return value


def merge_vllm_kwargs(kwargs: VllmKwargs, args: dict[str, Any], caps: VllmCapabilities, max_model_len: int,
                      on_cpu: bool) -> tuple[dict[str, str], list[IgnoredOption]]:
    """Merge ``kwargs`` into the engine arguments ``args`` (in place) for ``caps``; returns what each entry became
    (``applied``: path -> line) and what was ignored on CPU. Raises :class:`VllmKwargError`."""
    from rollout.options import IgnoredOption

    extra = kwargs.model_dump(exclude_none=True)
    check_names(extra, caps)
    ignored: list[IgnoredOption] = []
    if on_cpu:
        for path in [p for p in _paths(extra) if p in GPU_ONLY]:
            ignored.append(IgnoredOption(path, _drop(extra, path), GPU_ONLY[path], section=SECTION))
    applied: dict[str, str] = {}
    for name, value in extra.items():
        before = args.get(name)
        if isinstance(before, dict) and isinstance(value, dict):
            value = {**before, **value}
        args[name] = value
        note = f" (replaces {OVERRIDES[name]}: {before!r})" if name in OVERRIDES and before is not None else ""
        applied[name] = f"{name}={value!r}{note}"
    batched, seqs = args.get("max_num_batched_tokens"), args.get("max_num_seqs")
    if batched is not None and seqs is not None and batched < seqs:
        raise VllmKwargError("max_num_batched_tokens", batched, f"must be >= max_num_seqs ({seqs}): every running "
                                                                f"sequence needs a token of each step")
    if batched is not None and on_cpu and batched < max_model_len:
        raise VllmKwargError("max_num_batched_tokens", batched, f"must be >= the context length ({max_model_len}) "
                                                                f"on CPU, where prefills are not chunked (vLLM "
                                                                f"refuses to start otherwise)")
    return applied, ignored


def engine_args_object(engine_args: Mapping[str, Any]) -> Any:
    """vLLM's ``AsyncEngineArgs`` of ``engine_args``, without starting anything: vLLM builds its config classes
    (``kernel_config``, ``compilation_config``...) from nested dicts here and checks their keys and values; a
    refusal is a :class:`VllmKwargError` naming the argument."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    classes = {f.name: f.type for f in dataclasses.fields(AsyncEngineArgs)}
    for name, value in engine_args.items():
        cls = classes.get(name)
        if isinstance(value, Mapping) and isinstance(cls, type) and dataclasses.is_dataclass(cls):
            try:
                cls(**value)
            except (TypeError, ValueError) as err:
                raise VllmKwargError(name, dict(value), f"vLLM's {cls.__name__} refuses it: {_one_line(err)}") from None
    try:
        return AsyncEngineArgs(**engine_args)
    except (TypeError, ValueError) as err:
        raise VllmKwargError("", "", f"vLLM's AsyncEngineArgs refuses the engine arguments: {_one_line(err)}") from None


def _one_line(err: BaseException, limit: int = 400) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + "..."
