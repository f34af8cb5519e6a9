"""Receive weight pushes over a collective group inside vLLM's workers.

vLLM runs its model in worker processes (V1 ``AsyncLLM`` always puts the
engine core in a child process), so a push that arrives over NCCL (gloo on
CPU) must be received *there*, on the worker's device, next to the model.
:class:`CollectiveWeightReceiver` is a vLLM ``worker_extension_cls``: its
methods are mixed into the worker class and called from the engine with
``collective_rpc``:

1. ``inflight_join_weight_group(host, port, rank_base, world_size, timeout_s)``
   -- join the learner's :class:`protocol.weight_transfer.WeightTransferGroup`
   as rank ``rank_base + worker rank`` (an engine with tensor parallelism has
   one member per worker; each gets the full weights), closing any previous
   group first.
2. ``inflight_receive_weights()`` -- receive the next push into buffers on
   the worker's device and verify its device checksums (a corrupted or short
   transfer raises, nothing is kept); returns the encoded
   :class:`protocol.WeightManifest`. Generation continues around it: the
   engine core runs this between two scheduler steps and it lasts as long as
   the transfer.
3. ``inflight_install_received(version, direct_load)`` -- with generation
   paused by the engine, load the received tensors through vLLM's layerwise
   ``reload_weights`` (the path that repacks CPU linear weights and reorders
   FlashInfer CUTLASS MoE gate/up halves; a plain ``load_weights`` would
   not), or, once :mod:`rollout.direct_load` has proven plain ``load_weights``
   gives the same tensors for this model, through that faster path, and once
   its copy plan is proven too, with one foreach copy from the buffers into
   the parameters; then free the buffers. Returns the bytes and the path taken.
4. ``inflight_drop_received()`` -- free the buffers of a push the engine
   rejected.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class CollectiveWeightReceiver:
    """Mixed into vLLM's worker class (``worker_extension_cls``); uses the worker's ``device``, ``rank``
    and ``reload_weights``."""

    _inflight_group = None
    _inflight_received = None
    _inflight_direct_load = None

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
        from rollout.direct_load import DirectLoad, worker_kv_caches

        if self._inflight_received is None or self._inflight_received[0].version != version:
            have = None if self._inflight_received is None else self._inflight_received[0].version
            raise RuntimeError(f"inflight_install_received: v{version} was not received by this worker "
                               f"(holding {have})")
        manifest, buckets = self._inflight_received
        if self._inflight_direct_load is None:
            self._inflight_direct_load = DirectLoad(direct_load)
        loader = self._inflight_direct_load
        try:
            path = loader.install(self.model_runner.get_model(), lambda: iter(named_views(manifest, buckets)),
                                  lambda weights: self.reload_weights(weights_iterator=weights),
                                  ignore=worker_kv_caches(self))
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
