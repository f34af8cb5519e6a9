"""MoE experts as grouped GEMMs (policy.megatron_cfg.moe_grouped_gemm), float32 on CPU, on the tiny Qwen3-MoE
(SwiGLU experts), a tiny Nemotron-H and a tiny Nano-Omni (squared-ReLU experts): the same log-probs, loss, gradient
norm and updated weights as Megatron's per-expert loop (SequentialMLP), and an export equal to the source checkpoint
bit for bit; with EP = 2 in two gloo processes too (Qwen3-MoE, Nemotron-H)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, run_ranks
from learner_batches import VOCAB, groups, sequences
from nemotron_h_models import MOE_PATTERN, build_nemotron_h
from safetensors.torch import load_file

LR = 3e-3
KEYS = ("loss", "grad_norm", "num_valid_tokens", "probs_ratio_mean", "token_entropy_mean")


def _learner(model_dir: str, grouped: bool, ep: int = 1):
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", moe_grouped_gemm=grouped, expert_model_parallel_size=ep,
                              optimizer=OptimizerConfig(lr=LR, weight_decay=0.0))
    return Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=64), 64)


def _text_vocab(learner) -> int:
    """Token ids to draw from: the model's, below the tiny tokenizers' media tokens (a Nano-Omni's follow its text)."""
    return min(learner.arch.vocab_size, VOCAB)


def _run(learner, batch) -> dict:
    from learner.hf_export import export_hf_state_dict

    initial = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    lps = learner.logprobs(*sequences(4, seed=9, vocab=_text_vocab(learner)))
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


@pytest.fixture(scope="module")
def moe_dirs(tiny_moe_dir, tmp_path_factory) -> dict[str, str]:
    """A checkpoint per family of experts: Qwen3-MoE (SwiGLU), Nemotron-H and Nano-Omni (squared ReLU)."""
    from services.models.tiny_omni import make_tiny_omni

    root = tmp_path_factory.mktemp("grouped")
    return {"qwen3_moe": tiny_moe_dir, "nemotron_h": str(build_nemotron_h(root / "nemotron_h", MOE_PATTERN, seed=5)),
            "nano_omni": str(make_tiny_omni(root / "omni", seed=1, moe=True))}


def _source(model_dir: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h", "nano_omni"])
def test_grouped_experts_equal_the_per_expert_loop(moe_dirs, family, tmp_path):
    model_dir = moe_dirs[family]
    loop = _learner(model_dir, grouped=False)
    assert loop.arch.is_moe and (loop.arch.hybrid is None) == (family == "qwen3_moe")
    batch = groups(loop, num_groups=2, group_size=4, seed=4, vocab=_text_vocab(loop))
    want = _run(loop, batch)
    assert any(".local_experts." in n for n, _ in loop.gpt.named_parameters())
    loop.shutdown()
    grouped = _learner(model_dir, grouped=True)
    names = [n for n, _ in grouped.gpt.named_parameters()]
    assert not any(".local_experts." in n for n in names) and any(n.endswith("mlp.experts.weight1") for n in names)
    got = _run(grouped, batch)
    grouped.shutdown()
    source = _source(model_dir)
    _same(got, want, source)
    moved = torch.cat([(want["state"][n] - source[n]).abs().reshape(-1) for n in source if ".experts." in n])
    assert (moved > 1e-4).float().mean() > 0.5  # the experts trained: the comparison above means something

    if family != "nano_omni":  # the same language model as Nemotron-H's; EP of the tower adds nothing
        out = str(tmp_path / "rank0.pt")
        run_ranks(_worker, model_dir, batch, out, world=2, timeout_s=240.0, what=f"grouped experts, EP=2 ({family})")
        _same(torch.load(out, weights_only=False), want, source)
