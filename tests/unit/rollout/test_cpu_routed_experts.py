"""The CPU runner's routed-experts capture (rollout/cpu_routed_experts.py) without an engine: the V1 batch layout the
worker connector reads, the sampled counts, and vLLM's own compatibility check once patched (the V2 requirement
lifted on CPU, every other rule kept). The capture itself runs through the real loop in
tests/integration/services/test_routing_replay_loop.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rollout.cpu_routed_experts import patch_vllm, sampled_counts, step_rows


def v1_runner(req_ids: list[str], computed: list[int], starts: list[int]) -> SimpleNamespace:
    """A V1 runner after a step: persistent batch arrays longer than the step's requests, as vLLM keeps them."""
    pad = 3
    batch = SimpleNamespace(num_reqs=len(req_ids), req_ids=[*req_ids, *(None,) * pad],
                            num_computed_tokens_cpu=np.array([*computed, *(0,) * pad], np.int32))
    return SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=np.array([*starts, 99, 99], np.int32)))


def test_a_steps_rows_are_read_in_batch_order_and_copied():
    runner = v1_runner(["b", "a"], [17, 0], [0, 1, 9])  # "b" decodes its 18th token, "a" prefills 8
    rows = step_rows(runner)
    assert rows.req_ids == ["b", "a"]
    assert rows.query_start_loc_np.tolist() == [0, 1, 9] and rows.num_computed_tokens_np.tolist() == [17, 0]
    runner.input_batch.num_computed_tokens_cpu[:] = 5  # the runner's next step must not change this one's
    assert rows.num_computed_tokens_np.tolist() == [17, 0]


def test_sampled_counts_follow_the_requests_not_the_outputs_order():
    output = SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2}, sampled_token_ids=[[5], [], [7]])
    assert sampled_counts(output, ["c", "b", "a"]).tolist() == [1, 0, 1]  # "b": a partial prefill chunk


def aux_config(prefix_caching: bool, pp: int = 1) -> SimpleNamespace:
    """What vLLM's ``_verify_aux_output_compatibility`` reads of a ``VllmConfig`` on the V1 runner."""
    return SimpleNamespace(aux_output_config=SimpleNamespace(enabled=True), use_v2_model_runner=False,
                           model_config=SimpleNamespace(runner_type="generate", is_moe=True),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching), speculative_config=None,
                           kv_transfer_config=None,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pp, decode_context_parallel_size=1,
                                                           prefill_context_parallel_size=1))


def test_vllms_check_lets_the_cpu_v1_runner_return_routed_experts_and_keeps_its_other_rules():
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert current_platform.is_cpu()
    patch_vllm()
    patch_vllm()  # idempotent: the methods are wrapped once
    verify = VllmConfig._verify_aux_output_compatibility
    assert getattr(CPUModelRunner, "inflight_routed_experts", False)
    verify(aux_config(prefix_caching=True))  # type: ignore[arg-type] - vLLM's own check, V1 runner on CPU
    with pytest.raises(ValueError, match="requires prefix caching"):
        verify(aux_config(prefix_caching=False))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline parallelism"):
        verify(aux_config(prefix_caching=True, pp=2))  # type: ignore[arg-type]
    assert not current_platform.is_out_of_tree()  # only inside the check
