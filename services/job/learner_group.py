"""The driver's side of a learner job's ranks: :class:`LearnerGroup` starts ``world_size``
:class:`~services.job.learner_actor.LearnerActor` actors (one per GPU, or one process on CPU), gives them a
common ``torch.distributed`` rendezvous on rank 0's node (:func:`start_ranks`; the model's files are shipped to
ranks whose node lacks them, :mod:`services.models.files`), and calls every method on all ranks at once,
returning rank 0's answer. :meth:`LearnerGroup.reset` builds the ranks' learners again for a new job on the same
processes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.job.learner_actor import LearnerActor, LearnerSpec
from services.refit.learner_port import ExportedWeights, IpcExport, SentPush

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from services.models.files import ModelFiles
    from services.recipe.config import Recipe


def start_ranks(actors: list, wait: Callable[[list, str], Any]) -> tuple[str, int]:
    """Meet the ranks where rank 0 runs: ask rank 0 for its node's IP and the port of the rendezvous store it
    opens there, then set every rank up with that address (the driver's node may be another one).
    ``wait(refs, what)`` resolves refs."""
    host, port = wait([actors[0].rendezvous_address.remote()], "rendezvous_address")
    wait([a.setup.remote(host, port) for a in actors], "setup")
    return host, port


CPU_PLACEMENT_TIMEOUT_S = 300.0
"""Bound of the wait for CPU learner ranks that ask for ``cluster.learner_resources`` (no GPUs)."""


def wait_placed(recipe: Recipe, actors: list, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until every rank actor is placed and answers. Only ranks that ask for
    something a cluster may lack (GPUs, ``cluster.learner_resources``) are waited for here; on timeout the
    :class:`~services.recipe.gpu_layout.PlacementError` names what they ask for and the cluster's GPUs."""
    import ray

    from services.recipe.gpu_layout import PlacementError, fewer_gpus_hint, gpu_census, learner_gpus_per_rank

    per, extra = learner_gpus_per_rank(recipe), dict(recipe.cluster.learner_resources or {})
    if not per and not extra:
        return
    if not per:  # CPU ranks steered by learner_resources: a loaded machine may take long to start a worker
        timeout_s = max(timeout_s, CPU_PLACEMENT_TIMEOUT_S)
    refs = [a.__ray_ready__.remote() for a in actors]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ray.get(done)  # a rank that failed to construct raises here
    if not pending:
        return
    asks = f"{per:g} GPU" + "".join(f", {v:g} {k}" for k, v in extra.items())
    more = f"; cluster.learner_resources: {extra} (a node must have them besides the GPUs)" if extra else ""
    raise PlacementError(f"learner: {len(pending)} of {len(actors)} ranks were not placed within {timeout_s:g} s; "
                         f"each asks for {asks} and {gpu_census(recipe).describe()}{more}; "
                         f"{fewer_gpus_hint(recipe)}")


class LearnerGroup:
    """All ranks of one learner job, driven in lockstep."""

    def __init__(self, recipe: Recipe, model_path: ModelFiles | str, call_timeout_s: float = 1800.0,
                 colocation: PlacementGroup | None = None, placement_timeout_s: float | None = None):
        """``model_path``: a model directory on this node, or :class:`~services.models.files.ModelFiles` (ranks on
        nodes without the directory get its files shipped). ``colocation``: the pool's colocation placement
        group (``pool.colocation_group``), which puts rank ``j`` on GPU slot ``j``, shared with the engine worker
        there (engine ``j // k`` for ``k`` GPUs per engine, :mod:`services.recipe.gpu_layout`); None for separate pools
        and CPU runs. Raises :class:`~services.recipe.gpu_layout.PlacementError` at once when the cluster has too few
        free GPUs for the ranks, and after ``placement_timeout_s`` (default
        :data:`~services.recipe.gpu_layout.LEARNER_PLACEMENT_TIMEOUT_S`) when they were not placed."""
        import ray

        from services.models.files import ModelFiles, share
        from services.recipe.gpu_layout import (
            LEARNER_PLACEMENT_TIMEOUT_S,
            PlacementError,
            check_learner_fits,
            colocation_bundles,
            gpu_census,
            learner_options,
        )

        world = max(1, recipe.learner_gpus)
        check_learner_fits(recipe, gpu_census(recipe))
        if colocation is None and colocation_bundles(recipe):
            raise PlacementError("a colocated recipe on GPUs places its learner ranks in the pool's colocation "
                                 "group, and the pool has none: deploy the pool from a recipe with "
                                 "policy.generation.colocated.enabled=true")
        if colocation is not None and len(colocation.bundle_specs) < world:
            raise PlacementError(f"the pool's colocation group has {len(colocation.bundle_specs)} GPU bundles; "
                                 f"this learner has {world} ranks (its recipe's cluster must match the pool's)")
        self.timeout = call_timeout_s
        self._own_files = not isinstance(model_path, ModelFiles)
        self.files = model_path if isinstance(model_path, ModelFiles) else share(model_path)
        spec = self.spec = LearnerSpec.of(recipe, self.files)
        self.actors = [ray.remote(LearnerActor).options(num_cpus=0, max_restarts=0,
                                                        **learner_options(recipe, r, colocation)
                                                        ).remote(r, world, spec) for r in range(world)]
        try:
            wait_placed(recipe, self.actors, placement_timeout_s or LEARNER_PLACEMENT_TIMEOUT_S)
        except PlacementError:
            self._release()
            raise
        self.master = start_ranks(self.actors, self.wait)  # surfaces construction errors here, bounded

    def reset(self, recipe: Recipe, model_path: str) -> None:
        """Build every rank's learner again from ``recipe`` on the same processes, as a new job finds them (weights
        from ``model_path``, a fresh optimizer, version 0): a job's ranks without their start (a Ray worker, torch
        and Megatron-Core imported, the rendezvous). The recipe must ask for as many ranks, the same model and the
        same Megatron parallel sizes (``ValueError`` names what differs, before anything changes)."""
        from pathlib import Path

        world, have = max(1, recipe.learner_gpus), len(self.actors)
        if world != have:
            raise ValueError(f"learner reset: the recipe asks for {world} ranks (learner_gpus); this group has {have}")
        if Path(model_path).resolve() != Path(self.files.path).resolve():
            raise ValueError(f"learner reset: the recipe's model {model_path} is not this group's {self.files.path}")
        spec = LearnerSpec.of(recipe, self.files)
        if (new := _parallel_sizes(spec)) != (old := _parallel_sizes(self.spec)):
            raise ValueError(f"learner reset: the recipe's Megatron (TP, PP, EP) = {new}; this group's ranks were "
                             f"set up with {old}")
        self.wait([a.rebuild.remote(spec) for a in self.actors], "rebuild")
        self.spec = spec

    # ------------------------------------------------------------ the ranks' methods, rank 0's answer
    def version(self) -> int:
        return self.wait([a.version.remote() for a in self.actors], "version")

    def train_step(self, group_refs: list, images: dict | None = None) -> dict[str, Any]:
        """One optimizer step on the groups behind ``group_refs``; the learner's metrics (``skip_reason``: ''
        when the step was applied)."""
        return self.wait([a.train_step.remote(group_refs, images) for a in self.actors], "train_step")

    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                 images: list | None = None) -> list[list[float]]:
        """Response log-probs; ``images``: per sequence, its prompt's ``ImageInputs`` or None."""
        return self.wait([a.logprobs.remote(prompt_ids, response_ids, images) for a in self.actors], "logprobs")

    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank's state under ``path``; ``extra``: the job's state, kept by rank 0."""
        self.wait([a.save_checkpoint.remote(path, extra) for a in self.actors], "save_checkpoint")

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Every rank's state from ``path``; returns the job's state saved with it."""
        return self.wait([a.load_checkpoint.remote(path) for a in self.actors], "load_checkpoint")

    def save_hf(self, path: str) -> None:
        """The policy as a Hugging Face model directory at ``path``."""
        self.wait([a.save_hf.remote(path) for a in self.actors], "save_hf")

    # ------------------------------------------------------------ a push's steps (services.refit.learner_port)
    def export_weights(self, bucket_bytes: int) -> ExportedWeights:
        return self.wait([a.export_weights.remote(bucket_bytes) for a in self.actors], "export_weights")

    def stage_weights(self) -> None:
        self.wait([a.stage_weights.remote() for a in self.actors], "stage_weights")

    def send_staged(self, bucket_bytes: int) -> SentPush:
        return self.wait([a.send_staged.remote(bucket_bytes) for a in self.actors], "send_staged")

    def weight_group_address(self) -> tuple[str, int]:
        return self.wait([a.weight_group_address.remote() for a in self.actors], "weight_group_address")

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> Pending:
        return Pending(self, [a.join_weight_group.remote(host, port, world_size, timeout_s) for a in self.actors],
                       "join_weight_group")

    def gpu_uuid(self) -> str:
        return self.wait([a.gpu_uuid.remote() for a in self.actors], "gpu_uuid")

    def export_ipc(self, bucket_bytes: int, cuda_graph: bool) -> IpcExport:
        return self.wait([a.export_ipc.remote(bucket_bytes, cuda_graph) for a in self.actors], "export_ipc")

    def release_ipc(self, failed: bool) -> int:
        return self.wait([a.release_ipc.remote(failed) for a in self.actors], "release_ipc")

    def wait(self, refs: list, method: str) -> Any:
        """Rank 0's answer to a call started on every rank (``refs``, rank 0 first), within the call timeout."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(refs, timeout=self.timeout)[0]
        except GetTimeoutError:
            raise TimeoutError(f"learner: {method} did not finish within {self.timeout:.0f} s") from None

    def shutdown(self) -> None:
        try:
            self.wait([a.shutdown.remote() for a in self.actors], "shutdown")
        except Exception:  # noqa: BLE001 - killed below anyway
            pass
        self._release()

    def _release(self) -> None:
        """Kill the rank actors and, if this group registered the model's files, their holder."""
        import ray

        for a in self.actors:
            ray.kill(a)  # pyright: ignore[reportArgumentType] - typed as ActorProxy[LearnerActor]; an ActorHandle
        if self._own_files and self.files.holder is not None:
            ray.kill(self.files.holder)


def _parallel_sizes(spec: LearnerSpec) -> tuple[int, int, int]:
    m = spec.megatron
    return m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size


@dataclass(frozen=True)
class Pending:
    """A call started on every rank (:meth:`LearnerGroup.join_weight_group`); :meth:`wait` for rank 0's end."""

    group: LearnerGroup
    refs: list
    method: str

    def wait(self) -> None:
        self.group.wait(self.refs, self.method)
