"""Sync vs async step-time breakdown on the same model, prompts, group size and lengths.

    python bench/step_breakdown.py [--recipe PATH] [--steps N] [key=value ...]

Deploys one rollout pool, then attaches two learner jobs one after the other:
the synchronous baseline (generate -> train -> refit) and lag-1 async. Prints
the seed's table (means over warm steps: step 1 dropped) and the overlap
efficiency of async, ``max(generation, training) / async step``, where
generation is the sync run's generation time and training the async run's
policy training time (1.0 = generation completely hidden behind training or
vice versa). Writes bench/results/step_breakdown_<device>.json.

    python bench/step_breakdown.py --metrics sync=RUN_A/metrics.jsonl --metrics async=RUN_B/metrics.jsonl

compares two runs made apart instead (e.g. the colocated sync recipe and the async recipe on one GPU,
which need pools of their own: ``bash bench/gpu_session.sh M``), with the same table and JSON.

On CPU, quote the ratios, not the absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS = ["step_s", "policy_training_s", "generation_exposed_s", "refit_s", "other_s"]


def warm_mean(rows: list[dict], key: str) -> float:
    rows = rows[1:] if len(rows) > 1 else rows
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def summarize(path: str | Path) -> dict:
    """Means over the warm steps of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r]  # step rows only
    out = {k: warm_mean(rows, k) for k in KEYS}
    for key in ("reward_mean", "trajectory_age_mean", "refit_bytes", "refit_pause_s", "refit_install_s",
                "gen_kl_error", "parity_max_abs_logprob_diff"):
        out[key] = warm_mean(rows, key)
    out["steps"] = len(rows)
    return out


def run_both(args) -> dict[str, dict]:
    """Deploy one pool and run the sync and the async learner against it, one after the other."""
    from services import pool as pool_api
    from services.cluster import ray_runtime
    from services.app import deploy_pool, run_learner
    from services.recipe.config import load_recipe

    common = list(args.overrides) + [f"grpo.max_num_steps={args.steps}", "checkpointing.enabled=false",
                                     "logger.tensorboard_enabled=false"]
    recipes = {"sync": load_recipe(args.recipe, common + ["grpo.async_grpo.enabled=false"]),
               "async": load_recipe(args.recipe, common + ["grpo.async_grpo.enabled=true",
                                                           "policy.generation.colocated.enabled=false"])}
    work = Path(tempfile.mkdtemp(prefix="step-breakdown-"))
    ray_runtime.connect("local" if not os.environ.get("RAY_ADDRESS") else None)
    results: dict[str, dict] = {}
    try:
        deploy_pool(recipes["async"], work)
        for mode, recipe in recipes.items():
            results[mode] = summarize(run_learner(recipe, recipe.rollout_pool.name, work / mode, resume=False))
    finally:
        pool_api.shutdown(recipes["async"].rollout_pool.name)
        ray_runtime.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/step_breakdown_<device>.json)")
    ap.add_argument("--metrics", action="append", default=[], metavar="MODE=PATH",
                    help="compare finished runs instead (MODE sync or async, PATH its metrics.jsonl); give both")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    sources: dict[str, str] = {}
    if args.metrics:
        sources = dict(m.split("=", 1) for m in args.metrics)
        if set(sources) != {"sync", "async"}:
            ap.error(f"--metrics needs sync=PATH and async=PATH, got {sorted(sources)}")
        results = {mode: summarize(sources[mode]) for mode in ("sync", "async")}
    else:
        results = run_both(args)

    sync, asyn = results["sync"], results["async"]
    generation = sync["generation_exposed_s"]
    training = asyn["policy_training_s"]
    overlap = max(generation, training) / asyn["step_s"]
    speedup = sync["step_s"] / asyn["step_s"]
    print(f"\n{'mode':6} | " + " | ".join(f"{k:>20}" for k in KEYS))
    for mode in ("sync", "async"):
        print(f"{mode:6} | " + " | ".join(f"{results[mode][k]:20.3f}" for k in KEYS))
    for mode in ("sync", "async"):
        r = results[mode]
        print(f"{mode}: refit {r['refit_bytes'] / 1e9:.2f} GB in {r['refit_s']:.3f} s, generation pause "
              f"{r['refit_pause_s'] * 1e3:.0f} ms (install {r['refit_install_s'] * 1e3:.0f} ms), gen KL {r['gen_kl_error']:.2e}")
    print(f"\nasync speed-up over sync: {speedup:.2f}x; overlap efficiency max(gen, train)/async step = "
          f"{overlap:.3f} (goal >= 0.95)")
    device = "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0).replace(" ", "_").lower()
    except Exception:  # noqa: BLE001
        pass
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"step_breakdown_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "overrides": args.overrides, "metrics": sources,
                               "host": platform.node(), "device": device, "results": results,
                               "async_speedup": speedup, "overlap_efficiency": overlap}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
