"""The run's model directory with ``policy.tokenizer.name`` and ``policy.hf_config_overrides`` applied (issue 32.7):
the tokenizer is loaded from where the recipe says, the overrides are in the config every reader sees."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.recipe.config import PolicyConfig
from services.models.variant import model_variant, resolve_policy_model


@pytest.fixture()
def dirs(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setattr("services.models.variant.CACHE", tmp_path / "cache")
    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 10000.0,
                                                   "max_position_embeddings": 2048}))
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").write_text('{"model": "old"}')
    (model / "tokenizer_config.json").write_text('{"which": "old"}')
    (tok / "tokenizer.json").write_text('{"model": "new"}')
    (tok / "tokenizer_config.json").write_text('{"which": "new"}')
    (tok / "README.md").write_text("not a tokenizer file")
    return model, tok


def test_without_either_the_model_directory_is_used_as_it_is(dirs):
    model, _ = dirs
    assert resolve_policy_model(PolicyConfig(model_name=str(model))) == str(model.resolve())
    same = PolicyConfig(model_name=str(model), tokenizer={"name": str(model)})  # pyright: ignore[reportArgumentType]
    assert resolve_policy_model(same) == str(model.resolve())


def test_the_tokenizer_comes_from_its_own_directory_and_the_overrides_are_in_config_json(dirs):
    model, tok = dirs
    policy = PolicyConfig(model_name=str(model), tokenizer={"name": str(tok)},  # pyright: ignore[reportArgumentType]
                          hf_config_overrides={"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    out = Path(resolve_policy_model(policy))
    assert out != model.resolve()
    assert json.loads((out / "tokenizer.json").read_text()) == {"model": "new"}
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"which": "new"}
    assert (out / "model.safetensors").read_bytes() == b"weights" and (out / "model.safetensors").is_symlink()
    assert not (out / "README.md").exists()
    assert json.loads((out / "config.json").read_text()) == {
        "model_type": "qwen2", "rope_theta": 1e6, "max_position_embeddings": 2048,
        "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert json.loads((model / "config.json").read_text())["rope_theta"] == 10000.0  # the model is untouched
    assert resolve_policy_model(policy) == str(out)  # made once


def test_the_tokenizer_loads_with_transformers_from_the_variant(tmp_path: Path, monkeypatch):
    from transformers import AutoTokenizer

    from services.models.tiny_model import make_tiny_model

    monkeypatch.setattr("services.models.variant.CACHE", tmp_path / "cache")
    a = Path(make_tiny_model(tmp_path / "a", arch="qwen2"))
    b = tmp_path / "b"
    AutoTokenizer.from_pretrained(str(a)).save_pretrained(str(b))
    (b / "chat_template.jinja").write_text("{{ 'B:' + messages[0]['content'] }}")
    out = model_variant(a, b, {})
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "B:hi"


def test_a_tokenizer_name_that_is_no_tokenizer_directory_is_a_clear_error(dirs, tmp_path: Path):
    model, _ = dirs
    policy = PolicyConfig(model_name=str(model), tokenizer={"name": str(tmp_path / "nowhere")})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="policy.tokenizer.name: .* is not a tokenizer directory"):
        resolve_policy_model(policy)
