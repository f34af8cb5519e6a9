"""NeMo-RL's ``policy.router_replay.enabled`` is routing replay on both sides (issue 37, item 1): true turns on the
learner's ``moe_enable_routing_replay`` and the engines' ``enable_return_routed_experts``, false leaves both off
(the default); the learner's switch without the engines' is refused naming both keys, and so is a recipe that sets
the engines' off beside ``router_replay.enabled: true``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.recipe.config import load_recipe_with_report

MEGATRON = Path(__file__).resolve().parents[2] / "data" / "nemo_rl" / "grpo_math_1B_megatron.yaml"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("moe")
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4, "vocab_size": 448}))
    return str(out)


@pytest.mark.parametrize("enabled", [True, False])
def test_router_replay_reaches_the_learner_and_the_engines(moe, enabled):
    recipe, report = load_recipe_with_report(MEGATRON, [f"policy.model_name={moe}",
                                                        f"policy.router_replay.enabled={str(enabled).lower()}"])
    assert recipe.policy.megatron_cfg.moe_enable_routing_replay is enabled
    assert recipe.policy.generation.vllm_cfg.enable_return_routed_experts is enabled
    assert not any(i.source == "policy.router_replay.enabled" for i in report.ignored)


def test_the_learner_cannot_replay_what_the_engines_do_not_return(moe):
    with pytest.raises(Exception, match="moe_enable_routing_replay requires .*enable_return_routed_experts"):
        load_recipe_with_report(MEGATRON, [f"policy.model_name={moe}",
                                           "policy.megatron_cfg.moe_enable_routing_replay=true"])
    with pytest.raises(Exception, match="router_replay.enabled: maps to .*enable_return_routed_experts = True"):
        load_recipe_with_report(MEGATRON, [f"policy.model_name={moe}", "policy.router_replay.enabled=true",
                                           "policy.generation.vllm_cfg.enable_return_routed_experts=false"])
