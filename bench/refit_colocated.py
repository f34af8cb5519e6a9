"""``bench/refit.py --gpus 1 --colocated``: refit through CUDA IPC between two processes on one GPU.

The learner side (:func:`ipc_learner_side`) is a second process, as a learner
rank is in a colocated pool: it holds the model's tensors on the GPU, and for
each push packs them into buckets with their checksums and exports CUDA IPC
shares of them (``learner.ipc_export``). The engine side (:func:`colocated`) is
an in-process vLLM ``LLM`` with the engine's worker extension: its worker maps
the shares, checks the buckets and installs them along its install path
(``rollout.install.ipc_receiver``). See ``bench/refit.py`` for the command line.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

MiB = 1 << 20
PROMPT = [1, 5, 9, 17, 33, 65, 101, 7]


COLOCATED_PUSHES = ["scaled", "original"] * 4
"""Weights of the colocated pushes, in order: the first (it must change the weights) proves plain load and the
copy plan (``checked``), the rest take the engine's proven path."""


def ipc_learner_side(model_dir: str, bucket_bytes: int, conn) -> None:
    """The colocated learner: the model's tensors on GPU 0, exported through CUDA IPC on request
    (``learner.ipc_export``), each push's buckets kept until the engine says it is done with them."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    from safetensors.torch import load_file

    from learner.ipc_export import IpcExporter
    from protocol import encode
    tensors = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors += sorted(load_file(str(f), device="cuda:0").items())
    pushes = {"scaled": [(n, t * 1.5 if t.dim() > 1 else t) for n, t in tensors], "original": tensors}
    exporter = IpcExporter()
    conn.send(sum(t.numel() * t.element_size() for _, t in tensors))
    while (request := conn.recv()) is not None:
        label, version = request
        t0 = time.monotonic()
        manifest, shares = exporter.export(version, pushes[label], bucket_bytes)
        conn.send((encode(manifest), [s.to_wire() for s in shares], t0, time.monotonic()))
        conn.recv()  # the engine has installed (or refused) it
        exporter.release(version)
        conn.send(exporter.held)


def colocated(args, model_dir: str, results) -> None:
    """One GPU, two processes as in a colocated pool: the learner's process exports CUDA IPC shares of its
    buckets; this process's vLLM worker (the engine's ``worker_extension_cls``) maps them, checks them and
    installs them along its install path (``rollout.install.ipc_receiver``). Timed from the export's start to
    installed, on one system-wide monotonic clock."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from protocol import WeightManifest, decode
    from rollout.options import WORKER_EXTENSION
    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    learner = ctx.Process(target=ipc_learner_side, args=(model_dir, args.install_bucket_mib * MiB, theirs),
                          daemon=True)
    learner.start()
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.4, max_model_len=512,
              seed=0, worker_extension_cls=WORKER_EXTENSION)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)

    def generate():
        out = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), out.cumulative_logprob
    base = generate()
    nbytes = conn.recv()
    runs, checks = [], {"scaled_changed_output": True, "scaled_outputs_equal": True, "originals_bit_identical": True}
    scaled_out = None
    for version, label in enumerate(COLOCATED_PUSHES, start=1):
        conn.send((label, version))
        manifest_bytes, shares, t0, exported = conn.recv()
        received = time.monotonic()
        llm.collective_rpc("inflight_map_ipc", args=(manifest_bytes, shares))
        mapped = time.monotonic()
        res = llm.collective_rpc("inflight_install_mapped", args=(version, True))[0]
        torch.cuda.synchronize()
        installed = time.monotonic()
        conn.send("done")
        held = conn.recv()
        out = generate()
        if label == "scaled":
            scaled_out = scaled_out or out
            checks["scaled_changed_output"] &= out[0] != base[0]
            checks["scaled_outputs_equal"] &= out == scaled_out
        else:
            checks["originals_bit_identical"] &= out == base  # tokens and their summed log-prob, exactly
        runs.append({"weights": label, "path": res["path"], "export_s": exported - t0, "handoff_s": received - exported,
                     "map_verify_s": mapped - received, "install_s": installed - mapped,
                     "export_to_installed_s": installed - t0, "learner_holds_after_release": held})
    conn.send(None)
    learner.join(60)
    results.put({"bytes": nbytes, "raw": [], "push": [], "mode": "one GPU, colocated: CUDA IPC",
                 "install": {}, "colocated": runs, "greedy": checks, "cpu_path": {},
                 "engine_tensors": len(decode(manifest_bytes, expect=WeightManifest).tensors),
                 "direct_load_refused": res["refused_reason"], "copy_plan_refused": res["copy_refused_reason"]})


def colocated_report(args, n: int, result: dict, build_s: float) -> None:
    """Print and write the colocated runs: medians per install path, effective GB/s export -> installed."""
    runs = result["colocated"]
    paths = {}
    for r in runs:
        paths.setdefault(r["path"], []).append(r)
    keys = ("export_s", "handoff_s", "map_verify_s", "install_s", "export_to_installed_s")
    summary = {p: dict({k: statistics.median(r[k] for r in rs) for k in keys}, pushes=len(rs))
               for p, rs in paths.items()}
    for v in summary.values():
        v["gbps"] = n / v["export_to_installed_s"] / 1e9
    report = {"model": f"qwen2 {args.size} bf16", "bytes": n, "model_build_s": build_s, "gpus": 1,
              "mode": result["mode"], "tensors": result["engine_tensors"], "bucket_mib": args.install_bucket_mib,
              "greedy": result["greedy"], "direct_load_refused": result["direct_load_refused"],
              "copy_plan_refused": result["copy_plan_refused"], "paths": summary, "runs": runs}
    print(f"model {report['model']}: {n / 1e9:.2f} GB in {report['tensors']} tensors, CUDA IPC, "
          f"{args.install_bucket_mib} MiB buckets")
    print(f"{'path (pushes)':<16}" + "".join(f"{k.removesuffix('_s'):>22}" for k in keys) + f"{'GB/s':>10}")
    for p, v in summary.items():
        label = f"{p} ({v['pushes']})"
        print(f"{label:<16}" + "".join(f"{v[k]:>22.4f}" for k in keys) + f"{v['gbps']:>10.1f}")
    print("greedy:", report["greedy"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
