"""Routing replay and sequence masking through the real async loop on CPU (issue 37's acceptance).

A pool of its own serves a tiny Qwen3-MoE whose routers are near-tied (each expert's row is one shared row plus 1%
of its own), so routing flips as soon as the router weights move; a learner job trains it 1-off async for a few
steps with ``policy.router_replay.enabled`` and ``grpo.seq_logprob_error_threshold``. What it shows:

- the engine (vLLM-CPU's V1 runner with rollout/cpu_routed_experts.py) returns the experts it routed: every
  trajectory carries ``[prompt + response - 1, 2 MoE layers, top-2]``, and those sampled wholly at version 0 equal
  the top-2 of float32 transformers on the initial weights at every position;
- the learner replays them: ``router_replay_rows`` on every step, and flips caught (``router_replay_flip_rate`` > 0:
  rows where the engine's experts differ from the learner's own choice after the routers trained);
- sequences over the threshold leave the loss, counted under their reason (``seq_masked_logprob_error``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from data_pool import run_recorded_async
from test_pool_and_loops import tiny_recipe

POOL_NAME = "inflight-replay-pool"
STEPS = 4


def near_tied_moe(src: str, out: Path) -> str:
    """A copy of the tiny MoE at ``src`` whose router rows are one shared row plus 1% of each expert's own."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for path in out.glob("*.safetensors"):
        state = load_file(path)
        for name, w in state.items():
            if name.endswith("mlp.gate.weight"):
                state[name] = (w[:1] + 0.01 * w).contiguous()
        save_file(state, path, metadata={"format": "pt"})
    return str(out)


def hf_topk(model_dir: str, ids: np.ndarray, top_k: int) -> np.ndarray:
    """transformers' top-k experts ``[positions, MoE layers, top_k]`` (sorted ids) for the token row ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.as_tensor(ids[None], dtype=torch.long), output_router_logits=True).router_logits
    top = [torch.topk(lg.reshape(len(ids), -1), top_k, dim=-1).indices for lg in logits]
    return np.sort(torch.stack(top, dim=1).numpy(), axis=-1)


@pytest.mark.timeout(600)
def test_the_loop_replays_the_engines_routing_and_masks_sequences_over_the_threshold(
        ray_cluster, tiny_moe_dir, tmp_path: Path):
    from services import pool as pool_api
    from services.app import deploy_pool
    from services.job.learner_group import LearnerGroup

    model = near_tied_moe(tiny_moe_dir, tmp_path / "near-tied-moe")
    recipe = tiny_recipe(f"policy.model_name={model}", f"rollout_pool.name={POOL_NAME}",
                         "rollout_pool.route_prefix=/replay", "policy.router_replay.enabled=true",
                         "grpo.seq_logprob_error_threshold=1.01", f"grpo.max_num_steps={STEPS}",
                         "checkpointing.enabled=false")
    deployed = deploy_pool(recipe, tmp_path / "pool")
    assert deployed.status.ready, deployed
    try:
        _, recording = run_recorded_async(LearnerGroup, recipe, tmp_path / "run")  # a model of its own: its own group
    finally:
        pool_api.shutdown(POOL_NAME)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS

    groups = [g for batch in recording.batches for g in batch]
    trajectories = [(g, t) for g in groups for t in g.trajectories if t.ok]
    assert trajectories
    checked = 0
    for g, t in trajectories:
        positions = len(g.prompt_ids) + len(t.response_ids) - 1
        assert t.routed_experts is not None and t.routed_experts.shape == (positions, 2, 2), t.routed_experts
        if checked < 4 and not np.any(t.versions):  # sampled wholly on the initial weights
            ids = np.concatenate([g.prompt_ids, t.response_ids])[:positions]
            np.testing.assert_array_equal(np.sort(t.routed_experts, axis=-1), hf_topk(model, ids, 2))
            checked += 1
    assert checked > 0, "no trajectory was sampled wholly at version 0"

    print("replay rows / flip rate / masked per step:",
          [(r["router_replay_rows"], round(r["router_replay_flip_rate"], 4), r["seq_masked_logprob_error"])
           for r in rows])
    assert all(r["router_replay_rows"] > 0 for r in rows)
    assert any(r["router_replay_flip_rate"] > 0 for r in rows)               # a flip, caught by replay
    assert any(r["seq_masked_logprob_error"] > 0 for r in rows)              # masked, with its reason
    assert all(r["seq_masked"] == r["seq_masked_logprob_error"] for r in rows)
