"""Rules for NeMo-RL's ``logger.*``, ``checkpointing.*``, ``cluster.*`` and its other top-level sections
(``reward_penalties``, ``data_plane``, ``on_policy_distillation``).

Keys with Inflight's name and meaning pass through unchanged (no rule): ``logger.{log_dir, tensorboard_enabled,
wandb_enabled, mlflow_enabled}``, ``logger.wandb.{project, name}``, ``logger.mlflow.{experiment_name, run_name,
tracking_uri}``, ``checkpointing.{enabled, checkpoint_dir, save_period, keep_top_k, higher_is_better}``,
``cluster.{gpus_per_node, num_nodes}``. A feature Inflight lacks is accepted only while it is off
(:class:`NeutralOnly`); the settings of a feature that is off are ignored.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.recipe.checkpointing import from_nemo_rl_metric
from services.recipe.nemo_rl.policy_rules import nemo_rl
from services.recipe.nemo_rl.rules import (
    Derive,
    Ignore,
    NeutralOnly,
    Path,
    Rename,
    Rule,
    Source,
    TranslationError,
    When,
)


def _metric(value: Any) -> Any:
    if value is None:
        return None
    try:
        return from_nemo_rl_metric(value)
    except ValueError as e:
        raise TranslationError("checkpointing.metric_name", str(e)) from None


def _refuse(path: Path, why: str) -> Callable[[Any, Source], list[tuple[Path, Any]]]:
    """A :class:`Derive` function for a section whose presence alone is unsupported: any key under it is an error."""
    def fn(value: Any, src: Source) -> list[tuple[Path, Any]]:
        raise TranslationError(path, why)
    return fn


LOGGER_RULES: dict[Path, Rule] = {
    "logger.num_val_samples_to_print": Ignore("NeMo-RL prints validation conversations on the terminal; Inflight "
                                              "prints none (validation numbers go to the step row)"),
    "logger.monitor_gpus": Ignore("NeMo-RL's GPU utilisation and memory metrics; Inflight logs none (read them with "
                                  "nvidia-smi or DCGM)"),
    "logger.gpu_monitoring.*": Ignore("intervals of NeMo-RL's GPU monitoring, which Inflight does not have"),
    "logger.swanlab_enabled": NeutralOnly((False,), "SwanLab logging is not supported (TensorBoard, W&B and MLflow "
                                                    "are)"),
    "logger.swanlab.*": Ignore("the SwanLab run's names; SwanLab is off (logger.swanlab_enabled)"),
    "logger.tensorboard": Ignore("NeMo-RL's TensorBoard options (none set); Inflight writes TensorBoard events "
                                 "under RUN_DIR/tensorboard"),
    "logger.tensorboard.log_dir": Ignore("TensorBoard's directory; Inflight writes its events under "
                                         "RUN_DIR/tensorboard"),
    "logger.wandb.log_nemo_gym_full_result_tables": Ignore("W&B tables of NeMo-Gym results; Inflight has no "
                                                           "NeMo-Gym environment"),
    "logger.wandb.entity": NeutralOnly((None,), "the W&B team is not a recipe key here; set WANDB_ENTITY"),
    "logger.mlflow.run_id": NeutralOnly((None,), "continuing an existing MLflow run is not supported (a new run "
                                                 "starts)"),
    "logger.mlflow.artifact_location": NeutralOnly((None,), "MLflow's artifact location follows "
                                                            "logger.mlflow.tracking_uri here"),
}

CHECKPOINT_RULES: dict[Path, Rule] = {
    "checkpointing.metric_name": When(nemo_rl, Rename("checkpointing.metric_name", _metric), None,
                                      "NeMo-RL's 'val:<key>' / 'train:<key>' form, in a NeMo-RL recipe"),
    "checkpointing.save_consolidated": Rename("checkpointing.save_hf"),
    "checkpointing.model_save_format": Ignore("the file format of NeMo-RL's DTensor weights (safetensors or "
                                              "torch_save); Inflight's checkpoints have one format of their own, "
                                              "and checkpointing.save_hf writes safetensors"),
    "checkpointing.save_optimizer": NeutralOnly((True,), "Inflight's checkpoints always hold the optimizer state, "
                                                         "which a resume needs"),
    "checkpointing.checkpoint_must_save_by": NeutralOnly((None,), "a wall-clock deadline for a last checkpoint "
                                                                  "(and stop) is not implemented"),
    "checkpointing.ft_save_period": NeutralOnly((None,), "NeMo-RL's extra fault-tolerance checkpoints are not "
                                                         "implemented (checkpointing.save_period is the period)"),
    "checkpointing.ft_keep_latest_k": NeutralOnly((None,), "NeMo-RL's extra fault-tolerance checkpoints are not "
                                                           "implemented (the newest checkpoint is always kept)"),
    "checkpointing.pretrained_checkpoint.*": Derive(
        _refuse("checkpointing.pretrained_checkpoint", "starting from a Megatron checkpoint is not supported (the "
                                                       "weights come from policy.model_name); expected no such key"),
        "starting weights from a Megatron checkpoint"),
    "checkpointing.model_cache_dir": Ignore("NeMo-RL's Automodel cache for safetensors checkpoints"),
    "checkpointing.model_repo_id": Ignore("NeMo-RL's Automodel repository id for safetensors checkpoints"),
    "checkpointing.is_async": NeutralOnly((False,), "asynchronous checkpoint writing is not implemented"),
}

CLUSTER_RULES: dict[Path, Rule] = {
    "cluster.master_port_range_low": Ignore("ports of NeMo-RL's torch.distributed rendezvous; Inflight's "
                                            "processes find their own through Ray"),
    "cluster.master_port_range_high": Ignore("ports of NeMo-RL's torch.distributed rendezvous; Inflight's "
                                             "processes find their own through Ray"),
    "cluster.segment_size": Ignore("NeMo-RL's placement of workers by NVLink domain segment; Inflight's placement "
                                   "groups place workers by node"),
}

OTHER_RULES: dict[Path, Rule] = {
    "reward_penalties.penalize_duplicated_reasoning": NeutralOnly((False,), "NeMo-Gym's reward-zeroing penalties "
                                                                            "are not implemented"),
    "reward_penalties.penalize_empty_final_answer": NeutralOnly((False,), "NeMo-Gym's reward-zeroing penalties "
                                                                          "are not implemented"),
    "reward_penalties.penalize_unwanted_tokens": NeutralOnly((False,), "NeMo-Gym's reward-zeroing penalties are "
                                                                       "not implemented"),
    "reward_penalties.penalize_malformed_think_tag": NeutralOnly((False,), "NeMo-Gym's reward-zeroing penalties "
                                                                           "are not implemented"),
    "reward_penalties.token_ids": Ignore("token ids for the reward penalties, which are all off"),
    "reward_penalties.token_ids.*": Ignore("token ids for the reward penalties, which are all off"),
    "data_plane.enabled": NeutralOnly((False,), "NeMo-RL's TransferQueue data plane (its grpo_train_sync trainer); "
                                                "Inflight's trajectories travel through its own channel"),
    "data_plane.*": Ignore("settings of NeMo-RL's TransferQueue data plane, which is off (data_plane.enabled)"),
    "on_policy_distillation": NeutralOnly((None,), "multi-teacher on-policy distillation is not implemented"),
    "on_policy_distillation.*": Derive(
        _refuse("on_policy_distillation", "is set: multi-teacher on-policy distillation is not implemented (expected "
                                          "null)"), "multi-teacher on-policy distillation"),
}

RUN_RULES: dict[Path, Rule] = {**LOGGER_RULES, **CHECKPOINT_RULES, **CLUSTER_RULES, **OTHER_RULES}
"""Rules for NeMo-RL's ``logger.*``, ``checkpointing.*``, ``cluster.*`` and other top-level sections."""
SAME_MEANING = ("logger.log_dir", "logger.tensorboard_enabled", "logger.wandb_enabled", "logger.mlflow_enabled",
                "logger.wandb.project", "logger.wandb.name", "logger.mlflow.experiment_name", "logger.mlflow.run_name",
                "logger.mlflow.tracking_uri", "checkpointing.enabled", "checkpointing.checkpoint_dir",
                "checkpointing.save_period", "checkpointing.keep_top_k", "checkpointing.higher_is_better",
                "cluster.gpus_per_node", "cluster.num_nodes")
"""Keys of these sections with no rule: Inflight's keys of the same name and meaning. Two differ in detail:
NeMo-RL makes ``logger.log_dir/exp_<n>`` per run where Inflight's ``log_dir`` is the run directory, and a relative
``checkpoint_dir`` is under the run directory here, under the working directory there."""
