"""vLLM's routed-experts output (routing replay) on its CPU backend, whose model runner lacks the capture.

vLLM 0.32 returns ``CompletionOutput.routed_experts`` through its AuxOutput connector, which only Model Runner V2
drives, and V2 needs Triton; the CPU backend runs the V1 runner (``CPUModelRunner``), so vLLM refuses the setting
there ("AuxOutput Connector requires Model Runner V2"). vLLM leaves that check to out-of-tree platforms, which "bring
their own model runners"; :func:`patch_vllm` (called by the ``vllm.general_plugins`` entry point in every vLLM
process, rollout/cpu_moe_plugin.py) does exactly that for the CPU runner:

- the compatibility check runs as for an out-of-tree platform on CPU (every other check of it still applies: MoE
  model, generate runner, prefix caching);
- ``CPUModelRunner`` owns vLLM's own worker connector (``AuxOutputWorkerConnector``: the same capturer on the
  routers, block store and request tails V2 uses) and drives it as V2 does: ``begin_step`` with each step's
  scheduler metadata, a snapshot of the step's rows after the forward (:class:`StepRows`: V1's batch layout in the
  names the connector reads), and the request outputs on the step's ``ModelRunnerOutput`` after sampling.

The scheduler side (block hashes, the outputs on each finished request) is vLLM's, unchanged. A no-op off CPU and
for engines started without ``enable_return_routed_experts``; vLLM 0.25.1 (no AuxOutput connector) is left alone.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepRows:
    """One V1 step's batch as the worker connector's ``prepare_output`` reads it from V2's ``InputBatch``."""

    req_ids: list[str]
    """The step's requests in batch order."""
    query_start_loc_np: np.ndarray
    """Row offsets of each request's tokens in the step, ``len(req_ids) + 1`` of them."""
    num_computed_tokens_np: np.ndarray
    """Each request's first position in the step (its tokens computed before it)."""


def step_rows(runner: Any) -> StepRows:
    """The batch layout of the step a V1 ``runner`` just ran (read before its ``sample_tokens``)."""
    batch = runner.input_batch
    n = batch.num_reqs
    return StepRows(list(batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].copy(),
                    batch.num_computed_tokens_cpu[:n].copy())


def sampled_counts(output: Any, req_ids: list[str]) -> np.ndarray:
    """How many tokens each of ``req_ids`` sampled in a V1 ``ModelRunnerOutput`` (0 for a partial prefill)."""
    index = output.req_id_to_index
    return np.array([len(output.sampled_token_ids[index[r]]) for r in req_ids], dtype=np.int64)


@contextmanager
def _out_of_tree(platform: Any):
    """The ``platform`` object's ``is_out_of_tree()`` answers True inside: vLLM then leaves the model runner's
    support to the platform."""
    platform.is_out_of_tree = lambda: True
    try:
        yield
    finally:
        del platform.is_out_of_tree


def patch_vllm() -> None:
    """Drive vLLM's routed-experts connector from the CPU model runner (module docstring). Idempotent."""
    try:
        from vllm.config import VllmConfig
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # vLLM 0.25.1: no AuxOutput connector (its V1 runner captures on GPU itself)
        return
    if getattr(CPUModelRunner, "inflight_routed_experts", False):
        return
    verify = VllmConfig._verify_aux_output_compatibility
    runner: Any = CPUModelRunner  # its methods are replaced below, so typed loosely
    init_kv, execute, sample = runner.initialize_kv_cache, runner.execute_model, runner.sample_tokens

    def verify_on_cpu(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            verify(self)
            return
        with _out_of_tree(current_platform):
            verify(self)

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
        init_kv(self, kv_cache_config, is_profiling, **kwargs)
        if (not is_profiling and self.vllm_config.aux_output_config.enabled
                and getattr(self, "inflight_aux", None) is None):
            self.inflight_aux = get_aux_output_connector(self.get_model(), self.vllm_config, kv_cache_config)

    def execute_model(self, scheduler_output, *args, **kwargs):
        aux = getattr(self, "inflight_aux", None)
        self.inflight_pending = None
        if aux is not None:
            aux.begin_step(scheduler_output.aux_output_connector_metadata)
        result = execute(self, scheduler_output, *args, **kwargs)
        if aux is not None and result is None and self.execute_model_state is not None:
            self.inflight_pending = aux.prepare_output(step_rows(self))
        return result

    def sample_tokens(self, grammar_output):
        output = sample(self, grammar_output)
        pending, self.inflight_pending = getattr(self, "inflight_pending", None), None
        if pending is not None:
            counts = sampled_counts(output, pending.request_ids)
            pending.enqueue_cpu_copy(counts, np.zeros_like(counts))
            output.aux_output_connector_output = pending.process_output()
        return output

    VllmConfig._verify_aux_output_compatibility = verify_on_cpu
    runner.initialize_kv_cache, runner.execute_model = initialize_kv_cache, execute_model
    runner.sample_tokens, runner.inflight_routed_experts = sample_tokens, True
