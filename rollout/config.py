"""Typed configuration of generation (``policy.generation``), NeMo-RL names.

:class:`GenerationConfig` holds the sampling settings, deadlines and retries;
:class:`VllmConfig` (``policy.generation.vllm_cfg``) the engine options that
:mod:`rollout.options` maps onto vLLM; :class:`ColocatedConfig` whether the
engines share the learner's devices. The docstring under each field is its
description in ``inflight validate --explain``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from protocol.config_base import ConfigModel


class ServingChatKwargs(ConfigModel):
    """The parsers of the pool's ``/v1/chat/completions``: tool calls and reasoning read out of the model's text.

    ``policy.generation.vllm_cfg.http_server_serving_chat_kwargs``, NeMo-RL's key; vLLM's own parsers."""

    enable_auto_tools: bool = False
    """Let the model decide to call tools (``tool_choice: "auto"``); needs ``tool_parser``. Named and
    ``required`` tool choices work without it (vLLM constrains the output to the tool's JSON schema)."""
    tool_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """vLLM's tool-call parser for the model's format (e.g. ``hermes``, ``llama3_json``, ``qwen3_coder``)."""
    reasoning_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """vLLM's reasoning parser (e.g. ``qwen3``, ``deepseek_r1``): the answer's thinking is returned apart, as
    ``reasoning`` and ``reasoning_content``. None: the whole text is the answer's ``content``."""

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ServingChatKwargs:
        if self.enable_auto_tools and self.tool_parser is None:
            raise ValueError("enable_auto_tools needs tool_parser (the model's tool-call format, e.g. hermes)")
        return self


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
    (``rollout.install.direct_load``); False: always ``reload_weights``."""
    enable_return_routed_experts: bool = False
    """Return the experts each position was routed to (vLLM's name; rollout/routed_experts.py: on CPU through
    rollout/cpu_routed_experts.py; needs ``enable_prefix_caching``, so not for a hybrid Mamba model on CPU), carried
    by each trajectory for routing replay (``policy.megatron_cfg.moe_enable_routing_replay``). Off by default."""
    expose_http_server: bool = False
    """Serve OpenAI's ``POST /v1/chat/completions`` and ``GET /v1/models`` from the pool's engines at the current
    policy version, for agents (docs/agents.md); callers need the pool's serving key (docs/security.md)."""
    http_server_serving_chat_kwargs: ServingChatKwargs = Field(default_factory=ServingChatKwargs)
    """Tool-call and reasoning parsers of ``/v1/chat/completions`` (with ``expose_http_server``)."""


class KernelKwargs(ConfigModel):
    """``policy.generation.vllm_kwargs.kernel_config``: vLLM's ``KernelConfig`` (other keys pass to it unchanged and
    are checked against the installed vLLM's)."""

    model_config = ConfigDict(extra="allow")
    moe_backend: str | None = None
    """Fused-MoE kernel (``KernelConfig.moe_backend``, e.g. ``flashinfer_cutlass`` on Hopper/Blackwell); a GPU
    kernel: ignored on CPU. None: vLLM picks."""
    enable_flashinfer_autotune: bool | None = None
    """Let FlashInfer time its kernel variants at engine start and keep the fastest (longer start, faster
    decode); GPU only: ignored on CPU. None: vLLM's default."""


class VllmKwargs(ConfigModel):
    """``policy.generation.vllm_kwargs``: extra vLLM engine arguments; any other key passes through, checked.

    NeMo-RL's key: vLLM's ``AsyncEngineArgs``. The fields are the seed recipes' tuned stack; any other key passes
    to vLLM unchanged, checked against the installed vLLM (:mod:`rollout.vllm_kwargs`, docs/rollout.md
    "Engine options")."""

    model_config = ConfigDict(extra="allow")
    max_num_seqs: int | None = Field(default=None, ge=1, le=65536)
    """Most sequences an engine runs at once; replaces ``vllm_cfg.max_num_seqs`` when set."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Most tokens one engine step schedules (prefill + decode). On CPU, where prefills are not chunked, it must
    be >= the context length. None: vLLM's default."""
    all2all_backend: str | None = None
    """All-to-all of expert parallelism (``ParallelConfig.all2all_backend``, e.g.
    ``flashinfer_nvlink_one_sided``); GPU collectives: ignored on CPU."""
    kernel_config: KernelKwargs | None = None
    """vLLM's kernel choices (``KernelConfig``): ``moe_backend`` (the fused-MoE kernel, e.g. ``flashinfer_cutlass``)
    and ``enable_flashinfer_autotune`` (FlashInfer times its kernel variants at start and keeps the fastest); both
    GPU only, ignored on CPU. Other ``KernelConfig`` keys pass through, checked."""
    mamba_ssm_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    """Dtype of a hybrid model's Mamba state; replaces Inflight's float32 for hybrids when set."""
    limit_mm_per_prompt: dict[str, Any] | None = None
    """Most items of each modality per prompt, e.g. ``{image: 1}``; vLLM sizes its encoder memory for this many.
    Replaces Inflight's ``{image: 8, video: 0}`` for vision-language models when set."""
    skip_mm_profiling: bool | None = None
    """Skip vLLM's memory profiling of the multimodal encoder at start (faster start; the encoder's peak memory
    is then not reserved)."""


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
    bad_words: list[str] = Field(default_factory=list)
    """Words never sampled (vLLM ``SamplingParams.bad_words``: each word's tokens, with and without a leading
    space, are masked when they would complete it). Training scores the answers under the unmasked policy."""
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    """Deadline for one sample attempt; an attempt that exceeds it is aborted in the engine and retried."""
    max_retries: int = Field(default=2, ge=0, le=10)
    """Times a failed or timed-out sample is regenerated before it is dropped with a reason."""
    colocated: ColocatedConfig = Field(default_factory=lambda: ColocatedConfig())
    """Whether generation shares the learner's devices (NeMo-RL ``policy.generation.colocated``)."""
    vllm_cfg: VllmConfig = Field(default_factory=lambda: VllmConfig())
    """Engine options."""
    vllm_kwargs: VllmKwargs = Field(default_factory=lambda: VllmKwargs())
    """Extra vLLM engine arguments, passed through (NeMo-RL's key and meaning), checked against the installed
    vLLM."""

    @property
    def tempered(self) -> bool:
        """Whether ``temperature``, ``top_k`` or ``top_p`` make the sampled distribution differ from the model's
        softmax (then the engine reports, and the learner scores, log-probs under the sampled one)."""
        return self.temperature != 1.0 or self.top_k is not None or self.top_p != 1.0

    @property
    def group_deadline_s(self) -> float:
        """Longest the pool may take to answer a group: every sample may need all its attempts, plus a minute."""
        return self.request_timeout_s * (self.max_retries + 1) + 60.0

    @model_validator(mode="after")
    def _sampling(self):
        if self.temperature == 0.0:
            raise ValueError("temperature: GRPO needs temperature > 0 (answers of a group must differ)")
        return self
