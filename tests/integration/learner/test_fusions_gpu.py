"""GPU: Megatron's MLP with ``bias_activation_fusion`` (its compiled SwiGLU, forward and backward) equals the
unfused MLP of the same weights in bf16, outputs and gradients; the compiled entropy of the learner's log-prob path
equals the eager one (filtered tokens' -inf logits included). Skipped without a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from learner.config import MegatronConfig
from learner.hf_config import parse_hf_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

QWEN3_TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "head_dim": 16,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 128, "max_position_embeddings": 256,
              "tie_word_embeddings": True, "hidden_act": "silu"}


def test_the_fused_swiglu_mlp_equals_the_unfused_one():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from learner.model import init_distributed, transformer_config

    init_distributed(MegatronConfig(), seed=0)
    outs = []
    for fusion in (False, True):
        config = transformer_config(parse_hf_config(QWEN3_TINY), MegatronConfig(bias_activation_fusion=fusion))
        assert config.bias_activation_fusion is fusion
        torch.manual_seed(0)
        mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)).cuda()
        x = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y, _ = mlp(x)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad, mlp.linear_fc1.weight.grad))
    for plain, fused in zip(*outs, strict=True):
        torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_the_compiled_entropy_equals_the_eager_one():
    from learner.logprobs import ENTROPY_CHUNK_ROWS, vocab_parallel_entropy

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, ENTROPY_CHUNK_ROWS + 5):  # the eager path's chunks; the compiled one's dynamic shapes
        logits = (torch.randn(rows, 1000, generator=gen) * 4).to(torch.bfloat16)
        logits[::3, 500:] = float("-inf")  # a top-k/top-p filtered distribution
        eager = vocab_parallel_entropy(logits)  # CPU: the chunked eager path
        compiled = vocab_parallel_entropy(logits.cuda())
        assert compiled.dtype == torch.float32 and compiled.shape == (rows,)
        torch.testing.assert_close(compiled.cpu(), eager, rtol=1e-5, atol=1e-5)
