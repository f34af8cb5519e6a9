"""Learner step throughput vs a bare Megatron forward/backward on the same packed batch (CPU or GPU), per
attention backend and packing budget: tokens/s, MFU and peak GPU memory.

Both sides see identical micro-batches: the bare loop runs forward + backward of the summed
per-token log-probs and an optimizer step on the same DDP-wrapped model, without the GRPO
bookkeeping (sample collection, packing, advantages, loss, metrics, finiteness checks, the
token-count and metric all-reduces). The ratio learner / bare says how much of the raw Megatron
throughput `Learner.train_step` keeps. Learner and bare steps alternate (L, B, L, B, …) so that
both see the same load on a shared machine; each side reports its median, and ``ratio_paired``
is the median over pairs of bare / learner step time.

Unless ``--no-two-step``, the same loop also runs the batch as two optimizer steps (``train_global_batch_size``
= half the batch; π_prev then comes from an extra no-grad forward of the whole batch): ``two_step_s`` is its
median step time, ``two_step_ratio`` = two_step_s / learner_step_s, ``prev_logprobs_s`` the median
time of that extra forward and ``prev_logprobs_share`` its share of the two-step step.

``--shape qwen3-0.6b|qwen3-1.7b|qwen3-4b|qwen3-8b`` builds a random bf16 model of that published shape (its
vocabulary of 151936 included; on the GPU) instead of a tiny one; ``--mb-tokens`` and ``--backends`` take
comma lists (every pair runs in this process, one learner each; an out-of-memory is recorded, not fatal);
``--seq-len`` is the longest sequence (lengths uniform in [seq-len/2, seq-len], at least ``--tokens-per-mb``
budgets' worth of tokens a step). MFU = 6 · parameters · tokens/s / ``--peak-tflops`` (790: the bf16 rate
measured on an H200), attention's own FLOPs not counted.

``--fusions`` compares the learner's speed-only fusions (torch's fused AdamW, the compiled SwiGLU of
``bias_activation_fusion``, the compiled entropy on a GPU) with Megatron's per-tensor AdamW, plain SwiGLU and the
eager entropy; ``--profile`` adds each run's CUDA
kernel time by kind (:mod:`bench.kernel_profile`).

``--shape nemotron-h-2b`` is a random bf16 Nemotron-H (hybrid Mamba2 / attention / MoE) shaped after
Nemotron-3-Nano-30B-A3B, shortened (:data:`NEMOTRON_H_SHAPES`); ``nemotron-h-tiny`` the same layer pattern tiny,
for a CPU smoke run. For MoE shapes the MFU counts *active* parameters: every parameter except the routed
experts', plus top-k / experts of theirs (embedding and output layer included, as for the dense shapes);
``parameters`` stays the total.

    python bench/learner_step.py [--arch qwen2|...] [--size tiny] [--groups 8] [--group-size 8] [--steps 5]
    python bench/learner_step.py --shape qwen3-0.6b --mb-tokens 4096,8192,16384,32768 --backends local,flex \
        --chunk 2048 --no-two-step --steps 3
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.kernel_profile, run as a script

from services.models.tiny_model import ARCHS

SHAPES = {  # Qwen3's published dense shapes: hidden, layers, heads, kv heads, intermediate, tied
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, True), "qwen3-1.7b": (2048, 28, 16, 8, 6144, True),
    "qwen3-4b": (2560, 36, 32, 8, 9728, True), "qwen3-8b": (4096, 36, 32, 8, 12288, False),
}

NANO3_PATTERN_SHORT = "MEMEM*EMEMEM*EMEME"
"""Nemotron-3-Nano's ``MEMEM*EMEMEM*…`` cut to 18 layers: 8 Mamba2, 8 MoE, 2 attention (Nano 3: 23 / 23 / 6)."""
# NemotronHConfig keywords; Nano 3 scaled from hidden 2688 to 2048 (mamba inner 1.5x hidden, state 128, 8 groups;
# GQA 2 kv heads of 128; experts top-6 of squared-ReLU, moe ffn ~0.66x hidden, shared 2x it)
NEMOTRON_H_SHAPES: dict[str, dict[str, Any]] = {
    "nemotron-h-2b": dict(vocab_size=131072, hidden_size=2048, hybrid_override_pattern=NANO3_PATTERN_SHORT,
                          num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=1344,
                          mamba_num_heads=48, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                          chunk_size=128, n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=1344,
                          moe_shared_expert_intermediate_size=2688),
    "nemotron-h-tiny": dict(vocab_size=512, hidden_size=64, hybrid_override_pattern=NANO3_PATTERN_SHORT,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                            chunk_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            moe_shared_expert_intermediate_size=64),
}


def make_nemotron_h_model(out: Path, shape: str) -> Path:
    """A random bf16 ``NemotronHForCausalLM`` of ``shape`` in ``out`` (config.json as transformers writes it)."""
    import torch
    from transformers import AutoModelForCausalLM, NemotronHConfig

    cfg = NemotronHConfig(**NEMOTRON_H_SHAPES[shape], routed_scaling_factor=2.5, n_group=1, topk_group=1,
                          norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=262144,
                          tie_word_embeddings=False, num_nextn_predict_layers=0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    return out


def active_parameters(model, top_k: int | None, experts: int | None) -> float:
    """Parameters one token goes through: all but the routed experts', plus top_k / experts of theirs."""
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name and "shared_expert" not in name:
            routed += p.numel()
    return total - routed + (routed * top_k / experts if top_k and experts else routed)


def make_shaped_model(out: Path, shape: str) -> Path:
    """A random bf16 Qwen3 of ``shape`` (head_dim 128, vocab 151936) in ``out``, built on the GPU if any."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape in NEMOTRON_H_SHAPES:
        return make_nemotron_h_model(out, shape)
    hidden, layers, heads, kv, ffn, tied = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=128, intermediate_size=ffn, max_position_embeddings=40960,
                      rope_theta=1000000.0, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    return out


def unfuse_adam(optimizer) -> None:
    """Back to torch's per-tensor AdamW, as Megatron builds it without TE or Apex (the ``--fusions`` baseline)."""
    from learner.optimizer import torch_optimizers

    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            group["fused"], group["foreach"] = False, True


FUSIONS = ("adam", "swiglu", "entropy")
"""What ``--fusions`` names (joined by ``+``; ``all`` / ``none``): torch's fused AdamW, the compiled SwiGLU of
``bias_activation_fusion``, the compiled entropy of the log-prob path."""


def set_fusions(learner, fused: set[str]) -> None:
    """Undo the learner's fusions not in ``fused`` (the baseline: Megatron's per-tensor AdamW, eager entropy;
    SwiGLU is set through the config before the model is built)."""
    import torch

    from learner import logprobs

    if "adam" not in fused:
        unfuse_adam(learner.optim.optimizer)
    logprobs._compiled_row_entropy = None if "entropy" in fused else (
        lambda x: torch.cat([logprobs._row_entropy(c) for c in x.split(logprobs.ENTROPY_CHUNK_ROWS)]))


def run_one(args, model_dir: Path, backend: str, mb_tokens: int, experts: str = "loop",
            fusions: str = "all") -> dict:
    """One learner (``backend``, ``mb_tokens``, ``fusions``) on a fresh batch: the measured medians (module
    docstring)."""
    import torch

    from bench.kernel_profile import profile
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig, TrainStepConfig
    from learner.logprobs import token_logprobs
    from learner.trainer import Learner
    from protocol.messages import Trajectory, TrajectoryGroup

    cuda = torch.cuda.is_available()
    fused = set(FUSIONS) if fusions == "all" else set() if fusions == "none" else set(fusions.split("+"))
    if fused - set(FUSIONS):
        raise ValueError(f"--fusions: {sorted(fused - set(FUSIONS))} not among {FUSIONS} (or all / none)")
    seq_len = min(args.seq_len, mb_tokens)
    megatron = MegatronConfig(precision="bfloat16" if cuda else "float32", optimizer=OptimizerConfig(lr=1e-5),
                              attention_backend=backend, logprob_chunk_size=args.chunk,
                              activation_checkpointing=args.recompute, moe_grouped_gemm=experts == "grouped",
                              bias_activation_fusion="swiglu" in fused)
    learner = Learner(str(model_dir), megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=mb_tokens),
                      max_total_sequence_length=seq_len)
    set_fusions(learner, fused)
    rng = np.random.default_rng(0)
    vocab = learner.arch.vocab_size
    num_groups = args.groups
    if args.tokens_per_mb:  # enough sequences for tokens_per_mb budgets
        num_groups = max(1, int(np.ceil(args.tokens_per_mb * mb_tokens / (0.75 * seq_len * args.group_size))))
    prompts, responses = [], []
    for _ in range(num_groups):
        lo = max(16, seq_len // 2) if args.shape else 32
        prompt_len = int(rng.integers(16, 64)) if not args.shape else 64
        prompt = rng.integers(3, vocab, prompt_len).astype(np.int32)
        hi = seq_len - prompt_len if args.shape else 256
        for _ in range(args.group_size):
            prompts.append(prompt)
            responses.append(rng.integers(3, vocab, int(rng.integers(min(lo, hi), hi + 1))).astype(np.int32))
    lps = learner.logprobs(prompts, responses)
    groups = []
    for g in range(num_groups):
        sl = slice(g * args.group_size, (g + 1) * args.group_size)
        trajs = [Trajectory(r, lp, np.zeros(r.size), float(rng.random())) for r, lp in zip(responses[sl], lps[sl],
                                                                                          strict=True)]
        groups.append(TrajectoryGroup(f"g{g}", f"p{g}", prompts[sl][0], trajs, args.group_size, vocab))

    batch = learner._collect(groups)
    micro_batches, _ = learner._pack([s.tokens for s in batch.samples])
    micro_batches = [mb.to(learner.device) for mb in micro_batches]

    def bare_step() -> float:
        t0 = time.perf_counter()
        learner.model.zero_grad_buffer()
        learner.optim.zero_grad()
        for mb in micro_batches:
            token_logprobs(learner.model, mb, learner.logprob_chunk).sum().backward()
        learner.model.finish_grad_sync()
        learner.optim.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    one_step = TrainStepConfig()
    two_steps = TrainStepConfig(train_global_batch_size=num_groups * args.group_size // 2)

    def two_step() -> dict[str, float]:
        learner.step_cfg = two_steps
        try:
            return learner.train_step(groups)
        finally:
            learner.step_cfg = one_step

    learner.train_step(groups)  # warm-up (flex compiles here)
    bare_step()
    if args.two_step:
        two_step()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    learner_s, bare_s, two_s, prev_s, fills, tokens = [], [], [], [], [], 0.0
    for _ in range(args.steps):
        m = learner.train_step(groups)
        learner_s.append(m["policy_training_s"])
        fills.append(m["fill_ratio"])
        tokens = m["tokens_per_s"] * m["policy_training_s"]
        bare_s.append(bare_step())
        if args.two_step:
            m2 = two_step()
            assert m2["optimizer_steps"] == 2, m2
            two_s.append(m2["policy_training_s"])
            prev_s.append(m2["prev_logprobs_s"])
    profiles = ({"profile_learner": profile(lambda: learner.train_step(groups)), "profile_bare": profile(bare_step)}
                if args.profile else {})
    params = sum(p.numel() for p in learner.gpt.parameters())
    active = active_parameters(learner.gpt, learner.arch.moe_top_k, learner.arch.num_experts)
    learner_tps = tokens / float(np.median(learner_s))
    bare_tps = tokens / float(np.median(bare_s))
    peak = args.peak_tflops * 1e12
    result = {"arch": args.shape or args.arch, "size": args.size, "device": "cuda" if cuda else "cpu",
              "precision": megatron.precision, "experts": experts, "attention_backend": backend, "fusions": fusions,
              "logprob_chunk_size": args.chunk,
              "activation_checkpointing": args.recompute,
              "parameters": params, "active_parameters": active, "max_sequence_length": seq_len,
              "tokens_per_step": tokens,
              "micro_batches": len(micro_batches), "train_mb_tokens": mb_tokens, "fill_ratio": float(np.mean(fills)),
              "learner_step_s": float(np.median(learner_s)), "bare_step_s": float(np.median(bare_s)),
              "learner_tokens_per_s": learner_tps, "bare_tokens_per_s": bare_tps, "ratio": learner_tps / bare_tps,
              "ratio_paired": float(np.median(np.asarray(bare_s) / np.asarray(learner_s))),
              "mfu_learner": 6 * active * learner_tps / peak, "mfu_bare": 6 * active * bare_tps / peak,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "steps": args.steps,
              **profiles}
    if args.two_step:
        result.update({"two_step_s": float(np.median(two_s)),
                       "two_step_ratio": float(np.median(two_s)) / float(np.median(learner_s)),
                       "prev_logprobs_s": float(np.median(prev_s)),
                       "prev_logprobs_share": float(np.median(np.asarray(prev_s) / np.asarray(two_s)))})
    learner.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2", choices=list(ARCHS))
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--shape", default=None, choices=[*SHAPES, *NEMOTRON_H_SHAPES])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--mb-tokens", default="1024", help="comma list of packing budgets")
    ap.add_argument("--backends", default="auto", help="comma list of policy.megatron_cfg.attention_backend")
    ap.add_argument("--experts", default="loop", help="comma list: loop (per-expert GEMMs), grouped "
                    "(policy.megatron_cfg.moe_grouped_gemm)")
    ap.add_argument("--fusions", default="all", help="comma list of all, none or +-joined names of FUSIONS: adam "
                    "(torch's fused AdamW), swiglu (policy.megatron_cfg.bias_activation_fusion), entropy (compiled)")
    ap.add_argument("--profile", action="store_true", help="also time 2 learner and 2 bare steps' CUDA kernels by "
                    "kind (bench/kernel_profile.py)")
    ap.add_argument("--chunk", type=int, default=None, help="policy.megatron_cfg.logprob_chunk_size")
    ap.add_argument("--seq-len", type=int, default=8192, help="longest sequence with --shape")
    ap.add_argument("--tokens-per-mb", type=float, default=0.0, help="batch size in budgets (0: --groups)")
    ap.add_argument("--no-two-step", dest="two_step", action="store_false")
    ap.add_argument("--recompute", action="store_true", help="policy.megatron_cfg.activation_checkpointing")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "learner_step_cpu.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

    import torch

    from services.models.tiny_model import make_tiny_model

    where = Path(tempfile.mkdtemp())
    model_dir = (make_shaped_model(where / args.shape, args.shape) if args.shape else
                 make_tiny_model(where / args.arch, seed=0, arch=args.arch, size=args.size))
    results = []
    for budget in (int(b) for b in args.mb_tokens.split(",")):
        for backend, experts, fusions in ((b, e, f) for b in args.backends.split(",") for e in args.experts.split(",")
                                          for f in args.fusions.split(",")):
            t0 = time.perf_counter()
            try:
                r = run_one(args, model_dir, backend, budget, experts, fusions)
            except torch.OutOfMemoryError as err:
                r = {"arch": args.shape or args.arch, "experts": experts, "attention_backend": backend,
                     "fusions": fusions,
                     "train_mb_tokens": budget,
                     "logprob_chunk_size": args.chunk, "oom": str(err).splitlines()[0][:600]}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
            out = Path(args.out)  # after each run: a run cut short by a time limit keeps what it measured
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
