"""NeMo-RL's ``data.*`` / ``env.*`` (services/recipe/nemo_rl/table_data.py) and ``logger.*`` / ``checkpointing.*`` /
``cluster.*`` / other top-level keys (services/recipe/nemo_rl/table_run.py) on NeMo-RL's own recipes: every leaf has a
rule or is an Inflight key of the same meaning, the translated sections validate as Inflight's models, the named
datasets map to their Hub ids and columns, and each refusal names the key, its value and what was expected."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from services.recipe.config import is_recipe_key
from services.recipe.checkpointing import CheckpointingConfig
from services.recipe.data import DataConfig, EnvConfig
from services.recipe.logger import LoggerConfig
from services.recipe.nemo_rl import table_data, table_run
from services.recipe.nemo_rl.rules import TranslationError, find_rule, leaves, translate
from services.recipe.nemo_rl.table_data import DATA_RULES
from services.recipe.nemo_rl.table_run import RUN_RULES
from services.recipe.files import read_recipe

DATA = Path(__file__).resolve().parents[2] / "data" / "nemo_rl"
FIXTURES = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.yaml"))
OTHERS = ("grpo", "loss_fn", "policy")
"""Sections other tables own."""
RULES = {**DATA_RULES, **RUN_RULES}
SAME = (*table_data.SAME_MEANING, *table_run.SAME_MEANING)
TEXT_FIXTURES = [f for f in FIXTURES if not f.startswith("grpo_sliding_puzzle")]
"""The recipes of a data set, text or images (the sliding puzzle fails on its game: test_nemo_rl_older_names.py)."""
BASE = {"policy": {"dtensor_cfg": {"enabled": True}, "max_total_sequence_length": 4096},
        "data": {"train": {"dataset_name": "OpenMathInstruct-2"}, "default": {"env_name": "math"}},
        "env": {"math": {"num_workers": 4}}}
"""A minimal NeMo-RL recipe (``policy.dtensor_cfg`` makes it one) for the single-key cases."""


is_inflight_key = is_recipe_key


def part(name: str) -> dict:
    """This table's sections of a fixture, plus the two policy keys its rules read."""
    data = read_recipe(DATA / name)
    out = {k: copy.deepcopy(v) for k, v in data.items() if k not in OTHERS}
    out["policy"] = {k: data["policy"][k] for k in ("dtensor_cfg", "max_total_sequence_length")}
    return out


def translated(data: dict) -> tuple[dict, Any]:
    return translate(data, RULES, is_inflight_key)


def with_(**sections: Any) -> dict:
    """``BASE`` with ``sections`` merged over it (dotted keys)."""
    out = copy.deepcopy(BASE)
    for dotted, value in sections.items():
        node = out
        *head, last = dotted.split("__")
        for p in head:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def test_the_fixtures_have_every_section():
    assert {"recipes/llm/dapo-qwen2.5-7b.v2.yaml", "vlm_grpo_3B_megatron.yaml"} <= set(FIXTURES)
    assert set(part("grpo_math_1B.yaml")) == {"data", "env", "logger", "checkpointing", "cluster", "reward_penalties",
                                              "data_plane", "on_policy_distillation", "policy"}


@pytest.mark.parametrize("name", FIXTURES)
def test_every_leaf_has_a_rule_or_is_the_same_inflight_key(name):
    for path, _ in leaves(part(name)):
        if path.startswith("policy."):
            continue
        if find_rule(RULES, path) is None:
            assert path in SAME, f"{name}: {path} has no rule and is not listed as the same key"
            assert is_inflight_key(path), f"{name}: {path} is listed as the same key but Inflight has no such key"


@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_each_leaf_is_mapped_kept_or_ignored_with_a_reason(name):
    data = part(name)
    _, report = translated(data)
    mine = [p for p, _ in leaves(data) if not p.startswith("policy.")]   # policy.* is the policy table's
    unknown = [p for p in report.unknown if not p.startswith("policy.")]
    assert unknown == [], f"{name}: keys neither ruled nor Inflight's: {unknown}"
    accounted = set(report.kept) | {m.source for m in report.mapped} | {i.source for i in report.ignored}
    assert set(mine) <= accounted
    assert all(item.why for item in report.ignored)


@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_the_translated_sections_validate(name):
    out, _ = translated(part(name))
    DataConfig.model_validate(out["data"])
    EnvConfig.model_validate(out["env"])
    LoggerConfig.model_validate(out["logger"])
    CheckpointingConfig.model_validate(out["checkpointing"])
    assert set(out) <= {"data", "env", "logger", "checkpointing", "cluster", "policy"}


def test_same_meaning_keys_are_inflight_keys_without_rules():
    for path in SAME:
        assert is_inflight_key(path), path
        assert find_rule(RULES, path) is None, path


def test_grpo_math_1b_data_is_openmathinstruct2_on_the_hub_with_its_hold_out():
    out, report = translated(part("grpo_math_1B.yaml"))
    assert out["data"] == {
        "shuffle": True, "train_data_path": "hf://nvidia/OpenMathInstruct-2", "train_split": "train_1M",
        "input_key": "problem", "output_key": "expected_answer", "task_columns": [], "split_validation_size": 0.05,
        "split_validation_seed": 42, "prompt_file": "examples/prompts/cot.txt", "system_prompt_file": None,
        "env_name": "math"}
    assert out["env"] == {"math": {"num_workers": 8, "math_verify_impl": "hf_math_verify"}}
    ignored = {i.source: i.why for i in report.ignored}
    assert "math_hf_data_processor" in ignored["data.default.processor"]
    assert "upper bound" in ignored["data.max_input_seq_length"]      # 512 = the whole sequence: Inflight's default
    assert out["checkpointing"]["metric_name"] == "val_reward_mean"   # val:accuracy = mean validation reward
    assert out["checkpointing"]["save_hf"] is False                  # save_consolidated
    assert out["cluster"] == {"gpus_per_node": 1, "num_nodes": 1}
    assert {"cluster.master_port_range_low", "cluster.segment_size", "logger.monitor_gpus", "data_plane.backend",
            "reward_penalties.token_ids", "on_policy_distillation", "logger.tensorboard"} <= set(ignored)


def test_dapo_data_is_the_dapo_sets_scored_by_dapo_math_verify():
    out, report = translated(part("recipes/llm/dapo-qwen2.5-7b.v2.yaml"))
    d = out["data"]
    assert (d["train_data_path"], d["train_split"]) == ("hf://BytedTsinghua-SIA/DAPO-Math-17k", "train")
    assert (d["val_data_path"], d["val_split"]) == ("hf://BytedTsinghua-SIA/AIME-2024", "train")
    assert (d["input_key"], d["output_key"], d["task_columns"]) == ("prompt.0.content", "reward_model.ground_truth",
                                                                   [])
    assert d["prompt_file"] is None and d["max_input_seq_length"] == 2047  # NeMo-RL masks >= 2048, here > 2047
    assert "split_validation_size" not in d                           # DAPOMath17K ignores it in NeMo-RL too
    ignored = {i.source for i in report.ignored}
    assert {"data.train.split_validation_size", "data.train.seed"} <= ignored
    env = EnvConfig.model_validate(out["env"]).named["math"]
    assert env.math_verify_impl == "dapo_math_verify" and [f.name for f in env.reward_functions] == \
        ["dapo_math_verify"] and env.num_workers == 16


def test_vlm_recipe_is_clevr_cogent_on_the_hub_with_its_image_column():
    out, report = translated(part("vlm_grpo_3B_megatron.yaml"))
    d = out["data"]
    assert (d["train_data_path"], d["train_split"]) == ("hf://MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train")
    assert (d["val_data_path"], d["val_split"]) == ("hf://MMInstruction/Clevr_CoGenT_ValA", "train")
    assert (d["input_key"], d["output_key"], d["image_key"], d["task_columns"]) == ("problem", "solution", "image", [])
    assert {m.source for m in report.mapped if m.target == "data.image_key"} == {"data.default.processor"}
    env = EnvConfig.model_validate(out["env"]).named["clevr-cogent"]  # NeMo-RL's format / exact_alnum, 0.2 / 0.8
    assert [(f.name, f.weight) for f in env.reward_functions] == [("tag_format", 0.2), ("exact_alnum", 0.8)]
    assert DataConfig.model_validate(d).image_key == "image"


def test_a_local_copy_of_a_named_set_replaces_the_hub(tmp_path):
    out, report = translated(with_(data__train={"dataset_name": "clevr-cogent", "split": "valB",
                                                "data_path": str(tmp_path), "processor": "vlm_hf_data_processor"}))
    d = out["data"]
    assert (d["train_data_path"], d["image_key"], d["output_key"]) == (str(tmp_path), "image", "solution")
    assert "train_split" not in d and "data.train.split" in {i.source for i in report.ignored}


@pytest.mark.parametrize("train, path, match", [
    ({"dataset_name": "clevr-cogent"}, "data.train.dataset_name",
     "'default': clevr-cogent is a vision-language dataset; expected vlm_hf_data_processor"),
    ({"dataset_name": "OpenMathInstruct-2", "processor": "vlm_hf_data_processor"}, "data.train.processor",
     "OpenMathInstruct-2 is a text dataset; expected default"),
    ({"data_path": "rows.jsonl", "processor": "vlm_hf_data_processor"}, "data.train.processor",
     "on a data_path dataset: its image column is not known here"),
])
def test_the_image_processor_must_fit_the_dataset(train, path, match):
    with pytest.raises(TranslationError, match=match) as e:
        translated(with_(data__train=train))
    assert e.value.path == path


@pytest.mark.parametrize("rewards, path, match", [
    ([{"name": "geo3k", "weight": 1.0}], "env.clevr-cogent.reward_functions.0.name", "'geo3k': expected one of"),
    ([{"name": "format", "weight": 1.0, "kwargs": {"think_tag": "t"}}], "env.clevr-cogent.reward_functions.0.kwargs",
     "reads the <think>/<answer> tags only"),
])
def test_vlm_rewards_without_a_counterpart_are_refused(rewards, path, match):
    data = with_(data__train={"dataset_name": "clevr-cogent", "processor": "vlm_hf_data_processor"},
                 data__default={"env_name": "clevr-cogent"}, env={"clevr-cogent": {"reward_functions": rewards}})
    with pytest.raises(TranslationError, match=match) as e:
        translated(data)
    assert e.value.path == path


@pytest.mark.parametrize("name, hub, split, cols", [
    ("OpenMathInstruct-2", "hf://nvidia/OpenMathInstruct-2", "train_1M", ("problem", "expected_answer")),
    ("DAPOMath17K", "hf://BytedTsinghua-SIA/DAPO-Math-17k", "train", ("prompt.0.content", "reward_model.ground_truth")),
    ("DAPOMathAIME2024", "hf://BytedTsinghua-SIA/AIME-2024", "train", ("prompt.0.content",
                                                                       "reward_model.ground_truth")),
    ("AIME2024", "hf://HuggingFaceH4/aime_2024", "train", ("problem", "answer")),
    ("DeepScaler", "hf://agentica-org/DeepScaleR-Preview-Dataset", "train", ("problem", "answer")),
])
def test_named_datasets_map_to_their_hub_ids_and_columns(name, hub, split, cols):
    out, _ = translated(with_(data__train={"dataset_name": name}))
    d = out["data"]
    assert (d["train_data_path"], d["train_split"], d["input_key"], d["output_key"]) == (hub, split, *cols)
    assert d["task_columns"] == []


def test_openmathinstruct2_split_output_key_and_default_hold_out():
    out, _ = translated(with_(data__train={"dataset_name": "OpenMathInstruct-2", "split": "train_2M",
                                           "output_key": "generated_answer"}))
    d = out["data"]
    assert (d["train_split"], d["output_key"], d["split_validation_size"], d["split_validation_seed"]) == \
        ("train_2M", "generated_answer", 0.05, 42)                    # the class's defaults: 0.05, seed 42
    with pytest.raises(TranslationError, match=r"data.train.split: 'test': OpenMathInstruct-2 has the splits "
                                               r"train, train_1M, train_2M, train_5M"):
        translated(with_(data__train={"dataset_name": "OpenMathInstruct-2", "split": "test"}))


@pytest.mark.parametrize("train, path, match", [
    ({"dataset_name": "squad"}, "data.train.dataset_name",
     "'squad' is not a NeMo-RL dataset Inflight knows; expected one of OpenMathInstruct-2, DAPOMath17K"),
    ({"dataset_name": "geometry3k"}, "data.train.dataset_name", "vision-language datasets other than clevr-cogent"),
    ({"dataset_name": "OpenMathInstruct-2", "repeat": 2}, "data.train.repeat",
     "2: a NeMo-RL dataset option Inflight does not have"),
    ({"dataset_name": "OpenMathInstruct-2", "processor": "sft_processor"}, "data.train.processor",
     "'sft_processor': .*expected one of default, math_hf_data_processor, vlm_hf_data_processor"),
    ({"dataset_name": "OpenMathInstruct-2", "subset": "x"}, "data.train.subset", "'x': .*expected null"),
    ({"data_path": "/no/such/file"}, "data.train.data_path", "no such file or directory"),
    ({"data_path": "rows.txt"}, "data.train.data_path", ".txt files are not read here"),
])
def test_dataset_refusals_name_key_value_and_expected(train, path, match):
    with pytest.raises(TranslationError, match=match) as e:
        translated(with_(data__train=train))
    assert e.value.path == path


def test_several_datasets_are_refused_one_in_a_list_is_read():
    with pytest.raises(TranslationError, match="a list of 2 datasets.*expected one dataset") as e:
        translated(with_(data__train=[{"dataset_name": "AIME2024"}, {"dataset_name": "DeepScaler"}]))
    assert e.value.path == "data.train"
    out, report = translated(with_(data__train=[{"dataset_name": "AIME2024"}]))
    assert out["data"]["train_data_path"] == "hf://HuggingFaceH4/aime_2024"
    assert {m.source for m in report.mapped} >= {"data.train"}


def test_a_data_path_dataset_keeps_its_columns_and_hold_out(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"question": "1+1", "answer": "2"}\n')
    out, _ = translated(with_(data__train={"data_path": str(rows), "input_key": "question", "output_key": "answer",
                                           "split_validation_size": 0.1, "seed": 3},
                              data__default={"dataset_name": "ResponseDataset", "env_name": "math",
                                             "prompt_file": None}))
    assert out["data"] == {"train_data_path": str(rows), "input_key": "question", "output_key": "answer",
                           "split_validation_size": 0.1, "split_validation_seed": 3, "prompt_file": None,
                           "env_name": "math"}
    out, _ = translated(with_(data__train={"data_path": "org/some-set", "split": "train_a"}))
    assert (out["data"]["train_data_path"], out["data"]["train_split"]) == ("hf://org/some-set", "train_a")


def test_training_and_validation_sets_must_share_columns():
    with pytest.raises(TranslationError, match="gives data.input_key = 'problem', but data.train.dataset_name "
                                               "gives 'prompt.0.content'") as e:
        translated(with_(data__train={"dataset_name": "DAPOMath17K"}, data__validation={"dataset_name": "AIME2024"}))
    assert e.value.path == "data.validation.dataset_name"


def test_max_input_seq_length_below_the_sequence_is_kept_minus_one():
    out, _ = translated(with_(data__max_input_seq_length=1024))
    assert out["data"]["max_input_seq_length"] == 1023
    out, report = translated(with_(data__max_input_seq_length=4096))
    assert "max_input_seq_length" not in out["data"]
    assert "data.max_input_seq_length" in {i.source for i in report.ignored}


def test_env_sections_no_dataset_names_are_ignored_and_the_used_one_is_checked():
    out, report = translated(with_(env__code={"num_workers": 2}, env__mystery={"x": 1}))
    assert out["env"] == {"math": {"num_workers": 4}}
    assert {"env.code.num_workers", "env.mystery.x"} <= {i.source for i in report.ignored}
    for env, path, match in [({"math_verify_impl": "sympy"}, "env.math.math_verify_impl",
                              "'sympy': expected one of hf_math_verify, dapo_math_verify"),
                             ({"stop_strings": ["</answer>"]}, "env.math.stop_strings",
                              "not supported for the math environment \\(expected null\\)"),
                             ({"verifier_type": "english_multichoice"}, "env.math.verifier_type", "null or math"),
                             ({"frobnicate": 1}, "env.math.frobnicate", "not an option of NeMo-RL's math")]:
        with pytest.raises(TranslationError, match=match) as e:
            translated(with_(env__math=env))
        assert e.value.path == path


def test_inflight_env_keys_on_a_nemo_rl_recipe_pass_through():
    functions = [{"name": "format", "weight": 0.2}, {"name": "math_verify", "weight": 0.8}]
    out, _ = translated(with_(env__math={"num_workers": 2, "timeout_s": 5, "reward_functions": functions}))
    assert out["env"] == {"math": {"num_workers": 2, "timeout_s": 5, "reward_functions": functions}}


@pytest.mark.parametrize("key, value, match", [
    ("logger__swanlab_enabled", True, "True is not supported \\(SwanLab logging is not supported.*expected False"),
    ("data_plane__enabled", True, "TransferQueue data plane.*expected False"),
    ("reward_penalties__penalize_empty_final_answer", True, "reward-zeroing penalties.*expected False"),
    ("checkpointing__checkpoint_must_save_by", "00:03:45:00", "wall-clock deadline.*expected None"),
    ("checkpointing__save_optimizer", False, "always hold the optimizer state.*expected True"),
    ("data__use_multiple_dataloader", True, "one dataloader per dataset.*expected False"),
    ("on_policy_distillation", {"teachers": []}, "multi-teacher on-policy distillation"),
    ("on_policy_distillation", {"teachers": [{"model": "x"}]}, "multi-teacher on-policy distillation"),
])
def test_features_inflight_lacks_are_refused_when_on(key, value, match):
    with pytest.raises(TranslationError, match=match) as e:
        translated(with_(**{key: value}))
    assert e.value.path.startswith(key.replace("__", ".").split(".")[0])


@pytest.mark.parametrize("nemo, inflight", [("val:accuracy", "val_reward_mean"), ("val:pass_k", "val_pass_at_k"),
                                            ("train:reward", "reward_mean"), ("train:loss", "loss"), (None, None),
                                            ("val_reward", "val_reward_mean")])
def test_checkpoint_metric_names_take_inflight_names(nemo, inflight):
    out, _ = translated(with_(checkpointing__metric_name=nemo))
    assert out["checkpointing"]["metric_name"] == inflight


def test_the_older_val_reward_spelling_means_the_validation_reward_in_any_recipe():
    """Issue 32.7: older NeMo-RL recipes write ``metric_name: val_reward`` (the checkpoint state's validation
    accuracy); it was refused."""
    assert CheckpointingConfig(metric_name="val_reward").metric_name == "val_reward_mean"
    assert CheckpointingConfig(metric_name="val_accuracy").metric_name == "val_accuracy"


def test_an_unknown_nemo_rl_metric_lists_the_known_ones():
    with pytest.raises(TranslationError, match="'val:avg_length' has no counterpart.*val:accuracy -> val_reward_mean"):
        translated(with_(checkpointing__metric_name="val:avg_length"))
    with pytest.raises(ValueError, match="NeMo-RL's 'val:'/'train:' form.*use 'val_reward_mean'"):
        CheckpointingConfig(metric_name="val:accuracy")


def test_an_inflight_recipe_passes_these_sections_unchanged():
    data = read_recipe(DATA.parents[2] / "recipes" / "math-jsonl-cpu.yaml")
    out, report = translated(data)
    for section in ("data", "env", "checkpointing", "logger"):
        assert out[section] == data[section], section
    assert report.ignored == [] and report.mapped == []
