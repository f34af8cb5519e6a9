"""``policy.generation.vllm_kwargs`` reach a real vLLM engine: read back from the started engine's own config
(issue 36, item 1). Uses the directory's shared engine (no engine start of its own)."""
from __future__ import annotations

from rollout_engine_helpers import HARNESS_VLLM_KWARGS


def test_vllm_kwargs_are_read_back_from_the_engine(harness):
    config = harness.engine._llm.vllm_config  # the AsyncLLM's VllmConfig, built by vLLM from the engine arguments
    assert config.scheduler_config.max_num_seqs == HARNESS_VLLM_KWARGS["max_num_seqs"]
    assert config.scheduler_config.max_num_batched_tokens == HARNESS_VLLM_KWARGS["max_num_batched_tokens"]
    lines = harness.engine.options.describe()
    assert "policy.generation.vllm_kwargs.max_num_seqs -> max_num_seqs=200 (replaces " \
           "policy.generation.vllm_cfg.max_num_seqs: 256)" in lines
    if harness.engine.options.platform == "cpu":
        assert any(line.startswith("policy.generation.vllm_kwargs.kernel_config.moe_backend='flashinfer_cutlass' "
                                   "ignored on cpu") for line in lines)


def test_the_engine_reads_its_vllm_kwargs_back(harness):
    by_path = {entry.path: entry for entry in harness.engine.read_back}
    assert by_path["max_num_seqs"].where == "scheduler_config.max_num_seqs" and by_path["max_num_seqs"].holds
    assert by_path["max_num_batched_tokens"].found == HARNESS_VLLM_KWARGS["max_num_batched_tokens"]
    assert all(entry.holds for entry in harness.engine.read_back), [e.line() for e in harness.engine.read_back]
