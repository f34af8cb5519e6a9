"""Reading recipe files: defaults chains, ``_override_``, overrides before interpolation, resolvers, errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.recipe.files import RecipeError, parse_override, read_recipe


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_chain_is_recursive_relative_to_each_file_and_later_files_win(tmp_path: Path):
    write(tmp_path, "pyproject.toml", "")  # the project tree: ../base is inside it
    write(tmp_path, "base/root.yaml", "a: {x: 1, y: 1, z: 1}\nlist: [1, 2]\n")
    write(tmp_path, "base/mid.yaml", "defaults: root.yaml\na: {y: 2}\n")
    write(tmp_path, "other.yaml", "a: {z: 3}\nlist: [9]\n")
    child = write(tmp_path, "sub/child.yaml", "defaults: [../base/mid.yaml, ../other.yaml]\na: {x: 4}\n")
    assert read_recipe(child) == {"a": {"x": 4, "y": 2, "z": 3}, "list": [9]}


def test_a_defaults_cycle_is_an_error(tmp_path: Path):
    write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(RecipeError, match="cycle") as err:
        read_recipe(tmp_path / "a.yaml")
    assert err.value.path == "defaults"


def test_override_marker_replaces_the_inherited_mapping(tmp_path: Path):
    write(tmp_path, "base.yaml", "policy: {optimizer: {name: adamw, kwargs: {lr: 1, eps: 2}}, keep: 1}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\npolicy:\n  optimizer:\n    _override_: true\n"
                                          "    name: sgd\n")
    assert read_recipe(child) == {"policy": {"optimizer": {"name": "sgd"}, "keep": 1}}
    top = write(tmp_path, "top.yaml", "defaults: base.yaml\npolicy: {_override_: true, only: 1}\n")
    assert read_recipe(top) == {"policy": {"only": 1}}


@pytest.mark.parametrize("expr, value", [("${add:3,4}", 7), ("${mul:${n}, 2}", 16), ("${div:${n}, 2}", 4.0),
                                         ("${max:${n}, 10}", 10), ("${mul:2, ${mul:${n}, 3}}", 48)])
def test_nemo_rl_resolvers(tmp_path: Path, expr: str, value):
    path = write(tmp_path, "r.yaml", f"n: 8\nv: {expr}\n")
    assert read_recipe(path)["v"] == value


def test_overrides_apply_before_interpolation(tmp_path: Path):
    base = write(tmp_path, "base.yaml", "policy:\n  max_total_sequence_length: 512\n  generation:\n"
                                        "    max_new_tokens: ${policy.max_total_sequence_length}\n"
                                        "  packing: ${mul:${policy.max_total_sequence_length}, 4}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\n")
    data = read_recipe(child, ["policy.max_total_sequence_length=1024"])
    assert data["policy"]["generation"]["max_new_tokens"] == 1024 and data["policy"]["packing"] == 4096
    assert read_recipe(base)["policy"]["packing"] == 2048


def test_override_syntax(tmp_path: Path):
    path = write(tmp_path, "r.yaml", "a: {b: 1, c: null}\nd: 2\n")
    data = read_recipe(path, ["+a.new=1e-4", "++a.c.x=[1, two]", "~d", "a.s=${a.b}"])
    assert data == {"a": {"b": 1, "c": {"x": [1, "two"]}, "new": 1e-4, "s": 1}}
    assert parse_override("k.v={x: 1}") == (["k", "v"], {"x": 1}, False)
    with pytest.raises(RecipeError, match="key.path=value"):
        read_recipe(path, ["a.b"])
    with pytest.raises(RecipeError, match="cannot set a key under it") as err:
        read_recipe(path, ["d.x=1"])
    assert err.value.path == "d"
    with pytest.raises(RecipeError, match="no such key"):
        read_recipe(path, ["~a.nope"])


def test_a_missing_mandatory_value_names_its_key(tmp_path: Path):
    base = write(tmp_path, "base.yaml", "policy:\n  model_name: ???\n  other: 1\n")
    with pytest.raises(RecipeError, match=r"mandatory value \(\?\?\?\) not set") as err:
        read_recipe(base)
    assert err.value.path == "policy.model_name"
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\npolicy:\n  other: ???\n")  # ??? does not override
    assert read_recipe(child, ["policy.model_name=m"]) == {"policy": {"model_name": "m", "other": 1}}


@pytest.mark.parametrize("expr, words", [("${policy.nope}", "cannot resolve"),
                                         ("${nosuch:1,2}", "resolver .nosuch. is not allowed"),
                                         ("${policy.a", "cannot be read as a recipe")])
def test_a_bad_interpolation_names_its_key(tmp_path: Path, expr: str, words: str):
    path = write(tmp_path, "r.yaml", f"policy:\n  a: 1\n  b: {expr}\n")
    with pytest.raises(RecipeError, match=words) as err:
        read_recipe(path)
    assert err.value.path == "policy.b"


def test_merging_a_mapping_over_a_list_is_an_error(tmp_path: Path):
    write(tmp_path, "base.yaml", "policy: {scheduler: [1, 2]}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\npolicy: {scheduler: {name: x}}\n")
    with pytest.raises(RecipeError, match="cannot merge"):
        read_recipe(child)


def test_floats_without_a_dot_are_floats(tmp_path: Path):
    """OmegaConf's YAML reads ``1e-8`` as a number (PyYAML alone would give the string), as NeMo-RL's recipes need."""
    assert read_recipe(write(tmp_path, "r.yaml", "eps: 1e-8\n")) == {"eps": 1e-8}
