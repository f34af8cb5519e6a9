"""Where actors go: GPU requests per actor, colocation slots (real Ray with declared GPUs, one and two nodes),
and the layouts `inflight validate` refuses."""
from __future__ import annotations

import pytest

from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import GpuCensus, PlacementError, check_learner_fits, learner_gpus_per_rank
from services.pool.placement import engine_gpus


def test_cpu_recipe_asks_for_no_gpu():
    r = load_recipe(None)
    assert engine_gpus(r) == 0 and learner_gpus_per_rank(r) == 0
    check_learner_fits(r, GpuCensus(0, 0))


def test_separate_pools_take_whole_gpus():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml")
    assert engine_gpus(r) == 2 and learner_gpus_per_rank(r) == 1
    check_learner_fits(r, GpuCensus(32, 16, 8, 16))  # the pool's 8 engines x 2 hold 16
    with pytest.raises(PlacementError, match="asks for 16 GPUs"):
        check_learner_fits(r, GpuCensus(8, 8, 8, 16))


def test_one_gpu_colocated_shares_it():
    r = load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml")
    assert engine_gpus(r) == 0.5 and learner_gpus_per_rank(r) == 0.5
    check_learner_fits(r, GpuCensus(1, 0))  # the ranks go into the pool's colocation group


def test_colocated_multi_gpu_engine_actor_leaves_the_gpu_shares_to_its_vllm_workers():
    """Seed recipe 1 (16 engines x TP2 colocated on 8 x 4 GPUs): the engine actor asks for no GPU (its two vLLM
    workers take half a GPU each), the learner's 32 ranks half a GPU each."""
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-sync-colocated.yaml")
    assert r.gpus_per_engine == 2 and engine_gpus(r) == 0 and learner_gpus_per_rank(r) == 0.5
    check_learner_fits(r, GpuCensus(32, 0))


def test_slots_run_node_by_node_whatever_order_ray_granted_the_bundles_in():
    from services.recipe.gpu_layout import slots_by_node

    granted = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a", 5: "b", 6: "a", 7: "b"}  # PACK interleaved two nodes
    assert slots_by_node(granted) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert slots_by_node({0: "b", 1: "b", 2: "a", 3: "a"}) == [0, 1, 2, 3]


def test_an_engine_whose_slots_were_granted_on_two_nodes_is_refused():
    from services.pool.placement import check_engine_slots

    r = load_recipe(RECIPES_DIR / "grpo-8gpu-sync-colocated.yaml", ["cluster.num_nodes=2", "cluster.gpus_per_node=4"])
    check_engine_slots(r, {b: "ab"[b % 2] for b in range(8)})  # 4 + 4: engines 0, 1 on a; 2, 3 on b
    with pytest.raises(PlacementError, match=r"engine 2's 2 GPUs \(colocation bundles \[4, 5\]\) were granted on 2 "
                                             r"nodes; the group holds \[5, 3\] GPUs per node"):
        check_engine_slots(r, {b: "a" if b < 5 else "b" for b in range(8)})  # 5 + 3 (a larger cluster, fragmented)


def test_vllm_reads_the_environment_that_places_its_ray_workers():
    """The variable names :func:`engine_options` sets are the ones vLLM's Ray executor reads."""
    import vllm.envs

    from services.pool.placement import BUNDLE_INDICES_ENV, PER_WORKER_GPUS_ENV

    assert {BUNDLE_INDICES_ENV, PER_WORKER_GPUS_ENV} <= set(vllm.envs.environment_variables)


SYNC32 = RECIPES_DIR / "grpo-32gpu-sync-colocated.yaml"


@pytest.mark.parametrize("overrides,match", [
    (["policy.generation.vllm_cfg.tensor_parallel_size=8"],
     r"^policy.generation.vllm_cfg: an engine takes .* = 8 GPUs, more than cluster.gpus_per_node \(4\)"),
    (["cluster.gpus_per_node=3", "rollout_pool.num_engines=8", "policy.megatron_cfg.expert_model_parallel_size=4"],
     r"^policy.generation.vllm_cfg: colocated engines of .* = 2 GPUs must divide cluster.gpus_per_node \(3\)"),
    (["rollout_pool.num_engines=8"], r"^rollout_pool.num_engines: colocated, .* \(8 x 2 = 16\) must equal the "
                                     r"learner's ranks, cluster.num_nodes x cluster.gpus_per_node \(32\)"),
    (["rollout_pool.learner_gpus=16"], r"^rollout_pool.learner_gpus \(16\): colocated, the learner has one rank"),
])
def test_validate_rejects_layouts_placement_cannot_do(overrides, match):
    from services.recipe.config import RecipeError

    with pytest.raises(RecipeError, match=match):
        load_recipe(SYNC32, overrides)


def test_separate_pool_engines_must_fit_whole_on_nodes():
    from services.recipe.config import RecipeError

    # 4 engines x TP2 + 1 learner GPU = 9 = 3 nodes x 3 GPUs, but only one TP2 engine fits on a node
    with pytest.raises(RecipeError, match=r"^rollout_pool.num_engines \(4\): engines of 2 GPUs each on one node fit 3"):
        load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml",
                    ["cluster.num_nodes=3", "cluster.gpus_per_node=3", "rollout_pool.num_engines=4",
                     "rollout_pool.learner_gpus=1"])


COLOCATED_2GPU = ["cluster.gpus_per_node=2", "rollout_pool.num_engines=2"]

def test_colocation_needs_a_group_only_on_gpus():
    from services.recipe.gpu_layout import colocation_bundles
    from services.pool.placement import engine_options

    assert colocation_bundles(load_recipe(None)) == 0
    assert colocation_bundles(load_recipe(RECIPES_DIR / "gpu-2xh200-async.yaml")) == 0
    assert colocation_bundles(load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml", COLOCATED_2GPU)) == 2
    assert engine_options(load_recipe(None), 0, None) == {"num_gpus": 0}
