"""Multi-turn trajectories on real Megatron-Core: the tokens of a masked middle span (environment tokens, loss
mask 0) are context only. What they carry as log-probs and versions changes nothing in a step (weights bit for
bit, every metric), with one optimizer step and with two (π_prev from the no-grad forward), the KL penalty's
reference forward included; unmasking them does change the step, and so does changing their token ids (they
are in the sequence)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner_batches import VOCAB, make_learner
from protocol import Trajectory, TrajectoryGroup, masked_fill

LR = 2e-2
NUM_GROUPS, GROUP_SIZE = 2, 4


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}


def _batch(scorer, variant: str, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups whose responses have their middle third masked. ``variant``: ``base`` (canonical values at the
    masked tokens), ``junk`` (other log-probs and versions there), ``unmasked`` (every token trained, the
    masked ones with the scorer's log-probs) or ``ids`` (other token ids at the masked positions)."""
    rng = np.random.default_rng(seed)
    junk = np.random.default_rng(seed + 1)  # its own stream: the other variants' draws stay the same
    out = []
    for g in range(NUM_GROUPS):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        responses = [rng.integers(3, VOCAB, rng.integers(9, 18)).astype(np.int32) for _ in range(GROUP_SIZE)]
        other_ids = [rng.integers(3, VOCAB, r.size).astype(np.int32) for r in responses]
        noise = [rng.normal(0, 0.05, r.size) for r in responses]
        masks = []
        for r in responses:
            mask = np.ones(r.size, np.uint8)
            mask[r.size // 3:2 * r.size // 3] = 0
            masks.append(mask)
        if variant == "ids":
            responses = [np.where(m == 1, r, o).astype(np.int32) for r, o, m in
                         zip(responses, other_ids, masks, strict=True)]
        lps = scorer.logprobs([prompt] * GROUP_SIZE, responses)
        trajs = []
        for i, (r, lp, m, e) in enumerate(zip(responses, lps, masks, noise, strict=True)):
            gen = np.minimum(lp + e, 0.0).astype(np.float32)  # off-policy a little: IS weights and gen KL move
            versions = np.where(np.arange(r.size) < r.size // 2, 0, 1)  # an in-flight update inside the sample
            if variant == "unmasked":
                trajs.append(Trajectory(r, gen, versions, float(i % 2)))
                continue
            gen_c, vers_c = masked_fill(m, gen, versions)
            if variant == "junk":
                gen_c = np.where(m == 1, gen_c, -5.0 - junk.random(r.size)).astype(np.float32)
                vers_c = np.where(m == 1, vers_c, junk.integers(0, 9, r.size)).astype(np.int32)
            trajs.append(Trajectory(r, gen_c, vers_c, float(i % 2), "stop", "", {}, m, ["stop", "stop"]))
        out.append(TrajectoryGroup(f"g{g}", f"p{g}", prompt, trajs, GROUP_SIZE, VOCAB))
    return out


@pytest.mark.parametrize("global_batch", [None, GROUP_SIZE], ids=["one-optimizer-step", "two-optimizer-steps"])
def test_masked_tokens_are_context_only(tiny_model_dir, global_batch):
    from learner.config import LossConfig, TrainStepConfig

    cfg = dict(lr=LR, loss=LossConfig(reference_policy_kl_penalty=0.05, truncated_importance_sampling_ratio=2.0),
               step_config=TrainStepConfig(train_global_batch_size=global_batch))
    runs = {}
    for variant in ("base", "junk", "unmasked", "ids"):
        learner = make_learner(tiny_model_dir, **cfg)
        try:
            batch = _batch(learner, variant)
            initial = _params(learner)
            metrics = learner.train_step(batch)
            runs[variant] = (metrics, _params(learner), batch, initial)
        finally:
            learner.shutdown()
    base, base_params, batch, initial = runs["base"]
    sampled = sum(int(t.loss_mask.sum()) for g in batch for t in g.trajectories)
    env = sum(int((t.loss_mask == 0).sum()) for g in batch for t in g.trajectories)
    assert base["num_valid_tokens"] == sampled and base["env_tokens"] == env > 0
    assert base["optimizer_steps"] == (1 if global_batch is None else 2) and base["step_skipped"] == 0
    assert any(not torch.equal(base_params[k], v) for k, v in initial.items())
    assert base["is_weight_mean"] != 1.0 and base["gen_kl_error"] > 0

    junk, junk_params, _, _ = runs["junk"]
    assert all(torch.equal(base_params[k], junk_params[k]) for k in base_params)
    for key in ("loss", "grad_norm", "num_valid_tokens", "gen_kl_error", "policy_kl_error", "is_weight_mean",
                "is_weight_max", "probs_ratio_mean", "clip_fraction", "token_entropy_mean", "token_mult_prob_error"):
        assert junk[key] == base[key], key

    unmasked, unmasked_params, _, _ = runs["unmasked"]
    assert unmasked["num_valid_tokens"] == sampled + env and unmasked["env_tokens"] == 0
    assert any(not torch.equal(base_params[k], unmasked_params[k]) for k in base_params)
    assert unmasked["loss"] != base["loss"]

    ids, ids_params, _, _ = runs["ids"]  # same sampled tokens, other context between them
    assert ids["num_valid_tokens"] == sampled
    assert any(not torch.equal(base_params[k], ids_params[k]) for k in base_params)
