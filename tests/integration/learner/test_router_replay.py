"""Routing replay through the learner's real step (issue 37, items 1 and 4), for Qwen3-MoE and Nemotron-H MoE.

A case built to flip routing: every router's rows are made nearly equal (one shared row plus 1% of each
expert's own, no score-correction bias), so its scores are near-tied; the "engine" is the same model with 0.3%
noise on the router weights (the size of a kernel's rounding next to such gaps), recording the experts it routed
every position to (Megatron's RECORD, through :class:`learner.router_replay.TokenReplay`) and its log-probs. The learner
then scores those trajectories in a ``train_step`` (packed rows, several sequences each) without and with their
``routed_experts``: without, flipped routers make the gen KL large; with replay the flips are caught (the rows
whose engine experts differ from the learner's own are counted) and the gen KL falls by orders of magnitude.
The same seeds both ways; the learning rate is negligible, so both steps score the same weights. Under EP=2 x DP=2
(two gloo ranks) the same steps give the same gen KL as one process.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_batches import VOCAB

ENGINE_NOISE = 0.003
"""The engine's router weights: the learner's plus this x their spread of Gaussian noise."""


def _flips(metrics: dict) -> int:
    """The replayed rows whose engine experts differ from the learner's own, from a step's metrics."""
    return round(metrics["router_replay_flip_rate"] * metrics["router_replay_rows"])


def _learner(model_dir: str, ep: int = 1):
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    megatron = MegatronConfig(precision="float32", moe_enable_routing_replay=True, expert_model_parallel_size=ep,
                              optimizer=OptimizerConfig(lr=1e-12, weight_decay=0.0))
    return Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=128),
                   max_total_sequence_length=64)


def _engine_groups(learner) -> list:
    """3 groups of 4, sampled by the noisy-router "engine": its log-probs and its routing of every position
    but the last (the engine never feeds the last sampled token)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from learner.router_replay import replays_of, routers
    from protocol.messages import Trajectory, TrajectoryGroup

    found, replays = routers(learner.gpt), replays_of(learner.gpt)
    with torch.no_grad():
        for r in found:  # near-tied logits: one shared row plus 1% of each expert's own (and no score bias)
            r.weight.copy_(r.weight[:1] + 0.01 * r.weight)
            if r.expert_bias is not None:
                r.expert_bias.zero_()
    exact = [r.weight.detach().clone() for r in found]
    rng = np.random.default_rng(0)
    out = []
    for g in range(3):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        trajs = []
        for i in range(4):
            resp = rng.integers(3, VOCAB, rng.integers(4, 16)).astype(np.int32)
            torch.manual_seed(10 * g + i)
            with torch.no_grad():
                for r, w in zip(found, exact, strict=True):
                    r.weight.copy_(w + ENGINE_NOISE * torch.randn_like(w) * w.std())
            for rep in replays:
                rep.set_router_replay_action(RouterReplayAction.RECORD)
            lp = np.asarray(learner.logprobs([prompt], [resp])[0])
            routed = np.stack([np.asarray(rep.get_recorded_indices()) for rep in replays], axis=1)  # [T, L, K]
            for rep in replays:
                rep.clear_router_replay_action()
                rep.clear_indices()
            assert routed.shape[0] == prompt.size + resp.size
            trajs.append(Trajectory(resp, lp, np.zeros(resp.size), float(i % 2),
                                    routed_experts=routed[:-1].astype(np.uint8)))
        out.append(TrajectoryGroup(f"g{g}", f"p{g}", prompt, trajs, 4, VOCAB))
    with torch.no_grad():
        for r, w in zip(found, exact, strict=True):
            r.weight.copy_(w)
    return out


def _without_routing(groups: list) -> list:
    from protocol.messages import Trajectory, TrajectoryGroup
    return [TrajectoryGroup(g.group_id, g.prompt_id, g.prompt_ids,
                            [Trajectory(t.response_ids, t.logprobs, t.versions, t.reward) for t in g.trajectories],
                            g.group_size, g.vocab_size) for g in groups]


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h_moe"])
def test_replay_catches_routing_flips_and_removes_the_mismatch_they_cause(family_models, family):

    learner = _learner(family_models(family))
    try:
        groups = _engine_groups(learner)
        prep = learner._prepare(learner._collect(groups).samples)
        assert any(len(mb.segments) > 1 for mb in prep.mine)  # packed rows: replay places each sequence's routing
        step, flips = {}, {}
        for name, batch in (("without", _without_routing(groups)), ("with", groups)):
            step[name] = learner.train_step(batch)
            flips[name] = _flips(step[name])
        for name, m in step.items():
            print(f"\n{family} {name} replay: gen KL {m['gen_kl_error']:.3e}, mean exp|d logprob| "
                  f"{m['token_mult_prob_error']:.5f}, per-sequence mismatch mean {m['logprob_mismatch_mean']:.2e} "
                  f"max {m['logprob_mismatch_max']:.2e} token max {m['logprob_mismatch_token_max']:.2e} over "
                  f"threshold {m['logprob_mismatch_over_threshold_share']:.2f}, flipped rows replayed {flips[name]}, "
                  f"over {m['num_valid_tokens']:.0f} tokens")
        without, with_ = step["without"], step["with"]
        assert without["num_valid_tokens"] == with_["num_valid_tokens"] > 30
        assert without["router_replay_rows"] == 0 < with_["router_replay_rows"]  # no routing carried: none replayed
        assert flips["with"] > 0  # the engine's flips, caught (the step's metrics)
        assert with_["gen_kl_error"] < without["gen_kl_error"] / 50
        assert with_["token_mult_prob_error"] < 1.02 < without["token_mult_prob_error"]
        assert with_["logprob_mismatch_max"] < 0.05 < without["logprob_mismatch_mean"]
    finally:
        learner.shutdown()


def _ep_worker(rank: int, port: int, model_dir: str, batches, out_path: str) -> None:
    from gloo_ranks import become_rank
    become_rank(rank, 2, port)
    from learner.model import shutdown_distributed

    learner = _learner(model_dir, ep=2)
    out = {name: learner.train_step(batch) for name, batch in batches.items()}
    torch.save(out, f"{out_path}.{rank}")
    shutdown_distributed()


def test_expert_parallel_ranks_replay_as_one_process_does(family_models, tmp_path):
    """EP=2 x DP=2 in two gloo ranks (each rank its own packed rows, padded to equal shapes, routing before the
    dispatch): the same gen KL as one process, with and without replay."""
    from gloo_ranks import run_ranks


    single = _learner(family_models("qwen3_moe"))
    try:
        groups = _engine_groups(single)
        single.save_hf(str(tmp_path / "near-tied"))  # the near-tied routers, for the ranks to load
        batches = {"without": _without_routing(groups), "with": groups}
        one = {name: single.train_step(batch) for name, batch in batches.items()}
        assert _flips(one["with"]) > 0
    finally:
        single.shutdown()
    run_ranks(_ep_worker, str(tmp_path / "near-tied"), batches, str(tmp_path / "out"), timeout_s=240,
              what="EP=2 routing-replay ranks")
    ranks = [torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in (0, 1)]
    print(f"\nEP=2: gen KL without {ranks[0]['without']['gen_kl_error']:.3e}, with "
          f"{ranks[0]['with']['gen_kl_error']:.3e}; flips caught over both ranks {_flips(ranks[0]['with'])} "
          f"(one process: {_flips(one['with'])})")
    for name in batches:
        for r in ranks:
            assert r[name]["gen_kl_error"] == pytest.approx(one[name]["gen_kl_error"], rel=1e-3, abs=1e-7), name
            assert r[name]["num_valid_tokens"] == one[name]["num_valid_tokens"]
    for r in ranks:  # the step's counts are summed over the data-parallel ranks: each rank reports the total
        assert r["with"]["router_replay_rows"] == one["with"]["router_replay_rows"] > 0
        assert _flips(r["with"]) == pytest.approx(_flips(one["with"]), abs=2)
    assert ranks[0]["with"]["gen_kl_error"] < ranks[0]["without"]["gen_kl_error"] / 50
