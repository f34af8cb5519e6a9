"""``policy.megatron_cfg.freeze_moe_router`` on real Megatron-Core: a train step on the tiny MoE model leaves every
router weight as loaded and still moves the experts; without the flag the router moves too."""
from __future__ import annotations

import torch

from learner_batches import groups, make_learner


def _routers_and_experts(learner) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}
    return ({k: v for k, v in params.items() if ".mlp.router." in k},
            {k: v for k, v in params.items() if ".mlp.experts." in k})


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_frozen_router_keeps_its_weights_and_the_experts_train(tiny_moe_dir):
    for frozen in (True, False):
        learner = make_learner(tiny_moe_dir, lr=1e-2, freeze_moe_router=frozen)
        try:
            routers, experts = _routers_and_experts(learner)
            assert routers and experts
            learner.train_step(groups(learner, seed=3))
            assert learner.last_skip_reason == ""
            routers_after, experts_after = _routers_and_experts(learner)
            assert _moved(experts, experts_after), "the experts did not train"
            moved = _moved(routers, routers_after)
            assert (not moved) if frozen else moved == set(routers), (frozen, sorted(moved))
        finally:
            learner.shutdown()
