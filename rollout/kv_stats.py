"""vLLM's own counts of KV-cache recomputation and of tokens sampled, read in-process through a custom stat logger.

A running request whose KV cache is dropped (an install with
``recompute_kv_cache_after_weight_updates``, or a full KV cache) is preempted
by vLLM's scheduler and prefilled again. vLLM reports that per engine step to
its stat loggers (``IterationStats.num_preempted_reqs``, and
``PrefixCacheStats.preempted_queries`` / ``preempted_hits`` when the request
is scheduled again); :class:`KvCounters` sums them for ``RolloutEngine.stats()``.
docs/rollout.md ("KV cache across an update") has what they show.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class KvCounters:
    """Totals since the engine started, as vLLM's scheduler reported them."""

    kv_preemptions: int = 0
    """Running requests vLLM preempted: their KV cache was freed and they are prefilled again."""
    kv_reprefill_tokens: int = 0
    """Tokens (prompt + sampled so far) of preempted requests when they were scheduled again."""
    kv_reprefill_cached_tokens: int = 0
    """Of those, tokens found in the prefix cache (not computed again)."""
    vllm_generated_tokens: int = 0
    """Tokens vLLM sampled for every request it ran (training groups, evaluation, OpenAI chat requests), as its
    scheduler counted them: a request aborted early stops adding to it."""

    def as_stats(self) -> dict[str, int]:
        """The counters as ``RolloutEngine.stats()`` entries."""
        return asdict(self)

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Add one engine step's ``SchedulerStats`` / ``IterationStats`` (either may be None)."""
        if iteration_stats is not None:
            self.kv_preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
            self.vllm_generated_tokens += int(getattr(iteration_stats, "num_generation_tokens", 0))
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            self.kv_reprefill_tokens += int(getattr(prefix, "preempted_queries", 0))
            self.kv_reprefill_cached_tokens += int(getattr(prefix, "preempted_hits", 0))


def build_async_llm(engine_args, counters: KvCounters):
    """``AsyncLLM.from_engine_args(engine_args)`` with a stat logger that feeds ``counters``
    (vLLM's default loggers stay on)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CountingLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            counters.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return AsyncLLM.from_engine_args(engine_args, stat_loggers=[_CountingLogger])
