"""Relative paths of a recipe found from any directory (issue 33.3): from the current directory first, else from
the recipe file's directory, else from its project tree; the resolved path is shown by ``inflight validate``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.recipe.config import RECIPES_DIR, load_recipe_with_report
from services.recipe.paths import locate, search_dirs


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def project(tmp_path: Path) -> Path:
    """A project tree: recipes/r.yaml naming a prompt file beside it, data and a reward file from the top."""
    top = tmp_path / "proj"
    write(top, "pyproject.toml", "")
    write(top, "recipes/prompts/p.txt", "Solve: {}\n")
    write(top, "data/train.jsonl", '{"input": "1+1", "output": "2"}\n')
    write(top, "rewards/score.py", "def score(batch):\n    return [1.0 for _ in batch]\n")
    return write(top, "recipes/r.yaml",
                 f"defaults: {RECIPES_DIR / 'tiny-cpu.yaml'}\n"
                 "data: {prompt_file: prompts/p.txt, train_data_path: 'data/*.jsonl', dataset_name: null}\n"
                 "env: {reward_fn: 'rewards/score.py:score'}\n")


def test_paths_not_found_from_here_are_found_from_the_recipe_and_its_project(tmp_path: Path, monkeypatch):
    recipe_file = project(tmp_path)
    monkeypatch.chdir(tmp_path)  # elsewhere: none of the paths exists from here
    recipe, report = load_recipe_with_report(recipe_file)
    top = tmp_path / "proj"
    assert recipe.data.prompt_file == str(top / "recipes/prompts/p.txt")
    assert recipe.data.train_data_path == str(top / "data/*.jsonl")
    assert recipe.env.reward_fn == f"{top / 'rewards/score.py'}:score"
    assert [r.key for r in report.resolved] == ["data.train_data_path", "data.prompt_file", "env.reward_fn"]
    assert report.resolved[1].line() == (f"path: data.prompt_file: prompts/p.txt -> {top / 'recipes/prompts/p.txt'} "
                                         f"(not found from the current directory)")


def test_a_path_found_from_here_or_nowhere_stays_as_written(tmp_path: Path, monkeypatch):
    recipe_file = project(tmp_path)
    monkeypatch.chdir(tmp_path / "proj")  # data/ and rewards/ are here
    recipe, report = load_recipe_with_report(recipe_file, ["data.system_prompt_file=nowhere.txt"])
    assert recipe.data.train_data_path == "data/*.jsonl" and recipe.env.reward_fn == "rewards/score.py:score"
    assert recipe.data.system_prompt_file == "nowhere.txt"
    assert [r.key for r in report.resolved] == ["data.prompt_file"]
    dirs = search_dirs(recipe_file)
    assert dirs == (tmp_path / "proj/recipes", tmp_path / "proj")
    deep = write(tmp_path, "proj/configs/recipes/llm/x.yaml", "a: 1\n")
    assert search_dirs(deep) == (tmp_path / "proj/configs/recipes/llm", tmp_path / "proj/configs/recipes",
                                 tmp_path / "proj/configs", tmp_path / "proj")
    assert search_dirs(tmp_path / "loose.yaml") == (tmp_path,)  # no project tree: its own directory only
    assert locate("tiny://qwen2", dirs) == "tiny://qwen2" and locate("/abs/x", dirs) == "/abs/x"


def test_validate_from_another_directory_uses_and_shows_the_resolved_path(tmp_path: Path):
    recipe_file = project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    repo = RECIPES_DIR.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-m", "services.cli", "validate", "--recipe", str(recipe_file)],
                         capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env)
    assert out.returncode == 0, out.stderr
    want = tmp_path / "proj/recipes/prompts/p.txt"
    assert f"prompt_file: {want}" in out.stdout
    assert f"inflight: path: data.prompt_file: prompts/p.txt -> {want}" in out.stderr
