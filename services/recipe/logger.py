"""Typed configuration of where a run's metrics go (``logger``): ``metrics.jsonl`` always, TensorBoard, Weights &
Biases (``logger.wandb``) and MLflow (``logger.mlflow``), each optional; plus the gen KL parity probe's
thresholds. Key names follow NeMo-RL (``logger.wandb_enabled``, ``logger.wandb.project``, ...)."""
from __future__ import annotations

from pydantic import Field

from protocol.config_base import ConfigModel


class WandbConfig(ConfigModel):
    """``logger.wandb``: the Weights & Biases run (files under RUN_DIR/wandb). Offline unless the environment
    sets ``WANDB_MODE`` (``online`` syncs live; an offline run is uploaded later with ``wandb sync``)."""

    project: str = Field(default="inflight", min_length=1)
    """W&B project."""
    name: str | None = None
    """W&B run name; default the run directory's name."""


class MlflowConfig(ConfigModel):
    """``logger.mlflow``: the MLflow run."""

    experiment_name: str = Field(default="inflight", min_length=1)
    """MLflow experiment (created if missing)."""
    run_name: str | None = None
    """MLflow run name; default the run directory's name."""
    tracking_uri: str | None = None
    """Tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db``, ``file:/path``); default the
    local file store ``file:RUN_DIR/mlruns`` (read it with ``mlflow ui --backend-store-uri RUN_DIR/mlruns``)."""


class LoggerConfig(ConfigModel):
    """``logger``: where metrics go."""

    tensorboard_enabled: bool = True
    """Write TensorBoard events under RUN_DIR/tensorboard."""
    wandb_enabled: bool = False
    """Log every metrics row (with its step) and the recipe (as the run config) to Weights & Biases."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases run."""
    mlflow_enabled: bool = False
    """Log every metrics row (with its step) and the recipe (as params and ``recipe.json``) to MLflow."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """MLflow run."""
    log_dir: str = "runs/latest"
    """Run directory (metrics.jsonl, plots, checkpoints)."""
    parity_probe_sequences: int = Field(default=4, ge=0)
    """Fixed sequences (prompt tokens + a fixed continuation) scored by the learner and by every engine installed
    since it was last probed, after the first push and after each refit (gen KL parity probe); 0 disables it."""
    parity_max_gen_kl: float = Field(default=0.01, gt=0.0)
    """Largest gen KL the probe accepts after a refit. Above it the engine is not serving the learner's
    weights (e.g. a load path that scrambles fused tensors): the job pushes once more and, if the probe
    still fails, stops with ``ParityError``. Measured: ~1e-11 float32 on CPU; on H200 in bf16 ~5e-5 (dense
    0.6B) and 2.6e-6 (small MoE, FlashInfer CUTLASS)."""
    parity_max_gen_kl_ratio: float = Field(default=20.0, ge=0.0)
    """Also fail the probe when gen KL exceeds this multiple of the median of the last 5 accepted refits
    (baseline at least 1e-6): a wrong install can stay under ``parity_max_gen_kl`` on a model with
    near-uniform outputs (measured on H200, random MoE, wrong vs right path: 3.0e-4 vs 2.6e-6 = 115x, and in another
    run 3.3e-4 vs 9.5e-6 = 34x); 0 disables."""
