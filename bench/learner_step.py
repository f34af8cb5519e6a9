"""Learner step throughput vs a bare Megatron forward/backward on the same packed batch (CPU or GPU).

Both sides see identical micro-batches: the bare loop runs forward + backward of the summed
per-token log-probs and an optimizer step on the same DDP-wrapped model, without the GRPO
bookkeeping (sample collection, packing, advantages, loss, metrics, finiteness checks, the
token-count and metric all-reduces). The ratio learner / bare says how much of the raw Megatron
throughput `Learner.train_step` keeps. Learner and bare steps alternate (L, B, L, B, …) so that
both see the same load on a shared machine; each side reports its median, and ``ratio_paired``
is the median over pairs of bare / learner step time.

The same loop also runs the batch as two optimizer steps (``train_global_batch_size`` = half the
batch; π_prev then comes from an extra no-grad forward of the whole batch): ``two_step_s`` is its
median step time, ``two_step_ratio`` = two_step_s / learner_step_s, ``prev_logprobs_s`` the median
time of that extra forward and ``prev_logprobs_share`` its share of the two-step step.

    python bench/learner_step.py [--arch qwen2|qwen3|llama|llama3|qwen3_moe|mistral] [--groups 8] [--group-size 8] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from services.tiny_model import ARCHS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2", choices=list(ARCHS))
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--mb-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "learner_step_cpu.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

    import torch

    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig, TrainStepConfig
    from learner.logprobs import token_logprobs
    from learner.trainer import Learner
    from protocol.messages import Trajectory, TrajectoryGroup
    from services.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / args.arch, seed=0, arch=args.arch, size=args.size)
    megatron = MegatronConfig(precision="float32" if not torch.cuda.is_available() else "bfloat16",
                              optimizer=OptimizerConfig(lr=1e-5))
    learner = Learner(str(model_dir), megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=args.mb_tokens),
                      max_total_sequence_length=512)
    rng = np.random.default_rng(0)
    vocab = learner.arch.vocab_size
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(3, vocab, int(rng.integers(16, 64))).astype(np.int32)
        responses = [rng.integers(3, vocab, int(rng.integers(32, 256))).astype(np.int32)
                     for _ in range(args.group_size)]
        lps = learner.logprobs([prompt] * args.group_size, responses)
        trajs = [Trajectory(r, lp, np.zeros(r.size), float(rng.random())) for r, lp in zip(responses, lps, strict=True)]
        groups.append(TrajectoryGroup(f"g{g}", f"p{g}", prompt, trajs, args.group_size, vocab))

    batch = learner._collect(groups)
    micro_batches, _ = learner._pack([s.tokens for s in batch.samples])
    micro_batches = [mb.to(learner.device) for mb in micro_batches]

    def bare_step() -> float:
        t0 = time.perf_counter()
        learner.model.zero_grad_buffer()
        learner.optim.zero_grad()
        for mb in micro_batches:
            token_logprobs(learner.model, mb).sum().backward()
        learner.model.finish_grad_sync()
        learner.optim.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    one_step = TrainStepConfig()
    two_steps = TrainStepConfig(train_global_batch_size=args.groups * args.group_size // 2)

    def two_step() -> dict[str, float]:
        learner.step_cfg = two_steps
        try:
            return learner.train_step(groups)
        finally:
            learner.step_cfg = one_step

    learner.train_step(groups)  # warm-up
    bare_step()
    two_step()
    learner_s, bare_s, two_s, prev_s, fills, tokens = [], [], [], [], [], 0.0
    for _ in range(args.steps):
        m = learner.train_step(groups)
        learner_s.append(m["policy_training_s"])
        fills.append(m["fill_ratio"])
        tokens = m["tokens_per_s"] * m["policy_training_s"]
        bare_s.append(bare_step())
        m2 = two_step()
        assert m2["optimizer_steps"] == 2, m2
        two_s.append(m2["policy_training_s"])
        prev_s.append(m2["prev_logprobs_s"])
    learner_tps = tokens / float(np.median(learner_s))
    bare_tps = tokens / float(np.median(bare_s))
    result = {"arch": args.arch, "size": args.size, "device": "cuda" if torch.cuda.is_available() else "cpu",
              "precision": megatron.precision, "tokens_per_step": tokens, "micro_batches": len(micro_batches),
              "train_mb_tokens": args.mb_tokens, "fill_ratio": float(np.mean(fills)),
              "learner_step_s": float(np.median(learner_s)), "bare_step_s": float(np.median(bare_s)),
              "learner_tokens_per_s": learner_tps, "bare_tokens_per_s": bare_tps, "ratio": learner_tps / bare_tps,
              "ratio_paired": float(np.median(np.asarray(bare_s) / np.asarray(learner_s))),
              "two_step_s": float(np.median(two_s)),
              "two_step_ratio": float(np.median(two_s)) / float(np.median(learner_s)),
              "prev_logprobs_s": float(np.median(prev_s)),
              "prev_logprobs_share": float(np.median(np.asarray(prev_s) / np.asarray(two_s))),
              "steps": args.steps}
    print(f"{'metric':<24}{'value':>14}")
    for k in ("tokens_per_step", "micro_batches", "fill_ratio", "learner_step_s", "bare_step_s",
              "learner_tokens_per_s", "bare_tokens_per_s", "ratio", "ratio_paired", "two_step_s", "two_step_ratio",
              "prev_logprobs_s", "prev_logprobs_share"):
        v = result[k]
        print(f"{k:<24}{v:>14.3f}" if isinstance(v, float) else f"{k:<24}{v:>14}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    learner.shutdown()


if __name__ == "__main__":
    main()
