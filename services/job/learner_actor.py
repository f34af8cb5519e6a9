"""One learner rank as a Ray actor: a :class:`learner.trainer.Learner` built from a :class:`LearnerSpec`.

:class:`services.job.learner_group.LearnerGroup` starts the ranks and calls every method on all of them at once
(Megatron is SPMD). Trajectories reach the actors as protocol bytes in the Ray object store and
are decoded inside. Weights leave either as encoded ``WeightManifest`` /
``WeightBucket`` bytes put in the object store by rank 0
(``policy.refit_transport: object_store``), with ``collective`` straight
from rank 0's device over a :class:`protocol.weight_transfer.WeightTransferGroup`
that rank 0 opens with the pool's engines (NCCL on GPU, gloo on CPU), or with
``cuda_ipc`` as buckets on rank 0's GPU that an engine there maps in place
(:mod:`learner.ipc_export`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from learner.config import LossConfig, MegatronConfig, SamplingDist, SequencePackingConfig, TrainStepConfig
from protocol import TrajectoryGroup, decode, encode
from services.refit.learner_port import ExportedWeights, IpcExport, SentPush

if TYPE_CHECKING:
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] -- public API

    from learner.ipc_export import IpcExporter
    from learner.trainer import Learner
    from services.models.files import ModelFiles
    from services.recipe.config import Recipe


@dataclass(frozen=True)
class LearnerSpec:
    """What every rank builds its :class:`learner.trainer.Learner` from (sent to each actor)."""

    model: ModelFiles | str
    """The model's files: a directory, or where to fetch them on nodes that lack it."""
    megatron: MegatronConfig
    loss: LossConfig
    packing: SequencePackingConfig
    max_total_sequence_length: int
    normalize_rewards: bool
    seed: int
    step_config: TrainStepConfig
    """The ``grpo.*`` and ``policy.*`` keys a step applies (:class:`learner.config.TrainStepConfig`) and
    ``policy.generation``'s temperature / top_k / top_p."""
    freeze_vision_tower: bool = True
    """``policy.freeze_vision_tower`` (vision-language models)."""

    @classmethod
    def of(cls, recipe: Recipe, model: ModelFiles | str) -> LearnerSpec:
        p, g = recipe.policy, recipe.grpo
        step = TrainStepConfig.of(g, p, SamplingDist(p.generation.temperature, p.generation.top_k,
                                                   p.generation.top_p))
        return cls(model, p.megatron_cfg, recipe.loss_fn, p.sequence_packing, p.max_total_sequence_length,
                   g.normalize_rewards, g.seed, step, p.freeze_vision_tower)


class LearnerActor:
    def __init__(self, rank: int, world_size: int, spec: LearnerSpec):
        """Cheap: the rank joins ``torch.distributed`` and builds its model in :meth:`setup`."""
        self.rank, self.world_size = rank, world_size
        self.spec = spec
        self.learner: Learner  # built by setup()
        self._weight_group = None
        self._staged = None
        self._ipc: IpcExporter | None = None  # rank 0's exported buckets, made at its first export_ipc
        self._rendezvous: TCPStore | None = None  # rank 0's store, open from rendezvous_address until setup joins it
        self._weight_store: TCPStore | None = None  # rank 0's, open from weight_group_address until the group forms

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and the port of the rendezvous store it opens now (``MASTER_ADDR``/``_PORT``
        of the other ranks): listening from the moment the port is chosen, so nothing else can take it."""
        import ray

        from learner.model import open_rendezvous_store

        self._rendezvous = open_rendezvous_store(self.world_size)
        return ray.util.get_node_ip_address(), self._rendezvous.port

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the ranks at ``master_addr:master_port`` and build the learner from the model's files (shipped
        to this node if it does not have them, :mod:`services.models.files`); returns the policy version."""
        from learner.model import join_process_group
        from learner.trainer import Learner
        from services.models.files import ensure_local

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if self._rendezvous is not None:  # rank 0 meets the others at the store it holds
            store, self._rendezvous = self._rendezvous, None
            join_process_group(store)
        s = self.spec
        self.learner = Learner(ensure_local(s.model), s.megatron, s.loss, s.packing, s.max_total_sequence_length,
                               normalize_rewards=s.normalize_rewards, seed=s.seed, step_config=s.step_config,
                               freeze_vision_tower=s.freeze_vision_tower)
        return self.learner.policy_version

    def rebuild(self, spec: LearnerSpec) -> int:
        """Drop this rank's learner (model, optimizer, weight group, exported buckets) and build a new one from
        ``spec`` in the same process and process group (its Megatron parallel sizes must be the old ones);
        returns the new learner's policy version."""
        self.leave_weight_group()
        if self._ipc is not None:
            self._ipc.release(failed=True)
        self.learner.shutdown()
        self._staged, self._ipc, self._weight_store = None, None, None
        self.spec = spec
        return self.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def version(self) -> int:
        return self.learner.policy_version

    def train_step(self, group_refs: list, images: dict | None = None) -> dict:
        """One step on the groups behind ``group_refs``; ``images``: a vision-language prompt's
        :class:`~learner.mrope_positions.ImageInputs` by prompt id."""
        import ray

        groups = [cast(TrajectoryGroup, decode(b, expect=TrajectoryGroup)) for b in ray.get(group_refs)]
        metrics: dict = self.learner.train_step(groups, images)
        metrics["skip_reason"] = self.learner.last_skip_reason  # "" when the step was applied
        return metrics

    def export_weights(self, bucket_bytes: int) -> ExportedWeights | None:
        """Rank 0 returns the manifest and its buckets' refs; other ranks take part and return None."""
        import ray

        exported = self.learner.export_weights(bucket_bytes)  # collective: every rank takes part
        if self.rank != 0 or exported is None:  # None on every rank but 0
            return None
        manifest, buckets = exported
        return ExportedWeights(encode(manifest), [ray.put(encode(b)) for b in buckets])

    def weight_group_address(self) -> tuple[str, int] | None:
        """Rank 0: where it hosts the weight group's store (this node's address; the port of a store it opens now
        and holds until :meth:`join_weight_group`)."""
        import ray

        from protocol.weight_transfer import open_sender_store

        if self.rank != 0:
            return None
        self._weight_store = open_sender_store()
        return ray.util.get_node_ip_address(), self._weight_store.port

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Rank 0: open the weight group as its sender at the store :meth:`weight_group_address` opened (returns
        once every engine worker joined)."""
        from protocol.weight_transfer import WeightTransferGroup

        if self.rank != 0:
            return
        self.leave_weight_group()
        store, self._weight_store = self._weight_store, None
        if store is None or store.port != port:
            raise RuntimeError(f"learner rank 0 holds no weight-group store at port {port} "
                               f"(weight_group_address names the port; call it first)")
        self._weight_group = WeightTransferGroup(host, port, 0, world_size, self.learner.device, timeout_s,
                                                 store=store)

    def leave_weight_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.close()  # aborts, bounded; never raises

    def stage_weights(self) -> None:
        """Gather this version's HF tensors on rank 0's device (collective), ready for :meth:`send_staged`."""
        self._staged = self.learner.export_weight_tensors()

    def send_staged(self, bucket_bytes: int) -> SentPush | None:
        """Rank 0: push the staged tensors to the weight group; returns the version, bytes and seconds."""
        import time

        if self.rank != 0:
            return None
        if self._weight_group is None or self._staged is None:
            raise RuntimeError("send_staged: no weight group joined or nothing staged")
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        try:
            manifest = self._weight_group.send(self.learner.policy_version, staged, bucket_bytes)
        except Exception:
            self.leave_weight_group()  # the receivers' collectives then fail at once instead of timing out
            raise
        return SentPush(manifest.version, manifest.total_bytes, time.perf_counter() - t0)

    def gpu_uuid(self) -> str:
        """The UUID of this rank's GPU ('' on CPU): an engine on it alone can map the pushes of ``export_ipc``."""
        from learner.ipc_export import gpu_uuid

        return gpu_uuid(self.learner.device)

    def export_ipc(self, bucket_bytes: int, cuda_graph: bool) -> IpcExport | None:
        """Rank 0: this version's HF tensors packed into buckets on its GPU, shared through CUDA IPC; returns
        the manifest and the wire form of each share, and keeps the buckets until :meth:`release_ipc`.
        ``cuda_graph``: pack by one CUDA graph replay where the learner can (one GPU; ``learner.ipc_graph``).
        Collective (every rank takes part in the gather); other ranks return None."""
        from learner.ipc_export import IpcExporter

        if self._ipc is None:
            self._ipc = IpcExporter()
        exported = self._ipc.export_learner(self.learner, self.world_size, bucket_bytes, cuda_graph)
        if exported is None:
            return None
        manifest, shares = exported
        return IpcExport(encode(manifest), [s.to_wire() for s in shares])

    def release_ipc(self, failed: bool) -> int:
        """Rank 0: free the buckets of every exported version (the engines answered; ``failed``: not all
        installed it, so the next export packs into new buckets); returns the bytes."""
        return self._ipc.release(failed=failed) if self._ipc is not None else 0

    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                 images: list | None = None) -> list[list[float]]:
        """Response log-probs; ``images``: per sequence, its prompt's ``ImageInputs`` or None."""
        import numpy as np

        out = self.learner.logprobs([np.asarray(p, np.int32) for p in prompt_ids],
                                    [np.asarray(r, np.int32) for r in response_ids], images)
        return [a.tolist() for a in out]

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.learner.save_checkpoint(path, extra if self.rank == 0 else None)

    def load_checkpoint(self, path: str) -> dict:
        return self.learner.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.learner.save_hf(path)

    def shutdown(self) -> None:
        self.leave_weight_group()
        self.learner.shutdown()
