"""How long a call waits for the rollout engine's event loop while it generates, per front-end setting.

A weight push reaches the engine as a call on the engine actor's event loop, and its steps are calls to the
engine core whose answers come back through the same loop. While vLLM's front end is behind the engine core it
holds that loop (rollout/frontend_yield.py). This bench starts one real engine (a tiny random Qwen2, eager, CPU
or GPU) and generates PROMPTS x GROUP answers of up to MAX_NEW_TOKENS tokens per round while, every 0.25 s,
another thread submits a probe to the engine's loop (as Ray delivers an actor call) that asks the engine core
for its GPUs (a ``collective_rpc`` round trip, as an install's steps are). Per round: the probes' start delay
and round trip, the loop's longest lag, tokens/s, and how many answers' text differs from one decode of their
tokens (vLLM's detokenized rounds). Rounds: the engine's own version labels and streamed ones (the GPU hosts'
vLLM 0.25.1) x :data:`SETTINGS` (the heap frozen after start, rollout/gc_heap.py; the front end yielding between
outputs, rollout/frontend_yield.py; the text decoded once per answer). Prints a table, writes JSON.

    python bench/engine_loop_lag.py --prompts 16 --group 16 --max-new-tokens 256 \
        --out bench/results/engine_loop_lag_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBE_EVERY_S = 0.25


async def one_round(engine, requests, group_size: int, lag) -> dict:
    """Generate the groups of ``requests``; the answers, the wall time and the loop's longest lag."""
    lag.take()
    t0 = time.perf_counter()
    groups = [g async for g in engine.generate(requests, group_size)]
    wall = time.perf_counter() - t0
    return {"groups": groups, "wall_s": wall, "loop_lag_max_s": lag.take()}


def probe_while(engine, loop, done: threading.Event) -> list[tuple[float, float]]:
    """From this thread, every PROBE_EVERY_S until ``done``: (start delay, round trip) of a probe on ``loop``."""
    out = []

    async def probe(submitted: float) -> tuple[float, float]:
        started = time.perf_counter()
        await engine.gpu_uuids()
        return started - submitted, time.perf_counter() - started

    while not done.wait(PROBE_EVERY_S):
        out.append(asyncio.run_coroutine_threadsafe(probe(time.perf_counter()), loop).result(120))
    return out


SETTINGS = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
"""(heap frozen, front end yielding, text decoded once) per round: as vLLM is, then each remedy added."""


def measure(engine, loop, lag, requests, group_size: int, run) -> dict:
    """One round with the probes running beside it."""
    done, probes = threading.Event(), []
    prober = threading.Thread(target=lambda: probes.extend(probe_while(engine, loop, done)))
    prober.start()
    out = run(one_round(engine, requests, group_size, lag))
    done.set()
    prober.join()
    tokens = sum(len(t.response_ids) for g in out["groups"] for t in g.trajectories)
    delays, trips = [p[0] for p in probes] or [0.0], [p[1] for p in probes] or [0.0]
    return {"wall_s": out["wall_s"], "tokens_per_s": tokens / out["wall_s"],
            "answers": sum(len(g.trajectories) for g in out["groups"]), "probes": len(probes),
            "probe_delay_p50_s": statistics.median(delays), "probe_delay_max_s": max(delays),
            "probe_rpc_p50_s": statistics.median(trips), "probe_rpc_max_s": max(trips),
            "loop_lag_max_s": out["loop_lag_max_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="bench/results/engine_loop_lag_cpu.json")
    args = ap.parse_args()

    from rollout import frontend_yield
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    from services.data.tasks import make_prompts
    from services.models.tiny_model import make_tiny_model
    from services.pool.loop_lag import LoopLag

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(1800)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "tiny", seed=0, arch="qwen2"))
        generation = GenerationConfig(max_new_tokens=args.max_new_tokens, request_timeout_s=600.0, max_retries=0,
                                      vllm_cfg=VllmConfig(enforce_eager=True, seed=0, gpu_memory_utilization=0.3))
        engine = RolloutEngine(model, generation, 64 + args.max_new_tokens, get_reward_fn("repeat_letter"),
                               engine_id="bench", initial_version=0)
        run(engine.start())
        lag = LoopLag()
        loop.call_soon_threadsafe(lag.start)
        text_of, rows, seen = engine.sampler.text_of, [], []
        answer_text = engine.sampler._text  # record vLLM's own text of each answer, to compare with one decode
        engine.sampler._text = lambda params, ids, text: seen.append((list(ids), text)) or answer_text(
            params, ids, text)
        requests = make_prompts("repeat_letter", engine.tokenizer, args.prompts, seed=0)
        try:
            run(one_round(engine, requests[:2], 2, lag))  # warm-up
            for streamed in (False, True) if engine.labels.engine_side else (True,):  # 0.25.1: streamed only
                for frozen, yields, decode_once in SETTINGS:
                    engine.labels.streamed = streamed
                    gc.unfreeze()
                    gc.collect()
                    if frozen:
                        gc.freeze()
                    (frontend_yield.yield_between_outputs if yields else frontend_yield.restore)(engine._llm)
                    engine.sampler.text_of = text_of if decode_once else None
                    seen[:] = []
                    row = measure(engine, loop, lag, requests, args.group, run)
                    row.update(labels="streamed" if streamed else "engine", gc_frozen=frozen, yields=yields,
                               decode_once=decode_once,
                               text_differs=0 if decode_once else sum(text != text_of(ids) for ids, text in seen))
                    rows.append(row)
                    print(f"{row['labels']:8} frozen={frozen!s:5} yield={yields!s:5} decode_once={decode_once!s:5} "
                          f"{row['tokens_per_s']:6.0f} tok/s  probe delay p50 {row['probe_delay_p50_s'] * 1e3:5.1f} "
                          f"max {row['probe_delay_max_s'] * 1e3:6.1f} ms  rpc p50 {row['probe_rpc_p50_s'] * 1e3:5.1f} "
                          f"max {row['probe_rpc_max_s'] * 1e3:6.1f} ms  loop lag max "
                          f"{row['loop_lag_max_s'] * 1e3:6.1f} ms  text differs {row['text_differs']}/{row['answers']}",
                          flush=True)
        finally:
            run(engine.shutdown())
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
