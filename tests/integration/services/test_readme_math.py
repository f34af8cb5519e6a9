"""README's "Train on your own data" block, as a user runs it: generate the word problems, train on them with
``recipes/math-jsonl-cpu.yaml``; validation accuracy at the end must beat its value at step 0 (the issue's
acceptance), and the kept checkpoints must be the best by ``val_accuracy`` plus the newest. Then, on that run, the
"Export to Hugging Face" and "Evaluate and sample" blocks as written: both exports load, eval scores the 64 held-out
problems from the checkpoint and from the export, generate samples.

Marked ``slow`` (about 3 minutes on 2 cores for the training, as much again for the rest): ``make test`` leaves it
out, ``make test-all`` runs it.
"""
from __future__ import annotations

import json

import pytest
from readme_blocks import readme_commands, run_as_user

README_SECTION = "## Train on your own data"
LATER_SECTIONS = ("## Export to Hugging Face", "## Evaluate and sample")


@pytest.mark.slow
def test_readme_math_block_learns_on_its_own_data(tmp_path):
    run_as_user(tmp_path, readme_commands(README_SECTION))
    rows = [json.loads(line) for line in (tmp_path / "runs/math-jsonl-cpu/metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_accuracy"] for r in rows if "val_accuracy" in r}
    assert sorted(val) == [0, 5, 10, 15, 20, 25, 30], val
    assert val[30] > val[0], val
    kept = sorted(p.name for p in (tmp_path / "runs/math-jsonl-cpu/results/checkpoints").glob("step_*"))
    best = sorted(s for s in val if s > 0)
    best = sorted(best, key=lambda s: (val[s], s), reverse=True)[:2]
    assert set(kept) == {f"step_{s:06d}" for s in {*best, 30}}, (kept, val)

    run_as_user(tmp_path, [cmd for section in LATER_SECTIONS for cmd in readme_commands(section)])
    for export in ("hf/math-easy", "hf/math-30"):
        assert (tmp_path / export / "config.json").is_file(), export
    greedy = json.loads((tmp_path / "runs/math-jsonl-cpu/eval/step_000030.json").read_text())
    pass4 = json.loads((tmp_path / "eval-math-easy-pass4.json").read_text())
    assert len(greedy["prompts"]) == len(pass4["prompts"]) == 64
    assert pass4["summary"]["samples"] == 4 * 64
