"""GPU smoke of our own components: RolloutEngine (vLLM, CUDA graphs on) and Learner (Megatron-Core, bf16).

One process, one GPU, colocated: the engine starts first (its engine core is a
child process, which must start before this process touches CUDA), then the
learner is built from the same random-init Qwen2 (bf16). Steps:

1. a group generation on the engine (``enforce_eager=False``: torch.compile + CUDA graphs);
2. ``Learner.train_step`` on a few groups;
3. in-flight updates (:data:`INSTALLS`), each of a freshly trained version while
   groups are running: through the object store with the pause as it was shipped
   before (vLLM's fixed 20 ms settle, prefix reset inside the pause) and as it is
   now, then twice through CUDA IPC (the engine core maps this process's buckets).
   For each: export -> installed, and the engine's timed breakdown
   (``rollout.install.installer.PauseBreakdown``: verify / stage / receive before the pause;
   pause request, settle, drain, install, label, resume inside it; prefix reset
   after it). Every sample must finish, with versions in {old, new},
   non-decreasing, some samples split, and the front end drained in time;
4. parity: the engine's ``logprobs_of`` vs ``Learner.logprobs`` on the last pushed weights.

Prints one JSON object (also written to ``--out``) and the breakdown as a table; exits 1 if a check failed.

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

INSTALLS = [("object_store", "before"), ("object_store", "after"), ("cuda_ipc", "after"), ("cuda_ipc", "after")]
"""(transport, pause order) of the in-flight updates, in order. ``before``: the pause as shipped before issue 21
(``pause_generation``'s fixed 20 ms settle, prefix-cache reset inside the pause); ``after``: the default
``rollout.install.installer.PauseSettings`` (no settle, reset after the resume)."""


async def inflight_update(engine, learner, requests, groups, args, transport: str, order: str) -> dict:
    """Train one step (a new version), then push it while ``requests`` x ``group_size`` samples run; returns
    the timings (export -> installed, the engine's breakdown) and the checks of the running samples."""
    from learner.ipc_export import IpcExporter
    from rollout.install.installer import PauseSettings

    learner.train_step(groups)
    before = engine.version
    engine.installer.settings = PauseSettings(settle_s=0.02, prefix_reset_inside=True) if order == "before" \
        else PauseSettings()
    tasks = [asyncio.create_task(engine.generate_group(r, args.group_size)) for r in requests]
    while engine.stats()["requests_running"] < len(requests) * args.group_size:
        await asyncio.sleep(0.005)
    await asyncio.sleep(args.update_after_s)
    t0 = time.perf_counter()
    if transport == "object_store":
        manifest, buckets = learner.export_weights(64 << 20)
        exported = time.perf_counter()
        version = await engine.install(manifest, buckets)
    else:
        exporter = IpcExporter()
        manifest, shares = exporter.export(learner.policy_version, learner.export_weight_tensors(), 64 << 20)
        exported = time.perf_counter()
        try:
            version = await engine.install_ipc(manifest, [s.to_wire() for s in shares])
        finally:
            exporter.release()
    installed = time.perf_counter()
    inflight = await asyncio.gather(*tasks)
    stats = engine.stats()
    trajs = [t for g in inflight for t in g.trajectories]
    phases = stats["phases_last"]
    return {"transport": transport, "order": order, "version": version, "bytes": manifest.total_bytes,
            "export_s": exported - t0, "export_to_installed_s": installed - t0,
            "engine_install_call_s": stats["refit_seconds_last"], "paused_s": stats["pause_seconds_last"],
            "paused_minus_install_s": phases["paused_s"] - phases["install_s"], "phases": phases,
            "install_path": stats["install_path_last"] if transport == "cuda_ipc" else "reload (file)",
            "drain_backlog": stats["drain_backlog_last"], "drain_complete": stats["drain_complete_last"],
            "split_samples": sum(int(0 < (t.versions == before).sum() < t.versions.size) for t in trajs),
            "samples": len(trajs),
            "checks": {"samples_ok": all(t.ok for t in trajs),
                       "versions_monotone": all(set(np.unique(t.versions)) <= {before, version}
                                                and (np.diff(t.versions) >= 0).all() for t in trajs),
                       "some_sample_split": any(0 < (t.versions == before).sum() < t.versions.size for t in trajs),
                       "drain_complete": bool(stats["drain_complete_last"])}}


def summary(out: dict) -> str:
    """The in-flight updates as a table (milliseconds)."""
    keys = ("verify_s", "stage_s", "receive_s", "pause_s", "settle_s", "drain_s", "install_s", "label_s",
            "resume_s", "paused_s", "prefix_reset_s")
    lines = [" | ".join(["transport/order", "export->installed", "export", *[k.removesuffix("_s") for k in keys],
                         "backlog"])]
    for u in out["inflight_updates"]:
        ms = [u["export_to_installed_s"], u["export_s"], *[u["phases"][k] for k in keys]]
        lines.append(" | ".join([f"{u['transport']}/{u['order']}", *[f"{v * 1e3:.1f}" for v in ms],
                                 str(u["drain_backlog"])]))
    return "\n".join(lines)


async def run(args) -> dict:
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    from services.data.tasks import make_prompts
    from services.models.tiny_model import make_tiny_model

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

    engine.generation.max_new_tokens = args.inflight_tokens
    out["inflight_updates"] = []
    for transport, order in INSTALLS:
        out["inflight_updates"].append(await inflight_update(engine, learner, requests, groups, args, transport,
                                                             order))
    for i, u in enumerate(out["inflight_updates"]):
        for name, ok in u.pop("checks").items():
            out["checks"][f"update{i}_{u['transport']}_{u['order']}_{name}"] = ok

    prompts = [r.prompt_ids for r in requests]
    responses = [g.trajectories[0].response_ids for g in groups]  # scored at the last pushed version
    engine_lp = await engine.logprobs_of([p.tolist() for p in prompts], [r.tolist() for r in responses])
    learner_lp = learner.logprobs(prompts, responses)
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(engine_lp, learner_lp, strict=True)])
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
    print(summary(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    raise SystemExit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
