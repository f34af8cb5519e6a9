"""The cluster wing: the Ray cluster the pool and the learner run on.

:mod:`.cluster` (the persistent local head node of ``inflight pool deploy``: start, find, stop), :mod:`.cluster_auth`
(its token authentication), :mod:`.cluster_procs` (its processes, found and stopped) and :mod:`.ray_runtime`
(joining a cluster or starting a private one). It prints through the operator wing (:mod:`services.operator`).
"""
