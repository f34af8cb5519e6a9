"""Placement checks count free GPUs, not the cluster's total, and say who holds the others (issue 21, item 3).

The Ray resource queries are fakes here; tests/integration/services/test_placement_gpus.py runs the same
checks against a private Ray with declared GPUs."""
from __future__ import annotations

import pytest

from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import GpuCensus, PlacementError, check_learner_fits, check_pool_fits, gpu_census

ASYNC2 = RECIPES_DIR / "gpu-2xh200-async.yaml"


def census(recipe, total: float, available: float) -> GpuCensus:
    return gpu_census(recipe, cluster=lambda: {"CPU": 16.0, "GPU": total}, available=lambda: {"GPU": available})


def test_the_async_recipe_on_one_gpu_names_the_gpus_asked_for_free_and_who_holds_them():
    """The hang of issue 21: 1 GPU in all, the pool's one engine on it; the old check (need 1 <= total 1)
    let the rank actor wait 1800 s for a GPU."""
    r = load_recipe(ASYNC2)
    c = census(r, total=1, available=0)
    assert (c.free, c.pool_engines, c.pool_gpus) == (0, 1, 1)
    with pytest.raises(PlacementError) as err:
        check_learner_fits(r, c)
    msg = str(err.value)
    assert "the learner asks for 1 GPUs (1 rank x 1 GPU, rollout_pool.learner_gpus)" in msg
    assert "0 of the Ray cluster's 1 GPUs are free (the rollout pool's 1 engine holds 1 of 1 GPUs)" in msg
    assert "cluster.num_nodes x cluster.gpus_per_node = 1 x 2 = 2 GPUs" in msg
    assert "policy.generation.colocated.enabled=true" in msg and "rollout_pool.num_engines" in msg


def test_an_engine_not_placed_yet_still_counts_as_the_pools():
    """Free = the available GPUs less what the pool's engines take and do not hold yet."""
    r = load_recipe(ASYNC2)
    c = census(r, total=2, available=2)
    assert c.free == 1
    check_learner_fits(r, c)
    assert census(r, total=2, available=1).free == 1  # the engine placed: the same
    c = census(r, total=2, available=0)  # something else holds the learner's GPU
    assert c.free == 0
    assert c.holders() == "the rollout pool's 1 engine holds 1 of 2 GPUs and other actors or placement groups hold 1"
    with pytest.raises(PlacementError, match="0 of the Ray cluster's 2 GPUs are free"):
        check_learner_fits(r, c)


def test_cpu_recipes_ask_for_nothing_and_pass():
    r = load_recipe(None)
    c = census(r, total=0, available=0)
    assert (c.pool_engines, c.pool_gpus) == (0, 0)
    check_learner_fits(r, c)
    check_pool_fits(r, c, missing_engines=r.rollout_pool.num_engines)


def test_colocated_ranks_are_checked_against_the_group_not_the_free_gpus():
    """A colocated pool's group holds every GPU (none is free); the learner's ranks go into it."""
    r = load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml")
    check_learner_fits(r, census(r, total=1, available=0))
    with pytest.raises(PlacementError, match="needs 0.5 GPUs .* has 0 in all"):
        check_learner_fits(r, census(r, total=0, available=0))


def test_a_fresh_pool_fails_before_booting_when_its_learner_would_not_fit():
    r = load_recipe(ASYNC2)
    check_pool_fits(r, census(r, total=2, available=2), missing_engines=1)
    with pytest.raises(PlacementError) as err:
        check_pool_fits(r, census(r, total=1, available=1), missing_engines=1)
    assert ("the rollout pool asks for 1 GPUs (1 engine x 1 GPU (num_engines x tensor_parallel_size x "
            "pipeline_parallel_size)) and its learner for 1 more (rollout_pool.learner_gpus), 2 in all; 1 of the "
            "Ray cluster's 1 GPUs are free") in str(err.value)
    with pytest.raises(PlacementError, match=r"asks for 1 GPUs .* 0 of the Ray cluster's 2 GPUs are free \(2 held"):
        check_pool_fits(r, census(r, total=2, available=0), missing_engines=1)


def test_a_restarted_pool_replica_counts_only_the_engines_it_must_make():
    """Its engines that still exist hold their GPUs (and the learner attached holds its own)."""
    r = load_recipe(RECIPES_DIR / "grpo-8gpu-async-4x4.yaml")
    n = r.rollout_pool.num_engines
    check_pool_fits(r, census(r, total=8, available=0), missing_engines=0)
    if n > 1:
        check_pool_fits(r, census(r, total=8, available=r.gpus_per_engine), missing_engines=1)
