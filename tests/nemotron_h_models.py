"""Tiny random Nemotron-H models (transformers' ``NemotronHForCausalLM``, float32) for the tests.

:func:`build_nemotron_h` writes one into a directory with ``save_pretrained`` and rewrites its
``config.json`` in the published form (``hybrid_override_pattern``) or keeps what transformers writes
(``layers_block_type``). Every weight is random — the norms, ``A_log``, ``D``, ``dt_bias`` and the
router's ``e_score_correction_bias`` (a buffer) included — so a weight that a mapping drops or swaps
changes the log-probs. :func:`lift_dt_clamp` takes transformers' prefill ``dt ≥ time_step_min`` clamp
off (vLLM and Megatron have none), making it the oracle for the learner's log-probs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

DENSE_PATTERN = "M*M-"
"""Mamba, attention, Mamba, MLP."""
MOE_PATTERN = "ME*E"
"""Mamba, MoE, attention, MoE."""
VOCAB = 160


def tiny_config(pattern: str, **overrides) -> dict:
    """The keyword arguments of a tiny ``NemotronHConfig`` with layer ``pattern``."""
    cfg = dict(vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern=pattern, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
               ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
               routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, layer_norm_epsilon=1e-5,
               max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values in every parameter and in the routers' score-correction bias (HF inits some to 1/0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight")):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 3 + 0.5))
        elif name.endswith(".D"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith("dt_bias"):  # softplus from ~1e-4 to ~0.7: some dt below time_step_min (1e-3)
            p.copy_(torch.rand(p.shape, generator=g) * 9 - 9)
        else:
            p.copy_(0.15 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def build_nemotron_h(out_dir: str | Path, pattern: str = DENSE_PATTERN, seed: int = 0,
                     published_config: bool = True, **overrides) -> Path:
    """Write a tiny random ``NemotronHForCausalLM`` (float32) with layer ``pattern`` into ``out_dir``.

    ``published_config``: ``config.json`` carries ``hybrid_override_pattern`` (as the published checkpoints);
    otherwise the ``layers_block_type`` list transformers writes."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**tiny_config(pattern, **overrides))).float()
    randomize(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    if published_config:
        blocks = cfg.pop("layers_block_type")
        symbols = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                   "mlp": "-", "moe": "E"}
        cfg["hybrid_override_pattern"] = "".join(symbols[b] for b in blocks)
        cfg["num_hidden_layers"] = len(blocks)
    path.write_text(json.dumps(cfg, indent=2))
    return out


def lift_dt_clamp(model: torch.nn.Module) -> torch.nn.Module:
    """Set every Mamba mixer's ``time_step_limit`` to ``(0, inf)``: transformers clamps ``dt`` to
    ``time_step_min`` in prefill, vLLM and Megatron do not."""
    for module in model.modules():
        if hasattr(module, "time_step_limit") and hasattr(module, "A_log"):
            setattr(module, "time_step_limit", (0.0, float("inf")))  # noqa: B010 (a tuple, not a module)
    return model


def load_nemotron_h(model_dir: str | Path, lift_clamp: bool = True) -> torch.nn.Module:
    """The HF model of ``model_dir`` in float32, eval mode, with the dt clamp lifted unless told otherwise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return lift_dt_clamp(model) if lift_clamp else model
