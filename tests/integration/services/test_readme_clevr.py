"""README's "Train on images" block, as a user runs it: draw the CLEVR-style data, warm-start the tiny VLM on the
format, train with ``recipes/clevr-tiny-cpu.yaml``. The quick test runs the same commands shortened (a few
warm-start steps, 2 training steps, no validation) and checks that the image path ran end to end: every prompt
trained, no image failed, both reward components and the parity probe reported. The slow one (``make test-all``)
runs the block as written and checks the issue's acceptance: the format reward rises; the exact answer is
reported.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from readme_blocks import readme_commands, run_as_user

README_SECTION = "## Train on images"


def run_block(tmp_path: Path, extra: dict[str, str]) -> list[dict]:
    """Run the README's commands in ``tmp_path`` (a command containing a key of ``extra`` gets its value appended);
    the run's metrics rows."""
    cmds = [cmd + "".join(f" {v}" for k, v in extra.items() if k in cmd) for cmd in readme_commands(README_SECTION)]
    run_as_user(tmp_path, cmds)
    path = tmp_path / "runs/clevr-tiny-cpu/metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_readme_clevr_block_runs_images_end_to_end(tmp_path):
    rows = run_block(tmp_path, {"make_clevr": "--num-train 64 --num-val 8", "warm_start": "--steps 10 --rows 64",
                                "inflight run": "grpo.max_num_steps=2 grpo.val_at_start=false grpo.val_period=0"})
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert {"reward_tag_format_mean", "reward_exact_alnum_mean"} <= set(r), sorted(r)
        assert r["data_image_failures"] == 0
        assert r["parity_engines_probed"] >= 1 and r["gen_kl_error"] < 1e-3, r  # the probe ran on image prompts


@pytest.mark.slow
def test_readme_clevr_block_raises_the_format_reward(tmp_path):
    rows = run_block(tmp_path, {})
    fmt = {r["step"]: r["reward_tag_format_mean"] for r in rows if "reward_tag_format_mean" in r}
    assert len(fmt) == 30, sorted(fmt)
    first, last = sum(fmt[s] for s in (1, 2, 3)) / 3, sum(fmt[s] for s in range(21, 31)) / 10
    assert last > first + 0.2, fmt
    assert all("reward_exact_alnum_mean" in r for r in rows if "reward_tag_format_mean" in r)
