"""Typed configuration of the learner: Megatron parallelism and optimizer
(``policy.megatron_cfg``), sequence packing (``policy.sequence_packing``),
the GRPO loss (``loss_fn``) and the per-step GRPO options (``grpo.*``,
``policy.train_global_batch_size``). Names follow NeMo-RL."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from protocol.config_base import ConfigModel


class OptimizerConfig(ConfigModel):
    """``policy.megatron_cfg.optimizer``: AdamW through Megatron-Core's optimizer."""

    lr: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0.0)
    """Learning rate at the end of the decay."""
    weight_decay: float = Field(default=0.01, ge=0.0, le=1.0)
    """Decoupled weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Adam beta1."""
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """Adam beta2."""
    adam_eps: float = Field(default=1e-8, gt=0.0, le=1e-2)
    """Adam epsilon."""
    clip_grad: float = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up, in optimizer steps."""
    lr_warmup_init: float = Field(default=0.0, ge=0.0)
    """Learning rate the warm-up starts from (Megatron's ``init_lr``; NeMo-RL's ``scheduler.lr_warmup_init``);
    it rises linearly to ``lr`` over ``lr_warmup_steps``. Unused without warm-up."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    lr_decay_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps over which the rate decays to ``min_lr`` (warm-up included; NeMo-RL's
    ``lr_decay_iters``); a recipe that leaves it out gets ``grpo.max_num_steps`` x the optimizer steps per
    rollout batch at load. Must exceed ``lr_warmup_steps`` for a linear or cosine schedule."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer)."""

    @model_validator(mode="after")
    def _lrs(self):
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        if self.lr_warmup_init > self.lr:
            raise ValueError(f"lr_warmup_init ({self.lr_warmup_init}) must be <= lr ({self.lr})")
        return self


class MegatronConfig(ConfigModel):
    """``policy.megatron_cfg``: Megatron-Core parallelism and training settings."""

    tensor_model_parallel_size: int = Field(default=1, ge=1, le=64)
    """Tensor parallelism of the learner."""
    expert_model_parallel_size: int = Field(default=1, ge=1, le=256)
    """Expert parallelism of the learner (MoE models)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1, le=64)
    """Pipeline parallelism of the learner: stages of num_hidden_layers / PP layers each, run by Megatron-Core's
    1F1B schedule (learner.pipeline); must divide the model's layers (checked when the model is built)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (saves memory, costs time)."""
    precision: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter/compute dtype; the optimizer keeps fp32 master weights for bf16."""
    bias_activation_fusion: bool = True
    """SwiGLU as one compiled kernel forward and one backward (Megatron's ``bias_swiglu_impl``, NeMo-RL's key) on a
    GPU; the CPU runs the unfused ops, the same math. Only SwiGLU MLPs (dense and Qwen3-MoE experts) fuse:
    Nemotron-H's squared-ReLU layers ignore it."""
    moe_grouped_gemm: bool = False
    """MoE experts as grouped GEMMs (learner.grouped_experts: torch._grouped_mm over all of a rank's experts)
    instead of Megatron's loop of per-expert GEMMs; Megatron's name. Qwen3-MoE's SwiGLU and Nemotron-H's
    squared-ReLU experts; dense models ignore it."""
    freeze_moe_router: bool = False
    """Keep the MoE router's weights fixed (NeMo-RL's GRPO default: a trained router lets the engines' expert
    choice drift from the learner's); no effect on a dense model."""
    gpu_memory_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    """Cap of each rank's CUDA caching allocator, as a fraction of its GPU's memory
    (``torch.cuda.set_per_process_memory_fraction``, set as the rank picks its device): an allocation past it
    raises out-of-memory in the learner instead of taking the memory of an engine on the same GPU. None: no cap.
    Needed by ``rollout_pool.share_gpu``; no effect on CPU."""
    attention_backend: Literal["auto", "flex", "sdpa", "sdpa_batched", "local"] = "auto"
    """Core attention over packed rows (:mod:`learner.attention`): ``flex`` (flex_attention, document mask),
    ``sdpa`` (SDPA per sequence), ``sdpa_batched`` (SDPA per bucket of similar lengths, right-padded), ``local``
    (Megatron's DotProductAttention under a dense ``[T, T]`` mask: quadratic memory, for comparison); ``auto``:
    sdpa_batched on a GPU (the fastest there: fewer kernel launches), sdpa on the CPU (docs/benchmarks.md)."""
    logprob_chunk_size: int | None = Field(default=None, ge=1)
    """Positions per chunk of the output layer + log-prob + entropy (NeMo-RL's ``policy.logprob_chunk_size``):
    the fp32 logits of one chunk exist at a time, forward and backward (the chunk's logits are recomputed in
    the backward). None: the whole row at once, unless ``defer_fp32_logits``."""
    defer_fp32_logits: bool = False
    """Never hold a whole row's logits in fp32 (NeMo-RL's key): with ``logprob_chunk_size`` unset, chunks of
    ``learner.logprobs.DEFAULT_CHUNK`` positions."""
    moe_enable_routing_replay: bool = False
    """Routing replay (R3, Megatron's name): the policy's MoE routers use the experts the engine routed each
    token to (``Trajectory.routed_experts``; :mod:`learner.router_replay`) for π_prev and the training forward;
    tokens without engine routing, and the reference policy, route themselves. Needs the engines to return them
    (``policy.generation.vllm_cfg.enable_return_routed_experts``); not with pipeline stages and activation
    checkpointing together. Off by default; docs/learner.md, "Routing replay"."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""

    @model_validator(mode="after")
    def _replay_without_staged_recompute(self) -> MegatronConfig:
        if self.moe_enable_routing_replay and self.activation_checkpointing and self.pipeline_model_parallel_size > 1:
            raise ValueError("moe_enable_routing_replay with activation_checkpointing and "
                             "pipeline_model_parallel_size > 1: the 1F1B schedule's backward recomputes a micro-batch "
                             "after later forwards changed the replayed routing; turn one of them off")
        return self


class SequencePackingConfig(ConfigModel):
    """``policy.sequence_packing``: first-fit-decreasing packing into micro-batches."""

    enabled: bool = True
    """Pack several sequences into one micro-batch row."""
    train_mb_tokens: int = Field(default=10240, ge=16)
    """Token budget of one packed micro-batch."""


class LossConfig(ConfigModel):
    """``loss_fn``: GRPO clipped surrogate with importance-sampling correction and an optional k3 KL penalty
    (NeMo-RL's ``ClippedPGLossFn``; formulas in docs/learner.md, "The loss")."""

    ratio_clip_min: float = Field(default=0.2, ge=0.0, le=1.0)
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = Field(default=0.28, ge=0.0, le=10.0)
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max."""
    ratio_clip_c: float | None = Field(default=None, gt=1.0, le=1000.0)
    """Dual clip c (Ye et al. 2020): where A < 0 the surrogate is at least c·A, so a token whose ratio ran far
    above 1 adds at most c·|A| to the loss and no gradient. None: off."""
    use_importance_sampling_correction: bool = True
    """Multiply by the importance weight w = pi_prev / pi_gen (truncated as below) to correct for the engine's
    behaviour policy; False: w = 1."""
    truncated_importance_sampling_ratio: float | None = Field(default=2.0, gt=0.0)
    """c, the upper bound of the importance weight; None: the weight is not truncated (NeMo-RL's null)."""
    truncated_importance_sampling_ratio_min: float | None = Field(default=None, ge=0.0)
    """Lower bound of the importance weight: tis clamps it from below (None: 0), icepop keeps weights in
    [ratio_min, c] (None: [1/c, c]). Needs ``truncated_importance_sampling_ratio``."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] = "tis"
    """tis: w = clamp(ratio, ratio_min, c). icepop: w = ratio inside [ratio_min, c], 0 outside (token masked).
    seq-mask-tis (NeMo-RL): a sequence whose geometric-mean ratio exp(mean_t log ratio) is outside
    [ratio_min, c] gets w = 0 on every token (they stay in N); the others keep the raw, untruncated ratio.
    Needs both bounds (NeMo-RL's reference: 0.999, 1.002)."""
    geo_rs_ratio_max: float | None = Field(default=None, ge=1.0, le=100.0)
    """Geometric rejection sampling (verl's ``rollout_rs: geometric``, ``rollout_rs_threshold``): a sequence whose
    geometric-mean pi_prev / pi_gen lies above it is rejected, out of the loss and N (typical: 1.0002-1.001).
    None: off."""
    geo_rs_ratio_min: float | None = Field(default=None, gt=0.0, le=1.0)
    """Lower bound of geometric rejection sampling (verl's ``rollout_rs_threshold_lower``); None: 1 /
    ``geo_rs_ratio_max``. Needs ``geo_rs_ratio_max``."""
    opsm_delta: float | None = Field(default=None, ge=0.0, le=100.0)
    """Off-policy sequence masking (slime/miles ``--opsm-delta``, DeepSeek-V3.2): a sequence with advantage < 0
    whose mean log(pi_gen / pi_prev) over its trained tokens exceeds it is rejected, out of the loss and N
    (slime's example: 1e-4). None: off."""
    force_on_policy_ratio: bool = False
    """pi_prev := pi_theta, detached: the ratio is exactly 1 and the clip never binds (NeMo-RL). Needs one
    optimizer step per rollout batch (``policy.train_global_batch_size`` None or the whole batch), where
    pi_prev is that forward anyway; the importance weight is then pi_theta / pi_gen."""
    reference_policy_kl_penalty: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL to the reference (initial) policy; 0 disables the reference model."""
    kl_input_clamp_value: float | None = Field(default=20.0, gt=0.0)
    """log(pi_ref / pi_theta) is clamped to [-v, v] before the k3 formula (a token where it binds has no KL
    gradient); None: no clamp."""
    kl_output_clamp_value: float | None = Field(default=10.0, gt=0.0)
    """The per-token KL term is clamped to [-v, v] (no gradient where it binds); None: no clamp."""

    @model_validator(mode="after")
    def _truncation_bounds(self):
        lo, hi = self.truncated_importance_sampling_ratio_min, self.truncated_importance_sampling_ratio
        if lo is not None and hi is None:
            raise ValueError(f"truncated_importance_sampling_ratio_min ({lo}) needs "
                             f"truncated_importance_sampling_ratio (None: the weight is not truncated)")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"truncated_importance_sampling_ratio_min ({lo}) must be <= "
                             f"truncated_importance_sampling_ratio ({hi})")
        if self.truncated_importance_sampling_type == "seq-mask-tis" and (lo is None or hi is None):
            raise ValueError(f"truncated_importance_sampling_type seq-mask-tis needs both bounds of the geometric-mean "
                             f"ratio, got truncated_importance_sampling_ratio_min {lo} and "
                             f"truncated_importance_sampling_ratio {hi} (NeMo-RL's reference: 0.999 and 1.002)")
        if self.truncated_importance_sampling_type == "seq-mask-tis" and not self.use_importance_sampling_correction:
            raise ValueError("truncated_importance_sampling_type seq-mask-tis needs use_importance_sampling_correction "
                             "true (NeMo-RL refuses it too)")
        if self.geo_rs_ratio_min is not None and self.geo_rs_ratio_max is None:
            raise ValueError(f"geo_rs_ratio_min ({self.geo_rs_ratio_min}) needs geo_rs_ratio_max (None: geometric "
                             f"rejection sampling is off)")
        return self


class RewardScalingConfig(ConfigModel):
    """``grpo.reward_scaling``: a linear map of every reward, after clamping (NeMo-RL's ``scale_rewards``)."""

    enabled: bool = False
    """r -> target_min + (clamp(r, source_min, source_max) - source_min) / (source_max - source_min)
    x (target_max - target_min), before reward shaping and advantages."""
    source_min: float = 0.0
    """Low end of the rewards' range; lower rewards are clamped to it."""
    source_max: float = 1.0
    """High end of the rewards' range; higher rewards are clamped to it."""
    target_min: float = 0.0
    """What ``source_min`` maps to."""
    target_max: float = 1.0
    """What ``source_max`` maps to."""

    @model_validator(mode="after")
    def _ranges(self):
        if not self.source_max > self.source_min:
            raise ValueError(f"source_max ({self.source_max}) must be > source_min ({self.source_min})")
        if not self.target_max > self.target_min:
            raise ValueError(f"target_max ({self.target_max}) must be > target_min ({self.target_min}): an equal "
                             f"or reversed range gives every answer the same reward or ranks worse answers higher")
        return self


class RewardShapingConfig(ConfigModel):
    """``grpo.reward_shaping``: DAPO's overlong penalty, or a factor for truncated answers (NeMo-RL's
    ``apply_reward_shaping``), applied after scaling and before advantages."""

    enabled: bool = False
    """Shape the rewards (the raw ones stay in ``reward_*`` metrics, the shaped ones in ``shaped_reward_*``)."""
    overlong_buffer_length: int | None = Field(default=None, ge=1)
    """L_buf: answers longer than ``max_response_length - L_buf`` tokens lose
    ``(length - (max_response_length - L_buf)) / L_buf x overlong_buffer_penalty``."""
    overlong_buffer_penalty: float | None = Field(default=None, ge=0.0)
    """The penalty at ``max_response_length`` tokens (it keeps growing linearly past it)."""
    max_response_length: int | None = Field(default=None, ge=1)
    """L_max of the penalty, in response tokens."""
    stop_properly_penalty_coef: float | None = Field(default=None, ge=0.0, le=1.0)
    """When set, replaces the overlong penalty: the reward of an answer cut at the length limit
    (``finish_reason == "length"``) is multiplied by it (0: no reward, 1: no penalty)."""

    @model_validator(mode="after")
    def _complete(self):
        if not self.enabled or self.stop_properly_penalty_coef is not None:
            return self
        buf, top = self.overlong_buffer_length, self.max_response_length
        if buf is None or self.overlong_buffer_penalty is None or top is None:
            missing = [k for k in ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
                       if getattr(self, k) is None]
            raise ValueError(f"enabled with stop_properly_penalty_coef None (the overlong penalty) needs "
                             f"{', '.join(missing)}")
        if buf > top:
            raise ValueError(f"overlong_buffer_length ({buf}) must be <= max_response_length ({top})")
        return self


class GrpoStepKeys(ConfigModel):
    """The ``grpo.*`` keys a training step applies, declared here once: the recipe's ``grpo`` section
    (``services.recipe.grpo.GrpoConfig``) inherits them and hands them to the learner whole
    (:meth:`TrainStepConfig.of`)."""

    use_leave_one_out_baseline: bool = False
    """Baseline of a sample = mean reward of the other samples of its group (RLOO) instead of the group mean."""
    overlong_filtering: bool = False
    """Truncated samples (``finish_reason == "length"``) keep their place in their group's baseline but are masked
    out of the loss."""
    seq_logprob_error_threshold: float | None = Field(default=None, ge=1.0)
    """NeMo-RL's sequence-level log-prob error masking: a sample whose mean exp(|log pi_prev - log pi_gen|) over its
    trained tokens exceeds it keeps its place in its group's baseline but is masked out of the loss and N, counted
    as ``seq_masked_logprob_error`` (NeMo-RL's Nemotron recipes: 2). None: off."""
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    """Linear map of the rewards with clamping (DAPO: {0, 1} -> {-1, 1}), before shaping and advantages."""
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    """DAPO's overlong penalty (or a factor for truncated answers), after scaling, before advantages."""


class PolicyStepKeys(ConfigModel):
    """The ``policy.*`` keys a training step applies, declared here once: the recipe's ``policy`` section
    (``services.recipe.config.PolicyConfig``) inherits them."""

    train_global_batch_size: int | None = Field(default=None, ge=1)
    """Samples per optimizer step; the rollout batch (``grpo.num_prompts_per_step x num_generations_per_prompt``)
    must be a multiple of it. None: the whole rollout batch is one optimizer step."""


@dataclass(frozen=True)
class SamplingDist:
    """How the engine turned logits into the distribution it sampled from (``policy.generation``)."""

    temperature: float = 1.0
    """Logits are divided by it first (> 0)."""
    top_k: int | None = None
    """Only the ``top_k`` largest logits stay (ties with the k-th stay too); None: no top-k."""
    top_p: float = 1.0
    """Only the smallest set of most likely tokens whose probability reaches ``top_p`` stays; 1: no top-p."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature: {self.temperature} must be > 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k: {self.top_k} must be >= 1 or None")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1]")

    @property
    def neutral(self) -> bool:
        """Whether this is the plain softmax (temperature 1, no filter): the logits pass unchanged."""
        return self.temperature == 1.0 and self.top_k is None and self.top_p == 1.0

    @property
    def filters(self) -> bool:
        """Whether a top-k or top-p filter applies."""
        return self.top_k is not None or self.top_p < 1.0


class TrainStepConfig(GrpoStepKeys, PolicyStepKeys):
    """The options one :meth:`learner.trainer.Learner.train_step` applies: the ``grpo.*`` and ``policy.*`` keys of
    its bases, and the distribution the engine sampled from."""

    sampling: SamplingDist = Field(default_factory=SamplingDist)
    """``policy.generation.temperature``, ``top_k``, ``top_p``: the distribution the engine sampled from, under
    which π_prev, π_θ and π_ref of the training step are scored (as NeMo-RL's learner does); the parity probe
    compares the plain softmax."""

    @classmethod
    def of(cls, grpo: GrpoStepKeys, policy: PolicyStepKeys, sampling: SamplingDist) -> TrainStepConfig:
        """Every key of ``grpo`` and ``policy`` that a step applies (each section may be the recipe's larger one,
        which inherits these keys), with ``sampling``."""
        taken = {name: getattr(grpo, name) for name in GrpoStepKeys.model_fields}
        taken.update({name: getattr(policy, name) for name in PolicyStepKeys.model_fields})
        return cls(**taken, sampling=sampling)
