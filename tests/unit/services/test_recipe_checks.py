"""Issue 33.2: what a recipe points to is checked before anything starts, every problem at once, one line each
(key, value, what was expected): ``services.preflight.checks`` directly, and ``inflight validate`` / ``run`` /
``pool deploy`` / ``learner attach`` as the user runs them (before: a missing data file, reward file or prompt file
passed ``validate`` and failed after 90-290 s of Ray + vLLM start-up as a 30-line traceback)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.preflight.checks import RecipeProblems, check_recipe
from services.recipe.config import load_recipe

ROOT = Path(__file__).resolve().parents[3]


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _keys(checks) -> list[str]:
    return [p.key for p in checks.problems]


def test_every_missing_file_is_one_problem_naming_key_and_value(tmp_path):
    recipe = load_recipe(None, [f"data.train_data_path={tmp_path}/nope/train.jsonl",
                                f"data.val_data_path={tmp_path}/val-*.jsonl",
                                f"data.prompt_file={tmp_path}/prompt.txt",
                                f"data.system_prompt_file={tmp_path}/system.txt",
                                f"env.reward_fn={tmp_path}/check_reward.py:score"])
    checks = check_recipe(recipe, here=True)
    assert _keys(checks) == ["data.prompt_file", "data.system_prompt_file", "data.train_data_path",
                             "data.val_data_path", "env.reward_fn"], checks.problems
    lines = [p.line() for p in checks.problems]
    assert lines[0] == f"data.prompt_file '{tmp_path}/prompt.txt': no such file"
    assert lines[2].startswith(f"data.train_data_path '{tmp_path}/nope/train.jsonl': no such file")
    assert lines[3].startswith(f"data.val_data_path '{tmp_path}/val-*.jsonl': no such file")  # a glob of nothing
    assert lines[4].startswith(f"env.reward_fn '{tmp_path}/check_reward.py:score': cannot import")
    assert all("\n" not in line for line in lines)
    with pytest.raises(RecipeProblems) as err:
        checks.raise_problems()
    assert str(err.value).splitlines()[0] == "5 problems with what the recipe points to:"


def test_data_rows_are_read_with_the_key_mapping(tmp_path):
    good = _rows(tmp_path / "good.jsonl", [{"question": "1+1", "answer": 2}] * 3)
    no_column = _rows(tmp_path / "other.jsonl", [{"prompt": "1+1", "answer": 2}])
    bad_row = _rows(tmp_path / "bad.jsonl", [{"question": "1+1", "answer": 2}, {"question": "", "answer": 3}])
    keys = ["data.input_key=question", "data.output_key=answer"]
    assert check_recipe(load_recipe(None, [*keys, f"data.train_data_path={good}"]), here=True).problems == []
    checks = check_recipe(load_recipe(None, [*keys, f"data.train_data_path={no_column}",
                                             f"data.val_data_path={bad_row}"]), here=True)
    train, val = (p.line() for p in checks.problems)
    assert train.startswith(f"data.train_data_path '{no_column}': no column 'question' (data.input_key)"), train
    assert val == (f"data.val_data_path '{bad_row}': {bad_row} row 1: key 'question': empty prompt (set "
                   f"data.skip_invalid_rows: true to skip and count such rows)")
    skipping = load_recipe(None, [*keys, f"data.train_data_path={bad_row}", "data.skip_invalid_rows=true"])
    assert check_recipe(skipping, here=True).problems == []


def test_prompt_file_needs_one_field_and_reward_and_environment_must_load(tmp_path):
    (tmp_path / "prompt.txt").write_text("Solve {} and {}")
    (tmp_path / "reward.py").write_text("def score(batch):\n    return [0.0] * len(batch)\n")
    recipe = load_recipe(None, [f"data.prompt_file={tmp_path}/prompt.txt", "env.game.environment=no_such_pkg.m:Game",
                                f"env.game.reward_functions=[{{name: '{tmp_path}/reward.py:score'}}, "
                                f"{{name: '{tmp_path}/reward.py:nothing'}}]", "grpo.max_rollout_turns=2"])
    lines = [p.line() for p in check_recipe(recipe, here=False).problems]
    assert lines[0].startswith(f"data.prompt_file '{tmp_path}/prompt.txt': expected exactly one {{}}"), lines
    assert lines[1].startswith(f"env.game.reward_functions[1].name '{tmp_path}/reward.py:nothing': "), lines
    assert lines[2].startswith("env.game.environment 'no_such_pkg.m:Game': cannot import 'no_such_pkg.m'"), lines
    assert len(lines) == 3


def test_model_directory_and_tokenizer(tmp_path):
    assert check_recipe(load_recipe(None, ["policy.model_name=Qwen/Qwen2.5-1.5B"]), here=False).problems == []
    here = check_recipe(load_recipe(None, ["policy.model_name=Qwen/Qwen2.5-1.5B"]), here=True)
    assert [p.line() for p in here.problems] == [
        "policy.model_name 'Qwen/Qwen2.5-1.5B': no model directory here (no config.json); expected a local Hugging "
        "Face checkpoint directory (hub ids are not downloaded) or tiny://ARCH"]
    empty = tmp_path / "empty-model"
    empty.mkdir()  # a directory that exists here is checked by validate too
    assert _keys(check_recipe(load_recipe(None, [f"policy.model_name={empty}"]), here=False)) == ["policy.model_name"]


def _cli(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300,
                         cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(cwd),
                                       "INFLIGHT_HOME": str(cwd / "inflight-home")})
    return out, time.monotonic() - start


BAD = ("data.train_data_path=data/missing/train.jsonl", "data.prompt_file=prompts/missing.txt",
       "env.reward_fn=rewards/missing.py:score")


def test_validate_reports_every_problem_at_once_one_line_each(tmp_path):
    out, _ = _cli("validate", *BAD, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "inflight: recipe error: 3 problems with what the recipe points to:", out.stderr
    assert [ln.split()[0] for ln in lines[1:]] == ["data.prompt_file", "data.train_data_path", "env.reward_fn"]
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("command", [("run", "--steps", "1"), ("pool", "deploy"),
                                     ("learner", "attach", "--pool", "p")], ids=lambda c: c[0])
def test_run_deploy_and_attach_stop_before_anything_starts(tmp_path, command):
    out, _ = _cli(*command, "--run-dir", str(tmp_path / "run"), *BAD, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("inflight: recipe error: 3 problems"), out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 4 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "inflight-home").exists()  # nothing started
