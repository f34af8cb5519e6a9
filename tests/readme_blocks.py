"""Shared by the README tests: a section's bash block as commands, run as a user runs them in a fresh directory."""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(section: str) -> list[str]:
    """The commands of the first bash block under the README heading ``section`` (trailing ``  # notes`` cut; a
    line ending in ``\\`` continues on the next, as in bash)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(section):], re.S)
    assert block, f"README.md: no bash block under {section!r}"
    joined = re.sub(r"\\\n\s*", " ", block.group(1))
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def run_as_user(tmp_path: Path, commands: Sequence[str], links: Sequence[str] = (".venv", "scripts", "recipes"),
                pythonpath: bool = False, timeout: float = 900) -> None:
    """Run ``commands`` in ``tmp_path`` (with ``links`` to the checkout's folders), each one to success."""
    for name in links:
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTEST"))}
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    for cmd in commands:
        done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{cmd!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def ray_worker_log(run_dir: Path) -> str:
    """What a run's Ray workers logged (``RUN_DIR/logs/ray``; the rollout engine's lines among them)."""
    return "".join(f.read_text(errors="replace") for f in sorted((run_dir / "logs/ray").glob("worker-*.err")))
