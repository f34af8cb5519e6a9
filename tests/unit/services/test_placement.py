"""GPU requests per actor for the shipped layouts."""
from __future__ import annotations

import pytest

from services.config import RECIPES_DIR, load_recipe
from services.placement import PlacementError, check_learner_fits, engine_gpus, learner_gpus_per_rank


def test_cpu_recipe_asks_for_no_gpu():
    r = load_recipe(None)
    assert engine_gpus(r) == 0 and learner_gpus_per_rank(r) == 0
    check_learner_fits(r, 0)


def test_separate_pools_take_whole_gpus():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml")
    assert engine_gpus(r) == 2 and learner_gpus_per_rank(r) == 1
    check_learner_fits(r, 32)
    with pytest.raises(PlacementError, match="needs 16 GPUs"):
        check_learner_fits(r, 8)


def test_one_gpu_colocated_shares_it():
    r = load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml")
    assert engine_gpus(r) == 0.5 and learner_gpus_per_rank(r) == 0.5
    check_learner_fits(r, 1)


def test_colocated_multi_gpu_engines_are_refused():
    with pytest.raises(PlacementError, match="2 GPUs per engine is not supported"):
        engine_gpus(load_recipe(RECIPES_DIR / "grpo-32gpu-sync-colocated.yaml"))
