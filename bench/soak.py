"""Soak: stream groups at full rate through the real pool and trajectory channel, watching for leaks.

Starts a private local Ray, deploys the pool (the CPU default recipe), and
plays the learner's part without training: it keeps ``--inflight`` prompts
submitted, reads every group from its ``TrajectoryChannel``, decodes it and
submits a new prompt for each one received. Every ``--sample-s`` seconds it
records the resident memory (RSS) and open file descriptors of

- the pool: the Serve replica (controller + HTTP), each engine actor and its
  vLLM child processes;
- the learner side: this process alone (its descendants are the local Ray
  node, which hosts everything else) and the channel's queue actor;

and, at the end, prints a table and the growth of each from the end of the
warm-up (``--warmup-s``) to the last sample. Goal: < 5 % growth.

Run: ``VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/soak.py [--minutes 30]``;
writes ``bench/results/soak_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROWTH_GOAL_PCT = 5.0


def tree_usage(pid: int, children: bool = True) -> dict:
    """RSS (MiB) and open file descriptors of ``pid`` and (unless ``children=False``) its descendants."""
    import psutil

    rss, fds, procs = 0, 0, 0
    try:
        root = psutil.Process(pid)
        members = [root, *(root.children(recursive=True) if children else [])]
    except psutil.NoSuchProcess:
        return {"rss_mib": 0.0, "fds": 0, "procs": 0}
    for p in members:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            procs += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return {"rss_mib": round(rss / 2**20, 1), "fds": fds, "procs": procs}


def growth_pct(first: float, last: float) -> float:
    return 0.0 if first == 0 else round(100.0 * (last - first) / first, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=60.0, help="growth is measured from the end of the warm-up")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--inflight", type=int, default=16, help="prompts kept submitted")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak_cpu.json"))
    args = ap.parse_args()

    import ray

    from protocol import TrajectoryGroup, decode, encode
    from services import pool as pool_api
    from services.cluster import ray_runtime
    from services.app import deploy_pool
    from services.job.channel import ChannelTimeout, TrajectoryChannel
    from services.recipe.config import load_recipe
    from services.data.prompt_source import PromptSource
    from services.models.source import resolve_model

    os.environ.setdefault("INFLIGHT_ADMIN_TOKEN", "soak-admin-token")
    recipe = load_recipe(None, ["rollout_pool.name=inflight-soak", "logger.tensorboard_enabled=false"])
    temp_dir = tempfile.mkdtemp(prefix="inflight-soak-ray-")
    ray_runtime.connect(address="local", temp_dir=temp_dir)
    channel = None
    try:
        t_deploy = time.perf_counter()
        deploy_pool(recipe, Path(temp_dir) / "run")
        print(f"pool ready in {time.perf_counter() - t_deploy:.0f} s", flush=True)
        handle = pool_api.connect(recipe.rollout_pool.name)
        channel = TrajectoryChannel.create("soak-trajectories", recipe.rollout_pool.max_inflight_groups)
        handle.attach.remote("soak-learner", channel).result(timeout_s=60)
        channel_pid = ray.get(channel.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        model_path = resolve_model(recipe.policy.model_name)
        g = recipe.grpo
        source = PromptSource.of_task(recipe, model_path)

        def submit(n: int) -> None:
            handle.submit.remote([encode(r) for r in source.next(n, 1)], g.num_generations_per_prompt).result(
                timeout_s=120)

        def sample(elapsed: float, groups: int, tokens: int) -> dict:
            st = handle.status.remote().result(timeout_s=30)
            row = {"t_s": round(elapsed, 1), "groups": groups, "tokens": tokens,
                   "replica": tree_usage(st.pid), "learner": tree_usage(os.getpid(), children=False),
                   "channel": tree_usage(channel_pid)}
            for eid, es in st.engines.items():
                row[eid] = tree_usage(es.pid)
            return row

        submit(args.inflight)
        samples, groups, tokens, failed = [], 0, 0, 0
        t0 = time.monotonic()
        next_sample = t0
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            try:
                group = decode(channel.recv(5.0), expect=TrajectoryGroup)
                groups += 1
                tokens += sum(int(t.response_ids.size) for t in group.trajectories)
                failed += sum(t.reward is None for t in group.trajectories)
                submit(1)
            except ChannelTimeout:
                pass
            if time.monotonic() >= next_sample:
                samples.append(sample(time.monotonic() - t0, groups, tokens))
                next_sample += args.sample_s
        samples.append(sample(time.monotonic() - t0, groups, tokens))
        report(args, samples, groups, tokens, failed, time.monotonic() - t0)
    finally:
        if channel is not None:
            channel.close()
        try:
            pool_api.shutdown(recipe.rollout_pool.name)
        finally:
            ray_runtime.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def report(args, samples: list[dict], groups: int, tokens: int, failed: int, seconds: float) -> None:
    procs = [k for k in samples[0] if isinstance(samples[0][k], dict)]
    base = next((s for s in samples if s["t_s"] >= args.warmup_s), samples[0])
    last = samples[-1]
    print(f"\n{'t_s':>7} {'groups':>7} " + " ".join(f"{p[-18:]:>26}" for p in procs))
    print(f"{'':>15} " + " ".join(f"{'RSS MiB / fds / procs':>26}" for _ in procs))
    for s in samples:
        print(f"{s['t_s']:>7.0f} {s['groups']:>7} " + " ".join(
            f"{s[p]['rss_mib']:>14.1f} / {s[p]['fds']:>4} / {s[p]['procs']:>2}" for p in procs))
    growth = {p: {"rss_pct": growth_pct(base[p]["rss_mib"], last[p]["rss_mib"]),
                  "fds_pct": growth_pct(base[p]["fds"], last[p]["fds"])} for p in procs}
    worst = max(max(v.values()) for v in growth.values())
    print(f"\ngrowth from t={base['t_s']:.0f} s to t={last['t_s']:.0f} s: {growth}")
    print(f"{groups} groups, {tokens} tokens in {seconds:.0f} s ({groups / seconds:.1f} groups/s, "
          f"{tokens / seconds:.0f} tok/s), {failed} failed samples; worst growth {worst:.2f} % "
          f"({'within' if worst < GROWTH_GOAL_PCT else 'ABOVE'} the {GROWTH_GOAL_PCT:.0f} % goal)")
    out = {"minutes": args.minutes, "warmup_s": args.warmup_s, "inflight": args.inflight, "groups": groups,
           "tokens": tokens, "failed_samples": failed, "seconds": round(seconds, 1), "growth_pct": growth,
           "worst_growth_pct": worst, "goal_pct": GROWTH_GOAL_PCT, "samples": samples,
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
