"""How a learner job's weights reach the pool's engines: one home per transport (``policy.refit_transport``).

The learner **pushes**, an engine **installs**. :mod:`services.refit.object_store`
holds both ends of a push through the Ray object store,
:mod:`services.refit.collective` both halves of the weight-group handshake,
:mod:`services.refit.cuda_ipc` both ends of a push that a colocated engine maps
from the learner's GPU memory, and :mod:`services.refit.result` what a push
returns (:class:`RefitResult`) and how a failed one is named. The learner job
builds its side with :func:`make_refit`; the pool builds the other halves on
:class:`services.refit.port.PoolPort`, what a push needs from the pool (its
``Fleet`` implements it): nothing here imports the pool or the job.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.refit.collective import CollectiveRefit
from services.refit.cuda_ipc import CudaIpcRefit
from services.refit.learner_port import LearnerPort
from services.refit.object_store import ObjectStoreRefit
from services.refit.result import RefitError, RefitResult

if TYPE_CHECKING:
    from services.recipe.config import Recipe

TRANSPORTS = {"object_store": ObjectStoreRefit, "collective": CollectiveRefit, "cuda_ipc": CudaIpcRefit}

__all__ = ["CollectiveRefit", "CudaIpcRefit", "ObjectStoreRefit", "RefitError", "RefitResult", "make_refit"]


def make_refit(recipe: Recipe, pool: Any, learner: LearnerPort) -> ObjectStoreRefit | CollectiveRefit | CudaIpcRefit:
    """The learner's side of the transport ``recipe.policy.refit_transport`` names."""
    return TRANSPORTS[recipe.policy.refit_transport](recipe, pool, learner)
