"""The distribution the engine sampled from, on the learner's logits: ``logits / temperature``, then top-k, then
top-p, in vLLM's order and with its tie rules (``vllm/v1/sample/ops/topk_topp_sampler.py``).

NeMo-RL's learner scores tokens under this transformed distribution, so that π_prev, π_θ and the engine's
``processed_logprobs`` describe the same thing; at temperature 1 with no filter it is the plain softmax and
nothing here runs. One rule differs from the engine on purpose: the target token always stays in the support.
A token the engine sampled was inside its filter; where the learner's logits put it just outside (a top-p
boundary moved by numerical mismatch) it keeps its probability instead of ``-inf``, which would make the step's
loss non-finite; prompt and environment positions (not trained) stay finite the same way.

With tensor parallelism each rank holds a slice of the vocabulary: the filter's cut-offs are found on the
gathered row (without a graph) and each rank masks its own slice. docs/learner.md, "The sampling distribution".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from learner.config import SamplingDist


def sampled_logits(logits: torch.Tensor, targets: torch.Tensor, sampling: SamplingDist,
                   tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[N, V_local]`` logits of the distribution ``sampling`` describes (``-inf`` outside its filter, the
    ``[N]`` global ``targets`` always kept), differentiable with respect to ``logits``; ``logits`` itself is
    unchanged. Under a TP group ``logits`` is this rank's contiguous slice of the vocabulary."""
    if sampling.neutral:
        return logits
    scaled = logits.float() / sampling.temperature if sampling.temperature != 1.0 else logits.float()
    if not sampling.filters:
        return scaled
    keep = _kept(scaled.detach(), targets.reshape(-1), sampling, tp_group)
    return scaled.masked_fill(~keep, float("-inf"))


@torch.no_grad()
def _kept(scaled: torch.Tensor, targets: torch.Tensor, sampling: SamplingDist,
          tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[N, V_local]`` bool: the tokens of this rank's slice that the filter keeps, targets included."""
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    if tp:
        parts = [torch.empty_like(scaled) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, scaled.contiguous(), group=tp_group)
        full = torch.cat(parts, dim=-1)
        offset = dist.get_rank(tp_group) * scaled.shape[-1]
    else:
        full, offset = scaled, 0
    keep = _filter(full, sampling)
    keep[torch.arange(full.shape[0], device=full.device), targets.to(full.device)] = True
    return keep[:, offset:offset + scaled.shape[-1]]


def _filter(full: torch.Tensor, sampling: SamplingDist) -> torch.Tensor:
    """``[N, V]`` bool: the tokens vLLM's top-k then top-p keep on temperature-scaled logits ``full``."""
    sorted_logits, order = full.sort(dim=-1, descending=False)
    vocab = full.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = sorted_logits[:, vocab - sampling.top_k].unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False  # at least one
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    keep_sorted = torch.isfinite(sorted_logits)
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
