"""The learner's two speed-only fusions: torch's fused AdamW in place of Megatron's fallback (the same update as
the per-tensor one, refused once the optimizer has stepped), and ``policy.megatron_cfg.bias_activation_fusion``
(Megatron's compiled SwiGLU) only on a GPU and only when asked (the GPU's own check:
tests/integration/learner/test_fusions_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from learner.config import MegatronConfig
from learner.hf_config import parse_hf_config
from learner.optimizer import fuse_adam

QWEN3_TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "head_dim": 16,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 128, "max_position_embeddings": 256,
              "tie_word_embeddings": True, "hidden_act": "silu"}


def _adam(seed: int) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(7, 5, generator=g, requires_grad=True), torch.randn(11, generator=g, requires_grad=True)]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), params


def _steps(opt: torch.optim.AdamW, params: list[torch.Tensor], n: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_fused_adam_takes_the_same_steps_as_the_per_tensor_one():
    plain, p_plain = _adam(0)
    fused, p_fused = _adam(0)
    fuse_adam(SimpleNamespace(optimizer=fused))  # pyright: ignore[reportArgumentType]
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    assert not any(g["fused"] for g in plain.param_groups)
    _steps(plain, p_plain)
    _steps(fused, p_fused)
    for start, a, b in zip(_adam(0)[1], p_plain, p_fused, strict=True):
        assert (a != start).all()  # every weight moved
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_fuse_adam_reaches_every_chained_optimizer_and_refuses_one_that_stepped():
    first, _ = _adam(0)
    second, p_second = _adam(1)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=first), SimpleNamespace(optimizer=second)])
    fuse_adam(chained)  # pyright: ignore[reportArgumentType]
    assert all(g["fused"] for opt in (first, second) for g in opt.param_groups)
    stepped, p_stepped = _adam(2)
    _steps(stepped, p_stepped, 1)
    with pytest.raises(RuntimeError, match="stepped already"):
        fuse_adam(SimpleNamespace(optimizer=stepped))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(("asked", "cuda", "fused"), [(True, False, False), (True, True, True), (False, True, False)])
def test_swiglu_fuses_only_on_a_gpu_and_only_when_asked(monkeypatch, asked, cuda, fused):
    from learner.model import transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = transformer_config(parse_hf_config(QWEN3_TINY), MegatronConfig(bias_activation_fusion=asked))
    assert config.bias_activation_fusion is fused
