"""Typed configuration of a learner job's checkpoints (``checkpointing``, NeMo-RL names; ``save_hf`` is NeMo-RL's
``save_consolidated``): where they go, how often, which are kept, and whether each also gets a Hugging Face copy."""
from __future__ import annotations

from pydantic import Field

from protocol.config_base import ConfigModel


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
    """Metric of the step row that ranks checkpoints, e.g. ``val_reward_mean`` or ``val_accuracy``."""
    higher_is_better: bool = True
    """Whether a larger ``metric_name`` is better."""
    save_hf: bool = False
    """Also write a Hugging Face directory (safetensors, config, tokenizer) at every save, as ``step_<k>/hf``."""
