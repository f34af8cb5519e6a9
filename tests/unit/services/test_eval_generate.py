"""`inflight eval` and `inflight generate` without vLLM (issue 33, item 8): pass@k, the summary, table and JSON
file, the argument checks (one line, exit 2, before any engine starts), prompts from a file or stdin, and a run
directory's checkpoint exported once into RUN_DIR/exports and reused."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from services.offline import local_engine
from services.cli import main
from services.recipe.config import load_recipe
from services.offline.eval import default_out, sampling
from services.offline.eval_report import PromptResult, pass_at, summarize, table, write_json
from services.offline.generate import check_counts, read_prompts
from services.offline.local_engine import LocalEngineError, ModelChoice, pick_model


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at(4, 0, 1) == 0.0 and pass_at(4, 4, 4) == 1.0
    assert pass_at(4, 1, 1) == pytest.approx(0.25) and pass_at(4, 1, 4) == 1.0
    assert pass_at(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at(3, 1, 3) == 1.0 and pass_at(4, 2, 3) == 1.0                         # n - c < j
    with pytest.raises(ValueError, match="pass@5"):
        pass_at(4, 1, 5)


def test_the_summary_counts_failed_answers_apart_never_as_wrong():
    results = [PromptResult("a", [1.0, 0.0], ["4", "5"]),
               PromptResult("b", [None, 1.0], ["", "7"], ["reward: timed out"]),
               PromptResult("c", [None, None], ["", ""], ["TimeoutError: no answer"] * 2),
               PromptResult("d", [0.0, 0.5], ["x", "y"])]
    s = summarize(results, k=2, seconds=1.5)
    assert (s.prompts, s.samples, s.failed_samples) == (4, 8, 3)
    assert s.reward_mean == pytest.approx(2.5 / 5)
    assert s.accuracy == pytest.approx(1 / 2)                     # first answers scored: a (right), d (wrong)
    assert s.pass_at_k[1] == pytest.approx((0.5 + 1.0 + 0.0) / 3)  # b counts with its one scored answer
    assert s.pass_at_k[2] == pytest.approx(1 / 2)                  # a and d have 2 scored answers; a has a right one
    greedy = summarize([PromptResult("a", [1.0]), PromptResult("b", [0.2])], k=1, seconds=0.0)
    assert set(greedy.pass_at_k) == {1} and greedy.accuracy == greedy.pass_at_k[1] == 0.5


def test_the_table_and_the_json_file(tmp_path):
    results = [PromptResult("val:row-0", [1.0], ["4"]), PromptResult("val:row-1", [None], [""], ["boom"])]
    s = summarize(results, k=1, seconds=2.0)
    text = table(s, "eval of m")
    assert text.splitlines()[0] == "eval of m"
    assert "| pass@1                  | 1.0000 |" in text and "| failed samples          | 1 |" in text
    out = write_json(tmp_path / "sub" / "e.json", summarize([PromptResult("p", [None], [""], ["x"])], 1, 0.0),
                     results, {"k": 1})
    doc = json.loads(out.read_text())
    assert doc["about"] == {"k": 1} and doc["summary"]["reward_mean"] is None    # NaN is null: valid JSON
    assert [p["prompt_id"] for p in doc["prompts"]] == ["val:row-0", "val:row-1"]
    assert doc["prompts"][1] == {"prompt_id": "val:row-1", "rewards": [None], "answers": [""], "failures": ["boom"]}


def test_temperatures_of_greedy_and_pass_at_k():
    recipe = load_recipe(None)
    assert sampling(recipe, 1, None) == 0.0
    assert sampling(recipe, 4, None) == recipe.policy.generation.temperature
    assert sampling(load_recipe(None, ["grpo.val_temperature=0.7"]), 4, None) == 0.7
    with pytest.raises(LocalEngineError, match="--pass-k 4 with temperature 0"):
        sampling(recipe, 4, 0.0)
    with pytest.raises(LocalEngineError, match="--pass-k: expected >= 1, got 0"):
        sampling(recipe, 0, None)


def test_default_json_paths(tmp_path):
    recipe = load_recipe(None)
    run = ModelChoice(recipe, "/x/exports/step_000005", "r step 5", tmp_path, 5)
    assert default_out(run, 1) == tmp_path / "eval" / "step_000005.json"
    assert default_out(run, 4) == tmp_path / "eval" / "step_000005-pass4.json"
    assert default_out(ModelChoice(recipe, "/models/tiny", "/models/tiny"), 1) == Path("eval-tiny.json")


def test_which_model_one_line_errors(tmp_path):
    with pytest.raises(LocalEngineError, match="exactly one of --model HF_DIR and --run-dir DIR"):
        pick_model(None, None, None, None, [])
    with pytest.raises(LocalEngineError, match="exactly one of"):
        pick_model(str(tmp_path), str(tmp_path), None, None, [])
    with pytest.raises(LocalEngineError, match="--step goes with --run-dir"):
        pick_model(str(tmp_path), None, 3, None, [])
    with pytest.raises(LocalEngineError, match=r"--model .*: not a Hugging Face model directory \(no config.json\)"):
        pick_model(str(tmp_path), None, None, None, [])
    with pytest.raises(LocalEngineError, match="no run directory"):
        pick_model(None, str(tmp_path / "nope"), None, None, [])


def test_a_run_checkpoint_is_exported_once_into_the_run_directory(monkeypatch, tmp_path):
    from services.offline.export import save_run_recipe

    recipe = load_recipe(None)
    save_run_recipe(recipe, "/models/tiny", tmp_path)
    ckpt = tmp_path / "results" / "checkpoints" / "step_000004"
    monkeypatch.setattr("services.offline.export.find_checkpoint", lambda r, run_dir, step: ckpt)
    calls = []

    def fake_export(run_dir, out, step, recipe_path, overrides, progress=None):
        calls.append((str(run_dir), step))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr("services.offline.export.export", fake_export)
    got = pick_model(None, str(tmp_path), None, None, [])
    again = pick_model(None, str(tmp_path), None, None, [])
    assert got.model_dir == again.model_dir == str((tmp_path / local_engine.EXPORTS / "step_000004").resolve())
    assert calls == [(str(tmp_path), 4)] and got.step == 4 and got.run_dir == tmp_path  # exported once


def test_prompts_from_a_file_or_stdin(monkeypatch, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("What is 2+2?\n\n  Say hi  \n")
    assert read_prompts(str(f)) == ["What is 2+2?", "Say hi"]
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert read_prompts("-") == ["one", "two"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n \n"))
    with pytest.raises(LocalEngineError, match="--prompts stdin: no prompt"):
        read_prompts("-")
    with pytest.raises(LocalEngineError, match="no such file"):
        read_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(LocalEngineError, match="-n: expected >= 1, got 0"):
        check_counts(0, None, None)
    with pytest.raises(LocalEngineError, match="--max-tokens: expected >= 1"):
        check_counts(1, 0, None)


@pytest.mark.parametrize(("argv", "message"), [
    (["eval"], "give exactly one of --model HF_DIR and --run-dir DIR"),
    (["eval", "--model", "{tmp}", "--max-prompts", "0"], "--max-prompts: expected >= 1, got 0"),
    (["eval", "--model", "{tmp}"], "not a Hugging Face model directory"),
    (["generate", "--model", "{tmp}", "--prompts", "{tmp}/none.txt"], "no such file"),
    (["generate", "--model", "{tmp}", "-n", "0"], "-n: expected >= 1, got 0"),
])
def test_the_cli_verbs_exit_2_with_one_line_before_any_engine(tmp_path, capsys, argv, message):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("inflight: ") and message in err[0], err
