"""The optional metric sinks of a run besides ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow.

Each gets every row's finite numeric values with the row's step (:meth:`Sink.write`); W&B and MLflow also get the
recipe once, as the run's config / params. :class:`services.job.run_log.RunLog` owns them: a sink that cannot
start or fails a write is reported once and dropped, and the run goes on.

W&B runs offline unless ``WANDB_MODE`` is set (files under RUN_DIR/wandb; ``wandb sync`` uploads them later).
MLflow defaults to the local file store ``file:RUN_DIR/mlruns`` (allowed with ``MLFLOW_ALLOW_FILE_STORE``, which
MLflow 3 otherwise refuses since it only needs the ``mlflow-skinny`` client, no database).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from services.recipe.logger import LoggerConfig

MLFLOW_PARAM_BATCH = 100
"""MLflow's limit on params per ``log_batch`` call."""
MLFLOW_PARAM_VALUE_CHARS = 6000
"""MLflow's limit on a param value's length."""


class Sink(Protocol):
    name: str

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    name = "TensorBoard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    name = "W&B"

    def __init__(self, run_dir: Path, cfg: LoggerConfig, params: dict[str, Any]):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or run_dir.resolve().name,
                               dir=str(run_dir), mode=os.environ.get("WANDB_MODE") or "offline",  # type: ignore[arg-type]
                               config=params, reinit="create_new",
                               settings=wandb.Settings(console="off", silent=True))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # stops the wandb-core process this run started


class MlflowSink:
    name = "MLflow"

    def __init__(self, run_dir: Path, cfg: LoggerConfig, params: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.mlflow.tracking_uri or f"file:{(run_dir / 'mlruns').resolve()}"
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(cfg.mlflow.experiment_name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(cfg.mlflow.experiment_name)
        self.run_id = client.create_run(exp_id, run_name=cfg.mlflow.run_name or run_dir.resolve().name).info.run_id
        flat = [Param(k, str(v)[:MLFLOW_PARAM_VALUE_CHARS]) for k, v in sorted(_flatten(params).items())]
        for i in range(0, len(flat), MLFLOW_PARAM_BATCH):
            client.log_batch(self.run_id, params=flat[i:i + MLFLOW_PARAM_BATCH])
        client.log_dict(self.run_id, params, "recipe.json")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def sink_factories(run_dir: Path, tensorboard: bool, cfg: LoggerConfig | None,
                   params: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, zero-argument constructor) of each enabled sink, in the order they are opened."""
    out: list[tuple[str, Any]] = []
    if tensorboard:
        out.append((TensorBoardSink.name, lambda: TensorBoardSink(run_dir)))
    if cfg is not None and cfg.wandb_enabled:
        out.append((WandbSink.name, lambda: WandbSink(run_dir, cfg, params)))
    if cfg is not None and cfg.mlflow_enabled:
        out.append((MlflowSink.name, lambda: MlflowSink(run_dir, cfg, params)))
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``policy.generation.temperature``); lists as JSON."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out
