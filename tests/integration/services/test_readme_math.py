"""README's "Train on your own data" block, as a user runs it: generate the word problems, train on them with
``recipes/math-jsonl-cpu.yaml``; validation accuracy at the end must beat its value at step 0 (the issue's
acceptance), and the kept checkpoints must be the best by ``val_accuracy`` plus the newest.

Marked ``slow`` (about 3 minutes on 2 cores): ``make test`` leaves it out, ``make test-all`` runs it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README_SECTION = "## Train on your own data"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(README_SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"README.md: no bash block under {README_SECTION!r}"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_math_block_learns_on_its_own_data(tmp_path):
    for name in (".venv", "scripts", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTEST"))}
    for cmd in readme_commands():
        done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"{cmd!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "runs/math-jsonl-cpu/metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_accuracy"] for r in rows if "val_accuracy" in r}
    assert sorted(val) == [0, 5, 10, 15, 20, 25, 30], val
    assert val[30] > val[0], val
    kept = sorted(p.name for p in (tmp_path / "runs/math-jsonl-cpu/results/checkpoints").glob("step_*"))
    best = sorted(s for s in val if s > 0)
    best = sorted(best, key=lambda s: (val[s], s), reverse=True)[:2]
    assert set(kept) == {f"step_{s:06d}" for s in {*best, 30}}, (kept, val)
