"""``LearnerGroup.reset`` through real Ray and Megatron-Core: a one-rank group that has trained, built again in
place, is what a new group is: policy version 0, the model's log-probs, and a first step (a fresh optimizer)
that gives a new group's loss, gradient norm and weights."""
from __future__ import annotations

import numpy as np
import pytest
from learner_batches import groups
from test_pool_and_loops import tiny_recipe

VOCAB = 64
STEP_KEYS = ("loss", "grad_norm", "policy_version", "optimizer_steps")


def group_refs(learner, seed: int) -> list:
    """Two on-policy groups of four (log-probs from ``learner``, rewards that vary inside each), in the object
    store."""
    import ray

    from protocol import encode

    return [ray.put(encode(g)) for g in groups(learner, num_groups=2, group_size=4, seed=seed, vocab=VOCAB)]


def probe(learner) -> list[list[float]]:
    return learner.logprobs([[5, 6, 7, 8]], [[9, 10, 11]])


def test_a_reset_group_is_a_new_group(fresh_learner, tmp_path):
    from services.job.learner_group import LearnerGroup
    from services.models.variant import resolve_policy_model

    recipe = tiny_recipe("grpo.max_num_steps=2")
    model = resolve_policy_model(recipe.policy)
    new = LearnerGroup(recipe, model)
    try:
        start, refs = probe(new), group_refs(new, seed=0)
        first = new.train_step(refs)
        assert first["optimizer_steps"] == 1 and new.version() == 1
        trained = probe(new)
        assert np.abs(np.subtract(trained, start)).max() > 1e-4, "the step changed nothing: the test cannot tell"

        lent = fresh_learner(recipe, model)
        lent.train_step(group_refs(lent, seed=1))  # its own history: another step, on other groups
        lent.train_step(group_refs(lent, seed=2))
        lent.reset(recipe, model)
        assert lent.version() == 0
        assert np.abs(np.subtract(probe(lent), start)).max() == 0.0
        again = lent.train_step(refs)
        assert {k: again[k] for k in STEP_KEYS} == pytest.approx({k: first[k] for k in STEP_KEYS}, rel=1e-6)
        assert np.abs(np.subtract(probe(lent), trained)).max() < 1e-6
    finally:
        new.shutdown()
