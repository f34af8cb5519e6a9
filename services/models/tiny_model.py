"""Build a tiny random-init Hugging Face model and a locally trained tokenizer.

No hub access: the tokenizer is a byte-level BPE (Qwen's pre-tokenizer regex,
a few hundred tokens, a ChatML chat template that shows ``tools`` and ``tool``
messages as Qwen2.5's does) trained on a small synthetic
corpus, and the model is a random init of a real architecture (``ARCHS``: Qwen2,
Qwen3, Llama 2 and 3.x, Mistral, Qwen3-MoE, Nemotron-H dense and MoE hybrids; its
``config.json`` carries the keys of the family's published one, at reduced sizes)
saved with ``save_pretrained`` as safetensors. Everything is
deterministic for a given seed, so tests and the embedded default can rebuild
the same model anywhere.

Measured pitfalls this module avoids: transformers rebuilds a ``qwen2``
tokenizer as ``Qwen2Tokenizer`` from vocab + merges, so a word-level
``tokenizer.json`` gets silently mangled (we train a byte-level BPE with the
same regex, which survives the rebuild); vLLM's CPU attention needs a
head_dim of 32, 64, 80, 96, ... (we use 32 or more).
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

ARCH_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "llama3": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM",
                "nemotron_h": "NemotronHForCausalLM", "nemotron_h_moe": "NemotronHForCausalLM"}
ARCHS = tuple(ARCH_CLASSES)
"""``llama`` is Llama 2's layout (unscaled RoPE); ``llama3`` adds Llama 3.x's ``llama3`` RoPE scaling;
``nemotron_h`` / ``nemotron_h_moe``: Nemotron-H hybrids of the layer patterns in :data:`HYBRID_PATTERNS`."""
HYBRID_PATTERNS = {"nemotron_h": "M-M*-", "nemotron_h_moe": "ME*ME"}
"""Nemotron-H layer patterns (``hybrid_override_pattern``: M Mamba2, * attention, - MLP, E MoE), by tiny arch:
the dense one has every layer type but MoE, the MoE one Mamba, attention and MoE as Nemotron 3 Nano has."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOOLS_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOL_CALL_INSTRUCTIONS = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    # ``{{ '\\n' }}`` where a newline follows a block tag: transformers renders with trim_blocks, which drops it
    # with tools: a system turn (the first system message's text, then the tools) as Qwen2.5's template writes it
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    + TOOLS_INSTRUCTIONS + "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    + TOOL_CALL_INSTRUCTIONS + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"  # already in the tools' system turn
    # consecutive tool messages: one user turn, each result in <tool_response> (Qwen2.5's rendering)
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m['content'] }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML. Without tools and tool messages it renders as it always has; ``tools=`` adds a system turn listing
them in ``<tools>`` with the ``<tool_call>`` instructions, and ``tool`` messages render as Qwen2.5's do."""
WORDS = (
    "the a an and or but if then of to in on at by for with from up down is are was were be "
    "have has had do does did will can i you he she it we they this that what which who where "
    "when why how one two three four five six seven eight nine ten zero plus minus times equals "
    "answer question think step solve number sum total add cat dog bird fish tree sun moon star "
    "sky sea river red blue green black white big small old new good bad go went see saw make "
    "take give find know say get run eat read write play work look want need like time day year "
    "system user assistant hello yes no not all some many more repeat letter word only "
    ". , ? ! : ; ( ) - + = * / 0 1 2 3 4 5 6 7 8 9"
).split()

# Model sizes. "tiny" is what CPU tests use; "0.6b" has Qwen3-0.6B-like dimensions for GPU benches.
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, moe_intermediate_size=768, num_experts=64,
                 num_experts_per_tok=8),
}


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    for _ in range(1500):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
    return lines


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 448, seed: int = 0):
    """Train a byte-level BPE tokenizer with Qwen's regex and save it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def media_tokenizer(out_dir: str | os.PathLike, media_tokens: Sequence[str], chat_template: str, dtype: str,
                    init_std: float) -> tuple[Any, dict[str, int], int]:
    """The shared start of a tiny multimodal model: checks ``dtype`` and ``init_std`` (naming the field), writes
    the seed-0 tokenizer with ``media_tokens`` added and ``chat_template`` to ``out_dir``, and returns it read
    back, the media tokens' ids and the vocabulary size (rounded up to a multiple of 64)."""
    from transformers import AutoTokenizer

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: expected float32 or bfloat16, got {dtype!r}")
    if not init_std > 0:
        raise ValueError(f"init_std: expected > 0, got {init_std}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, seed=0)
    tok.add_special_tokens({"additional_special_tokens": list(media_tokens)})
    tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = {t: tok.convert_tokens_to_ids(t) for t in media_tokens}
    return tok, ids, ((len(tok) + 63) // 64) * 64


class _CommonConfig(TypedDict):
    """The HF config fields every tiny architecture shares."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_parameters: dict
    tie_word_embeddings: bool
    initializer_range: float
    eos_token_id: int
    pad_token_id: int
    bos_token_id: None
    rms_norm_eps: float


def _rope(arch: str, max_positions: int) -> dict:
    """``rope_parameters`` as the family publishes them; llama3's original context is max_positions / 8, so
    the scaling changes the frequencies that matter at test lengths (Llama 3.1: 8192 of 131072)."""
    if arch == "llama3":
        return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": max(max_positions // 8, 16)}
    return {"rope_type": "default", "rope_theta": 1000000.0 if arch in ("qwen3", "mistral") else 10000.0}


def _config(arch: str, vocab: int, size: str, tok, max_positions: int, init_std: float | None = None,
            tie_word_embeddings: bool = False):
    import transformers as tf

    dims = SIZES[size]
    common = _CommonConfig(
        vocab_size=vocab, hidden_size=dims["hidden_size"], num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_key_value_heads"],
        max_position_embeddings=max_positions, rope_parameters=_rope(arch, max_positions),
        tie_word_embeddings=tie_word_embeddings, initializer_range=init_std or (0.2 if size == "tiny" else 0.02),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, rms_norm_eps=1e-6)
    ffn, head_dim = dims["intermediate_size"], dims["head_dim"]
    if arch == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=ffn, use_sliding_window=False, **common)
    elif arch == "qwen3":  # head_dim twice hidden/heads, as Qwen3-0.6B (1024 / 16 heads, head_dim 128)
        cfg = tf.Qwen3Config(intermediate_size=ffn, head_dim=2 * head_dim, attention_bias=False,
                             use_sliding_window=False, sliding_window=None, **common)
    elif arch in ("llama", "llama3"):
        cfg = tf.LlamaConfig(intermediate_size=ffn, head_dim=head_dim, attention_bias=False, mlp_bias=False,
                             hidden_act="silu", **common)
    elif arch == "mistral":  # MistralConfig's default window is 4096: Mistral 7B v0.2+ publish null
        cfg = tf.MistralConfig(intermediate_size=ffn, head_dim=head_dim, sliding_window=None, hidden_act="silu",
                               **common)
    elif arch == "qwen3_moe":
        # head_dim: Qwen3MoeConfig takes it as an extra keyword (its dataclass signature leaves it out)
        cfg = tf.Qwen3MoeConfig(intermediate_size=ffn, head_dim=head_dim,  # pyright: ignore[reportCallIssue]
                                moe_intermediate_size=dims["moe_intermediate_size"], num_experts=dims["num_experts"],
                                num_experts_per_tok=dims["num_experts_per_tok"], decoder_sparse_step=1,
                                mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                                use_sliding_window=False, **common)
    elif arch in HYBRID_PATTERNS:
        cfg = _nemotron_h_config(arch, dims, common)
    else:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    cfg.architectures = [ARCH_CLASSES[arch]]
    return cfg


def _nemotron_h_config(arch: str, dims: dict, common: _CommonConfig):
    """A Nemotron-H config with Nemotron 3 Nano's choices (no RoPE, squared-ReLU MLPs and experts, a sigmoid
    router with a score-correction bias, one shared expert, routed scaling 2.5) at reduced sizes: Mamba2 heads
    of 32 (hidden * 2 wide), 2 groups, state 16; attention head_dim 32 (vLLM CPU's attention needs 32, 64, ...)."""
    import transformers as tf

    keep = {k: v for k, v in common.items() if k not in ("rope_parameters", "rms_norm_eps", "num_hidden_layers")}
    hidden = dims["hidden_size"]
    return tf.NemotronHConfig(
        **keep, hybrid_override_pattern=HYBRID_PATTERNS[arch],  # pyright: ignore[reportCallIssue]
        head_dim=dims["head_dim"], intermediate_size=dims["intermediate_size"], mlp_hidden_act="relu2",
        attention_bias=False, mlp_bias=False, use_bias=False, layer_norm_epsilon=1e-5,
        mamba_num_heads=2 * hidden // 32, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4,
        expand=2, chunk_size=128, use_conv_bias=True, mamba_hidden_act="silu", mamba_proj_bias=False,
        n_routed_experts=dims["num_experts"], num_experts_per_tok=dims["num_experts_per_tok"],
        moe_intermediate_size=dims["moe_intermediate_size"], n_shared_experts=1,
        moe_shared_expert_intermediate_size=dims["moe_intermediate_size"], routed_scaling_factor=2.5,
        norm_topk_prob=True, n_group=1, topk_group=1, residual_in_fp32=False, num_nextn_predict_layers=0)


def _perturb_hybrid(model, generator) -> None:
    """Move the tensors Nemotron-H's init sets to constants (Mamba ``A_log``/``D``, the norms' weights, the
    router's score-correction bias, zero at init) off them, so that a loader that drops or mangles one of
    them changes the outputs."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "D", "e_score_correction_bias") or (leaf == "weight" and "norm" in name):
                nudge(tensor, generator)


def nudge(tensor, generator) -> None:
    """Add 0.1 x standard-normal noise from the CPU ``generator`` to ``tensor`` in place (drawn on the CPU in
    float32, then moved to the tensor's device and dtype: the same draws under any default device)."""
    import torch

    tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=torch.float32, device="cpu")
                .to(tensor.device, tensor.dtype))


def _publish_hybrid_config(out: Path) -> None:
    """Rewrite ``config.json`` in the form NVIDIA publishes Nemotron-H: ``hybrid_override_pattern`` (a string)
    and ``num_hidden_layers``, where ``save_pretrained`` writes the ``layers_block_type`` list."""
    from transformers import NemotronHConfig

    path = out / "config.json"
    cfg = json.loads(path.read_text())
    layers = cfg.pop("layers_block_type")
    cfg.pop("mtp_layers_block_type", None)  # no multi-token-prediction layers
    cfg["hybrid_override_pattern"] = NemotronHConfig._list_to_pattern(layers)
    cfg["num_hidden_layers"] = len(layers)
    # transformers 5 writes an infinite float as {"__float__": "Infinity"}; the published files have Infinity
    cfg["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v for v in cfg["time_step_limit"]]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny_model(out_dir: str | os.PathLike, seed: int = 0, arch: str = "qwen2", size: str = "tiny",
                    dtype: str = "float32", max_positions: int = 2048, tokenizer_from: str | None = None,
                    init_std: float | None = None, tie_word_embeddings: bool = False) -> Path:
    """Write a random-init model + tokenizer to ``out_dir`` and return it.

    ``tie_word_embeddings`` shares the embedding with the output layer (Qwen2.5-0.5B/1.5B, Qwen3-0.6B): the
    safetensors file then has no ``lm_head.weight``.

    ``tokenizer_from`` reuses the tokenizer of another tiny model (so two
    models with different seeds share token ids). ``init_std`` overrides the
    weights' init scale (0.2 for ``tiny``, 0.02 otherwise): with 0.02 the
    outputs are close to uniform, so even scrambled weights barely move the
    log-probs; 0.2 gives peaked outputs, like a trained model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {tuple(SIZES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from:
        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        tok.save_pretrained(str(out))
    else:
        build_tokenizer(out, seed=0)
        tok = AutoTokenizer.from_pretrained(str(out))
    vocab = ((len(tok) + 63) // 64) * 64
    if init_std is not None and not init_std > 0:
        raise ValueError(f"init_std: expected > 0, got {init_std}")
    if arch in HYBRID_PATTERNS and tie_word_embeddings:
        raise ValueError(f"tie_word_embeddings: {arch} has an untied output layer (as Nemotron-H publishes it); "
                         f"expected False")
    cfg = _config(arch, vocab, size, tok, max_positions, init_std, tie_word_embeddings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    if arch in HYBRID_PATTERNS:
        _perturb_hybrid(model, torch.Generator().manual_seed(seed))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    if arch in HYBRID_PATTERNS:
        _publish_hybrid_config(out)
    (out / "inflight_tiny.json").write_text(json.dumps({"seed": seed, "arch": arch, "size": size, "dtype": dtype,
                                                              "tie_word_embeddings": tie_word_embeddings}))
    return out
