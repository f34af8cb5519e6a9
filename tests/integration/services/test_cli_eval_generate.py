"""`inflight eval` and `inflight generate` as a user calls them (issue 33, item 8): subprocesses on a tiny exported
model through real vLLM on CPU, one engine start each. eval scores the recipe's validation set (tiny-cpu.yaml:
the built-in task's validation prompts) with its reward and writes the JSON file it names; generate prints the
answers to prompts read from stdin; on a run directory, eval exports the checkpoint (services/offline/export.py, in the
command's process, before vLLM starts there) into RUN_DIR/exports and scores it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.recipe.config import RECIPES_DIR

PROMPTS = 4
SAVE_CHECKPOINT = """
import sys
from pathlib import Path
from learner.trainer import Learner
from services.recipe.config import load_recipe
from services.offline.export import save_run_recipe
from services.job.checkpoints import Checkpoints, JobState
from services.job.learner_actor import LearnerSpec
from services.job.prompt_book import BookState

model, run_dir = sys.argv[1:]
recipe = load_recipe(None, [f"policy.model_name={model}"])
save_run_recipe(recipe, model, run_dir)
s = LearnerSpec.of(recipe, model)
learner = Learner(str(s.model), s.megatron, s.loss, s.packing, s.max_total_sequence_length,
                  normalize_rewards=s.normalize_rewards, seed=s.seed, step_config=s.step_config)

Checkpoints(recipe.checkpointing, Path(run_dir)).save(learner, JobState(3, BookState({}, {}, [], [], {}), []))
learner.shutdown()
"""
"""A run directory as a learner job leaves it: recipe.yaml and the checkpoint of step 3 (the initial weights)."""


def clean_env() -> dict[str, str]:
    """This process's environment without what an earlier test left in it for its own use: a Ray address, and the
    MASTER_PORT an in-process learner set (it may still listen there: a child learner would fail with EADDRINUSE)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_ADDRESS") and k not in ("MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    return env


def inflight(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = clean_env()
    return subprocess.run([sys.executable, "-m", "services.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny model as `inflight make-tiny-model` writes it (what an export looks like: HF files, tokenizer)."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    done = inflight("make-tiny-model", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_eval_scores_the_validation_set_prints_a_table_and_writes_the_json_it_names(exported, tmp_path):
    out = inflight("eval", "--model", str(exported), "--recipe", str(RECIPES_DIR / "tiny-cpu.yaml"),
                   "--max-prompts", str(PROMPTS), "--pass-k", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"eval of {exported} ({PROMPTS} prompts, k=2, temperature 1)")
    assert any(ln.startswith("| pass@2 ") for ln in lines) and any(ln.startswith("| mean reward ") for ln in lines)
    path = tmp_path / "eval-tiny-pass2.json"
    assert lines[-1] == "wrote eval-tiny-pass2.json" and path.is_file()
    doc = json.loads(path.read_text())
    assert len(doc["prompts"]) == PROMPTS and doc["summary"]["samples"] == 2 * PROMPTS
    assert all(len(p["rewards"]) == 2 and p["prompt_id"].startswith("val:") for p in doc["prompts"])
    scored = [r for p in doc["prompts"] for r in p["rewards"] if r is not None]
    assert scored and all(0.0 <= r <= 1.0 for r in scored)        # repeat_letter's reward
    assert doc["about"]["k"] == 2 and doc["about"]["model"] == str(exported)


def test_generate_prints_n_samples_of_each_prompt_from_stdin(exported):
    out = inflight("generate", "--model", str(exported), "-n", "2", "--max-tokens", "6",
                   stdin="Repeat the letter a\nSay hello\n")
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("=== ")] == ["=== prompt 1: Repeat the letter a",
                                                             "=== prompt 2: Say hello"]
    heads = [ln for ln in lines if ln.startswith("--- sample ")]
    assert len(heads) == 4 and all("tokens" in h for h in heads), lines
    assert all(int(h.split("(")[1].split()[0]) <= 6 for h in heads)


def test_eval_of_a_run_directory_exports_its_checkpoint_once_and_scores_it(exported, tmp_path):
    run = tmp_path / "run"
    made = subprocess.run([sys.executable, "-c", SAVE_CHECKPOINT, str(exported), str(run)], capture_output=True,
                          text=True, timeout=600, env=clean_env())
    assert made.returncode == 0, made.stderr[-3000:]
    out = inflight("eval", "--run-dir", str(run), "--max-prompts", "2")
    assert out.returncode == 0, out.stderr[-4000:]
    assert (run / "exports" / "step_000003" / "config.json").is_file()
    assert out.stdout.strip().splitlines()[-1] == f"wrote {run / 'eval' / 'step_000003.json'}"
    doc = json.loads((run / "eval" / "step_000003.json").read_text())
    assert doc["about"]["step"] == 3 and len(doc["prompts"]) == 2 and doc["summary"]["samples"] == 2
