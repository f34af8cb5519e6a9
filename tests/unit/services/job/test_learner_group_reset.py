"""LearnerGroup.reset refuses a recipe its ranks cannot take, naming what differs, before any rank is called."""
from __future__ import annotations

import pytest

from services.job.learner_actor import LearnerSpec
from services.job.learner_group import LearnerGroup
from services.models.files import ModelFiles
from services.recipe.config import load_recipe


class Rank:
    """A rank actor that records the calls made to it."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name: str):
        self.calls.append(name)
        raise AssertionError(f"reset called {name} on a rank before refusing")


def group_of(recipe, model_dir: str, ranks: int) -> tuple[LearnerGroup, list]:
    calls: list = []
    group = LearnerGroup.__new__(LearnerGroup)  # its ranks as fakes: no Ray
    group.actors, group.timeout = [Rank(calls) for _ in range(ranks)], 60.0
    group.files = ModelFiles(model_dir, "node", "127.0.0.1")
    group.spec = LearnerSpec.of(recipe, group.files)
    return group, calls


def test_reset_refuses_another_rank_count_model_or_parallel_layout_before_any_rank_is_called(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    one_rank = load_recipe(None, [])
    group, calls = group_of(one_rank, str(model), ranks=1)
    with pytest.raises(ValueError, match=r"asks for 2 ranks \(learner_gpus\); this group has 1"):
        group.reset(load_recipe(None, ["rollout_pool.learner_gpus=2"]), str(model))
    with pytest.raises(ValueError, match=f"model {other} is not this group's {model}"):
        group.reset(one_rank, str(other))
    two_ranks = load_recipe(None, ["rollout_pool.learner_gpus=2"])
    group, calls = group_of(two_ranks, str(model), ranks=2)
    tp2 = load_recipe(None, ["rollout_pool.learner_gpus=2", "policy.megatron_cfg.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"\(TP, PP, EP\) = \(2, 1, 1\); this group's ranks were set up with "
                                         r"\(1, 1, 1\)"):
        group.reset(tp2, str(model))
    assert calls == [] and group.spec.megatron.tensor_model_parallel_size == 1  # nothing called, nothing changed
