"""The recipe's GPU layout: what can be placed (checked at load) and the placement both wings share.

:func:`check_gpu_layout` is called by :class:`services.recipe.config.Recipe`'s validator;
every message starts with the key path to change. CPU recipes
(``cluster.gpus_per_node: 0``) have no layout. The rest is what the pool
(:mod:`services.pool.placement`) and the learner job both need: GPU shares per
learner rank, the colocation group's size, its GPU *slots* (bundles node by
node) and a learner rank's Ray options. How colocation works:
docs/architecture.md, "Placement"; async on one GPU (``rollout_pool.share_gpu``): docs/gpu.md.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.recipe.config import Recipe

COLOCATED_SHARE = 0.5
"""The share of a GPU a colocated engine worker and a colocated learner rank each ask for; also the halves the
engine and the learner rank of ``rollout_pool.share_gpu`` ask for."""
SHARED_GPU_MEMORY_MAX = 0.95
"""Most of the GPU ``rollout_pool.share_gpu``'s engine and learner may take together (vLLM's
``gpu_memory_utilization`` + the learner's ``gpu_memory_fraction``): the rest holds the two CUDA contexts and
what neither allocator counts (NCCL, cuBLAS workspaces)."""


class PlacementError(ValueError):
    """The recipe's GPU layout cannot be placed on this cluster."""


def colocated_on_gpus(recipe: Recipe) -> bool:
    return bool(recipe.cluster.gpus_per_node) and recipe.policy.generation.colocated.enabled


def shares_one_gpu(recipe: Recipe) -> bool:
    """Whether the pool's engine and the learner's rank share the cluster's one GPU (``rollout_pool.share_gpu``)."""
    return bool(recipe.cluster.gpus_per_node) and recipe.rollout_pool.share_gpu


def learner_gpus_per_rank(recipe: Recipe) -> float:
    if not recipe.cluster.gpus_per_node:
        return 0
    return COLOCATED_SHARE if recipe.policy.generation.colocated.enabled or shares_one_gpu(recipe) else 1


def pool_gpus_per_engine(recipe: Recipe) -> float:
    """GPUs one engine of a separate pool holds: ``k`` whole ones, half of the one GPU with ``share_gpu``."""
    return COLOCATED_SHARE if shares_one_gpu(recipe) else float(recipe.gpus_per_engine)


LEARNER_PLACEMENT_TIMEOUT_S = 30.0
"""Longest the learner's rank actors may wait for the GPUs (and ``cluster.learner_resources``) they ask for."""


@dataclass(frozen=True)
class GpuCensus:
    """The Ray cluster's GPUs as a placement check sees them: in all, free, and what the pool holds."""

    total: float
    """GPUs of the Ray cluster in all (``ray.cluster_resources``)."""
    available: float
    """GPUs no actor or placement group holds now (``ray.available_resources``)."""
    pool_engines: int = 0
    """Engines of the recipe's rollout pool that hold (or are about to hold) GPUs of their own."""
    pool_gpus: float = 0
    """GPUs those engines hold (``num_engines x gpus_per_engine``, 0.5 with ``rollout_pool.share_gpu``; 0 on CPU
    and colocated)."""

    @property
    def free(self) -> float:
        """GPUs a new actor can have: the available ones, less what the pool's engines take and do not hold
        yet (an engine still being placed is not subtracted from ``available``)."""
        return max(0.0, min(self.available, self.total - self.pool_gpus))

    def holders(self) -> str:
        """Who holds the GPUs that are not free, in words."""
        held = self.total - self.free
        if held <= 0:
            return "none is held"
        parts, pool = [], min(self.pool_gpus, held)
        if pool:
            one = self.pool_engines == 1
            parts.append(f"the rollout pool's {self.pool_engines} engine{'' if one else 's'} "
                         f"hold{'s' if one else ''} {pool:g} of {self.total:g} GPUs")
        other = held - pool
        if other > 0:
            parts.append(f"other actors or placement groups hold {other:g}")
        return " and ".join(parts)

    def describe(self) -> str:
        return f"{self.free:g} of the Ray cluster's {self.total:g} GPUs are free ({self.holders()})"


def pool_engine_gpus(recipe: Recipe) -> tuple[int, float]:
    """Engines of the recipe's pool with GPUs of their own, and those GPUs (half of one with
    ``rollout_pool.share_gpu``; none on CPU or colocated: a colocated pool's GPUs are its colocation group's,
    the learner's ranks included)."""
    if not recipe.cluster.gpus_per_node or recipe.policy.generation.colocated.enabled:
        return 0, 0
    n = recipe.rollout_pool.num_engines
    return n, n * pool_gpus_per_engine(recipe)


def gpu_census(recipe: Recipe, cluster: Callable[[], Mapping[str, float]] | None = None,
               available: Callable[[], Mapping[str, float]] | None = None) -> GpuCensus:
    """The connected Ray cluster's GPUs for ``recipe`` (``cluster``/``available``: the resource queries,
    ``ray.cluster_resources``/``ray.available_resources`` by default)."""
    if cluster is None or available is None:
        import ray

        cluster, available = cluster or ray.cluster_resources, available or ray.available_resources
    engines, gpus = pool_engine_gpus(recipe)
    return GpuCensus(float(cluster().get("GPU", 0)), float(available().get("GPU", 0)), engines, gpus)


def _layout(recipe: Recipe) -> str:
    c = recipe.cluster
    return (f"the recipe lays out cluster.num_nodes x cluster.gpus_per_node = {c.num_nodes} x {c.gpus_per_node} "
            f"= {c.num_nodes * c.gpus_per_node} GPUs")


def fewer_gpus_hint(recipe: Recipe) -> str:
    """What to change in a recipe that asks for more GPUs than the cluster has free."""
    return (f"{_layout(recipe)}. To fit: share the GPUs between engines and learner "
            f"(policy.generation.colocated.enabled=true, sync only: grpo.async_grpo.enabled=false, "
            f"rollout_pool.learner_gpus unset; on one GPU recipes/gpu-1xh200-sync.yaml; async on one GPU: "
            f"rollout_pool.share_gpu=true, recipes/gpu-1xh200-async.yaml), or give the pool fewer "
            f"engines (rollout_pool.num_engines, now {recipe.rollout_pool.num_engines}) or the learner fewer "
            f"GPUs (rollout_pool.learner_gpus) and set cluster.gpus_per_node to the GPUs the nodes have, or free "
            f"or add GPUs")


def check_learner_fits(recipe: Recipe, census: GpuCensus) -> None:
    """Fail fast (instead of rank actors waiting for GPUs) when the learner cannot be placed: apart from the
    pool its ranks need whole *free* GPUs; colocated they go into the pool's group (it has one GPU per rank,
    checked against the cluster's GPUs in all). Nothing is asked for on CPU (``cluster.gpus_per_node: 0``)."""
    world, per = max(1, recipe.learner_gpus), learner_gpus_per_rank(recipe)
    need = world * per
    if not need:
        return
    if colocated_on_gpus(recipe):
        if need > census.total:
            raise PlacementError(f"the learner needs {need:g} GPUs ({world} ranks x {per:g}) but the Ray cluster "
                                 f"has {census.total:g} in all; {fewer_gpus_hint(recipe)}")
        return
    if need > census.free:
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        key = "rollout_pool.share_gpu" if shares_one_gpu(recipe) else "rollout_pool.learner_gpus"
        raise PlacementError(f"the learner asks for {need:g} GPUs ({ranks} x {per:g} GPU, {key}) and "
                             f"{census.describe()}; {fewer_gpus_hint(recipe)}")


def check_pool_fits(recipe: Recipe, census: GpuCensus, missing_engines: int) -> None:
    """Fail a separate pool's start-up at once (before any vLLM engine boots for minutes) when the
    ``missing_engines`` engines it is about to create cannot have their GPUs; on a fresh deploy (none of its
    engines exists yet) the learner that will attach must fit too. Nothing to check on CPU or colocated
    (the colocation group's own check, :func:`services.pool.placement.colocation_group`)."""
    engines, _ = pool_engine_gpus(recipe)
    if not engines or not missing_engines:
        return
    k = pool_gpus_per_engine(recipe)
    need = missing_engines * k
    free = census.available  # the engines about to be made hold nothing yet
    learner = recipe.learner_gpus * learner_gpus_per_rank(recipe) if missing_engines == engines else 0.0
    how = "rollout_pool.share_gpu" if shares_one_gpu(recipe) else "num_engines x tensor_parallel_size x " \
                                                                   "pipeline_parallel_size"
    what = f"{missing_engines} engine{'s' if missing_engines != 1 else ''} x {k:g} GPU ({how})"
    held = census.total - free
    holders = f"{held:g} held by other actors or placement groups" if held > 0 else "none is held"
    if need > free:
        raise PlacementError(f"the rollout pool asks for {need:g} GPUs ({what}) and {free:g} of the Ray "
                             f"cluster's {census.total:g} GPUs are free ({holders}); {fewer_gpus_hint(recipe)}")
    if need + learner > free:
        raise PlacementError(f"the rollout pool asks for {need:g} GPUs ({what}) and its learner for "
                             f"{learner:g} more (rollout_pool.learner_gpus), {need + learner:g} in all; "
                             f"{free:g} of the Ray cluster's {census.total:g} GPUs are free ({holders}), so "
                             f"the learner could not be placed after the engines boot; {fewer_gpus_hint(recipe)}")


def colocation_bundles(recipe: Recipe) -> int:
    """Whole-GPU bundles a colocated pool reserves (every cluster GPU); 0 when not colocated on GPUs."""
    return recipe.cluster.num_nodes * recipe.cluster.gpus_per_node if colocated_on_gpus(recipe) else 0


def bundle_nodes(group: Any) -> dict[int, str]:
    """Node id of each bundle of a granted placement group."""
    import ray

    nodes = ray.util.placement_group_table(group).get("bundles_to_node_id") or {}
    if len(nodes) != len(group.bundle_specs):
        raise PlacementError(f"placement group {group.id.hex()} is not granted yet ({len(nodes)} of "
                             f"{len(group.bundle_specs)} bundles placed)")
    return {int(b): n for b, n in nodes.items()}


def slots_by_node(nodes: Mapping[int, str]) -> list[int]:
    """Bundle indices node by node (nodes in the order of their lowest bundle, bundles ascending within one):
    slot ``s`` of the colocation group is bundle ``slots_by_node(...)[s]``."""
    first: dict[str, int] = {}
    for b in sorted(nodes):
        first.setdefault(nodes[b], b)
    return sorted(nodes, key=lambda b: (first[nodes[b]], b))


def gpu_slots(group: Any) -> list[int]:
    """The colocation group's bundle indices in slot order (see :func:`slots_by_node`)."""
    return slots_by_node(bundle_nodes(group))


def in_bundle(group: Any, bundle: int) -> Any:
    """The scheduling strategy that puts an actor on ``bundle`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)


def learner_options(recipe: Recipe, rank: int, group: Any) -> dict:
    """Ray actor options of learner rank ``rank``: its GPUs and, colocated, its slot's bundle."""
    options: dict = {"num_gpus": learner_gpus_per_rank(recipe)}
    if group is None and recipe.cluster.learner_resources:
        options["resources"] = dict(recipe.cluster.learner_resources)
    if group is not None:
        slots = gpu_slots(group)
        if rank >= len(slots):
            raise PlacementError(f"learner rank {rank} has no colocation slot (the group has {len(slots)})")
        options["scheduling_strategy"] = in_bundle(group, slots[rank])
    return options


def check_gpu_layout(recipe: Recipe) -> None:
    """Raise ``ValueError`` naming the key when the recipe's engines and learner cannot be placed on
    ``cluster.num_nodes x cluster.gpus_per_node`` GPUs."""
    c, pool_cfg = recipe.cluster, recipe.rollout_pool
    total = c.num_nodes * c.gpus_per_node
    if pool_cfg.share_gpu:
        _check_shared_gpu(recipe)
    if total == 0:
        return
    v, m = recipe.policy.generation.vllm_cfg, recipe.policy.megatron_cfg
    k, n = recipe.gpus_per_engine, pool_cfg.num_engines
    if v.expert_parallel_size > k:
        raise ValueError(f"policy.generation.vllm_cfg.expert_parallel_size ({v.expert_parallel_size}) must be "
                         f"<= GPUs per engine ({k})")
    if k > c.gpus_per_node:
        raise ValueError(f"policy.generation.vllm_cfg: an engine takes tensor_parallel_size x pipeline_parallel_size "
                         f"= {k} GPUs, more than cluster.gpus_per_node ({c.gpus_per_node}); an engine's GPUs must "
                         f"be on one node")
    pool = n * k
    if recipe.policy.generation.colocated.enabled:
        learner = _check_colocated(recipe, k, pool, total)
    elif pool_cfg.share_gpu:
        learner = 1  # the engine's GPU, its other half
    else:
        learner = pool_cfg.learner_gpus if pool_cfg.learner_gpus is not None else total - pool
        if learner + pool != total:
            raise ValueError(f"cluster: learner GPUs ({learner}) + rollout GPUs ({pool} = {n} engines x {k}) must "
                             f"equal num_nodes x gpus_per_node ({total})")
        if learner <= 0:
            raise ValueError(f"cluster: no GPUs left for the learner ({total} total, {pool} for the pool)")
    fit = c.num_nodes * (c.gpus_per_node // k)
    if n > fit:
        raise ValueError(f"rollout_pool.num_engines ({n}): engines of {k} GPUs each on one node fit {fit} times "
                         f"on cluster.num_nodes x cluster.gpus_per_node = {c.num_nodes} x {c.gpus_per_node}")
    mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if learner % mp:
        raise ValueError(f"policy.megatron_cfg: learner GPUs ({learner}) not divisible by TP x PP ({mp})")
    dp = learner // mp
    if (dp * m.tensor_model_parallel_size) % m.expert_model_parallel_size:
        raise ValueError(f"policy.megatron_cfg.expert_model_parallel_size ({m.expert_model_parallel_size}) must "
                         f"divide DP x TP ({dp * m.tensor_model_parallel_size}) of the learner")


def _check_colocated(recipe: Recipe, k: int, pool: int, total: int) -> int:
    """Colocated, every cluster GPU holds one engine worker and one learner rank; returns the learner's GPUs."""
    c, pool_cfg = recipe.cluster, recipe.rollout_pool
    if c.gpus_per_node % k:
        raise ValueError(f"policy.generation.vllm_cfg: colocated engines of tensor_parallel_size x "
                         f"pipeline_parallel_size = {k} GPUs must divide cluster.gpus_per_node ({c.gpus_per_node}) "
                         f"so that every GPU of a node holds one engine worker")
    if pool != total:
        raise ValueError(f"rollout_pool.num_engines: colocated, every GPU holds an engine worker and a learner rank, "
                         f"so num_engines x {k} GPUs per engine ({pool_cfg.num_engines} x {k} = {pool}) must equal "
                         f"the learner's ranks, cluster.num_nodes x cluster.gpus_per_node ({total})")
    if pool_cfg.learner_gpus is not None and pool_cfg.learner_gpus != total:
        raise ValueError(f"rollout_pool.learner_gpus ({pool_cfg.learner_gpus}): colocated, the learner has one rank "
                         f"per cluster GPU ({total}); leave it unset")
    return total


def _check_shared_gpu(recipe: Recipe) -> None:
    """``rollout_pool.share_gpu``: one engine and one learner rank, each on half of the cluster's one GPU, with
    the GPU's memory split between them and a weight transport that works between two processes on one GPU."""
    c, pool_cfg, p = recipe.cluster, recipe.rollout_pool, recipe.policy
    v, m = p.generation.vllm_cfg, p.megatron_cfg
    why = "rollout_pool.share_gpu puts the pool's engine and the learner's rank on the cluster's one GPU"
    if p.generation.colocated.enabled:
        raise ValueError(f"policy.generation.colocated.enabled: {why} without colocation (the engine keeps its "
                         f"memory while the learner trains); set it false, or leave share_gpu false to colocate")
    if (c.num_nodes, c.gpus_per_node) != (1, 1):
        raise ValueError(f"cluster.gpus_per_node ({c.gpus_per_node}) x cluster.num_nodes ({c.num_nodes}): {why}; "
                         f"set both to 1 (with more GPUs give the learner its own: rollout_pool.learner_gpus)")
    if pool_cfg.num_engines != 1:
        raise ValueError(f"rollout_pool.num_engines ({pool_cfg.num_engines}): {why}, which holds one engine; "
                         f"set it to 1")
    if recipe.gpus_per_engine != 1:
        raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size x pipeline_parallel_size "
                         f"({v.tensor_parallel_size} x {v.pipeline_parallel_size}): {why}; set both to 1")
    if m.tensor_model_parallel_size * m.pipeline_model_parallel_size != 1:
        raise ValueError(f"policy.megatron_cfg.tensor_model_parallel_size x pipeline_model_parallel_size "
                         f"({m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size}): {why}, one rank; "
                         f"set both to 1")
    if pool_cfg.learner_gpus not in (None, 1):
        raise ValueError(f"rollout_pool.learner_gpus ({pool_cfg.learner_gpus}): {why}, one rank; leave it unset "
                         f"or set it to 1")
    if m.gpu_memory_fraction is None:
        raise ValueError(f"policy.megatron_cfg.gpu_memory_fraction: {why}; give the learner its memory budget "
                         f"beside policy.generation.vllm_cfg.gpu_memory_utilization ({v.gpu_memory_utilization:g}), "
                         f"the two together <= {SHARED_GPU_MEMORY_MAX:g}")
    if v.gpu_memory_utilization + m.gpu_memory_fraction > SHARED_GPU_MEMORY_MAX + 1e-9:
        raise ValueError(f"policy.generation.vllm_cfg.gpu_memory_utilization ({v.gpu_memory_utilization:g}) + "
                         f"policy.megatron_cfg.gpu_memory_fraction ({m.gpu_memory_fraction:g}) = "
                         f"{v.gpu_memory_utilization + m.gpu_memory_fraction:g}: {why}, so they must be <= "
                         f"{SHARED_GPU_MEMORY_MAX:g} together (the rest holds both CUDA contexts)")
    if p.refit_transport == "collective":
        raise ValueError(f"policy.refit_transport ('collective'): {why}, and NCCL refuses two ranks of one group "
                         f"on one GPU; use 'cuda_ipc' (the engine maps the learner's buckets on their GPU) or "
                         f"'object_store'")
