"""Which vLLM start-up setting hangs? Engine start under every combination of

* ``VLLM_ENABLE_V1_MULTIPROCESSING`` 0/1 (engine core in this process / in a child process),
* ``VLLM_USE_V2_MODEL_RUNNER`` 0/1,
* whether the parent process made a CUDA context before starting the engine,

each in a fresh subprocess with a deadline: start ``vllm.LLM`` (tiny random
Qwen2, bf16, CUDA graphs on), generate 16 x 32 tokens, shut down. A run that
misses the deadline is killed and reported as ``hang``. Combinations run in
parallel, one per entry of ``--gpus`` (``0,0`` runs two at a time on GPU 0). Prints a table and writes
``bench/results/vllm_start_matrix_<device>.json``.

    python bench/vllm_start_matrix.py --gpus 0,1 --deadline-s 150
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time
t0 = time.monotonic()
if sys.argv[2] == "1":
    import torch
    torch.zeros(1, device="cuda")  # a CUDA context in the parent before the engine starts
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=256, seed=0)
started = time.monotonic() - t0
outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 16, SamplingParams(max_tokens=32, temperature=1.0),
                    use_tqdm=False)
print("RESULT " + json.dumps({"start_s": started, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}),
      flush=True)
"""


def run_one(model_dir: str, gpu: str, mp: int, v2: int, parent_cuda: int, deadline_s: float) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, VLLM_ENABLE_V1_MULTIPROCESSING=str(mp),
               VLLM_USE_V2_MODEL_RUNNER=str(v2))
    row = {"multiprocessing": mp, "v2_model_runner": v2, "parent_cuda_context": parent_cuda, "gpu": gpu}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, model_dir, str(parent_cuda)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        row.update(outcome="hang", seconds=time.monotonic() - t0, tail=out[-1500:])
        return row
    result = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and result:
        row.update(outcome="ok", seconds=time.monotonic() - t0, **json.loads(result[-1][7:]))
    else:
        row.update(outcome=f"error rc={proc.returncode}", seconds=time.monotonic() - t0, tail=out[-1500:])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--deadline-s", type=float, default=150.0)
    ap.add_argument("--cases", default=None, help="only these MP,V2,parent_cuda triples, e.g. 0,0,0;1,0,1")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from services.models.tiny_model import make_tiny_model
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="qwen2", size="tiny", dtype="bfloat16"))
    combos = list(itertools.product((0, 1), (0, 1), (0, 1)))
    if args.cases:
        combos = [tuple(int(x) for x in c.split(",")) for c in args.cases.split(";")]
    gpus: Queue = Queue()
    for g in args.gpus.split(","):
        gpus.put(g)

    def job(combo):
        gpu = gpus.get()
        try:
            row = run_one(model_dir, gpu, *combo, args.deadline_s)
        finally:
            gpus.put(gpu)
        print(f"MP={row['multiprocessing']} V2={row['v2_model_runner']} parent_cuda={row['parent_cuda_context']}: "
              f"{row['outcome']} in {row['seconds']:.1f}s", flush=True)
        return row

    with ThreadPoolExecutor(len(args.gpus.split(","))) as ex:
        rows = list(ex.map(job, combos))
    print(f"\n{'MP':>3}{'V2':>4}{'parent CUDA':>13}  outcome        seconds  start_s")
    for r in rows:
        print(f"{r['multiprocessing']:>3}{r['v2_model_runner']:>4}{r['parent_cuda_context']:>13}  "
              f"{r['outcome']:<14}{r['seconds']:>8.1f}  {r.get('start_s', float('nan')):>7.1f}")
    out = ROOT / "bench" / "results" / f"vllm_start_matrix_h200{'_cases' if args.cases else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"deadline_s": args.deadline_s, "runs": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
