"""The vLLM plugin's non-gated (squared-ReLU) CPU experts against transformers' Nemotron-H experts and a
per-token reference, and its registration (no engine is started)."""
from __future__ import annotations

import pytest
import torch

from rollout.cpu_moe_plugin import NON_GATED, activate, non_gated_experts, register

E, H, I, T, K = 5, 16, 12, 9, 2


def routed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, I, H, generator=g, dtype=torch.float64)  # up projection, [E, I, H]
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64)  # down projection, [E, H, I]
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    return hidden, w1, w2, ids, weights


def per_token(hidden, w1, w2, ids, weights, b1=None, b2=None):
    """The MoE sum written out token by token (squared ReLU)."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                up = w1[e] @ hidden[t] + (0 if b1 is None else b1[e])
                out[t] += weights[t, k] * (w2[e] @ torch.relu(up) ** 2 + (0 if b2 is None else b2[e]))
    return out


def test_relu2_experts_equal_transformers_nemotron_h_experts():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    hidden, w1, w2, ids, weights = routed()
    cfg = NemotronHConfig(hidden_size=H, n_routed_experts=E, moe_intermediate_size=I, mlp_hidden_act="relu2")
    hf = NemotronHExperts(cfg).double()
    with torch.no_grad():
        hf.up_proj.copy_(w1)
        hf.down_proj.copy_(w2)
        want = hf(hidden, ids, weights)
    got = non_gated_experts(hidden, w1, w2, weights, ids, "relu2_no_mul")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, per_token(hidden, w1, w2, ids, weights), rtol=1e-12, atol=1e-12)


def test_other_ranks_experts_biases_and_input_weighting():
    hidden, w1, w2, ids, weights = routed(1)
    ids[::2, 1] = -1  # experts of another rank (expert_map gives -1)
    want = per_token(hidden, w1, w2, ids, weights)
    torch.testing.assert_close(non_gated_experts(hidden, w1, w2, weights, ids, "relu2_no_mul"), want)
    ones = torch.ones_like(weights)
    torch.testing.assert_close(non_gated_experts(hidden, w1, w2, weights, ids, "relu2_no_mul", weigh=False),
                               per_token(hidden, w1, w2, ids, ones))
    b1, b2 = torch.randn(E, I, dtype=torch.float64), torch.randn(E, H, dtype=torch.float64)
    torch.testing.assert_close(non_gated_experts(hidden, w1, w2, weights, ids, "relu2_no_mul", b1, b2),
                               per_token(hidden, w1, w2, ids, weights, b1, b2))


@pytest.mark.parametrize("name", NON_GATED)
def test_each_non_gated_activation(name):
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    want = {"relu2_no_mul": torch.relu(x) ** 2, "silu_no_mul": x * torch.sigmoid(x),
            "gelu_no_mul": torch.nn.functional.gelu(x),
            "gelu_tanh_no_mul": torch.nn.functional.gelu(x, approximate="tanh")}[name]
    torch.testing.assert_close(activate(name, x), want)
    with pytest.raises(ValueError, match="activation: expected one of .* got 'silu'"):
        activate("silu", x)


def test_register_puts_the_torch_experts_first_on_cpu_only_once():
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    register()
    register()  # vLLM may load plugins more than once per process
    cpu = unquantized.backend_to_kernel_cls(unquantized.UnquantizedMoeBackend.CPU)
    assert cpu[0].__name__ == "TorchNonGatedExperts"
    assert [c.__name__ for c in cpu].count("TorchNonGatedExperts") == 1
    assert "CPUUnquantizedExperts" in [c.__name__ for c in cpu[1:]]  # gated models keep vLLM's kernels
    triton = unquantized.backend_to_kernel_cls(unquantized.UnquantizedMoeBackend.TRITON)
    assert "TorchNonGatedExperts" not in [c.__name__ for c in triton]


def test_the_swallowed_refusal_is_the_last_statement_of_vllms_post_init():
    """The plugin lets a non-gated config through by swallowing vLLM's refusal; that is only sound while the
    refusal is the last thing ``FusedMoEConfig.__post_init__`` does (nothing after it is skipped)."""
    import inspect

    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    register()
    original = getattr(FusedMoEConfig.__post_init__, "__wrapped__", FusedMoEConfig.__post_init__)
    body = [line.strip() for line in inspect.getsource(original).splitlines() if line.strip()]
    refusal = next(i for i, line in enumerate(body) if "is_act_and_mul=False is supported only for" in line)
    assert body[refusal + 1:] == [")"], body[refusal - 4:]


def test_register_does_nothing_off_cpu(monkeypatch):
    from vllm.model_executor.layers.fused_moe import config
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.platforms import current_platform

    def kernels(backend):
        return []

    post_init = config.FusedMoEConfig.__post_init__
    monkeypatch.setattr(unquantized, "backend_to_kernel_cls", kernels)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    register()
    assert unquantized.backend_to_kernel_cls is kernels and config.FusedMoEConfig.__post_init__ is post_init
