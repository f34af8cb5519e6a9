"""Typed configuration of a learner job's checkpoints (``checkpointing``, NeMo-RL names; ``save_hf`` is NeMo-RL's
``save_consolidated``): where they go, how often, which are kept, and whether each also gets a Hugging Face copy."""
from __future__ import annotations

from pydantic import Field, field_validator

from protocol.config_base import ConfigModel

NEMO_RL_METRICS = {"val:accuracy": "val_reward_mean", "val:pass_k": "val_pass_at_k", "train:reward": "reward_mean",
                   "train:loss": "loss", "train:grad_norm": "grad_norm", "val_reward": "val_reward_mean"}
"""NeMo-RL's ``checkpointing.metric_name`` ("val:" or "train:" and a key of its metrics) -> the step row's key
with the same meaning. NeMo-RL's ``val:accuracy`` is the mean reward over every validation answer, which is
``val_reward_mean`` here (``val_accuracy`` counts first answers with reward >= 1 - 1e-6; with 0/1 rewards and one
answer per prompt the two are equal); its ``pass_k`` counts a reward > 0 as correct, ``val_pass_at_k`` >= 1 - 1e-6.
``val_reward`` is older NeMo-RL recipes' spelling of ``val:accuracy`` (the checkpoint state's ``val_reward`` is
``val_metrics["accuracy"]``)."""


def from_nemo_rl_metric(name: str) -> str:
    """The step row's key for NeMo-RL's metric name ``name``; ``ValueError`` listing the known ones otherwise."""
    if name in NEMO_RL_METRICS:
        return NEMO_RL_METRICS[name]
    raise ValueError(f"NeMo-RL metric {name!r} has no counterpart in Inflight's step row; known: "
                     f"{', '.join(f'{k} -> {v}' for k, v in NEMO_RL_METRICS.items())}")


class CheckpointingConfig(ConfigModel):
    """``checkpointing``: learner state on disk (NeMo-RL names)."""

    enabled: bool = True
    """Save checkpoints."""
    checkpoint_dir: str = "results/checkpoints"
    """Where checkpoints go (relative paths are under the run directory)."""
    save_period: int = Field(default=10, ge=1)
    """Save every N steps (and at the end)."""
    keep_top_k: int = Field(default=2, ge=1)
    """Checkpoints kept: the best ``keep_top_k`` by ``metric_name`` (NeMo-RL semantics), or the most recent ones
    when ``metric_name`` is not set. The newest is always kept as well, so a run can resume."""
    metric_name: str | None = None
    """Metric of the step row that ranks checkpoints, e.g. ``val_reward_mean`` or ``val_accuracy`` (NeMo-RL's
    ``val:accuracy`` form is an error that names the key to use; older NeMo-RL recipes' ``val_reward`` means
    ``val_reward_mean``)."""
    higher_is_better: bool = True
    """Whether a larger ``metric_name`` is better."""
    save_hf: bool = False
    """Also write a Hugging Face directory (safetensors, config, tokenizer) at every save, as ``step_<k>/hf``."""

    @field_validator("metric_name")
    @classmethod
    def _row_key(cls, v: str | None) -> str | None:
        if v is not None and ":" not in v and v in NEMO_RL_METRICS:
            return NEMO_RL_METRICS[v]  # an older NeMo-RL spelling (val_reward)
        if v is not None and ":" in v:
            hint = f"use {NEMO_RL_METRICS[v]!r}" if v in NEMO_RL_METRICS else \
                f"NeMo-RL's names: {', '.join(f'{k} -> {n}' for k, n in NEMO_RL_METRICS.items())}"
            raise ValueError(f"{v!r} is NeMo-RL's 'val:'/'train:' form; expected a key of the step row ({hint})")
        return v
