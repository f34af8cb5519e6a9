"""Which chunk the log-probs run in: ``logprob_chunk_size``, else ``defer_fp32_logits``' default, else the row."""
from __future__ import annotations

from learner.config import MegatronConfig
from learner.logprobs import DEFAULT_CHUNK, logprob_chunk


def test_chunk_size_wins_then_defer_fp32_logits_then_the_whole_row():
    assert logprob_chunk(MegatronConfig(logprob_chunk_size=512, defer_fp32_logits=True)) == 512
    assert logprob_chunk(MegatronConfig(defer_fp32_logits=True)) == DEFAULT_CHUNK == 2048
    assert logprob_chunk(MegatronConfig()) is None
