"""`inflight validate`: exit 0 with the resolved recipe, exit 2 with a one-line error."""
from __future__ import annotations

import subprocess
import sys

from services.recipe.config import RECIPES_DIR


def _run(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", "validate", *args],
                          capture_output=True, text=True, timeout=120)


def test_async_recipe_prints_resolved_values():
    out = _run("--recipe", str(RECIPES_DIR / "grpo-32gpu-async-1off.yaml"))
    assert out.returncode == 0, out.stderr
    assert "enabled: true" in out.stdout and "max_trajectory_age_steps: 1" in out.stdout


def test_bad_override_exits_2_with_the_key_and_no_traceback():
    out = _run("--recipe", str(RECIPES_DIR / "tiny-cpu.yaml"), "grpo.num_generations_per_prompt=0")
    assert out.returncode == 2
    assert "grpo.num_generations_per_prompt" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_malformed_override_exits_2():
    out = _run("grpo.num_prompts_per_step")
    assert out.returncode == 2 and "key.path=value" in out.stderr
