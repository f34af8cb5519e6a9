"""Issue 33.2: an error raised in the command itself after it opened RUN_DIR/logs (a data row that cannot be read
while training, a bug) is one line on the console naming its type and message, exit 1, with the traceback in
RUN_DIR/logs/driver.log (before: a Python traceback, chained exceptions included, on the console). The CLI runs as a
subprocess whose ``run_embedded`` raises, so nothing starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CLI = """
import sys
from services import app
def run_embedded(recipe, run_dir, **kwargs):
    try:
        raise KeyError("question")
    except KeyError as err:
        raise ValueError("data.train_data_path: train.jsonl row 9: key 'question': missing") from err
app.run_embedded = run_embedded
from services.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_error_after_start_is_one_line_and_its_traceback_is_filed(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", CLI, "run", "--run-dir", str(run_dir)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"inflight: ValueError: data.train_data_path: train.jsonl row 9: key 'question': missing "
                    f"(traceback: {run_dir / 'logs' / 'driver.log'})"), out.stderr[-3000:]
    filed = (run_dir / "logs" / "driver.log").read_text()
    assert "Traceback" in filed and "KeyError: 'question'" in filed  # the whole chain
