"""Shared by the vision-language learner tests (Qwen2.5-VL, Nano-Omni): on-policy groups of image prompts, and one
training step with the tower frozen or trained, checked the same way for every family."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from protocol.messages import Trajectory, TrajectoryGroup

PromptMaker = Callable[[int, list], tuple[list, list, list]]
"""(seed, one image size per prompt) -> (prompt ids, responses, images) of the family's test prompts."""


def image_groups(learner, make_prompts: PromptMaker, size, num_groups: int = 2, group_size: int = 4):
    """On-policy groups of image prompts (rewards vary inside each group) and their images by prompt id."""
    out, by_prompt = [], {}
    for g in range(num_groups):
        prompts, responses, images = make_prompts(10 + g, [size] * group_size)
        lps = learner.logprobs([prompts[0]] * group_size, responses, [images[0]] * group_size)
        trajs = [Trajectory(r, lp, np.zeros(r.size), float(i % 2))
                 for i, (r, lp) in enumerate(zip(responses, lps, strict=True))]
        out.append(TrajectoryGroup(f"g{g}", f"p{g}", prompts[0], trajs, group_size, learner.arch.vocab_size))
        by_prompt[f"p{g}"] = images[0]
    return out, by_prompt


def split_params(learner, unused: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(vision side, language model) parameters, copied; names containing ``unused`` (a part no image reaches, such
    as a video embedder) left out."""
    params = {k: v.detach().clone() for k, v in learner.gpt.named_parameters() if unused is None or unused not in k}
    tower = {k: v for k, v in params.items() if k.startswith("visual.")}
    return tower, {k: v for k, v in params.items() if k not in tower}


def changed(before: dict[str, torch.Tensor], learner) -> int:
    now = dict(learner.gpt.named_parameters())
    return sum(not torch.equal(v, now[k].detach()) for k, v in before.items())


def step_and_check(learner, make_prompts: PromptMaker, size, frozen: bool, unused: str | None = None) -> None:
    """One training step on image groups: the language model always changes; the tower changes exactly when it is
    trained (a frozen one stays in eval mode through the step's ``model.train()``); the step's own forward equals
    ``logprobs()`` on the same images."""
    groups, images = image_groups(learner, make_prompts, size)
    tower, lm = split_params(learner, unused)
    if frozen:
        assert not any(p.requires_grad for n, p in learner.gpt.named_parameters() if n.startswith("visual."))
    m = learner.train_step(groups, images)
    assert m["step_skipped"] == 0 and learner.policy_version == 1 and m["grad_norm"] > 0
    assert m["gen_kl_error"] < 1e-6
    assert changed(tower, learner) == (0 if frozen else len(tower)) and changed(lm, learner) == len(lm)
    if frozen:
        assert not learner.gpt.visual.training
