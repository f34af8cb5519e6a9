"""Async on one GPU (issue 21, item 3): ``rollout_pool.share_gpu`` puts the pool's engine and the learner's rank on
the cluster's one GPU, half of it each in Ray's count, with the memory split by the recipe. The layouts it cannot
run are refused at load, each naming the key; the Ray options and the placement checks agree on the halves.
Real Ray with one declared GPU: tests/unit/services/pool/test_placement_share_gpu.py."""
from __future__ import annotations

import pytest

from services.recipe.config import RECIPES_DIR, RecipeError, load_recipe
from services.recipe.gpu_layout import (
    GpuCensus,
    PlacementError,
    check_learner_fits,
    check_pool_fits,
    gpu_census,
    learner_gpus_per_rank,
    learner_options,
    pool_engine_gpus,
)
from services.pool.placement import engine_gpus, engine_options

ASYNC1 = RECIPES_DIR / "gpu-1xh200-async.yaml"


def census(recipe, total: float, available: float) -> GpuCensus:
    return gpu_census(recipe, cluster=lambda: {"CPU": 16.0, "GPU": total}, available=lambda: {"GPU": available})


def test_the_one_gpu_async_recipe_validates_as_engine_and_learner_side_by_side():
    r = load_recipe(ASYNC1)
    assert r.rollout_pool.share_gpu and r.grpo.async_grpo.enabled and not r.policy.generation.colocated.enabled
    assert (r.cluster.num_nodes, r.cluster.gpus_per_node, r.rollout_pool.num_engines) == (1, 1, 1)
    assert r.policy.refit_transport == "cuda_ipc"
    v, m = r.policy.generation.vllm_cfg, r.policy.megatron_cfg
    assert m.gpu_memory_fraction is not None and v.gpu_memory_utilization + m.gpu_memory_fraction <= 0.95
    assert r.learner_gpus == 1  # one rank, on the engine's GPU


def test_engine_and_learner_rank_each_ask_ray_for_half_of_the_gpu():
    r = load_recipe(ASYNC1)
    assert engine_gpus(r) == 0.5 and learner_gpus_per_rank(r) == 0.5
    assert engine_options(r, 0, None) == {"num_gpus": 0.5}
    assert learner_options(r, 0, None) == {"num_gpus": 0.5}
    assert pool_engine_gpus(r) == (1, 0.5)


def test_without_share_gpu_the_engine_takes_the_whole_gpu():
    r = load_recipe(RECIPES_DIR / "gpu-2xh200-async.yaml")
    assert engine_gpus(r) == 1 and learner_gpus_per_rank(r) == 1 and pool_engine_gpus(r) == (1, 1.0)


def test_the_placement_checks_count_the_pools_half_and_the_learners_half():
    r = load_recipe(ASYNC1)
    check_pool_fits(r, census(r, total=1, available=1), missing_engines=1)  # a fresh deploy: 0.5 + 0.5 <= 1
    c = census(r, total=1, available=1)  # the engine being placed: its half is not free already
    assert c.free == 0.5
    check_learner_fits(r, c)
    check_learner_fits(r, census(r, total=1, available=0.5))  # the engine placed
    with pytest.raises(PlacementError) as err:  # something else holds the learner's half
        check_learner_fits(r, census(r, total=1, available=0))
    msg = str(err.value)
    assert "the learner asks for 0.5 GPUs (1 rank x 0.5 GPU, rollout_pool.share_gpu)" in msg, msg
    assert ("0 of the Ray cluster's 1 GPUs are free (the rollout pool's 1 engine holds 0.5 of 1 GPUs and other "
            "actors or placement groups hold 0.5)") in msg, msg
    with pytest.raises(PlacementError, match=r"the rollout pool asks for 0.5 GPUs \(1 engine x 0.5 GPU "
                                             r"\(rollout_pool.share_gpu\)\) and its learner for 0.5 more"):
        check_pool_fits(r, census(r, total=1, available=0.5), missing_engines=1)
    with pytest.raises(PlacementError, match=r"the rollout pool asks for 0.5 GPUs .* and 0 of the Ray cluster's "
                                             r"1 GPUs are free"):
        check_pool_fits(r, census(r, total=1, available=0), missing_engines=1)


def test_a_memory_split_at_the_limit_passes():
    load_recipe(ASYNC1, ["policy.generation.vllm_cfg.gpu_memory_utilization=0.5"])  # 0.5 + 0.45 = 0.95


@pytest.mark.parametrize("overrides,match", [
    (["grpo.async_grpo.enabled=false", "policy.generation.colocated.enabled=true"],
     r"^policy.generation.colocated.enabled: rollout_pool.share_gpu puts .* without colocation"),
    (["cluster.gpus_per_node=2"],
     r"^cluster.gpus_per_node \(2\) x cluster.num_nodes \(1\): rollout_pool.share_gpu .*set both to 1"),
    (["cluster.num_nodes=2"], r"^cluster.gpus_per_node \(1\) x cluster.num_nodes \(2\): rollout_pool.share_gpu"),
    (["cluster.gpus_per_node=0"], r"^cluster.gpus_per_node \(0\) x cluster.num_nodes \(1\): rollout_pool.share_gpu"),
    (["rollout_pool.num_engines=2"], r"^rollout_pool.num_engines \(2\): rollout_pool.share_gpu .*set it to 1"),
    (["policy.generation.vllm_cfg.tensor_parallel_size=2"],
     r"^policy.generation.vllm_cfg.tensor_parallel_size x pipeline_parallel_size \(2 x 1\): "
     r"rollout_pool.share_gpu"),
    (["policy.megatron_cfg.tensor_model_parallel_size=2"],
     r"^policy.megatron_cfg.tensor_model_parallel_size x pipeline_model_parallel_size \(2 x 1\): "
     r"rollout_pool.share_gpu"),
    (["rollout_pool.learner_gpus=2"], r"^rollout_pool.learner_gpus \(2\): rollout_pool.share_gpu .*unset"),
    (["policy.megatron_cfg.gpu_memory_fraction=null"],
     r"^policy.megatron_cfg.gpu_memory_fraction: rollout_pool.share_gpu .*memory budget .*"
     r"gpu_memory_utilization \(0.45\), the two together <= 0.95"),
    (["policy.generation.vllm_cfg.gpu_memory_utilization=0.6"],
     r"^policy.generation.vllm_cfg.gpu_memory_utilization \(0.6\) \+ policy.megatron_cfg.gpu_memory_fraction "
     r"\(0.45\) = 1.05: .* <= 0.95"),
    (["policy.refit_transport=collective"],
     r"^policy.refit_transport \('collective'\): rollout_pool.share_gpu .*NCCL refuses two ranks .*'cuda_ipc'"),
])
def test_layouts_share_gpu_cannot_run_are_refused_naming_the_key(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(ASYNC1, overrides)


def test_other_transports_and_an_explicit_single_learner_gpu_are_accepted():
    assert load_recipe(ASYNC1, ["policy.refit_transport=object_store"]).policy.refit_transport == "object_store"
    assert load_recipe(ASYNC1, ["rollout_pool.learner_gpus=1"]).learner_gpus == 1


def test_the_learner_memory_budget_is_bounded():
    with pytest.raises(RecipeError, match="^policy.megatron_cfg.gpu_memory_fraction"):
        load_recipe(ASYNC1, ["policy.megatron_cfg.gpu_memory_fraction=0"])
    with pytest.raises(RecipeError, match="^policy.megatron_cfg.gpu_memory_fraction"):
        load_recipe(ASYNC1, ["policy.megatron_cfg.gpu_memory_fraction=1.5"])
