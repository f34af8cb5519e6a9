"""Recipe loading within bounds (issue 32.2): only NeMo-RL's resolvers, ``defaults:`` confined to the recipe's tree
and to regular YAML files, sizes and alias expansion bounded, no file content in an error."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from services.recipe.files import RecipeError, read_recipe, register_resolvers
from services.recipe.guard import MAX_RECIPE_BYTES, ROOTS_ENV


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_oc_env_in_a_recipe_is_refused_naming_the_resolver_and_key(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_ADMIN_TOKEN", "s3cret")
    path = write(tmp_path, "r.yaml", "logger:\n  wandb:\n    name: run-${oc.env:INFLIGHT_ADMIN_TOKEN}\n")
    with pytest.raises(RecipeError, match="resolver 'oc.env' is not allowed") as err:
        read_recipe(path)
    assert err.value.path == "logger.wandb.name"
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("value", ["${oc.env:INFLIGHT_ADMIN_TOKEN}", "${add:1,${oc.decode:'2'}}",
                                   "${oc.select:a.b,1}", "${nosuch:1}"])
def test_other_resolvers_in_an_override_are_refused(tmp_path: Path, value: str):
    register_resolvers()  # an override used to be resolved as it was parsed, once add/mul/... were registered
    path = write(tmp_path, "r.yaml", "a: {b: 1}\n")
    with pytest.raises(RecipeError, match="is not allowed") as err:
        read_recipe(path, [f"logger.name={value}"])
    assert err.value.path == "logger.name"


def test_the_documented_resolvers_still_work(tmp_path: Path):
    path = write(tmp_path, "r.yaml", "a: 3\nb: ${mul:${a},${add:1,1}}\nc: ${max:${div:8,2},1}\n")
    assert read_recipe(path) == {"a": 3, "b": 6, "c": 4.0}


def test_defaults_outside_the_tree_or_not_yaml_are_refused_without_their_content(tmp_path: Path):
    path = write(tmp_path, "r.yaml", "defaults: /etc/passwd\n")
    with pytest.raises(RecipeError, match=r"not a \.yaml/\.yml file") as err:
        read_recipe(path)
    assert "root:" not in str(err.value)
    outside = write(tmp_path / "elsewhere", "base.yaml", "secret: hunter2\n")
    inner = write(tmp_path, "proj/recipes/r.yaml", f"defaults: {outside}\n")
    with pytest.raises(RecipeError, match="outside the recipe's tree"):
        read_recipe(inner)
    (tmp_path / "proj/recipes/link.yaml").symlink_to(outside)  # a link inside the tree to a file outside it
    via_link = write(tmp_path, "proj/recipes/r2.yaml", "defaults: link.yaml\n")
    with pytest.raises(RecipeError, match="outside the recipe's tree") as err:
        read_recipe(via_link)
    assert "hunter2" not in str(err.value)


def test_defaults_inside_the_project_tree_or_an_allowed_root_are_read(tmp_path: Path, monkeypatch):
    write(tmp_path, "proj/pyproject.toml", "")
    write(tmp_path, "proj/configs/base.yaml", "a: 1\n")
    child = write(tmp_path, "proj/configs/recipes/llm/x.yaml", "defaults: ../../base.yaml\nb: 2\n")
    assert read_recipe(child) == {"a": 1, "b": 2}
    shared = write(tmp_path, "shared/base.yaml", "a: 5\n")
    other = write(tmp_path, "loose/x.yaml", f"defaults: {shared}\n")
    monkeypatch.setenv(ROOTS_ENV, str(tmp_path / "shared"))
    assert read_recipe(other) == {"a": 5}


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path: Path):
    fifo = tmp_path / "base.yaml"
    os.mkfifo(fifo)
    child = write(tmp_path, "r.yaml", "defaults: base.yaml\n")
    start = time.monotonic()
    with pytest.raises(RecipeError, match="not a regular file"):
        read_recipe(child)
    with pytest.raises(RecipeError, match="not a regular file"):
        read_recipe(Path("/dev/zero"))
    assert time.monotonic() - start < 5.0


def test_a_large_file_is_refused(tmp_path: Path):
    path = write(tmp_path, "big.yaml", "a: " + "x" * MAX_RECIPE_BYTES + "\n")
    with pytest.raises(RecipeError, match=f"larger than {MAX_RECIPE_BYTES} bytes"):
        read_recipe(path)


def test_an_alias_bomb_is_refused_quickly(tmp_path: Path):
    lines = ["l0: &a0 [x, x, x, x, x, x, x, x, x, x]"]  # l6 expands to 10^7 leaves
    lines += [f"l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    path = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(RecipeError, match="expands to more than"):
        read_recipe(path)
    assert time.monotonic() - start < 5.0


def test_a_recursive_alias_is_refused(tmp_path: Path):
    path = write(tmp_path, "r.yaml", "a: &x [1, *x]\n")
    with pytest.raises(RecipeError, match="refers to itself"):
        read_recipe(path)


def test_a_yaml_error_says_where_without_quoting_the_file(tmp_path: Path):
    path = write(tmp_path, "r.yaml", "a: 1\nsecret_line: hunter2: x\n")
    with pytest.raises(RecipeError, match=r"line 2, column \d+") as err:
        read_recipe(path)
    assert "hunter2" not in str(err.value)
