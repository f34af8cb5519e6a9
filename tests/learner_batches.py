"""Learner factory, deterministic prompts/responses/groups and a float32 transformers reference
for the learner integration tests (and the services tests that train a learner group)."""
from __future__ import annotations

import numpy as np
import torch

from protocol.messages import Trajectory, TrajectoryGroup

VOCAB = 448


def sequences(n: int, seed: int = 0, prompt_len=(4, 12), response_len=(3, 20), vocab: int = VOCAB):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(*prompt_len)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(3, vocab, rng.integers(*response_len)).astype(np.int32) for _ in range(n)]
    return prompts, responses


def groups(learner, num_groups: int = 3, group_size: int = 4, seed: int = 0,
           vocab: int = VOCAB) -> list[TrajectoryGroup]:
    """On-policy groups: log-probs from the learner itself, rewards that vary inside each group."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, 6).astype(np.int32)
        responses = [rng.integers(3, vocab, rng.integers(4, 16)).astype(np.int32) for _ in range(group_size)]
        lps = learner.logprobs([prompt] * group_size, responses)
        trajs = [Trajectory(r, lp, np.zeros(r.size), float(i % 2)) for i, (r, lp) in enumerate(zip(responses, lps))]
        out.append(TrajectoryGroup(f"g{g}", f"p{g}", prompt, trajs, group_size, vocab))
    return out


@torch.no_grad()
def hf_response_logprobs(model, prompts, responses) -> list[np.ndarray]:
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor(np.concatenate([p, r]), dtype=torch.long)[None]
        logp = model(ids).logits.float().log_softmax(-1)[0]
        out.append(logp[len(p) - 1:-1].gather(-1, torch.tensor(r, dtype=torch.long)[:, None])[:, 0].numpy())
    return out


def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_learner(model_dir: str, **overrides):
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", freeze_moe_router=overrides.pop("freeze_moe_router", False),
                              optimizer=OptimizerConfig(lr=overrides.pop("lr", 1e-3), weight_decay=0.0))
    loss = overrides.pop("loss", LossConfig())
    packing = overrides.pop("packing", SequencePackingConfig(train_mb_tokens=256))
    max_len = overrides.pop("max_total_sequence_length", 128)
    return Learner(model_dir, megatron, loss, packing, max_total_sequence_length=max_len, **overrides)
