"""Typed configuration of the algorithm's sizes and schedule (``grpo``, NeMo-RL names): prompts and answers per step,
steps and epochs, baselines, dynamic sampling, multi-turn episodes, sequence masking, validation, and lag-1
asynchronous mode (``grpo.async_grpo``)."""
from __future__ import annotations

from pydantic import Field, model_validator

from learner.config import GrpoStepKeys
from protocol.config_base import ConfigModel


class AsyncGrpoConfig(ConfigModel):
    """``grpo.async_grpo``: lag-1 asynchronous GRPO."""

    enabled: bool = False
    """Overlap generation of later steps with training of step k (requires non-colocated generation)."""
    max_trajectory_age_steps: int = Field(default=1, ge=1, le=64)
    """A: generation runs up to A steps ahead of training (prompts of step k+A are scheduled when step k starts,
    so a trained group is A versions old in steady state), and a group holding a token more than A policy
    versions older than the step is dropped and replaced. 1 is lag-1 ("1-off") async GRPO."""
    in_flight_weight_updates: bool = True
    """Push new weights without draining running requests (pause(keep) -> load -> resume)."""
    recompute_kv_cache_after_weight_updates: bool = False
    """After an in-flight update, recompute the KV cache of running requests with the new weights."""


class GrpoConfig(GrpoStepKeys):
    """``grpo``: the algorithm's sizes and schedule; the keys a training step applies (baselines, filtering,
    sequence masking, reward scaling and shaping) are inherited from :class:`learner.config.GrpoStepKeys`."""

    num_prompts_per_step: int = Field(default=64, ge=1, le=65536)
    """Prompts (groups) trained per step."""
    num_generations_per_prompt: int = Field(default=16, ge=2, le=4096)
    """Group size G: answers sampled per prompt (>= 2: advantages compare answers of a group)."""
    max_num_steps: int = Field(default=100, ge=1)
    """Training steps to run."""
    normalize_rewards: bool = True
    """Divide group-centred rewards by the group's std (+1e-6); False keeps only the centring."""
    seed: int = Field(default=42, ge=0)
    """Seed of data order, sampling and initialisation."""
    max_consecutive_skipped_steps: int = Field(default=3, ge=1, le=1000)
    """Learner steps in a row that may be skipped (non-finite loss or gradient, no valid tokens) before the job
    stops with the learner's reason; a skipped step trains nothing, pushes nothing and drops its prompts as
    ``step_skipped``."""
    max_num_epochs: int | None = Field(default=None, ge=1)
    """Passes over the training rows; the run ends at ``max_num_steps`` or after this many epochs, whichever is
    first. None: as many as ``max_num_steps`` needs."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal (zero advantage) is dropped and its prompt
    replaced by a fresh one until the step has ``num_prompts_per_step`` groups with signal."""
    dynamic_sampling_max_gen_batches: int = Field(default=10, ge=1, le=1000)
    """Bound of dynamic sampling: at most this many times ``num_prompts_per_step`` prompts are tried for one step;
    past it the step trains on what it has and ``dynamic_sampling_exhausted`` is counted."""
    max_rollout_turns: int = Field(default=1, ge=1, le=64)
    """Sampled turns per episode of a multi-turn environment (``env.<name>.environment``); an episode the
    environment has not ended by then is truncated (``env.<name>.truncated_reward``). 1: single-turn."""
    val_period: int = Field(default=0, ge=0)
    """Validate every N steps (0: never)."""
    val_at_start: bool = False
    """Validate once before the first step (step 0)."""
    max_val_samples: int = Field(default=256, ge=1)
    """Validation prompts used (the first ones of the validation set)."""
    val_batch_size: int = Field(default=64, ge=1)
    """Validation prompts submitted to the pool at once."""
    val_num_generations: int = Field(default=1, ge=1, le=1024)
    """Answers per validation prompt; k of pass@k."""
    val_temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    """Sampling temperature of validation; 0 is greedy (then ``val_num_generations`` must be 1)."""
    async_grpo: AsyncGrpoConfig = Field(default_factory=AsyncGrpoConfig)
    """Asynchronous (lag-1) mode."""

    @model_validator(mode="after")
    def _val_sampling(self):
        if self.val_temperature == 0.0 and self.val_num_generations > 1:
            raise ValueError(f"val_num_generations ({self.val_num_generations}) > 1 needs val_temperature > 0 "
                             f"(greedy answers of one prompt are all the same)")
        return self
