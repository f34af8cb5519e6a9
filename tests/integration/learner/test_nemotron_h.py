"""Nemotron-H in the learner (tiny random models, float32, CPU): log-probs equal transformers' with its dt clamp
lifted, packed sequences score as each alone (several layouts; without the boundaries Mamba leaks), HF → Megatron
→ HF is exact with the router's expert bias (a buffer) carried, and training steps run and move the Mamba weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_batches import make_learner
from nemotron_h_models import DENSE_PATTERN, MOE_PATTERN, VOCAB, build_nemotron_h, load_nemotron_h
from safetensors.torch import load_file

from protocol.messages import Trajectory, TrajectoryGroup


def _sequences(n: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, rng.integers(3, 14)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(3, VOCAB, rng.integers(2, 30)).astype(np.int32) for _ in range(n)]
    return prompts, responses


@torch.no_grad()
def _hf_logprobs(model, prompts, responses) -> list[np.ndarray]:
    out = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor(np.concatenate([p, r]), dtype=torch.long)[None]
        logp = model(ids).logits.float().log_softmax(-1)[0]
        out.append(logp[len(p) - 1:-1].gather(-1, torch.tensor(r, dtype=torch.long)[:, None])[:, 0].numpy())
    return out


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def hybrid_learners(tmp_path_factory):
    """{"dense": (dir, Learner), "moe": (dir, Learner)}: the dense model's config.json in transformers' own
    spelling (layers_block_type), the MoE one's in the published one (hybrid_override_pattern)."""
    root = tmp_path_factory.mktemp("nemotron_h")
    dirs = {"dense": build_nemotron_h(root / "dense", DENSE_PATTERN, seed=1, published_config=False),
            "moe": build_nemotron_h(root / "moe", MOE_PATTERN, seed=2)}
    out = {k: (d, make_learner(str(d))) for k, d in dirs.items()}
    yield out
    for _, learner in out.values():
        learner.shutdown()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logprobs_match_transformers_with_the_dt_clamp_lifted(hybrid_learners, kind):
    model_dir, learner = hybrid_learners[kind]
    assert learner.arch.hybrid is not None
    assert learner.arch.hybrid.pattern == {"dense": DENSE_PATTERN, "moe": MOE_PATTERN}[kind]
    prompts, responses = _sequences(6, seed=3)
    ours = learner.logprobs(prompts, responses)  # packed: 6 sequences in one 256-token row
    lifted = _hf_logprobs(load_nemotron_h(model_dir), prompts, responses)
    clamped = _hf_logprobs(load_nemotron_h(model_dir, lift_clamp=False), prompts, responses)
    for a, b, r in zip(ours, lifted, responses, strict=True):
        assert a.shape == (r.size,)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    print(f"\nnemotron_h {kind}: max |Δ logprob| vs transformers {_max_diff(ours, lifted):.2e} "
          f"(with its prefill dt clamp: {_max_diff(ours, clamped):.2e})")
    if kind == "dense":  # two Mamba layers with some dt below time_step_min: the clamp is a real difference
        assert _max_diff(ours, clamped) > 1e-4


def _packed_logprobs(learner, prompts, responses, budget: int, enabled: bool = True) -> list[np.ndarray]:
    saved = learner.packing
    learner.packing = saved.model_copy(update={"train_mb_tokens": budget, "enabled": enabled})
    try:
        return learner.logprobs(prompts, responses)
    finally:
        learner.packing = saved


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_sequences_score_as_each_alone(hybrid_learners, kind, monkeypatch):
    """Several layouts — each alone, rows of 48 and 96 tokens, everything in one row, a reversed order — give
    the same log-probs; withholding the boundaries from the Mamba layers changes them (the leak this prevents)."""
    _, learner = hybrid_learners[kind]
    prompts, responses = _sequences(7, seed=4)
    alone = _packed_logprobs(learner, prompts, responses, 256, enabled=False)
    layouts = {budget: _packed_logprobs(learner, prompts, responses, budget) for budget in (48, 96, 512)}
    reversed_ = _packed_logprobs(learner, prompts[::-1], responses[::-1], 512)[::-1]
    for name, lps in [*layouts.items(), ("reversed", reversed_)]:
        assert _max_diff(lps, alone) <= 1e-5, name
    import learner.mamba_mixer as mixer
    monkeypatch.setattr(mixer, "seq_starts_from_cu_seqlens", lambda cu, total: None)
    leaky = _packed_logprobs(learner, prompts, responses, 512)
    assert _max_diff(leaky, alone) > 1e-3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_round_trip_is_exact_with_the_expert_bias(hybrid_learners, kind):
    from learner.hf_export import export_hf_state_dict

    model_dir, learner = hybrid_learners[kind]
    source = load_file(f"{model_dir}/model.safetensors")
    exported = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    assert exported is not None and list(exported) == [m.name for m in learner.hf_metas]
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    biases = {n: b for n, b in learner.gpt.named_buffers() if n.endswith("router.expert_bias")}
    assert len(biases) == MOE_PATTERN.count("E") if kind == "moe" else not biases
    for name, bias in biases.items():  # loaded (not left at zero) from HF's e_score_correction_bias
        layer = name.split(".")[2]
        torch.testing.assert_close(bias, source[f"backbone.layers.{layer}.mixer.gate.e_score_correction_bias"],
                                   rtol=0, atol=0)
        assert bias.abs().max() > 0.05


def test_expert_bias_changes_the_routing(hybrid_learners):
    """The bias matters at these weights: zeroing it (what a parameters-only mapping leaves) moves log-probs."""
    _, learner = hybrid_learners["moe"]
    prompts, responses = _sequences(4, seed=5)
    before = learner.logprobs(prompts, responses)
    biases = [b for n, b in learner.gpt.named_buffers() if n.endswith("router.expert_bias")]
    saved = [b.clone() for b in biases]
    try:
        for b in biases:
            b.zero_()
        assert _max_diff(learner.logprobs(prompts, responses), before) > 1e-3
    finally:
        for b, s in zip(biases, saved, strict=True):
            b.copy_(s)


def _groups(learner, n_groups: int = 2, size: int = 4) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(6)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, VOCAB, 7).astype(np.int32)
        responses = [rng.integers(3, VOCAB, rng.integers(4, 14)).astype(np.int32) for _ in range(size)]
        lps = learner.logprobs([prompt] * size, responses)
        trajs = [Trajectory(r, lp, np.zeros(r.size), float(i % 2))
                 for i, (r, lp) in enumerate(zip(responses, lps, strict=True))]
        out.append(TrajectoryGroup(f"g{g}", f"p{g}", prompt, trajs, size, VOCAB))
    return out


def test_training_steps_move_the_mamba_weights(tmp_path):
    model_dir = build_nemotron_h(tmp_path / "moe", MOE_PATTERN, seed=7)
    learner = make_learner(str(model_dir), lr=1e-2)
    try:
        mamba = {n: p.detach().clone() for n, p in learner.gpt.named_parameters()
                 if n.startswith("decoder.layers.0.mixer.")}
        assert {n.rsplit("mixer.", 1)[1] for n in mamba} >= {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log",
                                                             "D", "norm.weight", "out_proj.weight"}
        bias = {n: b.clone() for n, b in learner.gpt.named_buffers() if n.endswith("expert_bias")}
        for _ in range(2):
            metrics = learner.train_step(_groups(learner))
            assert np.isfinite(metrics["loss"]) and metrics["step_skipped"] == 0, metrics
            assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        assert learner.policy_version == 2
        now = dict(learner.gpt.named_parameters())
        for name, before in mamba.items():
            assert not torch.equal(now[name].detach(), before), f"{name} did not change"
        for name, b in learner.gpt.named_buffers():  # the bias update rate is 0: routing stays the checkpoint's
            if name in bias:
                assert torch.equal(b, bias[name]), name
    finally:
        learner.shutdown()


def test_activation_checkpointing_changes_no_number(tmp_path):
    """With ``activation_checkpointing`` each hybrid layer is recomputed in the backward: the same loss, gradient
    norm and updated weights as without."""
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    model_dir = str(build_nemotron_h(tmp_path / "dense", DENSE_PATTERN, seed=8))
    results = []
    for recompute in (False, True):
        megatron = MegatronConfig(precision="float32", activation_checkpointing=recompute,
                                  optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0))
        learner = Learner(model_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=256), 128)
        try:
            assert learner.gpt.decoder.recompute is recompute
            metrics = learner.train_step(_groups(learner))
            results.append((metrics, {n: p.detach().clone() for n, p in learner.gpt.named_parameters()}))
        finally:
            learner.shutdown()
    (plain, w_plain), (recomputed, w_recomputed) = results
    for key in ("loss", "grad_norm"):
        assert abs(plain[key] - recomputed[key]) <= 1e-6 * max(1.0, abs(plain[key])), key
    for name, value in w_plain.items():
        torch.testing.assert_close(w_recomputed[name], value, rtol=1e-5, atol=1e-6)


def test_checkpoint_restore_is_bit_identical(tmp_path):
    """save → step → restore → step gives the same weights, expert-bias buffers and metrics (Mamba + MoE model)."""
    model_dir = build_nemotron_h(tmp_path / "moe", MOE_PATTERN, seed=9)
    learner = make_learner(str(model_dir), lr=1e-2)
    try:
        batch = _groups(learner)
        learner.train_step(batch)
        learner.save_checkpoint(str(tmp_path / "ckpt"))
        first = learner.train_step(batch)
        state = {k: v.clone() for k, v in learner.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        learner.load_checkpoint(str(tmp_path / "ckpt"))
        second = learner.train_step(batch)
        for name, value in learner.gpt.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, state[name]), name
        timings = ("policy_training_s", "tokens_per_s", "prev_logprobs_s")
        assert {k: v for k, v in first.items() if k not in timings} == \
               {k: v for k, v in second.items() if k not in timings}
    finally:
        learner.shutdown()
