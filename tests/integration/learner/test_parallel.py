"""TP=2, and EP=2 × DP=2 on the tiny MoE, in two gloo processes give the same log-probs, loss, gradient
norm and updated weights as one process; export from them is exact and checkpoints restore per rank."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, check_checkpoint_round_trip, run_ranks
from learner_batches import groups, make_learner, sequences
from safetensors.torch import load_file

WORLD = 2
TIMEOUT_S = 240.0


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
    prompts, responses = sequences(4, seed=9)
    lps = learner.logprobs(prompts, responses)
    metrics = learner.train_step(batch)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)

    # Per-rank checkpoint: save, step, restore, step again -> bit-identical on every rank.
    ckpt = os.path.join(os.path.dirname(out_path), "ckpt")
    check_checkpoint_round_trip(learner, batch, ckpt, f"rank {rank}")
    if rank == 0:
        torch.save({"initial": initial, "logprobs": lps, "metrics": metrics, "state": state}, out_path)
    shutdown_distributed()


def _run_two_ranks(model_dir: str, tp: int, ep: int, batch, out_path: str) -> dict:
    run_ranks(_worker, model_dir, tp, ep, batch, out_path, timeout_s=TIMEOUT_S,
              what=f"learner ranks (TP={tp}, EP={ep})")
    return torch.load(out_path, weights_only=False)


@pytest.mark.parametrize("arch,tp,ep", [("qwen2", 2, 1), ("qwen3_moe", 1, 2)])
def test_two_ranks_equal_one(arch, tp, ep, tiny_model_dir, tiny_moe_dir, tmp_path):
    from learner.config import SequencePackingConfig
    from learner.hf_export import export_hf_state_dict

    model_dir = tiny_model_dir if arch == "qwen2" else tiny_moe_dir
    single = make_learner(model_dir, lr=3e-3, packing=SequencePackingConfig(train_mb_tokens=64),
                          max_total_sequence_length=64)
    batch = groups(single, num_groups=2, group_size=4, seed=4)
    lps = single.logprobs(*sequences(4, seed=9))
    metrics = single.train_step(batch)
    state = export_hf_state_dict(single.gpt, single.arch, single.hf_metas)
    single.shutdown()

    multi = _run_two_ranks(model_dir, tp, ep, batch, str(tmp_path / "rank0.pt"))
    source = load_file(f"{model_dir}/model.safetensors")
    assert list(multi["initial"]) == list(state) and multi["initial"].keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(multi["initial"][name], tensor), name
    for a, b in zip(lps, multi["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for key in ("loss", "grad_norm", "num_valid_tokens", "probs_ratio_mean", "is_weight_mean",
                "logprob_mismatch_sequences"):  # the per-sequence mismatch: summed over the DP ranks
        assert multi["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    assert multi["metrics"]["num_micro_batches"] == metrics["num_micro_batches"] > 1
    if ep > 1:  # an odd number of micro-batches of different lengths: both kinds of padding ran
        assert metrics["num_micro_batches"] % 2 == 1 and multi["metrics"]["pad_tokens"] > 0
    # Adam's first update is ~lr·sign(g): an element whose gradient is ~0 may flip sign between the
    # two reduction orders and move by up to 2·lr. Everything else must agree to float32 noise.
    lr = 3e-3
    diffs = torch.cat([(multi["state"][n] - t).abs().reshape(-1) for n, t in state.items()])
    assert diffs.max() <= 2 * lr + 1e-6
    assert (diffs > 1e-5).float().mean() < 1e-3, f"{int((diffs > 1e-5).sum())} of {diffs.numel()} differ"
