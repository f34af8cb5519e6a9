"""Rollout throughput: ``RolloutEngine.generate`` vs raw vLLM on the same model, prompts and sampling.

Workload: ``--prompts`` repeat-letter prompts x ``--group`` samples x up to
``--max-tokens`` tokens (temperature 1, sampled-token log-probs on), on the
tiny random Qwen2 of the CPU default (float32). Variants, each on a freshly
started engine, one after another:

* ``llm``             -- offline ``vllm.LLM.generate`` on all P x G requests at once (the ceiling);
* ``async_delta``     -- raw ``AsyncLLM``, one request per sample, ``output_kind=DELTA`` (one output per token);
* ``async_final``     -- raw ``AsyncLLM``, one request per sample, ``output_kind=FINAL_ONLY``;
* ``rollout_engine``  -- :class:`rollout.engine.RolloutEngine.generate` (FINAL_ONLY, scoring, versions).

tok/s = generated tokens / wall time of one full batch, best of ``--repeats``
after one warm-up batch. Prints a table and the ratio rollout_engine / llm,
and writes ``bench/results/rollout_throughput_<device>[_eager].json``.

Run: ``VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/rollout_throughput.py [--eager]``
On a GPU: ``python bench/rollout_throughput.py --size 0.6b --prompts 32 --group 16 --max-tokens 256 [--eager]``
(bf16, CUDA graphs unless ``--eager``).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.config import GenerationConfig, VllmConfig  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.options import build_engine_options  # noqa: E402
from rollout.rewards.registry import get_reward_fn  # noqa: E402
from services.data.tasks import make_prompts  # noqa: E402
from services.models.tiny_model import make_tiny_model  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 512


def sampling_params(args, seed: int, kind: str | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    extra = {"output_kind": getattr(RequestOutputKind, kind)} if kind else {}
    return SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0, seed=seed, **extra)


def requests(prompts, group: int) -> list[tuple[list[int], int]]:
    return [(p.prompt_ids.tolist(), i * group + j) for i, p in enumerate(prompts) for j in range(group)]


def timed(run_once, repeats: int) -> tuple[float, int]:
    """Best wall time of ``run_once`` (returns tokens) after a warm-up; returns (seconds, tokens)."""
    run_once()
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = run_once()
        best = min(best, time.perf_counter() - t0)
    return best, tokens


def bench_llm(args, engine_args, prompts) -> dict:
    from vllm import LLM
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    start_s = time.perf_counter() - t0
    reqs = requests(prompts, args.group)

    def run_once() -> int:
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs],
                            [sampling_params(args, seed) for _, seed in reqs], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    seconds, tokens = timed(run_once, args.repeats)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"start_s": start_s, "seconds": seconds, "tokens": tokens}


def bench_async(args, engine_args, prompts, kind: str) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    reqs = requests(prompts, args.group)

    async def main() -> dict:
        t0 = time.perf_counter()
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        start_s = time.perf_counter() - t0
        batch = [0]

        async def one(ids: list[int], seed: int) -> int:
            n = 0
            async for out in llm.generate({"prompt_token_ids": ids}, sampling_params(args, seed, kind),
                                          f"{kind}-{batch[0]}-{seed}"):
                n = len(out.outputs[0].token_ids) if kind == "FINAL_ONLY" else n + len(out.outputs[0].token_ids)
            return n

        async def run_once() -> int:
            batch[0] += 1
            return sum(await asyncio.gather(*(one(ids, seed) for ids, seed in reqs)))

        await run_once()
        best, tokens = float("inf"), 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = await run_once()
            best = min(best, time.perf_counter() - t0)
        llm.shutdown()
        return {"start_s": start_s, "seconds": best, "tokens": tokens}
    return asyncio.run(main())


def bench_rollout_engine(args, model_dir: str, generation: GenerationConfig, prompts) -> dict:
    async def main() -> dict:
        engine = RolloutEngine(model_dir, generation, MAX_MODEL_LEN, get_reward_fn("repeat_letter"), "bench")
        t0 = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - t0

        async def run_once() -> int:
            n = 0
            async for group in engine.generate(prompts, args.group):
                n += sum(int(t.response_ids.size) for t in group.trajectories)
            return n

        await run_once()
        best, tokens = float("inf"), 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = await run_once()
            best = min(best, time.perf_counter() - t0)
        failed = engine.stats()["samples_failed"]
        await engine.shutdown()
        return {"start_s": start_s, "seconds": best, "tokens": tokens, "samples_failed": failed}
    return asyncio.run(main())


def _gpu_name() -> str:
    """'h200' for an NVIDIA H200, from nvidia-smi (torch.cuda.get_device_name would create a CUDA context)."""
    import subprocess
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                          capture_output=True, text=True, timeout=30).stdout.strip()
    return name.split()[-1].lower() if name else "gpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: torch.compile)")
    ap.add_argument("--variants", default="llm,async_delta,async_final,rollout_engine")
    ap.add_argument("--size", default="tiny", help="services.models.tiny_model size (0.6b on a GPU)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args()

    import torch
    on_gpu = torch.cuda.is_available()  # only asks the driver: no CUDA context before the engines start
    precision = "bfloat16" if on_gpu else "float32"
    device = _gpu_name() if on_gpu else "cpu"
    results_path = RESULTS_DIR / f"rollout_throughput_{device}{'_eager' if args.eager and on_gpu else ''}.json"
    model_dir = str(make_tiny_model(tempfile.mkdtemp(prefix="bench-rollout-"), seed=0, size=args.size,
                                    dtype=precision))
    vllm_cfg = VllmConfig(enforce_eager=args.eager, precision=precision, seed=0,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    generation = GenerationConfig(max_new_tokens=args.max_tokens, vllm_cfg=vllm_cfg)
    options = build_engine_options(vllm_cfg, model_dir, MAX_MODEL_LEN)
    os.environ.update(options.env)
    from transformers import AutoTokenizer
    prompts = make_prompts("repeat_letter", AutoTokenizer.from_pretrained(model_dir), args.prompts, seed=0)

    runners = {
        "llm": lambda: bench_llm(args, options.engine_args, prompts),
        "async_delta": lambda: bench_async(args, options.engine_args, prompts, "DELTA"),
        "async_final": lambda: bench_async(args, options.engine_args, prompts, "FINAL_ONLY"),
        "rollout_engine": lambda: bench_rollout_engine(args, model_dir, generation, prompts),
    }
    results = {}
    for name in args.variants.split(","):
        r = runners[name]()
        r["tok_per_s"] = r["tokens"] / r["seconds"]
        results[name] = r
        print(f"[{name}] start {r['start_s']:.1f}s, {r['tokens']} tokens in {r['seconds']:.2f}s "
              f"= {r['tok_per_s']:.0f} tok/s", flush=True)

    print(f"\n{'variant':<16}{'tok/s':>10}{'tokens':>9}{'seconds':>9}{'start s':>9}{'vs llm':>9}")
    base = results.get("llm", {}).get("tok_per_s")
    for name, r in results.items():
        ratio = f"{r['tok_per_s'] / base:.2f}" if base else "-"
        print(f"{name:<16}{r['tok_per_s']:>10.0f}{r['tokens']:>9}{r['seconds']:>9.2f}{r['start_s']:>9.1f}{ratio:>9}")
    ratio = results["rollout_engine"]["tok_per_s"] / base if base and "rollout_engine" in results else None
    if ratio is not None:
        print(f"\nrollout_engine / llm = {ratio:.2f} (goal >= 0.95)")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps({
        "workload": {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "enforce_eager": args.eager,
                     "model": f"random qwen2 ({args.size}) {precision}", "device": device},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "results": results, "rollout_engine_over_llm": ratio}, indent=2))
    print(f"wrote {results_path}")


if __name__ == "__main__":  # required: vLLM spawns its worker processes
    main()
