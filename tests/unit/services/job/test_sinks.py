"""W&B (offline) and MLflow (local file store) get every metrics row with its step and the recipe, read back
from what each wrote; a sink that cannot start warns once and the others still get the rows. No Ray."""
from __future__ import annotations

import glob
import json
import struct

import pytest

from services.recipe.config import Recipe
from services.job.run_log import RunLog

ROWS = [{"step": 0, "val_reward_mean": 0.25},
        {"step": 1, "reward_mean": 0.5, "loss": 1.5, "skip_reason": "text is not logged", "gen_kl_error": float("nan")},
        {"step": 2, "reward_mean": 0.75, "loss": 1.25, "val_reward_mean": 0.5}]
EXPECTED = {"val_reward_mean": [(0, 0.25), (2, 0.5)], "reward_mean": [(1, 0.5), (2, 0.75)],
            "loss": [(1, 1.5), (2, 1.25)]}


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    for k, v in {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
                 "WANDB_DISABLE_CODE": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default


def _recipe(**logger) -> Recipe:
    r = Recipe()
    r.logger = r.logger.model_validate({"tensorboard_enabled": False, "wandb_enabled": True, "mlflow_enabled": True,
                                        **logger})
    return r


def _write(tmp_path, recipe: Recipe) -> RunLog:
    log = RunLog(tmp_path, recipe.logger.tensorboard_enabled, recipe.logger, recipe.model_dump(mode="json"))
    for row in ROWS:
        log.write(row)
    log.close()
    return log


def _wandb_records(path: str):
    """The protobuf records of an offline ``.wandb`` file (LevelDB log format: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL / FIRST start a record, MIDDLE / LAST continue it
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _wandb_history(run_dir) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((rec.history.step.num, json.loads(item.value_json)))
        elif kind == "run":
            config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.run.config.update}
    return history, config


def _mlflow_history(uri: str, experiment: str) -> tuple[dict[str, list[tuple[int, float]]], dict, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
               for k in run.data.metrics}
    return history, run.data.params, run.info.status


def test_every_row_reaches_wandb_and_mlflow_with_its_step_and_the_recipe_is_the_run_config(tmp_path):
    recipe = _recipe(wandb={"project": "p", "name": "n1"}, mlflow={"experiment_name": "e1", "run_name": "r1"})
    _write(tmp_path, recipe)
    history, config = _wandb_history(tmp_path)
    assert history == EXPECTED  # NaN and text values are left out, like TensorBoard
    assert config["grpo"]["max_num_steps"] == recipe.grpo.max_num_steps
    ml, params, status = _mlflow_history(f"file:{tmp_path / 'mlruns'}", "e1")  # the default store
    assert ml == EXPECTED
    assert params["grpo.max_num_steps"] == str(recipe.grpo.max_num_steps) and status == "FINISHED"


def test_a_sink_that_cannot_start_warns_once_and_the_others_get_every_row(tmp_path, caplog):
    recipe = _recipe(tensorboard_enabled=True, mlflow={"tracking_uri": "nosuchscheme://nowhere"})
    with caplog.at_level("WARNING"):
        _write(tmp_path, recipe)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "MLflow could not start" in warnings[0], warnings
    assert _wandb_history(tmp_path)[0] == EXPECTED
    assert glob.glob(str(tmp_path / "tensorboard" / "events.*"))
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_sink_whose_write_fails_warns_once_and_the_others_get_every_row(tmp_path, caplog, monkeypatch):
    from services.job import sinks

    def broken(self, step, scalars):
        raise OSError("tracking server went away")

    monkeypatch.setattr(sinks.MlflowSink, "write", broken)
    with caplog.at_level("WARNING"):
        _write(tmp_path, _recipe())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "MLflow failed writing step 0" in warnings[0], warnings
    assert _wandb_history(tmp_path)[0] == EXPECTED
