"""Nemotron-H on one GPU (vLLM 0.25.1): a Nano-3-shaped random hybrid served by the rollout engine, and a push
into a running engine checked against a freshly started engine on the same weights.

``build`` writes a random bf16 ``NemotronHForCausalLM`` of ``bench/learner_step.py``'s ``--shape`` (default
``nemotron-h-2b``: Nano 3's ``MEMEM*EMEMEM*EMEME`` cut to 18 layers, hidden 2048, 32 squared-ReLU experts top-6
and a shared expert) with the tiny local tokenizer, whose vocabulary (448 tokens) replaces the shape's
131072: 1.71B parameters instead of 2.24B, so that the toy task's tokens are the model's. The Mamba tensors
the init sets to constants (``A_log``, ``D``, the norms, the routers' score-correction bias) are moved off them
per seed, so a loader that drops one shows; ``config.json`` is written in the published form
(``hybrid_override_pattern``).

``install A B`` starts an engine on B (bf16 and CUDA graphs unless told otherwise; Triton MoE; the float32 SSM
cache the engine sets for hybrids), times its start and a greedy generation, and keeps the log-probs of its
answers and a fingerprint of every tensor its model holds (shape, dtype, checksum); then an engine on A takes B
through ``RolloutEngine.install`` (the object-store push: staged, then vLLM's layerwise ``reload_weights``) and
must give what the fresh engine gave and hold the same tensors. Prints a table and writes ``--out`` (JSON).

    python bench/nemotron_h_gpu.py build /tmp/models/nemotron-h-a --seed 0
    python bench/nemotron_h_gpu.py install /tmp/models/nemotron-h-a /tmp/models/nemotron-h-b \
        --out bench/results/nemotron_h_install_h200.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
from learner_step import NEMOTRON_H_SHAPES


def build(out: Path, shape: str, seed: int) -> dict:
    """The random model of ``shape`` (vocabulary of the tiny tokenizer) in ``out``; returns its sizes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, NemotronHConfig

    from services.models.tiny_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    dims = {**NEMOTRON_H_SHAPES[shape], "vocab_size": (len(tok) + 63) // 64 * 64}
    cfg = NemotronHConfig(**dims, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
                          layer_norm_epsilon=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
                          num_nextn_predict_layers=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():  # off the init's constants (A_log = log(1..H), D = 1, norms = 1, bias = 0)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "D", "e_score_correction_bias") or (leaf == "weight" and "norm" in name):
                t.add_(0.1 * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out), safe_serialization=True)
    path = out / "config.json"
    written = json.loads(path.read_text())
    layers = written.pop("layers_block_type")
    written.pop("mtp_layers_block_type", None)
    written["hybrid_override_pattern"] = NemotronHConfig._list_to_pattern(layers)
    written["num_hidden_layers"] = len(layers)
    written["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v
                                  for v in written["time_step_limit"]]
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return {"dir": str(out), "shape": shape, "seed": seed, "parameters": params,
            "pattern": written["hybrid_override_pattern"], "vocab_size": dims["vocab_size"]}


class Served:
    """A started rollout engine on its own event loop, and how long the start took."""

    def __init__(self, model_dir: str, args):
        from rollout.config import GenerationConfig, VllmConfig
        from rollout.engine import RolloutEngine
        from rollout.rewards.registry import get_reward_fn

        generation = GenerationConfig(max_new_tokens=args.max_new_tokens, request_timeout_s=600.0, max_retries=0,
                                      vllm_cfg=VllmConfig(enforce_eager=args.eager, precision=args.precision, seed=0,
                                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                                          moe_backend="triton"))
        self.engine = RolloutEngine(model_dir, generation, 2048, get_reward_fn("repeat_letter"),
                                    engine_id=Path(model_dir).name)
        self.loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        self.run(self.engine.start())
        self.start_s = time.perf_counter() - t0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def greedy(self, requests) -> tuple[list[list[int]], float]:
        """Greedy answers to every request, generated together; and tokens per second."""
        async def all_of():
            return await asyncio.gather(*(self.engine.generate_group(r, 1, temperature=0.0) for r in requests))
        t0 = time.perf_counter()
        groups = self.run(all_of())
        answers = [g.trajectories[0].response_ids.tolist() for g in groups]
        return answers, sum(map(len, answers)) / (time.perf_counter() - t0)

    def logprobs(self, prompts, answers) -> list[np.ndarray]:
        return [np.asarray(x, np.float64) for x in self.run(self.engine.logprobs_of(prompts, answers))]

    def fingerprint(self) -> dict[str, tuple]:
        """(shape, dtype, device checksum) of every tensor the worker's model holds, KV cache left out."""
        def read(worker):
            from rollout.install.direct_load import fingerprint, worker_kv_caches
            return fingerprint(worker.model_runner.get_model(), worker_kv_caches(worker)).entries
        (entries,) = self.run(self.engine._llm.collective_rpc(read))
        return entries

    def close(self) -> None:
        try:
            self.run(self.engine.shutdown())
        finally:
            self.loop.close()


def object_store_push(model_dir: str, version: int):
    """The checkpoint as the learner's object-store push (raw bytes per tensor)."""
    import torch
    from safetensors.torch import load_file

    from protocol import pack_buckets

    tensors: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    raw = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.contiguous().view(torch.uint8).numpy()
            .reshape(-1)) for n, t in sorted(tensors.items())]
    return pack_buckets(raw, version=version, bucket_bytes=256 << 20), sum(r[3].size for r in raw)


def install_check(a: str, b: str, args) -> dict:
    from services.data.tasks import make_prompts

    fresh = Served(b, args)
    try:
        requests = make_prompts("repeat_letter", fresh.engine.tokenizer, args.prompts, seed=0)
        prompts = [r.prompt_ids.tolist() for r in requests]
        answers, tok_s = fresh.greedy(requests)
        reference = fresh.logprobs(prompts, answers)
        fresh_tensors = fresh.fingerprint()
        fresh_start_s = fresh.start_s
    finally:
        fresh.close()
    served = Served(a, args)
    try:
        base = served.logprobs(prompts, answers)
        (manifest, buckets), nbytes = object_store_push(b, 1)
        t0 = time.perf_counter()
        assert served.run(served.engine.install(manifest, buckets)) == 1
        install_call_s = time.perf_counter() - t0
        installed = served.logprobs(prompts, answers)
        installed_answers, _ = served.greedy(requests)
        installed_tensors = served.fingerprint()
        stats = served.engine.stats()
    finally:
        served.close()
    diff = lambda x, y: max(float(np.abs(p - q).max()) for p, q in zip(x, y, strict=True))  # noqa: E731
    return {
        "model_b": b, "prompts": len(prompts), "answer_tokens": sum(map(len, answers)),
        "fresh_engine_start_s": round(fresh_start_s, 1), "engine_a_start_s": round(served.start_s, 1),
        "greedy_tok_s": round(tok_s, 1),
        "a_vs_b_max_abs_logprob": diff(base, reference),
        "install_vs_fresh_max_abs_logprob": diff(installed, reference),
        "install_vs_fresh_mean_abs_logprob": float(np.mean(np.abs(np.concatenate(installed)
                                                                  - np.concatenate(reference)))),
        "install_greedy_answers_same": sum(x == y for x, y in zip(installed_answers, answers, strict=True)),
        "model_tensors": len(fresh_tensors),
        "install_vs_fresh_tensors_differing": sorted(n for n in fresh_tensors.keys() | installed_tensors.keys()
                                                     if fresh_tensors.get(n) != installed_tensors.get(n)),
        "push_bytes": nbytes, "install_call_s": round(install_call_s, 3),
        "install_phases_s": {k: round(v, 4) for k, v in stats["phases_last"].items() if v},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("model_dir", type=Path)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--shape", default="nemotron-h-2b", choices=sorted(NEMOTRON_H_SHAPES))
    i = sub.add_parser("install")
    i.add_argument("a")
    i.add_argument("b")
    i.add_argument("--prompts", type=int, default=32)
    i.add_argument("--max-new-tokens", type=int, default=128)
    i.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    i.add_argument("--precision", default="bfloat16", choices=["bfloat16", "float32"])
    i.add_argument("--eager", action="store_true", help="no CUDA graphs (a CPU smoke run)")
    i.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "build":
        result = build(args.model_dir, args.shape, args.seed)
    else:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the fingerprint reader runs on the worker
        result = install_check(args.a, args.b, args)
    print(json.dumps(result, indent=2))
    if args.cmd == "install":
        print(f"\n| fresh start | tok/s greedy | install of {result['push_bytes'] / 1e9:.2f} GB | install vs fresh "
              f"max / mean | greedy same | tensors differing | A vs B |\n|---|---|---|---|---|---|---|\n"
              f"| {result['fresh_engine_start_s']} s | {result['greedy_tok_s']} | {result['install_call_s']} s | "
              f"{result['install_vs_fresh_max_abs_logprob']:.2e} / {result['install_vs_fresh_mean_abs_logprob']:.2e} "
              f"| {result['install_greedy_answers_same']}/{result['prompts']} | "
              f"{len(result['install_vs_fresh_tensors_differing'])} of {result['model_tensors']} | "
              f"{result['a_vs_b_max_abs_logprob']:.2e} |")
    if args.cmd == "install" and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
