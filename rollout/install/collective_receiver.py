"""Receive weight pushes over a collective group inside vLLM's workers (``worker_extension_cls``).

A push over NCCL (gloo on CPU) must be received in the worker processes, on
the worker's device, next to the model. :class:`CollectiveWeightReceiver` is
mixed into vLLM's worker class; the engine calls its methods through
``collective_rpc``: ``inflight_reload_weights`` (install a staged bucket push,
then :mod:`rollout.install.cpu_reload`), ``inflight_join_weight_group`` (join the learner's
:class:`protocol.weight_transfer.WeightTransferGroup`), ``inflight_receive_weights``
(receive and device-verify the next push between two scheduler steps),
``inflight_install_received`` (install it while paused, through
:mod:`rollout.install.direct_load`) and ``inflight_drop_received`` (free a rejected
push). docs/rollout.md ("Pushes over a weight group") has the steps. The CUDA IPC methods
(a colocated learner's buffers mapped in place) come from :class:`rollout.install.ipc_receiver.IpcWeightReceiver`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rollout.install.ipc_receiver import IpcWeightReceiver

logger = logging.getLogger(__name__)


class CollectiveWeightReceiver(IpcWeightReceiver):
    """Mixed into vLLM's worker class (``worker_extension_cls``); uses the worker's ``device``, ``rank``
    and ``reload_weights``."""

    _inflight_group = None
    _inflight_received = None
    _inflight_direct_load = None

    if TYPE_CHECKING:  # provided by the vLLM worker class this is mixed into
        model_runner: Any

        def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None) -> None: ...

    def inflight_reload_weights(self, weights_path: str) -> list[str]:
        """Install a staged push with ``reload_weights``, then rebuild the CPU kernels it leaves stale
        (:mod:`rollout.install.cpu_reload`); returns what was repaired."""
        from safetensors import safe_open

        from rollout.install.cpu_reload import repair_after_reload
        from rollout.nano_omni import PROJECTOR_PREFIXES, install_projector, is_vllm_nano_omni

        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        if not is_vllm_nano_omni(model):  # the staged file is read again only for a model whose reload needs it
            return repair_after_reload(model)
        with safe_open(f"{weights_path}/model.safetensors", framework="pt") as staged:
            projector = [(k, staged.get_tensor(k)) for k in staged.keys() if k.startswith(PROJECTOR_PREFIXES)]
        return repair_after_reload(model) + install_projector(model, projector)

    def inflight_join_weight_group(self, host: str, port: int, rank_base: int, world_size: int,
                                   timeout_s: float) -> int:
        from protocol.weight_transfer import WeightTransferGroup

        self.inflight_leave_weight_group()
        rank = rank_base + int(getattr(self, "rank", 0))
        device = getattr(self, "device", None) or "cpu"  # the worker's torch.device (CPU workers set cpu)
        logger.info("weight group %s:%d: joining as rank %d of %d on %s", host, port, rank, world_size, device)
        self._inflight_group = WeightTransferGroup(host, port, rank, world_size, device, timeout_s)
        return rank

    def inflight_leave_weight_group(self) -> None:
        group, self._inflight_group = self._inflight_group, None
        self._inflight_received = None
        if group is not None:
            group.close()  # aborts, bounded; never raises

    def inflight_receive_weights(self) -> bytes:
        from protocol import encode

        if self._inflight_group is None:
            raise RuntimeError("inflight_receive_weights: this worker has not joined a weight group")
        self._inflight_received = None
        manifest, buckets = self._inflight_group.recv()
        self._inflight_received = (manifest, buckets)
        return encode(manifest)

    def inflight_install_received(self, version: int, direct_load: bool = False) -> dict:
        from protocol.weight_transfer import named_views
        from rollout.install.cpu_reload import repair_after_reload
        from rollout.install.direct_load import DirectLoad, worker_kv_caches
        from rollout.nano_omni import install_projector, is_vllm_nano_omni

        if self._inflight_received is None or self._inflight_received[0].version != version:
            have = None if self._inflight_received is None else self._inflight_received[0].version
            raise RuntimeError(f"inflight_install_received: v{version} was not received by this worker "
                               f"(holding {have})")
        manifest, buckets = self._inflight_received
        if self._inflight_direct_load is None:
            self._inflight_direct_load = DirectLoad(direct_load)
        loader = self._inflight_direct_load
        model = self.model_runner.get_model()
        try:
            path = loader.install(model, lambda: iter(named_views(manifest, buckets)),
                                  lambda weights: self.reload_weights(weights_iterator=weights),
                                  ignore=worker_kv_caches(self))
            repair_after_reload(model)  # once per install, whichever path installed it
            if is_vllm_nano_omni(model):
                install_projector(model, named_views(manifest, buckets))
        finally:
            self._inflight_received = None
        if path == "checked" and loader.plan is not None:
            logger.info("weight install: copy plan (%d copies) proven equal to plain load_weights; used from now "
                        "on", len(loader.plan.steps))
        elif path == "checked" and loader.plan_refused_reason:
            logger.info("weight install: copy plan not used: %s", loader.plan_refused_reason)
        elif path == "checked":
            logger.info("weight install: plain load_weights %s", "proven equal to reload_weights; used from now on"
                        if loader.proven else f"not used: {loader.refused_reason or 'push changed nothing'}")
        return {"bytes": manifest.total_bytes, "path": path, "refused_reason": loader.refused_reason,
                "copy_refused_reason": loader.plan_refused_reason}

    def inflight_drop_received(self) -> None:
        self._inflight_received = None
