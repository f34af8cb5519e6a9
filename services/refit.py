"""How a learner job gets its weights onto the pool's engines (``policy.refit_transport``).

**object_store.** Rank 0 exports the HF-named weights to host memory as
CRC32-checked :class:`protocol.WeightBucket` s in the Ray object store; the
pool keeps a copy (for engines that restart later) and every engine installs
them from ``/dev/shm``. Works on any hardware; costs a device→host copy, a
CRC32 and a file per push.

**collective.** Rank 0 and the engines' vLLM workers form one
:class:`protocol.weight_transfer.WeightTransferGroup` (NCCL on GPU, gloo on
CPU). A push is three moves:

1. ``stage_weights``: every learner rank gathers the HF tensors on rank 0's
   device (no host copy);
2. ``receive_weights`` on the pool: its engines' workers wait for the push
   between two generation steps...
3. ``send_staged``: ...while rank 0 broadcasts it in buckets; each engine
   checks the device checksums and the manifest, then pauses only for the
   reload.

The group is formed before the first push and again whenever it no longer
holds exactly the engine processes that are up (an engine restarted or
died, or a push failed): the pool plans the ranks, rank 0 opens the group's
store and every planned worker joins. A restarted engine takes no work until
it has the learner's version, so while waiting for groups the job also asks
the pool for engines wanting weights and pushes its current version to them.
"""
from __future__ import annotations

import logging

log = logging.getLogger("inflight.refit")


class ObjectStoreRefit:
    """Buckets through the Ray object store (the pool keeps them for engines that restart)."""

    def __init__(self, recipe, pool, learner):
        self.pool, self.learner = pool, learner
        self.bucket_bytes = recipe.policy.refit_bucket_mb * 1024 * 1024
        # the pool waits up to refit_timeout_s for an engine, again for the buckets, again for the engines
        self.timeout_s = 3 * recipe.policy.refit_timeout_s + 60

    def push(self, reset: bool) -> dict:
        manifest, refs = self.learner.call("export_weights", self.bucket_bytes)
        return self.pool.update_weights.remote(manifest, refs, reset).result(timeout_s=self.timeout_s)

    def engines_waiting(self) -> bool:
        """The pool reinstalls its latest push on restarted engines itself: none ever wait for the learner."""
        return False


class CollectiveRefit:
    """Buckets broadcast from rank 0's device to every engine worker over one weight group."""

    def __init__(self, recipe, pool, learner):
        self.pool, self.learner = pool, learner
        self.bucket_bytes = recipe.policy.refit_bucket_mb * 1024 * 1024
        self.timeout_s = recipe.policy.refit_timeout_s
        self.groups_formed = 0
        self._group_ok = False

    def push(self, reset: bool) -> dict:
        if not self._group_ok or not self.pool.weight_group_current.remote().result(timeout_s=60):
            self._form_group()
            reset = True  # members that joined may hold any version
        self.learner.call("stage_weights")
        received = self.pool.receive_weights.remote(reset, self.timeout_s)
        try:
            sent = self.learner.call("send_staged", self.bucket_bytes)
            out = received.result(timeout_s=self.timeout_s + 60)
        except Exception:
            self._group_ok = False  # re-formed before the next attempt
            _settle(received, self.timeout_s + 60)  # the pool has dropped the group before we retry
            raise
        out.update(send_seconds=sent["seconds"], groups_formed=self.groups_formed)
        return out

    def _form_group(self) -> None:
        plan = self.pool.weight_group_plan.remote(self.timeout_s).result(timeout_s=self.timeout_s + 60)
        host, port = self.learner.call("weight_group_address")
        joining = self.learner.call_async("join_weight_group", host, port, plan["world_size"], self.timeout_s)
        self.pool.join_weight_group.remote(host, port, plan, self.timeout_s).result(timeout_s=self.timeout_s + 90)
        self.learner.wait(joining, "join_weight_group")
        self._group_ok = True
        self.groups_formed += 1
        log.info("weight group %s:%d formed: %d engines, world size %d", host, port, len(plan["ranks"]),
                 plan["world_size"])

    def engines_waiting(self) -> bool:
        """True if an engine is up without the current weights (restarted): it waits for a push."""
        waiting = self.pool.engines_wanting_weights.remote().result(timeout_s=60)
        if waiting:
            log.info("engines %s are up without the current weights", waiting)
        return bool(waiting)


def _settle(response, timeout_s: float) -> None:
    """Wait for a pool call to end, whatever its outcome."""
    try:
        response.result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - the caller raises its own error
        pass


TRANSPORTS = {"object_store": ObjectStoreRefit, "collective": CollectiveRefit}


def make_refit(recipe, pool, learner):
    """The transport ``recipe.policy.refit_transport`` names."""
    return TRANSPORTS[recipe.policy.refit_transport](recipe, pool, learner)
