"""Environment overlap: tokens/s of multi-turn rollouts while the environment takes 0, 50 or 200 ms per step.

Workload: ``--prompts`` repeat-letter prompts x ``--group`` samples, episodes of ``--turns`` sampled turns of up
to ``--max-tokens`` tokens (temperature 1) on the tiny random Qwen2 of the CPU default, one
:class:`rollout.engine.RolloutEngine` started once. The environment answers every turn but the last with one
user message after ``delay`` ms. Variants per delay:

* ``overlapped`` -- the environment awaits its delay (``asyncio.sleep``): while one episode waits, the others
  generate (how the engine calls every environment);
* ``serial``     -- the same environment blocking the engine's event loop for its delay (``time.sleep`` inside
  ``async def``): every step stops all generation, i.e. the environment called serially.

tok/s = sampled tokens / wall time of one batch, best of ``--repeats`` after a warm-up batch. Prints a table and
writes ``bench/results/env_overlap_<device>.json``.

Run: ``VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/env_overlap.py``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.config import GenerationConfig, VllmConfig  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.episodes.environment import EnvStep, Message, Turn, as_async  # noqa: E402
from rollout.rewards.registry import get_reward_fn  # noqa: E402
from services.data.tasks import make_prompts  # noqa: E402
from services.models.tiny_model import make_tiny_model  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 512


class DelayedEnvironment:
    """Answers each turn with "Go on." after ``delay_s`` (awaited, or blocking the loop), done at the last."""

    def __init__(self, delay_s: float, turns: int, blocking: bool):
        self.delay_s, self.turns, self.blocking = delay_s, turns, blocking
        self.name = "delayed"

    async def reset(self, task: dict) -> tuple[dict, list[Message]]:
        return {"turn": 0}, []

    async def step(self, state: dict, turn: Turn) -> EnvStep:
        state["turn"] += 1
        if state["turn"] >= self.turns or turn.final:
            return EnvStep.final(float(len(turn.token_ids) > 0))
        if self.blocking:
            time.sleep(self.delay_s)  # noqa: ASYNC251 -- on purpose: the serial baseline stalls the loop
        else:
            await asyncio.sleep(self.delay_s)
        return EnvStep.more([Message("user", "Go on.")])


async def batch(engine: RolloutEngine, prompts, group: int) -> tuple[int, int, float]:
    """(sampled tokens, episodes, seconds) of one batch."""
    t0 = time.perf_counter()
    tokens = episodes = 0
    async for g in engine.generate(prompts, group):
        for t in g.trajectories:
            tokens += int(t.loss_mask.sum())
            episodes += 1
    return tokens, episodes, time.perf_counter() - t0


async def run(args) -> list[dict]:
    model_dir = make_tiny_model(tempfile.mkdtemp(prefix="env-overlap-"), seed=0)
    generation = GenerationConfig(max_new_tokens=args.max_tokens, temperature=1.0, request_timeout_s=600.0,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5))
    engine = RolloutEngine(str(model_dir), generation, MAX_MODEL_LEN, get_reward_fn("repeat_letter"),
                           engine_id="bench", max_rollout_turns=args.turns)
    await engine.start()
    from transformers import AutoTokenizer
    prompts = make_prompts("repeat_letter", AutoTokenizer.from_pretrained(str(model_dir)), args.prompts, seed=0)
    rows = []
    try:
        for delay_ms in args.delays_ms:
            for variant in ("overlapped", "serial"):
                env = DelayedEnvironment(delay_ms / 1000, args.turns, blocking=variant == "serial")
                engine.sampler.environment = as_async(env, 600.0)
                await batch(engine, prompts, args.group)  # warm-up
                best = None
                for _ in range(args.repeats):
                    got = await batch(engine, prompts, args.group)
                    if best is None or got[2] < best[2]:
                        best = got
                assert best is not None
                tokens, episodes, seconds = best
                rows.append({"delay_ms": delay_ms, "variant": variant, "tokens": tokens, "episodes": episodes,
                             "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)})
                print(f"  delay {delay_ms:>3} ms {variant:<10} {tokens:>6} tokens {seconds:7.2f} s "
                      f"{tokens / seconds:8.1f} tok/s", flush=True)
    finally:
        await engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--delays-ms", type=int, nargs="+", default=[0, 50, 200])
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    by = {(r["delay_ms"], r["variant"]): r for r in rows}
    print("\n| env delay | overlapped tok/s | serial tok/s | overlapped / serial |")
    print("|---|---|---|---|")
    for d in args.delays_ms:
        o, s = by[(d, "overlapped")], by[(d, "serial")]
        print(f"| {d} ms | {o['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
              f"{o['tokens_per_s'] / s['tokens_per_s']:.2f}x |")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "env_overlap_cpu.json"
    out.write_text(json.dumps({"args": vars(args), "machine": platform.machine(), "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
