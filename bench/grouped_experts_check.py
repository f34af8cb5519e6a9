"""Grouped experts vs Megatron's per-expert loop on one model and batch (issue 35 item 3): the response log-probs
of both learners, max |difference|, and after one identical train step the loss and grad norm of each.

    python3 bench/grouped_experts_check.py --size small --out bench/results/grouped_experts_check.json

bf16 on a GPU (float32 on CPU); a random Qwen3-MoE from ``services.models.tiny_model``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="small")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner
    from protocol.messages import Trajectory, TrajectoryGroup
    from services.models.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "moe", seed=0, arch="qwen3_moe", size=args.size))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 400, 32).astype(np.int32) for _ in range(args.sequences)]
    responses = [rng.integers(3, 400, int(rng.integers(64, 512))).astype(np.int32) for _ in range(args.sequences)]
    cuda = torch.cuda.is_available()
    result: dict = {"size": args.size, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    lps = {}
    for experts in ("loop", "grouped"):
        megatron = MegatronConfig(precision="bfloat16" if cuda else "float32", moe_grouped_gemm=experts == "grouped",
                                  optimizer=OptimizerConfig(lr=1e-5))
        learner = Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=8192), 8192)
        lps[experts] = learner.logprobs(prompts, responses)
        groups = [TrajectoryGroup(f"g{g}", f"p{g}", prompts[g * 8], [
            Trajectory(responses[i], lps[experts][i], np.zeros(responses[i].size), float(i % 2))
            for i in range(g * 8, g * 8 + 8)], 8, 400) for g in range(args.sequences // 8)]
        m = learner.train_step(groups)
        result[experts] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "precision": megatron.precision}
        learner.shutdown()
        if cuda:
            torch.cuda.empty_cache()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(lps["loop"], lps["grouped"], strict=True))
    result["logprob_max_abs_diff"] = diff
    result["logprob_mean_abs"] = float(np.mean([np.abs(a).mean() for a in lps["loop"]]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
