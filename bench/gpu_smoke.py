"""GPU smoke of our own components: RolloutEngine (vLLM, CUDA graphs on) and Learner (Megatron-Core, bf16).

One process, one GPU, colocated: the engine starts first (its engine core is a
child process, which must start before this process touches CUDA), then the
learner is built from the same random-init Qwen2 (bf16). Steps:

1. a group generation on the engine (``enforce_eager=False``: torch.compile + CUDA graphs);
2. ``Learner.train_step`` on a few groups, then ``export_weights`` as v1;
3. an in-flight ``install`` of v1 while groups are running: every sample
   must finish, with versions in {0, v1}, non-decreasing, and some samples split;
4. parity: the engine's ``logprobs_of`` vs ``Learner.logprobs`` on the v1 weights.

Prints one JSON object (also written to ``--out``); exits 1 if a check failed.

    python bench/gpu_smoke.py [--size small] [--out bench/results/gpu_smoke_h200.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np


async def run(args) -> dict:
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards import get_reward_fn
    from rollout.tasks import make_prompts
    from services.tiny_model import make_tiny_model

    out: dict = {"checks": {}}
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="qwen2", size=args.size,
                                    dtype="bfloat16"))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, request_timeout_s=120.0, max_retries=0,
                                  vllm_cfg=VllmConfig(enforce_eager=False, precision="bfloat16", seed=0,
                                                      gpu_memory_utilization=0.35))
    engine = RolloutEngine(model_dir, generation, 1024, get_reward_fn("repeat_letter"), engine_id="smoke")
    t = time.monotonic()
    await engine.start()
    out["engine_start_s"] = time.monotonic() - t
    out["engine_options"] = engine.options.describe()
    out["version_labels"] = "streamed" if engine.labels.streamed else "engine"
    requests = make_prompts("repeat_letter", engine.tokenizer, args.groups, seed=0)

    t = time.monotonic()
    groups = [g async for g in engine.generate(requests, args.group_size)]
    elapsed = time.monotonic() - t
    tokens = sum(t.response_ids.size for g in groups for t in g.trajectories)
    out["generate"] = {"groups": len(groups), "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
    out["checks"]["all_samples_ok"] = all(t.ok for g in groups for t in g.trajectories)

    import torch
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    t = time.monotonic()
    learner = Learner(model_dir, MegatronConfig(precision="bfloat16", optimizer=OptimizerConfig(lr=1e-4)),
                      LossConfig(), SequencePackingConfig(train_mb_tokens=4096), max_total_sequence_length=1024)
    out["learner_build_s"] = time.monotonic() - t
    out["learner_model"] = type(learner.model).__name__
    steps = []
    for _ in range(args.train_steps):
        m = learner.train_step(groups)
        torch.cuda.synchronize()
        steps.append({k: float(m[k]) for k in ("loss", "policy_training_s", "tokens_per_s") if k in m})
    out["train_steps"] = steps
    out["checks"]["train_step_finite"] = all(np.isfinite(s.get("loss", 0.0)) for s in steps)

    t = time.monotonic()
    manifest, buckets = learner.export_weights(64 << 20)
    out["export_s"] = time.monotonic() - t
    out["export_bytes"] = manifest.total_bytes
    engine.generation.max_new_tokens = args.inflight_tokens
    tasks = [asyncio.create_task(engine.generate_group(r, args.group_size)) for r in requests]
    while engine.stats()["requests_running"] < len(requests) * args.group_size:
        await asyncio.sleep(0.005)
    await asyncio.sleep(args.update_after_s)
    version = await engine.install(manifest, buckets)
    inflight = await asyncio.gather(*tasks)
    stats = engine.stats()
    trajs = [t for g in inflight for t in g.trajectories]
    out["inflight_update"] = {"version": version, "refit_s": stats["refit_seconds_last"],
                              "pause_s": stats["pause_seconds_last"],
                              "drain_incomplete": stats["version_drain_incomplete"],
                              "split_samples": sum(int(0 < (t.versions == 0).sum() < t.versions.size) for t in trajs),
                              "samples": len(trajs)}
    out["checks"]["inflight_samples_ok"] = all(t.ok for t in trajs)
    out["checks"]["versions_monotone"] = all(set(np.unique(t.versions)) <= {0, version}
                                             and (np.diff(t.versions) >= 0).all() for t in trajs)
    out["checks"]["some_sample_split"] = out["inflight_update"]["split_samples"] > 0

    prompts = [r.prompt_ids for r in requests]
    responses = [g.trajectories[0].response_ids for g in inflight]
    engine_lp = await engine.logprobs_of([p.tolist() for p in prompts], [r.tolist() for r in responses])
    learner_lp = learner.logprobs(prompts, responses)
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(engine_lp, learner_lp)])
    out["parity"] = {"tokens": int(diffs.size), "mean_abs_diff": float(diffs.mean()),
                     "max_abs_diff": float(diffs.max())}
    out["checks"]["parity_mean_below_0.05"] = out["parity"]["mean_abs_diff"] < 0.05
    learner.shutdown()
    await engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--inflight-tokens", type=int, default=512)
    ap.add_argument("--update-after-s", type=float, default=0.3)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_smoke_h200.json"))
    args = ap.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2, default=str)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    raise SystemExit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
