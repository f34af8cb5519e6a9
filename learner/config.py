"""Typed configuration of the learner: Megatron parallelism and optimizer
(``policy.megatron_cfg``), sequence packing (``policy.sequence_packing``),
the GRPO loss (``loss_fn``) and the per-step GRPO options (``grpo.*``,
``policy.train_global_batch_size``). Names follow NeMo-RL."""
from __future__ import annotations

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
        return self


class MegatronConfig(ConfigModel):
    """``policy.megatron_cfg``: Megatron-Core parallelism and training settings."""

    tensor_model_parallel_size: int = Field(default=1, ge=1, le=64)
    """Tensor parallelism of the learner."""
    expert_model_parallel_size: int = Field(default=1, ge=1, le=256)
    """Expert parallelism of the learner (MoE models)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1, le=64)
    """Pipeline parallelism of the learner (only 1 is supported so far)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (saves memory, costs time)."""
    precision: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter/compute dtype; the optimizer keeps fp32 master weights for bf16."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""

    @model_validator(mode="after")
    def _pp(self):
        if self.pipeline_model_parallel_size != 1:
            raise ValueError("pipeline_model_parallel_size: only 1 is supported by this learner")
        return self


class SequencePackingConfig(ConfigModel):
    """``policy.sequence_packing``: first-fit-decreasing packing into micro-batches."""

    enabled: bool = True
    """Pack several sequences into one micro-batch row."""
    train_mb_tokens: int = Field(default=10240, ge=16)
    """Token budget of one packed micro-batch."""


class LossConfig(ConfigModel):
    """``loss_fn``: GRPO clipped surrogate with importance-sampling correction."""

    ratio_clip_min: float = Field(default=0.2, ge=0.0, le=1.0)
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = Field(default=0.28, ge=0.0, le=10.0)
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max."""
    use_importance_sampling_correction: bool = True
    """Multiply by w = min(pi_prev / pi_gen, c) to correct for the engine's behaviour policy."""
    truncated_importance_sampling_ratio: float = Field(default=2.0, gt=0.0)
    """c, the truncation of the importance weight."""
    truncated_importance_sampling_type: Literal["tis", "icepop"] = "tis"
    """tis: w = min(ratio, c). icepop: w = ratio inside [1/c, c], 0 outside (token masked)."""
    reference_policy_kl_penalty: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL to the reference (initial) policy; 0 disables the reference model."""


class TrainStepConfig(ConfigModel):
    """The GRPO options one :meth:`learner.trainer.Learner.train_step` applies (``grpo.*``,
    ``policy.train_global_batch_size``)."""

    train_global_batch_size: int | None = Field(default=None, ge=1)
    """Samples per optimizer step; the rollout batch (every trajectory, failed ones included) must be a
    multiple of it. None: the whole batch is one optimizer step."""
    use_leave_one_out_baseline: bool = False
    """A sample's baseline is the mean reward of the other valid samples of its group (RLOO)."""
    overlong_filtering: bool = False
    """Samples with ``finish_reason == "length"`` keep their reward in the group's baseline but contribute
    no token to the loss."""
