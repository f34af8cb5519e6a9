"""NeMo-RL's ``policy.logprob_chunk_size`` and ``policy.megatron_cfg.defer_fp32_logits`` reach the learner (issue 35):
chunked log-probs that never hold a whole row's fp32 logits (learner/logprobs.py)."""
from __future__ import annotations

import json
from pathlib import Path

from services.recipe.config import load_recipe_with_report

MEGATRON = Path(__file__).resolve().parents[2] / "data" / "nemo_rl" / "grpo_math_1B_megatron.yaml"


def test_logprob_chunk_size_and_defer_fp32_logits_are_honoured(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 448, "eos_token_id": 2,
                                                      "max_position_embeddings": 16384}))
    overrides = [f"policy.model_name={tmp_path}", "policy.logprob_chunk_size=1024",
                 "policy.megatron_cfg.defer_fp32_logits=true"]
    recipe, report = load_recipe_with_report(MEGATRON, overrides)
    m = recipe.policy.megatron_cfg
    assert (m.logprob_chunk_size, m.defer_fp32_logits) == (1024, True)
    ignored = {i.source for i in report.ignored}
    assert not ignored & {"policy.logprob_chunk_size", "policy.megatron_cfg.defer_fp32_logits"}
