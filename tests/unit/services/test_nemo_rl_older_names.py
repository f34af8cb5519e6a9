"""Older NeMo-RL spellings and NeMo-RL's sliding-puzzle recipe (issues 32.7, 33.7): ``data.add_system_prompt`` and
``vllm_cfg.enable_expert_parallel`` mapped to their meaning, ``metric_name: val_reward`` the validation reward, and
the sliding-puzzle environment refused with the true reason (NeMo-RL's own script plays it on puzzles it makes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.recipe.config import RecipeError, is_recipe_key, load_recipe_with_report
from services.recipe.nemo_rl.rules import translate
from services.recipe.nemo_rl.table import TABLE
from services.recipe.files import read_recipe

PUZZLE = Path(__file__).resolve().parents[2] / "data" / "nemo_rl" / "grpo_sliding_puzzle.yaml"


def test_the_sliding_puzzle_recipe_has_no_unknown_key_and_its_older_names_keep_their_meaning():
    out, report = translate(read_recipe(PUZZLE), TABLE, is_recipe_key, strict=False)
    assert report.unknown == []  # data.add_system_prompt and vllm_cfg.enable_expert_parallel were unknown
    assert out["data"]["system_prompt_file"] is None  # add_system_prompt: false -> no system turn
    assert out["policy"]["generation"]["vllm_cfg"]["expert_parallel_size"] == 1  # enable_expert_parallel: false
    assert out["checkpointing"]["metric_name"] == "val_reward_mean"  # val_reward: the validation accuracy
    assert {m.source for m in report.mapped} >= {"data.add_system_prompt",
                                                 "policy.generation.vllm_cfg.enable_expert_parallel"}


def test_its_environment_is_refused_with_the_true_reason():
    with pytest.raises(RecipeError) as err:
        load_recipe_with_report(PUZZLE, ["policy.generation.top_p=1.0", "policy.generation.top_k=null"])
    assert err.value.path == "env.sliding_puzzle_game"
    assert "run_grpo_sliding_puzzle.py" in err.value.reason and "Inflight has no such environment" in err.value.reason


def test_add_system_prompt_true_keeps_the_system_prompt_file_and_false_contradicts_one():
    def system_prompt(add: bool) -> tuple[object, list[str]]:
        data = read_recipe(PUZZLE, [f"data.add_system_prompt={str(add).lower()}",
                                    "data.default.system_prompt_file=sys.txt"])
        data.pop("env")
        out, report = translate(data, TABLE, is_recipe_key, strict=False)
        return out["data"].get("system_prompt_file"), [str(e) for e in report.errors if "system_prompt" in str(e)]

    assert system_prompt(True) == ("sys.txt", [])
    _, errors = system_prompt(False)
    assert any("data.system_prompt_file" in e and "sys.txt" in e for e in errors)
