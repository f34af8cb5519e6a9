"""The tiny model factory: local tokenizer round trip, determinism, every architecture."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from services.tiny_model import make_tiny_model

TEXTS = ["What is 12 plus 7? The answer is 19.", "the red cat saw a big dog", "Ünïcode and émojis 🙂 survive",
         "  leading spaces\nand newlines\n\n"]


def test_tokenizer_round_trips_through_autotokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        assert tok.decode(tok(text).input_ids) == text
    assert 256 < len(tok) <= 448
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_same_seed_same_weights_other_seed_differs(tmp_path, tiny_model_dir):
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1, tokenizer_from=tiny_model_dir)
    a = load_file(f"{tiny_model_dir}/model.safetensors")
    b = load_file(f"{again}/model.safetensors")
    c = load_file(f"{other}/model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)
    from transformers import AutoTokenizer
    t1, t2 = AutoTokenizer.from_pretrained(str(again)), AutoTokenizer.from_pretrained(str(other))
    assert t1.get_vocab() == t2.get_vocab()
    assert all(t1(t).input_ids == t2(t).input_ids for t in TEXTS)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_other_architectures_load_in_transformers(tmp_path, arch, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    out = make_tiny_model(tmp_path / arch, seed=0, arch=arch, tokenizer_from=tiny_model_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["head_dim"] == 32
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_cli_make_tiny_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "make-tiny-model", str(tmp_path / "m"),
                          "--seed", "3", "--arch", "llama"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "m" / "inflight_tiny.json").read_text())["seed"] == 3
