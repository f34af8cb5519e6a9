"""The sampling distribution on the learner's logits (learner/sampling_dist.py) against vLLM's own top-k/top-p
code and its ``processed_logprobs``: the same kept tokens and log-probs, the target always kept, finite
gradients, and nothing done at temperature 1 with no filter."""
from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from learner.config import SamplingDist
from learner.sampling_dist import sampled_logits

CASES = [SamplingDist(0.7), SamplingDist(1.0, top_k=5), SamplingDist(1.0, top_p=0.9),
         SamplingDist(0.6, top_k=20, top_p=0.8), SamplingDist(1.3, top_k=1), SamplingDist(0.9, top_p=0.05)]


def vllm_processed_logprobs(logits: torch.Tensor, s: SamplingDist) -> torch.Tensor:
    """What vLLM's sampler reports as ``processed_logprobs``: temperature, then its top-k/top-p, then log-softmax."""
    z = logits.float() / s.temperature
    n = z.shape[0]
    k = torch.full((n,), s.top_k, dtype=torch.long) if s.top_k is not None else None
    p = torch.full((n,), s.top_p) if s.top_p < 1.0 else None
    return apply_top_k_top_p_pytorch(z.clone(), k, p).log_softmax(dim=-1)


@pytest.mark.parametrize("s", CASES, ids=str)
def test_kept_tokens_and_log_probs_equal_vllms_processed_logprobs(s):
    torch.manual_seed(0)
    logits = torch.randn(64, 300) * 3
    logits[3, :10] = 4.0  # ties at the top-k / top-p edge
    expected = vllm_processed_logprobs(logits, s)
    targets = expected.argmax(dim=-1)  # a token vLLM may sample: inside the filter
    got = sampled_logits(logits, targets, s).log_softmax(dim=-1)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite], atol=1e-5)
    if s.filters:
        assert (~finite).any()  # the case filters something


def test_a_target_outside_the_filter_stays_in_the_support_with_finite_gradients():
    torch.manual_seed(1)
    logits = torch.randn(8, 50, requires_grad=True)
    s = SamplingDist(0.8, top_k=3)
    targets = logits.detach().argmin(dim=-1)  # the least likely token: outside any top-3
    out = sampled_logits(logits, targets, s)
    lp = out.log_softmax(dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.isfinite(lp).all()
    assert (torch.isfinite(out).sum(dim=-1) == 4).all()  # the top 3 and the target
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad.abs() > 0).sum(dim=-1).eq(4).all()  # filtered tokens get no gradient


def test_the_plain_softmax_passes_the_logits_unchanged():
    logits = torch.randn(4, 10)
    assert sampled_logits(logits, torch.zeros(4, dtype=torch.long), SamplingDist()) is logits
    assert SamplingDist().neutral and not SamplingDist(top_p=0.99).neutral


@pytest.mark.parametrize("kwargs, field", [({"temperature": 0.0}, "temperature"), ({"top_k": 0}, "top_k"),
                                           ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingDist(**kwargs)
