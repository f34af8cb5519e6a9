"""Typed configuration of generation (``policy.generation``), NeMo-RL names.

:class:`GenerationConfig` holds the sampling settings, deadlines and retries;
:class:`VllmConfig` (``policy.generation.vllm_cfg``) the engine options that
:mod:`rollout.options` maps onto vLLM; :class:`ColocatedConfig` whether the
engines share the learner's devices. The docstring under each field is its
description in ``inflight validate --explain``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from protocol.config_base import ConfigModel


class VllmConfig(ConfigModel):
    """``policy.generation.vllm_cfg``: options of each vLLM engine."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs per engine for tensor parallelism (vLLM ``tensor_parallel_size``)."""
    expert_parallel_size: int = Field(default=1, ge=1, le=64)
    """Expert parallelism inside an engine; > 1 sets vLLM ``enable_expert_parallel`` (MoE models only)."""
    pipeline_parallel_size: int = Field(default=1, ge=1, le=16)
    """Pipeline stages per engine (vLLM ``pipeline_parallel_size``)."""
    enforce_eager: bool = False
    """True: eager PyTorch. False: torch.compile and, on GPU, CUDA graphs (``compilation_config.cudagraph_mode``)."""
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    """Most sequences an engine runs at once (vLLM ``SchedulerConfig.max_num_seqs``)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length of the engine; default: ``policy.max_total_sequence_length``."""
    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=0.98)
    """Fraction of GPU memory vLLM may take (ignored on CPU)."""
    cpu_kvcache_space_gib: float = Field(default=1.0, gt=0.0, le=512)
    """KV-cache size on CPU in GiB (exported as ``VLLM_CPU_KVCACHE_SPACE``; required on CPU)."""
    moe_backend: Literal["auto", "triton", "flashinfer_cutlass", "flashinfer_trtllm", "cutlass", "marlin"] = "auto"
    """Fused-MoE kernel (vLLM ``KernelConfig.moe_backend``); ``flashinfer_cutlass`` on Hopper/Blackwell."""
    all2all_backend: Literal["auto", "allgather_reducescatter", "naive", "pplx", "deepep_high_throughput",
                             "deepep_low_latency", "flashinfer_all2allv",
                             "flashinfer_nvlink_one_sided"] = "auto"
    """All-to-all for expert parallelism (vLLM ``ParallelConfig.all2all_backend``)."""
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Engine dtype. The CPU recipe uses float32 so that engine and learner log-probs agree tightly."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching; the prefix cache is reset after every weight update."""
    seed: int = Field(default=0, ge=0)
    """Sampling seed of the engine (per-request seeds derive from it)."""
    direct_weight_load: bool = True
    """Collective refit: install pushes with vLLM's plain ``load_weights`` once the first push has proven it
    gives the same tensors as the layerwise ``reload_weights`` for this model, and with one foreach copy into
    the parameters once a copy plan recorded on that push is proven equal to plain load
    (``rollout.direct_load``); False: always ``reload_weights``."""


class ColocatedConfig(ConfigModel):
    """``policy.generation.colocated``."""

    enabled: bool = True
    """True: generation shares the learner's devices (sync baseline). Async requires False."""


class GenerationConfig(ConfigModel):
    """``policy.generation``: sampling and engine settings."""

    backend: Literal["vllm"] = "vllm"
    """Generation backend; only vLLM."""
    max_new_tokens: int = Field(default=4096, ge=1)
    """Most tokens sampled per answer."""
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    """Sampling temperature; GRPO needs > 0 so that a group's answers differ."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int | None = Field(default=None, ge=1)
    """Top-k sampling; None disables it."""
    stop_strings: list[str] = Field(default_factory=list)
    """Extra strings that end an answer (EOS always does)."""
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    """Deadline for one sample attempt; an attempt that exceeds it is aborted in the engine and retried."""
    max_retries: int = Field(default=2, ge=0, le=10)
    """Times a failed or timed-out sample is regenerated before it is dropped with a reason."""
    colocated: ColocatedConfig = Field(default_factory=lambda: ColocatedConfig())
    """Whether generation shares the learner's devices (NeMo-RL ``policy.generation.colocated``)."""
    vllm_cfg: VllmConfig = Field(default_factory=lambda: VllmConfig())
    """Engine options."""

    @property
    def group_deadline_s(self) -> float:
        """Longest the pool may take to answer a group: every sample may need all its attempts, plus a minute."""
        return self.request_timeout_s * (self.max_retries + 1) + 60.0

    @model_validator(mode="after")
    def _sampling(self):
        if self.temperature == 0.0:
            raise ValueError("temperature: GRPO needs temperature > 0 (answers of a group must differ)")
        return self
