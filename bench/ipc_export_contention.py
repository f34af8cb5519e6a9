"""The CUDA IPC export's pack beside a busy GPU: eager (a kernel or more per tensor) vs one CUDA graph replay.

An engine generating on the learner's GPU (async on one GPU) keeps that GPU busy from another process, and the
two processes then share it in time slices. This bench builds a learner of a published shape (random bf16
weights, ``bench/learner_step.py``'s shapes) and times ``IpcExporter.export`` (eager) and ``export_graphed``
(``learner.ipc_graph``), each push packed, checked and released, first with the GPU to itself, then while a
second process replays a CUDA graph of small matmuls back to back (a stand-in for vLLM's decode graphs).
``first_s`` is the first push (the graph's capture); the medians leave it out. Prints a table, writes JSON.

    python bench/ipc_export_contention.py --shape qwen3-0.6b --reps 6 --out bench/results/ipc_export_contention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def burn(seconds: float) -> None:
    """Keep the GPU busy from this process: a graph of 64 small matmuls, replayed until ``seconds`` pass."""
    import torch

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x
        for _ in range(64):
            y = torch.tanh(y @ w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(64):
            y = torch.tanh(y @ w)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()


def time_pushes(learner, graphed: bool, reps: int, bucket_bytes: int) -> dict:
    """``reps`` pushes of ``learner``'s weights (pack, checksums, shares, release); the first and the median."""
    from learner.ipc_export import IpcExporter

    exporter, seconds = IpcExporter(), []
    for rep in range(reps):
        learner.policy_version = rep + 1
        t0 = time.perf_counter()
        exported = exporter.export_learner(learner, 1, bucket_bytes, cuda_graph=graphed)
        seconds.append(time.perf_counter() - t0)
        assert exported is not None
        exporter.release()
    return {"first_s": seconds[0], "median_s": statistics.median(seconds[1:]), "max_s": max(seconds[1:]),
            "captures": exporter.captures, "all_s": seconds}


def measure(learner, busy: bool, reps: int, bucket_bytes: int) -> list[dict]:
    """Eager then graphed pushes, with the GPU to itself or beside the competing process (``busy``)."""
    competitor = None
    if busy:
        competitor = subprocess.Popen([sys.executable, __file__, "--burn", "600"], stdout=subprocess.PIPE, text=True)
        assert competitor.stdout is not None and competitor.stdout.readline().strip() == "ready"
        time.sleep(1.0)
    rows = []
    try:
        for graphed in (False, True):
            row = {"gpu_busy": busy, "pack": "cuda_graph" if graphed else "eager",
                   **time_pushes(learner, graphed, reps, bucket_bytes)}
            rows.append(row)
            print(f"{'busy' if busy else 'idle':5} {row['pack']:10} first {row['first_s'] * 1e3:8.1f} ms  "
                  f"median {row['median_s'] * 1e3:8.1f} ms  max {row['max_s'] * 1e3:8.1f} ms", flush=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--out", default="bench/results/ipc_export_contention.json")
    ap.add_argument("--burn", type=float, default=0.0, help=argparse.SUPPRESS)  # the competing process
    args = ap.parse_args()
    if args.burn:
        burn(args.burn)
        return
    import torch

    from bench.learner_step import make_shaped_model
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_shaped_model(Path(tmp) / "model", args.shape)
        learner = Learner(str(model_dir), MegatronConfig(precision="bfloat16", optimizer=OptimizerConfig(lr=1e-5)),
                          LossConfig(), SequencePackingConfig(train_mb_tokens=4096), max_total_sequence_length=4096)
        rows = [row for busy in (False, True) for row in measure(learner, busy, args.reps, args.bucket_mb << 20)]
    weights = sum(p.numel() * p.element_size() for p in learner.gpt.parameters())
    out = {"shape": args.shape, "weight_bytes": weights, "bucket_mb": args.bucket_mb, "reps": args.reps,
           "device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
