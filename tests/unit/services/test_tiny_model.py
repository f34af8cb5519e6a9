"""The tiny model factory (local tokenizer round trip, determinism, every architecture), ``tiny://`` names and
the model check of ``inflight validate``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from services.models.tiny_model import ARCHS, make_tiny_model

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


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3", "llama", "llama3", "qwen3_moe", "mistral"])
def test_other_architectures_load_in_transformers(family_models, family):
    import torch
    from transformers import AutoModelForCausalLM
    out = family_models(family)
    cfg = json.loads(open(f"{out}/config.json").read())
    assert cfg["model_type"] == {"qwen2_tied": "qwen2", "llama3": "llama"}.get(family, family)
    assert cfg.get("head_dim") == {"qwen2_tied": None, "qwen3": 64}.get(family, 32)  # Qwen2 derives it
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, cfg["vocab_size"]) and torch.isfinite(logits).all()
    weights = load_file(f"{out}/model.safetensors")
    assert ("lm_head.weight" in weights) is not cfg["tie_word_embeddings"]


def test_cli_make_tiny_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "make-tiny-model", str(tmp_path / "m"),
                          "--seed", "3", "--arch", "llama3", "--tie-word-embeddings"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "m" / "inflight_tiny.json").read_text())["seed"] == 3
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["rope_parameters"]["rope_type"] == "llama3"
    assert "tied embeddings" in out.stdout


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_is_a_tiny_name_and_checks_without_being_built(arch, tmp_path, monkeypatch):
    from services.models import source as model_source
    monkeypatch.setattr(model_source, "CACHE", tmp_path)
    tiny = model_source.parse_tiny(f"tiny://{arch}?seed=2&tie=1")
    assert (tiny.arch, tiny.seed, tiny.size, tiny.tie_word_embeddings) == (arch, 2, "tiny", True)
    assert tiny.cache_dir == tmp_path / "tiny" / f"{arch}-tied-tiny-s2"
    assert f"tiny random {arch} (tiny, seed 2, tied embeddings)" in model_source.check_model(f"tiny://{arch}?seed=2&tie=1")
    assert not any(tmp_path.iterdir())  # nothing built
    assert model_source.parse_tiny(f"tiny://{arch}").cache_dir.name == f"{arch}-tiny-s0"  # the cache names of before


@pytest.mark.parametrize("name", ["tiny://gpt2", "tiny://qwen3?size=huge", "tiny://llama3?tie=yes", "tiny://qwen2?seed=x"])
def test_bad_tiny_names_list_the_choices(name):
    from services.models.source import check_model
    with pytest.raises(ValueError, match=r"expected tiny://<qwen2\|qwen3\|llama\|llama3\|qwen3_moe\|mistral\|"
                                         r"nemotron_h\|nemotron_h_moe\|qwen2_5_vl>"):
        check_model(name)


def test_check_model_describes_a_directory_and_refuses_an_unsupported_one(family_models, tmp_path):
    from services.models.source import check_model
    assert check_model(family_models("llama3")).startswith("llama: 2 layers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"config.json model_type: 'gpt2' is not supported \(supported: qwen2, "):
        check_model(str(tmp_path))
    assert "needs a local HF checkpoint directory" in check_model("Qwen/Qwen2.5-1.5B")


def _validate(*overrides: str):
    return subprocess.run([sys.executable, "-m", "services.cli", "validate", *overrides],
                          capture_output=True, text=True, timeout=120)


def test_validate_fails_for_an_unsupported_model_and_names_the_field(tmp_path, family_models):
    src = json.loads(open(f"{family_models('mistral')}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**src, "sliding_window": 4096}))
    out = _validate(f"policy.model_name={tmp_path}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "config.json sliding_window: 4096 is not supported (supported: null for mistral" in out.stderr


def test_validate_names_the_family_and_says_a_hub_id_needs_a_local_directory(family_models):
    ok = _validate(f"policy.model_name={family_models('qwen3')}")
    assert ok.returncode == 0, ok.stderr
    assert "policy.model_name: qwen3: 2 layers" in ok.stderr
    hub = _validate("policy.model_name=Qwen/Qwen2.5-1.5B")
    assert hub.returncode == 0 and "needs a local HF checkpoint directory" in hub.stderr


@pytest.mark.parametrize("arch,pattern", [("nemotron_h", "M-M*-"), ("nemotron_h_moe", "ME*ME")])
def test_nemotron_h_is_written_in_the_published_config_form_and_loads(tmp_path, arch, pattern):
    """``hybrid_override_pattern`` (as NVIDIA publishes Nemotron-H), not the ``layers_block_type`` list
    ``save_pretrained`` writes; transformers reads it back; init constants (A_log, D, norms, expert bias) moved."""
    import torch
    from transformers import AutoModelForCausalLM

    out = make_tiny_model(tmp_path / arch, seed=1, arch=arch)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hybrid_override_pattern"] == pattern and cfg["num_hidden_layers"] == len(pattern)
    assert "layers_block_type" not in cfg and cfg["time_step_limit"] == [0.0, float("inf")]
    assert cfg["architectures"] == ["NemotronHForCausalLM"] and cfg["mlp_hidden_act"] == "relu2"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.hybrid_override_pattern == pattern
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    weights = load_file(f"{out}/model.safetensors")
    assert not (weights["backbone.layers.0.mixer.D"] == 1).any()
    assert ("backbone.layers.1.mixer.gate.e_score_correction_bias" in weights) is ("E" in pattern)
    if "E" in pattern:
        assert (weights["backbone.layers.1.mixer.gate.e_score_correction_bias"] != 0).all()
    with pytest.raises(ValueError, match="tie_word_embeddings: nemotron_h"):
        make_tiny_model(tmp_path / "tied", arch="nemotron_h", tie_word_embeddings=True)



@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["nemotron_h_moe", "nemotron_h_omni"])
def test_hybrids_are_built_under_a_cuda_default_device_as_gpu_session_builds_them(arch, tmp_path):
    """``bench/gpu_session.sh`` builds its models under ``torch.device('cuda')``; the perturbations of Nemotron-H's
    constants and the Omni tower's norms died there ("Expected a 'cuda' device type for generator but found 'cpu'",
    H100, 2026-12-05). Their draws now come from the CPU generator and move to the tensor's device."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    with torch.device("cuda"):
        make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", dtype="bfloat16")
    assert (tmp_path / arch / "config.json").exists()
