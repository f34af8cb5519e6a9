"""README's "The seed's recipes" block, as a user runs it: a tiny Nano-Omni and a local CLEVR-CoGenT copy, both of
NeMo-RL's Nemotron-3-Nano-Omni recipes (tests/data/nemo_rl/recipes/vlm, unmodified) validated, then each run for 3
steps on CPU with the overrides the README lists: the sync colocated one on the policy it trains (age 0), the async
1-off one on trajectories one version old with a weight push into the running engine every step; the images reach
both sides (no image failed, the parity probe scored image prompts within bfloat16's reach); the engines run with the
recipes' vllm_kwargs, read back from vLLM's own config."""
from __future__ import annotations

import json
from pathlib import Path

from readme_blocks import ray_worker_log, readme_commands, run_as_user

README_SECTION = "## The seed's recipes"
STEPS = [1, 2, 3]


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) >= 1 and "reward_mean" in r]


def test_readme_seed_recipes_validate_and_run_3_steps(tmp_path):
    commands = readme_commands(README_SECTION)
    assert sum("inflight validate" in c for c in commands) == 2 and sum("inflight run" in c for c in commands) == 2
    run_as_user(tmp_path, commands, links=(".venv", "scripts", "tests"))
    sync, async_ = metrics(tmp_path / "runs/seed-sync"), metrics(tmp_path / "runs/seed-async")
    for rows in (sync, async_):
        assert [r["step"] for r in rows] == STEPS
        for r in rows:
            assert r["data_image_failures"] == 0 and r["parity_engines_probed"] >= 1, r
            assert r["gen_kl_error"] < 1e-2, r  # bfloat16 engine and learner on image prompts
            assert r["refit_transport"] and r["refit_pause_s"] > 0, r  # each step's policy reached the engine
    for run, seqs in (("seed-sync", 64), ("seed-async", 128)):  # the recipes' vllm_kwargs, read back from vLLM
        log = ray_worker_log(tmp_path / "runs" / run)
        assert f"vllm_kwargs.max_num_seqs={seqs} read back from scheduler_config.max_num_seqs" in log
        assert "vllm_kwargs.mamba_ssm_cache_dtype='float32' read back from cache_config.mamba_ssm_cache_dtype" in log
        assert "read back from model_config.multimodal_config.limit_per_prompt" in log
        assert "but the engine runs with" not in log and "no field of vLLM's config holds it" not in log
    assert [r["policy_version"] for r in async_] == [1.0, 2.0, 3.0]
    assert all(r["trajectory_age_mean"] == 0 for r in sync)
    assert [r["trajectory_age_mean"] for r in async_[1:]] == [1.0, 1.0]  # 1-off: generated while the learner trained
