"""A :class:`~rollout.engine.RolloutEngine`'s counters as typed values: :meth:`RolloutEngine.counters`.

:class:`RolloutCounters` is one snapshot (copies, not the live counters) of the sampling, install and vLLM KV
counters, with the environment's (:class:`EnvCounters`) when the engine plays episodes. ``as_dict`` gives the flat
dict ``RolloutEngine.stats()`` answers (the benches and the GPU tests read it by key).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rollout.install.installer import InstallStats
from rollout.kv_stats import KvCounters
from rollout.sampling import SamplingStats


@dataclass(frozen=True)
class EnvCounters:
    """An environment's counters, cumulative since its engine started (the pool's ``inflight_env_*`` metrics,
    labelled ``env``). A counter its source does not keep is None (no metric series for it)."""

    name: str
    """The environment's name (``env.<name>``; the metrics' ``env`` label)."""
    episodes: int
    """Episodes played to the end (done, truncated or failed)."""
    env_failures: int
    """Samples failed by the environment (error, timeout, bad answer)."""
    env_wait_seconds: float
    """Seconds samples spent awaiting the environment, summed over samples (they overlap)."""
    turns: int | None = None
    """Sampled turns answered by the environment (None: an agent, which keeps no such count)."""
    env_tokens: int | None = None
    """Environment tokens appended to episodes (loss mask 0; None: an agent)."""
    episodes_truncated: int | None = None
    """Episodes cut by ``grpo.max_rollout_turns`` or the context before the environment ended them (None: an
    agent)."""
    calls: dict[str, int] | None = None
    """Calls to an environment or agent server by outcome (``ok``, ``timeout``, ``http_5xx``, ...); None: no
    server."""
    retries: int | None = None
    """Calls made again after a failed one (None: no server)."""

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain values, leaving out those that are None."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        order = ("name", "episodes", "turns", "env_tokens", "env_failures", "episodes_truncated", "env_wait_seconds",
                 "calls", "retries")
        return {k: dict(out[k]) if k == "calls" else out[k] for k in order if out[k] is not None}


@dataclass(frozen=True)
class RolloutCounters:
    """One snapshot of a rollout engine's counters since it started (:meth:`RolloutEngine.counters`)."""

    engine_id: str
    """The engine's id."""
    version: int
    """The policy version it serves (0: the model on disk)."""
    sampling: SamplingStats
    """Groups, samples, tokens, requests running, retries, aborts, reward failures, episodes."""
    installs: InstallStats
    """Pushes installed or rejected, and the cost of the last one."""
    kv: KvCounters
    """vLLM's preemptions, re-prefilled tokens and sampled tokens (:mod:`rollout.kv_stats`)."""
    sleeps_skipped_on_cpu: int
    """``sleep`` calls skipped: vLLM on CPU cannot sleep."""
    weights_broken: str
    """Why the workers' weights are inconsistent (an install failed part-way); '' while they are whole."""
    vllm_unfinished_requests: int
    """Requests vLLM has not finished (0 before it starts)."""
    env: EnvCounters | None = None
    """The environment's counters, if the engine plays episodes with one."""

    def as_dict(self) -> dict[str, Any]:
        """The flat dict of ``RolloutEngine.stats()``: the sampling and install counters by name (``phases_last``
        as a dict of seconds by phase), then the others, the KV counters and ``env`` (only with an environment)."""
        out: dict[str, Any] = {**vars(self.sampling), **self.installs.as_dict()}
        out.update(sleeps_skipped_on_cpu=self.sleeps_skipped_on_cpu, version=self.version, engine_id=self.engine_id,
                   weights_broken=self.weights_broken, **self.kv.as_stats(),
                   vllm_unfinished_requests=self.vllm_unfinished_requests)
        if self.env is not None:
            out["env"] = self.env.as_dict()
        return out
