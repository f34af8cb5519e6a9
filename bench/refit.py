"""Refit GPU to GPU on one host: raw NCCL ceiling, bucketed push, and the vLLM install (2 GPUs).

Two processes joined by :class:`protocol.weight_transfer.WeightTransferGroup`:
the learner side on GPU 0 holds the model's tensors (read from the model's
safetensors onto the GPU: the export from Megatron's layout is not timed) and
the engine side on GPU 1 runs an in-process vLLM engine of the same model
(``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so ``collective_rpc``
hands GPU tensors to the worker without pickling). Measured:

(a) a raw NCCL broadcast of one buffer of the model's size (the ceiling);
(b) :meth:`WeightTransferGroup.send` / ``recv`` of the model for several
    bucket sizes, with and without double buffering, end to end (send start
    on GPU 0 -> every bucket received and checksum-verified on GPU 1; one
    system-wide monotonic clock);
(c) the install, on each path of :mod:`rollout.install.direct_load`: ``checked``
    (the first push: plain ``load_weights`` and ``reload_weights`` both run and
    are compared, then the copy plan is found with markers and compared with
    plain load), ``copy`` (the proven copy plan: one foreach copy from the
    received buckets into vLLM's parameters), ``direct`` (plain
    ``load_weights`` into vLLM's fused parameters) and ``reload`` (vLLM's
    layerwise ``reload_weights(weights_iterator=<views of the received
    buckets>)``), in the order of :data:`INSTALLS`, alternating scaled and
    original weights;
    and, for comparison, the CPU path's install (GPU -> host, CRC32 per bucket,
    a safetensors file in /dev/shm, ``reload_weights(weights_path=...)``). Every scaled push must give the same changed greedy output and
    every original push must restore the first output exactly.

The engine is paused for the whole install (a synchronous ``LLM`` steps
nothing during ``collective_rpc``), so pause = install time here; the
pause/resume overhead of ``AsyncLLM`` is measured by ``bench/gpu_smoke.py``. With ``--gpus 1 --colocated``
the learner side is a second process on the GPU exporting CUDA IPC shares (``bench/refit_colocated.py``).

    python bench/refit.py [--size 1.5b] [--buckets 64,256,1024] [--out bench/results/refit_h200.json]
    python bench/refit.py --gpus 1 --colocated [--out bench/results/refit_h200_colocated.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
SIZE_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128, moe_intermediate_size=768, num_experts=8,
                 num_experts_per_tok=2)
"""Qwen2.5-1.5B's transformer dimensions (the vocabulary is the tiny tokenizer's, so ~1.3 B parameters)."""
PROMPT = [1, 5, 9, 17, 33, 65, 101, 7]
REPEATS = 3
INSTALLS = [("checked", "scaled")] + [
    (path, label) for _ in range(2) for path in ("copy", "direct", "reload") for label in ("original", "scaled")]
"""(install path, weights) of part (c), in order; each path ends up timed on both weight sets."""


def _sync(conn, value=None):
    """Exchange one message with the other side (a rendezvous)."""
    conn.send(value)
    return conn.recv()


def learner_side(args, model_dir: str, port: int, conn) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import torch
    from safetensors.torch import load_file

    from protocol.weight_transfer import WeightTransferGroup

    dev = torch.device("cuda:0")
    tensors = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors += sorted(load_file(str(f), device="cuda:0").items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    group = WeightTransferGroup("127.0.0.1", port, 0, 2, dev)
    _sync(conn, nbytes)  # engine is up
    raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(REPEATS + 1):  # (a) raw broadcast, first one warms up
        _sync(conn)
        t0 = time.monotonic()
        group._broadcast(raw).wait()
        torch.cuda.synchronize()
        conn.send(("raw", t0))
    for bucket_mib in args.buckets:  # (b) bucketed push
        for double in (True, False):
            for _ in range(REPEATS + 1):
                _sync(conn)
                t0 = time.monotonic()
                group.send(1, tensors, bucket_mib * MiB, double)
                conn.send(("push", t0))
    pushes = {"scaled": [(n, t * 1.5 if t.dim() > 1 else t) for n, t in tensors], "original": tensors}
    for version, (_, label) in enumerate(INSTALLS, start=2):  # (c) install through vLLM
        _sync(conn)
        t0 = time.monotonic()
        group.send(version, pushes[label], args.install_bucket_mib * MiB, True)
        conn.send((label, t0))
    _sync(conn)
    group.close()


def engine_side(args, model_dir: str, port: int, conn, results) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    from protocol.weight_transfer import WeightTransferGroup

    llm, generate = _engine(model_dir)
    base = generate()
    group = WeightTransferGroup("127.0.0.1", port, 1, 2, torch.device("cuda:0"))
    nbytes = _sync(conn)
    result = {"bytes": nbytes, "raw": [], "push": [], "install": {}}
    raw = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    for i in range(REPEATS + 1):
        _sync(conn)
        group._broadcast(raw).wait()
        torch.cuda.synchronize()
        done = time.monotonic()
        _, t0 = conn.recv()
        if i:
            result["raw"].append(done - t0)
    for bucket_mib in args.buckets:
        for double in (True, False):
            times = []
            for i in range(REPEATS + 1):
                _sync(conn)
                manifest, buckets = group.recv()
                done = time.monotonic()
                _, t0 = conn.recv()
                if i:
                    times.append(done - t0)
                del buckets
            result["push"].append({"bucket_mib": bucket_mib, "double_buffer": double,
                                   "buckets": len(manifest.bucket_sizes), "seconds": times})
    installs = _Installs(args, llm, generate, base)
    for path, label in INSTALLS:
        _sync(conn)
        manifest, buckets = group.recv()
        received = time.monotonic()
        _, t0 = conn.recv()
        installs.run(path, label, manifest, buckets, t0, received)
        del buckets
    result.update(installs.report())
    _sync(conn)
    group.close()
    results.put(result)


def _engine(model_dir: str):
    """An in-process vLLM engine of the model, and a greedy generation of a fixed prompt on it."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.4,
              max_model_len=512, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)

    def generate() -> list[int]:
        return list(llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    return llm, generate


def one_gpu(args, model_dir: str, results) -> None:
    """Without a second GPU: no NCCL. The learner's tensors live on the engine's GPU; a push is planned, packed
    into bucket buffers (one device copy, as the sender's staging copy) and checksummed on both sides
    (twice), then installed through vLLM like a received push."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file

    from protocol.weight_transfer import _manifest, device_checksum, dtype_name, plan_buckets
    llm, generate = _engine(model_dir)
    base = generate()
    tensors = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors += sorted(load_file(str(f), device="cuda:0").items())

    def pack(push, bucket_bytes):
        specs, sizes = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in push], bucket_bytes)
        buckets = [torch.empty(s, dtype=torch.uint8, device="cuda:0") for s in sizes]
        for spec, (_, t) in zip(specs, push):
            buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        sums = torch.stack([device_checksum(b) for b in buckets])
        again = torch.stack([device_checksum(b) for b in buckets])  # the receiver's verification
        if not torch.equal(sums, again):
            raise SystemExit("device checksum is not deterministic")
        return _manifest(1, specs, sizes, sums.tolist()), buckets

    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    result = {"bytes": nbytes, "raw": [], "push": [], "install": {}, "mode": "one GPU: pack + checksum, no NCCL"}
    for bucket_mib in args.buckets:
        times = []
        for i in range(REPEATS + 1):
            torch.cuda.synchronize()
            t0 = time.monotonic()
            manifest, buckets = pack(tensors, bucket_mib * MiB)
            torch.cuda.synchronize()
            if i:
                times.append(time.monotonic() - t0)
            del buckets
        result["push"].append({"bucket_mib": bucket_mib, "double_buffer": None,
                               "buckets": len(manifest.bucket_sizes), "seconds": times})
    installs = _Installs(args, llm, generate, base)
    pushes = {"scaled": [(n, t * 1.5 if t.dim() > 1 else t) for n, t in tensors], "original": tensors}
    for path, label in INSTALLS:
        torch.cuda.synchronize()
        t0 = time.monotonic()
        manifest, buckets = pack(pushes[label], args.install_bucket_mib * MiB)
        torch.cuda.synchronize()
        installs.run(path, label, manifest, buckets, t0, time.monotonic())
        del buckets
    result.update(installs.report())
    results.put(result)


class _Installs:
    """Part (c) on the engine side: installs received pushes on a given path of :mod:`rollout.install.direct_load`,
    in process (GPU tensors, no pickling), times them and checks the greedy output after each."""

    def __init__(self, args, llm, generate, base: list[int]):
        from rollout.install.direct_load import DirectLoad
        self.args, self.llm, self.generate, self.base = args, llm, generate, base
        self.direct = DirectLoad()
        self.times: dict[str, list[dict]] = {}
        self.greedy = {"scaled_outputs_equal": True, "scaled_changed_output": None, "originals_restored": True}
        self.scaled_output = None
        self.cpu_path = None
        self.tensors = 0

    def run(self, path: str, label: str, manifest, buckets, t0: float, received: float) -> None:
        import torch

        from protocol.weight_transfer import named_views
        from rollout.install.direct_load import worker_kv_caches
        views = lambda: iter(named_views(manifest, buckets))  # noqa: E731
        direct = self.direct

        def install(worker):
            model = worker.model_runner.get_model()
            if path == "reload":
                worker.reload_weights(weights_iterator=views())
                return "reload"
            if path == "direct" and direct.proven:  # plain load even where the copy plan is proven
                model.load_weights(views())
                return "direct"
            return direct.install(model, views, lambda w: worker.reload_weights(weights_iterator=w),
                                  ignore=worker_kv_caches(worker))

        taken = self.llm.collective_rpc(install)[0]
        torch.cuda.synchronize()
        installed = time.monotonic()
        if taken != path:  # plain load was refused (or not decided): report the path that ran
            print(f"install path {taken} where {path} was planned: {direct.refused_reason}")
        self.times.setdefault(taken, []).append(
            {"weights": label, "transfer_s": received - t0, "install_s": installed - received,
             "export_to_installed_s": installed - t0})
        out = self.generate()
        if label == "scaled":
            self.scaled_output = self.scaled_output or out
            self.greedy["scaled_outputs_equal"] &= out == self.scaled_output
            self.greedy["scaled_changed_output"] = out != self.base
        else:
            self.greedy["originals_restored"] &= out == self.base
            if self.cpu_path is None:
                self.cpu_path = _cpu_path(self.args, self.llm, manifest, buckets)
                self.greedy["cpu_path_keeps_original"] = self.generate() == self.base
        self.tensors = len(manifest.tensors)

    def report(self) -> dict:
        return {"install": self.times, "greedy": self.greedy, "cpu_path": self.cpu_path,
                "engine_tensors": self.tensors, "direct_load_refused": self.direct.refused_reason,
                "copy_plan_refused": self.direct.plan_refused_reason}


def _cpu_path(args, llm, manifest, buckets) -> dict:
    """The CPU path's install of the same weights: GPU -> host, CRC32 buckets, /dev/shm safetensors, reload."""
    import torch
    from safetensors.torch import save_file

    from protocol.weights import pack_buckets
    from protocol.weight_transfer import named_views
    t = time.monotonic()
    host = [(n, v.cpu()) for n, v in named_views(manifest, buckets)]
    t_d2h = time.monotonic()
    arrays = [(n, "bfloat16" if v.dtype == torch.bfloat16 else str(v.dtype).removeprefix("torch."),
               tuple(v.shape), v.contiguous().view(torch.uint8).numpy()) for n, v in host]
    pack_buckets(arrays, 2, args.install_bucket_mib * MiB)  # CRC32 of every bucket, as the CPU path does
    t_crc = time.monotonic()
    staged = Path(tempfile.mkdtemp(dir="/dev/shm"))
    save_file(dict(host), str(staged / "model.safetensors"))
    t_stage = time.monotonic()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(staged)})
    torch.cuda.synchronize()
    t_reload = time.monotonic()
    for f in staged.iterdir():
        f.unlink()
    staged.rmdir()
    return {"d2h_s": t_d2h - t, "crc32_pack_s": t_crc - t_d2h, "stage_shm_s": t_stage - t_crc,
            "reload_from_path_s": t_reload - t_stage, "total_s": t_reload - t}


def _install_summary(nbytes: int, runs: list[dict]) -> dict:
    """Medians over the runs of one install path (seconds) and the effective GB/s export -> installed."""
    med = {k: statistics.median(r[k] for r in runs) for k in ("transfer_s", "install_s", "export_to_installed_s")}
    return dict(med, runs=runs, gbps=_gbps(nbytes, med["export_to_installed_s"]))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1.5b", help="1.5b (Qwen2.5-1.5B dimensions) or a services.models.tiny_model size")
    ap.add_argument("--buckets", default="64,256,1024", help="bucket sizes in MiB")
    ap.add_argument("--install-bucket-mib", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=2, choices=[1, 2],
                    help="1: no NCCL; pack + checksum + install on one GPU (parts (b) without the wire and (c))")
    ap.add_argument("--colocated", action="store_true",
                    help="with --gpus 1: the learner in another process on the same GPU, pushes through CUDA IPC")
    ap.add_argument("--timeout-s", type=float, default=540.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "refit_h200.json"))
    args = ap.parse_args()
    args.buckets = [int(b) for b in args.buckets.split(",")]
    from services.models import tiny_model
    from services.cluster.head import free_port

    sizes = dict(tiny_model.SIZES, **{"1.5b": SIZE_1_5B})
    tiny_model.SIZES = sizes  # the bench's larger size, without changing the module's table for others
    import torch
    t = time.monotonic()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: 75 s on the CPU
        model_dir = str(tiny_model.make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="qwen2", size=args.size,
                                                   dtype="bfloat16"))
    build_s = time.monotonic() - t
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    port = free_port()
    from refit_colocated import colocated, colocated_report
    if args.colocated and args.gpus != 1:
        raise SystemExit("--colocated: the learner and the engine share one GPU; use --gpus 1")
    procs = ([ctx.Process(target=learner_side, args=(args, model_dir, port, a)),
              ctx.Process(target=engine_side, args=(args, model_dir, port, b, results))] if args.gpus == 2 else
             [ctx.Process(target=colocated if args.colocated else one_gpu, args=(args, model_dir, results))])
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout_s
    result = None
    while result is None and time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs):
        try:
            result = results.get(timeout=1.0)
        except queue.Empty:
            pass
    for p in procs:
        p.join(max(1.0, min(30.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
    if result is None:
        raise SystemExit(f"refit bench failed or timed out: exit codes {[p.exitcode for p in procs]}")
    n = result["bytes"]
    if args.colocated:
        return colocated_report(args, n, result, build_s)
    report = {"model": f"qwen2 {args.size} bf16", "bytes": n, "model_build_s": build_s, "gpus": args.gpus,
              "tensors": result["engine_tensors"], "greedy": result["greedy"], "cpu_path": result["cpu_path"],
              "raw_broadcast": {"seconds_median": statistics.median(result["raw"]),
                                "gbps": _gbps(n, statistics.median(result["raw"]))} if result["raw"] else None,
              "push": [dict(r, seconds_median=statistics.median(r["seconds"]),
                            gbps=_gbps(n, statistics.median(r["seconds"]))) for r in result["push"]],
              "direct_load_refused": result["direct_load_refused"], "copy_plan_refused": result["copy_plan_refused"],
              "install": {path: _install_summary(n, runs) for path, runs in result["install"].items()}}
    print(f"model {report['model']}: {n / 1e9:.2f} GB in {report['tensors']} tensors")
    print(f"{'what':<44}{'seconds':>10}{'GB/s':>10}")
    if report["raw_broadcast"]:
        print(f"{'(a) raw NCCL broadcast, one buffer':<44}{report['raw_broadcast']['seconds_median']:>10.4f}"
              f"{report['raw_broadcast']['gbps']:>10.1f}")
    for r in report["push"]:
        how = {True: "double", False: "single", None: "pack+verify, no wire"}[r["double_buffer"]]
        label = f"(b) push {r['bucket_mib']} MiB x{r['buckets']} {how}"
        print(f"{label:<44}{r['seconds_median']:>10.4f}{r['gbps']:>10.1f}")
    for path, v in report["install"].items():
        print(f"{'(c) ' + path + ': transfer + verify':<44}{v['transfer_s']:>10.4f}")
        print(f"{'(c) ' + path + ': install':<44}{v['install_s']:>10.4f}")
        print(f"{'(c) ' + path + ': export -> installed':<44}{v['export_to_installed_s']:>10.4f}{v['gbps']:>10.1f}")
    if report["direct_load_refused"]:
        print("direct load refused:", report["direct_load_refused"])
    if report["copy_plan_refused"]:
        print("copy plan refused:", report["copy_plan_refused"])
    for k, v in report["cpu_path"].items():
        print(f"{'(c) CPU path ' + k:<44}{v:>10.4f}")
    print("greedy:", report["greedy"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
