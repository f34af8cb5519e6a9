"""Nemotron-H in two gloo processes equals one process — TP=2 on the dense pattern (the Mamba tensors' per-rank
layout: in_proj ``[z_r; x_r; B_r; C_r; dt_r]``, conv1d ``[x_r; B_r; C_r]``, heads, gated-norm channels, out_proj
columns; attention; MLP) and EP=2 × DP=2 on the MoE pattern (experts split, expert bias on every rank): the same
log-probs, loss and gradient norm, and export is exact before training. (MoE layers with TP > 1 are refused:
Megatron trains them only with sequence parallelism.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, run_ranks
from learner_batches import make_learner
from nemotron_h_models import VOCAB, build_nemotron_h
from safetensors.torch import load_file

from protocol.messages import Trajectory, TrajectoryGroup

WORLD = 2
TIMEOUT_S = 300.0


def _sequences() -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, VOCAB, rng.integers(3, 10)).astype(np.int32) for _ in range(5)]
    return prompts, [rng.integers(3, VOCAB, rng.integers(2, 20)).astype(np.int32) for _ in range(5)]


def _batch(learner) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(12)
    prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
    responses = [rng.integers(3, VOCAB, rng.integers(4, 12)).astype(np.int32) for _ in range(4)]
    lps = learner.logprobs([prompt] * 4, responses)
    trajs = [Trajectory(r, lp, np.zeros(r.size), float(i % 2))
             for i, (r, lp) in enumerate(zip(responses, lps, strict=True))]
    return [TrajectoryGroup("g0", "p0", prompt, trajs, 4, VOCAB)]


def _worker(rank: int, port: int, model_dir: str, tp: int, ep: int, batch, out_path: str) -> None:
    become_rank(rank, WORLD, port)
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.hf_export import export_hf_state_dict
    from learner.model import shutdown_distributed
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    learner = Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=64), 64)
    initial = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    lps = learner.logprobs(*_sequences())
    metrics = learner.train_step(batch)
    if rank == 0:
        torch.save({"initial": initial, "logprobs": lps, "metrics": metrics}, out_path)
    shutdown_distributed()


@pytest.mark.parametrize("pattern,tp,ep", [("M*-M", 2, 1), ("ME*E", 1, 2)])
def test_two_ranks_equal_one(pattern, tp, ep, tmp_path):
    from learner.config import SequencePackingConfig

    model_dir = str(build_nemotron_h(tmp_path / "model", pattern, seed=5))
    single = make_learner(model_dir, lr=3e-3, packing=SequencePackingConfig(train_mb_tokens=64),
                          max_total_sequence_length=64)
    batch = _batch(single)
    lps = single.logprobs(*_sequences())
    metrics = single.train_step(batch)
    single.shutdown()

    out_path = str(tmp_path / "rank0.pt")
    run_ranks(_worker, model_dir, tp, ep, batch, out_path, timeout_s=TIMEOUT_S,
              what=f"learner ranks (TP={tp}, EP={ep})")
    tp = torch.load(out_path, weights_only=False)

    source = load_file(f"{model_dir}/model.safetensors")
    assert tp["initial"].keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(tp["initial"][name], tensor), name
    for a, b in zip(tp["logprobs"], lps, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm"):
        assert abs(tp["metrics"][key] - metrics[key]) <= 1e-4 * max(1.0, abs(metrics[key])), key
