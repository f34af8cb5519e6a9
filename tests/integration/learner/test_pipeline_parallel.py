"""Pipeline parallelism: two gloo stages (one layer each) give the same log-probs, loss, gradient norm, entropy and
updated weights as one process; the export gathered from both stages is the source checkpoint bit for bit before
training, and a checkpoint restores per stage. Untied and tied embeddings (the output layer on the last stage is a
copy of the first stage's embedding, its gradient summed with it)."""
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
LR = 3e-3


def _worker(rank: int, port: int, model_dir: str, batch, out_path: str) -> None:
    become_rank(rank, WORLD, port)
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.hf_export import export_hf_state_dict
    from learner.model import shutdown_distributed
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", pipeline_model_parallel_size=WORLD,
                              optimizer=OptimizerConfig(lr=LR, weight_decay=0.0))
    learner = Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=64), 64)
    assert len(learner.gpt.decoder.layers) == 1  # one of the two layers on each stage
    initial = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    lps = learner.logprobs(*sequences(4, seed=9))
    metrics = learner.train_step(batch)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    assert (state is None) == (rank != 0)

    ckpt = os.path.join(os.path.dirname(out_path), "ckpt")
    check_checkpoint_round_trip(learner, batch, ckpt, f"stage {rank}")
    torch.save({"initial": initial, "logprobs": lps, "metrics": metrics, "state": state}, f"{out_path}.{rank}")
    shutdown_distributed()


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "qwen3_moe"])
def test_two_stages_equal_one_process(family, family_models, tmp_path):
    from learner.config import SequencePackingConfig
    from learner.hf_export import export_hf_state_dict

    model_dir = family_models(family)
    single = make_learner(model_dir, lr=LR, packing=SequencePackingConfig(train_mb_tokens=64),
                          max_total_sequence_length=64)
    batch = groups(single, num_groups=2, group_size=4, seed=4)
    lps = single.logprobs(*sequences(4, seed=9))
    metrics = single.train_step(batch)
    state = export_hf_state_dict(single.gpt, single.arch, single.hf_metas)
    single.shutdown()

    out = str(tmp_path / "stage")
    run_ranks(_worker, model_dir, batch, out, world=WORLD, timeout_s=TIMEOUT_S, what=f"pipeline stages ({family})")
    first, last = (torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD))
    source = load_file(f"{model_dir}/model.safetensors")
    assert list(first["initial"]) == list(state) and first["initial"].keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(first["initial"][name], tensor), name
    assert last["initial"] is None and last["state"] is None
    for a, b, c in zip(lps, first["logprobs"], last["logprobs"], strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(b, c)  # every stage has the last stage's numbers
    for key in ("loss", "grad_norm", "num_valid_tokens", "probs_ratio_mean", "is_weight_mean", "token_entropy_mean",
                "logprob_mismatch_sequences"):  # the per-sequence mismatch: the last stage's on every stage
        for stage in (first, last):
            assert stage["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    assert first["metrics"]["num_micro_batches"] == metrics["num_micro_batches"] > 1
    # Adam's first update is ~lr·sign(g): an element whose gradient is ~0 may flip sign between the two
    # reduction orders and move by up to 2·lr. Everything else must agree to float32 noise.
    assert list(first["state"]) == list(state)
    diffs = torch.cat([(first["state"][n] - t).abs().reshape(-1) for n, t in state.items()])
    assert diffs.max() <= 2 * LR + 1e-6
    assert (diffs > 1e-5).float().mean() < 1e-3, f"{int((diffs > 1e-5).sum())} of {diffs.numel()} differ"
    moved = torch.cat([(state[n] - source[n]).abs().reshape(-1) for n in state])
    assert (moved > 1e-4).float().mean() > 0.5  # the step changed the weights: the comparison above means something
