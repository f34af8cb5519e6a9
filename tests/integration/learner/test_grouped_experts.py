"""MoE experts as grouped GEMMs (policy.megatron_cfg.moe_grouped_gemm) on the tiny Qwen3-MoE, float32 on CPU: the
same log-probs, loss, gradient norm and updated weights as Megatron's per-expert loop (SequentialMLP), and an
export equal to the source checkpoint bit for bit; with EP = 2 in two gloo processes too."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, run_ranks
from learner_batches import groups, sequences
from safetensors.torch import load_file

LR = 3e-3
KEYS = ("loss", "grad_norm", "num_valid_tokens", "probs_ratio_mean", "token_entropy_mean")


def _learner(model_dir: str, grouped: bool, ep: int = 1):
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", moe_grouped_gemm=grouped, expert_model_parallel_size=ep,
                              optimizer=OptimizerConfig(lr=LR, weight_decay=0.0))
    return Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=64), 64)


def _run(learner, batch) -> dict:
    from learner.hf_export import export_hf_state_dict

    initial = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    lps = learner.logprobs(*sequences(4, seed=9))
    metrics = learner.train_step(batch)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    return {"initial": initial, "logprobs": lps, "metrics": metrics, "state": state}


def _worker(rank: int, port: int, model_dir: str, batch, out_path: str) -> None:
    become_rank(rank, 2, port)
    from learner.model import shutdown_distributed

    learner = _learner(model_dir, grouped=True, ep=2)
    result = _run(learner, batch)
    if rank == 0:
        torch.save(result, out_path)
    shutdown_distributed()


def _same(got: dict, want: dict, source: dict) -> None:
    assert list(got["initial"]) == list(want["initial"])
    for name, tensor in source.items():
        assert torch.equal(got["initial"][name], tensor), name
    for a, b in zip(want["logprobs"], got["logprobs"], strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    for key in KEYS:
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key
    # Adam's first update is ~lr·sign(g): a gradient of ~0 may flip sign between summation orders
    diffs = torch.cat([(got["state"][n] - t).abs().reshape(-1) for n, t in want["state"].items()])
    assert diffs.max() <= 2 * LR + 1e-6
    assert (diffs > 1e-5).float().mean() < 1e-3, f"{int((diffs > 1e-5).sum())} of {diffs.numel()} differ"


def test_grouped_experts_equal_the_per_expert_loop(tiny_moe_dir, tmp_path):
    loop = _learner(tiny_moe_dir, grouped=False)
    batch = groups(loop, num_groups=2, group_size=4, seed=4)
    want = _run(loop, batch)
    assert any(".local_experts." in n for n, _ in loop.gpt.named_parameters())
    loop.shutdown()
    grouped = _learner(tiny_moe_dir, grouped=True)
    names = [n for n, _ in grouped.gpt.named_parameters()]
    assert not any(".local_experts." in n for n in names) and any(n.endswith("mlp.experts.weight1") for n in names)
    got = _run(grouped, batch)
    grouped.shutdown()
    source = load_file(f"{tiny_moe_dir}/model.safetensors")
    _same(got, want, source)
    moved = torch.cat([(want["state"][n] - source[n]).abs().reshape(-1) for n in source if ".experts." in n])
    assert (moved > 1e-4).float().mean() > 0.5  # the experts trained: the comparison above means something

    out = str(tmp_path / "rank0.pt")
    run_ranks(_worker, tiny_moe_dir, batch, out, world=2, timeout_s=240.0, what="grouped experts, EP=2")
    _same(torch.load(out, weights_only=False), want, source)
